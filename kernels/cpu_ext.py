"""Build and load the C++ CPU kernels of kernels/csrc (ops under `torch.ops.pdserve_cpu`).

`make setup` builds them once (`python -m kernels.cpu_ext build`): g++ with torch's headers and
libraries as `torch.utils.cpp_extension` reports them, `-march=native` for this CPU, and OpenMP
from the same libgomp torch loads (one thread pool, shared with torch's own ops). The library is
cached under .cache/kernels/ by a key over the sources, torch's version, the compiler, the flags
and the CPU's instruction set, so a second build does nothing and a checkout moved to another CPU
or torch never loads a library built for something else.

At run time `load()` only looks for the library of the current key: nothing is compiled inside a
serving process. When there is none, callers keep the torch implementations (kernels.torch_ops),
and `unavailable_reason()` says why.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
CACHE_DIR = Path(__file__).resolve().parents[1] / ".cache" / "kernels"
LIBRARY_NAME = "pdserve_cpu"
COMPILER = os.environ.get("CXX", "g++")
CXX_FLAGS = ["-O3", "-march=native", "-std=c++20", "-fPIC", "-fopenmp", "-Wall", "-Wno-unused-function",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]

_lock = threading.Lock()
_loaded: bool | None = None
_reason: str | None = None


def _sources() -> list[Path]:
    return sorted(p for p in SOURCE_DIR.iterdir() if p.suffix in (".cpp", ".h"))


@functools.cache
def _cpu_flags() -> str:
    """The CPU's instruction-set flags (what -march=native compiles for)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.processor()


@functools.cache
def _compiler_version() -> str:
    try:
        return subprocess.run([COMPILER, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "missing"


def build_key() -> str:
    digest = hashlib.sha1()
    for path in _sources():
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    for part in (torch.__version__, " ".join(CXX_FLAGS), _cpu_flags(), _compiler_version()):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:16]


def library_path() -> Path:
    return CACHE_DIR / f"{LIBRARY_NAME}-{build_key()}.so"


def build(verbose: bool = False) -> Path:
    """Compile the library for the current key unless it exists; return its path."""
    from torch.utils.cpp_extension import include_paths, library_paths

    target = library_path()
    if target.exists():
        return target
    if shutil.which(COMPILER) is None:
        raise RuntimeError(f"no C++ compiler ({COMPILER}) on PATH")
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    includes = [f"-I{p}" for p in include_paths()]
    with tempfile.TemporaryDirectory(dir=CACHE_DIR) as scratch:
        def compile_one(source: Path) -> Path:
            obj = Path(scratch) / (source.stem + ".o")
            _run([COMPILER, *CXX_FLAGS, *includes, "-c", str(source), "-o", str(obj)], verbose)
            return obj

        units = [p for p in _sources() if p.suffix == ".cpp"]
        with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
            objects = list(pool.map(compile_one, units))
        libs = [f"-L{p}" for p in library_paths()] + [f"-Wl,-rpath,{p}" for p in library_paths()]
        partial = Path(scratch) / target.name
        _run([COMPILER, "-shared", "-fopenmp", *map(str, objects), *libs, "-lc10", "-ltorch_cpu", "-lgomp",
              "-o", str(partial)], verbose)
        os.replace(partial, target)  # atomic: a concurrent loader sees all of it or nothing
    for stale in CACHE_DIR.glob(f"{LIBRARY_NAME}-*.so"):
        if stale != target:
            stale.unlink(missing_ok=True)
    return target


def _run(command: list[str], verbose: bool) -> None:
    if verbose:
        print(" ".join(command), file=sys.stderr)
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{command[0]} failed ({result.returncode}):\n{result.stderr[-4000:]}")


def load() -> bool:
    """Load the library for the current key into torch.ops.pdserve_cpu; False if there is none."""
    global _loaded, _reason
    with _lock:
        if _loaded is None:
            path = library_path()
            if not path.exists():
                _loaded, _reason = False, (f"{path.name} is not built (run `make setup`, or "
                                           f"`python -m kernels.cpu_ext build`)")
            else:
                try:
                    torch.ops.load_library(str(path))
                    _loaded = True
                except OSError as exc:
                    _loaded, _reason = False, f"loading {path} failed: {exc}"
        return _loaded


def unavailable_reason() -> str | None:
    """Why `load()` returned False (None when it did not)."""
    load()
    return _reason


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels.cpu_ext", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["build", "path"])
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "path":
        print(library_path())
        return 0
    target = library_path()
    if target.exists():
        print(f"[kernels] {target.name} is up to date")
        return 0
    print(f"[kernels] building {target.name} (about a minute)", flush=True)
    build(args.verbose)
    return 0


if __name__ == "__main__":
    sys.exit(main())
