// mgpu_mpi_dist's pipeline and pipeline_checkpoint modes (tests/dist/mpi_dist.cpp says what each
// checks): pipeline::Executor with its stages in different processes, and its checkpoints.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <utility>

#include <unistd.h>

#include <mgpu/io/sharded_checkpoint.hpp>
#include <mgpu/nn/gpt.hpp>
#include <mgpu/nn/loss.hpp>
#include <mgpu/optim/optim.hpp>
#include <mgpu/parallel/data_parallel.hpp>

#include "mpi_dist.hpp"

namespace mpi_dist {

// The pipeline executor with its stages on every process's devices (one stage per pipeline
// device; with two replicas, a data x pipeline grid whose replicas sum their gradients across
// processes) against the same executor over world.size() devices of this process: every device
// computes the same chunk from the same inputs and the replicas' sums run in the same order, so
// the losses and parameters are the same bits however the devices are spread over processes.
void test_pipeline(Setup const& s) {
  namespace pp = mgpu::pipeline;
  std::shared_ptr<mgpu::Allocator> host = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  std::int64_t const rows = 26;  // uneven micro-batches
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0, 1);
  std::vector<Tensor> xs, ys;
  for (int b = 0; b < 3; ++b) {
    xs.push_back(Tensor::empty({rows, 6}, DType::float32, *host));
    for (float& v : xs.back().host_span<float>()) v = normal(rng);
    ys.push_back(Tensor::empty({rows}, DType::float32, *host));
    for (float& v : ys.back().host_span<float>()) v = static_cast<float>(rng() % 4);
  }
  pp::OptimizerFactory const sgd = [] {
    return std::make_unique<mgpu::optim::SGD>(mgpu::optim::SgdOptions{.lr = 0.05f, .momentum = 0.9f});
  };
  for (int const replicas : {1, 2}) {
    int const devices = s.size() / replicas;
    if (s.size() % replicas != 0 || devices + 1 > static_cast<int>(dp_model(false).cut_points().size()))
      continue;  // a unit per stage
    struct Config {
      bool dropout;
      float clip_norm;  // the global norm then sums every process's chunks
      bool fp16;        // float16 compute with a loss scaler, whose overflow count does too
    };
    for (Config const config : {Config{false, 0, false}, Config{true, 0.05f, false}, Config{false, 0.05f, true}}) {
      bool const dropout = config.dropout;
      mgpu::nn::Sequential const model = dp_model(dropout);
      std::vector<std::size_t> const cuts = pp::partition(model, devices, std::vector<double>(model.size(), 1.0)).cuts;
      for (pp::Schedule const& schedule : {pp::gpipe(devices, 4), pp::one_f_one_b(devices, 4)}) {
        std::string const what = "pipeline " + schedule.name + " x " + std::to_string(replicas) + " replica(s)" +
                                 (dropout ? ", dropout" : "") + (config.clip_norm > 0 ? ", clipping" : "") +
                                 (config.fp16 ? ", float16 with a loss scaler" : "");
        pp::ExecutorOptions options{.seed = 7,
                                    .data_parallel = replicas,
                                    .timeout = 60s,
                                    .compute = config.fp16 ? DType::float16 : DType::float32,
                                    .clip_norm = config.clip_norm};
        if (config.fp16) options.loss_scaler.emplace();
        mgpu::DeviceGroup one("host:" + std::to_string(s.size()));
        pp::Executor reference(model, one, cuts, schedule, sgd, options);
        options.make_communicator = mgpu::dist::communicator_factory(s.world);
        options.make_subset_communicator = mgpu::dist::subset_communicator_factory(s.world);
        pp::Executor executor(model, s.group, cuts, schedule, sgd, options);
        for (std::size_t b = 0; b < xs.size(); ++b) {
          float const expected = reference.step(xs[b], ys[b]);
          float const got = executor.step(xs[b], ys[b]);
          EXPECT(std::memcmp(&got, &expected, sizeof got) == 0,
                 what << ": step " << b << " loss " << got << " (expected " << expected << ")");
          EXPECT(executor.last_step_applied() == reference.last_step_applied(),
                 what << ": step " << b << " applied or skipped unlike one process");
        }
        if (config.fp16)
          EXPECT(executor.loss_scaler()->state().scale == reference.loss_scaler()->state().scale,
                 what << ": the loss scale differs");
        for (int l = 0; l < s.local(); ++l) {
          int const c = s.rank(l) % devices;  // one chunk per device
          int const replica = s.rank(l) / devices;
          bool const same = same_bits(host_values(executor.chunk(c, replica).master_parameters(), s.group.stream(l)),
                                      host_values(reference.chunk(c, replica).master_parameters(), one.stream(0)));
          EXPECT(same, what << ": chunk " << c << " of replica " << replica << " on world rank " << s.rank(l)
                            << " differs from one process's");
        }
        Gathered const weights = gather_both(executor, reference, model);
        EXPECT(same_bits(weights.got, weights.want), what << ": gather_parameters differs from one process's");
        int const remote = s.rank(0) == 0 ? s.size() - 1 : 0;
        expect_refused([&] { static_cast<void>(executor.chunk(remote % devices, remote / devices)); },
                       "another process", what + ": chunk of another process");
      }
    }
  }
  // A grid that is not the world's devices.
  mgpu::nn::Sequential const model = dp_model(false);
  pp::ExecutorOptions options{
      .seed = 7, .timeout = 60s, .make_communicator = mgpu::dist::communicator_factory(s.world)};
  std::vector<std::size_t> const all{0, model.size()};
  expect_refused([&] { pp::Executor(model, s.group, all, pp::gpipe(1, 2), sgd, options); },
                 "a world of " + std::to_string(s.size()), "a one-device pipeline over the world");
  // The processes past world rank 0 would run no stage: each of them names itself.
  std::string const idle = "this process, whose devices are world ranks [" + std::to_string(s.rank(0)) + ", " +
                           std::to_string(s.rank(0) + s.local()) + "), would run no stage";
  try {
    pp::Executor executor(model, s.group, all, pp::gpipe(1, 2), sgd, options);
    EXPECT(false, "a one-device pipeline over the world was accepted");
  } catch (mgpu::Error const& e) {
    bool const named = std::string(e.what()).find(idle) != std::string::npos;
    EXPECT(named == (s.rank(0) > 0), "a one-device pipeline over the world: " << e.what());
  }
  // Replicas across processes sum their gradients over subset communicators: without their
  // factory the executor is refused, at ZeRO-0 too.
  pp::ExecutorOptions replicas = options;
  replicas.data_parallel = 2;
  expect_refused([&] { pp::Executor(model, s.group, all, pp::gpipe(1, 2), sgd, replicas); },
                 "data_parallel 2 over several processes without make_subset_communicator",
                 "replicas across processes without the subset factory");
}

