// The GEMM family: gemm, linear (GEMM with bias and activation), and the bias and activation
// gradients. GEMMs go to the host GEMM (ops/host_gemm.hpp) on host streams and to cuBLAS on CUDA
// streams; add_bias uses Eigen on float32 host tensors.
#include <mgpu/ops/ops.hpp>

#include <Eigen/Core>

#include <atomic>
#include <string>
#include <utility>
#include <vector>

#include "core/backend.hpp"
#include "ops/host_gemm.hpp"
#include "ops/op_support.hpp"

namespace mgpu::ops {

namespace {

using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MatrixMap = Eigen::Map<Matrix>;

// Enqueues C = alpha op(A) op(B) + beta C on the stream (arguments checked by the caller).
void enqueue_gemm(Tensor const& a, bool transpose_a, Tensor const& b, bool transpose_b, Tensor const& c, float alpha, float beta,
                  Stream& stream) {
  if (stream.device().kind == DeviceKind::host) {
    host::GemmCall const call{.dtype = a.dtype(), .transpose_a = transpose_a, .transpose_b = transpose_b, .m = c.dim(0), .n = c.dim(1),
                              .k = transpose_a ? a.dim(0) : a.dim(1), .a = a.data(), .b = b.data(), .c = c.data(), .alpha = alpha, .beta = beta};
    mgpu::detail::enqueue_using(stream, [call] { host::gemm(call); }, a, b, c);
    return;
  }
#if MGPU_CUDA_ENABLED
  std::int64_t const k = transpose_a ? a.dim(0) : a.dim(1);
  bool const tf32 = float32_matmul() == Float32Matmul::tf32;
  int const ordinal = stream.device().index;
  mgpu::detail::StreamInternals::with_blas_handle(stream, kernels::create_blas_handle, kernels::destroy_blas_handle, [&](void* handle) {
    kernels::gemm(handle, ordinal, a.dtype(), transpose_a, transpose_b, c.dim(0), c.dim(1), k, alpha, a.data(), b.data(), beta,
                  c.data(), stream.native_handle(), tf32);
  });
  mgpu::detail::release_after(stream, a, b, c);
#else
  throw Error(Errc::device, "gemm on " + stream.device().to_string() + " (this build has no CUDA backend)");
#endif
}

// activation_bias_grad over rows on a host stream: contiguous, vectorized along the row, with the
// column sums in float32 in the L1 cache (rounded once into db for 16-bit storage).
template <class T, class F>
void activation_bias_grad_rows(T const* __restrict z, T const* __restrict dy, T* __restrict dz, T* __restrict db, std::int64_t rows,
                               std::int64_t cols, bool accumulate) {
  thread_local std::vector<float> sums;
  sums.assign(static_cast<std::size_t>(cols), 0.0f);
  float* __restrict acc = sums.data();
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t j = 0; j < cols; ++j) {
      float const d = F::backward(detail::load(z, r * cols + j), detail::load(dy, r * cols + j));
      detail::store(dz, r * cols + j, d);
      acc[j] += d;
    }
  }
  for (std::int64_t j = 0; j < cols; ++j) detail::store(db, j, accumulate ? detail::load(db, j) + acc[j] : acc[j]);
}

// bias_grad over rows on a host stream: the column sums of dy in float32 as activation_bias_grad_rows
// keeps them, a row at a time (Eigen's column sums of a row-major float32 matrix took 4x as long, a
// column at a time would stride through dy once per column).
template <class T>
void bias_grad_rows(T const* __restrict dy, T* __restrict db, std::int64_t rows, std::int64_t cols, bool accumulate) {
  thread_local std::vector<float> sums;
  sums.assign(static_cast<std::size_t>(cols), 0.0f);
  float* __restrict acc = sums.data();
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t j = 0; j < cols; ++j) acc[j] += detail::load(dy, r * cols + j);
  for (std::int64_t j = 0; j < cols; ++j) detail::store(db, j, accumulate ? detail::load(db, j) + acc[j] : acc[j]);
}
}  // namespace

namespace {
std::atomic<Float32Matmul> float32_matmul_mode{Float32Matmul::exact};
}  // namespace

