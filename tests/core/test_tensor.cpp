// Tensors: views, copies, conversion and fill on host devices.
#include <mgpu/core/tensor.hpp>

#include <numeric>

#include "support/catch.hpp"
#include "support/expect_error.hpp"

using mgpu::Device;
using mgpu::DeviceKind;
using mgpu::DType;
using mgpu::Tensor;

TEST_CASE("A tensor knows its shape, size and device", "[core][tensor]") {
  auto allocator = mgpu::Allocator::create(Device{DeviceKind::host, 2});
  Tensor t = Tensor::empty({4, 3}, DType::float32, *allocator);
  CHECK(t.numel() == 12);
  CHECK(t.nbytes() == 48);
  CHECK(t.rank() == 2);
  CHECK(t.dim(1) == 3);
  CHECK(t.device() == Device{DeviceKind::host, 2});
  CHECK(mgpu::to_string(t.shape()) == "[4, 3]");
  REQUIRE_MGPU_ERROR(t.dim(2), mgpu::Errc::invalid_argument, "expected a dimension in [0, 2)");
  REQUIRE_MGPU_ERROR(Tensor::empty({2, -1}, DType::float32, *allocator), mgpu::Errc::invalid_argument,
                     "extent -1 in dimension 1");
  REQUIRE_MGPU_ERROR(t.host_span<mgpu::bfloat16>(), mgpu::Errc::invalid_argument, "host_span<bfloat16> of a float32 tensor");
  Tensor scalar = Tensor::empty({}, DType::float16, *allocator);
  CHECK(scalar.numel() == 1);
  REQUIRE_MGPU_ERROR(scalar.slice(0, 1), mgpu::Errc::invalid_argument, "slice of a 0-d tensor");
}

TEST_CASE("A slice along the first dimension is a view", "[core][tensor]") {
  auto allocator = mgpu::Allocator::create(Device{DeviceKind::host, 0});
  Tensor t = Tensor::empty({5, 2}, DType::float32, *allocator);
  auto all = t.host_span<float>();
  std::iota(all.begin(), all.end(), 0.0f);
  Tensor rows = t.slice(1, 3);
  CHECK(rows.shape() == mgpu::Shape{2, 2});
  CHECK(rows.shares_storage(t));
  CHECK(rows.host_span<float>()[0] == 2.0f);
  rows.host_span<float>()[3] = -1.0f;  // writes through to the original
  CHECK(all[5] == -1.0f);
  CHECK(t.slice(5, 5).numel() == 0);
  CHECK(rows.slice(1, 2).host_span<float>()[0] == 4.0f);  // views of views
  REQUIRE_MGPU_ERROR(t.slice(3, 6), mgpu::Errc::invalid_argument, "expected 0 <= begin <= end <= 5");
  REQUIRE_MGPU_ERROR(t.slice(2, 1), mgpu::Errc::invalid_argument, "slice [2, 1)");
  CHECK(allocator->stats().allocations == 1);  // slicing never allocates
}

TEST_CASE("Host copies run on the stream and keep their tensors alive", "[core][tensor]") {
  auto a0 = mgpu::Allocator::create(Device{DeviceKind::host, 0});
  auto a1 = mgpu::Allocator::create(Device{DeviceKind::host, 1});
  mgpu::Stream stream(Device{DeviceKind::host, 1});
  Tensor dst = Tensor::empty({1000}, DType::float32, *a1);
  {
    Tensor src = Tensor::empty({1000}, DType::float32, *a0);
    auto s = src.host_span<float>();
    std::iota(s.begin(), s.end(), 1.0f);
    copy_async(dst, src, stream);
  }  // src's last handle is gone: the enqueued copy keeps it alive
  stream.synchronize();
  auto d = dst.host_span<float>();
  for (std::size_t i = 0; i < d.size(); ++i) REQUIRE(d[i] == static_cast<float>(i + 1));
  CHECK(a0->stats().allocated == 0);  // released after the copy ran

  Tensor wrong_shape = Tensor::empty({999}, DType::float32, *a0);
  REQUIRE_MGPU_ERROR(copy_async(dst, wrong_shape, stream), mgpu::Errc::invalid_argument, "destination shape [1000] differs from source shape [999]");
  Tensor wrong_type = Tensor::empty({1000}, DType::float16, *a0);
  REQUIRE_MGPU_ERROR(copy_async(dst, wrong_type, stream), mgpu::Errc::invalid_argument, "use convert_async");
  REQUIRE_MGPU_ERROR(copy_async(dst, Tensor{}, stream), mgpu::Errc::invalid_argument, "undefined tensor");
}

TEST_CASE("convert_async rounds like the scalar conversions; fill_async fills", "[core][tensor]") {
  auto allocator = mgpu::Allocator::create(Device{DeviceKind::host, 0});
  mgpu::Stream stream(Device{DeviceKind::host, 0});
  Tensor src = Tensor::empty({257}, DType::float32, *allocator);
  auto s = src.host_span<float>();
  for (std::size_t i = 0; i < s.size(); ++i) s[i] = 0.1f * static_cast<float>(i) - 7.3f;
  Tensor half = Tensor::empty({257}, DType::float16, *allocator);
  Tensor brain = Tensor::empty({257}, DType::bfloat16, *allocator);
  Tensor back = Tensor::empty({257}, DType::float32, *allocator);
  convert_async(half, src, stream);
  convert_async(brain, src, stream);
  convert_async(back, half, stream);
  stream.synchronize();
  for (std::size_t i = 0; i < s.size(); ++i) {
    REQUIRE(half.host_span<mgpu::float16>()[i].bits == mgpu::float_to_float16_bits(s[i]));
    REQUIRE(brain.host_span<mgpu::bfloat16>()[i].bits == mgpu::float_to_bfloat16_bits(s[i]));
    REQUIRE(back.host_span<float>()[i] == static_cast<float>(mgpu::float16(s[i])));
  }
  fill_async(brain, 3.140625f, stream);
  stream.synchronize();
  for (auto v : brain.host_span<mgpu::bfloat16>()) REQUIRE(static_cast<float>(v) == 3.140625f);

  Tensor small = Tensor::empty({256}, DType::float16, *allocator);
  REQUIRE_MGPU_ERROR(convert_async(small, src, stream), mgpu::Errc::invalid_argument, "expected the same number of elements");
}
