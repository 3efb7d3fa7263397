// Attention of new queries to a KV cache read in place: attention_with_kvcache's kernel on the CPU (a decoding step,
// chunked prefill).
//
// The cache is [B, Lmax, Hkv, D], or paged [num_blocks, block_size, Hkv, D] with a block table, read through its
// strides (each row of D values contiguous); sequence b holds lengths[b] keys and its query i sits at key position
// lengths[b] - Lq + i. One task per (sequence, KV head, block of rows, key split): the query heads of the KV head's
// group and their queries are the rows of one small problem (GQA heads packed), so each key and value is read once
// per task, with no gather, no transpose and no copy of the cache. Keys go by in chunks of at most kChunk that never
// cross a page:
//   S = q.k * scale, capped (softcap tanh(S / softcap)), minus ALiBi's slope |position - j|, -inf outside the row's
//   causal mask and window (keys past lengths[b] are never read)
//   m' = max(m, rowmax S),  P = exp(S - m'),  l = l exp(m - m') + rowsum P,  acc = acc exp(m - m') + P V
// With fewer tasks than threads, a sequence's keys split into ranges whose partial (m, l, acc) merge at the end. The
// sink joins l last, as a key with no value, as in attention.cpp: out = acc / l, lse = m + log l (a row with no
// visible key: out 0, lse -inf, or the sink; a NaN score: NaN).
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <optional>
#include <type_traits>
#include <vector>

#include "attention_rows.h"
#include "common.h"

namespace fused_transformer_cpu {

namespace {

constexpr int64_t kChunk = 128;     // keys per chunk
constexpr int64_t kRowBlock = 16;   // rows (query heads x queries) per task, at least a GQA group

template <typename scalar_t>
struct KVCacheProblem {
  int64_t batch, q_len, heads, kv_heads, head_dim, group;
  int64_t rows_per_block, row_blocks, splits;
  const int32_t* lengths;
  const int32_t* block_table = nullptr;  // [B, table_stride]; null: not paged
  int64_t table_stride = 0, block_size = 0;
  bool causal = false;
  int64_t window_left = -1, window_right = -1;  // -1: no limit on that side
  scalar_t scale = 1, softcap = 0;  // softcap 0: none
  const scalar_t* alibi = nullptr;  // slopes [B, H] through alibi_batch_stride (0: [H])
  int64_t alibi_batch_stride = 0;
  const scalar_t* sinks = nullptr;  // [H]

