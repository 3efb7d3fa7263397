// LayerNorm, or RMSNorm with rms, with residual add and dropout, one pass per row.
//
// Forward, per row of N features:
//   z = dropout(x) + residual   (each part optional; rounded to x's dtype, as the returned z is)
//   y = (z - mean) * rstd * weight + bias,   rstd = 1 / sqrt(mean((z - mean)^2) + eps)
//   RMSNorm: mean is 0 (neither computed nor stored), so rstd = 1 / sqrt(mean(z^2) + eps)
// Backward, with xhat = (z - mean) * rstd and g = dy * weight:
//   dz = (g - xhat * mean(g * xhat) - mean(g)) * rstd  [+ dz of the returned z],  dresidual = dz,
//   dx = dropout(dz) with the forward's mask,  dweight = sum_rows(dy * xhat),  dbias = sum_rows(dy)
//   RMSNorm: mean = 0 again, and no mean(g) term (y does not depend on a shift of z)
// dweight / dbias: each fixed chunk of rows writes a partial row, then the partials are added in chunk order,
// so the result does not depend on the number of threads.
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <optional>
#include <vector>

#include "common.h"

namespace fused_transformer_cpu {

namespace {

// Rows per chunk of the backward's partial sums: a function of the row count only (determinism).
constexpr int64_t kMaxChunks = 64;

// Sums with 8 independent lanes, which the compiler vectorises (a single accumulator would be serial).
template <typename acc_t, typename F>
acc_t lane_sum(int64_t n, F&& term) {
  acc_t lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) lanes[l] += term(i + l);
  acc_t total = 0;
  for (; i < n; ++i) total += term(i);
  for (int l = 0; l < 8; ++l) total += lanes[l];
  return total;
}

template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void norm_forward_kernel(const scalar_t* x, const scalar_t* residual, const acc_t* weight, const acc_t* bias,
                         scalar_t* y, scalar_t* z_out, acc_t* mean, acc_t* rstd, int64_t rows, int64_t n, acc_t eps,
                         bool rms, const DropoutMask& dropout) {
  const bool round_z = residual != nullptr || dropout.enabled();
  const acc_t keep_scale = static_cast<acc_t>(dropout.keep_scale());
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> z(n);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t offset = row * n;
      for (int64_t c = 0; c < n; ++c) z[c] = static_cast<acc_t>(x[offset + c]);
      if (dropout.enabled())
        for (int64_t c = 0; c < n; ++c) z[c] = dropout.keep(offset + c) ? z[c] * keep_scale : acc_t(0);
      if (residual != nullptr)
        for (int64_t c = 0; c < n; ++c) z[c] += static_cast<acc_t>(residual[offset + c]);
      if (round_z)  // normalise exactly the z that is returned and that the backward reads back
        for (int64_t c = 0; c < n; ++c) z[c] = static_cast<acc_t>(static_cast<scalar_t>(z[c]));
      if (z_out != nullptr)
        for (int64_t c = 0; c < n; ++c) z_out[offset + c] = static_cast<scalar_t>(z[c]);

      const acc_t row_mean = rms ? acc_t(0) : lane_sum<acc_t>(n, [&](int64_t c) { return z[c]; }) / n;
      const acc_t variance = lane_sum<acc_t>(n, [&](int64_t c) { return (z[c] - row_mean) * (z[c] - row_mean); }) / n;
      const acc_t row_rstd = acc_t(1) / std::sqrt(variance + eps);
      if (!rms) mean[row] = row_mean;
      rstd[row] = row_rstd;
      for (int64_t c = 0; c < n; ++c) {
        acc_t value = (z[c] - row_mean) * row_rstd;
        if (weight != nullptr) value *= weight[c];
        if (bias != nullptr) value += bias[c];
        y[offset + c] = static_cast<scalar_t>(value);
      }
    }
  });
}

