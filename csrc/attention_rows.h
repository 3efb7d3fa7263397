// Row helpers of the attention kernels (attention.cpp, attention_kvcache.cpp): the largest score, exp and its sum,
// dot products and the softcap. float versions are multiversioned (FT_MULTIVERSIONED, common.h); double versions
// serve the float64 tests. Internal linkage: each kernel file gets its own copy.
#pragma once

#include <algorithm>

#include "common.h"

namespace fused_transformer_cpu {
namespace {

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
  // always_inline: a lambda left out of line would be one function that every ISA's clone calls across ABIs.
  map8(x, n, -std::numeric_limits<float>::infinity(), [&](Float8 v, int64_t) __attribute__((always_inline)) {
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

// x = cap * tanh(x / cap) in place; tanh_out (may be null) gets tanh(x / cap), the backward's chain factor. NaN
// stays NaN.
// (A lambda through map8 would not be inlined into the AVX2 clone here, and calling it across ISAs breaks.)
FT_INLINE Float8 capped_tanh(Float8 v, float inverse) { return select(v != v, v, fast_tanh(v * inverse)); }
FT_INLINE void softcap_row_body(float* x, int64_t n, float cap, float* tanh_out) {
  const float inverse = 1.0f / cap;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8(x + i, capped_tanh(load8(x + i), inverse));
  if (i < n) {
    float tail[8] = {};
    for (int64_t l = 0; i + l < n; ++l) tail[l] = x[i + l];
    const Float8 t = capped_tanh(load8(tail), inverse);
    for (int64_t l = 0; i + l < n; ++l) x[i + l] = t[l];
  }
  if (tanh_out != nullptr) std::memcpy(tanh_out, x, n * sizeof(float));
  for (i = 0; i < n; ++i) x[i] *= cap;
}
FT_MULTIVERSIONED(void, softcap_row, (float* x, int64_t n, float cap, float* tanh_out), (x, n, cap, tanh_out))

void softcap_row(double* x, int64_t n, double cap, double* tanh_out) {
  for (int64_t i = 0; i < n; ++i) {
    const double t = std::tanh(x[i] / cap);
    if (tanh_out != nullptr) tanh_out[i] = t;
    x[i] = cap * t;
  }
}

}  // namespace
}  // namespace fused_transformer_cpu
