"""An engine stepping in the main thread, fed through one port.

    EnginePort.receive() ─▶ SubmitRequest / AbortRequest / LoadQuery ─▶ admit, abort, answer
    step() ─▶ StepOutputs: one TokenDelta per request that moved ─▶ EnginePort.send()

The port is the engine's side of the engine protocol (``protocol``): ``LocalPort`` when
the gRPC edge runs in this process, ``SocketPort`` (``link``) when it runs in a process of
its own. The loop only sees messages; it never knows which.

Admission happens here, between steps, whichever port a request came from: a request
that is invalid, arrives while ``max_queued_requests`` wait, or arrives while draining
ends at once with a final delta whose ``error`` says why. Every request admitted ends
with exactly one finished delta; when the engine fails or stops, every open request ends
with an UNAVAILABLE error (its caller continues elsewhere).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

from pdmesh.shared.engine.hidden_states import answer_hidden_states
from pdmesh.shared.engine.request import Request, RequestStatus
from pdmesh.shared.runtime.protocol import (
    AbortRequest,
    Draining,
    EngineLoad,
    Failure,
    InvalidRequest,
    LoadQuery,
    LoraCommand,
    NotFound,
    QueueFull,
    Status,
    SubmitRequest,
    ToEngine,
    TokenDelta,
    refused,
)

if TYPE_CHECKING:  # (the gRPC edge processes import the runtime without torch)
    from pdmesh.shared.engine.engine import EngineCore, StepOutput
    from pdmesh.shared.runtime.shared_cores import SharedCores

log = logging.getLogger(__name__)

LOAD_EVERY_S = 0.1  # how often the loop publishes its load while it runs
# cores an engine whose threads take all of them leaves, while it decodes, to the processes
# that carry its tokens out (its gRPC edge, a gateway, the clients of one box); 0: none
FREE_CORES_ENV = "PDMESH_DECODE_FREE_CORES"
YIELD_POLL_S = 0.002  # a yielding decode engine looks this often whether prefill is done


class EnginePort(Protocol):
    """The engine's end of the engine protocol. Called from the loop's thread only."""

    closed: bool  # the other end went away: the loop stops

    def receive(self) -> list[ToEngine]:
        """Messages that arrived since the last call; never blocks."""

    def wait(self, timeout_s: float) -> bool:
        """Until a message arrives (True), or ``timeout_s``."""

    def send(self, deltas: list[TokenDelta]) -> None:
        """One step's deltas (possibly none), as one message."""

    def publish(self, load: EngineLoad) -> None:
        """The engine's load and state, for the other end's Health answers."""


class LocalPort:
    """The port when the gRPC edge runs in this process (another thread): a queue in,
    a callback out (``InProcessEngineClient`` sets it to hop onto its event loop)."""

    def __init__(self) -> None:
        self.closed = False
        self._inbox: queue.SimpleQueue[ToEngine] = queue.SimpleQueue()
        self._wake = threading.Event()
        self.on_deltas: Callable[[list[TokenDelta]], None] = lambda deltas: None
        self.on_load: Callable[[EngineLoad], None] = lambda load: None

    def put(self, message: ToEngine) -> None:
        """From any thread."""
        self._inbox.put(message)
        self._wake.set()

    def receive(self) -> list[ToEngine]:
        out = []
        while True:
            try:
                out.append(self._inbox.get_nowait())
            except queue.Empty:
                return out

    def wait(self, timeout_s: float) -> bool:
        woken = self._wake.wait(timeout_s)
        self._wake.clear()  # (a put between the timeout and this clear is in the inbox)
        return woken or not self._inbox.empty()

    def send(self, deltas: list[TokenDelta]) -> None:
        if deltas:
            self.on_deltas(deltas)

    def publish(self, load: EngineLoad) -> None:
        self.on_load(load)


