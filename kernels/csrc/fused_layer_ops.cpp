// The small per-layer ops of a decoder step, each fused into one pass over its rows.
//
// In a decode step these ops touch little data, so their cost was the chain of separate torch ops
// (casts, pow, mean, rsqrt, mul, cat, neg, index_copy_ ...): about 20 launches per layer. Each
// kernel here does the same arithmetic in fp32 and rounds to the tensor's dtype at the points
// where HF transformers' torch ops round, so bf16 results stay as close to HF as the op chain was.
//   rms_norm        y = w * round(x * rsqrt(mean(x^2) + eps))                     (HF RMSNorm)
//   add_rms_norm    residual = round(residual + x) in place, then rms_norm(residual)
//   qk_norm_rope_store  per token: q/k head norms (Qwen3), rotary (rotate-half), K and V written
//                   into the pool slot, q and k returned
//   silu_and_mul    round(round(silu(gate)) * up) over [gate | up] halves
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "numerics.h"

namespace pdserve {
namespace {

// Rows per parallel chunk are chosen so a chunk holds about this many elements: a decode batch
// stays on the calling thread (its work takes tens of microseconds; a parallel region waits for
// every thread, and on a shared machine one of them is often descheduled for milliseconds),
// prefill chunks spread over the threads.
constexpr int64_t kElementsPerChunk = 1 << 18;

int64_t grain_for(int64_t row_elements) {
  return std::max<int64_t>(1, kElementsPerChunk / std::max<int64_t>(1, row_elements));
}

template <typename T>
inline Vec16 load_n(const T* p, int64_t n) {
  return n == kLanes ? Vec16::load(p) : load_tail(p, n);
}

template <typename T>
inline void store_n(T* p, Vec16 value, int64_t n) {
  if (n == kLanes) {
    value.store(p);
  } else {
    store_tail(p, value, n);
  }
}

template <typename T>
float inverse_rms(const T* x, int64_t size, float eps) {
  Vec16 squares = Vec16::zero();
  for (int64_t i = 0; i < size; i += kLanes) {
    const Vec16 v = load_n(x + i, std::min<int64_t>(kLanes, size - i));
    squares = squares.fma(v, v);
  }
  return 1.0f / std::sqrt(squares.sum() / static_cast<float>(size) + eps);
}

// out = weight * round(x * inverse), rounded; `out` may alias `x`.
template <typename T, typename Out>
void scale_row(const T* x, const T* weight, float inverse, int64_t size, Out* out) {
  for (int64_t i = 0; i < size; i += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, size - i);
    const Vec16 normed = (load_n(x + i, n) * Vec16::fill(inverse)).template round_as<T>();
    store_n(out + i, (load_n(weight + i, n) * normed).template round_as<T>(), n);
  }
}

void check_rows(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), "x must be a contiguous 2-d CPU tensor");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must be contiguous, of x's dtype, with x.size(1) elements");
}

template <typename F>
void dispatch(at::ScalarType type, const char* name, F&& body) {
  switch (type) {
    case at::kFloat: body(float{}); break;
    case at::kBFloat16: body(c10::BFloat16{}); break;
    case at::kHalf: body(c10::Half{}); break;
    default: TORCH_CHECK(false, name, " supports float32, bfloat16 and float16, got ", type);
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight);
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t rows = x.size(0), size = x.size(1);
  dispatch(x.scalar_type(), "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    const T* in = x.data_ptr<T>();
    const T* w = weight.data_ptr<T>();
    T* o = out.data_ptr<T>();
    at::parallel_for(0, rows, grain_for(size), [&](int64_t first, int64_t last) {
      for (int64_t r = first; r < last; ++r) {
        scale_row(in + r * size, w, inverse_rms(in + r * size, size, static_cast<float>(eps)), size, o + r * size);
      }
    });
  });
  return out;
}

