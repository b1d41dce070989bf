// Checkpoints of the data x tensor x pipeline grid across processes, run by ctest under mpirun:
//
//   grid_checkpoint_dist COUNTS FOLDER  (8 devices in all, e.g. "4,4") pipeline::Executor's
//       DP 2 x TP 2 x PP 2 grid (dropout, clipping, a vocab the ranks do not divide) over the
//       processes' devices saves into FOLDER mid-run; resumed across the processes, in one
//       process by the same grid and on one device (io::load_training), each run's losses and
//       weights are the uninterrupted run's within float32 rounding (the uninterrupted run: the
//       same grid in one process, which every process runs itself). A folder with a damaged
//       shard is refused on every process, naming the shard and its record, and the grid loads
//       the good one after.
//
// Exit status 0 when every check passed.
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <mgpu/dist/dist.hpp>
#include <mgpu/io/checkpoint.hpp>
#include <mgpu/io/sharded_checkpoint.hpp>
#include <mgpu/nn/gpt.hpp>
#include <mgpu/nn/loss.hpp>
#include <mgpu/nn/train.hpp>
#include <mgpu/ops/ops.hpp>
#include <mgpu/optim/optim.hpp>
#include <mgpu/pipeline/pipeline.hpp>

using mgpu::DType;
using mgpu::Tensor;
using namespace std::chrono_literals;
namespace nn = mgpu::nn;
namespace pp = mgpu::pipeline;

namespace {

int failures = 0;
int checks = 0;
int process = 0;

#define EXPECT(condition, what)                                                                      \
  do {                                                                                               \
    ++checks;                                                                                        \
    if (!(condition)) {                                                                              \
      ++failures;                                                                                    \
      std::ostringstream text_;                                                                      \
      text_ << what;                                                                                 \
      std::fprintf(stderr, "process %d: FAILED %s: %s\n", process, #condition, text_.str().c_str()); \
    }                                                                                                \
  } while (false)

nn::GptConfig const config{.vocab = 33, .block_size = 8, .n_layer = 2, .n_head = 2, .n_embd = 16, .dropout = 0.1f};
std::uint64_t const seed = 5;
int const steps = 5, saved_at = 2;
float const clip = 0.1f;
double const tolerance = 1e-5;  // float32 rounding of other summation orders
mgpu::optim::AdamWOptions const adamw{.lr = 0.01f, .weight_decay = 0.1f};

pp::ChunkOptimizerFactory const chunk_adamw = [](nn::Sequential const& chunk) {
  mgpu::optim::AdamWOptions options = adamw;
  options.decay_ranges = chunk.matrix_ranges();
  return std::make_unique<mgpu::optim::AdamW>(options);
};

std::shared_ptr<mgpu::Allocator> const host = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});

struct Batch {
  Tensor ids, targets;
};
std::vector<Batch> make_batches() {
  std::mt19937 rng(12);
  std::vector<Batch> out;
  for (int b = 0; b < steps; ++b) {
    Batch batch{Tensor::empty({8, config.block_size}, DType::int32, *host),
                Tensor::empty({8, config.block_size}, DType::int32, *host)};
    for (Tensor const* t : {&batch.ids, &batch.targets})
      for (std::int32_t& v : t->host_span<std::int32_t>()) v = static_cast<std::int32_t>(rng() % config.vocab);
    out.push_back(batch);
  }
  return out;
}

// The whole model's float32 weights, as `executor` gathers them.
std::vector<double> gathered(pp::Executor& executor) {
  mgpu::Stream stream{mgpu::Device{mgpu::DeviceKind::host, 0}};
  nn::Sequential whole = nn::gpt(config);
  nn::Context ctx{*host, stream};
  whole.materialize(ctx, seed + 1);
  executor.gather_parameters(whole, stream);
  auto const values = whole.master_parameters().host_span<float>();
  return {values.begin(), values.end()};
}

double worst(std::vector<double> const& have, std::vector<double> const& want) {
  if (have.size() != want.size()) return INFINITY;
  double out = 0;
  for (std::size_t i = 0; i < have.size(); ++i)
    out = std::max(out, std::abs(have[i] - want[i]) / (1 + std::abs(want[i])));
  return out;
}

