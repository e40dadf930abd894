"""--moe-a2a-backend and --elastic-ep-backend: which all-to-all library expert parallelism runs on.

pdserve's dispatch/combine (engine.tp.expert_parallel) runs on torch.distributed's
all_to_all_single: gloo on CPU, NCCL on CUDA. The two libraries SGLang offers need what a CPU
host lacks:
- DeepEP (`deep_ep`): NVIDIA GPUs with NVSHMEM (intranode NVLink, internode IBGDA RDMA); it is not
  installed here, and no wheel exists for a CPU-only torch.
- Mooncake EP (`mooncake.ep`, its `Buffer` in mooncake.mooncake_ep_buffer): ships with the
  mooncake-transfer-engine wheels, but only a build with WITH_EP=ON (CUDA) has its `mooncake._ep`
  extension, and its process-group module `mooncake.pg_<torch version>` is built per torch release.
  The installed non-CUDA wheel (0.3.13.post1) has neither: `import mooncake.ep` raises
  "Mooncake EP was not built. Please rebuild Mooncake with WITH_EP=ON."
Neither library's dispatch is wired into pdserve even where it imports (their kernels take GPU
tensors and their own buffer layout), so every backend resolves to torch.distributed, and a worker
asked for another says once, at start, why and what runs instead. The tokens each rank receives,
the experts that run on them and the order of the sums are the same, so output is identical; only
the speed of the exchange differs.

`--elastic-ep-backend mooncake` (SGLang: keep serving when an EP rank fails, its experts served
from replicas) is accepted and not run: an EP rank that dies takes its worker down like any TP
rank (engine.tp.ranks), the worker's registry lease expires and the gateway routes around it.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

TORCH = "torch.distributed"

# Where each library lives and what it needs, for the message when it cannot be used.
_LIBRARIES = {
    "deepep": ("deep_ep", "DeepEP needs NVIDIA GPUs with NVSHMEM"),
    "mooncake": ("mooncake.ep", "Mooncake EP needs a CUDA build of Mooncake (WITH_EP=ON)"),
}


@dataclass(frozen=True)
class A2ABackend:
    """The backend asked for and the one that runs; `reason` says why they differ (None if equal)."""

    requested: str
    running: str
    reason: str | None = None


def resolve(requested: str, collective_backend: str) -> A2ABackend:
    """The all-to-all that runs for `--moe-a2a-backend requested` on ranks joined over
    `collective_backend` (gloo or nccl)."""
    if requested == "none":
        return A2ABackend(requested, TORCH)
    if requested not in _LIBRARIES:
        raise ValueError(f"--moe-a2a-backend must be none, deepep or mooncake, got {requested!r}")
    module, needs = _LIBRARIES[requested]
    try:
        importlib.import_module(module)
    except Exception as exc:  # ImportError, or a library that fails to initialise without its hardware
        failure = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        why = f"{needs}; `import {module}` failed: {failure}"
    else:
        why = f"`{module}` imports, but pdserve has no dispatch path for it yet"
    return A2ABackend(requested, TORCH,
                      f"--moe-a2a-backend {requested}: {why}; using {TORCH} all_to_all over "
                      f"{collective_backend} instead: identical output, only speed differs")


def announce(moe_a2a_backend: str, elastic_ep_backend: str, collective_backend: str) -> A2ABackend:
    """Resolve the backend and log, once at start (rank 0), every flag that runs as something else."""
    backend = resolve(moe_a2a_backend, collective_backend)
    if backend.reason:
        log.warning("%s", backend.reason)
    if elastic_ep_backend != "none":
        log.warning("--elastic-ep-backend %s: not run; an expert-parallel rank that dies takes its worker "
                    "down (like any TP rank), its registry lease expires and the gateway routes around it",
                    elastic_ep_backend)
    return backend
