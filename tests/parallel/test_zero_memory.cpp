// DataParallel's ZeRO stages' memory, each device's bytes counted by its allocator: stage 1 keeps the
// optimizer state of its owned elements (counted from the bucket layout) only, stage 2 its owned
// gradients and the staging buffers, stage 3 1/N of the replicated run's parameters, gradients and
// optimizer state plus the units it gathers; and stage 3's gather schedule and prefetch on the
// communication lanes.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <mgpu/core/device_group.hpp>
#include <mgpu/core/memory.hpp>
#include <mgpu/nn/gpt.hpp>
#include <mgpu/nn/loss.hpp>
#include <mgpu/optim/optim.hpp>
#include <mgpu/parallel/data_parallel.hpp>
#include <mgpu/trace/timeline.hpp>

#include "support/catch.hpp"
#include "support/nn_env.hpp"
#include "support/zero_fixture.hpp"

using mgpu::Tensor;
namespace nn = mgpu::nn;
using namespace mgpu::test::zero;

namespace {

// The memory tests' GPT: six blocks of one bucket each, so that the staging buffers are a
// fraction of the gradients; and the allocator's bytes for a float32 tensor of `elements`.
nn::GptConfig const deep{.vocab = 64, .block_size = 16, .n_layer = 6, .n_head = 2, .n_embd = 32};
std::size_t block(std::int64_t elements) { return mgpu::Allocator::block_size(static_cast<std::size_t>(elements) * sizeof(float)); }

// A GPT data parallel at `stage` with a gradient bucket per block (the memory tests' run).
DataParallel bucket_per_block(nn::GptConfig const& config, mgpu::DeviceGroup& group, int stage) {
  DataParallelOptions options;
  options.zero_stage = stage;
  options.clip_norm = clip;
  options.loss = std::make_shared<nn::TokenCrossEntropy const>();
  options.first_bucket_cap_bytes = 4096;
  options.bucket_cap_bytes = 8192;
  return DataParallel(nn::gpt(config), group, mgpu::optim::AdamW({.decay_ranges = nn::gpt_decay_ranges(config)}), options);
}

// Elements of the flat buffers whose optimizer state `rank` of `n` keeps at zero_stage 1: its
// block of each bucket, and the elements past the blocks (or a whole bucket smaller than n), which
// every rank updates.
std::int64_t owned_elements(std::vector<mgpu::parallel::Bucket> const& buckets, int n) {
  std::int64_t owned = 0;
  for (auto const& b : buckets) {
    std::int64_t const block = b.size() / n;
    owned += block > 0 ? block + (b.size() - block * n) : b.size();
  }
  return owned;
}

}  // namespace

TEST_CASE("zero_stage 1 keeps on each device the optimizer state of its owned elements only", "[parallel][dp][zero]") {
  Env env;
  mgpu::test::TokenBatch const b = mgpu::test::rule_batch(env, batch, config.block_size, config.vocab, 7);
  std::int64_t const parameters = nn::gpt(config).parameter_count();
  for (int const devices : {2, 3, 4}) {
    for (int const stage : {0, 1}) {
      CAPTURE(devices, stage);
      mgpu::DeviceGroup group("host:" + std::to_string(devices));
      DataParallel dp(nn::gpt(config), group, gpt_adamw(), gpt_options(stage));
      group.synchronize();
      std::vector<std::size_t> before;
      for (int r = 0; r < devices; ++r) before.push_back(group.allocator(r).stats().allocated);
      for (int s = 0; s < 2; ++s) dp.step(b.ids, b.targets);
      group.synchronize();
      // What a device holds after the steps beyond the replica and its gradients: AdamW's m and v.
      std::int64_t const kept = stage == 0 ? parameters : owned_elements(dp.buckets(), devices);
      std::size_t const expected = 2 * mgpu::Allocator::block_size(static_cast<std::size_t>(kept) * sizeof(float));
      for (int r = 0; r < devices; ++r) {
        CAPTURE(r);
        std::size_t const held = group.allocator(r).stats().allocated - before[static_cast<std::size_t>(r)];
        CHECK(held == expected);
        if (stage == 1) {  // about 1/N: the elements past the blocks are fewer than the ranks per bucket
          std::size_t const leftovers = dp.buckets().size() * static_cast<std::size_t>(devices) * 2 * sizeof(float);
          CHECK(held <= 2 * mgpu::Allocator::block_size(static_cast<std::size_t>(parameters) * sizeof(float)) /
                                static_cast<std::size_t>(devices) +
                            leftovers + 2 * 4096);
        }
      }
    }
  }
}

