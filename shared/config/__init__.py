"""vLLM-Ascend's ``--additional-config``, parsed more strictly than vLLM-Ascend does.

``parse_additional_config`` turns the flag's JSON (plus the deprecated environment
variables and the engine flags) into a frozen, fully resolved ``AdditionalConfig``, or
raises one ``ConfigError`` listing every unknown key (with the closest valid one), bad
value and forbidden combination. Layout: ``schema`` / ``scheduler_schema`` /
``feature_schema`` declare the keys, ``legacy`` the old spellings, ``reader`` checks
values, ``rules`` checks combinations, ``parse`` ties them together.
"""

from pdmesh.shared.config.engine_args import EngineArgs
from pdmesh.shared.config.errors import ConfigError, ConfigProblem
from pdmesh.shared.config.parse import parse_additional_config
from pdmesh.shared.config.schema import AdditionalConfig

__all__ = [
    "AdditionalConfig",
    "ConfigError",
    "ConfigProblem",
    "EngineArgs",
    "parse_additional_config",
]
