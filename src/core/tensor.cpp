// Tensor storage, views, and copies between host and device memory.
#include <mgpu/core/tensor.hpp>

#include <cstring>
#include <limits>
#include <utility>

#include <mgpu/core/detail/elementwise.hpp>

#include "core/backend.hpp"
#include "core/convert_kernels.hpp"
#include "core/cuda_backend.hpp"

namespace mgpu {
namespace {

std::int64_t checked_numel(Shape const& shape) {
  std::int64_t count = 1;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0)
      throw Error(Errc::invalid_argument, "tensor shape " + to_string(shape) + " has extent " +
                                              std::to_string(shape[i]) + " in dimension " + std::to_string(i) +
                                              " (expected extents >= 0)");
    if (shape[i] != 0 && count > std::numeric_limits<std::int64_t>::max() / 8 / shape[i])
      throw Error(Errc::invalid_argument, "tensor shape " + to_string(shape) + " has too many elements");
    count *= shape[i];
  }
  return count;
}

void check_same_layout(Tensor const& dst, Tensor const& src, char const* operation) {
  if (!dst.defined() || !src.defined())
    throw Error(Errc::invalid_argument, std::string(operation) + " got an undefined tensor (expected tensors made by Tensor::empty)");
  if (dst.shape() != src.shape())
    throw Error(Errc::invalid_argument, std::string(operation) + ": destination shape " + to_string(dst.shape()) +
                                            " differs from source shape " + to_string(src.shape()) +
                                            " (expected equal shapes)");
}

bool on_host(Tensor const& t) { return t.device().kind == DeviceKind::host; }

void staging_copy_to_device(Tensor const& dst, Tensor const& src, Stream& stream) {
  std::size_t const bytes = src.nbytes();
  auto staging = std::make_shared<Buffer>(detail::host_staging_allocator().allocate_pinned(bytes));
  stream.enqueue([staging, from = src.data(), keep = src.keep_alive(), bytes] { std::memcpy(staging->data(), from, bytes); });
  detail::cuda::memcpy_async(stream.device().index, dst.data(), staging->data(), bytes, stream.native_handle());
  detail::release_after(stream, *staging, dst);
}

void staging_copy_to_host(Tensor const& dst, Tensor const& src, Stream& stream) {
  std::size_t const bytes = src.nbytes();
  auto staging = std::make_shared<Buffer>(detail::host_staging_allocator().allocate_pinned(bytes));
  detail::cuda::memcpy_async(stream.device().index, staging->data(), src.data(), bytes, stream.native_handle());
  detail::release_after(stream, src);
  stream.enqueue([staging, to = dst.data(), keep_dst = dst.keep_alive(), bytes] {
    std::memcpy(to, staging->data(), bytes);
  });
}

}  // namespace

