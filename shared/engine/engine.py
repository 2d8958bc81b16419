"""The engine core: requests in, tokens out, one step at a time.

    step():  schedule -> run model -> sample -> update

Everything a step decides lives in the scheduler and its policy; everything it computes
lives in the model runner and the kernels. The engine validates requests on the way in,
so a bad one raises ValueError naming the field and never reaches a step.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pdmesh.shared.engine.block_manager import KVBlock, KVCacheManager
from pdmesh.shared.engine.config import EngineConfig
from pdmesh.shared.engine.draft_length import DraftLength
from pdmesh.shared.engine.kv_cache_spec import allocate_caches, cache_spec, layer_caches
from pdmesh.shared.engine.kv_connector import PoolConnector
from pdmesh.shared.engine.kv_sizing import kv_blocks
from pdmesh.shared.engine.model_runner import ModelRunner
from pdmesh.shared.engine.mtp import MtpProposer
from pdmesh.shared.engine.parallel_setup import (
    setup_expert_parallel,
    setup_finegrained,
    start_tensor_parallel,
)
from pdmesh.shared.engine.policy import policy_from_config
from pdmesh.shared.engine.request import Request, RequestStatus
from pdmesh.shared.engine.sampler import Sampler, ranked_logprobs
from pdmesh.shared.engine.sampling_params import SamplingParams
from pdmesh.shared.engine.scheduler import Scheduler, SchedulerOutput
from pdmesh.shared.engine.spec_decode import (
    Proposer,
    SpecStats,
    SpeculativeConfig,
    VerifyBudget,
    drafts_allowed,
    make_ngram_proposer,
)
from pdmesh.shared.engine.step_costs import StepCosts
from pdmesh.shared.engine.structured import GrammarCompiler, check_grammar
from pdmesh.shared.infra.launcher import ready_timeout_s
from pdmesh.shared.kernels import get_backend, resolve_device
from pdmesh.shared.kvpool.base import CacheRegions, KVPool
from pdmesh.shared.models.checkpoint import model_fingerprint
from pdmesh.shared.models.config import ModelConfig, parse_dtype
from pdmesh.shared.models.loader import load_model
from pdmesh.shared.models.transformer import weight_bytes
from pdmesh.shared.parallel.finegrained_tp import FineGrainedLayout

log = logging.getLogger(__name__)


@dataclass
class _Save:
    """A prompt waiting to be put into the pool: its block table per cache group, and
    the blocks pinned until the put has read them."""

    request: Request
    tables: list[list[int]]
    num_tokens: int  # the tokens they hold: the prompt (and tokens it came with)
    pinned: list[list[KVBlock]]


@dataclass
class StepOutput:
    """What one step produced for one request."""

    request: Request
    new_token_ids: list[int]
    finished: bool


class EngineCore:
    def __init__(self, config: EngineConfig, kv_pool: KVPool | None = None,
                 save_prompts: bool = False):
        """``kv_pool``: load prompt blocks from this pool at admission; with
        ``save_prompts`` (a prefill instance) also put every computed prompt there."""
        config.validate()
        self.config = config
        torch.manual_seed(config.seed)
        self.device = resolve_device(config.device)
        self.backend = get_backend(self.device)
        model_cfg = ModelConfig.from_folder(config.model)
        self.dtype = parse_dtype(config.dtype, default=model_cfg.dtype)
        t0 = time.perf_counter()
        self.max_model_len = self._resolve_max_model_len(model_cfg)  # (before ranks start)
        self.tp_ranks = shard = None
        # the engines' own group (lockstep, DyntraLB): None, the default one, unless
        # tensor-parallel workers share the world with them
        self.dp_group = None
        if config.tensor_parallel_size > 1:
            self.tp_ranks, shard = start_tensor_parallel(config, model_cfg, self.device)
            weakref.finalize(self, self.tp_ranks.close)
        fine = FineGrainedLayout.from_config(config.finegrained_tp_config,
                                             config.data_parallel_rank,
                                             config.data_parallel_size)
        try:
            self.model_config, self.model = load_model(config.model, self.backend, self.dtype,
                                                       model_cfg, config.quantization,
                                                       shard=shard, fine=fine)
            if self.tp_ranks is not None:  # every rank has its shard: join their groups
                self.tp_weight_bytes = [weight_bytes(self.model.w), *(
                    r["weight_bytes"] for r in self.tp_ranks.join(ready_timeout_s()))]
                self.model.tp.group = self.tp_ranks.groups.tp
                self.dp_group = self.tp_ranks.groups.dp
        except BaseException:
            if self.tp_ranks is not None:
                self.tp_ranks.kill()
            raise
        self.ep = setup_expert_parallel(config, self.model, self.model_config, self.device,
                                        self.tp_ranks)
        self.model.shared_expert_dp = config.enable_shared_expert_dp
        if fine is not None:
            setup_finegrained(config, self.model, model_cfg, fine,
                              joined=self.ep is not None, device=self.device)
        # ranks that step together, an idle one too (expert parallelism, fine-grained TP)
        self.lockstep = self.ep is not None or fine is not None
        if config.expert_load_window and self.model.moe_layers:
            from pdmesh.shared.parallel.expert_load import ExpertLoadRecorder

            self.model.load_recorder = ExpertLoadRecorder(
                len(self.model.moe_layers), self.model_config.moe.num_experts,
                config.expert_load_window, config.expert_load_phase, self.backend.device)
        self.max_num_batched_tokens = config.max_num_batched_tokens or max(8192,
                                                                           config.max_num_seqs)
        # what the paged cache keeps, group by group (one for most models; DeepSeek-V4:
        # its compressed history and its sliding window), and what a token of context
        # takes there, and so in the pool (MLA: the latent; V4: its compressed entries)
        self.speculative = self._speculative_config()
        mtp = self.speculative is not None and self.speculative.is_mtp
        # (the model's own config: a tensor-parallel rank's heads)
        self.cache_spec = cache_spec(self.model.config, config.block_size,
                                     mtp_layers=1 if mtp else 0,
                                     int8=config.kv_cache_dtype == "int8")
        # the layout the pool holds: the whole model's, whatever this engine's TP size
        self.pool_spec = self.cache_spec if self.tp_ranks is None else cache_spec(
            model_cfg, config.block_size, mtp_layers=1 if mtp else 0,
            int8=config.kv_cache_dtype == "int8")
        self.kv_bytes_per_token = round(self.pool_spec.bytes_per_token(self.dtype))
        groups = kv_blocks(config, self.cache_spec, self.dtype, self.device,
                           self.max_model_len, self.max_num_batched_tokens)
        num_blocks = groups[0].num_blocks
        if self.tp_ranks is not None:  # the other ranks' caches: as many blocks
            self.tp_ranks.broadcast([g.num_blocks for g in groups])
        self.kv_fingerprint = self.fingerprint()  # reads the checkpoint: computed once
        self.kv = KVCacheManager(groups, config.block_size, config.enable_prefix_caching,
                                 fingerprint=self.kv_fingerprint)
        caches = allocate_caches(self.cache_spec, [g.num_blocks for g in groups], self.dtype,
                                 self.backend.device)
        num_layers = self.model_config.num_layers
        per_layer = layer_caches(self.cache_spec, caches, num_layers + (1 if mtp else 0))
        if self.tp_ranks is not None:
            kv_bytes = sum(x.numel() * x.element_size() for group in caches for x in group)
            log.info("engine: tensor-parallel memory per rank: weights %s MB, KV cache "
                     "%.2f MB each", " / ".join(f"{b / 1e6:.2f}" for b in self.tp_weight_bytes),
                     kv_bytes / 1e6)
        self.runner = ModelRunner(self.model, self.backend, self.kv, per_layer[:num_layers])
        self.runner.tp_ranks = self.tp_ranks
        self.sampler = Sampler(self.backend, self.model_config.vocab_size)
        self.grammars = GrammarCompiler(Path(config.model) / "tokenizer.json",
                                        self.model_config.vocab_size,
                                        self.model_config.eos_token_ids)
        self.proposer: Proposer | None = None
        self.verify_budget: VerifyBudget | None = None
        if self.speculative is not None:
            spec = self.speculative
            if mtp:
                self.proposer = MtpProposer(self.model, self.backend, self.kv,
                                            per_layer[num_layers],
                                            confidence=spec.dynamic is not None)
                self.proposer.tp_ranks = self.tp_ranks
            else:
                self.proposer = make_ngram_proposer(spec)
            if spec.dynamic is not None:
                self.verify_budget = VerifyBudget(spec.dynamic, spec.num_speculative_tokens)
        self.draft_length: DraftLength | None = None
        if self.speculative is not None and self.speculative.adaptive:
            self.draft_length = DraftLength(self.speculative.num_speculative_tokens)
        self.spec_stats = SpecStats()
        self.connector = None
        windows, names = [g.window for g in groups], [g.name for g in groups]
        if kv_pool is not None and self.tp_ranks is not None:
            from pdmesh.shared.parallel.tp_kv import ShardedPoolConnector

            self.connector = ShardedPoolConnector(
                kv_pool, caches, self.pool_spec, self.dtype, self.tp_ranks, self.kv.hasher,
                self.kv_fingerprint, save_prompts, windows=windows, names=names)
        elif kv_pool is not None:
            self.connector = PoolConnector(
                kv_pool, [CacheRegions(t) for t in caches], self.kv.hasher,
                self.kv_fingerprint, save_prompts, windows=windows, names=names)
        self.step_costs = StepCosts()
        # pool reads run beside the steps, never inside one
        self.scheduler = Scheduler(self.kv, policy_from_config(config),
                                   config.max_num_seqs, self.max_num_batched_tokens,
                                   self.max_model_len, self.connector,
                                   # (TP: transfers are collectives, in step order)
                                   async_kv_load=kv_pool is not None and self.tp_ranks is None,
                                   kv_load_timeout_s=config.kv_load_timeout_s)
        self.scheduler.recompute_elsewhere = config.recompute_scheduler
        self.dyntralb = None
        if config.dyntra_lb is not None and self.ep is not None:
            from pdmesh.shared.engine.dyntralb import DyntraLB

            self.dyntralb = DyntraLB(config.dyntra_lb, config.data_parallel_rank,
                                     config.data_parallel_size, config.block_size,
                                     config.max_num_seqs)
        elif config.dyntra_lb is not None:
            # vLLM-Ascend plans only on DP ranks that step together (MoE models); a dense
            # model keeps its scheduler class there and never plans either
            log.warning("dyntra_lb_config: ranks that do not step in lockstep (no expert "
                        "parallelism) have no DP bubble to balance; DyntraLB is inactive")
        self._requests: dict[str, Request] = {}
        self._saves: list[_Save] = []  # prompts to put into the pool (``finish_saves``)
        self._ids = itertools.count()
        window = self.cache_spec.window_bytes(self.dtype)
        log.info("engine ready in %.2fs: %s on %s, %s, %d KV blocks of %d tokens, "
                 "%d KV bytes per token%s", time.perf_counter() - t0,
                 self.model_config.architecture, self.device,
                 str(self.dtype).removeprefix("torch."), num_blocks, config.block_size,
                 self.kv_bytes_per_token,
                 f" + {window} window bytes per sequence ("
                 + ", ".join(f"{g.name}: {g.num_blocks} blocks" for g in groups) + ")"
                 if window else "")

    def close(self) -> None:
        """Stop what this engine started beside itself (tensor-parallel ranks)."""
        if self.tp_ranks is not None:
            self.tp_ranks.close()

    # -- configuration ----------------------------------------------------------------
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

    def fingerprint(self) -> str:
        """What makes KV interchangeable: the model's content, its cache layout (groups,
        layers, tensors, heads, sizes), the dtype and the block size. The root of every
        block hash, and the prefix of every pool key."""
        import hashlib

        layout = hashlib.blake2b(self.pool_spec.layout().encode(), digest_size=8).hexdigest()
        return (f"{model_fingerprint(self.config.model)}:{layout}:"
                f"{str(self.dtype).removeprefix('torch.')}:{self.config.block_size}")

    def _speculative_config(self) -> SpeculativeConfig | None:
        raw = self.config.speculative_config
        spec = raw if raw is None or isinstance(raw, SpeculativeConfig) \
            else SpeculativeConfig.from_dict(raw)
        if spec is None or not spec.is_mtp:
            return spec
        not_run = getattr(self.model.w, "mtp_not_run", None)
        if not_run is not None:
            raise ValueError(f"speculative_config.method: mtp: {self.config.model}'s {not_run}; "
                             f"pdmesh runs DeepSeek-V4 MTP blocks with sliding-window "
                             f"attention only")
        layers = len(self.model.w.mtp)
        if not layers:
            raise ValueError(f"speculative_config.method: mtp needs the checkpoint's MTP "
                             f"layers; {self.config.model} has none "
                             f"(num_nextn_predict_layers "
                             f"{self.model_config.num_nextn_predict_layers})")
        if spec.num_speculative_tokens is None:
            spec = dataclasses.replace(spec, num_speculative_tokens=layers)
        if spec.dynamic is not None and spec.dynamic.method == "dspark":
            raise ValueError("dynamic_spec_config.method: dspark needs a draft model with "
                             f"a confidence head; {self.config.model}'s MTP layers have "
                             "none (dflash estimates confidence without one)")
        return spec

    def _resolve_max_model_len(self, model_cfg: ModelConfig) -> int:
        limit = model_cfg.max_position_embeddings
        asked = self.config.max_model_len
        if asked is None:
            return limit
        if asked > limit:
            raise ValueError(f"max_model_len: {asked} exceeds the model's "
                             f"max_position_embeddings ({limit})")
        return asked

    # -- requests ---------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, priority: int | None = None,
                    output_token_ids: list[int] | None = None) -> Request:
        """``output_token_ids``: tokens already generated elsewhere (a decode instance
        continuing a prefill); they count towards ``max_tokens``. ``priority`` None: the
        config's ``default_priority``."""
        done = list(output_token_ids or [])
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
        self._requests[rid] = req
        self.scheduler.add(req)
        if self.dyntralb is not None:
            self.dyntralb.note_added(req.num_tokens)
        return req

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
        return self.scheduler.has_unfinished or bool(self._saves)

    # -- the step ---------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """One forward pass over what the scheduler picked. On a prefill instance a
        request whose prompt this step completed comes out with its token but not yet
        finished: its prompt's put into the pool follows in ``finish_saves`` (the caller
        sends the tokens first, so the first token does not wait for the put), or at the
        start of the next step."""
        saved = self.finish_saves()
        t_start = time.perf_counter()
        sched = self.scheduler.schedule()
        handed_back = self._handed_back()
        if sched.is_empty:
            self.idle_step()
            return saved + handed_back
        try:
            logits, sample_idx = self.runner.execute(
                sched, hidden=self.proposer is not None and self.proposer.needs_hidden)
            if self.model.load_recorder is not None:
                self.model.load_recorder.end_step(is_prefill=any(
                    n > 1 and r not in sched.drafts
                    for r, n in zip(sched.requests, sched.num_tokens, strict=True)))
        except BaseException:
            # This step's full blocks were made findable by hash before being computed:
            # forget every cached prefix rather than serve one that was never filled.
            self.kv.reset_prefix_cache()
            raise
        self._score_prompts()
        tokens: dict[int, Any] = self._sample(sched, logits, sample_idx)
        saving: set[int] = set()
        if self.connector is not None and self.connector.save_prompts:
            for i in sample_idx:  # these computed their prompt's last token just now
                req = sched.requests[i]
                if not req.kv_keys:  # its prompt (and any tokens it came with) just done
                    # the put reads the blocks after the request may have ended: pin them
                    self._saves.append(_Save(req, [self.kv.block_ids(req, g) for g in
                                                   range(len(self.kv.groups))],
                                             req.num_tokens, self.kv.pin(req)))
                    saving.add(id(req))
        finished = self.scheduler.update(sched, tokens)
        decoding = [n for r, n in zip(sched.requests, sched.num_tokens, strict=True)
                    if n == 1 or r in sched.drafts]
        prompt_tokens = sched.total_tokens - sum(decoding)
        self.step_costs.record(time.perf_counter() - t_start, prompt_tokens, len(decoding))
        for req in finished:
            self._requests.pop(req.request_id, None)
        if self.proposer is not None:
            t_proposer = time.perf_counter()
            ready, k = self._draft_plan()
            if self.proposer.needs_hidden:
                rows, self.runner.last_rows = self.runner.last_rows, None
                if k or not ready:
                    self.proposer.absorb(rows, saving)
                else:  # no drafts next step: the proposer's state has a gap
                    self.proposer.skip(rows)
            if ready and k:
                self._propose(ready, k)
            if self.draft_length is not None:
                t_end = time.perf_counter()
                if ready and k:
                    self.draft_length.record_proposer(len(ready), k, t_end - t_proposer)
                if not prompt_tokens:
                    self.draft_length.record_step(sched.total_tokens, t_proposer - t_start)
        done = {id(r) for r in finished} - saving  # those saving finish with their put
        return saved + [StepOutput(sched.requests[i], tokens[i] if sched.requests[i] in
                                   sched.drafts else [tokens[i]], id(sched.requests[i]) in done)
                        for i in sample_idx] + handed_back

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
            for i, d, tokens in zip(spec, drafts, kept, strict=True):
                self.spec_stats.record(len(d.tokens), len(tokens) - 1)
                if self.draft_length is not None:
                    self.draft_length.record_verified(len(d.tokens), len(tokens) - 1)
                out[i] = tokens
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

    def _draft_plan(self) -> tuple[list[Request], int]:
        """The running requests about to decode whose sampling verification reproduces
        exactly and that the proposer can draft for, and how many drafts each is to
        verify next step (0: none)."""
        spec = self.speculative
        assert spec is not None
        assert self.proposer is not None
        decoding = [r for r in self.scheduler.running
                    if r.num_tokens - r.num_computed_tokens == 1]
        ready = [r for r in decoding if drafts_allowed(r) and self.proposer.can_draft(r)]
        most = spec.disable_by_batch_size
        if not ready or (most is not None and len(self.scheduler.running)
                         + len(self.scheduler.waiting) > most):
            return ready, 0
        k = spec.num_speculative_tokens
        if self.draft_length is not None:
            k = self.draft_length.choose(len(ready), len(decoding) - len(ready))
            # every decision ages the counts, none included: lengths not chosen for a
            # while are asked for again, and their step times measured afresh
            self.draft_length.record_asked(len(ready), k)
        self.spec_stats.draft_length = k
        return ready, k

    def _propose(self, ready: list[Request], k: int) -> None:
        """Up to ``k`` drafts for each of ``ready`` for the next step."""
        assert self.proposer is not None
        proposed = self.proposer.propose(ready, k)
        if self.verify_budget is not None:
            proposed = self.verify_budget.apply(proposed)
        for req, drafts in zip(ready, proposed, strict=True):
            req.drafts = drafts if drafts.tokens else None

    def finish_saves(self) -> list[StepOutput]:
        """Put the prompts the last step completed into the pool; each request comes out
        again (no new token) with its keys set, finished if it ended meanwhile."""
        saves, self._saves = self._saves, []
        try:
            for s in saves:
                t0 = time.monotonic()
                s.request.kv_keys = self.connector.save(s.request, s.tables, s.num_tokens)
                s.request.kv_put_time = (t0, time.monotonic())
        finally:  # (also when a put raised) the blocks go back
            for s in saves:
                self.kv.unpin(s.pinned)
        return [StepOutput(s.request, [], s.request.is_finished) for s in saves]

    def _handed_back(self) -> list[StepOutput]:
        """Requests the recompute scheduler gave up this step: finished, no new token."""
        out = []
        for req in self.scheduler.handed_back:
            self._requests.pop(req.request_id, None)
            out.append(StepOutput(req, [], True))
        self.scheduler.handed_back.clear()
        return out

