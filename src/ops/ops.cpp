// The training ops on host devices: Eigen maps over tensor storage (no copies), run on the stream.
// CUDA tensors are rejected until the CUDA implementations land.
#include <mgpu/ops/ops.hpp>

#include <Eigen/Core>

#include <cmath>
#include <string>

#include <mgpu/core/error.hpp>
#include <mgpu/ops/detail/math.hpp>

namespace mgpu::ops {
namespace {

using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MatrixMap = Eigen::Map<Matrix>;
using Array = Eigen::Map<Eigen::ArrayXf>;

void check(Tensor const& t, char const* op, char const* role, Stream const& stream) {
  if (!t.defined()) throw Error(Errc::invalid_argument, std::string(op) + ": " + role + " is undefined (expected a tensor)");
  if (t.dtype() != DType::float32)
    throw Error(Errc::invalid_argument, std::string(op) + ": " + role + " is " + std::string(to_string(t.dtype())) +
                                            " (expected float32; convert_async converts)");
  if (t.device().kind != DeviceKind::host || stream.device().kind != DeviceKind::host)
    throw Error(Errc::device, std::string(op) + ": " + role + " on " + t.device().to_string() + " with a stream of " +
                                  stream.device().to_string() + " (these ops run on host devices only so far)");
}

void check_same(Tensor const& a, Tensor const& b, char const* op) {
  if (a.shape() != b.shape())
    throw Error(Errc::invalid_argument, std::string(op) + ": shapes " + to_string(a.shape()) + " and " + to_string(b.shape()) +
                                            " differ (expected equal shapes)");
}

std::int64_t rows(Tensor const& t) { return t.rank() == 0 ? 1 : t.dim(0); }
std::int64_t cols(Tensor const& t) { return t.rank() == 0 ? 1 : t.numel() / std::max<std::int64_t>(1, t.dim(0)); }

MatrixMap matrix(Tensor const& t) { return {static_cast<float*>(t.data()), rows(t), cols(t)}; }
Array array(Tensor const& t) { return {static_cast<float*>(t.data()), t.numel()}; }

// Enqueues `work`, keeping the tensors alive until it has run.
template <class Work>
void enqueue(Stream& stream, std::vector<Tensor> keep, Work work) {
  stream.enqueue([keep = std::move(keep), work = std::move(work)] { work(); });
}

}  // namespace

void gemm(Tensor const& a, bool transpose_a, Tensor const& b, bool transpose_b, Tensor const& c, float alpha, float beta,
          Stream& stream) {
  for (auto const& [t, role] : {std::pair{&a, "A"}, std::pair{&b, "B"}, std::pair{&c, "C"}}) {
    check(*t, "gemm", role, stream);
    if (t->rank() != 2) throw Error(Errc::invalid_argument, std::string("gemm: ") + role + " has shape " + to_string(t->shape()) + " (expected 2-D)");
  }
  std::int64_t const m = transpose_a ? a.dim(1) : a.dim(0);
  std::int64_t const k = transpose_a ? a.dim(0) : a.dim(1);
  std::int64_t const k2 = transpose_b ? b.dim(1) : b.dim(0);
  std::int64_t const n = transpose_b ? b.dim(0) : b.dim(1);
  if (k != k2 || c.dim(0) != m || c.dim(1) != n)
    throw Error(Errc::invalid_argument, "gemm: op(A) is [" + std::to_string(m) + ", " + std::to_string(k) + "], op(B) is [" +
                                            std::to_string(k2) + ", " + std::to_string(n) + "], C is " + to_string(c.shape()) +
                                            " (expected [m, k] x [k, n] -> [m, n])");
  enqueue(stream, {a, b, c}, [=] {
    MatrixMap const A = matrix(a);
    MatrixMap const B = matrix(b);
    MatrixMap C = matrix(c);
    if (beta == 0.0f) C.setZero();
    else if (beta != 1.0f) C *= beta;
    if (transpose_a && transpose_b) C.noalias() += alpha * A.transpose() * B.transpose();
    else if (transpose_a) C.noalias() += alpha * A.transpose() * B;
    else if (transpose_b) C.noalias() += alpha * A * B.transpose();
    else C.noalias() += alpha * A * B;
  });
}

void add_bias(Tensor const& y, Tensor const& bias, Stream& stream) {
  check(y, "add_bias", "y", stream);
  check(bias, "add_bias", "bias", stream);
  if (bias.numel() != cols(y))
    throw Error(Errc::invalid_argument, "add_bias: bias has " + std::to_string(bias.numel()) + " elements for y of shape " +
                                            to_string(y.shape()) + " (expected one per column)");
  enqueue(stream, {y, bias}, [=] { matrix(y).rowwise() += Eigen::Map<Eigen::RowVectorXf>(static_cast<float*>(bias.data()), bias.numel()); });
}

void bias_grad(Tensor const& dy, Tensor const& db, Stream& stream) {
  check(dy, "bias_grad", "dy", stream);
  check(db, "bias_grad", "db", stream);
  if (db.numel() != cols(dy))
    throw Error(Errc::invalid_argument, "bias_grad: db has " + std::to_string(db.numel()) + " elements for dy of shape " +
                                            to_string(dy.shape()) + " (expected one per column)");
  enqueue(stream, {dy, db}, [=] {
    Eigen::Map<Eigen::RowVectorXf>(static_cast<float*>(db.data()), db.numel()) = matrix(dy).colwise().sum();
  });
}

namespace {
template <class F>
void unary(char const* op, Tensor const& x, Tensor const& y, Stream& stream, F f) {
  check(x, op, "x", stream);
  check(y, op, "y", stream);
  check_same(x, y, op);
  enqueue(stream, {x, y}, [=] {
    float const* in = static_cast<float const*>(x.data());
    float* out = static_cast<float*>(y.data());
    for (std::int64_t i = 0; i < x.numel(); ++i) out[i] = f(in[i]);
  });
}

template <class F>
void binary_grad(char const* op, Tensor const& x, Tensor const& dy, Tensor const& dx, Stream& stream, F f) {
  check(x, op, "x", stream);
  check(dy, op, "dy", stream);
  check(dx, op, "dx", stream);
  check_same(x, dy, op);
  check_same(x, dx, op);
  enqueue(stream, {x, dy, dx}, [=] {
    float const* in = static_cast<float const*>(x.data());
    float const* g = static_cast<float const*>(dy.data());
    float* out = static_cast<float*>(dx.data());
    for (std::int64_t i = 0; i < x.numel(); ++i) out[i] = f(in[i], g[i]);
  });
}
}  // namespace

void relu(Tensor const& x, Tensor const& y, Stream& stream) { unary("relu", x, y, stream, [](float v) { return detail::relu(v); }); }
void relu_backward(Tensor const& x, Tensor const& dy, Tensor const& dx, Stream& stream) {
  binary_grad("relu_backward", x, dy, dx, stream, [](float v, float g) { return detail::relu_grad(v, g); });
}
void gelu(Tensor const& x, Tensor const& y, Stream& stream) { unary("gelu", x, y, stream, [](float v) { return detail::gelu(v); }); }
void gelu_backward(Tensor const& x, Tensor const& dy, Tensor const& dx, Stream& stream) {
  binary_grad("gelu_backward", x, dy, dx, stream, [](float v, float g) { return detail::gelu_grad(v, g); });
}

void softmax_cross_entropy(Tensor const& logits, Tensor const& labels, Tensor const& dlogits, float* loss, Stream& stream) {
  check(logits, "softmax_cross_entropy", "logits", stream);
  check(labels, "softmax_cross_entropy", "labels", stream);
  check(dlogits, "softmax_cross_entropy", "dlogits", stream);
  check_same(logits, dlogits, "softmax_cross_entropy");
  if (logits.rank() != 2 || labels.numel() != logits.dim(0))
    throw Error(Errc::invalid_argument, "softmax_cross_entropy: logits " + to_string(logits.shape()) + ", labels " +
                                            to_string(labels.shape()) + " (expected logits [N, C] and N labels)");
  enqueue(stream, {logits, labels, dlogits}, [=] {
    std::int64_t const n = logits.dim(0);
    std::int64_t const c = logits.dim(1);
    float const* z = static_cast<float const*>(logits.data());
    float const* y = static_cast<float const*>(labels.data());
    float* dz = static_cast<float*>(dlogits.data());
    double total = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      auto const label = static_cast<std::int64_t>(y[i]);
      if (label < 0 || label >= c || static_cast<float>(label) != y[i])
        throw Error(Errc::invalid_argument, "softmax_cross_entropy: label " + std::to_string(y[i]) + " in row " + std::to_string(i) +
                                                " (expected a class id in [0, " + std::to_string(c) + "))");
      float const* row = z + i * c;
      float const top = *std::max_element(row, row + c);
      double sum = 0;
      for (std::int64_t j = 0; j < c; ++j) sum += std::exp(static_cast<double>(row[j] - top));
      double const log_sum = std::log(sum);
      total += log_sum - (row[label] - top);
      for (std::int64_t j = 0; j < c; ++j) {
        double const p = std::exp(static_cast<double>(row[j] - top) - log_sum);
        dz[i * c + j] = static_cast<float>((p - (j == label ? 1.0 : 0.0)) / static_cast<double>(n));
      }
    }
    *loss = n > 0 ? static_cast<float>(total / static_cast<double>(n)) : 0.0f;
  });
}

