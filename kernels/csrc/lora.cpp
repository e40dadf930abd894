// Batched LoRA: each row of a step adds its own adapter's delta to a projection's output.
//
//   lora_delta_add  out[t] = round(out[t] + scale[s] * Bt_s^T (A_s x[t])),  s = row_slots[t] >= 0
//
// The adapters' weights sit side by side in one slot pool per projection (engine/lora/ops.py's
// layout): a [S * W, in] and bt [S * W, out] (B transposed), slot s's rows at s*W. A projection
// fuses M sub-modules (q/k/v: 3), each with its own R = W / M rank rows in A and Bt; sub-module m
// writes only its output columns [bounds[m], bounds[m+1]), so the expand skips the zero blocks of
// the fused B, and a slot reads only its adapter's `ranks[s]` of the R rows.
//
// Rows are grouped by slot and taken kBlock at a time, so a slot's weights are read once per block
// and not once per row; each row keeps its own accumulators in one fixed order, so its result never
// depends on the rows beside it. Rows of the base model (slot -1) are not touched. Sums are in fp32.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "numerics.h"

namespace pdserve {
namespace {

constexpr int64_t kBlock = 4;

template <typename T>
inline Vec16 load_n(const T* p, int64_t n) {
  return n == kLanes ? Vec16::load(p) : load_tail(p, n);
}

struct Block {
  int64_t first;  // index into `order`
  int64_t count;
};

template <typename T>
void lora_rows(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
               const int64_t* slots, const float* scales, const int64_t* ranks, at::IntArrayRef bounds,
               int64_t num_slots) {
  const int64_t rows = x.size(0), in = x.size(1), outs = out.size(1);
  const int64_t modules = static_cast<int64_t>(bounds.size()) - 1;
  const int64_t width = a.size(0) / num_slots, rank_rows = width / modules;
  const T* xs = x.data_ptr<T>();
  const T* as = a.data_ptr<T>();
  const T* bts = bt.data_ptr<T>();
  T* os = out.data_ptr<T>();

  // The rows of each slot, in slot order (a counting sort), cut into blocks of one slot.
  std::vector<int64_t> order;
  order.reserve(rows);
  std::vector<Block> blocks;
  for (int64_t s = 0; s < num_slots; ++s) {
    const int64_t start = static_cast<int64_t>(order.size());
    for (int64_t t = 0; t < rows; ++t) {
      if (slots[t] == s) order.push_back(t);
    }
    if (ranks[s] == 0) continue;  // an empty slot (its rows get a zero delta)
    for (int64_t i = start; i < static_cast<int64_t>(order.size()); i += kBlock) {
      blocks.push_back({i, std::min<int64_t>(kBlock, static_cast<int64_t>(order.size()) - i)});
    }
  }
  if (blocks.empty()) return;
  // A block's work is about kBlock * rank * modules * (in + out / modules) multiply-adds: a decode
  // step's few blocks of a small projection stay on one thread.
  const int64_t per_block = kBlock * rank_rows * (modules * in + outs);
  const int64_t grain = std::max<int64_t>(1, (1 << 18) / std::max<int64_t>(1, per_block));
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), grain, [&](int64_t first, int64_t last) {
    std::vector<float> inputs(kBlock * in), hidden(kBlock * width);
    for (int64_t item = first; item < last; ++item) {
      const Block block = blocks[item];
      const int64_t* block_rows = order.data() + block.first;
      const int64_t n = block.count, slot = slots[block_rows[0]], rank = std::min(ranks[slot], rank_rows);
      const float scale = scales[slot];
      for (int64_t r = 0; r < n; ++r) {
        const T* row = xs + block_rows[r] * in;
        for (int64_t i = 0; i < in; ++i) inputs[r * in + i] = to_float(row[i]);
      }
      // shrink: hidden[r][m*R + j] = scale * A[s*W + m*R + j] . x[r]
      for (int64_t m = 0; m < modules; ++m) {
        for (int64_t j = 0; j < rank; ++j) {
          const int64_t column = m * rank_rows + j;
          const T* a_row = as + (slot * width + column) * in;
          Vec16 acc[kBlock] = {Vec16::zero(), Vec16::zero(), Vec16::zero(), Vec16::zero()};
          for (int64_t i = 0; i < in; i += kLanes) {
            const int64_t lanes = std::min<int64_t>(kLanes, in - i);
            const Vec16 av = load_n(a_row + i, lanes);
            for (int64_t r = 0; r < n; ++r) acc[r] = acc[r].fma(av, load_n(inputs.data() + r * in + i, lanes));
          }
          for (int64_t r = 0; r < n; ++r) hidden[r * width + column] = scale * acc[r].sum();
        }
      }
      // expand: out[r][k] += sum_j hidden[r][m*R + j] * Bt[s*W + m*R + j][k], k in module m's columns
      for (int64_t m = 0; m < modules; ++m) {
        const T* bt_rows = bts + (slot * width + m * rank_rows) * outs;
        for (int64_t k = bounds[m]; k < bounds[m + 1]; k += kLanes) {
          const int64_t lanes = std::min<int64_t>(kLanes, bounds[m + 1] - k);
          Vec16 acc[kBlock] = {Vec16::zero(), Vec16::zero(), Vec16::zero(), Vec16::zero()};
          for (int64_t j = 0; j < rank; ++j) {
            const Vec16 bv = load_n(bt_rows + j * outs + k, lanes);
            for (int64_t r = 0; r < n; ++r) {
              acc[r] = acc[r].fma(Vec16::fill(hidden[r * width + m * rank_rows + j]), bv);
            }
          }
          for (int64_t r = 0; r < n; ++r) {
            T* o = os + block_rows[r] * outs + k;
            const Vec16 sum = load_n(o, lanes) + acc[r];
            if (lanes == kLanes) {
              sum.store(o);
            } else {
              store_tail(o, sum, lanes);
            }
          }
        }
      }
    }
  });
}

