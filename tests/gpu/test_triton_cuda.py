"""Part "triton": every case of tests/kernels/triton_checks.py with the kernels compiled for the GPU
at hand (not interpreted) and run on CUDA tensors, against the same torch references and tolerances.
The cases are written device-agnostic: under `torch.set_default_device("cuda")` their tensors, and
so the kernels' launches, are on the GPU (kernels.ops sends CUDA tensors to Triton)."""

from __future__ import annotations

import os

import pytest

from tests.gpu.hardware import require

require("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("[gpu:triton] TRITON_INTERPRET=1 is set: the kernels would be interpreted, not compiled",
                allow_module_level=True)

import torch  # noqa: E402

from tests.kernels.triton_checks import CASES  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")]


@pytest.fixture
def on_cuda():
    previous = torch.get_default_device()
    torch.set_default_device("cuda")
    try:
        yield
    finally:
        torch.set_default_device(previous)


@pytest.mark.parametrize("name", sorted(CASES))
def test_compiled_kernel_matches_torch_reference_on_cuda(on_cuda, name):
    CASES[name]()
    torch.cuda.synchronize()  # a kernel fault surfaces here, in its own case
