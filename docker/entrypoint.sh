#!/bin/sh
# Entrypoint of every pdserve image: runs its arguments (normally `pdserve ...`) as PID 1's only
# child-free process (exec), so SIGTERM from `docker stop` reaches pdserve's graceful shutdown.
#
# A worker (`pdserve launch-server`) runs with the store tier of --enable-hierarchical-cache when a
# Mooncake Store master is named (PDSERVE_HICACHE_MOONCAKE_MASTER or MOONCAKE_MASTER, as the compose
# profile hicache asks for): the compose file's commands stay the same with the profile off or on.
#
# `--host auto` is replaced by this container's own address. A worker binds that address and
# registers it with the bootstrap registry; the gateway and the other workers dial it, and the
# transfer engines write KV pages to it. 0.0.0.0 would bind fine but be registered as an address
# no other container can reach. Set CONTAINER_HOST to advertise something else (a host IP with
# `network_mode: host`, for example).
set -eu

container_host() {
    if [ -n "${CONTAINER_HOST:-}" ]; then
        echo "$CONTAINER_HOST"
    else
        python3 -c 'import socket; print(socket.gethostbyname(socket.gethostname()))'
    fi
}

# Worker images carry the C++ CPU kernels built for the build machine's CPU. On a CPU with other
# instruction sets their cache key differs: build them for this one first (a no-op when they match;
# on failure the engine runs its torch ops and says so).
if [ -f /app/kernels/cpu_ext.py ] && command -v g++ >/dev/null 2>&1; then
    (cd /app && nice -n 10 python3 -m kernels.cpu_ext build --isa active >&2) || echo "[entrypoint] C++ kernels not built" >&2
fi

[ "$#" -gt 0 ] || set -- pdserve --help
hicache=""
if [ "${1:-}" = "pdserve" ] && [ "${2:-}" = "launch-server" ] \
        && [ -n "${PDSERVE_HICACHE_MOONCAKE_MASTER:-}${MOONCAKE_MASTER:-}" ]; then
    case " $* " in
        *" --enable-hierarchical-cache "*) ;;  # the command asks for it itself
        *) hicache="--enable-hierarchical-cache" ;;
    esac
fi
previous=""
for arg do
    shift
    if [ "$previous" = "--host" ] && [ "$arg" = "auto" ]; then
        arg=$(container_host)
    fi
    set -- "$@" "$arg"
    previous=$arg
done
[ -z "$hicache" ] || set -- "$@" --enable-hierarchical-cache --hicache-storage-backend mooncake
exec "$@"
