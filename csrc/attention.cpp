// Flash attention on the CPU: online softmax over key blocks, nothing of [Lq, Lk] kept beyond one block per thread.
//
// Forward, per (batch, head, block of query rows), over the key blocks that block can see:
//   S = Q K^T * scale + bias, -inf where a bool mask is false, above the causal diagonal and at padded
//   keys (keys after a sequence's last real key are never read)
//   m' = max(m, rowmax S),  P = exp(S - m'),  l = l exp(m - m') + rowsum P,  acc = acc exp(m - m') + dropout(P) V
//   out = acc / l,  lse = m + log l   (a row with no visible key: out = 0, lse = -inf; a row with a NaN score:
//   out and lse NaN, as torch's softmax gives)
// Dropout scales probabilities by keep / (1 - p) after the softmax, so l sums the undropped P.
//
// Backward, with P = exp(S - lse) recomputed per block, Pd = dropout(P) and delta_i = rowsum(dO * O)_i:
//   dV += Pd^T dO,  dPd = dO V^T,  dS = Pd * dPd - P * delta,  dQ += dS K scale,  dK += dS^T Q scale
// One task per (batch, kv head) walks every key block and every query head of its group, so dK, dV and dQ
// each have one writer: no atomics, no per-thread copies, and a result that does not depend on threads.
#include <ATen/Parallel.h>

#include <algorithm>
#include <optional>
#include <vector>

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

template <typename scalar_t>
struct AttentionProblem {
  int64_t batch, heads, kv_heads, q_len, k_len, head_dim;
  const scalar_t* bias = nullptr;  // [B, H, Lq, Lk] through bias_stride (0 for broadcast dims), last stride 1
  int64_t bias_stride[3] = {0, 0, 0};
  const bool* keep = nullptr;  // a bool mask instead of bias, true = may attend; strides as bias's
  int64_t keep_stride[3] = {0, 0, 0};
  const bool* key_padding = nullptr;  // [B, Lk], true = padding
  const int64_t* key_ends = nullptr;  // [B]: 1 + the last key that is not padding (0 if none)
  const bool* padding_has_holes = nullptr;  // [B]: some key before key_ends[b] is padding
  bool causal = false;
  int64_t causal_offset = 0;  // query i sees key j <= i + causal_offset
  scalar_t scale = 1;
  DropoutMask dropout{0, 0.0};

  int64_t group() const { return heads / kv_heads; }
  int64_t key_length(int64_t b) const { return key_ends ? key_ends[b] : k_len; }
  // Keys [0, key_end) may be visible to query row i (the mask may still hide some).
  int64_t key_end(int64_t b, int64_t i) const {
    int64_t end = key_length(b);
    if (causal) end = std::min(end, i + causal_offset + 1);
    return std::max<int64_t>(end, 0);
  }
};

// ----------------------------------------------------------------------------------------- row helpers
// float versions are multiversioned (FT_MULTIVERSIONED, common.h); double versions serve the float64 tests.

// The largest of x[0..n), or NaN if one is NaN (comparisons alone would skip it).
FT_INLINE float row_max_body(const float* x, int64_t n) {
  const float minus_inf = -std::numeric_limits<float>::infinity();
  Float8 lanes = broadcast(minus_inf);
  Int8 nan_lanes = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const Float8 v = load8(x + i);
    lanes = select(v > lanes, v, lanes);
    nan_lanes |= v != v;
  }
  float result = minus_inf;
  bool any_nan = false;
  for (; i < n; ++i) {
    result = std::max(result, x[i]);
    any_nan |= std::isnan(x[i]);
  }
  for (int l = 0; l < 8; ++l) {
    result = std::max(result, lanes[l]);
    any_nan |= nan_lanes[l] != 0;
  }
  return any_nan ? std::numeric_limits<float>::quiet_NaN() : result;
}
FT_MULTIVERSIONED(float, row_max, (const float* x, int64_t n), (x, n))

double row_max(const double* x, int64_t n) {
  double result = -std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) return x[i];
    result = std::max(result, x[i]);
  }
  return result;
}

// x = exp(x - shift) in place; returns the sum. shift is finite; -inf entries become 0.
FT_INLINE float exp_shifted_sum_body(float* x, int64_t n, float shift) {
  Float8 total = broadcast(0.0f);
  map8(x, n, -std::numeric_limits<float>::infinity(), [&](Float8 v, int64_t) {
    const Float8 e = fast_exp(v - shift);
    total += e;
    return e;
  });
  return sum8(total);
}
FT_MULTIVERSIONED(float, exp_shifted_sum, (float* x, int64_t n, float shift), (x, n, shift))

double exp_shifted_sum(double* x, int64_t n, double shift) {
  double total = 0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - shift);
    total += x[i];
  }
  return total;
}

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

