"""Routing choices, from registry entries (the real redis, a unique prefix)."""

from __future__ import annotations

from collections import Counter

import pytest

from pdmesh.services.gateway.router import Router
from pdmesh.shared.infra.registry import ADAPTERS_TTL_MS, Instance, Registry


def registry(prefix: str, *instances: Instance) -> Registry:
    reg = Registry(prefix=prefix)
    for inst in instances:
        reg.put(inst)
    return reg


def test_prefill_by_queued_tokens_then_requests(registry_prefix):
    reg = registry(registry_prefix + "-r1",
                   Instance("p1", "prefill", "a:1", load={"queued_prefill_tokens": 900}),
                   Instance("p2", "prefill", "a:2", load={"queued_prefill_tokens": 100,
                                                          "running": 5}),
                   Instance("p3", "prefill", "a:3", load={"queued_prefill_tokens": 100,
                                                          "running": 1}))
    r = Router(reg)
    assert r.pick("prefill").id == "p3"
    assert r.pick("prefill", exclude={"p3"}).id == "p2"
    assert r.pick("decode") is None


def test_decode_by_blocks_in_use_and_random_ties(registry_prefix):
    same = {"total_kv_blocks": 100, "free_kv_blocks": 60}
    reg = registry(registry_prefix + "-r2",
                   Instance("d1", "decode", "b:1", load=same),
                   Instance("d2", "decode", "b:2", load=same),
                   Instance("d3", "decode", "b:3", load={"total_kv_blocks": 100,
                                                         "free_kv_blocks": 10}))
    r = Router(reg)
    picks = Counter(r.pick("decode").id for _ in range(200))
    assert set(picks) == {"d1", "d2"}  # never the fuller d3; identical ones share the work
    assert min(picks.values()) > 50


def test_draining_instances_get_nothing(registry_prefix):
    reg = registry(registry_prefix + "-r3",
                   Instance("d1", "decode", "b:1", draining=True),
                   Instance("d2", "decode", "b:2"))
    assert {Router(reg).pick("decode").id for _ in range(20)} == {"d2"}


def test_only_instances_of_the_gateways_model(registry_prefix):
    reg = registry(registry_prefix + "-r4",
                   Instance("p1", "prefill", "a:1", model="other"),
                   Instance("p2", "prefill", "a:2", model="tiny"))
    assert {Router(reg, model="tiny").pick("prefill").id for _ in range(10)} == {"p2"}


def test_an_adapter_s_requests_go_where_it_is_held(registry_prefix):
    """Adapter affinity: among the instances holding the request's LoRA adapter, by
    the usual cost (the busier holder still wins over an idle instance without it);
    when none holds it, any instance (it reads the adapter from its folder)."""
    reg = registry(registry_prefix + "-lora",
                   Instance("p1", "prefill", "a:1", adapters=("sql",),
                            load={"queued_prefill_tokens": 900}),
                   Instance("p2", "prefill", "a:2", adapters=("sql", "chat"),
                            load={"queued_prefill_tokens": 500}),
                   Instance("p3", "prefill", "a:3"))
    r = Router(reg)
    assert r.pick("prefill").id == "p3"
    assert r.pick("prefill", adapter="sql").id == "p2"
    assert r.pick("prefill", adapter="sql", exclude={"p2"}).id == "p1"
    assert r.pick("prefill", adapter="chat").id == "p2"
    assert r.pick("prefill", adapter="other").id == "p3"
    assert r.pick("prefill", adapter="chat", exclude={"p2"}).id == "p3"
    assert {i.id: i.adapters for i in reg.instances()} == {
        "p1": ("sql",), "p2": ("sql", "chat"), "p3": ()}


def test_the_adapters_the_mesh_serves_are_shared_by_its_gateways(registry_prefix):
    """The adapter table beside the instances: what one gateway's router adds or takes
    out, another's reads; a name is served from one folder only."""
    prefix = registry_prefix + "-lora-table"
    one, two = Router(Registry(prefix=prefix)), Router(Registry(prefix=prefix))
    assert one.serve_adapter("sql", "/adapters/sql")
    assert not two.serve_adapter("sql", "/elsewhere/sql")
    assert one.adapters() == two.adapters() == {"sql": "/adapters/sql"}
    assert 0 < Registry(prefix=prefix)._redis.pttl(f"{prefix}:lora-adapters") <= \
        ADAPTERS_TTL_MS  # (gone a while after the mesh's last gateway)
    assert two.unserve_adapter("sql") and not one.unserve_adapter("sql")
    assert one.adapters() == {} and Registry(prefix=prefix).adapters() == {}


