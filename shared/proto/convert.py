"""Proto messages <-> the engine's dataclasses, in one place (the services' edges)."""

from __future__ import annotations

from pdmesh.shared.engine.request import Logprob
from pdmesh.shared.engine.sampling_params import SamplingParams
from pdmesh.shared.proto import common_pb2


def sampling_from_proto(m: common_pb2.SamplingParams) -> SamplingParams:
    """ValueError, naming the field, if the values are out of range."""
    return SamplingParams(
        temperature=m.temperature, top_p=m.top_p, top_k=m.top_k, min_p=m.min_p,
        seed=m.seed if m.HasField("seed") else None,
        presence_penalty=m.presence_penalty, frequency_penalty=m.frequency_penalty,
        repetition_penalty=m.repetition_penalty, stop_token_ids=list(m.stop_token_ids),
        max_tokens=m.max_tokens, min_tokens=m.min_tokens, ignore_eos=m.ignore_eos,
        logprobs=m.logprobs if m.HasField("logprobs") else None)


def sampling_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    m = common_pb2.SamplingParams(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty, stop_token_ids=p.stop_token_ids,
        max_tokens=p.max_tokens or 0, min_tokens=p.min_tokens, ignore_eos=p.ignore_eos)
    if p.seed is not None:
        m.seed = p.seed
    if p.logprobs is not None:
        m.logprobs = p.logprobs
    return m


def logprobs_to_proto(lp: dict[int, Logprob]) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(entries=[
        common_pb2.TokenLogprob(token_id=t, logprob=v.logprob, rank=v.rank)
        for t, v in lp.items()])


def logprobs_from_proto(m: common_pb2.TokenLogprobs) -> dict[int, Logprob]:
    return {e.token_id: Logprob(e.logprob, e.rank) for e in m.entries}
