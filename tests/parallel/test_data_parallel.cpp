// DataParallel against an independent reference: the same model trained by classification_step on
// one host device with the whole batch. Shard sizes, accumulation, 16-bit compute, clipping,
// dropout, determinism, overlap on the timeline, rebalancing, placement and compression; its
// checkpoints are in test_data_parallel_checkpoint.cpp, its errors in test_data_parallel_errors.cpp.
#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <mgpu/parallel/data_parallel.hpp>

#include "support/catch.hpp"
#include "support/dp_fixture.hpp"
#include "support/expect_error.hpp"
#include "support/nn_env.hpp"

using mgpu::DType;
using mgpu::Tensor;
using mgpu::parallel::DataParallel;
using mgpu::parallel::DataParallelOptions;
using mgpu::test::Env;
using mgpu::test::host_values;
using namespace mgpu::test::dp;

namespace {

// Labels 0, 1, ..., 9, 0, 1, ... for `rows` rows, in host memory.
Tensor cycling_labels(Env& env, std::int64_t rows) {
  Tensor y = Tensor::empty({rows}, DType::float32, *env.allocator);
  for (std::int64_t i = 0; i < rows; ++i) y.host_span<float>()[static_cast<std::size_t>(i)] = static_cast<float>(i % 10);
  return y;
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