void set_float32_matmul(Float32Matmul mode) noexcept { float32_matmul_mode.store(mode, std::memory_order_relaxed); }
Float32Matmul float32_matmul() noexcept { return float32_matmul_mode.load(std::memory_order_relaxed); }

void gemm(Tensor const& a, bool transpose_a, Tensor const& b, bool transpose_b, Tensor const& c, float alpha, float beta,
          Stream& stream) {
  for (auto const& [t, role] : {std::pair{&a, "A"}, std::pair{&b, "B"}, std::pair{&c, "C"}}) {
    check(*t, "gemm", role, stream);
    check_dtype(*t, a.dtype(), "gemm", role);
    if (t->rank() != 2)
      throw Error(Errc::invalid_argument, std::string("gemm: ") + role + " has shape " + to_string(t->shape()) + " (expected 2-D)");
  }
  std::int64_t const m = transpose_a ? a.dim(1) : a.dim(0);
  std::int64_t const k = transpose_a ? a.dim(0) : a.dim(1);
  std::int64_t const k2 = transpose_b ? b.dim(1) : b.dim(0);
  std::int64_t const n = transpose_b ? b.dim(0) : b.dim(1);
  if (k != k2 || c.dim(0) != m || c.dim(1) != n)
    throw Error(Errc::invalid_argument, "gemm: op(A) is [" + std::to_string(m) + ", " + std::to_string(k) + "], op(B) is [" +
                                            std::to_string(k2) + ", " + std::to_string(n) + "], C is " + to_string(c.shape()) +
                                            " (expected [m, k] x [k, n] -> [m, n])");
  enqueue_gemm(a, transpose_a, b, transpose_b, c, alpha, beta, stream);
}

void linear(Tensor const& x, Tensor const& w, Tensor const& bias, Tensor const& y, ActivationKind act, Tensor const& pre,
            Stream& stream) {
  for (auto const& [t, role] : {std::pair{&x, "x"}, std::pair{&w, "w"}, std::pair{&bias, "bias"}, std::pair{&y, "y"}}) {
    check(*t, "linear", role, stream);
    check_dtype(*t, x.dtype(), "linear", role);
  }
  if (x.rank() != 2 || w.rank() != 2 || y.rank() != 2 || w.dim(0) != x.dim(1) || bias.numel() != w.dim(1) ||
      y.dim(0) != x.dim(0) || y.dim(1) != w.dim(1))
    throw Error(Errc::invalid_argument, "linear: x " + to_string(x.shape()) + ", w " + to_string(w.shape()) + ", bias " +
                                            to_string(bias.shape()) + ", y " + to_string(y.shape()) +
                                            " (expected x [N, in], w [in, out], bias [out], y [N, out])");
  if (act == ActivationKind::gelu) {
    check(pre, "linear", "pre", stream);
    check_same(pre, y, "linear");
  } else if (pre.defined()) {
    throw Error(Errc::invalid_argument, std::string("linear: a pre-activation tensor with ") + activation_name(act) +
                                            " (expected an undefined tensor: only gelu keeps one)");
  }
  Tensor const& z = act == ActivationKind::gelu ? pre : y;  // the GEMM's output
  if (stream.device().kind == DeviceKind::host) {
    // One GEMM with the bias and the activation in its epilogue (GELU into y, z keeping x W + bias).
    host::GemmCall const call{.dtype = x.dtype(), .m = x.dim(0), .n = w.dim(1), .k = x.dim(1), .a = x.data(), .b = w.data(), .c = z.data(),
                              .bias = bias.data(), .relu = act == ActivationKind::relu,
                              .gelu_out = act == ActivationKind::gelu ? y.data() : nullptr};
    mgpu::detail::enqueue_using(stream, [call] { host::gemm(call); }, x, w, bias, y, z);
    return;
  }
  enqueue_gemm(x, false, w, false, z, 1.0f, 0.0f, stream);
  visit(x.dtype(), [&]<class T>(T) {
    visit_activation(act, [&]<class F>(F) {
      run_each(stream, HostOpFamily::activation, y.numel(),
               detail::BiasActivationOp<T, F>{ptr<T>(z), ptr<T>(bias), ptr<T>(y), cols(y)}, {z, bias, y});
    });
  });
}

