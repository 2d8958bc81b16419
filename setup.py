"""Package layout only (everything else is in pyproject.toml): the repository keeps the
design's top-level folders, and the distribution installs them under one name,

    pdmesh/    -> pdmesh             (the `pdmesh` command, the public imports)
    shared/    -> pdmesh.shared      (engine library, config, runtime, infra, cli tools)
    services/  -> pdmesh.services    (gateway, prefill, decode, kvstore, eplb)

so site-packages gains one package, not generic top-level ones named ``shared`` and
``services``. The price: the tree is not laid out as it is installed, and a tool that
reads it resolves ``pdmesh.shared.X`` to ``shared/X`` (``pdmesh.services.X`` to
``services/X``) by this one rule. FOLDERS below is the mapping (package_dir; an editable
install copies it into its finder); ``pdmesh/__init__.py`` applies it to a checkout that
is not the installed one, and ``tests/test_layering.py`` to its ``ast`` reader.
docs/architecture.md ("The packages") says why the folders stay where they are.
"""

from setuptools import Extension, find_packages, setup

FOLDERS = {"pdmesh": "pdmesh", "pdmesh.shared": "shared", "pdmesh.services": "services"}


def packages() -> list[str]:
    found = ["pdmesh"]
    for name in ("shared", "services"):
        found += [f"pdmesh.{p}" for p in find_packages(include=[name, f"{name}.*"])]
    return found


# Not a Python module: a preload library that binds native listeners to --host
# (shared/infra/bindhost.py). Optional: without a C compiler pdmesh installs without it
# and says so when a service starts.
BIND_SHIM = Extension("pdmesh.shared.infra._bindhost", ["shared/infra/bindhost.c"],
                      libraries=["dl"], optional=True)

# Not a Python module either: small C kernels the cpu backend calls through ctypes
# (shared/kernels/cpu_ops.py). Optional too: without them it runs the same math as torch ops.
# OpenMP: loaded after torch, it binds to the libgomp torch has loaded (one thread pool);
# no fused multiply-add contraction, so activations round exactly as torch rounds them.
CPU_OPS = Extension("pdmesh.shared.kernels._cpu_ops", ["shared/kernels/cpu_ops.c"],
                    extra_compile_args=["-fopenmp", "-ffp-contract=off"],
                    extra_link_args=["-fopenmp"],
                    optional=True)

setup(packages=packages(), package_dir=FOLDERS, ext_modules=[BIND_SHIM, CPU_OPS])