struct Run {
  std::vector<double> losses, weights;  // the losses of steps [saved_at, steps), then the weights
};

void expect_continues(Run const& got, Run const& want, std::string const& what) {
  EXPECT(worst(got.losses, want.losses) <= tolerance,
         what << ": losses differ from the uninterrupted run's by " << worst(got.losses, want.losses));
  EXPECT(worst(got.weights, want.weights) <= 5 * tolerance,
         what << ": weights differ from the uninterrupted run's by " << worst(got.weights, want.weights));
}

// Steps [from, steps) of `executor`, then its weights.
Run finish(pp::Executor& executor, std::vector<Batch> const& batches, int from) {
  Run run;
  for (int b = from; b < steps; ++b)
    run.losses.push_back(
        executor.step(batches[static_cast<std::size_t>(b)].ids, batches[static_cast<std::size_t>(b)].targets));
  run.weights = gathered(executor);
  return run;
}

void test_grid_checkpoint(mgpu::dist::World const& world, mgpu::DeviceGroup& group,
                          std::filesystem::path const& folder) {
  std::vector<Batch> const batches = make_batches();
  nn::Sequential const model = nn::gpt(config);
  std::vector<std::size_t> const cuts = pp::partition(model, 2, std::vector<double>(model.size(), 1.0)).cuts;
  pp::ExecutorOptions options{.seed = seed,
                              .data_parallel = 2,
                              .timeout = 60s,
                              .clip_norm = clip,
                              .tensor_parallel = pp::tensor_parallel_stages(nn::gpt(config), {}, 2)};
  mgpu::io::TrainingState const position{.step = saved_at, .data_seed = 41};
  Run uninterrupted;
  {
    mgpu::DeviceGroup one("host:8");
    pp::Executor reference(model, one, cuts, pp::one_f_one_b(2, 2), chunk_adamw, options);
    for (int b = 0; b < saved_at; ++b)
      reference.step(batches[static_cast<std::size_t>(b)].ids, batches[static_cast<std::size_t>(b)].targets);
    uninterrupted = finish(reference, batches, saved_at);
  }
  pp::ExecutorOptions const in_one_process = options;
  options.make_communicator = mgpu::dist::communicator_factory(world);
  options.make_subset_communicator = mgpu::dist::subset_communicator_factory(world);
  if (process == 0) std::filesystem::remove_all(folder);  // before any process writes (save() agrees first)
  {
    pp::Executor executor(model, group, cuts, pp::one_f_one_b(2, 2), chunk_adamw, options);
    for (int b = 0; b < saved_at; ++b)
      executor.step(batches[static_cast<std::size_t>(b)].ids, batches[static_cast<std::size_t>(b)].targets);
    executor.save(folder, position);
    expect_continues(finish(executor, batches, saved_at), uninterrupted, "the run that saved");
  }
  {
    pp::Executor executor(model, group, cuts, pp::one_f_one_b(2, 2), chunk_adamw, options);
    executor.step(batches[0].ids, batches[0].targets);  // what load() replaces
    EXPECT(executor.load(folder).data_seed == position.data_seed, "resumed across the processes: the training state");
    expect_continues(finish(executor, batches, saved_at), uninterrupted, "resumed across the processes");
  }
  {
    mgpu::DeviceGroup one("host:8");
    pp::Executor executor(model, one, cuts, pp::one_f_one_b(2, 2), chunk_adamw, in_one_process);
    EXPECT(executor.load(folder).step == saved_at, "resumed in one process: the training state");
    expect_continues(finish(executor, batches, saved_at), uninterrupted, "resumed in one process");
  }
  {
    mgpu::Stream stream{mgpu::Device{mgpu::DeviceKind::host, 0}};
    nn::Context ctx{*host, stream};
    nn::Sequential one = nn::gpt(config);
    one.materialize(ctx, seed + 2);
    mgpu::optim::AdamWOptions options_one = adamw;
    options_one.decay_ranges = nn::gpt_decay_ranges(config);
    mgpu::optim::AdamW optimizer(options_one);
    mgpu::io::load_training(mgpu::io::ShardedCheckpoint::load(folder).joined(), folder.string(), one, optimizer, *host,
                            stream);
    Run run;
    for (int b = saved_at; b < steps; ++b)
      run.losses.push_back(mgpu::ops::item(nn::train_step(one, optimizer, batches[static_cast<std::size_t>(b)].ids,
                                                          batches[static_cast<std::size_t>(b)].targets,
                                                          nn::TokenCrossEntropy{}, ctx, {.clip_norm = clip})
                                               .loss,
                                           stream));
    stream.synchronize();
    auto const values = one.master_parameters().host_span<float>();
    run.weights.assign(values.begin(), values.end());
    expect_continues(run, uninterrupted, "resumed on one device");
  }
  // Process 0 damages a copy of the folder (a byte in the middle of its shard, which holds every
  // record); every process's load fails naming the shard and the record, changing nothing.
  std::filesystem::path const copy = folder.string() + "-damaged";
  auto const barrier = mgpu::dist::make_communicator(world, group);
  auto const wait_all = [&] {
    group.run([&](int l, mgpu::Device, mgpu::Stream& stream) { barrier->barrier(barrier->first_rank() + l, stream); });
    group.synchronize();
  };
  std::filesystem::path shard;
  for (auto const& entry : std::filesystem::directory_iterator(folder))
    if (entry.path().filename().string().starts_with("shard-") &&
        entry.path().filename().string().find("-0-of-") != std::string::npos)
      shard = copy / entry.path().filename();
  if (process == 0) {
    std::filesystem::remove_all(copy);
    std::filesystem::copy(folder, copy);
    std::fstream file(shard, std::ios::in | std::ios::out | std::ios::binary);
    auto const middle = static_cast<std::streamoff>(std::filesystem::file_size(shard) / 2);
    char byte = 0;
    file.seekg(middle);
    file.read(&byte, 1);
    byte = static_cast<char>(byte ^ 0x10);
    file.seekp(middle);
    file.write(&byte, 1);
  }
  wait_all();
  pp::Executor executor(model, group, cuts, pp::one_f_one_b(2, 2), chunk_adamw, options);
  std::vector<double> const before = gathered(executor);
  try {
    executor.load(copy);
    EXPECT(false, "a damaged shard was accepted");
  } catch (mgpu::Error const& e) {
    std::string const text = e.what();
    EXPECT(e.category() == mgpu::Errc::corrupt_data &&
               text.find(shard.filename().string() + ": checksum mismatch in record '") != std::string::npos,
           "a damaged shard: " << text << " (expected corrupt_data naming " << shard.filename().string()
                               << " and its record)");
  }
  EXPECT(gathered(executor) == before, "a failed load changed the weights");
  EXPECT(executor.load(folder).step == saved_at, "a load after a failed one");
  expect_continues(finish(executor, batches, saved_at), uninterrupted, "loaded after a failed load");
  wait_all();
  if (process == 0) std::filesystem::remove_all(copy);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: grid_checkpoint_dist COUNTS FOLDER (8 devices in all)\n");
    return 2;
  }
  std::vector<int> counts;
  int total = 0;
  for (std::stringstream list(argv[1]); list.good();) {
    std::string item;
    std::getline(list, item, ',');
    counts.push_back(std::stoi(item));
    total += counts.back();
  }
  if (total != 8) {
    std::fprintf(stderr, "usage: grid_checkpoint_dist COUNTS FOLDER (8 devices in all, not %d)\n", total);
    return 2;
  }
  try {
    mgpu::dist::Session session;
    process = session.place().rank;
    if (session.place().size != static_cast<int>(counts.size())) {
      std::fprintf(stderr, "process %d: %d processes, but COUNTS lists %zu\n", process, session.place().size,
                   counts.size());
      return 2;
    }
    mgpu::DeviceGroup group("host:" + std::to_string(counts[static_cast<std::size_t>(process)]));
    mgpu::dist::World const world = mgpu::dist::make_world(group);
    test_grid_checkpoint(world, group, argv[2]);
    std::printf("process %d: %d of %d checks passed\n", process, checks - failures, checks);
    return failures == 0 ? 0 : 1;
  } catch (std::exception const& e) {
    std::fprintf(stderr, "process %d: %s\n", process, e.what());
    return 1;
  }
}
