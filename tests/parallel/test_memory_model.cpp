// parallel::predict_gpt_memory: its parameter bytes against the shards the executors really make,
// its split of the rows and micro-batches, a one-stage pipeline against one device, any schedule's
// passes against the closed forms, 16-bit activations, and its refusals. The whole prediction against the allocator's measured
// peaks in every layout is tests/examples/memory_model_check.sh (through train_gpt).
#include <mgpu/parallel/memory_model.hpp>

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include <mgpu/comm/communicator.hpp>
#include <mgpu/core/device_group.hpp>
#include <mgpu/core/memory.hpp>
#include <mgpu/nn/gpt.hpp>
#include <mgpu/parallel/tensor_parallel.hpp>
#include <mgpu/pipeline/pipeline.hpp>

#include "support/catch.hpp"
#include "support/expect_error.hpp"

namespace par = mgpu::parallel;

namespace {
// 12 heads split 1, 2, 3 and 4 ways; vocab 67 splits unevenly.
mgpu::nn::GptConfig const config{.vocab = 67, .block_size = 8, .n_layer = 2, .n_head = 12, .n_embd = 48};

std::size_t float_bytes(std::int64_t values) { return mgpu::Allocator::block_size(static_cast<std::size_t>(values) * sizeof(float)); }
}  // namespace

TEST_CASE("predicted parameter bytes are those of the model and of every tensor-parallel shard", "[parallel][memory]") {
  std::vector<par::GptMemory> const one = par::predict_gpt_memory(config, 4, {});
  REQUIRE(one.size() == 1);
  CHECK(one[0].parameters == float_bytes(mgpu::nn::gpt(config).parameter_count()));
  CHECK(one[0].gradients == one[0].parameters);
  CHECK(one[0].optimizer == 2 * one[0].parameters);  // AdamW's m and v
  for (int ranks : {2, 3, 4}) {
    mgpu::DeviceGroup group("host:" + std::to_string(ranks));
    par::TensorParallel tp(group, mgpu::nn::gpt(config), {.seed = 1});
    std::vector<par::GptMemory> const predicted = par::predict_gpt_memory(config, 4, {.tensor_parallel = ranks});
    REQUIRE(predicted.size() == static_cast<std::size_t>(ranks));
    for (int r = 0; r < ranks; ++r) {
      INFO("rank " << r << " of " << ranks);
      CHECK(predicted[static_cast<std::size_t>(r)].parameters == float_bytes(tp.shard(r).parameter_count()));
      CHECK(predicted[static_cast<std::size_t>(r)].optimizer == 2 * predicted[static_cast<std::size_t>(r)].parameters);
    }
  }
}

