// The elementwise middle of the feed-forward block, fused after the first matmul (the matmuls stay with ATen):
//   forward:  out = dropout(act(h + bias))            h = x @ w1^T, [rows, F]
//   backward: dpre = dout * dropout_factor * act'(h + bias)
// Nothing but h is kept for the backward: h + bias is recomputed, the dropout mask regenerated from the seed.
//   relu' = [not pre <= 0] (1 at NaN, as torch's threshold_backward);  gelu' = Phi(pre) + pre * phi(pre);
//   gelu_tanh: u = sqrt(2/pi) (pre + 0.044715 pre^3), act = pre (1 + tanh u) / 2,
//              act' = (1 + tanh u) / 2 + pre (1 - tanh^2 u) sqrt(2/pi) (1 + 3 * 0.044715 pre^2) / 2
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <optional>
#include <string_view>
#include <vector>

#include "common.h"

namespace fused_transformer_cpu {

namespace {

enum class Activation { kRelu, kGelu, kGeluTanh };

Activation parse_activation(std::string_view name) {
  if (name == "relu") return Activation::kRelu;
  if (name == "gelu") return Activation::kGelu;
  if (name == "gelu_tanh") return Activation::kGeluTanh;
  TORCH_CHECK_VALUE(false, "bias_activation: activation='", name, "' must be 'relu', 'gelu' or 'gelu_tanh'");
}

constexpr double kSqrtHalf = 0.70710678118654752440;
constexpr double kInvSqrt2Pi = 0.39894228040143267794;
constexpr double kSqrt2OverPi = 0.79788456080286535588;
constexpr double kTanhCoefficient = 0.044715;

// The math per value, on 8 floats (vectorised helpers) or one double (std:: functions, for the float64 tests).
FT_INLINE Float8 erf_of(Float8 x) { return fast_erf(x); }
FT_INLINE double erf_of(double x) { return std::erf(x); }
FT_INLINE Float8 exp_of(Float8 x) { return fast_exp(x); }
FT_INLINE double exp_of(double x) { return std::exp(x); }
FT_INLINE Float8 tanh_of(Float8 x) { return fast_tanh(x); }
FT_INLINE double tanh_of(double x) { return std::tanh(x); }
// value unless x <= 0: relu (value = x) and its gradient (value = grad) as torch computes them, so a NaN x passes
// NaN forward and the gradient backward (max(x, 0) or x > 0 would turn NaN into 0).
FT_INLINE Float8 zero_where_nonpositive(Float8 x, Float8 value) { return select(x <= 0.0f, broadcast(0.0f), value); }
FT_INLINE double zero_where_nonpositive(double x, double value) { return x <= 0.0 ? 0.0 : value; }

// act(x) (forward) or grad * act'(x) (backward), with V = Float8 or double and T its element type.
template <bool kBackward, Activation kActivation, typename V, typename T>
FT_INLINE V activation_value(V x, V grad) {
  if constexpr (kActivation == Activation::kRelu) {
    return zero_where_nonpositive(x, kBackward ? grad : x);
  } else if constexpr (kActivation == Activation::kGelu) {
    const V cdf = T(0.5) * (T(1) + erf_of(x * T(kSqrtHalf)));
    if (kBackward) return grad * (cdf + x * T(kInvSqrt2Pi) * exp_of(T(-0.5) * x * x));
    return x * cdf;
  } else {
    const V x2 = x * x;
    const V t = tanh_of(T(kSqrt2OverPi) * x * (T(1) + T(kTanhCoefficient) * x2));
    if (kBackward)
      return grad * (T(0.5) * (T(1) + t) +
                     T(0.5) * x * (T(1) - t * t) * T(kSqrt2OverPi) * (T(1) + T(3 * kTanhCoefficient) * x2));
    return x * (T(0.5) * (T(1) + t));
  }
}

// Eight values of the row: pre = act(pre) forward, grad = grad * act'(pre) backward. A function, not a lambda: a
// lambda is not inlined into the multiversioned callers (its target differs), and ran as an SSE2 call per 8 values.
template <bool kBackward, Activation kActivation>
FT_INLINE void activation_step(float* pre_at, float* grad_at) {
  const Float8 x = load8(pre_at);
  if (kBackward)
    store8(grad_at, activation_value<true, kActivation, Float8, float>(x, load8(grad_at)));
  else
    store8(pre_at, activation_value<false, kActivation, Float8, float>(x, x));
}

// Forward: pre = act(pre). Backward: grad = grad * act'(pre). Eight floats at a time, the tail padded.
template <bool kBackward, Activation kActivation>
FT_INLINE void activation_row_float(float* pre, float* grad, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) activation_step<kBackward, kActivation>(pre + i, kBackward ? grad + i : nullptr);
  if (i < n) {
    float pre_tail[8] = {0, 0, 0, 0, 0, 0, 0, 0}, grad_tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t l = 0; i + l < n; ++l) {
      pre_tail[l] = pre[i + l];
      if (kBackward) grad_tail[l] = grad[i + l];
    }
    activation_step<kBackward, kActivation>(pre_tail, grad_tail);
    for (int64_t l = 0; i + l < n; ++l) (kBackward ? grad : pre)[i + l] = kBackward ? grad_tail[l] : pre_tail[l];
  }
}

