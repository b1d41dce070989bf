// DataParallel's errors: bad input refused with clear errors and before any collective, a step that
// fails inside (before or once updates have begun) or past the communicator's deadline reported as
// such, and the executor left usable or saying it needs a load().
#include <atomic>
#include <chrono>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <mgpu/ops/ops.hpp>
#include <mgpu/parallel/data_parallel.hpp>

#include "support/catch.hpp"
#include "support/dp_fixture.hpp"
#include "support/expect_error.hpp"
#include "support/nn_env.hpp"
#include "support/temp_path.hpp"

using mgpu::DType;
using mgpu::Tensor;
using mgpu::parallel::DataParallel;
using mgpu::parallel::DataParallelOptions;
using namespace mgpu::test::dp;

namespace {

// The first layer's forward throws on the ranks after the first (row offset > 0) while `armed`.
class FailingShard final : public mgpu::nn::Layer {
 public:
  explicit FailingShard(std::shared_ptr<bool> armed) : armed_(std::move(armed)) {}
  std::string name() const override { return "FailingShard"; }
  Tensor forward(Tensor const& x, mgpu::nn::Context& ctx) override {
    if (*armed_ && ctx.row_offset > 0) throw mgpu::Error(mgpu::Errc::invalid_argument, "FailingShard: refuses the rows from " + std::to_string(ctx.row_offset));
    return x;
  }
  Tensor backward(Tensor const& dy, mgpu::nn::Context&) override { return dy; }
  std::unique_ptr<mgpu::nn::Layer> clone() const override { return std::make_unique<FailingShard>(armed_); }

 private:
  std::shared_ptr<bool> armed_;
};

mgpu::nn::Sequential mlp_after(std::unique_ptr<mgpu::nn::Layer> first) {
  mgpu::nn::Sequential model;
  model.add(std::move(first));
  mgpu::nn::Sequential const body = small_mlp();
  for (std::size_t l = 0; l < body.size(); ++l) model.add(body.layer(l).clone());
  return model;
}

// Plain SGD that, while `armed`, fails on its second update range of a step, once the first range's
// update has run on its stream (so some parameters have certainly changed).
class FailingUpdate final : public mgpu::optim::Optimizer {
 public:
  explicit FailingUpdate(std::shared_ptr<bool> armed) : armed_(std::move(armed)) {}
  std::string name() const override { return "failing-update"; }
  std::vector<mgpu::optim::NamedTensor> state() const override {
    if (!unused_.defined()) return {};
    return {{"unused", unused_}};
  }
  std::vector<mgpu::optim::NamedTensor> prepare_state(Tensor const& params, mgpu::Allocator& allocator, mgpu::Stream& stream) override {
    if (!unused_.defined()) unused_ = mgpu::ops::zeros({state_elements(params)}, allocator, stream);
    ranges_ = 0;
    return state();
  }

 private:
  void update_slices(Tensor const& params, Tensor const& grads, std::int64_t /*begin*/, std::int64_t /*end*/,
                     std::int64_t /*state_begin*/, mgpu::Stream& stream, float lr_scale) override {
    if (*armed_ && ++ranges_ == 2) {
      stream.synchronize();
      throw mgpu::Error(mgpu::Errc::invalid_argument, "FailingUpdate: refuses a second range");
    }
    mgpu::ops::add_scaled(params, grads, -0.1f * lr_scale, stream);
  }
  void reset_state() override { unused_ = Tensor{}; }
  std::shared_ptr<bool> armed_;
  Tensor unused_;
  int ranges_ = 0;
};

// Holds back the ranks after the first while `armed`, until `released` (a rank failed), so the
// first rank waits past its deadline whatever the deadline and the machine's load.
struct Hold {
  std::atomic<bool> armed{true}, released{false};
};
class HeldShard final : public mgpu::nn::Layer {
 public:
  explicit HeldShard(std::shared_ptr<Hold> hold) : hold_(std::move(hold)) {}
  std::string name() const override { return "HeldShard"; }
  Tensor forward(Tensor const& x, mgpu::nn::Context& ctx) override {
    while (hold_->armed && ctx.row_offset > 0 && !hold_->released) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return x;
  }
  Tensor backward(Tensor const& dy, mgpu::nn::Context&) override { return dy; }
  std::unique_ptr<mgpu::nn::Layer> clone() const override { return std::make_unique<HeldShard>(hold_); }

 private:
  std::shared_ptr<Hold> hold_;
};

}  // namespace

