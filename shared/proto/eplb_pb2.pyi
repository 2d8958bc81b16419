from pdmesh.shared.proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class LoadReport(_message.Message):
    __slots__ = ("group", "dp_rank", "dp_size", "num_layers", "num_experts", "num_slots", "counts", "step", "placement_version", "eplb_policy_type", "stage_counts", "stage_steps", "decide_round")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    DP_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    EPLB_POLICY_TYPE_FIELD_NUMBER: _ClassVar[int]
    STAGE_COUNTS_FIELD_NUMBER: _ClassVar[int]
    STAGE_STEPS_FIELD_NUMBER: _ClassVar[int]
    DECIDE_ROUND_FIELD_NUMBER: _ClassVar[int]
    group: str
    dp_rank: int
    dp_size: int
    num_layers: int
    num_experts: int
    num_slots: int
    counts: _containers.RepeatedScalarFieldContainer[int]
    step: int
    placement_version: int
    eplb_policy_type: int
    stage_counts: _containers.RepeatedScalarFieldContainer[int]
    stage_steps: int
    decide_round: int
    def __init__(self, group: _Optional[str] = ..., dp_rank: _Optional[int] = ..., dp_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_experts: _Optional[int] = ..., num_slots: _Optional[int] = ..., counts: _Optional[_Iterable[int]] = ..., step: _Optional[int] = ..., placement_version: _Optional[int] = ..., eplb_policy_type: _Optional[int] = ..., stage_counts: _Optional[_Iterable[int]] = ..., stage_steps: _Optional[int] = ..., decide_round: _Optional[int] = ...) -> None: ...

class ReportAck(_message.Message):
    __slots__ = ("placement_version",)
    PLACEMENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    placement_version: int
    def __init__(self, placement_version: _Optional[int] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("group",)
    GROUP_FIELD_NUMBER: _ClassVar[int]
    group: str
    def __init__(self, group: _Optional[str] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("group", "version", "num_layers", "num_slots", "phy2log", "balancedness_before", "balancedness_after")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    PHY2LOG_FIELD_NUMBER: _ClassVar[int]
    BALANCEDNESS_BEFORE_FIELD_NUMBER: _ClassVar[int]
    BALANCEDNESS_AFTER_FIELD_NUMBER: _ClassVar[int]
    group: str
    version: int
    num_layers: int
    num_slots: int
    phy2log: _containers.RepeatedScalarFieldContainer[int]
    balancedness_before: _containers.RepeatedScalarFieldContainer[float]
    balancedness_after: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, group: _Optional[str] = ..., version: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_slots: _Optional[int] = ..., phy2log: _Optional[_Iterable[int]] = ..., balancedness_before: _Optional[_Iterable[float]] = ..., balancedness_after: _Optional[_Iterable[float]] = ...) -> None: ...

class RebalanceRequest(_message.Message):
    __slots__ = ("group", "force")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    group: str
    force: bool
    def __init__(self, group: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("group",)
    GROUP_FIELD_NUMBER: _ClassVar[int]
    group: str
    def __init__(self, group: _Optional[str] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("version", "balancedness", "reports", "ranks_reporting", "dp_size", "num_layers", "num_experts", "num_slots", "decisions", "proposed_balancedness")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BALANCEDNESS_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    RANKS_REPORTING_FIELD_NUMBER: _ClassVar[int]
    DP_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_BALANCEDNESS_FIELD_NUMBER: _ClassVar[int]
    version: int
    balancedness: _containers.RepeatedScalarFieldContainer[float]
    reports: int
    ranks_reporting: _containers.RepeatedScalarFieldContainer[int]
    dp_size: int
    num_layers: int
    num_experts: int
    num_slots: int
    decisions: int
    proposed_balancedness: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, version: _Optional[int] = ..., balancedness: _Optional[_Iterable[float]] = ..., reports: _Optional[int] = ..., ranks_reporting: _Optional[_Iterable[int]] = ..., dp_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_experts: _Optional[int] = ..., num_slots: _Optional[int] = ..., decisions: _Optional[int] = ..., proposed_balancedness: _Optional[_Iterable[float]] = ...) -> None: ...
