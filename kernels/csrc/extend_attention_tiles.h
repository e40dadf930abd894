// The register-tiled matmuls of extend attention (extend_attention.cpp) on one packed K/V block of
// kKeyBlock keys: R rows of queries (or of softmax weights) at a time, each tile's accumulators held
// in registers. fp32 operands use Vec16 FMAs; bf16 operands, on a CPU with AVX512-BF16, dpbf16 on
// pairs of elements (bf16 products summed in fp32). Included by extend_attention.cpp only: its
// definitions share that file's unnamed namespace.
#pragma once

#include <cstdint>
#include <cstring>

#include "numerics.h"

namespace pdserve {
namespace {

// Keys per KV block: a row's scores for one block are four vectors, kept in registers.
constexpr int64_t kKeyBlock = 64;
constexpr int kKeyVectors = kKeyBlock / kLanes;

// ---- microkernels: R rows at a time ----
// scores[r][0..kKeyBlock) = q[r] . K block (unscaled).
template <int R>
void scores_tile(const float* q, int64_t D, const float* k, float* scores) {
  Vec16 acc[R][kKeyVectors];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kKeyVectors; ++c) acc[r][c] = Vec16::zero();
  for (int64_t d = 0; d < D; ++d) {
    Vec16 keys[kKeyVectors];
    for (int c = 0; c < kKeyVectors; ++c) keys[c] = Vec16::load(k + d * kKeyBlock + c * kLanes);
    for (int r = 0; r < R; ++r) {
      const Vec16 x = Vec16::fill(q[r * D + d]);
      for (int c = 0; c < kKeyVectors; ++c) acc[r][c] = acc[r][c].fma(x, keys[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kKeyVectors; ++c) acc[r][c].store(scores + r * kKeyBlock + c * kLanes);
}

// out[r][0..D) += p[r] . V block, D = NV * 16.
template <int R, int NV>
void values_tile(const float* p, const float* v, float* out) {
  constexpr int64_t D = NV * kLanes;
  Vec16 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = Vec16::load(out + r * D + c * kLanes);
  for (int64_t t = 0; t < kKeyBlock; ++t) {
    Vec16 values[NV];
    for (int c = 0; c < NV; ++c) values[c] = Vec16::load(v + t * D + c * kLanes);
    for (int r = 0; r < R; ++r) {
      const Vec16 x = Vec16::fill(p[r * kKeyBlock + t]);
      for (int c = 0; c < NV; ++c) acc[r][c] = acc[r][c].fma(x, values[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c].store(out + r * D + c * kLanes);
}

#if defined(__AVX512BF16__)
inline __m512bh as_bf16_pairs(__m512i x) { return reinterpret_cast<__m512bh&>(x); }

inline __m512bh broadcast_pair(const uint16_t* pair) {
  int32_t bits;
  std::memcpy(&bits, pair, sizeof(bits));
  return as_bf16_pairs(_mm512_set1_epi32(bits));
}

template <int R>
void scores_tile(const uint16_t* q, int64_t D, const uint16_t* k, float* scores) {
  __m512 acc[R][kKeyVectors];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kKeyVectors; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t pair = 0; pair < D / 2; ++pair) {
    __m512bh keys[kKeyVectors];
    for (int c = 0; c < kKeyVectors; ++c) {
      keys[c] = as_bf16_pairs(_mm512_loadu_si512(k + (pair * kKeyBlock + c * kLanes) * 2));
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh x = broadcast_pair(q + r * D + 2 * pair);
      for (int c = 0; c < kKeyVectors; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], x, keys[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kKeyVectors; ++c) _mm512_storeu_ps(scores + r * kKeyBlock + c * kLanes, acc[r][c]);
}

template <int R, int NV>
void values_tile(const uint16_t* p, const uint16_t* v, float* out) {
  constexpr int64_t D = NV * kLanes;
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_loadu_ps(out + r * D + c * kLanes);
  for (int64_t pair = 0; pair < kKeyBlock / 2; ++pair) {
    __m512bh values[NV];
    for (int c = 0; c < NV; ++c) {
      values[c] = as_bf16_pairs(_mm512_loadu_si512(v + (pair * D + c * kLanes) * 2));
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh x = broadcast_pair(p + r * kKeyBlock + 2 * pair);
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], x, values[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(out + r * D + c * kLanes, acc[r][c]);
}
#endif

// Rows per tile: R x (vectors per row) accumulators plus the loaded operands fit 32 registers.
constexpr int kScoreRows = 6;
template <int NV>
constexpr int value_rows() { return NV <= 4 ? 6 : (NV <= 8 ? 3 : 1); }

template <int R, typename P>
void scores_rows(const P* q, int64_t D, const P* k, float* scores, int64_t rows) {
  if constexpr (R > 0) {
    int64_t r = 0;
    for (; r + R <= rows; r += R) scores_tile<R>(q + r * D, D, k, scores + r * kKeyBlock);
    if (r < rows) scores_rows<R - 1>(q + r * D, D, k, scores + r * kKeyBlock, rows - r);
  }
}

template <int R, int NV, typename P>
void values_rows(const P* p, const P* v, float* out, int64_t rows) {
  if constexpr (R > 0) {
    int64_t r = 0;
    for (; r + R <= rows; r += R) values_tile<R, NV>(p + r * kKeyBlock, v, out + r * NV * kLanes);
    if (r < rows) values_rows<R - 1, NV>(p + r * kKeyBlock, v, out + r * NV * kLanes, rows - r);
  }
}

}  // namespace
}  // namespace pdserve
