// The pipeline executor against the unsplit model on one device: for every schedule and size, the
// loss and parameter gradients of a step, and the parameters after several optimizer steps; a
// failing stage stops every device with an error naming it; bad input is rejected.
#include <mgpu/nn/layers.hpp>
#include <mgpu/nn/train.hpp>
#include <mgpu/ops/ops.hpp>
#include <mgpu/optim/optim.hpp>
#include <mgpu/pipeline/pipeline.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "support/catch.hpp"
#include "support/expect_error.hpp"
#include "support/nn_env.hpp"

using mgpu::Tensor;
using mgpu::test::as_double;
using mgpu::test::Env;
namespace nn = mgpu::nn;
namespace pp = mgpu::pipeline;

namespace {
// Nine units: both fusions, LayerNorm and two Dropouts, so any cut moves every kind of layer.
nn::Sequential make_model() {
  nn::Sequential m;
  m.add(std::make_unique<nn::Linear>(6, 12));
  m.add(std::make_unique<nn::ReLU>());
  m.add(std::make_unique<nn::Dropout>(0.2f));
  m.add(std::make_unique<nn::Linear>(12, 12, nn::Init::xavier));
  m.add(std::make_unique<nn::GELU>());
  m.add(std::make_unique<nn::LayerNorm>(12));
  m.add(std::make_unique<nn::Linear>(12, 10));
  m.add(std::make_unique<nn::ReLU>());
  m.add(std::make_unique<nn::Linear>(10, 10));
  m.add(std::make_unique<nn::ReLU>());
  m.add(std::make_unique<nn::Dropout>(0.1f));
  m.add(std::make_unique<nn::Linear>(10, 8));
  m.add(std::make_unique<nn::ReLU>());
  m.add(std::make_unique<nn::Linear>(8, 3, nn::Init::xavier));
  return m;
}

// `chunks` stages with units spread evenly.
std::vector<std::size_t> even_cuts(nn::Sequential const& model, int chunks) {
  auto const points = model.cut_points();
  auto const units = points.size() - 1;
  std::vector<std::size_t> cuts;
  for (int c = 0; c <= chunks; ++c) cuts.push_back(points[static_cast<std::size_t>(c) * units / static_cast<std::size_t>(chunks)]);
  return cuts;
}

pp::OptimizerFactory sgd(float lr = 0.1f) {
  return [lr] { return std::make_unique<mgpu::optim::SGD>(mgpu::optim::SgdOptions{.lr = lr, .momentum = 0.9f}); };
}

struct Batch {
  Tensor x, y;
};
Batch make_batch(Env& env, std::int64_t n, unsigned seed) {
  Batch b{env.random({n, 6}, seed), Tensor::empty({n}, mgpu::DType::float32, *env.allocator)};
  for (std::int64_t i = 0; i < n; ++i) b.y.host_span<float>()[static_cast<std::size_t>(i)] = static_cast<float>((i * 5 + seed) % 3);
  return b;
}

// The unsplit model's loss and gradients on one device.
std::pair<double, std::vector<double>> reference(Env& env, Batch const& b, std::uint64_t seed) {
  nn::Sequential model = make_model();
  model.materialize(env.ctx, seed);
  Tensor const logits = model.forward(b.x, env.ctx);
  Tensor const dlogits = Tensor::empty(logits.shape(), logits.dtype(), *env.allocator);
  Tensor const loss = env.scalar();
  mgpu::ops::softmax_cross_entropy(logits, b.y, dlogits, loss, env.stream);
  model.backward(dlogits, env.ctx, false);
  double const l = mgpu::ops::item(loss, env.stream);
  return {l, as_double(model.gradients())};
}

enum class Buffer { parameters, gradients, masters };

// A buffer of every chunk, in model order.
std::vector<double> gathered(pp::Executor& ex, Buffer buffer) {
  std::vector<double> all;
  for (int c = 0; c < ex.schedule().chunks(); ++c) {
    nn::Sequential& chunk = ex.chunk(c);
    auto const part = as_double(buffer == Buffer::gradients ? chunk.gradients()
                                : buffer == Buffer::masters ? chunk.master_parameters()
                                                            : chunk.parameters());
    all.insert(all.end(), part.begin(), part.end());
  }
  return all;
}

// Within float32 rounding by default; 16-bit compute passes its own tolerances.
void check_close(std::vector<double> const& got, std::vector<double> const& want, double margin = 1e-5, double epsilon = 1e-4) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    CAPTURE(i);
    CHECK(got[i] == Approx(want[i]).margin(margin).epsilon(epsilon));
  }
}