  int64_t length(int64_t b) const { return lengths[b]; }
  int64_t position(int64_t b, int64_t i) const { return lengths[b] - q_len + i; }
  bool limits_right() const { return causal || window_right >= 0; }
  int64_t right_limit() const {
    return causal ? (window_right >= 0 ? std::min<int64_t>(window_right, 0) : 0) : window_right;
  }
  // Query i of sequence b sees keys [key_begin, key_end).
  int64_t key_begin(int64_t b, int64_t i) const {
    return window_left >= 0 ? std::clamp<int64_t>(position(b, i) - window_left, 0, length(b)) : 0;
  }
  int64_t key_end(int64_t b, int64_t i) const {
    int64_t end = length(b);
    if (limits_right()) end = std::min(end, position(b, i) + right_limit() + 1);
    return std::max<int64_t>(end, 0);
  }
};

// K or V of the cache: element (block or sequence, row in block, KV head, 0) through stride[0..2].
template <typename cache_t>
struct CacheRows {
  const cache_t* data;
  int64_t stride[3];
};

// ------------------------------------------------------------------------------------------ row loops
// float versions are multiversioned (FT_MULTIVERSIONED, common.h); double versions serve the float64 tests.

#if defined(__clang__)
#define FT_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define FT_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, Int8{__VA_ARGS__})
#endif

// [a0 + a1, b0 + b1, a2 + a3, b2 + b3, ...]: one level of a transposing reduction.
FT_INLINE Float8 pair_sums(Float8 a, Float8 b) {
  return FT_SHUFFLE(a, b, 0, 8, 2, 10, 4, 12, 6, 14) + FT_SHUFFLE(a, b, 1, 9, 3, 11, 5, 13, 7, 15);
}

// [q . k_0, ..., q . k_7] for k_t = k + t * ks, d a multiple of 8: eight lanes each, summed by one transposing
// reduction instead of eight horizontal sums.
FT_INLINE Float8 dot8_keys(const float* q, const float* k, int64_t ks, int64_t d) {
  Float8 a0 = {}, a1 = {}, a2 = {}, a3 = {}, a4 = {}, a5 = {}, a6 = {}, a7 = {};
  for (int64_t c = 0; c < d; c += 8) {
    const Float8 x = load8(q + c);
    a0 += x * load8(k + c);
    a1 += x * load8(k + ks + c);
    a2 += x * load8(k + 2 * ks + c);
    a3 += x * load8(k + 3 * ks + c);
    a4 += x * load8(k + 4 * ks + c);
    a5 += x * load8(k + 5 * ks + c);
    a6 += x * load8(k + 6 * ks + c);
    a7 += x * load8(k + 7 * ks + c);
  }
  const Float8 p01 = pair_sums(a0, a1), p23 = pair_sums(a2, a3), p45 = pair_sums(a4, a5), p67 = pair_sums(a6, a7);
  const Float8 q03 = FT_SHUFFLE(p01, p23, 0, 1, 8, 9, 4, 5, 12, 13) + FT_SHUFFLE(p01, p23, 2, 3, 10, 11, 6, 7, 14, 15);
  const Float8 q47 = FT_SHUFFLE(p45, p67, 0, 1, 8, 9, 4, 5, 12, 13) + FT_SHUFFLE(p45, p67, 2, 3, 10, 11, 6, 7, 14, 15);
  return FT_SHUFFLE(q03, q47, 0, 1, 2, 3, 8, 9, 10, 11) + FT_SHUFFLE(q03, q47, 4, 5, 6, 7, 12, 13, 14, 15);
}

// s[r * ld + j] = scale * q_r . k_j for rows r < rows (q_r = q + r * d) and keys j < cols (k_j = k + j * ks).
FT_INLINE void chunk_scores_body(const float* q, int64_t rows, const float* k, int64_t ks, int64_t cols, int64_t d,
                                 float scale, float* s, int64_t ld) {
  int64_t j = 0;
  if (d % 8 == 0)
    for (; j + 8 <= cols; j += 8)
      for (int64_t r = 0; r < rows; ++r) store8(s + r * ld + j, scale * dot8_keys(q + r * d, k + j * ks, ks, d));
  for (; j < cols; ++j)
    for (int64_t r = 0; r < rows; ++r) s[r * ld + j] = scale * dot(q + r * d, k + j * ks, d);
}
FT_MULTIVERSIONED(void, chunk_scores,
                  (const float* q, int64_t rows, const float* k, int64_t ks, int64_t cols, int64_t d, float scale,
                   float* s, int64_t ld),
                  (q, rows, k, ks, cols, d, scale, s, ld))

void chunk_scores(const double* q, int64_t rows, const double* k, int64_t ks, int64_t cols, int64_t d, double scale,
                  double* s, int64_t ld) {
  for (int64_t j = 0; j < cols; ++j)
    for (int64_t r = 0; r < rows; ++r) s[r * ld + j] = scale * dot(q + r * d, k + j * ks, d);
}

// out[0 .. 8 kVectors) += sum_j weights[j] v_j[0 .. 8 kVectors) (v_j = v + j * vs), in registers: eight independent
// chains of fused multiply-adds (kVectors columns x 8 / kVectors keys at a time), so that no add waits on the last.
template <int kVectors>
FT_INLINE void value_columns(const float* weights, const float* v, int64_t vs, int64_t cols, float* out) {
  constexpr int kUnroll = 8 / kVectors;
  Float8 acc[kUnroll][kVectors] = {};
  int64_t j = 0;
  for (; j + kUnroll <= cols; j += kUnroll)
    for (int u = 0; u < kUnroll; ++u) {
      const float w = weights[j + u];
      const float* row = v + (j + u) * vs;
      for (int t = 0; t < kVectors; ++t) acc[u][t] += w * load8(row + 8 * t);
    }
  for (; j < cols; ++j)
    for (int t = 0; t < kVectors; ++t) acc[0][t] += weights[j] * load8(v + j * vs + 8 * t);
  for (int t = 0; t < kVectors; ++t) {
    Float8 total = load8(out + 8 * t);
    for (int u = 0; u < kUnroll; ++u) total += acc[u][t];
    store8(out + 8 * t, total);
  }
}

// acc[r * d + c] += sum_j p[r * ld + j] v_j[c] (v_j = v + j * vs): 64 columns at a time, then 32, 16, 8, the rest.
FT_INLINE void chunk_values_body(const float* p, int64_t ld, int64_t rows, const float* v, int64_t vs, int64_t cols,
                                 int64_t d, float* acc) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* weights = p + r * ld;
    float* out = acc + r * d;
    int64_t c = 0;
    for (; c + 64 <= d; c += 64) value_columns<8>(weights, v + c, vs, cols, out + c);
    if (c + 32 <= d) {
      value_columns<4>(weights, v + c, vs, cols, out + c);
      c += 32;
    }
    if (c + 16 <= d) {
      value_columns<2>(weights, v + c, vs, cols, out + c);
      c += 16;
    }
    if (c + 8 <= d) {
      value_columns<1>(weights, v + c, vs, cols, out + c);
      c += 8;
    }
    for (; c < d; ++c) {
      float total = out[c];
      for (int64_t j = 0; j < cols; ++j) total += weights[j] * v[j * vs + c];
      out[c] = total;
    }
  }
}
FT_MULTIVERSIONED(void, chunk_values,
                  (const float* p, int64_t ld, int64_t rows, const float* v, int64_t vs, int64_t cols, int64_t d,
                   float* acc),
                  (p, ld, rows, v, vs, cols, d, acc))

