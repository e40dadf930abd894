// Decode attention read straight from the page-major KV pool (libkv/pool.py):
// buffer[page, layer, k|v, slot, kv_head, dim]. One query token per sequence.
//
// Work item = (sequence, span). An item walks its pages in order, reads each token's K and V row
// (all KV heads, contiguous) once, front to back with the next block prefetched, and uses each KV
// head's values for all `group` query heads that share it (GQA), keeping an online softmax per
// query head (running max, running sum, fp32 accumulator), so nothing is gathered or padded. Long
// sequences are split into spans, which threads take independently; the spans' partial results
// are merged afterwards with the usual max/sum rescaling.
//
// Batch invariance: a sequence's output must not depend on what else is in the batch, or on the
// thread count, or a request's greedy tokens would change with the load it was served under (the
// chaos suite caught one: a 300-token sequence split in two when the batch was small, whole when
// it was not, 2e-7 apart, and the argmax flipped later). So the summation order is a function of
// the sequence alone: spans are fixed kSpanTokens-long ranges of token positions, and blocks
// within a span are aligned to multiples of kBlock positions (and to page ends), whatever the
// batch.
// (An earlier version made one item per (sequence, KV head): it read 128 of every 512 bytes of a
// row, which the hardware prefetchers did not follow; 2.4 GB/s from memory in a decode step.)
#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "numerics.h"
#include "pool_checks.h"

