// Flash attention on the CPU: online softmax over key blocks, nothing of [Lq, Lk] kept beyond one block per thread.
//
// Forward, per (batch, head, block of query rows), over the key blocks that block can see:
//   S = Q K^T * scale, capped (softcap tanh(S / softcap)), minus ALiBi's slope |i + o - j|, plus bias, -inf where
//   a bool mask is false, above the causal diagonal and at padded keys (keys after a sequence's last real key are
//   never read)
//   m' = max(m, rowmax S),  P = exp(S - m'),  l = l exp(m - m') + rowsum P,  acc = acc exp(m - m') + dropout(P) V
//   out = acc / l,  lse = m + log l   (a row with no visible key: out = 0, lse = -inf; a row with a NaN score:
//   out and lse NaN, as torch's softmax gives). An attention sink joins l last, as a key with no value: a real
//   row's l += exp(sink - m) (rescaled to max(m, sink)), so its lse holds the sink and a row with no key gets
//   lse = sink.
// Dropout scales probabilities by keep / (1 - p) after the softmax, so l sums the undropped P.
//
// Backward, with P = exp(S - lse) recomputed per block, Pd = dropout(P) and delta_i = rowsum(dO * O)_i:
//   dV += Pd^T dO,  dPd = dO V^T,  dS = Pd * dPd - P * delta,  dQ += dS K scale,  dK += dS^T Q scale
// (with a softcap, dS is multiplied by the cap's derivative 1 - tanh^2 first). The forward's lse holds the sinks,
// so P needs no sink here, and delta = rowsum(dO * O) holds because a sink has no value; the sinks' own
// gradient, -exp(sink - lse) delta summed over rows, is computed in Python (contract.sinks_gradient).
// One task per (batch, kv head) walks every key block and every query head of its group, so dK, dV and dQ
// each have one writer: no atomics, no per-thread copies, and a result that does not depend on threads.
#include <ATen/Parallel.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "attention_backward_tiles.h"
#include "attention_forward_tiles.h"
#include "attention_rows.h"
#include "common.h"

// The Fortran BLAS that libtorch_cpu exports (MKL on x86-64 wheels). ATen's own cpublas::gemm wrappers are not
// exported to extensions. Weak, so a torch without them still loads this extension and uses gemm_loops.
extern "C" {
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc) __attribute__((weak));
void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc) __attribute__((weak));
}

namespace fused_transformer_cpu {

namespace {

constexpr int64_t kQueryBlock = 64;
constexpr int64_t kKeyBlock = 128;
constexpr int64_t kTiledCausalKeys = 512;  // tiled_forward_for: the causal forward's tiles from this many keys

template <typename scalar_t>
struct AttentionProblem {
  int64_t batch, heads, kv_heads, q_len, k_len, head_dim;  // q_len, k_len: the longest sequence's (varlen)
  const scalar_t* bias = nullptr;  // [B, H, Lq, Lk] through bias_stride (0 for broadcast dims), last stride 1
  int64_t bias_stride[3] = {0, 0, 0};
  const bool* keep = nullptr;  // a bool mask instead of bias, true = may attend; strides as bias's
  int64_t keep_stride[3] = {0, 0, 0};
  const bool* key_padding = nullptr;  // [B, Lk], true = padding
  const int64_t* key_ends = nullptr;  // [B]: 1 + the last key that is not padding (0 if none), or the length
  const bool* padding_has_holes = nullptr;  // [B]: some key before key_ends[b] is padding
  const bool* query_padding = nullptr;  // [B, Lq], true = padding: the row's output is 0 and its lse -inf
  const int64_t* query_ends = nullptr;  // [B]: rows from here on are not computed (padding, or past a sequence)
  bool causal = false;
  // Query i's diagonal key is i + offset: alignment_offsets[b] when given (per sequence), else alignment_offset.
  int64_t alignment_offset = 0;
  const int64_t* alignment_offsets = nullptr;
  int64_t window_left = -1, window_right = -1;  // keys i + offset - left .. i + offset + right; -1 = no limit
  scalar_t scale = 1;
  scalar_t softcap = 0;  // > 0: scaled scores s become softcap * tanh(s / softcap), before ALiBi and the masks
  const scalar_t* alibi = nullptr;  // slopes [B, H] through alibi_batch_stride (0: [H]); score -= slope |i + o - j|
  int64_t alibi_batch_stride = 0;
  const scalar_t* sinks = nullptr;  // [H]: a logit per head in each real row's softmax denominator
  DropoutMask dropout{0, 0.0};
  bool packed = false;  // variable-length sequences packed as [T, heads, D]: no rows past query_length(b)

