// Element-wise activations (ReLU, GELU) and dropout, forward and backward.
#include <mgpu/ops/ops.hpp>

#include <cstdint>
#include <string>

#include "ops/op_support.hpp"

namespace mgpu::ops {

char const* activation_name(ActivationKind kind) noexcept {
  switch (kind) {
    case ActivationKind::identity: return "identity";
    case ActivationKind::relu: return "relu";
    case ActivationKind::gelu: return "gelu";
  }
  return "unknown";
}

namespace {
template <class F>
void activation(char const* op, Tensor const& x, Tensor const& y, Stream& stream) {
  check(x, op, "x", stream);
  check(y, op, "y", stream);
  check_same(x, y, op);
  visit(x.dtype(), [&]<class T>(T) {
    run_each(stream, HostOpFamily::activation, x.numel(), detail::ActivationOp<T, F>{ptr<T>(x), ptr<T>(y)}, {x, y});
  });
}

template <class F>
void activation_grad(char const* op, Tensor const& x, Tensor const& dy, Tensor const& dx, Stream& stream) {
  check(x, op, "x", stream);
  check(dy, op, "dy", stream);
  check(dx, op, "dx", stream);
  check_same(x, dy, op);
  check_same(x, dx, op);
  visit(x.dtype(), [&]<class T>(T) {
    run_each(stream, HostOpFamily::activation, x.numel(),
             detail::ActivationGradOp<T, F>{ptr<T>(x), ptr<T>(dy), ptr<T>(dx)}, {x, dy, dx});
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
void dropout_op(char const* op, Tensor const& x, Tensor const& y, float p, std::uint64_t seed, std::int64_t offset, Stream& stream) {
  check(x, op, "input", stream);
  check(y, op, "output", stream);
  check_same(x, y, op);
  if (!(p >= 0.0f && p < 1.0f)) throw Error(Errc::invalid_argument, std::string(op) + ": p " + std::to_string(p) + " (expected 0 <= p < 1)");
  if (offset < 0) throw Error(Errc::invalid_argument, std::string(op) + ": offset " + std::to_string(offset) + " (expected >= 0)");
  visit(x.dtype(), [&]<class T>(T) {
    run_each(stream, HostOpFamily::activation, x.numel(),
             detail::DropoutOp<T>{ptr<T>(x), ptr<T>(y), seed, 1.0f - p, static_cast<std::uint64_t>(offset)}, {x, y});
  });
}
}  // namespace

void dropout(Tensor const& x, Tensor const& y, float p, std::uint64_t seed, Stream& stream, std::int64_t offset) {
  dropout_op("dropout", x, y, p, seed, offset, stream);
}
void dropout_backward(Tensor const& dy, Tensor const& dx, float p, std::uint64_t seed, Stream& stream, std::int64_t offset) {
  dropout_op("dropout_backward", dy, dx, p, seed, offset, stream);
}

}  // namespace mgpu::ops
