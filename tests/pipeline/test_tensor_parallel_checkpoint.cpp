// Checkpoints of a data x tensor x pipeline grid (pipeline::Executor with tensor-parallel stages)
// in the one-device format: saved by DP 2 x TP 2 x PP 2 mid-run (dropout on, a vocab the ranks do
// not divide), resumed on one device (io::load_training), on TP 4 (TensorParallel), on a plain
// 2-stage pipeline x DP 2, on DataParallel x 2 with ZeRO-1 and by a new grid, each continuing with
// the uninterrupted run's losses and weights within float32 rounding; a one-device checkpoint
// loaded into the grid continues as the one device; a folder save loads back; a damaged shard or
// file and another model's checkpoint are refused naming the file (and the damaged record), the
// grid unchanged.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <mgpu/core/device_group.hpp>
#include <mgpu/io/checkpoint.hpp>
#include <mgpu/nn/gpt.hpp>
#include <mgpu/nn/loss.hpp>
#include <mgpu/nn/train.hpp>
#include <mgpu/ops/ops.hpp>
#include <mgpu/optim/optim.hpp>
#include <mgpu/parallel/data_parallel.hpp>
#include <mgpu/parallel/tensor_parallel.hpp>
#include <mgpu/pipeline/pipeline.hpp>

#include "support/catch.hpp"
#include "support/expect_error.hpp"
#include "support/nn_env.hpp"
#include "support/temp_path.hpp"

using mgpu::test::as_double;
using mgpu::test::Env;
using mgpu::test::worst_relative;
namespace nn = mgpu::nn;
namespace io = mgpu::io;
namespace par = mgpu::parallel;
namespace pp = mgpu::pipeline;

namespace {

// 67 ids: over 2 ranks 33 and 34 rows, so the last stage's tied copies differ in size.
nn::GptConfig const config{.vocab = 67, .block_size = 16, .n_layer = 2, .n_head = 4, .n_embd = 32, .dropout = 0.1f};
std::uint64_t const seed = 7;
std::int64_t const batch = 8;
int const steps = 8, saved_at = 4;
float const clip = 0.5f;
mgpu::optim::AdamWOptions const adamw{.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .weight_decay = 0.1f};
double const curve_tolerance = 1e-5;  // float32 rounding of other summation orders, as the grids' tests
double const weight_tolerance = 5e-5;

using Batch = mgpu::test::TokenBatch;

std::vector<Batch> make_batches(Env& env) {
  std::vector<Batch> out;
  for (int s = 0; s < steps; ++s)
    out.push_back(mgpu::test::rule_batch(env, batch, config.block_size, config.vocab, 500 + static_cast<unsigned>(s)));
  return out;
}

pp::ChunkOptimizerFactory chunk_adamw() {
  return [](nn::Sequential const& chunk) {
    mgpu::optim::AdamWOptions options = adamw;
    options.decay_ranges = chunk.matrix_ranges();
    return std::make_unique<mgpu::optim::AdamW>(options);
  };
}

// DP 2 x TP 2 x PP 2 (1F1B) on 8 host devices.
std::unique_ptr<pp::Executor> make_grid(mgpu::DeviceGroup& group) {
  return std::make_unique<pp::Executor>(nn::gpt(config), group, std::vector<std::size_t>{0, 3, 6},
                                        pp::one_f_one_b(2, 2), chunk_adamw(),
                                        pp::ExecutorOptions{.seed = seed,
                                                            .data_parallel = 2,
                                                            .clip_norm = clip,
                                                            .tensor_parallel = pp::tensor_parallel_stages(config, 2)});
}

std::vector<double> gathered(pp::Executor& ex, Env& env) {
  nn::Sequential whole = nn::gpt(config);
  whole.materialize(env.ctx, seed + 1);
  ex.gather_parameters(whole, env.stream);
  return as_double(whole.master_parameters());
}

// The steps [saved_at, steps) on one device from `path`: losses, then the weights.
struct Run {
  std::vector<double> losses, weights;
};
Run one_device(Env& env, std::vector<Batch> const& batches, std::filesystem::path const& path) {
  nn::Sequential model = nn::gpt(config);
  model.materialize(env.ctx, seed + 1);  // other weights, which the file replaces
  mgpu::optim::AdamWOptions options = adamw;
  options.decay_ranges = nn::gpt_decay_ranges(config);
  mgpu::optim::AdamW optimizer(options);
  CHECK(io::load_training(path, model, optimizer, *env.allocator, env.stream).step == saved_at);
  Run run;
  for (int s = saved_at; s < steps; ++s)
    run.losses.push_back(mgpu::ops::item(nn::train_step(model, optimizer, batches[static_cast<std::size_t>(s)].ids,
                                                        batches[static_cast<std::size_t>(s)].targets,
                                                        nn::TokenCrossEntropy{}, env.ctx, {.clip_norm = clip})
                                             .loss,
                                         env.stream));
  env.stream.synchronize();
  run.weights = as_double(model.master_parameters());
  return run;
}

double worst_difference(std::vector<double> const& got, std::vector<double> const& want) {
  REQUIRE(got.size() == want.size());
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(got[i] - want[i]));
  return worst;
}

