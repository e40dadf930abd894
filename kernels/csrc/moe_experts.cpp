// The routed experts of a mixture-of-experts layer in one op:
//   out[t] = sum_j w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)),  e = ids[t, j]
// with every expert's gate_up [E, 2I, H] and down [E, H, I] stacked in plain row-major tensors of
// the model dtype (this rank's I columns under tensor parallelism).
//
// Why: run as one oneDNN matmul per expert and projection, a decode step of a 16-expert model
// spends ~50 us of call overhead per matmul on ~4 rows each. Here each expert's weights are read
// once per call for all of its rows, in two parallel regions:
//   1. per (expert, block of intermediate columns): gate and up dot products of the expert's rows,
//      then silu(gate) * up, into a per-pair activation buffer;
//   2. per block of hidden columns: every expert's down dot products for its rows, then each
//      token's weighted sum of its pairs for those columns.
//
// Numerics (batch invariance): each output element is a dot product over the contiguous input
// dimension, summed 16 lanes at a time in increasing index order and the lanes reduced in a fixed
// order; no sum runs across rows, and the register tiling over rows never changes a row's sum.
// A token's pairs are added in increasing expert id (then top-k slot), the order of the torch
// path's stable argsort + index_add_. So a token's output depends only on its own data.
// Rounding points are those of engine.models.moe's torch path (and HF): gate/up rounded to the
// model dtype, silu rounded, silu * up rounded, down rounded, down * weight rounded, and the
// running sum over a token's pairs rounded after each add (index_add_ into a model-dtype tensor).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "numerics.h"

