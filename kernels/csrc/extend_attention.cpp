// Extend (prefill) attention of one span read straight from the page-major KV pool (libkv/pool.py):
// buffer[page, layer, k|v, slot, kv_head, dim]. The span's L new queries sit at absolute positions
// prefix_len .. prefix_len + L - 1; its keys are the prefix_len + L tokens on its pages (the new
// tokens' K/V were stored there before this runs), attended causally.
//
// Flash style. First every KV head's keys and values are copied once from the pages into blocks of
// kKeyBlock tokens in the layout the matmul microkernels (extend_attention_tiles.h) read (bf16:
// pairs of elements in 32-bit lanes, as _mm512_dpbf16_ps takes them), so the page walk and the
// transposition cost O(S D), not O(L S D). Then a work item is (KV head, block of kQueryBlock query
// positions): its rows are those positions times the `group` query heads sharing the KV head (GQA:
// each K/V block is used by all of them), and it walks the KV blocks up to the diagonal (blocks
// entirely above it are skipped): scores in fp32 (bf16 products summed in fp32 by dpbf16), an
// online softmax in fp32 per row (running max, running sum), then P (rounded to bf16 as torch's
// flash attention does) times V accumulated in fp32.
//
// Why a microkernel rather than at::native::cpublas::gemm: torch's own CPU flash attention calls
// that per block and reaches 80-90 GFLOP/s per thread on this Zen 5 (no AMX, so no brgemm for
// bf16); the calls are small (tens of rows by 64) and the per-call overhead dominates.
//
// fp32 and fp16 use the same loops with fp32 operands (fp16 converted on the copy, exactly), as
// does bf16 on a CPU without AVX512-BF16.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "extend_attention_tiles.h"
#include "numerics.h"
#include "pool_checks.h"

