"""What `make test-gpu` installs and runs: the one list scripts/test_gpu.sh, its `--dry-run` and
the suite runner (tools.gpu.suite) all read. Standard library only: it runs under the machine's
python3 before the GPU venv exists.

The GPU venv gets the project's own pins from pyproject.toml (read here, never copied), with two
swaps: torch from PyPI, whose Linux x86_64 wheel at the same pin is the CUDA build (the CPU venv
gets the +cpu build of that pin), and Mooncake's CUDA build instead of its non-CUDA one. The
wheels that exist only for one CUDA major (Mooncake, NIXL) are picked after torch is installed, by
the CUDA major torch was built for, and installed one by one: a missing one makes only its
part skip, with the reason printed.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pip vendors the same parser
    from pip._vendor import tomli as tomllib  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parents[2]
DEFAULT_VENV = ".venv-gpu"
CPU_ONLY = "mooncake-transfer-engine-non-cuda"
NIXL_VERSION = "1.5.1"  # scripts/setup.sh's nixl-cu12 pin


@dataclass(frozen=True)
class Part:
    """One row of the summary: a pytest run over `paths`, or (bench) a command of its own."""

    name: str
    what: str
    paths: tuple[str, ...] = ()


PARTS = (
    Part("parity", "engine on CUDA vs HF on CUDA: fp32 exact, bf16 teacher-forced (tiny, llama, tiny-moe, "
         "tiny-deepseek)", ("tests/gpu/test_parity_cuda.py",)),
    Part("triton", "Triton kernels compiled and run on CUDA vs torch references; cubins for sm_80/sm_90",
         ("tests/gpu/test_triton_cuda.py", "tests/kernels/test_triton_compile.py")),
    Part("pd", "prefill and decode on a GPU each (--base-gpu-id), KV GPU to GPU over mooncake and nixl, "
         "vs colocated", ("tests/gpu/test_pd_gpu.py",)),
    Part("tp", "TP 2 over NCCL vs HF (needs 2 GPUs)", ("tests/gpu/test_tp_nccl.py",)),
    Part("graphs", "decode CUDA graphs on vs --disable-cuda-graph: greedy tokens equal (tiny, llama)",
         ("tests/gpu/test_cuda_graphs.py",)),
    Part("bench", "bench engine --device cuda on qwen3-4b-shape (bf16), batch 1, 16 and 64, graphs on and "
         "off, beside the GPU's measured bandwidth bound and the seeds' 144 tok/s"),
)
PART_NAMES = tuple(part.name for part in PARTS)


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


_FIRST = re.compile(r"(torch|triton)\b")


def torch_pins() -> list[str]:
    """The project's torch and triton requirements (the CPU venv's pins), installed first and together
    so pip resolves the CUDA torch against the pinned triton before anything else can pick a build."""
    return [dep for dep in _pyproject()["project"]["dependencies"] if _FIRST.match(dep)]


def base_requirements() -> list[str]:
    """pyproject's dependencies and dev extras, less torch and triton (`torch_pins`) and the non-CUDA
    Mooncake (its CUDA build comes from `cuda_wheels`)."""
    project = _pyproject()["project"]
    deps = project["dependencies"] + project["optional-dependencies"]["dev"]
    return [dep for dep in deps if not _FIRST.match(dep) and not dep.startswith(CPU_ONLY)]


def cuda_wheels(cuda_major: int | None) -> list[str]:
    """The transfer engines' CUDA builds for torch's CUDA major, installed without their dependencies
    (NIXL's metadata would pull another torch). Unknown major: none, and the pd part says why."""
    mooncake_version = next(dep for dep in _pyproject()["project"]["dependencies"]
                            if dep.startswith(CPU_ONLY)).split("==")[1]
    if cuda_major == 12:
        return [f"mooncake-transfer-engine=={mooncake_version}", f"nixl=={NIXL_VERSION}",
                f"nixl-cu12=={NIXL_VERSION}"]
    if cuda_major == 13:  # Mooncake's CUDA 13 build is published under its own name and versions
        return ["mooncake-transfer-engine-cuda13", f"nixl=={NIXL_VERSION}", f"nixl-cu13=={NIXL_VERSION}"]
    return []


def describe(venv: str, parts: list[str]) -> str:
    """The plan `--dry-run` prints."""
    lines = [f"venv: {venv} ({'reused' if (REPO / venv / 'bin' / 'python').exists() else 'created'}; "
             "stamped by pyproject.toml, scripts/test_gpu.sh and this plan: a second run installs nothing)",
             f"1. pip install {' '.join(torch_pins())} (PyPI's Linux torch wheel: the CUDA build)",
             f"2. pip install {' '.join(base_requirements())}",
             "3. pip install --no-deps -e . (pdserve itself)",
             "4. by torch's CUDA major, each alone, --no-deps (a failure skips only its part):",
             f"   CUDA 12: {' '.join(cuda_wheels(12))}",
             f"   CUDA 13: {' '.join(cuda_wheels(13))}",
             "parts:"]
    lines += [f"  {part.name:7s} {part.what}" + ("" if part.name in parts else "  [not selected]")
              for part in PARTS]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.gpu.plan", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("describe", help="print the plan")
    show.add_argument("--venv", default=DEFAULT_VENV)
    show.add_argument("--parts", default=",".join(PART_NAMES))
    sub.add_parser("torch", help="print the torch and triton requirements, one a line")
    sub.add_parser("requirements", help="print the requirements after torch, one a line")
    wheels = sub.add_parser("cuda-wheels", help="print the CUDA-only wheels for a CUDA major, one a line")
    wheels.add_argument("--cuda-major", type=int, default=None)
    sub.add_parser("parts", help="print the part names")
    args = parser.parse_args(argv)
    if args.command == "describe":
        print(describe(args.venv, check_parts(args.parts)))
    elif args.command == "torch":
        print("\n".join(torch_pins()))
    elif args.command == "requirements":
        print("\n".join(base_requirements()))
    elif args.command == "cuda-wheels":
        print("\n".join(cuda_wheels(args.cuda_major)))
    else:
        print(" ".join(PART_NAMES))
    return 0


def check_parts(parts: str) -> list[str]:
    chosen = [name for name in parts.split(",") if name]
    unknown = sorted(set(chosen) - set(PART_NAMES))
    if unknown:
        raise SystemExit(f"unknown part(s) {', '.join(unknown)}; expected some of {', '.join(PART_NAMES)}")
    return chosen


if __name__ == "__main__":
    sys.exit(main())