void chunk_values(const double* p, int64_t ld, int64_t rows, const double* v, int64_t vs, int64_t cols, int64_t d,
                  double* acc) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j) {
      const double w = p[r * ld + j];
      const double* row = v + j * vs;
      for (int64_t c = 0; c < d; ++c) acc[r * d + c] += w * row[c];
    }
}

// ------------------------------------------------------------------------------------------ kernel

// The rows [cols, D] of keys j0 .. j0 + cols - 1 of KV head h of sequence b (within one page), as scalar_t: in place
// when the cache holds scalar_t, else converted into buffer. Returns (rows, row stride).
template <typename scalar_t, typename cache_t>
std::pair<const scalar_t*, int64_t> cache_chunk(const KVCacheProblem<scalar_t>& p, const CacheRows<cache_t>& cache,
                                                int64_t b, int64_t h, int64_t j0, int64_t cols, scalar_t* buffer) {
  const int64_t d = p.head_dim;
  const cache_t* rows = p.block_table
                            ? cache.data + p.block_table[b * p.table_stride + j0 / p.block_size] * cache.stride[0] +
                                  (j0 % p.block_size) * cache.stride[1]
                            : cache.data + b * cache.stride[0] + j0 * cache.stride[1];
  rows += h * cache.stride[2];
  if constexpr (std::is_same_v<cache_t, scalar_t>) {
    return {rows, cache.stride[1]};
  } else {
    for (int64_t j = 0; j < cols; ++j)
      for (int64_t c = 0; c < d; ++c) buffer[j * d + c] = static_cast<scalar_t>(rows[j * cache.stride[1] + c]);
    return {buffer, d};
  }
}

