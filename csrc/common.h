// Helpers shared by the CPU kernels: the accumulation dtype, the counter-based dropout mask, and vectorisable
// float math (exp, erf, tanh) compiled once per instruction set.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>

namespace fused_transformer_cpu {

// Kernels run in float32 (float64 for float64 inputs); other dtypes are converted at the op boundary.
inline at::ScalarType accumulate_dtype(at::ScalarType dtype) {
  return dtype == at::kDouble ? at::kDouble : at::kFloat;
}

inline void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), "fused_transformer cpu kernels: ", name, " must be a CPU tensor, got ",
                    t.device());
}

inline void check_accumulate_dtype(const at::Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble,
                   "fused_transformer cpu kernels: ", name, " must be float32 or float64 here, got ",
                   t.scalar_type());
}

// Dropout is a pure function of (seed, element index): the backward regenerates the forward's mask and
// dropout_keep_mask() replays it for tests, with no mask stored. splitmix64's finaliser decorrelates
// consecutive indices; its top 24 bits are compared with p.
class DropoutMask {
 public:
  DropoutMask(int64_t seed, double p)
      : seed_(static_cast<uint64_t>(seed)),
        threshold_(static_cast<uint64_t>(p * 16777216.0)),
        keep_scale_(p > 0.0 ? 1.0 / (1.0 - p) : 1.0),
        enabled_(p > 0.0) {}

  bool enabled() const { return enabled_; }
  double keep_scale() const { return keep_scale_; }
  uint64_t seed() const { return seed_; }
  uint64_t threshold() const { return threshold_; }

  bool keep(uint64_t index) const {
    uint64_t z = seed_ + (index + 1) * 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
    return (z >> 40) >= threshold_;
  }

  // The factor an element is multiplied by: 0 if dropped, 1 / (1 - p) if kept.
  template <typename scalar_t>
  scalar_t factor(uint64_t index) const {
    return keep(index) ? static_cast<scalar_t>(keep_scale_) : scalar_t(0);
  }

 private:
  uint64_t seed_;
  uint64_t threshold_;
  double keep_scale_;
  bool enabled_;
};

// The value of an op's seed tensor (one int64 drawn from torch's generator, see backend.draw_dropout_seed), or 0
// when it has none (no dropout). Read here, by the kernel, so the caller never syncs on it.
inline int64_t seed_value(const std::optional<at::Tensor>& seed) {
  if (!seed.has_value()) return 0;
  TORCH_CHECK_VALUE(seed->numel() == 1 && seed->scalar_type() == at::kLong && seed->device().is_cpu(),
                    "the dropout seed must be one int64 on the CPU, got ", seed->scalar_type(), " ", seed->sizes());
  return seed->item<int64_t>();
}

// ------------------------------------------------------------------------------------------ norm.cpp
// LayerNorm, or RMSNorm with rms; registered in ops.cpp, whose schemas give the shapes. norm_fwd returns y, z,
// mean, rstd (mean empty with rms); norm_bwd returns dx, dresidual, dweight, dbias (it reads no mean with
// rms).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> norm_fwd(
    const at::Tensor& x, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& residual, double eps, double dropout_p, const std::optional<at::Tensor>& seed,
    bool store_z, bool rms);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> norm_bwd(
    const at::Tensor& dy, const std::optional<at::Tensor>& dz, const at::Tensor& z,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, const at::Tensor& mean,
    const at::Tensor& rstd, double dropout_p, const std::optional<at::Tensor>& seed, bool has_residual,
    bool rms);
// The name of the op a norm call serves, for its messages (ops.cpp).
const char* norm_op_name(bool rms);

// ------------------------------------------------------------------------------------------ float math
// at::vec's portable (DEFAULT) build computes exp and erf with scalar std:: calls, and building its AVX2
// variant needs per-file ISA flags. Instead the hot loops run on 8-float GCC/Clang vector types (one AVX2
// register, two SSE2 ones) with branch-free polynomials. FT_MULTIVERSIONED compiles a float loop three times, for
// AVX-512 (F, VL, BW, DQ, with FMA), for AVX2 with FMA and for the baseline ISA, and the first call picks one from
// the capability ATen runs its own kernels at (cpu_level: ATEN_CPU_CAPABILITY=avx2 switches both to AVX2), so the
// wheel stays portable. Not target_clones("avx2"): that clone has no FMA (each polynomial step is a multiply and an
// add), and "arch=x86-64-v3" also asks for BMI/LZCNT, which some hypervisors hide from AVX2 + FMA guests.
enum class CpuLevel : int { kBaseline = 0, kAvx2 = 1, kAvx512 = 2 };
CpuLevel cpu_level();  // ops.cpp
const char* cpu_level_name(CpuLevel level);

template <typename Fn>
Fn pick_for_cpu(Fn avx512, Fn avx2, Fn baseline) {
  switch (cpu_level()) {
    case CpuLevel::kAvx512: return avx512;
    case CpuLevel::kAvx2: return avx2;
    default: return baseline;
  }
}

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
#define FT_MULTIVERSIONED(ret, name, params, args)                                                          \
  __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma"))) static ret name##_avx512 params { \
    return name##_body args;                                                                                \
  }                                                                                                         \
  __attribute__((target("avx2,fma"))) static ret name##_avx2 params { return name##_body args; }          \
  static ret name##_baseline params { return name##_body args; }                                            \
  ret name params {                                                                                         \
    static ret(*const chosen) params = pick_for_cpu(&name##_avx512, &name##_avx2, &name##_baseline);        \
    return chosen args;                                                                                     \
  }
