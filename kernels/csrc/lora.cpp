// Batched LoRA: each row of a step adds its own adapter's delta to a projection's output.
//
//   lora_delta_add  out[t] = round(out[t] + scale[s] * B_s @ (A_s @ x[t])),  s = row_slots[t] >= 0
//
// The adapters' weights sit side by side in one slot pool per projection (engine/lora/ops.py's
// layout): a [S * W, in], slot s's rows at s*W; b [out, S * W], its columns at s*W. A row reads
// only its own slot's W rows of A and W columns of B (the torch path multiplies by every slot's
// and masks); rows of the base model (slot -1) are not touched at all. Sums are in fp32.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <vector>

#include "numerics.h"

namespace pdserve {
namespace {

template <typename T>
inline float dot(const T* a, const float* b, int64_t size) {
  Vec16 acc = Vec16::zero();
  int64_t i = 0;
  for (; i + kLanes <= size; i += kLanes) acc = acc.fma(Vec16::load(a + i), Vec16::load(b + i));
  if (i < size) acc = acc.fma(load_tail(a + i, size - i), load_tail(b + i, size - i));
  return acc.sum();
}

template <typename T>
void lora_rows(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
               const int64_t* slots, const float* scales, int64_t width) {
  const int64_t rows = x.size(0), in = x.size(1), outs = out.size(1), columns = b.size(1);
  const T* xs = x.data_ptr<T>();
  const T* as = a.data_ptr<T>();
  const T* bs = b.data_ptr<T>();
  T* os = out.data_ptr<T>();
  // A row's work is in * W + out * W multiply-adds: a decode batch stays on one thread.
  const int64_t grain = std::max<int64_t>(1, (1 << 18) / std::max<int64_t>(1, (in + outs) * width));
  at::parallel_for(0, rows, grain, [&](int64_t first, int64_t last) {
    std::vector<float> row(in), hidden(width);
    for (int64_t t = first; t < last; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      for (int64_t i = 0; i < in; ++i) row[i] = to_float(xs[t * in + i]);
      const T* a_slot = as + slot * width * in;
      for (int64_t j = 0; j < width; ++j) hidden[j] = scales[slot] * dot(a_slot + j * in, row.data(), in);
      const T* b_slot = bs + slot * width;
      T* o = os + t * outs;
      for (int64_t k = 0; k < outs; ++k) {
        o[k] = from_float<T>(to_float(o[k]) + dot(b_slot + k * columns, hidden.data(), width));
      }
    }
  });
}

at::Tensor lora_delta_add(at::Tensor out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                          const at::Tensor& row_slots, const at::Tensor& scales) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() && a.is_contiguous() && b.is_contiguous()
              && out.is_contiguous(), "x, a, b and out must be contiguous CPU tensors");
  TORCH_CHECK(a.scalar_type() == x.scalar_type() && b.scalar_type() == x.scalar_type()
              && out.scalar_type() == x.scalar_type(), "x, a, b and out must share a dtype");
  const int64_t num_slots = scales.size(0);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && row_slots.scalar_type() == at::kLong
              && row_slots.numel() == x.size(0), "row_slots: int64 per row of x; scales: float32 per slot");
  TORCH_CHECK(a.size(0) % num_slots == 0 && a.size(1) == x.size(1) && b.size(1) == a.size(0)
              && out.size(0) == x.size(0) && out.size(1) == b.size(0), "a [S*W, in], b [out, S*W], out [T, out]");
  const int64_t width = a.size(0) / num_slots;
  const int64_t* slots = row_slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < row_slots.numel(); ++t) TORCH_CHECK(slots[t] < num_slots, "row slot out of range");
  const float* scale = scales.data_ptr<float>();
  switch (x.scalar_type()) {
    case at::kFloat: lora_rows<float>(out, x, a, b, slots, scale, width); break;
    case at::kBFloat16: lora_rows<c10::BFloat16>(out, x, a, b, slots, scale, width); break;
    default: TORCH_CHECK(false, "lora_delta_add supports float32 and bfloat16, got ", x.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(PDSERVE_OPS, m) {
  m.def("lora_delta_add(Tensor(a!) out, Tensor x, Tensor a, Tensor b, Tensor row_slots, Tensor scales) -> Tensor(a!)",
        &lora_delta_add);
}

}  // namespace pdserve
