// Element types and 16-wide float vectors shared by the pdserve CPU kernels.
//
// Every kernel computes in fp32 and stores in the tensor's dtype. `round_as<T>` reproduces the
// rounding a torch op in dtype T applies to its fp32 result, so a fused kernel rounds at the same
// points as the chain of torch ops (and HF transformers) it replaces.
//
// Vec16 is an AVX-512 register in the library built for AVX-512 (kernels.cpu_ext's `avx512` variant,
// -march=native), two AVX2 registers in the `avx2` one (fp32 FMAs, bf16 and fp16 widened in
// registers), else an array the compiler vectorizes as it can; kernels are written once against it.
// Each variant has one fixed order per reduction, so a row's result never depends on its batch.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

// The torch.ops namespace the kernels register under: one per variant, so several can be loaded in
// one process (kernels.cpu_ext passes it).
#ifndef PDSERVE_OPS
#define PDSERVE_OPS pdserve_cpu
#endif

#if defined(PDSERVE_ISA_AVX2) && defined(__AVX512F__)
#error "the avx2 variant must be compiled without AVX-512 (kernels.cpu_ext passes its flags)"
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif

namespace pdserve {

template <typename T>
inline float to_float(T value) {
  return static_cast<float>(value);
}

template <typename T>
inline T from_float(float value) {
  return static_cast<T>(value);  // c10's conversions round to nearest even
}

template <typename T>
inline float round_as(float value) {
  return to_float(from_float<T>(value));
}

constexpr int kLanes = 16;

#if defined(__AVX512F__)

struct Vec16 {
  __m512 v;
  static Vec16 zero() { return {_mm512_setzero_ps()}; }
  static Vec16 fill(float x) { return {_mm512_set1_ps(x)}; }
  static Vec16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec16 load(const c10::BFloat16* p) {
    __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))};
  }
  static Vec16 load(const c10::Half* p) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store(c10::BFloat16* p) const {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits(), 16)));
  }
  void store(c10::Half* p) const {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
  // The value a store to T and a load back would give (round to nearest even, as c10 does).
  template <typename T>
  Vec16 round_as() const {
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      return {_mm512_castsi512_ps(_mm512_and_si512(bf16_bits(), _mm512_set1_epi32(static_cast<int>(0xffff0000u))))};
    } else if constexpr (std::is_same_v<T, c10::Half>) {
      return {_mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT))};
    } else {
      return *this;
    }
  }
  // fp32 bits rounded to nearest even at bit 16 (a quiet NaN stays a NaN).
  __m512i bf16_bits() const {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_blend_epi32(nan, rounded, _mm512_set1_epi32(0x7fc00000));
  }
  float sum() const { return _mm512_reduce_add_ps(v); }
  float max() const { return _mm512_reduce_max_ps(v); }
  Vec16 operator+(Vec16 o) const { return {_mm512_add_ps(v, o.v)}; }
  Vec16 operator-(Vec16 o) const { return {_mm512_sub_ps(v, o.v)}; }
  Vec16 operator*(Vec16 o) const { return {_mm512_mul_ps(v, o.v)}; }
  // a * b + this
  Vec16 operator/(Vec16 o) const { return {_mm512_div_ps(v, o.v)}; }
  Vec16 operator-() const { return {_mm512_sub_ps(_mm512_setzero_ps(), v)}; }
  Vec16 fma(Vec16 a, Vec16 b) const { return {_mm512_fmadd_ps(a.v, b.v, v)}; }
  static Vec16 max(Vec16 a, Vec16 b) { return {_mm512_max_ps(a.v, b.v)}; }
};

// exp(x) for a vector: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by a degree-6 polynomial
// (relative error about 2e-7, below fp32's 6e-8 step only by a few ulp), times 2^n built in the
// exponent bits. Inputs below -87 give 0 (softmax weights that small vanish in fp32 anyway).
inline Vec16 exp(Vec16 x) {
  const __m512 lo = _mm512_set1_ps(-87.0f), hi = _mm512_set1_ps(88.0f);
  __m512 v = _mm512_min_ps(_mm512_max_ps(x.v, lo), hi);
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), v);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  __m512 r2 = _mm512_mul_ps(r, r);
  p = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  __m512 result = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
  // exactly 0 below the clamp, as std::exp underflows
  __mmask16 tiny = _mm512_cmp_ps_mask(x.v, lo, _CMP_LT_OQ);
  return {_mm512_mask_blend_ps(tiny, result, _mm512_setzero_ps())};
}