  int64_t group() const { return heads / kv_heads; }
  int64_t key_length(int64_t b) const { return key_ends ? key_ends[b] : k_len; }
  int64_t query_length(int64_t b) const { return query_ends ? query_ends[b] : q_len; }
  int64_t offset(int64_t b) const { return alignment_offsets ? alignment_offsets[b] : alignment_offset; }
  bool limits_right() const { return causal || window_right >= 0; }
  bool modifies_scores() const { return softcap > 0 || alibi != nullptr; }
  // The last visible key is i + offset + right_limit() (when limits_right()).
  int64_t right_limit() const { return causal ? (window_right >= 0 ? std::min<int64_t>(window_right, 0) : 0) : window_right; }
  // Keys [key_begin, key_end) may be visible to query row i (the masks may still hide some).
  int64_t key_begin(int64_t b, int64_t i) const {
    return window_left >= 0 ? std::clamp<int64_t>(i + offset(b) - window_left, 0, key_length(b)) : 0;
  }
  int64_t key_end(int64_t b, int64_t i) const {
    int64_t end = key_length(b);
    if (limits_right()) end = std::min(end, i + offset(b) + right_limit() + 1);
    return std::max<int64_t>(end, 0);
  }
  // Query rows [query_begin, query_end) may see key j.
  int64_t query_begin(int64_t b, int64_t j) const {
    return limits_right() ? std::clamp<int64_t>(j - offset(b) - right_limit(), 0, query_length(b)) : 0;
  }
  int64_t query_stop(int64_t b, int64_t j) const {
    const int64_t end = query_length(b);
    return window_left >= 0 ? std::clamp<int64_t>(j - offset(b) + window_left + 1, 0, end) : end;
  }
};

// ----------------------------------------------------------------------------------------- row helpers
// (row_max, exp_shifted_sum, dot and softcap_row, which the KV-cache kernel shares: attention_rows.h)

// dS = Pd * dPd - P * delta (in place over dpd).
FT_INLINE void softmax_grad_row_body(const float* dropped, const float* probs, float* dpd, int64_t n, float delta) {
  for (int64_t i = 0; i < n; ++i) dpd[i] = dropped[i] * dpd[i] - probs[i] * delta;
}
FT_MULTIVERSIONED(void, softmax_grad_row,
                  (const float* dropped, const float* probs, float* dpd, int64_t n, float delta),
                  (dropped, probs, dpd, n, delta))

void softmax_grad_row(const double* dropped, const double* probs, double* dpd, int64_t n, double delta) {
  for (int64_t i = 0; i < n; ++i) dpd[i] = dropped[i] * dpd[i] - probs[i] * delta;
}

// dS *= 1 - tanh^2, the derivative of the softcap.
template <typename scalar_t>
FT_INLINE void softcap_grad_row(scalar_t* ds, const scalar_t* tanh_values, int64_t n) {
  for (int64_t i = 0; i < n; ++i) ds[i] *= scalar_t(1) - tanh_values[i] * tanh_values[i];
}

// -------------------------------------------------------------------------------------------- gemm

template <typename scalar_t>
using BlasGemm = void (*)(const char*, const char*, const int*, const int*, const int*, const scalar_t*,
                          const scalar_t*, const int*, const scalar_t*, const int*, const scalar_t*, scalar_t*,
                          const int*);

template <typename scalar_t>
BlasGemm<scalar_t> blas_gemm();
template <>
inline BlasGemm<float> blas_gemm<float>() { return &sgemm_; }
template <>
inline BlasGemm<double> blas_gemm<double>() { return &dgemm_; }

// C = alpha * op(A) @ op(B) + beta * C on row-major matrices, by loops whose innermost index is contiguous in
// memory. For small products (one decoding query against a few keys) this beats a BLAS call, whose fixed
// cost is larger than the arithmetic.
template <typename scalar_t>
FT_INLINE void gemm_loops_body(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, scalar_t alpha,
                               const scalar_t* a, int64_t lda, const scalar_t* b, int64_t ldb, scalar_t beta,
                               scalar_t* c, int64_t ldc) {
  for (int64_t i = 0; i < m; ++i) {
    scalar_t* c_row = c + i * ldc;
    for (int64_t j = 0; j < n; ++j) c_row[j] = beta == scalar_t(0) ? scalar_t(0) : beta * c_row[j];
  }
  if (transpose_b) {  // C[i, j] += alpha * dot(op(A)[i, :], B[j, :])
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        const scalar_t* b_row = b + j * ldb;
        scalar_t total = 0;
        if (transpose_a)
          for (int64_t l = 0; l < k; ++l) total += a[l * lda + i] * b_row[l];
        else
          total = dot(a + i * lda, b_row, k);
        c[i * ldc + j] += alpha * total;
      }
    return;
  }
  for (int64_t i = 0; i < m; ++i)  // C[i, :] += alpha * op(A)[i, l] * B[l, :]
    for (int64_t l = 0; l < k; ++l) {
      const scalar_t factor = alpha * (transpose_a ? a[l * lda + i] : a[i * lda + l]);
      const scalar_t* b_row = b + l * ldb;
      scalar_t* c_row = c + i * ldc;
      for (int64_t j = 0; j < n; ++j) c_row[j] += factor * b_row[j];
    }
}

// float is compiled for AVX2 + FMA as well (see FT_MULTIVERSIONED): these loops are the whole of a decoding
// step's attention arithmetic.
FT_INLINE void gemm_loops_float_body(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha,
                                     const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                                     int64_t ldc) {
  gemm_loops_body(transpose_a, transpose_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
FT_MULTIVERSIONED(void, gemm_loops_float,
                  (bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                   int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc),
                  (transpose_a, transpose_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc))
void gemm_loops(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  gemm_loops_float(transpose_a, transpose_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void gemm_loops(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, double alpha, const double* a,
                int64_t lda, const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
  gemm_loops_body(transpose_a, transpose_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

// The same through BLAS (column-major: row-major C is column-major C^T = op(B)^T op(A)^T, so the operands
// swap), except for products below kSmallGemm multiply-adds or when torch exports no BLAS. Blocks are small
// (<= 64 x 128 x head_dim), so int sizes suffice.
constexpr int64_t kSmallGemm = 4096;

template <typename scalar_t>
void gemm_row_major(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, scalar_t alpha,
                    const scalar_t* a, int64_t lda, const scalar_t* b, int64_t ldb, scalar_t beta, scalar_t* c,
                    int64_t ldc) {
  if (m == 0 || n == 0) return;
  BlasGemm<scalar_t> gemm = blas_gemm<scalar_t>();
  if (gemm == nullptr || m * n * k < kSmallGemm) {
    gemm_loops(transpose_a, transpose_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  const char op_a = transpose_a ? 'T' : 'N', op_b = transpose_b ? 'T' : 'N';
  const int m_ = static_cast<int>(m), n_ = static_cast<int>(n), k_ = static_cast<int>(k);
  const int lda_ = static_cast<int>(lda), ldb_ = static_cast<int>(ldb), ldc_ = static_cast<int>(ldc);
  gemm(&op_b, &op_a, &n_, &m_, &k_, &alpha, b, &ldb_, a, &lda_, &beta, c, &ldc_);
}

// ------------------------------------------------------------------------------------------ blocks

// A [B, heads, L, D] tensor read through its strides, each row of D values contiguous: q, k and v straight out
// of a fused projection (views with gaps) need no copy, and out / dq / dk / dv are written as [B, L, heads, D]
// so that merging the heads afterwards is a free view.
// Packed variable-length sequences ([T, heads, D]) have no batch stride: sequence b starts at row starts[b].
template <typename T>
struct HeadRows {
  T* data;
  int64_t batch_stride, head_stride, row_stride;
  const int64_t* starts = nullptr;

  T* at(int64_t b, int64_t h, int64_t i) const {
    return data + (starts ? starts[b] * row_stride : b * batch_stride) + h * head_stride + i * row_stride;
  }
};

template <typename T>
HeadRows<T> head_rows(const at::Tensor& t) {
  // A single row (L = 1) may come with any stride, 1 or 0 included (torch calls such a tensor contiguous, so
  // .contiguous() keeps it): only row 0 is read, so any stride works, and D (at least 1) is a leading dimension
  // BLAS accepts.
  const int64_t row_stride = t.size(2) == 1 ? std::max<int64_t>(t.size(3), 1) : t.stride(2);
  return {t.data_ptr<std::remove_const_t<T>>(), t.stride(0), t.stride(1), row_stride};
}

// The softcap and ALiBi on scores[rows, cols] of query rows i0.. and keys j0.. (see compute_scores).
template <typename scalar_t>
void modify_scores(const AttentionProblem<scalar_t>& p, int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t j0,
                   int64_t cols, scalar_t* scores, int64_t ld, scalar_t* tanh_values) {
  for (int64_t r = 0; r < rows; ++r) {
    scalar_t* row = scores + r * ld;
    if (p.softcap > 0) softcap_row(row, cols, p.softcap, tanh_values ? tanh_values + r * ld : nullptr);
    if (p.alibi != nullptr) {
      const scalar_t slope = p.alibi[b * p.alibi_batch_stride + h];
      const int64_t diagonal = i0 + r + p.offset(b) - j0;  // key column c is |diagonal - c| from the query
      for (int64_t c = 0; c < cols; ++c) row[c] -= slope * static_cast<scalar_t>(std::abs(diagonal - c));
    }
  }
}

// scores[rows, cols] (row stride ld) for query rows i0.. of head h of batch b against keys j0.. of
// that head's k. With a softcap, tanh_values (same layout; may be null) gets tanh(s / softcap) for the backward.
template <typename scalar_t>
void compute_scores(const AttentionProblem<scalar_t>& p, const HeadRows<const scalar_t>& q,
                    const HeadRows<const scalar_t>& k, int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t j0,
                    int64_t cols, scalar_t* scores, int64_t ld, scalar_t* tanh_values = nullptr) {
  gemm_row_major<scalar_t>(false, true, rows, cols, p.head_dim, p.scale, q.at(b, h, i0), q.row_stride,
                           k.at(b, h / p.group(), j0), k.row_stride, 0, scores, ld);
  if (p.modifies_scores()) modify_scores(p, b, h, i0, rows, j0, cols, scores, ld, tanh_values);
  const bool* padding = p.key_padding && p.padding_has_holes[b] ? p.key_padding + b * p.k_len + j0 : nullptr;
  const bool limited = p.limits_right() || p.window_left >= 0;
  if (p.bias == nullptr && p.keep == nullptr && !limited && padding == nullptr) return;
  const scalar_t minus_inf = -std::numeric_limits<scalar_t>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    scalar_t* row = scores + r * ld;
    const int64_t i = i0 + r;
    if (p.bias != nullptr) {
      // Added as torch adds it: a NaN score at a -inf key stays NaN (the Triton kernel does the same).
      const scalar_t* bias_row = p.bias + b * p.bias_stride[0] + h * p.bias_stride[1] + i * p.bias_stride[2] + j0;
      for (int64_t c = 0; c < cols; ++c) row[c] += bias_row[c];
    }
    if (p.keep != nullptr) {  // hides the key whatever its score, as padding and the causal mask do
      const bool* keep_row = p.keep + b * p.keep_stride[0] + h * p.keep_stride[1] + i * p.keep_stride[2] + j0;
      for (int64_t c = 0; c < cols; ++c)
        if (!keep_row[c]) row[c] = minus_inf;
    }
    if (padding != nullptr)
      for (int64_t c = 0; c < cols; ++c)
        if (padding[c]) row[c] = minus_inf;
    if (limited) {  // the causal mask and the window
      const int64_t begin = std::clamp<int64_t>(p.key_begin(b, i) - j0, 0, cols);
      const int64_t end = std::clamp<int64_t>(p.key_end(b, i) - j0, begin, cols);
      std::fill(row, row + begin, minus_inf);
      std::fill(row + end, row + cols, minus_inf);
    }
  }
}

// Multiplies probs[rows, cols] by the dropout factors of rows i0.. and keys j0.. of head (b, h) into dropped.
template <typename scalar_t>
void apply_dropout(const AttentionProblem<scalar_t>& p, int64_t bh, int64_t i0, int64_t rows, int64_t j0,
                   int64_t cols, const scalar_t* probs, scalar_t* dropped, int64_t ld) {
  const scalar_t keep_scale = static_cast<scalar_t>(p.dropout.keep_scale());
  for (int64_t r = 0; r < rows; ++r) {
    const uint64_t base = static_cast<uint64_t>((bh * p.q_len + i0 + r) * p.k_len + j0);
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t at = r * ld + c;
      dropped[at] = p.dropout.keep(base + c) ? probs[at] * keep_scale : scalar_t(0);
    }
  }
}

// ------------------------------------------------------------------------------------------ kernels

struct ForwardTiles {
  int64_t rows, cols;
  int64_t diagonal_cols;  // under a causal mask: key tiles that reach past a tile's first row's last visible key
};

// Forward tiles: up to 256 query rows x 512 keys from 128 queries on, which spreads BLAS's packing of each key and
// value block over more work (5-7% faster at L 256-2048 than 64 x 128, measured against SDPA in one run), while
// every thread still gets four tiles; a decoding step's few rows keep small tiles (no larger buffer to zero-fill).
// Under a causal mask the part of a tile above the diagonal is computed for nothing: 64 query rows, 512 keys
// where every row of the tile sees them all, and 128-key tiles across the diagonal.
template <typename scalar_t>
ForwardTiles forward_tiles(const AttentionProblem<scalar_t>& p, int64_t threads) {
  constexpr int64_t kLargeRows = 256, kLargeCols = 512;
  const int64_t rows = p.limits_right() || p.window_left >= 0 ? kQueryBlock : kLargeRows;
  const int64_t tasks = p.batch * p.heads * ((p.q_len + rows - 1) / rows);
  if (p.q_len < 128 || tasks < 4 * threads) return {kQueryBlock, kKeyBlock, kKeyBlock};
  return {std::min(rows, p.q_len), std::min(kLargeCols, std::max<int64_t>(p.k_len, 1)), kKeyBlock};
}

// out = acc / sum and lse = max + log(sum) of a forward task's rows [0, tile_rows) (query rows i0..), with the
// attention sink; rows from `rows` on, and query padding, get 0 and -inf.
template <typename scalar_t>
void finish_rows(const AttentionProblem<scalar_t>& p, const HeadRows<scalar_t>& out, const HeadRows<scalar_t>& lse,
                 int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t tile_rows, const scalar_t* acc,
                 const scalar_t* row_max, const scalar_t* row_sum) {
  const int64_t d = p.head_dim;
  const scalar_t minus_inf = -std::numeric_limits<scalar_t>::infinity();
  for (int64_t r = 0; r < tile_rows; ++r) {
    scalar_t* out_row = out.at(b, h, i0 + r);
    const bool padding = r >= rows || (p.query_padding && p.query_padding[b * p.q_len + i0 + r]);
    scalar_t sum = padding ? scalar_t(0) : row_sum[r], max = padding ? minus_inf : row_max[r], acc_scale = 1;
    if (p.sinks != nullptr && !padding && !std::isnan(sum)) {  // a key with no value, rescaled to max(m, sink)
      const scalar_t sink = p.sinks[h], new_max = std::max(max, sink);
      if (new_max != minus_inf) {
        acc_scale = max == minus_inf ? scalar_t(0) : std::exp(max - new_max);
        sum = sum * acc_scale + std::exp(sink - new_max);
        max = new_max;
      }
    }
    const bool has_key = !padding && sum != 0;  // true for NaN, which then fills the row
    const scalar_t inverse = has_key ? acc_scale / sum : scalar_t(0);
    for (int64_t c = 0; c < d; ++c) out_row[c] = has_key ? acc[r * d + c] * inverse : scalar_t(0);
    *lse.at(b, h, i0 + r) = has_key ? max + std::log(sum) : minus_inf;
  }
}

// The scores of query rows i0 .. i0 + rows (< kTiledRows) of head (b, h) against keys [key_start, key_stop) as the
// tiled kernels take them; key_limits (2 * kTiledRows) and alibi_rows (kTiledRows) hold what the rows need.
TiledForward tiled_scores(const AttentionProblem<float>& p, const HeadRows<const float>& q,
                          const HeadRows<const float>& k, const HeadRows<const float>& v, int64_t b, int64_t h,
                          int64_t i0, int64_t rows, int64_t key_start, int64_t key_stop, int64_t seen_by_all_begin,
                          int64_t seen_by_all_end, int32_t* key_limits, float* alibi_rows) {
  TiledForward t{q.at(b, h, i0), q.row_stride, k.at(b, h / p.group(), 0), v.at(b, h / p.group(), 0),
                 k.row_stride, v.row_stride, rows, p.head_dim, key_start, key_stop, p.scale, p.softcap};
  if (p.alibi != nullptr) {
    for (int64_t r = 0; r < kTiledRows; ++r) alibi_rows[r] = static_cast<float>(i0 + r + p.offset(b));
    t.alibi_rows = alibi_rows;
    t.alibi_slope = p.alibi[b * p.alibi_batch_stride + h];
  }
  t.limited = p.limits_right() || p.window_left >= 0;
  if (t.limited) {
    for (int64_t r = 0; r < kTiledRows; ++r) {
      key_limits[r] = r < rows ? static_cast<int32_t>(p.key_begin(b, i0 + r)) : 0;
      key_limits[kTiledRows + r] = r < rows ? static_cast<int32_t>(p.key_end(b, i0 + r)) : 0;
    }
    t.key_begin = key_limits;
    t.key_end = key_limits + kTiledRows;
    t.all_begin = seen_by_all_begin;
    t.all_end = seen_by_all_end;
  }
  return t;
}

// The register-tiled forward (attention_forward_tiles.h) where it serves the problem: float32 on a CPU with AVX2 or
// AVX-512, scores modified by the softcap and ALiBi and masked only by the causal mask, the window and padding after a
// sequence's last real key.
template <typename scalar_t>
void (*tiled_forward_for(const AttentionProblem<scalar_t>& p))(const TiledForward&) {
  if constexpr (!std::is_same_v<scalar_t, float>) {
    return nullptr;
  } else {
    if (p.bias != nullptr || p.keep != nullptr || p.dropout.enabled()) return nullptr;
    // A task computes all kTiledRows rows whatever the queries: below that many, the row loop wins (B 32, H 8, 16
    // keys, D 32: 73 us against 665 us at 1 query, 542 against 692 at 32; at 64 they are even).
    if (p.q_len < kTiledRows) return nullptr;
    // Causal (or a right window) below 512 keys: the tiles compute whole 64-row diagonal blocks, where the row loop
    // narrows them; it took 0.72-0.92x the tiles' time at 64-384 keys (B 1-8, H 1-8, D 64), about even at 512, and
    // 1.08-1.12x at 1024. Without the causal mask the tiles win at every length (the row loop 1.08-1.28x their time).
    if (p.limits_right() && p.k_len < kTiledCausalKeys) return nullptr;
    return tiled_forward();
  }
}

// The register-tiled backward (attention_backward_tiles.h) where it serves the problem: what the tiled forward serves,
// less the softcap and head dims that are not a multiple of the vector width.
template <typename scalar_t>
void (*tiled_backward_for(const AttentionProblem<scalar_t>& p))(const TiledBackward&) {
  if constexpr (!std::is_same_v<scalar_t, float>) {
    return nullptr;
  } else {
    if (p.bias != nullptr || p.keep != nullptr || p.dropout.enabled() || p.softcap > 0) return nullptr;
    const auto [kernel, lanes] = tiled_backward();
    return kernel != nullptr && p.head_dim % lanes == 0 ? kernel : nullptr;
  }
}

template <typename scalar_t>
void attention_forward_kernel(const AttentionProblem<scalar_t>& p, const HeadRows<const scalar_t>& q,
                              const HeadRows<const scalar_t>& k, const HeadRows<const scalar_t>& v,
                              const HeadRows<scalar_t>& out, const HeadRows<scalar_t>& lse) {
  const int64_t d = p.head_dim, q_len = p.q_len;
  const auto tiled = tiled_forward_for(p);
  const ForwardTiles tiles =
      tiled ? ForwardTiles{kTiledRows, kKeyBlock, kKeyBlock} : forward_tiles(p, at::get_num_threads());
  const int64_t q_tile = tiles.rows, k_tile = tiles.cols;
  const int64_t q_blocks = (q_len + q_tile - 1) / q_tile;
  const scalar_t minus_inf = -std::numeric_limits<scalar_t>::infinity();
  at::parallel_for(0, p.batch * p.heads * q_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> scores(q_tile * k_tile, 0), dropped, acc(q_tile * d);
    std::vector<scalar_t> row_max_(q_tile), row_sum(q_tile);
    std::vector<float> workspace(tiled ? tiled_workspace_floats(d) : 0);
    std::vector<int32_t> key_limits(tiled ? 2 * kTiledRows : 0);
    std::vector<float> alibi_rows(tiled ? kTiledRows : 0);
    if (p.dropout.enabled()) dropped.assign(q_tile * k_tile, 0);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / q_blocks, b = bh / p.heads, h = bh % p.heads;
      const int64_t i0 = (task % q_blocks) * q_tile;
      // Rows past a packed sequence do not exist; past the last real query of a padded one they are zeros.
      const int64_t tile_rows = std::clamp<int64_t>((p.packed ? p.query_length(b) : q_len) - i0, 0, q_tile);
      const int64_t rows = std::clamp<int64_t>(p.query_length(b) - i0, 0, tile_rows);

      // The tile's first row sees the earliest keys and its last row the latest: key blocks outside the causal
      // mask and the window are never visited. Keys in [seen_by_all_begin, seen_by_all_end) are visible to every
      // row of the tile as far as those two go.
      const int64_t key_start = rows > 0 ? p.key_begin(b, i0) : 0, key_stop = rows > 0 ? p.key_end(b, i0 + rows - 1) : 0;
      const int64_t seen_by_all_begin = rows > 0 ? p.key_begin(b, i0 + rows - 1) : 0;
      const int64_t seen_by_all_end = p.limits_right() ? p.key_end(b, i0) : key_stop;
      if constexpr (std::is_same_v<scalar_t, float>) {
        if (tiled && !(p.key_padding && p.padding_has_holes[b])) {
          TiledForward t = tiled_scores(p, q, k, v, b, h, i0, rows, key_start, key_stop, seen_by_all_begin,
                                        seen_by_all_end, key_limits.data(), alibi_rows.data());
          t.acc = acc.data();
          t.row_max = row_max_.data();
          t.row_sum = row_sum.data();
          t.workspace = workspace.data();
          if (rows > 0) tiled(t);
          finish_rows(p, out, lse, b, h, i0, rows, tile_rows, acc.data(), row_max_.data(), row_sum.data());
          continue;
        }
      }
      std::fill(row_max_.begin(), row_max_.begin() + rows, minus_inf);
      std::fill(row_sum.begin(), row_sum.begin() + rows, scalar_t(0));
      std::fill(acc.begin(), acc.begin() + rows * d, scalar_t(0));
      for (int64_t j0 = key_start, cols = 0; j0 < key_stop; j0 += cols) {
        const bool seen_by_all = j0 >= seen_by_all_begin && j0 + k_tile <= seen_by_all_end;
        cols = std::min(seen_by_all ? k_tile : tiles.diagonal_cols, key_stop - j0);
        compute_scores(p, q, k, b, h, i0, rows, j0, cols, scores.data(), k_tile);
        for (int64_t r = 0; r < rows; ++r) {
          scalar_t* row = scores.data() + r * k_tile;
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
        const scalar_t* weights = scores.data();
        if (p.dropout.enabled()) {
          apply_dropout(p, bh, i0, rows, j0, cols, scores.data(), dropped.data(), k_tile);
          weights = dropped.data();
        }
        gemm_row_major<scalar_t>(false, false, rows, d, cols, 1, weights, k_tile, v.at(b, h / p.group(), j0),
                                 v.row_stride, 1, acc.data(), d);
      }

      finish_rows(p, out, lse, b, h, i0, rows, tile_rows, acc.data(), row_max_.data(), row_sum.data());
    }
  });
}

// dq, dk, dv must be zero on entry.
// A backward task is one (batch, kv head) and a chunk of its key blocks: it alone writes dk / dv of those keys.
// With fewer heads than threads twice over, the keys are split into chunks so that every thread has work (a single
// task would also run outside any parallel region, where BLAS threads each small block product); each chunk then
// adds its dq into a partial of its own, summed in chunk order afterwards (deterministic for a thread count).
struct BackwardPlan {
  int64_t blocks_per_chunk, chunks;
};

BackwardPlan plan_backward(int64_t batch, int64_t kv_heads, int64_t k_len, int64_t threads) {
  const int64_t key_blocks = (k_len + kKeyBlock - 1) / kKeyBlock, head_tasks = batch * kv_heads;
  const int64_t wanted = 2 * std::max<int64_t>(threads, 1);
  const int64_t blocks_per_chunk = head_tasks >= wanted || key_blocks <= 1
                                       ? std::max<int64_t>(key_blocks, 1)
                                       : std::max<int64_t>(key_blocks * head_tasks / wanted, 1);
  return {blocks_per_chunk, std::max<int64_t>((key_blocks + blocks_per_chunk - 1) / blocks_per_chunk, 1)};
}

template <typename scalar_t>
void attention_backward_kernel(const AttentionProblem<scalar_t>& p, const HeadRows<const scalar_t>& q,
                               const HeadRows<const scalar_t>& k, const HeadRows<const scalar_t>& v,
                               const HeadRows<const scalar_t>& out, const HeadRows<const scalar_t>& dout,
                               const HeadRows<const scalar_t>& lse, const HeadRows<scalar_t>& dq,
                               const HeadRows<scalar_t>& dk,
                               const HeadRows<scalar_t>& dv) {
  const int64_t d = p.head_dim, q_len = p.q_len, group = p.group();
  const scalar_t minus_inf = -std::numeric_limits<scalar_t>::infinity();
  // delta_i = rowsum(dO * O)_i, once per query row.
  std::vector<scalar_t> delta(p.batch * p.heads * q_len);
  at::parallel_for(0, p.batch * p.heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / p.heads, h = bh % p.heads;
      for (int64_t i = 0; i < p.query_length(b); ++i) delta[bh * q_len + i] = dot(dout.at(b, h, i), out.at(b, h, i), d);
    }
  });
  const int64_t head_tasks = p.batch * p.kv_heads;
  const BackwardPlan plan = plan_backward(p.batch, p.kv_heads, p.k_len, at::get_num_threads());
  const int64_t blocks_per_chunk = plan.blocks_per_chunk, chunks = plan.chunks;
  std::vector<scalar_t> dq_partial(chunks > 1 ? head_tasks * chunks * group * q_len * d : 0, scalar_t(0));
  const auto tiled = tiled_backward_for(p);
  at::parallel_for(0, head_tasks * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> workspace(tiled ? tiled_backward_workspace_floats(d) : 0), alibi_rows(tiled ? kTiledRows : 0);
    std::vector<int32_t> key_limits(tiled ? 2 * kTiledRows : 0);
    std::vector<scalar_t> probs(kQueryBlock * kKeyBlock, 0), dprobs(kQueryBlock * kKeyBlock, 0), dropped, tanh_values;
    if (p.dropout.enabled()) dropped.assign(kQueryBlock * kKeyBlock, 0);
    if (p.softcap > 0) tanh_values.assign(kQueryBlock * kKeyBlock, 0);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t head_task = task / chunks, chunk = task % chunks;
      const int64_t b = head_task / p.kv_heads, kv_head = head_task % p.kv_heads, first_h = kv_head * group;
      const int64_t key_len = p.key_length(b);
      const int64_t chunk_end = std::min(key_len, (chunk + 1) * blocks_per_chunk * kKeyBlock);
      scalar_t* partial = chunks > 1 ? dq_partial.data() + task * group * q_len * d : nullptr;
      if constexpr (std::is_same_v<scalar_t, float>) {
        if (tiled && !(p.key_padding && p.padding_has_holes[b])) {
          // Per query head and block of 64 rows, every key of the chunk those rows can see.
          const int64_t chunk_begin = chunk * blocks_per_chunk * kKeyBlock;
          if (chunk_begin >= chunk_end) continue;
          const int64_t query_start = p.query_begin(b, chunk_begin), query_stop = p.query_stop(b, chunk_end - 1);
          for (int64_t g = 0; g < group; ++g) {
            const int64_t h = first_h + g, bh = b * p.heads + h;
            for (int64_t i0 = query_start; i0 < query_stop; i0 += kTiledRows) {
              const int64_t rows = std::min(kTiledRows, query_stop - i0);
              const int64_t key_start = std::max(chunk_begin, p.key_begin(b, i0));
              const int64_t key_stop = std::min(chunk_end, p.key_end(b, i0 + rows - 1));
              if (key_start >= key_stop) continue;
              const int64_t seen_by_all_end = p.limits_right() ? p.key_end(b, i0) : key_stop;
              TiledBackward t{q.at(b, h, i0), dout.at(b, h, i0), q.row_stride, dout.row_stride, lse.at(b, h, i0),
                              delta.data() + bh * q_len + i0,
                              partial ? partial + (g * q_len + i0) * d : dq.at(b, h, i0),
                              partial ? d : dq.row_stride, dk.at(b, kv_head, 0), dv.at(b, kv_head, 0),
                              dk.row_stride, dv.row_stride,
                              tiled_scores(p, q, k, v, b, h, i0, rows, key_start, key_stop,
                                           p.key_begin(b, i0 + rows - 1), seen_by_all_end, key_limits.data(),
                                           alibi_rows.data()),
                              workspace.data()};
              tiled(t);
            }
          }
          continue;
        }
      }
      for (int64_t j0 = chunk * blocks_per_chunk * kKeyBlock; j0 < chunk_end; j0 += kKeyBlock) {
        const int64_t cols = std::min(kKeyBlock, chunk_end - j0);
        const scalar_t* k_block = k.at(b, kv_head, j0);
        const scalar_t* v_block = v.at(b, kv_head, j0);
        scalar_t* dk_block = dk.at(b, kv_head, j0);
        scalar_t* dv_block = dv.at(b, kv_head, j0);
        // Under the causal mask and the window, only queries [query_start, query_stop) see any of these keys.
        const int64_t query_start = p.query_begin(b, j0), query_stop = p.query_stop(b, j0 + cols - 1);
        for (int64_t g = 0; g < group; ++g) {
          const int64_t h = first_h + g, bh = b * p.heads + h;
          for (int64_t i0 = query_start; i0 < query_stop; i0 += kQueryBlock) {
            const int64_t rows = std::min(kQueryBlock, query_stop - i0);
            compute_scores(p, q, k, b, h, i0, rows, j0, cols, probs.data(), kKeyBlock,
                           p.softcap > 0 ? tanh_values.data() : nullptr);
            for (int64_t r = 0; r < rows; ++r) {
              scalar_t* row = probs.data() + r * kKeyBlock;
              const scalar_t row_lse = *lse.at(b, h, i0 + r);
              if (row_lse == minus_inf)
                std::fill(row, row + cols, scalar_t(0));
              else if (std::isnan(row_lse))  // the forward's NaN row: NaN probabilities, as torch's softmax
                std::fill(row, row + cols, row_lse);
              else
                exp_shifted_sum(row, cols, row_lse);
            }
            const scalar_t* weights = probs.data();
            if (p.dropout.enabled()) {
              apply_dropout(p, bh, i0, rows, j0, cols, probs.data(), dropped.data(), kKeyBlock);
              weights = dropped.data();
            }
            const scalar_t* q_block = q.at(b, h, i0);
            const scalar_t* dout_block = dout.at(b, h, i0);
            gemm_row_major<scalar_t>(true, false, cols, d, rows, 1, weights, kKeyBlock, dout_block, dout.row_stride,
                                     1, dv_block, dv.row_stride);
            gemm_row_major<scalar_t>(false, true, rows, cols, d, 1, dout_block, dout.row_stride, v_block,
                                     v.row_stride, 0, dprobs.data(), kKeyBlock);
            for (int64_t r = 0; r < rows; ++r) {
              const int64_t at = r * kKeyBlock;
              softmax_grad_row(weights + at, probs.data() + at, dprobs.data() + at, cols, delta[bh * q_len + i0 + r]);
              if (p.softcap > 0) softcap_grad_row(dprobs.data() + at, tanh_values.data() + at, cols);
            }
            scalar_t* dq_rows = partial ? partial + (g * q_len + i0) * d : dq.at(b, h, i0);
            gemm_row_major<scalar_t>(false, false, rows, d, cols, p.scale, dprobs.data(), kKeyBlock, k_block,
                                     k.row_stride, 1, dq_rows, partial ? std::max<int64_t>(d, 1) : dq.row_stride);
            gemm_row_major<scalar_t>(true, false, cols, d, rows, p.scale, dprobs.data(), kKeyBlock, q_block,
                                     q.row_stride, 1, dk_block, dk.row_stride);
          }
        }
      }
    }
  });
  if (chunks == 1) return;
  at::parallel_for(0, p.batch * p.heads * q_len, 256, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t bh = row / q_len, i = row % q_len, b = bh / p.heads, h = bh % p.heads;
      if (i >= p.query_length(b)) continue;
      const int64_t head_task = b * p.kv_heads + h / group, g = h % group;
      scalar_t* dq_row = dq.at(b, h, i);
      for (int64_t chunk = 0; chunk < chunks; ++chunk) {
        const scalar_t* part = dq_partial.data() + ((head_task * chunks + chunk) * group + g) * q_len * d + i * d;
        for (int64_t c = 0; c < d; ++c) dq_row[c] += part[c];
      }
    }
  });
}

