"""The npu-multinode-dp overlay: one decode instance of 16 DP ranks as a StatefulSet of
two 8-NPU pods. Its objects validate against the Kubernetes schemas, and the pods' real
shell line, run with each pod's environment, gives pdmesh a command line that parses and
splits the ranks as intended."""

from __future__ import annotations

import json
import subprocess
import sys

from pdmesh.cli import parse_args
from pdmesh.shared.runtime.dp_launcher import device_env, local_ranks
from tests.deploy.test_manifests import K8S, k8s_docs, kustomize

OVERLAY = K8S / "overlays" / "npu-multinode-dp"


def test_overlay_replaces_the_decode_deployment_with_the_statefulset():
    rendered = {(d["kind"], d["metadata"]["name"]) for d in kustomize(OVERLAY)}
    npu = {(d["kind"], d["metadata"]["name"]) for d in kustomize(OVERLAY.parent / "npu")}
    assert rendered == npu - {("Deployment", "decode")} | {("StatefulSet", "decode-dp"),
                                                            ("Service", "decode-dp")}
    docs = {(d["kind"], d["metadata"]["name"]): d for d in kustomize(OVERLAY)}
    sts, svc = docs[("StatefulSet", "decode-dp")], docs[("Service", "decode-dp")]
    # the base's decode Service and NetworkPolicies select the pods; the headless Service
    # names them before they are ready (rank 0 waits for every rank)
    assert sts["spec"]["template"]["metadata"]["labels"]["app"] == "decode"
    assert sts["spec"]["serviceName"] == "decode-dp" and svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True


def pod_command(sts: dict, ordinal: int, tmp_path, ip: str | None = None) -> list[str]:
    """What the pod's container hands pdmesh: its shell line run with its environment,
    `pdmesh` a stub that prints its arguments."""
    container = sts["spec"]["template"]["spec"]["containers"][0]
    stub = tmp_path / "bin" / "pdmesh"
    stub.parent.mkdir(exist_ok=True)
    stub.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    stub.chmod(0o755)
    base = {(d["kind"], d["metadata"]["name"]): d for d in k8s_docs(K8S / "base")}
    env = dict(base[("ConfigMap", "pdmesh-flags")]["data"], DEVICE="npu")
    for item in container["env"]:
        env[item["name"]] = item.get("value", ip or f"10.0.0.{ordinal + 1}")  # fieldRefs
    env.update(HOSTNAME=f"{sts['metadata']['name']}-{ordinal}",
               PATH=f"{stub.parent}:/usr/bin:/bin")
    assert container["command"] == ["sh", "-c"]
    run = subprocess.run(["sh", "-c", container["args"][0]], env=env, capture_output=True,
                         text=True, timeout=30, check=True)
    return json.loads(run.stdout)


def test_each_pod_runs_its_own_eight_ranks(tmp_path):
    sts = next(d for d in k8s_docs(OVERLAY) if d["kind"] == "StatefulSet")
    npus = sts["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"][
        "huawei.com/Ascend910"]
    covered = []
    for ordinal in range(sts["spec"]["replicas"]):
        argv = pod_command(sts, ordinal, tmp_path)
        flags = parse_args(argv, resolve=False)[2]
        assert argv[0] == "decode" and flags.device == "npu"
        assert flags.data_parallel_address == "decode-dp-0.decode-dp"
        assert flags.advertise_host == f"10.0.0.{ordinal + 1}"
        assert flags.headless == (ordinal > 0)  # as vLLM's recipes: rank 0's node is not
        ranks = local_ranks(flags)
        assert ranks == range(8 * ordinal, 8 * ordinal + 8)
        covered += list(ranks)
        # local rank i on NPU i of the pod, all within what the pod asks for
        devices = [device_env("npu", i, environ={})["ASCEND_RT_VISIBLE_DEVICES"]
                   for i in range(len(ranks))]
        assert devices == [str(i) for i in range(npus)]
    assert covered == list(range(16))  # every rank of the instance, once