void check_continues(std::string const& layout, Run const& got, Run const& want) {
  CAPTURE(layout);
  double const losses = worst_relative(got.losses, want.losses);
  double const weights = worst_difference(got.weights, want.weights);
  WARN(layout << ": worst relative loss difference " << losses << ", weights " << weights);
  CHECK(losses <= curve_tolerance);
  CHECK(weights < weight_tolerance);
}

}  // namespace

TEST_CASE("a DP 2 x TP 2 x PP 2 checkpoint resumes on one device, TP 4, PP 2 x DP 2, ZeRO-1 DP 2 and a new grid",
          "[pipeline][tensor][checkpoint]") {
  Env env;
  std::vector<Batch> const batches = make_batches(env);
  auto const path = mgpu::test::temp_path("mgpu_grid_checkpoint.ckpt");
  mgpu::DeviceGroup eight("host:8");
  std::unique_ptr<pp::Executor> grid = make_grid(eight);
  for (int s = 0; s < saved_at; ++s)
    grid->step(batches[static_cast<std::size_t>(s)].ids, batches[static_cast<std::size_t>(s)].targets);
  grid->save(path, {.step = saved_at, .data_seed = 3});
  std::vector<double> const saved = gathered(*grid, env);
  Run uninterrupted;
  for (int s = saved_at; s < steps; ++s)
    uninterrupted.losses.push_back(
        grid->step(batches[static_cast<std::size_t>(s)].ids, batches[static_cast<std::size_t>(s)].targets));
  uninterrupted.weights = gathered(*grid, env);
  REQUIRE(worst_difference(uninterrupted.weights, saved) > 1e-3);  // the steps after the save moved the weights

  SECTION("one device") { check_continues("one device", one_device(env, batches, path), uninterrupted); }
  SECTION("TP 4 (TensorParallel)") {
    mgpu::DeviceGroup four("host:4");
    par::TensorParallel tp(four, config, {.seed = seed + 1, .adamw = adamw, .clip_norm = clip});
    CHECK(tp.load(path).step == saved_at);
    std::vector<float> const loaded = tp.gather_parameters();
    CHECK(std::vector<double>(loaded.begin(), loaded.end()) == saved);
    Run run;
    for (int s = saved_at; s < steps; ++s)
      run.losses.push_back(
          tp.step(batches[static_cast<std::size_t>(s)].ids, batches[static_cast<std::size_t>(s)].targets).loss);
    std::vector<float> const end = tp.gather_parameters();
    run.weights.assign(end.begin(), end.end());
    check_continues("TP 4", run, uninterrupted);
  }
  SECTION("a plain 2-stage pipeline x DP 2") {
    mgpu::DeviceGroup four("host:4");
    pp::Executor plain(nn::gpt(config), four, {0, 3, 6}, pp::one_f_one_b(2, 2), chunk_adamw(),
                       {.seed = seed + 1,
                        .data_parallel = 2,
                        .clip_norm = clip,
                        .loss = std::make_shared<nn::TokenCrossEntropy const>()});
    CHECK(plain.load(path).data_seed == 3);
    CHECK(gathered(plain, env) == saved);
    Run run;
    for (int s = saved_at; s < steps; ++s)
      run.losses.push_back(
          plain.step(batches[static_cast<std::size_t>(s)].ids, batches[static_cast<std::size_t>(s)].targets));
    run.weights = gathered(plain, env);
    check_continues("PP 2 x DP 2", run, uninterrupted);
  }
  SECTION("DataParallel over 2 devices with ZeRO-1") {
    mgpu::DeviceGroup two("host:2");
    mgpu::optim::AdamWOptions options = adamw;
    options.decay_ranges = nn::gpt_decay_ranges(config);
    par::DataParallelOptions dp_options;
    dp_options.zero_stage = 1;
    dp_options.seed = seed + 1;
    dp_options.clip_norm = clip;
    dp_options.loss = std::make_shared<nn::TokenCrossEntropy const>();
    par::DataParallel dp(nn::gpt(config), two, mgpu::optim::AdamW(options), dp_options);
    CHECK(dp.load(path).step == saved_at);
    Run run;
    for (int s = saved_at; s < steps; ++s)
      run.losses.push_back(
          dp.step(batches[static_cast<std::size_t>(s)].ids, batches[static_cast<std::size_t>(s)].targets).loss);
    run.weights = as_double(dp.replica(0).master_parameters());
    check_continues("DataParallel ZeRO-1 x 2", run, uninterrupted);
  }
  SECTION("a new grid, after steps of its own") {
    mgpu::DeviceGroup group("host:8");
    std::unique_ptr<pp::Executor> resumed = make_grid(group);
    resumed->step(batches[0].ids, batches[0].targets);  // weights, moments and RNG that load() replaces
    CHECK(resumed->load(path).step == saved_at);
    CHECK(gathered(*resumed, env) == saved);
    Run run;
    for (int s = saved_at; s < steps; ++s)
      run.losses.push_back(
          resumed->step(batches[static_cast<std::size_t>(s)].ids, batches[static_cast<std::size_t>(s)].targets));
    run.weights = gathered(*resumed, env);
    CHECK(run.losses == uninterrupted.losses);  // the same layout: bit for bit
    CHECK(run.weights == uninterrupted.weights);
  }
  std::filesystem::remove(path);
}

