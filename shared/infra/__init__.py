"""Infrastructure every service shares: the redis registry, signal handling, starting
child processes, logs, Prometheus metrics, OpenTelemetry tracing, addresses and the bind
shim that keeps native listeners on --host."""
