// bench_gpt's BM_gpt_layouts/<layout>: one training step (clipping 1.0, AdamW) of a GPT in each
// layout the library has, on host devices, every one through the front door users run,
// train::Trainer (built from a train::ParallelConfig; docs/parallel-layouts.md). The model is the
// mid-sized GPT (n_layer 4, n_head 4, n_embd 256, block 128, batch 8, vocab 256: 3.2 M
// parameters) except in the last row, issue 36's memory row (n_layer 8, n_embd 256, block 32,
// batch 4: 6.4 M parameters; BM_gpt_zero compares the ZeRO stages at that shape). The layouts:
//   0 one device;
//   1 data parallel over host:2 with the replicated update (ZeRO-0);  2 the same with ZeRO-1;
//   3 ZeRO-1 with full recomputation;  4 tensor parallel over host:2 (vocab-parallel embedding,
//   head and loss);  5 a 1F1B pipeline of 2 stages and 4 micro-batches over host:2;
//   6 two data-parallel replicas of tensor parallel over host:2 each (host:4), replicated update;
//   7 ZeRO-2 over host:2 (a gradient bucket per block: 1 MiB caps);  8 tensor parallel over host:2
//   with sequence parallelism;  9 two pipeline stages of tensor parallel 2 each (host:4, 1F1B,
//   4 micro-batches);  10 ZeRO-3 over host:2 with a bucket per block as its units;
//   11, 12 row 6 with ZeRO-1 and ZeRO-3 over the tensor-parallel replicas (ZeRO needs replicas:
//   tensor parallelism alone has one);  13 data parallel over host:4 with ZeRO-1;  14 ZeRO-3 over
//   host:4 with the default options (a unit per transformer block, the embedding and the final
//   LayerNorm their own);  15 row 14 at issue 36's shape;  16, 17 a 1F1B pipeline of 2 stages x 2
//   data-parallel replicas (host:4, 2 micro-batches) at issue 36's shape with ZeRO-1 and ZeRO-3
//   over the replicas.
// Pipelines are cut at the model's middle cut point. Each row steps once untimed, then times its
// steps (a short run):
//   tokens_per_s        batch * block / the median step time;
//   peak_bytes_device   the largest device allocator peak over the timed steps (parameters,
//                       gradients, optimizer state, activations, buffers; as train_gpt --json's
//                       peak_bytes; blocks are reused in stream order, as on a GPU);
//   predicted_peak_bytes_device  the memory model's prediction of that peak (Trainer::predicted_memory);
//   devices             how many devices the layout uses.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>

#include <mgpu/mgpu.hpp>
#include <mgpu/nn/gpt.hpp>
#include <mgpu/train/trainer.hpp>

#include "bench_gpt_support.hpp"

