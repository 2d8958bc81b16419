"""SGLang's parallel layout flags (--enable-dp-attention, --enable-dp-lm-head,
--moe-dense-tp-size, --expert-parallel-size) read into pdmesh's by every command: what
they become, what is said, and what is refused naming the flag."""

from __future__ import annotations

import pytest

from pdmesh.shared.config.serve import serve_config


def check(*words: str):
    return serve_config("config check", ["--role", "mixed", "--model", "/tmp/m", "--device",
                                         "cpu", *words])


def test_dp_attention_is_dp_ranks_with_the_experts_over_all_of_them():
    cfg = check("--tp-size", "4", "--dp-size", "4", "--enable-dp-attention")
    e = cfg.engine
    assert (e.data_parallel_size, e.tensor_parallel_size, e.enable_expert_parallel) == \
        (4, 1, True)
    assert e.finegrained_tp_config == {"mlp_tensor_parallel_size": 4,
                                       "lmhead_tensor_parallel_size": 4}
    assert "--enable-dp-attention" not in cfg.accepted_without_effect
    assert any("4 DP ranks with 1 TP rank(s) each" in w for w in cfg.flag_warnings)
    # the LM head in each rank's own TP group; the dense MLPs whole
    e = check("--tp-size", "4", "--dp-size", "4", "--enable-dp-attention",
              "--enable-dp-lm-head", "--moe-dense-tp-size", "1").engine
    assert e.finegrained_tp_config is None and e.enable_expert_parallel
    # attention TP 2 in each of 2 DP ranks: the split stays within TP, and it is said
    cfg = check("--tp-size", "4", "--dp-size", "2", "--enable-dp-attention")
    assert (cfg.engine.data_parallel_size, cfg.engine.tensor_parallel_size) == (2, 2)
    assert cfg.engine.finegrained_tp_config is None
    assert any("stay whole on each DP rank" in w for w in cfg.flag_warnings)


def test_the_user_s_own_finegrained_keys_win():
    e = check("--tp-size", "2", "--dp-size", "2", "--enable-dp-attention",
              "--additional-config",
              '{"finegrained_tp_config": {"lmhead_tensor_parallel_size": 1}}').engine
    assert e.finegrained_tp_config == {"mlp_tensor_parallel_size": 2}


def test_expert_parallel_size_without_dp_attention():
    e = check("--tp-size", "2", "--ep-size", "2").engine
    assert (e.tensor_parallel_size, e.enable_expert_parallel) == (2, True)
    assert not check("--tp-size", "2", "--ep-size", "1").engine.enable_expert_parallel
    cfg = check("--enable-dp-lm-head", "--moe-dense-tp-size", "1")
    said = " ".join(cfg.flag_warnings)
    assert "--enable-dp-lm-head: without effect" in said
    assert "--moe-dense-tp-size: without effect" in said


@pytest.mark.parametrize(("words", "flag"), [
    (("--tp-size", "2", "--dp-size", "4", "--enable-dp-attention"), "--enable-dp-attention"),
    (("--tp-size", "6", "--dp-size", "4", "--enable-dp-attention"), "--enable-dp-attention"),
    (("--tp-size", "4", "--dp-size", "4", "--enable-dp-attention", "--ep-size", "2"),
     "--expert-parallel-size"),
    (("--tp-size", "4", "--ep-size", "3"), "--expert-parallel-size"),
    (("--tp-size", "4", "--dp-size", "4", "--enable-dp-attention", "--moe-dense-tp-size",
      "2"), "--moe-dense-tp-size"),
])
def test_a_layout_pdmesh_cannot_run_is_refused_naming_the_flag(words, flag):
    with pytest.raises(ValueError, match=f"^{flag}: "):
        check(*words)


def test_nodes_run_their_share_of_the_dp_ranks():
    base = ("--tp-size", "16", "--dp-size", "16", "--enable-dp-attention", "--nnodes", "2",
            "--dist-init-addr", "10.0.0.1:5000")
    first = check(*base, "--node-rank", "0")
    second = serve_config("config check", ["--role", "mixed", "--model", "/tmp/m", "--device",
                                           "cpu", *base, "--node-rank", "1"])
    for cfg, start in ((first, 0), (second, 8)):
        f = cfg.flags
        assert (f.data_parallel_size, f.data_parallel_size_local, f.data_parallel_start_rank,
                f.data_parallel_address, f.data_parallel_rpc_port) == \
            (16, 8, start, "10.0.0.1", 5000)
    assert not first.flags.headless and second.flags.headless
    # two replicas of TP 8, one per node
    f = check("--tp-size", "8", "--dp-size", "2", "--nnodes", "2", "--node-rank", "1",
              "--dist-init-addr", "h:1").flags
    assert (f.tensor_parallel_size, f.data_parallel_size_local,
            f.data_parallel_start_rank) == (8, 1, 1)


@pytest.mark.parametrize(("words", "flag"), [
    (("--tp-size", "16", "--nnodes", "2", "--dist-init-addr", "h:1"), "--nnodes"),
    (("--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--nnodes", "2"),
     "--dist-init-addr"),
    (("--dp-size", "2", "--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "h:1"),
     "--node-rank"),
])
def test_a_multi_node_line_pdmesh_cannot_run_is_refused(words, flag):
    with pytest.raises(ValueError, match=f"^{flag}: "):
        check(*words)
