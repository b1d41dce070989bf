// parallel::Mesh in one process: one communicator per group along each dimension, made once (the
// same object on a second call), whose all-reduce equals a serial sum over the group's ranks
// (counted by hand: rank = dp * 2 + tp); the trainer on a user-made mesh gives the losses of the
// one built from its config; a dimension the mesh lacks, a mesh of another size than the device
// count and a mesh of another layout than the config's are refused naming them.
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <mgpu/core/device_group.hpp>
#include <mgpu/parallel/mesh.hpp>
#include <mgpu/train/trainer.hpp>

#include "support/catch.hpp"
#include "support/expect_error.hpp"
#include "support/nn_env.hpp"

using mgpu::Errc;
using mgpu::Tensor;
using mgpu::comm::DeviceMesh;
using mgpu::parallel::Mesh;

namespace {

// Rank r's value at element i.
float value(int rank, int i) { return static_cast<float>((rank + 1) * 10 + i * (rank % 3 + 1)); }

}  // namespace

TEST_CASE("a mesh makes one communicator per group, once, reducing over the group's ranks", "[parallel][mesh]") {
  auto const mesh = std::make_shared<Mesh>(mgpu::DeviceGroup("host:4"), DeviceMesh({{"dp", 2}, {"tp", 2}}));
  mgpu::DeviceGroup& group = mesh->group();
  std::vector<std::string_view> const both{"dp", "tp"};
  std::set<mgpu::comm::Communicator const*> tp, dp;
  for (int r = 0; r < 4; ++r) {
    mgpu::comm::Communicator& t = mesh->communicator(r, "tp");
    CHECK(&t == &mesh->communicator(r, "tp"));                            // made once
    CHECK(&t == &mesh->communicator(r ^ 1, "tp"));                        // its partner along tp shares it
    CHECK(&mesh->communicator(r, both) == &mesh->communicator(0, both));  // one over every rank
    CHECK(t.size() == 2);
    tp.insert(&t);
    dp.insert(&mesh->communicator(r, "dp"));
  }
  CHECK(tp.size() == 2);  // one per group
  CHECK(dp.size() == 2);
  CHECK(tp.count(&mesh->communicator(0, "dp")) == 0);
  CHECK(mesh->made() == 2 + 2 + 1);  // the tp groups, the dp groups, the one over both

  int const n = 6;
  std::vector<Tensor> along_tp(4), along_dp(4);
  group.run([&](int rank, mgpu::Device, mgpu::Stream& stream) {
    auto const r = static_cast<std::size_t>(rank);
    for (Tensor* t : {&along_tp[r], &along_dp[r]}) {
      *t = Tensor::empty({n}, mgpu::DType::float32, group.allocator(rank));
      for (int i = 0; i < n; ++i) t->host_span<float>()[static_cast<std::size_t>(i)] = value(rank, i);
    }
    mesh->communicator(rank, "tp")
        .all_reduce(mesh->layout().group_rank(rank, "tp"), along_tp[r], along_tp[r], mgpu::comm::ReduceOp::sum, stream);
    mesh->communicator(rank, "dp")
        .all_reduce(mesh->layout().group_rank(rank, "dp"), along_dp[r], along_dp[r], mgpu::comm::ReduceOp::sum, stream);
  });
  group.synchronize();
  CHECK(mesh->made() == 5);  // asked again, made no more
  for (int rank = 0; rank < 4; ++rank) {
    int const d = rank / 2, t = rank % 2;
    for (int i = 0; i < n; ++i) {
      float tp_sum = 0, dp_sum = 0;  // serial sums over the group's ranks
      for (int u = 0; u < 2; ++u) tp_sum += value(d * 2 + u, i);
      for (int a = 0; a < 2; ++a) dp_sum += value(a * 2 + t, i);
      CHECK(along_tp[static_cast<std::size_t>(rank)].host_span<float>()[static_cast<std::size_t>(i)] == tp_sum);
      CHECK(along_dp[static_cast<std::size_t>(rank)].host_span<float>()[static_cast<std::size_t>(i)] == dp_sum);
    }
  }
}