// ----------------------------------------------------------------------------------------------- ops

// t [B, heads, L, D] in dtype, copied only if its rows are not contiguous and apart (BLAS needs a row stride of at
// least D: a sequence dim broadcast with stride 0 does not qualify); HeadRows reads the other dims through
// their strides.
at::Tensor with_contiguous_rows(const at::Tensor& t, at::ScalarType dtype) {
  at::Tensor converted = t.to(dtype);
  // Rows BLAS can read in place: D contiguous values each (any stride when D = 1), rows apart (overlapping or
  // broadcast rows are copied; a single row is fine, see head_rows) and a row stride that fits BLAS's int.
  const bool unit_elements = converted.stride(3) == 1 || converted.size(3) <= 1;
  const bool rows_apart = converted.size(2) <= 1 || (converted.stride(2) >= converted.size(3) &&
                                                     converted.stride(2) <= std::numeric_limits<int>::max());
  if (unit_elements && rows_apart) return converted;
  return converted.clone(at::MemoryFormat::Contiguous);  // .contiguous() keeps tensors torch calls contiguous
}

// A zeroed or uninitialised [B, heads, L, D] tensor laid out as [B, L, heads, D] (see HeadRows).
at::Tensor new_head_rows(const at::Tensor& like, bool zeroed) {
  const std::vector<int64_t> sizes = {like.size(0), like.size(2), like.size(1), like.size(3)};
  return (zeroed ? at::zeros(sizes, like.options()) : at::empty(sizes, like.options())).transpose(1, 2);
}