TEST_CASE("predicted memory splits the rows over the replicas and the optimizer state with ZeRO-1", "[parallel][memory]") {
  // 8 rows over 3 replicas: 3, 3, 2.
  std::vector<par::GptMemory> const dp = par::predict_gpt_memory(config, 8, {.data_parallel = 3, .zero_stage = 1});
  REQUIRE(dp.size() == 3);
  CHECK(dp[0].activations == dp[1].activations);
  CHECK(dp[2].activations < dp[0].activations);
  std::vector<par::GptMemory> const replicated = par::predict_gpt_memory(config, 8, {.data_parallel = 3, .zero_stage = 0});
  CHECK(replicated[0].optimizer == 2 * replicated[0].parameters);
  // ZeRO-2 keeps the owned gradients and the staging buffers (a block each: a bucket per block) instead
  // of the whole gradient buffer: less with 8 blocks over 3 ranks.
  mgpu::nn::GptConfig deep = config;
  deep.n_layer = 8;
  std::int64_t const block = 12 * deep.n_embd * deep.n_embd + 13 * deep.n_embd;
  std::int64_t const whole = mgpu::nn::gpt(deep).parameter_count();
  std::vector<par::GptMemory> const zero2 = par::predict_gpt_memory(deep, 8, {.data_parallel = 3, .zero_stage = 2,
                                                                                 .bucket_cap_bytes = 16 << 10,
                                                                                 .first_bucket_cap_bytes = 16 << 10});
  CHECK(zero2[0].gradients < float_bytes(whole));
  CHECK(zero2[0].gradients >= float_bytes(whole / 3) + 2 * float_bytes(block));
  CHECK(zero2[0].optimizer == par::predict_gpt_memory(deep, 8, {.data_parallel = 3, .zero_stage = 1, .bucket_cap_bytes = 16 << 10,
                                                                 .first_bucket_cap_bytes = 16 << 10})[0].optimizer);
  // ZeRO-3 keeps the owned parameters and the buffers they are gathered into, the same sizes as
  // ZeRO-2's gradients, in place of the whole parameter buffer, and of the gradients' staging one
  // block's (the block whose backward runs at the peak) less than ZeRO-2; the rest is ZeRO-2's.
  std::vector<par::GptMemory> const zero3 = par::predict_gpt_memory(deep, 8, {.data_parallel = 3, .zero_stage = 3,
                                                                                 .bucket_cap_bytes = 16 << 10,
                                                                                 .first_bucket_cap_bytes = 16 << 10});
  CHECK(zero2[0].parameters == float_bytes(whole));
  CHECK(zero3[0].parameters == zero2[0].gradients);
  CHECK(zero3[0].gradients + float_bytes(block) == zero2[0].gradients);
  CHECK(zero3[0].optimizer == zero2[0].optimizer);
  CHECK(zero3[0].activations + zero3[0].workspace == zero2[0].activations + zero2[0].workspace);
  // One replica's rows on one device hold what that replica's device holds, less the optimizer state.
  std::vector<par::GptMemory> const three_rows = par::predict_gpt_memory(config, 3, {});
  CHECK(three_rows[0].activations == dp[0].activations);
  CHECK(three_rows[0].workspace == dp[0].workspace);
  // Two replicas of 2-way tensor parallelism (the replicated update): each replica's ranks as the
  // 2-way split of its rows.
  std::vector<par::GptMemory> const grid =
      par::predict_gpt_memory(config, 8, {.data_parallel = 2, .tensor_parallel = 2, .zero_stage = 0});
  std::vector<par::GptMemory> const half = par::predict_gpt_memory(config, 4, {.tensor_parallel = 2});
  REQUIRE(grid.size() == 4);
  for (std::size_t r = 0; r < 4; ++r) CHECK(grid[r].total() == half[r % 2].total());
}

// In 16 bits each rank also holds compute-type copies: of every parameter at ZeRO 0 to 2, of the
// gradients of the units backward is in at ZeRO 0 to 2 (the embedding's and the last block's), of the
// gathered units' parameters and gradients at ZeRO-3, whose float32 parameters are the owned
// masters and one unit's gather staging.
TEST_CASE("predicted 16-bit memory adds the compute-type copies, and ZeRO-2 and 3 shard the float32 masters", "[parallel][memory]") {
  mgpu::nn::GptConfig deep = config;
  deep.n_layer = 8;
  std::int64_t const whole = mgpu::nn::gpt(deep).parameter_count();
  for (mgpu::DType const compute : {mgpu::DType::bfloat16, mgpu::DType::float16}) {
    CAPTURE(mgpu::to_string(compute));
    std::size_t const copy = mgpu::Allocator::block_size(static_cast<std::size_t>(whole) * 2);
    std::vector<par::GptMemory> by_stage, by_stage32;
    for (int const stage : {0, 1, 2, 3}) {
      par::GptLayout layout{.data_parallel = 4, .zero_stage = stage, .bucket_cap_bytes = 16 << 10, .first_bucket_cap_bytes = 16 << 10};
      by_stage32.push_back(par::predict_gpt_memory(deep, 8, layout)[0]);
      layout.compute = compute;
      by_stage.push_back(par::predict_gpt_memory(deep, 8, layout)[0]);
    }
    std::int64_t const c = deep.n_embd;
    auto const half = [](std::int64_t values) { return mgpu::Allocator::block_size(static_cast<std::size_t>(values) * 2); };
    std::size_t const unit_copies = half(12 * c * c + 13 * c) + half((deep.vocab + deep.block_size) * c);
    CHECK(by_stage[0].parameters == float_bytes(whole) + copy);
    CHECK(by_stage[0].gradients == float_bytes(whole) + unit_copies);
    CHECK(by_stage[2].gradients == by_stage32[2].gradients + unit_copies);
    CHECK(by_stage[2].parameters == by_stage[1].parameters);
    CHECK(by_stage[3].parameters < by_stage32[3].parameters);  // the gathered units in 16 bits
    for (int s = 0; s < 4; ++s) {
      CHECK(by_stage[s].optimizer == by_stage32[s].optimizer);
      if (s > 0) CHECK(by_stage[s].total() < by_stage[s - 1].total());
    }
  }
  REQUIRE_MGPU_ERROR(par::predict_gpt_memory(deep, 8, {.compute = mgpu::DType::int32}), mgpu::Errc::invalid_argument,
                     "in int32 (expected float32, bfloat16 or float16)");
}

