"""Proto messages <-> the engine's types, and gRPC codes <-> the engine protocol's
``Status``, in one place (the services' gRPC edges and the gateway's clients)."""

from __future__ import annotations

from collections.abc import Iterable

import grpc

from pdmesh.shared.engine.request import Logprob
from pdmesh.shared.engine.sampling_params import SamplingParams
from pdmesh.shared.proto import common_pb2, decode_pb2, prefill_pb2
from pdmesh.shared.runtime.protocol import EngineLoad, Status, SubmitRequest, TokenDelta


def sampling_from_proto(m: common_pb2.SamplingParams) -> SamplingParams:
    """ValueError, naming the field, if the values are out of range."""
    return SamplingParams(
        temperature=m.temperature, top_p=m.top_p, top_k=m.top_k, min_p=m.min_p,
        seed=m.seed if m.HasField("seed") else None,
        presence_penalty=m.presence_penalty, frequency_penalty=m.frequency_penalty,
        repetition_penalty=m.repetition_penalty, stop_token_ids=list(m.stop_token_ids),
        max_tokens=m.max_tokens, min_tokens=m.min_tokens, ignore_eos=m.ignore_eos,
        logprobs=m.logprobs if m.HasField("logprobs") else None,
        prompt_logprobs=m.prompt_logprobs if m.HasField("prompt_logprobs") else None,
        grammar=m.grammar if m.HasField("grammar") else None,
        grammar_after=m.grammar_after if m.HasField("grammar_after") else None,
        logit_bias=dict(m.logit_bias),
        bad_words_token_ids=[list(w.token_ids) for w in m.bad_words_token_ids],
        return_hidden_states=m.return_hidden_states)


def sampling_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    m = common_pb2.SamplingParams(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty, stop_token_ids=p.stop_token_ids,
        max_tokens=p.max_tokens or 0, min_tokens=p.min_tokens, ignore_eos=p.ignore_eos,
        logit_bias=p.logit_bias,
        bad_words_token_ids=[common_pb2.TokenIds(token_ids=w) for w in p.bad_words_token_ids],
        return_hidden_states=p.return_hidden_states)
    if p.grammar is not None:
        m.grammar = p.grammar
    if p.grammar_after is not None:
        m.grammar_after = p.grammar_after
    if p.seed is not None:
        m.seed = p.seed
    if p.logprobs is not None:
        m.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        m.prompt_logprobs = p.prompt_logprobs
    return m


def logprobs_to_proto(lp: dict[int, Logprob]) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(entries=[
        common_pb2.TokenLogprob(token_id=t, logprob=v.logprob, rank=v.rank)
        for t, v in lp.items()])


def logprobs_from_proto(m: common_pb2.TokenLogprobs) -> dict[int, Logprob]:
    return {e.token_id: Logprob(e.logprob, e.rank) for e in m.entries}


def prompt_logprobs_to_proto(lps: list[dict[int, Logprob] | None]
                             ) -> list[common_pb2.TokenLogprobs]:
    """A prompt's logprobs; the first token's None travels as no entries."""
    return [logprobs_to_proto(lp or {}) for lp in lps]


def prompt_logprobs_from_proto(ms: Iterable[common_pb2.TokenLogprobs]
                               ) -> list[dict[int, Logprob] | None]:
    return [logprobs_from_proto(m) if m.entries else None for m in ms]


# -- the engine protocol at the services' gRPC edges ------------------------------------
def grpc_code(status: Status) -> grpc.StatusCode:
    """A refusal's gRPC status: Status names are gRPC's own."""
    return grpc.StatusCode[status.value]


def status_of(code: grpc.StatusCode) -> Status | None:
    """The engine-protocol status a gRPC code stands for (None: no such refusal)."""
    return Status.__members__.get(code.name)


def load_to_proto(load: EngineLoad) -> common_pb2.WorkerLoad:
    return common_pb2.WorkerLoad(running=load.running, waiting=load.waiting,
                                 free_kv_blocks=load.free_kv_blocks,
                                 total_kv_blocks=load.total_kv_blocks,
                                 queued_prefill_tokens=load.queued_prefill_tokens,
                                 stalled_ms=load.stalled_ms)


def submit_from_proto(m: decode_pb2.GenerateRequest | prefill_pb2.PrefillRequest,
                      request_id: str) -> SubmitRequest:
    """ValueError, naming the field, if the sampling values are out of range."""
    return SubmitRequest(request_id, list(m.prompt_token_ids), sampling_from_proto(m.sampling),
                         m.priority if m.HasField("priority") else None,
                         list(m.output_token_ids), lora_name=m.lora_name or None,
                         lora_path=m.lora_path or None)


def fill_chunk(chunk: decode_pb2.GenerateChunk, delta: TokenDelta) -> None:
    chunk.token_ids.extend(delta.token_ids)
    if delta.logprobs:
        chunk.logprobs.extend(logprobs_to_proto(lp) for lp in delta.logprobs)
    if delta.prompt_logprobs:
        chunk.prompt_logprobs.extend(prompt_logprobs_to_proto(delta.prompt_logprobs))
    if delta.finish_reason:
        chunk.finish_reason = delta.finish_reason
    if delta.num_cached_tokens:
        chunk.num_cached_tokens = delta.num_cached_tokens
    if delta.stop_reason is not None:
        chunk.stop_reason = delta.stop_reason
    if delta.hidden_states:
        chunk.hidden_states.extend(delta.hidden_states)


def delta_from_chunk(request_id: str, chunk: decode_pb2.GenerateChunk) -> TokenDelta:
    return TokenDelta(request_id, list(chunk.token_ids), chunk.num_cached_tokens,
                      [logprobs_from_proto(m) for m in chunk.logprobs],
                      chunk.finish_reason or None,
                      chunk.stop_reason if chunk.HasField("stop_reason") else None,
                      prompt_logprobs=prompt_logprobs_from_proto(chunk.prompt_logprobs),
                      hidden_states=list(chunk.hidden_states))