// Shapes, the mask (a float bias in the accumulate dtype, or a bool keep-mask) broadcast to [B, H, Lq, Lk], the
// key padding with where each sequence's keys end and whether padding interrupts them, the query padding with
// where each sequence's queries end, and per-sequence alignment offsets, checked once. Packed (varlen) inputs
// [T, heads, D] are held as [1, heads, T, D] views, with the sequences' starts and lengths.
struct AttentionInputs {
  at::Tensor q, k, v, bias, keep, key_padding, key_ends, padding_has_holes, query_padding, query_ends;
  at::Tensor alignment_offsets, q_starts, k_starts, alibi, sinks;
  int64_t batch = 0, q_len = 0, k_len = 0;
};

// mask broadcast to [batch, heads, q_len, k_len]; the kernel reads mask rows with unit stride, so the key dim
// is materialised if it is broadcast or strided.
at::Tensor broadcast_mask(at::Tensor mask, int64_t batch, int64_t heads, int64_t q_len, int64_t k_len) {
  TORCH_CHECK_VALUE(mask.dim() <= 4, "attention: the mask must broadcast to [B, H, Lq, Lk], got ", mask.sizes());
  if (mask.dim() == 0) mask = mask.reshape({1});
  if (mask.size(-1) != k_len || mask.stride(-1) != 1) {
    std::vector<int64_t> sizes(mask.sizes().begin(), mask.sizes().end());
    sizes.back() = k_len;
    mask = mask.expand(sizes).contiguous();
  }
  return mask.expand({batch, heads, q_len, k_len});
}

