// DataParallel against an independent reference: the same model trained by classification_step on
// one host device with the whole batch. Shard sizes, accumulation, 16-bit compute, clipping,
// dropout, determinism, overlap on the timeline, rebalancing, placement, checkpoints and errors.
#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include <mgpu/io/sharded_checkpoint.hpp>
#include <mgpu/nn/train.hpp>
#include <mgpu/ops/ops.hpp>
#include <mgpu/parallel/data_parallel.hpp>

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

namespace {

constexpr std::int64_t features = 6;
constexpr std::int64_t classes = 4;

mgpu::nn::Sequential small_mlp(bool dropout = false) {
  if (!dropout) return mgpu::nn::Sequential::mlp({features, 16, 12, classes});
  mgpu::nn::Sequential model;
  model.add(std::make_unique<mgpu::nn::Linear>(features, 16));
  model.add(std::make_unique<mgpu::nn::ReLU>());
  model.add(std::make_unique<mgpu::nn::Dropout>(0.3f));
  model.add(std::make_unique<mgpu::nn::Linear>(16, classes));
  return model;
}

// Batches of random features and labels in host memory.
struct Data {
  Env env;
  std::vector<Tensor> x, y;
  Data(int batches, std::int64_t rows, unsigned seed) {
    std::mt19937 rng(seed);
    for (int b = 0; b < batches; ++b) {
      x.push_back(env.random({rows, features}, seed * 100 + static_cast<unsigned>(b)));
      Tensor labels = Tensor::empty({rows}, DType::float32, *env.allocator);
      for (float& v : labels.host_span<float>()) v = static_cast<float>(rng() % classes);
      y.push_back(labels);
    }
  }
};


// The reference: one device, the whole batch, classification_step.
struct Reference {
  Env env;
  mgpu::nn::Sequential model;
  mgpu::optim::SGD sgd{{.lr = 0.1f, .momentum = 0.9f}};
  std::optional<mgpu::optim::LossScaler> scaler;
  Reference(mgpu::nn::Sequential m, DType compute = DType::float32) : model(std::move(m)) { model.materialize(env.ctx, 1, compute); }
  float step(Tensor const& x, Tensor const& y, float clip = 0) {
    mgpu::nn::StepOptions options;
    options.clip_norm = clip;
    options.scaler = scaler ? &*scaler : nullptr;
    auto const r = mgpu::nn::classification_step(model, sgd, x, y, env.ctx, options);
    return mgpu::ops::item(r.loss, env.stream);
  }
  std::vector<float> params() { return host_values(model.master_parameters(), env.stream); }
};

void require_close(std::vector<float> const& a, std::vector<float> const& b, double tolerance) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(static_cast<double>(a[i]) - b[i]) / (1.0 + std::abs(b[i])));
  INFO("largest relative difference " << worst);
  REQUIRE(worst <= tolerance);
}

// Labels 0, 1, ..., 9, 0, 1, ... for `rows` rows, in host memory.
Tensor cycling_labels(Env& env, std::int64_t rows) {
  Tensor y = Tensor::empty({rows}, DType::float32, *env.allocator);
  for (std::int64_t i = 0; i < rows; ++i) y.host_span<float>()[static_cast<std::size_t>(i)] = static_cast<float>(i % 10);
  return y;
}

std::vector<float> dp_params(DataParallel& dp, int replica = 0) {
  return host_values(dp.replica(replica).master_parameters(), dp.group().stream(replica));
}

}  // namespace

TEST_CASE("Data parallel on 1..8 host devices equals one device on the global batch", "[parallel][dp]") {
  Data data(3, 29, 1);  // 29 rows: uneven shards everywhere
  Reference ref(small_mlp());
  std::vector<float> losses;
  for (int b = 0; b < 3; ++b) losses.push_back(ref.step(data.x[b], data.y[b]));
  for (int n = 1; n <= 8; ++n) {
    INFO(n << " devices");
    mgpu::DeviceGroup group{"host:" + std::to_string(n)};
    DataParallel dp(small_mlp(), group, mgpu::optim::SGD({.lr = 0.1f, .momentum = 0.9f}), {.first_bucket_cap_bytes = 64});
    for (int b = 0; b < 3; ++b) {
      auto const r = dp.step(data.x[b], data.y[b]);
      CHECK(r.loss == Approx(losses[static_cast<std::size_t>(b)]).epsilon(1e-5));
      std::int64_t total = 0;
      for (auto rows : r.rows) total += rows;
      CHECK(total == 29);
    }
    require_close(dp_params(dp), ref.params(), 2e-6);
    require_close(dp_params(dp, n - 1), dp_params(dp), 0);  // replicas never diverge
  }
}