// Each device's bytes, counted by its allocator after two steps: stage 2 holds, in place of the
// whole gradient buffer, its owned elements' gradients and the two staging buffers shared by the
// buckets but the last (the last bucket's own has memory only from backward's start to its
// reduce): about 1/N of the gradients plus those.
// Six blocks of one bucket each, so that the staging buffers are a fraction of the gradients.
TEST_CASE("zero_stage 2 keeps on each device the gradients of its owned elements and the staging buffers only",
          "[parallel][dp][zero][gpt]") {
  Env env;
  mgpu::test::TokenBatch const b = mgpu::test::rule_batch(env, batch, deep.block_size, deep.vocab, 7);
  std::int64_t const parameters = nn::gpt(deep).parameter_count();
  for (int const devices : {2, 3, 4}) {
    std::vector<std::vector<std::size_t>> held(3);
    std::vector<mgpu::parallel::Bucket> buckets;
    for (int const stage : {1, 2}) {
      CAPTURE(devices, stage);
      mgpu::DeviceGroup group("host:" + std::to_string(devices));
      DataParallel dp = bucket_per_block(deep, group, stage);
      for (int s = 0; s < 2; ++s) dp.step(b.ids, b.targets);
      dp.group().synchronize();  // host streams' queued work holds tensors until it has run
      buckets = dp.buckets();
      for (int r = 0; r < devices; ++r) held[static_cast<std::size_t>(stage)].push_back(group.allocator(r).stats().allocated);
    }
    REQUIRE(buckets.size() == 8);  // the final LayerNorm, six blocks, the embeddings
    std::int64_t const owned = owned_elements(buckets, devices);
    std::int64_t staging = 0;
    for (std::size_t i = 0; i + 1 < buckets.size(); ++i) staging = std::max(staging, buckets[i].size());
    std::size_t const stage2_grads = block(owned) + 2 * block(staging);
    // The elements past the blocks are fewer than the ranks per bucket.
    std::size_t const leftovers = buckets.size() * static_cast<std::size_t>(devices) * sizeof(float) + 4096;
    CHECK(block(owned) <= block(parameters) / static_cast<std::size_t>(devices) + leftovers);
    for (int r = 0; r < devices; ++r) {
      CAPTURE(devices, r);
      auto const i = static_cast<std::size_t>(r);
      CHECK(held[1][i] + stage2_grads == held[2][i] + block(parameters));  // one gradient layout for the other
      CHECK(held[2][i] < held[1][i]);
    }
  }
}

// Each device's bytes counted by its allocator. Held after a step (parameters, gradients and
// optimizer state: what the steps keep), stage 3 holds, in place of stage 2's whole parameter
// buffer and its two shared staging buffers, its owned elements' parameters and the last bucket's
// gathered parameters (the other buckets' memory has gone back): exactly that. Against the
// replicated run (stage 0): at most 1/N of its bytes plus the last bucket's parameters and
// gradients, plus the elements past the blocks. The peak over the steps (after construction, which
// holds the whole model before sharding it) adds to that no more than the replicated run's peak
// adds to its own (the activations) plus the units gathered meanwhile: two buckets' parameters and
// two buckets' gradients.
TEST_CASE("zero_stage 3 keeps on each device 1/N of the replicated run's parameters, gradients and optimizer state plus the "
          "gathered buckets",
          "[parallel][dp][zero][gpt]") {
  Env env;
  mgpu::test::TokenBatch const b = mgpu::test::rule_batch(env, batch, deep.block_size, deep.vocab, 7);
  std::int64_t const parameters = nn::gpt(deep).parameter_count();
  for (int const devices : {2, 3, 4}) {
    std::vector<std::vector<std::size_t>> held(4), peak(4);
    std::vector<mgpu::parallel::Bucket> buckets;
    for (int const stage : {0, 2, 3}) {
      CAPTURE(devices, stage);
      mgpu::DeviceGroup group("host:" + std::to_string(devices));
      DataParallel dp = bucket_per_block(deep, group, stage);
      for (int r = 0; r < devices; ++r) group.allocator(r).reset_peak();
      std::vector<float> losses;
      for (int s = 0; s < 3; ++s) losses.push_back(dp.step(b.ids, b.targets).loss);
      dp.group().synchronize();  // host streams' queued work holds tensors until it has run
      buckets = dp.buckets();
      for (int r = 0; r < devices; ++r) {
        held[static_cast<std::size_t>(stage)].push_back(group.allocator(r).stats().allocated);
        peak[static_cast<std::size_t>(stage)].push_back(group.allocator(r).stats().peak_allocated);
      }
      CHECK(losses.back() < losses.front());
    }
    REQUIRE(buckets.size() == 8);  // the final LayerNorm, six blocks, the embeddings
    std::int64_t const owned = owned_elements(buckets, devices);
    std::int64_t shared = 0;
    for (std::size_t i = 0; i + 1 < buckets.size(); ++i) shared = std::max(shared, buckets[i].size());
    std::size_t const last = block(buckets.back().size());  // its gathered parameters, or its gradients' staging
    std::size_t const leftovers = 4 * (buckets.size() * static_cast<std::size_t>(devices) * sizeof(float) + 4096);
    for (int r = 0; r < devices; ++r) {
      CAPTURE(devices, r);
      auto const i = static_cast<std::size_t>(r);
      WARN("device " << r << " of " << devices << ": held " << held[0][i] << " (stage 0), " << held[2][i] << " (stage 2), " << held[3][i]
                     << " (stage 3); peak " << peak[0][i] << ", " << peak[2][i] << ", " << peak[3][i]);
      CHECK(held[3][i] + block(parameters) + 2 * block(shared) == held[2][i] + block(owned) + last);  // one layout for the other
      CHECK(held[3][i] <= held[0][i] / static_cast<std::size_t>(devices) + 2 * last + leftovers);
      CHECK(peak[3][i] - held[3][i] <= peak[0][i] - held[0][i] + 4 * block(shared));
      CHECK(held[3][i] < held[2][i]);
    }
  }
}

