"""deploy/observability, validated offline: the compose profile `observability` wires
Prometheus, Grafana and the OpenTelemetry collector to files that exist; every scrape
target is a port a service really serves /metrics on; the dashboard queries exactly the
metrics pdmesh exports (shared.infra.metrics.METRIC_NAMES); the collector takes OTLP
traces."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import yaml

from pdmesh.cli import parse_args
from pdmesh.shared.infra.metrics import METRIC_NAMES

ROOT = Path(__file__).resolve().parents[2]
OBS = ROOT / "deploy/observability"
DASHBOARD = OBS / "grafana/dashboard.json"
PDMESH_SERVICES = {"kvstore", "eplb", "prefill", "decode", "gateway"}
OBSERVABILITY = {"prometheus", "grafana", "otel-collector"}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def compose() -> dict:
    exe = shutil.which("docker-compose")
    assert exe, "docker-compose is not installed (scripts/setup.sh installs it)"
    run = subprocess.run([exe, "-f", str(ROOT / "docker-compose.yml"), "--profile",
                          "observability", "config"],
                         capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "MODEL_DIR": "/tmp/model"})
    assert run.returncode == 0, run.stderr
    return yaml.safe_load(run.stdout)


def load_yaml(name: str) -> dict:
    return yaml.safe_load((OBS / name).read_text())


def binds(service: dict) -> dict[str, tuple[Path, bool]]:
    """Mount target -> (host source, read-only), in either syntax `config` prints."""
    out = {}
    for v in service.get("volumes", []):
        if isinstance(v, str):
            src, dst, *mode = v.split(":")
            out[dst] = (Path(src), "ro" in mode)
        else:
            out[v["target"]] = (Path(v["source"]), bool(v.get("read_only")))
    return out


def container_ports(service: dict) -> set[int]:
    """Container ports a compose service publishes, in either syntax `config` prints."""
    return {int(p["target"]) if isinstance(p, dict) else int(str(p).rsplit(":", 1)[-1])
            for p in service.get("ports", [])}


def metrics_port(command: list[str]) -> int:
    """The port a pdmesh service's command serves /metrics on (the gateway: its HTTP
    port; the gRPC services: --metrics-port), as pdmesh's own parser reads it."""
    args = parse_args(command, resolve=False)[2]
    port = args.port if command[0] == "gateway" else args.metrics_port
    assert port > 0, f"{command[0]}: no fixed metrics port in {command}"
    return port


def test_observability_files_parse():
    names = sorted(p.relative_to(OBS).as_posix() for p in OBS.rglob("*.y*ml"))
    assert names == ["grafana/provisioning/dashboards/pdmesh.yaml",
                     "grafana/provisioning/datasources/prometheus.yaml",
                     "otel-collector.yaml", "prometheus-k8s.yml", "prometheus.yml"]
    for name in names:
        assert isinstance(load_yaml(name), dict), name


