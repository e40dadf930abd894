"""KV-cache kernels over the page-major pool of libkv.pool.

- `kernels.ops`: the entry points (store_kv, paged_decode_attention, gather_kv, gather_pages,
  scatter_pages); CUDA tensors run Triton kernels, anything else the torch implementations.
- `kernels.torch_ops`: vectorized torch implementations (the CPU path and the references).
- `kernels.triton_kv`, `kernels.triton_attention`: the Triton kernels, tested on CPU under
  TRITON_INTERPRET=1 (tests/kernels/triton_checks.py) and compiled for sm_80/sm_90 in tests.
- `kernels.cpu_kernels`, `kernels/csrc/`: C++ CPU kernels (paged decode attention read from the
  pages; fused norms, rotary + KV store, SiLU*mul), built by `make setup` through `kernels.cpu_ext`
  and tested against the torch implementations; the engine uses them on CPU when they are built.
- The timing of the torch CPU decode-attention variants considered is a benchmark tool:
  tools/bench/decode_attention.py.
"""