at::Tensor add_rms_norm(at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(residual, weight);
  TORCH_CHECK(x.sizes() == residual.sizes() && x.is_contiguous() && x.scalar_type() == residual.scalar_type(),
              "x must be contiguous, of the residual's shape and dtype");
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t rows = x.size(0), size = x.size(1);
  dispatch(x.scalar_type(), "add_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    T* res = residual.data_ptr<T>();
    const T* in = x.data_ptr<T>();
    const T* w = weight.data_ptr<T>();
    T* o = out.data_ptr<T>();
    at::parallel_for(0, rows, grain_for(size), [&](int64_t first, int64_t last) {
      for (int64_t r = first; r < last; ++r) {
        T* row = res + r * size;
        for (int64_t i = 0; i < size; i += kLanes) {
          const int64_t n = std::min<int64_t>(kLanes, size - i);
          store_n(row + i, load_n(row + i, n) + load_n(in + r * size + i, n), n);
        }
        scale_row(row, w, inverse_rms(row, size, static_cast<float>(eps)), size, o + r * size);
      }
    });
  });
  return out;
}

// One head of one token: optional RMS norm over head_dim, then rotate-half rotary with this
// position's cos/sin rows, written to `out`. HF rounds q * cos, rotate_half(q) * sin and their sum.
template <typename T>
void norm_rope_head(const T* x, const T* norm_weight, float eps, const T* cos, const T* sin, int64_t head_dim,
                    float* scratch, T* out) {
  if (norm_weight != nullptr) {
    scale_row(x, norm_weight, inverse_rms(x, head_dim, eps), head_dim, scratch);
  } else {
    for (int64_t d = 0; d < head_dim; ++d) scratch[d] = to_float(x[d]);
  }
  const int64_t half = head_dim / 2;
  for (int64_t d = 0; d < half; d += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, half - d);
    const Vec16 x1 = load_n(scratch + d, n), x2 = load_n(scratch + half + d, n);
    const Vec16 first = (x1 * load_n(cos + d, n)).template round_as<T>() +
                        (-x2 * load_n(sin + d, n)).template round_as<T>();
    const Vec16 second = (x2 * load_n(cos + half + d, n)).template round_as<T>() +
                         (x1 * load_n(sin + half + d, n)).template round_as<T>();
    store_n(out + d, first, n);
    store_n(out + half + d, second, n);
  }
}