TEST_CASE("Weighted and empty shards give the full-batch gradient", "[parallel][dp]") {
  Data data(2, 3, 2);
  Reference ref(small_mlp());
  for (int b = 0; b < 2; ++b) ref.step(data.x[b], data.y[b]);
  mgpu::DeviceGroup group{"host:5"};
  DataParallelOptions options;
  options.weights = {1, 0, 3, 2, 0.5};  // rank 1 never gets rows; with 3 rows others are empty too
  DataParallel dp(small_mlp(), group, mgpu::optim::SGD({.lr = 0.1f, .momentum = 0.9f}), options);
  for (int b = 0; b < 2; ++b) {
    auto const r = dp.step(data.x[b], data.y[b]);
    CHECK(r.rows[1] == 0);
  }
  require_close(dp_params(dp, 1), ref.params(), 2e-6);
}

TEST_CASE("Gradient accumulation over k micro-batches equals one step on their union", "[parallel][dp]") {
  Data data(2, 12, 3);
  Env env;
  Tensor x = Tensor::empty({24, features}, DType::float32, *env.allocator);
  Tensor y = Tensor::empty({24}, DType::float32, *env.allocator);
  for (int b = 0; b < 2; ++b) {
    mgpu::copy_async(x.slice(b * 12, (b + 1) * 12), data.x[b], env.stream);
    mgpu::copy_async(y.slice(b * 12, (b + 1) * 12), data.y[b], env.stream);
  }
  env.stream.synchronize();
  Reference ref(small_mlp());
  ref.step(x, y);
  ref.step(x, y);
  for (int n : {1, 3}) {
    mgpu::DeviceGroup group{"host:" + std::to_string(n)};
    DataParallel dp(small_mlp(), group, mgpu::optim::SGD({.lr = 0.1f, .momentum = 0.9f}), {.accumulation_steps = 2});
    for (int round = 0; round < 2; ++round) {
      CHECK_FALSE(dp.step(data.x[0], data.y[0]).applied);
      CHECK(dp.step(data.x[1], data.y[1]).applied);
    }
    require_close(dp_params(dp), ref.params(), 3e-6);
  }
}

TEST_CASE("bfloat16 and float16 (loss scaling) data parallel match one device", "[parallel][dp]") {
  Data data(3, 20, 4);
  for (DType compute : {DType::bfloat16, DType::float16}) {
    INFO(mgpu::to_string(compute));
    Reference ref(small_mlp(), compute);
    if (compute == DType::float16) ref.scaler.emplace(1024.0f);
    for (int b = 0; b < 3; ++b) ref.step(data.x[b], data.y[b]);
    mgpu::DeviceGroup group{"host:3"};
    DataParallelOptions options;
    options.compute = compute;
    if (compute == DType::float16) options.loss_scaler.emplace(1024.0f);
    DataParallel dp(small_mlp(), group, mgpu::optim::SGD({.lr = 0.1f, .momentum = 0.9f}), options);
    for (int b = 0; b < 3; ++b) CHECK(dp.step(data.x[b], data.y[b]).applied);
    // Shards round their own activations, so 16-bit results agree to 16-bit precision.
    require_close(dp_params(dp), ref.params(), compute == DType::bfloat16 ? 2e-2 : 4e-3);
    require_close(dp_params(dp, 2), dp_params(dp), 0);
  }
}

TEST_CASE("float16 overflow skips the same step on every replica", "[parallel][dp]") {
  Data data(1, 8, 5);
  mgpu::DeviceGroup group{"host:2"};
  DataParallelOptions options;
  options.compute = DType::float16;
  options.loss_scaler.emplace(1e30f);  // the scaled loss gradient overflows float16
  DataParallel dp(small_mlp(), group, mgpu::optim::SGD({.lr = 0.1f}), options);
  auto const before = dp_params(dp);
  CHECK_FALSE(dp.step(data.x[0], data.y[0]).applied);
  CHECK(dp_params(dp) == before);
  CHECK(dp_params(dp, 1) == before);
  CHECK(dp.loss_scaler()->skipped() == 1);
}

TEST_CASE("Clipping uses the global norm of the reduced gradients", "[parallel][dp]") {
  Data data(3, 17, 6);
  Reference ref(small_mlp());
  for (int b = 0; b < 3; ++b) ref.step(data.x[b], data.y[b], 0.05f);
  mgpu::DeviceGroup group{"host:4"};
  DataParallel dp(small_mlp(), group, mgpu::optim::SGD({.lr = 0.1f, .momentum = 0.9f}), {.clip_norm = 0.05f});
  for (int b = 0; b < 3; ++b) dp.step(data.x[b], data.y[b]);
  require_close(dp_params(dp), ref.params(), 2e-6);
}

