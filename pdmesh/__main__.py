"""``python -m pdmesh``: the `pdmesh` command."""

from pdmesh.cli import entry

entry()