// Throws from forward on one micro-batch.
class Faulty final : public nn::Layer {
 public:
  std::string name() const override { return "Faulty"; }
  Tensor forward(Tensor const& x, nn::Context& ctx) override {
    if (ctx.micro_batch == 2) throw mgpu::Error(mgpu::Errc::invalid_argument, "Faulty: refuses micro-batch 2");
    return x;
  }
  Tensor backward(Tensor const& dy, nn::Context&) override { return dy; }
  std::unique_ptr<nn::Layer> clone() const override { return std::make_unique<Faulty>(); }
};

// Fails in its stream work (not while enqueuing) on one micro-batch.
class FaultyOnStream final : public nn::Layer {
 public:
  std::string name() const override { return "FaultyOnStream"; }
  Tensor forward(Tensor const& x, nn::Context& ctx) override {
    if (ctx.micro_batch == 1)
      ctx.stream.enqueue([] { throw mgpu::Error(mgpu::Errc::invalid_argument, "FaultyOnStream: micro-batch 1 failed on the stream"); });
    return x;
  }
  Tensor backward(Tensor const& dy, nn::Context&) override { return dy; }
  std::unique_ptr<nn::Layer> clone() const override { return std::make_unique<FaultyOnStream>(); }
};

// make_model() with `fault` after its LayerNorm (layer 5): in chunk 1 of the cuts {0, 3, 9, 15}.
nn::Sequential with_fault(std::unique_ptr<nn::Layer> fault) {
  nn::Sequential const model = make_model();
  nn::Sequential faulty;
  for (std::size_t l = 0; l < model.size(); ++l) {
    faulty.add(model.layer(l).clone());
    if (l == 5) faulty.add(std::move(fault));
  }
  return faulty;
}
}  // namespace

TEST_CASE("every schedule's loss and gradients equal the unsplit model's", "[parallel][pipeline]") {
  Env env;
  Batch const b = make_batch(env, 16, 3);
  auto const [want_loss, want_grads] = reference(env, b, 7);
  nn::Sequential const model = make_model();
  for (int p = 1; p <= 4; ++p) {
    mgpu::DeviceGroup group("host:" + std::to_string(p));
    for (int m = 1; m <= 8; ++m) {
      std::vector<pp::Schedule> schedules{pp::gpipe(p, m), pp::one_f_one_b(p, m), pp::zero_bubble_h1(p, m)};
      if (m % p == 0) schedules.push_back(pp::interleaved_one_f_one_b(p, 2, m));
      if (m == 1) schedules.push_back(pp::layer_split(p));
      for (pp::Schedule const& s : schedules) {
        CAPTURE(p, m, s.name);
        pp::Executor ex(model, group, even_cuts(model, s.chunks()), s, sgd(), {.seed = 7});
        float const loss = ex.compute_gradients(b.x, b.y);
        CHECK(loss == Approx(want_loss).epsilon(1e-5));
        check_close(gathered(ex, Buffer::gradients), want_grads);
      }
    }
  }
}

TEST_CASE("k pipelined optimizer steps equal single-device training", "[parallel][pipeline]") {
  Env env;
  nn::Sequential reference_model = make_model();
  reference_model.materialize(env.ctx, 11);
  mgpu::optim::SGD opt({.lr = 0.1f, .momentum = 0.9f});
  std::vector<Batch> batches;
  for (unsigned k = 0; k < 3; ++k) batches.push_back(make_batch(env, 12, 20 + k));
  for (Batch const& b : batches) nn::classification_step(reference_model, opt, b.x, b.y, env.ctx);
  env.stream.synchronize();
  auto const want = as_double(reference_model.parameters());
  mgpu::DeviceGroup group("host:3");
  for (std::string const name : {"1f1b", "zb", "interleaved"}) {
    CAPTURE(name);
    pp::Schedule const s = pp::make_schedule(name, 3, 6, 2);
    pp::Executor ex(make_model(), group, even_cuts(make_model(), s.chunks()), s, sgd(), {.seed = 11});
    for (Batch const& b : batches) ex.step(b.x, b.y);
    check_close(gathered(ex, Buffer::parameters), want);
  }
}

