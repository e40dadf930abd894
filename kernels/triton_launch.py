"""Where a Triton kernel may be launched: CUDA tensors, or any tensors under Triton's interpreter.

The interpreter (`TRITON_INTERPRET=1`, read by Triton itself when it is imported) runs kernels on
CPU tensors with numpy, which is how the kernels are tested on machines without a GPU.
"""

from __future__ import annotations

import torch
import triton


def interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)


def check_launchable(*tensors: torch.Tensor) -> None:
    """Raise if a kernel cannot run on these tensors (CPU tensors outside the interpreter)."""
    if interpreting():
        return
    for tensor in tensors:
        if not tensor.is_cuda:
            raise ValueError(f"Triton kernels need CUDA tensors (got {tensor.device}); "
                             "use the torch implementation or set TRITON_INTERPRET=1")
