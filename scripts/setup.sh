#!/usr/bin/env bash
# Installs everything pdmesh needs into .venv at the repository root, on a fresh Debian
# machine as root: apt packages, the venv, pip packages. Idempotent: a stamp keyed on the
# dependency files skips the work when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv
STAMP=$VENV/.pdmesh-installed
key=$(cat pyproject.toml setup.py requirements/*.txt scripts/setup.sh shared/kernels/cpu_ops.c \
  shared/infra/bindhost.c | sha256sum | cut -d' ' -f1)
# torch-npu's wheel, read (never installed) by the test that checks every torch_npu call
# against the op schemas it ships (tests/shared/kernels/test_device_schemas.py)
NPU_SCHEMAS=.cache/vendor/torch_npu-2.14.0
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$key" ] && ls $NPU_SCHEMAS-*.whl >/dev/null 2>&1
then
  exit 0
fi

apt_pkgs=()
# Mooncake's wheel links libibverbs; redis backs the registry; venv for Debian's python3.
ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1 ' || apt_pkgs+=(libibverbs1)
# ... and its master links libcurl and libnuma
ldconfig -p 2>/dev/null | grep -q 'libcurl.so.4 ' || apt_pkgs+=(libcurl4)
ldconfig -p 2>/dev/null | grep -q 'libnuma.so.1 ' || apt_pkgs+=(libnuma1)
command -v redis-server >/dev/null 2>&1 || apt_pkgs+=(redis-server)
# the registry's TLS test makes its certificates with the openssl command
command -v openssl >/dev/null 2>&1 || apt_pkgs+=(openssl)
python3 -c 'import ensurepip' >/dev/null 2>&1 || apt_pkgs+=(python3-venv)
# tests validate docker-compose.yml offline with `docker-compose config`
command -v docker-compose >/dev/null 2>&1 || apt_pkgs+=(docker-compose)
# and render the Kubernetes overlays with `kubectl kustomize` (any kubectl will do)
command -v kubectl >/dev/null 2>&1 || apt_pkgs+=(kubernetes-client)
# the bind shim (shared/infra/bindhost.c) is compiled at install
command -v cc >/dev/null 2>&1 || apt_pkgs+=(gcc libc6-dev)
if [ ${#apt_pkgs[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "setup: apt-get install ${apt_pkgs[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${apt_pkgs[@]}" >/dev/null
  else
    echo "setup: please install Debian packages: ${apt_pkgs[*]}" >&2
  fi
fi

python3 - <<'PY'
import sys
if sys.version_info < (3, 11):
    sys.exit(f"pdmesh needs Python 3.11+, found {sys.version.split()[0]}")
PY

[ -x $VENV/bin/python ] || python3 -m venv $VENV
PIP="$VENV/bin/pip install --disable-pip-version-check -q"

# Which accelerator stack: npu if the Ascend driver is there, cuda if nvidia-smi is, else cpu.
target=${PDMESH_INSTALL_TARGET:-}
if [ -z "$target" ]; then
  if command -v npu-smi >/dev/null 2>&1; then target=npu
  elif command -v nvidia-smi >/dev/null 2>&1; then target=cuda
  else target=cpu
  fi
fi
echo "setup: installing for $target into $VENV"
if [ "$target" = cpu ]; then
  # Pin the CPU build first, so nothing later can pull a CUDA torch.
  $PIP -r requirements/cpu.txt
fi
$PIP -e ".[$target]" -r requirements/test.txt
ls $NPU_SCHEMAS-*.whl >/dev/null 2>&1 || $VENV/bin/pip download --disable-pip-version-check \
  -q --no-deps -d .cache/vendor "torch-npu==${NPU_SCHEMAS##*-}"
echo "$key" > "$STAMP"