TEST_CASE("the automatic partition balances profiled layer costs", "[parallel][pipeline]") {
  nn::Sequential const model = make_model();
  // Unit costs 1, 1, 1, 1, 8, 1, 1, 1, 1 (the Linear+ReLU at layer 8 is heavy): the best 3-way
  // split isolates it, slowest stage 8.
  std::vector<double> seconds(model.size(), 0.0);
  for (std::size_t const l : model.cut_points()) {
    if (l < model.size()) seconds[l] = l == 8 ? 8.0 : 1.0;
  }
  pp::Partition const plan = pp::partition(model, 3, seconds);
  CHECK(plan.cuts == std::vector<std::size_t>{0, 8, 10, 14});
  CHECK(*std::max_element(plan.chunk_seconds.begin(), plan.chunk_seconds.end()) == Approx(8.0));
  REQUIRE_MGPU_ERROR(pp::partition(model, 10, seconds), mgpu::Errc::invalid_argument, "expected 1 to 9 stages");
  mgpu::DeviceGroup group("host:1");
  auto const profiled = pp::profile_layers(model, group, {8, 6}, 1).seconds;
  REQUIRE(profiled.size() == model.size());
  CHECK(profiled[0] > 0.0);
  CHECK(profiled[1] == 0.0);  // the ReLU runs inside the Linear before it
}

TEST_CASE("bfloat16 pipelined steps equal the unsplit model trained in bfloat16", "[parallel][pipeline]") {
  Env env;
  std::vector<Batch> batches;
  for (unsigned k = 0; k < 3; ++k) batches.push_back(make_batch(env, 12, 30 + k));
  nn::Sequential reference_model = make_model();
  reference_model.materialize(env.ctx, 5, mgpu::DType::bfloat16);
  mgpu::optim::SGD opt({.lr = 0.1f, .momentum = 0.9f});
  std::vector<float> want_losses;
  for (Batch const& b : batches)
    want_losses.push_back(mgpu::ops::item(nn::classification_step(reference_model, opt, b.x, b.y, env.ctx).loss, env.stream));
  env.stream.synchronize();
  auto const want = as_double(reference_model.master_parameters());
  mgpu::DeviceGroup group("host:2");
  for (std::string const name : {"1f1b", "zb", "interleaved"}) {
    CAPTURE(name);
    pp::Schedule const s = pp::make_schedule(name, 2, 4, 2);
    pp::Executor ex(make_model(), group, even_cuts(make_model(), s.chunks()), s, sgd(), {.seed = 5, .compute = mgpu::DType::bfloat16});
    CHECK(ex.chunk(0).compute_type() == mgpu::DType::bfloat16);
    for (std::size_t k = 0; k < batches.size(); ++k) CHECK(ex.step(batches[k].x, batches[k].y) == Approx(want_losses[k]).epsilon(2e-2));
    check_close(gathered(ex, Buffer::masters), want, 2e-3, 2e-2);
  }
}

TEST_CASE("float16 with loss scaling: an overflow in any stage skips the step on every stage", "[parallel][pipeline]") {
  Env env;
  std::vector<Batch> batches;
  for (unsigned k = 0; k < 3; ++k) batches.push_back(make_batch(env, 12, 50 + k));
  // A first scale of 1e10 overflows float16's loss gradient (largest finite 65504); the backoff
  // then brings it to 1e4. The unsplit model in float16 with the same scaler is the reference.
  auto const scaler = [] { return mgpu::optim::LossScaler(1e10f, 2.0f, 1e-6f, 2000); };
  nn::Sequential reference_model = make_model();
  reference_model.materialize(env.ctx, 9, mgpu::DType::float16);
  mgpu::optim::SGD opt({.lr = 0.1f, .momentum = 0.9f});
  mgpu::optim::LossScaler reference_scaler = scaler();
  std::vector<bool> want_applied;
  for (Batch const& b : batches)
    want_applied.push_back(nn::classification_step(reference_model, opt, b.x, b.y, env.ctx, {.scaler = &reference_scaler}).applied);
  REQUIRE(want_applied == std::vector<bool>{false, true, true});
  env.stream.synchronize();
  auto const want = as_double(reference_model.master_parameters());

  mgpu::DeviceGroup group("host:3");
  pp::Schedule const s = pp::one_f_one_b(3, 3);
  pp::Executor ex(make_model(), group, even_cuts(make_model(), 3), s, sgd(), {.seed = 9, .compute = mgpu::DType::float16, .loss_scaler = scaler()});
  auto const initial = gathered(ex, Buffer::masters);
  ex.step(batches[0].x, batches[0].y);
  CHECK_FALSE(ex.last_step_applied());
  CHECK(gathered(ex, Buffer::masters) == initial);  // no stage updated, not even those whose gradients were finite
  REQUIRE(ex.loss_scaler() != nullptr);
  CHECK(ex.loss_scaler()->skipped() == 1);
  CHECK(ex.loss_scaler()->scale() == reference_scaler.scale());
  for (std::size_t k = 1; k < batches.size(); ++k) {
    ex.step(batches[k].x, batches[k].y);
    CHECK(ex.last_step_applied());
  }
  check_close(gathered(ex, Buffer::masters), want, 2e-3, 2e-2);
}

