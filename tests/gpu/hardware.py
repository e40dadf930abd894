"""What the GPU suite needs, and the printed reason a part skips without it.

Every module of tests/gpu calls `require(...)` before importing anything heavy, so on a machine
without CUDA the whole suite is collected and skipped in seconds, loading no model. The reasons
start with the part's name so `pytest -rs` and scripts/test_gpu.sh's summary say which part
skipped and why; tests/tools/gpu/test_skips.py checks them on CPU machines.
"""

from __future__ import annotations

import importlib

import pytest
import torch


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def missing(gpus: int = 1, modules: tuple[str, ...] = ()) -> str | None:
    """Why a part cannot run here, or None when it can."""
    if not torch.cuda.is_available():
        return (f"no CUDA: torch.cuda.is_available() is False (torch {torch.__version__}, "
                f"built for CUDA {torch.version.cuda})")
    if gpu_count() < gpus:
        return f"needs {gpus} GPUs, found {gpu_count()}"
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:  # an ImportError, or a CUDA wheel failing to load its libraries
            return f"{module} does not import: {type(exc).__name__}: {exc}{_library_hint(exc)}"
    return None


def _library_hint(exc: Exception) -> str:
    """NIXL's wheels keep libnixl.so in a hidden folder beside the package (.nixl_cu13.mesonpy.libs,
    the RPATH of its bindings); a copy of site-packages that skipped dot-folders loses it."""
    if "libnixl" not in str(exc):
        return ""
    return (" (NIXL's libraries sit in the hidden folder .nixl_cuNN.mesonpy.libs beside the package: "
            "install the wheels with pip, or copy site-packages with its dot-folders; docs/gpu.md)")


def require(part: str, gpus: int = 1, modules: tuple[str, ...] = ()) -> None:
    """Skip the calling module, naming `part` and the reason, unless it can run."""
    reason = missing(gpus, modules)
    if reason is not None:
        pytest.skip(f"[gpu:{part}] {reason}", allow_module_level=True)


def used_bytes(index: int) -> int:
    """Memory in use on GPU `index` by every process, as the driver counts it (a process's own
    allocator cannot see another's, and nvidia-smi's PIDs may be from another PID namespace)."""
    free, total = torch.cuda.mem_get_info(index)
    return total - free
