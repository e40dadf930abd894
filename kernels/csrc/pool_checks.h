// Argument checks shared by the attention ops that read the page-major KV pool
// buffer[page, layer, k|v, slot, kv_head, dim] (libkv/pool.py) for queries q [tokens, Hq, D].
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace pdserve {

inline void check_queries_and_pool(const at::Tensor& q, const at::Tensor& buffer, int64_t layer) {
  TORCH_CHECK(q.device().is_cpu() && buffer.device().is_cpu(), "pdserve_cpu kernels take CPU tensors");
  TORCH_CHECK(q.dim() == 3 && buffer.dim() == 6, "q [tokens, Hq, D] and buffer [pages, layers, 2, P, Hkv, D] expected");
  TORCH_CHECK(q.scalar_type() == buffer.scalar_type(), "q and the KV pool must have one dtype, got ",
              q.scalar_type(), " and ", buffer.scalar_type());
  TORCH_CHECK(buffer.stride(5) == 1 && buffer.stride(4) == buffer.size(5),
              "a token's K (and V) for all KV heads must be one contiguous row of the pool");
  TORCH_CHECK(q.size(2) == buffer.size(5) && q.size(1) % buffer.size(4) == 0,
              "q heads must be a multiple of the KV heads with the same head_dim");
  TORCH_CHECK(layer >= 0 && layer < buffer.size(1), "layer ", layer, " out of range");
}

}  // namespace pdserve