// The gather schedule, on each rank's communication lane in stream order: forward gathers every
// bucket once, first layers first (the last bucket and the one before it at layer 0, then each
// bucket before the one forward enters is prefetched); backward gathers only buckets 2 to B - 2
// again (0 and 1, the last forward ran, and the last bucket are still in their buffers), each
// after the bucket before it has been reduce-scattered; no all-gather of updated buckets (stage
// 1's) runs, the next forward gathers the owned parameters as they are.
TEST_CASE("zero_stage 3 gathers each bucket's parameters before forward reaches it, and buckets 2 to B - 2 again in backward",
          "[parallel][dp][zero][trace]") {
  Env env;
  mgpu::test::TokenBatch const b = mgpu::test::rule_batch(env, batch, deep.block_size, deep.vocab, 7);
  mgpu::DeviceGroup group("host:2");
  auto timeline = std::make_shared<mgpu::trace::Timeline>();
  DataParallelOptions options;
  options.zero_stage = 3;
  options.loss = std::make_shared<nn::TokenCrossEntropy const>();
  options.first_bucket_cap_bytes = 4096;
  options.bucket_cap_bytes = 8192;
  options.timeline = timeline;
  DataParallel dp(nn::gpt(deep), group, mgpu::optim::AdamW({.decay_ranges = nn::gpt_decay_ranges(deep)}), options);
  REQUIRE(dp.buckets().size() == 8);
  timeline->enable();
  dp.step(b.ids, b.targets);
  dp.group().synchronize();
  for (int rank = 0; rank < 2; ++rank) {
    CAPTURE(rank);
    std::vector<mgpu::trace::Span> spans;
    for (auto const& span : timeline->spans())
      if (span.rank == rank && span.lane == mgpu::trace::Lane::communication) spans.push_back(span);
    std::sort(spans.begin(), spans.end(), [](auto const& x, auto const& y) { return x.begin_ns < y.begin_ns; });
    std::vector<std::string> names;
    for (auto const& span : spans)
      if (span.name.find("gather") != std::string::npos || span.name.find("reduce") != std::string::npos) names.push_back(span.name);
    std::vector<std::string> want;
    for (int bucket = 7; bucket >= 0; --bucket) want.push_back("all-gather parameters bucket " + std::to_string(bucket));
    want.push_back("reduce-scatter bucket 0");
    for (int bucket = 1; bucket < 8; ++bucket) {
      if (bucket + 1 <= 6) want.push_back("all-gather parameters bucket " + std::to_string(bucket + 1));  // prefetched on entering
      want.push_back("reduce-scatter bucket " + std::to_string(bucket));
    }
    CHECK(names == want);
  }
}