TEST_CASE("DataParallel rejects bad input with clear errors", "[parallel][dp]") {
  Data data(1, 3, 14);
  mgpu::DeviceGroup group{"host:4"};
  REQUIRE_MGPU_ERROR(DataParallel(small_mlp(), group, mgpu::optim::SGD{}, {.bucket_cap_bytes = 0}), mgpu::Errc::invalid_argument,
                     "a bucket cap of 0 bytes");
  REQUIRE_MGPU_ERROR(DataParallel(small_mlp(), group, mgpu::optim::SGD{}, {.weights = {1, 2}}), mgpu::Errc::invalid_argument,
                     "2 shard weights (expected 4");
  DataParallel strict(small_mlp(), group, mgpu::optim::SGD{}, {.allow_empty_shards = false});
  REQUIRE_MGPU_ERROR(strict.step(data.x[0], data.y[0]), mgpu::Errc::invalid_argument, "expected at least 4 rows");
  DataParallel dp(small_mlp(), group, mgpu::optim::SGD{});
  Tensor bad = data.env.make({3}, {0, 1, 7});
  REQUIRE_MGPU_ERROR(dp.step(data.x[0], bad), mgpu::Errc::invalid_argument, "label 7.000000 at row 2 (expected a class id in [0, 4))");
  REQUIRE_MGPU_ERROR(dp.step(data.x[0], data.y[0].slice(0, 2)), mgpu::Errc::invalid_argument, "expected [3]");
  // A replica whose weights were changed behind the executor's back is named.
  dp.verify_replicas();
  mgpu::fill_async(dp.replica(2).master_parameters().slice(0, 1), 5.0f, dp.group().stream(2));
  REQUIRE_MGPU_ERROR(dp.verify_replicas(), mgpu::Errc::invalid_argument, "replica on rank 2 layer 0");
}

TEST_CASE("A bad batch is refused before any collective and leaves the executor as it was", "[parallel][dp]") {
  Data data(3, 12, 25);
  mgpu::DeviceGroup group{"host:3"};
  DataParallel straight(small_mlp(), group, mgpu::optim::SGD({.lr = 0.1f, .momentum = 0.9f}));
  run_steps(straight, data, 0, 3);
  DataParallel dp(small_mlp(), group, mgpu::optim::SGD({.lr = 0.1f, .momentum = 0.9f}));
  Tensor const narrow = data.env.random({12, 5}, 3);
  REQUIRE_MGPU_ERROR(dp.step(narrow, data.y[0]), mgpu::Errc::invalid_argument, "DataParallel::step: x of shape [12, 5]: Linear(6, 16): input of shape [12, 5] (expected [batch, 6])");
  Tensor const half = mgpu::test::to_dtype(data.env, data.x[0], DType::bfloat16);
  data.env.stream.synchronize();
  REQUIRE_MGPU_ERROR(dp.step(half, data.y[0]), mgpu::Errc::invalid_argument, "x of dtype bfloat16 for Linear(6, 16), which takes no token ids (expected float32)");
  Tensor const labels_2d = data.y[0].reshape({12, 1});
  REQUIRE_MGPU_ERROR(dp.step(data.x[0], labels_2d), mgpu::Errc::invalid_argument, "labels of shape [12, 1]");
  // A batch in another group's device memory is fine: the scatter copies it.
  mgpu::DeviceGroup elsewhere{"host:2"};
  Tensor const x = Tensor::empty(data.x[0].shape(), DType::float32, elsewhere.allocator(1));
  Tensor const y = Tensor::empty(data.y[0].shape(), DType::float32, elsewhere.allocator(1));
  mgpu::copy_async(x, data.x[0], elsewhere.stream(1));
  mgpu::copy_async(y, data.y[0], elsewhere.stream(1));
  elsewhere.stream(1).synchronize();
  dp.step(x, y);
  run_steps(dp, data, 1, 3);
  CHECK(dp_params(dp) == dp_params(straight));
}

TEST_CASE("A step that fails inside is reported as itself and leaves the executor usable", "[parallel][dp]") {
  Data data(4, 12, 26);
  auto const armed = std::make_shared<bool>(false);
  for (int k : {1, 2}) {
    INFO("accumulation_steps " << k);
    mgpu::DeviceGroup group{"host:3"};
    DataParallel straight(mlp_after(std::make_unique<FailingShard>(armed)), group, mgpu::optim::SGD({.lr = 0.1f, .momentum = 0.9f}),
                          {.accumulation_steps = k});
    auto const straight_trace = run_steps(straight, data, 1, 4);
    DataParallel dp(mlp_after(std::make_unique<FailingShard>(armed)), group, mgpu::optim::SGD({.lr = 0.1f, .momentum = 0.9f}),
                    {.accumulation_steps = k});
    if (k == 2) run_steps(dp, data, 0, 1);  // accumulated, then dropped with the failed step's cycle
    *armed = true;
    try {
      dp.step(data.x[1], data.y[1]);
      FAIL("expected an error");
    } catch (mgpu::Error const& e) {
      std::string const message = e.what();
      CAPTURE(message);
      CHECK(message.find("FailingShard: refuses the rows from") != std::string::npos);
    }
    *armed = false;
    CHECK(run_steps(dp, data, 1, 4) == straight_trace);
    CHECK(dp_params(dp) == dp_params(straight));
    dp.verify_replicas();
  }
}

