// A tensor-parallel executor's timeline: with DP 2 x TP 2 and sequence parallelism every rank
// records its forward, each layer's backward, the token parts' all-reduces, the replicas' all-reduce of the gradient bucket and
// the commit point's barrier, each on its lane and in order within the step; tracing changes no
// loss (the untraced run's, bit for bit).
#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <mgpu/core/device_group.hpp>
#include <mgpu/nn/gpt.hpp>
#include <mgpu/parallel/tensor_parallel.hpp>
#include <mgpu/trace/timeline.hpp>

#include "support/catch.hpp"
#include "support/nn_env.hpp"

namespace nn = mgpu::nn;
namespace par = mgpu::parallel;
namespace trace = mgpu::trace;

TEST_CASE("a DP 2 x TP 2 sequence-parallel step records every rank's compute and collectives, changing no loss",
          "[parallel][tensor][trace]") {
  nn::GptConfig const config{.vocab = 64, .block_size = 16, .n_layer = 2, .n_head = 4, .n_embd = 32};
  mgpu::test::Env env;
  std::vector<mgpu::test::TokenBatch> const batches = mgpu::test::rule_batches(env, 3, 4, config, 300);
  std::vector<double> plain;  // untraced
  {
    mgpu::DeviceGroup group("host:4");
    par::TensorParallel tp(group, nn::gpt(config), {.seed = 3, .clip_norm = 0.5f, .data_parallel = 2, .sequence_parallel = true});
    for (auto const& b : batches) plain.push_back(tp.step(b.ids, b.targets).loss);
  }
  auto const timeline = std::make_shared<trace::Timeline>();
  mgpu::DeviceGroup group("host:4");
  par::TensorParallel tp(group, nn::gpt(config),
                         {.seed = 3, .clip_norm = 0.5f, .data_parallel = 2, .sequence_parallel = true, .timeline = timeline});
  std::vector<double> traced;
  for (std::size_t s = 0; s < batches.size(); ++s) {
    if (s + 1 == batches.size()) timeline->enable();  // the last step only
    traced.push_back(tp.step(batches[s].ids, batches[s].targets).loss);
  }
  CHECK(traced == plain);

  // Per rank: the spans of each kind, on the lane they belong to.
  struct Seen {
    int forward = 0, backward = 0, token_parts = 0, replicas = 0, barrier = 0;
    std::int64_t forward_end = 0, first_backward = -1, barrier_begin = -1, last_reduce_end = 0;
  };
  std::map<int, Seen> seen;
  for (trace::Span const& span : timeline->spans()) {
    Seen& s = seen[span.rank];
    CHECK(span.begin_ns <= span.end_ns);
    if (span.name == "forward") {
      CHECK(span.lane == trace::compute);
      ++s.forward;
      s.forward_end = span.end_ns;
    } else if (span.name.starts_with("backward ")) {
      CHECK(span.lane == trace::compute);
      ++s.backward;
      if (s.first_backward < 0) s.first_backward = span.begin_ns;
    } else if (span.name.starts_with("all_reduce(") || span.name.starts_with("all-reduce bucket ")) {
      CHECK(span.lane == trace::communication);
      CHECK(span.category == "communication");
      (span.name.ends_with(" token parts)") ? s.token_parts : s.replicas) += 1;
      s.last_reduce_end = std::max(s.last_reduce_end, span.end_ns);
    } else if (span.name == "barrier (commit point)") {
      CHECK(span.lane == trace::communication);
      ++s.barrier;
      s.barrier_begin = span.begin_ns;
    }
  }
  REQUIRE(seen.size() == 4);
  for (auto const& [rank, s] : seen) {
    CAPTURE(rank);
    CHECK(s.forward == 1);
    CHECK(s.backward >= config.n_layer + 2);  // blocks, final LayerNorm, head, embedding
    // Sequence parallelism: each block's LayerNorms and the final LayerNorm sum their token parts.
    CHECK(s.token_parts == config.n_layer + 1);
    CHECK(s.replicas == 1);  // the gradient bucket (the shard fits the first one's 1 MiB), over the 2 replicas
    CHECK(s.barrier == 1);
    CHECK(s.forward_end <= s.first_backward);  // in order on the rank's stream
    CHECK(s.last_reduce_end <= s.barrier_begin);
  }
}