// One row's result from its running max m, sum l and unnormalised acc[D]: the sink joins l (a real query row always),
// out = acc / l, lse = m + log l.
template <typename scalar_t, typename out_t>
void finish_row(const KVCacheProblem<scalar_t>& p, int64_t h, scalar_t m, scalar_t l, const scalar_t* acc, out_t* out,
                scalar_t* lse) {
  const scalar_t minus_inf = -std::numeric_limits<scalar_t>::infinity();
  scalar_t acc_scale = 1;
  if (p.sinks != nullptr && !std::isnan(l)) {
    const scalar_t sink = p.sinks[h], new_max = std::max(m, sink);
    if (new_max != minus_inf) {
      acc_scale = m == minus_inf ? scalar_t(0) : std::exp(m - new_max);
      l = l * acc_scale + std::exp(sink - new_max);
      m = new_max;
    }
  }
  const bool has_key = l != 0;  // true for NaN, which then fills the row
  const scalar_t inverse = has_key ? acc_scale / l : scalar_t(0);
  for (int64_t c = 0; c < p.head_dim; ++c) out[c] = static_cast<out_t>(has_key ? acc[c] * inverse : scalar_t(0));
  *lse = has_key ? m + std::log(l) : minus_inf;
}

// q [B, Lq, H, D] through q_stride (last stride 1), out [B, Lq, H, D] contiguous, lse [B, H, Lq] contiguous.
template <typename scalar_t, typename cache_t>
void kvcache_attention_kernel(const KVCacheProblem<scalar_t>& p, const cache_t* q, const int64_t* q_stride,
                              const CacheRows<cache_t>& k, const CacheRows<cache_t>& v, cache_t* out, scalar_t* lse) {
  const int64_t d = p.head_dim, group = p.group, rows_per_block = p.rows_per_block;
  const int64_t blocks = p.batch * p.kv_heads * p.row_blocks, tasks = blocks * p.splits;
  const scalar_t minus_inf = -std::numeric_limits<scalar_t>::infinity();
  // Split partials: per task and row, m, l and acc[D].
  std::vector<scalar_t> partial(p.splits > 1 ? tasks * rows_per_block * (d + 2) : 0);
  int64_t work = 0;  // multiply-adds, to run small problems without waking the other threads
  for (int64_t b = 0; b < p.batch; ++b) work += p.length(b);
  work *= p.heads * p.q_len * std::max<int64_t>(d, 1) * 2;
  const int64_t grain = work < 65536 ? std::max<int64_t>(tasks, 1) : 1;

  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> q_rows(rows_per_block * d), scores(rows_per_block * kChunk), acc(rows_per_block * d);
    std::vector<scalar_t> row_max_(rows_per_block), row_sum(rows_per_block), k_buffer, v_buffer;
    if (!std::is_same_v<cache_t, scalar_t>) {
      k_buffer.resize(kChunk * d);
      v_buffer.resize(kChunk * d);
    }
    for (int64_t task = begin; task < end; ++task) {
      const int64_t block = task / p.splits, split = task % p.splits;
      const int64_t b = block / (p.kv_heads * p.row_blocks), kv_head = block / p.row_blocks % p.kv_heads;
      const int64_t r0 = block % p.row_blocks * rows_per_block;
      const int64_t rows = std::min(rows_per_block, p.q_len * group - r0);
      // Row r is query (r0 + r) / group of head kv_head * group + (r0 + r) % group.
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = (r0 + r) / group, h = kv_head * group + (r0 + r) % group;
        const cache_t* row = q + b * q_stride[0] + i * q_stride[1] + h * q_stride[2];
        for (int64_t c = 0; c < d; ++c) q_rows[r * d + c] = static_cast<scalar_t>(row[c]);
      }
      std::fill(row_max_.begin(), row_max_.begin() + rows, minus_inf);
      std::fill(row_sum.begin(), row_sum.begin() + rows, scalar_t(0));
      std::fill(acc.begin(), acc.begin() + rows * d, scalar_t(0));
      // The block's first row sees the earliest keys and its last the latest; this split takes its share of them.
      const int64_t first = r0 / group, last = (r0 + rows - 1) / group;
      const int64_t key_start = p.key_begin(b, first), key_stop = std::max(key_start, p.key_end(b, last));
      const int64_t share = (key_stop - key_start + p.splits - 1) / p.splits;
      const int64_t split_start = std::min(key_stop, key_start + split * share);
      const int64_t split_stop = std::min(key_stop, split_start + share);
      for (int64_t j0 = split_start, cols = 0; j0 < split_stop; j0 += cols) {
        cols = std::min(kChunk, split_stop - j0);
        if (p.block_table) cols = std::min(cols, p.block_size - j0 % p.block_size);  // within one page
        const auto [k_rows, k_stride] = cache_chunk(p, k, b, kv_head, j0, cols, k_buffer.data());
        const auto [v_rows, v_stride] = cache_chunk(p, v, b, kv_head, j0, cols, v_buffer.data());
        chunk_scores(q_rows.data(), rows, k_rows, k_stride, cols, d, p.scale, scores.data(), kChunk);
        for (int64_t r = 0; r < rows; ++r) {
          scalar_t* row = scores.data() + r * kChunk;
          const int64_t i = (r0 + r) / group, h = kv_head * group + (r0 + r) % group;
          if (p.softcap > 0) softcap_row(row, cols, p.softcap, static_cast<scalar_t*>(nullptr));
          if (p.alibi != nullptr) {
            const scalar_t slope = p.alibi[b * p.alibi_batch_stride + h];
            const int64_t diagonal = p.position(b, i) - j0;  // key column c is |diagonal - c| from the query
            for (int64_t c = 0; c < cols; ++c) row[c] -= slope * static_cast<scalar_t>(std::abs(diagonal - c));
          }
          const int64_t visible_begin = std::clamp<int64_t>(p.key_begin(b, i) - j0, 0, cols);
          const int64_t visible_end = std::clamp<int64_t>(p.key_end(b, i) - j0, visible_begin, cols);
          std::fill(row, row + visible_begin, minus_inf);
          std::fill(row + visible_end, row + cols, minus_inf);
          const scalar_t block_max = row_max(row, cols);
          if (std::isnan(block_max) || std::isnan(row_max_[r])) {  // a NaN score: the row's out and lse are NaN
            row_max_[r] = row_sum[r] = std::numeric_limits<scalar_t>::quiet_NaN();
            std::fill(row, row + cols, scalar_t(0));
            continue;
          }
          const scalar_t new_max = std::max(row_max_[r], block_max);
          if (new_max == minus_inf) {  // nothing visible to this row yet
            std::fill(row, row + cols, scalar_t(0));
            continue;
          }
          const scalar_t rescale = row_max_[r] == minus_inf ? scalar_t(0) : std::exp(row_max_[r] - new_max);
          row_sum[r] = row_sum[r] * rescale + exp_shifted_sum(row, cols, new_max);
          row_max_[r] = new_max;
          if (rescale != scalar_t(1))
            for (int64_t c = 0; c < d; ++c) acc[r * d + c] *= rescale;
        }
        chunk_values(scores.data(), kChunk, rows, v_rows, v_stride, cols, d, acc.data());
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = (r0 + r) / group, h = kv_head * group + (r0 + r) % group;
        if (p.splits == 1) {
          finish_row(p, h, row_max_[r], row_sum[r], acc.data() + r * d, out + ((b * p.q_len + i) * p.heads + h) * d,
                     lse + (b * p.heads + h) * p.q_len + i);
          continue;
        }
        scalar_t* part = partial.data() + (task * rows_per_block + r) * (d + 2);
        part[0] = row_max_[r];
        part[1] = row_sum[r];
        std::copy(acc.begin() + r * d, acc.begin() + (r + 1) * d, part + 2);
      }
    }
  });
  if (p.splits == 1) return;
  // Merge the splits of each block's rows: rescale every partial to the largest m.
  at::parallel_for(0, blocks, std::max<int64_t>(blocks, 1), [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> merged(d);
    for (int64_t block = begin; block < end; ++block) {
      const int64_t b = block / (p.kv_heads * p.row_blocks), kv_head = block / p.row_blocks % p.kv_heads;
      const int64_t r0 = block % p.row_blocks * rows_per_block;
      const int64_t rows = std::min(rows_per_block, p.q_len * group - r0);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = (r0 + r) / group, h = kv_head * group + (r0 + r) % group;
        const auto part = [&](int64_t split) {
          return partial.data() + ((block * p.splits + split) * rows_per_block + r) * (d + 2);
        };
        scalar_t m = minus_inf;
        bool nan = false;
        for (int64_t split = 0; split < p.splits; ++split) {
          nan |= std::isnan(part(split)[0]);
          m = std::max(m, part(split)[0]);
        }
        scalar_t l = 0;
        std::fill(merged.begin(), merged.end(), scalar_t(0));
        if (nan) {
          l = m = std::numeric_limits<scalar_t>::quiet_NaN();
        } else if (m != minus_inf) {
          for (int64_t split = 0; split < p.splits; ++split) {
            const scalar_t* values = part(split);
            if (values[0] == minus_inf) continue;
            const scalar_t factor = std::exp(values[0] - m);
            l += values[1] * factor;
            for (int64_t c = 0; c < d; ++c) merged[c] += values[2 + c] * factor;
          }
        }
        finish_row(p, h, m, l, merged.data(), out + ((b * p.q_len + i) * p.heads + h) * d,
                   lse + (b * p.heads + h) * p.q_len + i);
      }
    }
  });
}

