"""The engine core: requests in, tokens out, one step at a time.

    step():  schedule -> execute -> sample -> update -> outputs

Everything a step decides lives in the scheduler and its policy; everything it computes
lives in the model runner and the kernels; a feature that needs the step is a StepHook
(``step_hooks.py``). The engine validates requests on the way in, so a bad one raises
ValueError naming the field and never reaches a step. ``build_engine`` (``build.py``)
wires the parts (ranks, model, caches, connector, proposer, grammars, scheduler) and
hands them in.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pdmesh.shared.engine.block_manager import KVCacheManager
from pdmesh.shared.engine.config import EngineConfig
from pdmesh.shared.engine.draft_length import DraftLength
from pdmesh.shared.engine.dyntralb import DyntraLB
from pdmesh.shared.engine.kv_cache_spec import KVCacheSpec
from pdmesh.shared.engine.kv_connector import PoolConnector
from pdmesh.shared.engine.lora_request import LoRARequest
from pdmesh.shared.engine.model_runner import ModelRunner
from pdmesh.shared.engine.pooling import Pooling, PoolingParams
from pdmesh.shared.engine.prompt_saves import PromptSaves
from pdmesh.shared.engine.request import Request, RequestStatus
from pdmesh.shared.engine.sampler import Sampler, ranked_logprobs
from pdmesh.shared.engine.sampling_params import SamplingParams
from pdmesh.shared.engine.scheduler import Scheduler, SchedulerOutput
from pdmesh.shared.engine.spec_decode import Proposer, SpecStats, SpeculativeConfig, VerifyBudget
from pdmesh.shared.engine.speculation import Speculation
from pdmesh.shared.engine.step_costs import StepCosts
from pdmesh.shared.engine.step_hooks import StepHook, StepOutput, StepRecord
from pdmesh.shared.engine.structured import GrammarCompiler, check_grammar
from pdmesh.shared.kernels import KernelBackend
from pdmesh.shared.models.config import ModelConfig
from pdmesh.shared.models.deepseek_v4 import DeepseekV4
from pdmesh.shared.models.transformer import CausalLM
from pdmesh.shared.parallel.expert_parallel import ExpertParallel
from pdmesh.shared.parallel.tp_ranks import TensorParallelRanks

__all__ = ["EngineCore", "StepOutput"]

log = logging.getLogger(__name__)


# the fewest prompt tokens a step under a time budget computes (``chunk_step_ms``), the
# budget kept or not: a prompt always progresses
MIN_PROMPT_CHUNK = 16

@dataclass(eq=False)
class EngineCore:
    """An engine's parts, as ``build_engine`` wired them, and its requests."""

    config: EngineConfig
    device: str  # cpu, cuda or npu
    backend: KernelBackend
    dtype: torch.dtype
    model_config: ModelConfig  # the model's (a tensor-parallel rank's model.config: its heads)
    model: CausalLM | DeepseekV4
    max_model_len: int
    max_num_batched_tokens: int
    # the paged cache, group by group (one for most models; DeepSeek-V4: its compressed
    # history and its sliding window), and the layout the pool holds (the whole model's,
    # whatever this engine's TP size); a token's bytes there, and the keys' fingerprint
    cache_spec: KVCacheSpec
    pool_spec: KVCacheSpec
    kv_bytes_per_token: int
    kv_fingerprint: str
    kv: KVCacheManager
    runner: ModelRunner
    sampler: Sampler
    grammars: GrammarCompiler
    scheduler: Scheduler
    speculative: SpeculativeConfig | None = None
    speculation: Speculation | None = None
    connector: PoolConnector | None = None  # the KV pool's, if any
    saves: PromptSaves | None = None  # a prefill instance's puts into the pool
    dyntralb: DyntraLB | None = None
    step_costs: StepCosts = field(default_factory=StepCosts)
    # a step that computes prompt chunks stays under this many ms, by the step costs
    # measured (0: no such budget; a decode instance's --decode-tpot-slo-ms: the prompts
    # the gateway offloads to it are computed in chunks its decode streams can bear)
    chunk_step_ms: float = 0.0
    # a step whose rows all decode (no prompt chunk) runs on this many torch threads,
    # every other step on the threads the engine started with (0: every step on those;
    # the serving loop sets it where the engine's threads take every core: decode steps
    # leave one to the processes that carry their tokens out)
    decode_threads: int = 0
    spec_stats: SpecStats = field(default_factory=SpecStats)
    hooks: list[StepHook] = field(default_factory=list)  # in the order they run
    # parallel ranks: the other tensor-parallel ranks (rank 0 drives them), the engines'
    # own group (lockstep, DyntraLB; None: the default one), expert parallelism, and
    # whether ranks step together, an idle one too (EP, fine-grained TP)
    tp_ranks: TensorParallelRanks | None = None
    tp_weight_bytes: list[int] = field(default_factory=list)
    dp_group: Any = None
    ep: ExpertParallel | None = None
    lockstep: bool = False
    # the pooling runner: the model's pooling (a request's own fields over it), and
    # whether it may cut embeddings short (Matryoshka); None: this engine generates
    pooling: Pooling | None = None
    matryoshka: bool = False
    stats_log: Any = None  # stats_log.StatsLog: the periodic stats line (None: none)
    lora: Any = None  # lora.LoraManager: the LoRA adapters (None: --enable-lora not given)

    def __post_init__(self) -> None:
        self._requests: dict[str, Request] = {}
        if self.lora is not None:
            self.lora.in_use = lambda: {r.lora.lora_name for r in self._requests.values()
                                        if r.lora is not None}
        self._ids = itertools.count()
        self._needs_hidden = self.proposer is not None and self.proposer.needs_hidden
        self._all_threads = 0  # (read at the first step that sets its threads)

    @property
    def proposer(self) -> Proposer | None:
        return None if self.speculation is None else self.speculation.proposer

    @property
    def draft_length(self) -> DraftLength | None:
        return None if self.speculation is None else self.speculation.draft_length

    @property
    def verify_budget(self) -> VerifyBudget | None:
        return None if self.speculation is None else self.speculation.verify_budget

    def close(self) -> None:
        """Stop what this engine started beside itself (pool reads, tensor-parallel
        ranks)."""
        if self.connector is not None:
            self.connector.close()
        if self.tp_ranks is not None:
            self.tp_ranks.close()

    def idle_step(self) -> None:
        """A step with nothing of this rank's to compute: the other ranks' tokens still
        pass through this rank's experts (expert parallelism) and its slices of the
        modules fine-grained TP splits (a forward of no tokens: every collective, in
        the forward's order)."""
        if self.model.fg is not None:
            self.runner.forward_nothing()
        elif self.ep is not None:
            self.ep.idle_step(self.model_config.hidden_size, self.dtype, self.backend.device,
                              self.backend)

    # -- requests ---------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, priority: int | None = None,
                    output_token_ids: list[int] | None = None,
                    pooling: PoolingParams | None = None,
                    lora_request: Any = None) -> Request:
        """``output_token_ids``: tokens already generated elsewhere (a decode instance
        continuing a prefill); they count towards ``max_tokens``. ``priority`` None: the
        config's ``default_priority``. ``pooling``: an embedding request (a pooling
        engine's only kind; ``params`` are then unused), its own fields over the model's
        pooling: it ends with its ``embedding``. ``lora_request``: the LoRA adapter it
        runs (models.lora.LoRARequest; read now unless held)."""
        done = list(output_token_ids or [])
        self.check_runner(pooling)
        hash_root = self.lora_root(lora_request)
        resolved = None
        if pooling is not None:
            assert self.pooling is not None  # (check_runner)
            resolved = pooling.over(self.pooling)
            resolved.validate(self.model_config.hidden_size, self.matryoshka)
            params, done = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), []
        self._check_request(prompt_token_ids, params, done)  # (its grammar: by the compile)
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self._requests:
            raise ValueError(f"request_id: {rid!r} is already in flight")
        priority = self._priority(rid, priority)
        req = Request(rid, list(prompt_token_ids), params,
                      eos_token_ids=self.model_config.eos_token_ids, priority=priority)
        if params.grammar is not None:  # (its state catches up on ``done`` when sampled)
            req.grammar = self.grammars.start(params.grammar, after=params.grammar_after)
        req.token_ids.extend(done)
        req.num_carried_outputs = len(done)
        req.pooling = resolved
        req.lora, req.hash_root = lora_request, hash_root
        self._requests[rid] = req
        self.scheduler.add(req)
        if self.dyntralb is not None:
            self.dyntralb.note_added(req.num_tokens)
        return req

    def lora_request(self, name: str | None, path: str | None = None) -> Any:
        """The LoRARequest of an adapter by name (None: the base model): one this
        engine holds, or the one in folder ``path`` (read when the request is added);
        ValueError naming ``model`` for neither."""
        if name is None:
            return None
        if self.lora is None:
            raise ValueError(f"model: the LoRA adapter {name!r} is not served here "
                             "(LoRA adapters are not enabled: --enable-lora)")
        return self.lora.request(name, path)

    def load_lora(self, name: str, path: str) -> None:
        """vLLM's load_lora_adapter: read the adapter now (ValueError naming what does
        not fit: its folder, its rank, a module it targets)."""
        if self.lora is None:
            raise ValueError("lora_name: LoRA adapters are not enabled here (--enable-lora)")
        self.lora.add(LoRARequest(name, 1, path))

    def unload_lora(self, name: str) -> None:
        """vLLM's unload_lora_adapter: requests running it finish with it, new ones
        are refused (KeyError when it is not loaded)."""
        if self.lora is None:
            raise KeyError(name)
        self.lora.unload(name)

    def lora_root(self, lora_request: Any) -> bytes | None:
        """The block-hash root of a request running ``lora_request`` (its adapter read
        or found first); None for the base model. ValueError when it cannot run."""
        if lora_request is None:
            return None
        if self.lora is None:
            raise ValueError("lora_request: LoRA adapters are not enabled (--enable-lora)")
        adapter = self.lora.load(lora_request)
        return self.kv.hasher.root_for(f"lora:{adapter.digest}")

    def check_runner(self, pooling: PoolingParams | None) -> None:
        """ValueError when the request is not of the kind this engine runs."""
        if pooling is None and self.pooling is not None:
            raise ValueError("prompt: this model runs the pooling runner (--runner "
                             "pooling, --is-embedding): it serves embeddings, not "
                             "generation")
        if pooling is not None and self.pooling is None:
            raise ValueError("input: this model generates; embeddings need an instance "
                             "started with --runner pooling (SGLang's --is-embedding)")

    def _priority(self, rid: str, priority: int | None) -> int:
        """The priority a request runs with. One given to an engine that does not
        schedule by priority is refused (``abort_on_priority_when_disabled``) or ignored
        with a warning."""
        cfg = self.config
        if priority is None:
            return cfg.default_priority
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority: must be an integer, got {priority!r}")
        if cfg.scheduling_policy != "priority":
            if cfg.abort_on_priority_when_disabled:
                raise ValueError("priority: this engine does not schedule by priority "
                                 "(--abort-on-priority-when-disabled); send the request "
                                 "without one")
            if priority != cfg.default_priority:
                log.warning("request %s: priority %d has no effect: this engine schedules "
                            "%s (priority needs --scheduling-policy priority or "
                            "--enable-priority-scheduling)", rid, priority,
                            cfg.scheduling_policy)
        return priority

    def validate_request(self, prompt: list[int], params: SamplingParams,
                         output: list[int] | None = None) -> None:
        """ValueError naming the field if the request cannot run here; changes nothing."""
        self._check_request(prompt, params, output)
        if params.grammar is not None:
            check_grammar(params.grammar)

    def _check_request(self, prompt: list[int], params: SamplingParams,
                       output: list[int] | None) -> None:
        """validate_request but for the grammar (add_request's compile reports its faults
        without parsing it twice)."""
        params.validate()
        if params.return_hidden_states and self.speculative is not None:
            raise ValueError("return_hidden_states: not with speculative decoding (its "
                             "verify steps feed drafts the answer may not keep)")
        output = output or []
        if any(not isinstance(t, int) or not 0 <= t < self.model_config.vocab_size
               for t in output):
            raise ValueError("output_token_ids: outside the vocabulary")
        if params.max_tokens is not None and len(output) >= params.max_tokens:
            raise ValueError(f"output_token_ids: {len(output)} already generated, "
                             f"max_tokens is {params.max_tokens}")
        if not prompt:
            raise ValueError("prompt: must contain at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids: {bad[:5]} outside the vocabulary [0, {vocab})")
        bad_stop = [t for t in params.stop_token_ids if t >= vocab]
        if bad_stop:
            raise ValueError(f"stop_token_ids: {bad_stop[:5]} outside the vocabulary [0, {vocab})")
        if len(prompt) > self.max_model_len:
            raise ValueError(f"prompt: {len(prompt)} tokens is longer than max_model_len "
                             f"({self.max_model_len})")
        longest = min(len(prompt) + (params.max_tokens or self.max_model_len), self.max_model_len)
        if self.kv.blocks_for(longest) > self.kv.num_blocks:
            raise ValueError(
                f"max_tokens: prompt ({len(prompt)}) + max_tokens needs "
                f"{self.kv.blocks_for(longest)} KV blocks, the cache has {self.kv.num_blocks}")

    def abort(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is not None and not req.is_finished:
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or (self.saves is not None
                                                 and self.saves.pending)

    # -- the step ---------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """One forward pass over what the scheduler picked. On a prefill instance a
        request whose prompt this step completed comes out with its token but not yet
        finished: its prompt's put into the pool follows in ``finish_saves`` (the caller
        sends the tokens first, so the first token does not wait for the put), or at the
        start of the next step."""
        saved = self.finish_saves()
        started = time.perf_counter()
        if self.chunk_step_ms:
            self.scheduler.prompt_cap = self.prompt_chunk_tokens()
        sched = self.scheduler.schedule()
        handed_back = self._handed_back()
        if sched.is_empty:
            self.idle_step()
            return saved + handed_back
        step = StepRecord(sched, started)
        if self.decode_threads:
            self._set_step_threads(step)
        logits = self._execute(step)
        self._score_prompts()
        step.tokens = self._sample(sched, logits, step.sample_idx)
        for hook in self.hooks:
            hook.sampled(step)
        step.finished = self.scheduler.update(sched, step.tokens)
        for req in step.finished:
            self._requests.pop(req.request_id, None)
        for hook in self.hooks:
            hook.updated(step)
        return saved + step.outputs() + handed_back

    def _set_step_threads(self, step: StepRecord) -> None:
        self._all_threads = self._all_threads or torch.get_num_threads()
        n = self.decode_threads if not step.prompt_tokens else self._all_threads
        if n != torch.get_num_threads():
            torch.set_num_threads(n)

    def measure_step_costs(self, prompt_tokens: int = 128, new_tokens: int = 3) -> None:
        """Before serving: a prompt of random tokens computed in one step and a few
        tokens decoded on the usual path, so the step costs this engine publishes are
        known from its first request on (a gateway prices offloaded prompts with them,
        and routes a burst as it arrives). Nothing of it reaches the pool, the prefix
        cache, the counters or the other step hooks."""
        sched = self.scheduler
        kept = (self.hooks, self.saves, self.dyntralb, self.chunk_step_ms, sched.connector,
                sched.prefix_queries, sched.prefix_hits, self.kv.on_free)
        self.hooks, self.saves, self.dyntralb, self.chunk_step_ms = [self.step_costs], None, \
            None, 0.0
        self.kv.on_free = None
        sched.connector, sched.prompt_cap = None, None
        try:
            n = max(1, min(prompt_tokens, self.max_num_batched_tokens,
                           self.max_model_len - new_tokens))
            while n > 1 and self.kv.blocks_for(n + new_tokens) > self.kv.num_blocks:
                n //= 2  # (a cache of a few blocks)
            ids = torch.randint(self.model_config.vocab_size, (n,),
                                generator=torch.Generator().manual_seed(0)).tolist()
            self.add_request(ids, SamplingParams(temperature=0.0, max_tokens=new_tokens,
                                                 ignore_eos=True),
                             request_id="pdmesh-step-costs")
            while self.scheduler.has_unfinished:
                self.step()
        finally:
            (self.hooks, self.saves, self.dyntralb, self.chunk_step_ms, sched.connector,
             sched.prefix_queries, sched.prefix_hits, self.kv.on_free) = kept
            self._requests.pop("pdmesh-step-costs", None)
            self.kv.reset_prefix_cache()

    def prompt_chunk_tokens(self) -> int:
        """The prompt tokens a step computes at most: ``max_num_batched_tokens``, or
        under ``chunk_step_ms`` what fits beside a decode step by the costs measured, at
        least ``MIN_PROMPT_CHUNK`` (prompts always progress), and that many while the
        cost of a prompt token is not known yet."""
        if not self.chunk_step_ms:
            return self.max_num_batched_tokens
        costs = self.step_costs
        fits = MIN_PROMPT_CHUNK
        if costs.prefill_ns_per_token:
            fits = int((self.chunk_step_ms * 1e3 - costs.decode_step_us) * 1e3
                       / costs.prefill_ns_per_token)
        return min(max(MIN_PROMPT_CHUNK, fits), self.max_num_batched_tokens)

    def _execute(self, step: StepRecord) -> torch.Tensor:
        """The forward pass: the logits of the rows to sample (``step.sample_idx``)."""
        try:
            reqs = step.sched.requests
            hidden = self._needs_hidden or any(h.wants_hidden(reqs) for h in self.hooks)
            logits, step.sample_idx = self.runner.execute(step.sched, hidden=hidden)
            for hook in self.hooks:
                hook.executed(step)
        except BaseException:
            # This step's full blocks were made findable by hash before being computed:
            # forget every cached prefix rather than serve one that was never filled.
            self.kv.reset_prefix_cache()
            raise
        return logits

    def _sample(self, sched: SchedulerOutput, logits: torch.Tensor, sample_idx: list[int]
                ) -> dict[int, Any]:
        """Position in the step -> its sampled token, or (a request that verified
        drafts) the list of tokens it keeps. Logprobs go onto the requests."""
        reqs, drafted = sched.requests, sched.drafts
        starts: dict[int, int] = {}
        if not drafted:
            rows, plain = logits, sample_idx
        else:
            at = 0
            for i in sample_idx:
                starts[i] = at
                at += 1 + len(drafted[reqs[i]].tokens) if reqs[i] in drafted else 1
            plain = [i for i in sample_idx if reqs[i] not in drafted]
            rows = logits[[starts[i] for i in plain]]
        out: dict[int, Any] = {}
        if plain:
            sampled = self.sampler(rows, [reqs[i] for i in plain])
            for i, token, lp in zip(plain, sampled.token_ids, sampled.logprobs, strict=True):
                out[i] = token
                if lp is not None:
                    reqs[i].logprobs.append(lp)
        spec = [i for i in sample_idx if reqs[i] in drafted]
        if spec:
            drafts = [drafted[reqs[i]] for i in spec]
            kept = self.sampler.verify(
                torch.cat([logits[starts[i]:starts[i] + 1 + len(d.tokens)]
                           for i, d in zip(spec, drafts, strict=True)]),
                [reqs[i] for i in spec], drafts, self.speculative)
            out.update(zip(spec, kept, strict=True))
        return out

    def _score_prompts(self) -> None:
        """The logprobs of the prompt tokens this step's logits scored, onto the requests
        that asked for them (``Request.prompt_logprobs``)."""
        scored, self.runner.prompt_logits = self.runner.prompt_logits, None
        if scored is None:
            return
        spans = scored.spans
        tokens = [t for r, f, n in spans for t in r.prompt_token_ids[f:f + n]]
        top = [r.sampling_params.prompt_logprobs for r, _, n in spans for _ in range(n)]
        entries = ranked_logprobs(torch.log_softmax(scored.logits, dim=-1),
                                  torch.tensor(tokens, device=scored.logits.device), top)
        at = 0
        for r, _, n in spans:
            r.prompt_logprobs.extend(entries[at:at + n])
            at += n

    def finish_saves(self) -> list[StepOutput]:
        """Put the prompts the last step completed into the pool (a prefill instance);
        each request comes out again (no new token) with its keys set, finished if it
        ended meanwhile."""
        return [] if self.saves is None else self.saves.finish()

    def _handed_back(self) -> list[StepOutput]:
        """Requests the recompute scheduler gave up this step, or whose KV read failed
        under kv_load_failure_policy "fail": finished, no new token."""
        out = []
        for req in self.scheduler.handed_back:
            self._requests.pop(req.request_id, None)
            out.append(StepOutput(req, [], True))
        self.scheduler.handed_back.clear()
        return out
