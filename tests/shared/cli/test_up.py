"""`pdmesh up` end to end: the mesh comes up, serves, and Ctrl-C leaves no process."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pdmesh.shared.engine import LLM, SamplingParams
from tests.mesh import stop_all
from tests.processes import alive


def running_with(marker: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if marker in cmd:
                pids.append(int(proc.name))
    return pids


def launch(*args: str) -> tuple[subprocess.Popen, str | None, list[str]]:
    """`pdmesh ARGS...` (up or serve) in a session of its own; its URL once the mesh is
    ready (None if it never was) and what it printed until then."""
    proc = subprocess.Popen([sys.executable, "-m", "pdmesh", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out: list[str] = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        out.append(line)
        if m := re.search(r"mesh ready: (http://\S+)/v1", line):
            return proc, m.group(1), out
    return proc, None, out


def shut(proc: subprocess.Popen, prefix: str) -> None:
    """SIGTERM, then whatever is left of it (by its registry prefix) killed."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    finally:
        kill_all(proc, prefix)


@pytest.mark.parametrize("command,moe", [("up", False), ("serve", False), ("up", True)])
def test_up_serves_and_stops_cleanly(tiny_models, tmp_path, registry_prefix, command, moe):
    """`up`: the PD mesh; `serve`: one mixed instance behind the gateway; `up` on a MoE
    model adds the EPLB controller, here with a decode instance of two EP ranks."""
    model_path = tiny_models["qwen3_moe" if moe else "qwen3"]
    prefix = f"{registry_prefix}-{command}-{int(moe)}"
    extra = ["--decode-args", "--data-parallel-size 2 --enable-expert-parallel"] if moe else []
    proc, url, out = launch(command, str(model_path), "--port", "0", "--registry-prefix",
                            prefix, "--log-dir", str(tmp_path), "--engine-args",
                            "--device cpu --block-size 16 --pool-segment-mb 64", *extra)
    try:
        found = [m.group(1) for line in out
                 if (m := re.search(r"mooncake master ([\d.]+:\d+)", line))]
        master = found[0] if found else None
        assert url and (master or command == "serve"), "".join(out)
        assert moe == any("eplb controller ready" in line for line in out), "".join(out)
        model = str(model_path)  # the name as given, as vLLM serves it
        r = httpx.post(url + "/v1/completions", timeout=60,
                       json={"model": model, "prompt": [5, 6, 7, 8], "max_tokens": 8,
                             "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        secret = _per_run_secret(out)  # internals closed to other local processes
        assert secret.stat().st_mode & 0o777 == 0o600
        assert secret.parent.stat().st_mode & 0o777 == 0o700
        _refused_without_the_secret(prefix, "mixed" if command == "serve" else "decode")
        # overload is a 429: the gateway's bound, twice the decoding engines' slots (256
        # sequences each, default; two DP ranks in the MoE case)
        [gateway] = [cmd for pid in running_with(prefix)
                     if " gateway " in (cmd := _cmdline(pid))]
        assert f"--max-queued-requests {1024 if moe else 512} " in gateway + " ", gateway
        offline = LLM(str(model_path), device="cpu", block_size=16)
        expected = offline.generate([[5, 6, 7, 8]], SamplingParams(
            temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0].text
        assert r.json()["choices"][0]["text"] == expected
        # the gRPC edge processes of the engines (they carry no prefix on their command
        # line; each is a child of its engine process)
        ours = set(running_with(prefix))
        edges = [pid for pid in running_with("pdmesh.services.decode.edge")
                 if _parent(pid) in ours]
        assert edges, "no gRPC edge process found"
        proc.send_signal(signal.SIGINT)  # Ctrl-C, and a supervisor's SIGTERM right after:
        proc.send_signal(signal.SIGTERM)  # the second arrives while the first is handled
        proc.wait(60)
        assert running_with(prefix) == []  # every service it started is gone
        assert not secret.parent.exists()  # and the run's secret
        assert not [pid for pid in edges if alive(pid)]
        if master:
            host, port = master.split(":")
            with socket.socket() as s:  # and so is the Mooncake master
                assert s.connect_ex((host, int(port))) != 0
    finally:
        kill_all(proc, prefix)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _per_run_secret(out: list[str]) -> Path:
    found = [m.group(1) for line in out
             if (m := re.search(r"PDMESH_CLUSTER_SECRET_FILE=(\S+)", line))]
    assert found, "".join(out)
    return Path(found[0])


def _refused_without_the_secret(prefix: str, role: str) -> None:
    """An engine's internal gRPC answers a caller without the run's token with
    UNAUTHENTICATED."""
    import grpc

    from pdmesh.shared.infra.registry import Registry
    from pdmesh.shared.proto import common_pb2, decode_pb2_grpc

    inst = Registry("redis://127.0.0.1:6379/0", prefix).instances(role=role)[0]
    with grpc.insecure_channel(inst.address) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            decode_pb2_grpc.DecodeStub(channel).Health(common_pb2.HealthRequest(), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def kill_all(proc: subprocess.Popen, prefix: str) -> None:
    """Whatever is left of a launch: the launcher, and every process of its prefix."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for pid in running_with(prefix):
        subprocess.run(["kill", "-9", str(pid)], check=False)


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, ValueError):
        return -1


def test_serve_runs_a_vllm_serve_command_line(qwen3_path, tmp_path, registry_prefix):
    """`pdmesh serve` takes `vllm serve`'s flags as they are: underscores, several served
    names, --max_model_len enforced at the gateway, flags without effect accepted."""
    prefix = f"{registry_prefix}-serve-vllm"
    proc, url, out = launch("serve", str(qwen3_path), "--port", "0", "--max_model_len", "64",
                            "--served-model-name", "first", "second", "--block-size", "16",
                            "--device", "cpu", "--trust-remote-code", "--registry-prefix",
                            prefix, "--log-dir", str(tmp_path))
    try:
        assert url, "".join(out)
        models = httpx.get(url + "/v1/models", timeout=10).json()["data"]
        assert [m["id"] for m in models] == ["first", "second"]
        assert {m["max_model_len"] for m in models} == {64}
        for name in ("first", "second"):
            r = httpx.post(url + "/v1/completions", timeout=60, json={
                "model": name, "prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["model"] == name, r.text
        r = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": "first", "prompt": list(range(100, 170)), "max_tokens": 4})
        assert r.status_code == 400 and "max_model_len (64)" in r.text
        mixed_log = next(tmp_path.glob("mixed-*.log")).read_text()
        assert "without effect: --trust-remote-code" in mixed_log
    finally:
        shut(proc, prefix)


def test_ngram_speculation_serves_exactly_and_counts_its_drafts(qwen3_path, tmp_path,
                                                                registry_prefix):
    """--speculative-config with the ngram method takes effect on an instance behind the
    gateway: greedy answers, streamed or not, are the offline engine's without it, and
    the instance's /metrics count the drafts it verified (vLLM's spec_decode counters)."""
    from pdmesh.shared.infra.launcher import Service

    reg = ["--registry-prefix", registry_prefix + "-spec"]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
            "prompt_lookup_min": 1}
    started: list[Service] = []
    try:
        mixed = Service("mixed", ["mixed", str(qwen3_path), "--block-size", "16", "--device",
                                  "cpu", "--host", "127.0.0.1", "--port", "0",
                                  "--metrics-port", "0", "--speculative-config",
                                  json.dumps(spec), *reg], tmp_path)
        started.append(mixed)
        gateway = Service("gateway", ["gateway", str(qwen3_path), "--host", "127.0.0.1",
                                      "--port", "0", *reg], tmp_path)
        started.append(gateway)
        url = gateway.info["http"]
        prompt = [11, 12, 13, 14, 15] * 8
        want = LLM(str(qwen3_path), device="cpu", block_size=16).generate(
            [prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
        body = {"model": str(qwen3_path), "prompt": prompt, "max_tokens": 32,
                "temperature": 0, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", timeout=60, json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want[0].outputs[0].text
        text = ""
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={**body, "stream": True}) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        assert text == want[0].outputs[0].text
        assert "--speculative-config" not in mixed.log_path.read_text()
        lines = [line.rsplit(" ", 1) for line in
                 httpx.get(mixed.info["metrics"], timeout=10).text.splitlines()
                 if line.startswith("pdmesh_spec_decode_")]

        def total(family: str) -> float:
            return sum(float(v) for k, v in lines if k.split("{")[0] == family)

        drafted = total("pdmesh_spec_decode_num_draft_tokens_total")
        accepted = total("pdmesh_spec_decode_num_accepted_tokens_total")
        per_pos = total("pdmesh_spec_decode_num_accepted_tokens_per_pos_total")
        assert drafted > 0 and 0 < accepted <= drafted and per_pos == accepted
        lengths = [float(v) for k, v in lines
                   if k.split("{")[0] == "pdmesh_spec_decode_draft_length"]
        assert len(lengths) == 1 and 0 <= lengths[0] <= 3  # (the gauge: the last choice)
        # and the registry (`pdmesh status`) shows them, at the next heartbeat
        from pdmesh.shared.infra.registry import Registry

        registry = Registry("redis://127.0.0.1:6379/0", registry_prefix + "-spec")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            [inst] = registry.instances(role="mixed")
            if inst.load["spec_draft_tokens"] == drafted:
                break
            time.sleep(0.2)
        assert inst.load["spec_accepted_tokens"] == accepted
    finally:
        stop_all(started)


def test_vllm_pd_serve_lines_become_the_mesh_instances(qwen3_path, tmp_path,
                                                      registry_prefix):
    """The seeds' P and D lines (`vllm serve` with kv_role kv_producer / kv_consumer, no
    kvstore address) start a prefill and a decode instance of the mesh, which find the
    kvstore in the registry; the gateway, as the PD proxy, answers like the offline
    engine - the decode instance drafting with n-gram speculation (the seed's D line
    drafts with MTP), many prompts token-identical. A gateway flag on such a line is
    listed as without effect."""
    from pdmesh.shared.infra.launcher import Service
    from pdmesh.shared.infra.registry import Registry

    reg = ["--registry-prefix", registry_prefix + "-vllmpd"]
    seed = ["--enable-expert-parallel", "--seed", "1024", "--max-num-batched-tokens", "120",
            "--block-size", "16", "--trust-remote-code", "--device", "cpu",
            "--host", "127.0.0.1", "--port", "0", *reg]
    started: list[Service] = []
    try:
        started.append(Service("kvstore", ["kvstore", *reg], tmp_path))
        for role, kv_role, extra in (
                ("prefill", "kv_producer", ["--max-num-seqs", "16", "--enforce-eager"]),
                ("decode", "kv_consumer", ["--max-num-seqs", "60", "--no-enable-prefix-caching",
                                           "--stall-timeout", "30", "--speculative-config",
                                           '{"num_speculative_tokens": 3, "method": "ngram",'
                                           ' "prompt_lookup_min": 1}'])):
            transfer = {"kv_connector": "MooncakeHybridConnector", "kv_role": kv_role,
                        "kv_port": "30000", "engine_id": "0"}
            started.append(Service(role, ["serve", str(qwen3_path), *seed, *extra,
                                          "--kv-transfer-config", json.dumps(transfer)],
                                   tmp_path))
        prefill_log, decode_log = (s.log_path.read_text() for s in started[1:])
        assert "a prefill instance of the mesh" in prefill_log
        assert "a decode instance of the mesh" in decode_log
        assert "--stall-timeout: without effect on a decode instance" in decode_log
        gateway = Service("gateway", ["gateway", str(qwen3_path), "--host", "127.0.0.1",
                                      "--port", "0", *reg], tmp_path)
        started.append(gateway)
        prompts = [[5, 6, 7, 8, 9], *([20 + i, 30 + i, 40 + i] * 6 for i in range(5))]
        want = LLM(str(qwen3_path), device="cpu", block_size=16).generate(
            prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        for prompt, expected in zip(prompts, want, strict=True):
            r = httpx.post(gateway.info["http"] + "/v1/completions", timeout=60, json={
                "model": str(qwen3_path), "prompt": prompt, "max_tokens": 24,
                "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == expected.outputs[0].text, prompt
        registry = Registry("redis://127.0.0.1:6379/0", registry_prefix + "-vllmpd")
        deadline = time.monotonic() + 10  # the decode instance drafted (next heartbeat)
        while registry.instances(role="decode")[0].load["spec_draft_tokens"] == 0:
            assert time.monotonic() < deadline, "the decode instance never drafted"
            time.sleep(0.2)
        assert [i.address for i in registry.instances(role="prefill")] == [
            started[1].address]
        assert [i.address for i in registry.instances(role="decode")] == [started[2].address]
    finally:
        stop_all(started)


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v4"])
def test_mtp_speculation_across_the_pd_mesh(tiny_models, tmp_path, registry_prefix, arch):
    """DeepSeek PD instances with MTP on both sides, as the seed runs them: the prefill
    instance computes the MTP layer's KV over the prompt and puts it in the pool with the
    rest (DeepSeek-V4: the MTP block's window K=V in the window group's blocks); the
    decode instance continues from the pool (pool hits, its prompt not recomputed) and
    drafts with MTP (k = 2); the gateway's answers are the offline engine's, many
    prompts."""
    from pdmesh.shared.infra.launcher import Service
    from pdmesh.shared.infra.registry import Registry

    model = str(tiny_models[arch])
    prefix = f"{registry_prefix}-mtppd-{arch}"
    reg = ["--registry-prefix", prefix]
    spec = '{"num_speculative_tokens": 2, "method": "deepseek_mtp"}'
    common = ["--block-size", "16", "--device", "cpu", "--host", "127.0.0.1", "--port", "0",
              "--speculative-config", spec, *reg]
    started: list[Service] = []
    try:
        started.append(Service("kvstore", ["kvstore", *reg], tmp_path))
        for role in ("prefill", "decode"):
            started.append(Service(role, [role, model, *common, "--metrics-port", "0"],
                                   tmp_path))
        decode = started[2]
        gateway = Service("gateway", ["gateway", model, "--host", "127.0.0.1", "--port", "0",
                                      *reg], tmp_path)
        started.append(gateway)
        prompts = [[5, 6, 7, 8, 9] * 7, *([200 + 7 * i, 31 + i, 977 - i] * 12
                                          for i in range(6))]
        want = LLM(model, device="cpu", block_size=16).generate(
            prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
        for prompt, expected in zip(prompts, want, strict=True):
            r = httpx.post(gateway.info["http"] + "/v1/completions", timeout=60, json={
                "model": model, "prompt": prompt, "max_tokens": 20, "temperature": 0,
                "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == expected.outputs[0].text, prompt
        metrics = {k.split("{")[0]: float(v) for k, v in (
            line.rsplit(" ", 1) for line in
            httpx.get(decode.info["metrics"], timeout=10).text.splitlines()
            if line.startswith("pdmesh_"))}
        assert metrics["pdmesh_kv_pool_hits_total"] > 0  # prompts continued from the pool
        assert metrics["pdmesh_spec_decode_num_draft_tokens_total"] > 0
        registry = Registry("redis://127.0.0.1:6379/0", prefix)
        deadline = time.monotonic() + 10
        while registry.instances(role="decode")[0].load["spec_draft_tokens"] == 0:
            assert time.monotonic() < deadline, "the decode instance never drafted"
            time.sleep(0.2)
    finally:
        stop_all(started)


def test_up_restarts_what_dies_and_dies_with_its_children(qwen3_path, tmp_path,
                                                           registry_prefix):
    """A service of `pdmesh up` that dies is started again on its old ports and the mesh
    serves on (here the decode instance and the gateway, killed in turn); a `pdmesh up`
    killed with SIGKILL takes every process it started with it."""
    prefix = f"{registry_prefix}-supervise"
    proc, url, out = launch("up", str(qwen3_path), "--port", "0", "--registry-prefix",
                            prefix, "--log-dir", str(tmp_path), "--engine-args",
                            "--device cpu --block-size 16 --pool-segment-mb 64")
    lines: list[str] = []
    reader = None
    try:
        assert url, "".join(out)
        import threading

        reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")),
                                  daemon=True)
        reader.start()
        body = {"model": str(qwen3_path), "prompt": [5, 6, 7, 8], "max_tokens": 6,
                "temperature": 0, "ignore_eos": True}
        first = httpx.post(url + "/v1/completions", timeout=60, json=body).json()
        for role in ("decode", "gateway"):
            [pid] = [p for p in running_with(prefix) if _command(p).startswith(
                f"{sys.executable} -m pdmesh {role} ")]
            subprocess.run(["kill", "-9", str(pid)], check=True)
            deadline = time.monotonic() + 90
            while not any(f"[up] {role} restarted" in line for line in lines):
                assert proc.poll() is None, "".join(lines)  # up itself keeps running
                assert time.monotonic() < deadline, "".join(lines)
                time.sleep(0.2)
            deadline = time.monotonic() + 30
            while True:  # the same URL serves the same answer again
                try:
                    r = httpx.post(url + "/v1/completions", timeout=60, json=body)
                    if r.status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "".join(lines)
                time.sleep(0.5)
            assert r.json()["choices"][0]["text"] == first["choices"][0]["text"]
        children = running_with(prefix)
        assert len(children) >= 4
        proc.kill()  # SIGKILL: no chance to stop anything itself
        proc.wait(10)
        deadline = time.monotonic() + 20
        while [p for p in children if alive(p)] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [_command(p) for p in children if alive(p)] == []
    finally:
        kill_all(proc, prefix)


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_up_starts_its_own_redis_again_on_its_port(tmp_path):
    """The redis `pdmesh up` started itself (none listened) is started again on the same
    port when it dies, so every service's --redis-url stays right."""
    import redis as redis_client

    from pdmesh.shared.cli.up import MeshRedis
    from tests.processes import free_port

    own = MeshRedis(tmp_path, port=free_port())
    try:
        first = own.proc.pid
        client = redis_client.Redis.from_url(own.url, socket_timeout=3)
        assert client.ping()
        own.proc.kill()
        own.proc.wait(10)
        own.check()
        assert own.restarts == 1 and own.proc.pid != first and alive(own.proc.pid)
        assert client.ping()  # the same URL
        own.check()  # alive: nothing to do
        assert own.restarts == 1
    finally:
        own.stop()
    assert not alive(own.proc.pid)


def test_up_hands_the_serving_flags_to_its_gateway(qwen3_path, tmp_path, registry_prefix):
    """`pdmesh up --enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser
    qwen3 --structured-outputs-config ...`: the gateway reads the model's calls and
    reasoning (the engines accept the flags for it), with the official openai client; the
    forced text binds from the first token (enable_in_reasoning), reasoning included.
    `--lora-modules` reaches the engines and the gateway: a request naming the adapter
    (or SGLang's lora_path naming it, by name or folder) gets the offline engine's text
    with it, prefilled and decoded with it; /v1/models lists it under its base; an
    adapter nobody serves is a 400 naming lora_path."""
    import openai

    from pdmesh.shared.engine import LoRARequest
    from tests.shared.engine.lora_reference import make_adapters

    [adapter] = make_adapters(qwen3_path, tmp_path / "adapter", "qwen3", [(4, 8.0, False)], 2)
    prefix = f"{registry_prefix}-up-tools"
    proc, url, out = launch("up", str(qwen3_path), "--port", "0", "--registry-prefix",
                            prefix, "--log-dir", str(tmp_path), "--lora-modules",
                            f"sql={adapter}", "--max-lora-rank", "8",
                            "--enable-auto-tool-choice",
                            "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
                            "--structured-outputs-config", '{"enable_in_reasoning": true}',
                            "--log-requests", "--log-requests-level", "0",
                            "--engine-args", "--device cpu --block-size 16 "
                            "--pool-segment-mb 64")
    try:
        assert url, "".join(out)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        text = ('<think>\nthe user asks for the weather\n</think>\n\n<tool_call>\n'
                '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}}}}]
        r = client.chat.completions.create(
            model=str(qwen3_path), messages=[{"role": "user", "content": "weather?"}],
            tools=tools, max_tokens=200, temperature=0, extra_body={"guided_choice": [text]})
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls", msg
        assert msg.reasoning == "\nthe user asks for the weather\n"
        assert [(t.function.name, t.function.arguments) for t in msg.tool_calls] == [
            ("get_weather", '{"city": "Oslo"}')]
        # --log-requests (SGLang's spelling of vLLM's --enable-log-requests): the gateway
        # logs each finished request
        deadline = time.monotonic() + 10
        logged = ""
        while f"request {r.id} finished" not in logged and time.monotonic() < deadline:
            time.sleep(0.2)
            logged = "".join(p.read_text() for p in tmp_path.glob("gateway-*.log"))
        assert f"request {r.id} finished" in logged, logged[-2000:]
        cards = {m.id: m for m in client.models.list().data}
        assert cards["sql"].parent == str(qwen3_path) and cards["sql"].root == str(adapter)
        offline = LLM(str(qwen3_path), device="cpu", block_size=16, enable_lora=True,
                      max_lora_rank=8)
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        prompt = list(range(300, 331))
        expected = offline.generate([prompt], params, lora_request=LoRARequest(
            "sql", 1, str(adapter)))[0].outputs[0].text
        assert expected != offline.generate([prompt], params)[0].outputs[0].text
        for body in ({"model": "sql"}, {"model": str(qwen3_path), "lora_path": "sql"},
                     {"model": str(qwen3_path), "lora_path": str(adapter)}):
            got = client.completions.create(
                model=body["model"], prompt=prompt, max_tokens=8, temperature=0,
                extra_body={"ignore_eos": True, **({"lora_path": body["lora_path"]}
                                                   if "lora_path" in body else {})})
            assert got.choices[0].text == expected, body
        with pytest.raises(openai.BadRequestError, match="lora_path"):
            client.completions.create(model=str(qwen3_path), prompt=prompt, max_tokens=2,
                                      extra_body={"lora_path": "/not/here"})
    finally:
        shut(proc, prefix)


def test_a_headless_serve_line_runs_its_node_s_engine_ranks_without_a_gateway(
        tiny_models, tmp_path, registry_prefix):
    """The multi-node mixed recipe on loopback: the head node's `serve` line (rank 0 of
    two, expert-parallel) and the worker node's, with --data-parallel-start-rank 1
    --headless. The worker runs its `pdmesh mixed` rank alone - no gateway - which joins
    rank 0's group; the head's gateway answers as the offline engine does, over both
    ranks."""
    from pdmesh.shared.infra.launcher import Service
    from pdmesh.shared.infra.net import free_port
    from pdmesh.shared.infra.registry import Registry

    model = str(tiny_models["qwen3_moe"])
    prefix = f"{registry_prefix}-headless"
    line = [model, "--device", "cpu", "--block-size", "16", "--registry-prefix", prefix,
            "--redis-url", "redis://127.0.0.1:6379/0", "--enable-expert-parallel",
            "--data-parallel-size", "2", "--data-parallel-size-local", "1",
            "--data-parallel-address", "127.0.0.1",
            "--data-parallel-rpc-port", str(free_port("127.0.0.1"))]
    worker = Service("mixed", ["serve", *line, "--data-parallel-start-rank", "1",
                               "--headless"], tmp_path, wait=False)
    proc = None
    try:
        proc, url, out = launch("serve", *line, "--port", "0", "--log-dir", str(tmp_path))
        assert url, "".join(out)
        worker.wait_ready()
        assert "--headless: this node's engine ranks alone, no gateway" in \
            worker.log_path.read_text()
        registry = Registry("redis://127.0.0.1:6379/0", prefix)
        assert sorted(i.dp_rank for i in registry.instances("mixed")) == [0, 1]
        assert len(registry.instances("gateway")) == 1  # the head node's
        prompts = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45]]
        want = LLM(model, device="cpu", block_size=16).generate(
            prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        for prompt, expected in zip(prompts, want, strict=True):
            r = httpx.post(url + "/v1/completions", timeout=60, json={
                "model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == expected.outputs[0].text
    finally:
        if proc is not None:
            shut(proc, prefix)
        stop_all([worker])
