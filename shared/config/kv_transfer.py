"""``--kv-transfer-config``, read as vLLM's KVTransferConfig and vLLM-Ascend's connectors
read it, then told what pdmesh does with it.

pdmesh moves KV through its Mooncake pool whichever Mooncake connector a line names, so
``kv_connector`` must name one of the Mooncake family (vLLM-Ascend's or vLLM's); another
known connector (NIXL, LMCache, ...) is refused, an unknown name gets a did-you-mean.
``kv_role`` decides the instance's role (checked in ``serve``). The fields that place
vLLM's transfers - ``kv_port``, ``engine_id``, ``kv_rank``, ``kv_ip``,
``kv_parallel_size``, ``kv_buffer_*``, the connector's module path - are read and listed
as without effect (the pool and the registry place the KV). ``kv_load_failure_policy``
(recompute | fail) decides what a failed pool or tier read does. ``kv_connector_extra_config``
is read: its ``prefill`` / ``decode`` ``dp_size`` / ``tp_size`` must be whole numbers >=
1, and an instance whose own side disagrees with its flags is told so; ``load_async``
(vLLM-Ascend's Ascend Store) puts reads beside the steps or inside them,
``consumer_is_to_put`` has a decode instance put each request it finishes (prompt and
answer) into the pool; its other pool keys are listed as without effect (``IDLE_EXTRA``).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

MOONCAKE_CONNECTORS = ("MooncakeConnectorV1", "MooncakeHybridConnector",
                       "MooncakeLayerwiseConnector", "MooncakeConnector",
                       "MooncakeConnectorStoreV1", "MooncakeStoreConnector",
                       "AscendStoreConnector")
OTHER_CONNECTORS = ("NixlConnector", "LMCacheConnectorV1", "LMCacheConnector",
                    "P2pNcclConnector", "SharedStorageConnector", "MultiConnector",
                    "OffloadingConnector", "DecodeBenchConnector", "LLMDataDistCMgrConnector")
PLACEMENT_FIELDS = ("kv_port", "engine_id", "kv_rank", "kv_ip", "kv_parallel_size",
                    "kv_buffer_device", "kv_buffer_size", "kv_connector_module_path",
                    "enable_permute_local_kv")
FIELDS = ("kv_connector", "kv_role", "kv_connector_extra_config", "kv_load_failure_policy",
          *PLACEMENT_FIELDS)
FAILURE_POLICIES = ("recompute", "fail")
# kv_connector_extra_config keys (vLLM-Ascend's Ascend Store) read and told to be
# without effect, and why
IDLE_EXTRA = {"consumer_is_to_load": "a decode instance always reads the prompt's KV from "
                                     "the pool (what it misses it computes)",
              "lookup_rpc_port": "lookups are in-process", "backend": "the pool is Mooncake"}
SIDES = ("prefill", "decode")


def check(kv: Mapping[str, Any], role: str, dp_size: int, tp_size: int) -> list[str]:
    """Warnings for an instance of ``role`` with these sizes; ValueError naming the field
    for a value pdmesh cannot run."""
    unknown = [k for k in kv if k not in FIELDS]
    if unknown:
        close = difflib.get_close_matches(unknown[0], FIELDS, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ValueError(f"--kv-transfer-config: unknown field {unknown[0]!r}{hint}")
    connector = kv.get("kv_connector")
    if connector is not None and connector not in MOONCAKE_CONNECTORS:
        if connector in OTHER_CONNECTORS:
            raise ValueError(f"--kv-transfer-config: kv_connector {connector!r} is not "
                             "supported; pdmesh moves KV through its Mooncake pool (use "
                             f"one of {', '.join(MOONCAKE_CONNECTORS[:2])})")
        close = difflib.get_close_matches(str(connector), MOONCAKE_CONNECTORS
                                          + OTHER_CONNECTORS, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ValueError(f"--kv-transfer-config: kv_connector {connector!r} is not a known "
                         f"connector{hint}")
    policy = kv.get("kv_load_failure_policy", "recompute")
    if policy not in FAILURE_POLICIES:
        raise ValueError(f"--kv-transfer-config: kv_load_failure_policy must be recompute or "
                         f"fail, got {policy!r}")
    extra = kv.get("kv_connector_extra_config", {})
    if not isinstance(extra, Mapping):
        raise ValueError("--kv-transfer-config: kv_connector_extra_config must be an object")
    for name in ("load_async", "consumer_is_to_put"):
        if not isinstance(extra.get(name, False), bool):
            raise ValueError(f"--kv-transfer-config: kv_connector_extra_config.{name} must "
                             f"be true or false, got {extra[name]!r}")
    warnings = [f"--kv-transfer-config: kv_connector_extra_config.{k}: without effect "
                f"({why})" for k, why in IDLE_EXTRA.items() if k in extra]
    if extra.get("consumer_is_to_put") and role != "decode":
        warnings.append("--kv-transfer-config: kv_connector_extra_config.consumer_is_to_put: "
                        f"without effect on a {role} instance (a decode instance, the "
                        "consumer, puts the requests it finishes into the pool)")
    for side in SIDES:
        sizes = extra.get(side)
        if sizes is None:
            continue
        if not isinstance(sizes, Mapping):
            raise ValueError(f"--kv-transfer-config: kv_connector_extra_config.{side} must "
                             "be an object")
        for name in ("dp_size", "tp_size"):
            value = sizes.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"--kv-transfer-config: kv_connector_extra_config.{side}."
                                 f"{name} must be a whole number >= 1, got {value!r}")
        own = {"dp_size": dp_size, "tp_size": tp_size}
        if side == role:
            for name, have in own.items():
                said = sizes.get(name)
                if said is not None and said != have:
                    warnings.append(f"--kv-transfer-config: kv_connector_extra_config.{side}."
                                    f"{name} is {said} but this {role} instance runs "
                                    f"{have} (its flags decide)")
    placement = [k for k in PLACEMENT_FIELDS if k in kv]
    if placement:
        warnings.append("--kv-transfer-config: without effect (pdmesh's Mooncake pool and "
                        f"registry place the KV): {', '.join(placement)}")
    if any(side in extra for side in SIDES):
        warnings.append("--kv-transfer-config: kv_connector_extra_config read; pdmesh's "
                        "pool keys do not depend on the other side's layout")
    return warnings