// Writes rows [B, Lnew, Hkv, D] into cache at positions lengths[b] .. lengths[b] + Lnew - 1 of each sequence, through
// every stride of both (the cache as given, never a copy).
template <typename T>
void append_rows(const at::Tensor& cache, const at::Tensor& rows, const int32_t* lengths, const int32_t* block_table,
                 int64_t table_stride, int64_t block_size) {
  T* out = cache.data_ptr<T>();
  const T* in = rows.data_ptr<T>();
  const int64_t d = rows.size(3), out_step = cache.stride(3), in_step = rows.stride(3);
  for (int64_t b = 0; b < rows.size(0); ++b)
    for (int64_t t = 0; t < rows.size(1); ++t) {
      const int64_t position = lengths[b] + t;
      const int64_t block = block_table ? block_table[b * table_stride + position / block_size] : b;
      const int64_t row = block_table ? position % block_size : position;
      for (int64_t h = 0; h < rows.size(2); ++h) {
        T* to = out + block * cache.stride(0) + row * cache.stride(1) + h * cache.stride(2);
        const T* from = in + b * rows.stride(0) + t * rows.stride(1) + h * rows.stride(2);
        for (int64_t c = 0; c < d; ++c) to[c * out_step] = from[c * in_step];
      }
    }
}