// A GPT pipelined over the world's devices (its tied LM head's copy of wte on another device, in
// another process where there are two; with two replicas, a data x pipeline grid, and with ZeRO-1,
// 2 and 3 over them), AdamW with clipping and dropout, against one process's executor: losses and chunks
// bitwise (with ZeRO-3 gathered whole first), also after loading that executor's checkpoint.
void test_pipeline_gpt(Setup const& s) {
  namespace pp = mgpu::pipeline;
  std::shared_ptr<mgpu::Allocator> host = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  mgpu::nn::GptConfig const config{
      .vocab = 32, .block_size = 8, .n_layer = 2, .n_head = 2, .n_embd = 16, .dropout = 0.1f};
  mgpu::nn::Sequential const model = mgpu::nn::gpt(config);
  TokenBatches const batches = token_batches(3, 6, 32, 3);
  std::vector<Tensor> const& xs = batches.xs;
  std::vector<Tensor> const& ys = batches.ys;
  pp::ChunkOptimizerFactory const& adamw = chunk_adamw;
  // With ZeRO-3 each replica keeps its owned parameters between steps: gather_parameters (a
  // collective) makes every chunk whole again, until the next step.
  auto const whole_again = [&](pp::Executor& ex, mgpu::DeviceGroup& group) {
    mgpu::nn::Sequential whole = mgpu::nn::gpt(config);
    mgpu::nn::Context ctx{*host, group.stream(0)};
    whole.materialize(ctx, 1);
    ex.gather_parameters(whole, group.stream(0));
  };
  for (auto const& [replicas, zero] : {std::pair{1, 0}, std::pair{2, 0}, std::pair{2, 1}, std::pair{2, 2}, std::pair{2, 3}}) {
    int const devices = s.size() / replicas;
    if (s.size() % replicas != 0 || devices < 2) continue;  // the head on another device than the embedding
    std::string const what =
        "GPT pipeline x " + std::to_string(replicas) + " replica(s)" + (zero > 0 ? ", ZeRO-" + std::to_string(zero) : "");
    std::vector<std::size_t> const cuts = pp::partition(model, devices, std::vector<double>(model.size(), 1.0)).cuts;
    pp::ExecutorOptions options{.seed = 5,
                                .data_parallel = replicas,
                                .zero_stage = zero,
                                .timeout = 60s,
                                .clip_norm = 0.1f,
                                .loss = std::make_shared<mgpu::nn::TokenCrossEntropy>()};
    mgpu::DeviceGroup one("host:" + std::to_string(s.size()));
    pp::Executor reference(model, one, cuts, pp::one_f_one_b(devices, 2), adamw, options);
    options.make_communicator = mgpu::dist::communicator_factory(s.world);
    options.make_subset_communicator = mgpu::dist::subset_communicator_factory(s.world);
    pp::Executor executor(model, s.group, cuts, pp::one_f_one_b(devices, 2), adamw, options);
    // A bad id is refused by every process before any action; the run below then follows the reference.
    expect_refused([&] { (void)executor.step(with_last_id(xs[0], 32), ys[0]); }, "token id 32 at row 5, position 7 of the batch",
                   what + ": an id of the vocab's size");
    for (std::size_t b = 0; b < xs.size(); ++b) {
      float const expected = reference.step(xs[b], ys[b]);
      float const got = executor.step(xs[b], ys[b]);
      EXPECT(std::memcmp(&got, &expected, sizeof got) == 0,
             what << ": step " << b << " loss " << got << " (expected " << expected << ")");
    }
    if (zero == 3) whole_again(reference, one), whole_again(executor, s.group);
    for (int l = 0; l < s.local(); ++l) {
      int const c = s.rank(l) % devices;
      int const replica = s.rank(l) / devices;
      EXPECT(same_bits(host_values(executor.chunk(c, replica).master_parameters(), s.group.stream(l)),
                       host_values(reference.chunk(c, replica).master_parameters(), one.stream(0))),
             what << ": chunk " << c << " of replica " << replica << " differs from one process's");
    }
    // One process's checkpoint loads into the executor across processes (each process its chunks,
    // their AdamW state and RNG), which then steps as that process does.
    std::filesystem::path const file =
        std::filesystem::temp_directory_path() /
        ("mgpu_mpi_dist_gpt_" + std::to_string(::getpid()) + "_" + std::to_string(4 * replicas + zero) + ".ckpt");
    reference.save(file);
    pp::Executor resumed(model, s.group, cuts, pp::one_f_one_b(devices, 2), adamw, options);
    resumed.load(file);
    std::filesystem::remove(file);
    float const expected = reference.step(xs[0], ys[0]);
    float const got = resumed.step(xs[0], ys[0]);
    EXPECT(std::memcmp(&got, &expected, sizeof got) == 0,
           what << ": after load, loss " << got << " (expected " << expected << ")");
    if (zero == 3) whole_again(reference, one), whole_again(resumed, s.group);
    for (int l = 0; l < s.local(); ++l) {
      int const c = s.rank(l) % devices;
      int const replica = s.rank(l) / devices;
      EXPECT(same_bits(host_values(resumed.chunk(c, replica).master_parameters(), s.group.stream(l)),
                       host_values(reference.chunk(c, replica).master_parameters(), one.stream(0))),
             what << ": after load, chunk " << c << " of replica " << replica << " differs from one process's");
    }
  }
}