// dweight_partial / dbias_partial: [chunks, n], written when the parameter exists. mean is not read with rms.
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void norm_backward_kernel(const scalar_t* dy, const scalar_t* dz, const scalar_t* z, const acc_t* weight,
                          const acc_t* mean, const acc_t* rstd, scalar_t* dx, scalar_t* dresidual,
                          acc_t* dweight_partial, acc_t* dbias_partial, int64_t rows, int64_t n, int64_t chunk_rows,
                          bool rms, const DropoutMask& dropout) {
  const int64_t chunks = (rows + chunk_rows - 1) / chunk_rows;
  const acc_t keep_scale = static_cast<acc_t>(dropout.keep_scale());
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> xhat(n), g(n), dy_row(n);
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      acc_t* dweight_sum = dweight_partial != nullptr ? dweight_partial + chunk * n : nullptr;
      acc_t* dbias_sum = dbias_partial != nullptr ? dbias_partial + chunk * n : nullptr;
      if (dweight_sum != nullptr) std::fill(dweight_sum, dweight_sum + n, acc_t(0));
      if (dbias_sum != nullptr) std::fill(dbias_sum, dbias_sum + n, acc_t(0));
      for (int64_t row = chunk * chunk_rows; row < std::min(rows, (chunk + 1) * chunk_rows); ++row) {
        const int64_t offset = row * n;
        const acc_t row_mean = rms ? acc_t(0) : mean[row];
        for (int64_t c = 0; c < n; ++c) {
          xhat[c] = (static_cast<acc_t>(z[offset + c]) - row_mean) * rstd[row];
          dy_row[c] = static_cast<acc_t>(dy[offset + c]);
          g[c] = weight != nullptr ? dy_row[c] * weight[c] : dy_row[c];
        }
        const acc_t mean_g_xhat = lane_sum<acc_t>(n, [&](int64_t c) { return g[c] * xhat[c]; }) / n;
        const acc_t mean_g = rms ? acc_t(0) : lane_sum<acc_t>(n, [&](int64_t c) { return g[c]; }) / n;
        for (int64_t c = 0; c < n; ++c) {
          acc_t grad = (g[c] - xhat[c] * mean_g_xhat - mean_g) * rstd[row];
          if (dz != nullptr) grad += static_cast<acc_t>(dz[offset + c]);
          if (dresidual != nullptr) dresidual[offset + c] = static_cast<scalar_t>(grad);
          if (dropout.enabled()) grad = dropout.keep(offset + c) ? grad * keep_scale : acc_t(0);
          dx[offset + c] = static_cast<scalar_t>(grad);
        }
        if (dweight_sum != nullptr)
          for (int64_t c = 0; c < n; ++c) dweight_sum[c] += dy_row[c] * xhat[c];
        if (dbias_sum != nullptr)
          for (int64_t c = 0; c < n; ++c) dbias_sum[c] += dy_row[c];
      }
    }
  });
}

// partial [chunks, n] -> [n], adding the chunks in order.
at::Tensor sum_partials(const at::Tensor& partial, at::ScalarType out_dtype) {
  at::Tensor total = partial.select(0, 0).clone();
  AT_DISPATCH_FLOATING_TYPES(partial.scalar_type(), "sum_partials", [&] {
    const int64_t chunks = partial.size(0), n = partial.size(1);
    const scalar_t* rows = partial.data_ptr<scalar_t>();
    scalar_t* out = total.data_ptr<scalar_t>();
    for (int64_t chunk = 1; chunk < chunks; ++chunk)
      for (int64_t c = 0; c < n; ++c) out[c] += rows[chunk * n + c];
  });
  return total.to(out_dtype);
}

// op: the name of the op the caller called (norm_op_name), for the messages.
void check_rows(const at::Tensor& t, const char* name, const at::Tensor& like, const char* op) {
  check_cpu(t, name);
  TORCH_CHECK_VALUE(t.sizes() == like.sizes(), op, ": ", name, " must have shape ", like.sizes(), ", got ",
                    t.sizes());
  TORCH_CHECK_TYPE(t.scalar_type() == like.scalar_type(), op, ": ", name, " must have dtype ", like.scalar_type(),
                   ", got ", t.scalar_type());
}

// A parameter [n] in the accumulate dtype of x, or an undefined tensor.
at::Tensor parameter(const std::optional<at::Tensor>& p, const char* name, const at::Tensor& x, const char* op) {
  if (!p.has_value()) return at::Tensor();
  check_cpu(*p, name);
  TORCH_CHECK_VALUE(p->dim() == 1 && p->size(0) == x.size(1), op, ": ", name, " must be [", x.size(1), "], got ",
                    p->sizes());
  return p->to(accumulate_dtype(x.scalar_type())).contiguous();
}