// Eight independent partial sums, which the compiler vectorises (a single accumulator would be serial).
template <typename scalar_t>
FT_INLINE scalar_t dot(const scalar_t* a, const scalar_t* b, int64_t n) {
  scalar_t lanes[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) lanes[l] += a[i + l] * b[i + l];
  scalar_t total = 0;
  for (; i < n; ++i) total += a[i] * b[i];
  for (int l = 0; l < 8; ++l) total += lanes[l];
  return total;
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
template <typename T>
struct HeadRows {
  T* data;
  int64_t batch_stride, head_stride, row_stride;

  T* at(int64_t b, int64_t h, int64_t i) const { return data + b * batch_stride + h * head_stride + i * row_stride; }
};

template <typename T>
HeadRows<T> head_rows(const at::Tensor& t) {
  // A single row (L = 1) may come with any stride, 1 or 0 included (torch calls such a tensor contiguous, so
  // .contiguous() keeps it): only row 0 is read, so any stride works, and D (at least 1) is a leading dimension
  // BLAS accepts.
  const int64_t row_stride = t.size(2) == 1 ? std::max<int64_t>(t.size(3), 1) : t.stride(2);
  return {t.data_ptr<std::remove_const_t<T>>(), t.stride(0), t.stride(1), row_stride};
}

// scores[rows, cols] (row stride ld) for query rows i0.. of head h of batch b against keys j0.. of
// that head's k.
template <typename scalar_t>
void compute_scores(const AttentionProblem<scalar_t>& p, const HeadRows<const scalar_t>& q,
                    const HeadRows<const scalar_t>& k, int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t j0,
                    int64_t cols, scalar_t* scores, int64_t ld) {
  gemm_row_major<scalar_t>(false, true, rows, cols, p.head_dim, p.scale, q.at(b, h, i0), q.row_stride,
                           k.at(b, h / p.group(), j0), k.row_stride, 0, scores, ld);
  const bool* padding = p.key_padding && p.padding_has_holes[b] ? p.key_padding + b * p.k_len + j0 : nullptr;
  if (p.bias == nullptr && p.keep == nullptr && !p.causal && padding == nullptr) return;
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
    if (p.causal) {
      const int64_t visible = std::clamp<int64_t>(i + p.causal_offset + 1 - j0, 0, cols);
      std::fill(row + visible, row + cols, minus_inf);
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
  const int64_t rows = p.causal ? kQueryBlock : kLargeRows;
  const int64_t tasks = p.batch * p.heads * ((p.q_len + rows - 1) / rows);
  if (p.q_len < 128 || tasks < 4 * threads) return {kQueryBlock, kKeyBlock, kKeyBlock};
  return {std::min(rows, p.q_len), std::min(kLargeCols, std::max<int64_t>(p.k_len, 1)), kKeyBlock};
}

template <typename scalar_t>
void attention_forward_kernel(const AttentionProblem<scalar_t>& p, const HeadRows<const scalar_t>& q,
                              const HeadRows<const scalar_t>& k, const HeadRows<const scalar_t>& v,
                              const HeadRows<scalar_t>& out, scalar_t* lse) {
  const int64_t d = p.head_dim, q_len = p.q_len;
  const ForwardTiles tiles = forward_tiles(p, at::get_num_threads());
  const int64_t q_tile = tiles.rows, k_tile = tiles.cols;
  const int64_t q_blocks = (q_len + q_tile - 1) / q_tile;
  const scalar_t minus_inf = -std::numeric_limits<scalar_t>::infinity();
  at::parallel_for(0, p.batch * p.heads * q_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> scores(q_tile * k_tile, 0), dropped, acc(q_tile * d);
    std::vector<scalar_t> row_max_(q_tile), row_sum(q_tile);
    if (p.dropout.enabled()) dropped.assign(q_tile * k_tile, 0);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / q_blocks, b = bh / p.heads, h = bh % p.heads;
      const int64_t i0 = (task % q_blocks) * q_tile, rows = std::min(q_tile, q_len - i0);
      std::fill(row_max_.begin(), row_max_.begin() + rows, minus_inf);
      std::fill(row_sum.begin(), row_sum.begin() + rows, scalar_t(0));
      std::fill(acc.begin(), acc.begin() + rows * d, scalar_t(0));

      // The last row of the block sees the most keys; blocks wholly above the diagonal are never visited.
      const int64_t key_stop = p.key_end(b, i0 + rows - 1);
      // Keys below this are visible to every row of the tile (causal; the other masks still apply).
      const int64_t seen_by_all = p.causal ? i0 + p.causal_offset + 1 : key_stop;
      for (int64_t j0 = 0, cols = 0; j0 < key_stop; j0 += cols) {
        cols = std::min(j0 + k_tile <= seen_by_all ? k_tile : tiles.diagonal_cols, key_stop - j0);
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

      for (int64_t r = 0; r < rows; ++r) {
        scalar_t* out_row = out.at(b, h, i0 + r);
        const bool has_key = row_sum[r] != 0;  // true for NaN, which then fills the row
        const scalar_t inverse = has_key ? scalar_t(1) / row_sum[r] : scalar_t(0);
        for (int64_t c = 0; c < d; ++c) out_row[c] = acc[r * d + c] * inverse;
        lse[bh * q_len + i0 + r] = has_key ? row_max_[r] + std::log(row_sum[r]) : minus_inf;
      }
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
                               const scalar_t* lse, const HeadRows<scalar_t>& dq, const HeadRows<scalar_t>& dk,
                               const HeadRows<scalar_t>& dv) {
  const int64_t d = p.head_dim, q_len = p.q_len, group = p.group();
  const scalar_t minus_inf = -std::numeric_limits<scalar_t>::infinity();
  // delta_i = rowsum(dO * O)_i, once per query row.
  std::vector<scalar_t> delta(p.batch * p.heads * q_len);
  at::parallel_for(0, p.batch * p.heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh)
      for (int64_t i = 0; i < q_len; ++i)
        delta[bh * q_len + i] = dot(dout.at(bh / p.heads, bh % p.heads, i), out.at(bh / p.heads, bh % p.heads, i), d);
  });
  const int64_t head_tasks = p.batch * p.kv_heads;
  const BackwardPlan plan = plan_backward(p.batch, p.kv_heads, p.k_len, at::get_num_threads());
  const int64_t blocks_per_chunk = plan.blocks_per_chunk, chunks = plan.chunks;
  std::vector<scalar_t> dq_partial(chunks > 1 ? head_tasks * chunks * group * q_len * d : 0, scalar_t(0));
  at::parallel_for(0, head_tasks * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> probs(kQueryBlock * kKeyBlock, 0), dprobs(kQueryBlock * kKeyBlock, 0), dropped;
    if (p.dropout.enabled()) dropped.assign(kQueryBlock * kKeyBlock, 0);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t head_task = task / chunks, chunk = task % chunks;
      const int64_t b = head_task / p.kv_heads, kv_head = head_task % p.kv_heads, first_h = kv_head * group;
      const int64_t key_len = p.key_length(b);
      const int64_t chunk_end = std::min(key_len, (chunk + 1) * blocks_per_chunk * kKeyBlock);
      scalar_t* partial = chunks > 1 ? dq_partial.data() + task * group * q_len * d : nullptr;
      for (int64_t j0 = chunk * blocks_per_chunk * kKeyBlock; j0 < chunk_end; j0 += kKeyBlock) {
        const int64_t cols = std::min(kKeyBlock, chunk_end - j0);
        const scalar_t* k_block = k.at(b, kv_head, j0);
        const scalar_t* v_block = v.at(b, kv_head, j0);
        scalar_t* dk_block = dk.at(b, kv_head, j0);
        scalar_t* dv_block = dv.at(b, kv_head, j0);
        // Under the causal mask, queries before first_query see none of these keys.
        const int64_t first_query = p.causal ? std::clamp<int64_t>(j0 - p.causal_offset, 0, q_len) : 0;
        for (int64_t g = 0; g < group; ++g) {
          const int64_t h = first_h + g, bh = b * p.heads + h;
          for (int64_t i0 = first_query; i0 < q_len; i0 += kQueryBlock) {
            const int64_t rows = std::min(kQueryBlock, q_len - i0);
            compute_scores(p, q, k, b, h, i0, rows, j0, cols, probs.data(), kKeyBlock);
            for (int64_t r = 0; r < rows; ++r) {
              scalar_t* row = probs.data() + r * kKeyBlock;
              const scalar_t row_lse = lse[bh * q_len + i0 + r];
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

// Shapes, the mask (a float bias in the accumulate dtype, or a bool keep-mask) broadcast to [B, H, Lq, Lk], and
// the key padding with where each sequence's keys end and whether padding interrupts them, checked once.
struct AttentionInputs {
  at::Tensor q, k, v, bias, keep, key_padding, key_ends, padding_has_holes;
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

AttentionInputs prepare_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& key_padding) {
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
  if (bias.has_value()) {
    check_cpu(*bias, "bias");
    if (bias->scalar_type() == at::kBool)
      inputs.keep = broadcast_mask(*bias, batch, heads, q_len, k_len);
    else
      inputs.bias = broadcast_mask(bias->to(inputs.q.scalar_type()), batch, heads, q_len, k_len);
  }
  if (key_padding.has_value()) {
    check_cpu(*key_padding, "key_padding");
    TORCH_CHECK_VALUE(key_padding->scalar_type() == at::kBool && key_padding->dim() == 2 &&
                          key_padding->size(0) == batch && key_padding->size(1) == k_len,
                      "attention: key_padding must be bool [B, Lk] = [", batch, ", ", k_len, "], got ",
                      key_padding->scalar_type(), " ", key_padding->sizes());
    inputs.key_padding = key_padding->contiguous();
    inputs.key_ends = at::empty({batch}, at::TensorOptions().dtype(at::kLong));
    inputs.padding_has_holes = at::empty({batch}, at::TensorOptions().dtype(at::kBool));
    const bool* padding = inputs.key_padding.data_ptr<bool>();
    int64_t* ends = inputs.key_ends.data_ptr<int64_t>();
    bool* holes = inputs.padding_has_holes.data_ptr<bool>();
    for (int64_t b = 0; b < batch; ++b) {
      const bool* row = padding + b * k_len;
      int64_t end = k_len;
      while (end > 0 && row[end - 1]) --end;
      ends[b] = end;
      holes[b] = std::find(row, row + end, true) != row + end;
    }
  }
  return inputs;
}

template <typename scalar_t>
AttentionProblem<scalar_t> make_problem(const AttentionInputs& inputs, bool is_causal, int64_t causal_offset,
                                        double scale, double dropout_p, int64_t seed) {
  AttentionProblem<scalar_t> p;
  p.batch = inputs.q.size(0);
  p.heads = inputs.q.size(1);
  p.q_len = inputs.q.size(2);
  p.head_dim = inputs.q.size(3);
  p.kv_heads = inputs.k.size(1);
  p.k_len = inputs.k.size(2);
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
    p.key_ends = inputs.key_ends.data_ptr<int64_t>();
    p.padding_has_holes = inputs.padding_has_holes.data_ptr<bool>();
  }
  p.causal = is_causal;
  p.causal_offset = causal_offset;
  p.scale = static_cast<scalar_t>(scale);
  p.dropout = DropoutMask(seed, dropout_p);
  return p;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> attention_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 const std::optional<at::Tensor>& bias,
                                                 const std::optional<at::Tensor>& key_padding, bool is_causal,
                                                 int64_t causal_offset, double scale, double dropout_p,
                                                 const std::optional<at::Tensor>& seed) {
  const AttentionInputs inputs = prepare_inputs(q, k, v, bias, key_padding);
  at::Tensor out = new_head_rows(inputs.q, /*zeroed=*/false);
  at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, inputs.q.options());
  AT_DISPATCH_FLOATING_TYPES(inputs.q.scalar_type(), "attention_fwd", [&] {
    const auto problem =
        make_problem<scalar_t>(inputs, is_causal, causal_offset, scale, dropout_p, seed_value(seed));
    attention_forward_kernel(problem, head_rows<const scalar_t>(inputs.q), head_rows<const scalar_t>(inputs.k),
                             head_rows<const scalar_t>(inputs.v), head_rows<scalar_t>(out), lse.data_ptr<scalar_t>());
  });
  return {out.to(q.scalar_type()), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& key_padding,
    bool is_causal, int64_t causal_offset, double scale, double dropout_p,
                                                 const std::optional<at::Tensor>& seed) {
  const AttentionInputs inputs = prepare_inputs(q, k, v, bias, key_padding);
  TORCH_CHECK_VALUE(dout.sizes() == q.sizes() && out.sizes() == q.sizes(), "attention_bwd: dout ", dout.sizes(),
                    " and out ", out.sizes(), " must have q's shape ", q.sizes());
  TORCH_CHECK_VALUE(lse.dim() == 3 && lse.sizes() == q.sizes().slice(0, 3), "attention_bwd: lse must be [B, H, Lq]");
  const auto dtype = inputs.q.scalar_type();
  const at::Tensor dout_acc = with_contiguous_rows(dout, dtype), out_acc = with_contiguous_rows(out, dtype);
  const at::Tensor lse_acc = lse.to(dtype).contiguous();
  at::Tensor dq = new_head_rows(inputs.q, true), dk = new_head_rows(inputs.k, true), dv = new_head_rows(inputs.v, true);
  AT_DISPATCH_FLOATING_TYPES(dtype, "attention_bwd", [&] {
    const auto problem =
        make_problem<scalar_t>(inputs, is_causal, causal_offset, scale, dropout_p, seed_value(seed));
    attention_backward_kernel(problem, head_rows<const scalar_t>(inputs.q), head_rows<const scalar_t>(inputs.k),
                              head_rows<const scalar_t>(inputs.v), head_rows<const scalar_t>(out_acc),
                              head_rows<const scalar_t>(dout_acc), lse_acc.data_ptr<scalar_t>(),
                              head_rows<scalar_t>(dq), head_rows<scalar_t>(dk), head_rows<scalar_t>(dv));
  });
  return {dq.to(q.scalar_type()), dk.to(k.scalar_type()), dv.to(v.scalar_type())};
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
}

}  // namespace fused_transformer_cpu