template <bool kBackward>
FT_INLINE void activation_row_float(Activation activation, float* pre, float* grad, int64_t n) {
  switch (activation) {
    case Activation::kRelu: return activation_row_float<kBackward, Activation::kRelu>(pre, grad, n);
    case Activation::kGelu: return activation_row_float<kBackward, Activation::kGelu>(pre, grad, n);
    case Activation::kGeluTanh: return activation_row_float<kBackward, Activation::kGeluTanh>(pre, grad, n);
  }
}

template <bool kBackward>
void activation_row_double(Activation activation, double* pre, double* grad, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const double g = kBackward ? grad[i] : 0.0;
    double result = 0;
    switch (activation) {
      case Activation::kRelu: result = activation_value<kBackward, Activation::kRelu, double, double>(pre[i], g); break;
      case Activation::kGelu: result = activation_value<kBackward, Activation::kGelu, double, double>(pre[i], g); break;
      case Activation::kGeluTanh:
        result = activation_value<kBackward, Activation::kGeluTanh, double, double>(pre[i], g);
        break;
    }
    (kBackward ? grad : pre)[i] = result;
  }
}

FT_INLINE void activation_forward_row_body(Activation activation, float* x, int64_t n) {
  activation_row_float<false>(activation, x, nullptr, n);
}
FT_INLINE void activation_backward_row_body(Activation activation, float* pre, float* grad, int64_t n) {
  activation_row_float<true>(activation, pre, grad, n);
}
FT_MULTIVERSIONED(void, activation_forward_row, (Activation activation, float* x, int64_t n), (activation, x, n))
FT_MULTIVERSIONED(void, activation_backward_row, (Activation activation, float* pre, float* grad, int64_t n),
                  (activation, pre, grad, n))
void activation_forward_row(Activation activation, double* x, int64_t n) {
  activation_row_double<false>(activation, x, nullptr, n);
}
void activation_backward_row(Activation activation, double* pre, double* grad, int64_t n) {
  activation_row_double<true>(activation, pre, grad, n);
}

// Runs row_fn(row index, pre [n], grad [n] or nullptr) on acc_t buffers holding h + bias (and grad), per row in
// parallel; loads and stores convert at this boundary.
template <typename scalar_t, typename acc_t, typename F>
void for_each_row(const scalar_t* h, const acc_t* bias, const scalar_t* grad, int64_t rows, int64_t n, F&& row_fn) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 8192 / std::max<int64_t>(n, 1)), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> pre(n), grad_row(grad != nullptr ? n : 0);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t offset = row * n;
      for (int64_t c = 0; c < n; ++c) pre[c] = static_cast<acc_t>(h[offset + c]);
      if (bias != nullptr)
        for (int64_t c = 0; c < n; ++c) pre[c] += bias[c];
      if (grad != nullptr)
        for (int64_t c = 0; c < n; ++c) grad_row[c] = static_cast<acc_t>(grad[offset + c]);
      row_fn(row, pre.data(), grad != nullptr ? grad_row.data() : nullptr);
    }
  });
}

FT_INLINE void apply_dropout_row_body(const DropoutMask& dropout, int64_t offset, float* x, int64_t n) {
  const Float8 keep_scale = broadcast(static_cast<float>(dropout.keep_scale())), zero = broadcast(0.0f);
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) store8(x + c, select(keep8(dropout, offset + c), load8(x + c) * keep_scale, zero));
  for (; c < n; ++c) x[c] = dropout.keep(offset + c) ? x[c] * keep_scale[0] : 0.0f;
}
FT_MULTIVERSIONED(void, apply_dropout_row, (const DropoutMask& dropout, int64_t offset, float* x, int64_t n),
                  (dropout, offset, x, n))
