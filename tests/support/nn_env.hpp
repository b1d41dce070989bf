// A host device, its allocator and stream, and helpers to make tensors, for the nn and ops tests.
#pragma once

#include <mgpu/core/memory.hpp>
#include <mgpu/core/stream.hpp>
#include <mgpu/core/tensor.hpp>
#include <mgpu/nn/layers.hpp>

#include <algorithm>
#include <random>
#include <vector>

namespace mgpu::test {

struct Env {
  std::shared_ptr<mgpu::Allocator> allocator = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  mgpu::Stream stream{mgpu::Device{mgpu::DeviceKind::host, 0}};
  mgpu::nn::Context ctx{*allocator, stream};
  Tensor make(mgpu::Shape shape, std::vector<float> const& values) {
    Tensor t = Tensor::empty(std::move(shape), mgpu::DType::float32, *allocator);
    std::copy(values.begin(), values.end(), t.host_span<float>().begin());
    return t;
  }
  Tensor random(mgpu::Shape shape, unsigned seed, float stddev = 1.0f) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> n(0, stddev);
    Tensor t = Tensor::empty(std::move(shape), mgpu::DType::float32, *allocator);
    for (float& v : t.host_span<float>()) v = n(rng);
    return t;
  }
  Tensor scalar() { return Tensor::empty({1}, mgpu::DType::float32, *allocator); }
};

inline std::vector<double> as_double(Tensor const& t) {
  auto s = t.host_span<float>();
  return {s.begin(), s.end()};
}

}  // namespace mgpu::test
