// train_gpt: trains a GPT-2-style language model (nn::gpt) on a token stream, reports the
// validation loss as it goes, and samples text from it with a key/value cache.
//
//   train_gpt --data build/data/shakespeare                 # a folder of llm.c token shards
//   train_gpt --data notes.txt --iters 500                  # a text file, byte-tokenized, 90/10 split
//   train_gpt --data build/data/shakespeare --eval-only --init-from gpt2_byte.bin
//   train_gpt --checkpoint run.ckpt --resume --sample 300 --temperature 0.8 --top-k 40 --json
//
// Data: --data is a text file (tokenized with the byte-level tokenizer, vocab 256; the first 90%
// of its bytes train, the last 10% validate) or a folder of token shards in llm.c's format, read
// as they are: files whose name contains "val" validate, the others train (in name order).
//
// The validation loss is defined exactly (data::evaluate_lm): the mean per-token cross-entropy over
// the first K = --eval-iters x --batch-size consecutive, non-overlapping --block-size windows of the
// validation stream, targets the next tokens.
//
// Training: per-token cross-entropy (nn::TokenCrossEntropy), clipping by global norm, AdamW with
// weight decay on the weight matrices only. The layout:
//   one device                  nn::train_step
//   --dp N (or N --devices)     parallel::DataParallel: replicas all-reduce their gradients in
//     [--zero 0|1|2|3]          buckets while backward goes on; --zero 1 (the default) reduce-
//     [--bucket-kb K]           scatters them instead, each replica updating 1/N of the weights and
//                               keeping their AdamW state only (ZeRO-1), 2 also keeps only their
//                               reduced gradients (ZeRO-2: layers write into bucket-sized staging
//                               buffers), 3 only their weights too (ZeRO-3: each transformer
//                               block's weights all-gathered just before its forward and backward,
//                               the next one prefetched), 0 updates every weight everywhere (--zero
//                               is refused with a pipeline or --tp); --bucket-kb caps the gradient
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
//                               batch, gradients all-reduced across the replicas, every replica
//                               updating every weight; fp32
//   --tp N --stages K [--dp A]  a data x tensor x pipeline grid over A x N x K devices
//     [--schedule S]            (pipeline::Executor with tensor-parallel stages): every stage
//     [--micro-batches M]       split over N devices, N pipelines per replica in lock-step, rank
//                               t's pipeline holding rank t's shard of every stage; the groups of
//                               N on the best links as above; any schedule; --sequence-parallel
//                               too; without checkpoints
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
// Every layout gives the one-device losses within float32 rounding, and (but --tp with --stages)
// writes checkpoints in one format, so a run may resume on another layout. --devices defaults to
// host:(stages x dp), or host:(dp x N x stages) with --tp N. Evaluation, sampling and --save-llmc read a float32
// copy of the whole model (the stages' or shards' master weights, gathered before each use).
//
// Across processes (mpirun, srun): --devices is each process's, and data parallelism (each process
// its rows of every batch) or the pipeline (stages and replicas over the world's devices) spans
// every process's devices; process 0 prints. `mpirun -np 2 train_gpt --devices host:1` gives
// `train_gpt --devices host:2`'s losses. --tp's grid spans the world's devices too (each process
// passing every batch whole), e.g. `mpirun -np 2 train_gpt --devices host:2 --dp 2 --tp 2` (tensor
// parallel inside each process, data parallel across them) or `--devices host:1 --tp 2` (across
// them), and with --stages the data x tensor x pipeline grid. --checkpoint (not with --tp and --stages) is then a
// folder of one shard per process (DataParallel::save, pipeline::Executor::save), which --resume
// reads on any process count or layout over 2 or more devices, in one process too.
//   mpirun -np 2 train_gpt --data notes.txt --devices host:1
//   mpirun -np 2 train_gpt --data notes.txt --devices host:1 --stages 2
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <numbers>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <unistd.h>

#include <mgpu/data/evaluate.hpp>
#include <mgpu/data/tokens.hpp>
#include <mgpu/mgpu.hpp>

#include "example_cli.hpp"

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

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
  std::vector<std::size_t> plan_cuts;  // the planner's pipeline cuts
  int zero = 1;  // DataParallelOptions::zero_stage
  bool zero_given = false;  // --zero on the command line (it applies to data parallelism only)
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

// The train and validation streams as token shards in memory.
struct Splits {
  std::vector<std::vector<std::uint16_t>> train, val;
  std::string description;
};

Splits load_splits(Options const& o) {
  Splits s;
  if (fs::is_directory(o.data)) {
    std::vector<fs::path> files;
    for (auto const& entry : fs::directory_iterator(o.data))
      if (entry.is_regular_file() && entry.path().extension() == ".bin") files.push_back(entry.path());
    std::sort(files.begin(), files.end());
    for (auto const& f : files)
      (f.filename().string().find("val") != std::string::npos ? s.val : s.train)
          .push_back(mgpu::data::read_token_shard(f, o.vocab));
    if (s.train.empty() || s.val.empty())
      throw mgpu::Error(mgpu::Errc::invalid_argument,
                        "--data " + o.data + ": " + std::to_string(s.train.size()) + " train and " +
                            std::to_string(s.val.size()) +
                            " validation shards (expected *.bin token shards, at least one whose name contains "
                            "\"val\" and one that does not; scripts/example-data.sh writes such a folder)");
    s.description = "token shards in " + o.data;
    return s;
  }
  std::ifstream in(o.data, std::ios::binary);
  if (!in)
    throw mgpu::Error(mgpu::Errc::io, "--data " + o.data +
                                          ": cannot open (expected a text file or a folder of token shards; "
                                          "scripts/example-data.sh writes build/data/shakespeare)");
  std::string const text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::uint16_t> const tokens = mgpu::data::ByteTokenizer{}.encode(text);
  auto const split = static_cast<std::ptrdiff_t>(tokens.size() * 9 / 10);
  s.train.emplace_back(tokens.begin(), tokens.begin() + split);
  s.val.emplace_back(tokens.begin() + split, tokens.end());
  s.description = o.data + " (" + std::to_string(text.size()) + " bytes, byte-level tokens, 90/10 split)";
  return s;
}

std::int64_t count_tokens(std::vector<std::vector<std::uint16_t>> const& shards) {
  std::int64_t n = 0;
  for (auto const& s : shards) n += static_cast<std::int64_t>(s.size());
  return n;
}

