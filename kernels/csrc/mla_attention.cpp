// Multi-head latent attention (DeepSeek V2/V3) in the absorbed form, read straight from the MLA pool
// buffer[page, layer, 0, slot, 0, :] = [latent (kv_lora_rank) | rotated k_pe (rope)] (libkv/pool.py).
// engine.models.mla explains the form; its torch path (a bmm, SDPA and a bmm per sequence) is the
// reference this kernel is tested against (tests/kernels/test_mla_attention.py).
//
// Per (token row, head), for the row's sequence (a decode row, or one row of an extend span, which
// sees its prefix and the span's rows up to its own position), all in fp32:
//   q_lat   = [W_uk[h]^T q_nope[t, h] | q_pe[t, h]]                      (kv_lora_rank + rope)
//   s_j     = q_lat . pool_row_j                  for the keys j < limit   (limit = position + 1)
//   p_j     = exp(scale (s_j - max s)) / sum
//   out_lat = sum_j p_j latent_j
//   out     = W_uv[h]^T out_lat                                            rounded to the model dtype
//
// Batch invariance: every sum above runs in an order fixed by the row's own sequence and position
// (ascending over keys, over W's rows, blocks of 16 keys aligned to position 0), and each of an
// item's three steps (q_lat; attention to out_lat; out) is computed whole by one thread (three
// parallel passes: the weight-bound steps head by head, the attention row by row), so a row's
// output is the same bits whatever else is in the batch, however the items fall to threads, and
// whether its position came as a decode row or inside an extend span
// (tests/engine/test_batch_invariance.py, tests/engine/test_mla.py, tests/kernels/test_mla_attention.py).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "numerics.h"