namespace pdserve {
namespace {

// Query positions per work item: 32 positions x 3 heads = 96 rows, whose scores (24 KB) and
// accumulators (24 KB) stay in L2 across the KV blocks, with enough items for every thread.
constexpr int64_t kQueryBlock = 32;
// The packed K/V copy a thread keeps between calls, at most (16 MB: K and V of 8 KV heads of
// 128 dims over 4096 tokens in bf16).
constexpr size_t kKeptPackedBytes = size_t{16} << 20;

#if defined(__AVX512BF16__)
constexpr bool kHaveBf16Dot = true;
#else
constexpr bool kHaveBf16Dot = false;
#endif

// Operand type of the matmuls for element type T: raw bf16 bits where dpbf16 can take them.
template <typename T>
using Operand = std::conditional_t<std::is_same_v<T, c10::BFloat16> && kHaveBf16Dot, uint16_t, float>;

inline void store_operand(float* p, Vec16 x) { x.store(p); }

inline void store_operand(uint16_t* p, Vec16 x) {
#if defined(__AVX512BF16__)
  const __m256bh rounded = _mm512_cvtneps_pbh(x.v);  // round to nearest even, as c10 does
  std::memcpy(p, &rounded, sizeof(rounded));
#else
  x.store(reinterpret_cast<c10::BFloat16*>(p));
#endif
}

template <typename T, typename P>
inline P element_to_operand(T x) {
  if constexpr (std::is_same_v<P, float>) {
    return to_float(x);
  } else {
    return x.x;  // bf16 stays bf16
  }
}

// ---- packing: the pages' K and V of one KV head into a block of kKeyBlock tokens ----
// fp32 operands: K as [D][kKeyBlock] (a row of scores is a sum of rows of K^T), V as [kKeyBlock][D].
// bf16 operands: K as [D/2][kKeyBlock][2] and V as [kKeyBlock/2][D][2] (dpbf16 multiplies pairs).
// Tokens past the span are zeros: their scores are masked, and P is 0 there, so 0 * V stays 0.
struct Pool {
  int64_t page_stride, kv_stride, slot_stride, layer_offset, page_size;
};

template <typename T>
inline const T* key_row(const Pool& pool, const T* data, const int32_t* pages, int64_t token, int64_t head,
                        int64_t head_dim) {
  return data + pages[token / pool.page_size] * pool.page_stride + pool.layer_offset +
         (token % pool.page_size) * pool.slot_stride + head * head_dim;
}

template <typename T, typename P>
void pack_block(const Pool& pool, const T* data, const int32_t* pages, int64_t head, int64_t head_dim,
                int64_t first, int64_t total, P* k_out, P* v_out) {
  const int64_t D = head_dim, count = std::min(kKeyBlock, total - first);
  if (count < kKeyBlock) {  // the span's last block: zeros past its end
    std::fill(k_out, k_out + kKeyBlock * D, P{});
    std::fill(v_out, v_out + kKeyBlock * D, P{});
  }
  if constexpr (std::is_same_v<P, float>) {
    for (int64_t t = 0; t < count; ++t) {
      const T* k = key_row(pool, data, pages, first + t, head, D);
      const T* v = k + pool.kv_stride;
      for (int64_t d = 0; d < D; ++d) k_out[d * kKeyBlock + t] = to_float(k[d]);
      for (int64_t d = 0; d < D; ++d) v_out[t * D + d] = to_float(v[d]);
    }
  } else {
    // In 32-bit units: K's pairs of dims are a transpose [key][D/2] -> [D/2][key]; V's pairs
    // of keys interleave two rows, element by element (a loop the compiler vectorizes).
    uint32_t* k_pairs = reinterpret_cast<uint32_t*>(k_out);
    uint32_t* v_pairs = reinterpret_cast<uint32_t*>(v_out);
    for (int64_t t = 0; t < count; t += 2) {
      const uint16_t* k0 = reinterpret_cast<const uint16_t*>(key_row(pool, data, pages, first + t, head, D));
      const uint16_t* v0 = k0 + pool.kv_stride;
      const bool pair = t + 1 < count;
      const uint16_t* k1 = pair ? reinterpret_cast<const uint16_t*>(key_row(pool, data, pages, first + t + 1, head, D)) : k0;
      const uint16_t* v1 = k1 + pool.kv_stride;
      for (int64_t d = 0; d < D / 2; ++d) {
        uint32_t a, b;
        std::memcpy(&a, k0 + 2 * d, sizeof(a));
        std::memcpy(&b, k1 + 2 * d, sizeof(b));
        k_pairs[d * kKeyBlock + t] = a;
        if (pair) k_pairs[d * kKeyBlock + t + 1] = b;
      }
      uint32_t* v_dst = v_pairs + (t / 2) * D;
      if (pair) {
        for (int64_t d = 0; d < D; ++d) v_dst[d] = static_cast<uint32_t>(v0[d]) | (static_cast<uint32_t>(v1[d]) << 16);
      } else {
        for (int64_t d = 0; d < D; ++d) v_dst[d] = v0[d];
      }
    }
  }
}

#if defined(__AVX512BF16__)
// 2^t for t <= 0 (or -inf) on the bf16 path: the degree-5 polynomial of torch's exp_u20 (what
// its CPU flash attention uses; about 20 ulp), rewritten for 2^f (coefficients times ln2^k) so the
// caller folds the softmax scale, the max and log2(e) into one fmsub, with 2^n applied by scalef:
// about half the instructions of numerics.h's exp. The weights are rounded to bf16 (2^-9) before
// P @ V anyway. Below 2^-125.5 (e^-87) the result is exactly 0, as with numerics.h's exp.
inline __m512 exp2_nonpositive(__m512 t) {
  const __mmask16 live = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-125.5f), _CMP_GE_OQ);
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);  // exact, in [-0.5, 0.5]
  __m512 p = _mm512_fmadd_ps(f, _mm512_set1_ps(0.00132630886f), _mm512_set1_ps(0.00967148789f));
  p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(0.0555073904f));
  p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(0.240222426f));
  p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(0.693146973f));
  p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(live, p, n);  // NaN lanes of t = -inf are masked to 0
}
#endif

