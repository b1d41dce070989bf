// Tensors: typed, shaped, contiguous row-major views of device memory, and copies between them.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <mgpu/core/device.hpp>
#include <mgpu/core/dtype.hpp>
#include <mgpu/core/error.hpp>
#include <mgpu/core/memory.hpp>
#include <mgpu/core/stream.hpp>

namespace mgpu {

/// A tensor's extents, outermost first.
using Shape = std::vector<std::int64_t>;

/// "[4, 3]".
std::string to_string(Shape const& shape);

/// A contiguous row-major tensor. Copying a Tensor copies the handle, not the data (like a
/// shared_ptr); slice() gives views that share storage. The storage is freed when the last handle
/// goes. Handles are not synchronized: share one across threads only for reading.
class Tensor {
 public:
  Tensor() = default;

  /// An uninitialised tensor in `allocator`'s device memory. Throws Error(invalid_argument) for a
  /// negative extent and Error(out_of_memory) when the device has no room.
  static Tensor empty(Shape shape, DType dtype, Allocator& allocator);
  /// The same for work enqueued on `stream` (Allocator::allocate(bytes, stream)): its storage may
  /// be a block that earlier work on `stream` still uses, so other streams and the host touch it
  /// only after waiting for `stream`.
  static Tensor empty(Shape shape, DType dtype, Allocator& allocator, Stream& stream);
  /// An uninitialised host tensor in pinned memory (allocator.allocate_pinned()), the fastest
  /// source and destination of copies to and from a GPU.
  static Tensor empty_pinned(Shape shape, DType dtype, Allocator& allocator);

  [[nodiscard]] DType dtype() const noexcept { return dtype_; }
  [[nodiscard]] Shape const& shape() const noexcept { return shape_; }
  [[nodiscard]] Device device() const noexcept { return device_; }
  [[nodiscard]] std::int64_t rank() const noexcept { return static_cast<std::int64_t>(shape_.size()); }
  /// Extent of dimension `dim`; throws Error(invalid_argument) when out of range.
  [[nodiscard]] std::int64_t dim(std::int64_t dim) const;
  [[nodiscard]] std::int64_t numel() const noexcept;
  [[nodiscard]] std::size_t nbytes() const noexcept { return static_cast<std::size_t>(numel()) * size_of(dtype_); }
  /// True when this tensor sits in pinned host memory.
  [[nodiscard]] bool pinned() const noexcept;
  [[nodiscard]] bool defined() const noexcept { return storage_ != nullptr; }

  [[nodiscard]] void* data() const noexcept;

  /// Host-side typed access: T must match dtype() and the device must be a host device.
  template <Storable T>
  [[nodiscard]] std::span<T> host_span() const {
    check_host_access(dtype_of<T>);
    return {static_cast<T*>(data()), static_cast<std::size_t>(numel())};
  }

  /// Rows [begin, end) of the first dimension, as a view sharing this tensor's storage.
  /// Throws Error(invalid_argument) for a 0-d tensor or a range outside [0, dim(0)].
  [[nodiscard]] Tensor slice(std::int64_t begin, std::int64_t end) const;

  /// The same elements viewed with another shape of the same number of elements (no copy).
  /// Throws Error(invalid_argument) when the element counts differ.
  [[nodiscard]] Tensor reshape(Shape shape) const;

  /// True when both tensors view the same allocation.
  [[nodiscard]] bool shares_storage(Tensor const& other) const noexcept {
    return storage_ != nullptr && storage_ == other.storage_;
  }

  /// Keeps the storage alive (for work enqueued on a stream that reads or writes it).
  [[nodiscard]] std::shared_ptr<void const> keep_alive() const noexcept { return storage_; }

 private:
  /// A tensor over all of `storage` (empty() and empty_pinned(): their shape is checked first).
  Tensor(Buffer storage, Shape shape, DType dtype, Device device);
  void check_host_access(DType requested) const;
  friend struct detail::BufferInternals;
  std::shared_ptr<Buffer> storage_;
  std::size_t offset_ = 0;  // bytes from the start of storage_
  Device device_{};
  Shape shape_;
  DType dtype_ = DType::float32;
};

/// Enqueues dst = src on `stream`. Shapes and dtypes must match (Error(invalid_argument)
/// otherwise). Host-to-host copies run on a host stream; copies that touch CUDA memory run on a
/// CUDA stream of one of the two devices (peer copies between GPUs, pageable host memory staged
/// through pinned buffers). Both tensors are kept alive until the copy has run.
void copy_async(Tensor const& dst, Tensor const& src, Stream& stream);

/// Enqueues dst = src converted to dst's element type (round to nearest even). Both tensors must
/// be on the stream's device and have the same number of elements.
void convert_async(Tensor const& dst, Tensor const& src, Stream& stream);

/// Enqueues dst[i] = value (rounded to dst's element type) on the stream of dst's device.
void fill_async(Tensor const& dst, float value, Stream& stream);

}  // namespace mgpu