namespace pdserve {
namespace {

// Keys scored at once: sixteen dot products reduced together by sum_each.
constexpr int64_t kBlock = 16;
// Heads of a row that walk its keys together (one attention work item).
constexpr int64_t kHeadGroup = 2;
// Accumulator vectors held in registers by one pass of a weighted row sum (8 x 16 floats).
constexpr int kChunkVectors = 8;

// out[c0 .. c0 + NV * 16) = sum over i < count, ascending, of weight[i] * row_at(i)[c], added to
// out's values when kAdd (the sum's fp32 steps are the same whether or not it is cut in pieces).
template <typename T, int NV, bool kAdd, typename RowAt>
void weighted_sum_chunk(const RowAt& row_at, const float* weight, int64_t count, int64_t c0, float* out) {
  Vec16 acc[NV];
  for (int v = 0; v < NV; ++v) acc[v] = kAdd ? Vec16::load(out + c0 + v * kLanes) : Vec16::zero();
  for (int64_t i = 0; i < count; ++i) {
    const T* row = row_at(i) + c0;
    const Vec16 w = Vec16::fill(weight[i]);
    for (int v = 0; v < NV; ++v) acc[v] = acc[v].fma(w, Vec16::load(row + v * kLanes));
  }
  for (int v = 0; v < NV; ++v) acc[v].store(out + c0 + v * kLanes);
}

// out[0 .. width) = (out if kAdd) + sum over i < count, ascending, of weight[i] * row_at(i)[0 .. width).
template <typename T, bool kAdd = false, typename RowAt>
void weighted_sum(const RowAt& row_at, const float* weight, int64_t count, int64_t width, float* out) {
  int64_t c0 = 0;
  for (; c0 + kChunkVectors * kLanes <= width; c0 += kChunkVectors * kLanes) {
    weighted_sum_chunk<T, kChunkVectors, kAdd>(row_at, weight, count, c0, out);
  }
  const int64_t vectors = (width - c0) / kLanes;
  switch (vectors) {
    case 0: break;
    case 1: weighted_sum_chunk<T, 1, kAdd>(row_at, weight, count, c0, out); break;
    case 2: weighted_sum_chunk<T, 2, kAdd>(row_at, weight, count, c0, out); break;
    case 3: weighted_sum_chunk<T, 3, kAdd>(row_at, weight, count, c0, out); break;
    case 4: weighted_sum_chunk<T, 4, kAdd>(row_at, weight, count, c0, out); break;
    case 5: weighted_sum_chunk<T, 5, kAdd>(row_at, weight, count, c0, out); break;
    case 6: weighted_sum_chunk<T, 6, kAdd>(row_at, weight, count, c0, out); break;
    case 7: weighted_sum_chunk<T, 7, kAdd>(row_at, weight, count, c0, out); break;
  }
  c0 += vectors * kLanes;
  if (c0 < width) {  // the last width % 16 columns (small test models only)
    Vec16 acc = kAdd ? load_tail(out + c0, width - c0) : Vec16::zero();
    for (int64_t i = 0; i < count; ++i) acc = acc.fma(Vec16::fill(weight[i]), load_tail(row_at(i) + c0, width - c0));
    store_tail(out + c0, acc, width - c0);
  }
}

// One row's sequence: its pages and how many of its keys the row sees.
struct RowTask {
  const int32_t* pages;
  int64_t limit;  // keys 0 .. limit - 1
};

struct Shapes {
  int64_t heads, nope, rank, rope, v_dim, width /* rank + rope */, padded /* width rounded up to 16 */;
  int64_t page_stride, layer_offset, slot_stride, page_size;
  int64_t q_nope_row, q_nope_head, q_pe_row, q_pe_head;  // element strides of the queries
};

// Scratch of one thread's attention items.
struct Scratch {
  std::vector<float> scores, probs;
  std::vector<const void*> keys;
  int64_t keys_row = -1;  // the row whose key pointers `keys` holds
};

// q_lat [padded] of (row, head): the K half of kv_b_proj applied to q_nope (the rows of W_uk[h]
// weighted by q_nope, ascending), then q_pe, then zeros.
template <typename T>
void absorb_query(const Shapes& g, const T* q_nope, const T* q_pe, const float* k_up, int64_t row, int64_t head,
                  float* q_nope_f32, float* q_lat) {
  const T* qn = q_nope + row * g.q_nope_row + head * g.q_nope_head;
  const T* qp = q_pe + row * g.q_pe_row + head * g.q_pe_head;
  for (int64_t n = 0; n < g.nope; ++n) q_nope_f32[n] = to_float(qn[n]);
  const float* w_uk = k_up + head * g.nope * g.rank;
  weighted_sum<float>([&](int64_t n) { return w_uk + n * g.rank; }, q_nope_f32, g.nope, g.rank, q_lat);
  for (int64_t r = 0; r < g.rope; ++r) q_lat[g.rank + r] = to_float(qp[r]);
  std::fill(q_lat + g.width, q_lat + g.padded, 0.0f);
}

// out_lat [rank] of (row, head) for the heads [h0, h1) (at most kHeadGroup): softmax(scale * scores)
// over the row's keys times their latents. The heads go through the keys together, a block of 16
// keys at a time, so a block is read from memory (or L2) once and from L1 by the other heads; each
// head's sums are the same steps as if it ran alone.
template <typename T>
void attend_heads(const Shapes& g, const T* pool, const float* q_lat, float scale, const RowTask& task, int64_t row,
                  int64_t h0, int64_t h1, float* out_lat, Scratch& s) {
  const int64_t limit = task.limit, blocks = (limit + kBlock - 1) / kBlock, stride = blocks * kBlock;
  if (s.keys_row != row) {  // a thread's items come as runs of one row's head groups: resolve the pages once
    s.keys.resize(static_cast<size_t>(stride));
    for (int64_t j = 0; j < stride; ++j) {  // a missing key of the last block reads key 0 (its score is -inf)
      const int64_t key = j < limit ? j : 0;
      s.keys[j] = pool + task.pages[key / g.page_size] * g.page_stride + g.layer_offset +
                  (key % g.page_size) * g.slot_stride;
    }
    s.keys_row = row;
  }
  const T* const* keys = reinterpret_cast<const T* const*>(s.keys.data());
  const int64_t full = g.width / kLanes * kLanes;

  // Scores, sixteen keys at a time: each query vector is loaded once for the block's sixteen keys.
  for (int64_t block = 0; block < blocks; ++block) {
    const T* const* k = keys + block * kBlock;
    for (int64_t h = h0; h < h1; ++h) {
      const float* q = q_lat + h * g.padded;
      Vec16 dots[kBlock];
      for (int64_t t = 0; t < kBlock; ++t) dots[t] = Vec16::zero();
      for (int64_t d = 0; d < full; d += kLanes) {
        const Vec16 qd = Vec16::load(q + d);
        for (int64_t t = 0; t < kBlock; ++t) dots[t] = dots[t].fma(qd, Vec16::load(k[t] + d));
      }
      if (full < g.width) {
        const Vec16 qd = Vec16::load(q + full);
        for (int64_t t = 0; t < kBlock; ++t) dots[t] = dots[t].fma(qd, load_tail(k[t] + full, g.width - full));
      }
      sum_each(dots).store(s.scores.data() + (h - h0) * stride + block * kBlock);
    }
  }

  // Softmax in fp32: the max is order-free, the sum runs over lanes block by block, then across lanes.
  float inverse[kHeadGroup];
  for (int64_t h = h0; h < h1; ++h) {
    float* scores = s.scores.data() + (h - h0) * stride;
    float* probs = s.probs.data() + (h - h0) * stride;
    for (int64_t j = limit; j < stride; ++j) scores[j] = -std::numeric_limits<float>::infinity();
    Vec16 maxes = Vec16::fill(-std::numeric_limits<float>::infinity());
    for (int64_t block = 0; block < blocks; ++block) maxes = Vec16::max(maxes, Vec16::load(scores + block * kBlock));
    const Vec16 max = Vec16::fill(maxes.max()), scales = Vec16::fill(scale);
    Vec16 sums = Vec16::zero();
    for (int64_t block = 0; block < blocks; ++block) {
      const Vec16 p = exp((Vec16::load(scores + block * kBlock) - max) * scales);  // 0 past the limit
      p.store(probs + block * kBlock);
      sums = sums + p;
    }
    inverse[h - h0] = 1.0f / sums.sum();  // one term at least is exp(0)
    std::fill(out_lat + h * g.rank, out_lat + (h + 1) * g.rank, 0.0f);
  }

  // out_lat = sum_j p_j latent_j, ascending in j, block by block for all the heads.
  for (int64_t block = 0; block < blocks; ++block) {
    const int64_t first = block * kBlock, count = std::min(kBlock, limit - first);
    for (int64_t h = h0; h < h1; ++h) {
      weighted_sum<T, true>([&](int64_t t) { return keys[first + t]; }, s.probs.data() + (h - h0) * stride + first,
                            count, g.rank, out_lat + h * g.rank);
    }
  }
  for (int64_t h = h0; h < h1; ++h) {
    for (int64_t c = 0; c < g.rank; ++c) out_lat[h * g.rank + c] *= inverse[h - h0];
  }
}

// out[row, head] = W_uv[h]^T out_lat (the rows of W_uv[h]^T weighted by out_lat, ascending), in T.
template <typename T>
void project_value(const Shapes& g, const float* v_up_t, const float* out_lat, int64_t row, int64_t head,
                   float* result, T* out) {
  const float* w_uv = v_up_t + head * g.rank * g.v_dim;
  weighted_sum<float>([&](int64_t c) { return w_uv + c * g.v_dim; }, out_lat, g.rank, g.v_dim, result);
  T* dst = out + (row * g.heads + head) * g.v_dim;
  for (int64_t v = 0; v < g.v_dim; ++v) dst[v] = from_float<T>(result[v]);
}

template <typename T>
void run(const Shapes& g, const at::Tensor& q_nope, const at::Tensor& q_pe, const at::Tensor& buffer,
         const at::Tensor& k_up, const at::Tensor& v_up_t, double scale, const std::vector<RowTask>& tasks,
         at::Tensor& out) {
  const int64_t rows = static_cast<int64_t>(tasks.size()), items = rows * g.heads;
  int64_t max_limit = 1;
  for (const RowTask& task : tasks) max_limit = std::max(max_limit, task.limit);
  const int64_t padded_keys = (max_limit + kBlock - 1) / kBlock * kBlock;
  const T* pool = buffer.data_ptr<T>();
  const T* q_nope_data = q_nope.data_ptr<T>();
  const T* q_pe_data = q_pe.data_ptr<T>();
  const float* k_up_data = k_up.data_ptr<float>();
  const float* v_up_data = v_up_t.data_ptr<float>();
  T* out_data = out.data_ptr<T>();
  // Three passes, each over all (row, head) items: a head's W_uk or W_uv (nope or v_head_dim rows of
  // kv_lora_rank fp32, 64 KiB each in small-deepseek) is read once per thread and pass when the items
  // run head by head, where running each (row, head) whole re-read both for every item. The passes
  // change no sum's order: each item's arithmetic is the same wherever it runs.
  // Kept by the calling thread across calls and only grown: a fresh allocation of this size is an
  // mmap whose page faults cost about a tenth of the op. Every element is written before it is read.
  thread_local std::vector<float> storage;
  const size_t needed = static_cast<size_t>(items * (g.padded + g.rank));
  if (storage.size() < needed) storage.resize(needed);
  float* q_lat = storage.data();
  float* out_lat = storage.data() + items * g.padded;
  at::parallel_for(0, items, 1, [&](int64_t first, int64_t last) {
    std::vector<float> q_nope_f32(static_cast<size_t>(g.nope));
    for (int64_t item = first; item < last; ++item) {  // head-major
      const int64_t head = item / rows, row = item % rows;
      absorb_query<T>(g, q_nope_data, q_pe_data, k_up_data, row, head, q_nope_f32.data(),
                      q_lat + (row * g.heads + head) * g.padded);
    }
  });
  // Items (row, group of kHeadGroup heads), a row's groups consecutive so that they share its keys in
  // cache. Rows are taken in zigzag order (last, first, second last, ...): an extend span's later
  // rows see more keys, and at::parallel_for hands each thread one contiguous range of items.
  const int64_t groups = (g.heads + kHeadGroup - 1) / kHeadGroup;
  at::parallel_for(0, rows * groups, 1, [&](int64_t first, int64_t last) {
    Scratch s;
    s.scores.resize(static_cast<size_t>(kHeadGroup * padded_keys));
    s.probs.resize(static_cast<size_t>(kHeadGroup * padded_keys));
    for (int64_t item = first; item < last; ++item) {
      const int64_t rank = item / groups, group = item % groups;
      const int64_t row = rank % 2 == 0 ? rows - 1 - rank / 2 : rank / 2;
      const int64_t h0 = group * kHeadGroup, h1 = std::min(g.heads, h0 + kHeadGroup);
      attend_heads<T>(g, pool, q_lat + row * g.heads * g.padded, static_cast<float>(scale), tasks[row], row, h0, h1,
                      out_lat + row * g.heads * g.rank, s);
    }
  });
  at::parallel_for(0, items, 1, [&](int64_t first, int64_t last) {
    std::vector<float> result(static_cast<size_t>(g.v_dim));
    for (int64_t item = first; item < last; ++item) {  // head-major
      const int64_t head = item / rows, row = item % rows;
      project_value<T>(g, v_up_data, out_lat + (row * g.heads + head) * g.rank, row, head, result.data(),
                       out_data);
    }
  });
}

// The pages of a sequence of `tokens` tokens must be listed and inside the pool.
void check_pages(const int32_t* pages, int64_t available, int64_t tokens, int64_t page_size, int64_t num_pages) {
  const int64_t used = (tokens + page_size - 1) / page_size;
  TORCH_CHECK(used <= available, "a sequence of ", tokens, " tokens needs ", used, " pages but ", available,
              " are listed");
  for (int64_t i = 0; i < used; ++i) {
    TORCH_CHECK(pages[i] >= 0 && pages[i] < num_pages, "page id ", pages[i], " out of range");
  }
}

at::Tensor mla_attention(const at::Tensor& q_nope_in, const at::Tensor& q_pe_in, const at::Tensor& buffer,
                         int64_t layer, const at::Tensor& k_up_in, const at::Tensor& v_up_t_in, double scale,
                         const std::optional<at::Tensor>& decode_page_table,
                         const std::optional<at::Tensor>& decode_seq_lens, at::TensorList span_page_ids,
                         at::IntArrayRef span_starts, at::IntArrayRef span_lengths,
                         at::IntArrayRef span_prefix_lens) {
  TORCH_CHECK(q_nope_in.device().is_cpu() && buffer.device().is_cpu(), "pdserve_cpu kernels take CPU tensors");
  TORCH_CHECK(q_nope_in.dim() == 3 && q_pe_in.dim() == 3 && buffer.dim() == 6,
              "q_nope [T, H, nope], q_pe [T, H, rope] and buffer [pages, layers, 1, P, 1, C] expected");
  TORCH_CHECK(buffer.size(2) == 1 && buffer.size(4) == 1 && buffer.stride(5) == 1, "an MLA pool expected");
  TORCH_CHECK(layer >= 0 && layer < buffer.size(1), "layer ", layer, " out of range");
  TORCH_CHECK(q_nope_in.scalar_type() == buffer.scalar_type() && q_pe_in.scalar_type() == buffer.scalar_type(),
              "q_nope, q_pe and the pool must have one dtype");
  TORCH_CHECK(k_up_in.scalar_type() == at::kFloat && v_up_t_in.scalar_type() == at::kFloat,
              "k_up and v_up_t must be float32");
  at::Tensor q_nope = q_nope_in.stride(2) == 1 ? q_nope_in : q_nope_in.contiguous();
  at::Tensor q_pe = q_pe_in.stride(2) == 1 ? q_pe_in : q_pe_in.contiguous();
  at::Tensor k_up = k_up_in.contiguous(), v_up_t = v_up_t_in.contiguous();
  const int64_t tokens = q_nope.size(0), heads = q_nope.size(1);
  const int64_t rank = k_up.size(2), rope = q_pe.size(2), width = buffer.size(5);
  TORCH_CHECK(q_pe.size(0) == tokens && q_pe.size(1) == heads, "q_nope and q_pe must have the same rows and heads");
  TORCH_CHECK(k_up.dim() == 3 && k_up.size(0) == heads && k_up.size(1) == q_nope.size(2),
              "k_up [H, nope, kv_lora_rank] expected");
  TORCH_CHECK(v_up_t.dim() == 3 && v_up_t.size(0) == heads && v_up_t.size(1) == rank,
              "v_up_t [H, kv_lora_rank, v_head_dim] expected");
  TORCH_CHECK(rank + rope == width, "pool rows of ", width, " values, but kv_lora_rank + rope = ", rank + rope);

  Shapes g{heads, q_nope.size(2), rank, rope, v_up_t.size(2), width, (width + kLanes - 1) / kLanes * kLanes,
           buffer.stride(0), layer * buffer.stride(1), buffer.stride(3), buffer.size(3),
           q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1)};