def test_compose_profile_mounts_the_config():
    services = compose()["services"]
    assert OBSERVABILITY <= set(services)
    for name, svc in services.items():
        assert (svc.get("profiles") == ["observability"]) == (name in OBSERVABILITY), name
    images = {n: services[n]["image"].split(":")[0] for n in OBSERVABILITY}
    assert images == {"prometheus": "prom/prometheus", "grafana": "grafana/grafana",
                      "otel-collector": "otel/opentelemetry-collector-contrib"}
    mounted = {}
    for name in OBSERVABILITY:
        for dst, (src, read_only) in binds(services[name]).items():
            assert src.exists() and src.resolve().is_relative_to(OBS), (name, src)
            assert read_only, (name, dst)
            mounted[(name, dst)] = src.resolve()

    prom_conf = next(a.split("=", 1)[1] for a in services["prometheus"]["command"]
                     if a.startswith("--config.file="))
    assert mounted[("prometheus", prom_conf)] == OBS / "prometheus.yml"
    otel_conf = next(a.split("=", 1)[1] for a in services["otel-collector"]["command"]
                     if a.startswith("--config="))
    assert mounted[("otel-collector", otel_conf)] == OBS / "otel-collector.yaml"
    assert mounted[("grafana", "/etc/grafana/provisioning")] == OBS / "grafana/provisioning"
    # the dashboard provider reads the folder the dashboard is mounted into
    provider = load_yaml("grafana/provisioning/dashboards/pdmesh.yaml")["providers"][0]
    dash_dst = next(d for (n, d), src in mounted.items() if src == DASHBOARD)
    assert Path(dash_dst).parent == Path(provider["options"]["path"])
    env = services["grafana"]["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    # the datasource points at the compose Prometheus
    ds = load_yaml("grafana/provisioning/datasources/prometheus.yaml")["datasources"]
    assert [(d["type"], d["url"]) for d in ds] == [("prometheus", "http://prometheus:9090")]
    assert 9090 in container_ports(services["prometheus"])


def test_compose_scrape_targets_are_served():
    services = compose()["services"]
    served = {name: metrics_port(services[name]["command"]) for name in PDMESH_SERVICES}
    scraped: dict[str, int] = {}
    for job in load_yaml("prometheus.yml")["scrape_configs"]:
        assert job.get("metrics_path", "/metrics") == "/metrics", job["job_name"]
        assert job["honor_labels"] is True, job["job_name"]  # keep pdmesh's `instance`
        for static in job["static_configs"]:
            for target in static["targets"]:
                host, port = target.rsplit(":", 1)
                assert host in PDMESH_SERVICES, f"{target}: not a pdmesh compose service"
                assert int(port) == served[host], f"{target}: {host} serves {served[host]}"
                assert job["job_name"] == host  # the dashboard filters on job="gateway"
                scraped[host] = int(port)
    assert scraped == served  # every service scraped


def test_k8s_scrape_config_selects_the_metrics_ports():
    jobs = load_yaml("prometheus-k8s.yml")["scrape_configs"]
    assert len(jobs) == 1
    job = jobs[0]
    assert job["honor_labels"] is True
    assert [c["role"] for c in job["kubernetes_sd_configs"]] == ["pod"]
    relabel = job["relabel_configs"]
    keep = next(r for r in relabel if r["action"] == "keep" and r["source_labels"] == [
        "__meta_kubernetes_pod_label_app", "__meta_kubernetes_pod_container_port_name"])
    assert any(r.get("target_label") == "job" and r["source_labels"] ==
               ["__meta_kubernetes_pod_label_app"] for r in relabel)

    def kept(app: str, port_name: str) -> bool:  # Prometheus anchors relabel regexes
        return re.fullmatch(keep["regex"], f"{app};{port_name}") is not None

    for app in PDMESH_SERVICES:
        assert kept(app, "http" if app == "gateway" else "metrics"), app
        assert not kept(app, "grpc"), app
    assert not kept("redis", "redis")
    # every port it keeps in the manifests is the one the container serves metrics on
    docs = [doc for f in sorted((ROOT / "deploy/k8s/base").glob("*.yaml"))
            for doc in yaml.safe_load_all(f.read_text()) if doc]
    flags = next(d for d in docs if d["kind"] == "ConfigMap")["data"]
    env = {**flags, "POD_IP": "10.0.0.7", "DEVICE": "cpu"}
    found = set()
    for doc in docs:
        if doc["kind"] != "Deployment":
            continue
        app = doc["spec"]["template"]["metadata"]["labels"]["app"]
        container = doc["spec"]["template"]["spec"]["containers"][0]
        args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a)
                for a in container.get("args", [])]
        for port in container.get("ports", []):
            if kept(app, port["name"]):
                assert port["containerPort"] == metrics_port(args), app
                found.add(app)
    assert PDMESH_SERVICES <= found, PDMESH_SERVICES - found


def all_panels(panels: list[dict]) -> list[dict]:
    """Every panel, rows and the panels nested in (collapsed) rows included."""
    return [q for p in panels for q in [p, *all_panels(p.get("panels", []))]]


def test_dashboard_queries_exactly_the_exported_metrics():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["schemaVersion"] >= 36 and dash["uid"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    everything = all_panels(dash["panels"])
    ids = [p["id"] for p in everything]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    used: set[str] = set()
    for p in everything:
        if p["type"] == "row":  # a row only groups panels; it has no query
            continue
        title = p["title"]
        assert p["targets"], f"{title}: no query"
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, title
        for t in p["targets"]:
            assert t["datasource"]["uid"] == p["datasource"]["uid"] == "${datasource}"
            expr = t["expr"]
            assert expr.count("(") == expr.count(")"), f"{title}: {expr}"
            names = re.findall(r"\bpdmesh_[a-z0-9_]+", expr)
            assert names, f"{title}: {expr} queries no pdmesh metric"
            for name in names:
                used.add(exported_family(name, expr, title))
    assert not set(METRIC_NAMES) - used, "exported but on no panel"


def exported_family(name: str, expr: str, title: str) -> str:
    """The METRIC_NAMES entry ``name`` refers to; counters only under rate(), histogram
    buckets only under histogram_quantile(rate())."""
    if name in METRIC_NAMES:
        if name.endswith("_total"):
            assert re.search(rf"\b(i?rate|increase)\({name}\b", expr), f"{title}: {expr}"
        return name
    base = next((name.removesuffix(s) for s in HISTOGRAM_SUFFIXES if name.endswith(s)), "")
    assert base in METRIC_NAMES and not base.endswith("_total"), \
        f"{title}: {name} is not exported (pdmesh.shared.infra.metrics.METRIC_NAMES)"
    if name.endswith("_bucket"):
        assert "histogram_quantile(" in expr and re.search(rf"\brate\({name}\b", expr), \
            f"{title}: {expr}"
    return base


def test_otel_collector_takes_otlp_traces():
    conf = load_yaml("otel-collector.yaml")
    protocols = conf["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"].endswith(":4317")
    assert protocols["http"]["endpoint"].endswith(":4318")
    traces = conf["service"]["pipelines"]["traces"]
    assert "otlp" in traces["receivers"]
    assert "batch" in traces["processors"] and "batch" in conf["processors"]
    assert traces["exporters"] and set(traces["exporters"]) <= set(conf["exporters"])
    assert "debug" in traces["exporters"]
    assert {4317, 4318} <= container_ports(compose()["services"]["otel-collector"])
