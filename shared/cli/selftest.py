"""`pdmesh selftest [--device DEVICE]`: what a user with new hardware runs first (issue 42).

Each kernel op of the device's backend on small cases against the plain reference on the
host (``kernels.reference``), in float32 and the half dtypes; then, unless ``--no-e2e``, a
tiny model (``make-tiny-model``, random, seed 0) served end to end by `pdmesh up` on the
device - a prefill and a decode instance, the KV through the pool - its greedy answers
against the engine's on the host; and on a device with graphs (cuda, npu), its decode from
captured graphs against its eager decode. Prints a table a bug report can carry (and
writes it as JSON with ``--json``); exit status 1 when a case fails or errs.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pdmesh.shared.infra.launcher import stop_group
from pdmesh.shared.kernels import AttentionMetadata, get_backend, resolve_device
from pdmesh.shared.kernels import reference as ref

TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 4e-3}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# the sampler's ops run on float32 logits (a half dtype's rounding would move top-p's edge)
FLOAT32_ONLY = {"top_k_top_p"}


@dataclass
class Row:
    case: str
    dtype: str
    status: str  # ok, FAIL, ERROR
    max_err: float | None = None
    tol: float | None = None
    detail: str = ""


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda", "npu"))
    p.add_argument("--dtypes", default="float32,bfloat16,float16",
                   help="the kernel cases' dtypes, comma-separated")
    p.add_argument("--no-e2e", action="store_true", help="the kernel cases only")
    p.add_argument("--json", default=None, help="write the table here as JSON too")


# -- the kernel cases -------------------------------------------------------------------
def _on(meta: AttentionMetadata, dev: torch.device) -> AttentionMetadata:
    import dataclasses

    return dataclasses.replace(meta, **{f.name: getattr(meta, f.name).to(dev)
                                        for f in dataclasses.fields(meta)
                                        if isinstance(getattr(meta, f.name), torch.Tensor)})


def _attention(backend, dtype, ctx, new, bs, g) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v, kc, vc, meta = ref.paged_batch(ctx, new, bs, dtype=dtype, generator=g)
    dev = backend.device
    kc_d, vc_d, m = kc.to(dev), vc.to(dev), _on(meta, dev)
    backend.prepare_attention(m)
    backend.write_kv_cache(k.to(dev), v.to(dev), kc_d, vc_d, m.slot_mapping)
    scale = q.shape[-1] ** -0.5
    if all(n == 1 for n in new):
        got = backend.paged_attention_decode(q.to(dev), kc_d, vc_d, m, scale)
    else:
        got = backend.paged_attention_prefill(q.to(dev), k.to(dev), v.to(dev), kc_d, vc_d, m,
                                              scale)
    flat_k, flat_v = kc.view(-1, *kc.shape[2:]), vc.view(-1, *vc.shape[2:])
    flat_k[meta.slot_mapping], flat_v[meta.slot_mapping] = k, v
    return got, ref.paged_attention(q, kc, vc, meta, scale)


def _cases() -> dict[str, Callable]:
    """case -> fn(backend, dtype, generator) -> (got, expected)."""
    def rms(b, dt, g):
        x, w = torch.randn(7, 256, generator=g).to(dt), (1 + torch.randn(256, generator=g)
                                                         / 10).to(dt)
        return b.rms_norm(x.to(b.device), w.to(b.device), 1e-6), ref.rms_norm(x, w, 1e-6)

    def add_rms(b, dt, g):
        x, r = (torch.randn(7, 256, generator=g).to(dt) for _ in range(2))
        w = (1 + torch.randn(256, generator=g) / 10).to(dt)
        y, s = b.add_rms_norm(x.to(b.device), r.to(b.device), w.to(b.device), 1e-6)
        return torch.cat((y.cpu(), s.cpu())), torch.cat((ref.rms_norm(x + r, w, 1e-6), x + r))

    def rotary(b, dt, g):
        x = torch.randn(6, 10, 64, generator=g).to(dt)
        emb = torch.rand(6, 32, generator=g) * 6
        cos, sin = torch.cat((emb, emb), -1).cos(), torch.cat((emb, emb), -1).sin()
        c, s = b.rotary_tables(cos.to(b.device), sin.to(b.device))
        return b.rotary_embedding(x.to(b.device), c, s), ref.rotary(x, cos, sin)

    def swiglu(b, dt, g):
        x = torch.randn(9, 256, generator=g).to(dt)
        return b.silu_and_mul(x.clone().to(b.device)), ref.silu_and_mul(x)

    def gating(b, dt, g):
        logits = torch.randn(12, 16, generator=g).to(dt)
        w, ids = b.moe_gating_topk(logits.to(b.device), 4, True)
        probs = logits.float().softmax(-1)
        top = probs.topk(4, -1)
        want = top.values / top.values.sum(-1, keepdim=True)
        same = torch.equal(ids.cpu().sort(-1).values, top.indices.sort(-1).values)
        return (w.cpu().float().sort(-1).values if same else w.cpu().float() * float("nan"),
                want.sort(-1).values)

    def gmm(b, dt, g):
        sizes = [3, 0, 5, 2]
        x = torch.randn(10, 64, generator=g).to(dt)
        w = (torch.randn(4, 64, 32, generator=g) / 8).to(dt)
        want = torch.cat([x[s:s + n].float() @ w[e].float() for e, (s, n) in
                          enumerate(zip([0, 3, 3, 8], sizes, strict=True))])
        return b.grouped_matmul(x.to(b.device), w.to(b.device), sizes), want

    def int8(b, dt, g):
        x = torch.randn(5, 64, generator=g).to(dt)
        qw, s = ref.quantize_per_channel(torch.randn(64, 48, generator=g) / 20)
        seen = x.to(torch.bfloat16) if b.name == "npu" and dt == torch.float32 else x
        return b.int8_linear(x.to(b.device), qw.to(b.device), s.to(b.device)), \
            ref.int8_linear(seen, qw, s)

    def topkp(b, dt, g):
        logits = torch.randn(4, 300, generator=g).to(dt)
        k, p = [5, 300, 40, 1], [0.9, 0.5, 1.0, 0.7]
        got = b.top_k_top_p(logits.to(b.device), torch.tensor(k).to(b.device),
                            torch.tensor(p).to(b.device))
        want = ref.top_k_top_p(logits, k, p)
        return got.isfinite().float(), want.isfinite().float()  # (which tokens stay)

    return {
        "rms_norm": rms, "add_rms_norm": add_rms, "rotary_embedding": rotary,
        "silu_and_mul": swiglu, "moe_gating_topk": gating, "grouped_matmul": gmm,
        "int8_linear (W8A8 dynamic)": int8, "top_k_top_p": topkp,
        "attention prefill (fresh)": lambda b, dt, g: _attention(b, dt, [0, 0], [7, 19], 128,
                                                                 g),
        "attention prefill (context)": lambda b, dt, g: _attention(b, dt, [130, 5], [9, 4],
                                                                   128, g),
        "attention decode": lambda b, dt, g: _attention(b, dt, [40, 150, 7], [1, 1, 1], 128,
                                                        g),
    }


def kernel_rows(device: str, dtypes: list[torch.dtype]) -> list[Row]:
    backend = get_backend(device)
    rows = []
    for name, case in _cases().items():
        for dt in dtypes:
            if name in FLOAT32_ONLY and dt != torch.float32:
                continue
            label = str(dt).removeprefix("torch.")
            tol = TOL[dt] if not (name.startswith("int8") and dt == torch.float32) \
                else TOL[torch.bfloat16]
            try:
                got, want = case(backend, dt, torch.Generator().manual_seed(7))
                err = float((got.cpu().double() - want.double()).abs().max()) if \
                    got.numel() else 0.0
                scale = float(want.double().abs().max()) if want.numel() else 1.0
                ok = err == err and err <= tol * max(1.0, scale)  # (nan: not ok)
                rows.append(Row(name, label, "ok" if ok else "FAIL", err, tol))
            except Exception as e:  # noqa: BLE001 - every failure goes in the table
                where = traceback.extract_tb(e.__traceback__)[-1]
                rows.append(Row(name, label, "ERROR", detail=f"{type(e).__name__}: {e} "
                                f"({Path(where.filename).name}:{where.lineno})"))
    return rows


# -- end to end --------------------------------------------------------------------------
PROMPTS = ["def fibonacci(n):", "The capital of France is"]


def e2e_rows(device: str, workdir: Path) -> list[Row]:
    """A tiny model through `pdmesh up` on ``device``: its greedy answers against the
    engine's own on the host (float32 both)."""
    from pdmesh.shared.engine import LLM, SamplingParams
    from pdmesh.shared.models.tiny import make_tiny_model

    model = make_tiny_model(workdir / "tiny-qwen3", "qwen3", seed=0)
    offline = LLM(str(model), device="cpu", dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].text for o in offline.generate(PROMPTS, params)]
    del offline
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdmesh", "up", str(model), "--port", "0", "--host",
         "127.0.0.1", "--served-model-name", "tiny", "--registry-prefix",
         f"selftest-{uuid.uuid4().hex[:8]}", "--log-dir", str(workdir / "logs"),
         "--engine-args", f"--device {device} --dtype float32"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        url, seen = None, []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and url is None:
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            if m := re.search(r"mesh ready: (http://\S+)/v1", line):
                url = m.group(1)
        if url is None:
            return [Row("pd end to end", "float32", "ERROR",
                        detail="pdmesh up never came up: " + "".join(seen[-5:]).strip())]
        return [_ask(url, i, prompt, text) for i, (prompt, text) in
                enumerate(zip(PROMPTS, want, strict=True))]
    finally:
        stop_group(proc, signal.SIGINT)


