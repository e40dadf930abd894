"""Part "pd": a prefill and a decode worker as real processes, one GPU per role (`--base-gpu-id`),
their KV pools in GPU memory, KV pages written from prefill's GPU memory into decode's by each
transfer backend whose CUDA wheel imports here; greedy output equals the colocated worker's (on
GPU 0) and HF transformers' (fp32, CPU), as tests/e2e/test_pd_services.py checks on CPU. With one
GPU both roles share GPU 0, and the test says so in a warning. Each worker's start line names the
device of its KV pool, which must be the GPU it was given.
"""

from __future__ import annotations

import importlib
import warnings

import pytest

from tests.gpu.hardware import require

require("pd")

from tests.e2e.cluster import Cluster, worker_args  # noqa: E402
from tests.e2e.test_pd_services import (  # noqa: E402, F401  (reference is a fixture)
    CHUNK,
    NEW_TOKENS,
    assert_pages_idle,
    check_against_reference,
    reference,
)
from tests.e2e.worker_client import run_all  # noqa: E402
from tests.gpu.hardware import gpu_count  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.e2e, pytest.mark.timeout(600)]

# The modules libkv/transfer imports for each backend (any one of them will do).
BACKEND_MODULES = {"mooncake": ("mooncake.engine",), "nixl": ("nixl_cu12", "nixl")}


def backend_missing(backend: str) -> str | None:
    errors = []
    for module in BACKEND_MODULES[backend]:
        try:
            importlib.import_module(module)
            return None
        except Exception as exc:  # ImportError, or a CUDA build failing to load its libraries
            errors.append(f"{module}: {type(exc).__name__}: {exc}")
    return "; ".join(errors)


@pytest.mark.parametrize("backend", sorted(BACKEND_MODULES))
def test_pd_one_gpu_per_role_matches_colocated(backend, cluster: Cluster, tiny_model, reference):  # noqa: F811
    reason = backend_missing(backend)
    if reason:
        pytest.skip(f"[gpu:pd-{backend}] its wheel does not import: {reason}")
    decode_gpu = 1 if gpu_count() >= 2 else 0
    if decode_gpu == 0:
        warnings.warn("[gpu:pd] one GPU: prefill and decode both run on GPU 0", stacklevel=1)
    gpu = ("--device", "auto")  # the workers' default: cuda:<--base-gpu-id>
    prefill, decode = cluster.start_many([
        ("prefill", worker_args(tiny_model, "prefill", backend=backend,
                                extra=(*CHUNK, *gpu, "--base-gpu-id", "0"))),
        ("decode", worker_args(tiny_model, "decode", backend=backend,
                               extra=(*CHUNK, *gpu, "--base-gpu-id", str(decode_gpu)))),
    ])
    prompts = reference[0]
    got = run_all(decode.address, prompts, [prefill.address] * len(prompts), max_new_tokens=NEW_TOKENS)
    check_against_reference(got, reference)
    assert prefill.metric("pdserve:kv_transfer_bytes_total") > 0
    for proc, index in ((prefill, 0), (decode, decode_gpu)):
        log = proc.log()
        assert f"tokens on cuda:{index}, " in log, proc.log_tail()
        assert f", transfer backend {backend}, " in log, proc.log_tail()
    assert_pages_idle(prefill, decode)