at::Tensor lora_delta_add(at::Tensor out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
                          const at::Tensor& row_slots, const at::Tensor& scales, const at::Tensor& ranks,
                          at::IntArrayRef bounds) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() && a.is_contiguous() && bt.is_contiguous()
              && out.is_contiguous(), "x, a, bt and out must be contiguous CPU tensors");
  TORCH_CHECK(a.scalar_type() == x.scalar_type() && bt.scalar_type() == x.scalar_type()
              && out.scalar_type() == x.scalar_type(), "x, a, bt and out must share a dtype");
  const int64_t num_slots = scales.size(0);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && row_slots.scalar_type() == at::kLong
              && row_slots.numel() == x.size(0) && ranks.scalar_type() == at::kLong && ranks.numel() == num_slots,
              "row_slots: int64 per row of x; scales: float32 and ranks: int64 per slot");
  const int64_t modules = static_cast<int64_t>(bounds.size()) - 1;
  TORCH_CHECK(modules >= 1 && bounds[0] == 0 && bounds[modules] == out.size(1),
              "bounds: the sub-modules' first output columns, then the output width");
  for (int64_t m = 0; m < modules; ++m) TORCH_CHECK(bounds[m] <= bounds[m + 1], "bounds must not decrease");
  TORCH_CHECK(a.size(0) % (num_slots * modules) == 0 && a.size(1) == x.size(1) && bt.size(0) == a.size(0)
              && out.size(0) == x.size(0) && out.size(1) == bt.size(1), "a [S*W, in], bt [S*W, out], out [T, out]");
  const int64_t* slots = row_slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < row_slots.numel(); ++t) TORCH_CHECK(slots[t] < num_slots, "row slot out of range");
  const float* scale = scales.data_ptr<float>();
  const int64_t* rank = ranks.data_ptr<int64_t>();
  switch (x.scalar_type()) {
    case at::kFloat: lora_rows<float>(out, x, a, bt, slots, scale, rank, bounds, num_slots); break;
    case at::kBFloat16: lora_rows<c10::BFloat16>(out, x, a, bt, slots, scale, rank, bounds, num_slots); break;
    default: TORCH_CHECK(false, "lora_delta_add supports float32 and bfloat16, got ", x.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(PDSERVE_OPS, m) {
  m.def("lora_delta_add(Tensor(a!) out, Tensor x, Tensor a, Tensor bt, Tensor row_slots, Tensor scales, "
        "Tensor ranks, int[] bounds) -> Tensor(a!)",
        &lora_delta_add);
}

}  // namespace pdserve