const at::TensorOptions kLongOptions = at::TensorOptions().dtype(at::kLong);

// [B] int64: one past the last position of each row of padding [B, L] (true = padding) that is not padding;
// with holes [B] set where padding comes before that end.
at::Tensor padding_ends(const at::Tensor& padding, at::Tensor* holes) {
  const int64_t batch = padding.size(0), length = padding.size(1);
  at::Tensor ends = at::empty({batch}, kLongOptions);
  if (holes) *holes = at::empty({batch}, at::TensorOptions().dtype(at::kBool));
  const bool* data = padding.data_ptr<bool>();
  for (int64_t b = 0; b < batch; ++b) {
    const bool* row = data + b * length;
    int64_t end = length;
    while (end > 0 && row[end - 1]) --end;
    ends.data_ptr<int64_t>()[b] = end;
    if (holes) holes->data_ptr<bool>()[b] = std::find(row, row + end, true) != row + end;
  }
  return ends;
}

// [B] int64: key_ends[b] (k_len when undefined) - query_ends[b], the per-sequence bottom-right alignment.
at::Tensor key_end_minus_query_end(const at::Tensor& key_ends, const at::Tensor& query_ends, int64_t k_len) {
  const int64_t batch = query_ends.size(0);
  at::Tensor offsets = at::empty({batch}, kLongOptions);
  for (int64_t b = 0; b < batch; ++b)
    offsets.data_ptr<int64_t>()[b] =
        (key_ends.defined() ? key_ends.data_ptr<int64_t>()[b] : k_len) - query_ends.data_ptr<int64_t>()[b];
  return offsets;
}

