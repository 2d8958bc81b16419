"""The library every pdmesh service runs, installed as ``pdmesh.shared``. By role:

engine library   ``engine`` (paged KV cache, scheduling, the offline ``LLM``), ``models``,
                 ``kernels`` (cpu / cuda / npu), ``kvpool`` (Mooncake and in-process
                 pools), ``parallel`` (expert parallelism, EPLB's rank side and algorithm)
training         ``training``: the tiny models' trainers (they run the engine)
configuration    ``config``: the flag table, flags -> ServeConfig, --additional-config
contracts        ``proto``: the gRPC protos and their stubs
runtime          ``runtime``: the engine protocol, EngineClient, the engine loop, the gRPC
                 edge, ServiceHost, the proto conversions - what turns the engine into a
                 service
infrastructure   ``infra``: registry, signals, process launcher, logs, metrics, tracing,
                 addresses and the bind shim
cli              ``cli``: `pdmesh up` / `serve`, status, health, config check, generate,
                 make-tiny-model, quantize, the benchmarks

Nothing here imports ``pdmesh.services``: the services build on this, not the other way.
The packages are layers, each importing only those before it: kernels, infra, proto,
parallel, models, kvpool, engine, training, config, runtime, cli (tests/test_layering.py).
"""