// ---- one work item: a KV head and a block of query positions ----
template <typename T, int NV>
void attend_block(const T* q_data, int64_t num_q_heads, int64_t group, int64_t head, int64_t first_query,
                  int64_t queries, int64_t prefix_len, float scale, const Operand<T>* k_blocks,
                  const Operand<T>* v_blocks, T* out_data, std::vector<Operand<T>>& q_rows,
                  std::vector<float>& scores, std::vector<Operand<T>>& probs, std::vector<float>& acc,
                  std::vector<float>& row_max, std::vector<float>& row_sum /* [rows][kLanes] */) {
  using P = Operand<T>;
  constexpr int64_t D = NV * kLanes;
  const int64_t rows = queries * group;
  // Row r is query position first_query + r / group of query head head * group + r % group.
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = q_data + ((first_query + r / group) * num_q_heads + head * group + r % group) * D;
    for (int64_t d = 0; d < D; ++d) q_rows[r * D + d] = element_to_operand<T, P>(src[d]);
  }
  std::fill(acc.begin(), acc.begin() + rows * D, 0.0f);
  std::fill(row_max.begin(), row_max.begin() + rows, -std::numeric_limits<float>::infinity());
  std::fill(row_sum.begin(), row_sum.begin() + rows * kLanes, 0.0f);

  const int64_t last_position = prefix_len + first_query + queries - 1;
  const int64_t blocks = last_position / kKeyBlock + 1;  // the rest lie above the diagonal
  for (int64_t block = 0; block < blocks; ++block) {
    const int64_t first_key = block * kKeyBlock;
    // Rows at positions before the block's first key see none of it (only in the last blocks).
    const int64_t first_row = std::max<int64_t>(0, (first_key - prefix_len - first_query) * group);
    const int64_t live_rows = rows - first_row;
    scores_rows<kScoreRows>(q_rows.data() + first_row * D, D, k_blocks + block * kKeyBlock * D,
                            scores.data() + first_row * kKeyBlock, live_rows);
    for (int64_t r = first_row; r < rows; ++r) {
      float* s = scores.data() + r * kKeyBlock;
      // Keys this row may see in the block (causal; the span's end is at or past every position).
      const int64_t visible = std::clamp<int64_t>(prefix_len + first_query + r / group - first_key + 1, 0, kKeyBlock);
      P* p = probs.data() + r * kKeyBlock;
      Vec16 x[kKeyVectors];
      Vec16 maxes = Vec16::fill(-std::numeric_limits<float>::infinity());
      for (int c = 0; c < kKeyVectors; ++c) {
        x[c] = Vec16::load(s + c * kLanes);  // unscaled: max(s) * scale == max(s * scale)
        if ((c + 1) * kLanes > visible) {  // mask the keys past the diagonal
          float lanes[kLanes];
          x[c].store(lanes);
          for (int64_t i = std::max<int64_t>(0, visible - c * kLanes); i < kLanes; ++i) {
            lanes[i] = -std::numeric_limits<float>::infinity();
          }
          x[c] = Vec16::load(lanes);
        }
        maxes = Vec16::max(maxes, x[c]);
      }
      const float new_max = std::max(row_max[r], maxes.max() * scale);
      // Once a row's max has settled most blocks leave it unchanged: no exp, no rescaling then.
      const float correction = new_max == row_max[r] ? 1.0f : std::exp(row_max[r] - new_max);  // 0 at first
      Vec16 sums = Vec16::zero();
      for (int c = 0; c < kKeyVectors; ++c) {
        Vec16 e;  // exactly 0 where masked
#if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<P, uint16_t>) {
          constexpr float kLog2e = 1.44269504088896341f;
          e = {exp2_nonpositive(_mm512_fmsub_ps(x[c].v, _mm512_set1_ps(scale * kLog2e),
                                                _mm512_set1_ps(new_max * kLog2e)))};
        } else {
          e = exp(x[c] * Vec16::fill(scale) - Vec16::fill(new_max));
        }
#else
        e = exp(x[c] * Vec16::fill(scale) - Vec16::fill(new_max));
#endif
        sums = sums + e;
        store_operand(p + c * kLanes, e);
      }
      // The row's sum stays 16 lane sums until the end: one horizontal add per row, not per block.
      float* lane_sums = row_sum.data() + r * kLanes;
      (Vec16::load(lane_sums) * Vec16::fill(correction) + sums).store(lane_sums);
      row_max[r] = new_max;
      if (correction != 1.0f) {
        float* a = acc.data() + r * D;
        for (int c = 0; c < NV; ++c) (Vec16::load(a + c * kLanes) * Vec16::fill(correction)).store(a + c * kLanes);
      }
    }
    values_rows<value_rows<NV>(), NV>(probs.data() + first_row * kKeyBlock, v_blocks + block * kKeyBlock * D,
                                      acc.data() + first_row * D, live_rows);
  }
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = out_data + ((first_query + r / group) * num_q_heads + head * group + r % group) * D;
    const Vec16 inverse = Vec16::fill(1.0f / Vec16::load(row_sum.data() + r * kLanes).sum());  // > 0: key 0 is
                                                                                           // seen by every row
    for (int c = 0; c < NV; ++c) (Vec16::load(acc.data() + r * D + c * kLanes) * inverse).store(dst + c * kLanes);
  }
}

