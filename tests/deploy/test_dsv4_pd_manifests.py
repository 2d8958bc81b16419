"""The npu-dsv4-pd overlay: the seeds' DeepSeek-V4-Pro "3×2P+1×2D" PD deployment. Rendered
by kubectl, it replaces the engine Deployments with two StatefulSets; each pod's real
shell line, run with the pod's environment, gives pdmesh the recipe's command line for
its place in the topology: the DP ranks, the TP devices, the kv_role and engine_id."""

from __future__ import annotations

import json

import pytest

from pdmesh.cli import parse_args
from pdmesh.shared.config.serve import serve_config
from pdmesh.shared.models.config import ModelConfig
from pdmesh.shared.runtime.dp_launcher import device_env, local_ranks
from tests.deploy.test_manifests import K8S, kustomize
from tests.deploy.test_multinode_dp_manifests import pod_command

OVERLAY = K8S / "overlays" / "npu-dsv4-pd"
SPLIT = {"prefill": {"dp_size": 2, "tp_size": 16}, "decode": {"dp_size": 16, "tp_size": 2}}


@pytest.fixture(scope="module")
def rendered() -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in kustomize(OVERLAY)}


def test_the_engine_deployments_become_statefulsets(rendered):
    npu = {(d["kind"], d["metadata"]["name"]) for d in kustomize(OVERLAY.parent / "npu")}
    engines = {("StatefulSet", "prefill-dp"), ("Service", "prefill-dp"),
               ("StatefulSet", "decode-dp"), ("Service", "decode-dp")}
    assert set(rendered) == npu - {("Deployment", "prefill"), ("Deployment", "decode")} \
        | engines
    for name in ("prefill-dp", "decode-dp"):
        assert rendered[("Service", name)]["spec"]["clusterIP"] == "None"
        assert rendered[("Service", name)]["spec"]["publishNotReadyAddresses"] is True


def _pods(sts: dict, tmp_path) -> list[tuple[list[str], object, int]]:
    """(argv, flags, NPUs of the pod) for every pod of ``sts``."""
    npus = sts["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"][
        "huawei.com/Ascend910"]
    out = []
    for ordinal in range(sts["spec"]["replicas"]):
        argv = pod_command(sts, ordinal, tmp_path)
        out.append((argv, parse_args(argv, resolve=False)[2], npus))
    return out


def _devices_of_ranks(flags, npus: int) -> list[list[str]]:
    """The NPUs each local rank of the pod takes; all distinct and within the pod's."""
    tp = flags.tensor_parallel_size
    taken = [device_env("npu", i, tp, environ={})["ASCEND_RT_VISIBLE_DEVICES"].split(",")
             for i in range(len(local_ranks(flags)))]
    flat = [d for rank in taken for d in rank]
    assert len(flat) == len(set(flat)) == npus and {int(d) for d in flat} == set(range(npus))
    return taken


def test_three_prefill_instances_of_dp2_tp16(rendered, tmp_path):
    instances: dict[str, list[int]] = {}
    for pod, (argv, flags, npus) in enumerate(_pods(rendered[("StatefulSet", "prefill-dp")],
                                                    tmp_path)):
        assert argv[0] == "prefill" and flags.device == "npu"
        transfer = flags.kv_transfer_config
        assert transfer["kv_role"] == "kv_producer" and transfer["kv_port"] == "30000"
        assert transfer["kv_connector_extra_config"] == SPLIT
        assert (flags.data_parallel_size, flags.tensor_parallel_size) == (2, 16)
        instance = pod // 2
        assert transfer["engine_id"] == str(instance)  # the recipe numbers P instances 0-2
        assert flags.data_parallel_address == f"prefill-dp-{2 * instance}.prefill-dp"
        assert flags.headless == (pod % 2 == 1)
        assert flags.enable_expert_parallel and flags.enforce_eager
        assert flags.speculative_config == {"num_speculative_tokens": 1, "method": "mtp",
                                            "enforce_eager": True}
        instances.setdefault(transfer["engine_id"], []).extend(local_ranks(flags))
        assert _devices_of_ranks(flags, npus) == [[str(i) for i in range(16)]]
    assert instances == {"0": [0, 1], "1": [0, 1], "2": [0, 1]}


def test_one_decode_instance_of_dp16_tp2(rendered, tmp_path):
    ranks = []
    for node, (argv, flags, npus) in enumerate(_pods(rendered[("StatefulSet", "decode-dp")],
                                                     tmp_path)):
        assert argv[0] == "decode"
        transfer = flags.kv_transfer_config
        assert (transfer["kv_role"], transfer["engine_id"]) == ("kv_consumer", "3")
        assert transfer["kv_connector_extra_config"] == SPLIT
        assert (flags.data_parallel_size, flags.tensor_parallel_size) == (16, 2)
        assert flags.data_parallel_address == "decode-dp-0.decode-dp"
        assert flags.headless == (node > 0)
        assert json.loads(flags.additional_config)["recompute_scheduler_enable"] is True
        assert not flags.enable_prefix_caching
        ranks += list(local_ranks(flags))
        assert _devices_of_ranks(flags, npus) == [[str(2 * i), str(2 * i + 1)]
                                                  for i in range(8)]
    assert ranks == list(range(16))


@pytest.mark.parametrize("name", ["prefill-dp", "decode-dp"])
def test_the_recipe_lines_resolve_with_their_tensor_parallelism(rendered, tmp_path,
                                                                qwen3_path, name):
    """Each pod's line resolves into an engine configuration on npu with the recipe's
    tensor-parallel size where it divides the (tiny) model's heads, and is refused
    naming the flag and the heads where it does not (16 of the tiny model's 8)."""
    argv = _pods(rendered[("StatefulSet", name)], tmp_path)[1][0]
    # the tiny model in the recipe's place, with its context length
    argv = [f"--model={qwen3_path}" if w.startswith("--model=")
            else "--max-model-len=4096" if w.startswith(("--max-model-len=", "--max_model_len="))
            else w for w in argv]
    tp = int(next(w for w in argv if w.startswith("--tensor-parallel-size=")).split("=")[1])
    heads = ModelConfig.from_folder(qwen3_path).num_heads
    if heads % tp:
        with pytest.raises(ValueError, match=rf"^--tensor-parallel-size: {tp} does not "
                                             rf"divide num_attention_heads \({heads}\)"):
            serve_config(argv[0], argv[1:], device="npu")
        return
    config = serve_config(argv[0], argv[1:], device="npu")
    assert config.engine is not None and config.role == argv[0]
    assert config.engine.tensor_parallel_size == tp