TEST_CASE("Dropout: N replicas drop what one device drops from the whole batch", "[parallel][dp]") {
  Data data(3, 23, 7);
  Reference ref(small_mlp(true));
  for (int b = 0; b < 3; ++b) ref.step(data.x[b], data.y[b]);
  mgpu::DeviceGroup group{"host:3"};
  DataParallel dp(small_mlp(true), group, mgpu::optim::SGD({.lr = 0.1f, .momentum = 0.9f}));
  for (int b = 0; b < 3; ++b) dp.step(data.x[b], data.y[b]);
  require_close(dp_params(dp), ref.params(), 2e-6);
}

TEST_CASE("Deterministic mode: bitwise equal parameters whatever the buckets, overlap and timing", "[parallel][dp]") {
  Data data(4, 31, 8);
  std::vector<std::vector<float>> runs;
  for (std::size_t cap : {std::size_t{64}, std::size_t{1} << 30}) {
    for (bool overlap : {true, false}) {
      mgpu::DeviceGroup group{"host:3"};
      DataParallelOptions options;
      options.deterministic = true;
      options.overlap = overlap;
      options.bucket_cap_bytes = cap;
      options.first_bucket_cap_bytes = cap;
      DataParallel dp(small_mlp(), group, mgpu::optim::AdamW({.lr = 0.01f}), options);
      for (int b = 0; b < 4; ++b) dp.step(data.x[b], data.y[b]);
      runs.push_back(dp_params(dp));
    }
  }
  for (auto const& run : runs) REQUIRE(run == runs.front());
}

TEST_CASE("The sharded update gives bitwise the replicated update's parameters and optimizer state", "[parallel][dp]") {
  Data data(3, 23, 14);
  // Buckets of one layer each, whose lengths do not divide by n (blocks plus replicated leftovers),
  // small and large.
  for (bool const wide : {false, true}) {
    for (int n = 2; n <= 5; ++n) {
      std::vector<std::vector<float>> params, state;
      for (bool const shard : {false, true}) {
        INFO(n << " devices, zero_stage " << shard << (wide ? ", wide model" : ""));
        mgpu::DeviceGroup group{"host:" + std::to_string(n)};
        DataParallelOptions options;
        options.zero_stage = shard ? 1 : 0;
        options.first_bucket_cap_bytes = 64;
        options.bucket_cap_bytes = 300;
        DataParallel dp(wide ? mgpu::nn::Sequential::mlp({features, 700, 400, classes}) : small_mlp(), group,
                        mgpu::optim::AdamW({.lr = 0.01f, .weight_decay = 0.1f}), options);
        for (int b = 0; b < 3; ++b) dp.step(data.x[b], data.y[b]);
        params.push_back(dp_params(dp));
        for (int r = 1; r < n; ++r) REQUIRE(dp_params(dp, r) == params.back());  // every rank gathered every block
        std::vector<float> all;
        for (auto const& [name, tensor] : dp.optimizer(n - 1).state()) {
          auto const values = host_values(tensor, dp.group().stream(n - 1));
          all.insert(all.end(), values.begin(), values.end());
        }
        state.push_back(all);
      }
      CHECK(params[1] == params[0]);
      CHECK(state[1] == state[0]);  // the last rank's optimizer gathered the other ranks' blocks
    }
  }
}

TEST_CASE("With clipping and a loss scaler the sharded update splits the work and matches the replicated update", "[parallel][dp]") {
  Data data(3, 23, 15);
  for (int n = 2; n <= 4; ++n) {
    std::vector<std::vector<float>> params;
    for (bool const shard : {false, true}) {
      INFO(n << " devices, zero_stage " << shard);
      mgpu::DeviceGroup group{"host:" + std::to_string(n)};
      auto timeline = std::make_shared<mgpu::trace::Timeline>();
      timeline->enable();
      DataParallelOptions options;
      options.zero_stage = shard ? 1 : 0;
      options.first_bucket_cap_bytes = 64;  // buckets of one layer whose lengths do not divide by n
      options.bucket_cap_bytes = 300;
      options.clip_norm = 0.05f;             // clipping at every step
      options.loss_scaler.emplace(256.0f);
      options.timeline = timeline;
      DataParallel dp(small_mlp(), group, mgpu::optim::AdamW({.lr = 0.01f, .weight_decay = 0.1f}), options);
      for (int b = 0; b < 3; ++b) REQUIRE(dp.step(data.x[b], data.y[b]).applied);
      params.push_back(dp_params(dp));
      for (int r = 1; r < n; ++r) REQUIRE(dp_params(dp, r) == params.back());  // every rank gathered every block
      // Each rank reduce-scattered and gathered every bucket (sharded), or all-reduced them.
      std::vector<int> scattered(static_cast<std::size_t>(n)), gathered(static_cast<std::size_t>(n)), all_reduced(static_cast<std::size_t>(n));
      for (auto const& span : timeline->spans()) {
        auto const r = static_cast<std::size_t>(span.rank);
        if (span.name.starts_with("reduce-scatter bucket")) ++scattered[r];
        if (span.name.starts_with("all-gather bucket")) ++gathered[r];
        if (span.name.starts_with("all-reduce bucket")) ++all_reduced[r];
      }
      auto const steps_x_buckets = static_cast<int>(3 * dp.buckets().size());
      for (int r = 0; r < n; ++r) {
        auto const i = static_cast<std::size_t>(r);
        CHECK(scattered[i] == (shard ? steps_x_buckets : 0));
        CHECK(gathered[i] == (shard ? steps_x_buckets : 0));
        CHECK(all_reduced[i] == (shard ? 0 : steps_x_buckets));
      }
    }
    // The norm is summed block by block instead of over the whole buffer: the last bits may differ.
    require_close(params[1], params[0], 1e-6);
  }
}

