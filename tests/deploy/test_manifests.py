"""docker-compose.yml and deploy/k8s, validated offline (no Docker engine or cluster
here): compose by `docker-compose config`, Kubernetes objects against the 1.37 schemas,
and every service command against pdmesh's own command line."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from pdmesh.cli import parse_args

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy/k8s"
K8S_VERSION = "1.37"
PDMESH_SERVICES = {"kvstore", "eplb", "prefill", "decode", "gateway"}


def parses(argv: list[str]) -> None:
    """SystemExit if pdmesh's parser rejects the arguments."""
    parse_args(argv, resolve=False)


def compose() -> dict:
    exe = shutil.which("docker-compose")
    assert exe, "docker-compose is not installed (scripts/setup.sh installs it)"
    run = subprocess.run([exe, "-f", str(ROOT / "docker-compose.yml"), "config"],
                         capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "MODEL_DIR": "/tmp/model"})
    assert run.returncode == 0, run.stderr
    return yaml.safe_load(run.stdout)


def test_compose_is_valid_and_complete():
    cfg = compose()
    # the observability profile's services (prometheus, grafana, otel-collector) are
    # checked in test_observability.py
    services = {n: s for n, s in cfg["services"].items() if not s.get("profiles")}
    assert set(services) == PDMESH_SERVICES | {"redis", "cluster-secret"}
    for name in PDMESH_SERVICES:
        svc = services[name]
        assert svc["command"][0] == name
        parses(svc["command"])  # every flag given exists
        parses(svc["healthcheck"]["test"][2:])  # ["CMD", "pdmesh", ...]
        volumes = " ".join(str(v) for v in svc.get("volumes") or [])
        assert "/models/model" in volumes
        # the cluster secret: on, with no step of the user's
        assert "cluster-secret:/run/pdmesh:ro" in volumes
        assert svc["environment"]["PDMESH_CLUSTER_SECRET_FILE"] == "/run/pdmesh/cluster-secret"
        assert svc["environment"]["PDMESH_REDIS_PASSWORD_FILE"] == "/run/pdmesh/cluster-secret"
        assert svc["environment"]["PDMESH_TLS_DIR"] == "/run/pdmesh"  # mutual TLS
        for dep_name, dep in svc.get("depends_on", {}).items():
            assert dep["condition"] == ("service_completed_successfully"
                                        if dep_name == "cluster-secret" else "service_healthy")
    maker = services["cluster-secret"]
    parses(maker["command"])
    assert maker["command"][1:] == ["/run/pdmesh/cluster-secret", "--tls"]
    assert maker["volumes"] == ["cluster-secret:/run/pdmesh:rw"]  # it alone writes it
    assert maker["restart"] == "no"
    first = {n for n, s in services.items() if "redis" in s.get("depends_on", {})}
    assert first and all("cluster-secret" in services[n]["depends_on"] for n in first)
    assert services["gateway"]["ports"]
    # redis requires the secret as its password, read from the same volume
    red = services["redis"]
    assert "--requirepass" in red["command"][-1] and "/run/pdmesh/cluster-secret" in \
        red["command"][-1]
    assert "cluster-secret:/run/pdmesh:ro" in red["volumes"]
    assert red["depends_on"]["cluster-secret"]["condition"] == "service_completed_successfully"


def k8s_docs(folder: Path) -> list[dict]:
    docs = []
    for f in sorted(folder.glob("*.yaml")):
        if f.name == "kustomization.yaml":
            continue
        docs += [d for d in yaml.safe_load_all(f.read_text()) if d]
    return docs


def test_k8s_base_objects_validate():
    docs = k8s_docs(K8S / "base")
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for name in PDMESH_SERVICES | {"redis"}:
        assert ("Deployment", name) in kinds and ("Service", name) in kinds
    for d in docs:
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)
    listed = yaml.safe_load((K8S / "base/kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(f.name for f in (K8S / "base").glob("*.yaml")
                                    if f.name != "kustomization.yaml")


def container_args(deployment: dict, env: dict[str, str]) -> list[str]:
    c = deployment["spec"]["template"]["spec"]["containers"][0]
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in c["args"]]


