"""`pdmesh bench kv-transfer`: what a prompt's KV costs to move through the Mooncake pool.

Starts a private ``mooncake_master`` and two engines on the model, each with its own pool
client, as a prefill and a decode instance have: the prefill engine computes a prompt
and puts its blocks (every cache group the model has: K and V, MLA's latent, or
DeepSeek-V4's compressed history and the tail of its sliding window); the decode engine
gets them and continues from its first token. Reports bytes and rate each way, per
prompt, and checks that decode's next token equals the prefill engine's own.
"""

from __future__ import annotations

import argparse
import statistics
import time


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8"))
    p.add_argument("--runs", type=int, default=3)


def run(a: argparse.Namespace) -> int:
    from pdmesh.shared.cli.bench.offline import workload
    from pdmesh.shared.engine.build import build_engine
    from pdmesh.shared.engine.config import EngineConfig
    from pdmesh.shared.engine.engine import EngineCore
    from pdmesh.shared.engine.sampling_params import SamplingParams
    from pdmesh.shared.kvpool.master import MasterPorts, MasterSupervisor
    from pdmesh.shared.kvpool.mooncake import MooncakePool
    from pdmesh.shared.models.tokenizer import Tokenizer

    prompts = workload(Tokenizer(a.model), a.runs, a.tokens)

    def engine(pool: MooncakePool, save: bool) -> EngineCore:
        return build_engine(EngineConfig(model=a.model, device="cpu", dtype=a.dtype,
                                         block_size=a.block_size, max_model_len=a.tokens + 64,
                                         kv_cache_dtype=a.kv_cache_dtype),
                            kv_pool=pool, save_prompts=save)

    sup = MasterSupervisor(MasterPorts("127.0.0.1", 0, 0, 0))
    sup.start()
    ports = sup.ports
    rows = []
    try:
        producer = MooncakePool(ports.master_address, ports.metadata_url,
                                segment_bytes=512 << 20)
        consumer = MooncakePool(ports.master_address, ports.metadata_url,
                                segment_bytes=64 << 20)
        try:
            prefill, decode = engine(producer, True), engine(consumer, False)
            for r, prompt in enumerate(prompts):
                two = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
                p_req = prefill.add_request(prompt, two, request_id=f"p{r}")
                t0 = time.perf_counter()
                while not p_req.output_token_ids:
                    prefill.step()
                ttft = time.perf_counter() - t0
                while not p_req.is_finished:
                    prefill.step()
                first, second = p_req.output_token_ids
                t0 = time.perf_counter()
                d_req = decode.add_request(prompt, two, request_id=f"d{r}",
                                           output_token_ids=[first])
                while not d_req.is_finished:
                    decode.step()
                handoff = time.perf_counter() - t0
                if d_req.output_token_ids != [first, second]:
                    raise RuntimeError(f"run {r}: decode continued with "
                                       f"{d_req.output_token_ids[1:]}, prefill with {[second]}")
                if not d_req.kv_get_bytes:
                    raise RuntimeError(f"run {r}: decode loaded nothing from the pool")
                put_s = p_req.kv_put_time[1] - p_req.kv_put_time[0]
                get_s = d_req.kv_get_time[1] - d_req.kv_get_time[0]
                rows.append((p_req.kv_put_bytes, put_s, d_req.kv_get_bytes, get_s, ttft,
                             handoff))
            per_token = prefill.kv_bytes_per_token
            groups = [g.name for g in prefill.cache_spec.groups]
        finally:
            consumer.close()
            producer.close()
    finally:
        sup.stop()
    put_b, get_b = rows[-1][0], rows[-1][2]
    print(f"{a.tokens}-token prompt, {a.dtype}, KV cache {a.kv_cache_dtype}, block size "
          f"{a.block_size}, cache groups "
          f"{', '.join(groups)}; KV bytes per token of history {per_token:,}")
    print(f"  put {put_b:,} bytes ({put_b / a.tokens:,.0f} per prompt token), median "
          f"{statistics.median(r[0] / r[1] for r in rows) / 1e9:.2f} GB/s")
    print(f"  get {get_b:,} bytes ({get_b / a.tokens:,.0f} per prompt token), median "
          f"{statistics.median(r[2] / r[3] for r in rows) / 1e9:.2f} GB/s; decode's next "
          f"token equals prefill's in {len(rows)}/{len(rows)} runs")
    print(f"  prefill TTFT median {statistics.median(r[4] for r in rows) * 1e3:.1f} ms; "
          f"decode's load + next token median {statistics.median(r[5] for r in rows) * 1e3:.1f} "
          f"ms")
    return 0