at::Tensor check_padding(const at::Tensor& padding, const char* name, int64_t batch, int64_t length) {
  check_cpu(padding, name);
  TORCH_CHECK_VALUE(padding.scalar_type() == at::kBool && padding.dim() == 2 && padding.size(0) == batch &&
                        padding.size(1) == length,
                    "attention: ", name, " must be bool [", batch, ", ", length, "], got ", padding.scalar_type(), " ",
                    padding.sizes());
  return padding.contiguous();
}

AttentionInputs prepare_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& key_padding,
                               const std::optional<at::Tensor>& query_padding, bool per_sequence_alignment) {
  check_cpu(q, "q");
  check_cpu(k, "k");
  check_cpu(v, "v");
  TORCH_CHECK_VALUE(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes(),
                    "attention: q must be [B, H, Lq, D] and k, v [B, Hkv, Lk, D], got ", q.sizes(), ", ", k.sizes(),
                    ", ", v.sizes());
  TORCH_CHECK_VALUE(k.size(0) == q.size(0) && k.size(3) == q.size(3) && k.size(1) > 0 && q.size(1) % k.size(1) == 0,
                    "attention: k ", k.sizes(), " does not match q ", q.sizes());
  AttentionInputs inputs;
  const at::ScalarType dtype = accumulate_dtype(q.scalar_type());
  inputs.q = with_contiguous_rows(q, dtype);
  inputs.k = with_contiguous_rows(k, dtype);
  inputs.v = with_contiguous_rows(v, dtype);
  const int64_t batch = q.size(0), heads = q.size(1), q_len = q.size(2), k_len = k.size(2);
  inputs.batch = batch;
  inputs.q_len = q_len;
  inputs.k_len = k_len;
  if (bias.has_value()) {
    check_cpu(*bias, "bias");
    if (bias->scalar_type() == at::kBool)
      inputs.keep = broadcast_mask(*bias, batch, heads, q_len, k_len);
    else
      inputs.bias = broadcast_mask(bias->to(inputs.q.scalar_type()), batch, heads, q_len, k_len);
  }
  if (key_padding.has_value()) {
    inputs.key_padding = check_padding(*key_padding, "key_padding", batch, k_len);
    inputs.key_ends = padding_ends(inputs.key_padding, &inputs.padding_has_holes);
  }
  if (query_padding.has_value()) {
    inputs.query_padding = check_padding(*query_padding, "query_padding", batch, q_len);
    inputs.query_ends = padding_ends(inputs.query_padding, nullptr);
    if (per_sequence_alignment)  // the last real query sees the last real key
      inputs.alignment_offsets = key_end_minus_query_end(inputs.key_ends, inputs.query_ends, k_len);
  }
  return inputs;
}

// [T, heads, D] -> [1, heads, T, D] in the accumulate dtype, rows as BLAS reads them.
at::Tensor packed_head_rows(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  check_cpu(t, name);
  TORCH_CHECK_VALUE(t.dim() == 3, "attention_varlen: ", name, " must be [T, heads, D], got ", t.sizes());
  return with_contiguous_rows(t.permute({1, 0, 2}).unsqueeze(0), dtype);
}

