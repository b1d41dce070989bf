// In-place updates of float buffers: the optimizer steps (SGD, AdamW), scaling, converting and
// accumulating copies, column copies, and zeros().
#include <mgpu/ops/ops.hpp>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "ops/op_support.hpp"

namespace mgpu::ops {

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
  run_each(stream, HostOpFamily::optimizer, params.numel(), op, {params, grads, velocity});
}

void adamw_update(Tensor const& params, Tensor const& grads, Tensor const& m, Tensor const& v, float lr, float beta1, float beta2,
                  float eps, float weight_decay, std::int64_t step, Stream& stream) {
  check_buffers("adamw_update", {&params, &grads, &m, &v}, stream);
  if (step < 1) throw Error(Errc::invalid_argument, "adamw_update: step " + std::to_string(step) + " (expected >= 1)");
  float const bias1 = 1.0f - std::pow(beta1, static_cast<float>(step));
  float const bias2 = 1.0f - std::pow(beta2, static_cast<float>(step));
  detail::AdamWOp const op{ptr<float>(params), ptr<float>(grads), ptr<float>(m), ptr<float>(v), lr, beta1, beta2, eps, weight_decay, bias1, bias2};
  run_each(stream, HostOpFamily::optimizer, params.numel(), op, {params, grads, m, v});
}

void scale(Tensor const& t, float factor, Stream& stream) {
  check(t, "scale", "t", stream);
  visit(t.dtype(), [&]<class T>(T) {
    run_each(stream, HostOpFamily::elementwise, t.numel(), detail::ScaleOp<T>{ptr<T>(t), factor}, {t});
  });
}

void scale_convert(Tensor const& dst, Tensor const& src, float factor, Stream& stream) {
  check(dst, "scale_convert", "dst", stream);
  check(src, "scale_convert", "src", stream);
  if (dst.numel() != src.numel())
    throw Error(Errc::invalid_argument, "scale_convert: dst " + to_string(dst.shape()) + " and src " + to_string(src.shape()) +
                                            " (expected the same number of elements)");
  visit(dst.dtype(), [&]<class D>(D) {
    visit(src.dtype(), [&]<class S>(S) {
      run_each(stream, HostOpFamily::elementwise, dst.numel(),
               detail::ScaleConvertOp<D, S>{ptr<D>(dst), ptr<S>(src), factor}, {dst, src});
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
      run_each(stream, HostOpFamily::elementwise, dst.numel(),
               detail::AddScaledOp<D, S>{ptr<D>(dst), ptr<S>(src), factor}, {dst, src});
    });
  });
}

void copy_columns(Tensor const& src, std::int64_t src_column, Tensor const& dst, std::int64_t dst_column,
                  std::int64_t columns, Stream& stream) {
  check(src, "copy_columns", "src", stream);
  check(dst, "copy_columns", "dst", stream);
  check_dtype(dst, src.dtype(), "copy_columns", "dst");
  std::int64_t const a = src.shape().empty() ? 0 : src.shape().back();
  std::int64_t const b = dst.shape().empty() ? 0 : dst.shape().back();
  std::int64_t const rows = a > 0 ? src.numel() / a : 0;
  if (a < 1 || b < 1 || dst.numel() / b != rows)
    throw Error(Errc::invalid_argument, "copy_columns: src " + to_string(src.shape()) + " and dst " +
                                            to_string(dst.shape()) +
                                            " (expected [..., a] and [..., b] with as many rows)");
  if (columns < 0 || src_column < 0 || dst_column < 0 || src_column + columns > a || dst_column + columns > b)
    throw Error(Errc::invalid_argument, "copy_columns: " + std::to_string(columns) + " columns from " +
                                            std::to_string(src_column) + " of " + std::to_string(a) + " to " +
                                            std::to_string(dst_column) + " of " + std::to_string(b) +
                                            " (expected blocks inside both)");
  if (rows * columns == 0) return;
  visit(src.dtype(), [&]<class T>(T) {
    run_each(stream, HostOpFamily::elementwise, rows * columns,
             detail::CopyColumnsOp<T>{ptr<T>(src), ptr<T>(dst), a, src_column, b, dst_column, columns}, {src, dst});
  });
}

Tensor zeros(Shape shape, Allocator& allocator, Stream& stream) {
  Tensor z = Tensor::empty(std::move(shape), DType::float32, allocator);
  fill_async(z, 0.0f, stream);
  return z;
}

}  // namespace mgpu::ops