// The learning rate at step `it`: linear warm-up to lr over `warmup` steps, then cosine to min_lr at
// `iters` (as the PyTorch peer and nanoGPT).
float lr_at(Options const& o, std::int64_t it) {
  if (it < o.warmup) return o.lr * static_cast<float>(it + 1) / static_cast<float>(o.warmup);
  double const r = std::min(
      1.0, static_cast<double>(it - o.warmup) / static_cast<double>(std::max<std::int64_t>(1, o.iters - o.warmup)));
  return o.min_lr + static_cast<float>(0.5 * (1.0 + std::cos(std::numbers::pi * r))) * (o.lr - o.min_lr);
}

// What a training step gives back: the loss as a device scalar (reading it synchronizes) on one
// device, or as a number the data-parallel step has already read.
struct StepLoss {
  mgpu::Tensor device;
  float value = NAN;
  float read(mgpu::Stream& stream) const { return device.defined() ? mgpu::ops::item(device, stream) : value; }
};

// The training state and its step: train_step is the one place a batch turns into an update, on
// one device (nn::train_step) or data parallel (DataParallel::step).
struct Trainer {
  mgpu::nn::Sequential& model;
  mgpu::optim::Optimizer& optimizer;
  mgpu::nn::Context& ctx;
  mgpu::Device device;
  float clip;
  std::optional<mgpu::optim::LossScaler> scaler;
  mgpu::parallel::DataParallel* parallel = nullptr;
  mgpu::pipeline::Executor* pipeline = nullptr;
  mgpu::trace::Timeline* timeline = nullptr;
  mgpu::parallel::TensorParallel* tensor = nullptr;
  mgpu::nn::TokenCrossEntropy loss{};
  // Across processes: each process's share of a batch's rows (its devices' speeds), and this one.
  std::vector<double> process_weights{};
  int process = 0;
  mgpu::parallel::DataParallelResult last_dp{};  // the last data-parallel step's (the metrics read it)

  // ids and targets as host int32 tensors on this device.
  mgpu::Tensor on_device(mgpu::Tensor const& host) {
    if (device.kind == mgpu::DeviceKind::host) return host;
    mgpu::Tensor t = mgpu::Tensor::empty(host.shape(), host.dtype(), ctx.allocator);
    mgpu::copy_async(t, host, ctx.stream);
    return t;
  }

  // Forward, per-token cross-entropy (mean over the batch's tokens), backward, unscale (fp16),
  // clipping by global norm, AdamW at `lr_scale`, refresh of the compute-type weights.
  StepLoss train_step(mgpu::data::TokenBatch const& batch, float lr_scale) {
    if (parallel != nullptr && process_weights.size() > 1) {  // this process's rows
      std::vector<std::int64_t> const rows =
          mgpu::shard_sizes(batch.x.dim(0), static_cast<int>(process_weights.size()), process_weights);
      std::int64_t begin = 0;
      for (int p = 0; p < process; ++p) begin += rows[static_cast<std::size_t>(p)];
      std::int64_t const end = begin + rows[static_cast<std::size_t>(process)];
      last_dp = parallel->step(batch.x.slice(begin, end), batch.y.slice(begin, end), lr_scale);
      return {{}, last_dp.loss};
    }
    if (parallel != nullptr) return {{}, (last_dp = parallel->step(batch.x, batch.y, lr_scale)).loss};
    if (pipeline != nullptr) return {{}, pipeline->step(batch.x, batch.y, lr_scale)};
    if (tensor != nullptr) return {{}, static_cast<float>(tensor->step(batch.x, batch.y, lr_scale).loss)};
    mgpu::nn::StepOptions const options{
        .lr_scale = lr_scale, .clip_norm = clip, .scaler = scaler ? &*scaler : nullptr, .timeline = timeline};
    return {mgpu::nn::train_step(model, optimizer, on_device(batch.x), on_device(batch.y), loss, ctx, options).loss};
  }
};

// The model's float32 master parameters on the host.
std::vector<float> host_parameters(mgpu::nn::Sequential const& model, mgpu::Stream& stream) {
  mgpu::Tensor const& p = model.master_parameters();
  if (p.device().kind == mgpu::DeviceKind::host) {
    stream.synchronize();
    auto const s = p.host_span<float>();
    return {s.begin(), s.end()};
  }
  auto host = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  mgpu::Tensor const copy = mgpu::Tensor::empty(p.shape(), mgpu::DType::float32, *host);
  mgpu::copy_async(copy, p, stream);
  stream.synchronize();
  auto const s = copy.host_span<float>();
  return {s.begin(), s.end()};
}

void set_parameters(mgpu::nn::Sequential& model, std::vector<float> const& values, mgpu::Stream& stream) {
  auto host = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  mgpu::Tensor const src = mgpu::Tensor::empty({static_cast<std::int64_t>(values.size())}, mgpu::DType::float32, *host);
  std::copy(values.begin(), values.end(), src.host_span<float>().begin());
  mgpu::copy_async(model.master_parameters(), src, stream);
  model.sync_parameters(stream);
  stream.synchronize();
}

