// The backward's five block products on register tiles (float32, AVX2 and AVX-512), scores held transposed as in
// attention_forward_tiles.h.
//
// A block is up to 64 query rows of one head. Its Q^T * scale and dO^T are copied once, and per block of keys:
//   S^T = K Qt,  P^T = exp(S^T - lse),  dP^T = V dOt       (vectors along the query rows, K and V broadcast)
//   dS^T = scale * P^T (dP^T - delta)
//   dV += P^T dO,  dK += dS^T Q                            (vectors along the head dim, P^T and dS^T broadcast)
//   dQ^T += K^T dS^T                                        (vectors along the query rows, K broadcast)
// dK and dV rows are read and written in place (the caller's task alone writes those keys); dQ^T is added into dq
// once, after the block's last keys. Served: what the tiled forward serves, less the softcap (whose backward needs
// the tanh of every score) and a head dim that is not a multiple of the vector width.
#pragma once

#include <utility>

#include "attention_forward_tiles.h"

namespace fused_transformer_cpu {
namespace {

struct TiledBackward {
  const float* q;  // row 0 of the block
  const float* dout;
  int64_t q_stride, dout_stride;
  const float* lse;    // the block's rows, contiguous
  const float* delta;  // rowsum(dO * O), the block's rows, contiguous
  float* dq;           // row 0 of the block: dq += the block's dQ
  int64_t dq_stride;
  float* dk;  // key 0 of the kv head
  float* dv;
  int64_t dk_stride, dv_stride;
  // The scores: k, v, strides, rows, d, the key range, scale, ALiBi and the per-row key limits, as the forward
  // takes them (acc, row_max and row_sum unused).
  TiledForward scores;
  float* workspace;  // tiled_backward_workspace_floats(d) floats
};

inline int64_t tiled_backward_workspace_floats(int64_t d) { return (3 * d + 2 * kTiledKeys + 2) * kTiledRows + 16; }

// out[key, c .. c + kColVectors * N) += sum over rows r of pt[key, r] x[r, c ..], for kKeys keys.
template <typename F, int kKeys, int kColVectors>
FT_INLINE void keys_tile(const float* pt, const float* x, int64_t x_stride, int64_t rows, float* out,
                         int64_t out_stride) {
  broadcast_tile<F, kKeys, kColVectors>(rows, pt, kTiledRows, 1, x, x_stride, out, out_stride);
}

// keys_tile over every head-dim column (d a multiple of the vector width), kKeys keys.
template <typename F, int kColVectors, int kKeys>
FT_INLINE void keys_rows(const float* pt, const float* x, int64_t x_stride, int64_t rows, int64_t d, float* out,
                         int64_t out_stride) {
  constexpr int kN = sizeof(F) / sizeof(float);
  int64_t c = 0;
  for (; c + kColVectors * kN <= d; c += kColVectors * kN)
    keys_tile<F, kKeys, kColVectors>(pt, x + c, x_stride, rows, out + c, out_stride);
  switch ((d - c) / kN) {  // fewer than kColVectors vectors left
    case 0: return;
    case 1: return keys_tile<F, kKeys, 1>(pt, x + c, x_stride, rows, out + c, out_stride);
    case 2: return keys_tile<F, kKeys, (kColVectors > 2 ? 2 : 1)>(pt, x + c, x_stride, rows, out + c, out_stride);
    default: return keys_tile<F, kKeys, (kColVectors > 3 ? 3 : 1)>(pt, x + c, x_stride, rows, out + c, out_stride);
  }
}

// out[keys, :] += pt[keys, rows] x[rows, :].
template <typename F, int kColVectors>
FT_INLINE void keys_product(const float* pt, int64_t keys, const float* x, int64_t x_stride, int64_t rows, int64_t d,
                            float* out, int64_t out_stride) {
  int64_t key = 0;
  for (; key + kTileColumns <= keys; key += kTileColumns)
    keys_rows<F, kColVectors, kTileColumns>(pt + key * kTiledRows, x, x_stride, rows, d, out + key * out_stride,
                                            out_stride);
  const float* p = pt + key * kTiledRows;
  float* o = out + key * out_stride;
  switch (keys - key) {
    case 0: return;
    case 5: return keys_rows<F, kColVectors, 5>(p, x, x_stride, rows, d, o, out_stride);
    case 4: return keys_rows<F, kColVectors, 4>(p, x, x_stride, rows, d, o, out_stride);
    case 3: return keys_rows<F, kColVectors, 3>(p, x, x_stride, rows, d, o, out_stride);
    case 2: return keys_rows<F, kColVectors, 2>(p, x, x_stride, rows, d, o, out_stride);
    default: return keys_rows<F, kColVectors, 1>(p, x, x_stride, rows, d, o, out_stride);
  }
}

template <int kLanes, int kRowVectors, int kColVectors>
FT_INLINE void tiled_backward_body(const TiledBackward& b) {
  using F = typename Lanes<kLanes>::F;
  constexpr int64_t kStrip = kLanes * kRowVectors, kStrips = kTiledRows / kStrip;
  const TiledForward& t = b.scores;
  const int64_t d = t.d, rows = t.rows;
  float* qt = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(b.workspace) + 63) & ~uintptr_t(63));
  float* dot = qt + d * kTiledRows;
  float* dqt = dot + d * kTiledRows;
  float* pt = dqt + d * kTiledRows;
  float* dst = pt + kTiledKeys * kTiledRows;
  float* shift = dst + kTiledKeys * kTiledRows;
  float* delta = shift + kTiledRows;
  for (int64_t c = 0; c < d; ++c)
    for (int64_t r = 0; r < kTiledRows; ++r) {
      qt[c * kTiledRows + r] = r < rows ? b.q[r * b.q_stride + c] * t.scale : 0.0f;
      dot[c * kTiledRows + r] = r < rows ? b.dout[r * b.dout_stride + c] : 0.0f;
    }
  std::fill(dqt, dqt + d * kTiledRows, 0.0f);
  // P = exp(S - lse); a row with no key (lse -inf) and the rows past the block get exp(S - inf) = 0, a NaN lse NaN.
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < kTiledRows; ++r) {
    shift[r] = r < rows && b.lse[r] != -inf ? b.lse[r] : inf;
    delta[r] = r < rows ? b.delta[r] : 0.0f;
  }
  TiledForward values = t;  // dP^T = V dOt: V in K's place, nothing modified or masked
  values.k = t.v;
  values.k_stride = t.v_stride;
  values.softcap = 0;
  values.alibi_rows = nullptr;

  for (int64_t j0 = t.key_start; j0 < t.key_stop; j0 += kTiledKeys) {
    const int64_t keys = std::min(kTiledKeys, t.key_stop - j0);
    const bool masked = t.limited && !(j0 >= t.all_begin && j0 + keys <= t.all_end);
    for (int64_t strip = 0; strip < kStrips; ++strip) {
      const int64_t row0 = strip * kStrip;
      F unused_max[kRowVectors] = {};
      scores_strip<F, kRowVectors>(t, qt + row0, j0, keys, row0, pt + row0, unused_max, masked);
      scores_strip<F, kRowVectors>(values, dot + row0, j0, keys, row0, dst + row0, unused_max, false);
      F row_shift[kRowVectors], row_delta[kRowVectors];
      for (int r = 0; r < kRowVectors; ++r) {
        row_shift[r] = load_vec<F>(shift + row0 + r * kLanes);
        row_delta[r] = load_vec<F>(delta + row0 + r * kLanes);
      }
      for (int64_t key = 0; key < keys; ++key) {
        float* p_row = pt + key * kTiledRows + row0;
        float* ds_row = dst + key * kTiledRows + row0;
#pragma GCC unroll 4
        for (int r = 0; r < kRowVectors; ++r) {
          const F p = fast_exp(load_vec<F>(p_row + r * kLanes) - row_shift[r]);
          store_vec(p_row + r * kLanes, p);
          store_vec(ds_row + r * kLanes, p * (load_vec<F>(ds_row + r * kLanes) - row_delta[r]) * t.scale);
        }
      }
    }
    keys_product<F, kColVectors>(pt, keys, b.dout, b.dout_stride, rows, d, b.dv + j0 * b.dv_stride, b.dv_stride);
    keys_product<F, kColVectors>(dst, keys, b.q, b.q_stride, rows, d, b.dk + j0 * b.dk_stride, b.dk_stride);
    for (int64_t strip = 0; strip < kStrips; ++strip)  // dQ^T: K in V's place
      values_strip<F, kRowVectors>(dst + strip * kStrip, keys, t.k + j0 * t.k_stride, t.k_stride, d,
                                   dqt + strip * kStrip);
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < d; ++c) b.dq[r * b.dq_stride + c] += dqt[c * kTiledRows + r];
}

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma"))) void tiled_backward_avx512(
    const TiledBackward& b) {
  tiled_backward_body<16, 4, 4>(b);
}
__attribute__((target("avx2,fma"))) void tiled_backward_avx2(const TiledBackward& b) {
  tiled_backward_body<8, 2, 2>(b);
}

// The tiled backward for this CPU and its vector width (the head dim must be a multiple of it), or null.
inline std::pair<void (*)(const TiledBackward&), int64_t> tiled_backward() {
  switch (cpu_level()) {
    case CpuLevel::kAvx512: return {&tiled_backward_avx512, 16};
    case CpuLevel::kAvx2: return {&tiled_backward_avx2, 8};
    default: return {nullptr, 0};
  }
}
#else
inline std::pair<void (*)(const TiledBackward&), int64_t> tiled_backward() { return {nullptr, 0}; }
#endif

}  // namespace
}  // namespace fused_transformer_cpu