def test_background_refresh_sees_new_instances(registry_prefix):
    import time

    reg = registry(registry_prefix + "-r5")
    r = Router(reg, refresh_s=0.05)
    r.start()
    assert r.pick("decode") is None
    reg.put(Instance("d9", "decode", "c:1"))
    r.forget()
    deadline = time.monotonic() + 5
    while r.pick("decode") is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert r.pick("decode").id == "d9"


def two_prefills(prefix: str, **load_p1) -> Router:
    base = {"block_size": 4, "total_kv_blocks": 100}
    return Router(registry(prefix,
                           Instance("p1", "prefill", "a:1", load={**base, **load_p1}),
                           Instance("p2", "prefill", "a:2", load=base)))


def test_prefill_follows_its_cached_prefix(registry_prefix):
    r = two_prefills(registry_prefix + "-r6")
    shared = list(range(1, 17))  # 4 blocks of 4
    first = r.pick("prefill", prompt=shared + [50, 51])
    r.sent(first, shared + [50, 51])
    r.answered(first, shared + [50, 51])
    # the same 16-token prefix again: only the instance that computed it skips it
    assert {r.pick("prefill", prompt=shared + [60, 61, 62]).id for _ in range(20)} == {first.id}
    # a prompt sharing nothing is a tie again: both instances get some
    other = list(range(100, 118))
    assert {r.pick("prefill", prompt=other).id for _ in range(50)} == {"p1", "p2"}
    # a prefix match must start at the first block
    shifted = [0] + shared
    assert {r.pick("prefill", prompt=shifted).id for _ in range(50)} == {"p1", "p2"}


def test_a_busy_cache_loses_to_an_idle_instance(registry_prefix):
    r = two_prefills(registry_prefix + "-r7", queued_prefill_tokens=500)
    p1 = next(i for i in r.instances("prefill") if i.id == "p1")
    prompt = list(range(1, 41))
    r.sent(p1, prompt)
    r.answered(p1, prompt)
    # p1 holds 40 cached tokens but has 500 queued: p2 computes 40 sooner
    assert r.pick("prefill", prompt=prompt).id == "p2"


def test_tokens_in_flight_count_before_the_next_heartbeat(registry_prefix):
    r = two_prefills(registry_prefix + "-r8")
    a, b = list(range(1, 101)), list(range(200, 210))
    p1 = next(i for i in r.instances("prefill") if i.id == "p1")
    r.sent(p1, a)  # 100 tokens on their way to p1, not yet in its heartbeat
    assert {r.pick("prefill", prompt=b).id for _ in range(20)} == {"p2"}
    r.answered(p1, a)
    assert {r.pick("prefill", prompt=b).id for _ in range(50)} == {"p1", "p2"}


def test_prefix_estimate_keeps_at_most_the_instance_capacity():
    from pdmesh.services.gateway.router import PrefixEstimate, block_hashes

    est = PrefixEstimate()
    old, new = block_hashes(list(range(0, 40)), 4), block_hashes(list(range(100, 140)), 4)
    est.add(old, capacity=12)
    est.add(new, capacity=12)
    assert est.hits(new) == 10 and est.hits(old) == 0  # old's first blocks were evicted
    assert block_hashes([1, 2, 3], 4) == []  # no full block, nothing cacheable


# step costs well within the default TPOT budget: 5 ms decode steps, 10 us per prompt token
CHEAP = {"decode_step_us": 5000, "prefill_ns_per_token": 10_000,
         "max_num_batched_tokens": 2048}


def test_prefill_offload_only_while_prefill_is_backed_up(registry_prefix):
    reg = registry(registry_prefix + "-r9",
                   Instance("p1", "prefill", "a:1", load={"queued_prefill_tokens": 0}),
                   Instance("d1", "decode", "b:1", load=CHEAP),
                   Instance("d2", "decode", "b:2", load=CHEAP))
    prompt = list(range(100))
    assert Router(reg).offload_target(prompt) is None  # off by default
    r = Router(reg, offload_threshold=1000)
    assert r.offload_target(prompt) is None  # prefill idle: the usual path
    p1 = r.pick("prefill")
    for _ in range(9):  # 900 tokens queued there: still under the threshold
        r.sent(p1, prompt)
    assert r.offload_target(prompt) is None
    r.sent(p1, prompt)  # 1000 queued: decode may take prompts, up to half the backlog
    first = r.offload_target(prompt)
    assert first is not None and first.role == "decode"
    r.sent(first, prompt)
    second = r.offload_target(prompt)  # the other decode instance, now less loaded
    assert second is not None and second.id != first.id
    r.sent(second, prompt)
    for _ in range(4):
        r.sent(first, prompt)
        r.sent(second, prompt)  # 500 queued on each: a sixth would pass half of 1000
    assert r.offload_target(prompt) is None
    r.answered(first, prompt)  # its first prompt done
    assert r.offload_target(prompt).id == first.id
    for _ in range(10):
        r.answered(p1, prompt)  # prefill caught up: no more offloading
    assert r.offload_target(prompt) is None


