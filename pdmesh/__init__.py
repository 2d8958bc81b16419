"""pdmesh: a prefill/decode-disaggregated LLM serving mesh.

The one import name the distribution installs. The engine as a library, as vLLM's is::

    from pdmesh import LLM, SamplingParams

The code lives in two sub-packages, installed beneath this one (``setup.py`` maps
the repository's ``shared/`` and ``services/`` folders here): ``pdmesh.shared``, the
library every service runs (engine, models, kernels, KV pool, config, runtime,
infrastructure, command-line tools), and ``pdmesh.services``, the five services
(gateway, prefill, decode, kvstore, eplb). ``pdmesh.cli`` is the `pdmesh` command.
"""

from __future__ import annotations

import importlib
import os

# Every pdmesh process starts its children with fork + exec (subprocess, multiprocessing's
# "spawn"), never a fork that goes on running gRPC. gRPC's fork support (on by default in
# its core since 1.81) restarts its poller in the child between fork and exec, where
# subprocess has closed the poller's epoll fd: the child can die or hang before exec
# (grpc/grpc#43055; seen here as a DP rank that never started). Off unless set.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

# A source checkout that is not the installed copy (a second worktree, say): shared/
# and services/ sit beside this folder, not inside it, so look for them there too.
_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not os.path.isdir(os.path.join(os.path.dirname(__file__), "shared")) and os.path.isfile(
        os.path.join(_root, "shared", "__init__.py")):
    __path__.append(_root)

# Loaded on first use (PEP 562), so `import pdmesh` stays cheap (no torch).
_EXPORTS = {
    "LLM": "pdmesh.shared.engine.llm",
    "CompletionOutput": "pdmesh.shared.engine.llm",
    "RequestOutput": "pdmesh.shared.engine.llm",
    "SamplingParams": "pdmesh.shared.engine.sampling_params",
    "EngineConfig": "pdmesh.shared.engine.config",
}

__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pdmesh' has no attribute {name!r}")


__all__ = ["LLM", "CompletionOutput", "EngineConfig", "RequestOutput", "SamplingParams"]