void mse(Tensor const& pred, Tensor const& target, Tensor const& dpred, float* loss, Stream& stream) {
  check(pred, "mse", "pred", stream);
  check(target, "mse", "target", stream);
  check(dpred, "mse", "dpred", stream);
  check_same(pred, target, "mse");
  check_same(pred, dpred, "mse");
  enqueue(stream, {pred, target, dpred}, [=] {
    auto const n = static_cast<float>(std::max<std::int64_t>(1, pred.numel()));
    Eigen::ArrayXf const diff = array(pred) - array(target);
    array(dpred) = diff * (2.0f / n);
    *loss = diff.square().sum() / n;
  });
}

void sgd_update(Tensor const& params, Tensor const& grads, Tensor const& velocity, float lr, float momentum, float weight_decay,
                bool nesterov, Stream& stream) {
  for (auto const* t : {&params, &grads, &velocity}) check(*t, "sgd_update", "buffer", stream);
  check_same(params, grads, "sgd_update");
  check_same(params, velocity, "sgd_update");
  enqueue(stream, {params, grads, velocity}, [=] {
    float* p = static_cast<float*>(params.data());
    float const* g = static_cast<float const*>(grads.data());
    float* v = static_cast<float*>(velocity.data());
    for (std::int64_t i = 0; i < params.numel(); ++i) detail::sgd_step(p[i], g[i], v[i], lr, momentum, weight_decay, nesterov);
  });
}