// The layout the flags ask for, checked against the devices before anything is built.
// `size`: the world's devices (this process's group's, or across processes every process's).
void check_layout(Options const& o, bool pipelined, int size) {
  auto const refuse = [](std::string const& what) { throw mgpu::Error(mgpu::Errc::invalid_argument, what); };
  if (o.zero < 0 || o.zero > 3)
    refuse("--zero " + std::to_string(o.zero) + " (expected 0, the replicated update, 1, ZeRO-1: the sharded update and "
           "optimizer state, 2, ZeRO-2: the gradients sharded too, or 3, ZeRO-3: the parameters too)");
  if (o.zero >= 2 && o.precision != "fp32")
    refuse("--zero " + std::to_string(o.zero) + " with --precision " + o.precision +
           " (expected fp32: sharded gradients are float32 only for now)");
  if (o.bucket_kb > 0 && (pipelined || o.tp > 1))
    refuse("--bucket-kb with " + (pipelined ? std::string("a pipeline") : "--tp " + std::to_string(o.tp)) +
           " (expected --bucket-kb with data parallelism only)");
  if (o.zero_given && (pipelined || o.tp > 1))
    refuse("--zero " + std::to_string(o.zero) + " with " + (pipelined ? std::string("a pipeline") : "--tp " + std::to_string(o.tp)) +
           " (expected --zero with data parallelism only: the pipeline and tensor-parallel executors do not shard their "
           "update)");
  if (o.sequence_parallel && o.tp < 2)
    refuse("--sequence-parallel with --tp " + std::to_string(o.tp) +
           " (expected --tp 2 or more: it splits the tensor-parallel devices' tokens)");
  if (o.tp > 1) {
    if (o.sequence_parallel && o.block_size % o.tp != 0)
      refuse("--sequence-parallel with --block-size " + std::to_string(o.block_size) + " over --tp " +
             std::to_string(o.tp) + " (expected a block size divisible by --tp)");
    int const stages = pipelined ? o.stages : 1;
    if (size != o.tp * o.dp * stages)
      refuse("--devices " + o.devices + " has " + std::to_string(size) + " devices (expected --dp x --tp" +
             (pipelined ? " x --stages = " : " = ") + std::to_string(o.tp * o.dp * stages) + ")");
    if (o.batch_size < o.dp)
      refuse("--batch-size " + std::to_string(o.batch_size) + " with --dp " + std::to_string(o.dp) +
             " (expected at least one row per replica)");
    if (pipelined && !o.checkpoint.empty())
      refuse("--tp " + std::to_string(o.tp) + " with --stages " + std::to_string(o.stages) +
             " and --checkpoint (expected --checkpoint with --tp alone: a pipeline's tensor-parallel chunks do not save yet)");
    return;
  }
  if (pipelined) {
    if (size != o.stages * o.dp)
      refuse("--devices " + o.devices + " has " + std::to_string(size) + " devices (expected --stages x --dp = " +
             std::to_string(o.stages * o.dp) + ")");
    return;
  }
  if (o.micro_batches != 1)
    refuse("--micro-batches " + std::to_string(o.micro_batches) +
           " without a pipeline (expected --schedule or --stages > 1: micro-batches are a pipeline's)");
  if (o.dp != 1 && o.dp != size)
    refuse("--dp " + std::to_string(o.dp) + " with --devices " + o.devices + " (expected the number of devices, " +
           std::to_string(size) + ": one replica per device)");
}

mgpu::nn::Recompute recompute_of(std::string const& name) {
  for (auto const r : {mgpu::nn::Recompute::none, mgpu::nn::Recompute::selective, mgpu::nn::Recompute::full})
    if (mgpu::nn::to_string(r) == name) return r;
  throw mgpu::Error(mgpu::Errc::invalid_argument, "--recompute " + name + " (expected none, selective or full)");
}

// Each layer's forward + backward FLOPs for a micro-batch of `rows` sequences (3x the forward's
// multiply-adds x 2; element-wise layers count one pass), the costs the stages are cut by; a
// block's recomputation adds its attention core's forward (selective) or its whole forward (full).
mgpu::pipeline::LayerProfile layer_costs(mgpu::nn::Sequential const& model, mgpu::nn::GptConfig const& c,
                                         std::int64_t rows) {
  auto const tokens = static_cast<double>(rows * c.block_size);
  auto const t = static_cast<double>(c.block_size), w = static_cast<double>(c.n_embd);
  mgpu::pipeline::LayerProfile profile;
  for (std::size_t l = 0; l < model.size(); ++l) {
    mgpu::nn::Layer const& layer = model.layer(l);
    double forward = tokens * w;  // embedding lookup, dropout, LayerNorm: one pass
    double rerun = 0;
    if (auto const* block = dynamic_cast<mgpu::nn::TransformerBlock const*>(&layer)) {
      double const core = 2 * tokens * t * w;    // causal QK^T and PV
      forward = 2 * tokens * 12 * w * w + core;  // and four Linears (12 C^2)
      rerun = block->recompute() == mgpu::nn::Recompute::full        ? forward
              : block->recompute() == mgpu::nn::Recompute::selective ? core
                                                                     : 0.0;
    } else if (dynamic_cast<mgpu::nn::TiedLMHead const*>(&layer) != nullptr) {
      forward = 2 * tokens * w * static_cast<double>(c.vocab);
    }
    profile.seconds.push_back(3 * forward + rerun);  // FLOPs in the seconds' place: partition() compares them only
    profile.parameter_bytes.push_back(static_cast<double>(layer.parameter_count()) * sizeof(float));
    profile.activation_bytes.push_back(0.0);  // not modelled: the stages are cut by time
  }
  return profile;
}

// What --plan chose, and what it weighed.
struct Planned {
  mgpu::plan::Plan plan;
  std::size_t memory_bytes = 0;
};

// --plan auto: measures the GPT's costs on the devices, plans its layout for the batch, prints the
// choice and the runner-up, and writes the choice into the layout flags.
Planned plan_layout(Options& o, mgpu::nn::GptConfig const& config, int processes, FILE* log) {
  if (!o.layout_flags.empty())
    throw mgpu::Error(mgpu::Errc::invalid_argument, "--plan " + o.plan + " with " + o.layout_flags +
                                                        " (expected no layout flags: the planner chooses them)");
  if (processes > 1)
    throw mgpu::Error(mgpu::Errc::invalid_argument, "--plan " + o.plan + " in a job of " + std::to_string(processes) +
                                                        " processes (expected one process: the planner lays out one process's devices)");
  if (o.precision != "fp32")
    throw mgpu::Error(mgpu::Errc::invalid_argument,
                      "--plan " + o.plan + " with --precision " + o.precision + " (expected fp32: the memory model is float32's)");
  mgpu::DeviceGroup group(o.devices);
  int const devices = group.size();
  // Costs at one row, a replica's rows and the whole batch: the lines through them cover every
  // layout's micro-batches.
  std::vector<std::int64_t> rows{1, std::max<std::int64_t>(1, o.batch_size / devices), o.batch_size};
  rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
  mgpu::plan::GptCosts const costs = mgpu::plan::measure_gpt_costs(config, group, rows);
  Planned planned;
  planned.memory_bytes = std::numeric_limits<std::size_t>::max();
  for (mgpu::sched::DeviceState const& d : mgpu::sched::node_state(group).devices)
    planned.memory_bytes = std::min(planned.memory_bytes, static_cast<std::size_t>(d.free_bytes));
  if (o.device_memory_mb > 0) planned.memory_bytes = static_cast<std::size_t>(o.device_memory_mb) << 20;
  planned.plan = mgpu::plan::plan_gpt(config, o.batch_size, devices, costs, {.memory_bytes = planned.memory_bytes});
  std::vector<mgpu::plan::Candidate> const& ranked = planned.plan.candidates;
  mgpu::plan::Layout const& chosen = ranked.front().layout;
  o.dp = chosen.data_parallel, o.tp = chosen.tensor_parallel, o.stages = chosen.stages;
  o.zero = chosen.zero_stage, o.micro_batches = chosen.micro_batches, o.plan_cuts = chosen.cuts;
  o.sequence_parallel = chosen.sequence_parallel;
  o.recompute = std::string(mgpu::nn::to_string(chosen.recompute));
  if (chosen.stages > 1) o.schedule = "1f1b";
  std::fprintf(log, "plan: %zu of %zu layouts over %s fit %.1f MiB per device; ranked by step time from measured costs\n",
               ranked.size(), planned.plan.considered, o.devices.c_str(), static_cast<double>(planned.memory_bytes) / (1 << 20));
  for (std::size_t i = 0; i < std::min<std::size_t>(2, ranked.size()); ++i)
    std::fprintf(log, "  %s %s: predicted %.1f ms per step, %.2f MB per device\n", i == 0 ? "chosen:   " : "runner-up:",
                 mgpu::plan::to_string(ranked[i].layout).c_str(), ranked[i].step_seconds * 1e3,
                 static_cast<double>(ranked[i].peak_bytes) / 1e6);
  return planned;
}

