"""Build and load the C++ CPU kernels of kernels/csrc, once per instruction set.

`make setup` builds them once (`python -m kernels.cpu_ext build`): g++ with torch's headers and
libraries as `torch.utils.cpp_extension` reports them, and OpenMP from the same libgomp torch loads
(one thread pool, shared with torch's own ops). The sources are compiled once per instruction set
(ISAS) the CPU runs: `avx512` with `-march=native` (its AVX512-BF16 paths where the CPU has them),
`avx2` with AVX2 + FMA and no AVX-512 at all (what a Zen 3 or a cloud VM without AVX-512 runs; on an
AVX-512 machine it is built too, so its code is tested there), `portable` with no vector extension
(built only where neither runs, or when asked for). Each library registers its ops under its own
namespace (`torch.ops.pdserve_cpu_avx2`, ...) with hidden symbols, so one process can load several
and compare them. A library is cached under .cache/kernels/ by a key over the sources, torch's
version, the compiler, the flags and the CPU's instruction set, so a second build does nothing and a
checkout moved to another CPU or torch never loads a library built for something else.

At run time a process uses one variant, `active_isa()`: the best the CPU runs, or the one
PDSERVE_CPU_ISA names (pdserve.envs). `load()` only looks for that library: nothing is compiled inside
a serving process. When there is none, callers keep the torch implementations (kernels.torch_ops),
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
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve import envs

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
CACHE_DIR = Path(__file__).resolve().parents[1] / ".cache" / "kernels"
LIBRARY_NAME = "pdserve_cpu"
COMPILER = os.environ.get("CXX", "g++")
# Hidden symbols: the variants' libraries define the same C++ names (Vec16 is a 512-bit register in one
# and two 256-bit ones in another); each must bind to its own, even with several loaded in one process.
CXX_FLAGS = ["-O3", "-std=c++20", "-fPIC", "-fopenmp", "-fvisibility=hidden", "-fvisibility-inlines-hidden",
             "-Wall", "-Wno-unused-function",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]


@dataclass(frozen=True)
class Isa:
    name: str
    flags: tuple[str, ...]  # what the compiler may use
    needs: tuple[str, ...]  # /proc/cpuinfo flags the CPU must have to run it
    built_by_default: bool = True

    @property
    def namespace(self) -> str:
        return f"{LIBRARY_NAME}_{self.name}"


# Best first: `auto` takes the first the CPU runs.
ISAS = (
    Isa("avx512", ("-march=native",), ("avx512f", "avx512bw", "avx512vl", "avx512dq")),
    # An explicit set, not -march=native minus AVX-512, so the code cannot use AVX-512 by accident on a
    # machine that has it (numerics.h also refuses to compile if it sees __AVX512F__ here).
    Isa("avx2", ("-march=x86-64-v2", "-mavx2", "-mfma", "-mf16c", "-mtune=native", "-DPDSERVE_ISA_AVX2"),
        ("avx2", "fma", "f16c")),
    Isa("portable", (), (), built_by_default=False),
)

_lock = threading.Lock()
_loaded: dict[str, bool] = {}
_reasons: dict[str, str] = {}


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


def isa(name: str) -> Isa:
    for candidate in ISAS:
        if candidate.name == name:
            return candidate
    raise ValueError(f"unknown CPU instruction set {name!r}: choose auto or one of "
                     f"{', '.join(i.name for i in ISAS)}")


@functools.cache
def _cpu_flag_set() -> frozenset[str]:
    return frozenset(_cpu_flags().split())


def runs_here(variant: Isa) -> bool:
    return all(flag in _cpu_flag_set() for flag in variant.needs)


def executable_isas() -> list[Isa]:
    """The variants this CPU runs that `build` builds: what tests compare against the torch references."""
    return [i for i in ISAS if i.built_by_default and runs_here(i)] or [isa("portable")]


def active_isa() -> Isa:
    """The variant this process uses: PDSERVE_CPU_ISA, or with `auto` the best this CPU runs."""
    return _resolve(envs.CPU_ISA.get())


@functools.cache  # every kernel call asks (the env may change between calls, in tests)
def _resolve(name: str) -> Isa:
    name = name.strip().lower()
    if name == "auto":
        return next(i for i in ISAS if runs_here(i))
    return isa(name)


def build_key(variant: Isa | None = None) -> str:
    variant = variant or active_isa()
    digest = hashlib.sha1()
    for path in _sources():
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    for part in (torch.__version__, " ".join(_flags(variant)), _cpu_flags(), _compiler_version()):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:16]


def _flags(variant: Isa) -> list[str]:
    return [*CXX_FLAGS, *variant.flags, f"-DPDSERVE_OPS={variant.namespace}"]


def library_path(variant: Isa | None = None) -> Path:
    variant = variant or active_isa()
    return CACHE_DIR / f"{variant.namespace}-{build_key(variant)}.so"


def build(verbose: bool = False, variant: Isa | None = None) -> Path:
    """Compile the library of `variant` (the active one by default) for the current key unless it
    exists; return its path."""
    from torch.utils.cpp_extension import include_paths, library_paths

    variant = variant or active_isa()
    target = library_path(variant)
    if target.exists():
        return target
    if shutil.which(COMPILER) is None:
        raise RuntimeError(f"no C++ compiler ({COMPILER}) on PATH")
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    includes = [f"-I{p}" for p in include_paths()]
    with tempfile.TemporaryDirectory(dir=CACHE_DIR) as scratch:
        def compile_one(source: Path) -> Path:
            obj = Path(scratch) / (source.stem + ".o")
            _run([COMPILER, *_flags(variant), *includes, "-c", str(source), "-o", str(obj)], verbose)
            return obj

        units = [p for p in _sources() if p.suffix == ".cpp"]
        with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
            objects = list(pool.map(compile_one, units))
        libs = [f"-L{p}" for p in library_paths()] + [f"-Wl,-rpath,{p}" for p in library_paths()]
        partial = Path(scratch) / target.name
        _run([COMPILER, "-shared", "-fopenmp", *map(str, objects), *libs, "-lc10", "-ltorch_cpu", "-lgomp",
              "-o", str(partial)], verbose)
        os.replace(partial, target)  # atomic: a concurrent loader sees all of it or nothing
    # Older builds of this variant, and libraries from before there were variants.
    for stale in [*CACHE_DIR.glob(f"{variant.namespace}-*.so"), *CACHE_DIR.glob(f"{LIBRARY_NAME}-*.so")]:
        if stale != target:
            stale.unlink(missing_ok=True)
    return target


def _run(command: list[str], verbose: bool) -> None:
    if verbose:
        print(" ".join(command), file=sys.stderr)
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{command[0]} failed ({result.returncode}):\n{result.stderr[-4000:]}")


def load(variant: Isa | None = None) -> bool:
    """Load the library of `variant` (the active one by default) into torch.ops.<its namespace>; False
    if there is none, or the CPU cannot run it."""
    variant = variant or active_isa()
    with _lock:
        if variant.name not in _loaded:
            path = library_path(variant)
            if not runs_here(variant):
                missing = [f for f in variant.needs if f not in _cpu_flag_set()]
                _loaded[variant.name], _reasons[variant.name] = False, (
                    f"this CPU cannot run the {variant.name} kernels (no {', '.join(missing)})")
            elif not path.exists():
                _loaded[variant.name], _reasons[variant.name] = False, (
                    f"{path.name} is not built (run `make setup`, or `python -m kernels.cpu_ext build`)")
            else:
                try:
                    torch.ops.load_library(str(path))
                    _loaded[variant.name] = True
                except OSError as exc:
                    _loaded[variant.name], _reasons[variant.name] = False, f"loading {path} failed: {exc}"
        return _loaded[variant.name]


def ops(variant: Isa | None = None) -> torch._ops._OpNamespace:
    """torch.ops.<namespace> of `variant` (the active one by default); call `load` first."""
    return getattr(torch.ops, (variant or active_isa()).namespace)


def unavailable_reason(variant: Isa | None = None) -> str | None:
    """Why `load()` returned False (None when it did not)."""
    variant = variant or active_isa()
    load(variant)
    return _reasons.get(variant.name)


def _named(name: str | None) -> Isa:
    return active_isa() if name in (None, "active") else isa(name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels.cpu_ext", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["build", "path"])
    parser.add_argument("--isa", help="one variant, or `active`: the one this process loads "
                                      "(PDSERVE_CPU_ISA). Default: every one this CPU runs (build), the "
                                      "active one (path)")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "path":
        print(library_path(_named(args.isa)))
        return 0
    variants = [_named(args.isa)] if args.isa else executable_isas()
    if not args.isa and active_isa() not in variants:  # PDSERVE_CPU_ISA=portable, say
        variants.append(active_isa())
    for variant in variants:
        target = library_path(variant)
        if target.exists():
            print(f"[kernels] {target.name} is up to date")
            continue
        print(f"[kernels] building {target.name} (about a minute)", flush=True)
        build(args.verbose, variant)
    return 0


if __name__ == "__main__":
    sys.exit(main())