def _ask(url: str, i: int, prompt: str, want: str) -> Row:
    import httpx

    try:
        r = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0,
            "ignore_eos": True})
        got = r.json()["choices"][0]["text"] if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError) as e:
        return Row(f"pd end to end, prompt {i}", "float32", "ERROR", detail=repr(e))
    if got is None:
        return Row(f"pd end to end, prompt {i}", "float32", "ERROR",
                   detail=f"HTTP {r.status_code}: {r.text[:200]}")
    return Row(f"pd end to end, prompt {i}", "float32", "ok" if got == want else "FAIL",
               detail="greedy text as on the host" if got == want else
               f"got {got!r}, the host's engine {want!r}")


def graph_rows(device: str, workdir: Path) -> list[Row]:
    """Decode from the device's graphs (CUDA graphs, ACL graphs) against its eager
    decode: the same greedy tokens, every step of 1-4 sequences replayed, nothing turned
    down. None on a device without graphs (cpu)."""
    from pdmesh.shared.engine import LLM, SamplingParams
    from pdmesh.shared.engine.decode_graphs import GraphDevice
    from pdmesh.shared.models.tiny import make_tiny_model

    if GraphDevice.of(torch.device(device)) is None:
        return []
    model = workdir / "tiny-qwen3"
    if not (model / "config.json").exists():
        make_tiny_model(model, "qwen3", seed=0)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = PROMPTS + [p + " and" for p in PROMPTS[:1]]  # 3 sequences: padded to 4
    try:
        eager = LLM(str(model), device=device, dtype="float32", enforce_eager=True)
        want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
        del eager
        llm = LLM(str(model), device=device, dtype="float32",
                  compilation_config={"cudagraph_capture_sizes": [1, 2, 4]})
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    except Exception as e:  # noqa: BLE001 (reported, as a kernel case's error is)
        return [Row("decode graphs", "float32", "ERROR", detail=f"{type(e).__name__}: {e}")]
    graphs = llm.engine.runner.graphs
    if graphs is None or graphs.disabled is not None or not graphs.replays:
        why = "no graphs were built" if graphs is None else graphs.disabled or "none replayed"
        return [Row("decode graphs", "float32", "FAIL", detail=why)]
    return [Row("decode graphs", "float32", "ok" if got == want else "FAIL",
                detail=f"{graphs.replays} steps replayed (sizes {graphs.sizes}), greedy "
                       "tokens as eager" if got == want else
                       f"got {got}, eagerly {want}")]