void activation_bias_grad(ActivationKind act, Tensor const& z, Tensor const& dy, Tensor const& dz, Tensor const& db,
                          Stream& stream, bool accumulate) {
  check(dy, "activation_bias_grad", "dy", stream);
  check(dz, "activation_bias_grad", "dz", stream);
  check(db, "activation_bias_grad", "db", stream);
  check_same(dy, dz, "activation_bias_grad");
  check_dtype(db, dy.dtype(), "activation_bias_grad", "db");
  if (act != ActivationKind::identity) {
    check(z, "activation_bias_grad", "z", stream);
    check_same(z, dy, "activation_bias_grad");
  }
  if (dy.rank() != 2 || db.numel() != dy.dim(1))
    throw Error(Errc::invalid_argument, "activation_bias_grad: dy " + to_string(dy.shape()) + " and db " + to_string(db.shape()) +
                                            " (expected dy [N, out] and db [out])");
  Tensor const& input = act == ActivationKind::identity ? dy : z;  // identity reads no z
  visit_activation(act, [&]<class F>(F) {
    visit(dy.dtype(), [&]<class T>(T) {
      if (stream.device().kind == DeviceKind::host) {
        mgpu::detail::enqueue_using(
            stream,
            [in = ptr<T>(input), g = ptr<T>(dy), out = ptr<T>(dz), bias = ptr<T>(db), n = rows(dy), c = cols(dy),
             accumulate] {
              host::timed(HostOpFamily::activation,
                          [&] { activation_bias_grad_rows<T, F>(in, g, out, bias, n, c, accumulate); });
            },
            input, dy, dz, db);
        return;
      }
      run_each(stream, HostOpFamily::activation, cols(dy),
               detail::ActivationBiasGradCol<T, F>{ptr<T>(input), ptr<T>(dy), ptr<T>(dz), ptr<T>(db), rows(dy),
                                                   cols(dy), accumulate},
               {input, dy, dz, db});
    });
  });
}

void add_bias(Tensor const& y, Tensor const& bias, Stream& stream) {
  check(y, "add_bias", "y", stream);
  check(bias, "add_bias", "bias", stream);
  check_dtype(bias, y.dtype(), "add_bias", "bias");
  if (bias.numel() != cols(y))
    throw Error(Errc::invalid_argument, "add_bias: bias has " + std::to_string(bias.numel()) + " elements for y of shape " +
                                            to_string(y.shape()) + " (expected one per column)");
  if (host_float32(y, stream)) {  // Eigen's broadcast vectorizes along rows
    mgpu::detail::enqueue_using(
        stream,
        [out = ptr<float>(y), n = rows(y), c = cols(y), b = ptr<float>(bias)] {
          host::timed(HostOpFamily::activation,
                      [&] { MatrixMap(out, n, c).rowwise() += Eigen::Map<Eigen::RowVectorXf>(b, c); });
        },
        y, bias);
    return;
  }
  visit(y.dtype(), [&]<class T>(T) {
    run_each(stream, HostOpFamily::activation, y.numel(), detail::BiasAddOp<T>{ptr<T>(y), ptr<T>(bias), cols(y)},
             {y, bias});
  });
}

void bias_grad(Tensor const& dy, Tensor const& db, Stream& stream, bool accumulate) {
  check(dy, "bias_grad", "dy", stream);
  check(db, "bias_grad", "db", stream);
  check_dtype(db, dy.dtype(), "bias_grad", "db");
  if (db.numel() != cols(dy))
    throw Error(Errc::invalid_argument, "bias_grad: db has " + std::to_string(db.numel()) + " elements for dy of shape " +
                                            to_string(dy.shape()) + " (expected one per column)");
  visit(dy.dtype(), [&]<class T>(T) {
    if (stream.device().kind == DeviceKind::host) {
      mgpu::detail::enqueue_using(
          stream,
          [g = ptr<T>(dy), sums = ptr<T>(db), n = rows(dy), c = cols(dy), accumulate] {
            host::timed(HostOpFamily::activation, [&] { bias_grad_rows<T>(g, sums, n, c, accumulate); });
          },
          dy, db);
      return;
    }
    run_each(stream, HostOpFamily::activation, cols(dy),
             detail::BiasGradOp<T>{ptr<T>(dy), ptr<T>(db), rows(dy), cols(dy), accumulate}, {dy, db});
  });
}

}  // namespace mgpu::ops
