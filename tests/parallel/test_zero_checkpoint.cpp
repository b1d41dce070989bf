// DataParallel's ZeRO checkpoints: saved at stage 1, 2 or 3 (a file or a folder) they hold the whole
// model and optimizer state and resume at other stages and on other device counts, against a run
// straight through.
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <mgpu/core/device_group.hpp>
#include <mgpu/optim/optim.hpp>
#include <mgpu/parallel/data_parallel.hpp>

#include "support/catch.hpp"
#include "support/expect_error.hpp"
#include "support/nn_env.hpp"
#include "support/temp_path.hpp"
#include "support/zero_fixture.hpp"

namespace nn = mgpu::nn;
using namespace mgpu::test::zero;

namespace {

// The checkpoint tests' run: six batches of clusters (seeds from `first`), an MLP data parallel at
// `stage` with small buckets (several per model), and the weights of six steps straight through.
struct CheckpointRun {
  Env env;
  MlpBatches data;
  explicit CheckpointRun(unsigned first) : data(mlp_batches(env, 23, first, 6)) {}
  static std::unique_ptr<DataParallel> make(mgpu::DeviceGroup& group, int stage, int accumulation = 1) {
    return std::make_unique<DataParallel>(mlp(), group, mlp_adamw(), mlp_options(stage, accumulation));
  }
  // Steps [begin, end) of `dp`.
  void steps(DataParallel& dp, int begin, int end) const {
    for (int s = begin; s < end; ++s) dp.step(data.xs[static_cast<std::size_t>(s)], data.ys[static_cast<std::size_t>(s)]);
  }
  std::vector<float> straight(mgpu::DeviceGroup& group, int stage) const {
    auto dp = make(group, stage);
    steps(*dp, 0, 6);
    return host_values(dp->replica(0).master_parameters(), group.stream(0));
  }
  // The run after three steps on `group` at `stage`, saved as a file, dir/stage<stage>.ckpt, and as
  // a folder, dir/stage<stage>-folder (each rank writes its owned state).
  void save_at_step_3(mgpu::DeviceGroup& group, int stage, std::filesystem::path const& dir) const {
    auto dp = make(group, stage);
    steps(*dp, 0, 3);
    std::string const name = "stage" + std::to_string(stage);
    dp->save(dir / (name + ".ckpt"), {.step = 3});
    std::filesystem::create_directories(dir / (name + "-folder"));
    dp->save(dir / (name + "-folder"), {.step = 3});
  }
  // Resumed on `group` at `stage` from `saved` (at step 3), steps 3 to 6 give `straight`'s weights:
  // bit for bit when `same` (the device count that saved), else within 1e-5.
  void check_resumed(mgpu::DeviceGroup& group, int stage, std::filesystem::path const& saved, std::vector<float> const& straight,
                     bool same) const {
    auto dp = make(group, stage);
    CHECK(dp->load(saved).step == 3);
    steps(*dp, 3, 6);
    std::vector<float> const weights = host_values(dp->replica(0).master_parameters(), group.stream(0));
    if (same) {
      CHECK(weights == straight);  // the same run, resumed
    } else {
      CHECK(worst_relative(weights, straight, 1) <= 1e-5);
    }
  }
};

}  // namespace