TEST_CASE("a mesh refuses a dimension it lacks and another size than the device count", "[parallel][mesh]") {
  Mesh mesh(mgpu::DeviceGroup("host:2"), DeviceMesh({{"dp", 2}}));
  REQUIRE_MGPU_ERROR(mesh.communicator(0, "tp"), Errc::invalid_argument, "tp");
  REQUIRE_MGPU_ERROR(mesh.communicator(2, "dp"), Errc::invalid_argument, "rank 2");
  REQUIRE_MGPU_ERROR(Mesh(mgpu::DeviceGroup("host:4"), DeviceMesh({{"dp", 3}})), Errc::invalid_argument,
                     "a mesh of 3 ranks (dp 3) over 4 devices (expected the device count, 4)");
}

TEST_CASE("a mesh's factories refuse another group than the mesh's, and a subset of no rank", "[parallel][mesh]") {
  auto const mesh = std::make_shared<Mesh>(mgpu::DeviceGroup("host:2"), DeviceMesh({{"dp", 2}}));
  mgpu::DeviceGroup other("host:2");
  std::string const another = "Mesh: a communicator for another DeviceGroup than the mesh's (expected mesh->group())";
  std::string const none = "Mesh: a communicator over no rank (expected at least one)";
  REQUIRE_MGPU_ERROR(Mesh::factory(mesh)(other, {}), Errc::invalid_argument, another);
  REQUIRE_MGPU_ERROR(Mesh::subset_factory(mesh)(other, {}, {}), Errc::invalid_argument, another);  // the group first
  REQUIRE_MGPU_ERROR(Mesh::subset_factory(mesh)(mesh->group(), {}, {}), Errc::invalid_argument, none);
  REQUIRE_MGPU_ERROR(mesh->over({}), Errc::invalid_argument, none);
  CHECK(mesh->made() == 0);
  CHECK(Mesh::factory(mesh)(mesh->group(), {})->size() == 2);
  CHECK(Mesh::subset_factory(mesh)(mesh->group(), {1}, {})->size() == 1);
  CHECK(mesh->made() == 2);
}

TEST_CASE("the trainer on a user-made mesh gives the losses of one built from its config", "[parallel][mesh][train]") {
  namespace nn = mgpu::nn;
  namespace train = mgpu::train;
  mgpu::test::Env env;
  nn::GptConfig const config{.vocab = 64, .block_size = 16, .n_layer = 2, .n_head = 2, .n_embd = 32};
  train::ParallelConfig const parallel{.dp = 2, .tp = 2};
  train::TrainerOptions const options{.seed = 3, .batch_size = 4};
  auto const mesh = std::make_shared<Mesh>(mgpu::DeviceGroup("host:4"), DeviceMesh({{"dp", 2}, {"tp", 2}, {"pp", 1}}));
  train::Trainer from_config(config, mgpu::DeviceGroup("host:4"), parallel, options);
  train::Trainer from_mesh(config, mesh, parallel, options);
  CHECK(from_mesh.mesh() == mesh);
  CHECK(&from_mesh.group() == &mesh->group());
  for (int s = 0; s < 3; ++s) {
    mgpu::test::TokenBatch const batch =
        mgpu::test::rule_batch(env, 4, config.block_size, config.vocab, 7u + static_cast<unsigned>(s));
    float const expected = from_config.step(batch.ids, batch.targets).loss;
    CHECK(from_mesh.step(batch.ids, batch.targets).loss == expected);
  }
  // The executor took every communicator from the mesh, one per group, before the first step: the
  // tp groups (2), the dp groups (2) and the one over every rank (the step's commit point).
  int const made = mesh->made();
  CHECK(made == 2 + 2 + 1);
  std::vector<std::string_view> const both{"dp", "tp"};
  for (int r = 0; r < 4; ++r) {
    (void)mesh->communicator(r, "tp");
    (void)mesh->communicator(r, "dp");
    (void)mesh->communicator(r, both);
  }
  CHECK(mesh->made() == made);  // the executor's own

  REQUIRE_MGPU_ERROR(train::Trainer(config, mesh, train::ParallelConfig{.dp = 4}, options), Errc::invalid_argument,
                     "Trainer: the mesh dp 2 x tp 2 x pp 1 (expected dp 4 x tp 1 x pp 1");
  auto const transposed = std::make_shared<Mesh>(mgpu::DeviceGroup("host:4"), DeviceMesh({{"tp", 2}, {"dp", 2}}));
  REQUIRE_MGPU_ERROR(train::Trainer(config, transposed, parallel, options), Errc::invalid_argument,
                     "the mesh tp 2 x dp 2 (expected dp 2 x tp 2 x pp 1, its dimensions in that order)");
}