// Lane t of the result is the sum of the 16 lanes of v[t]: sixteen horizontal sums in 45
// shuffles and adds instead of 16 separate reductions of about 8 dependent steps each.
inline Vec16 sum_each(const Vec16* v) {
  __m512 pairs[8];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i].v, v[2 * i + 1].v),
                             _mm512_unpackhi_ps(v[2 * i].v, v[2 * i + 1].v));
  }
  __m512 quads[4];
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane sums of four vectors, in order
    quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  __m512 halves[2];
  for (int i = 0; i < 2; ++i) {  // fold the four 128-bit lanes pairwise
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0b10001000),
                              _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0b11011101));
  }
  return {_mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0b10001000),
                        _mm512_shuffle_f32x4(halves[0], halves[1], 0b11011101))};
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

// AVX2 + FMA: lanes 0-7 in `lo`, 8-15 in `hi`.
namespace avx2 {

// fp32 bits rounded to nearest even at bit 16 (a quiet NaN stays a NaN), as c10 rounds to bf16.
inline __m256i bf16_bits(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_castps_si256(
      _mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), nan));
}

// Sixteen fp32 lanes (two vectors) -> 16 bf16 (round to nearest even), in order.
inline __m256i to_bf16(__m256 lo, __m256 hi) {
  const __m256i a = _mm256_srli_epi32(bf16_bits(lo), 16), b = _mm256_srli_epi32(bf16_bits(hi), 16);
  // packus works per 128-bit half ([a0-3 b0-3 | a4-7 b4-7]): put the quarters back in order.
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0b11011000);
}

inline __m256 widen_bf16(__m128i raw) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)): the order sum_each uses too.
inline float sum8(__m256 v) {
  const __m256 h = _mm256_hadd_ps(v, v);
  const __m256 q = _mm256_hadd_ps(h, h);
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(q), _mm256_extractf128_ps(q, 1)));
}

inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f), hi = _mm256_set1_ps(88.0f);
  const __m256 v = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), v);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 result = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  return _mm256_blendv_ps(result, _mm256_setzero_ps(), _mm256_cmp_ps(x, lo, _CMP_LT_OQ));  // 0 below the clamp
}

// Lane t of the result: the sum of the eight lanes of v[t], in sum8's order.
inline __m256 sum_each8(const __m256* v) {
  const __m256 h01 = _mm256_hadd_ps(v[0], v[1]), h23 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 h45 = _mm256_hadd_ps(v[4], v[5]), h67 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 q0 = _mm256_hadd_ps(h01, h23), q1 = _mm256_hadd_ps(h45, h67);
  return _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20), _mm256_permute2f128_ps(q0, q1, 0x31));
}

}  // namespace avx2

struct Vec16 {
  __m256 lo, hi;
  static Vec16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static Vec16 fill(float x) {
    const __m256 v = _mm256_set1_ps(x);
    return {v, v};
  }
  static Vec16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static Vec16 load(const c10::BFloat16* p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {avx2::widen_bf16(_mm256_castsi256_si128(raw)), avx2::widen_bf16(_mm256_extracti128_si256(raw, 1))};
  }
  static Vec16 load(const c10::Half* p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm256_cvtph_ps(_mm256_castsi256_si128(raw)), _mm256_cvtph_ps(_mm256_extracti128_si256(raw, 1))};
  }
  void store(float* p) const {
    _mm256_storeu_ps(p, lo);
    _mm256_storeu_ps(p + 8, hi);
  }
  void store(c10::BFloat16* p) const {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), avx2::to_bf16(lo, hi));
  }
  void store(c10::Half* p) const {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p) + 1, _mm256_cvtps_ph(hi, _MM_FROUND_TO_NEAREST_INT));
  }
  template <typename T>
  Vec16 round_as() const {
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
      return {_mm256_castsi256_ps(_mm256_and_si256(avx2::bf16_bits(lo), high)),
              _mm256_castsi256_ps(_mm256_and_si256(avx2::bf16_bits(hi), high))};
    } else if constexpr (std::is_same_v<T, c10::Half>) {
      return {_mm256_cvtph_ps(_mm256_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT)),
              _mm256_cvtph_ps(_mm256_cvtps_ph(hi, _MM_FROUND_TO_NEAREST_INT))};
    } else {
      return *this;
    }
  }
  float sum() const { return avx2::sum8(_mm256_add_ps(lo, hi)); }
  float max() const {
    __m256 m = _mm256_max_ps(lo, hi);
    m = _mm256_max_ps(m, _mm256_permute2f128_ps(m, m, 1));
    m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, _MM_SHUFFLE(1, 0, 3, 2)));
    m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm256_cvtss_f32(m);
  }
  Vec16 operator+(Vec16 o) const { return {_mm256_add_ps(lo, o.lo), _mm256_add_ps(hi, o.hi)}; }
  Vec16 operator-(Vec16 o) const { return {_mm256_sub_ps(lo, o.lo), _mm256_sub_ps(hi, o.hi)}; }
  Vec16 operator*(Vec16 o) const { return {_mm256_mul_ps(lo, o.lo), _mm256_mul_ps(hi, o.hi)}; }
  Vec16 operator/(Vec16 o) const { return {_mm256_div_ps(lo, o.lo), _mm256_div_ps(hi, o.hi)}; }
  Vec16 operator-() const { return {_mm256_sub_ps(_mm256_setzero_ps(), lo), _mm256_sub_ps(_mm256_setzero_ps(), hi)}; }
  // a * b + this
  Vec16 fma(Vec16 a, Vec16 b) const { return {_mm256_fmadd_ps(a.lo, b.lo, lo), _mm256_fmadd_ps(a.hi, b.hi, hi)}; }
  static Vec16 max(Vec16 a, Vec16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
};

