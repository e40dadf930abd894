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
// (kernels.cpu_ext's `avx2` library: 8-lane registers, tiles of up to 6 rows x 8 to 64 outputs) keeps
// the same order per output and the same rounding: its results equal the AVX-512 one's bit for bit.
#include <ATen/Parallel.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <utility>
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

// A tile is RM rows x CV vectors of 8 outputs, at vector v0 of a group's 8, over the input pairs
// [k0, k1). Per pair and vector, one 256-bit load of W holds inputs k and k+1 of 8 outputs; a shift (k)
// and a mask (k+1) make them fp32, and each row's FMA takes x[r, k] broadcast from memory (a load, not
// a register). Each output still adds its inputs in increasing k with one fp32 accumulator, as the
// AVX-512 tile does: the bits are the same. Why this shape: AVX2 has 16 registers and its FMAs take 4
// cycles at 2 a cycle, so a tile wants about 12 independent accumulators (kTileVectors: RM x CV near
// 12), where tiles of 4 rows x 16 outputs had 8. The loops are unrolled by pragma: without it gcc kept
// the accumulator array in memory, a store per FMA (measured: the avx2 linears of a batch-16 step went
// from 1.9-2.1x to 1.6-2.05x the avx512 ones' time, on a loaded machine).
//
// The sums carry over between calls in `acc` (fp32 rows of kGroupCols): the first block starts them at
// zero; the last adds the bias, and the caller rounds them to bf16.
template <int RM, int CV>
void tile(const float* x, int64_t x_stride, const uint16_t* w, int v0, int64_t k0, int64_t k1, float* acc_buf,
          bool first, bool last, int64_t pf_phase, int64_t pf_period, const float* bias) {
  __m256 acc[RM][CV];
  #pragma GCC unroll 16
  for (int r = 0; r < RM; ++r)
    #pragma GCC unroll 16
    for (int j = 0; j < CV; ++j)
      acc[r][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc_buf + r * kGroupCols + 8 * (v0 + j));
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  int64_t pf = pf_phase;
  for (int64_t k = k0; k < k1; ++k) {
    // This tile's CV x 8 x 2 weights of pair k (32 bytes per vector of the pair's 256).
    const auto* wk = reinterpret_cast<const __m256i*>(w + (k * kGroupCols + 8 * v0) * 2);
    if (pf == 0) {  // W kPrefetchPairs ahead, into L2, shared among the row tiles (see the AVX-512 tile)
      const char* ahead = reinterpret_cast<const char*>(wk) + kPrefetchPairs * kGroupCols * 4;
      for (int line = 0; line < (32 * CV + 63) / 64; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T1);
      pf = pf_period;
    }
    --pf;
    const float* xk = x + 2 * k;
    #pragma GCC unroll 16
    for (int j = 0; j < CV; ++j) {
      const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(wk + j), 16));
      #pragma GCC unroll 16
      for (int r = 0; r < RM; ++r)
        acc[r][j] = _mm256_fmadd_ps(_mm256_broadcast_ss(xk + r * x_stride), even, acc[r][j]);
    }
    #pragma GCC unroll 16
    for (int j = 0; j < CV; ++j) {
      const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(wk + j), high));
      #pragma GCC unroll 16
      for (int r = 0; r < RM; ++r)
        acc[r][j] = _mm256_fmadd_ps(_mm256_broadcast_ss(xk + r * x_stride + 1), odd, acc[r][j]);
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < RM; ++r)
    #pragma GCC unroll 16
    for (int j = 0; j < CV; ++j) {
      __m256 sum = acc[r][j];
      if (last && bias) sum = _mm256_add_ps(sum, _mm256_loadu_ps(bias + 8 * (v0 + j)));
      _mm256_storeu_ps(acc_buf + r * kGroupCols + 8 * (v0 + j), sum);
    }
}

using TileFn = void (*)(const float*, int64_t, const uint16_t*, int, int64_t, int64_t, float*, bool, bool, int64_t,
                        int64_t, const float*);
constexpr int kMaxTileRows = 6;
constexpr int kGroupVectors = kGroupCols / 8;
// Vectors per tile for RM rows: about 12 accumulators (RM x CV), at most the group's 8.
constexpr int kTileVectors[kMaxTileRows + 1] = {0, 8, 6, 4, 3, 2, 2};

template <int RM, int... CV>
constexpr std::array<TileFn, kGroupVectors + 1> tiles_of_rows(std::integer_sequence<int, 0, CV...>) {
  return {nullptr, tile<RM, CV>...};
}
template <int... RM>
constexpr std::array<std::array<TileFn, kGroupVectors + 1>, kMaxTileRows + 1> all_tiles(
    std::integer_sequence<int, 0, RM...>) {
  return {std::array<TileFn, kGroupVectors + 1>{},
          tiles_of_rows<RM>(std::make_integer_sequence<int, kGroupVectors + 1>())...};
}
// kTiles[rows][vectors]
constexpr auto kTiles = all_tiles(std::make_integer_sequence<int, kMaxTileRows + 1>());

// The finished sums of `rows` rows x `cols` outputs (acc_buf rows of kGroupCols, bias added) rounded to
// bf16 once (round to nearest even, as the AVX-512 tile's vcvtneps2bf16).
void store_rows(const float* acc_buf, int64_t rows, int64_t cols, c10::BFloat16* out, int64_t out_stride) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* sums = acc_buf + r * kGroupCols;
    c10::BFloat16* dst = out + r * out_stride;
    for (int64_t c = 0; c < cols; c += 16) {
      const __m256i y = avx2::to_bf16(_mm256_loadu_ps(sums + c), _mm256_loadu_ps(sums + c + 8));
      if (cols - c >= 16) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c), y);
      } else {
        uint16_t bits[16];
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(bits), y);
        std::memcpy(dst + c, bits, (cols - c) * sizeof(uint16_t));
      }
    }
  }
}
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
      // Row tiles of at most kMaxTileRows, as even as they go (16 rows: 6, 5, 5, not 6, 6, 4), so
      // none has too few accumulators.
      const int64_t tiles = (r1 - r0 + kMaxTileRows - 1) / kMaxTileRows;
      for (int64_t g = first; g < last; ++g) {
        const uint16_t* w = wp + g * k2 * kGroupCols * 2;
        const int64_t col0 = g * kGroupCols;
        const int64_t valid = std::min<int64_t>(kGroupCols, out_features - col0);
        const int vectors = static_cast<int>((valid + 7) / 8);  // all-padding vectors compute nothing
        const float* group_bias = bp ? bp + col0 : nullptr;
        float bias_pad[kGroupCols] = {};
        if (group_bias && valid < kGroupCols) {
          std::copy(group_bias, group_bias + valid, bias_pad);
          group_bias = bias_pad;
        }
        for (int64_t k0 = 0; k0 < k2; k0 += kBlockPairs) {
          const int64_t k1 = std::min(k2, k0 + kBlockPairs);
          for (int64_t t = 0, r = r0; t < tiles; ++t) {
            const int64_t rm = (r1 - r + (tiles - t) - 1) / (tiles - t);
            const int per_tile = kTileVectors[rm];
            for (int v0 = 0; v0 < vectors; v0 += per_tile) {
              kTiles[rm][std::min(per_tile, vectors - v0)](xp + r * x_stride, x_stride, w, v0, k0, k1,
                                                           acc.data() + (r - r0) * kGroupCols, k0 == 0, k1 == k2,
                                                           t, tiles, group_bias);
            }
            r += rm;
          }
        }
        store_rows(acc.data(), r1 - r0, valid, op + r0 * out_features + col0, out_features);
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
