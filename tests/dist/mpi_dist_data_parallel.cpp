// mgpu_mpi_dist's data_parallel and checkpoint modes (tests/dist/mpi_dist.cpp says what each checks):
// DataParallel across the processes, and its checkpoints saved and loaded across them.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>

#include <mgpu/io/sharded_checkpoint.hpp>
#include <mgpu/nn/loss.hpp>
#include <mgpu/optim/optim.hpp>
#include <mgpu/parallel/data_parallel.hpp>

#include "mpi_dist.hpp"

namespace mpi_dist {

// DataParallel across the processes, each passing its rows of every global batch (those of its
// ranks in the reference's even split, so that every rank's shard is the same), against the
// reference over world.size() devices of this process.
void test_data_parallel(Setup const& s) {
  std::shared_ptr<mgpu::Allocator> host = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  std::int64_t const rows = 29;  // uneven shards
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0, 1);
  std::vector<Tensor> xs, ys;
  for (int b = 0; b < 3; ++b) {
    xs.push_back(Tensor::empty({rows, 6}, DType::float32, *host));
    for (float& v : xs.back().host_span<float>()) v = normal(rng);
    ys.push_back(Tensor::empty({rows}, DType::float32, *host));
    for (float& v : ys.back().host_span<float>()) v = static_cast<float>(rng() % 4);
  }
  std::vector<std::int64_t> const shards = mgpu::shard_sizes(rows, s.size());
  std::int64_t begin = 0;
  for (int r = 0; r < s.rank(0); ++r) begin += shards[static_cast<std::size_t>(r)];
  std::int64_t end = begin;
  for (int l = 0; l < s.local(); ++l) end += shards[static_cast<std::size_t>(s.rank(l))];
  bool const one_each = s.world.processes == s.size();
  struct Config {
    bool overlap;
    int zero_stage;
    bool dropout;
    float clip_norm;  // the sharded update then sums each rank's squares over the world
    bool hook;        // bf16 compression
  };
  for (Config const c : {Config{true, 1, false, 0, false}, Config{false, 1, true, 0, false}, Config{true, 0, true, 0, false},
                         Config{true, 1, false, 0.5f, false}, Config{true, 2, true, 0.5f, false}, Config{true, 3, false, 0, false},
                         Config{true, 3, true, 0.5f, false}, Config{true, 0, false, 0, true}, Config{true, 1, true, 0.5f, true}}) {
    std::string const what = std::string("data_parallel overlap ") + (c.overlap ? "on" : "off") + ", zero_stage " +
                             std::to_string(c.zero_stage) + (c.dropout ? ", dropout" : "") +
                             (c.clip_norm > 0 ? ", clipping" : "") + (c.hook ? ", bf16 compression" : "");
    mgpu::parallel::DataParallelOptions options;
    options.bucket_cap_bytes = options.first_bucket_cap_bytes = 4;  // a bucket per layer
    options.overlap = c.overlap;
    options.zero_stage = c.zero_stage;
    options.clip_norm = c.clip_norm;
    if (c.hook) options.comm_hook = std::make_shared<mgpu::parallel::Bf16Compression>();
    options.comm.timeout = 60s;
    mgpu::optim::AdamW const adamw(mgpu::optim::AdamWOptions{.lr = 0.01f});
    mgpu::DeviceGroup one("host:" + std::to_string(s.size()));
    mgpu::parallel::DataParallel reference(dp_model(c.dropout), one, adamw, options);
    options.make_communicator = mgpu::dist::communicator_factory(s.world);
    if (c.hook) options.comm_hook = std::make_shared<mgpu::parallel::Bf16Compression>();  // its own residuals
    // Several devices in a process sum their bfloat16 buckets in the process first: another rounding.
    float const tolerance = c.hook ? 1e-3f : 1e-5f;
    mgpu::parallel::DataParallel dp(dp_model(c.dropout), s.group, adamw, options);
    EXPECT(dp.buckets().size() == 3, what << ": " << dp.buckets().size() << " buckets (expected 3)");
    for (std::size_t b = 0; b < xs.size(); ++b) {
      float const expected = reference.step(xs[b], ys[b]).loss;
      mgpu::parallel::DataParallelResult const got = dp.step(xs[b].slice(begin, end), ys[b].slice(begin, end));
      EXPECT(one_each ? got.loss == expected : std::abs(got.loss - expected) <= tolerance * std::abs(expected),
             what << ": step " << b << " loss " << got.loss << " (expected " << expected << ")");
      for (int l = 0; l < s.local(); ++l)
        EXPECT(got.rows[static_cast<std::size_t>(l)] == shards[static_cast<std::size_t>(s.rank(l))],
               what << ": rank " << s.rank(l) << " had " << got.rows[static_cast<std::size_t>(l)] << " rows");
    }
    std::vector<float> const want = host_values(reference.replica(0).master_parameters(), one.stream(0));
    for (int l = 0; l < s.local(); ++l) {
      std::vector<float> const have = host_values(dp.replica(l).master_parameters(), s.group.stream(l));
      double worst = 0;
      bool bitwise = have.size() == want.size();
      for (std::size_t i = 0; bitwise && i < have.size(); ++i) {
        bitwise = std::memcmp(&have[i], &want[i], sizeof(float)) == 0;
      }
      for (std::size_t i = 0; i < std::min(have.size(), want.size()); ++i)
        worst = std::max(worst, std::abs(static_cast<double>(have[i]) - want[i]) / (1 + std::abs(want[i])));
      EXPECT(one_each ? bitwise : worst <= tolerance, what << ": rank " << s.rank(l)
                                                      << "'s parameters differ from one process's by " << worst
                                                      << (one_each ? " (expected the same bits)" : ""));
    }
  }
  {
    // A bad label in the last process's rows (class 7 of 4): every process refuses the step at
    // once, that process naming the label, the others that process, and the run then goes on as
    // one process's that never saw the bad step (dropout on, so a moved RNG would show).
    std::string const what = "data_parallel: a bad label in the last process's rows";
    mgpu::parallel::DataParallelOptions options;
    options.comm.timeout = 60s;
    mgpu::optim::AdamW const adamw(mgpu::optim::AdamWOptions{.lr = 0.01f});
    mgpu::DeviceGroup one("host:" + std::to_string(s.size()));
    mgpu::parallel::DataParallel reference(dp_model(true), one, adamw, options);
    options.make_communicator = mgpu::dist::communicator_factory(s.world);
    mgpu::parallel::DataParallel dp(dp_model(true), s.group, adamw, options);
    int const bad_process = s.world.processes - 1;
    Tensor const labels = Tensor::empty({end - begin}, DType::float32, *host);
    std::copy(ys[0].host_span<float>().begin() + begin, ys[0].host_span<float>().begin() + end, labels.host_span<float>().begin());
    if (process == bad_process) labels.host_span<float>()[0] = 7;
    auto const start = std::chrono::steady_clock::now();
    std::string const needle = process == bad_process ? "label 7.000000 at row 0 (expected a class id in [0, 4))"
                                                      : "refused its part of the batch";
    expect_refused([&] { (void)dp.step(xs[0].slice(begin, end), labels); }, needle, what);
    double const waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT(waited < 10, what << ": refused after " << waited << " s (expected at once, not at the 60 s deadline)");
    for (std::size_t b = 0; b < xs.size(); ++b) {
      float const expected = reference.step(xs[b], ys[b]).loss;
      float const got = dp.step(xs[b].slice(begin, end), ys[b].slice(begin, end)).loss;
      EXPECT(one_each ? got == expected : std::abs(got - expected) <= 1e-5f * std::abs(expected),
             what << ": step " << b << " loss " << got << " (expected " << expected << ")");
    }
  }
  {
    // Rebalancing across processes: a cost model makes each rank of process p take p + 1 ms per
    // row. Before any step process_rows() splits by the weights given (the device counts), after
    // one by the measured speeds (process p: its devices / (p + 1)), the same on every process;
    // the run follows one process's losses whichever processes hold the rows.
    std::string const what = "data_parallel rebalancing across processes";
    mgpu::parallel::DataParallelOptions options;
    options.comm.timeout = 60s;
    mgpu::optim::AdamW const adamw(mgpu::optim::AdamWOptions{.lr = 0.01f});
    mgpu::DeviceGroup one("host:" + std::to_string(s.size()));
    mgpu::parallel::DataParallel reference(dp_model(false), one, adamw, options);
    options.make_communicator = mgpu::dist::communicator_factory(s.world);
    options.rebalance = true;
    options.rebalance_ewma = 1;
    options.rebalance_time = [p = process](int, std::int64_t shard_rows, double) {
      return static_cast<double>(shard_rows) * (p + 1);
    };
    mgpu::parallel::DataParallel dp(dp_model(false), s.group, adamw, options);
    std::vector<double> devices, speeds;
    for (int p = 0; p < s.world.processes; ++p) {
      devices.push_back(s.world.local_size(p));
      speeds.push_back(s.world.local_size(p) / (p + 1.0));
    }
    for (std::size_t b = 0; b < xs.size(); ++b) {
      std::vector<std::int64_t> const split = dp.process_rows(rows, devices);
      std::vector<std::int64_t> const want = mgpu::shard_sizes(rows, s.world.processes, b == 0 ? devices : speeds);
      EXPECT(split == want, what << ": step " << b << ": process " << process << " was given "
                                 << split[static_cast<std::size_t>(process)] << " rows (expected "
                                 << want[static_cast<std::size_t>(process)] << ")");
      std::int64_t first = 0;
      for (int p = 0; p < process; ++p) first += split[static_cast<std::size_t>(p)];
      std::int64_t const last = first + split[static_cast<std::size_t>(process)];
      float const expected = reference.step(xs[b], ys[b]).loss;
      float const got = dp.step(xs[b].slice(first, last), ys[b].slice(first, last)).loss;
      EXPECT(std::abs(got - expected) <= 1e-5f * std::abs(expected),
             what << ": step " << b << " loss " << got << " (expected " << expected << ")");
    }
    EXPECT(close_to(host_values(dp.replica(0).master_parameters(), s.group.stream(0)),
                    host_values(reference.replica(0).master_parameters(), one.stream(0)), 1e-5),
           what << ": the parameters differ from one process's");
    expect_refused([&] { (void)dp.process_rows(rows, {1.0}); }, "one per process", what + ": one weight");
  }
  // Not across processes: the scheduler's choice of ranks (a request), refused with the reason.
  mgpu::parallel::DataParallelOptions options;
  options.make_communicator = mgpu::dist::communicator_factory(s.world);
  options.request = mgpu::sched::Request{};
  expect_refused([&] { mgpu::parallel::DataParallel dp(dp_model(false), s.group, mgpu::optim::SGD(mgpu::optim::SgdOptions{}), options); },
                 "spans every device of every process", "a request across processes");
}

