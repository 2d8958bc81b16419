#!/usr/bin/env bash
# Builds the one pdmesh image (deploy/Dockerfile) without a network inside the build:
# a wheelhouse made here on the host (.cache/wheelhouse: pdmesh and every dependency,
# torch pinned for cpu) is installed in the image with `pip install --no-index`, as an
# air-gapped Ascend cluster installs.
#
#   scripts/image.sh                  # BASE=python:3.11-slim-bookworm, TARGET=cpu
#   BASE=debian TAG=pdmesh:cpu scripts/image.sh
#   BASE=<CANN image with python 3.11> TARGET=npu TAG=pdmesh:npu scripts/image.sh
#
# BASE=debian builds the base here from Debian's packages with debootstrap (no registry:
# Docker Hub unreachable), with python3, Mooncake's libraries and redis-server, imported as
# pdmesh-base:bookworm (kept: built once per machine). Any other BASE is an image the
# daemon has or can pull; it needs Python 3.11 and either Mooncake's libraries
# (libibverbs1, libcurl4, libnuma1) or a reachable Debian mirror.
#
# Environment: BASE, TARGET (cpu | npu | cuda), TAG (default pdmesh:$TARGET),
# DEBIAN_MIRROR (debootstrap's, default http://deb.debian.org/debian).
set -euo pipefail
cd "$(dirname "$0")/.."

BASE=${BASE:-python:3.11-slim-bookworm}
TARGET=${TARGET:-cpu}
TAG=${TAG:-pdmesh:$TARGET}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
WHEELS=.cache/wheelhouse
PY=${PY:-.venv/bin/python}

case "$TARGET" in cpu|npu|cuda) ;; *) echo "image: TARGET must be cpu, npu or cuda, not '$TARGET'" >&2; exit 2;; esac
command -v docker >/dev/null || { echo "image: the docker command is missing" >&2; exit 2; }
docker info >/dev/null 2>&1 || { echo "image: no Docker daemon answers (start dockerd)" >&2; exit 2; }

# -- the base -------------------------------------------------------------------------------
if [ "$BASE" = debian ]; then
  BASE=pdmesh-base:bookworm
  if ! docker image inspect $BASE >/dev/null 2>&1; then
    command -v debootstrap >/dev/null || { echo "image: BASE=debian needs debootstrap" >&2; exit 2; }
    root=$(mktemp -d /tmp/pdmesh-rootfs.XXXXXX)
    trap 'rm -rf "$root"' EXIT
    echo "image: debootstrap bookworm into $root"
    debootstrap --variant=minbase \
      --include=python3,python3-venv,libibverbs1,libcurl4,libnuma1,redis-server,ca-certificates \
      bookworm "$root" "$MIRROR" >/dev/null
    rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/archives/*.deb
    tar -C "$root" -c . | docker import -c 'ENV LANG=C.UTF-8' - $BASE >/dev/null
  fi
fi

# -- the wheelhouse -------------------------------------------------------------------------
# Resolved by the base's own Python (dependencies' markers follow its exact version), in a
# throwaway container of the base on the host's network, with this host's find-links
# folder (where the CPU torch lies) and index settings; pdmesh's own wheel built here.
mkdir -p $WHEELS
rm -f $WHEELS/pdmesh-*.whl
$PY -m pip wheel -q --disable-pip-version-check --no-deps --wheel-dir $WHEELS .
key=$( (cat pyproject.toml setup.py requirements/*.txt; echo "$TARGET $BASE") | sha256sum | cut -d' ' -f1)
if [ "$(cat $WHEELS/.key 2>/dev/null)" != "$key" ]; then
  echo "image: wheelhouse for $TARGET on $BASE in $WHEELS"
  find $WHEELS -name '*.whl' ! -name 'pdmesh-*' -delete
  pins=""
  [ "$TARGET" = cpu ] && pins="-r /src/requirements/cpu.txt"  # the CPU torch, never a CUDA one
  find_links="${PIP_FIND_LINKS:-} $($PY -m pip config get global.find-links 2>/dev/null || true)"
  links=()
  for d in $find_links; do
    [ -d "$d" ] && links+=(-v "$d:$d:ro")
  done
  cert=${PIP_CERT:-$($PY -m pip config get global.cert 2>/dev/null || true)}
  [ -f "$cert" ] && links+=(-v "$cert:/etc/pdmesh-pip-ca.pem:ro" -e PIP_CERT=/etc/pdmesh-pip-ca.pem)
  docker run --rm --network host -v "$PWD/requirements:/src/requirements:ro" \
    -v "$PWD/$WHEELS:/wheels" "${links[@]}" \
    -e PIP_FIND_LINKS="/wheels $find_links" \
    -e PIP_INDEX_URL="${PIP_INDEX_URL:-$($PY -m pip config get global.index-url 2>/dev/null || true)}" \
    -e PIP_DISABLE_PIP_VERSION_CHECK=1 "$BASE" sh -ec "
      python3 -m venv /tmp/v && /tmp/v/bin/pip wheel -q --wheel-dir /wheels $pins 'pdmesh[$TARGET]'
      chown -R $(id -u):$(id -g) /wheels"
  echo "$key" > $WHEELS/.key
fi

echo "image: building $TAG from $BASE"
docker build -q -f deploy/Dockerfile --build-arg BASE="$BASE" --build-arg TARGET="$TARGET" \
  -t "$TAG" . >/dev/null
docker image prune -f --filter label=pdmesh.stage=build >/dev/null  # the build stage
echo "image: $TAG"