// The prefetch: backward gathers bucket b + 1 as it enters bucket b, so the gather runs on the
// communication stream while bucket b's layer computes. Emulated at a tenth of the host's speed,
// compute is mostly sleep, so the communication workers get a core however loaded the machine is;
// bucket 2's layer is the widest, so its backward is long beside the other rank's lag.
TEST_CASE("zero_stage 3's backward gathers the next bucket's parameters while the current bucket computes",
          "[parallel][dp][zero][trace]") {
  Env env;
  Tensor x = env.random({64, 64}, 9);
  Tensor y = env.make({64}, std::vector<float>(64, 1.0f));
  mgpu::DeviceGroup group{"host:2@speed=0.1"};
  auto timeline = std::make_shared<mgpu::trace::Timeline>();
  DataParallelOptions options;
  options.zero_stage = 3;
  options.timeline = timeline;
  options.first_bucket_cap_bytes = 64;  // a bucket per Linear
  options.bucket_cap_bytes = 64;
  DataParallel dp(nn::Sequential::mlp({64, 128, 1024, 1024, 16, 10}), group, mgpu::optim::SGD({.lr = 0.01f}), options);
  REQUIRE(dp.buckets().size() == 5);  // buckets 2 and 3 are gathered again in backward
  timeline->enable();
  dp.step(x, y);
  dp.step(x, y);
  dp.group().synchronize();
  auto const spans = timeline->spans();
  bool overlapped = false;
  for (auto const& gather : spans) {
    if (gather.name != "all-gather parameters bucket 3") continue;
    for (auto const& bwd : spans)  // bucket 2 is Linear(1024, 1024)
      if (bwd.rank == gather.rank && bwd.name == "backward Linear(1024, 1024)" && gather.begin_ns < bwd.end_ns &&
          gather.end_ns > bwd.begin_ns)
        overlapped = true;
  }
  if (!overlapped) {
    for (auto const& s : spans) UNSCOPED_INFO(s.rank << " " << s.lane << " " << s.name << " " << s.begin_ns / 1000 << " " << s.end_ns / 1000);
  }
  CHECK(overlapped);
}

// With default options each stage peaks (its allocator's peak bytes over two steps after the
// first) no higher than the stage before it, on 6 blocks (float32 and bfloat16) and on a model
// that its tied embedding dominates (one block, vocab 1024, C 16: one unit holds most parameters),
// where stage 3 peaks above stage 2, below stage 1: the owned parameters (1/N) come on top of the
// whole embedding unit, which the LM head's backward reads at the peak, where stage 2 holds the
// whole parameter buffer only. There, in bfloat16, stage 2 peaks above stage 1 too: in the
// block's backward it holds the embedding's float32 staging and the owned gradients (1/N)
// together, more than stage 1's whole gradients. Stages 2 and 3 reduce a block at a time by default, hold the owned gradients
// from a step's first reduce to the next step, and the last bucket's staging from backward's start
// to its reduce only. Each stage peaks no higher in bfloat16 than in float32: below stage 3 the
// layers write their 16-bit gradients a unit at a time, not into a whole 16-bit copy.
TEST_CASE("With default options zero_stage 3 peaks no higher than 2, and 2 no higher than 1", "[parallel][dp][zero][gpt]") {
  Env env;
  nn::GptConfig const embedding{.vocab = 1024, .block_size = 16, .n_layer = 1, .n_head = 2, .n_embd = 16};
  struct Case {
    nn::GptConfig model;
    mgpu::DType compute;
    bool three_below_two, two_below_one;
  };
  std::vector<std::vector<std::size_t>> peaks;
  for (Case const& c : {Case{deep, mgpu::DType::float32, true, true}, Case{deep, mgpu::DType::bfloat16, true, true},
                        Case{embedding, mgpu::DType::float32, false, true}, Case{embedding, mgpu::DType::bfloat16, false, false}}) {
    CAPTURE(c.model.vocab, c.model.n_layer, mgpu::to_string(c.compute));
    mgpu::test::TokenBatch const b = mgpu::test::rule_batch(env, 4, c.model.block_size, c.model.vocab, 11);
    std::vector<std::size_t> peak;
    for (int const stage : {1, 2, 3}) {
      mgpu::DeviceGroup group("host:2");
      DataParallelOptions options;
      options.zero_stage = stage;
      options.compute = c.compute;
      options.loss = std::make_shared<nn::TokenCrossEntropy const>();
      DataParallel dp(nn::gpt(c.model), group, mgpu::optim::AdamW({.decay_ranges = nn::gpt_decay_ranges(c.model)}), options);
      dp.step(b.ids, b.targets);  // the first step also lays out the sharded state
      dp.group().synchronize();
      for (int r = 0; r < 2; ++r) group.allocator(r).reset_peak();
      for (int s = 0; s < 2; ++s) dp.step(b.ids, b.targets);
      dp.group().synchronize();
      peak.push_back(std::max(group.allocator(0).stats().peak_allocated, group.allocator(1).stats().peak_allocated));
    }
    WARN("peak bytes at stages 1, 2, 3: " << peak[0] << ", " << peak[1] << ", " << peak[2]);
    if (c.two_below_one) CHECK(peak[1] <= peak[0]);
    CHECK(peak[2] <= peak[0]);
    if (c.three_below_two) CHECK(peak[2] <= peak[1]);
    peaks.push_back(peak);
  }
  for (std::size_t stage = 0; stage < 3; ++stage) {  // bfloat16 (cases 1 and 3) against float32 (0 and 2)
    CAPTURE(stage + 1);
    CHECK(peaks[1][stage] <= peaks[0][stage]);
    CHECK(peaks[3][stage] <= peaks[2][stage]);
  }
}