// pipeline::Executor::save() across the processes into `folder` (the same on every process) at step
// 2 of 5 of a GPT pipelined over 2 stages (its tied LM head's copy of wte in the second stage, with
// AdamW, clipping and dropout; with two replicas where the world has 4 devices, replica 0 all in one
// process and the other process's shard empty), and load() of it: resumed across the processes,
// and in one process over as many devices, the same bits as an uninterrupted run in one process
// (the same ranks and layout); in one process on one device (one stage, another layout) within
// float32 tolerance; saved again into a folder in one process (one shard) and resumed from that;
// loaded by a DataParallel (the same records).
// Every process writes the chunks its ranks run, so the shards are the processes; a damaged shard
// names its file, and a save no process can write fails on every process.
void test_pipeline_checkpoint(Setup const& s, std::filesystem::path const& folder) {
  namespace pp = mgpu::pipeline;
  std::shared_ptr<mgpu::Allocator> host = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  mgpu::Stream host_stream{mgpu::Device{mgpu::DeviceKind::host, 0}};
  if (process == 0) std::filesystem::remove_all(folder);  // before any process writes (save() agrees first)
  mgpu::nn::GptConfig const config{
      .vocab = 32, .block_size = 8, .n_layer = 2, .n_head = 2, .n_embd = 16, .dropout = 0.1f};
  mgpu::nn::Sequential const model = mgpu::nn::gpt(config);
  int const steps = 5, saved_at = 2;
  TokenBatches const batches = token_batches(steps, 6, 32, 4);
  std::vector<Tensor> const& xs = batches.xs;
  std::vector<Tensor> const& ys = batches.ys;
  pp::ChunkOptimizerFactory const& adamw = chunk_adamw;
  int const replicas = s.size() / 2;
  std::vector<std::size_t> const cuts = pp::partition(model, 2, std::vector<double>(model.size(), 1.0)).cuts;
  pp::ExecutorOptions options{.seed = 5,
                              .data_parallel = replicas,
                              .timeout = 60s,
                              .clip_norm = 0.1f,
                              .loss = std::make_shared<mgpu::nn::TokenCrossEntropy>()};
  mgpu::io::TrainingState const position{.step = saved_at, .epoch = 1, .batch = saved_at, .data_seed = 78};
  std::string const what = "pipeline checkpoint x " + std::to_string(replicas) + " replica(s)";
  mgpu::DeviceGroup one("host:" + std::to_string(s.size()));
  pp::Executor reference(model, one, cuts, pp::one_f_one_b(2, 2), adamw, options);
  std::vector<float> losses;
  for (int b = 0; b < steps; ++b) losses.push_back(reference.step(xs[static_cast<std::size_t>(b)], ys[static_cast<std::size_t>(b)]));
  mgpu::nn::Sequential whole = model.clone();
  mgpu::nn::Context ctx{*host, host_stream};
  whole.materialize(ctx, 1);
  reference.gather_parameters(whole, host_stream);
  std::vector<float> const want = host_values(whole.master_parameters(), host_stream);
  // `executor` from step `from` on against the uninterrupted run.
  auto const finish = [&](pp::Executor& executor, int from, double tolerance, std::string const& run) {
    for (int b = from; b < steps; ++b) {
      auto const u = static_cast<std::size_t>(b);
      float const loss = executor.step(xs[u], ys[u]);
      EXPECT(close_to({loss}, {losses[u]}, tolerance),
             what << ", " << run << ": step " << b << " loss " << loss << " (expected " << losses[u] << ")");
    }
    executor.gather_parameters(whole, host_stream);
    EXPECT(close_to(host_values(whole.master_parameters(), host_stream), want, tolerance),
           what << ", " << run << ": the parameters differ from the uninterrupted run's");
  };
  auto const loaded = [&](pp::Executor& executor, std::filesystem::path const& from, std::string const& run) {
    mgpu::io::TrainingState const got = executor.load(from);
    EXPECT(got.step == position.step && got.epoch == position.epoch && got.batch == position.batch &&
               got.data_seed == position.data_seed,
           what << ", " << run << ": loaded step " << got.step << ", epoch " << got.epoch << ", batch " << got.batch
                << ", seed " << got.data_seed);
  };
  options.make_communicator = mgpu::dist::communicator_factory(s.world);
  options.make_subset_communicator = mgpu::dist::subset_communicator_factory(s.world);
  std::vector<float> at_save;  // the parameters saved
  {
    pp::Executor executor(model, s.group, cuts, pp::one_f_one_b(2, 2), adamw, options);
    for (int b = 0; b < saved_at; ++b) executor.step(xs[static_cast<std::size_t>(b)], ys[static_cast<std::size_t>(b)]);
    executor.save(folder, position);
    executor.gather_parameters(whole, host_stream);
    at_save = host_values(whole.master_parameters(), host_stream);
    finish(executor, saved_at, 0, "the run that saved");
    // Nothing can be written under a file: every process fails, none waits for another.
    try {
      executor.save("/dev/null/pipeline", position);
      EXPECT(false, what << ": a save under /dev/null was accepted");
    } catch (mgpu::Error const& e) {
      EXPECT(e.category() == mgpu::Errc::io, what << ": a save under /dev/null: " << e.what() << " (expected Error(io))");
    }
  }
  mgpu::io::ShardedCheckpoint const written = mgpu::io::ShardedCheckpoint::load(folder);
  EXPECT(written.shards() == s.world.processes && written.split_names().size() == 3,
         what << ": " << written.shards() << " shards, " << written.split_names().size()
              << " split records (expected " << s.world.processes << " and the parameters with AdamW's 2)");
  {
    pp::Executor executor(model, s.group, cuts, pp::one_f_one_b(2, 2), adamw, options);
    loaded(executor, folder, "resumed across the processes");
    finish(executor, saved_at, 0, "resumed across the processes");
  }
  {
    // Each process reads the boxes of the chunks its ranks run, and the tied head's process wte's
    // box for the head's copy: the parameters and AdamW's two buffers, float32, no others.
    pp::Executor executor(model, s.group, cuts, pp::one_f_one_b(2, 2), adamw, options);
    mgpu::io::ShardedCheckpoint const opened = mgpu::io::ShardedCheckpoint::load(folder);
    std::uint64_t const before = opened.payload_bytes_read();
    EXPECT(executor.load(opened).step == position.step, what << ": load of an opened folder");
    std::vector<bool> needed(2, false);
    for (int l = 0; l < s.local(); ++l) needed[static_cast<std::size_t>(s.rank(l) % 2)] = true;
    std::uint64_t elements = needed[1] ? static_cast<std::uint64_t>(config.vocab * config.n_embd) : 0;
    for (std::size_t c = 0; c < 2; ++c) {
      for (std::size_t layer = cuts[c]; layer < cuts[c + 1] && needed[c]; ++layer)
        elements += static_cast<std::uint64_t>(model.layer(layer).parameter_count());
    }
    EXPECT(opened.payload_bytes_read() - before == 3 * sizeof(float) * elements,
           what << ": process " << process << " read " << opened.payload_bytes_read() - before
                << " bytes of boxes (expected " << 3 * sizeof(float) * elements << ": its chunks' "
                << (needed[1] ? "and the head's rows of wte" : "only") << ")");
    finish(executor, saved_at, 0, "loaded from an opened folder");
  }
  options.make_communicator = nullptr;
  {
    mgpu::DeviceGroup same("host:" + std::to_string(s.size()));
    pp::Executor executor(model, same, cuts, pp::one_f_one_b(2, 2), adamw, options);
    loaded(executor, folder, "resumed in one process");
    // In one process, a save into an existing folder writes a one-shard save of the same records.
    std::filesystem::path const again = folder.string() + "-one-" + std::to_string(process);
    std::filesystem::remove_all(again);
    std::filesystem::create_directories(again);
    executor.save(again, position);
    EXPECT(mgpu::io::ShardedCheckpoint::load(again).shards() == 1, what << ": a save into a folder in one process");
    pp::Executor resaved(model, same, cuts, pp::one_f_one_b(2, 2), adamw, options);
    loaded(resaved, again, "saved again in one process");
    std::filesystem::remove_all(again);
    finish(executor, saved_at, 0, "resumed in one process");
    finish(resaved, saved_at, 0, "saved again in one process");
  }
  {
    options.data_parallel = 1;
    mgpu::DeviceGroup single("host:1");
    pp::Executor executor(model, single, {0, model.size()}, pp::gpipe(1, 2), adamw, options);
    loaded(executor, folder, "resumed on one device");
    finish(executor, saved_at, 1e-5, "resumed on one device");
  }
  {
    // The same records as DataParallel's: one loads the folder (each rank its owned elements of
    // the AdamW state, the parameters whole).
    mgpu::parallel::DataParallelOptions dp_options;
    dp_options.zero_stage = 1;
    mgpu::DeviceGroup two("host:2");
    mgpu::parallel::DataParallel dp(model.clone(), two, mgpu::optim::AdamW(mgpu::optim::AdamWOptions{.lr = 0.01f}), dp_options);
    mgpu::io::TrainingState const got = dp.load(folder);
    EXPECT(got.step == position.step, what << ": DataParallel loaded step " << got.step);
    for (int l = 0; l < two.size(); ++l)
      EXPECT(same_bits(host_values(dp.replica(l).master_parameters(), two.stream(l)), at_save),
             what << ": DataParallel's replica " << l << " differs from the parameters saved");
  }
  // A copy of the folder with one byte flipped near the end of shard `index` (in its last piece).
  auto const damaged = [&](std::filesystem::path const& copy, int index) {
    std::filesystem::remove_all(copy);
    std::filesystem::copy(folder, copy);
    std::filesystem::path const shard = mgpu::io::shard_path(copy, written.save_id(), index, written.shards());
    std::fstream file(shard, std::ios::in | std::ios::out | std::ios::binary);
    file.seekg(-100, std::ios::end);
    char byte = 0;
    file.read(&byte, 1);
    byte = static_cast<char>(byte ^ 0x10);
    file.seekp(-100, std::ios::end);
    file.write(&byte, 1);
    return shard;
  };
  if (s.size() == 2 && s.local() == 1) {
    // One device per process: process 1's shard damaged, which only process 1 reads. It fails
    // naming the file, process 0 naming process 1, and both executors stay usable.
    options.make_communicator = mgpu::dist::communicator_factory(s.world);
    options.make_subset_communicator = mgpu::dist::subset_communicator_factory(s.world);
    std::filesystem::path const copy = folder.string() + "-damaged";
    auto const barrier = mgpu::dist::make_communicator(s.world, s.group);
    std::filesystem::path shard;
    if (process == 0) shard = damaged(copy, 1);
    s.group.run([&](int l, mgpu::Device, mgpu::Stream& stream) { barrier->barrier(s.rank(l), stream); });
    s.group.synchronize();
    pp::Executor executor(model, s.group, cuts, pp::one_f_one_b(2, 2), adamw, options);
    try {
      executor.load(copy);
      EXPECT(false, what << ": process 1's damaged shard was accepted by process " << process);
    } catch (mgpu::Error const& e) {
      std::string const text = e.what();
      bool const named = process == 1 ? e.category() == mgpu::Errc::corrupt_data && text.find("shard-") != std::string::npos
                                      : e.category() == mgpu::Errc::io && text.find("world rank 1 failed") != std::string::npos;
      EXPECT(named, what << ": process 1's damaged shard, on process " << process << ": " << text);
    }
    loaded(executor, folder, "loaded after a failed load");
    finish(executor, saved_at, 0, "loaded after a failed load");
    s.group.run([&](int l, mgpu::Device, mgpu::Stream& stream) { barrier->barrier(s.rank(l), stream); });
    s.group.synchronize();
    if (process == 0) std::filesystem::remove_all(copy);
    options.make_communicator = nullptr;
  }
  // Each process damages its own copy: one byte near the end of shard 0 (process 0's).
  std::filesystem::path const copy = folder.string() + "-damaged-" + std::to_string(process);
  std::filesystem::path const shard = damaged(copy, 0);
  mgpu::DeviceGroup two("host:2");
  pp::Executor executor(model, two, cuts, pp::one_f_one_b(2, 2), adamw, options);
  try {
    executor.load(copy);
    EXPECT(false, what << ": a damaged shard was accepted");
  } catch (mgpu::Error const& e) {
    EXPECT(e.category() == mgpu::Errc::corrupt_data &&
               std::string(e.what()).find(shard.filename().string()) != std::string::npos,
           what << ": a damaged shard: " << e.what() << " (expected corrupt_data naming " << shard.filename().string() << ")");
  }
  std::filesystem::remove_all(copy);
}

}  // namespace mpi_dist
