// DataParallel's ZeRO stages against the replicated update (zero_stage 0) as the reference: the
// same loss curve and weights over 20 AdamW steps with clipping (a GPT and an MLP on 2 to 4 host
// devices), each rank's optimizer state bytes measured by its allocator against the owned elements
// counted from the bucket layout, the whole state gathered by optimizer() mid-run, and bad stages;
// stage 2 and 3 against stage 1 and 2 bit for bit, their bytes against the allocator's, stage 3's
// gather schedule, and checkpoints across stages and device counts.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <mgpu/core/memory.hpp>
#include <mgpu/nn/gpt.hpp>
#include <mgpu/nn/loss.hpp>
#include <mgpu/ops/ops.hpp>
#include <mgpu/optim/optim.hpp>
#include <mgpu/parallel/data_parallel.hpp>
#include <mgpu/trace/timeline.hpp>

#include "support/catch.hpp"
#include "support/expect_error.hpp"
#include "support/nn_env.hpp"
#include "support/temp_path.hpp"

using mgpu::DType;
using mgpu::Tensor;
using mgpu::parallel::DataParallel;
using mgpu::parallel::DataParallelOptions;
using mgpu::test::Env;
using mgpu::test::host_values;
namespace nn = mgpu::nn;

namespace {

nn::GptConfig const config{.vocab = 64, .block_size = 16, .n_layer = 2, .n_head = 2, .n_embd = 32};
std::int64_t const batch = 7;  // uneven over 2, 3 and 4 devices
int const steps = 20;
float const clip = 0.5f;  // below the gradients' norm early on, so steps clip

mgpu::optim::AdamW gpt_adamw() {
  return mgpu::optim::AdamW(
      {.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .weight_decay = 0.1f, .decay_ranges = nn::gpt_decay_ranges(config)});
}


// The largest |got - want| / (floor + |want|).
double worst_relative(std::vector<float> const& got, std::vector<float> const& want, double floor = 0) {
  REQUIRE(got.size() == want.size());
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i)
    worst = std::max(
        worst, std::abs(static_cast<double>(got[i]) - want[i]) / (floor + std::abs(static_cast<double>(want[i]))));
  return worst;
}

// The memory tests' GPT: six blocks of one bucket each, so that the staging buffers are a
// fraction of the gradients; and the allocator's bytes for a float32 tensor of `elements`.
nn::GptConfig const deep{.vocab = 64, .block_size = 16, .n_layer = 6, .n_head = 2, .n_embd = 32};
std::size_t block(std::int64_t elements) { return mgpu::Allocator::block_size(static_cast<std::size_t>(elements) * sizeof(float)); }

// A GPT data parallel at `stage` with a gradient bucket per block (the memory tests' run).
DataParallel bucket_per_block(nn::GptConfig const& config, mgpu::DeviceGroup& group, int stage) {
  DataParallelOptions options;
  options.zero_stage = stage;
  options.clip_norm = clip;
  options.loss = std::make_shared<nn::TokenCrossEntropy const>();
  options.first_bucket_cap_bytes = 4096;
  options.bucket_cap_bytes = 8192;
  return DataParallel(nn::gpt(config), group, mgpu::optim::AdamW({.decay_ranges = nn::gpt_decay_ranges(config)}), options);
}

