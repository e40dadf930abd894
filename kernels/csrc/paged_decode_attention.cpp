// Decode attention read straight from the page-major KV pool (libkv/pool.py):
// buffer[page, layer, k|v, slot, kv_head, dim]. One query token per sequence.
//
// Work item = (sequence, KV head, split). An item walks its pages in order, loads each K and V row
// once and uses it for all `group` query heads that share the KV head (GQA), keeping an online
// softmax (running max, running sum, fp32 accumulator) so nothing is gathered or padded. Long
// sequences are split into page-aligned spans when there are too few items to keep every thread
// busy; the spans' partial results are merged afterwards with the usual max/sum rescaling.
#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "numerics.h"

namespace pdserve {
namespace {

// Tokens scored at once inside a page: scores of a block live in registers/L1 before the softmax.
constexpr int kBlock = 32;
// A split covers at least this many tokens: below that, merging costs more than it saves.
constexpr int64_t kMinSplitTokens = 256;

struct Geometry {
  int64_t page_stride, kv_stride, slot_stride, head_stride;  // element strides of the pool
  int64_t layer_offset;
  int64_t page_size, num_kv_heads, group, head_dim;
};

// Partial attention of `group` query heads over tokens [begin, end) of one sequence: the running
// max m, sum l and unnormalized accumulator acc [group, head_dim] of the online softmax.
template <typename T, bool kVector>
void attend_span(const Geometry& g, const T* pool, const int32_t* pages, int64_t kv_head,
                 const float* q /* [group, head_dim], prescaled */, int64_t begin, int64_t end,
                 float* m, float* l, float* acc) {
  const int64_t G = g.group, D = g.head_dim;
  for (int64_t i = 0; i < G; ++i) {
    m[i] = -std::numeric_limits<float>::infinity();
    l[i] = 0.0f;
  }
  std::fill(acc, acc + G * D, 0.0f);
  std::vector<float> scores_storage(static_cast<size_t>(G * kBlock));
  float* scores = scores_storage.data();

  int64_t token = begin;
  while (token < end) {
    const int64_t page = pages[token / g.page_size];
    const int64_t slot = token % g.page_size;
    const int64_t count = std::min<int64_t>({end - token, g.page_size - slot, kBlock});
    const T* k_rows = pool + page * g.page_stride + g.layer_offset + slot * g.slot_stride + kv_head * g.head_stride;
    const T* v_rows = k_rows + g.kv_stride;

    for (int64_t t = 0; t < count; ++t) {
      const T* k = k_rows + t * g.slot_stride;
      if constexpr (kVector) {
        // K row loaded once per chunk of 16 dims, multiplied into every query head of the group.
        for (int64_t h = 0; h < G; ++h) {
          Vec16 dot = Vec16::zero();
          for (int64_t d = 0; d < D; d += kLanes) dot = dot.fma(Vec16::load(q + h * D + d), Vec16::load(k + d));
          scores[h * kBlock + t] = dot.sum();
        }
      } else {
        for (int64_t h = 0; h < G; ++h) {
          float dot = 0.0f;
          for (int64_t d = 0; d < D; ++d) dot += q[h * D + d] * to_float(k[d]);
          scores[h * kBlock + t] = dot;
        }
      }
    }
    for (int64_t h = 0; h < G; ++h) {
      float* s = scores + h * kBlock;
      float block_max = -std::numeric_limits<float>::infinity();
      for (int64_t t = 0; t < count; ++t) block_max = std::max(block_max, s[t]);
      const float new_max = std::max(m[h], block_max);
      const float correction = std::exp(m[h] - new_max);  // 0 on the first block (m = -inf)
      float block_sum = 0.0f;
      if constexpr (kVector) {
        int64_t t = 0;
        for (; t + kLanes <= count; t += kLanes) {
          Vec16 p = exp(Vec16::load(s + t) - Vec16::fill(new_max));
          p.store(s + t);
          block_sum += p.sum();
        }
        for (; t < count; ++t) {
          s[t] = std::exp(s[t] - new_max);
          block_sum += s[t];
        }
      } else {
        for (int64_t t = 0; t < count; ++t) {
          s[t] = std::exp(s[t] - new_max);
          block_sum += s[t];
        }
      }
      l[h] = l[h] * correction + block_sum;
      m[h] = new_max;
      if (correction != 1.0f) {
        float* a = acc + h * D;
        for (int64_t d = 0; d < D; ++d) a[d] *= correction;
      }
    }
    for (int64_t t = 0; t < count; ++t) {
      const T* v = v_rows + t * g.slot_stride;
      if constexpr (kVector) {
        for (int64_t d = 0; d < D; d += kLanes) {
          const Vec16 vd = Vec16::load(v + d);
          for (int64_t h = 0; h < G; ++h) {
            float* a = acc + h * D + d;
            Vec16::load(a).fma(Vec16::fill(scores[h * kBlock + t]), vd).store(a);
          }
        }
      } else {
        for (int64_t h = 0; h < G; ++h) {
          const float p = scores[h * kBlock + t];
          float* a = acc + h * D;
          for (int64_t d = 0; d < D; ++d) a[d] += p * to_float(v[d]);
        }
      }
    }
    token += count;
  }
}

template <typename T, bool kVector>
void run(const at::Tensor& q, const at::Tensor& buffer, int64_t layer, const at::Tensor& page_table,
         const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  const int64_t batch = q.size(0), num_q_heads = q.size(1), head_dim = q.size(2);
  Geometry g{buffer.stride(0), buffer.stride(2), buffer.stride(3), buffer.stride(4), layer * buffer.stride(1),
             buffer.size(3), buffer.size(4), num_q_heads / buffer.size(4), head_dim};
  const int64_t G = g.group, D = head_dim, Hkv = g.num_kv_heads;
  const T* pool = buffer.data_ptr<T>();
  const int32_t* table = page_table.data_ptr<int32_t>();
  const int64_t table_width = page_table.size(1);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const T* q_data = q.data_ptr<T>();
  T* out_data = out.data_ptr<T>();

  // Splits per sequence: enough items for every thread several times over, never spans shorter
  // than kMinSplitTokens, always whole pages.
  const int64_t threads = at::get_num_threads();
  int64_t longest = 0;
  for (int64_t b = 0; b < batch; ++b) longest = std::max<int64_t>(longest, lens[b]);
  int64_t splits = 1;
  if (batch * Hkv < 4 * threads) {
    splits = std::min<int64_t>((4 * threads + batch * Hkv - 1) / (batch * Hkv),
                               std::max<int64_t>(1, longest / kMinSplitTokens));
  }
  const int64_t items = batch * Hkv * splits;
  // Partial results of every item: m, l, then acc [G, D].
  const int64_t partial_size = 2 * G + G * D;
  std::vector<float> partials(static_cast<size_t>(items * partial_size));

  at::parallel_for(0, items, 1, [&](int64_t first, int64_t last) {
    std::vector<float> q_scaled(static_cast<size_t>(G * D));
    for (int64_t item = first; item < last; ++item) {
      const int64_t b = item / (Hkv * splits), h = (item / splits) % Hkv, split = item % splits;
      const int64_t len = lens[b];
      const int64_t pages_used = (len + g.page_size - 1) / g.page_size;
      const int64_t pages_per_split = (pages_used + splits - 1) / splits;
      const int64_t begin = std::min(len, split * pages_per_split * g.page_size);
      const int64_t end = std::min(len, (split + 1) * pages_per_split * g.page_size);
      float* m = partials.data() + item * partial_size;
      float* l = m + G;
      float* acc = l + G;
      for (int64_t i = 0; i < G * D; ++i) {
        q_scaled[i] = to_float(q_data[b * num_q_heads * D + h * G * D + i]) * static_cast<float>(scale);
      }
      TORCH_CHECK(pages_used <= table_width, "sequence ", b, " of ", len, " tokens needs ", pages_used,
                  " pages but the page table has ", table_width, " columns");
      attend_span<T, kVector>(g, pool, table + b * table_width, h, q_scaled.data(), begin, end, m, l, acc);
    }
  });

  // Merge the splits of each (sequence, KV head) and write out in q's dtype.
  at::parallel_for(0, batch * Hkv, 1, [&](int64_t first, int64_t last) {
    std::vector<float> merged(static_cast<size_t>(D));
    for (int64_t bh = first; bh < last; ++bh) {
      const int64_t b = bh / Hkv, h = bh % Hkv;
      for (int64_t i = 0; i < G; ++i) {
        float max_all = -std::numeric_limits<float>::infinity();
        for (int64_t s = 0; s < splits; ++s) max_all = std::max(max_all, partials[(bh * splits + s) * partial_size + i]);
        std::fill(merged.begin(), merged.end(), 0.0f);
        float total = 0.0f;
        for (int64_t s = 0; s < splits; ++s) {
          const float* m = partials.data() + (bh * splits + s) * partial_size;
          const float* l = m + G;
          const float* acc = l + G + i * D;
          if (l[i] == 0.0f) continue;  // an empty span (short sequence, or length 0)
          const float weight = std::exp(m[i] - max_all);
          total += l[i] * weight;
          for (int64_t d = 0; d < D; ++d) merged[d] += acc[d] * weight;
        }
        T* o = out_data + b * num_q_heads * D + (h * G + i) * D;
        const float inverse = total > 0.0f ? 1.0f / total : 0.0f;  // length 0: a zero output
        for (int64_t d = 0; d < D; ++d) o[d] = from_float<T>(merged[d] * inverse);
      }
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& buffer, int64_t layer,
                                  const at::Tensor& page_table, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu() && buffer.device().is_cpu(), "pdserve_cpu kernels take CPU tensors");
  TORCH_CHECK(q.dim() == 3 && buffer.dim() == 6, "q [B, Hq, D] and buffer [pages, L, 2, P, Hkv, D] expected");
  TORCH_CHECK(q.scalar_type() == buffer.scalar_type(), "q and the KV pool must have one dtype, got ",
              q.scalar_type(), " and ", buffer.scalar_type());
  TORCH_CHECK(buffer.stride(5) == 1, "the KV pool's head_dim must be contiguous");
  TORCH_CHECK(q.size(2) == buffer.size(5) && q.size(1) % buffer.size(4) == 0,
              "q heads must be a multiple of the KV heads with the same head_dim");
  TORCH_CHECK(layer >= 0 && layer < buffer.size(1), "layer ", layer, " out of range");
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

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor buffer, int layer, Tensor page_table, Tensor seq_lens, "
        "float scale) -> Tensor",
        &paged_decode_attention);
}

}  // namespace pdserve