namespace pdserve {
namespace {

constexpr int kTileRows = 4;  // input rows per register tile
constexpr int kTileCols = 4;  // weight rows per register tile (16 accumulators)
constexpr int64_t kGateColumns = 32;  // intermediate columns per phase-1 work item
constexpr int64_t kDownColumns = 64;  // hidden columns per phase-2 work item

// out[r][c] = dot(x[r], w[c]) over `size` elements, products and sums in fp32.
template <typename T>
inline void dot_tile(const T* const* x, const T* const* w, int64_t size, float (*out)[kTileCols]) {
  Vec16 acc[kTileRows][kTileCols];
#pragma GCC unroll 4
  for (int r = 0; r < kTileRows; ++r) {
#pragma GCC unroll 4
    for (int c = 0; c < kTileCols; ++c) acc[r][c] = Vec16::zero();
  }
  int64_t i = 0;
  for (; i + kLanes <= size; i += kLanes) {
    Vec16 wv[kTileCols];
#pragma GCC unroll 4
    for (int c = 0; c < kTileCols; ++c) wv[c] = Vec16::load(w[c] + i);
#pragma GCC unroll 4
    for (int r = 0; r < kTileRows; ++r) {
      const Vec16 xv = Vec16::load(x[r] + i);
#pragma GCC unroll 4
      for (int c = 0; c < kTileCols; ++c) acc[r][c] = acc[r][c].fma(xv, wv[c]);
    }
  }
  if (i < size) {
    const int64_t n = size - i;
    Vec16 wv[kTileCols];
    for (int c = 0; c < kTileCols; ++c) wv[c] = load_tail(w[c] + i, n);
    for (int r = 0; r < kTileRows; ++r) {
      const Vec16 xv = load_tail(x[r] + i, n);
      for (int c = 0; c < kTileCols; ++c) acc[r][c] = acc[r][c].fma(xv, wv[c]);
    }
  }
  for (int r = 0; r < kTileRows; ++r) {
    for (int c = 0; c < kTileCols; ++c) out[r][c] = acc[r][c].sum();
  }
}

#if defined(__AVX512BF16__)
// bf16 on CPUs with AVX512-BF16 (the library is built with -march=native and keyed by the CPU's
// flags): vdpbf16ps multiplies 32 bf16 pairs exactly in fp32 and adds them into 16 fp32 lanes,
// two products per lane in a fixed order, with no conversions; still one sum order per element.
inline void dot_tile(const c10::BFloat16* const* x, const c10::BFloat16* const* w, int64_t size,
                     float (*out)[kTileCols]) {
  __m512 acc[kTileRows][kTileCols];
#pragma GCC unroll 4
  for (int r = 0; r < kTileRows; ++r) {
#pragma GCC unroll 4
    for (int c = 0; c < kTileCols; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  auto step = [&](int64_t i, __mmask32 mask) {
    __m512bh wv[kTileCols];
#pragma GCC unroll 4
    for (int c = 0; c < kTileCols; ++c) wv[c] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w[c] + i);
#pragma GCC unroll 4
    for (int r = 0; r < kTileRows; ++r) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x[r] + i);
#pragma GCC unroll 4
      for (int c = 0; c < kTileCols; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
    }
  };
  int64_t i = 0;
  for (; i + 32 <= size; i += 32) step(i, ~__mmask32{0});
  if (i < size) step(i, static_cast<__mmask32>((1u << (size - i)) - 1u));
  for (int r = 0; r < kTileRows; ++r) {
    for (int c = 0; c < kTileCols; ++c) out[r][c] = _mm512_reduce_add_ps(acc[r][c]);
  }
}
#endif

template <typename F>
void dispatch(at::ScalarType type, F&& body) {
  switch (type) {
    case at::kFloat: body(float{}); break;
    case at::kBFloat16: body(c10::BFloat16{}); break;
    case at::kHalf: body(c10::Half{}); break;
    default: TORCH_CHECK(false, "moe_experts supports float32, bfloat16 and float16, got ", type);
  }
}

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                       const at::Tensor& gate_up, const at::Tensor& down) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), "x must be a contiguous 2-d CPU tensor");
  TORCH_CHECK(gate_up.dim() == 3 && down.dim() == 3 && gate_up.is_contiguous() && down.is_contiguous(),
              "gate_up and down must be contiguous [E, 2I, H] and [E, H, I]");
  const int64_t tokens = x.size(0), hidden = x.size(1);
  const int64_t experts = gate_up.size(0), width = down.size(2);
  TORCH_CHECK(gate_up.size(1) == 2 * width && gate_up.size(2) == hidden && down.size(0) == experts &&
                  down.size(1) == hidden,
              "gate_up must be [E, 2I, H] and down [E, H, I] for x's H");
  TORCH_CHECK(gate_up.scalar_type() == x.scalar_type() && down.scalar_type() == x.scalar_type(),
              "expert weights must have x's dtype");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == tokens && weights.sizes() == ids.sizes(),
              "ids and weights must be [T, k]");
  const int64_t top_k = ids.size(1), pairs = tokens * top_k;
  const at::Tensor id_values = ids.to(at::kLong).contiguous();
  const at::Tensor weight_values = weights.to(at::kFloat).contiguous();
  const int64_t* id = id_values.data_ptr<int64_t>();
  const float* route_weight = weight_values.data_ptr<float>();

  // Pairs (t * k + j) grouped by expert, stable: the torch path's argsort(stable=True) order.
  std::vector<int64_t> starts(experts + 1, 0);
  for (int64_t q = 0; q < pairs; ++q) {
    TORCH_CHECK(id[q] >= 0 && id[q] < experts, "expert id ", id[q], " out of range");
    ++starts[id[q] + 1];
  }
  for (int64_t e = 0; e < experts; ++e) starts[e + 1] += starts[e];
  std::vector<int64_t> order(pairs), position(pairs);  // sorted slot -> pair, pair -> sorted slot
  {
    std::vector<int64_t> next(starts.begin(), starts.end() - 1);
    for (int64_t q = 0; q < pairs; ++q) {
      position[q] = next[id[q]]++;
      order[position[q]] = q;
    }
  }
  // Each token's sorted slots in increasing order: the order its pairs are summed in.
  std::vector<int64_t> token_slots(position);
  for (int64_t t = 0; t < tokens; ++t) std::sort(token_slots.begin() + t * top_k, token_slots.begin() + (t + 1) * top_k);

  at::Tensor out = at::empty({tokens, hidden}, x.options());
  if (tokens == 0) return out;
  std::vector<float> projected(static_cast<size_t>(pairs * hidden));   // [sorted slot, H]

  dispatch(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* x_data = x.data_ptr<T>();
    std::vector<T> activations(static_cast<size_t>(pairs * width));  // [sorted slot, I], rounded to T
    const T* gate_up_data = gate_up.data_ptr<T>();
    const T* down_data = down.data_ptr<T>();
    T* out_data = out.data_ptr<T>();

    // Phase 1: (expert, column block) items over the experts that received tokens.
    const int64_t blocks = (width + kGateColumns - 1) / kGateColumns;
    std::vector<int64_t> items;
    for (int64_t e = 0; e < experts; ++e) {
      if (starts[e + 1] > starts[e]) {
        for (int64_t b = 0; b < blocks; ++b) items.push_back(e * blocks + b);
      }
    }
    at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t first, int64_t last) {
      for (int64_t item = first; item < last; ++item) {
        const int64_t e = items[item] / blocks, b = items[item] % blocks;
        const int64_t col_end = std::min(width, (b + 1) * kGateColumns);
        const T* w_expert = gate_up_data + e * 2 * width * hidden;
        for (int64_t n = b * kGateColumns; n < col_end; n += 2) {
          const int64_t n2 = std::min(n + 1, col_end - 1);  // an odd last column repeats itself
          const T* w[kTileCols] = {w_expert + n * hidden, w_expert + n2 * hidden, w_expert + (width + n) * hidden,
                                   w_expert + (width + n2) * hidden};
          for (int64_t s = starts[e]; s < starts[e + 1]; s += kTileRows) {
            const int64_t rows = std::min<int64_t>(kTileRows, starts[e + 1] - s);
            const T* xr[kTileRows];
            for (int r = 0; r < kTileRows; ++r) xr[r] = x_data + (order[s + std::min<int64_t>(r, rows - 1)] / top_k) * hidden;
            float result[kTileRows][kTileCols];
            dot_tile(xr, w, hidden, result);
            for (int64_t r = 0; r < rows; ++r) {
              for (int c = 0; c < 2 && n + c < col_end; ++c) {
                const float g = round_as<T>(result[r][c]), u = round_as<T>(result[r][2 + c]);
                const float silu = round_as<T>(g / (1.0f + std::exp(-g)));
                activations[(s + r) * width + n + c] = from_float<T>(silu * u);
              }
            }
          }
        }
      }
    });

    // Phase 2: hidden column blocks; each runs every expert's down rows for its columns, then
    // each token's weighted sum over its pairs for those columns.
    const int64_t down_blocks = (hidden + kDownColumns - 1) / kDownColumns;
    at::parallel_for(0, down_blocks, 1, [&](int64_t first, int64_t last) {
      for (int64_t b = first; b < last; ++b) {
        const int64_t h_begin = b * kDownColumns, h_end = std::min(hidden, h_begin + kDownColumns);
        for (int64_t e = 0; e < experts; ++e) {
          if (starts[e + 1] == starts[e]) continue;
          const T* w_expert = down_data + e * hidden * width;
          for (int64_t h = h_begin; h < h_end; h += kTileCols) {
            const int64_t cols = std::min<int64_t>(kTileCols, h_end - h);
            const T* w[kTileCols];
            for (int c = 0; c < kTileCols; ++c) w[c] = w_expert + (h + std::min<int64_t>(c, cols - 1)) * width;
            for (int64_t s = starts[e]; s < starts[e + 1]; s += kTileRows) {
              const int64_t rows = std::min<int64_t>(kTileRows, starts[e + 1] - s);
              const T* ar[kTileRows];
              for (int r = 0; r < kTileRows; ++r) ar[r] = activations.data() + (s + std::min<int64_t>(r, rows - 1)) * width;
              float result[kTileRows][kTileCols];
              dot_tile(ar, w, width, result);
              for (int64_t r = 0; r < rows; ++r) {
                for (int64_t c = 0; c < cols; ++c) projected[(s + r) * hidden + h + c] = round_as<T>(result[r][c]);
              }
            }
          }
        }
        for (int64_t t = 0; t < tokens; ++t) {
          T* o = out_data + t * hidden;
          for (int64_t h = h_begin; h < h_end; ++h) {
            float sum = 0.0f;
            for (int64_t m = 0; m < top_k; ++m) {
              const int64_t s = token_slots[t * top_k + m];
              sum = round_as<T>(sum + round_as<T>(projected[s * hidden + h] * route_weight[order[s]]));
            }
            o[h] = from_float<T>(sum);
          }
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(PDSERVE_OPS, m) {
  m.def("moe_experts(Tensor x, Tensor ids, Tensor weights, Tensor gate_up, Tensor down) -> Tensor", &moe_experts);
}

}  // namespace pdserve
