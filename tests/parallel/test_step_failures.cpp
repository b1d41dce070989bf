// A step that fails inside its device work is reported as its cause, never as the communication
// errors it causes on the other devices, and changes nothing: weights, optimizer state and step
// count, dropout's RNG and the loss scaler are as before it, the communicators are made anew, and
// the executor goes on exactly as a twin that never saw the step. The failure here is real: the
// last device's memory is limited so that a batch 16 times larger runs out of it mid-step.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <mgpu/core/error.hpp>
#include <mgpu/core/memory.hpp>

#include "support/catch.hpp"
#include "support/expect_error.hpp"
#include "support/gpt_layouts.hpp"
#include "support/nn_env.hpp"

namespace layouts = mgpu::test::layouts;

namespace {

// Every layout of `family`: a step that runs out of memory on the last device is reported as
// out_of_memory, and the executor then follows a twin that never saw it.
void check_out_of_memory(std::string const& family) {
  mgpu::test::Env env;
  std::int64_t const rows = 4;
  std::vector<mgpu::test::TokenBatch> const batches = mgpu::test::rule_batches(env, 4, rows, layouts::config, 80);
  mgpu::test::TokenBatch const big = mgpu::test::rule_batch(env, 16 * rows, layouts::config.block_size, layouts::config.vocab, 99);
  std::vector<layouts::Layout> const chosen = layouts::of(family);
  REQUIRE(!chosen.empty());
  for (layouts::Layout const& layout : chosen) {
    INFO(layout.name);
    layouts::Trainer const twin = layout.make();
    layouts::Trainer const trainer = layout.make();
    CHECK(trainer.step(batches[0].ids, batches[0].targets, 1.0f) == twin.step(batches[0].ids, batches[0].targets, 1.0f));
    // Room for the batch's own rows (the executors copy them first), not for its activations.
    trainer.last->set_limit(trainer.last->stats().reserved + (std::size_t{64} << 10));
    try {
      (void)trainer.step(big.ids, big.targets, 1.0f);
      FAIL("expected the step to run out of memory");
    } catch (mgpu::Error const& e) {
      std::string const message = e.what();
      CAPTURE(message);
      CHECK(e.category() == mgpu::Errc::out_of_memory);
    }
    trainer.last->set_limit(std::nullopt);
    for (std::size_t s = 1; s < batches.size(); ++s) {
      CAPTURE(s);
      CHECK(trainer.step(batches[s].ids, batches[s].targets, 1.0f) == twin.step(batches[s].ids, batches[s].targets, 1.0f));
    }
  }
}

}  // namespace

TEST_CASE("one device: a step out of memory is reported as itself, changes nothing, and training goes on", "[failures]") {
  check_out_of_memory("one device");
}

namespace {
// The identity, but while `armed` its forward's work fails on the stream (after train_step has
// returned: the error shows at the next synchronize).
class FailsOnStream final : public mgpu::nn::Layer {
 public:
  explicit FailsOnStream(std::shared_ptr<bool> armed) : armed_(std::move(armed)) {}
  std::string name() const override { return "FailsOnStream"; }
  mgpu::Tensor forward(mgpu::Tensor const& x, mgpu::nn::Context& ctx) override {
    if (*armed_) ctx.stream.enqueue([] { throw mgpu::Error(mgpu::Errc::device, "FailsOnStream: the work failed"); });
    return x;
  }
  mgpu::Tensor backward(mgpu::Tensor const& dy, mgpu::nn::Context&) override { return dy; }
  std::unique_ptr<mgpu::nn::Layer> clone() const override { return std::make_unique<FailsOnStream>(armed_); }

 private:
  std::shared_ptr<bool> armed_;
};
}  // namespace

TEST_CASE("one device: a step whose work fails after train_step returned is put back at the next call", "[failures]") {
  mgpu::test::Env env;
  std::vector<mgpu::test::TokenBatch> const batches = mgpu::test::rule_batches(env, 5, 4, layouts::config, 120);
  auto const armed = std::make_shared<bool>(false);
  auto const make = [&] {
    mgpu::nn::Sequential const gpt = mgpu::nn::gpt(layouts::config);
    mgpu::nn::Sequential model;
    for (std::size_t l = 0; l < gpt.size(); ++l) {
      model.add(gpt.layer(l).clone());
      if (l == 1) model.add(std::make_unique<FailsOnStream>(armed));  // after the embedding's dropout
    }
    model.materialize(env.ctx, layouts::seed);
    return model;
  };
  mgpu::nn::Sequential model = make(), twin = make();
  mgpu::optim::AdamW opt(layouts::adamw), twin_opt(layouts::adamw);
  mgpu::nn::TokenCrossEntropy const loss;
  auto const step = [&](mgpu::nn::Sequential& m, mgpu::optim::AdamW& o, std::size_t b) {
    return mgpu::nn::train_step(m, o, batches[b].ids, batches[b].targets, loss, env.ctx).loss;
  };
  CHECK(mgpu::ops::item(step(model, opt, 0), env.stream) == mgpu::ops::item(step(twin, twin_opt, 0), env.stream));
  // Read at once: the error shows at item(), and the next call puts the step back.
  *armed = true;
  mgpu::Tensor const failed = step(model, opt, 1);
  *armed = false;
  REQUIRE_MGPU_ERROR((void)mgpu::ops::item(failed, env.stream), mgpu::Errc::device, "FailsOnStream: the work failed");
  CHECK(mgpu::ops::item(step(model, opt, 2), env.stream) == mgpu::ops::item(step(twin, twin_opt, 2), env.stream));
  // Not read: the next call reports it, having put the step back, and runs nothing itself.
  *armed = true;
  (void)step(model, opt, 3);
  *armed = false;
  REQUIRE_MGPU_ERROR((void)step(model, opt, 4), mgpu::Errc::device, "FailsOnStream: the work failed");
  CHECK(opt.steps() == twin_opt.steps());
  CHECK(mgpu::ops::item(step(model, opt, 4), env.stream) == mgpu::ops::item(step(twin, twin_opt, 4), env.stream));
  CHECK(opt.steps() == twin_opt.steps());
}
TEST_CASE("data parallel: a step out of device memory inside is reported as itself, changes nothing, and the executor goes on",
          "[parallel][failures]") {
  check_out_of_memory("data parallel");
}
TEST_CASE("every pipeline schedule: a step out of device memory inside is reported as itself, changes nothing, and the "
          "executor goes on",
          "[pipeline][failures]") {
  check_out_of_memory("pipeline");
}
TEST_CASE("tensor parallelism: a step out of device memory inside is reported as itself, changes nothing, and the executor "
          "goes on",
          "[tp][failures]") {
  check_out_of_memory("tensor");
}
