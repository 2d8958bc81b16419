"""pdmesh gateway service (built by a later issue; see ../../README.md)."""