TEST_CASE("a pipeline of one stage holds what one device holds; stages hold their layers and micro-batches",
          "[parallel][memory]") {
  std::size_t const layers = mgpu::nn::gpt(config).size();  // embedding, dropout, 2 blocks, LayerNorm, head
  for (auto recompute : {mgpu::nn::Recompute::none, mgpu::nn::Recompute::full}) {
    mgpu::nn::GptConfig c = config;
    c.recompute = recompute;
    std::vector<par::GptMemory> const one = par::predict_gpt_memory(c, 4, {});
    std::vector<par::GptMemory> const stage = par::predict_gpt_memory(c, 4, {.cuts = {0, layers}});
    REQUIRE(stage.size() == 1);
    CHECK(stage[0].total() == one[0].total());
  }
  // Two stages, the blocks split: the second holds the head's own copy of wte.
  mgpu::nn::Sequential const model = mgpu::nn::gpt(config);
  std::vector<std::size_t> const cuts{0, 3, layers};
  std::int64_t first = 0, second = config.vocab * config.n_embd;
  for (std::size_t l = 0; l < layers; ++l) (l < 3 ? first : second) += model.layer(l).parameter_count();
  std::vector<par::GptMemory> const gpipe = par::predict_gpt_memory(config, 8, {.cuts = cuts, .micro_batches = 4, .gpipe = true});
  std::vector<par::GptMemory> const one_f_one_b = par::predict_gpt_memory(config, 8, {.cuts = cuts, .micro_batches = 4});
  REQUIRE(gpipe.size() == 2);
  CHECK(gpipe[0].parameters == float_bytes(first));
  CHECK(gpipe[1].parameters == float_bytes(second));
  // 1F1B keeps 2 micro-batches in flight on the first stage and 1 on the last; GPipe all 4.
  CHECK(one_f_one_b[0].activations * 2 == gpipe[0].activations);
  CHECK(one_f_one_b[1].activations * 4 == gpipe[1].activations);
  // Replicas of the pipeline: replica a's stages hold what a pipeline of its rows holds (7 rows over
  // 2 replicas: 4 and 3).
  std::vector<par::GptMemory> const grid =
      par::predict_gpt_memory(config, 7, {.data_parallel = 2, .zero_stage = 0, .cuts = cuts, .micro_batches = 3});
  std::vector<par::GptMemory> const four = par::predict_gpt_memory(config, 4, {.cuts = cuts, .micro_batches = 3});
  std::vector<par::GptMemory> const three = par::predict_gpt_memory(config, 3, {.cuts = cuts, .micro_batches = 3});
  REQUIRE(grid.size() == 4);
  for (std::size_t s = 0; s < 2; ++s) {
    CHECK(grid[s].total() == four[s].total());
    CHECK(grid[2 + s].total() == three[s].total());
  }
  CHECK(four[0].activations > three[0].activations);
  // With ZeRO-1 each replica keeps AdamW's state of half its chunk (and a few elements past the
  // blocks), the rest as without.
  std::vector<par::GptMemory> const zero1 = par::predict_gpt_memory(config, 7, {.data_parallel = 2, .cuts = cuts, .micro_batches = 3});
  REQUIRE(zero1.size() == 4);
  for (std::size_t d = 0; d < 4; ++d) {
    CHECK(static_cast<double>(zero1[d].optimizer) >= 0.45 * static_cast<double>(grid[d].optimizer));
    CHECK(static_cast<double>(zero1[d].optimizer) <= 0.55 * static_cast<double>(grid[d].optimizer));
    CHECK(zero1[d].total() - zero1[d].optimizer == grid[d].total() - grid[d].optimizer);
  }
}

