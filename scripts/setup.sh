#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: system packages, the venv, the project and the built-in models.
# `make run` and `make test` both call this; a second call does almost nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}

# Mooncake's non-CUDA wheel links libibverbs (even for TCP), libnuma and libcurl.
missing=()
for pair in libibverbs.so.1:libibverbs1 libnuma.so.1:libnuma1 libcurl.so.4:libcurl4; do
  ldconfig -p 2>/dev/null | grep -q "${pair%%:*}" || missing+=("${pair##*:}")
done
# The chaos suite's network scenarios put a worker in a network namespace (`ip netns`, veth links).
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
# Its idle-cut scenario drops a worker's open connections silently with an iptables rule in there.
command -v iptables >/dev/null 2>&1 || missing+=(iptables)
# The registry's etcd store (`pdserve bootstrap --registry-store etcd`) and its tests run Debian's etcd.
command -v etcd >/dev/null 2>&1 || missing+=(etcd-server)
# g++ builds the engine's C++ CPU kernels (below).
command -v g++ >/dev/null || missing+=(g++)
# tests/e2e/test_grafana_dashboards.py runs the dashboards' queries against a real Prometheus (Debian's
# 2.42); tests/docker validates docker/compose.yaml with docker-compose 1.29.
command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
if [ ${#missing[@]} -gt 0 ]; then
  echo "[setup] apt-get install ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

stamp="$VENV/.pdserve-installed"
want=$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-16)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  [ -x "$VENV/bin/python" ] || { echo "[setup] creating $VENV"; $PY -m venv "$VENV"; }
  echo "[setup] pip install (first time: a few minutes)"
  "$VENV/bin/pip" install -q --disable-pip-version-check -e ".[dev]"
  # NIXL's package metadata asks for CUDA torch; the UCX backend needs none of it.
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps nixl-cu12==1.5.1
  echo "$want" > "$stamp"
fi

# The engine's C++ CPU kernels (kernels/csrc), cached under .cache/kernels by a key over the sources,
# torch, the compiler and the CPU. The stamp skips even starting Python when nothing changed. A failed
# build is not fatal: the engine then runs its torch ops and says so in its log.
kernel_stamp=".cache/kernels/.stamp"
kernel_want=$( (cat kernels/csrc/* kernels/cpu_ext.py "$stamp"; grep -m1 '^flags' /proc/cpuinfo) | sha1sum | cut -c1-16)
if [ ! -f "$kernel_stamp" ] || [ "$(cat "$kernel_stamp")" != "$kernel_want" ]; then
  if "$VENV/bin/python" -m kernels.cpu_ext build; then
    echo "$kernel_want" > "$kernel_stamp"
  else
    echo "[setup] WARNING: building the C++ CPU kernels failed; the engine will use its slower torch ops" >&2
  fi
fi

# The built-in checkpoints: written by code from a fixed seed, never downloaded.
for preset in tiny; do  # `--preset small` (about 125M) is for benchmarks: see README
  dir=".cache/models/$preset"
  if [ ! -f "$dir/model.safetensors" ]; then
    echo "[setup] writing built-in model '$preset' to $dir"
    "$VENV/bin/pdserve" make-tiny-model --preset "$preset" --out "$dir"
  fi
done