TEST_CASE("a failing stage stops every device with an error naming it", "[parallel][pipeline]") {
  Env env;
  Batch const b = make_batch(env, 8, 5);
  nn::Sequential const faulty = with_fault(std::make_unique<Faulty>());
  mgpu::DeviceGroup group("host:3");
  pp::Schedule const s = pp::one_f_one_b(3, 4);
  std::vector<std::size_t> const cuts{0, 3, 9, 15};
  pp::Executor ex(faulty, group, cuts, s, sgd(), {.seed = 1, .timeout = std::chrono::milliseconds(20000)});
  auto const start = std::chrono::steady_clock::now();
  REQUIRE_MGPU_ERROR(ex.compute_gradients(b.x, b.y), mgpu::Errc::invalid_argument,
                     "pipeline device 1, chunk 1, action 10 (forward(mb 2, chunk 1)): Faulty: refuses micro-batch 2");
  // The others were stopped by the abort, not by the 20 s deadline.
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));
}

TEST_CASE("work that fails on a stage's stream stops every device with that error", "[parallel][pipeline]") {
  Env env;
  Batch const b = make_batch(env, 8, 5);
  nn::Sequential const faulty = with_fault(std::make_unique<FaultyOnStream>());
  mgpu::DeviceGroup group("host:3");
  pp::Executor ex(faulty, group, {0, 3, 9, 15}, pp::one_f_one_b(3, 4), sgd(), {.seed = 1, .timeout = std::chrono::milliseconds(20000)});
  auto const start = std::chrono::steady_clock::now();
  // Device 1 learns of it when it next waits for its stream, before a later forward; device 2 may
  // fail first, with the abort that device 1's skipped send caused, but the step reports the cause.
  REQUIRE_MGPU_ERROR(ex.compute_gradients(b.x, b.y), mgpu::Errc::invalid_argument,
                     "FaultyOnStream: micro-batch 1 failed on the stream");
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));  // the abort, not the 20 s deadline
}

TEST_CASE("the executor rejects bad input", "[parallel][pipeline]") {
  Env env;
  nn::Sequential const model = make_model();
  mgpu::DeviceGroup group("host:2");
  auto const s = pp::one_f_one_b(2, 4);
  REQUIRE_MGPU_ERROR(pp::Executor(model, group, {0, 8, 14}, pp::interleaved_one_f_one_b(2, 8, 4), sgd()), mgpu::Errc::invalid_argument,
                     "16 pipeline stages for a model of 9 units");
  REQUIRE_MGPU_ERROR(pp::Executor(model, group, {0, 8, 3, 14}, pp::interleaved_one_f_one_b(2, 1, 4), sgd()),
                     mgpu::Errc::invalid_argument, "4 cut points (expected 3");
  REQUIRE_MGPU_ERROR(pp::Executor(model, group, {0, 8, 5, 14}, pp::interleaved_one_f_one_b(3, 1, 3), sgd()),
                     mgpu::Errc::invalid_argument, "a schedule for 3 devices times 1 data-parallel replicas on a group of 2");
  mgpu::DeviceGroup three("host:3");
  REQUIRE_MGPU_ERROR(pp::Executor(model, three, {0, 8, 5, 14}, pp::one_f_one_b(3, 3), sgd()), mgpu::Errc::invalid_argument,
                     "cut points out of order: 5 after 8");
  REQUIRE_MGPU_ERROR(pp::Executor(model, group, {0, 7, 14}, s, sgd()), mgpu::Errc::invalid_argument, "a stage cut at layer 7");
  pp::Schedule zero = s;
  zero.micro_batches = 0;
  REQUIRE_MGPU_ERROR(pp::Executor(model, group, {0, 8, 14}, zero, sgd()), mgpu::Errc::invalid_argument, "0 micro-batches");
  pp::Schedule broken = s;
  broken.actions[0].pop_back();
  REQUIRE_MGPU_ERROR(pp::Executor(model, group, {0, 8, 14}, broken, sgd()), mgpu::Errc::invalid_argument, "invalid schedule");
  pp::Executor ex(model, group, {0, 8, 14}, s, sgd());
  Batch const small = make_batch(env, 3, 1);
  REQUIRE_MGPU_ERROR(ex.compute_gradients(small.x, small.y), mgpu::Errc::invalid_argument,
                     "a batch of 3 rows cannot be split into 1 replica(s) x 4 micro-batches");
  Batch const b = make_batch(env, 8, 1);
  REQUIRE_MGPU_ERROR(ex.compute_gradients(b.x, small.y), mgpu::Errc::invalid_argument, "one float32 class id per row");
}