# -- the report --------------------------------------------------------------------------
def environment(device: str) -> dict[str, str]:
    from importlib import metadata

    env = {"pdmesh": metadata.version("pdmesh"), "python": platform.python_version(),
           "torch": torch.__version__, "machine": platform.machine(), "device": device}
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name(0)
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        env["cuda"] = str(torch.version.cuda)
    if device == "npu":
        import torch_npu

        env["torch_npu"] = getattr(torch_npu, "__version__", "?")
        env["npu"] = torch.npu.get_device_name(0)
    return env


def run(a: argparse.Namespace) -> int:
    device = resolve_device(a.device)
    try:
        dtypes = [DTYPES[d.strip()] for d in a.dtypes.split(",") if d.strip()]
    except KeyError as e:
        raise SystemExit(f"--dtypes: {e.args[0]!r} is not one of {', '.join(DTYPES)}") from None
    env = environment(device)
    rows = kernel_rows(device, dtypes)
    if not a.no_e2e:
        with tempfile.TemporaryDirectory(prefix="pdmesh-selftest-") as tmp:
            rows += e2e_rows(device, Path(tmp))
            rows += graph_rows(device, Path(tmp))
    print("pdmesh selftest: " + ", ".join(f"{k} {v}" for k, v in env.items()))
    print(f"{'case':30} {'dtype':9} {'status':6} {'max err':>10} {'tol':>8}  detail")
    for r in rows:
        err = "" if r.max_err is None else f"{r.max_err:.2e}"
        tol = "" if r.tol is None else f"{r.tol:.0e}"
        print(f"{r.case:30} {r.dtype:9} {r.status:6} {err:>10} {tol:>8}  {r.detail}")
    bad = [r for r in rows if r.status != "ok"]
    print(f"{len(rows) - len(bad)} of {len(rows)} ok" + (f"; {len(bad)} not" if bad else ""))
    if a.json:
        Path(a.json).write_text(json.dumps({"environment": env,
                                            "rows": [asdict(r) for r in rows]}, indent=1))
    return 1 if bad else 0
