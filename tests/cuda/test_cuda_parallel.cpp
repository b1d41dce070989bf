// DataParallel on GPUs: two logical devices sharing cuda:0 (so it runs on a one-GPU machine, through
// the CUDA-peer communicator), and every visible GPU, against host-device data parallelism on the
// same batches (itself checked against one device in tests/parallel).
#include <mgpu/parallel/data_parallel.hpp>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "support/catch.hpp"

using mgpu::DType;
using mgpu::Tensor;

namespace {

std::vector<float> params(mgpu::parallel::DataParallel& dp, int replica) {
  auto staging = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  Tensor const& p = dp.replica(replica).master_parameters();
  Tensor copy = Tensor::empty(p.shape(), p.dtype(), *staging);
  mgpu::copy_async(copy, p, dp.group().stream(replica));
  dp.group().stream(replica).synchronize();
  auto s = copy.host_span<float>();
  return {s.begin(), s.end()};
}

std::vector<float> train(std::string const& spec, mgpu::parallel::DataParallelOptions options = {}) {
  auto host = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  Tensor x = Tensor::empty({40, 12}, DType::float32, *host);
  Tensor y = Tensor::empty({40}, DType::float32, *host);
  std::mt19937 rng(3);
  std::normal_distribution<float> n(0, 1);
  for (float& v : x.host_span<float>()) v = n(rng);
  for (float& v : y.host_span<float>()) v = static_cast<float>(rng() % 5);
  mgpu::DeviceGroup group{spec};
  mgpu::parallel::DataParallel dp(mgpu::nn::Sequential::mlp({12, 32, 5}), group, mgpu::optim::SGD({.lr = 0.1f, .momentum = 0.9f}), options);
  for (int i = 0; i < 3; ++i) dp.step(x, y);
  auto const first = params(dp, 0);
  CHECK(params(dp, dp.group().size() - 1) == first);  // replicas never diverge
  return first;
}

void require_close(std::vector<float> const& a, std::vector<float> const& b) {
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) REQUIRE(a[i] == Approx(b[i]).margin(1e-4).epsilon(1e-3));
}

}  // namespace

TEST_CASE("DataParallel on two logical devices of cuda:0 matches host devices", "[cuda][parallel]") {
  auto const host = train("host:2");
  require_close(train("cuda:0,0"), host);
  mgpu::parallel::DataParallelOptions deterministic;
  deterministic.deterministic = true;
  require_close(train("cuda:0,0", deterministic), host);
}

TEST_CASE("DataParallel on every visible GPU matches host devices", "[cuda][parallel]") {
  int const gpus = mgpu::cuda_device_count();
  require_close(train("cuda"), train("host:" + std::to_string(gpus)));
}
