"""Linear layers whose weights are reordered once, at load time, into oneDNN's blocked layout.

Why: `F.linear` on CPU hands a plain row-major weight to MKL (fp32) or oneDNN (bf16) on every
call; oneDNN's own kernels on a prepacked weight (what torch.compile's freezing pass does) were
2x faster in bf16 and 3-4x faster in fp32 at decode shapes, and 1.2-2x at prefill shapes (small
preset, 2 threads, 16 x 768 into 1280/768/4096, 16 x 2048 into 768, the 32000-wide head; all
weights of a bf16 step then stream at about 37 GB/s, the memory bandwidth of the machine).

bf16 on a CPU with AVX512-BF16, when the C++ kernels are built, goes further: the weight is packed
for kernels/csrc/bf16_gemm.cpp, which streams it once per call and does the math in fp32 FMAs
(oneDNN without AMX uses vdpbf16ps, which issues at half the FMA's rate here: a batch-16 decode
GEMM is compute-bound, and the kernel ran it 1.7x faster than oneDNN). It is used for every row
count, prefill included: each output sums its inputs in one fixed order whatever the rows, so a
row's result never depends on the batch, while switching kernels at some row count would make a
decode row's result depend on whether a prompt chunk shared its step. Also where the CPU has AMX:
oneDNN's AMX kernels are faster on long prompts, but their sums depend on the row count
(kernels/cpu_kernels.py bf16_gemm_preferred).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_kernels

# The batch size oneDNN is told to expect when choosing the blocked layout (a hint: any number of
# rows works). Decode batches are what the engine runs most often.
_EXPECTED_ROWS = 16


def _can_pack(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class Linear:
    """y = x @ weight.T + bias over the last dimension of x.

    On CPU with oneDNN (fp32, or bf16 where the CPU has bf16 instructions) the weight is kept only
    in its packed form; elsewhere (CUDA, fp16) this is plain `F.linear`. Results agree with
    `F.linear` to the rounding of a different summation order.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        # Chosen once, at load: the C++ bf16 GEMM where this CPU and build have it, else oneDNN.
        self.gemm = (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
                     and cpu_kernels.bf16_gemm_preferred())
        if self.gemm:
            self.packed = False
            self.weight = cpu_kernels.pack_bf16_gemm_weight(weight)
            self.gemm_bias = None if bias is None else bias.float().contiguous()
            return
        self.packed = _can_pack(weight)
        self.weight = (torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _EXPECTED_ROWS)
                       if self.packed else weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemm:
            rows = x.reshape(-1, self.in_features).contiguous()
            out = cpu_kernels.bf16_gemm(rows, self.weight, self.gemm_bias, self.out_features)
            return out.reshape(*x.shape[:-1], self.out_features)
        if not self.packed:
            return F.linear(x, self.weight, self.bias)
        if x.numel() == self.in_features:
            # oneDNN runs a single row through another kernel than two or more rows (measured: a
            # different sum for inputs wider than 1024, in fp32 and, after rounding, in about one
            # bf16 output in 3,000), so a request's tokens would change with whether it decoded
            # alone or in a batch. Two rows cost what one does (the step streams the weights either
            # way); every other row count agreed bit for bit.
            pair = torch.cat([x.reshape(1, -1)] * 2)
            out = torch.ops.mkldnn._linear_pointwise(pair, self.weight, self.bias, "none", [], "")
            return out[:1].reshape(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