template <typename T, int NV>
void run(const at::Tensor& q, const at::Tensor& buffer, int64_t layer, const at::Tensor& page_ids,
         int64_t prefix_len, double scale, at::Tensor& out) {
  using P = Operand<T>;
  constexpr int64_t D = NV * kLanes;
  const int64_t length = q.size(0), num_q_heads = q.size(1), num_kv_heads = buffer.size(4);
  const int64_t group = num_q_heads / num_kv_heads, total = prefix_len + length;
  const Pool pool{buffer.stride(0), buffer.stride(2), buffer.stride(3), layer * buffer.stride(1), buffer.size(3)};
  const T* data = buffer.data_ptr<T>();
  const int32_t* pages = page_ids.data_ptr<int32_t>();
  const int64_t key_blocks = (total + kKeyBlock - 1) / kKeyBlock;
  const int64_t block_size = kKeyBlock * D;
  // Kept by the calling thread across calls and only grown: a fresh allocation of this size is an
  // mmap whose page faults cost as much as the packing itself (0.6 of 0.86 ms for 2048 tokens).
  // Not zero-initialized: pack_block writes every element.
  thread_local std::vector<P> storage;
  const size_t packed_size = static_cast<size_t>(num_kv_heads * key_blocks * block_size);
  if (storage.size() < 2 * packed_size) storage.resize(2 * packed_size);
  P* k_blocks = storage.data();
  P* v_blocks = storage.data() + packed_size;
  at::parallel_for(0, num_kv_heads * key_blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t item = first; item < last; ++item) {
      const int64_t head = item / key_blocks, block = item % key_blocks;
      pack_block<T, P>(pool, data, pages, head, D, block * kKeyBlock, total,
                       k_blocks + item * block_size, v_blocks + item * block_size);
    }
  });

  const int64_t query_blocks = (length + kQueryBlock - 1) / kQueryBlock;
  const T* q_data = q.data_ptr<T>();
  T* out_data = out.data_ptr<T>();
  // at::parallel_for gives each thread one contiguous range of items, and a query block's work
  // grows with its position (causal): items take the query blocks in zigzag order (last, first,
  // second last, second, ...) so every range holds about the same work.
  at::parallel_for(0, num_kv_heads * query_blocks, 1, [&](int64_t first, int64_t last) {
    const int64_t max_rows = kQueryBlock * group;
    std::vector<P> q_rows(static_cast<size_t>(max_rows * D)), probs(static_cast<size_t>(max_rows * kKeyBlock));
    std::vector<float> scores(static_cast<size_t>(max_rows * kKeyBlock)), acc(static_cast<size_t>(max_rows * D));
    std::vector<float> row_max(static_cast<size_t>(max_rows)), row_sum(static_cast<size_t>(max_rows * kLanes));
    for (int64_t item = first; item < last; ++item) {
      const int64_t head = item % num_kv_heads, rank = item / num_kv_heads;
      const int64_t query_block = rank % 2 == 0 ? query_blocks - 1 - rank / 2 : rank / 2;
      const int64_t first_query = query_block * kQueryBlock;
      const int64_t queries = std::min(kQueryBlock, length - first_query);
      const size_t offset = static_cast<size_t>(head * key_blocks * block_size);
      attend_block<T, NV>(q_data, num_q_heads, group, head, first_query, queries, prefix_len,
                          static_cast<float>(scale), k_blocks + offset, v_blocks + offset, out_data,
                          q_rows, scores, probs, acc, row_max, row_sum);
    }
  });
  // A very long span's copy is not kept: at that length the page faults are small against the
  // attention, and the memory would stay with the thread for good.
  if (storage.size() * sizeof(P) > kKeptPackedBytes) std::vector<P>().swap(storage);
}

