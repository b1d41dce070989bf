// train_gpt's flags: the Options they fill and their CLI11 definitions (one job: the command line).
//
// The layout flags, which train_gpt turns into a train::ParallelConfig:
//   one device                  nn::train_step
//   --dp N (or N --devices)     parallel::DataParallel: replicas all-reduce their gradients in
//     [--zero 0|1|2|3]          buckets while backward goes on; --zero 1 (the default) reduce-
//     [--bucket-kb K]           scatters them instead, each replica updating 1/N of the weights and
//                               keeping their AdamW state only (ZeRO-1), 2 also keeps only their
//                               reduced gradients (ZeRO-2: layers write into bucket-sized staging
//                               buffers), 3 only their weights too (ZeRO-3: each transformer
//                               block's weights all-gathered just before its forward and backward,
//                               the next one prefetched), 0 updates every weight everywhere (a
//                               pipeline's replicas take 0 or 1);
//                               --bucket-kb caps the gradient
//                               buckets (and makes them ZeRO-3's units)
//   --schedule S --stages K     pipeline::Executor: the model cut into K stages (x --chunks per
//     [--micro-batches M]       device for interleaved) by each layer's forward + backward FLOPs,
//     [--dp N]                  M micro-batches per step, N pipeline replicas (a data x pipeline
//                               grid over K x N devices); the tied LM head's stage holds a copy of
//                               wte kept equal to the first stage's
//   --tp N                      parallel::TensorParallel: every transformer block split across N
//     [--dp A]                  devices (Megatron: MLP and attention heads), the embedding, LM
//                               head and cross-entropy split by vocab, dropout as on one device;
//                               with --dp, A replicas of N neighbouring devices each (a data x
//                               tensor grid over A x N devices), each replica its rows of the
//                               batch, gradients reduced across the replicas in buckets by data
//                               parallelism's engine, with its --zero stages (1, the default,
//                               and 0 in any precision; 2 and 3 in fp32) and --bucket-kb
//   --tp N --stages K [--dp A]  a data x tensor x pipeline grid over A x N x K devices
//     [--schedule S]            (pipeline::Executor with tensor-parallel stages): every stage
//     [--micro-batches M]       split over N devices, N pipelines per replica in lock-step, rank
//                               t's pipeline holding rank t's shard of every stage; the groups of
//                               N on the best links as above; any schedule; --sequence-parallel
//                               and checkpoints too
//     [--sequence-parallel]     sequence parallelism: between the split regions each device holds
//                               1/N of the tokens (LayerNorm, dropout and residual activations),
//                               all-gathers and reduce-scatters in place of the all-reduces
//                               (--block-size divisible by N)
// --recompute none|selective|full (nn::Recompute) trades memory for recomputed forward work in any
// layout, the losses unchanged bit for bit.
// --plan auto (plan::plan_gpt) chooses the layout instead of the flags above: it measures the
// model's costs on --devices (default host:cores), weighs every data x tensor x pipeline split of
// them with each ZeRO stage, recomputation mode and micro-batch count, drops those the memory model
// says exceed --device-memory MiB (default: the devices' free memory) and runs the one predicted
// fastest, printing it and the runner-up (--json: "plan").
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include <mgpu/mgpu.hpp>

#include "example_cli.hpp"