AttentionInputs prepare_varlen_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_q,
                                      int64_t max_k, bool bottom_right) {
  TORCH_CHECK_VALUE(v.sizes() == k.sizes() && q.dim() == 3 && k.dim() == 3 && k.size(2) == q.size(2) &&
                        k.size(1) > 0 && q.size(1) % k.size(1) == 0,
                    "attention_varlen: q must be [Tq, H, D] and k, v [Tk, Hkv, D], got ", q.sizes(), ", ", k.sizes(),
                    ", ", v.sizes());
  AttentionInputs inputs;
  const at::ScalarType dtype = accumulate_dtype(q.scalar_type());
  inputs.q = packed_head_rows(q, "q", dtype);
  inputs.k = packed_head_rows(k, "k", dtype);
  inputs.v = packed_head_rows(v, "v", dtype);
  check_cpu(cu_seqlens_q, "cu_seqlens_q");
  check_cpu(cu_seqlens_k, "cu_seqlens_k");
  TORCH_CHECK_VALUE(cu_seqlens_q.dim() == 1 && cu_seqlens_q.sizes() == cu_seqlens_k.sizes() && cu_seqlens_q.size(0) >= 1,
                    "attention_varlen: cu_seqlens_q and cu_seqlens_k must be [B + 1], got ", cu_seqlens_q.sizes(),
                    " and ", cu_seqlens_k.sizes());
  const int64_t batch = cu_seqlens_q.size(0) - 1;
  inputs.batch = batch;
  inputs.q_len = max_q;
  inputs.k_len = max_k;
  inputs.q_starts = cu_seqlens_q.to(at::kLong).contiguous();
  inputs.k_starts = cu_seqlens_k.to(at::kLong).contiguous();
  const int64_t* q_starts = inputs.q_starts.data_ptr<int64_t>();
  const int64_t* k_starts = inputs.k_starts.data_ptr<int64_t>();
  TORCH_CHECK_VALUE(q_starts[0] == 0 && q_starts[batch] == q.size(0) && k_starts[0] == 0 && k_starts[batch] == k.size(0),
                    "attention_varlen: cu_seqlens must run from 0 to the packed lengths ", q.size(0), " and ",
                    k.size(0));
  inputs.query_ends = at::empty({batch}, kLongOptions);
  inputs.key_ends = at::empty({batch}, kLongOptions);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t q_length = q_starts[b + 1] - q_starts[b], k_length = k_starts[b + 1] - k_starts[b];
    TORCH_CHECK_VALUE(0 <= q_length && q_length <= max_q && 0 <= k_length && k_length <= max_k,
                      "attention_varlen: sequence ", b, " has ", q_length, " queries and ", k_length,
                      " keys; cu_seqlens must not decrease and max_seqlen_q / max_seqlen_k (", max_q, ", ", max_k,
                      ") bound every length");
    inputs.query_ends.data_ptr<int64_t>()[b] = q_length;
    inputs.key_ends.data_ptr<int64_t>()[b] = k_length;
  }
  if (bottom_right) inputs.alignment_offsets = key_end_minus_query_end(inputs.key_ends, inputs.query_ends, max_k);
  return inputs;
}

// ALiBi slopes ([H] or [B, H]) and attention sinks ([H]), when given, in the accumulate dtype.
void add_slopes_and_sinks(AttentionInputs& inputs, const std::optional<at::Tensor>& alibi_slopes,
                          const std::optional<at::Tensor>& sinks) {
  const int64_t batch = inputs.batch, heads = inputs.q.size(1);
  const at::ScalarType dtype = inputs.q.scalar_type();
  if (alibi_slopes.has_value()) {
    check_cpu(*alibi_slopes, "alibi_slopes");
    const auto sizes = alibi_slopes->sizes();
    TORCH_CHECK_VALUE((sizes.size() == 1 && sizes[0] == heads) ||
                          (sizes.size() == 2 && sizes[0] == batch && sizes[1] == heads),
                      "attention: alibi_slopes must be [", heads, "] or [", batch, ", ", heads, "], got ", sizes);
    inputs.alibi = alibi_slopes->to(dtype).contiguous();
  }
  if (sinks.has_value()) {
    check_cpu(*sinks, "sinks");
    TORCH_CHECK_VALUE(sinks->dim() == 1 && sinks->size(0) == heads, "attention: sinks must be [", heads, "], got ",
                      sinks->sizes());
    inputs.sinks = sinks->to(dtype).contiguous();
  }
}

// The options every attention op takes after its tensors; softcap 0 for none.
struct AttentionOptions {
  bool is_causal;
  int64_t alignment_offset, window_left, window_right;
  double scale, dropout_p;
  int64_t seed;
  double softcap = 0;
};

double softcap_value(const std::optional<double>& softcap) {
  TORCH_CHECK_VALUE(!softcap.has_value() || (*softcap > 0 && std::isfinite(*softcap)),
                    "attention: softcap must be a finite number > 0, got ", softcap.value_or(0));
  return softcap.value_or(0);
}

template <typename scalar_t>
AttentionProblem<scalar_t> make_problem(const AttentionInputs& inputs, const AttentionOptions& options) {
  AttentionProblem<scalar_t> p;
  p.batch = inputs.batch;
  p.heads = inputs.q.size(1);
  p.q_len = inputs.q_len;
  p.head_dim = inputs.q.size(3);
  p.kv_heads = inputs.k.size(1);
  p.k_len = inputs.k_len;
  if (inputs.bias.defined()) {
    p.bias = inputs.bias.data_ptr<scalar_t>();
    for (int dim = 0; dim < 3; ++dim) p.bias_stride[dim] = inputs.bias.stride(dim);
  }
  if (inputs.keep.defined()) {
    p.keep = inputs.keep.data_ptr<bool>();
    for (int dim = 0; dim < 3; ++dim) p.keep_stride[dim] = inputs.keep.stride(dim);
  }
  if (inputs.key_padding.defined()) {
    p.key_padding = inputs.key_padding.data_ptr<bool>();
    p.padding_has_holes = inputs.padding_has_holes.data_ptr<bool>();
  }
  if (inputs.key_ends.defined()) p.key_ends = inputs.key_ends.data_ptr<int64_t>();
  if (inputs.query_padding.defined()) p.query_padding = inputs.query_padding.data_ptr<bool>();
  if (inputs.query_ends.defined()) p.query_ends = inputs.query_ends.data_ptr<int64_t>();
  if (inputs.alignment_offsets.defined()) p.alignment_offsets = inputs.alignment_offsets.data_ptr<int64_t>();
  p.packed = inputs.q_starts.defined();
  p.causal = options.is_causal;
  p.alignment_offset = options.alignment_offset;
  p.window_left = options.window_left;
  p.window_right = options.window_right;
  p.scale = static_cast<scalar_t>(options.scale);
  p.softcap = static_cast<scalar_t>(options.softcap);
  if (inputs.alibi.defined()) {
    p.alibi = inputs.alibi.data_ptr<scalar_t>();
    p.alibi_batch_stride = inputs.alibi.dim() == 2 ? inputs.alibi.stride(0) : 0;
  }
  if (inputs.sinks.defined()) p.sinks = inputs.sinks.data_ptr<scalar_t>();
  p.dropout = DropoutMask(options.seed, options.dropout_p);
  return p;
}

// t's rows, packed ones reached through the sequences' starts.
template <typename T>
HeadRows<T> rows_of(const at::Tensor& t, const at::Tensor& starts) {
  HeadRows<T> rows = head_rows<T>(t);
  if (starts.defined()) rows.starts = starts.data_ptr<int64_t>();
  return rows;
}

// lse [B, H, Lq] (contiguous), or [H, T] for packed sequences, as rows of one element.
template <typename T>
HeadRows<T> lse_rows(const at::Tensor& lse, const at::Tensor& starts) {
  if (starts.defined()) return {lse.data_ptr<std::remove_const_t<T>>(), 0, lse.stride(0), 1, starts.data_ptr<int64_t>()};
  return {lse.data_ptr<std::remove_const_t<T>>(), lse.stride(0), lse.stride(1), 1};
}