namespace {

using namespace bench::gpt;

Shape const mid{"mid", {.vocab = 256, .block_size = 128, .n_layer = 4, .n_head = 4, .n_embd = 256}, 8};
Shape const issue36{"issue 36", {.vocab = 256, .block_size = 32, .n_layer = 8, .n_head = 4, .n_embd = 256}, 4};

// The model's middle cut point: where a pipeline of two stages is cut.
std::size_t middle_cut(mgpu::nn::GptConfig const& config) {
  mgpu::nn::Sequential const whole = mgpu::nn::gpt(config);
  std::vector<std::size_t> const points = whole.cut_points();
  return *std::min_element(points.begin(), points.end(), [&](std::size_t a, std::size_t b) {
    auto const off = [&](std::size_t p) { return std::abs(static_cast<double>(p) - static_cast<double>(whole.size()) / 2); };
    return off(a) < off(b);
  });
}

void BM_gpt_layouts(benchmark::State& state) {
  using R = mgpu::nn::Recompute;
  std::size_t const per_block = std::size_t{1} << 20;  // a bucket cap below a block: a bucket (and ZeRO-3 unit) each
  // Each layout: its name, shape, devices and config (a pipeline's cuts set below).
  struct Row {
    char const* name;
    Shape const* shape;
    char const* devices;
    mgpu::train::ParallelConfig config;
  };
  static Row const rows[] = {
      {"one device", &mid, "host:1", {}},
      {"host:2 data parallel, replicated update", &mid, "host:2", {.dp = 2, .zero = 0}},
      {"host:2 data parallel, ZeRO-1", &mid, "host:2", {.dp = 2, .zero = 1}},
      {"host:2 ZeRO-1, full recomputation", &mid, "host:2", {.dp = 2, .zero = 1, .recompute = R::full}},
      {"host:2 tensor parallel", &mid, "host:2", {.tp = 2}},
      {"host:2 pipeline, 1F1B x 4 micro-batches", &mid, "host:2", {.stages = 2, .micro_batches = 4}},
      {"host:4 data parallel 2 x tensor parallel 2", &mid, "host:4", {.dp = 2, .tp = 2, .zero = 0}},
      {"host:2 ZeRO-2, a bucket per block", &mid, "host:2", {.dp = 2, .zero = 2, .bucket_cap_bytes = per_block}},
      {"host:2 tensor parallel, sequence parallel", &mid, "host:2", {.tp = 2, .sequence_parallel = true}},
      {"host:4 tensor parallel 2 x pipeline 2, 1F1B x 4 micro-batches", &mid, "host:4", {.tp = 2, .stages = 2, .micro_batches = 4}},
      {"host:2 ZeRO-3, a bucket per block", &mid, "host:2", {.dp = 2, .zero = 3, .bucket_cap_bytes = per_block}},
      {"host:4 data parallel 2 x tensor parallel 2, ZeRO-1", &mid, "host:4", {.dp = 2, .tp = 2, .zero = 1}},
      {"host:4 data parallel 2 x tensor parallel 2, ZeRO-3", &mid, "host:4", {.dp = 2, .tp = 2, .zero = 3}},
      {"host:4 data parallel, ZeRO-1", &mid, "host:4", {.dp = 4, .zero = 1}},
      {"host:4 ZeRO-3, default units (a block each)", &mid, "host:4", {.dp = 4, .zero = 3}},
      {"host:4 ZeRO-3, default units; n_layer 8, block 32, batch 4", &issue36, "host:4", {.dp = 4, .zero = 3}},
      {"host:4 pipeline 2 x data parallel 2, ZeRO-1; n_layer 8, block 32, batch 4", &issue36, "host:4",
       {.dp = 2, .stages = 2, .micro_batches = 2, .zero = 1}},
      {"host:4 pipeline 2 x data parallel 2, ZeRO-3; n_layer 8, block 32, batch 4", &issue36, "host:4",
       {.dp = 2, .stages = 2, .micro_batches = 2, .zero = 3}},
  };
  Row const& row = rows[state.range(0)];
  Shape const& shape = *row.shape;
  mgpu::train::ParallelConfig config = row.config;
  config.clip_norm = 1.0f;
  if (config.pipelined()) config.cuts = {0, middle_cut(shape.config), mgpu::nn::gpt(shape.config).size()};
  GptTrainer batches(shape);  // its batches feed the layout (its own model does not train)
  mgpu::train::Trainer trainer(shape.config, mgpu::DeviceGroup(row.devices), config,
                               {.seed = 1, .adamw = adamw_options, .batch_size = shape.batch});
  std::int64_t next = 0;
  auto const step = [&] {
    std::int64_t const b = next++ % GptTrainer::pool;
    (void)trainer.step(batches.inputs.slice(b * shape.batch, (b + 1) * shape.batch),
                       batches.targets.slice(b * shape.batch, (b + 1) * shape.batch));
  };
  step();  // the allocators' caches, the optimizer's state
  std::vector<mgpu::Allocator*> const allocators = trainer.allocators();
  for (mgpu::Allocator* a : allocators) a->reset_peak();
  std::vector<double> step_s;
  for (auto _ : state) {
    auto const t0 = Clock::now();
    step();
    step_s.push_back(seconds_since(t0));
  }
  double peak = 0;
  for (mgpu::Allocator* a : allocators) peak = std::max(peak, static_cast<double>(a->stats().peak_allocated));
  double predicted = 0;
  if (std::optional<std::vector<mgpu::parallel::GptMemory>> const memory = trainer.predicted_memory())
    for (mgpu::parallel::GptMemory const& m : *memory) predicted = std::max(predicted, static_cast<double>(m.total()));
  state.SetLabel(std::string(shape.name) + ", " + row.name);
  state.counters["tokens_per_s"] = static_cast<double>(batches.tokens()) / median(step_s);
  state.counters["peak_bytes_device"] = peak;
  state.counters["predicted_peak_bytes_device"] = predicted;
  state.counters["devices"] = static_cast<double>(allocators.size());
}
BENCHMARK(BM_gpt_layouts)->DenseRange(0, 17)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(bench::iterations(4));

}  // namespace
