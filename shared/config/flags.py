"""Every flag pdmesh's services and engine commands take, declared once.

Spelled as ``vllm serve`` spells them, with SGLang's spelling as an alias where the
seeds list one (``--tp-size``, ``--context-length``, ``--model-path``, ...). Each flag
names the commands that take it; ``effect`` names those where it does something (the
rest accept it, so a vLLM command line starts unchanged, and list it at start-up). One
parser (``shared.config.parse_flags``) reads every command from this table, and one
function (``shared.config.serve.serve_config``) turns what it read into the config a
service runs - for the services, `pdmesh up`, `pdmesh serve` and `pdmesh config check`
alike.

    kind   "bool" (no value; --no-X sets False), "int", "float", "str", "json" (an object),
           "names" (one or more words), "list" (repeatable, one value each time)

An engine flag that fills an EngineConfig field takes that field's default
(``ENGINE_DEFAULT``): EngineConfig is the one home of the engine's defaults, which the
offline ``LLM`` takes as they are. (Serving on CPU, ``serving_defaults`` in
``engine_config.py`` lowers --max-num-batched-tokens, as vllm serve does.)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import MISSING, dataclass, fields
from typing import Any

from pdmesh.shared.config.sglang_flags import WITHOUT_EFFECT
from pdmesh.shared.engine.config import EngineConfig

ENGINES = frozenset({"prefill", "decode", "mixed"})
SERVICES = ENGINES | {"gateway", "kvstore", "eplb"}
LAUNCHERS = frozenset({"up", "serve"})  # start the mesh; `serve` takes vllm serve's flags
ENGINE_TOOLS = frozenset({"generate", "bench offline"})  # run the engine offline
CHECK = frozenset({"config check"})
ALL = SERVICES | LAUNCHERS | ENGINE_TOOLS | CHECK
# every command an engine's flags reach: the engines, `serve` (its mixed instance) and
# `config check` (it checks what an engine would run)
ENGINE_LINE = ENGINES | {"serve"} | CHECK

DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
# EngineConfig's field defaults, by field name: the engine flags' defaults
ENGINE_DEFAULT = {f.name: f.default for f in fields(EngineConfig) if f.default is not MISSING}
DEVICES = ("auto", "npu", "cuda", "cpu")


@dataclass(frozen=True, eq=False)  # (hashed by identity: one object per flag)
class Flag:
    name: str  # the canonical spelling, "--max-model-len"
    kind: str
    commands: frozenset[str]
    default: Any = None  # or {command: default} where commands differ
    help: str = ""
    aliases: tuple[str, ...] = ()  # other spellings: "-tp", SGLang's "--tp-size"
    choices: tuple[Any, ...] = ()
    effect: frozenset[str] | None = None  # commands where it acts (None: all of them)
    dest: str = ""  # the attribute it fills (default: from the name)

    @property
    def attr(self) -> str:
        return self.dest or self.name.lstrip("-").replace("-", "_")

    def default_for(self, command: str) -> Any:
        if isinstance(self.default, dict):
            return self.default.get(command, self.default.get("*"))
        if self.kind in ("list",) and self.default is None:
            return []
        return self.default

    def acts_in(self, command: str) -> bool:
        return self.effect is None or command in self.effect


def _flags(commands: Iterable[str], *specs: tuple) -> list[Flag]:
    """Flags sharing one set of commands: (name, kind, default, help, **extra) each."""
    out = []
    for spec in specs:
        name, kind, default, help_, *extra = spec
        out.append(Flag(name, kind, frozenset(commands), default, help_,
                        **(extra[0] if extra else {})))
    return out


def _compat(*specs: tuple) -> list[Flag]:
    """``vllm serve`` flags accepted without effect on the engine lines: (name, kind) or
    (name, kind, aliases) each."""
    return [Flag(spec[0], spec[1], ENGINE_LINE, None,
                 "accepted for vLLM compatibility, without effect",
                 aliases=spec[2] if len(spec) > 2 else (), effect=frozenset())
            for spec in specs]


# the KV pool's flags: a mixed instance acts on them with the KV tiers (--kv-load-timeout:
# its tier reads) and their Mooncake storage (all); said otherwise (tier_flags.py)
POOLED = {"effect": frozenset({"prefill", "decode", "mixed", "config check"})}
AT_THE_GATEWAY = frozenset({"gateway", "up", "serve", "config check"})
# the gateway's output parsers and chat encodings (services/gateway/parsers)
TOOL_CALL_PARSERS = ("hermes", "qwen3_coder", "llama3_json", "deepseek_v3", "deepseek_v31",
                     "deepseek_v4")
REASONING_PARSERS = ("deepseek_r1", "deepseek_v3", "qwen3", "deepseek_v4", "glm45", "kimi",
                     "step3")
TOKENIZER_MODES = ("auto", "hf", "slow", "deepseek_v4")  # (hf, slow: as auto)
MODEL_COMMANDS = ENGINES | {"gateway"} | LAUNCHERS | ENGINE_TOOLS | CHECK
REGISTRY = SERVICES | LAUNCHERS
TRACED = ENGINES | {"gateway"} | LAUNCHERS

FLAGS: list[Flag] = [
    # -- everywhere ---------------------------------------------------------------------
    *_flags(ALL,
            ("--log-level", "str", "WARNING", "debug, info, warning or error"),
            ("--log-format", "str", "text", "text, or json lines with request and trace ids",
             {"choices": ("text", "json")}),
            ("--cluster-secret-file", "str", None, "the mesh's shared secret (a file; or "
             "PDMESH_CLUSTER_SECRET): internal gRPC calls must carry its token and registry "
             "entries its signature (default: none, for one box on loopback)"),
            ("--tls-dir", "str", None, "mutual TLS on internal gRPC: a folder with ca.pem, "
             "cert.pem and key.pem (pdmesh cluster-secret --tls makes them; or "
             "PDMESH_TLS_DIR; default: plain text, for one box on loopback)")),
    # -- the model ----------------------------------------------------------------------
    Flag("--model", "str", MODEL_COMMANDS, None, "the model folder (or first positional "
         "argument, as `vllm serve MODEL`)", aliases=("--model-path",)),
    Flag("--served-model-name", "names", ENGINES | {"gateway"} | LAUNCHERS | CHECK, (),
         "the name(s) clients ask for (default: the model path; up/serve: its folder "
         "name)"),
    # -- where a service listens and registers ------------------------------------------
    Flag("--host", "str", SERVICES | LAUNCHERS | CHECK, "127.0.0.1",
         "the address to bind (every listener binds exactly this)"),
    Flag("--port", "int", SERVICES | LAUNCHERS | CHECK,
         {"gateway": 8000, "up": 8000, "serve": 8000, "config check": 8000, "*": 0},
         "the port to listen on (0: any free one); up/serve: the gateway's HTTP port"),
    *_flags(SERVICES,
            ("--advertise-host", "str", None, "the host others reach this service at "
             "(default: --host, or this machine's hostname when --host is 0.0.0.0)")),
    Flag("--redis-url", "str", REGISTRY,
         {"up": None, "serve": None, "*": "redis://127.0.0.1:6379/0"},
         "the registry (up: default a redis on 127.0.0.1:6379, started if none listens)"),
    Flag("--registry-prefix", "str", REGISTRY, "pdmesh",
         "redis key prefix, so several meshes can share one redis"),
    Flag("--metrics-port", "int", ENGINES | {"kvstore", "eplb"}, 0,
         "HTTP port of /metrics (0: any free one; -1: none); kvstore: the Mooncake "
         "master's"),
    Flag("--metrics-names", "str", ENGINES | {"gateway", "eplb"} | LAUNCHERS, "pdmesh",
         "pdmesh: /metrics families as pdmesh_X; vllm: as vLLM names them (vllm:X), so "
         "dashboards built for vLLM read them unchanged", choices=("pdmesh", "vllm")),
    Flag("--enable-trace", "bool", TRACED, False,
         "trace requests (OTLP to --otlp-traces-endpoint, default http://127.0.0.1:4317)"),
    Flag("--otlp-traces-endpoint", "str", TRACED, None,
         "OTLP/gRPC collector for traces (turns tracing on)",
         aliases=("--oltp-traces-endpoint",)),  # SGLang's seed spells it so
    # -- the engine ---------------------------------------------------------------------
    *_flags(ENGINES | ENGINE_TOOLS | {"serve"} | CHECK,
            ("--device", "str", ENGINE_DEFAULT["device"],
             "auto (npu, else cuda, else cpu), npu, cuda or cpu",
             {"choices": DEVICES}),
            ("--dtype", "str", ENGINE_DEFAULT["dtype"],
             "auto (the checkpoint's), float32, bfloat16 or float16", {"choices": DTYPES}),
            ("--quantization", "str", ENGINE_DEFAULT["quantization"],
             "ascend: a modelslim checkpoint (W8A8, W8A8_DYNAMIC, W4A8_DYNAMIC per weight); "
             "fp8: DeepSeek's block FP8 (detected without it too)", {"aliases": ("-q",)}),
            ("--kv-cache-dtype", "str", ENGINE_DEFAULT["kv_cache_dtype"],
             "auto (the model's dtype) or int8 (K and V per token and head in int8, their "
             "scales in the same blocks: half of bfloat16's bytes, in the cache and through "
             "the pool)"),
            ("--seed", "int", ENGINE_DEFAULT["seed"],
             "the engine's sampling seed", {"aliases": ("--random-seed",)}),
            ("--block-size", "int", ENGINE_DEFAULT["block_size"],
             "tokens per KV block", {"aliases": ("--page-size",)}),

            ("--max-num-seqs", "int", ENGINE_DEFAULT["max_num_seqs"],
             "requests in a batch at most", {"aliases": ("--max-running-requests",)}),
            ("--max-num-batched-tokens", "int", ENGINE_DEFAULT["max_num_batched_tokens"],
             "tokens one step computes at most (serving on CPU: 2,048 by default, as vllm "
             "serve)"),
            ("--chunked-prefill-size", "int", None, "SGLang's: prompt tokens one step "
             "computes at most (-1: no chunking); --max-num-batched-tokens wins"),
            ("--max-prefill-tokens", "int", None, "SGLang's: prompt tokens one prefill "
             "batch holds at most; --max-num-batched-tokens wins"),
            ("--enable-prefix-caching", "bool", ENGINE_DEFAULT["enable_prefix_caching"],
             "reuse the KV of shared prefixes"),
            ("--scheduling-policy", "str", ENGINE_DEFAULT["scheduling_policy"],
             "fcfs, or priority (lower values first)", {"choices": ("fcfs", "priority")}),
            ("--num-kv-blocks", "int", ENGINE_DEFAULT["num_kv_blocks"],
             "KV cache size in blocks (overrides the sizing)",
             {"aliases": ("--num-gpu-blocks-override",)}),
            ("--max-total-tokens", "int", None, "KV cache size in tokens (SGLang's; "
             "--num-kv-blocks wins)"),
            ("--kv-cache-memory-bytes", "int", ENGINE_DEFAULT["kv_cache_memory_bytes"],
             "KV cache size in bytes (CPU default: up to 1 GiB)"),
            ("--gpu-memory-utilization", "float", ENGINE_DEFAULT["gpu_memory_utilization"],
             "share of device memory to use", {"aliases": ("--mem-fraction-static",)}),
            ("--enforce-eager", "bool", ENGINE_DEFAULT["enforce_eager"],
             "run every step eagerly: no decode graphs (cuda: CUDA graphs, npu: ACL graphs; "
             "cpu always runs eagerly)"),
            ("--compilation-config", "json", ENGINE_DEFAULT["compilation_config"],
             'vLLM\'s: "cudagraph_mode" (NONE, PIECEWISE, FULL, FULL_DECODE_ONLY, '
             "FULL_AND_PIECEWISE: decode steps captured piecewise, attention between the "
             'pieces), "cudagraph_capture_sizes", "max_cudagraph_capture_size", '
             '"cudagraph_num_of_warmups"; other keys are listed without effect'),
            ("--disable-cuda-graph", "bool", False, "SGLang's --enforce-eager"),
            ("--cuda-graph-bs", "names", (), "SGLang's: the decode batch sizes captured "
             '(compilation-config\'s "cudagraph_capture_sizes" wins)'),
            ("--cuda-graph-max-bs", "int", None, "SGLang's: the largest decode batch "
             "captured (compilation-config's \"max_cudagraph_capture_size\" wins)"),
            ("--disable-cuda-graph-padding", "bool", False, "SGLang's: a decode batch "
             "between two capture sizes runs eagerly instead of padded")),
    Flag("--max-model-len", "int", ENGINES | ENGINE_TOOLS | {"serve", "gateway"} | CHECK,
         ENGINE_DEFAULT["max_model_len"], "context length (default: the model's)",
         aliases=("--context-length",)),
    Flag("--disable-radix-cache", "bool", ENGINES | {"serve"} | CHECK, False,
         "SGLang's spelling of --no-enable-prefix-caching"),
    Flag("--enable-dp-attention", "bool", ENGINE_LINE, False,
         "SGLang's: --tp-size counts every rank; attention data-parallel over --dp-size "
         "ranks, the experts over all (shared/config/sglang_parallel.py)"),
    Flag("--enable-dp-lm-head", "bool", ENGINE_LINE, False,
         "SGLang's: under --enable-dp-attention the LM head stays in each DP rank's TP "
         "group (not split over the DP ranks)"),
    Flag("--moe-dense-tp-size", "int", ENGINE_LINE, None,
         "SGLang's: under --enable-dp-attention the dense MLPs split over this many ranks "
         "(default: --tp-size; 1: whole on each)"),
    Flag("--expert-parallel-size", "int", ENGINE_LINE, None,
         "SGLang's: 1, or the ranks the MoE spans (--enable-expert-parallel)",
         aliases=("--ep-size", "--ep")),
    Flag("--nnodes", "int", ENGINE_LINE, None,
         "SGLang's: nodes of a multi-node instance, each running its share of the DP ranks "
         "(--data-parallel-size-local)"),
    Flag("--node-rank", "int", ENGINE_LINE, None,
         "SGLang's: this node's index (--data-parallel-start-rank; a node but the first "
         "runs ranks only, --headless)"),
    Flag("--dist-init-addr", "str", ENGINE_LINE, None,
         "SGLang's: HOST:PORT where the nodes meet (--data-parallel-address, "
         "--data-parallel-rpc-port)", aliases=("--nccl-init-addr",)),
    Flag("--speculative-algorithm", "str", ENGINE_LINE, None,
         "SGLang's: NGRAM, NEXTN (DeepSeek's MTP), EAGLE, EAGLE3, STANDALONE; read with the "
         "flags below into --speculative-config (shared/config/sglang_speculative.py)"),
    Flag("--speculative-num-steps", "int", ENGINE_LINE, None,
         "SGLang's: tokens drafted per step (NEXTN, EAGLE)"),
    Flag("--speculative-num-draft-tokens", "int", ENGINE_LINE, None,
         "SGLang's: NGRAM's tokens verified per step, the verified one counted"),
    Flag("--speculative-draft-model-path", "str", ENGINE_LINE, None,
         "SGLang's: the draft model (EAGLE, EAGLE3, STANDALONE)",
         aliases=("--speculative-draft-model",)),
    Flag("--speculative-ngram-min-match-window-size", "int", ENGINE_LINE, None,
         "SGLang's: NGRAM's shortest match (prompt_lookup_min)"),
    Flag("--speculative-ngram-max-match-window-size", "int", ENGINE_LINE, None,
         "SGLang's: NGRAM's longest match (prompt_lookup_max)"),
    Flag("--cpu-offload-gb", "float", ENGINE_LINE, ENGINE_DEFAULT["cpu_offload_gb"],
         "GiB of the decoder layers' weights kept in host memory, copied to the device layer "
         "by layer each forward (the KV cache gets the room; decode graphs off); without "
         "effect on cpu"),
    Flag("--enable-lora", "bool", ENGINE_LINE | {"gateway", "up"}, ENGINE_DEFAULT["enable_lora"],
         "serve LoRA adapters (PEFT's format) on the base model: --lora-modules, and a "
         "request's model naming one"),
    Flag("--lora-modules", "names", ENGINE_LINE | {"gateway", "up"}, ENGINE_DEFAULT["lora_modules"],
         "adapters served by name: name=path, or JSON {\"name\", \"path\"} (read at start; "
         "they turn --enable-lora on)"),
    Flag("--lora-paths", "names", ENGINE_LINE | {"gateway", "up"}, (),
         "SGLang's: path, name=path or JSON {\"lora_name\", \"lora_path\"}, as --lora-modules"),
    Flag("--max-loras", "int", ENGINE_LINE | {"up"}, ENGINE_DEFAULT["max_loras"],
         "adapters one step runs at most (their device slots); a request whose adapter would "
         "be one more waits", aliases=("--max-loras-per-batch",)),
    Flag("--max-lora-rank", "int", ENGINE_LINE | {"up"}, ENGINE_DEFAULT["max_lora_rank"],
         "the largest adapter rank (an adapter above it is refused)"),
    Flag("--max-cpu-loras", "int", ENGINE_LINE | {"up"}, ENGINE_DEFAULT["max_cpu_loras"],
         "adapters kept in host memory, least recently used dropped (default: --max-loras)",
         aliases=("--max-loaded-loras",)),
    Flag("--fully-sharded-loras", "bool", ENGINE_LINE, False,
         "vLLM's: shard adapters over tensor-parallel ranks; without effect: LoRA runs "
         "without tensor parallelism", effect=frozenset()),
    Flag("--enable-hierarchical-cache", "bool", ENGINE_LINE | {"up"}, False,
         "SGLang's HiCache: KV blocks kept in host memory (and in storage) under the prefix "
         "cache, read back before a prompt runs (engine/kv_tiers.py)"),
    Flag("--hicache-ratio", "float", ENGINE_LINE | {"up"}, 2.0,
         "the host tier's size as a multiple of the device KV cache's"),
    Flag("--hicache-size", "float", ENGINE_LINE | {"up"}, 0.0,
         "the host tier's size in GB (over --hicache-ratio; 0: the ratio decides)"),
    Flag("--hicache-write-policy", "str", ENGINE_LINE | {"up"}, "write_through",
         "when a block is copied to the host tier: computed (write_through), hit twice "
         "(write_through_selective), or evicted from the device (write_back)",
         choices=("write_back", "write_through", "write_through_selective")),
    Flag("--hicache-storage-backend", "str", ENGINE_LINE | {"up"}, None,
         "a storage tier under the host tier: file (a directory, "
         "$SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR or /tmp/hicache, shared by the instances "
         "on a host and kept across restarts) or mooncake (the mesh's KV pool)",
         choices=("file", "mooncake")),
    Flag("--hicache-storage-prefetch-policy", "str", ENGINE_LINE | {"up"}, "best_effort",
         "a read from the tiers still running after --kv-load-timeout is given up and the "
         "prompt computed (best_effort, timeout), or waited for (wait_complete)",
         choices=("best_effort", "wait_complete", "timeout")),
    Flag("--kv-offloading-size", "float", ENGINE_LINE | {"up"}, None,
         "vLLM's: GiB of host memory for KV blocks under the prefix cache (the host tier, "
         "as --enable-hierarchical-cache --hicache-size)"),
    Flag("--kv-offloading-backend", "str", ENGINE_LINE | {"up"}, "native",
         "vLLM's: native (pdmesh's tiers); lmcache is not bound",
         choices=("native", "lmcache")),
    Flag("--hf-overrides", "json", ENGINE_LINE | {"gateway", "up"}, ENGINE_DEFAULT["hf_overrides"],
         "config.json keys laid over the checkpoint's: rope_scaling, rope_parameters, "
         "rope_theta, max_position_embeddings (e.g. YaRN for a longer context); another "
         "key is refused", aliases=("--json-model-override-args",)),
    Flag("--runner", "str", ENGINES | {"serve"} | CHECK, ENGINE_DEFAULT["runner"],
         "generate, or pooling: the instance serves /v1/embeddings (a prompt's final "
         "hidden states pooled), not generation; auto: generate",
         choices=("auto", "generate", "pooling")),
    Flag("--convert", "str", ENGINES | {"serve"} | CHECK, "auto",
         "embed: a generative checkpoint served as an embedding model (--runner pooling)",
         choices=("auto", "none", "embed")),
    Flag("--task", "str", ENGINES | {"serve"} | CHECK, "auto",
         "vLLM's older spelling: embed (or embedding) is --runner pooling",
         choices=("auto", "generate", "embed", "embedding")),
    Flag("--is-embedding", "bool", ENGINES | {"serve"} | CHECK, False,
         "SGLang's --runner pooling"),
    Flag("--pooler-config", "json", ENGINES | {"serve"} | CHECK, ENGINE_DEFAULT["pooler_config"],
         'the pooling runner\'s defaults over the checkpoint\'s: {"pooling_type": "LAST" | '
         '"MEAN" | "CLS", "normalize": true, "dimensions": n}',
         aliases=("--override-pooler-config",)),
    # -- serving an engine --------------------------------------------------------------
    *_flags(ENGINE_LINE,
            ("--kvstore", "str", None, "the kvstore service's gRPC address (default: the "
             "one the registry lists, waited for; a mixed instance joins a pool only as "
             "its --hicache-storage-backend mooncake)", POOLED),
            ("--pool-segment-mb", "int", 512, "memory this instance lends to the KV pool",
             POOLED),
            ("--kv-load-timeout", "float", ENGINE_DEFAULT["kv_load_timeout_s"],
             "seconds a prompt's read from the KV pool or the KV tiers may take, plus its "
             "size at 256 MiB/s, before it is given up and the prompt computed here (0: no "
             "limit)", POOLED),
            ("--shutdown-timeout", "float", 30.0, "on SIGTERM, seconds requests in flight "
             "get to finish"),
            ("--tensor-parallel-size", "int", ENGINE_DEFAULT["tensor_parallel_size"],
             "tensor parallel ranks of each DP rank (their processes on its node, rank r on "
             "its device r)", {"aliases": ("-tp", "--tp-size")}),
            ("--data-parallel-size", "int", ENGINE_DEFAULT["data_parallel_size"],
             "data parallel ranks of this instance", {"aliases": ("-dp", "--dp-size")}),
            ("--data-parallel-rank", "int", None, "run as this one rank (the launcher sets "
             "it; without it, --data-parallel-size N starts N ranks)"),
            ("--data-parallel-address", "str", None, "host of rank 0's process-group store "
             "(default: --host)"),
            ("--data-parallel-rpc-port", "int", None, "port of rank 0's process-group store "
             "(default: a free one; a multi-node instance names it on every node)"),
            ("--data-parallel-size-local", "int", None, "ranks this node runs (default: all "
             "of them); less than --data-parallel-size: one node of a multi-node instance, "
             "local rank i on device i of the node (of ASCEND_RT_VISIBLE_DEVICES / "
             "CUDA_VISIBLE_DEVICES)"),
            ("--data-parallel-start-rank", "int", 0, "the first rank this node runs"),
            ("--headless", "bool", False, "this node runs engine ranks only, no API server "
             "(serve: its `pdmesh mixed` ranks, no gateway; prefill and decode never run "
             "one: the gateway is its own service)",
             {"effect": frozenset({"prefill", "decode", "mixed", "serve", "config check"})}),
            ("--enable-expert-parallel", "bool", ENGINE_DEFAULT["enable_expert_parallel"],
             "MoE experts spread over the DP ranks"),
            ("--enable-eplb", "bool", False, "dynamic EPLB (upstream vLLM's switch)"),
            ("--eplb-config", "json", None, "upstream vLLM's EPLB config"),
            ("--eplb-address", "str", None, "the EPLB controller's gRPC address (default: "
             "the one in the registry)"),
            ("--speculative-config", "json", ENGINE_DEFAULT["speculative_config"],
             'speculative decoding, as vLLM: {"method": "ngram" (with "prompt_lookup_min" / '
             '"prompt_lookup_max") or "deepseek_mtp" / "mtp" (the checkpoint\'s MTP layers), '
             '"num_speculative_tokens": k}; other methods (eagle, suffix, draft models) are '
             "accepted and listed without effect"),
            ("--kv-transfer-config", "json", None, 'JSON: {"kv_connector": ..., "kv_role": '
             '"kv_producer" | "kv_consumer" | "kv_both", ...}'),
            ("--additional-config", "str", "{}", "vLLM-Ascend's additional config (JSON), "
             "validated strictly"),
            ("--schedule-policy", "str", None, "SGLang's waiting-queue order: fcfs, lpm "
             "(longest cached prefix first), lof (longest output first), random; dfs-weight "
             "is read as lpm (default: --scheduling-policy's)",
             {"choices": ("fcfs", "lpm", "dfs-weight", "lof", "random")}),
            ("--enable-priority-scheduling", "bool", False, "schedule by priority, larger "
             "values first (SGLang's order)"),
            ("--schedule-low-priority-values-first", "bool", False, "with "
             "--enable-priority-scheduling: lower values first"),
            ("--priority-scheduling-preemption-threshold", "int", 10, "with "
             "--enable-priority-scheduling: a waiting request that finds no seat or KV "
             "blocks preempts running requests whose priority is worse than its own by "
             "more than this"),
            ("--disable-priority-preemption", "bool", False, "with "
             "--enable-priority-scheduling: never preempt a running request for a waiting "
             "one"),
            ("--default-priority-value", "int", None, "the priority of a request that gives "
             "none (default: with --enable-priority-scheduling the lowest there is, as "
             "SGLang; otherwise 0)"),
            ("--abort-on-priority-when-disabled", "bool",
             ENGINE_DEFAULT["abort_on_priority_when_disabled"], "refuse a request that gives "
             "a priority when the engine does not schedule by priority (otherwise it runs, "
             "its priority ignored, with a warning)")),
    Flag("--max-queued-requests", "int", ENGINE_LINE | {"gateway", "up"},
         ENGINE_DEFAULT["max_queued_requests"],
         "refuse requests while this many wait (engine: gRPC RESOURCE_EXHAUSTED; gateway, "
         "and its gateway for up / serve: 429 with Retry-After while this many are in "
         "flight); default: no limit (up / serve: twice the batch slots of the engines "
         "that decode, --max-num-seqs x their ranks)"),
    Flag("--api-key", "str", ENGINE_LINE | {"gateway", "up"}, None,
         "require 'Authorization: Bearer KEY' on every path but /health (the gateway "
         "checks it; also from --api-key-file, PDMESH_API_KEY or VLLM_API_KEY, which "
         "`ps` does not show)",
         effect=frozenset({"gateway", "up", "serve", "config check"})),
    Flag("--api-key-file", "str", ENGINE_LINE | {"gateway", "up"}, None,
         "read the API key from this file (its first line)",
         effect=frozenset({"gateway", "up", "serve", "config check"})),
    # -- the gateway --------------------------------------------------------------------
    # (vLLM's serving flags: on an engine line they are accepted for the gateway, which
    # serves the API; `up` and `serve` hand them to it)
    Flag("--enable-auto-tool-choice", "bool", ENGINE_LINE | {"gateway", "up"}, False,
         "tool_choice \"auto\": the model decides when to call a tool, its calls read by "
         "--tool-call-parser", effect=AT_THE_GATEWAY),
    Flag("--tool-call-parser", "str", ENGINE_LINE | {"gateway", "up"}, None,
         "how the model writes tool calls (vLLM's parser of the same name)",
         choices=TOOL_CALL_PARSERS, effect=AT_THE_GATEWAY),
    Flag("--reasoning-parser", "str", ENGINE_LINE | {"gateway", "up"}, None,
         "split the model's reasoning into `reasoning` (vLLM's parser of the same "
         "name)", choices=REASONING_PARSERS, effect=AT_THE_GATEWAY),
    Flag("--structured-outputs-config", "json", ENGINE_LINE | {"gateway", "up"}, None,
         'structured output, as vLLM: {"enable_in_reasoning": true} binds a grammar '
         "from the first token (default: only the answer after the model's reasoning, "
         "with --reasoning-parser); llguidance is the one backend here",
         effect=AT_THE_GATEWAY),
    Flag("--enable-force-include-usage", "bool", ENGINE_LINE | {"gateway", "up"}, False,
         "every stream ends with a usage chunk, as if each request set "
         "stream_options.include_usage", effect=AT_THE_GATEWAY),
    Flag("--enable-prompt-tokens-details", "bool", ENGINE_LINE | {"gateway", "up"}, False,
         "usage.prompt_tokens_details (cached prompt tokens); sent here whether set or "
         "not, as OpenAI sends it (vLLM sends null without it)", effect=AT_THE_GATEWAY),
    Flag("--disable-log-stats", "bool", ENGINE_LINE, False,
         "no periodic stats line (vLLM's, every VLLM_LOG_STATS_INTERVAL seconds: prompt and "
         "generation throughput, running and waiting requests, KV cache usage, prefix "
         "cache hit rate)"),
    Flag("--decode-log-interval", "int", ENGINE_LINE, ENGINE_DEFAULT["decode_log_interval"],
         "SGLang's: its decode stats line every this many decoding steps, in place of "
         "vLLM's periodic one (0: vLLM's)"),
    Flag("--enable-return-hidden-states", "bool", ENGINE_LINE | {"gateway", "up"}, False,
         "SGLang's: a request may set return_hidden_states: its answer carries the final "
         "hidden state of the last token the model was fed", effect=AT_THE_GATEWAY),
    Flag("--stream-interval", "int", ENGINE_LINE | {"gateway", "up"}, 1,
         "tokens a streamed chunk holds: after the first token, the gateway sends once "
         "this many are in (or the answer ends), as vLLM and SGLang buffer them",
         effect=AT_THE_GATEWAY),
    Flag("--tokenizer-mode", "str", ENGINE_LINE | {"gateway", "up"}, "auto",
         "auto: chats rendered by the checkpoint's chat template; deepseek_v4: by "
         "DeepSeek-V4's own message encoding (it ships no template)",
         choices=TOKENIZER_MODES, effect=AT_THE_GATEWAY),
    Flag("--chat-template", "str", ENGINE_LINE | {"gateway", "up"}, None,
         "the chat template in place of the checkpoint's: a file's path, or the template "
         "itself in one line (as vLLM reads it)", effect=AT_THE_GATEWAY),
    Flag("--trust-request-chat-template", "bool", ENGINE_LINE | {"gateway", "up"}, False,
         "a chat request may bring its own chat_template (refused with a 400 otherwise, "
         "as vLLM does)", effect=AT_THE_GATEWAY),
    Flag("--generation-config", "str", ENGINE_LINE | {"gateway", "up"}, "auto",
         "where a request's unset sampling fields take their defaults: auto (the model's "
         "generation_config.json: temperature, top_p, top_k, min_p, repetition_penalty, "
         "max_new_tokens), vllm (none), or a folder's", effect=AT_THE_GATEWAY),
    Flag("--override-generation-config", "json", ENGINE_LINE | {"gateway", "up"}, None,
         "those defaults set or overridden (JSON, e.g. {\"temperature\": 0.5})",
         effect=AT_THE_GATEWAY),
    Flag("--preferred-sampling-params", "json", ENGINE_LINE | {"gateway", "up"}, None,
         "SGLang's: default sampling parameters (JSON), over the others",
         effect=AT_THE_GATEWAY),
    Flag("--tokenizer", "str", ENGINE_LINE | {"gateway", "up"}, ENGINE_DEFAULT["tokenizer"],
         "the folder of the tokenizer (tokenizer.json, tokenizer_config.json with the "
         "chat template) when it is not the model's: the gateway tokenizes with it, "
         "engines compile grammars against it", aliases=("--tokenizer-path",)),
    Flag("--prefill-addresses", "names", {"gateway"}, (),
         "host:port of each prefill instance to route to, instead of those the registry "
         "lists (what `pdmesh proxy` gives, from vLLM-Ascend's proxy line)"),
    Flag("--decode-addresses", "names", {"gateway"}, (),
         "host:port of each decode (or mixed) instance to route to, instead of those the "
         "registry lists"),
    Flag("--prefill-offload-threshold", "int", {"gateway", "up", "serve"},
         {"gateway": 0, "*": 2048},
         "while every prefill instance has this many prompt tokens queued, a decode instance "
         "prefills new prompts itself; 0: never (up and serve: 2048, one box)"),
    Flag("--max-request-body-bytes", "int", {"gateway", "up", "serve"}, 8 << 20,
         "a request body larger than this is refused (413) as it is read"),
    Flag("--request-body-timeout", "float", {"gateway", "up", "serve"}, 30.0,
         "seconds a client gets to send a whole request body (then 408); a request takes "
         "a --max-queued-requests slot only once its body is in"),
    Flag("--instance-grace", "float", {"gateway", "up", "serve"}, 15.0,
         "seconds a request waits for a decode instance to come back (a restart) when none "
         "is live, before it fails with 503; 0: fail at once"),
    Flag("--stall-timeout", "float", {"gateway", "up", "serve"}, 10.0,
         "seconds a decode stream may go without a token once its instance has stopped "
         "heartbeating (SIGSTOPped, hung) before the request moves to another instance"),
    Flag("--decode-tpot-slo-ms", "float", {"gateway", "up", "serve", "decode"}, 50.0,
         "a decode instance computes the prompts it prefills itself (offloaded by the "
         "gateway, or with no prefill instance up) in chunks that keep its steps under this "
         "many ms, by the step costs it measures, and the gateway offloads a prompt to it "
         "only if that chunk beside its decode rows fits (by the costs it publishes)"),
    Flag("--enable-log-requests", "bool", ENGINE_LINE | {"gateway", "up"}, False,
         "the gateway logs every finished request (SGLang's --log-requests)",
         aliases=("--log-requests",), effect=AT_THE_GATEWAY),
    Flag("--log-requests-level", "int", ENGINE_LINE | {"gateway", "up"}, 2,
         "0 metadata, 1 + sampling parameters, 2 + the start of the input and output, 3 + "
         "all of them", choices=(0, 1, 2, 3), effect=AT_THE_GATEWAY),
    # -- the kvstore --------------------------------------------------------------------
    *_flags({"kvstore"},
            ("--master-port", "int", 0, "the Mooncake master's RPC port (0: a free one)"),
            ("--metadata-port", "int", 0, "its HTTP metadata server's port (0: a free one)"),
            ("--master-log", "str", None, "where the master writes its log"),
            ("--kv-lease-ttl-ms", "int", 1000, "how long a read pins a block against "
             "eviction (Mooncake's default, 10 s, lets a burst fill the pool)"),
            ("--eviction-high-watermark-ratio", "float", 0.9, "pool use that starts an "
             "eviction"),
            ("--eviction-ratio", "float", 0.05, "share of the pool one eviction frees")),
    # -- the EPLB controller ------------------------------------------------------------
    *_flags({"eplb"},
            ("--interval-s", "float", 10.0, "decide every timer-driven group this often "
             "(ranks that count EPLB rounds in steps are decided when they close one)"),
            ("--improvement-threshold", "float", 0.05, "publish a placement only when it "
             "raises mean balancedness by more than this"),
            ("--num-groups", "int", 1, "expert groups of the model (group-limited routing)"),
            ("--num-nodes", "int", 1, "nodes each group's ranks span")),
    # -- pdmesh up ----------------------------------------------------------------------
    *_flags({"up"},
            ("--prefill", "int", 1, "prefill instances"),
            ("--decode", "int", 1, "decode instances")),
    *_flags(LAUNCHERS,
            ("--engine-args", "str", "", "extra engine flags for every engine instance, as "
             "one string, split as a shell would (quote a JSON value)",
             {"dest": "engine_flags"}),
            ("--prefill-args", "str", "", "extra flags for prefill only",
             {"dest": "prefill_flags"}),
            ("--decode-args", "str", "", "extra flags for decode (serve: the mixed instance) "
             "only, e.g. \"--data-parallel-size 2 --enable-expert-parallel\"",
             {"dest": "decode_flags"})),
    Flag("--log-dir", "str", LAUNCHERS, None, "the services' logs (default: a fresh "
         "temporary folder)"),
    # -- config check -------------------------------------------------------------------
    *_flags(CHECK,
            ("--role", "str", None, "the instance to check for (default: from "
             "--kv-transfer-config's kv_role: prefill, decode, else mixed)",
             {"choices": ("prefill", "decode", "mixed")}),
            ("--vllm-command", "str", None, "a whole `vllm serve MODEL ...` line; checks it "
             "instead of the flags")),
    # -- generate, bench offline --------------------------------------------------------
    *_flags({"generate"},
            ("--prompt", "list", None, "a prompt (repeat for a batch)"),
            ("--chat", "bool", False, "wrap prompts in the chat template"),
            ("--max-tokens", "int", 32, "tokens to generate"),
            ("--temperature", "float", 0.0, "sampling temperature"),
            ("--top-p", "float", 1.0, "nucleus sampling"),
            ("--top-k", "int", 0, "top-k sampling (0: off)"),
            ("--sampling-seed", "int", None, "the request's own seed")),
    *_flags({"bench offline"},
            ("--num-prompts", "int", 32, "prompts in the batch"),
            ("--input-len", "int", 128, "tokens per prompt"),
            ("--output-len", "int", 128, "tokens generated per prompt"),
            ("--runs", "int", 3, "timed runs (the median is reported)"),
            ("--no-hf", "bool", False, "skip the transformers baseline"),
            ("--json", "str", None, "also write the figures here")),
    # -- SGLang's launch_server flags (Ascend-supported) accepted without effect ---------
    *(Flag(name, kind, ENGINE_LINE, None, f"SGLang's, without effect: {why}",
           aliases=aliases, effect=frozenset())
      for name, kind, aliases, _, why in WITHOUT_EFFECT),
    # -- `vllm serve` flags accepted without effect -------------------------------------
    *_compat(("--pipeline-parallel-size", "int", ("-pp", "--pp-size")),
             ("--async-scheduling", "bool"),
             ("--trust-remote-code", "bool"), ("--api-server-count", "int"),
             ("--safetensors-load-strategy", "str"), ("--model-loader-extra-config", "json"),
             ("--disable-hybrid-kv-cache-manager", "bool"), ("--enable-sleep-mode", "bool"),
             ("--enable-return-routed-experts", "bool"), ("--weight-transfer-config", "json"),
             ("--enable-chunked-prefill", "bool"), ("--distributed-executor-backend", "str"),
             ("--max-logprobs", "int"), ("--disable-log-requests", "bool"),
             ("--uvicorn-log-level", "str"),
 ("--load-format", "str"), ("--download-dir", "str"),
             ("--revision", "str"), ("--swap-space", "float"),
             ("--limit-mm-per-prompt", "json")),
]

def flags_for(command: str) -> dict[str, Flag]:
    """Every spelling the command takes -> its flag."""
    out: dict[str, Flag] = {}
    for flag in FLAGS:
        if command in flag.commands:
            for spelling in (flag.name, *flag.aliases):
                out[spelling] = flag
    return out


BY_NAME = {f.name: f for f in FLAGS}
