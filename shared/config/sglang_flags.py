"""SGLang's `launch_server` flags that the seeds list as supported on Ascend, beyond those
the flag table takes under their SGLang spelling (``--tp-size``, ``--mem-fraction-static``,
``--max-running-requests``, ``--page-size``, ``--context-length``, ``--disable-radix-cache``,
the decode graphs' ``--disable-cuda-graph``, ``--cuda-graph-bs``, ...,
``--enable-dp-attention`` and its companions, ``--is-embedding``, ``--schedule-policy``).

The rest are accepted so that an SGLang command line starts unchanged, and each one given
is said at start-up (and by `pdmesh config check`) to be without effect, with its reason:
(name, kind, aliases, why-kind, why). The why-kinds:

    ALWAYS     pdmesh always behaves as the flag asks (or its opposite cannot be had)
    OTHER      pdmesh does the same job its own way, named in the reason
    ABSENT     tied to hardware, a library or a model kind pdmesh does not have
    PLANNED    an open issue's
    COMPANION  read only with its switch

``scripts/sglang_flags.py`` counts them by why-kind (docs/serving.md).
"""

from __future__ import annotations

ALWAYS, OTHER, ABSENT, PLANNED, COMPANION = (
    "always so", "done another way", "not on this hardware or model", "planned",
    "read with its switch")