  // Each row's sequence and limit: decode rows first, then each span's rows.
  std::vector<RowTask> tasks(static_cast<size_t>(tokens), RowTask{nullptr, 0});
  at::Tensor table, lens;
  int64_t num_decode = 0;
  if (decode_page_table.has_value() && decode_page_table->numel() > 0) {
    table = decode_page_table->contiguous();
    lens = decode_seq_lens.value().contiguous();
    TORCH_CHECK(table.scalar_type() == at::kInt && lens.scalar_type() == at::kInt && table.dim() == 2,
                "decode_page_table [B, max_pages] and decode_seq_lens [B] must be int32");
    num_decode = table.size(0);
    TORCH_CHECK(lens.numel() == num_decode && num_decode <= tokens, "one seq_len per decode row expected");
    const int32_t* pages = table.data_ptr<int32_t>();
    const int32_t* len = lens.data_ptr<int32_t>();
    for (int64_t b = 0; b < num_decode; ++b) {
      TORCH_CHECK(len[b] >= 1, "decode row ", b, " has no keys");
      check_pages(pages + b * table.size(1), table.size(1), len[b], g.page_size, buffer.size(0));
      tasks[b] = RowTask{pages + b * table.size(1), len[b]};
    }
  }
  const size_t spans = span_page_ids.size();
  TORCH_CHECK(span_starts.size() == spans && span_lengths.size() == spans && span_prefix_lens.size() == spans,
              "one start, length and prefix_len per span expected");
  std::vector<at::Tensor> span_pages(spans);
  for (size_t i = 0; i < spans; ++i) {
    span_pages[i] = span_page_ids[i].contiguous();
    TORCH_CHECK(span_pages[i].scalar_type() == at::kInt && span_pages[i].dim() == 1, "span page_ids must be 1-d int32");
    const int64_t start = span_starts[i], length = span_lengths[i], prefix = span_prefix_lens[i];
    TORCH_CHECK(start >= num_decode && length >= 0 && prefix >= 0 && start + length <= tokens,
                "span ", i, " rows out of range");
    const int32_t* pages = span_pages[i].data_ptr<int32_t>();
    check_pages(pages, span_pages[i].numel(), prefix + length, g.page_size, buffer.size(0));
    for (int64_t r = 0; r < length; ++r) tasks[start + r] = RowTask{pages, prefix + r + 1};
  }
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(tasks[t].pages != nullptr, "row ", t, " is in no sequence");

  at::Tensor out = at::empty({tokens, heads, g.v_dim}, q_nope.options());
  if (tokens == 0) return out;
  switch (buffer.scalar_type()) {
    case at::kFloat: run<float>(g, q_nope, q_pe, buffer, k_up, v_up_t, scale, tasks, out); break;
    case at::kBFloat16: run<c10::BFloat16>(g, q_nope, q_pe, buffer, k_up, v_up_t, scale, tasks, out); break;
    case at::kHalf: run<c10::Half>(g, q_nope, q_pe, buffer, k_up, v_up_t, scale, tasks, out); break;
    default: TORCH_CHECK(false, "mla_attention supports float32, bfloat16 and float16, got ", buffer.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(PDSERVE_OPS, m) {
  m.def("mla_attention(Tensor q_nope, Tensor q_pe, Tensor buffer, int layer, Tensor k_up, Tensor v_up_t, "
        "float scale, Tensor? decode_page_table, Tensor? decode_seq_lens, Tensor[] span_page_ids, "
        "int[] span_starts, int[] span_lengths, int[] span_prefix_lens) -> Tensor",
        &mla_attention);
}

}  // namespace pdserve