template <typename T>
void dispatch_head_dim(const at::Tensor& q, const at::Tensor& buffer, int64_t layer, const at::Tensor& page_ids,
                       int64_t prefix_len, double scale, at::Tensor& out) {
  switch (q.size(2)) {
    case 32: return run<T, 2>(q, buffer, layer, page_ids, prefix_len, scale, out);
    case 64: return run<T, 4>(q, buffer, layer, page_ids, prefix_len, scale, out);
    case 128: return run<T, 8>(q, buffer, layer, page_ids, prefix_len, scale, out);
    case 256: return run<T, 16>(q, buffer, layer, page_ids, prefix_len, scale, out);
    default: TORCH_CHECK(false, "extend_attention supports head_dim 32, 64, 128 and 256, got ", q.size(2));
  }
}

at::Tensor extend_attention(const at::Tensor& q, const at::Tensor& buffer, int64_t layer, const at::Tensor& page_ids,
                            int64_t prefix_len, double scale) {
  check_queries_and_pool(q, buffer, layer);
  TORCH_CHECK(page_ids.scalar_type() == at::kInt && page_ids.dim() == 1, "page_ids must be 1-d int32");
  TORCH_CHECK(prefix_len >= 0, "prefix_len must be >= 0");
  const int64_t total = prefix_len + q.size(0), page_size = buffer.size(3);
  const int64_t pages_used = (total + page_size - 1) / page_size;
  TORCH_CHECK(page_ids.numel() >= pages_used, "a span of ", total, " tokens needs ", pages_used,
              " pages but page_ids has ", page_ids.numel());
  at::Tensor pages = page_ids.contiguous();
  const int32_t* ids = pages.data_ptr<int32_t>();
  for (int64_t i = 0; i < pages_used; ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < buffer.size(0), "page id ", ids[i], " out of range");
  }
  at::Tensor q_contiguous = q.contiguous();
  at::Tensor out = at::empty_like(q_contiguous);
  if (q.size(0) == 0) return out;
  switch (q.scalar_type()) {
    case at::kFloat: dispatch_head_dim<float>(q_contiguous, buffer, layer, pages, prefix_len, scale, out); break;
    case at::kBFloat16:
      dispatch_head_dim<c10::BFloat16>(q_contiguous, buffer, layer, pages, prefix_len, scale, out);
      break;
    case at::kHalf: dispatch_head_dim<c10::Half>(q_contiguous, buffer, layer, pages, prefix_len, scale, out); break;
    default: TORCH_CHECK(false, "extend_attention supports float32, bfloat16 and float16, got ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(PDSERVE_OPS, m) {
  m.def("extend_attention(Tensor q, Tensor buffer, int layer, Tensor page_ids, int prefix_len, float scale) "
        "-> Tensor",
        &extend_attention);
}

}  // namespace pdserve
