"""`pdmesh` command line: make-tiny-model, generate, bench, kvstore, prefill, decode,
config check."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import asdict


def _make_tiny_model(a: argparse.Namespace) -> int:
    from shared.models.tiny import make_tiny_model

    out = make_tiny_model(a.out, a.arch, seed=a.seed, size=a.size)
    print(f"wrote {a.size} {a.arch} model (seed {a.seed}) to {out}")
    return 0


def _generate(a: argparse.Namespace) -> int:
    import time

    from shared.engine import LLM, SamplingParams
    from shared.engine.args import engine_config_from_args

    t0 = time.perf_counter()
    llm = LLM(**asdict(engine_config_from_args(a)))
    ready = time.perf_counter() - t0
    params = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                            max_tokens=a.max_tokens, seed=a.sampling_seed)
    prompts = a.prompt or ["Hello"]
    if a.chat:
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}])
                   for p in prompts]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    took = time.perf_counter() - t0
    ntok = sum(len(o.outputs[0].token_ids) for o in outs)
    for o in outs:
        c = o.outputs[0]
        print(f"--- prompt: {o.prompt!r}\n{c.text!r}\n[{len(c.token_ids)} tokens, "
              f"finish_reason={c.finish_reason}]")
    print(f"engine ready in {ready:.2f}s on {llm.engine.device}; {ntok} tokens in "
          f"{took:.2f}s ({ntok / took:.0f} tok/s)")
    return 0


def _bench_offline(a: argparse.Namespace) -> int:
    from shared.bench.offline import run_offline_bench

    return run_offline_bench(a)


def _kvstore(a: argparse.Namespace) -> int:
    from services.kvstore.main import run

    return run(a)


def _prefill(a: argparse.Namespace) -> int:
    from services.prefill.main import run

    return run(a)


def _decode(a: argparse.Namespace) -> int:
    from services.decode.main import run

    return run(a)


def _gateway(a: argparse.Namespace) -> int:
    from services.gateway.main import run

    return run(a)


def _up(a: argparse.Namespace) -> int:
    from shared.up import run

    return run(a)


def _health(a: argparse.Namespace) -> int:
    from shared.health import run

    return run(a)


def _mixed(a: argparse.Namespace) -> int:
    from services.decode.main import run

    return run(a, role="mixed")


def _serve(a: argparse.Namespace) -> int:
    from shared.up import run

    return run(a, mixed=True)


def _config_check(a: argparse.Namespace) -> int:
    from shared.config.check import run

    return run(a)


def _bench_serve(a: argparse.Namespace) -> int:
    from shared.bench.serve import run

    return run(a)


def _bench_kv_transfer(a: argparse.Namespace) -> int:
    from shared.bench.kv_transfer import run

    return run(a)


def build_parser() -> argparse.ArgumentParser:
    from shared.engine.args import add_engine_args
    from shared.models.tiny import ARCHS, SIZES

    p = argparse.ArgumentParser(prog="pdmesh", description=__doc__)
    p.add_argument("--log-level", default="WARNING")
    sub = p.add_subparsers(dest="command", required=True)

    m = sub.add_parser("make-tiny-model", help="write a random model + locally trained tokenizer")
    m.add_argument("out")
    m.add_argument("--arch", choices=list(ARCHS), default="qwen3")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--size", choices=list(SIZES), default="tiny")
    m.set_defaults(func=_make_tiny_model)

    g = sub.add_parser("generate", help="offline generation with the engine")
    add_engine_args(g)
    g.add_argument("--prompt", action="append", help="repeat for a batch")
    g.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.set_defaults(func=_generate)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    off = bsub.add_parser("offline", help="batch and single-request throughput vs transformers")
    add_engine_args(off)
    off.add_argument("--num-prompts", type=int, default=32)
    off.add_argument("--input-len", type=int, default=128)
    off.add_argument("--output-len", type=int, default=128)
    off.add_argument("--runs", type=int, default=3)
    off.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    off.add_argument("--json", default=None, help="also write the figures here")
    off.set_defaults(func=_bench_offline)
    srv = bsub.add_parser("serve", help="load an OpenAI endpoint like `vllm bench serve`")
    from shared.bench.serve import add_args as add_serve_args

    add_serve_args(srv)
    srv.set_defaults(func=_bench_serve)
    kvx = bsub.add_parser("kv-transfer", help="KV put/get throughput through the pool")
    from shared.bench.kv_transfer import add_args as add_kvx_args

    add_kvx_args(kvx)
    kvx.set_defaults(func=_bench_kv_transfer)
    k = sub.add_parser("kvstore", help="the KV pool service: Mooncake master + pool index")
    from services.kvstore.main import add_args as add_kvstore_args

    add_kvstore_args(k)
    k.set_defaults(func=_kvstore)

    from shared.worker import add_worker_args

    pf = sub.add_parser("prefill", help="a prefill instance (gRPC)")
    add_worker_args(pf)
    pf.set_defaults(func=_prefill)
    dc = sub.add_parser("decode", help="a decode instance (gRPC, streaming)")
    add_worker_args(dc)
    dc.set_defaults(func=_decode)
    mx = sub.add_parser("mixed", help="a mixed prefill+decode instance (gRPC, no KV pool)")
    add_worker_args(mx)
    mx.set_defaults(func=_mixed)

    gw = sub.add_parser("gateway", help="the OpenAI-compatible HTTP gateway")
    from services.gateway.main import add_args as add_gateway_args

    add_gateway_args(gw)
    gw.set_defaults(func=_gateway)

    u = sub.add_parser("up", help="the whole mesh as local processes")
    from shared.up import add_args as add_up_args

    add_up_args(u)
    u.set_defaults(func=_up)
    sv = sub.add_parser("serve", help="one mixed instance behind the gateway (single box)")
    add_up_args(sv)
    sv.set_defaults(func=_serve)

    h = sub.add_parser("health", help="probe a service (for healthchecks)")
    from shared.health import add_args as add_health_args

    add_health_args(h)
    h.set_defaults(func=_health)

    c = sub.add_parser("config", help="configuration tools")
    csub = c.add_subparsers(dest="config", required=True)
    chk = csub.add_parser("check", help="print the effective --additional-config or its errors")
    from shared.config.check import add_args as add_check_args

    add_check_args(chk)
    chk.set_defaults(func=_config_check)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, ConnectionError) as e:
        print(f"pdmesh: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
