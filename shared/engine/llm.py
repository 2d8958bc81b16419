"""The offline API, shaped like vLLM's so its users already know it.

    llm = LLM(model="path/to/folder", device="cpu")
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=32))
    outs[0].outputs[0].text, .token_ids, .finish_reason, .logprobs
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdmesh.shared.engine.build import build_engine
from pdmesh.shared.engine.config import EngineConfig
from pdmesh.shared.engine.generation_defaults import default_sampling
from pdmesh.shared.engine.lora_request import LoRARequest
from pdmesh.shared.engine.pooling import PoolingParams
from pdmesh.shared.engine.request import Logprob, Request
from pdmesh.shared.engine.sampling_params import SamplingParams
from pdmesh.shared.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)

Prompt = str | list[int]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)
    # one per prompt token (the first: None), when prompt_logprobs asked for them
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


class LLM:
    def __init__(self, model: str, *, tokenizer: str | None = None,
                 generation_config: str = "auto",
                 override_generation_config: dict[str, Any] | None = None,
                 **engine_args: Any):
        """``engine_args``: EngineConfig's fields (``device``, ``dtype``, ``seed``,
        ``block_size``, ``max_model_len``, ``max_num_seqs``, ``max_num_batched_tokens``,
        ``enable_prefix_caching``, ``gpu_memory_utilization``, ``speculative_config``,
        ...), each defaulting as EngineConfig does: its fields are the one home of the
        engine's defaults (the flag table reads them too). A TypeError names an unknown
        one, as vLLM's LLM passes its extra keyword arguments to the engine.
        ``generation_config`` / ``override_generation_config``: where ``generate``'s
        default sampling parameters come from, as vLLM's (auto: the model's
        generation_config.json; vllm: none; a folder's)."""
        self._defaults, said = default_sampling(model, generation_config,
                                                override_generation_config)
        for warning in said:
            log.warning("%s", warning)
        self.engine = build_engine(EngineConfig(model=model, tokenizer=tokenizer,
                                                **engine_args))
        self.tokenizer = Tokenizer(tokenizer or model)

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` samples with when given no SamplingParams: the generation
        config's fields over SamplingParams' own defaults, as vLLM's LLM."""
        return SamplingParams(**self._defaults)

    def close(self) -> None:
        """Stop the processes the engine started beside this one (tensor-parallel ranks);
        nothing to do otherwise."""
        self.engine.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. Every prompt is validated before any
        runs, so a bad one raises ValueError and nothing is left half-done.
        ``lora_request``: the LoRA adapter every prompt runs, or one per prompt (None:
        the base model), as vLLM's (the engine needs ``enable_lora=True``)."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompt_list)
        else:
            params = list(sampling_params)
            if len(params) != len(prompt_list):
                raise ValueError(f"sampling_params: {len(params)} given for "
                                 f"{len(prompt_list)} prompts")
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"priority: {len(priority)} given for {len(prompt_list)} prompts")
        loras = _per_prompt(lora_request, len(prompt_list))
        token_lists = [self._tokenize(p, i) for i, p in enumerate(prompt_list)]
        for toks, sp in zip(token_lists, params, strict=True):
            self.engine.validate_request(toks, sp)
        for lora in dict.fromkeys(r for r in loras if r is not None):
            self.engine.lora_root(lora)  # (read now: a bad adapter fails before any runs)

        reqs: list[Request] = []
        try:
            for i, (toks, sp) in enumerate(zip(token_lists, params, strict=True)):
                prio = priority[i] if priority is not None else None
                reqs.append(self.engine.add_request(toks, sp, priority=prio,
                                                    lora_request=loras[i]))
            while self.engine.has_unfinished():
                self.engine.step()
        finally:
            for r in reqs:  # on an interrupt, leave no request holding KV blocks
                if not r.is_finished:
                    self.engine.abort(r.request_id)
        return [self._output(r, p) for r, p in zip(reqs, prompt_list, strict=True)]

    def embed(self, prompts: Prompt | Sequence[Prompt],
              pooling_params: PoolingParams | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in order (an engine built with
        ``runner="pooling"``, as vLLM's ``LLM.embed``); ``pooling_params``: dimensions,
        use_activation (normalizing) over the model's pooling. Every prompt is checked
        before any runs."""
        engine = self.engine
        params = pooling_params or PoolingParams()
        engine.check_runner(params)
        token_lists = [self._tokenize(p, i) for i, p in enumerate(_as_prompt_list(prompts))]
        assert engine.pooling is not None  # (check_runner)
        params.over(engine.pooling).validate(engine.model_config.hidden_size,
                                             engine.matryoshka)
        for toks in token_lists:
            engine.validate_request(toks, SamplingParams(max_tokens=1))
        reqs: list[Request] = []
        try:
            for toks in token_lists:
                reqs.append(engine.add_request(toks, SamplingParams(), pooling=params))
            while engine.has_unfinished():
                engine.step()
        finally:
            for r in reqs:
                if not r.is_finished:
                    engine.abort(r.request_id)
        return [EmbeddingRequestOutput(r.request_id, list(r.prompt_token_ids),
                                       EmbeddingOutput(list(r.embedding or [])))
                for r in reqs]

    def _tokenize(self, prompt: Prompt, index: int) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list | tuple) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise ValueError(f"prompts[{index}]: must be a string or a list of token ids")

    def _output(self, req: Request, prompt: Prompt) -> RequestOutput:
        sp = req.sampling_params
        ids = req.output_token_ids
        logprobs = None
        cumulative = None
        if sp.logprobs is not None:
            logprobs = req.logprobs
            self._decode_tokens(logprobs)
            cumulative = sum(step[t].logprob for step, t in zip(logprobs, ids, strict=False))
        completion = CompletionOutput(
            index=0,
            text=self.tokenizer.decode_answer(ids, skip_special_tokens=sp.skip_special_tokens),
            token_ids=list(ids),
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            logprobs=logprobs,
            cumulative_logprob=cumulative,
        )
        return RequestOutput(
            request_id=req.request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=list(req.prompt_token_ids),
            outputs=[completion],
            num_cached_tokens=max(req.num_cached_tokens, 0),
            prompt_logprobs=None if sp.prompt_logprobs is None
            else self._decode_tokens(req.prompt_logprobs),
        )

    def _decode_tokens(self, steps: list[dict[int, Logprob] | None]
                       ) -> list[dict[int, Logprob] | None]:
        """``steps`` with each entry's decoded_token set."""
        for step in steps:
            for tid, lp in (step or {}).items():
                lp.decoded_token = self.tokenizer.id_to_token(tid)
        return steps


def _per_prompt(lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                count: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    loras = list(lora_request)
    if len(loras) != count:
        raise ValueError(f"lora_request: {len(loras)} given for {count} prompts")
    return loras


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list | tuple) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # one prompt given as token ids
    if isinstance(prompts, list | tuple):
        if not prompts:
            raise ValueError("prompts: at least one prompt is required")
        return list(prompts)
    raise ValueError("prompts: must be a string, a list of token ids, or a list of those")
