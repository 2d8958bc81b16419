"""Signal handling that cannot deadlock: a storm of SIGTERMs while the main thread waits
(the pattern that hung `pdmesh up`: Event.set in a handler interrupting Event.wait)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

CHILD = textwrap.dedent("""
    import select, sys, threading
    from pdmesh.shared.infra.signals import SignalStop
    seen = []
    stop = SignalStop(on_signal=seen.append).install()
    other = threading.Event()  # the main thread also waits on a lock-based primitive
    print("ready", flush=True)
    while not select.select([sys.stdin], [], [], 0)[0]:  # until the parent closes stdin
        stop.wait(0.001)
        other.wait(0.0001)
    print("done", stop.count, len(seen), flush=True)
""")


def test_a_storm_of_signals_never_hangs_the_waiting_main_thread():
    """Signals sent back to back arrive while a handler still runs (nested handlers):
    with Event.set in the handler, the nested one blocks on the lock its outer frame
    holds, every time (the pattern `pdmesh up` had)."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        assert proc.stdout.readline().strip() == "ready"
        for i in range(2000):
            os.kill(proc.pid, signal.SIGTERM if i % 2 else signal.SIGINT)
        out, _ = proc.communicate("", timeout=20)  # closes stdin
    finally:
        proc.kill()
        proc.wait()
    done, count, seen = out.split()
    assert done == "done" and int(count) >= 1 and int(seen) == int(count)


def test_wait_returns_false_on_timeout_and_true_after_a_signal():
    from pdmesh.shared.infra.signals import SignalStop

    old = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        stop = SignalStop().install()
        t = time.monotonic()
        assert stop.wait(0.05) is False and time.monotonic() - t >= 0.04
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.wait(5) is True and stop.count == 1 and stop.is_set()
    finally:
        signal.signal(signal.SIGTERM, old[0])
        signal.signal(signal.SIGINT, old[1])