void adamw_update(Tensor const& params, Tensor const& grads, Tensor const& m, Tensor const& v, float lr, float beta1, float beta2,
                  float eps, float weight_decay, std::int64_t step, Stream& stream) {
  for (auto const* t : {&params, &grads, &m, &v}) check(*t, "adamw_update", "buffer", stream);
  check_same(params, grads, "adamw_update");
  check_same(params, m, "adamw_update");
  check_same(params, v, "adamw_update");
  if (step < 1) throw Error(Errc::invalid_argument, "adamw_update: step " + std::to_string(step) + " (expected >= 1)");
  float const bias1 = 1.0f - std::pow(beta1, static_cast<float>(step));
  float const bias2 = 1.0f - std::pow(beta2, static_cast<float>(step));
  enqueue(stream, {params, grads, m, v}, [=] {
    float* p = static_cast<float*>(params.data());
    float const* g = static_cast<float const*>(grads.data());
    float* mm = static_cast<float*>(m.data());
    float* vv = static_cast<float*>(v.data());
    for (std::int64_t i = 0; i < params.numel(); ++i)
      detail::adamw_step(p[i], g[i], mm[i], vv[i], lr, beta1, beta2, eps, weight_decay, bias1, bias2);
  });
}

void scale(Tensor const& t, float factor, Stream& stream) {
  check(t, "scale", "t", stream);
  enqueue(stream, {t}, [=] { array(t) *= factor; });
}

void global_norm(Tensor const& t, float* norm, bool* finite, Stream& stream) {
  check(t, "global_norm", "t", stream);
  enqueue(stream, {t}, [=] {
    Array const a = array(t);
    *finite = a.isFinite().all();
    *norm = static_cast<float>(std::sqrt(a.cast<double>().square().sum()));
  });
}

}  // namespace mgpu::ops
