"""Compiles every Triton kernel to a CUDA binary (sm_80, sm_90) without a GPU.

The interpreter checks numerics but accepts things the GPU compiler rejects (a loop-carried value
that changes dtype, unsupported casts or layouts); this catches those on a CPU-only machine. Triton's
own ptxas produces the cubin, so no CUDA driver or toolkit is needed.
"""

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.triton_attention import _paged_decode_kernel
from kernels.triton_kv import _copy_pages_kernel, _gather_kv_kernel, _store_kv_kernel

# Triton 3.9 warns once that its FP-fusion default will change; the kernels do not depend on it.
pytestmark = pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")


def _signature(kernel, pointers: dict[str, str], constexprs: dict[str, object]) -> dict[str, str]:
    """Pointer args get the given element type, constexprs are marked, the rest are integer scalars."""
    sig = {}
    for name in kernel.arg_names:
        if name in pointers:
            sig[name] = "*" + pointers[name]
        elif name in constexprs:
            sig[name] = "constexpr"
        elif name == "scale":
            sig[name] = "fp32"
        else:
            sig[name] = "i64" if name == "layer_offset" else "i32"
    return sig


def _kernels(kv: str):
    yield "paged_decode", _paged_decode_kernel, {
        "q_ptr": kv, "buffer_ptr": kv, "page_table_ptr": "i32", "seq_lens_ptr": "i32", "out_ptr": kv,
    }, dict(GROUP=3, PAGE_SIZE=16, HEAD_DIM=64, BLOCK_G=16, BLOCK_D=64, BLOCK_N=64)
    yield "store_kv", _store_kv_kernel, {
        "buffer_ptr": kv, "slots_ptr": "i64", "k_ptr": kv, "v_ptr": kv,
    }, dict(PAGE_SIZE=16, HEAD_DIM=128, TOKEN_ELEMS=1024, BLOCK=1024)
    yield "gather_kv", _gather_kv_kernel, {
        "buffer_ptr": kv, "page_ids_ptr": "i64", "k_out_ptr": kv, "v_out_ptr": kv,
    }, dict(PAGE_SIZE=16, TOKEN_ELEMS=512, BLOCK=512)
    for gather in (True, False):
        yield f"copy_pages_gather={gather}", _copy_pages_kernel, {
            "src_ptr": kv, "dst_ptr": kv, "page_ids_ptr": "i64",
        }, dict(PAGE_ELEMS=12 * 2 * 16 * 4 * 64, GATHER=gather, BLOCK=4096)


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "fp16"])
def test_kernels_compile_for_cuda(arch, kv_dtype):
    for name, kernel, pointers, constexprs in _kernels(kv_dtype):
        source = ASTSource(kernel, _signature(kernel, pointers, constexprs), constexprs=constexprs)
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32))
        assert compiled.asm.get("cubin"), f"{name} produced no cubin for sm_{arch}"
