"""The instances a proxy line names, in place of the registry: vLLM-Ascend's PD proxy
(``--prefiller-hosts/--prefiller-ports``, ``--decoder-hosts/--decoder-ports``) dials the
P and D nodes it is given, not whatever the registry lists. Each named instance is asked
for its health (role, model, load) at every refresh, all at once; one that does not
answer is left out, as an instance whose registry key expired is, until it answers
again."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import grpc

from pdmesh.shared.infra import cluster_auth
from pdmesh.shared.infra.registry import Instance
from pdmesh.shared.proto import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

HEALTH_TIMEOUT_S = 1.0


class NamedInstances:
    """What the Router reads instead of a Registry: ``instances(role, model)``."""

    ttl_ms = 2000  # (the Router's grace after a failed refresh; none fail here)

    def __init__(self, prefill: Sequence[str], decode: Sequence[str]):
        """``prefill``, ``decode``: host:port of each instance's gRPC port (a mixed
        instance among the decode ones)."""
        for flag, addresses in (("--prefill-addresses", prefill),
                                ("--decode-addresses", decode)):
            for address in addresses:
                host, _, port = address.rpartition(":")
                if not host or not port.isdigit():
                    raise ValueError(f"{flag}: {address!r} is not host:port")
        self.addresses = [*prefill, *decode]
        self._stubs = [(a, prefill_pb2_grpc.PrefillStub(cluster_auth.channel(a)))
                       for a in prefill]
        self._stubs += [(a, decode_pb2_grpc.DecodeStub(cluster_auth.channel(a)))
                        for a in decode]
        self._adapters: dict[str, str] = {}  # (no registry: the LoRA adapters kept here)

    def put_adapter(self, name: str, path: str) -> bool:
        if name in self._adapters:
            return False
        self._adapters[name] = path
        return True

    def remove_adapter(self, name: str) -> bool:
        return self._adapters.pop(name, None) is not None

    def adapters(self) -> dict[str, str]:
        return dict(self._adapters)

    def health(self) -> list[tuple[str, common_pb2.HealthResponse]]:
        """(address, its health) of each named instance that answers, asked all at once."""
        asked = [(address, stub.Health.future(common_pb2.HealthRequest(),
                                              timeout=HEALTH_TIMEOUT_S,
                                              metadata=cluster_auth.call_metadata() or None))
                 for address, stub in self._stubs]
        out = []
        for address, future in asked:
            try:
                out.append((address, future.result()))
            except grpc.RpcError:  # not up (yet), or gone: left out until it answers
                continue
        return out

    def instances(self, role: str | None = None, model: str | None = None) -> list[Instance]:
        now = time.time()
        out = []
        for address, h in self.health():
            inst = Instance(id=address, role=h.role, address=address, model=h.model,
                            load={f.name: int(getattr(h.load, f.name))
                                  for f in h.load.DESCRIPTOR.fields},
                            heartbeat=now, draining=not h.serving,
                            runner=h.runner or "generate",
                            adapters=tuple(h.lora_adapters))
            if (role is None or inst.role == role) and (model is None or inst.model == model):
                out.append(inst)
        return out

    def model(self, wait_s: float) -> tuple[str, str]:
        """(the model folder, the served name) of the first named instance that answers
        with a folder that is here, within ``wait_s``; ValueError naming --model if none
        does."""
        deadline = time.monotonic() + wait_s
        while True:
            for _, h in self.health():
                if h.model_path and os.path.isdir(h.model_path):
                    return h.model_path, h.model
            if time.monotonic() >= deadline:
                raise ValueError(
                    "--model: pdmesh's gateway tokenizes, so it needs the model's folder; "
                    f"none of the named instances ({', '.join(self.addresses)}) answered "
                    f"within {wait_s:g} s with a folder that is here - give --model PATH")
            time.sleep(0.5)