namespace pdserve {
namespace {

// Tokens scored at once: scores of a block stay in L1 between the softmax and the V pass.
constexpr int kBlock = 16;
// Token positions [k * kSpanTokens, (k+1) * kSpanTokens) of a sequence form its k-th work item.
// Long enough that merging the spans costs little (one rescale of Hq x D floats per span), short
// enough that a single long sequence still spreads over the threads.
constexpr int64_t kSpanTokens = 256;
static_assert(kSpanTokens % kBlock == 0, "spans must hold whole blocks");

struct Geometry {
  int64_t page_stride, kv_stride, slot_stride;  // element strides of the pool
  int64_t layer_offset;
  int64_t page_size, num_kv_heads, group, head_dim;
};

// Locality 3 asks for L1, 2 for L2 (gcc's portable spelling of prefetcht0 / prefetcht1).
template <int kLocality = 3>
inline void prefetch_rows(const void* first, int64_t bytes) {
  const char* p = static_cast<const char*>(first);
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(p + offset, 0, kLocality);
}

// Partial attention of all query heads of one sequence over its tokens [begin, end): per query
// head the running max m, sum l and unnormalized accumulator acc [head_dim] of the online softmax.
// A token's K (and V) for all KV heads is one contiguous row of the page, read front to back, and
// each KV head's values are loaded once for the `group` query heads that share it.
template <typename T, bool kVector>
void attend_span(const Geometry& g, const T* pool, const int32_t* pages, const float* q /* [Hq, D], prescaled */,
                 int64_t begin, int64_t end, float* m, float* l, float* acc, float* scores /* [Hq, kBlock] */) {
  const int64_t Hq = g.num_kv_heads * g.group, G = g.group, D = g.head_dim;
  for (int64_t i = 0; i < Hq; ++i) {
    m[i] = -std::numeric_limits<float>::infinity();
    l[i] = 0.0f;
  }
  std::fill(acc, acc + Hq * D, 0.0f);
  const int64_t row_bytes = g.num_kv_heads * D * static_cast<int64_t>(sizeof(T));
  // The span's K/V come from memory (the weights streamed since the last step evicted them from
  // cache): ask for all of it into L2 at once, so the loads overlap instead of one page at a time.
  for (int64_t token = begin; token < end; token += g.page_size - token % g.page_size) {
    const int64_t count = std::min<int64_t>(end - token, g.page_size - token % g.page_size);
    const T* k = pool + pages[token / g.page_size] * g.page_stride + g.layer_offset + (token % g.page_size) * g.slot_stride;
    prefetch_rows<2>(k, count * row_bytes);
    prefetch_rows<2>(k + g.kv_stride, count * row_bytes);
  }

  int64_t token = begin;
  while (token < end) {
    const int64_t slot = token % g.page_size;
    // Blocks end at multiples of kBlock positions (and at page ends): the same blocks whatever the
    // span's start, so the order of the online softmax's updates is a function of positions only.
    const int64_t count = std::min<int64_t>({end - token, g.page_size - slot, kBlock - token % kBlock});
    const T* k_rows = pool + pages[token / g.page_size] * g.page_stride + g.layer_offset + slot * g.slot_stride;
    const T* v_rows = k_rows + g.kv_stride;
    const int64_t next = token + count;
    if (next < end) {  // the next block is usually on another page: start fetching it now
      const T* next_k = pool + pages[next / g.page_size] * g.page_stride + g.layer_offset +
                        (next % g.page_size) * g.slot_stride;
      const int64_t next_count =
          std::min<int64_t>({end - next, g.page_size - next % g.page_size, kBlock - next % kBlock});
      prefetch_rows(next_k, next_count * row_bytes);
      prefetch_rows(next_k + g.kv_stride, next_count * row_bytes);
    }

    // Scores: for each query head, the dot products with the block's K rows (L1-resident after
    // the first head reads them), summed sixteen at a time.
    for (int64_t h = 0; h < g.num_kv_heads; ++h) {
      for (int64_t j = h * G; j < (h + 1) * G; ++j) {
        if constexpr (kVector) {
          Vec16 dots[kBlock];
          for (int64_t t = 0; t < kBlock; ++t) {
            dots[t] = Vec16::zero();
            if (t >= count) continue;
            const T* k = k_rows + t * g.slot_stride + h * D;
            for (int64_t d = 0; d < D; d += kLanes) dots[t] = dots[t].fma(Vec16::load(q + j * D + d), Vec16::load(k + d));
          }
          sum_each(dots).store(scores + j * kBlock);
        } else {
          for (int64_t t = 0; t < count; ++t) {
            const T* k = k_rows + t * g.slot_stride + h * D;
            float dot = 0.0f;
            for (int64_t d = 0; d < D; ++d) dot += q[j * D + d] * to_float(k[d]);
            scores[j * kBlock + t] = dot;
          }
        }
      }
    }
    for (int64_t j = 0; j < Hq; ++j) {
      float* s = scores + j * kBlock;
      float block_max = -std::numeric_limits<float>::infinity();
      for (int64_t t = 0; t < count; ++t) block_max = std::max(block_max, s[t]);
      const float new_max = std::max(m[j], block_max);
      const float correction = std::exp(m[j] - new_max);  // 0 on the first block (m = -inf)
      float block_sum = 0.0f;
      if constexpr (kVector) {
        if (count == kBlock) {
          const Vec16 p = exp(Vec16::load(s) - Vec16::fill(new_max));
          p.store(s);
          block_sum = p.sum();
        } else {
          for (int64_t t = 0; t < count; ++t) block_sum += (s[t] = std::exp(s[t] - new_max));
        }
      } else {
        for (int64_t t = 0; t < count; ++t) block_sum += (s[t] = std::exp(s[t] - new_max));
      }
      l[j] = l[j] * correction + block_sum;
      m[j] = new_max;
      if (correction != 1.0f) {
        float* a = acc + j * D;
        for (int64_t d = 0; d < D; ++d) a[d] *= correction;
      }
    }
    // Values: each query head's accumulator chunk stays in a register across the block's tokens.
    for (int64_t h = 0; h < g.num_kv_heads; ++h) {
      const T* v = v_rows + h * D;
      for (int64_t j = h * G; j < (h + 1) * G; ++j) {
        const float* p = scores + j * kBlock;
        float* a = acc + j * D;
        if constexpr (kVector) {
          for (int64_t d = 0; d < D; d += kLanes) {
            Vec16 sum = Vec16::load(a + d);
            for (int64_t t = 0; t < count; ++t) sum = sum.fma(Vec16::fill(p[t]), Vec16::load(v + t * g.slot_stride + d));
            sum.store(a + d);
          }
        } else {
          for (int64_t t = 0; t < count; ++t) {
            for (int64_t d = 0; d < D; ++d) a[d] += p[t] * to_float(v[t * g.slot_stride + d]);
          }
        }
      }
    }
    token = next;
  }
}

template <typename T, bool kVector>
void run(const at::Tensor& q, const at::Tensor& buffer, int64_t layer, const at::Tensor& page_table,
         const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  const int64_t batch = q.size(0), num_q_heads = q.size(1), head_dim = q.size(2);
  Geometry g{buffer.stride(0), buffer.stride(2), buffer.stride(3), layer * buffer.stride(1),
             buffer.size(3), buffer.size(4), num_q_heads / buffer.size(4), head_dim};
  const int64_t Hq = num_q_heads, D = head_dim;
  const T* pool = buffer.data_ptr<T>();
  const int32_t* table = page_table.data_ptr<int32_t>();
  const int64_t table_width = page_table.size(1);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const T* q_data = q.data_ptr<T>();
  T* out_data = out.data_ptr<T>();
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t pages_used = (lens[b] + g.page_size - 1) / g.page_size;
    TORCH_CHECK(lens[b] >= 0 && pages_used <= table_width, "sequence ", b, " of ", lens[b], " tokens needs ",
                pages_used, " pages but the page table has ", table_width, " columns");
  }

  // Items: one per kSpanTokens-long range of each sequence's positions (at least one per sequence).
  // item_start[b] is sequence b's first item; the items of a sequence are consecutive.
  std::vector<int64_t> item_start(static_cast<size_t>(batch + 1), 0);
  for (int64_t b = 0; b < batch; ++b) {
    item_start[b + 1] = item_start[b] + std::max<int64_t>(1, (lens[b] + kSpanTokens - 1) / kSpanTokens);
  }
  const int64_t items = item_start[batch];
  std::vector<int64_t> item_sequence(static_cast<size_t>(items));
  for (int64_t b = 0; b < batch; ++b) {
    std::fill(item_sequence.begin() + item_start[b], item_sequence.begin() + item_start[b + 1], b);
  }
  // Partial results of every item: m [Hq], l [Hq], then acc [Hq, D].
  const int64_t partial_size = 2 * Hq + Hq * D;
  std::vector<float> partials(static_cast<size_t>(items * partial_size));