namespace train_gpt {

struct Options {
  std::string data = "build/data/shakespeare";
  std::int64_t vocab = 256;
  std::int64_t n_layer = 4, n_head = 4, n_embd = 128, block_size = 64, batch_size = 12;
  std::int64_t iters = 2000;
  std::int64_t until_step = 0;  // 0: run to --iters
  float lr = 1e-3f, min_lr = 1e-4f;
  std::int64_t warmup = 100;
  float weight_decay = 0.1f, clip = 1.0f, dropout = 0.0f;
  std::string recompute = "none";
  std::uint64_t seed = 1337;
  std::int64_t eval_every = 500, eval_iters = 50, log_every = 0;
  std::string devices;  // empty: host:(stages x dp)
  std::string schedule;  // empty: data parallel (or one device), unless --stages > 1 (then 1f1b)
  int stages = 1, micro_batches = 1, dp = 1, chunks = 2;
  int tp = 1;  // tensor-parallel ranks
  bool sequence_parallel = false;  // TensorParallelOptions::sequence_parallel
  std::string plan;  // "auto": the planner chooses the layout flags
  std::string layout_flags;  // the layout flags given on the command line (refused with --plan)
  std::int64_t device_memory_mb = 0;  // the planner's budget per device (0: the devices' free memory)
  int zero = 1;  // DataParallelOptions::zero_stage
  bool zero_given = false;  // --zero on the command line (else 1 with several replicas)
  std::int64_t bucket_kb = 0;  // DataParallelOptions::bucket_cap_bytes in KiB (0: its default)
  std::string trace;
  std::string precision = "fp32";
  std::string checkpoint;
  bool resume = false;
  std::int64_t sample = 0;
  float temperature = 1.0f;
  std::int64_t top_k = 0;
  std::string prompt = "\n";
  std::string init_from, save_llmc;
  bool eval_only = false;
  bool json = false;
  bool progress = false, no_progress = false;  // default: the live view when stderr is a terminal
  examples::MetricsFlags metrics;
};

/// Registers every flag of train_gpt on `app`, filling `o`.
inline void add_flags(CLI::App& app, Options& o) {
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);  // a later flag wins (scripts/run.sh)
  app.add_option("--data", o.data, "a text file (byte tokens, 90/10 split) or a folder of train/val token shards")
      ->capture_default_str();
  app.add_option("--vocab", o.vocab, "token ids of the shards are below this (256 for bytes)")
      ->check(CLI::Range(1, 65536))
      ->capture_default_str();
  app.add_option("--n-layer", o.n_layer, "transformer blocks")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--n-head", o.n_head, "attention heads")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--n-embd", o.n_embd, "embedding width")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--block-size", o.block_size, "context length T")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--batch-size", o.batch_size, "sequences per step")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--iters", o.iters, "training steps")->check(CLI::NonNegativeNumber)->capture_default_str();
  app.add_option(
         "--until-step", o.until_step,
         "stop after this step, as a time-sliced job would; --resume continues (the schedule still spans --iters)")
      ->check(CLI::PositiveNumber);
  app.add_option("--lr", o.lr, "peak learning rate")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--min-lr", o.min_lr, "learning rate at the end of the cosine")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--warmup", o.warmup, "linear warm-up steps")->check(CLI::NonNegativeNumber)->capture_default_str();
  app.add_option("--weight-decay", o.weight_decay, "AdamW decay of the 2-D weights (embeddings, Linear weights)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--clip", o.clip, "clip gradients to this global norm (0: off)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--dropout", o.dropout, "dropout probability")->check(CLI::Range(0.0, 0.99))->capture_default_str();
  app.add_option("--recompute", o.recompute,
                 "activation recomputation per transformer block: none | selective (the attention core) | full (the "
                 "whole block from its input); the same results, less memory")
      ->check(CLI::IsMember({"none", "selective", "full"}))
      ->capture_default_str();
  app.add_option("--seed", o.seed, "seed of the weights and the sampled training windows")->capture_default_str();
  app.add_option("--eval-every", o.eval_every, "steps between validation losses (0: at the end only)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--eval-iters", o.eval_iters, "validation batches: K = eval-iters x batch-size windows")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--log-every", o.log_every, "steps between progress lines (default: iters / 20)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--devices", o.devices,
                 "the devices: one, several for data parallelism, stages x dp for a pipeline (host:2, cuda:0,1; "
                 "default host:(stages x dp))");
  app.add_option("--schedule", o.schedule, "pipeline schedule: layer-split | gpipe | 1f1b | interleaved | zb")
      ->check(CLI::IsMember({"layer-split", "gpipe", "1f1b", "interleaved", "zb"}));
  app.add_option("--stages", o.stages, "pipeline stages (devices per pipeline; > 1 without --schedule: 1f1b)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--micro-batches", o.micro_batches, "micro-batches per pipeline step")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--chunks", o.chunks, "model chunks per device for --schedule interleaved")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--dp", o.dp, "data-parallel replicas (of the pipeline, with --schedule; of the shards, with --tp)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--tp", o.tp,
                 "tensor-parallel devices: each transformer block split across them (n_head divisible by it)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_flag("--sequence-parallel", o.sequence_parallel,
               "with --tp: each device holds 1/tp of the tokens between the split regions (LayerNorm, dropout)");
  app.add_option("--zero", o.zero,
                 "ZeRO stage over the data-parallel replicas (plain, or of --tp shards): 1 shards the update and the "
                 "optimizer state, 2 the gradients too, 3 the parameters too, 0 replicates them")
      ->capture_default_str();
  app.add_option("--bucket-kb", o.bucket_kb,
                 "the data-parallel replicas' gradient bucket cap in KiB (default 25600; smaller buckets, smaller ZeRO-2 staging); with --zero 3 "
                 "the units are these buckets instead of one per transformer block")
      ->check(CLI::PositiveNumber);
  app.add_option("--plan", o.plan,
                 "auto: measure the model's costs on --devices (default host:cores) and run the layout the planner "
                 "predicts fastest among those that fit (no layout flags)")
      ->check(CLI::IsMember({"auto"}));
  app.add_option("--device-memory", o.device_memory_mb, "with --plan: MiB each device may use (default: its free memory)")
      ->check(CLI::PositiveNumber);
  app.add_option("--trace", o.trace, "write the last step's timeline (Chrome/Perfetto JSON) here");
  app.add_option("--precision", o.precision, "fp32 | bf16 | fp16 (16-bit compute, float32 master weights)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}))
      ->capture_default_str();
  app.add_option("--checkpoint", o.checkpoint,
                 "save model, optimizer and data position here at every evaluation and at the end");
  app.add_flag("--resume", o.resume, "continue from --checkpoint when it exists (same data stream, same schedule)");
  app.add_option("--sample", o.sample, "generate this many tokens after training")->check(CLI::NonNegativeNumber);
  app.add_option("--temperature", o.temperature, "sampling temperature (> 0)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--top-k", o.top_k, "sample among the k most likely tokens (0: all; 1: greedy)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--prompt", o.prompt, "the text generation continues (default: a newline)");
  app.add_option("--init-from", o.init_from,
                 "start from an llm.c model file (its architecture replaces the size flags)");
  app.add_option("--save-llmc", o.save_llmc, "write the trained model as an llm.c model file");
  app.add_flag("--eval-only", o.eval_only, "train nothing: report the validation loss");
  o.metrics.add_to(app);
  app.add_flag("--progress", o.progress, "a live view on stderr: a bar and a line per device (default: when stderr is a terminal)");
  app.add_flag("--no-progress", o.no_progress, "no live view, even on a terminal");
  app.add_flag("--json", o.json, "print the final metrics as one JSON object on stdout (progress goes to stderr)");
}

