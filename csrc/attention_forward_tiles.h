// The forward's two products on register tiles (float32, AVX2 and AVX-512), with the scores held transposed.
//
// A task is up to 64 query rows of one head. Their Q^T * scale is copied once into a [D, 64] panel. Per block of
// keys:
//   S^T[key, row] = sum_c K[key, c] Qt[c, row]      (each block's largest score per row taken as the tiles are stored)
//   P^T = exp(S^T - m),  l = l exp(m_old - m) + sum_key P^T,  acc^T = acc^T exp(m_old - m)
//   acc^T[c, row] += sum_key V[key, c] P^T[key, row]
// Vectors run along the query rows: K's and V's elements are broadcast from where they lie (nothing of them is
// packed, as a BLAS call packs both operands of each product again), and the max, the sums and the rescaling are
// plain vector ops, with no horizontal reduction. A register tile is kRowVectors vectors of rows x 6 keys (first
// product) or 6 head-dim columns (second): 24 accumulators of 16 lanes on AVX-512, 12 of 8 on AVX2.
// The softcap, ALiBi, the causal mask and the window (per-row key limits) apply as the tiles are stored; bias and bool
// masks, padding between real keys and dropout take the BLAS path (attention.cpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "common.h"

namespace fused_transformer_cpu {
namespace {

constexpr int64_t kTiledRows = 64;   // a task's query rows, and the row stride of every panel
constexpr int64_t kTiledKeys = 256;  // keys per block: S^T [256, 64] is 64 KB
constexpr int kTileColumns = 6;      // keys (first product) or head-dim columns (second) per register tile

template <int kLanes>
struct Lanes;
template <>
struct Lanes<8> {
  using F = float __attribute__((vector_size(32)));
};
template <>
struct Lanes<16> {
  using F = float __attribute__((vector_size(64)));
};

template <typename V>
FT_INLINE V load_vec(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <typename V>
FT_INLINE void store_vec(void* p, V v) {
  std::memcpy(p, &v, sizeof(v));
}

// One task: rows [0, rows) of a head, keys [key_start, key_stop). Writes acc (row-major [rows, d], not yet divided
// by the sums), row_max and row_sum (per row, as the BLAS path leaves them).
struct TiledForward {
  const float* q;  // row 0 of the task
  int64_t q_stride;
  const float* k;  // key 0 of the head
  const float* v;
  int64_t k_stride, v_stride;
  int64_t rows, d, key_start, key_stop;
  float scale;
  float softcap = 0;  // > 0: s = softcap * tanh(s / softcap)
  // With ALiBi: s -= alibi_slope * |alibi_rows[r] - key|, alibi_rows[r] being row r's diagonal key.
  const float* alibi_rows = nullptr;
  float alibi_slope = 0;
  // With limited keys: row r sees keys [key_begin[r], key_end[r]); keys [all_begin, all_end) are seen by every row.
  bool limited = false;
  const int32_t* key_begin = nullptr;
  const int32_t* key_end = nullptr;
  int64_t all_begin = 0, all_end = 0;
  float* acc;
  float* row_max;
  float* row_sum;
  float* workspace;  // tiled_workspace_floats(d) floats
};

inline int64_t tiled_workspace_floats(int64_t d) { return (2 * d + kTiledKeys + 2) * kTiledRows + 16; }

// st[key, 0..kRowVectors*N) for keys j .. j + kKeys of K, and the largest of each row so far in block_max.
template <typename F, int kRowVectors, int kKeys>
FT_INLINE void scores_tile(const TiledForward& t, const float* qt, int64_t j, int64_t row0, float* st,
                           F* block_max, bool masked) {
  using I = decltype(F{} < F{});
  constexpr int kN = sizeof(F) / sizeof(float);
  F acc[kKeys][kRowVectors] = {};
  const float* k = t.k + j * t.k_stride;
  for (int64_t c = 0; c < t.d; ++c) {
    F q[kRowVectors];
#pragma GCC unroll 4
    for (int r = 0; r < kRowVectors; ++r) q[r] = load_vec<F>(qt + c * kTiledRows + r * kN);
#pragma GCC unroll 6
    for (int key = 0; key < kKeys; ++key) {
      const float kb = k[key * t.k_stride + c];  // vector * scalar: one broadcast
#pragma GCC unroll 4
      for (int r = 0; r < kRowVectors; ++r) acc[key][r] += q[r] * kb;
    }
  }
  const F minus_inf = F{} - std::numeric_limits<float>::infinity();
#pragma GCC unroll 6
  for (int key = 0; key < kKeys; ++key) {
#pragma GCC unroll 4
    for (int r = 0; r < kRowVectors; ++r) {
      F s = acc[key][r];
      if (t.softcap > 0) s = s != s ? s : fast_tanh(s * (1.0f / t.softcap)) * t.softcap;
      if (t.alibi_rows != nullptr)
        s -= t.alibi_slope * abs(load_vec<F>(t.alibi_rows + row0 + r * kN) - static_cast<float>(j + key));
      if (masked) {
        const I at = I{} + static_cast<int32_t>(j + key);
        const I begin = load_vec<I>(t.key_begin + row0 + r * kN), end = load_vec<I>(t.key_end + row0 + r * kN);
        s = (at < begin) | (at >= end) ? minus_inf : s;
      }
      store_vec(st + key * kTiledRows + r * kN, s);
      block_max[r] = s > block_max[r] ? s : block_max[r];  // a NaN score is left out: the row's sum catches it
    }
  }
}

// out[i, 0 .. kVectors * N) += sum over n of scalars[i * scalar_row + n * scalar_step] vectors[n * vector_step ..],
// for i < kRows: the register tile of every product whose broadcast operand is not K (the forward's P^T V, the
// backward's dQ^T, dV and dK). It sums its own block from zero and adds that to out: a running sum over every
// block would chain more rounding.
template <typename F, int kRows, int kVectors>
FT_INLINE void broadcast_tile(int64_t n, const float* scalars, int64_t scalar_row, int64_t scalar_step,
                              const float* vectors, int64_t vector_step, float* out, int64_t out_row) {
  constexpr int kN = sizeof(F) / sizeof(float);
  F acc[kRows][kVectors] = {};
  for (int64_t k = 0; k < n; ++k) {
    F x[kVectors];
#pragma GCC unroll 4
    for (int v = 0; v < kVectors; ++v) x[v] = load_vec<F>(vectors + k * vector_step + v * kN);
#pragma GCC unroll 6
    for (int i = 0; i < kRows; ++i) {
      const float s = scalars[i * scalar_row + k * scalar_step];  // vector * scalar: one broadcast
#pragma GCC unroll 4
      for (int v = 0; v < kVectors; ++v) acc[i][v] += x[v] * s;
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < kRows; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < kVectors; ++v) {
      float* at = out + i * out_row + v * kN;
      store_vec(at, load_vec<F>(at) + acc[i][v]);
    }
}

// acct[c, rows] += sum over keys of V[key, c] pt[key, rows], for columns c .. c + kColumns.
template <typename F, int kRowVectors, int kColumns>
FT_INLINE void values_tile(const float* pt, int64_t keys, const float* v, int64_t v_stride, float* acct) {
  broadcast_tile<F, kColumns, kRowVectors>(keys, v, 1, v_stride, pt, kTiledRows, acct, kTiledRows);
}

// The register tiles for the last n < kTileColumns keys or columns.
template <typename F, int kRowVectors>
FT_INLINE void scores_tail(int n, const TiledForward& t, const float* qt, int64_t j, int64_t row0, float* st,
                           F* block_max, bool masked) {
  switch (n) {
    case 5: return scores_tile<F, kRowVectors, 5>(t, qt, j, row0, st, block_max, masked);
    case 4: return scores_tile<F, kRowVectors, 4>(t, qt, j, row0, st, block_max, masked);
    case 3: return scores_tile<F, kRowVectors, 3>(t, qt, j, row0, st, block_max, masked);
    case 2: return scores_tile<F, kRowVectors, 2>(t, qt, j, row0, st, block_max, masked);
    default: return scores_tile<F, kRowVectors, 1>(t, qt, j, row0, st, block_max, masked);
  }
}
template <typename F, int kRowVectors>
FT_INLINE void values_tail(int n, const float* pt, int64_t keys, const float* v, int64_t v_stride, float* acct) {
  switch (n) {
    case 5: return values_tile<F, kRowVectors, 5>(pt, keys, v, v_stride, acct);
    case 4: return values_tile<F, kRowVectors, 4>(pt, keys, v, v_stride, acct);
    case 3: return values_tile<F, kRowVectors, 3>(pt, keys, v, v_stride, acct);
    case 2: return values_tile<F, kRowVectors, 2>(pt, keys, v, v_stride, acct);
    default: return values_tile<F, kRowVectors, 1>(pt, keys, v, v_stride, acct);
  }
}

// st[keys, strip] for keys j0 .. j0 + keys of t's k against the panel qt (both at the strip's first row), and each
// row's largest score in block_max (which the caller initialises).
template <typename F, int kRowVectors>
FT_INLINE void scores_strip(const TiledForward& t, const float* qt, int64_t j0, int64_t keys, int64_t row0, float* st,
                            F* block_max, bool masked) {
  int64_t key = 0;
  for (; key + kTileColumns <= keys; key += kTileColumns)
    scores_tile<F, kRowVectors, kTileColumns>(t, qt, j0 + key, row0, st + key * kTiledRows, block_max, masked);
  if (key < keys)
    scores_tail<F, kRowVectors>(static_cast<int>(keys - key), t, qt, j0 + key, row0, st + key * kTiledRows,
                                block_max, masked);
}

// acct[0 .. d, strip] += sum over keys of v[key, c] pt[key, strip] (pt and acct at the strip's first row).
template <typename F, int kRowVectors>
FT_INLINE void values_strip(const float* pt, int64_t keys, const float* v, int64_t v_stride, int64_t d, float* acct) {
  int64_t c = 0;
  for (; c + kTileColumns <= d; c += kTileColumns)
    values_tile<F, kRowVectors, kTileColumns>(pt, keys, v + c, v_stride, acct + c * kTiledRows);
  if (c < d) values_tail<F, kRowVectors>(static_cast<int>(d - c), pt, keys, v + c, v_stride, acct + c * kTiledRows);
}

template <int kLanes, int kRowVectors>
FT_INLINE void tiled_forward_body(const TiledForward& t) {
  using F = typename Lanes<kLanes>::F;
  constexpr int64_t kStrip = kLanes * kRowVectors, kStrips = kTiledRows / kStrip;
  const int64_t d = t.d;
  float* qt = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(t.workspace) + 63) & ~uintptr_t(63));
  float* st = qt + d * kTiledRows;
  float* acct = st + kTiledKeys * kTiledRows;
  float* m = acct + d * kTiledRows;  // per row: the max so far, then the sum
  float* l = m + kTiledRows;
  for (int64_t c = 0; c < d; ++c)
    for (int64_t r = 0; r < kTiledRows; ++r)
      qt[c * kTiledRows + r] = r < t.rows ? t.q[r * t.q_stride + c] * t.scale : 0.0f;
  std::fill(acct, acct + d * kTiledRows, 0.0f);
  std::fill(m, m + kTiledRows, -std::numeric_limits<float>::infinity());
  std::fill(l, l + kTiledRows, 0.0f);
  const F minus_inf = F{} - std::numeric_limits<float>::infinity();

  for (int64_t j0 = t.key_start; j0 < t.key_stop; j0 += kTiledKeys) {
    const int64_t keys = std::min(kTiledKeys, t.key_stop - j0);
    const bool masked = t.limited && !(j0 >= t.all_begin && j0 + keys <= t.all_end);
    for (int64_t strip = 0; strip < kStrips; ++strip) {
      const int64_t row0 = strip * kStrip;
      F block_max[kRowVectors];
      for (int r = 0; r < kRowVectors; ++r) block_max[r] = minus_inf;
      scores_strip<F, kRowVectors>(t, qt + row0, j0, keys, row0, st + row0, block_max, masked);
      // New maxima, the rescaling of what came before, exp and the sums. A row that has seen no key (max -inf)
      // keeps exp(-inf) = 0 everywhere and a sum of 0.
      F shift[kRowVectors], sum[kRowVectors];
      for (int r = 0; r < kRowVectors; ++r) {
        float* m_at = m + row0 + r * kLanes;
        const F old_max = load_vec<F>(m_at), new_max = block_max[r] > old_max ? block_max[r] : old_max;
        const auto unseen = new_max == minus_inf;
        shift[r] = unseen ? F{} : new_max;
        const F rescale = unseen ? F{} + 1.0f : fast_exp(old_max - new_max);
        store_vec(m_at, new_max);
        sum[r] = load_vec<F>(l + row0 + r * kLanes) * rescale;
        for (int64_t c = 0; c < d; ++c) {
          float* at = acct + c * kTiledRows + row0 + r * kLanes;
          store_vec(at, load_vec<F>(at) * rescale);
        }
      }
      for (int64_t k = 0; k < keys; ++k) {
        float* row = st + k * kTiledRows + row0;
#pragma GCC unroll 4
        for (int r = 0; r < kRowVectors; ++r) {
          const F p = fast_exp(load_vec<F>(row + r * kLanes) - shift[r]);
          store_vec(row + r * kLanes, p);
          sum[r] += p;
        }
      }
      for (int r = 0; r < kRowVectors; ++r) store_vec(l + row0 + r * kLanes, sum[r]);
      values_strip<F, kRowVectors>(st + row0, keys, t.v + j0 * t.v_stride, t.v_stride, d, acct + row0);
    }
  }
  for (int64_t r = 0; r < t.rows; ++r) {
    for (int64_t c = 0; c < d; ++c) t.acc[r * d + c] = acct[c * kTiledRows + r];
    t.row_max[r] = m[r];
    t.row_sum[r] = l[r];
  }
}

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma"))) void tiled_forward_avx512(
    const TiledForward& t) {
  tiled_forward_body<16, 4>(t);
}
__attribute__((target("avx2,fma"))) void tiled_forward_avx2(const TiledForward& t) { tiled_forward_body<8, 2>(t); }

// The tiled forward for this CPU, or null where it has neither AVX2 with FMA nor AVX-512 (the BLAS path serves).
inline void (*tiled_forward())(const TiledForward&) {
  switch (cpu_level()) {
    case CpuLevel::kAvx512: return &tiled_forward_avx512;
    case CpuLevel::kAvx2: return &tiled_forward_avx2;
    default: return nullptr;
  }
}
#else
inline void (*tiled_forward())(const TiledForward&) { return nullptr; }
#endif

}  // namespace
}  // namespace fused_transformer_cpu
