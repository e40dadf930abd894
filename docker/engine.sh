#!/usr/bin/env bash
# A Docker engine for docker/build.sh and docker/smoke.sh (and tests/e2e/test_compose.py) where
# none runs: installs Debian's engine and tools when absent, starts dockerd in the background.
#
#   docker/engine.sh ensure     # prints "running" (an engine answers already) or "started PID"
#   docker/engine.sh stop PID   # stops a dockerd that `ensure` started
#
# Debian bookworm's docker.io (engine 20.10), docker-compose 1.29 and debootstrap (build.sh's
# local base image). dockerd runs as root without a service manager, with --iptables=false: it
# leaves the host's firewall and bridge filtering alone (other tests bridge network namespaces),
# and published ports still work through docker-proxy. Images, layers and the build cache stay in
# dockerd's data root (/var/lib/docker) between runs. Exit code 3: no engine can run here (the
# message says why); callers skip on it.
set -euo pipefail
DOCKER=${DOCKER:-docker}
LOG=${DOCKERD_LOG:-/tmp/pdserve-dockerd.log}
say() { echo "[docker/engine] $*" >&2; }

answers() { timeout 10 "$DOCKER" info >/dev/null 2>&1; }

install_missing() {
    local missing=()
    command -v dockerd >/dev/null || missing+=(docker.io)
    command -v "$DOCKER" >/dev/null || missing+=(docker.io)
    command -v docker-compose >/dev/null || missing+=(docker-compose)
    command -v debootstrap >/dev/null || missing+=(debootstrap)
    [ ${#missing[@]} -eq 0 ] && return
    [ "$(id -u)" -eq 0 ] || { say "cannot install ${missing[*]}: not root"; exit 3; }
    say "apt-get install ${missing[*]}"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${missing[@]}"; } >/dev/null 2>&1 || { say "apt-get install ${missing[*]} failed"; exit 3; }
}

case "${1:-}" in
ensure)
    install_missing
    if answers; then echo running; exit 0; fi
    [ "$(id -u)" -eq 0 ] || { say "no Docker engine answers and starting dockerd needs root"; exit 3; }
    setsid dockerd --iptables=false --ip-masq=false >"$LOG" 2>&1 < /dev/null &
    pid=$!
    for _ in $(seq 120); do
        if answers; then echo "started $pid"; exit 0; fi
        kill -0 "$pid" 2>/dev/null || { say "dockerd exited: $(tail -5 "$LOG" | tr '\n' ' ')"; exit 3; }
        sleep 0.5
    done
    kill "$pid" 2>/dev/null || true
    say "dockerd did not answer within 60s: $(tail -5 "$LOG" | tr '\n' ' ')"
    exit 3
    ;;
stop)
    pid=${2:?usage: engine.sh stop PID}
    kill "$pid" 2>/dev/null || exit 0
    for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || exit 0; sleep 0.5; done
    kill -9 "$pid" 2>/dev/null || true
    ;;
*)
    echo "usage: docker/engine.sh ensure | stop PID" >&2
    exit 2
    ;;
esac