// The checkpoint tests' run: six batches of clusters (seeds from `first`), an MLP data parallel at
// `stage` with small buckets (several per model), and the weights of six steps straight through.
struct CheckpointRun {
  Env env;
  std::vector<Tensor> xs, ys;
  explicit CheckpointRun(unsigned first) {
    for (unsigned s = 0; s < 6; ++s) {
      auto [x, y] = env.clusters(23, first + s);
      xs.push_back(x);
      ys.push_back(y);
    }
  }
  static std::unique_ptr<DataParallel> make(mgpu::DeviceGroup& group, int stage, int accumulation = 1) {
    DataParallelOptions options;
    options.zero_stage = stage;
    options.clip_norm = 0.2f;
    options.accumulation_steps = accumulation;
    options.first_bucket_cap_bytes = 64;
    options.bucket_cap_bytes = 300;
    return std::make_unique<DataParallel>(nn::Sequential::mlp({2, 24, 17, 3}), group,
                                          mgpu::optim::AdamW({.lr = 0.02f, .weight_decay = 0.1f}), options);
  }
  // Steps [begin, end) of `dp`.
  void steps(DataParallel& dp, int begin, int end) const {
    for (int s = begin; s < end; ++s) dp.step(xs[static_cast<std::size_t>(s)], ys[static_cast<std::size_t>(s)]);
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

// What one run gives: its loss curve, rank 0's final weights, and the whole optimizer state that
// optimizer(last rank) gathers at step 10 (the run then goes on with its state sharded again).
struct Run {
  std::vector<float> losses, weights, mid_state;
};

template <class Step>
Run run(DataParallel& dp, Step const& step) {
  Run out;
  for (int s = 0; s < steps; ++s) {
    out.losses.push_back(step(s));
    if (s != steps / 2) continue;
    int const last = static_cast<int>(dp.ranks().size()) - 1;
    for (auto const& [name, tensor] : dp.optimizer(last).state()) {
      std::vector<float> const v = host_values(tensor, dp.group().stream(last));
      out.mid_state.insert(out.mid_state.end(), v.begin(), v.end());
    }
  }
  out.weights = host_values(dp.replica(0).master_parameters(), dp.group().stream(0));
  return out;
}

// Measured (stage 1 against 0): losses within 8e-8 (GPT) and 3e-6 (MLP on 4 devices) relative,
// weights within 6e-6 of 1 + |w|, optimizer state within 1.5e-4 of 1e-6 + |s| (the clipping norm,
// summed block by block, differs in its last bits, and AdamW's m and v of elements whose gradients
// nearly cancel carry that further); the bounds leave room for other kernels' orders.
void check_close(Run const& got, Run const& want, double state_bound = 1e-3) {
  double const losses = worst_relative(got.losses, want.losses);
  double const weights = worst_relative(got.weights, want.weights, 1);
  double const state = worst_relative(got.mid_state, want.mid_state, 1e-6);
  WARN("worst relative differences: losses " << losses << ", weights " << weights << ", optimizer state " << state);
  CHECK(losses <= 1e-5);
  CHECK(weights <= 1e-4);
  CHECK(state <= state_bound);
}

// Elements of the flat buffers whose optimizer state `rank` of `n` keeps at zero_stage 1: its
// block of each bucket, and the elements past the blocks (or a whole bucket smaller than n), which
// every rank updates.
std::int64_t owned_elements(std::vector<mgpu::parallel::Bucket> const& buckets, int n) {
  std::int64_t owned = 0;
  for (auto const& b : buckets) {
    std::int64_t const block = b.size() / n;
    owned += block > 0 ? block + (b.size() - block * n) : b.size();
  }
  return owned;
}

}  // namespace

TEST_CASE("zero_stage 1 gives the replicated update's GPT loss curve, weights and optimizer state",
          "[parallel][dp][zero][gpt]") {
  Env env;
  std::vector<mgpu::test::TokenBatch> batches;
  for (int s = 0; s < steps; ++s)
    batches.push_back(
        mgpu::test::rule_batch(env, batch, config.block_size, config.vocab, 200 + static_cast<unsigned>(s)));
  auto const loss = std::make_shared<nn::TokenCrossEntropy const>();
  for (int const devices : {2, 3}) {
    std::vector<Run> runs;
    for (int const stage : {0, 1}) {
      CAPTURE(devices, stage);
      mgpu::DeviceGroup group("host:" + std::to_string(devices));
      DataParallelOptions options;
      options.zero_stage = stage;
      options.seed = 3;
      options.clip_norm = clip;
      options.loss = loss;
      options.first_bucket_cap_bytes = 4096;  // several buckets, whose lengths do not divide by the ranks
      options.bucket_cap_bytes = 16384;
      DataParallel dp(nn::gpt(config), group, gpt_adamw(), options);
      runs.push_back(run(dp, [&](int s) {
        return dp.step(batches[static_cast<std::size_t>(s)].ids, batches[static_cast<std::size_t>(s)].targets).loss;
      }));
    }
    CAPTURE(devices);
    CHECK(runs[0].losses.back() < 0.8f * runs[0].losses.front());  // it learns
    check_close(runs[1], runs[0]);
  }
}

TEST_CASE("zero_stage 1 gives the replicated update's MLP loss curve on 2 and 4 devices", "[parallel][dp][zero]") {
  Env env;
  std::vector<Tensor> xs, ys;
  for (int s = 0; s < steps; ++s) {
    auto [x, y] = env.clusters(29, 40 + static_cast<unsigned>(s));
    xs.push_back(x);
    ys.push_back(y);
  }
  for (int const devices : {2, 4}) {
    std::vector<Run> runs;
    for (int const stage : {0, 1}) {
      CAPTURE(devices, stage);
      mgpu::DeviceGroup group("host:" + std::to_string(devices));
      DataParallelOptions options;
      options.zero_stage = stage;
      options.clip_norm = 0.2f;
      options.first_bucket_cap_bytes = 64;  // buckets of one layer
      options.bucket_cap_bytes = 300;
      DataParallel dp(nn::Sequential::mlp({2, 24, 17, 3}), group,
                      mgpu::optim::AdamW({.lr = 0.02f, .weight_decay = 0.1f}), options);
      runs.push_back(run(
          dp, [&](int s) { return dp.step(xs[static_cast<std::size_t>(s)], ys[static_cast<std::size_t>(s)]).loss; }));
    }
    CAPTURE(devices);
    check_close(runs[1], runs[0]);
  }
}

TEST_CASE("zero_stage 1 keeps on each device the optimizer state of its owned elements only", "[parallel][dp][zero]") {
  Env env;
  mgpu::test::TokenBatch const b = mgpu::test::rule_batch(env, batch, config.block_size, config.vocab, 7);
  std::int64_t const parameters = nn::gpt(config).parameter_count();
  for (int const devices : {2, 3, 4}) {
    for (int const stage : {0, 1}) {
      CAPTURE(devices, stage);
      mgpu::DeviceGroup group("host:" + std::to_string(devices));
      DataParallelOptions options;
      options.zero_stage = stage;
      options.clip_norm = clip;
      options.loss = std::make_shared<nn::TokenCrossEntropy const>();
      options.first_bucket_cap_bytes = 4096;
      options.bucket_cap_bytes = 16384;
      DataParallel dp(nn::gpt(config), group, gpt_adamw(), options);
      group.synchronize();
      std::vector<std::size_t> before;
      for (int r = 0; r < devices; ++r) before.push_back(group.allocator(r).stats().allocated);
      for (int s = 0; s < 2; ++s) dp.step(b.ids, b.targets);
      group.synchronize();
      // What a device holds after the steps beyond the replica and its gradients: AdamW's m and v.
      std::int64_t const kept = stage == 0 ? parameters : owned_elements(dp.buckets(), devices);
      std::size_t const expected = 2 * mgpu::Allocator::block_size(static_cast<std::size_t>(kept) * sizeof(float));
      for (int r = 0; r < devices; ++r) {
        CAPTURE(r);
        std::size_t const held = group.allocator(r).stats().allocated - before[static_cast<std::size_t>(r)];
        CHECK(held == expected);
        if (stage == 1) {  // about 1/N: the elements past the blocks are fewer than the ranks per bucket
          std::size_t const leftovers = dp.buckets().size() * static_cast<std::size_t>(devices) * 2 * sizeof(float);
          CHECK(held <= 2 * mgpu::Allocator::block_size(static_cast<std::size_t>(parameters) * sizeof(float)) /
                                static_cast<std::size_t>(devices) +
                            leftovers + 2 * 4096);
        }
      }
    }
  }
}

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

TEST_CASE("DataParallel refuses a zero_stage outside 0..3, and at 2 and 3 what they do not shard", "[parallel][dp][zero]") {
  mgpu::DeviceGroup group("host:2");
  for (int const stage : {-1, 4}) {
    CAPTURE(stage);
    REQUIRE_MGPU_ERROR(DataParallel(nn::Sequential::mlp({2, 4, 3}), group, mgpu::optim::SGD{}, {.zero_stage = stage}),
                       mgpu::Errc::invalid_argument, "zero_stage " + std::to_string(stage) + " (expected 0");
  }
  // Each sharded stage refuses 16-bit compute (bfloat16 at 2, float16 at 3), a comm hook and overlap off.
  for (std::pair<int, DType> const& refused : {std::pair{2, DType::bfloat16}, std::pair{3, DType::float16}}) {
    int const stage = refused.first;
    DType const compute = refused.second;
    std::string const what = "zero_stage " + std::to_string(stage);
    CAPTURE(stage);
    REQUIRE_MGPU_ERROR(DataParallel(nn::Sequential::mlp({2, 4, 3}), group, mgpu::optim::SGD{}, {.zero_stage = stage, .compute = compute}),
                       mgpu::Errc::invalid_argument, what + " with " + std::string(to_string(compute)) + " compute (expected float32");
    REQUIRE_MGPU_ERROR(DataParallel(nn::Sequential::mlp({2, 4, 3}), group, mgpu::optim::SGD{},
                                    {.zero_stage = stage, .comm_hook = std::make_shared<mgpu::parallel::Bf16Compression>()}),
                       mgpu::Errc::invalid_argument, what + " with the comm hook bf16-compression (expected none");
    REQUIRE_MGPU_ERROR(DataParallel(nn::Sequential::mlp({2, 4, 3}), group, mgpu::optim::SGD{}, {.overlap = false, .zero_stage = stage}),
                       mgpu::Errc::invalid_argument, what + " without overlap (expected overlap on");
  }
}

namespace {
// One run's losses and final weights at `stage` (GPT on `devices` host devices).
Run gpt_run(int devices, int stage, int accumulation, std::vector<mgpu::test::TokenBatch> const& batches, float dropout = 0,
            nn::Recompute recompute = nn::Recompute::none) {
  nn::GptConfig model = config;
  model.dropout = dropout;
  model.recompute = recompute;
  mgpu::DeviceGroup group("host:" + std::to_string(devices));
  DataParallelOptions options;
  options.zero_stage = stage;
  options.seed = 3;
  options.clip_norm = clip;
  options.accumulation_steps = accumulation;
  options.loss = std::make_shared<nn::TokenCrossEntropy const>();
  options.first_bucket_cap_bytes = 4096;  // several buckets, whose lengths do not divide by the ranks
  options.bucket_cap_bytes = 16384;
  DataParallel dp(nn::gpt(model), group, gpt_adamw(), options);
  return run(dp, [&](int s) {
    auto const& b = batches[static_cast<std::size_t>(s)];
    return dp.step(b.ids, b.targets).loss;
  });
}

std::vector<mgpu::test::TokenBatch> gpt_batches(Env& env) {
  std::vector<mgpu::test::TokenBatch> batches;
  for (int s = 0; s < steps; ++s)
    batches.push_back(mgpu::test::rule_batch(env, batch, config.block_size, config.vocab, 200 + static_cast<unsigned>(s)));
  return batches;
}
}  // namespace

// Stage 2 reduces the same staging values as stage 1 reduces in place, in the same order, and
// clips and updates the same owned ranges: the same bits.
TEST_CASE("zero_stage 2 gives zero_stage 1's GPT losses, weights and optimizer state bit for bit", "[parallel][dp][zero][gpt]") {
  Env env;
  auto const batches = gpt_batches(env);
  for (int const devices : {2, 3}) {
    CAPTURE(devices);
    Run const one = gpt_run(devices, 1, 1, batches);
    Run const two = gpt_run(devices, 2, 1, batches);
    CHECK(one.losses.back() < 0.8f * one.losses.front());  // it learns
    CHECK(two.losses == one.losses);
    CHECK(two.weights == one.weights);
    CHECK(two.mid_state == one.mid_state);
  }
}

// With accumulation stage 2 reduces each micro-batch and adds the reduced gradients, where stage 1
// adds the micro-batches first: the same sums in another order. Measured: losses within 7e-8
// relative, weights 3e-6, optimizer state 2.3e-3 of 1e-6 + |s| (m and v of elements whose
// gradients nearly cancel).
TEST_CASE("zero_stage 2 with 2 accumulated micro-batches gives zero_stage 1's GPT loss curve", "[parallel][dp][zero][gpt]") {
  Env env;
  auto const batches = gpt_batches(env);
  for (int const devices : {2, 3}) {
    CAPTURE(devices);
    check_close(gpt_run(devices, 2, 2, batches), gpt_run(devices, 1, 2, batches), 1e-2);
  }
}

// Stage 3 reduces, clips and updates as stage 2 does (the same reduce-scatters of the same values,
// the same owned ranges), its layers reading gathered copies of the same parameters: the same bits.
TEST_CASE("zero_stage 2 gives zero_stage 1's MLP loss curve bit for bit on 2 and 3 devices, and with accumulation within fp32; "
          "zero_stage 3 gives zero_stage 2's and its count_correct bit for bit",
          "[parallel][dp][zero]") {
  Env env;
  std::vector<Tensor> xs, ys;
  for (int s = 0; s < steps; ++s) {
    auto [x, y] = env.clusters(29, 40 + static_cast<unsigned>(s));
    xs.push_back(x);
    ys.push_back(y);
  }
  for (int const devices : {2, 3}) {
    for (int const accumulation : {1, 2}) {
      std::vector<Run> runs;
      std::vector<std::int64_t> correct;
      for (int const stage : {1, 2, 3}) {
        CAPTURE(devices, accumulation, stage);
        mgpu::DeviceGroup group("host:" + std::to_string(devices));
        DataParallelOptions options;
        options.zero_stage = stage;
        options.clip_norm = 0.2f;
        options.accumulation_steps = accumulation;
        options.first_bucket_cap_bytes = 64;  // buckets of one layer
        options.bucket_cap_bytes = 300;
        DataParallel dp(nn::Sequential::mlp({2, 24, 17, 3}), group, mgpu::optim::AdamW({.lr = 0.02f, .weight_decay = 0.1f}),
                        options);
        runs.push_back(run(dp, [&](int s) { return dp.step(xs[static_cast<std::size_t>(s)], ys[static_cast<std::size_t>(s)]).loss; }));
        correct.push_back(dp.count_correct(xs[0], ys[0]));
      }
      CAPTURE(devices, accumulation);
      CHECK(runs[2].losses == runs[1].losses);
      CHECK(runs[2].weights == runs[1].weights);
      CHECK(runs[2].mid_state == runs[1].mid_state);
      CHECK(correct[2] == correct[1]);
      if (accumulation == 1) {
        CHECK(runs[1].losses == runs[0].losses);
        CHECK(runs[1].weights == runs[0].weights);
      } else {
        check_close(runs[1], runs[0]);
      }
    }
  }
}

// The other paths through the step: the update inside backward (no clipping, no loss scaler), a
// loss scaler (its unscaling and overflow check on the staging and owned gradients, a power of two
// so the scale is exact) and a rank without rows (its zero gradients written into the staging).
TEST_CASE("zero_stage 2 and 3 give zero_stage 1's MLP run bit for bit without clipping, with a loss scaler and with an empty shard",
          "[parallel][dp][zero]") {
  Env env;
  std::vector<Tensor> xs, ys, small_xs, small_ys;
  for (int s = 0; s < 10; ++s) {
    auto [x, y] = env.clusters(29, 90 + static_cast<unsigned>(s));
    xs.push_back(x);
    ys.push_back(y);
    auto [sx, sy] = env.clusters(2, 120 + static_cast<unsigned>(s));  // 2 rows over 3 devices
    small_xs.push_back(sx);
    small_ys.push_back(sy);
  }
  for (std::string const variant : {"update in backward", "loss scaler", "empty shard"}) {
    std::vector<Run> runs;
    for (int const stage : {1, 2, 3}) {
      CAPTURE(variant, stage);
      mgpu::DeviceGroup group("host:3");
      DataParallelOptions options;
      options.zero_stage = stage;
      options.first_bucket_cap_bytes = 64;
      options.bucket_cap_bytes = 300;
      if (variant == "loss scaler") options.loss_scaler.emplace(1024.0f);
      if (variant == "empty shard") options.clip_norm = 0.2f;
      DataParallel dp(nn::Sequential::mlp({2, 24, 17, 3}), group, mgpu::optim::AdamW({.lr = 0.02f, .weight_decay = 0.1f}),
                      options);
      bool const small = variant == "empty shard";
      Run out;
      for (int s = 0; s < 10; ++s) {
        auto const i = static_cast<std::size_t>(s);
        auto const r = dp.step(small ? small_xs[i] : xs[i], small ? small_ys[i] : ys[i]);
        if (small) CHECK(r.rows[2] == 0);
        out.losses.push_back(r.loss);
      }
      out.weights = host_values(dp.replica(0).master_parameters(), group.stream(0));
      runs.push_back(out);
    }
    CAPTURE(variant);
    CHECK(runs[1].losses == runs[0].losses);
    CHECK(runs[1].weights == runs[0].weights);
    CHECK(runs[2].losses == runs[0].losses);
    CHECK(runs[2].weights == runs[0].weights);
  }
}

// Each device's bytes, counted by its allocator after two steps: stage 2 holds, in place of the
// whole gradient buffer, its owned elements' gradients and the staging buffers (two shared by
// the buckets but the last, and the last bucket's own): about 1/N of the gradients plus those.
// Six blocks of one bucket each, so that the staging buffers are a fraction of the gradients.
TEST_CASE("zero_stage 2 keeps on each device the gradients of its owned elements and the staging buffers only",
          "[parallel][dp][zero][gpt]") {
  Env env;
  mgpu::test::TokenBatch const b = mgpu::test::rule_batch(env, batch, deep.block_size, deep.vocab, 7);
  std::int64_t const parameters = nn::gpt(deep).parameter_count();
  for (int const devices : {2, 3, 4}) {
    std::vector<std::vector<std::size_t>> held(3);
    std::vector<mgpu::parallel::Bucket> buckets;
    for (int const stage : {1, 2}) {
      CAPTURE(devices, stage);
      mgpu::DeviceGroup group("host:" + std::to_string(devices));
      DataParallel dp = bucket_per_block(deep, group, stage);
      for (int s = 0; s < 2; ++s) dp.step(b.ids, b.targets);
      dp.group().synchronize();  // host streams' queued work holds tensors until it has run
      buckets = dp.buckets();
      for (int r = 0; r < devices; ++r) held[static_cast<std::size_t>(stage)].push_back(group.allocator(r).stats().allocated);
    }
    REQUIRE(buckets.size() == 8);  // the final LayerNorm, six blocks, the embeddings
    std::int64_t const owned = owned_elements(buckets, devices);
    std::int64_t staging = 0;
    for (std::size_t i = 0; i + 1 < buckets.size(); ++i) staging = std::max(staging, buckets[i].size());
    std::size_t const stage2_grads = block(owned) + 2 * block(staging) + block(buckets.back().size());
    // The elements past the blocks are fewer than the ranks per bucket.
    std::size_t const leftovers = buckets.size() * static_cast<std::size_t>(devices) * sizeof(float) + 4096;
    CHECK(block(owned) <= block(parameters) / static_cast<std::size_t>(devices) + leftovers);
    for (int r = 0; r < devices; ++r) {
      CAPTURE(devices, r);
      auto const i = static_cast<std::size_t>(r);
      CHECK(held[1][i] + stage2_grads == held[2][i] + block(parameters));  // one gradient layout for the other
      CHECK(held[2][i] < held[1][i]);
    }
  }
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

// Stage 3 runs stage 2's reduces and updates on the owned parameters, and its layers read gathered
// copies of the same values: the same bits, through optimizer()'s whole gather at step 10 (after
// which the next step shards again), with 2 accumulated micro-batches, with dropout, and with full
// recomputation (each block's forward rerun inside its backward, from the buffers gathered for it).
TEST_CASE("zero_stage 3 gives zero_stage 2's GPT losses, weights and optimizer state bit for bit", "[parallel][dp][zero][gpt]") {
  Env env;
  auto const batches = gpt_batches(env);
  struct Case {
    int devices, accumulation;
    float dropout;
    nn::Recompute recompute;
  };
  nn::Recompute const none = nn::Recompute::none;
  for (Case const c : {Case{2, 1, 0.0f, none}, Case{3, 1, 0.0f, none}, Case{2, 2, 0.0f, none}, Case{3, 1, 0.1f, none},
                       Case{2, 1, 0.1f, nn::Recompute::full}}) {
    CAPTURE(c.devices, c.accumulation, c.dropout, std::string(nn::to_string(c.recompute)));
    Run const two = gpt_run(c.devices, 2, c.accumulation, batches, c.dropout, c.recompute);
    Run const three = gpt_run(c.devices, 3, c.accumulation, batches, c.dropout, c.recompute);
    if (c.accumulation == 1) CHECK(two.losses.back() < 0.8f * two.losses.front());  // it learns
    CHECK(three.losses == two.losses);
    CHECK(three.weights == two.weights);
    CHECK(three.mid_state == two.mid_state);
  }
}

// Each device's bytes counted by its allocator. Held after a step (parameters, gradients and
// optimizer state: what the steps keep), stage 3 holds, in place of stage 2's whole parameter
// buffer and its two shared staging buffers, its owned elements' parameters and the last bucket's
// gathered parameters (the other buckets' memory has gone back): exactly that. Against the
// replicated run (stage 0): at most 1/N of its bytes plus the last bucket's parameters and
// gradients, plus the elements past the blocks. The peak over the steps (after construction, which
// holds the whole model before sharding it) adds to that no more than the replicated run's peak
// adds to its own (the activations) plus the units gathered meanwhile: two buckets' parameters and
// two buckets' gradients.
TEST_CASE("zero_stage 3 keeps on each device 1/N of the replicated run's parameters, gradients and optimizer state plus the "
          "gathered buckets",
          "[parallel][dp][zero][gpt]") {
  Env env;
  mgpu::test::TokenBatch const b = mgpu::test::rule_batch(env, batch, deep.block_size, deep.vocab, 7);
  std::int64_t const parameters = nn::gpt(deep).parameter_count();
  for (int const devices : {2, 3, 4}) {
    std::vector<std::vector<std::size_t>> held(4), peak(4);
    std::vector<mgpu::parallel::Bucket> buckets;
    for (int const stage : {0, 2, 3}) {
      CAPTURE(devices, stage);
      mgpu::DeviceGroup group("host:" + std::to_string(devices));
      DataParallel dp = bucket_per_block(deep, group, stage);
      for (int r = 0; r < devices; ++r) group.allocator(r).reset_peak();
      std::vector<float> losses;
      for (int s = 0; s < 3; ++s) losses.push_back(dp.step(b.ids, b.targets).loss);
      dp.group().synchronize();  // host streams' queued work holds tensors until it has run
      buckets = dp.buckets();
      for (int r = 0; r < devices; ++r) {
        held[static_cast<std::size_t>(stage)].push_back(group.allocator(r).stats().allocated);
        peak[static_cast<std::size_t>(stage)].push_back(group.allocator(r).stats().peak_allocated);
      }
      CHECK(losses.back() < losses.front());
    }
    REQUIRE(buckets.size() == 8);  // the final LayerNorm, six blocks, the embeddings
    std::int64_t const owned = owned_elements(buckets, devices);
    std::int64_t shared = 0;
    for (std::size_t i = 0; i + 1 < buckets.size(); ++i) shared = std::max(shared, buckets[i].size());
    std::size_t const last = block(buckets.back().size());  // its gathered parameters, or its gradients' staging
    std::size_t const leftovers = 4 * (buckets.size() * static_cast<std::size_t>(devices) * sizeof(float) + 4096);
    for (int r = 0; r < devices; ++r) {
      CAPTURE(devices, r);
      auto const i = static_cast<std::size_t>(r);
      WARN("device " << r << " of " << devices << ": held " << held[0][i] << " (stage 0), " << held[2][i] << " (stage 2), " << held[3][i]
                     << " (stage 3); peak " << peak[0][i] << ", " << peak[2][i] << ", " << peak[3][i]);
      CHECK(held[3][i] + block(parameters) + 2 * block(shared) == held[2][i] + block(owned) + last);  // one layout for the other
      CHECK(held[3][i] <= held[0][i] / static_cast<std::size_t>(devices) + 2 * last + leftovers);
      CHECK(peak[3][i] - held[3][i] <= peak[0][i] - held[0][i] + 4 * block(shared));
      CHECK(held[3][i] < held[2][i]);
    }
  }
}

// The gather schedule, on each rank's communication lane in stream order: forward gathers every
// bucket once, first layers first (the last bucket and the one before it at layer 0, then each
// bucket before the one forward enters is prefetched); backward gathers only buckets 2 to B - 2
// again (0 and 1, the last forward ran, and the last bucket are still in their buffers), each
// after the bucket before it has been reduce-scattered; no all-gather of updated buckets (stage
// 1's) runs, the next forward gathers the owned parameters as they are.
TEST_CASE("zero_stage 3 gathers each bucket's parameters before forward reaches it, and buckets 2 to B - 2 again in backward",
          "[parallel][dp][zero][trace]") {
  Env env;
  mgpu::test::TokenBatch const b = mgpu::test::rule_batch(env, batch, deep.block_size, deep.vocab, 7);
  mgpu::DeviceGroup group("host:2");
  auto timeline = std::make_shared<mgpu::trace::Timeline>();
  DataParallelOptions options;
  options.zero_stage = 3;
  options.loss = std::make_shared<nn::TokenCrossEntropy const>();
  options.first_bucket_cap_bytes = 4096;
  options.bucket_cap_bytes = 8192;
  options.timeline = timeline;
  DataParallel dp(nn::gpt(deep), group, mgpu::optim::AdamW({.decay_ranges = nn::gpt_decay_ranges(deep)}), options);
  REQUIRE(dp.buckets().size() == 8);
  timeline->enable();
  dp.step(b.ids, b.targets);
  dp.group().synchronize();
  for (int rank = 0; rank < 2; ++rank) {
    CAPTURE(rank);
    std::vector<mgpu::trace::Span> spans;
    for (auto const& span : timeline->spans())
      if (span.rank == rank && span.lane == mgpu::trace::Lane::communication) spans.push_back(span);
    std::sort(spans.begin(), spans.end(), [](auto const& x, auto const& y) { return x.begin_ns < y.begin_ns; });
    std::vector<std::string> names;
    for (auto const& span : spans)
      if (span.name.find("gather") != std::string::npos || span.name.find("reduce") != std::string::npos) names.push_back(span.name);
    std::vector<std::string> want;
    for (int bucket = 7; bucket >= 0; --bucket) want.push_back("all-gather parameters bucket " + std::to_string(bucket));
    want.push_back("reduce-scatter bucket 0");
    for (int bucket = 1; bucket < 8; ++bucket) {
      if (bucket + 1 <= 6) want.push_back("all-gather parameters bucket " + std::to_string(bucket + 1));  // prefetched on entering
      want.push_back("reduce-scatter bucket " + std::to_string(bucket));
    }
    CHECK(names == want);
  }
}

// The prefetch: backward gathers bucket b + 1 as it enters bucket b, so the gather runs on the
// communication stream while bucket b's layer computes. Emulated at a tenth of the host's speed,
// compute is mostly sleep, so the communication workers get a core however loaded the machine is;
// bucket 2's layer is the widest, so its backward is long beside the other rank's lag.
TEST_CASE("zero_stage 3's backward gathers the next bucket's parameters while the current bucket computes",
          "[parallel][dp][zero][trace]") {
  Env env;
  Tensor x = env.random({64, 64}, 9);
  Tensor y = env.make({64}, std::vector<float>(64, 1.0f));
  mgpu::DeviceGroup group{"host:2@speed=0.1"};
  auto timeline = std::make_shared<mgpu::trace::Timeline>();
  DataParallelOptions options;
  options.zero_stage = 3;
  options.timeline = timeline;
  options.first_bucket_cap_bytes = 64;  // a bucket per Linear
  options.bucket_cap_bytes = 64;
  DataParallel dp(nn::Sequential::mlp({64, 128, 1024, 1024, 16, 10}), group, mgpu::optim::SGD({.lr = 0.01f}), options);
  REQUIRE(dp.buckets().size() == 5);  // buckets 2 and 3 are gathered again in backward
  timeline->enable();
  dp.step(x, y);
  dp.step(x, y);
  dp.group().synchronize();
  auto const spans = timeline->spans();
  bool overlapped = false;
  for (auto const& gather : spans) {
    if (gather.name != "all-gather parameters bucket 3") continue;
    for (auto const& bwd : spans)  // bucket 2 is Linear(1024, 1024)
      if (bwd.rank == gather.rank && bwd.name == "backward Linear(1024, 1024)" && gather.begin_ns < bwd.end_ns &&
          gather.end_ns > bwd.begin_ns)
        overlapped = true;
  }
  if (!overlapped) {
    for (auto const& s : spans) UNSCOPED_INFO(s.rank << " " << s.lane << " " << s.name << " " << s.begin_ns / 1000 << " " << s.end_ns / 1000);
  }
  CHECK(overlapped);
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