WITHOUT_EFFECT: tuple[tuple[str, str, tuple[str, ...], str, str], ...] = (
    ("--tokenizer-worker-num", "int", (), OTHER,
     "the gateway tokenizes on its own thread pool; run more gateways to add tokenizers"),
    ("--skip-tokenizer-init", "bool", (), OTHER,
     "the gateway renders chats and detokenizes every stream, so it loads the tokenizer; prompts "
     "given as token ids are not re-tokenized"),
    ("--enable-multimodal", "bool", (), ABSENT,
     "pdmesh serves text models"),
    ("--model-impl", "str", (), OTHER,
     "pdmesh runs its own model code (shared/models) for every architecture it loads"),
    ("--skip-server-warmup", "bool", (), ALWAYS,
     "every engine warms up before it registers (its step costs are measured: routing reads them),"
     " so nothing is left to skip or repeat"),
    ("--warmups", "str", (), ALWAYS,
     "every engine warms up before it registers (its step costs are measured: routing reads them)"),
    ("--nccl-port", "int", (), OTHER,
     "ranks meet on --data-parallel-rpc-port (a free port when not given)"),
    ("--prefill-max-requests", "int", (), OTHER,
     "a step's prompts are bounded by --max-num-batched-tokens and --max-num-seqs"),
    ("--schedule-conservativeness", "float", (), OTHER,
     "requests are admitted while KV blocks are free and preempted (recomputed) when decoding runs"
     " out, as vLLM does; no reservation is kept to scale"),
    ("--stream-output", "bool", (), ALWAYS,
     "OpenAI streams carry disjoint deltas; pdmesh serves no /generate"),
    ("--watchdog-timeout", "float", (), OTHER,
     "a stalled engine (no step for --stall-timeout at the gateway) is taken out of routing and "
     "its streams moved, not killed"),
    ("--soft-watchdog-timeout", "float", (), OTHER,
     "a stalled engine (no step for --stall-timeout at the gateway) is taken out of routing and "
     "its streams moved"),
    ("--base-gpu-id", "int", (), OTHER,
     "devices are chosen by ASCEND_RT_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES; each rank takes the "
     "next"),
    ("--gpu-id-step", "int", (), OTHER,
     "devices are chosen by ASCEND_RT_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES; each rank takes the "
     "next"),
    ("--sleep-on-idle", "bool", (), ALWAYS,
     "an idle engine blocks on its socket; it does not spin"),
    ("--log-level-http", "str", (), OTHER,
     "the gateway writes no access log; --enable-log-requests logs each request"),
    ("--weight-version", "str", (), OTHER,
     "a label for reinforcement-learning weight updates; an instance serves the checkpoint it "
     "loaded"),
    ("--completion-template", "str", (), OTHER,
     "code-completion (FIM) templates: /v1/completions sends the prompt as given"),
    ("--enable-cache-report", "bool", (), ALWAYS,
     "usage.prompt_tokens_details.cached_tokens is in every answer"),
    ("--load-balance-method", "str", (), OTHER,
     "the gateway routes over instances and DP ranks by estimated TTFT (prefill) and KV use "
     "(decode)"),
    ("--prefill-round-robin-balance", "bool", (), OTHER,
     "the gateway routes prompts by estimated TTFT, cached prefixes counted"),
    ("--lora-target-modules", "names", (), OTHER,
     "each adapter runs on the modules it targets (its adapter_config.json)"),
    ("--lora-eviction-policy", "str", (), OTHER,
     "adapters leave the device slots and host memory least recently used first (lru)"),
    ("--lora-backend", "str", (), OTHER,
     "a step's rows run grouped by adapter, one batched shrink and expand per projection "
     "(KernelBackend.lora_shrink_expand, SGMV-style)"),
    ("--max-lora-chunk-size", "int", (), OTHER,
     "a step's rows run grouped by adapter, one batched shrink and expand per projection "
     "(no chunks)"),
    ("--attention-backend", "str", (), OTHER,
     "pdmesh picks its kernels by device (shared/kernels: torch_npu's fused attention on npu, "
     "FlashAttention-style kernels on cuda, its own on cpu)"),
    ("--prefill-attention-backend", "str", (), OTHER,
     "pdmesh picks its kernels by device (shared/kernels)"),
    ("--decode-attention-backend", "str", (), OTHER,
     "pdmesh picks its kernels by device (shared/kernels)"),
    ("--sampling-backend", "str", (), OTHER,
     "pdmesh samples with its own sampler (shared/engine/sampler.py)"),
    ("--grammar-backend", "str", (), OTHER,
     "every grammar is compiled with llguidance"),
    ("--mm-attention-backend", "str", (), ABSENT,
     "pdmesh serves text models"),
    ("--speculative-eagle-topk", "int", (), OTHER,
     "drafts are chains (top-1), not trees"),
    ("--speculative-accept-threshold-single", "float", (), OTHER,
     "drafts are verified by rejection sampling (or vLLM-Ascend's rejection_sampler_config)"),
    ("--speculative-accept-threshold-acc", "float", (), OTHER,
     "drafts are verified by rejection sampling (or vLLM-Ascend's rejection_sampler_config)"),
    ("--speculative-attention-mode", "str", (), OTHER,
     "the draft runs the target's kernels"),
    ("--speculative-moe-runner-backend", "str", (), ABSENT,
     "the MoE runner backends are CUDA / Ascend libraries pdmesh does not bind; its MoE is its own"
     " kernels"),
    ("--speculative-moe-a2a-backend", "str", (), ABSENT,
     "DeepEP / Mooncake all-to-all libraries are not bound; the MoE exchange is an all-to-all over"
     " the process group"),
    ("--moe-a2a-backend", "str", (), ABSENT,
     "DeepEP / Mooncake all-to-all libraries are not bound; the MoE exchange is an all-to-all over"
     " the process group (HCCL, NCCL, gloo)"),
    ("--moe-runner-backend", "str", (), ABSENT,
     "the MoE runner backends are CUDA / Ascend libraries pdmesh does not bind; its MoE is its own"
     " kernels"),
    ("--deepep-mode", "str", (), ABSENT,
     "DeepEP is not bound; the MoE exchange is an all-to-all over the process group"),
    ("--hicache-io-backend", "str", (), OTHER,
     "the KV tiers copy whole blocks with torch's index_select / index_copy_ on every device "
     "(docs/kv-tiers.md)"),
    ("--hicache-mem-layout", "str", (), OTHER,
     "the host tier keeps each cache tensor's blocks apart (layer_first)"),
    ("--radix-eviction-policy", "str", (), OTHER,
     "the prefix cache evicts the least recently freed block first (lru)"),
    ("--enable-tokenizer-batch-encode", "bool", (), OTHER,
     "the gateway tokenizes each prompt on its thread pool"),
    ("--disable-outlines-disk-cache", "bool", (), OTHER,
     "every grammar is compiled with llguidance (no outlines)"),
    ("--disable-overlap-schedule", "bool", (), ALWAYS,
     "the engine schedules between its steps, never overlapped with one"),
    ("--enable-mixed-chunk", "bool", (), ALWAYS,
     "a step mixes prompt chunks with decoding rows"),
    ("--enable-torch-compile", "bool", (), ABSENT,
     "on cpu torch.compile measured slower than eager (docs/benchmarks.md, issue 42); on cuda and "
     "npu the decode graphs capture the step"),
    ("--enable-torch-compile-debug-mode", "bool", (), ABSENT,
     "no torch.compile (see --enable-torch-compile)"),
    ("--piecewise-cuda-graph-max-tokens", "int", (), OTHER,
     "decode graphs capture decode steps only (--compilation-config's sizes)"),
    ("--enable-dynamic-batch-tokenizer", "bool", (), OTHER,
     "the gateway tokenizes each prompt on its thread pool"),
    ("--dynamic-batch-tokenizer-batch-size", "int", (), OTHER,
     "the gateway tokenizes each prompt on its thread pool"),
    ("--dynamic-batch-tokenizer-batch-timeout", "float", (), OTHER,
     "the gateway tokenizes each prompt on its thread pool"),
    ("--num-reserved-decode-tokens", "int", (), OTHER,
     "a decode instance takes blocks as tokens come and preempts (or hands back, with the "
     "recompute scheduler) when it runs out"),
    ("--disaggregation-decode-polling-interval", "int", (), OTHER,
     "a decode instance is handed each prefilled request by the gateway; nothing polls"),
    ("--weight-loader-disable-mmap", "bool", (), OTHER,
     "weights are read with safetensors' safe_open, tensor by tensor"),
)


def reasons() -> dict[str, str]:
    """Every spelling of each flag here -> why it is without effect."""
    return {name: why for spec in WITHOUT_EFFECT for name in (spec[0], *spec[2])
            for why in (spec[4],)}
