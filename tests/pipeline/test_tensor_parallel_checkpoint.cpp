// Checkpoints of a data x tensor x pipeline grid (pipeline::Executor with tensor-parallel stages)
// in the one-device format: saved by DP 2 x TP 2 x PP 2 mid-run (dropout on, a vocab the ranks do
// not divide), resumed on one device (io::load_training), on TP 4 (TensorParallel), on a plain
// 2-stage pipeline x DP 2, on DataParallel x 2 with ZeRO-1 and by a new grid, each continuing with
// the uninterrupted run's losses and weights within float32 rounding; a one-device checkpoint
// loaded into the grid continues as the one device; a folder save loads back; a damaged shard or
// file and another model's checkpoint are refused naming the file (and the damaged record), the
// grid unchanged. Folders (format 2, each rank's boxes): saved by the grid with ZeRO, resumed on one
// device, TP 4 and PP 2 x DP 2 with ZeRO-1, each rank reading its chunks' boxes only.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <mgpu/core/device_group.hpp>
#include <mgpu/comm/communicator.hpp>
#include <mgpu/io/checkpoint.hpp>
#include <mgpu/io/sharded_checkpoint.hpp>
#include <mgpu/nn/gpt.hpp>
#include <mgpu/nn/loss.hpp>
#include <mgpu/nn/train.hpp>
#include <mgpu/ops/ops.hpp>
#include <mgpu/optim/optim.hpp>
#include <mgpu/parallel/data_parallel.hpp>
#include <mgpu/parallel/shard_boxes.hpp>
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
std::unique_ptr<pp::Executor> make_grid(mgpu::DeviceGroup& group, int zero_stage = 0) {
  return std::make_unique<pp::Executor>(nn::gpt(config), group, std::vector<std::size_t>{0, 3, 6},
                                        pp::one_f_one_b(2, 2), chunk_adamw(),
                                        pp::ExecutorOptions{.seed = seed,
                                                            .data_parallel = 2,
                                                            .zero_stage = zero_stage,
                                                            .clip_norm = clip,
                                                            .tensor_parallel = pp::tensor_parallel_stages(nn::gpt(config), {}, 2)});
}

std::vector<double> gathered(pp::Executor& ex, Env& env) {
  nn::Sequential whole = nn::gpt(config);
  whole.materialize(env.ctx, seed + 1);
  ex.gather_parameters(whole, env.stream);
  return as_double(whole.master_parameters());
}

// A 2-stage pipeline x DP 2 (1F1B) with ZeRO `zero_stage` on `group`'s 4 devices, no tensor parallelism.
pp::Executor make_plain(mgpu::DeviceGroup& group, int zero_stage = 0) {
  return pp::Executor(nn::gpt(config), group, {0, 3, 6}, pp::one_f_one_b(2, 2), chunk_adamw(),
                      {.seed = seed + 1,
                       .data_parallel = 2,
                       .zero_stage = zero_stage,
                       .clip_norm = clip,
                       .loss = std::make_shared<nn::TokenCrossEntropy const>()});
}

// An empty folder at the temporary `name`.
std::filesystem::path fresh_folder(std::string const& name) {
  auto const folder = mgpu::test::temp_path(name);
  std::filesystem::remove_all(folder);
  std::filesystem::create_directories(folder);
  return folder;
}

// The losses of steps [saved_at, steps), each `step(batch)`'s.
template <class Step>
std::vector<double> losses_after_save(std::vector<Batch> const& batches, Step const& step) {
  std::vector<double> losses;
  for (auto s = static_cast<std::size_t>(saved_at); s < static_cast<std::size_t>(steps); ++s) losses.push_back(step(batches[s]));
  return losses;
}

// The steps [saved_at, steps) of a run: losses, then the weights.
struct Run {
  std::vector<double> losses, weights;
};