// out [B, H, Lq, D] laid out as [B, Lq, H, D] (packed: [1, H, T, D] viewing [T, H, D]) and lse [B, H, Lq] (packed:
// [H, T]).
std::tuple<at::Tensor, at::Tensor> run_forward(const AttentionInputs& inputs, const AttentionOptions& options) {
  at::Tensor out = new_head_rows(inputs.q, /*zeroed=*/false);
  const auto& q = inputs.q;
  at::Tensor lse = inputs.q_starts.defined() ? at::empty({q.size(1), q.size(2)}, q.options())
                                             : at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "attention_fwd", [&] {
    const auto problem = make_problem<scalar_t>(inputs, options);
    attention_forward_kernel(problem, rows_of<const scalar_t>(inputs.q, inputs.q_starts),
                             rows_of<const scalar_t>(inputs.k, inputs.k_starts),
                             rows_of<const scalar_t>(inputs.v, inputs.k_starts),
                             rows_of<scalar_t>(out, inputs.q_starts), lse_rows<scalar_t>(lse, inputs.q_starts));
  });
  return {out, lse};
}

// dq, dk, dv laid out as out is.
std::tuple<at::Tensor, at::Tensor, at::Tensor> run_backward(const AttentionInputs& inputs,
                                                            const AttentionOptions& options, const at::Tensor& dout,
                                                            const at::Tensor& out, const at::Tensor& lse) {
  const auto dtype = inputs.q.scalar_type();
  const at::Tensor dout_acc = with_contiguous_rows(dout, dtype), out_acc = with_contiguous_rows(out, dtype);
  const at::Tensor lse_acc = lse.to(dtype).contiguous();
  at::Tensor dq = new_head_rows(inputs.q, true), dk = new_head_rows(inputs.k, true), dv = new_head_rows(inputs.v, true);
  AT_DISPATCH_FLOATING_TYPES(dtype, "attention_bwd", [&] {
    const auto problem = make_problem<scalar_t>(inputs, options);
    const at::Tensor& qs = inputs.q_starts;
    const at::Tensor& ks = inputs.k_starts;
    attention_backward_kernel(problem, rows_of<const scalar_t>(inputs.q, qs), rows_of<const scalar_t>(inputs.k, ks),
                              rows_of<const scalar_t>(inputs.v, ks), rows_of<const scalar_t>(out_acc, qs),
                              rows_of<const scalar_t>(dout_acc, qs), lse_rows<const scalar_t>(lse_acc, qs),
                              rows_of<scalar_t>(dq, qs), rows_of<scalar_t>(dk, ks), rows_of<scalar_t>(dv, ks));
  });
  return {dq, dk, dv};
}

// [1, heads, T, D] (laid out [T, heads, D]) -> [T, heads, D].
at::Tensor unpack(const at::Tensor& t, at::ScalarType dtype) { return t.squeeze(0).permute({1, 0, 2}).to(dtype); }

}  // namespace

std::tuple<at::Tensor, at::Tensor> attention_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 const std::optional<at::Tensor>& bias,
                                                 const std::optional<at::Tensor>& key_padding,
                                                 const std::optional<at::Tensor>& query_padding, bool is_causal,
                                                 bool bottom_right, int64_t window_left, int64_t window_right,
                                                 double scale, double dropout_p, const std::optional<at::Tensor>& seed,
                                                 std::optional<double> softcap,
                                                 const std::optional<at::Tensor>& alibi_slopes,
                                                 const std::optional<at::Tensor>& sinks) {
  AttentionInputs inputs = prepare_inputs(q, k, v, bias, key_padding, query_padding, bottom_right);
  add_slopes_and_sinks(inputs, alibi_slopes, sinks);
  const int64_t offset = bottom_right ? k.size(2) - q.size(2) : 0;
  auto [out, lse] = run_forward(inputs, {is_causal, offset, window_left, window_right, scale, dropout_p,
                                         seed_value(seed), softcap_value(softcap)});
  return {out.to(q.scalar_type()), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& key_padding,
    const std::optional<at::Tensor>& query_padding, bool is_causal, bool bottom_right, int64_t window_left,
    int64_t window_right, double scale, double dropout_p, const std::optional<at::Tensor>& seed,
    std::optional<double> softcap, const std::optional<at::Tensor>& alibi_slopes) {
  AttentionInputs inputs = prepare_inputs(q, k, v, bias, key_padding, query_padding, bottom_right);
  add_slopes_and_sinks(inputs, alibi_slopes, std::nullopt);
  TORCH_CHECK_VALUE(dout.sizes() == q.sizes() && out.sizes() == q.sizes(), "attention_bwd: dout ", dout.sizes(),
                    " and out ", out.sizes(), " must have q's shape ", q.sizes());
  TORCH_CHECK_VALUE(lse.dim() == 3 && lse.sizes() == q.sizes().slice(0, 3), "attention_bwd: lse must be [B, H, Lq]");
  const int64_t offset = bottom_right ? k.size(2) - q.size(2) : 0;
  auto [dq, dk, dv] = run_backward(inputs, {is_causal, offset, window_left, window_right, scale, dropout_p,
                                            seed_value(seed), softcap_value(softcap)}, dout, out, lse);
  return {dq.to(q.scalar_type()), dk.to(k.scalar_type()), dv.to(v.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor> attention_varlen_fwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool is_causal, bool bottom_right,
    int64_t window_left, int64_t window_right, double scale, double dropout_p, const std::optional<at::Tensor>& seed,
    std::optional<double> softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& sinks) {
  AttentionInputs inputs =
      prepare_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, bottom_right);
  add_slopes_and_sinks(inputs, alibi_slopes, sinks);
  auto [out, lse] = run_forward(inputs, {is_causal, 0, window_left, window_right, scale, dropout_p, seed_value(seed),
                                         softcap_value(softcap)});
  return {unpack(out, q.scalar_type()), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_varlen_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, bool is_causal, bool bottom_right, int64_t window_left, int64_t window_right, double scale,
    double dropout_p, const std::optional<at::Tensor>& seed, std::optional<double> softcap,
    const std::optional<at::Tensor>& alibi_slopes) {
  AttentionInputs inputs =
      prepare_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, bottom_right);
  add_slopes_and_sinks(inputs, alibi_slopes, std::nullopt);
  TORCH_CHECK_VALUE(dout.sizes() == q.sizes() && out.sizes() == q.sizes(), "attention_varlen_bwd: dout ",
                    dout.sizes(), " and out ", out.sizes(), " must have q's shape ", q.sizes());
  TORCH_CHECK_VALUE(lse.dim() == 2 && lse.size(0) == q.size(1) && lse.size(1) == q.size(0),
                    "attention_varlen_bwd: lse must be [H, Tq]");
  const auto as_head_rows = [](const at::Tensor& t) { return t.permute({1, 0, 2}).unsqueeze(0); };
  auto [dq, dk, dv] = run_backward(inputs, {is_causal, 0, window_left, window_right, scale, dropout_p,
                                            seed_value(seed), softcap_value(softcap)}, as_head_rows(dout),
                                   as_head_rows(out), lse);
  return {unpack(dq, q.scalar_type()), unpack(dk, k.scalar_type()), unpack(dv, v.scalar_type())};
}

// The number of tasks the backward runs in parallel for these sizes (tests check that few heads still split).
int64_t attention_bwd_tasks(int64_t batch, int64_t kv_heads, int64_t k_len, int64_t threads) {
  return batch * kv_heads * plan_backward(batch, kv_heads, k_len, threads).chunks;
}

TORCH_LIBRARY_FRAGMENT(fused_transformer_cpu, m) {
  m.def("attention_bwd_tasks(int batch, int kv_heads, int k_len, int threads) -> int", &attention_bwd_tasks);
}

TORCH_LIBRARY_IMPL(fused_transformer_cpu, CPU, m) {
  m.impl("attention_fwd", &attention_fwd);
  m.impl("attention_bwd", &attention_bwd);
  m.impl("attention_varlen_fwd", &attention_varlen_fwd);
  m.impl("attention_varlen_bwd", &attention_varlen_bwd);
}

}  // namespace fused_transformer_cpu