def test_k8s_commands_and_probes_parse():
    docs = k8s_docs(K8S / "base")
    flags = next(d for d in docs if d["kind"] == "ConfigMap")["data"]
    env = {**flags, "POD_IP": "10.0.0.7"}
    for d in docs:
        if d["kind"] != "Deployment" or d["metadata"]["name"] == "redis":
            continue
        args = container_args(d, env)
        assert args[0] == d["metadata"]["name"]
        parses(args)
        probe = d["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
        if "exec" in probe:
            parses(probe["exec"]["command"][1:])


OVERLAYS = sorted(p.parent.name for p in (K8S / "overlays").glob("*/kustomization.yaml"))


def kustomize(folder: Path) -> list[dict]:
    """The objects `kubectl kustomize` renders from ``folder`` (written in the form both
    Debian's kubectl 1.20 - kustomize v2 - and current ones render)."""
    exe = shutil.which("kubectl")
    assert exe, "kubectl is not installed (scripts/setup.sh installs kubernetes-client)"
    run = subprocess.run([exe, "kustomize", str(folder)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    return [d for d in yaml.safe_load_all(run.stdout) if d]


def pod_templates(docs: list[dict]) -> dict[str, dict]:
    return {d["metadata"]["name"]: d["spec"]["template"] for d in docs
            if d["kind"] in ("Deployment", "StatefulSet", "Job")}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_holds_together(overlay):
    """Rendered by kubectl: every object validates; every pod's ConfigMap exists; every
    Service and NetworkPolicy selects pods that exist; the image and DEVICE match."""
    docs = kustomize(K8S / "overlays" / overlay)
    for d in docs:
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)
    device = "cpu" if overlay == "cpu" else "npu"
    [configmap] = [d for d in docs if d["kind"] == "ConfigMap"]
    assert configmap["data"]["DEVICE"] == device
    pods = pod_templates(docs)
    labels = [t["metadata"].get("labels", {}) for t in pods.values()]
    for name, template in pods.items():
        for c in template["spec"]["containers"]:
            if c["image"].startswith("pdmesh"):
                assert c["image"] == f"pdmesh:{device}", name
            for ref in c.get("envFrom", []):
                assert ref["configMapRef"]["name"] == configmap["metadata"]["name"], name
    for d in docs:
        if d["kind"] == "Service":
            selector = d["spec"]["selector"]
        elif d["kind"] == "NetworkPolicy":
            selector = d["spec"]["podSelector"].get("matchLabels", {})
        else:
            continue
        assert any(selector.items() <= pod.items() for pod in labels), d["metadata"]["name"]
    if device == "npu":
        for name, template in pods.items():
            c = template["spec"]["containers"][0]
            if template["metadata"]["labels"]["app"] in ("prefill", "decode"):
                assert c["resources"]["limits"]["huawei.com/Ascend910"] >= 1, name


def test_base_and_overlays_keep_one_kustomize_form():
    """The fields kustomize v2 (Debian's kubectl) knows, so that any kubectl renders them."""
    v2_fields = {"apiVersion", "kind", "resources", "bases", "images", "commonLabels",
                 "configMapGenerator", "patchesJson6902", "patchesStrategicMerge"}
    for kust in K8S.glob("**/kustomization.yaml"):
        fields = set(yaml.safe_load(kust.read_text()))
        assert fields <= v2_fields, (kust, fields - v2_fields)


def test_engine_pods_drain_before_they_are_killed():
    """prefill and decode drain on SIGTERM: the pod's grace period outlasts
    --shutdown-timeout, and a preStop hook runs first."""
    docs = {d["metadata"]["name"]: d for d in k8s_docs(K8S / "base") if d["kind"] == "Deployment"}
    for name in ("prefill", "decode"):
        spec = docs[name]["spec"]["template"]["spec"]
        container = spec["containers"][0]
        timeout = next(float(a.split("=", 1)[1]) for a in container["args"]
                       if a.startswith("--shutdown-timeout="))
        assert spec["terminationGracePeriodSeconds"] > timeout, name
        assert container["lifecycle"]["preStop"]["exec"]["command"], name


def test_k8s_cluster_secret_is_on_with_no_user_step():
    """A Job makes the Secret (its account may create Secrets, nothing more); every
    pdmesh pod mounts it where the ConfigMap says the secret file is; NetworkPolicies
    keep prefill / decode to the gateway (and engines), the kvstore to engines."""
    docs = k8s_docs(K8S / "base")
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    flags = by[("ConfigMap", "pdmesh-flags")]["data"]
    assert flags["PDMESH_CLUSTER_SECRET_FILE"] == "/run/pdmesh/cluster-secret"
    assert flags["PDMESH_REDIS_PASSWORD_FILE"] == "/run/pdmesh/cluster-secret"
    for name in PDMESH_SERVICES | {"redis"}:
        pod = by[("Deployment", name)]["spec"]["template"]["spec"]
        [volume] = [v for v in pod["volumes"] if v["name"] == "cluster-secret"]
        assert volume["secret"]["secretName"] == "pdmesh-cluster-secret"
        mounts = pod["containers"][0]["volumeMounts"]
        assert {"name": "cluster-secret", "mountPath": "/run/pdmesh",
                "readOnly": True} in mounts
        if name != "redis":
            assert {"configMapRef": {"name": "pdmesh-flags"}} in pod["containers"][0]["envFrom"]
    redis_cmd = by[("Deployment", "redis")]["spec"]["template"]["spec"]["containers"][0]
    assert "--requirepass" in redis_cmd["command"][-1]
    job = by[("Job", "pdmesh-cluster-secret")]["spec"]["template"]["spec"]
    parses(job["containers"][0]["args"])
    args = job["containers"][0]["args"]
    assert args[args.index("--k8s-secret") + 1] == "pdmesh-cluster-secret"
    assert "--tls" in args and flags["PDMESH_TLS_DIR"] == "/run/pdmesh"  # mutual TLS
    assert job["serviceAccountName"] == "pdmesh-cluster-secret"
    assert by[("Role", "pdmesh-cluster-secret")]["rules"] == [
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]}]

    def sources(policy: str) -> set[str]:
        out = set()
        for rule in by[("NetworkPolicy", policy)]["spec"]["ingress"]:
            for peer in rule["from"]:
                sel = peer["podSelector"]
                out |= set(sel.get("matchLabels", {}).values())
                for e in sel.get("matchExpressions", []):
                    out |= set(e["values"])
        return out

    assert sources("pdmesh-engines") == {"gateway", "prefill", "decode", "kvstore",
                                         "prometheus"}
    assert sources("pdmesh-kvstore") == {"prefill", "decode", "kvstore", "prometheus"}
    assert "gateway" not in sources("pdmesh-kvstore") | sources("pdmesh-eplb")


def test_configmap_configs_reach_prefill_and_decode():
    """ADDITIONAL_CONFIG and KV_TRANSFER_CONFIG in the configmap are what prefill and decode
    run with: set them, and the parsed command lines carry them."""
    docs = k8s_docs(K8S / "base")
    flags = next(d for d in docs if d["kind"] == "ConfigMap")["data"]
    additional = '{"ascend_scheduler_config": {"enabled": true}}'
    transfer = '{"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_both"}'
    env = {**flags, "POD_IP": "10.0.0.7", "ADDITIONAL_CONFIG": additional,
           "KV_TRANSFER_CONFIG": transfer}
    for name in ("prefill", "decode"):
        deployment = next(d for d in docs if d["kind"] == "Deployment"
                          and d["metadata"]["name"] == name)
        parsed = parse_args(container_args(deployment, env), resolve=False)[2]
        for value, want in ((parsed.additional_config, additional),
                            (parsed.kv_transfer_config, transfer)):
            assert (value if isinstance(value, dict) else json.loads(value)) \
                == json.loads(want), name