// The steps [saved_at, steps) on one device from `path`.
Run one_device(Env& env, std::vector<Batch> const& batches, std::filesystem::path const& path) {  // a file or a folder
  nn::Sequential model = nn::gpt(config);
  model.materialize(env.ctx, seed + 1);  // other weights, which the file replaces
  mgpu::optim::AdamWOptions options = adamw;
  options.decay_ranges = nn::gpt_decay_ranges(config);
  mgpu::optim::AdamW optimizer(options);
  io::Checkpoint const records =
      std::filesystem::is_directory(path) ? io::ShardedCheckpoint::load(path).joined() : io::Checkpoint::load(path);
  CHECK(io::load_training(records, path.string(), model, optimizer, *env.allocator, env.stream).step == saved_at);
  Run run;
  run.losses = losses_after_save(batches, [&](Batch const& b) {
    return mgpu::ops::item(
        nn::train_step(model, optimizer, b.ids, b.targets, nn::TokenCrossEntropy{}, env.ctx, {.clip_norm = clip}).loss, env.stream);
  });
  env.stream.synchronize();
  run.weights = as_double(model.master_parameters());
  return run;
}

// TP 4 (TensorParallel) from `path` (a file or a folder): the `saved` weights, then its steps.
Run tensor_parallel_run(std::vector<Batch> const& batches, std::filesystem::path const& path, std::vector<double> const& saved) {
  mgpu::DeviceGroup four("host:4");
  par::TensorParallel tp(four, nn::gpt(config), {.seed = seed + 1, .adamw = adamw, .clip_norm = clip});
  CHECK(tp.load(path).step == saved_at);
  std::vector<float> const loaded = tp.gather_parameters();
  CHECK(std::vector<double>(loaded.begin(), loaded.end()) == saved);
  Run run;
  run.losses = losses_after_save(batches, [&tp](Batch const& b) { return tp.step(b.ids, b.targets).loss; });
  std::vector<float> const end = tp.gather_parameters();
  run.weights.assign(end.begin(), end.end());
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


// Each test's batches and 8 host devices for the grid (make_grid), and what a grid saved mid-run leaves.
struct GridFixture {
  Env env;
  std::vector<Batch> const batches = make_batches(env);
  mgpu::DeviceGroup eight{"host:8"};
  std::vector<double> saved;  // save_midway's: the grid's weights at the save,
  Run uninterrupted;          // and its steps after it

  // `ex`'s steps [saved_at, steps), then its weights.
  Run continue_run(pp::Executor& ex) {
    Run run;
    run.losses = losses_after_save(batches, [&ex](Batch const& b) { return ex.step(b.ids, b.targets); });
    run.weights = gathered(ex, env);
    return run;
  }

  // The steps [0, saved_at) of `grid`, saved to `path` (a file or a folder) with data seed 3, and
  // its steps after the save.
  void save_midway(pp::Executor& grid, std::filesystem::path const& path) {
    for (std::size_t s = 0; s < static_cast<std::size_t>(saved_at); ++s) grid.step(batches[s].ids, batches[s].targets);
    grid.save(path, {.step = saved_at, .data_seed = 3});
    saved = gathered(grid, env);
    uninterrupted = continue_run(grid);
  }
};

}  // namespace

TEST_CASE_METHOD(GridFixture, "a DP 2 x TP 2 x PP 2 checkpoint resumes on one device, TP 4, PP 2 x DP 2, ZeRO-1 DP 2 and a new grid",
                 "[pipeline][tensor][checkpoint]") {
  auto const path = mgpu::test::temp_path("mgpu_grid_checkpoint.ckpt");
  std::unique_ptr<pp::Executor> grid = make_grid(eight);
  save_midway(*grid, path);
  REQUIRE(worst_difference(uninterrupted.weights, saved) > 1e-3);  // the steps after the save moved the weights

  SECTION("one device") { check_continues("one device", one_device(env, batches, path), uninterrupted); }
  SECTION("TP 4 (TensorParallel)") { check_continues("TP 4", tensor_parallel_run(batches, path, saved), uninterrupted); }
  SECTION("a plain 2-stage pipeline x DP 2") {
    mgpu::DeviceGroup four("host:4");
    pp::Executor plain = make_plain(four);
    CHECK(plain.load(path).data_seed == 3);
    CHECK(gathered(plain, env) == saved);
    check_continues("PP 2 x DP 2", continue_run(plain), uninterrupted);
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
    run.losses = losses_after_save(batches, [&dp](Batch const& b) { return dp.step(b.ids, b.targets).loss; });
    run.weights = as_double(dp.replica(0).master_parameters());
    check_continues("DataParallel ZeRO-1 x 2", run, uninterrupted);
  }
  SECTION("a new grid, after steps of its own") {
    mgpu::DeviceGroup group("host:8");
    std::unique_ptr<pp::Executor> resumed = make_grid(group);
    resumed->step(batches[0].ids, batches[0].targets);  // weights, moments and RNG that load() replaces
    CHECK(resumed->load(path).step == saved_at);
    CHECK(gathered(*resumed, env) == saved);
    Run const run = continue_run(*resumed);
    CHECK(run.losses == uninterrupted.losses);  // the same layout: bit for bit
    CHECK(run.weights == uninterrupted.weights);
  }
  std::filesystem::remove(path);
}