TEST_CASE("a 2 x 2 data x pipeline grid trains as one device does", "[parallel][pipeline]") {
  Env env;
  std::vector<Batch> batches;
  for (unsigned k = 0; k < 3; ++k) batches.push_back(make_batch(env, 14, 40 + k));
  // The reference: loss and gradients of the first batch, then parameters after every batch.
  auto const [want_loss, want_grads] = reference(env, batches[0], 13);
  nn::Sequential reference_model = make_model();
  reference_model.materialize(env.ctx, 13);
  mgpu::optim::SGD opt({.lr = 0.1f, .momentum = 0.9f});
  for (Batch const& b : batches) nn::classification_step(reference_model, opt, b.x, b.y, env.ctx);
  env.stream.synchronize();
  auto const want = as_double(reference_model.parameters());

  mgpu::DeviceGroup group("host:4");
  for (std::string const name : {"1f1b", "zb"}) {
    CAPTURE(name);
    pp::Schedule const s = pp::make_schedule(name, 2, 3);
    pp::Executor ex(make_model(), group, even_cuts(make_model(), 2), s, sgd(), {.seed = 13, .data_parallel = 2});
    CHECK(ex.compute_gradients(batches[0].x, batches[0].y) == Approx(want_loss).epsilon(1e-5));
    std::vector<double> replica1;
    for (int c = 0; c < 2; ++c) {
      auto const part = as_double(ex.chunk(c, 1).gradients());
      replica1.insert(replica1.end(), part.begin(), part.end());
    }
    check_close(gathered(ex, Buffer::gradients), want_grads);
    CHECK(replica1 == gathered(ex, Buffer::gradients));  // the all-reduce gives both replicas the same sum
    pp::Executor trained(make_model(), group, even_cuts(make_model(), 2), s, sgd(), {.seed = 13, .data_parallel = 2});
    for (Batch const& b : batches) trained.step(b.x, b.y);
    check_close(gathered(trained, Buffer::parameters), want);
  }
  REQUIRE_MGPU_ERROR(pp::Executor(make_model(), group, {0, 8, 14}, pp::one_f_one_b(2, 2), sgd(), {.data_parallel = 3}),
                     mgpu::Errc::invalid_argument, "2 devices times 3 data-parallel replicas on a group of 4");
}

TEST_CASE("stage 0's allocator peak: 1F1B holds at most P micro-batches, GPipe M", "[parallel][pipeline]") {
  // A wide first stage, so its saved activations dominate what device 0 allocates in a step.
  nn::Sequential model;
  model.add(std::make_unique<nn::Linear>(6, 512));
  model.add(std::make_unique<nn::ReLU>());
  for (int l = 0; l < 3; ++l) model.add(std::make_unique<nn::Linear>(l == 0 ? 512 : 8, 8));
  Env env;
  Batch const b = make_batch(env, 64, 2);
  int const p = 4, m = 8;
  mgpu::DeviceGroup group("host:4");
  auto peak = [&](pp::Schedule const& s, Batch const& batch) {
    pp::Executor ex(model, group, {0, 2, 3, 4, 5}, s, sgd());
    ex.compute_gradients(batch.x, batch.y);  // warm up
    std::size_t const before = group.allocator(0).stats().allocated;
    group.allocator(0).reset_peak();
    ex.compute_gradients(batch.x, batch.y);
    return static_cast<double>(group.allocator(0).stats().peak_allocated - before);
  };
  // One micro-batch alone: its [8, 512] activation, the buffer its gradient comes back in, and
  // the backward's scratch.
  double const single = peak(pp::gpipe(p, 1), make_batch(env, 8, 2));
  double const activation = 8.0 * 512 * 4;
  double const gpipe = peak(pp::gpipe(p, m), b);
  double const ofob = peak(pp::one_f_one_b(p, m), b);
  double const beside = single - activation;  // what a step needs beside the saved activations
  CAPTURE(single, gpipe, ofob);
  CHECK(gpipe - beside >= m * activation);               // every micro-batch's activation at once
  CHECK(ofob <= p * single);                             // at most P micro-batches in flight
  CHECK(gpipe - beside >= 1.8 * (ofob - beside));        // about M / P = 2
}

