#!/usr/bin/env bash
# `make test-gpu`: prove the CUDA path on a machine with NVIDIA GPUs and nothing else prepared.
# Builds its own venv (.venv-gpu: CUDA torch at the project's pin, the transfer engines' CUDA wheels),
# then runs the GPU suite part by part and prints a summary table. What it installs and runs is listed
# in tools/gpu/plan.py (`--dry-run` prints it). Idempotent: a second run reuses the venv.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  cat <<'USAGE'
usage: scripts/test_gpu.sh [--dry-run] [--venv DIR | --python PATH] [--parts LIST] [--vllm-python PATH]

  --dry-run           print the plan (venv, wheels, parts) and exit; installs nothing
  --venv DIR          the GPU venv (default .venv-gpu; VENV_GPU also sets it)
  --python PATH       run the suite with this interpreter as it is and install nothing: one that
                      already has CUDA torch and pdserve's requirements (an NGC container, a machine
                      with no network and the wheels on PYTHONPATH)
  --parts LIST        comma-separated, from: parity,triton,pd,tp,graphs,bench (default: all)
  --vllm-python PATH  python of a venv with vLLM's CUDA build: the bench sets vLLM beside pdserve
  -h, --help          this text

Each part skips with a printed reason when its hardware or wheel is missing. Results and the summary
go to .cache/test-gpu/. Exit status: 0 all parts passed or skipped, 1 a part failed, 2 bad arguments,
3 no NVIDIA GPU on this machine (nothing is installed then).
USAGE
}

VENV=${VENV_GPU:-.venv-gpu}
PY=${PYTHON:-python3}
PARTS=""
DRY_RUN=0
VLLM_PYTHON=""
USE_PYTHON=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --venv) VENV=${2:?--venv needs a folder}; shift ;;
    --parts) PARTS=${2:?--parts needs a list}; shift ;;
    --python) USE_PYTHON=${2:?--python needs an interpreter}; shift ;;
    --vllm-python) VLLM_PYTHON=${2:?--vllm-python needs a path}; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "[test-gpu] unknown argument: $1" >&2; usage >&2; exit 2 ;;
  esac
  shift
done
PARTS=${PARTS:-$("$PY" -m tools.gpu.plan parts | tr ' ' ',')}
# The plan module checks the part names (exit 2 on an unknown one, before anything is installed).
plan=$("$PY" -m tools.gpu.plan describe --venv "$VENV" --parts "$PARTS") || exit 2

if [ "$DRY_RUN" = 1 ]; then
  echo "[test-gpu] plan (dry run: nothing installed or run)"
  echo "$plan"
  exit 0
fi

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "[test-gpu] no NVIDIA GPU here (nvidia-smi missing or finds none): nothing to prove; the suite's" \
       "CPU-side checks run in 'make test'" >&2
  exit 3
fi
echo "[test-gpu] GPUs:"; nvidia-smi -L

if [ -n "$USE_PYTHON" ]; then
  "$USE_PYTHON" -c "import torch; print('[test-gpu] using', __import__('sys').executable, 'torch', torch.__version__, 'CUDA', torch.version.cuda)" \
    || { echo "[test-gpu] --python $USE_PYTHON cannot import torch" >&2; exit 2; }
  exec "$USE_PYTHON" -m tools.gpu.suite --parts "$PARTS" ${VLLM_PYTHON:+--vllm-python "$VLLM_PYTHON"}
fi

# Mooncake's wheels link libibverbs, libnuma and libcurl (the same three scripts/setup.sh installs);
# the rest of setup.sh's system packages serve tests the GPU suite does not run.
missing=()
for pair in libibverbs.so.1:libibverbs1 libnuma.so.1:libnuma1 libcurl.so.4:libcurl4; do
  ldconfig -p 2>/dev/null | grep -q "${pair%%:*}" || missing+=("${pair##*:}")
done
"$PY" -c "import ensurepip" 2>/dev/null || missing+=(python3-venv)  # Debian splits venv out of python3
if [ ${#missing[@]} -gt 0 ]; then
  echo "[test-gpu] apt-get install ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

pip() { "$VENV/bin/pip" install -q --disable-pip-version-check "$@"; }
stamp="$VENV/.pdserve-gpu-installed"
want=$(cat pyproject.toml scripts/test_gpu.sh tools/gpu/plan.py | sha1sum | cut -c1-16)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  started=$SECONDS
  [ -x "$VENV/bin/python" ] || { echo "[test-gpu] creating $VENV"; "$PY" -m venv "$VENV"; }
  echo "[test-gpu] pip install $("$PY" -m tools.gpu.plan torch | tr '\n' ' ')(CUDA build: a few GB, minutes)"
  mapfile -t first < <("$PY" -m tools.gpu.plan torch)
  pip "${first[@]}"
  mapfile -t rest < <("$PY" -m tools.gpu.plan requirements)
  echo "[test-gpu] pip install pdserve's requirements"
  pip "${rest[@]}"
  pip --no-deps -e .
  cuda_major=$("$VENV/bin/python" -c "import torch; print((torch.version.cuda or '').split('.')[0])")
  echo "[test-gpu] torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)'), CUDA major '${cuda_major:-none}'"
  [ -n "$cuda_major" ] || echo "[test-gpu] WARNING: torch was not built for CUDA; every part will skip" >&2
  # One at a time: a wheel missing for this CUDA major leaves only its part to skip, with its reason.
  for wheel in $("$PY" -m tools.gpu.plan cuda-wheels ${cuda_major:+--cuda-major "$cuda_major"}); do
    pip --no-deps "$wheel" || echo "[test-gpu] WARNING: $wheel did not install; the pd part skips it" >&2
  done
  echo "$want" > "$stamp"
  echo "[test-gpu] $VENV ready in $((SECONDS - started)) s"
else
  echo "[test-gpu] reusing $VENV"
fi

exec "$VENV/bin/python" -m tools.gpu.suite --parts "$PARTS" ${VLLM_PYTHON:+--vllm-python "$VLLM_PYTHON"}
