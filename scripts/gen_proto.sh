#!/usr/bin/env bash
# Regenerates the gRPC stubs in shared/proto from its .proto files. The repository's
# shared/ is installed as pdmesh.shared, so the protos are compiled from a staging root
# where shared/proto sits at pdmesh/shared/proto: the stubs then import
# `pdmesh.shared.proto.*`. Usage: gen_proto.sh [PYTHON] [OUT_ROOT]
set -euo pipefail
cd "$(dirname "$0")/.."
py=${1:-.venv/bin/python}
PY="$(cd "$(dirname "$py")" && pwd)/$(basename "$py")"  # absolute, the venv's own (not resolved)
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/pdmesh/shared/proto"
cp shared/proto/*.proto "$stage/pdmesh/shared/proto/"
(cd "$stage" && "$PY" -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. \
   --pyi_out=. pdmesh/shared/proto/*.proto)
out=$(cd "${2:-shared/proto}" && pwd)
cp "$stage"/pdmesh/shared/proto/*_pb2*.py* "$out/"
