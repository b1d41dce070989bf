// A step that fails inside its device work is reported as its cause, never as the communication
// errors it causes on the other devices, and changes nothing: weights, optimizer state and step
// count, dropout's RNG and the loss scaler are as before it, the communicators are made anew, and
// the executor goes on exactly as a twin that never saw the step. The failure here is real: the
// last device's memory is limited so that a batch 16 times larger runs out of it mid-step.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <mgpu/core/error.hpp>
#include <mgpu/core/memory.hpp>

#include "support/catch.hpp"
#include "support/gpt_layouts.hpp"
#include "support/nn_env.hpp"

namespace layouts = mgpu::test::layouts;

namespace {

// Every layout of `family`: a step that runs out of memory on the last device is reported as
// out_of_memory, and the executor then follows a twin that never saw it.
void check_out_of_memory(std::string const& family) {
  mgpu::test::Env env;
  std::int64_t const rows = 4;
  std::vector<mgpu::test::TokenBatch> batches;
  for (unsigned s = 0; s < 4; ++s)
    batches.push_back(mgpu::test::rule_batch(env, rows, layouts::config.block_size, layouts::config.vocab, 80 + s));
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