#else
#define FT_MULTIVERSIONED(ret, name, params, args) \
  ret name params { return name##_body args; }
#endif

#define FT_INLINE inline __attribute__((always_inline))

using Float8 = float __attribute__((vector_size(32)));
using Int8 = int32_t __attribute__((vector_size(32)));

FT_INLINE Float8 broadcast(float value) { return Float8{} + value; }
// One blend instruction where the ISA has one (and / andnot / or in SSE2).
FT_INLINE Float8 select(Int8 mask, Float8 if_true, Float8 if_false) { return mask ? if_true : if_false; }
// abs, with_sign_of, fast_exp and fast_tanh take any float vector (8 or 16 lanes).
template <typename F>
FT_INLINE F abs(F x) {
  using I = decltype(x < x);
  return reinterpret_cast<F>(reinterpret_cast<I>(x) & 0x7fffffff);
}
// |magnitude| with the sign of sign.
template <typename F>
FT_INLINE F with_sign_of(F magnitude, F sign) {
  using I = decltype(magnitude < sign);
  return reinterpret_cast<F>((reinterpret_cast<I>(magnitude) & 0x7fffffff) |
                             (reinterpret_cast<I>(sign) & static_cast<int32_t>(0x80000000u)));
}
FT_INLINE Float8 load8(const float* p) {
  Float8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
FT_INLINE void store8(float* p, Float8 v) { std::memcpy(p, &v, sizeof(v)); }
FT_INLINE float sum8(Float8 v) {
  float total = 0;
  for (int l = 0; l < 8; ++l) total += v[l];
  return total;
}

// DropoutMask::keep of the eight indices first, ..., first + 7 as lanes (-1 kept, 0 dropped): the same integers,
// eight at a time (one vpmullq per multiply on AVX-512, emulated on AVX2).
using Uint64x8 = uint64_t __attribute__((vector_size(64)));
FT_INLINE Int8 keep8(const DropoutMask& dropout, uint64_t first) {
  const Uint64x8 lane = {1, 2, 3, 4, 5, 6, 7, 8};
  Uint64x8 z = dropout.seed() + (first + lane) * 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  z ^= z >> 31;
  return __builtin_convertvector((z >> 40) >= dropout.threshold(), Int8);
}

// x[0..n) = f(x[0..n)) eight at a time; the tail goes through a padded copy (fill: its unused lanes).
template <typename F>
FT_INLINE void map8(float* x, int64_t n, float fill, F&& f) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8(x + i, f(load8(x + i), i));
  if (i < n) {
    float tail[8];
    for (int l = 0; l < 8; ++l) tail[l] = i + l < n ? x[i + l] : fill;
    const Float8 out = f(load8(tail), i);
    for (int64_t l = 0; i + l < n; ++l) x[i + l] = out[l];
  }
}

// exp(x), ~1 ulp (Cephes expf): x = n ln2 + r, exp(r) by a degree-6 polynomial, 2^n via the exponent bits.
// Below -87.3 (including -inf: masked scores) it is exactly 0; above 88.7, +inf.
template <typename F>
FT_INLINE F fast_exp(F x) {
  using I = decltype(x < x);
  const F low = F{} - 87.3365f, high = F{} + 88.7228f;
  F clamped = x < low ? low : x;
  clamped = clamped > high ? high : clamped;
  // Round to nearest by adding and subtracting 1.5 * 2^23.
  const F n = (clamped * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  F r = clamped - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  F p = F{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const I exponent = __builtin_convertvector(n, I) << 23;
  F result = reinterpret_cast<F>(reinterpret_cast<I>(p) + exponent);
  result = x < low ? F{} : result;
  return x > high ? F{} + std::numeric_limits<float>::infinity() : result;
}

// erf(x) (Abramowitz & Stegun 7.1.26, |error| < 1.5e-7, the formula of at::vec's AVX2 erf).
FT_INLINE Float8 fast_erf(Float8 x) {
  const Float8 ax = abs(x);
  const Float8 t = 1.0f / (1.0f + 0.3275911f * ax);
  Float8 p = broadcast(1.061405429f);
  p = p * t - 1.453152027f;
  p = p * t + 1.421413741f;
  p = p * t - 0.284496736f;
  p = p * t + 0.254829592f;
  return with_sign_of(1.0f - p * t * fast_exp(-ax * ax), x);
}

// tanh(x) = sign(x) (1 - 2 / (exp(2|x|) + 1)); near 0 the series x - x^3/3 + 2x^5/15 - 17x^7/315 avoids the
// cancellation.
template <typename F>
FT_INLINE F fast_tanh(F x) {
  const F ax = abs(x);
  const F large = 1.0f - 2.0f / (fast_exp(2.0f * ax) + 1.0f);
  const F x2 = ax * ax;
  const F small = ax * (1.0f + x2 * (-0.333333333f + x2 * (0.133333333f + x2 * -0.0539682540f)));
  return with_sign_of(ax < 0.0625f ? small : large, x);
}

}  // namespace fused_transformer_cpu
