// y = x @ W^T (+ bias) in bf16 for CPUs with AVX-512 or AVX2 + FMA, on a weight packed once at load.
//
// Why: oneDNN's bf16 linears ran a decode step's weights at about 4 GB/s per thread (the small
// preset, batch 16, 50 of a step's 60 ms). A decode GEMM has few rows, so it is a stream of the
// weights: this kernel reads each weight once per call for up to kRowBlock rows and does the math
// in fp32 FMAs (see tile() for why not vdpbf16ps).
//
// Layout (kernels.cpu_kernels.pack_bf16_gemm_weight): W [N, K] is padded to N multiple of
// kGroupCols and K even, then stored as [N / 64][K / 2][64][2]: for one group of 64 outputs, the
// 64 x 2 weights of each pair of inputs are 256 contiguous bytes (four 512-bit loads), and a
// group's whole K is one contiguous run the hardware prefetcher streams.
//
// Batch invariance: every output is one fp32 accumulator that adds the K inputs in pairs, in
// increasing k, whatever the number of rows, the row tile, the thread split or the other rows; the
// bias is added in fp32 after the sum and the result rounded to bf16 once (round to nearest even);
// blocking over K only parks the fp32 sums in memory between blocks, which changes no bit.
// So a row's result is bit-identical alone or in any batch, prefill or decode. The AVX2 variant
// (kernels.cpu_ext's `avx2` library: 8-lane registers, so a tile is 16 outputs wide, not 64) keeps
// the same order per output and the same rounding: its results equal the AVX-512 one's bit for bit.
#include <ATen/Parallel.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <vector>

#include "numerics.h"

#if defined(__AVX512BF16__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace pdserve {
namespace {

constexpr int64_t kGroupCols = 64;  // outputs per packed group: four 16-lane accumulators per row
// Rows whose x stays in cache while a thread walks its groups: W is read from memory once per
// block of this many rows (all of a decode batch), then from L2 for each tile of rows inside it.
constexpr int64_t kRowBlock = 128;
// Input pairs per block of W (64 x 256 bytes = 16 KB, in L1): every row tile of the row block runs
// over one block before the next, so W streams from memory once while the tiles compute, instead of
// the first tile waiting on memory and the others then running from cache.
constexpr int64_t kBlockPairs = 64;
constexpr int64_t kPrefetchPairs = kBlockPairs;

bool supported() {
#if defined(__AVX512BF16__) || (defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__))
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512BF16__)

// One tile: RM rows x 64 outputs over the input pairs [k0, k1). Each 512-bit load of W holds the
// weights of inputs k and k+1 for 16 outputs; a shift (k) and a mask (k+1) make them fp32, and fp32
// FMAs with x[r, k] broadcast do the math. Why not vdpbf16ps: on this CPU (Emerald Rapids without
// AMX) it issues at half the rate of the FMA (measured 1.3 G vs 5.3 G instructions/s per core for
// 64 vs 32 flops), so converting the weights for two FMAs doubles the compute peak.
//
// The sums carry over between calls in `acc` (fp32, RM x 64, exact): the first block starts them at
// zero, the last adds the bias, rounds to bf16 once and stores the outputs.
template <int RM>
void tile(const float* x, int64_t x_stride, const __m512i* w, int64_t k0, int64_t k1, float* acc_buf, bool first,
          bool last, int64_t pf_phase, int64_t pf_period, const float* bias, c10::BFloat16* out, int64_t out_stride, int64_t valid_cols) {
  __m512 acc[RM][4];
  for (int r = 0; r < RM; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc_buf + r * 64 + 16 * j);
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  int64_t pf = pf_phase;
  for (int64_t k = k0; k < k1; ++k) {
    const __m512i* wk = w + 4 * k;
    if (pf == 0) {
      // W kPrefetchPairs ahead, into L2. The block's row tiles share the prefetches (tile i of n
      // takes every n-th pair): a core tracks only a few misses at a time, so one tile issuing
      // them all would stall on memory while the others computed with none in flight.
      for (int j = 0; j < 4; ++j) _mm_prefetch(reinterpret_cast<const char*>(wk + 4 * kPrefetchPairs + j), _MM_HINT_T1);
      pf = pf_period;
    }
    --pf;
    __m512 wf[4];
    for (int j = 0; j < 4; ++j) wf[j] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(wk + j), 16));
    for (int r = 0; r < RM; ++r) {
      const __m512 xr = _mm512_set1_ps(x[r * x_stride + 2 * k]);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(xr, wf[j], acc[r][j]);
    }
    for (int j = 0; j < 4; ++j) wf[j] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(wk + j), high));
    for (int r = 0; r < RM; ++r) {
      const __m512 xr = _mm512_set1_ps(x[r * x_stride + 2 * k + 1]);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(xr, wf[j], acc[r][j]);
    }
  }
  if (!last) {
    for (int r = 0; r < RM; ++r)
      for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc_buf + r * 64 + 16 * j, acc[r][j]);
    return;
  }
  for (int j = 0; j < 4; ++j) {
    const int64_t cols = std::clamp<int64_t>(valid_cols - 16 * j, 0, 16);
    if (cols == 0) break;
    const __mmask16 mask = cols == 16 ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * j) : _mm512_setzero_ps();
    for (int r = 0; r < RM; ++r) {
      const __m256bh y = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r][j], b));
      _mm256_mask_storeu_epi16(out + r * out_stride + 16 * j, mask, (__m256i)y);
    }
  }
}