// DataParallel::save() across the processes mid-run into `folder` (the same on every process), and
// load() of it: resumed across the processes, and in one process over 3 devices, against an
// uninterrupted run over world.size() devices of this process; the same bits with one device per
// process (the same ranks and layout), within float32 tolerance otherwise. With the sharded update
// (each process writes its ranks' optimizer state) and without (process 0 writes it whole). Then a
// save mid accumulation cycle is refused, and a damaged shard names its file.
void test_checkpoint(Setup const& s, std::filesystem::path const& folder) {
  std::shared_ptr<mgpu::Allocator> host = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  if (process == 0) std::filesystem::remove_all(folder);  // before any process writes (save() agrees first)
  std::int64_t const rows = 29;
  int const steps = 5;
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0, 1);
  std::vector<Tensor> xs, ys;
  for (int b = 0; b < steps; ++b) {
    xs.push_back(Tensor::empty({rows, 6}, DType::float32, *host));
    for (float& v : xs.back().host_span<float>()) v = normal(rng);
    ys.push_back(Tensor::empty({rows}, DType::float32, *host));
    for (float& v : ys.back().host_span<float>()) v = static_cast<float>(rng() % 4);
  }
  std::vector<std::int64_t> const shards = mgpu::shard_sizes(rows, s.size());
  std::int64_t begin = 0;
  for (int r = 0; r < s.rank(0); ++r) begin += shards[static_cast<std::size_t>(r)];
  std::int64_t end = begin;
  for (int l = 0; l < s.local(); ++l) end += shards[static_cast<std::size_t>(s.rank(l))];
  mgpu::optim::AdamW const adamw(mgpu::optim::AdamWOptions{.lr = 0.01f});
  struct Config {
    int zero_stage;
    int accumulation;  // 2: saved mid-cycle, each rank's accumulated gradients in the folder
    bool hook;         // bf16 compression: each rank's residuals in the folder
  };
  for (Config const c : {Config{1, 1, false}, Config{0, 1, false}, Config{1, 2, false}, Config{0, 1, true}}) {
    int const saved_at = c.accumulation == 2 ? 3 : 2;
    // 0: the same bits (one device per process); a process summing its devices' bfloat16 buckets
    // first rounds once more.
    double const across = s.world.processes == s.size() ? 0 : c.hook ? 1e-3 : 1e-5;
    mgpu::io::TrainingState const position{.step = saved_at, .epoch = 1, .batch = saved_at, .data_seed = 77};
    std::string const what = "checkpoint, zero_stage " + std::to_string(c.zero_stage) +
                             (c.accumulation > 1 ? ", saved mid accumulation cycle" : "") + (c.hook ? ", bf16 compression" : "");
    mgpu::parallel::DataParallelOptions options;
    options.bucket_cap_bytes = options.first_bucket_cap_bytes = 4;  // a bucket per layer
    options.zero_stage = c.zero_stage;
    options.accumulation_steps = c.accumulation;
    options.comm.timeout = 60s;
    auto const hook = [&] {  // each executor its own residuals
      options.comm_hook = c.hook ? std::make_shared<mgpu::parallel::Bf16Compression>() : nullptr;
      return options;
    };
    mgpu::DeviceGroup one("host:" + std::to_string(s.size()));
    mgpu::parallel::DataParallel reference(dp_model(true), one, adamw, hook());
    std::vector<float> losses;
    for (int b = 0; b < steps; ++b)
      losses.push_back(reference.step(xs[static_cast<std::size_t>(b)], ys[static_cast<std::size_t>(b)]).loss);
    std::vector<float> const want = host_values(reference.replica(0).master_parameters(), one.stream(0));
    // `dp` from step `from` on (its part of each batch: `first` to `last` rows) against the reference.
    auto const finish = [&](mgpu::parallel::DataParallel& dp, mgpu::DeviceGroup& group, int from, std::int64_t first,
                            std::int64_t last, double tolerance, std::string const& run) {
      for (int b = from; b < steps; ++b) {
        auto const u = static_cast<std::size_t>(b);
        float const loss = dp.step(xs[u].slice(first, last), ys[u].slice(first, last)).loss;
        EXPECT(close_to({loss}, {losses[u]}, tolerance),
               what << ", " << run << ": step " << b << " loss " << loss << " (expected " << losses[u] << ")");
      }
      for (int l = 0; l < group.size(); ++l)
        EXPECT(close_to(host_values(dp.replica(l).master_parameters(), group.stream(l)), want, tolerance),
               what << ", " << run << ": replica " << l << "'s parameters differ from the uninterrupted run's");
    };
    options.make_communicator = mgpu::dist::communicator_factory(s.world);
    {
      mgpu::parallel::DataParallel dp(dp_model(true), s.group, adamw, hook());
      for (int b = 0; b < saved_at; ++b)
        dp.step(xs[static_cast<std::size_t>(b)].slice(begin, end), ys[static_cast<std::size_t>(b)].slice(begin, end));
      dp.save(folder, position);
      finish(dp, s.group, saved_at, begin, end, across, "the run that saved");
    }
    mgpu::io::ShardedCheckpoint const written = mgpu::io::ShardedCheckpoint::load(folder);
    std::size_t const split = 2 + (c.accumulation > 1 ? 1 : 0) + (c.hook ? 1 : 0);
    EXPECT(written.shards() == s.world.processes && written.split_names().size() == split,
           what << ": " << written.shards() << " shards, " << written.split_names().size() << " split records (expected "
                << s.world.processes << " and " << split << ": AdamW's 2 and the per-rank rows)");
    {
      mgpu::parallel::DataParallel dp(dp_model(true), s.group, adamw, hook());
      mgpu::io::TrainingState const got = dp.load(folder);
      EXPECT(got.step == position.step && got.epoch == position.epoch && got.batch == position.batch &&
                 got.data_seed == position.data_seed,
             what << ": loaded step " << got.step << ", epoch " << got.epoch << ", batch " << got.batch << ", seed "
                  << got.data_seed);
      finish(dp, s.group, saved_at, begin, end, across, "resumed across the processes");
    }
    {
      options.make_communicator = nullptr;
      mgpu::DeviceGroup three("host:3");
      mgpu::parallel::DataParallel dp(dp_model(true), three, adamw, hook());
      dp.load(folder);
      // On another device count rank 0 takes the sum of the saved residuals: bf16's rounding then.
      finish(dp, three, saved_at, 0, rows, c.hook ? 1e-3 : 1e-5, "resumed in one process on 3 devices");
    }
  }
  mgpu::parallel::DataParallelOptions options;
  options.make_communicator = mgpu::dist::communicator_factory(s.world);
  options.comm.timeout = 60s;
  options.accumulation_steps = 2;
  options.zero_stage = 2;
  {
    mgpu::parallel::DataParallel dp(dp_model(false), s.group, adamw, options);
    dp.step(xs[0].slice(begin, end), ys[0].slice(begin, end));
    expect_refused([&] { dp.save(folder, mgpu::io::TrainingState{}); }, "accumulated micro-batches",
                   "a save across processes mid-cycle at zero_stage 2");
  }
  options.zero_stage = 1;
  // Each process damages its own copy: one byte near the end of shard 0 (process 0's, which holds
  // the whole records).
  std::filesystem::path const copy = folder.string() + "-damaged-" + std::to_string(process);
  std::filesystem::remove_all(copy);
  std::filesystem::copy(folder, copy);
  mgpu::io::ShardedCheckpoint const written = mgpu::io::ShardedCheckpoint::load(folder);
  std::filesystem::path const shard = mgpu::io::shard_path(copy, written.save_id(), 0, written.shards());
  {
    std::fstream file(shard, std::ios::in | std::ios::out | std::ios::binary);
    file.seekg(-100, std::ios::end);
    char byte = 0;
    file.read(&byte, 1);
    byte = static_cast<char>(byte ^ 0x10);
    file.seekp(-100, std::ios::end);
    file.write(&byte, 1);
  }
  options.make_communicator = nullptr;
  options.accumulation_steps = 1;
  mgpu::DeviceGroup two("host:2");
  mgpu::parallel::DataParallel dp(dp_model(true), two, adamw, options);
  try {
    dp.load(copy);
    EXPECT(false, "a damaged shard was accepted");
  } catch (mgpu::Error const& e) {
    EXPECT(e.category() == mgpu::Errc::corrupt_data &&
               std::string(e.what()).find(shard.filename().string()) != std::string::npos,
           "a damaged shard: " << e.what() << " (expected corrupt_data naming " << shard.filename().string() << ")");
  }
  std::filesystem::remove_all(copy);
}

}  // namespace mpi_dist