template <typename T>
T* pointer_or_null(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<T>() : nullptr;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> norm_fwd(
    const at::Tensor& x_in, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& residual, double eps, double dropout_p, const std::optional<at::Tensor>& seed,
    bool store_z, bool rms) {
  const char* op = norm_op_name(rms);
  check_cpu(x_in, "x");
  TORCH_CHECK_VALUE(x_in.dim() == 2, op, ": x must be [rows, N], got ", x_in.sizes());
  const at::Tensor x = x_in.contiguous();
  at::Tensor residual_rows;
  if (residual.has_value()) {
    check_rows(*residual, "residual", x, op);
    residual_rows = residual->contiguous();
  }
  const at::Tensor weight_acc = parameter(weight, "weight", x, op), bias_acc = parameter(bias, "bias", x, op);
  const int64_t rows = x.size(0), n = x.size(1);
  const auto stats_options = x.options().dtype(accumulate_dtype(x.scalar_type()));
  at::Tensor y = at::empty_like(x), z = store_z ? at::empty_like(x) : at::empty({0}, x.options());
  at::Tensor mean = at::empty({rms ? 0 : rows}, stats_options), rstd = at::empty({rows}, stats_options);
  const DropoutMask dropout(seed_value(seed), dropout_p);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "norm_fwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    norm_forward_kernel<scalar_t>(x.data_ptr<scalar_t>(), pointer_or_null<scalar_t>(residual_rows),
                                  pointer_or_null<acc_t>(weight_acc), pointer_or_null<acc_t>(bias_acc),
                                  y.data_ptr<scalar_t>(), store_z ? z.data_ptr<scalar_t>() : nullptr,
                                  rms ? nullptr : mean.data_ptr<acc_t>(), rstd.data_ptr<acc_t>(), rows, n,
                                  static_cast<acc_t>(eps), rms, dropout);
  });
  return {y, z, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> norm_bwd(
    const at::Tensor& dy_in, const std::optional<at::Tensor>& dz_in, const at::Tensor& z_in,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, const at::Tensor& mean,
    const at::Tensor& rstd, double dropout_p, const std::optional<at::Tensor>& seed, bool has_residual,
    bool rms) {
  const char* op = norm_op_name(rms);
  check_cpu(z_in, "z");
  TORCH_CHECK_VALUE(z_in.dim() == 2, op, " backward: z must be [rows, N], got ", z_in.sizes());
  const at::Tensor z = z_in.contiguous();
  check_rows(dy_in, "dy", z, op);
  const at::Tensor dy = dy_in.contiguous();
  at::Tensor dz;
  if (dz_in.has_value()) {
    check_rows(*dz_in, "dz", z, op);
    dz = dz_in->contiguous();
  }
  const at::Tensor weight_acc = parameter(weight, "weight", z, op);
  const int64_t rows = z.size(0), n = z.size(1);
  const int64_t chunk_rows = std::max<int64_t>(1, (rows + kMaxChunks - 1) / kMaxChunks);
  const int64_t chunks = (rows + chunk_rows - 1) / chunk_rows;
  const auto acc_options = z.options().dtype(accumulate_dtype(z.scalar_type()));
  at::Tensor dx = at::empty_like(z), dresidual = has_residual ? at::empty_like(z) : at::empty({0}, z.options());
  const auto partial = [&](bool present) {
    return present ? at::zeros({std::max<int64_t>(chunks, 1), n}, acc_options) : at::Tensor();
  };
  at::Tensor dweight_partial = partial(weight.has_value()), dbias_partial = partial(bias.has_value());
  const DropoutMask dropout(seed_value(seed), dropout_p);
  const at::Tensor mean_acc = rms ? at::Tensor() : mean.to(acc_options.dtype()).contiguous();
  const at::Tensor rstd_acc = rstd.to(acc_options.dtype()).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, z.scalar_type(), "norm_bwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    norm_backward_kernel<scalar_t>(
        dy.data_ptr<scalar_t>(), pointer_or_null<scalar_t>(dz), z.data_ptr<scalar_t>(),
        pointer_or_null<acc_t>(weight_acc), pointer_or_null<acc_t>(mean_acc), rstd_acc.data_ptr<acc_t>(),
        dx.data_ptr<scalar_t>(), has_residual ? dresidual.data_ptr<scalar_t>() : nullptr,
        pointer_or_null<acc_t>(dweight_partial), pointer_or_null<acc_t>(dbias_partial), rows, n, chunk_rows, rms,
        dropout);
  });
  at::Tensor dweight = weight.has_value() ? sum_partials(dweight_partial, weight->scalar_type())
                                          : at::empty({0}, z.options());
  at::Tensor dbias = bias.has_value() ? sum_partials(dbias_partial, bias->scalar_type()) : at::empty({0}, z.options());
  return {dx, dresidual, dweight, dbias};
}

}  // namespace fused_transformer_cpu