std::tuple<at::Tensor, at::Tensor> qk_norm_rope_store(
    const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
    const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm, double eps,
    at::Tensor& buffer, int64_t layer, const at::Tensor& slots, int64_t num_heads, int64_t num_kv_heads) {
  const int64_t tokens = qkv.size(0), head_dim = buffer.size(5);
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim,
              "qkv must be [T, (Hq + 2 Hkv) * head_dim] with contiguous rows");
  TORCH_CHECK(buffer.scalar_type() == qkv.scalar_type() && cos.scalar_type() == qkv.scalar_type() &&
                  sin.scalar_type() == qkv.scalar_type(),
              "qkv, the KV pool and the cos/sin tables must have one dtype");
  TORCH_CHECK(buffer.size(4) == num_kv_heads && buffer.stride(5) == 1 && head_dim % 2 == 0,
              "the KV pool must be [pages, L, 2, P, Hkv, D] with contiguous head_dim");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == head_dim && sin.sizes() == cos.sizes(),
              "cos/sin must be contiguous [positions, head_dim]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slots.scalar_type() == at::kLong &&
                  positions.numel() == tokens && slots.numel() == tokens,
              "positions and slots must be int64 with one entry per token");
  for (const auto& norm : {q_norm, k_norm}) {
    TORCH_CHECK(!norm.has_value() || (norm->numel() == head_dim && norm->is_contiguous() &&
                                      norm->scalar_type() == qkv.scalar_type()),
                "q_norm/k_norm must be contiguous [head_dim] of qkv's dtype");
  }
  at::Tensor q_out = at::empty({tokens, num_heads, head_dim}, qkv.options());
  at::Tensor k_out = at::empty({tokens, num_kv_heads, head_dim}, qkv.options());
  at::Tensor pos = positions.contiguous(), slot_ids = slots.contiguous();
  const int64_t row_elements = qkv.size(1);
  const int64_t page_size = buffer.size(3), num_positions = cos.size(0);

  dispatch(qkv.scalar_type(), "qk_norm_rope_store", [&](auto tag) {
    using T = decltype(tag);
    const T* qkv_data = qkv.data_ptr<T>();
    const T* cos_data = cos.data_ptr<T>();
    const T* sin_data = sin.data_ptr<T>();
    const T* qn = q_norm.has_value() ? q_norm->data_ptr<T>() : nullptr;
    const T* kn = k_norm.has_value() ? k_norm->data_ptr<T>() : nullptr;
    T* pool = buffer.data_ptr<T>();
    T* q_data = q_out.data_ptr<T>();
    T* k_data = k_out.data_ptr<T>();
    const int64_t* pos_data = pos.data_ptr<int64_t>();
    const int64_t* slot_data = slot_ids.data_ptr<int64_t>();
    at::parallel_for(0, tokens, grain_for(row_elements), [&](int64_t first, int64_t last) {
      std::vector<float> scratch(static_cast<size_t>(head_dim));
      for (int64_t t = first; t < last; ++t) {
        const int64_t position = pos_data[t], slot = slot_data[t];
        TORCH_CHECK(position >= 0 && position < num_positions, "position ", position, " outside the rotary table");
        const T* c = cos_data + position * head_dim;
        const T* s = sin_data + position * head_dim;
        const T* row = qkv_data + t * qkv.stride(0);
        for (int64_t h = 0; h < num_heads; ++h) {
          norm_rope_head(row + h * head_dim, qn, static_cast<float>(eps), c, s, head_dim, scratch.data(),
                         q_data + (t * num_heads + h) * head_dim);
        }
        T* k_slot = pool + (slot / page_size) * buffer.stride(0) + layer * buffer.stride(1) +
                    (slot % page_size) * buffer.stride(3);
        T* v_slot = k_slot + buffer.stride(2);
        const T* v_row = row + (num_heads + num_kv_heads) * head_dim;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          T* k = k_data + (t * num_kv_heads + h) * head_dim;
          norm_rope_head(row + (num_heads + h) * head_dim, kn, static_cast<float>(eps), c, s, head_dim,
                         scratch.data(), k);
          std::copy(k, k + head_dim, k_slot + h * buffer.stride(4));
          std::copy(v_row + h * head_dim, v_row + (h + 1) * head_dim, v_slot + h * buffer.stride(4));
        }
      }
    });
  });
  return {q_out, k_out};
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up must be a contiguous [T, 2 * intermediate] tensor");
  const int64_t rows = gate_up.size(0), size = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, size}, gate_up.options());
  dispatch(gate_up.scalar_type(), "silu_and_mul", [&](auto tag) {
    using T = decltype(tag);
    const T* in = gate_up.data_ptr<T>();
    T* o = out.data_ptr<T>();
    at::parallel_for(0, rows, grain_for(2 * size), [&](int64_t first, int64_t last) {
      for (int64_t r = first; r < last; ++r) {
        const T* gate = in + r * 2 * size;
        const T* up = gate + size;
        for (int64_t i = 0; i < size; i += kLanes) {
          const int64_t n = std::min<int64_t>(kLanes, size - i);
          const Vec16 g = load_n(gate + i, n);
          const Vec16 silu = (g / (Vec16::fill(1.0f) + exp(-g))).template round_as<T>();
          store_n(o + r * size + i, silu * load_n(up + i, n), n);
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(PDSERVE_OPS, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("add_rms_norm(Tensor(a!) residual, Tensor x, Tensor weight, float eps) -> Tensor", &add_rms_norm);
  m.def("qk_norm_rope_store(Tensor qkv, Tensor positions, Tensor cos, Tensor sin, Tensor? q_norm, "
        "Tensor? k_norm, float eps, Tensor(a!) buffer, int layer, Tensor slots, int num_heads, "
        "int num_kv_heads) -> (Tensor, Tensor)",
        &qk_norm_rope_store);
  m.def("silu_and_mul(Tensor gate_up) -> Tensor", &silu_and_mul);
}

}  // namespace pdserve