TEST_CASE_METHOD(GridFixture, "a one-device checkpoint loaded into DP 2 x TP 2 x PP 2 continues as the one device",
                 "[pipeline][tensor][checkpoint]") {
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
  std::unique_ptr<pp::Executor> grid = make_grid(eight);
  CHECK(grid->load(path).step == saved_at);
  check_continues("DP 2 x TP 2 x PP 2 from one device", continue_run(*grid), want);
  std::filesystem::remove(path);
}

TEST_CASE_METHOD(GridFixture,
                 "a grid's folder checkpoint loads back, and a damaged shard or another model's file is refused, the grid unchanged",
                 "[pipeline][tensor][checkpoint]") {
  auto const folder = fresh_folder("mgpu_grid_checkpoint_folder");
  std::unique_ptr<pp::Executor> grid = make_grid(eight);
  grid->step(batches[0].ids, batches[0].targets);
  grid->save(folder, {.step = 1});
  std::vector<double> const at_save = gathered(*grid, env);
  grid->step(batches[1].ids, batches[1].targets);
  CHECK(grid->load(folder).step == 1);
  CHECK(gathered(*grid, env) == at_save);
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

TEST_CASE_METHOD(GridFixture,
                 "a DP 2 x TP 2 x PP 2 ZeRO folder of each rank's boxes resumes on one device, TP 4 and PP 2 x DP 2 with ZeRO-1",
                 "[pipeline][tensor][checkpoint][box]") {
  int const zero = GENERATE(1, 2, 3);  // the grid's ZeRO stage
  CAPTURE(zero);
  auto const folder = fresh_folder("mgpu_grid_boxes_" + std::to_string(zero));
  std::unique_ptr<pp::Executor> grid = make_grid(eight, zero);
  save_midway(*grid, folder);
  {
    // Boxes only: the tensors by name, no element ranges of the whole model.
    auto const c = io::ShardedCheckpoint::load(folder);
    CHECK(c.version() == 2);
    CHECK(c.is_layout("model.parameters"));
    CHECK(!c.split_by_elements("model.parameters/h.0.attn_qkv.weight"));
  }

  check_continues("one device", one_device(env, batches, folder), uninterrupted);
  check_continues("TP 4", tensor_parallel_run(batches, folder, saved), uninterrupted);
  {
    // Each chunk's boxes read once (both replicas' chunks alike): the model and its two moments,
    // and the tied head's copy of wte, no more.
    mgpu::DeviceGroup four("host:4");
    pp::Executor plain = make_plain(four, 1);
    auto const c = io::ShardedCheckpoint::load(folder);
    std::uint64_t const at_load = c.payload_bytes_read();
    CHECK(plain.load(c).data_seed == 3);
    auto const model_bytes = static_cast<std::uint64_t>(nn::gpt(config).parameter_count()) * sizeof(float);
    auto const wte_bytes = static_cast<std::uint64_t>(config.vocab * config.n_embd) * sizeof(float);
    CHECK(c.payload_bytes_read() - at_load == 3 * (model_bytes + wte_bytes));
    CHECK(gathered(plain, env) == saved);
    check_continues("PP 2 x DP 2 ZeRO-1", continue_run(plain), uninterrupted);
  }
  {
    // A folder of whole records (DataParallel's in one process, as loaded) into the grid: the same weights.
    mgpu::DeviceGroup two("host:2");
    mgpu::optim::AdamWOptions options = adamw;
    options.decay_ranges = nn::gpt_decay_ranges(config);
    par::DataParallelOptions dp_options;
    dp_options.seed = seed + 1;
    par::DataParallel dp(nn::gpt(config), two, mgpu::optim::AdamW(options), dp_options);
    CHECK(dp.load(folder).step == saved_at);
    auto const whole_records = fresh_folder("mgpu_grid_whole_records_" + std::to_string(zero));
    dp.save(whole_records, {.step = saved_at});
    REQUIRE(!io::ShardedCheckpoint::load(whole_records).has_pieces("model.parameters"));
    std::unique_ptr<pp::Executor> again = make_grid(eight, zero);
    CHECK(again->load(whole_records).step == saved_at);
    CHECK(gathered(*again, env) == saved);
    std::filesystem::remove_all(whole_records);
  }
  std::filesystem::remove_all(folder);
}

TEST_CASE_METHOD(GridFixture, "a TP rank's pipeline chunk reads its own boxes: about half of its layers' bytes",
                 "[pipeline][tensor][checkpoint][box]") {
  auto const folder = fresh_folder("mgpu_grid_chunk_boxes");
  std::unique_ptr<pp::Executor> grid = make_grid(eight);
  grid->step(batches[0].ids, batches[0].targets);
  grid->save(folder, {.step = 1});
  std::vector<double> const whole = gathered(*grid, env);
  // Tensor-parallel rank 1's second chunk (the model's layers [3, 6): a block, the final LayerNorm
  // and the tied head, which holds a copy of its rank's 34 rows of wte).
  mgpu::DeviceGroup two("host:2");
  std::shared_ptr<mgpu::comm::Communicator> const comm = mgpu::comm::make_communicator(two);
  pp::TensorParallelStages const stages = pp::tensor_parallel_stages(nn::gpt(config), {}, 2);
  nn::Sequential chunk = stages.stage(comm, 1, 3, 6);
  for (std::size_t i = 0; i < chunk.size(); ++i)  // as the executor makes it: the head without its embedding
    if (auto* head = dynamic_cast<par::VocabParallelLMHead*>(&chunk.layer(i))) head->hold_weight();
  std::vector<std::size_t> const origins = stages.origins(comm, 1, 3, 6);
  nn::Sequential const model = nn::gpt(config);
  auto const c = io::ShardedCheckpoint::load(folder);
  std::uint64_t const at_load = c.payload_bytes_read();
  std::int64_t elements = 0, copied = 0;
  auto const host = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  std::vector<float> buffer(static_cast<std::size_t>(chunk.parameter_count()), -1.0f);
  for (par::ShardBox const& b : par::shard_boxes(model, chunk, origins)) {
    par::read_box_into(c, {}, "model.parameters", b, buffer, env.stream);
    // The box's elements of the whole model, serially, against where the chunk holds them.
    std::int64_t const cols = b.shape.back();
    std::int64_t const row0 = b.shape.size() == 1 ? 0 : b.box.offsets[0];
    for (std::size_t r = 0; r < b.rows.size(); ++r)
      for (std::int64_t k = 0; k < b.box.lengths.back(); ++k)
        CHECK(static_cast<double>(buffer[static_cast<std::size_t>(b.rows[r] + k)]) ==
              whole[static_cast<std::size_t>(b.offset + (row0 + static_cast<std::int64_t>(r)) * cols + b.box.offsets.back() + k)]);
    elements += b.box.numel();
    if (b.copy) copied += b.box.numel();
  }
  CHECK(std::find(buffer.begin(), buffer.end(), -1.0f) == buffer.end());  // every element read
  CHECK(elements == chunk.parameter_count());
  CHECK(copied == 34 * config.n_embd);  // rows 33 to 66 of wte
  CHECK(c.payload_bytes_read() - at_load == static_cast<std::uint64_t>(elements) * sizeof(float));
  // The whole model's layers [3, 6) and the wte rows the head uses: rank 1 reads about half.
  std::int64_t share = config.vocab * config.n_embd;
  for (std::size_t l = 3; l < 6; ++l) share += model.layer(l).parameter_count();
  double const fraction = static_cast<double>(elements) / static_cast<double>(share);
  WARN("TP rank 1's chunk 1 reads " << fraction << " of its layers' bytes");
  CHECK(fraction > 0.45);
  CHECK(fraction < 0.55);
  // Origins that do not fit the chunk are refused, naming what was expected.
  REQUIRE_MGPU_ERROR((void)par::shard_boxes(model, chunk, std::vector<std::size_t>{3, 4}), mgpu::Errc::invalid_argument,
                     "(expected one per layer)");
  std::vector<std::size_t> shifted = origins;
  shifted[0] = shifted[1];  // two layers of one origin
  REQUIRE_MGPU_ERROR((void)par::shard_boxes(model, chunk, shifted), mgpu::Errc::invalid_argument, "two layers with parameters");
  std::filesystem::remove_all(folder);
}
