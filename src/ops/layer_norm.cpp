// LayerNorm over the last dimension, forward and backward.
#include <mgpu/ops/ops.hpp>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "ops/op_support.hpp"

namespace mgpu::ops {

namespace {
void check_layer_norm(Tensor const& x, Tensor const& gamma, Tensor const& stats, char const* op, Stream const& stream) {
  check(x, op, "x", stream);
  check(gamma, op, "gamma", stream);
  check(stats, op, "stats", stream);
  check_dtype(gamma, x.dtype(), op, "gamma");
  check_dtype(stats, DType::float32, op, "stats");
  if (x.rank() != 2 || gamma.numel() != x.dim(1) || stats.numel() != 2 * x.dim(0))
    throw Error(Errc::invalid_argument, std::string(op) + ": x " + to_string(x.shape()) + ", gamma " + to_string(gamma.shape()) +
                                            ", stats " + to_string(stats.shape()) + " (expected x [N, D], gamma [D], stats [2, N])");
}

// dgamma (+)= sum over rows of dy xhat and dbeta (+)= sum of dy (detail::LayerNormParamGradCol's
// sums, in its order and rounding) with the rows outer and the columns inner, on the host.
template <class T>
void layer_norm_param_grads(T const* __restrict x, T const* __restrict dy, float const* __restrict mean,
                            float const* __restrict rstd, T* __restrict dgamma, T* __restrict dbeta, std::int64_t rows,
                            std::int64_t cols, bool accumulate) {
  thread_local std::vector<float> sums;
  sums.resize(static_cast<std::size_t>(2 * cols));
  float* __restrict dg = sums.data();
  float* __restrict db = dg + cols;
  for (std::int64_t j = 0; j < cols; ++j) {
    dg[j] = accumulate ? detail::load(dgamma, j) : 0.0f;
    db[j] = accumulate ? detail::load(dbeta, j) : 0.0f;
  }
  for (std::int64_t r = 0; r < rows; ++r) {
    float const m = mean[r], rs = rstd[r];
    for (std::int64_t j = 0; j < cols; ++j) {
      float const g = detail::load(dy, r * cols + j);
      dg[j] += g * (detail::load(x, r * cols + j) - m) * rs;
      db[j] += g;
    }
  }
  for (std::int64_t j = 0; j < cols; ++j) {
    detail::store(dgamma, j, dg[j]);
    detail::store(dbeta, j, db[j]);
  }
}
}  // namespace

void layer_norm(Tensor const& x, Tensor const& gamma, Tensor const& beta, Tensor const& y, Tensor const& stats,
                float eps, Stream& stream, Tensor const& residual) {
  check_layer_norm(x, gamma, stats, "layer_norm", stream);
  check(beta, "layer_norm", "beta", stream);
  check(y, "layer_norm", "y", stream);
  check_same(gamma, beta, "layer_norm");
  check_same(x, y, "layer_norm");
  if (!(eps > 0)) throw Error(Errc::invalid_argument, "layer_norm: eps " + std::to_string(eps) + " (expected > 0)");
  if (residual.defined()) {
    check(residual, "layer_norm", "residual", stream);
    check_same(x, residual, "layer_norm");
  }
  std::int64_t const n = x.dim(0);
  visit(x.dtype(), [&]<class T>(T) {
    detail::LayerNormRow<T> const op{ptr<T>(x),
                                     ptr<T>(gamma),
                                     ptr<T>(beta),
                                     ptr<T>(y),
                                     ptr<float>(stats),
                                     ptr<float>(stats) + n,
                                     x.dim(1),
                                     eps,
                                     residual.defined() ? ptr<T>(residual) : nullptr,
                                     residual.defined() ? ptr<T>(x) : nullptr};
    run_each(stream, HostOpFamily::norm, n, op,
             residual.defined() ? std::vector<Tensor>{x, gamma, beta, y, stats, residual}
                                : std::vector<Tensor>{x, gamma, beta, y, stats});
  });
}

void layer_norm_backward(Tensor const& x, Tensor const& gamma, Tensor const& stats, Tensor const& dy, Tensor const& dx,
                         Tensor const& dgamma, Tensor const& dbeta, Stream& stream, bool accumulate,
                         Tensor const& residual) {
  check_layer_norm(x, gamma, stats, "layer_norm_backward", stream);
  for (auto const& [t, role] : {std::pair{&dy, "dy"}, std::pair{&dx, "dx"}, std::pair{&dgamma, "dgamma"}, std::pair{&dbeta, "dbeta"}})
    check(*t, "layer_norm_backward", role, stream);
  check_same(x, dy, "layer_norm_backward");
  check_same(x, dx, "layer_norm_backward");
  check_same(gamma, dgamma, "layer_norm_backward");
  check_same(gamma, dbeta, "layer_norm_backward");
  if (residual.defined()) {
    check(residual, "layer_norm_backward", "residual", stream);
    check_same(x, residual, "layer_norm_backward");
  }
  std::int64_t const n = x.dim(0);
  std::int64_t const d = x.dim(1);
  float const* mean = ptr<float>(stats);
  float const* rstd = mean + n;
  visit(x.dtype(), [&]<class T>(T) {
    T const* skip = residual.defined() ? ptr<T>(residual) : nullptr;
    run_each(stream, HostOpFamily::norm, n,
             detail::LayerNormGradRow<T>{ptr<T>(x), ptr<T>(gamma), ptr<T>(dy), mean, rstd, ptr<T>(dx), d, skip},
             residual.defined() ? std::vector<Tensor>{x, gamma, stats, dy, dx, residual}
                                : std::vector<Tensor>{x, gamma, stats, dy, dx});
    if (stream.device().kind == DeviceKind::host) {
      // Rows in order, columns in vectors: each column's sums in LayerNormParamGradCol's order (rows
      // in order, from the old value or 0), without its strided walk down each column.
      mgpu::detail::enqueue_using(
          stream,
          [xs = ptr<T>(x), g = ptr<T>(dy), mean, rstd, dgamma = ptr<T>(dgamma), dbeta = ptr<T>(dbeta), n, d, accumulate] {
            host::timed(HostOpFamily::norm, [&] { layer_norm_param_grads(xs, g, mean, rstd, dgamma, dbeta, n, d, accumulate); });
          },
          x, stats, dy, dgamma, dbeta);
      return;
    }
    run_each(stream, HostOpFamily::norm, d,
             detail::LayerNormParamGradCol<T>{ptr<T>(x), ptr<T>(dy), mean, rstd, ptr<T>(dgamma), ptr<T>(dbeta), n, d,
                                              accumulate},
             {x, stats, dy, dgamma, dbeta});
  });
}

}  // namespace mgpu::ops