TEST_CASE("a one-device checkpoint loaded into DP 2 x TP 2 x PP 2 continues as the one device",
          "[pipeline][tensor][checkpoint]") {
  Env env;
  std::vector<Batch> const batches = make_batches(env);
  auto const path = mgpu::test::temp_path("mgpu_grid_from_one.ckpt");
  {
    nn::Sequential model = nn::gpt(config);
    model.materialize(env.ctx, seed);
    mgpu::optim::AdamWOptions options = adamw;
    options.decay_ranges = nn::gpt_decay_ranges(config);
    mgpu::optim::AdamW optimizer(options);
    for (int s = 0; s < saved_at; ++s)
      nn::train_step(model, optimizer, batches[static_cast<std::size_t>(s)].ids,
                     batches[static_cast<std::size_t>(s)].targets, nn::TokenCrossEntropy{}, env.ctx,
                     {.clip_norm = clip});
    io::save_training(path, model, optimizer, {.step = saved_at}, env.stream);
  }
  Run const want = one_device(env, batches, path);
  mgpu::DeviceGroup eight("host:8");
  std::unique_ptr<pp::Executor> grid = make_grid(eight);
  CHECK(grid->load(path).step == saved_at);
  Run got;
  for (int s = saved_at; s < steps; ++s)
    got.losses.push_back(
        grid->step(batches[static_cast<std::size_t>(s)].ids, batches[static_cast<std::size_t>(s)].targets));
  got.weights = gathered(*grid, env);
  check_continues("DP 2 x TP 2 x PP 2 from one device", got, want);
  std::filesystem::remove(path);
}

TEST_CASE(
    "a grid's folder checkpoint loads back, and a damaged shard or another model's file is refused, the grid unchanged",
    "[pipeline][tensor][checkpoint]") {
  Env env;
  std::vector<Batch> const batches = make_batches(env);
  auto const folder = mgpu::test::temp_path("mgpu_grid_checkpoint_folder");
  std::filesystem::remove_all(folder);
  std::filesystem::create_directories(folder);
  mgpu::DeviceGroup eight("host:8");
  std::unique_ptr<pp::Executor> grid = make_grid(eight);
  grid->step(batches[0].ids, batches[0].targets);
  grid->save(folder, {.step = 1});
  std::vector<double> const saved = gathered(*grid, env);
  grid->step(batches[1].ids, batches[1].targets);
  CHECK(grid->load(folder).step == 1);
  CHECK(gathered(*grid, env) == saved);
  grid->step(batches[1].ids, batches[1].targets);
  std::vector<double> const before = gathered(*grid, env);

  // A byte flipped in the middle of the shard, and of a one-file save: inside a record (the
  // parameters' or a moment's), which the error names.
  std::filesystem::path shard;
  for (auto const& entry : std::filesystem::directory_iterator(folder))
    if (entry.path().filename().string().starts_with("shard-")) shard = entry.path();
  REQUIRE(!shard.empty());
  auto const file = mgpu::test::temp_path("mgpu_grid_damaged.ckpt");
  grid->save(file);
  for (std::filesystem::path const& damaged : {shard, file}) {
    CAPTURE(damaged);
    {
      std::fstream out(damaged, std::ios::in | std::ios::out | std::ios::binary);
      auto const middle = static_cast<std::streamoff>(std::filesystem::file_size(damaged) / 2);
      out.seekg(middle);
      char byte = 0;
      out.get(byte);
      out.seekp(middle);
      out.put(static_cast<char>(byte ^ 0x5a));
    }
    REQUIRE_MGPU_ERROR(grid->load(damaged == shard ? folder : file), mgpu::Errc::corrupt_data,
                       damaged.filename().string() + ": checksum mismatch in record '");
    CHECK(gathered(*grid, env) == before);
  }
  std::filesystem::remove(file);

  nn::GptConfig wider = config;
  wider.n_embd = 24;
  nn::Sequential other = nn::gpt(wider);
  other.materialize(env.ctx, seed);
  mgpu::optim::AdamW optimizer(adamw);
  auto const wrong = mgpu::test::temp_path("mgpu_grid_other_model.ckpt");
  io::save_training(wrong, other, optimizer, {}, env.stream);
  REQUIRE_MGPU_ERROR(grid->load(wrong), mgpu::Errc::invalid_argument, wrong.string() + ": the model differs");
  CHECK(gathered(*grid, env) == before);
  std::filesystem::remove(wrong);
  std::filesystem::remove_all(folder);
}