// The "plan" field of --json: the chosen layout and its predictions, the runner-up, the counts.
std::string plan_json(std::optional<Planned> const& planned) {
  if (!planned) return "null";
  auto const layout = [](mgpu::plan::Candidate const& c) {
    char text[400];
    std::snprintf(text, sizeof text,
                  "{\"dp\": %d, \"tp\": %d, \"pp\": %d, \"zero\": %d, \"sequence_parallel\": %s, \"recompute\": \"%s\", "
                  "\"micro_batches\": %d, \"predicted_step_s\": %.6g, \"predicted_peak_bytes\": %zu}",
                  c.layout.data_parallel, c.layout.tensor_parallel, c.layout.stages, c.layout.zero_stage,
                  c.layout.sequence_parallel ? "true" : "false",
                  std::string(mgpu::nn::to_string(c.layout.recompute)).c_str(), c.layout.micro_batches, c.step_seconds,
                  c.peak_bytes);
    return std::string(text);
  };
  std::vector<mgpu::plan::Candidate> const& ranked = planned->plan.candidates;
  std::string json = layout(ranked.front());
  json.pop_back();
  return json + ", \"runner_up\": " + (ranked.size() > 1 ? layout(ranked[1]) : std::string("null")) +
         ", \"fit\": " + std::to_string(ranked.size()) + ", \"considered\": " + std::to_string(planned->plan.considered) +
         ", \"memory_bytes\": " + std::to_string(planned->memory_bytes) + "}";
}

std::string printable(std::string const& text) {
  std::string out;
  for (unsigned char const c : text)
    out += (c == '\n' || c == '\t' || (c >= 32 && c < 127)) ? static_cast<char>(c) : '?';
  return out;
}