TEST_CASE("sequence parallelism splits what a block keeps outside its split regions, nothing else", "[parallel][memory]") {
  for (int ranks : {2, 4}) {
    std::vector<par::GptMemory> const tp = par::predict_gpt_memory(config, 4, {.tensor_parallel = ranks});
    std::vector<par::GptMemory> const sp = par::predict_gpt_memory(config, 4, {.tensor_parallel = ranks, .sequence_parallel = true});
    REQUIRE(sp.size() == tp.size());
    for (std::size_t r = 0; r < sp.size(); ++r) {
      CHECK(sp[r].parameters == tp[r].parameters);
      CHECK(sp[r].optimizer == tp[r].optimizer);
      CHECK(sp[r].workspace == tp[r].workspace);
      CHECK(sp[r].activations < tp[r].activations);
    }
  }
  // Full recomputation keeps each block's input: 1/ranks of the tokens' residual stream.
  mgpu::nn::GptConfig full = config;
  full.recompute = mgpu::nn::Recompute::full;
  std::vector<par::GptMemory> const tp = par::predict_gpt_memory(full, 4, {.tensor_parallel = 2});
  std::vector<par::GptMemory> const sp = par::predict_gpt_memory(full, 4, {.tensor_parallel = 2, .sequence_parallel = true});
  std::size_t const inputs = static_cast<std::size_t>(config.n_layer) * float_bytes(4 * config.block_size * config.n_embd);
  std::size_t const split_inputs = static_cast<std::size_t>(config.n_layer) * float_bytes(2 * config.block_size * config.n_embd);
  CHECK(tp[0].activations - sp[0].activations > inputs - split_inputs);
}

TEST_CASE("tensor-parallel stages hold the executor's shards, and each rank the micro-batches of its stage", "[parallel][memory]") {
  std::size_t const layers = mgpu::nn::gpt(config).size();
  std::vector<std::size_t> const cuts{0, 3, layers};
  for (int ranks : {2, 3, 4}) {  // vocab 67: ranks hold 33/34, 22/22/23 and 16/17/17/17 rows
    mgpu::pipeline::TensorParallelStages const stages = mgpu::pipeline::tensor_parallel_stages(mgpu::nn::gpt(config), {}, ranks);
    mgpu::DeviceGroup group("host:" + std::to_string(ranks));
    std::shared_ptr<mgpu::comm::Communicator> const comm = mgpu::comm::make_communicator(group);
    std::vector<par::GptMemory> const grid =
        par::predict_gpt_memory(config, 8, {.tensor_parallel = ranks, .cuts = cuts, .micro_batches = 4});
    REQUIRE(grid.size() == static_cast<std::size_t>(2 * ranks));
    for (int r = 0; r < ranks; ++r) {
      // The second stage's LM head keeps its own copy of the rank's rows of wte.
      auto const [begin, end] = par::vocab_shard(config.vocab, ranks, r);
      for (std::size_t s = 0; s < 2; ++s) {
        mgpu::nn::Sequential const chunk = stages.stage(comm, r, cuts[s], cuts[s + 1]);
        std::int64_t const copy = s == 1 ? (end - begin) * config.n_embd : 0;
        CHECK(grid[static_cast<std::size_t>(r) * 2 + s].parameters == float_bytes(chunk.parameter_count() + copy));
      }
    }
    // One rank: the pipeline without tensor parallelism.
    if (ranks == 2) {
      std::vector<par::GptMemory> const plain = par::predict_gpt_memory(config, 8, {.cuts = cuts, .micro_batches = 4});
      std::vector<par::GptMemory> const one = par::predict_gpt_memory(config, 8, {.tensor_parallel = 1, .cuts = cuts, .micro_batches = 4});
      for (std::size_t s = 0; s < 2; ++s) CHECK(one[s].total() == plain[s].total());
      CHECK(grid[0].activations < plain[0].activations);
    }
  }
}