  at::parallel_for(0, items, 1, [&](int64_t first, int64_t last) {
    std::vector<float> q_scaled(static_cast<size_t>(Hq * D));
    std::vector<float> scores(static_cast<size_t>(Hq * kBlock));
    for (int64_t item = first; item < last; ++item) {
      const int64_t b = item_sequence[item], span = item - item_start[b];
      const int64_t len = lens[b];
      const int64_t begin = std::min(len, span * kSpanTokens);
      const int64_t end = std::min(len, (span + 1) * kSpanTokens);
      float* m = partials.data() + item * partial_size;
      float* l = m + Hq;
      float* acc = l + Hq;
      for (int64_t i = 0; i < Hq * D; ++i) {
        q_scaled[i] = to_float(q_data[b * Hq * D + i]) * static_cast<float>(scale);
      }
      attend_span<T, kVector>(g, pool, table + b * table_width, q_scaled.data(), begin, end, m, l, acc,
                              scores.data());
    }
  });

  // Normalize (merging the spans of each sequence, in order) and write out in q's dtype. When no
  // sequence has more than one span this is cheap enough for the calling thread: no second
  // parallel region. A single span merges to exactly its own acc / l (weight exp(0) = 1).
  const bool merges = items > batch;
  const int64_t merge_grain = merges ? 4 : batch + 1;  // > range: inline
  at::parallel_for(0, batch, merge_grain, [&](int64_t first, int64_t last) {
    std::vector<float> merged(static_cast<size_t>(D));
    for (int64_t b = first; b < last; ++b) {
      for (int64_t i = 0; i < Hq; ++i) {
        float max_all = -std::numeric_limits<float>::infinity();
        for (int64_t s = item_start[b]; s < item_start[b + 1]; ++s) {
          max_all = std::max(max_all, partials[s * partial_size + i]);
        }
        std::fill(merged.begin(), merged.end(), 0.0f);
        float total = 0.0f;
        for (int64_t s = item_start[b]; s < item_start[b + 1]; ++s) {
          const float* m = partials.data() + s * partial_size;
          const float* l = m + Hq;
          const float* acc = l + Hq + i * D;
          if (l[i] == 0.0f) continue;  // an empty span (short sequence, or length 0)
          const float weight = std::exp(m[i] - max_all);
          total += l[i] * weight;
          for (int64_t d = 0; d < D; ++d) merged[d] += acc[d] * weight;
        }
        T* o = out_data + (b * Hq + i) * D;
        const float inverse = total > 0.0f ? 1.0f / total : 0.0f;  // length 0: a zero output
        for (int64_t d = 0; d < D; ++d) o[d] = from_float<T>(merged[d] * inverse);
      }
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& buffer, int64_t layer,
                                  const at::Tensor& page_table, const at::Tensor& seq_lens, double scale) {
  check_queries_and_pool(q, buffer, layer);
  TORCH_CHECK(page_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "page_table and seq_lens must be int32");
  TORCH_CHECK(page_table.dim() == 2 && page_table.size(0) == q.size(0) && seq_lens.numel() == q.size(0),
              "page_table [B, max_pages] and seq_lens [B] expected");
  at::Tensor q_contiguous = q.contiguous();
  at::Tensor table = page_table.contiguous();
  at::Tensor lens = seq_lens.contiguous();
  at::Tensor out = at::empty_like(q_contiguous);
  if (q.size(0) == 0) return out;
  // Head dims that are a multiple of the vector width take the vector path; others the scalar one.
  const bool vector = q.size(2) % kLanes == 0;
  switch (q.scalar_type()) {
    case at::kFloat:
      vector ? run<float, true>(q_contiguous, buffer, layer, table, lens, scale, out)
             : run<float, false>(q_contiguous, buffer, layer, table, lens, scale, out);
      break;
    case at::kBFloat16:
      vector ? run<c10::BFloat16, true>(q_contiguous, buffer, layer, table, lens, scale, out)
             : run<c10::BFloat16, false>(q_contiguous, buffer, layer, table, lens, scale, out);
      break;
    case at::kHalf:
      vector ? run<c10::Half, true>(q_contiguous, buffer, layer, table, lens, scale, out)
             : run<c10::Half, false>(q_contiguous, buffer, layer, table, lens, scale, out);
      break;
    default:
      TORCH_CHECK(false, "paged_decode_attention supports float32, bfloat16 and float16, got ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(PDSERVE_OPS, m) {
  m.def("paged_decode_attention(Tensor q, Tensor buffer, int layer, Tensor page_table, Tensor seq_lens, "
        "float scale) -> Tensor",
        &paged_decode_attention);
}

}  // namespace pdserve
