"""The library every pdmesh service runs, installed as ``pdmesh.shared``. By role:

engine library   ``engine`` (paged KV cache, scheduling, the offline ``LLM``), ``models``,
                 ``kernels`` (cpu / cuda / npu), ``kvpool`` (Mooncake and in-process
                 pools), ``parallel`` (expert parallelism, EPLB's rank side and algorithm)
configuration    ``config``: the flag table, flags -> ServeConfig, --additional-config
contracts        ``proto``: the gRPC protos, their stubs and conversions
runtime          ``runtime``: the engine protocol, EngineClient, the engine loop, the gRPC
                 edge, ServiceHost - what turns the engine into a service
infrastructure   ``infra``: registry, signals, process launcher, logs, metrics, tracing,
                 addresses and the bind shim
cli              ``cli``: `pdmesh up` / `serve`, status, health, config check, generate,
                 the benchmarks

Nothing here imports ``pdmesh.services``: the services build on this, not the other way.
"""