TEST_CASE("a pipeline's prediction walks any schedule's passes, and 16-bit activations take half the bytes", "[parallel][memory]") {
  namespace pp = mgpu::pipeline;
  std::size_t const layers = mgpu::nn::gpt(config).size();  // embedding, dropout, 2 blocks, LayerNorm, head
  std::vector<std::size_t> const cuts{0, 3, layers};
  // The generators' 1F1B and GPipe orders give the closed forms' peaks (stage s: min(M, P - s)
  // micro-batches in flight; GPipe all of them).
  for (bool const gpipe : {false, true}) {
    pp::Schedule const schedule = gpipe ? pp::gpipe(2, 4) : pp::one_f_one_b(2, 4);
    std::vector<par::GptMemory> const closed = par::predict_gpt_memory(config, 8, {.cuts = cuts, .micro_batches = 4, .gpipe = gpipe});
    std::vector<par::GptMemory> const walked =
        par::predict_gpt_memory(config, 8, {.cuts = cuts, .micro_batches = 4, .passes = pp::memory_passes(schedule)});
    REQUIRE(walked.size() == 2);
    for (std::size_t d = 0; d < 2; ++d) CHECK(walked[d].total() == closed[d].total());
  }
  // Interleaved: each device holds its two chunks' parameters, counted from the model's layers.
  mgpu::nn::Sequential const model = mgpu::nn::gpt(config);
  std::vector<std::size_t> const four{0, 2, 3, 4, layers};
  std::vector<std::int64_t> chunk(4, 0);
  for (std::size_t l = 0; l < layers; ++l) chunk[l < 2 ? 0 : l < 3 ? 1 : l < 4 ? 2 : 3] += model.layer(l).parameter_count();
  chunk[3] += config.vocab * config.n_embd;  // the head's own copy of wte
  std::vector<par::GptMemory> const interleaved = par::predict_gpt_memory(
      config, 8, {.cuts = four, .micro_batches = 4, .passes = pp::memory_passes(pp::interleaved_one_f_one_b(2, 2, 4))});
  REQUIRE(interleaved.size() == 2);
  CHECK(interleaved[0].parameters == float_bytes(chunk[0]) + float_bytes(chunk[2]));
  CHECK(interleaved[1].parameters == float_bytes(chunk[1]) + float_bytes(chunk[3]));
  // Zero-bubble: what backward_input leaves for backward_weight stays until it runs, so a device
  // holds at least 1F1B's.
  std::vector<par::GptMemory> const zb =
      par::predict_gpt_memory(config, 8, {.cuts = cuts, .micro_batches = 4, .passes = pp::memory_passes(pp::zero_bubble_h1(2, 4))});
  std::vector<par::GptMemory> const one_f_one_b = par::predict_gpt_memory(config, 8, {.cuts = cuts, .micro_batches = 4});
  for (std::size_t d = 0; d < 2; ++d) CHECK(zb[d].activations >= one_f_one_b[d].activations);
  // 16 bits: the saved tensors in two bytes a value, LayerNorm statistics and log-sum-exp in four.
  for (mgpu::DType const compute : {mgpu::DType::bfloat16, mgpu::DType::float16}) {
    std::size_t const wide = par::predict_gpt_memory(config, 4, {})[0].activations;
    std::size_t const narrow = par::predict_gpt_memory(config, 4, {.compute = compute})[0].activations;
    CHECK(2 * narrow > wide);
    CHECK(2 * narrow < wide + wide / 10);
  }
  // Passes that miss a micro-batch's backward_weight, run a pass before what it needs, or put a
  // chunk on another device, are refused.
  std::vector<std::vector<par::GptPass>> passes = pp::memory_passes(pp::zero_bubble_h1(2, 4));
  std::vector<std::vector<par::GptPass>> missing = passes;
  missing[0].pop_back();
  REQUIRE_MGPU_ERROR(par::predict_gpt_memory(config, 8, {.cuts = cuts, .micro_batches = 4, .passes = missing}),
                     mgpu::Errc::invalid_argument, "backward_input and backward_weight");
  std::vector<std::vector<par::GptPass>> backwards_first = passes;
  std::swap(backwards_first[1].front(), backwards_first[1].back());
  REQUIRE_MGPU_ERROR(par::predict_gpt_memory(config, 8, {.cuts = cuts, .micro_batches = 4, .passes = backwards_first}),
                     mgpu::Errc::invalid_argument, "in that order");
  std::swap(passes[0], passes[1]);
  REQUIRE_MGPU_ERROR(par::predict_gpt_memory(config, 8, {.cuts = cuts, .micro_batches = 4, .passes = passes}),
                     mgpu::Errc::invalid_argument, "on device c % devices");
}