TEST_CASE("A step that fails once updates have begun says the executor cannot be used until a load()", "[parallel][dp][io]") {
  auto const dir = mgpu::test::temp_path("mgpu_dp_failed_update_test");
  std::filesystem::create_directories(dir);
  Data data(4, 12, 27);
  auto const armed = std::make_shared<bool>(false);
  auto const failing = [armed] { return std::unique_ptr<mgpu::optim::Optimizer>(new FailingUpdate(armed)); };
  DataParallelOptions options;
  options.zero_stage = 0;
  options.first_bucket_cap_bytes = 64;  // the last layer alone, then the others: two update ranges
  mgpu::DeviceGroup group{"host:2"};
  DataParallel dp(small_mlp(), group, failing, options);
  REQUIRE(dp.buckets().size() >= 2);
  run_steps(dp, data, 0, 1);
  dp.save(dir / "dp.ckpt", {.step = 1});
  *armed = true;
  REQUIRE_MGPU_ERROR(dp.step(data.x[1], data.y[1]), mgpu::Errc::invalid_argument, "FailingUpdate: refuses a second range");
  *armed = false;
  REQUIRE_MGPU_ERROR(dp.step(data.x[1], data.y[1]), mgpu::Errc::invalid_argument,
                     "the executor cannot be used after a step failed once updates had begun");
  REQUIRE_MGPU_ERROR(dp.step(data.x[1], data.y[1]), mgpu::Errc::invalid_argument, "FailingUpdate: refuses a second range");
  dp.load(dir / "dp.ckpt");
  run_steps(dp, data, 1, 4);
  DataParallel fresh(small_mlp(), group, failing, options);
  fresh.load(dir / "dp.ckpt");
  run_steps(fresh, data, 1, 4);
  CHECK(dp_params(dp) == dp_params(fresh));
  std::filesystem::remove_all(dir);
}

TEST_CASE("A step past the communicator's deadline says so", "[parallel][dp]") {
  Data data(2, 12, 28);
  auto const hold = std::make_shared<Hold>();
  mgpu::DeviceGroup group{"host:3"};
  int const listener = group.add_failure_listener([hold](int, std::string const&) { hold->released = true; });
  DataParallelOptions options;
  options.comm.timeout = std::chrono::milliseconds(200);
  DataParallel dp(mlp_after(std::make_unique<HeldShard>(hold)), group, mgpu::optim::SGD{}, options);
  REQUIRE_MGPU_ERROR(dp.step(data.x[0], data.y[0]), mgpu::Errc::timeout, "deadline");
  hold->armed = false;
  run_steps(dp, data, 0, 2);  // nothing had been reduced: the executor goes on
  dp.verify_replicas();
  group.remove_failure_listener(listener);
}

TEST_CASE("DataParallel refuses a missing optimizer and bad numbers", "[parallel][dp]") {
  Data data(1, 6, 29);
  mgpu::DeviceGroup group{"host:2"};
  std::function<std::unique_ptr<mgpu::optim::Optimizer>()> const none = [] { return std::unique_ptr<mgpu::optim::Optimizer>(); };
  REQUIRE_MGPU_ERROR(DataParallel(small_mlp(), group, none, {}), mgpu::Errc::invalid_argument, "the optimizer factory returned no optimizer");
  REQUIRE_MGPU_ERROR(DataParallel(small_mlp(), group, std::function<std::unique_ptr<mgpu::optim::Optimizer>()>{}, {}),
                     mgpu::Errc::invalid_argument, "without an optimizer factory");
  for (float clip : {-1.0f, std::nanf(""), INFINITY}) {
    REQUIRE_MGPU_ERROR(DataParallel(small_mlp(), group, mgpu::optim::SGD{}, {.clip_norm = clip}), mgpu::Errc::invalid_argument,
                       "(expected 0 for no clipping, or a finite norm > 0)");
  }
  DataParallel dp(small_mlp(), group, mgpu::optim::SGD{});
  auto const before = dp_params(dp);
  for (float lr_scale : {std::nanf(""), INFINITY, -1.0f}) {
    REQUIRE_MGPU_ERROR(dp.step(data.x[0], data.y[0], lr_scale), mgpu::Errc::invalid_argument, "(expected a finite lr_scale >= 0)");
  }
  CHECK(dp_params(dp) == before);
  Tensor const bad = data.env.make({6}, {0, 1, 2, 3, 4, 1});
  REQUIRE_MGPU_ERROR(dp.count_correct(data.x[0], bad), mgpu::Errc::invalid_argument, "DataParallel::count_correct: label 4.000000 at row 4 (expected a class id in [0, 4))");
}
