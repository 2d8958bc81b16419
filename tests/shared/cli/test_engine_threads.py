"""How `pdmesh up` shares the box's cores among its engines (OpenMP environment)."""

from __future__ import annotations

from pdmesh.shared.cli.up import PREFILL_SPIN_COUNT, engine_threads

PD = [("prefill", 1), ("decode", 1)]


def test_prefill_beside_decode_gets_the_cores_and_every_engine_sleeps_when_idle():
    env = engine_threads(PD, {"prefill": 1, "decode": 1}, 2, {})
    assert env == {"prefill": {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"},
                   "decode": {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}}


def test_several_prefill_instances_and_dp_ranks_share_what_there_is():
    env = engine_threads([("prefill", 2), ("decode", 1)], {"prefill": 1, "decode": 2}, 16,
                         {})
    assert env["prefill"]["OMP_NUM_THREADS"] == "8"  # 16 cores over 2 prefill engines
    assert env["decode"]["OMP_NUM_THREADS"] == "4"  # over all 4 engines
    tiny = engine_threads([("prefill", 3), ("decode", 2)], {"prefill": 1, "decode": 1}, 2,
                          {})
    assert tiny["prefill"]["OMP_NUM_THREADS"] == tiny["decode"]["OMP_NUM_THREADS"] == "1"


def test_engines_of_one_role_share_equally_with_the_default_policy():
    assert engine_threads([("mixed", 1)], {"mixed": 1}, 2, {}) == {
        "mixed": {"OMP_NUM_THREADS": "2"}}
    assert engine_threads([("mixed", 1)], {"mixed": 4}, 8, {}) == {
        "mixed": {"OMP_NUM_THREADS": "2"}}


def test_the_users_openmp_settings_win():
    env = engine_threads(PD, {"prefill": 1, "decode": 1}, 2,
                         {"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "ACTIVE"})
    assert all(e == {"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "ACTIVE"}
               for e in env.values())


def test_a_prefill_engine_that_decode_yields_to_spins_before_its_threads_sleep():
    env = engine_threads(PD, {"prefill": 1, "decode": 1}, 2, {}, decode_yields=True)
    assert env == {"prefill": {"OMP_NUM_THREADS": "2",
                               "GOMP_SPINCOUNT": str(PREFILL_SPIN_COUNT),
                               "KMP_BLOCKTIME": "1"},
                   "decode": {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}}
    mine = engine_threads(PD, {"prefill": 1, "decode": 1}, 2, {"GOMP_SPINCOUNT": "100"},
                          decode_yields=True)
    assert mine["prefill"]["GOMP_SPINCOUNT"] == "100"
    theirs = engine_threads(PD, {"prefill": 1, "decode": 1}, 2,
                            {"OMP_WAIT_POLICY": "PASSIVE"}, decode_yields=True)
    assert theirs["prefill"] == {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}