/// After parsing: which flags were given that the layout depends on.
inline void note_given(CLI::App const& app, Options& o) {
  o.zero_given = app.count("--zero") > 0;
  for (char const* flag : {"--dp", "--tp", "--stages", "--schedule", "--micro-batches", "--chunks", "--zero", "--bucket-kb",
                           "--recompute", "--sequence-parallel"})
    if (app.count(flag) > 0) o.layout_flags += (o.layout_flags.empty() ? "" : ", ") + std::string(flag);
}

/// The layout the flags ask for (compute, loss scaling and clipping aside: see run()).
inline mgpu::train::ParallelConfig parallel_config(Options const& o) {
  mgpu::train::ParallelConfig c{.dp = o.dp,
                                .tp = o.tp,
                                .stages = o.stages,
                                .schedule = o.schedule,
                                .micro_batches = o.micro_batches,
                                .chunks = o.chunks,
                                .zero = o.zero_given ? std::optional<int>(o.zero) : std::nullopt,
                                .bucket_cap_bytes = static_cast<std::size_t>(o.bucket_kb) << 10,
                                .sequence_parallel = o.sequence_parallel};
  for (auto const r : {mgpu::nn::Recompute::none, mgpu::nn::Recompute::selective, mgpu::nn::Recompute::full})
    if (mgpu::nn::to_string(r) == o.recompute) c.recompute = r;
  return c;
}

}  // namespace train_gpt