void apply_dropout_row(const DropoutMask& dropout, int64_t offset, double* x, int64_t n) {
  for (int64_t c = 0; c < n; ++c) x[c] = dropout.keep(offset + c) ? x[c] * dropout.keep_scale() : 0.0;
}

struct BiasActivationInputs {
  at::Tensor h, bias;
  Activation activation;
};

BiasActivationInputs prepare_inputs(const at::Tensor& h, const std::optional<at::Tensor>& bias,
                                    std::string_view activation) {
  check_cpu(h, "h");
  TORCH_CHECK_VALUE(h.dim() == 2, "bias_activation: h must be [rows, F], got ", h.sizes());
  BiasActivationInputs inputs{h.contiguous(), at::Tensor(), parse_activation(activation)};
  if (bias.has_value()) {
    check_cpu(*bias, "bias");
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == h.size(1), "bias_activation: bias must be [", h.size(1),
                      "], got ", bias->sizes());
    inputs.bias = bias->to(accumulate_dtype(h.scalar_type())).contiguous();
  }
  return inputs;
}

}  // namespace

// h: [rows, F] (x @ w1^T, no bias). Returns dropout(act(h + bias)) in h's dtype.
at::Tensor bias_activation_fwd(const at::Tensor& h_in, const std::optional<at::Tensor>& bias,
                               c10::string_view activation, double dropout_p,
                               const std::optional<at::Tensor>& seed) {
  const auto inputs = prepare_inputs(h_in, bias, std::string_view(activation.data(), activation.size()));
  const DropoutMask dropout(seed_value(seed), dropout_p);
  at::Tensor out = at::empty_like(inputs.h);
  const int64_t n = inputs.h.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, inputs.h.scalar_type(), "bias_activation_fwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    scalar_t* out_data = out.data_ptr<scalar_t>();
    for_each_row<scalar_t, acc_t>(
        inputs.h.data_ptr<scalar_t>(), inputs.bias.defined() ? inputs.bias.data_ptr<acc_t>() : nullptr, nullptr,
        inputs.h.size(0), n, [&](int64_t row, acc_t* pre, acc_t*) {
          activation_forward_row(inputs.activation, pre, n);
          if (dropout.enabled()) apply_dropout_row(dropout, row * n, pre, n);
          for (int64_t c = 0; c < n; ++c) out_data[row * n + c] = static_cast<scalar_t>(pre[c]);
        });
  });
  return out;
}

// Returns the gradient of the pre-activation h + bias, [rows, F] in h's dtype (also h's gradient).
at::Tensor bias_activation_bwd(const at::Tensor& grad_in, const at::Tensor& h_in, const std::optional<at::Tensor>& bias,
                               c10::string_view activation, double dropout_p,
                               const std::optional<at::Tensor>& seed) {
  const auto inputs = prepare_inputs(h_in, bias, std::string_view(activation.data(), activation.size()));
  check_cpu(grad_in, "grad");
  TORCH_CHECK_VALUE(grad_in.sizes() == h_in.sizes(), "bias_activation_bwd: grad must have h's shape ", h_in.sizes(),
                    ", got ", grad_in.sizes());
  const at::Tensor grad = grad_in.to(inputs.h.scalar_type()).contiguous();
  const DropoutMask dropout(seed_value(seed), dropout_p);
  at::Tensor grad_pre = at::empty_like(inputs.h);
  const int64_t n = inputs.h.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, inputs.h.scalar_type(), "bias_activation_bwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    scalar_t* out_data = grad_pre.data_ptr<scalar_t>();
    for_each_row<scalar_t, acc_t>(
        inputs.h.data_ptr<scalar_t>(), inputs.bias.defined() ? inputs.bias.data_ptr<acc_t>() : nullptr,
        grad.data_ptr<scalar_t>(), inputs.h.size(0), n, [&](int64_t row, acc_t* pre, acc_t* grad_row) {
          if (dropout.enabled()) apply_dropout_row(dropout, row * n, grad_row, n);
          activation_backward_row(inputs.activation, pre, grad_row, n);
          for (int64_t c = 0; c < n; ++c) out_data[row * n + c] = static_cast<scalar_t>(grad_row[c]);
        });
  });
  return grad_pre;
}

TORCH_LIBRARY_IMPL(fused_transformer_cpu, CPU, m) {
  m.impl("bias_activation_fwd", &bias_activation_fwd);
  m.impl("bias_activation_bwd", &bias_activation_bwd);
}

}  // namespace fused_transformer_cpu
