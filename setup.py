"""Package layout only (everything else is in pyproject.toml): the repository keeps the
design's top-level folders, and the distribution installs them under one name,

    pdmesh/    -> pdmesh             (the `pdmesh` command, the public imports)
    shared/    -> pdmesh.shared      (engine library, config, runtime, infra, cli tools)
    services/  -> pdmesh.services    (gateway, prefill, decode, kvstore, eplb)
"""

from setuptools import find_packages, setup

FOLDERS = {"pdmesh": "pdmesh", "pdmesh.shared": "shared", "pdmesh.services": "services"}


def packages() -> list[str]:
    found = ["pdmesh"]
    for name in ("shared", "services"):
        found += [f"pdmesh.{p}" for p in find_packages(include=[name, f"{name}.*"])]
    return found


setup(packages=packages(), package_dir=FOLDERS)