TEST_CASE("The timeline shows a bucket's all-reduce starting while earlier layers are in backward", "[parallel][dp][trace]") {
  Env env;
  Tensor x = env.random({64, 512}, 9);
  Tensor y = cycling_labels(env, 64);
  // Emulated at a tenth of the host's speed, compute is mostly sleep, so the communication
  // workers get a core however loaded the machine is.
  mgpu::DeviceGroup group{"host:2@speed=0.1"};
  auto timeline = std::make_shared<mgpu::trace::Timeline>();
  DataParallelOptions options;
  options.timeline = timeline;
  options.first_bucket_cap_bytes = 4096;  // the last layer's bucket alone
  // The first layer's backward (a 512 x 1024 weight gradient) takes much longer than the reduce
  // of the last layer's small bucket.
  DataParallel dp(mgpu::nn::Sequential::mlp({512, 1024, 32, 10}), group, mgpu::optim::SGD({.lr = 0.01f}), options);
  REQUIRE(dp.buckets().size() >= 2);
  timeline->enable();
  dp.step(x, y);
  dp.step(x, y);
  auto const spans = timeline->spans();
  bool overlapped = false;
  for (auto const& reduce : spans) {
    if (reduce.name != "reduce-scatter bucket 0" || reduce.rank != 0) continue;  // the sharded update's reduce
    for (auto const& bwd : spans) {
      // Bucket 0 holds the last layer only: its reduce must begin before an earlier layer's
      // backward ends.
      bool const earlier = bwd.name == "backward Linear(512, 1024)" || bwd.name == "backward Linear(1024, 32)";
      if (bwd.rank == 0 && earlier && reduce.begin_ns < bwd.end_ns) overlapped = true;
    }
  }
  if (!overlapped) {
    for (auto const& s : spans) UNSCOPED_INFO(s.rank << " " << s.lane << " " << s.name << " " << s.begin_ns / 1000 << " " << s.end_ns / 1000);
  }
  CHECK(overlapped);
  auto const json = nlohmann::json::parse(timeline->chrome_trace_json());
  int reduces = 0, gathers = 0, updates = 0, forwards = 0;
  for (auto const& e : json.at("traceEvents")) {
    if (e.at("ph") != "X") continue;
    std::string const name = e.at("name");
    reduces += name.rfind("reduce-scatter bucket", 0) == 0 ? 1 : 0;
    gathers += name.rfind("all-gather bucket", 0) == 0 ? 1 : 0;
    updates += name.rfind("update", 0) == 0 && e.at("tid") == mgpu::trace::Lane::communication ? 1 : 0;
    forwards += name == "forward" ? 1 : 0;
  }
  CHECK(forwards == 2 * 2);  // 2 ranks, 2 steps
  // Each bucket is reduce-scattered; each rank updates its block on the communication stream, then
  // gathers the bucket (both buckets split evenly in two: no leftover elements).
  CHECK(reduces == 2 * 2 * static_cast<int>(dp.buckets().size()));
  CHECK(updates == reduces);
  CHECK(gathers == reduces);
}

