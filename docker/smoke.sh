#!/usr/bin/env bash
# Smoke test of the compose deployment: up, wait until healthy, one chat completion, down.
#
#   docker/smoke.sh                         # builds the images first if any is missing
#   TRANSFER_BACKEND=nixl docker/smoke.sh   # compose variables pass through
#
# Runs as its own compose project (pdserve-smoke) on a free host port, so it does not disturb a
# deployment that is already up. Always tears down what it started (also on failure or Ctrl-C),
# printing every container's log tail first when something went wrong. Exit 0 = the gateway
# answered /v1/chat/completions with a completion.
set -euo pipefail
cd "$(dirname "$0")/.."

COMPOSE=${COMPOSE:-docker-compose}
PROJECT=${PROJECT:-pdserve-smoke}
READY_TIMEOUT=${READY_TIMEOUT:-300}
IMAGE_TAG=${IMAGE_TAG:-latest}
export IMAGE_TAG
GATEWAY_PORT=${GATEWAY_PORT:-$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
export GATEWAY_PORT
compose() { $COMPOSE -p "$PROJECT" -f docker/compose.yaml "$@"; }
say() { echo "[docker/smoke] $*"; }

for service in bootstrap gateway prefill decode; do
    if ! docker image inspect "pdserve-$service:$IMAGE_TAG" >/dev/null 2>&1; then
        say "image pdserve-$service:$IMAGE_TAG missing: running docker/build.sh"
        docker/build.sh
        break
    fi
done

ok=0
finish() {
    if [ "$ok" != 1 ]; then
        compose ps || true
        compose logs --no-color --tail 40 || true
    fi
    say "compose down"
    compose down -v --remove-orphans >/dev/null 2>&1 || true
}
trap finish EXIT
trap 'exit 130' INT TERM

started=$(date +%s)
say "compose up (project $PROJECT, gateway on 127.0.0.1:$GATEWAY_PORT)"
compose up -d
base="http://127.0.0.1:$GATEWAY_PORT"

# docker-compose 1.29 has no `up --wait`: poll the gateway's /health (200 once a pair can serve).
deadline=$(( started + READY_TIMEOUT ))
until body=$(curl -sf --max-time 3 "$base/health"); do
    if [ "$(date +%s)" -ge "$deadline" ]; then
        say "gateway not healthy within ${READY_TIMEOUT}s"
        exit 1
    fi
    if compose ps | grep -Eq "Exit|Restarting"; then
        say "a container exited while starting"
        exit 1
    fi
    sleep 2
done
say "healthy after $(( $(date +%s) - started ))s: $body"
compose ps

model=$(python3 -c 'import json, sys; print(json.loads(sys.argv[1]).get("model", "tiny"))' "$body")
request=$(printf '{"model": "%s", "messages": [{"role": "user", "content": "Hello from docker!"}], "max_tokens": 16, "temperature": 0}' "$model")
say "POST $base/v1/chat/completions $request"
reply=$(curl -sS --max-time 120 "$base/v1/chat/completions" -H 'Content-Type: application/json' -d "$request")
echo "$reply"
python3 - "$reply" <<'EOF'
import json, sys
reply = json.loads(sys.argv[1])
choice = reply["choices"][0]
assert choice["message"]["role"] == "assistant", choice
assert reply["usage"]["completion_tokens"] > 0, reply["usage"]
print(f"[docker/smoke] completion: {reply['usage']['completion_tokens']} tokens, "
      f"finish_reason {choice['finish_reason']}: {choice['message']['content']!r}")
EOF
ok=1
say "passed in $(( $(date +%s) - started ))s"
