"""`pdmesh` commands that are not services: `up` / `serve` (the mesh as local
processes), `status`, `health`, `config check`, `generate`, `make-tiny-model`,
`quantize` and the benchmarks. The command table itself is ``pdmesh.cli``."""