TEST_CASE("Rebalancing weights shards by each rank's time per row, an exponentially weighted mean", "[parallel][dp]") {
  // A cost model in place of the clock (rebalance_time), so the test does not depend on how busy
  // the machine is: rank 0 takes 0.01 ms a row; rank 1 too for the first 4 steps, then 0.02 ms.
  // The measured-time path is the same code; bench_data_parallel's BM_rebalance runs it on an
  // emulated half-speed device.
  Env env;
  std::int64_t const rows = 600;
  Tensor x = env.random({rows, 8}, 10);
  Tensor y = cycling_labels(env, rows);
  mgpu::DeviceGroup group{"host:2"};
  DataParallelOptions options;
  options.weights = {1, 1};
  options.rebalance = true;
  options.rebalance_ewma = 0.5;
  int step = 0;
  std::vector<std::int64_t> seen(2, -1);
  options.rebalance_time = [&](int rank, std::int64_t rank_rows, double measured_ms) {
    CHECK(measured_ms > 0);
    seen[static_cast<std::size_t>(rank)] = rank_rows;
    return static_cast<double>(rank_rows) * (rank == 1 && step >= 4 ? 0.02 : 0.01);
  };
  DataParallel dp(mgpu::nn::Sequential::mlp({8, 16, 10}), group, mgpu::optim::SGD({.lr = 0.01f}), options);
  double slow_ms_per_row = 0.01;  // the reference: rank 1's weighted mean, by the definition
  for (step = 0; step < 12; ++step) {
    auto const weights = dp.weights();
    auto const r = dp.step(x, y);
    INFO("step " << step << ": rows " << r.rows[0] << " : " << r.rows[1]);
    // Each step's shards follow the weights it started with, and rebalancing saw those rows.
    CHECK(std::abs(static_cast<double>(r.rows[0]) - static_cast<double>(rows) * weights[0] / (weights[0] + weights[1])) <= 1.0);
    CHECK(seen == std::vector<std::int64_t>{r.rows[0], r.rows[1]});
    slow_ms_per_row = step == 0 ? 0.01 : 0.5 * (step >= 4 ? 0.02 : 0.01) + 0.5 * slow_ms_per_row;
    CHECK(dp.weights()[0] / dp.weights()[1] == Approx(slow_ms_per_row / 0.01).epsilon(1e-12));
    CHECK(dp.weights()[0] + dp.weights()[1] == Approx(2.0));  // ranks keep their total weight
  }
  CHECK(dp.weights()[0] / dp.weights()[1] == Approx(2.0).epsilon(0.01));  // converged to 2:1
}

TEST_CASE("The scheduler picks the ranks and the shard weights follow device speed", "[parallel][dp][sched]") {
  Data data(2, 20, 11);
  Reference ref(small_mlp());
  for (int b = 0; b < 2; ++b) ref.step(data.x[b], data.y[b]);
  mgpu::DeviceGroup group{"host:4@speed=1,0.5,1,0.25"};
  DataParallelOptions options;
  options.request = mgpu::sched::Request{.devices = 2, .memory_bytes = 1 << 20};
  DataParallel dp(small_mlp(), group, mgpu::optim::SGD({.lr = 0.1f, .momentum = 0.9f}), options);
  REQUIRE(dp.ranks().size() == 2);
  CHECK(dp.group().size() == 2);
  std::vector<double> expected;
  for (int r : dp.ranks()) expected.push_back(group.device(r).speed);
  CHECK(dp.weights()[0] / dp.weights()[1] == Approx(expected[0] / expected[1]));
  for (int b = 0; b < 2; ++b) dp.step(data.x[b], data.y[b]);
  require_close(dp_params(dp), ref.params(), 2e-6);

  options.request->memory_bytes = 1e18;
  REQUIRE_MGPU_ERROR(DataParallel(small_mlp(), group, mgpu::optim::SGD{}, options), mgpu::Errc::out_of_memory, "can hold a replica");
}

