// The training ops: argument checks, then the same functor run on the host stream's worker or
// launched as a CUDA kernel (src/kernels/ops.cu). GEMMs go to the host GEMM (ops/host_gemm.hpp)
// on host streams and to cuBLAS on CUDA streams.
#include <mgpu/ops/ops.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <mgpu/config.hpp>
#include <mgpu/core/detail/elementwise.hpp>
#include <mgpu/core/error.hpp>
#include <mgpu/ops/detail/math.hpp>

#include "core/buffer_internals.hpp"
#include "core/host_staging.hpp"
#include "core/stream_internals.hpp"
#include "kernels/ops.hpp"
#include "ops/host_gemm.hpp"

namespace mgpu::ops {
namespace {

using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MatrixMap = Eigen::Map<Matrix>;

std::string str(DType t) { return std::string(to_string(t)); }

// A defined tensor on the stream's device.
void check(Tensor const& t, char const* op, char const* role, Stream const& stream) {
  if (!t.defined()) throw Error(Errc::invalid_argument, std::string(op) + ": " + role + " is undefined (expected a tensor)");
  if (t.dtype() == DType::int32)
    throw Error(Errc::invalid_argument, std::string(op) + ": " + role + " is int32 (expected float32, bfloat16 or float16)");
  if (t.device() != stream.device())
    throw Error(Errc::device, std::string(op) + ": " + role + " is on " + t.device().to_string() + " but the stream is on " +
                                  stream.device().to_string() + " (expected the stream's device)");
}

void check_dtype(Tensor const& t, DType expected, char const* op, char const* role) {
  if (t.dtype() != expected)
    throw Error(Errc::invalid_argument, std::string(op) + ": " + role + " is " + str(t.dtype()) + " (expected " + str(expected) + ")");
}

void check_same(Tensor const& a, Tensor const& b, char const* op) {
  if (a.shape() != b.shape())
    throw Error(Errc::invalid_argument, std::string(op) + ": shapes " + to_string(a.shape()) + " and " + to_string(b.shape()) +
                                            " differ (expected equal shapes)");
  if (a.dtype() != b.dtype())
    throw Error(Errc::invalid_argument, std::string(op) + ": dtypes " + str(a.dtype()) + " and " + str(b.dtype()) +
                                            " differ (expected one dtype)");
}

void check_scalar(Tensor const& out, char const* op, Stream const& stream) {
  check(out, op, "output", stream);
  check_dtype(out, DType::float32, op, "output");
  if (out.numel() != 1)
    throw Error(Errc::invalid_argument, std::string(op) + ": output has shape " + to_string(out.shape()) + " (expected one element)");
}

std::int64_t rows(Tensor const& t) { return t.rank() == 0 ? 1 : t.dim(0); }
std::int64_t cols(Tensor const& t) { return t.rank() == 0 ? 1 : t.numel() / std::max<std::int64_t>(1, t.dim(0)); }

template <class T>
T* ptr(Tensor const& t) {
  return static_cast<T*>(t.data());
}

MatrixMap matrix(Tensor const& t) { return {ptr<float>(t), rows(t), cols(t)}; }

// float32 on a host stream: the ops that Eigen does better than an element loop take this path.
bool host_float32(Tensor const& t, Stream const& stream) {
  return t.dtype() == DType::float32 && stream.device().kind == DeviceKind::host;
}

// Runs op(i) for i in [0, n) on the stream, keeping the tensors alive until it has run.
template <class Op>
void run_each(Stream& stream, std::int64_t n, Op const& op, std::vector<Tensor> keep) {
  if (stream.device().kind == DeviceKind::host) {
    stream.enqueue([n, op, keep = std::move(keep)] { mgpu::detail::for_each_index(n, op); });
    return;
  }
#if MGPU_CUDA_ENABLED
  mgpu::detail::ReleaseAfterOnExit const release(stream, keep);  // reused after the kernel
  kernels::each(stream.device().index, n, op, stream.native_handle());
#else
  throw Error(Errc::device, "ops on " + stream.device().to_string() + " (this build has no CUDA backend)");
#endif
}

// out[0] = scale * sum of op(i) for i in [0, n); float64 accumulation on the host.
template <class Op>
void run_reduce(Stream& stream, std::int64_t n, Op const& op, Tensor const& out, float scale, std::vector<Tensor> keep) {
  keep.push_back(out);
  float* result = ptr<float>(out);
  if (stream.device().kind == DeviceKind::host) {
    stream.enqueue([n, op, result, scale, keep = std::move(keep)] {
      double total = 0;
      for (std::int64_t i = 0; i < n; ++i) total += static_cast<double>(op(i));
      *result = static_cast<float>(static_cast<double>(scale) * total);
    });
    return;
  }
#if MGPU_CUDA_ENABLED
  mgpu::detail::ReleaseAfterOnExit const release(stream, keep);  // its kernels, also if the second fails to launch
  kernels::reduce(stream.device().index, n, op, result, scale, stream.native_handle());
#else
  throw Error(Errc::device, "ops on " + stream.device().to_string() + " (this build has no CUDA backend)");
#endif
}

// Calls fn(T{}) with T the element type of a float32, bfloat16 or float16 tensor.
template <class Fn>
void visit(DType dtype, Fn&& fn) {
  mgpu::detail::visit_dtype(dtype, [&]<class T>(std::type_identity<T>) { fn(T{}); });
}

// Enqueues C = alpha op(A) op(B) + beta C on the stream (arguments checked by the caller).
void enqueue_gemm(Tensor const& a, bool transpose_a, Tensor const& b, bool transpose_b, Tensor const& c, float alpha, float beta,
                  Stream& stream) {
  if (stream.device().kind == DeviceKind::host) {
    host::GemmCall const call{.dtype = a.dtype(), .transpose_a = transpose_a, .transpose_b = transpose_b, .m = c.dim(0), .n = c.dim(1),
                              .k = transpose_a ? a.dim(0) : a.dim(1), .a = a.data(), .b = b.data(), .c = c.data(), .alpha = alpha, .beta = beta};
    stream.enqueue([call, keep = std::vector<Tensor>{a, b, c}] { host::gemm(call); });
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

// Calls fn(F{}) with F the functor type of an activation.
template <class Fn>
void visit_activation(ActivationKind act, Fn&& fn) {
  switch (act) {
    case ActivationKind::identity: fn(detail::Identity{}); return;
    case ActivationKind::relu: fn(detail::Relu{}); return;
    case ActivationKind::gelu: fn(detail::Gelu{}); return;
  }
  throw Error(Errc::invalid_argument, "activation " + std::to_string(static_cast<int>(act)) + " (expected identity, relu or gelu)");
}

}  // namespace

char const* activation_name(ActivationKind kind) noexcept {
  switch (kind) {
    case ActivationKind::identity: return "identity";
    case ActivationKind::relu: return "relu";
    case ActivationKind::gelu: return "gelu";
  }
  return "unknown";
}

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
    stream.enqueue([call, keep = std::vector<Tensor>{x, w, bias, y, z}] { host::gemm(call); });
    return;
  }
  enqueue_gemm(x, false, w, false, z, 1.0f, 0.0f, stream);
  visit(x.dtype(), [&]<class T>(T) {
    visit_activation(act, [&]<class F>(F) {
      run_each(stream, y.numel(), detail::BiasActivationOp<T, F>{ptr<T>(z), ptr<T>(bias), ptr<T>(y), cols(y)}, {z, bias, y});
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
        stream.enqueue([input, dy, dz, db, accumulate] {
          activation_bias_grad_rows<T, F>(ptr<T>(input), ptr<T>(dy), ptr<T>(dz), ptr<T>(db), rows(dy), cols(dy), accumulate);
        });
        return;
      }
      run_each(stream, cols(dy), detail::ActivationBiasGradCol<T, F>{ptr<T>(input), ptr<T>(dy), ptr<T>(dz), ptr<T>(db), rows(dy), cols(dy), accumulate},
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
    stream.enqueue([y, bias] { matrix(y).rowwise() += Eigen::Map<Eigen::RowVectorXf>(ptr<float>(bias), bias.numel()); });
    return;
  }
  visit(y.dtype(), [&]<class T>(T) { run_each(stream, y.numel(), detail::BiasAddOp<T>{ptr<T>(y), ptr<T>(bias), cols(y)}, {y, bias}); });
}

void bias_grad(Tensor const& dy, Tensor const& db, Stream& stream, bool accumulate) {
  check(dy, "bias_grad", "dy", stream);
  check(db, "bias_grad", "db", stream);
  check_dtype(db, dy.dtype(), "bias_grad", "db");
  if (db.numel() != cols(dy))
    throw Error(Errc::invalid_argument, "bias_grad: db has " + std::to_string(db.numel()) + " elements for dy of shape " +
                                            to_string(dy.shape()) + " (expected one per column)");
  if (host_float32(dy, stream)) {  // column sums over contiguous rows
    stream.enqueue([dy, db, accumulate] {
      Eigen::Map<Eigen::RowVectorXf> out(ptr<float>(db), db.numel());
      if (accumulate) {
        out += matrix(dy).colwise().sum();
      } else {
        out = matrix(dy).colwise().sum();
      }
    });
    return;
  }
  visit(dy.dtype(), [&]<class T>(T) {
    run_each(stream, cols(dy), detail::BiasGradOp<T>{ptr<T>(dy), ptr<T>(db), rows(dy), cols(dy), accumulate}, {dy, db});
  });
}

namespace {
template <class F>
void activation(char const* op, Tensor const& x, Tensor const& y, Stream& stream) {
  check(x, op, "x", stream);
  check(y, op, "y", stream);
  check_same(x, y, op);
  visit(x.dtype(), [&]<class T>(T) { run_each(stream, x.numel(), detail::ActivationOp<T, F>{ptr<T>(x), ptr<T>(y)}, {x, y}); });
}

template <class F>
void activation_grad(char const* op, Tensor const& x, Tensor const& dy, Tensor const& dx, Stream& stream) {
  check(x, op, "x", stream);
  check(dy, op, "dy", stream);
  check(dx, op, "dx", stream);
  check_same(x, dy, op);
  check_same(x, dx, op);
  visit(x.dtype(), [&]<class T>(T) {
    run_each(stream, x.numel(), detail::ActivationGradOp<T, F>{ptr<T>(x), ptr<T>(dy), ptr<T>(dx)}, {x, dy, dx});
  });
}
}  // namespace

void relu(Tensor const& x, Tensor const& y, Stream& stream) { activation<detail::Relu>("relu", x, y, stream); }
void relu_backward(Tensor const& x, Tensor const& dy, Tensor const& dx, Stream& stream) {
  activation_grad<detail::Relu>("relu_backward", x, dy, dx, stream);
}
void gelu(Tensor const& x, Tensor const& y, Stream& stream) { activation<detail::Gelu>("gelu", x, y, stream); }
void gelu_backward(Tensor const& x, Tensor const& dy, Tensor const& dx, Stream& stream) {
  activation_grad<detail::Gelu>("gelu_backward", x, dy, dx, stream);
}

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
}  // namespace

void layer_norm(Tensor const& x, Tensor const& gamma, Tensor const& beta, Tensor const& y, Tensor const& stats, float eps,
                Stream& stream) {
  check_layer_norm(x, gamma, stats, "layer_norm", stream);
  check(beta, "layer_norm", "beta", stream);
  check(y, "layer_norm", "y", stream);
  check_same(gamma, beta, "layer_norm");
  check_same(x, y, "layer_norm");
  if (!(eps > 0)) throw Error(Errc::invalid_argument, "layer_norm: eps " + std::to_string(eps) + " (expected > 0)");
  std::int64_t const n = x.dim(0);
  visit(x.dtype(), [&]<class T>(T) {
    detail::LayerNormRow<T> const op{ptr<T>(x), ptr<T>(gamma), ptr<T>(beta), ptr<T>(y), ptr<float>(stats), ptr<float>(stats) + n, x.dim(1), eps};
    run_each(stream, n, op, {x, gamma, beta, y, stats});
  });
}

void layer_norm_backward(Tensor const& x, Tensor const& gamma, Tensor const& stats, Tensor const& dy, Tensor const& dx,
                         Tensor const& dgamma, Tensor const& dbeta, Stream& stream, bool accumulate) {
  check_layer_norm(x, gamma, stats, "layer_norm_backward", stream);
  for (auto const& [t, role] : {std::pair{&dy, "dy"}, std::pair{&dx, "dx"}, std::pair{&dgamma, "dgamma"}, std::pair{&dbeta, "dbeta"}})
    check(*t, "layer_norm_backward", role, stream);
  check_same(x, dy, "layer_norm_backward");
  check_same(x, dx, "layer_norm_backward");
  check_same(gamma, dgamma, "layer_norm_backward");
  check_same(gamma, dbeta, "layer_norm_backward");
  std::int64_t const n = x.dim(0);
  std::int64_t const d = x.dim(1);
  float const* mean = ptr<float>(stats);
  float const* rstd = mean + n;
  visit(x.dtype(), [&]<class T>(T) {
    run_each(stream, n, detail::LayerNormGradRow<T>{ptr<T>(x), ptr<T>(gamma), ptr<T>(dy), mean, rstd, ptr<T>(dx), d},
             {x, gamma, stats, dy, dx});
    run_each(stream, d, detail::LayerNormParamGradCol<T>{ptr<T>(x), ptr<T>(dy), mean, rstd, ptr<T>(dgamma), ptr<T>(dbeta), n, d, accumulate},
             {x, stats, dy, dgamma, dbeta});
  });
}

namespace {
void dropout_op(char const* op, Tensor const& x, Tensor const& y, float p, std::uint64_t seed, std::int64_t offset, Stream& stream) {
  check(x, op, "input", stream);
  check(y, op, "output", stream);
  check_same(x, y, op);
  if (!(p >= 0.0f && p < 1.0f)) throw Error(Errc::invalid_argument, std::string(op) + ": p " + std::to_string(p) + " (expected 0 <= p < 1)");
  if (offset < 0) throw Error(Errc::invalid_argument, std::string(op) + ": offset " + std::to_string(offset) + " (expected >= 0)");
  visit(x.dtype(), [&]<class T>(T) {
    run_each(stream, x.numel(), detail::DropoutOp<T>{ptr<T>(x), ptr<T>(y), seed, 1.0f - p, static_cast<std::uint64_t>(offset)}, {x, y});
  });
}
}  // namespace

void dropout(Tensor const& x, Tensor const& y, float p, std::uint64_t seed, Stream& stream, std::int64_t offset) {
  dropout_op("dropout", x, y, p, seed, offset, stream);
}
void dropout_backward(Tensor const& dy, Tensor const& dx, float p, std::uint64_t seed, Stream& stream, std::int64_t offset) {
  dropout_op("dropout_backward", dy, dx, p, seed, offset, stream);
}

namespace {
// Fails the stream, with the first bad row, unless every label is a class id in [0, c).
void fail_on_bad_label(char const* op, Tensor const& labels, std::int64_t n, std::int64_t c, Stream& stream) {
  auto const bad_label = [op, c](float label, std::int64_t row) {
    return Error(Errc::invalid_argument, std::string(op) + ": label " + std::to_string(label) + " in row " + std::to_string(row) +
                                             " (expected a class id in [0, " + std::to_string(c) + "))");
  };
  if (stream.device().kind == DeviceKind::host) {
    stream.enqueue([labels, n, c, bad_label] {
      float const* y = ptr<float>(labels);
      for (std::int64_t i = 0; i < n; ++i) {
        auto const label = static_cast<std::int64_t>(y[i]);
        if (!(y[i] >= 0.0f) || label >= c || static_cast<float>(label) != y[i]) throw bad_label(y[i], i);
      }
    });
  } else {
#if MGPU_CUDA_ENABLED
    // The GPU finds the first bad row; a host callback reads it back and fails the stream with the
    // host's error.
    auto found = std::make_shared<Buffer>(mgpu::detail::host_staging_allocator().allocate_pinned(sizeof(std::uint64_t)));
    {
      // Its kernel and its copy into `found`, also when a later step of the search fails.
      mgpu::detail::ReleaseAfterOnExit const release(stream, labels, *found);
      kernels::find_bad_label(stream.device().index, ptr<float>(labels), n, c, static_cast<std::uint64_t*>(found->data()),
                              stream.native_handle());
    }
    stream.enqueue([found, bad_label] {
      std::uint64_t const code = *static_cast<std::uint64_t const*>(found->data());
      if (code == ~std::uint64_t{0}) return;
      throw bad_label(std::bit_cast<float>(static_cast<std::uint32_t>(code)), static_cast<std::int64_t>(code >> 32));
    });
#endif
  }
}
}  // namespace

void softmax_cross_entropy(Tensor const& logits, Tensor const& labels, Tensor const& dlogits, Tensor const& loss, Stream& stream,
                           float grad_scale) {
  char const* op = "softmax_cross_entropy";
  check(logits, op, "logits", stream);
  check(labels, op, "labels", stream);
  check(dlogits, op, "dlogits", stream);
  check_scalar(loss, op, stream);
  check_same(logits, dlogits, op);
  check_dtype(labels, DType::float32, op, "labels");
  if (logits.rank() != 2 || labels.numel() != logits.dim(0) || logits.dim(1) < 1)
    throw Error(Errc::invalid_argument, std::string(op) + ": logits " + to_string(logits.shape()) + ", labels " +
                                            to_string(labels.shape()) + " (expected logits [N, C] with C >= 1 and N labels)");
  std::int64_t const n = logits.dim(0);
  std::int64_t const c = logits.dim(1);
  fail_on_bad_label(op, labels, n, c, stream);
  float const mean = n > 0 ? 1.0f / static_cast<float>(n) : 0.0f;
  visit(logits.dtype(), [&]<class T>(T) {
    detail::SoftmaxCrossEntropyRow<T> const row{ptr<T>(logits), ptr<float>(labels), ptr<T>(dlogits), c, grad_scale * mean};
    run_reduce(stream, n, row, loss, mean, {logits, labels, dlogits});
  });
}


void mse(Tensor const& pred, Tensor const& target, Tensor const& dpred, Tensor const& loss, Stream& stream, float grad_scale) {
  check(pred, "mse", "pred", stream);
  check(target, "mse", "target", stream);
  check(dpred, "mse", "dpred", stream);
  check_scalar(loss, "mse", stream);
  check_same(pred, target, "mse");
  check_same(pred, dpred, "mse");
  float const mean = 1.0f / static_cast<float>(std::max<std::int64_t>(1, pred.numel()));
  visit(pred.dtype(), [&]<class T>(T) {
    run_reduce(stream, pred.numel(), detail::SquaredErrorOp<T>{ptr<T>(pred), ptr<T>(target), ptr<T>(dpred), grad_scale * mean}, loss,
               mean, {pred, target, dpred});
  });
}

void count_correct(Tensor const& logits, Tensor const& labels, Tensor const& out, Stream& stream) {
  check(logits, "count_correct", "logits", stream);
  check(labels, "count_correct", "labels", stream);
  check_scalar(out, "count_correct", stream);
  check_dtype(labels, DType::float32, "count_correct", "labels");
  if (logits.rank() != 2 || labels.numel() != logits.dim(0))
    throw Error(Errc::invalid_argument, "count_correct: logits " + to_string(logits.shape()) + ", labels " + to_string(labels.shape()) +
                                            " (expected logits [N, C] and N labels)");
  fail_on_bad_label("count_correct", labels, logits.dim(0), logits.dim(1), stream);
  visit(logits.dtype(), [&]<class T>(T) {
    run_reduce(stream, logits.dim(0), detail::CorrectRow<T>{ptr<T>(logits), ptr<float>(labels), logits.dim(1)}, out, 1.0f, {logits, labels});
  });
}

namespace {
template <template <class> class Op>
void reduction(char const* op, Tensor const& t, Tensor const& out, Stream& stream) {
  check(t, op, "input", stream);
  check_scalar(out, op, stream);
  visit(t.dtype(), [&]<class T>(T) { run_reduce(stream, t.numel(), Op<T>{ptr<T>(t)}, out, 1.0f, {t}); });
}
}  // namespace

void sum(Tensor const& t, Tensor const& out, Stream& stream) { reduction<detail::ValueOp>("sum", t, out, stream); }
void sum_squares(Tensor const& t, Tensor const& out, Stream& stream) { reduction<detail::SquareOp>("sum_squares", t, out, stream); }
void count_nonfinite(Tensor const& t, Tensor const& out, Stream& stream) {
  reduction<detail::NonFiniteOp>("count_nonfinite", t, out, stream);
}

namespace {
void check_buffers(char const* op, std::initializer_list<Tensor const*> buffers, Stream const& stream) {
  Tensor const& first = **buffers.begin();
  for (Tensor const* t : buffers) {
    check(*t, op, "buffer", stream);
    check_dtype(*t, DType::float32, op, "buffer");
    check_same(first, *t, op);
  }
}
}  // namespace

void sgd_update(Tensor const& params, Tensor const& grads, Tensor const& velocity, float lr, float momentum, float weight_decay,
                bool nesterov, Stream& stream) {
  check_buffers("sgd_update", {&params, &grads, &velocity}, stream);
  detail::SgdOp const op{ptr<float>(params), ptr<float>(grads), ptr<float>(velocity), lr, momentum, weight_decay, nesterov};
  run_each(stream, params.numel(), op, {params, grads, velocity});
}

void adamw_update(Tensor const& params, Tensor const& grads, Tensor const& m, Tensor const& v, float lr, float beta1, float beta2,
                  float eps, float weight_decay, std::int64_t step, Stream& stream) {
  check_buffers("adamw_update", {&params, &grads, &m, &v}, stream);
  if (step < 1) throw Error(Errc::invalid_argument, "adamw_update: step " + std::to_string(step) + " (expected >= 1)");
  float const bias1 = 1.0f - std::pow(beta1, static_cast<float>(step));
  float const bias2 = 1.0f - std::pow(beta2, static_cast<float>(step));
  detail::AdamWOp const op{ptr<float>(params), ptr<float>(grads), ptr<float>(m), ptr<float>(v), lr, beta1, beta2, eps, weight_decay, bias1, bias2};
  run_each(stream, params.numel(), op, {params, grads, m, v});
}

void scale(Tensor const& t, float factor, Stream& stream) {
  check(t, "scale", "t", stream);
  visit(t.dtype(), [&]<class T>(T) { run_each(stream, t.numel(), detail::ScaleOp<T>{ptr<T>(t), factor}, {t}); });
}

void scale_convert(Tensor const& dst, Tensor const& src, float factor, Stream& stream) {
  check(dst, "scale_convert", "dst", stream);
  check(src, "scale_convert", "src", stream);
  if (dst.numel() != src.numel())
    throw Error(Errc::invalid_argument, "scale_convert: dst " + to_string(dst.shape()) + " and src " + to_string(src.shape()) +
                                            " (expected the same number of elements)");
  visit(dst.dtype(), [&]<class D>(D) {
    visit(src.dtype(), [&]<class S>(S) {
      run_each(stream, dst.numel(), detail::ScaleConvertOp<D, S>{ptr<D>(dst), ptr<S>(src), factor}, {dst, src});
    });
  });
}

void add_scaled(Tensor const& dst, Tensor const& src, float factor, Stream& stream) {
  check(dst, "add_scaled", "dst", stream);
  check(src, "add_scaled", "src", stream);
  if (dst.numel() != src.numel())
    throw Error(Errc::invalid_argument, "add_scaled: dst " + to_string(dst.shape()) + " and src " + to_string(src.shape()) +
                                            " (expected the same number of elements)");
  visit(dst.dtype(), [&]<class D>(D) {
    visit(src.dtype(), [&]<class S>(S) {
      run_each(stream, dst.numel(), detail::AddScaledOp<D, S>{ptr<D>(dst), ptr<S>(src), factor}, {dst, src});
    });
  });
}

float item(Tensor const& t, Stream& stream) {
  if (!t.defined() || t.numel() != 1 || t.dtype() != DType::float32)
    throw Error(Errc::invalid_argument, "item: tensor " + (t.defined() ? to_string(t.shape()) + " " + str(t.dtype()) : std::string("undefined")) +
                                            " (expected one float32 element)");
  if (t.device().kind == DeviceKind::host) {
    stream.synchronize();
    return *ptr<float>(t);
  }
  Tensor h = Tensor::empty(t.shape(), DType::float32, mgpu::detail::host_staging_allocator());
  copy_async(h, t, stream);
  stream.synchronize();
  return *ptr<float>(h);
}

Tensor zeros(Shape shape, Allocator& allocator, Stream& stream) {
  Tensor z = Tensor::empty(std::move(shape), DType::float32, allocator);
  fill_async(z, 0.0f, stream);
  return z;
}

}  // namespace mgpu::ops