def test_no_offload_without_a_decode_instance(registry_prefix):
    reg = registry(registry_prefix + "-r10",
                   Instance("p1", "prefill", "a:1", load={"queued_prefill_tokens": 50_000}))
    assert Router(reg, offload_threshold=10).offload_target([1, 2, 3]) is None


@pytest.mark.parametrize("threshold", [0, 10])
def test_without_a_prefill_instance_the_least_busy_decode_prefills(registry_prefix,
                                                                   threshold):
    """Served slower beats refused: with no prefill instance alive, every prompt goes to
    a decode instance, whatever the offload settings (0: offload off)."""
    reg = registry(registry_prefix + f"-r11-{threshold}", Instance("d1", "decode", "b:1"),
                   Instance("d2", "decode", "c:1"))
    r = Router(reg, offload_threshold=threshold)
    first = r.offload_target([1, 2, 3])
    assert first is not None
    r.sent(first, [1, 2, 3])
    second = r.offload_target([1, 2, 3])
    assert {first.id, second.id} == {"d1", "d2"}  # the one without a prompt in flight


def test_offload_never_pushes_a_decode_step_past_the_tpot_budget(registry_prefix):
    """Decode protected by construction: a decode instance takes an offloaded prompt only
    if its step, with the prompt's first chunk beside its decode rows, stays within
    --decode-tpot-slo-ms by its published step costs (else the prefill instances' cost
    per prompt token); with no cost known anywhere it takes nothing."""
    backed_up = {"queued_prefill_tokens": 100_000, "prefill_ns_per_token": 40_000}
    reg = registry(registry_prefix + "-r12",
                   Instance("p1", "prefill", "a:1", load=backed_up),
                   # 20 ms steps, 40 us per prompt token, 512-token chunks: a step with
                   # a prompt's chunk takes 20 + 0.04 x min(prompt, 512) ms
                   Instance("d1", "decode", "b:1", load={
                       "decode_step_us": 20_000, "prefill_ns_per_token": 40_000,
                       "max_num_batched_tokens": 512}),
                   # busy: 45 ms steps already
                   Instance("d2", "decode", "b:2", load={
                       "decode_step_us": 45_000, "prefill_ns_per_token": 40_000,
                       "max_num_batched_tokens": 512}))
    r = Router(reg, offload_threshold=1000, decode_tpot_slo_ms=50)
    d1 = next(i for i in r.instances("decode") if i.id == "d1")
    assert r.offloaded_step_ms(d1, 100) == pytest.approx(24.0)  # 20 + 100 x 0.04
    assert r.offloaded_step_ms(d1, 5000) == pytest.approx(40.48)  # one 512-token chunk
    short, long = list(range(100)), list(range(5000))
    # d2 would step 49 ms with 100 prompt tokens: under budget, but it is the busier
    assert r.offload_target(short).id in {"d1", "d2"}
    picked = {r.offload_target(list(range(200))).id for _ in range(10)}
    assert picked == {"d1"}  # d2: 45 + 8 = 53 ms > 50
    strict = Router(reg, offload_threshold=1000, decode_tpot_slo_ms=30)
    assert strict.offload_target(short).id == "d1"  # 24 ms
    assert strict.offload_target(long) is None  # 40.48 ms: no instance within 30 ms
    # a decode instance that never computed a prompt is priced at prefill's cost
    reg2 = registry(registry_prefix + "-r13",
                    Instance("p1", "prefill", "a:1", load=backed_up),
                    Instance("d1", "decode", "b:1", load={"decode_step_us": 10_000}))
    r2 = Router(reg2, offload_threshold=1000, decode_tpot_slo_ms=50)
    assert r2.offload_target(list(range(500))).id == "d1"  # 10 + 20 ms
    assert r2.offload_target(list(range(1500))) is None  # 10 + 60 ms
    # nothing measured anywhere: no offload at all
    reg3 = registry(registry_prefix + "-r14",
                    Instance("p1", "prefill", "a:1", load={"queued_prefill_tokens": 100_000}),
                    Instance("d1", "decode", "b:1"))
    assert Router(reg3, offload_threshold=1000).offload_target(short) is None