// A cache (or q) whose last dim is not contiguous is copied; everything else is read in place.
at::Tensor with_unit_last_stride(const at::Tensor& t) {
  return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous();
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> attention_with_kvcache_fwd(
    const at::Tensor& q_in, const at::Tensor& k_cache_in, const at::Tensor& v_cache_in, const at::Tensor& lengths_in,
    const std::optional<at::Tensor>& block_table_in, const std::optional<at::Tensor>& k_new,
    const std::optional<at::Tensor>& v_new, bool is_causal, int64_t window_left, int64_t window_right, double scale,
    std::optional<double> softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& sinks) {
  for (const auto& [t, name] : {std::pair{&q_in, "q"}, {&k_cache_in, "k_cache"}, {&v_cache_in, "v_cache"},
                                {&lengths_in, "cache_seqlens"}})
    check_cpu(*t, name);
  TORCH_CHECK_VALUE(q_in.dim() == 4 && k_cache_in.dim() == 4 && v_cache_in.sizes() == k_cache_in.sizes(),
                    "attention_with_kvcache: q must be [B, Lq, H, D] and the caches [B or blocks, L, Hkv, D], got ",
                    q_in.sizes(), ", ", k_cache_in.sizes(), ", ", v_cache_in.sizes());
  TORCH_CHECK_TYPE(k_cache_in.scalar_type() == q_in.scalar_type() && v_cache_in.scalar_type() == q_in.scalar_type(),
                   "attention_with_kvcache: the caches must have q's dtype ", q_in.scalar_type());
  const int64_t batch = q_in.size(0), q_len = q_in.size(1), heads = q_in.size(2), head_dim = q_in.size(3);
  const int64_t kv_heads = k_cache_in.size(2);
  const bool paged = block_table_in.has_value();
  TORCH_CHECK_VALUE(k_cache_in.size(3) == head_dim && kv_heads > 0 && heads % kv_heads == 0 &&
                        (paged || k_cache_in.size(0) == batch),
                    "attention_with_kvcache: the caches ", k_cache_in.sizes(), " do not match q ", q_in.sizes());
  TORCH_CHECK_VALUE(lengths_in.scalar_type() == at::kInt && lengths_in.dim() == 1 && lengths_in.size(0) == batch,
                    "attention_with_kvcache: cache_seqlens must be int32 [", batch, "], got ", lengths_in.scalar_type(),
                    " ", lengths_in.sizes());
  const at::Tensor lengths = lengths_in.contiguous();
  TORCH_CHECK_VALUE(k_new.has_value() == v_new.has_value(), "attention_with_kvcache: k_new and v_new go together");
  int64_t new_len = 0;
  if (k_new.has_value()) {
    check_cpu(*k_new, "k_new");
    check_cpu(*v_new, "v_new");
    TORCH_CHECK_VALUE(k_new->dim() == 4 && v_new->sizes() == k_new->sizes() && k_new->size(0) == batch &&
                          k_new->size(2) == kv_heads && k_new->size(3) == head_dim,
                      "attention_with_kvcache: k_new and v_new must be [", batch, ", Lnew, ", kv_heads, ", ", head_dim,
                      "], got ", k_new->sizes(), " and ", v_new->sizes());
    TORCH_CHECK_TYPE(k_new->scalar_type() == q_in.scalar_type() && v_new->scalar_type() == q_in.scalar_type(),
                     "attention_with_kvcache: k_new and v_new must have the cache's dtype ", q_in.scalar_type());
    new_len = k_new->size(1);
  }
  at::Tensor block_table;
  const int64_t block_size = k_cache_in.size(1);
  int64_t capacity = block_size;
  if (paged) {
    check_cpu(*block_table_in, "block_table");
    TORCH_CHECK_VALUE(block_table_in->scalar_type() == at::kInt && block_table_in->dim() == 2 &&
                          block_table_in->size(0) == batch && block_size > 0,
                      "attention_with_kvcache: block_table must be int32 [", batch, ", max_blocks], got ",
                      block_table_in->scalar_type(), " ", block_table_in->sizes());
    block_table = block_table_in->contiguous();
    capacity = block_table.size(1) * block_size;
  }
  // The values (the functional op checked them already, except under torch.compile), before anything is written:
  // nothing outside the cache is ever read or written.
  const int32_t* length_before = lengths.data_ptr<int32_t>();
  std::vector<int32_t> length(batch);  // keys per sequence once the new ones are in
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK_VALUE(0 <= length_before[b] && length_before[b] + new_len <= capacity, "attention_with_kvcache: ",
                      "sequence ", b, " has ", length_before[b] + new_len, " keys, outside the cache's ", capacity);
    length[b] = static_cast<int32_t>(length_before[b] + new_len);
    if (!paged) continue;
    const int32_t* row = block_table.data_ptr<int32_t>() + b * block_table.size(1);
    for (int64_t used = 0; used < (length[b] + block_size - 1) / block_size; ++used)
      TORCH_CHECK_VALUE(0 <= row[used] && row[used] < k_cache_in.size(0), "attention_with_kvcache: block_table holds ",
                        row[used], " for sequence ", b, ", outside [0, ", k_cache_in.size(0), ")");
  }
  if (new_len > 0)
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q_in.scalar_type(), "attention_with_kvcache_append", [&] {
      const int32_t* table = paged ? block_table.data_ptr<int32_t>() : nullptr;
      const int64_t table_stride = paged ? block_table.size(1) : 0;
      append_rows<scalar_t>(k_cache_in, *k_new, length_before, table, table_stride, block_size);
      append_rows<scalar_t>(v_cache_in, *v_new, length_before, table, table_stride, block_size);
    });
  const at::Tensor q = with_unit_last_stride(q_in), k_cache = with_unit_last_stride(k_cache_in);
  const at::Tensor v_cache = with_unit_last_stride(v_cache_in);

  const at::ScalarType dtype = q.scalar_type(), compute = accumulate_dtype(dtype);
  at::Tensor out = at::empty({batch, q_len, heads, head_dim}, q.options());
  at::Tensor lse = at::empty({batch, heads, q_len}, q.options().dtype(compute));
  at::Tensor alibi, sink_values;
  if (alibi_slopes.has_value()) {
    check_cpu(*alibi_slopes, "alibi_slopes");
    const auto sizes = alibi_slopes->sizes();
    TORCH_CHECK_VALUE((sizes.size() == 1 && sizes[0] == heads) ||
                          (sizes.size() == 2 && sizes[0] == batch && sizes[1] == heads),
                      "attention_with_kvcache: alibi_slopes must be [", heads, "] or [", batch, ", ", heads, "], got ",
                      sizes);
    alibi = alibi_slopes->to(compute).contiguous();
  }
  if (sinks.has_value()) {
    check_cpu(*sinks, "sinks");
    TORCH_CHECK_VALUE(sinks->dim() == 1 && sinks->size(0) == heads, "attention_with_kvcache: sinks must be [", heads,
                      "], got ", sinks->sizes());
    sink_values = sinks->to(compute).contiguous();
  }
  TORCH_CHECK_VALUE(!softcap.has_value() || (*softcap > 0 && std::isfinite(*softcap)),
                    "attention_with_kvcache: softcap must be a finite number > 0, got ", softcap.value_or(0));

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "attention_with_kvcache_fwd", [&] {
    using cache_t = scalar_t;
    using compute_t = at::opmath_type<cache_t>;
    KVCacheProblem<compute_t> p;
    p.batch = batch;
    p.q_len = q_len;
    p.heads = heads;
    p.kv_heads = kv_heads;
    p.head_dim = head_dim;
    p.group = heads / kv_heads;
    const int64_t rows = q_len * p.group;
    p.rows_per_block = std::max<int64_t>(std::min(rows, std::max(kRowBlock, p.group)), 1);
    p.row_blocks = (rows + p.rows_per_block - 1) / p.rows_per_block;
    p.lengths = length.data();
    if (paged) {
      p.block_table = block_table.data_ptr<int32_t>();
      p.table_stride = block_table.size(1);
      p.block_size = block_size;
    }
    p.causal = is_causal;
    p.window_left = window_left;
    p.window_right = window_right;
    p.scale = static_cast<compute_t>(scale);
    p.softcap = static_cast<compute_t>(softcap.value_or(0));
    if (alibi.defined()) {
      p.alibi = alibi.data_ptr<compute_t>();
      p.alibi_batch_stride = alibi.dim() == 2 ? alibi.stride(0) : 0;
    }
    if (sink_values.defined()) p.sinks = sink_values.data_ptr<compute_t>();
    // Key splits when there are fewer tasks than threads twice over, none shorter than 256 keys.
    const int64_t threads = at::get_num_threads(), blocks = batch * kv_heads * p.row_blocks;
    int64_t longest = 0;
    for (int64_t b = 0; b < batch; ++b) longest = std::max<int64_t>(longest, length[b]);
    p.splits = blocks == 0 || blocks >= 2 * threads
                   ? 1
                   : std::clamp<int64_t>((2 * threads + blocks - 1) / blocks, 1, std::max<int64_t>(longest / 256, 1));
    const int64_t q_stride[3] = {q.stride(0), q.stride(1), q.stride(2)};
    const CacheRows<cache_t> k{k_cache.data_ptr<cache_t>(), {k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)}};
    const CacheRows<cache_t> v{v_cache.data_ptr<cache_t>(), {v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)}};
    kvcache_attention_kernel<compute_t, cache_t>(p, q.data_ptr<cache_t>(), q_stride, k, v, out.data_ptr<cache_t>(),
                                                 lse.data_ptr<compute_t>());
  });
  return {out, lse};
}

TORCH_LIBRARY_IMPL(fused_transformer_cpu, CPU, m) {
  m.impl("attention_with_kvcache_fwd", &attention_with_kvcache_fwd);
}

}  // namespace fused_transformer_cpu