std::string to_string(Shape const& shape) {
  std::string text = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

Tensor::Tensor(Buffer storage, Shape shape, DType dtype, Device device)
    : storage_(std::make_shared<Buffer>(std::move(storage))), device_(device), shape_(std::move(shape)), dtype_(dtype) {}

Tensor Tensor::empty(Shape shape, DType dtype, Allocator& allocator) {
  std::size_t const bytes = static_cast<std::size_t>(checked_numel(shape)) * size_of(dtype);
  return Tensor(allocator.allocate(bytes), std::move(shape), dtype, allocator.device());
}

Tensor Tensor::empty(Shape shape, DType dtype, Allocator& allocator, Stream& stream) {
  Tensor t;
  std::int64_t const count = checked_numel(shape);
  t.storage_ = std::make_shared<Buffer>(allocator.allocate(static_cast<std::size_t>(count) * size_of(dtype), stream));
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  t.device_ = allocator.device();
  return t;
}

Tensor Tensor::empty_pinned(Shape shape, DType dtype, Allocator& allocator) {
  std::size_t const bytes = static_cast<std::size_t>(checked_numel(shape)) * size_of(dtype);
  return Tensor(allocator.allocate_pinned(bytes), std::move(shape), dtype, Device{DeviceKind::host, 0});
}

std::int64_t Tensor::dim(std::int64_t d) const {
  if (d < 0 || d >= rank())
    throw Error(Errc::invalid_argument, "dimension " + std::to_string(d) + " of a tensor of shape " + to_string(shape_) +
                                            " (expected a dimension in [0, " + std::to_string(rank()) + "))");
  return shape_[static_cast<std::size_t>(d)];
}

std::int64_t Tensor::numel() const noexcept {
  std::int64_t count = 1;
  for (std::int64_t extent : shape_) count *= extent;
  return count;
}

bool Tensor::pinned() const noexcept { return storage_ != nullptr && storage_->pinned(); }

void* Tensor::data() const noexcept {
  if (storage_ == nullptr || storage_->data() == nullptr) return nullptr;
  return static_cast<char*>(storage_->data()) + offset_;
}

void Tensor::check_host_access(DType requested) const {
  if (requested != dtype_)
    throw Error(Errc::invalid_argument, "host_span<" + std::string(mgpu::to_string(requested)) + "> of a " +
                                            std::string(mgpu::to_string(dtype_)) + " tensor (expected the tensor's own dtype)");
  if (device_.kind != DeviceKind::host)
    throw Error(Errc::invalid_argument, "host_span of a tensor on " + device_.to_string() +
                                            " (expected a host tensor; copy it to host memory first)");
}

Tensor Tensor::slice(std::int64_t begin, std::int64_t end) const {
  if (shape_.empty())
    throw Error(Errc::invalid_argument, "slice of a 0-d tensor (expected a tensor with at least one dimension)");
  if (begin < 0 || begin > end || end > shape_[0])
    throw Error(Errc::invalid_argument, "slice [" + std::to_string(begin) + ", " + std::to_string(end) +
                                            ") of a tensor of shape " + to_string(shape_) + " (expected 0 <= begin <= end <= " +
                                            std::to_string(shape_[0]) + ")");
  Tensor view = *this;
  std::size_t const row_bytes = shape_[0] == 0 ? 0 : nbytes() / static_cast<std::size_t>(shape_[0]);
  view.offset_ += static_cast<std::size_t>(begin) * row_bytes;
  view.shape_[0] = end - begin;
  return view;
}

Tensor Tensor::reshape(Shape shape) const {
  std::int64_t const count = checked_numel(shape);
  if (count != numel())
    throw Error(Errc::invalid_argument, "reshape of " + to_string(shape_) + " (" + std::to_string(numel()) + " elements) to " +
                                            to_string(shape) + " (" + std::to_string(count) + ") (expected the same number of elements)");
  Tensor view = *this;
  view.shape_ = std::move(shape);
  return view;
}

void copy_async(Tensor const& dst, Tensor const& src, Stream& stream) {
  check_same_layout(dst, src, "copy_async");
  if (dst.dtype() != src.dtype())
    throw Error(Errc::invalid_argument, "copy_async from " + std::string(to_string(src.dtype())) + " to " +
                                            std::string(to_string(dst.dtype())) +
                                            " (expected equal dtypes; use convert_async to convert)");
  std::size_t const bytes = src.nbytes();
  if (on_host(dst) && on_host(src)) {
    if (bytes == 0) return;
    detail::enqueue_using(stream, [to = dst.data(), from = src.data(), bytes] { std::memcpy(to, from, bytes); }, dst, src);
    return;
  }
  Device const s = stream.device();
  bool const stream_fits = s.kind == DeviceKind::cuda && (s == dst.device() || s == src.device());
  if (!stream_fits)
    throw Error(Errc::invalid_argument, "copy_async from " + src.device().to_string() + " to " + dst.device().to_string() +
                                            " on a stream of " + s.to_string() +
                                            " (expected a CUDA stream of the source or destination GPU)");
  if (bytes == 0) return;
  if (on_host(src) && !src.pinned()) {
    staging_copy_to_device(dst, src, stream);
  } else if (on_host(dst) && !dst.pinned()) {
    staging_copy_to_host(dst, src, stream);
  } else {
    detail::cuda::memcpy_async(s.index, dst.data(), src.data(), bytes, stream.native_handle());
    detail::release_after(stream, dst, src);
  }
}

void convert_async(Tensor const& dst, Tensor const& src, Stream& stream) {
  if (!dst.defined() || !src.defined())
    throw Error(Errc::invalid_argument, "convert_async got an undefined tensor (expected tensors made by Tensor::empty)");
  if (dst.numel() != src.numel())
    throw Error(Errc::invalid_argument, "convert_async from " + to_string(src.shape()) + " to " + to_string(dst.shape()) +
                                            " (expected the same number of elements)");
  Device const s = stream.device();
  bool const same_device = s.kind == DeviceKind::host ? on_host(dst) && on_host(src) : dst.device() == s && src.device() == s;
  if (!same_device)
    throw Error(Errc::invalid_argument, "convert_async from " + src.device().to_string() + " to " + dst.device().to_string() +
                                            " on a stream of " + s.to_string() + " (expected both tensors on the stream's device)");
  std::int64_t const count = src.numel();
  if (count == 0) return;
  if (s.kind == DeviceKind::host) {
    detail::visit_dtype(dst.dtype(), [&]<class D>(std::type_identity<D>) {
      detail::visit_dtype(src.dtype(), [&]<class S>(std::type_identity<S>) {
        detail::ConvertOp<D, S> const op{static_cast<D*>(dst.data()), static_cast<S const*>(src.data())};
        detail::enqueue_using(stream, [op, count] { detail::for_each_index(count, op); }, dst, src);
      });
    });
  } else {
    kernels::convert_async(s.index, dst.data(), dst.dtype(), src.data(), src.dtype(), count, stream.native_handle());
    detail::release_after(stream, dst, src);
  }
}

void fill_async(Tensor const& dst, float value, Stream& stream) {
  if (!dst.defined()) throw Error(Errc::invalid_argument, "fill_async got an undefined tensor (expected a tensor made by Tensor::empty)");
  Device const s = stream.device();
  bool const same_device = s.kind == DeviceKind::host ? on_host(dst) : dst.device() == s;
  if (!same_device)
    throw Error(Errc::invalid_argument, "fill_async of a tensor on " + dst.device().to_string() + " on a stream of " +
                                            s.to_string() + " (expected the tensor on the stream's device)");
  std::int64_t const count = dst.numel();
  if (count == 0) return;
  if (s.kind == DeviceKind::host) {
    detail::visit_dtype(dst.dtype(), [&]<class T>(std::type_identity<T>) {
      detail::FillOp<T> const op{static_cast<T*>(dst.data()), T(value)};
      detail::enqueue_using(stream, [op, count] { detail::for_each_index(count, op); }, dst);
    });
  } else {
    kernels::fill_async(s.index, dst.data(), dst.dtype(), value, count, stream.native_handle());
    detail::release_after(stream, dst);
  }
}

}  // namespace mgpu
