#!/usr/bin/env bash
# Generate Python (+ .pyi) for protos/v1/*.proto (and protos/etcd/*.proto, the etcd subset) beside the sources, run from the repo root with
# `-I .` so the code imports as `from protos.v1 import bootstrap_pb2` without patching.
# With --check, regenerate into a temporary tree and fail if anything differs from what is committed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
shopt -s nullglob
protos=(protos/v1/*.proto protos/etcd/*.proto)
[ ${#protos[@]} -gt 0 ] || { echo "no protos"; exit 0; }

generate() {  # $1: output root
  "$PY" -m grpc_tools.protoc -I . --python_out="$1" --pyi_out="$1" --grpc_python_out="$1" "${protos[@]}"
}

if [ "${1:-}" = "--check" ]; then
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  generate "$tmp"
  status=0
  for f in "$tmp"/protos/v1/* "$tmp"/protos/etcd/*; do
    name=${f#"$tmp"/}
    if ! cmp -s "$f" "$name"; then echo "$name is stale: run 'make protos'"; status=1; fi
  done
  for f in protos/v1/*_pb2*.py protos/v1/*_pb2*.pyi protos/etcd/*_pb2*.py protos/etcd/*_pb2*.pyi; do  # generated code whose .proto is gone
    [ -e "$tmp/$f" ] || { echo "$f has no .proto any more: delete it"; status=1; }
  done
  exit $status
fi
generate .
echo "generated: ${protos[*]}"