def test_a_prompt_mostly_in_a_prefill_cache_is_not_offloaded(registry_prefix):
    """Offloading a prompt whose longer part a prefill instance probably holds in its
    prefix cache would compute that part again on decode: such a prompt stays with the
    prefill instances, backed up or not; one that shares less goes to decode."""
    backed_up = {"queued_prefill_tokens": 100_000, "prefill_ns_per_token": 10_000,
                 "block_size": 16}
    reg = registry(registry_prefix + "-r15", Instance("p1", "prefill", "a:1", load=backed_up),
                   Instance("d1", "decode", "b:1", load={"decode_step_us": 5_000}))
    r = Router(reg, offload_threshold=1000, decode_tpot_slo_ms=50)
    p1 = next(i for i in r.instances("prefill") if i.id == "p1")
    system = list(range(1000, 1320))  # 320 tokens: 20 blocks
    r.sent(p1, system + [7, 8, 9])
    assert r.offload_target(system + list(range(50))) is None  # 320 of 370 cached there
    assert r.offload_target(system[:160] + list(range(5000, 5400))).id == "d1"  # 160 of 560
    assert r.offload_target(list(range(2000, 2400))).id == "d1"  # nothing shared

def test_a_stalled_instance_is_neither_picked_nor_alive(registry_prefix):
    """An engine that has had work for stall_timeout_s without finishing a step (its
    heartbeat's stalled_ms) gets no new request, and its streams are not waited for."""
    reg = registry(registry_prefix + "-r12",
                   Instance("d1", "decode", "a:1", load={"stalled_ms": 15_000}),
                   Instance("d2", "decode", "b:1", load={"stalled_ms": 400, "running": 9}))
    r = Router(reg, stall_timeout_s=10)
    assert [i.id for i in r.instances("decode")] == ["d2"]
    assert r.pick("decode").id == "d2"  # though d1 looks idle
    assert not r.listed("d1") and r.listed("d2")
    assert Router(reg, stall_timeout_s=30).listed("d1")  # under a longer timeout: alive


def test_a_restarted_redis_does_not_empty_the_routes(tmp_path):
    """Redis restarts empty: until every instance has heartbeated again (one TTL) the
    router keeps what it last saw beside what redis has; past that, an instance that
    never came back is gone."""
    import time

    from tests.processes import free_port, start_redis

    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    procs = [start_redis(tmp_path, port)]
    r = None
    try:
        reg = Registry(url, prefix="grace", ttl_s=1.5)
        for inst in (Instance("d1", "decode", "c:1"), Instance("p1", "prefill", "a:1")):
            reg.put(inst)
        r = Router(reg, refresh_s=0.05)
        r.start()
        assert r.pick("decode").id == "d1"
        procs[0].kill()
        procs[0].wait()
        time.sleep(0.3)  # refreshes fail: the last copy routes
        assert r.pick("decode").id == "d1" and r.pick("prefill").id == "p1"
        procs.append(start_redis(tmp_path, port))
        reg.put(Instance("p1", "prefill", "a:1"))  # p1 heartbeats again; d1 never does
        time.sleep(0.3)  # refreshes read the new, nearly empty redis
        assert r.pick("decode").id == "d1" and r.pick("prefill").id == "p1"
        deadline = time.monotonic() + 5
        while r.pick("decode") is not None:
            assert time.monotonic() < deadline, "an instance that never came back stays"
            reg.put(Instance("p1", "prefill", "a:1"))
            time.sleep(0.1)
        assert r.pick("prefill").id == "p1"
    finally:
        if r is not None:
            r.stop()  # (no refreshes against a redis that is gone)
        for proc in procs:
            proc.kill()
            proc.wait()


def test_an_instance_whose_heartbeats_stopped_is_not_counted_live(registry_prefix):
    """A killed instance's entry lasts until its key expires; /health counts only those
    whose heartbeat stamps still change."""
    import time

    a, b = (Instance(f"p{n}", "prefill", f"127.0.0.1:{n}") for n in (1, 2))
    reg = registry(registry_prefix + "-live", a, b)
    r = Router(reg, refresh_s=0.0)
    assert [i.id for i in r.live("prefill", within_s=0.5)] == ["p1", "p2"]  # new: live
    for _ in range(4):
        time.sleep(0.2)
        reg.put(a)  # p1 beats (a new stamp), p2 does not
        assert {i.id for i in r.instances("prefill")} == {"p1", "p2"}  # both still listed
    assert [i.id for i in r.live("prefill", within_s=0.5)] == ["p1"]