inline Vec16 exp(Vec16 x) { return {avx2::exp8(x.lo), avx2::exp8(x.hi)}; }

// Lane t of the result is v[t].sum(), bit for bit.
inline Vec16 sum_each(const Vec16* v) {
  __m256 folded[kLanes];
  for (int t = 0; t < kLanes; ++t) folded[t] = _mm256_add_ps(v[t].lo, v[t].hi);
  return {avx2::sum_each8(folded), avx2::sum_each8(folded + 8)};
}

#else  // portable fallback: plain arrays, vectorized by the compiler where it can

struct Vec16 {
  float v[kLanes];
  static Vec16 zero() { return fill(0.0f); }
  static Vec16 fill(float x) {
    Vec16 r;
    for (int i = 0; i < kLanes; ++i) r.v[i] = x;
    return r;
  }
  template <typename T>
  static Vec16 load(const T* p) {
    Vec16 r;
    for (int i = 0; i < kLanes; ++i) r.v[i] = to_float(p[i]);
    return r;
  }
  template <typename T>
  void store(T* p) const {
    for (int i = 0; i < kLanes; ++i) p[i] = from_float<T>(v[i]);
  }
  template <typename T>
  Vec16 round_as() const {
    Vec16 r;
    for (int i = 0; i < kLanes; ++i) r.v[i] = pdserve::round_as<T>(v[i]);
    return r;
  }
  float sum() const {
    float s = 0.0f;
    for (int i = 0; i < kLanes; ++i) s += v[i];
    return s;
  }
  float max() const {
    float m = v[0];
    for (int i = 1; i < kLanes; ++i) m = std::fmax(m, v[i]);
    return m;
  }
  Vec16 operator+(Vec16 o) const { Vec16 r; for (int i = 0; i < kLanes; ++i) r.v[i] = v[i] + o.v[i]; return r; }
  Vec16 operator-(Vec16 o) const { Vec16 r; for (int i = 0; i < kLanes; ++i) r.v[i] = v[i] - o.v[i]; return r; }
  Vec16 operator*(Vec16 o) const { Vec16 r; for (int i = 0; i < kLanes; ++i) r.v[i] = v[i] * o.v[i]; return r; }
  Vec16 operator/(Vec16 o) const { Vec16 r; for (int i = 0; i < kLanes; ++i) r.v[i] = v[i] / o.v[i]; return r; }
  Vec16 operator-() const { Vec16 r; for (int i = 0; i < kLanes; ++i) r.v[i] = -v[i]; return r; }
  Vec16 fma(Vec16 a, Vec16 b) const { Vec16 r; for (int i = 0; i < kLanes; ++i) r.v[i] = a.v[i] * b.v[i] + v[i]; return r; }
  static Vec16 max(Vec16 a, Vec16 b) { Vec16 r; for (int i = 0; i < kLanes; ++i) r.v[i] = std::fmax(a.v[i], b.v[i]); return r; }
};

inline Vec16 exp(Vec16 x) {
  Vec16 r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = std::exp(x.v[i]);
  return r;
}

inline Vec16 sum_each(const Vec16* v) {
  Vec16 r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = v[i].sum();
  return r;
}

#endif

// Loads and stores of the last n < 16 elements of a row, through a padded float buffer.
template <typename T>
inline Vec16 load_tail(const T* p, int64_t n) {
  float padded[kLanes] = {};
  for (int64_t i = 0; i < n; ++i) padded[i] = to_float(p[i]);
  return Vec16::load(padded);
}

template <typename T>
inline void store_tail(T* p, Vec16 value, int64_t n) {
  float padded[kLanes];
  value.store(padded);
  for (int64_t i = 0; i < n; ++i) p[i] = from_float<T>(padded[i]);
}

}  // namespace pdserve
