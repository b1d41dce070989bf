// Reductions of a tensor to one float32 (sum, sum of squares, non-finite count) and item().
#include <mgpu/ops/ops.hpp>

#include <string>

#include "core/backend.hpp"
#include "ops/op_support.hpp"

namespace mgpu::ops {

namespace {
template <template <class> class Op>
void reduction(char const* op, Tensor const& t, Tensor const& out, Stream& stream) {
  check(t, op, "input", stream);
  check_scalar(out, op, stream);
  visit(t.dtype(), [&]<class T>(T) {
    run_reduce(stream, HostOpFamily::elementwise, t.numel(), Op<T>{ptr<T>(t)}, out, 1.0f, {t});
  });
}
}  // namespace

void sum(Tensor const& t, Tensor const& out, Stream& stream) { reduction<detail::ValueOp>("sum", t, out, stream); }
void sum_squares(Tensor const& t, Tensor const& out, Stream& stream) { reduction<detail::SquareOp>("sum_squares", t, out, stream); }
void count_nonfinite(Tensor const& t, Tensor const& out, Stream& stream) {
  reduction<detail::NonFiniteOp>("count_nonfinite", t, out, stream);
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

}  // namespace mgpu::ops
