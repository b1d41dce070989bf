// The data x pipeline grid on GPUs: 2 pipeline devices x 2 data-parallel replicas as four logical
// devices of cuda:0 (the same stage across replicas all-reduces over a CUDA-peer subset
// communicator: NCCL cannot put two ranks on one GPU), and over four distinct GPUs where there are
// (NCCL subset communicators), against the same grid on host devices (itself checked against
// single-device training in tests/parallel).
#include <mgpu/config.hpp>
#include <mgpu/core/device.hpp>
#include <mgpu/nn/layers.hpp>
#include <mgpu/optim/optim.hpp>
#include <mgpu/pipeline/pipeline.hpp>

#include <random>
#include <string>
#include <vector>

#include "support/catch.hpp"

using mgpu::DType;
using mgpu::Tensor;
namespace pp = mgpu::pipeline;

namespace {

std::vector<float> to_host(Tensor const& t, mgpu::Stream& stream) {
  auto staging = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  Tensor copy = Tensor::empty(t.shape(), t.dtype(), *staging);
  mgpu::copy_async(copy, t, stream);
  stream.synchronize();
  auto s = copy.host_span<float>();
  return {s.begin(), s.end()};
}

// Every replica's parameters, chunk by chunk, after three 1F1B steps of a 2 x 2 grid on `spec`.
std::vector<std::vector<float>> train_grid(std::string const& spec) {
  auto host = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  Tensor x = Tensor::empty({32, 12}, DType::float32, *host);
  Tensor y = Tensor::empty({32}, DType::float32, *host);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0, 1);
  for (float& v : x.host_span<float>()) v = normal(rng);
  for (float& v : y.host_span<float>()) v = static_cast<float>(rng() % 5);
  mgpu::DeviceGroup group{spec};
  auto const model = mgpu::nn::Sequential::mlp({12, 32, 16, 5});  // Linear+ReLU, Linear+ReLU, Linear
  auto const sgd = [] { return std::make_unique<mgpu::optim::SGD>(mgpu::optim::SgdOptions{.lr = 0.1f, .momentum = 0.9f}); };
  pp::Executor executor(model, group, {0, 2, 5}, pp::one_f_one_b(2, 2), sgd, {.seed = 3, .data_parallel = 2});
  for (int i = 0; i < 3; ++i) executor.step(x, y);
  std::vector<std::vector<float>> params;
  for (int replica = 0; replica < 2; ++replica) {
    std::vector<float> all;
    for (int c = 0; c < 2; ++c) {
      auto const part = to_host(executor.chunk(c, replica).parameters(), group.stream(replica * 2 + c));
      all.insert(all.end(), part.begin(), part.end());
    }
    params.push_back(all);
  }
  CHECK(params[0] == params[1]);  // replicas never diverge
  return params;
}

void require_close(std::vector<float> const& a, std::vector<float> const& b) {
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) REQUIRE(a[i] == Approx(b[i]).margin(1e-4).epsilon(1e-3));
}

}  // namespace

TEST_CASE("a 2 x 2 data x pipeline grid on four logical devices of cuda:0 matches host devices", "[cuda][parallel][pipeline]") {
  require_close(train_grid("cuda:0,0,0,0")[0], train_grid("host:4")[0]);
}

TEST_CASE("a 2 x 2 data x pipeline grid on four GPUs (NCCL subsets) matches host devices", "[cuda][parallel][pipeline]") {
  if (!mgpu::built_with_nccl || mgpu::cuda_device_count() < 4)
    MGPU_SKIP("needs NCCL and 4 GPUs (this machine has " << mgpu::cuda_device_count() << (mgpu::built_with_nccl ? ")" : ", and no NCCL)"));
  require_close(train_grid("cuda:0,1,2,3")[0], train_grid("host:4")[0]);
}