TEST_CASE("predict_gpt_memory refuses layouts it cannot place, naming them", "[parallel][memory]") {
  REQUIRE_MGPU_ERROR(par::predict_gpt_memory(config, 4, {.tensor_parallel = 5}), mgpu::Errc::invalid_argument,
                     "tensor_parallel dividing n_head");
  REQUIRE_MGPU_ERROR(par::predict_gpt_memory(config, 4, {.data_parallel = 2, .zero_stage = 4}), mgpu::Errc::invalid_argument,
                     "zero_stage 0, 1, 2 or 3");
  REQUIRE_MGPU_ERROR(par::predict_gpt_memory(config, 2, {.data_parallel = 3}), mgpu::Errc::invalid_argument,
                     "at least one row per replica");
  REQUIRE_MGPU_ERROR(par::predict_gpt_memory(config, 2, {.data_parallel = 0}), mgpu::Errc::invalid_argument,
                     "data_parallel >= 1");
  std::size_t const layers = mgpu::nn::gpt(config).size();
  REQUIRE_MGPU_ERROR(par::predict_gpt_memory(config, 4, {.cuts = {0, 3, 3, layers}}), mgpu::Errc::invalid_argument, "increasing");
  REQUIRE_MGPU_ERROR(par::predict_gpt_memory(config, 4, {.cuts = {0, 3}}), mgpu::Errc::invalid_argument, "cuts from 0 to the model's");
  REQUIRE_MGPU_ERROR(par::predict_gpt_memory(config, 2, {.cuts = {0, layers}, .micro_batches = 3}), mgpu::Errc::invalid_argument,
                     "micro_batches <= each replica's rows");
  REQUIRE_MGPU_ERROR(par::predict_gpt_memory(config, 5, {.data_parallel = 2, .cuts = {0, layers}, .micro_batches = 3}),
                     mgpu::Errc::invalid_argument, "micro_batches <= each replica's rows");
  REQUIRE_MGPU_ERROR(par::predict_gpt_memory(config, 4, {.sequence_parallel = true}), mgpu::Errc::invalid_argument,
                     "tensor_parallel >= 2 dividing the block size");
  REQUIRE_MGPU_ERROR(par::predict_gpt_memory(config, 4, {.tensor_parallel = 3, .sequence_parallel = true}),
                     mgpu::Errc::invalid_argument, "over block_size 8");
  mgpu::nn::GptConfig bad = config;
  bad.n_embd = 50;  // not a multiple of n_head
  REQUIRE_MGPU_ERROR(par::predict_gpt_memory(bad, 2, {}), mgpu::Errc::invalid_argument, "n_head dividing n_embd");
}