class EngineLoop:
    def __init__(self, engine: EngineCore, port: EnginePort, eplb=None):
        """``eplb``: a RankEplb (expert-parallel ranks with dynamic EPLB)."""
        self.engine = engine
        self.port = port
        self.eplb = eplb
        self.on_finished: Callable[[Request], None] | None = None  # metrics
        self.on_drain: Callable[[], None] | None = None  # once, from the loop, when draining
        self._requests: dict[str, Request] = {}  # admitted and not yet finished
        self._pending: list[TokenDelta] = []  # deltas for the port, sent once per turn
        self._drain_deadline: float | None = None  # set by ``drain``
        self._drain_told = False
        self._drain_from_peer = False  # the drain came from a data-parallel peer's
        self._stopping = False  # set by stop(), a second drain() or a lost port
        self._load_sent = 0.0
        self._progress = time.monotonic()  # when a step last ended (or it was idle)
        # the box's cores shared with other engines (`pdmesh up`, shared_cores): a
        # prefill engine tells its work left, a decode engine yields while there is some
        self.cores: SharedCores | None = None
        self.cores_role = ""
        self._full_threads = 0  # a prefill engine's torch threads (0: run() reads them)
        self._threads = 0  # the torch threads it steps with now

    # -- control (any thread; drain and stop from signal handlers too) -------------------
    def stop(self) -> None:
        """Ask ``run`` to return (after failing every request still open)."""
        self._stopping = True

    def drain(self, timeout_s: float) -> None:
        """Refuse new requests (Draining) and let ``run`` return once every request in
        flight has finished, or after ``timeout_s`` (what is left then fails, and callers
        continue it elsewhere). A second call stops at once. Plain assignments only: it
        is called from signal handlers (shared.infra.signals)."""
        if self._drain_deadline is not None and not self._drain_from_peer:
            self._stopping = True
            return
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + timeout_s
        self._drain_from_peer = False  # (the peer's drain came first: this is the first)

    def peer_drain(self, timeout_s: float) -> None:
        """A data-parallel peer drains (the group cannot step without it): drain with
        it, for ``timeout_s``. A signal after this is still this instance's first (its
        launcher may signal every rank at once: the requests in flight still finish)."""
        if self._drain_deadline is None:
            log.warning("a data-parallel peer is draining; draining with it")
            self._drain_from_peer = True
            self._drain_deadline = time.monotonic() + timeout_s

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def _prompt_tokens_left(self) -> int:
        """Prompt tokens admitted or waiting, not yet computed."""
        s = self.engine.scheduler
        return sum(max(0, r.num_prompt_tokens - r.num_computed_tokens)
                   for r in (*s.running, *s.waiting))

    def load(self) -> EngineLoad:
        s = self.engine.scheduler
        queued = self._prompt_tokens_left()
        ep = self.engine.ep
        costs = self.engine.step_costs
        return EngineLoad(len(s.running), len(s.waiting), self.engine.kv.num_free_blocks,
                          self.engine.kv.num_blocks, queued, self.engine.config.block_size,
                          ep.version if ep is not None else 0,
                          ep.bytes_moved if ep is not None else 0,
                          round(costs.decode_step_us), round(costs.prefill_ns_per_token),
                          self.engine.prompt_chunk_tokens(), self.draining,
                          self.max_model_len, stalled_ms=self._stalled_ms(),
                          spec_draft_tokens=self.engine.spec_stats.num_draft_tokens,
                          spec_accepted_tokens=self.engine.spec_stats.num_accepted_tokens,
                          lora_adapters=[] if self.engine.lora is None
                          else self.engine.lora.held(), **self._tier_load())

    def _tier_load(self) -> dict[str, int]:
        """The KV tiers' figures for the heartbeat ({}: no tiers)."""
        tier = getattr(self.engine.connector, "tier", None)
        if tier is None:
            return {}
        return {"tier_host_blocks": sum(tier.occupancy()),
                "tier_host_capacity": sum(tier.capacity_blocks),
                "tier_host_hits": tier.stats.hits["host"],
                "tier_storage_hits": tier.stats.hits["storage"],
                "tier_queries": tier.stats.queries}

    def _stalled_ms(self) -> int:
        """Since the last step ended, while there is work (read from the heartbeat's
        thread too: a step that hangs shows here, its heartbeat going on)."""
        if not self.engine.has_unfinished():
            return 0
        return int((time.monotonic() - self._progress) * 1000)

    # -- the loop ------------------------------------------------------------------------
    def run(self) -> None:
        """Step in the calling thread until stopped. Call it from the main thread: torch's
        OpenMP kernels ran ~3x slower when stepping from a helper thread."""
        self.engine.grammars.prepare()  # (not on the step loop at the first grammar)
        import torch

        if self.cores is not None and not self._full_threads:
            self._full_threads = torch.get_num_threads()
        self._threads = self._full_threads
        if self.cores is None and not self.engine.lockstep and self.engine.tp_ranks is None:
            self.engine.decode_threads = decode_threads(torch.get_num_threads(),
                                                        usable_cores(), os.environ)
        self._publish(force=True)
        if self.engine.lockstep:
            self._run_lockstep()
        else:
            while not self._should_stop():
                self._turn()
        self._fail_all("engine stopped")

    def _turn(self) -> None:
        self._take_messages()
        shares = self.cores is not None
        if shares and self.cores_role == "prefill":  # (before its step: the step is the
            self.cores.publish(self._prompt_tokens_left())  # work decode yields to)
            # (backed up as decode sees it: every prefill engine of the box)
            self._set_threads(self.cores.prefill_threads(self.cores.prefill_left(),
                                                         self._full_threads))
        if self.engine.has_unfinished():
            t0 = time.monotonic()
            self._step()
            if shares and self.cores_role == "decode":
                self._yield(time.monotonic() - t0)
        else:
            self._idle(0.05)
        if shares and self.cores_role == "prefill":
            self.cores.publish(self._prompt_tokens_left())

    def _set_threads(self, n: int) -> None:
        if n != self._threads:
            import torch

            torch.set_num_threads(n)
            self._threads = n

    def _yield(self, step_s: float) -> None:
        """A decode engine's pause after a step while the box's prefill engines compute,
        ended early when they go idle or a message arrives."""
        end = time.monotonic() + self.cores.pause_after(step_s, self.engine.chunk_step_ms)
        while (left := end - time.monotonic()) > 0 and self.cores.prefill_busy():
            if self.port.wait(min(left, YIELD_POLL_S)):
                return

    def _run_lockstep(self) -> None:
        """Expert-parallel ranks: every rank steps when any rank has work (an idle rank's
        step serves the others' tokens), and all stop together. A rank told to drain
        drains them all (the group cannot step without it; its ranks may run under
        other launchers, on other nodes, that were not told)."""
        import torch
        import torch.distributed as dist

        # [any work, stop, newest placement version, -oldest placement version, drain
        # milliseconds left, then per rank: blocks of a long request DyntraLB has not
        # counted yet] - each rank fills its own slot, so the MAX all-reduce doubles as
        # an all-gather of those
        group = self.engine.dp_group  # (the engines: tensor-parallel workers sit apart)
        world = dist.get_world_size(group)
        rank = dist.get_rank(group)
        lb = self.engine.dyntralb
        flags = torch.zeros(5 + world, dtype=torch.int64)
        while True:
            self._take_messages()
            version = self.eplb.known_version() if self.eplb is not None else 0
            flags.zero_()
            flags[0] = int(self.engine.has_unfinished())
            flags[1] = -int(self._should_stop())  # MAX of -stop: every rank wants to stop
            flags[2], flags[3] = version, -version
            if self._drain_deadline is not None:
                flags[4] = max(1, int((self._drain_deadline - time.monotonic()) * 1000))
            if lb is not None:
                flags[5 + rank] = lb.pending_long()
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
            if flags[1] < 0:  # ranks stop together, once all are done (or told to)
                return
            if flags[4] and self._drain_deadline is None:  # another rank drains
                self.peer_drain(int(flags[4]) / 1000)
            if self.eplb is not None:
                self.eplb.at_step_boundary(int(flags[2]), -int(flags[3]), bool(flags[0]))
            if not flags[0]:
                if lb is not None and lb.wave_steps:
                    # (vLLM's DP engine core steps on, dummy steps counted and planned,
                    # until its every-32nd-step check that all ranks are done: a request
                    # arriving before that continues the wave)
                    if lb.wave_goes_on():
                        self._balance(lb, int(flags[5:].max()), world)
                        continue
                    lb.end_wave(self.engine.scheduler)
                self._idle(0.005)
                continue
            if lb is not None:
                self._balance(lb, int(flags[5:].max()), world)
            self._step()

    def _balance(self, lb, long_added: int, world: int) -> None:
        """DyntraLB between two lockstep steps: every rank's snapshot (an all-gather,
        only on steps that plan), the same plan on every rank, this rank's moves."""
        import torch
        import torch.distributed as dist

        scheduler = self.engine.scheduler
        if not lb.begin_step(long_added):
            lb.skip_step(scheduler)
            return
        mine = torch.tensor(lb.snapshot(scheduler), dtype=torch.int64)
        rows = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(rows, mine, group=self.engine.dp_group)
        lb.plan_step(scheduler, [r.tolist() for r in rows])

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 (the loop must outlive any one step)
            log.exception("engine step failed")
            self._fail_all(f"engine step failed: {e}")
            return
        finally:
            self._progress = time.monotonic()
        self._emit_step(outputs)
        self._flush()  # first tokens out before their prompts' puts into the pool
        try:
            saved = self.engine.finish_saves()
        except Exception as e:  # noqa: BLE001
            log.exception("pool save failed")
            self._fail_all(f"pool save failed: {e}")
            return
        if saved:
            self._emit_step(saved)
            self._flush()
        self._publish()

    def _should_stop(self) -> bool:
        if self._stopping:
            return True
        if self._drain_deadline is None:
            return False
        return not self._requests or time.monotonic() >= self._drain_deadline

    def _idle(self, timeout_s: float) -> None:
        self._progress = time.monotonic()
        if self.engine.stats_log is not None:
            self.engine.stats_log.idle()
        self._publish()
        self.port.wait(timeout_s)  # a signal's drain() is noticed after the timeout

    def _publish(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._load_sent >= LOAD_EVERY_S:
            self._load_sent = now
            self.port.publish(self.load())

    # -- messages in ---------------------------------------------------------------------
    def _take_messages(self) -> None:
        self._notice_drain()
        for message in self.port.receive():
            if isinstance(message, SubmitRequest):
                self._admit(message)
            elif isinstance(message, AbortRequest):
                self._abort(message.request_id)
            elif isinstance(message, LoadQuery):
                self._publish(force=True)
            elif isinstance(message, LoraCommand):
                self._pending.append(self._lora(message))
        self._flush()
        if self.port.closed and not self._stopping:
            log.error("the engine's gRPC edge went away; stopping")
            self._stopping = True

    def _notice_drain(self) -> None:
        if self._drain_deadline is not None and not self._drain_told:
            self._drain_told = True
            self._publish(force=True)
            if self.on_drain is not None:
                self.on_drain()

    def _admit(self, m: SubmitRequest) -> None:
        rid = m.request_id
        try:
            self._check_admission(rid)
            # (add_request validates it, and changes nothing when it raises)
            self._requests[rid] = self.engine.add_request(
                m.prompt_token_ids, m.sampling, request_id=rid, priority=m.priority,
                output_token_ids=m.output_token_ids or None, pooling=m.pooling,
                lora_request=self.engine.lora_request(m.lora_name, m.lora_path))
        except (Draining, QueueFull, ValueError) as e:
            self._pending.append(refused(rid, e))

    def _lora(self, m: LoraCommand) -> TokenDelta:
        """Load or unload an adapter; the answer: a finished delta, with the error."""
        try:
            if m.unload:
                self.engine.unload_lora(m.lora_name)
            else:
                self.engine.load_lora(m.lora_name, m.lora_path)
        except KeyError:
            return refused(m.token, NotFound(f"lora_name: no LoRA adapter {m.lora_name!r} "
                                             "is loaded here"))
        except ValueError as e:
            return refused(m.token, InvalidRequest(str(e)))
        self._publish(force=True)  # (its adapters, for the routers)
        return TokenDelta(m.token, finish_reason="stop")

    def _check_admission(self, rid: str) -> None:
        if self._drain_deadline is not None:
            raise Draining("this instance is draining (shutting down); use another")
        if rid in self._requests:
            raise InvalidRequest(f"request_id: {rid!r} is already in flight")
        limit = self.engine.config.max_queued_requests
        if limit is not None and sum(1 for r in self._requests.values()
                                     if r.status is RequestStatus.WAITING) >= limit:
            raise QueueFull(limit)

    def _abort(self, rid: str) -> None:
        if self._requests.pop(rid, None) is not None:
            self.engine.abort(rid)
            self._pending.append(TokenDelta(rid, finish_reason="abort"))

    # -- deltas out ----------------------------------------------------------------------
    def _emit_step(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            req = out.request
            rid = req.request_id
            if (self._requests.pop(rid, None) if out.finished
                    else self._requests.get(rid)) is None:
                continue  # aborted meanwhile
            if out.finished and self.on_finished is not None:
                self.on_finished(req)
            self._pending.append(_delta(req, out.new_token_ids, out.finished))

    def _flush(self) -> None:
        if self._pending:
            deltas, self._pending = self._pending, []
            self.port.send(deltas)

    def _fail_all(self, message: str) -> None:
        for rid in list(self._requests):
            self.engine.abort(rid)
            self._pending.append(TokenDelta(rid, error=Failure(Status.UNAVAILABLE, message)))
        self._requests.clear()
        self._flush()


def _delta(req: Request, tokens: list[int], finished: bool) -> TokenDelta:
    if req.pooling is not None:  # its embedding; the token sampled after it is not one
        return TokenDelta(req.request_id, [], max(req.num_cached_tokens, 0),
                          finish_reason=req.finish_reason if finished else None,
                          timing=req.timing() if finished else None,
                          embedding=req.embedding or [])
    lps = (req.logprobs[-len(tokens):]
           if tokens and req.sampling_params.logprobs is not None else [])
    cached = max(req.num_cached_tokens, 0)
    # the prompt's logprobs go with the first tokens generated here
    prompt = req.prompt_logprobs if req.sampling_params.prompt_logprobs is not None and \
        tokens and req.num_output_tokens - req.num_carried_outputs == len(tokens) else []
    if not finished:
        return TokenDelta(req.request_id, tokens, cached, lps, prompt_logprobs=prompt)
    return TokenDelta(req.request_id, tokens, cached, lps, req.finish_reason,
                      req.stop_reason, list(req.kv_keys), req.timing(), prompt_logprobs=prompt,
                      hidden_states=answer_hidden_states(req)
                      if req.sampling_params.return_hidden_states else [])


def usable_cores() -> int:
    """The cores this process may run on (its affinity: a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        return os.cpu_count() or 1


def decode_threads(threads: int, cores: int, environ: Mapping[str, str]) -> int:
    """The torch threads an engine decodes on (EngineCore.decode_threads; 0: its own).

    Measured (docs/benchmarks.md, issue 40, session 27): a mixed instance on 2 cores
    stepping its decode steps on both had TPOT 1.2-1.8x that of one thread, the tokens
    computed in time and then waiting for a core to reach the client, while its prompt
    steps want both. So where the engine's threads take every core it may run on, its
    decode steps leave ``PDMESH_DECODE_FREE_CORES`` (1) of them, as vLLM's CPU worker
    keeps one for its frontend all the time; prompt steps use all."""
    raw = environ.get(FREE_CORES_ENV, "")
    try:
        free = int(raw or 1)
    except ValueError:
        raise ValueError(f"{FREE_CORES_ENV}: expected a whole number, got {raw!r}") from None
    if free < 0:
        raise ValueError(f"{FREE_CORES_ENV}: must be >= 0, got {raw!r}")
    if not free or threads < cores or threads <= 1:
        return 0
    return max(1, threads - free)