int run(Options o) {
  mgpu::dist::Session session;  // the job's processes (one without a launcher)
  int const processes = session.place().size;
  bool const speaker = session.place().rank == 0;  // process 0 prints
  // The other processes' output goes nowhere.
  std::unique_ptr<FILE, int (*)(FILE*)> const quiet(speaker ? nullptr : std::fopen("/dev/null", "w"), &std::fclose);
  if (!speaker && !quiet)
    throw mgpu::Error(mgpu::Errc::io,
                      "cannot open /dev/null for process " + std::to_string(session.place().rank) + "'s output");
  FILE* const log = !speaker ? quiet.get() : o.json ? stderr : stdout;
  bool const terminal = speaker && !o.no_progress && (o.progress || ::isatty(STDERR_FILENO) != 0);
  // The model: from the flags, or the architecture and weights of an llm.c model file.
  std::optional<mgpu::io::LlmcModel> init;
  if (!o.init_from.empty()) {
    init = mgpu::io::read_llmc_model(o.init_from);
    o.n_layer = init->config.n_layer, o.n_head = init->config.n_head, o.n_embd = init->config.n_embd;
    o.block_size = init->config.block_size;
    if (init->config.vocab < o.vocab)
      throw mgpu::Error(mgpu::Errc::invalid_argument,
                        "--init-from " + o.init_from + ": vocab " + std::to_string(init->config.vocab) +
                            " (expected at least the data's " + std::to_string(o.vocab) + ")");
  }
  mgpu::nn::GptConfig config{.vocab = init ? init->config.vocab : o.vocab,
                                   .block_size = o.block_size,
                                   .n_layer = o.n_layer,
                                   .n_head = o.n_head,
                                   .n_embd = o.n_embd,
                                   .dropout = o.dropout,
                                   .recompute = recompute_of(o.recompute)};
  if (o.plan.empty() && o.device_memory_mb > 0)
    throw mgpu::Error(mgpu::Errc::invalid_argument, "--device-memory without --plan (expected --plan auto: it is the planner's budget)");
  Splits const splits = load_splits(o);  // before planning: a bad --data is refused at once
  if (o.devices.empty() && !o.plan.empty())  // the planner lays out the machine's cores
    o.devices = "host:" + std::to_string(std::max(1u, std::thread::hardware_concurrency()));
  std::optional<Planned> const planned = o.plan.empty() ? std::nullopt : std::optional<Planned>(plan_layout(o, config, processes, log));
  config.recompute = recompute_of(o.recompute);
  bool const pipelined = !o.schedule.empty() || o.stages > 1;
  if (pipelined && o.schedule.empty()) o.schedule = "1f1b";
  if (o.devices.empty())
    o.devices = "host:" + std::to_string(std::max(1, (o.tp > 1    ? o.tp * o.dp * (pipelined ? o.stages : 1)
                                                      : pipelined ? o.stages * o.dp
                                                                  : o.dp) /
                                                         processes));
  mgpu::DeviceGroup group(o.devices);
  int const tp_stages = pipelined ? o.stages : 1;  // the stages of a data x tensor x pipeline grid
  if (o.tp > 1 && o.dp * tp_stages > 1 && group.size() == o.tp * o.dp * tp_stages) {
    // Each tensor-parallel group all-reduces in every block: the scheduler puts each on the best
    // links of the link matrix (consecutive ranks form a group; equal links keep the order).
    // The executors' ranks form the mesh dp x tp x pp: the order's group g is the mesh's g-th group
    // along tp (stage s of replica a, g = a x stages + s).
    std::vector<int> ranks(static_cast<std::size_t>(group.size()));
    std::iota(ranks.begin(), ranks.end(), 0);
    std::vector<int> const order = mgpu::sched::tensor_parallel_order(mgpu::sched::node_state(group), ranks, o.tp);
    mgpu::comm::DeviceMesh const mesh({{"dp", o.dp}, {"tp", o.tp}, {"pp", tp_stages}});
    std::vector<int> placed(order.size());
    for (std::size_t i = 0; i < order.size(); ++i)
      placed[static_cast<std::size_t>(mesh.at("tp", static_cast<int>(i) / o.tp, static_cast<int>(i) % o.tp))] = order[i];
    if (placed != ranks) {
      std::vector<mgpu::Device> devices;
      for (int const r : placed) devices.push_back(group.device(r));
      std::string text;
      for (std::size_t i = 0; i < order.size(); ++i)
        text += (i == 0 ? "" : i % static_cast<std::size_t>(o.tp) == 0 ? " | " : ", ") + group.device(order[i]).to_string();
      group = mgpu::DeviceGroup(std::move(devices));
      std::fprintf(log, "tensor-parallel groups on the best links: %s\n", text.c_str());
    }
  }
  mgpu::dist::World const world = mgpu::dist::make_world(group);
  bool const across = world.processes > 1;
  check_layout(o, pipelined, world.size());
  mgpu::Device const device = group.device(0);
  if (o.resume && o.checkpoint.empty())
    throw mgpu::Error(mgpu::Errc::invalid_argument, "--resume without --checkpoint (expected --checkpoint PATH)");


  auto allocator = mgpu::Allocator::create(device);
  auto host = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  mgpu::Stream stream(device);
  mgpu::nn::Context ctx{*allocator, stream};
  // The one model; pipelined, the whole model in float32 that evaluation and sampling read (the
  // chunks are made from it and gathered back into it).
  mgpu::nn::Sequential model = mgpu::nn::gpt(config);
  model.materialize(ctx, o.seed, pipelined ? mgpu::DType::float32 : examples::precision(o.precision));
  if (init) set_parameters(model, init->parameters, stream);
  mgpu::optim::AdamWOptions const adamw{.lr = o.lr,
                                        .beta1 = 0.9f,
                                        .beta2 = 0.95f,
                                        .eps = 1e-8f,
                                        .weight_decay = o.weight_decay,
                                        .decay_ranges = model.matrix_ranges()};
  mgpu::optim::AdamW optimizer(adamw);
  auto const timeline = o.trace.empty() ? nullptr : std::make_shared<mgpu::trace::Timeline>();
  if (timeline) timeline->enable(false);  // the last step only
  // The live metrics, where the executors below report their devices' times.
  bool const data_parallel = !pipelined && o.tp == 1 && world.size() > 1;
  examples::JobMetrics metrics(o.metrics, "train_gpt",
                               {.dp = data_parallel ? world.size() : o.dp, .tp = o.tp, .pp = pipelined ? o.stages : 1, .zero = data_parallel ? o.zero : 0},
                               world, log);
  // Several devices: replicas of `model` (weights broadcast from it), trained data parallel.
  std::unique_ptr<mgpu::parallel::DataParallel> parallel;
  std::size_t bucket_cap = mgpu::parallel::DataParallelOptions{}.bucket_cap_bytes;  // for the memory model
  std::size_t first_bucket_cap = mgpu::parallel::DataParallelOptions{}.first_bucket_cap_bytes;
  bool const block_units = o.bucket_kb == 0;  // --zero 3's units: a transformer block each, or --bucket-kb's buckets
  if (data_parallel) {
    mgpu::parallel::DataParallelOptions options;
    options.metrics = metrics.registry();
    if (across) options.make_communicator = mgpu::dist::communicator_factory(world);
    options.seed = o.seed;
    options.compute = examples::precision(o.precision);
    options.clip_norm = o.clip;
    options.zero_stage = o.zero;
    if (o.bucket_kb > 0) {
      options.bucket_cap_bytes = static_cast<std::size_t>(o.bucket_kb) << 10;
      options.first_bucket_cap_bytes = std::min(options.first_bucket_cap_bytes, options.bucket_cap_bytes);
    }
    options.zero3_block_units = block_units;
    bucket_cap = options.bucket_cap_bytes, first_bucket_cap = options.first_bucket_cap_bytes;
    if (o.precision == "fp16") options.loss_scaler.emplace();
    options.loss = std::make_shared<mgpu::nn::TokenCrossEntropy>();
    options.timeline = timeline;
    parallel = std::make_unique<mgpu::parallel::DataParallel>(std::move(model), group, optimizer, std::move(options));
  }
  // Pipelined: stages cut by FLOPs for the devices' speeds, an AdamW per chunk decaying its own
  // weight matrices, and the model's weights (its seed's, or --init-from's) copied into the chunks.
  std::unique_ptr<mgpu::pipeline::Executor> pipeline;
  std::vector<std::size_t> cuts;  // the pipeline's, for the memory model
  if (pipelined) {
    mgpu::pipeline::Schedule schedule = o.schedule == "layer-split"
                                            ? mgpu::pipeline::layer_split(o.stages)
                                            : mgpu::pipeline::make_schedule(o.schedule, o.stages, o.micro_batches, o.chunks);
    if (o.schedule == "layer-split" && o.micro_batches != 1)
      throw mgpu::Error(mgpu::Errc::invalid_argument, "--schedule layer-split with --micro-batches " +
                                                          std::to_string(o.micro_batches) + " (expected 1: one batch through the stages in turn)");
    std::int64_t const micro_rows = std::max<std::int64_t>(1, o.batch_size / (schedule.micro_batches * o.dp));
    mgpu::pipeline::LayerProfile const costs = layer_costs(model, config, micro_rows);
    mgpu::pipeline::Partition const plan =
        mgpu::pipeline::partition(model, schedule, costs,
                                  across ? examples::world_stage_devices(world, schedule.devices)
                                         : mgpu::pipeline::stage_devices(group, schedule.devices),
                                  {.optimizer_states = 2});
    cuts = o.plan_cuts.empty() ? plan.cuts : o.plan_cuts;  // the planner cut by its measured costs
    mgpu::pipeline::ExecutorOptions options{.seed = o.seed,
                                            .data_parallel = o.dp,
                                            .compute = examples::precision(o.precision),
                                            .clip_norm = o.clip,
                                            .loss = std::make_shared<mgpu::nn::TokenCrossEntropy>(),
                                            .timeline = timeline};
    if (o.tp > 1) options.tensor_parallel = mgpu::pipeline::tensor_parallel_stages(config, o.tp, o.sequence_parallel);
    if (metrics || terminal) options.metrics = metrics.registry();  // timing costs ~0.2 us an action: only when read
    if (o.precision == "fp16") options.loss_scaler.emplace();
    if (across) {
      options.make_communicator = mgpu::dist::communicator_factory(world);
      options.make_subset_communicator = mgpu::dist::subset_communicator_factory(world);
    }
    pipeline = std::make_unique<mgpu::pipeline::Executor>(
        model, group, cuts, std::move(schedule),
        [&adamw](mgpu::nn::Sequential const& chunk) {
          mgpu::optim::AdamWOptions options = adamw;
          options.decay_ranges = chunk.matrix_ranges();
          return std::make_unique<mgpu::optim::AdamW>(options);
        },
        std::move(options));
    pipeline->scatter_parameters(model, stream);
    FILE* const out = log;
    std::fprintf(out, "%s over %d stage(s) x %d replica(s) x %d tensor-parallel rank(s), %d micro-batches (about %.3g sequences each); chunks cut by FLOPs:\n",
                 pipeline->schedule().name.c_str(), o.stages, o.dp, o.tp, pipeline->schedule().micro_batches,
                 static_cast<double>(o.batch_size) / (pipeline->schedule().micro_batches * o.dp));
    for (std::size_t c = 0; c + 1 < cuts.size(); ++c) {
      double flops = 0, bytes = 0;
      for (std::size_t l = cuts[c]; l < cuts[c + 1]; ++l) flops += costs.seconds[l], bytes += costs.parameter_bytes[l];
      std::fprintf(out, "  chunk %zu on device %d: layers [%zu, %zu), %.3g GFLOP per micro-batch, %.1f MiB of parameters\n", c,
                   plan.device[c], cuts[c], cuts[c + 1], flops * 1e-9, bytes / (1 << 20));
    }
  }
  // Tensor parallel: the shards materialized from the seed (the model's weights), or --init-from's.
  std::unique_ptr<mgpu::parallel::TensorParallel> tensor;
  if (o.tp > 1 && !pipelined) {
    mgpu::optim::AdamWOptions options = adamw;
    options.decay_ranges.clear();  // each shard decays its own 2-D weights
    mgpu::parallel::TensorParallelOptions tp_options{.seed = o.seed,
                                                     .adamw = options,
                                                     .clip_norm = o.clip,
                                                     .data_parallel = o.dp,
                                                     .sequence_parallel = o.sequence_parallel,
                                                     .compute = examples::precision(o.precision),
                                                     .metrics = metrics || terminal ? metrics.registry() : nullptr};
    if (o.precision == "fp16") tp_options.loss_scaler.emplace();
    tp_options.timeline = timeline;
    if (across) {  // the grid over the world's devices, each process passing the whole batch
      tp_options.make_communicator = mgpu::dist::communicator_factory(world);
      tp_options.make_subset_communicator = mgpu::dist::subset_communicator_factory(world);
    }
    tensor = std::make_unique<mgpu::parallel::TensorParallel>(group, config, std::move(tp_options));
    if (init) tensor->scatter_parameters(host_parameters(model, stream));
  }
  // What evaluation, checkpoints and sampling read: the one model, replica 0 on rank 0, or the
  // whole model gathered from the pipeline's chunks or the tensor-parallel shards.
  mgpu::nn::Sequential& net = parallel ? parallel->replica(0) : model;
  mgpu::optim::Optimizer& net_optimizer = parallel ? parallel->optimizer(0) : optimizer;
  if (parallel) parallel->reshard();  // ZeRO: what those gathered whole back to each rank's shards
  mgpu::Stream& net_stream = parallel ? group.stream(0) : stream;
  mgpu::nn::Context net_ctx{parallel ? group.allocator(0) : *allocator, net_stream};
  Trainer trainer{net, net_optimizer, net_ctx, device, o.clip, std::nullopt, parallel.get(), pipeline.get(), timeline.get()};
  trainer.tensor = tensor.get();
  if (across) {  // each process's rows: shares by its devices' speeds, as train_mlp splits them
    trainer.process_weights.assign(static_cast<std::size_t>(world.processes), 0.0);
    for (mgpu::dist::WorldDevice const& d : world.devices)
      trainer.process_weights[static_cast<std::size_t>(d.process)] += d.device.speed;
    trainer.process = world.process;
  }
  if (o.precision == "fp16" && !parallel && !pipeline) trainer.scaler.emplace();
  auto const gather = [&] {
    if (parallel) (void)parallel->replica(0);  // ZeRO-3: the shards gathered into the whole model
    if (pipeline) pipeline->gather_parameters(model, stream);
    if (tensor) set_parameters(model, tensor->gather_parameters(), stream);
  };
  // One checkpoint format for every layout: a run may resume on another one.
  auto const save = [&](mgpu::io::TrainingState const& at) {
    if (parallel) {
      parallel->save(o.checkpoint, at);
      parallel->reshard();
    } else if (pipeline) {
      pipeline->save(o.checkpoint, at);
    } else if (tensor) {
      tensor->save(o.checkpoint, at);
    } else {
      mgpu::io::save_training(o.checkpoint, model, optimizer, at, stream);
    }
  };

  mgpu::io::TrainingState state{.data_seed = o.seed};
  if (o.resume && fs::exists(o.checkpoint)) {
    state = parallel   ? parallel->load(o.checkpoint)
            : pipeline ? pipeline->load(o.checkpoint)
            : tensor   ? tensor->load(o.checkpoint)
                       : mgpu::io::load_training(o.checkpoint, model, optimizer, *allocator, stream);
    if (parallel) parallel->reshard();
    std::fprintf(log, "resumed from %s at step %lld\n", o.checkpoint.c_str(), static_cast<long long>(state.step));
  }
  mgpu::data::TokenLoader train_loader(splits.train, o.vocab,
                                       {.batch = o.batch_size, .block = o.block_size, .seed = state.data_seed});
  mgpu::data::TokenLoader const val_loader(splits.val, o.vocab,
                                           {.batch = o.batch_size, .block = o.block_size, .sequential = true});
  train_loader.seek(state.step);
  std::int64_t const eval_windows = o.eval_iters * o.batch_size;
  auto const evaluate = [&] {
    gather();
    double const loss = mgpu::data::evaluate_lm(net, val_loader, eval_windows, net_ctx);
    if (parallel) parallel->reshard();
    return loss;
  };

  std::fprintf(log,
               "mgpu %s: GPT of %lld parameters (n_layer %lld, n_head %lld, n_embd %lld, block %lld, vocab %lld) on %s "
               "(%s); data %s: %lld train / %lld val tokens\n",
               mgpu::version, static_cast<long long>(net.parameter_count()), static_cast<long long>(o.n_layer),
               static_cast<long long>(o.n_head), static_cast<long long>(o.n_embd), static_cast<long long>(o.block_size),
               static_cast<long long>(config.vocab), o.devices.c_str(), o.precision.c_str(),
               splits.description.c_str(), static_cast<long long>(count_tokens(splits.train)),
               static_cast<long long>(count_tokens(splits.val)));

  // This process's devices: peak_bytes reports each one's largest allocator peak over a training
  // step (evaluation runs on a gathered model between steps; it is not part of one).
  bool const several = parallel || pipeline || tensor;
  std::vector<mgpu::Allocator*> local_allocators;
  for (int r = 0; r < (several ? static_cast<int>(group.size()) : 1); ++r)
    local_allocators.push_back(several ? &group.allocator(r) : allocator.get());
  std::vector<std::size_t> step_peaks(local_allocators.size(), 0);
  int const replicas = parallel ? world.size() : o.dp;

  double val_loss = NAN;
  float train_loss = NAN;
  double train_seconds = 0;
  std::int64_t trained_steps = 0;
  if (o.eval_only) {
    val_loss = evaluate();
    std::fprintf(log, "val loss %.4f over the first %lld windows of %lld tokens\n", val_loss,
                 static_cast<long long>(eval_windows), static_cast<long long>(o.block_size));
  } else {
    std::int64_t const log_every = o.log_every > 0 ? o.log_every : std::max<std::int64_t>(1, o.iters / 20);
    auto const report_val = [&](std::int64_t step) {
      val_loss = evaluate();
      if (terminal) examples::clear_progress();
      std::fprintf(log, "step %lld/%lld  val loss %.4f\n", static_cast<long long>(step),
                   static_cast<long long>(o.iters), val_loss);
      std::fflush(log);
    };
    if (o.eval_every > 0 && state.step < o.iters) report_val(state.step);
    auto window_start = Clock::now();
    std::int64_t window_steps = 0;
    std::int64_t const last = o.until_step > 0 ? std::min(o.until_step, o.iters) : o.iters;
    for (std::int64_t it = state.step; it < last; ++it) {
      auto const start = Clock::now();
      if (timeline && it + 1 == last) timeline->enable(true);
      mgpu::data::TokenBatch const batch = train_loader.next(*host);  // host ids, copied by train_step if needed
      for (mgpu::Allocator* a : local_allocators) a->reset_peak();
      std::int64_t const skipped_before = trainer.scaler ? trainer.scaler->skipped() : 0;
      StepLoss const loss = trainer.train_step(batch, lr_at(o, it) / o.lr);
      bool const report = (it + 1) % log_every == 0 || it + 1 == last;
      if (report || terminal || metrics)
        train_loss = loss.read(net_stream);  // reading synchronizes
      else
        net_stream.synchronize();
      for (std::size_t r = 0; r < local_allocators.size(); ++r)
        step_peaks[r] = std::max(step_peaks[r], local_allocators[r]->stats().peak_allocated);
      double const step_s = std::chrono::duration<double>(Clock::now() - start).count();
      train_seconds += step_s;
      std::vector<mgpu::metrics::DeviceStep> const devices =
          metrics || terminal ? metrics.devices(world, local_allocators, parallel ? &trainer.last_dp : nullptr,
                                                              parallel ? parallel->weights() : std::vector<double>{},
                                                              o.batch_size / replicas, o.block_size)
                              : std::vector<mgpu::metrics::DeviceStep>{};
      if (metrics) {
        bool const skipped = parallel ? !trainer.last_dp.applied : trainer.scaler && trainer.scaler->skipped() > skipped_before;
        std::optional<double> const scale = trainer.scaler ? std::optional<double>(trainer.scaler->scale()) : std::nullopt;
        metrics.record({.step = it + 1, .loss = train_loss, .seconds = step_s, .samples = o.batch_size,
                        .tokens = o.batch_size * o.block_size, .learning_rate = lr_at(o, it), .loss_scale = scale, .skipped = skipped},
                       devices);
      }
      ++trained_steps, ++window_steps;
      state.step = it + 1;
      double const window_s = std::chrono::duration<double>(Clock::now() - window_start).count();
      double const tokens_per_s = static_cast<double>(window_steps * o.batch_size * o.block_size) / window_s;
      if (terminal)
        examples::draw_progress(it + 1, o.iters, train_loss, tokens_per_s,
                                train_seconds / static_cast<double>(trained_steps) * static_cast<double>(last - it - 1),
                                devices, step_s);
      if (report) {
        if (terminal) examples::clear_progress();
        std::fprintf(log, "step %lld/%lld  loss %.4f  lr %.2e  %.0f tokens/s\n", static_cast<long long>(it + 1),
                     static_cast<long long>(o.iters), train_loss, lr_at(o, it), tokens_per_s);
        std::fflush(log);
        window_start = Clock::now();
        window_steps = 0;
      }
      if (o.eval_every > 0 && ((it + 1) % o.eval_every == 0 || it + 1 == last)) {
        report_val(it + 1);
        if (!o.checkpoint.empty()) save(state);
        window_start = Clock::now();
        window_steps = 0;
      }
    }
    if (!o.checkpoint.empty()) save(state);
    if (std::isnan(val_loss)) val_loss = evaluate();
    if (timeline && speaker) {  // process 0's ranks
      timeline->enable(false);
      timeline->write_chrome_trace(o.trace);
      std::fprintf(log, "timeline of the last step: %s\n", o.trace.c_str());
    }
  }
  gather();

  if (!speaker) return 0;  // the others have done their part (the gathers)
  if (!o.save_llmc.empty()) {
    mgpu::io::write_llmc_model(o.save_llmc, config, host_parameters(net, net_stream));
    std::fprintf(log, "llm.c model file written to %s\n", o.save_llmc.c_str());
  }
  if (o.sample > 0) {
    // Generation runs on the host in float32: a model trained elsewhere or in 16 bits is copied.
    mgpu::Stream host_stream(mgpu::Device{mgpu::DeviceKind::host, 0});
    mgpu::nn::Context host_ctx{*host, host_stream};
    std::optional<mgpu::nn::Sequential> copy;
    mgpu::nn::Sequential const* sampler = &net;
    if (device.kind != mgpu::DeviceKind::host || net.compute_type() != mgpu::DType::float32) {
      copy.emplace(mgpu::nn::gpt(config));
      copy->materialize(host_ctx, o.seed);
      set_parameters(*copy, host_parameters(net, net_stream), host_stream);
      sampler = &*copy;
    }
    net_stream.synchronize();
    std::vector<std::uint16_t> const prompt16 = mgpu::data::ByteTokenizer{}.encode(o.prompt);
    std::vector<std::int32_t> const prompt(prompt16.begin(), prompt16.end());
    std::vector<std::int32_t> const ids =
        mgpu::nn::generate(*sampler, prompt, o.sample, {.temperature = o.temperature, .top_k = o.top_k, .seed = o.seed},
                           copy ? host_ctx : net_ctx);
    std::fprintf(log, "---- %lld sampled tokens (temperature %.2f, top-k %lld) ----\n",
                 static_cast<long long>(o.sample), o.temperature, static_cast<long long>(o.top_k));
    if (config.vocab <= 256) {
      std::vector<std::uint16_t> const bytes(ids.begin(), ids.end());
      std::fprintf(log, "%s%s\n", printable(o.prompt).c_str(),
                   printable(mgpu::data::ByteTokenizer{}.decode(bytes)).c_str());
    } else {
      for (std::int32_t const id : ids) std::fprintf(log, "%d ", id);
      std::fprintf(log, "\n");
    }
    std::fprintf(log, "----\n");
  }

  double const tokens_per_s =
      train_seconds > 0 ? static_cast<double>(trained_steps * o.batch_size * o.block_size) / train_seconds : 0.0;
  std::string devices, peaks;
  for (std::size_t r = 0; r < local_allocators.size(); ++r) {
    devices += std::string(r ? ", " : "") + "\"" + (several ? group.device(static_cast<int>(r)) : device).to_string() + "\"";
    // --eval-only trains no step: the peak of its evaluation
    std::size_t const peak = trained_steps > 0 ? step_peaks[r] : local_allocators[r]->stats().peak_allocated;
    peaks += (r ? ", " : "") + std::to_string(peak);
  }
  // The memory model's prediction of those peaks, for the layouts it covers (one process, float32;
  // tensor parallelism; GPipe or 1F1B pipelines, of tensor-parallel stages too, and their replicas).
  std::string predicted = "null";
  bool const modelled_pipeline = !pipeline || o.schedule == "gpipe" || o.schedule == "1f1b";
  if (!across && modelled_pipeline && o.precision == "fp32") {
    mgpu::parallel::GptLayout const layout{.data_parallel = parallel ? static_cast<int>(group.size()) : o.dp,
                                           .tensor_parallel = o.tp,
                                           .zero_stage = parallel ? o.zero : 0,
                                           .bucket_cap_bytes = bucket_cap,
                                           .first_bucket_cap_bytes = first_bucket_cap,
                                           .zero3_block_units = block_units,
                                           .cuts = cuts,
                                           .micro_batches = pipeline ? pipeline->schedule().micro_batches : 1,
                                           .gpipe = o.schedule == "gpipe",
                                           .sequence_parallel = o.sequence_parallel};
    predicted.clear();
    for (mgpu::parallel::GptMemory const& m : mgpu::parallel::predict_gpt_memory(config, o.batch_size, layout))
      predicted += (predicted.empty() ? "[" : ", ") + std::to_string(m.total());
    predicted += "]";
  }
  if (across) {  // the world's
    devices.clear();
    for (mgpu::dist::WorldDevice const& d : world.devices)
      devices += (d.rank ? ", \"" : "\"") + examples::device_name(world, d) + "\"";
  }
  if (o.json) {
    std::printf(
        "{\"tokens_per_s\": %.6g, \"train_loss\": %.6g, \"val_loss\": %.6g, \"params\": %lld, \"devices\": [%s], "
        "\"iters\": %lld, \"peak_bytes\": [%s], \"predicted_peak_bytes\": %s, \"precision\": \"%s\", \"eval_windows\": %lld, \"schedule\": \"%s\", "
        "\"stages\": %d, \"micro_batches\": %d, \"dp\": %d, \"recompute\": \"%s\", \"tp\": %d, "
        "\"sequence_parallel\": %s, \"zero\": %d, \"processes\": %d, \"plan\": %s}\n",
        tokens_per_s, std::isnan(train_loss) ? -1.0 : train_loss, val_loss,
        static_cast<long long>(net.parameter_count()), devices.c_str(), static_cast<long long>(state.step),
        peaks.c_str(), predicted.c_str(), o.precision.c_str(), static_cast<long long>(eval_windows),
        pipeline   ? pipeline->schedule().name.c_str()
        : parallel ? "data-parallel"
        : tensor   ? "tensor-parallel"
                   : "none",
        pipeline ? o.stages : 1, pipeline ? pipeline->schedule().micro_batches : 1, parallel ? world.size() : o.dp,
        o.recompute.c_str(), o.tp, o.sequence_parallel ? "true" : "false", parallel ? o.zero : 0, world.processes,
        plan_json(planned).c_str());
  } else {
    std::printf("final: train loss %.4f, val loss %.4f, %.0f tokens/s on %s\n", train_loss, val_loss, tokens_per_s,
                o.devices.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Train a GPT language model with mgpu"};
  Options o;
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
                 "ZeRO stage of data parallelism: 1 shards the update and the optimizer state, 2 the gradients too, 3 "
                 "the parameters too, 0 replicates them")
      ->capture_default_str();
  app.add_option("--bucket-kb", o.bucket_kb,
                 "data parallelism's gradient bucket cap in KiB (default 25600; smaller buckets, smaller ZeRO-2 staging); with --zero 3 "
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
  CLI11_PARSE(app, argc, argv);
  o.zero_given = app.count("--zero") > 0;
  for (char const* flag : {"--dp", "--tp", "--stages", "--schedule", "--micro-batches", "--chunks", "--zero", "--bucket-kb",
                           "--recompute", "--sequence-parallel"})
    if (app.count(flag) > 0) o.layout_flags += (o.layout_flags.empty() ? "" : ", ") + std::string(flag);
  try {
    return run(o);
  } catch (mgpu::Error const& e) {
    std::fprintf(stderr, "\ntrain_gpt: %s\n", e.what());
    return 2;
  } catch (std::exception const& e) {
    std::fprintf(stderr, "\ntrain_gpt: unexpected error: %s\n", e.what());
    return 1;
  }
}