TEST_CASE("A zero_stage 1 checkpoint holds the whole optimizer state and resumes on other device counts and stages",
          "[parallel][dp][zero][io]") {
  auto const dir = mgpu::test::temp_path("mgpu_zero_checkpoint_test");
  std::filesystem::create_directories(dir);
  CheckpointRun const data(60);
  auto const whole_state = [](DataParallel& dp) {
    std::vector<float> all;
    for (auto const& [name, tensor] : dp.optimizer(0).state()) {
      std::vector<float> const v = host_values(tensor, dp.group().stream(0));
      all.insert(all.end(), v.begin(), v.end());
    }
    return all;
  };
  // Straight through at stage 1 on 3 devices; and the same run saved after 3 steps, at each stage.
  mgpu::DeviceGroup three("host:3");
  std::vector<float> const straight = data.straight(three, 1);
  for (int const stage : {0, 1}) {
    auto dp = CheckpointRun::make(three, stage);
    data.steps(*dp, 0, 3);
    dp->save(dir / ("stage" + std::to_string(stage) + ".ckpt"), {.step = 3});
  }
  // Loaded on 2 devices at stage 0 (every rank loads the whole state): the stage 1 file holds the
  // state that the stage 0 run kept whole on every rank.
  std::vector<std::vector<float>> states;
  mgpu::DeviceGroup two("host:2");
  for (int const stage : {0, 1}) {
    auto dp = CheckpointRun::make(two, 0);
    dp->load(dir / ("stage" + std::to_string(stage) + ".ckpt"));
    states.push_back(whole_state(*dp));
  }
  CHECK(worst_relative(states[1], states[0], 1e-6) <= 1e-3);
  // Resumed on 2 devices at stage 0 and on 4 at stage 1: the straight run's weights.
  mgpu::DeviceGroup four("host:4");
  for (auto const& [group, stage] : {std::pair{&two, 0}, std::pair{&four, 1}}) {
    CAPTURE(group->size(), stage);
    data.check_resumed(*group, stage, dir / "stage1.ckpt", straight, false);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("A zero_stage 2 checkpoint (a file or a folder) resumes at stages 0, 1 and 2 on other device counts",
          "[parallel][dp][zero][io]") {
  auto const dir = mgpu::test::temp_path("mgpu_zero2_checkpoint_test");
  std::filesystem::create_directories(dir);
  CheckpointRun const data(80);
  mgpu::DeviceGroup three("host:3");
  std::vector<float> const straight = data.straight(three, 2);
  data.save_at_step_3(three, 2, dir);
  mgpu::DeviceGroup two("host:2");
  mgpu::DeviceGroup four("host:4");
  for (auto const& [group, stage] : {std::pair{&two, 0}, std::pair{&four, 1}, std::pair{&two, 2}, std::pair{&three, 2}}) {
    for (char const* saved : {"stage2.ckpt", "stage2-folder"}) {  // a folder: each rank reads its owned state
      CAPTURE(group->size(), stage, saved);
      data.check_resumed(*group, stage, dir / saved, straight, group == &three);
    }
  }
  // Mid accumulation cycle: refused both ways, the executor unchanged.
  auto dp = CheckpointRun::make(two, 2, 2);
  data.steps(*dp, 0, 1);
  REQUIRE_MGPU_ERROR(dp->save(dir / "mid.ckpt", {.step = 0}), mgpu::Errc::invalid_argument,
                     "after 1 of 2 accumulated micro-batches at zero_stage 2 (expected a save at the end of an accumulation cycle");
  {
    auto one = CheckpointRun::make(two, 1, 2);
    data.steps(*one, 0, 1);
    one->save(dir / "mid.ckpt", {.step = 0});
  }
  REQUIRE_MGPU_ERROR(dp->load(dir / "mid.ckpt"), mgpu::Errc::invalid_argument,
                     "saved after 1 of 2 accumulated micro-batches (expected a checkpoint saved at the end of a cycle at zero_stage 2");
  std::filesystem::remove_all(dir);
}

// A stage 3 checkpoint holds the whole model and optimizer state (gathered from the shards), so it
// resumes at any stage on any device count; stage 3 resumes stage 2's checkpoints too.
TEST_CASE("A zero_stage 3 checkpoint (a file or a folder) resumes at stages 0 to 3 on other device counts",
          "[parallel][dp][zero][io]") {
  auto const dir = mgpu::test::temp_path("mgpu_zero3_checkpoint_test");
  std::filesystem::create_directories(dir);
  CheckpointRun const data(80);
  mgpu::DeviceGroup three("host:3");
  std::vector<float> const straight = data.straight(three, 3);
  for (int const saver : {2, 3}) data.save_at_step_3(three, saver, dir);
  mgpu::DeviceGroup two("host:2");
  mgpu::DeviceGroup four("host:4");
  for (auto const& [group, stage] :
       {std::pair{&two, 0}, std::pair{&four, 1}, std::pair{&two, 2}, std::pair{&two, 3}, std::pair{&four, 3}, std::pair{&three, 3}}) {
    for (char const* saved : {"stage3.ckpt", "stage3-folder", "stage2.ckpt", "stage2-folder"}) {
      if (stage != 3 && std::string(saved).starts_with("stage2")) continue;  // stage 2's own test covers those
      CAPTURE(group->size(), stage, saved);
      data.check_resumed(*group, stage, dir / saved, straight, group == &three);
    }
  }
  std::filesystem::remove_all(dir);
}