using TileFn = void (*)(const float*, int64_t, const __m512i*, int64_t, int64_t, float*, bool, bool, int64_t, int64_t,
                        const float*,
                        c10::BFloat16*, int64_t, int64_t);
// Six rows x four vectors = 24 accumulators, leaving registers for the weights and a broadcast.
constexpr int kMaxTileRows = 6;
constexpr TileFn kTiles[kMaxTileRows + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};

#elif defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)

// One tile: RM rows x 16 of a group's 64 outputs (quarter q) over the input pairs [k0, k1). A 256-bit
// load of W holds the weights of inputs k and k+1 for 8 outputs; a shift (k) and a mask (k+1) make
// them fp32, as in the AVX-512 tile, and the FMAs run in the same order per output. 16 registers:
// 4 rows x 2 accumulators, two weight vectors, a broadcast and the mask (at 6 rows, 12 accumulators,
// gcc moved the accumulators through the stack on every input pair).
template <int RM>
void tile(const float* x, int64_t x_stride, const uint16_t* w, int quarter, int64_t k0, int64_t k1, float* acc_buf,
          bool first, bool last, int64_t pf_phase, int64_t pf_period, const float* bias, c10::BFloat16* out,
          int64_t out_stride, int64_t valid_cols) {
  __m256 acc[RM][2];
  for (int r = 0; r < RM; ++r)
    for (int j = 0; j < 2; ++j)
      acc[r][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc_buf + r * kGroupCols + 16 * quarter + 8 * j);
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  int64_t pf = pf_phase;
  for (int64_t k = k0; k < k1; ++k) {
    // This quarter's 16 x 2 weights of pair k: one 64-byte line of the pair's 256.
    const auto* wk = reinterpret_cast<const __m256i*>(w + (k * kGroupCols + 16 * quarter) * 2);
    if (pf == 0) {  // W kPrefetchPairs ahead, into L2, shared among the row tiles (see the AVX-512 tile)
      _mm_prefetch(reinterpret_cast<const char*>(wk) + kPrefetchPairs * kGroupCols * 4, _MM_HINT_T1);
      pf = pf_period;
    }
    --pf;
    __m256 wf[2];
    for (int j = 0; j < 2; ++j) wf[j] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(wk + j), 16));
    for (int r = 0; r < RM; ++r) {
      const __m256 xr = _mm256_broadcast_ss(x + r * x_stride + 2 * k);
      for (int j = 0; j < 2; ++j) acc[r][j] = _mm256_fmadd_ps(xr, wf[j], acc[r][j]);
    }
    for (int j = 0; j < 2; ++j) wf[j] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(wk + j), high));
    for (int r = 0; r < RM; ++r) {
      const __m256 xr = _mm256_broadcast_ss(x + r * x_stride + 2 * k + 1);
      for (int j = 0; j < 2; ++j) acc[r][j] = _mm256_fmadd_ps(xr, wf[j], acc[r][j]);
    }
  }
  if (!last) {
    for (int r = 0; r < RM; ++r)
      for (int j = 0; j < 2; ++j) _mm256_storeu_ps(acc_buf + r * kGroupCols + 16 * quarter + 8 * j, acc[r][j]);
    return;
  }
  const int64_t cols = std::clamp<int64_t>(valid_cols - 16 * quarter, 0, 16);
  if (cols == 0) return;
  float b[16] = {};
  if (bias) std::copy(bias + 16 * quarter, bias + 16 * quarter + cols, b);
  const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
  for (int r = 0; r < RM; ++r) {
    const __m256i y = avx2::to_bf16(_mm256_add_ps(acc[r][0], b0), _mm256_add_ps(acc[r][1], b1));
    c10::BFloat16* dst = out + r * out_stride + 16 * quarter;
    if (cols == 16) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), y);
    } else {
      uint16_t bits[16];
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(bits), y);
      std::memcpy(dst, bits, cols * sizeof(uint16_t));
    }
  }
}

using TileFn = void (*)(const float*, int64_t, const uint16_t*, int, int64_t, int64_t, float*, bool, bool, int64_t,
                        int64_t, const float*, c10::BFloat16*, int64_t, int64_t);
constexpr int kMaxTileRows = 4;
constexpr TileFn kTiles[kMaxTileRows + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>};

#endif