TEST_CASE("every action of a step is on the timeline, in each device's schedule order", "[parallel][pipeline]") {
  Env env;
  Batch const b = make_batch(env, 12, 4);
  mgpu::DeviceGroup group("host:3");
  auto timeline = std::make_shared<mgpu::trace::Timeline>();
  pp::Schedule const s = pp::zero_bubble_h1(3, 4);
  pp::Executor ex(make_model(), group, even_cuts(make_model(), 3), s, sgd(), {.timeline = timeline});
  timeline->enable();
  ex.compute_gradients(b.x, b.y);
  timeline->enable(false);
  for (int d = 0; d < 3; ++d) {
    CAPTURE(d);
    std::vector<std::string> want, got;
    for (pp::Action const& a : s.actions[static_cast<std::size_t>(d)])
      if (!pp::is_transfer(a.kind)) want.push_back(pp::to_string(a));
    std::size_t transfers = 0;
    for (mgpu::trace::Span const& span : timeline->spans()) {
      if (span.rank != d) continue;
      CHECK(span.category == "pipeline");
      CHECK(span.end_ns >= span.begin_ns);
      if (span.lane == mgpu::trace::compute) got.push_back(span.name);
      if (span.lane == mgpu::trace::communication) ++transfers;
    }
    CHECK(got == want);  // spans() is ordered by begin time: the stream ran them in schedule order
    CHECK(transfers > 0);
  }
}

TEST_CASE("bad labels are refused before any action, and the executor goes on", "[parallel][pipeline]") {
  Env env;
  mgpu::DeviceGroup group("host:2");
  pp::Schedule const s = pp::one_f_one_b(2, 4);
  pp::Executor ex(make_model(), group, {0, 8, 14}, s, sgd(), {.seed = 3});
  Batch const b = make_batch(env, 8, 7);
  for (float bad : {3.0f, -1.0f, 1.5f, std::nanf("")}) {
    INFO("label " << bad);
    Tensor y = Tensor::empty({8}, mgpu::DType::float32, *env.allocator);
    std::copy(b.y.host_span<float>().begin(), b.y.host_span<float>().end(), y.host_span<float>().begin());
    y.host_span<float>()[5] = bad;
    REQUIRE_MGPU_ERROR(ex.step(b.x, y), mgpu::Errc::invalid_argument, "pipeline batch: label " + std::to_string(bad) + " at row 5 (expected a class id in [0, 3))");
  }
  REQUIRE_MGPU_ERROR(ex.step(b.x, b.y.reshape({8, 1})), mgpu::Errc::invalid_argument, "pipeline batch: labels of shape [8, 1] for 8 rows");
  Tensor const narrow = env.random({8, 5}, 4);
  REQUIRE_MGPU_ERROR(ex.step(narrow, b.y), mgpu::Errc::invalid_argument, "pipeline batch: x of shape [8, 5]: Linear(6, 12)");
  REQUIRE_MGPU_ERROR(ex.step(b.x, b.y, std::nanf("")), mgpu::Errc::invalid_argument, "lr_scale nan (expected a finite lr_scale >= 0)");
  ex.step(b.x, b.y);
  mgpu::DeviceGroup other("host:2");
  pp::Executor fresh(make_model(), other, {0, 8, 14}, s, sgd(), {.seed = 3});
  fresh.step(b.x, b.y);
  CHECK(gathered(ex, Buffer::masters) == gathered(fresh, Buffer::masters));
}

TEST_CASE("an optimizer factory that makes no optimizer is refused", "[parallel][pipeline]") {
  mgpu::DeviceGroup group("host:2");
  REQUIRE_MGPU_ERROR(pp::Executor(make_model(), group, {0, 8, 14}, pp::one_f_one_b(2, 4), [] { return std::unique_ptr<mgpu::optim::Optimizer>(); }),
                     mgpu::Errc::invalid_argument, "returned no optimizer for chunk 0 of replica 0");
}
