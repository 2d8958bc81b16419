"""The engine protocol at the gRPC edges: what the gateway leaves unset stays unset."""

from __future__ import annotations

import pytest

from pdmesh.shared.engine.sampling_params import SamplingParams
from pdmesh.shared.proto import decode_pb2, prefill_pb2
from pdmesh.shared.proto.convert import sampling_to_proto, submit_from_proto


@pytest.mark.parametrize("message", [decode_pb2.GenerateRequest, prefill_pb2.PrefillRequest])
@pytest.mark.parametrize("priority", [None, 0, -3, 7])
def test_priority_given_or_not_survives_the_wire(message, priority):
    """A request without a priority reaches the engine as None (it takes the engine's
    --default-priority-value); 0 given is 0."""
    sent = message(request_id="r", prompt_token_ids=[1, 2],
                   sampling=sampling_to_proto(SamplingParams(max_tokens=2)), priority=priority)
    got = submit_from_proto(message.FromString(sent.SerializeToString()), "r")
    assert got.priority == priority