// x [M, K] bf16 contiguous; packed [N / 64, K2, 64, 2] bf16; bias [N] or none -> [M, N] bf16.
at::Tensor bf16_gemm(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                     int64_t out_features) {
  TORCH_CHECK(supported(), "bf16_gemm: this build has neither AVX512-BF16 nor AVX2 + FMA (keep oneDNN)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "bf16_gemm: x must be a contiguous 2-d bf16 tensor");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(2) == kGroupCols && packed.size(3) == 2,
              "bf16_gemm: packed must be [groups, K/2, 64, 2] bf16 (kernels.cpu_kernels.pack_bf16_gemm_weight)");
  const int64_t rows = x.size(0), in_features = x.size(1), groups = packed.size(0), k2 = packed.size(1);
  TORCH_CHECK(k2 == (in_features + 1) / 2, "bf16_gemm: x has ", in_features, " inputs, the weight ", 2 * k2);
  TORCH_CHECK(out_features > 0 && out_features <= groups * kGroupCols && out_features > (groups - 1) * kGroupCols,
              "bf16_gemm: out_features ", out_features, " does not match ", groups, " packed groups");
  std::optional<at::Tensor> bias32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features, "bf16_gemm: bias must be [out_features]");
    bias32 = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({rows, out_features}, x.options());
  if (rows == 0) return out;
  // x in fp32 (the FMAs' operand); an odd K reads x in pairs past each row's end, so give the rows a
  // zero column (its weight is zero).
  at::Tensor xin = x.to(at::kFloat);
  if (in_features % 2) xin = at::constant_pad_nd(xin, {0, 1});
#if defined(__AVX512BF16__)
  const float* xp = xin.data_ptr<float>();
  const auto* wp = reinterpret_cast<const __m512i*>(packed.data_ptr<c10::BFloat16>());
  const float* bp = bias32 ? bias32->data_ptr<float>() : nullptr;
  auto* op = out.data_ptr<c10::BFloat16>();
  const int64_t x_stride = 2 * k2;
  // Each thread takes a contiguous run of groups: its own stretch of the weights, streamed in order.
  at::parallel_for(0, groups, 1, [&](int64_t first, int64_t last) {
    std::vector<float> acc(kRowBlock * kGroupCols);
    for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
      const int64_t r1 = std::min(rows, r0 + kRowBlock);
      for (int64_t g = first; g < last; ++g) {
        const __m512i* w = wp + g * k2 * 4;
        const int64_t col0 = g * kGroupCols;
        const int64_t valid = std::min<int64_t>(kGroupCols, out_features - col0);
        for (int64_t k0 = 0; k0 < k2; k0 += kBlockPairs) {
          const int64_t k1 = std::min(k2, k0 + kBlockPairs);
          const int64_t tiles = (r1 - r0 + kMaxTileRows - 1) / kMaxTileRows;
          for (int64_t r = r0; r < r1; r += kMaxTileRows) {
            const int64_t rm = std::min<int64_t>(kMaxTileRows, r1 - r);
            kTiles[rm](xp + r * x_stride, x_stride, w, k0, k1, acc.data() + (r - r0) * kGroupCols, k0 == 0, k1 == k2,
                       (r - r0) / kMaxTileRows, tiles, bp ? bp + col0 : nullptr, op + r * out_features + col0, out_features, valid);
          }
        }
      }
    }
  });
#elif defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  const float* xp = xin.data_ptr<float>();
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>());
  const float* bp = bias32 ? bias32->data_ptr<float>() : nullptr;
  auto* op = out.data_ptr<c10::BFloat16>();
  const int64_t x_stride = 2 * k2;
  at::parallel_for(0, groups, 1, [&](int64_t first, int64_t last) {
    std::vector<float> acc(kRowBlock * kGroupCols);
    for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
      const int64_t r1 = std::min(rows, r0 + kRowBlock);
      for (int64_t g = first; g < last; ++g) {
        const uint16_t* w = wp + g * k2 * kGroupCols * 2;
        const int64_t col0 = g * kGroupCols;
        const int64_t valid = std::min<int64_t>(kGroupCols, out_features - col0);
        const int quarters = static_cast<int>((valid + 15) / 16);  // all-padding quarters compute nothing
        for (int64_t k0 = 0; k0 < k2; k0 += kBlockPairs) {
          const int64_t k1 = std::min(k2, k0 + kBlockPairs);
          const int64_t tiles = (r1 - r0 + kMaxTileRows - 1) / kMaxTileRows;
          for (int64_t r = r0; r < r1; r += kMaxTileRows) {
            const int64_t rm = std::min<int64_t>(kMaxTileRows, r1 - r);
            for (int q = 0; q < quarters; ++q) {
              kTiles[rm](xp + r * x_stride, x_stride, w, q, k0, k1, acc.data() + (r - r0) * kGroupCols, k0 == 0,
                         k1 == k2, (r - r0) / kMaxTileRows, tiles, bp ? bp + col0 : nullptr,
                         op + r * out_features + col0, out_features, valid);
            }
          }
        }
      }
    }
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(PDSERVE_OPS, m) {
  m.def("bf16_gemm_supported() -> bool", &supported);
  m.def("bf16_gemm(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor", &bf16_gemm);
}

}  // namespace pdserve
