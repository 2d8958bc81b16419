#!/usr/bin/env bash
# Starts a local redis on 127.0.0.1:6379 unless one already answers there.
set -euo pipefail
if (exec 3<>/dev/tcp/127.0.0.1/6379) 2>/dev/null; then
  exit 0
fi
echo "starting redis-server on 127.0.0.1:6379"
redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
  --dir /tmp --logfile /tmp/pdmesh-redis.log
for _ in $(seq 50); do
  (exec 3<>/dev/tcp/127.0.0.1/6379) 2>/dev/null && exit 0
  sleep 0.1
done
echo "redis did not come up" >&2
exit 1
