"""The engine protocol at the gRPC edges: what the gateway leaves unset stays unset."""

from __future__ import annotations

import pytest

from pdmesh.shared.engine.request import Logprob
from pdmesh.shared.engine.sampling_params import SamplingParams
from pdmesh.shared.proto import common_pb2, decode_pb2, prefill_pb2
from pdmesh.shared.runtime.proto_convert import (
    delta_from_chunk,
    fill_chunk,
    sampling_from_proto,
    sampling_to_proto,
    submit_from_proto,
)
from pdmesh.shared.runtime.protocol import TokenDelta


@pytest.mark.parametrize("message", [decode_pb2.GenerateRequest, prefill_pb2.PrefillRequest])
@pytest.mark.parametrize("priority", [None, 0, -3, 7])
def test_priority_given_or_not_survives_the_wire(message, priority):
    """A request without a priority reaches the engine as None (it takes the engine's
    --default-priority-value); 0 given is 0."""
    sent = message(request_id="r", prompt_token_ids=[1, 2],
                   sampling=sampling_to_proto(SamplingParams(max_tokens=2)), priority=priority)
    got = submit_from_proto(message.FromString(sent.SerializeToString()), "r")
    assert got.priority == priority


def test_bad_words_survive_the_wire():
    sp = SamplingParams(max_tokens=2, bad_words_token_ids=[[5], [7, 8, 9]])
    got = submit_from_proto(prefill_pb2.PrefillRequest.FromString(prefill_pb2.PrefillRequest(
        request_id="r", prompt_token_ids=[1], sampling=sampling_to_proto(sp))
        .SerializeToString()), "r")
    assert got.sampling.bad_words_token_ids == [[5], [7, 8, 9]]


def test_a_grammar_and_where_it_binds_survive_the_wire():
    sp = SamplingParams(max_tokens=2, grammar="start: /a/", grammar_after="</think>")
    got = sampling_from_proto(common_pb2.SamplingParams.FromString(
        sampling_to_proto(sp).SerializeToString()))
    assert (got.grammar, got.grammar_after) == ("start: /a/", "</think>")
    plain = sampling_from_proto(sampling_to_proto(SamplingParams(max_tokens=2)))
    assert (plain.grammar, plain.grammar_after) == (None, None)


def test_prompt_logprobs_survive_the_wire():
    """Asked for in the sampling; answered in a chunk, the first token's None included."""
    sp = sampling_from_proto(common_pb2.SamplingParams.FromString(sampling_to_proto(
        SamplingParams(max_tokens=2, prompt_logprobs=3)).SerializeToString()))
    assert sp.prompt_logprobs == 3
    assert sampling_from_proto(sampling_to_proto(SamplingParams())).prompt_logprobs is None
    lps = [None, {5: Logprob(-1.5, 2), 7: Logprob(-0.25, 1)}]
    chunk = decode_pb2.GenerateChunk()
    fill_chunk(chunk, TokenDelta("r", [9], prompt_logprobs=lps))
    got = delta_from_chunk("r", decode_pb2.GenerateChunk.FromString(chunk.SerializeToString()))
    assert got.prompt_logprobs == lps
    later = decode_pb2.GenerateChunk()
    fill_chunk(later, TokenDelta("r", [10]))
    assert delta_from_chunk("r", later).prompt_logprobs == []