TEST_CASE("Checkpoints: saved from rank 0, loaded on another device count, bit-identical continuation", "[parallel][dp][io]") {
  auto const dir = mgpu::test::temp_path("mgpu_dp_checkpoint_test");
  std::filesystem::create_directories(dir);
  Data data(4, 18, 12);
  std::vector<float> straight;
  {
    mgpu::DeviceGroup group{"host:2"};
    DataParallel dp(small_mlp(), group, mgpu::optim::SGD({.lr = 0.1f, .momentum = 0.9f}));
    for (int b = 0; b < 4; ++b) dp.step(data.x[b], data.y[b]);
    straight = dp_params(dp);
  }
  {
    mgpu::DeviceGroup group{"host:2"};
    DataParallel dp(small_mlp(), group, mgpu::optim::SGD({.lr = 0.1f, .momentum = 0.9f}));
    for (int b = 0; b < 2; ++b) dp.step(data.x[b], data.y[b]);
    dp.save(dir / "dp.ckpt", {.step = 2});
  }
  {
    mgpu::DeviceGroup group{"host:2"};
    DataParallel dp(small_mlp(), group, mgpu::optim::SGD({.lr = 0.1f, .momentum = 0.9f}), {.seed = 99});
    CHECK(dp.load(dir / "dp.ckpt").step == 2);
    for (int b = 2; b < 4; ++b) dp.step(data.x[b], data.y[b]);
    CHECK(dp_params(dp) == straight);  // bitwise
  }
  {
    mgpu::DeviceGroup group{"host:3"};
    DataParallel dp(small_mlp(), group, mgpu::optim::SGD({.lr = 0.1f, .momentum = 0.9f}), {.seed = 99});
    dp.load(dir / "dp.ckpt");
    for (int b = 2; b < 4; ++b) dp.step(data.x[b], data.y[b]);
    require_close(dp_params(dp), straight, 2e-6);
    require_close(dp_params(dp, 2), dp_params(dp), 0);
    DataParallel other(mgpu::nn::Sequential::mlp({features, 8, classes}), group, mgpu::optim::SGD{});
    REQUIRE_MGPU_ERROR(other.load(dir / "dp.ckpt"), mgpu::Errc::invalid_argument, "expected");
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("Checkpoints into a folder: one shard per process, loaded on another device count like the file",
          "[parallel][dp][io]") {
  auto const dir = mgpu::test::temp_path("mgpu_dp_folder_test");
  std::filesystem::create_directories(dir / "folder");
  Data data(4, 18, 12);
  auto const adamw = mgpu::optim::AdamW({.lr = 0.01f});
  std::vector<float> straight;
  {
    mgpu::DeviceGroup group{"host:2"};
    DataParallel dp(small_mlp(), group, adamw,
                    {.bucket_cap_bytes = 64, .first_bucket_cap_bytes = 64});  // sharded AdamW state
    for (int b = 0; b < 2; ++b) dp.step(data.x[b], data.y[b]);
    dp.save(dir / "folder", {.step = 2});  // an existing folder: a sharded save, each rank its owned state
    dp.save(dir / "dp.ckpt", {.step = 2});
    for (int b = 2; b < 4; ++b) dp.step(data.x[b], data.y[b]);
    straight = dp_params(dp);
  }
  CHECK(mgpu::io::ShardedCheckpoint::load(dir / "folder").shards() == 1);
  for (char const* devices : {"host:2", "host:3"}) {
    INFO("resumed on " << devices);
    std::vector<std::vector<float>> resumed;
    for (char const* from : {"dp.ckpt", "folder"}) {
      mgpu::DeviceGroup group{devices};
      DataParallel dp(small_mlp(), group, adamw, {.seed = 99});
      CHECK(dp.load(dir / from).step == 2);
      for (int b = 2; b < 4; ++b) dp.step(data.x[b], data.y[b]);
      resumed.push_back(dp_params(dp));
    }
    CHECK(resumed[1] == resumed[0]);  // the folder holds what the file holds: bitwise
    if (std::string(devices) == "host:2") CHECK(resumed[1] == straight);
  }
  // Saved mid accumulation cycle, or with a comm hook, a folder holds each rank's row of the
  // accumulated gradients or the hook's residuals as the file does: the same bits resumed.
  for (bool const hook : {false, true}) {
    INFO((hook ? "bf16 compression" : "mid accumulation cycle"));
    mgpu::DeviceGroup group{"host:2"};
    DataParallelOptions options;
    options.accumulation_steps = hook ? 1 : 2;
    auto const with_hook = [&] {  // each executor its own residuals
      if (hook) options.comm_hook = std::make_shared<mgpu::parallel::Bf16Compression>();
      return options;
    };
    std::filesystem::create_directories(dir / "cycle");
    DataParallel saver(small_mlp(), group, adamw, with_hook());
    saver.step(data.x[0], data.y[0]);
    saver.save(dir / "cycle", {});
    saver.save(dir / "cycle.ckpt", {});
    std::vector<std::vector<float>> resumed;
    for (char const* from : {"cycle.ckpt", "cycle"}) {
      DataParallel dp(small_mlp(), group, adamw, with_hook());
      dp.load(dir / from);
      for (int b = 1; b < 4; ++b) dp.step(data.x[b], data.y[b]);
      resumed.push_back(dp_params(dp));
    }
    CHECK(resumed[1] == resumed[0]);
    std::filesystem::remove_all(dir / "cycle");
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("bf16-compressed all-reduce with error feedback trains close to float32", "[parallel][dp]") {
  Data data(4, 24, 13);
  Reference ref(small_mlp());
  for (int b = 0; b < 4; ++b) ref.step(data.x[b], data.y[b]);
  mgpu::DeviceGroup group{"host:2"};
  auto hook = std::make_shared<mgpu::parallel::Bf16Compression>();
  DataParallelOptions options;
  options.comm_hook = hook;
  DataParallel dp(small_mlp(), group, mgpu::optim::SGD({.lr = 0.1f, .momentum = 0.9f}), options);
  for (int b = 0; b < 4; ++b) dp.step(data.x[b], data.y[b]);
  require_close(dp_params(dp), ref.params(), 2e-2);
  require_close(dp_params(dp, 1), dp_params(dp), 0);
  // The residual is what rounding to bfloat16 lost: at most half a bfloat16 ulp of the value.
  auto const residual = host_values(hook->residual(0, 0), dp.group().stream(0));
  double largest = 0;
  for (float v : residual) largest = std::max(largest, static_cast<double>(std::abs(v)));
  CHECK(largest > 0);
  CHECK(largest < 1e-2);
}

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

namespace {

// A step run by run_steps: whether it was applied, and the loss scaler after it.
struct StepTrace {
  bool applied;
  float scale;
  std::int64_t skipped;
  bool operator==(StepTrace const&) const = default;
};

// Steps [begin, end) of `data` on `dp`, traced.
std::vector<StepTrace> run_steps(DataParallel& dp, Data const& data, int begin, int end) {
  std::vector<StepTrace> trace;
  for (int b = begin; b < end; ++b) {
    bool const applied = dp.step(data.x[static_cast<std::size_t>(b)], data.y[static_cast<std::size_t>(b)]).applied;
    auto const* scaler = dp.loss_scaler();
    trace.push_back({applied, scaler ? scaler->scale() : 0.0f, scaler ? scaler->skipped() : 0});
  }
  return trace;
}

// Options with a hook of its own (a hook holds one executor's state).
DataParallelOptions own_hook(DataParallelOptions options) {
  if (options.comm_hook) options.comm_hook = std::make_shared<mgpu::parallel::Bf16Compression>();
  return options;
}

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

TEST_CASE("A run resumed from a checkpoint equals the uninterrupted run, mid-cycle and with a loss scaler or compression",
          "[parallel][dp][io]") {
  auto const dir = mgpu::test::temp_path("mgpu_dp_resume_test");
  std::filesystem::create_directories(dir);
  Data data(8, 18, 21);
  struct Case {
    char const* name;
    DataParallelOptions options;
    int save_after;          // steps before the checkpoint
    // Resumed on another device count against the uninterrupted run: measured 4e-8 (float32),
    // 1.3e-4 (bfloat16), 6e-5 (float16), 4e-4 (bf16 compression); 5e-2 and more before
    // checkpoints held the executor's state.
    double other_tolerance;
  };
  std::vector<Case> cases;
  cases.push_back({"float32, 2 accumulated micro-batches, saved mid-cycle", {.accumulation_steps = 2}, 3, 2e-6});
  cases.push_back({"bfloat16, 2 accumulated micro-batches, saved mid-cycle", {.accumulation_steps = 2, .compute = DType::bfloat16}, 3, 5e-3});
  DataParallelOptions fp16;
  fp16.compute = DType::float16;
  fp16.loss_scaler.emplace(1e9f, 2.0f, 0.01f, 2);  // overflows first, backs off, then grows every 2 finite steps
  cases.push_back({"float16 with a loss scaler that backed off", fp16, 3, 2e-3});
  cases.push_back({"float32 with bf16 compression", {.comm_hook = std::make_shared<mgpu::parallel::Bf16Compression>()}, 3, 1e-2});
  for (Case const& c : cases) {
    INFO(c.name);
    auto const sgd = mgpu::optim::SGD({.lr = 0.1f, .momentum = 0.9f});
    std::vector<float> straight;
    std::vector<StepTrace> straight_trace;
    {
      mgpu::DeviceGroup group{"host:2"};
      DataParallel dp(small_mlp(), group, sgd, own_hook(c.options));
      run_steps(dp, data, 0, c.save_after);
      straight_trace = run_steps(dp, data, c.save_after, 8);
      straight = dp_params(dp);
    }
    {
      mgpu::DeviceGroup group{"host:2"};
      DataParallel dp(small_mlp(), group, sgd, own_hook(c.options));
      run_steps(dp, data, 0, c.save_after);
      if (c.options.loss_scaler) {  // the state worth saving: backed off, part-way to growing
        INFO("scale " << dp.loss_scaler()->scale() << ", " << dp.loss_scaler()->state().good_steps << " good steps, " << dp.loss_scaler()->skipped() << " skipped");
        REQUIRE(dp.loss_scaler()->scale() < 1e9f);
        REQUIRE(dp.loss_scaler()->skipped() > 0);
        REQUIRE(dp.loss_scaler()->state().good_steps > 0);
      }
      dp.save(dir / "dp.ckpt", {.step = c.save_after});
    }
    for (char const* devices : {"host:2", "host:3"}) {
      INFO("resumed on " << devices);
      mgpu::DeviceGroup group{devices};
      DataParallelOptions options = own_hook(c.options);
      options.seed = 99;
      DataParallel dp(small_mlp(), group, sgd, options);
      CHECK(dp.load(dir / "dp.ckpt").step == c.save_after);
      CHECK(run_steps(dp, data, c.save_after, 8) == straight_trace);
      if (group.size() == 2) {
        CHECK(dp_params(dp) == straight);  // bitwise
      } else {
        require_close(dp_params(dp), straight, c.other_tolerance);
      }
      require_close(dp_params(dp, group.size() - 1), dp_params(dp), 0);
    }
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("load() leaves an executor exactly as a fresh one that loaded the same file", "[parallel][dp][io]") {
  auto const dir = mgpu::test::temp_path("mgpu_dp_reload_test");
  std::filesystem::create_directories(dir);
  Data data(8, 16, 22);
  DataParallelOptions options;
  options.accumulation_steps = 2;
  options.compute = DType::float16;
  options.loss_scaler.emplace(1024.0f, 2.0f, 0.5f, 1);  // grows on every applied step
  auto const sgd = mgpu::optim::SGD({.lr = 0.1f, .momentum = 0.9f});
  mgpu::DeviceGroup group{"host:2"};
  {
    DataParallel dp(small_mlp(), group, sgd, options);
    run_steps(dp, data, 0, 2);
    dp.save(dir / "dp.ckpt", {.step = 2});
  }
  DataParallel used(small_mlp(), group, sgd, options);
  run_steps(used, data, 0, 5);  // mid-cycle, its scaler grown past the file's
  used.load(dir / "dp.ckpt");
  auto const used_trace = run_steps(used, data, 2, 8);
  mgpu::DeviceGroup other{"host:2"};
  DataParallel fresh(small_mlp(), other, sgd, options);
  fresh.load(dir / "dp.ckpt");
  CHECK(run_steps(fresh, data, 2, 8) == used_trace);
  CHECK(dp_params(used) == dp_params(fresh));
  // A file saved before the first step has no optimizer state: the momentum the used executor
  // built up is dropped too.
  {
    DataParallel dp(small_mlp(), group, sgd, options);
    dp.save(dir / "start.ckpt", {});
  }
  used.load(dir / "start.ckpt");
  auto const restarted = run_steps(used, data, 0, 6);
  DataParallel started(small_mlp(), other, sgd, options);
  started.load(dir / "start.ckpt");
  CHECK(run_steps(started, data, 0, 6) == restarted);
  CHECK(dp_params(used) == dp_params(started));
  std::filesystem::remove_all(dir);
}

TEST_CASE("A checkpoint of save_training (no executor state) loads as one saved at the start of a cycle", "[parallel][dp][io]") {
  auto const dir = mgpu::test::temp_path("mgpu_dp_plain_checkpoint_test");
  std::filesystem::create_directories(dir);
  Data data(3, 12, 23);
  Reference ref(small_mlp());
  ref.step(data.x[0], data.y[0]);
  mgpu::io::save_training(dir / "plain.ckpt", ref.model, ref.sgd, {.step = 1}, ref.env.stream);
  for (int b = 1; b < 3; ++b) ref.step(data.x[b], data.y[b]);
  mgpu::DeviceGroup group{"host:2"};
  DataParallel dp(small_mlp(), group, mgpu::optim::SGD({.lr = 0.1f, .momentum = 0.9f}), {.seed = 5});
  CHECK(dp.load(dir / "plain.ckpt").step == 1);
  run_steps(dp, data, 1, 3);
  require_close(dp_params(dp), ref.params(), 2e-6);
  std::filesystem::remove_all(dir);
}

TEST_CASE("A checkpoint saved mid-cycle is refused by an executor with another accumulation cycle", "[parallel][dp][io]") {
  auto const dir = mgpu::test::temp_path("mgpu_dp_cycle_test");
  std::filesystem::create_directories(dir);
  Data data(1, 8, 24);
  mgpu::DeviceGroup group{"host:2"};
  DataParallel saved(small_mlp(), group, mgpu::optim::SGD{}, {.accumulation_steps = 3});
  saved.step(data.x[0], data.y[0]);
  saved.save(dir / "dp.ckpt", {});
  DataParallel other(small_mlp(), group, mgpu::optim::SGD{}, {.accumulation_steps = 2});
  auto const before = dp_params(other);
  REQUIRE_MGPU_ERROR(other.load(dir / "dp.ckpt"), mgpu::Errc::invalid_argument,
                     "saved after 1 of 3 accumulated micro-batches (expected accumulation_steps = 3");
  CHECK(dp_params(other) == before);
  std::filesystem::remove_all(dir);
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
