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
// weight decay on the weight matrices only, by train::Trainer in the layout the flags (or --plan
// auto) give as a train::ParallelConfig; train_gpt_flags.hpp lists the layouts and their flags.
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
// reads on any process count, layout or device count (one device too).
//   mpirun -np 2 train_gpt --data notes.txt --devices host:1
//   mpirun -np 2 train_gpt --data notes.txt --devices host:1 --stages 2
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <numbers>
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
#include "train_gpt_flags.hpp"
#include "train_gpt_plan.hpp"

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using train_gpt::Options;
using train_gpt::Planned;

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

// The text with what a terminal cannot print as '?'.
std::string printable(std::string const& text) {
  std::string out;
  for (unsigned char const c : text)
    out += (c == '\n' || c == '\t' || (c >= 32 && c < 127)) ? static_cast<char>(c) : '?';
  return out;
}

// Generation on the host in float32 (a model trained elsewhere or in 16 bits is copied there).
void sample(Options const& o, mgpu::nn::GptConfig const& config, mgpu::nn::Sequential const& net, mgpu::nn::Context& net_ctx,
            FILE* log) {
  auto host = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  mgpu::Stream host_stream(mgpu::Device{mgpu::DeviceKind::host, 0});
  mgpu::nn::Context host_ctx{*host, host_stream};
  std::optional<mgpu::nn::Sequential> copy;
  mgpu::nn::Sequential const* sampler = &net;
  if (net.master_parameters().device().kind != mgpu::DeviceKind::host || net.compute_type() != mgpu::DType::float32) {
    copy.emplace(mgpu::nn::gpt(config));
    copy->materialize(host_ctx, o.seed);
    mgpu::train::set_parameters(*copy, mgpu::train::host_parameters(net, net_ctx.stream), host_stream);
    sampler = &*copy;
  }
  net_ctx.stream.synchronize();
  std::vector<std::uint16_t> const prompt16 = mgpu::data::ByteTokenizer{}.encode(o.prompt);
  std::vector<std::int32_t> const prompt(prompt16.begin(), prompt16.end());
  std::vector<std::int32_t> const ids =
      mgpu::nn::generate(*sampler, prompt, o.sample, {.temperature = o.temperature, .top_k = o.top_k, .seed = o.seed},
                         copy ? host_ctx : net_ctx);
  std::fprintf(log, "---- %lld sampled tokens (temperature %.2f, top-k %lld) ----\n", static_cast<long long>(o.sample),
               o.temperature, static_cast<long long>(o.top_k));
  if (config.vocab <= 256) {
    std::vector<std::uint16_t> const bytes(ids.begin(), ids.end());
    std::fprintf(log, "%s%s\n", printable(o.prompt).c_str(), printable(mgpu::data::ByteTokenizer{}.decode(bytes)).c_str());
  } else {
    for (std::int32_t const id : ids) std::fprintf(log, "%d ", id);
    std::fprintf(log, "\n");
  }
  std::fprintf(log, "----\n");
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
  mgpu::train::ParallelConfig parallel = train_gpt::parallel_config(o);
  mgpu::nn::GptConfig const config{.vocab = init ? init->config.vocab : o.vocab,
                                   .block_size = o.block_size,
                                   .n_layer = o.n_layer,
                                   .n_head = o.n_head,
                                   .n_embd = o.n_embd,
                                   .dropout = o.dropout,
                                   .recompute = *parallel.recompute};
  if (o.plan.empty() && o.device_memory_mb > 0)
    throw mgpu::Error(mgpu::Errc::invalid_argument, "--device-memory without --plan (expected --plan auto: it is the planner's budget)");
  Splits const splits = load_splits(o);  // before planning: a bad --data is refused at once
  if (o.devices.empty() && !o.plan.empty())  // the planner lays out the machine's cores
    o.devices = "host:" + std::to_string(std::max(1u, std::thread::hardware_concurrency()));
  std::optional<Planned> planned;
  if (!o.plan.empty()) parallel = train_gpt::plan_layout(o, config, processes, log, planned);
  parallel.compute = examples::precision(o.precision);
  parallel.loss_scaler = o.precision == "fp16";
  parallel.clip_norm = o.clip;
  if (o.devices.empty()) o.devices = "host:" + std::to_string(std::max(1, parallel.devices() / processes));
  if (o.resume && o.checkpoint.empty())
    throw mgpu::Error(mgpu::Errc::invalid_argument, "--resume without --checkpoint (expected --checkpoint PATH)");

  auto const timeline = o.trace.empty() ? nullptr : std::make_shared<mgpu::trace::Timeline>();
  if (timeline) timeline->enable(false);  // the last step only
  bool const exported = o.metrics.port || !o.metrics.file.empty();
  mgpu::train::Trainer trainer(
      config, mgpu::DeviceGroup(o.devices), parallel,
      {.seed = o.seed,
       .adamw = {.lr = o.lr, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = o.weight_decay},
       .initial_parameters = init ? init->parameters : std::vector<float>{},
       .batch_size = o.batch_size,
       .across_processes = processes > 1,
       .timeline = timeline,
       .metrics_job = exported || terminal ? "train_gpt" : "",  // timing costs ~0.2 us an action: only when read
       .spelling = mgpu::train::Spelling::flags,
       .devices_text = o.devices});
  mgpu::train::Layout const& layout = trainer.layout();
  mgpu::dist::World const& world = trainer.world();
  if (!trainer.placement().empty())
    std::fprintf(log, "tensor-parallel groups on the best links: %s\n", trainer.placement().c_str());
  // The live metrics, where the executors report their devices' times.
  examples::JobMetrics metrics(o.metrics,
                               trainer.metrics() ? trainer.metrics()
                                                 : std::make_shared<mgpu::metrics::Registry>(
                                                       "train_gpt", mgpu::metrics::Layout{.dp = layout.dp, .tp = layout.tp, .pp = layout.stages, .zero = layout.zero}),
                               world, log);
  if (mgpu::pipeline::Executor const* pipeline = trainer.pipeline()) {
    std::fprintf(log, "%s over %d stage(s) x %d replica(s) x %d tensor-parallel rank(s), %d micro-batches (about %.3g sequences each); chunks cut by FLOPs:\n",
                 pipeline->schedule().name.c_str(), parallel.stages, parallel.dp, parallel.tp, layout.micro_batches,
                 static_cast<double>(o.batch_size) / (layout.micro_batches * parallel.dp));
    for (std::size_t c = 0; c < trainer.chunks().size(); ++c) {
      mgpu::train::ChunkInfo const& k = trainer.chunks()[c];
      std::fprintf(log, "  chunk %zu on device %d: layers [%zu, %zu), %.3g GFLOP per micro-batch, %.1f MiB of parameters\n", c,
                   k.device, k.begin, k.end, k.flops * 1e-9, k.parameter_bytes / (1 << 20));
    }
  }

  mgpu::io::TrainingState state{.data_seed = o.seed};
  if (o.resume && fs::exists(o.checkpoint)) {
    state = trainer.load(o.checkpoint);
    std::fprintf(log, "resumed from %s at step %lld\n", o.checkpoint.c_str(), static_cast<long long>(state.step));
  }
  auto host = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  mgpu::data::TokenLoader train_loader(splits.train, o.vocab,
                                       {.batch = o.batch_size, .block = o.block_size, .seed = state.data_seed});
  mgpu::data::TokenLoader const val_loader(splits.val, o.vocab,
                                           {.batch = o.batch_size, .block = o.block_size, .sequential = true});
  train_loader.seek(state.step);
  std::int64_t const eval_windows = o.eval_iters * o.batch_size;

  std::fprintf(log,
               "mgpu %s: GPT of %lld parameters (n_layer %lld, n_head %lld, n_embd %lld, block %lld, vocab %lld) on %s "
               "(%s); data %s: %lld train / %lld val tokens\n",
               mgpu::version, static_cast<long long>(trainer.parameter_count()), static_cast<long long>(o.n_layer),
               static_cast<long long>(o.n_head), static_cast<long long>(o.n_embd), static_cast<long long>(o.block_size),
               static_cast<long long>(config.vocab), o.devices.c_str(), o.precision.c_str(),
               splits.description.c_str(), static_cast<long long>(count_tokens(splits.train)),
               static_cast<long long>(count_tokens(splits.val)));

  // This process's devices: peak_bytes reports each one's largest allocator peak over a training
  // step (evaluation runs on a gathered model between steps; it is not part of one).
  std::vector<mgpu::Allocator*> const allocators = trainer.allocators();
  std::vector<std::size_t> step_peaks(allocators.size(), 0);
  double val_loss = NAN;
  float train_loss = NAN;
  double train_seconds = 0;
  std::int64_t trained_steps = 0;
  if (o.eval_only) {
    val_loss = trainer.evaluate(val_loader, eval_windows);
    std::fprintf(log, "val loss %.4f over the first %lld windows of %lld tokens\n", val_loss,
                 static_cast<long long>(eval_windows), static_cast<long long>(o.block_size));
  } else {
    std::int64_t const log_every = o.log_every > 0 ? o.log_every : std::max<std::int64_t>(1, o.iters / 20);
    auto const report_val = [&](std::int64_t step) {
      val_loss = trainer.evaluate(val_loader, eval_windows);
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
      mgpu::data::TokenBatch const batch = train_loader.next(*host);  // host ids, copied by the trainer if needed
      for (mgpu::Allocator* a : allocators) a->reset_peak();
      mgpu::train::Trainer::StepResult const step = trainer.step(batch.x, batch.y, lr_at(o, it) / o.lr);
      train_loss = step.loss;
      bool const report = (it + 1) % log_every == 0 || it + 1 == last;
      for (std::size_t r = 0; r < allocators.size(); ++r)
        step_peaks[r] = std::max(step_peaks[r], allocators[r]->stats().peak_allocated);
      double const step_s = std::chrono::duration<double>(Clock::now() - start).count();
      train_seconds += step_s;
      mgpu::parallel::DataParallel const* dp = trainer.data_parallel();
      std::vector<mgpu::metrics::DeviceStep> const devices =
          metrics || terminal ? metrics.devices(world, allocators, trainer.last_data_parallel_step(),
                                                dp ? dp->weights() : std::vector<double>{}, o.batch_size / layout.dp, o.block_size)
                              : std::vector<mgpu::metrics::DeviceStep>{};
      if (metrics) {
        mgpu::optim::LossScaler const* scaler = trainer.loss_scaler();
        metrics.record({.step = it + 1, .loss = train_loss, .seconds = step_s, .samples = o.batch_size,
                        .tokens = o.batch_size * o.block_size, .learning_rate = lr_at(o, it),
                        .loss_scale = scaler ? std::optional<double>(scaler->scale()) : std::nullopt, .skipped = !step.applied},
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
        if (!o.checkpoint.empty()) trainer.save(o.checkpoint, state);
        window_start = Clock::now();
        window_steps = 0;
      }
    }
    if (!o.checkpoint.empty()) trainer.save(o.checkpoint, state);
    if (std::isnan(val_loss)) val_loss = trainer.evaluate(val_loader, eval_windows);
    if (timeline && speaker) {  // process 0's ranks
      timeline->enable(false);
      timeline->write_chrome_trace(o.trace);
      std::fprintf(log, "timeline of the last step: %s\n", o.trace.c_str());
    }
  }
  mgpu::nn::Sequential& net = trainer.gather();  // collective across processes

  if (!speaker) return 0;  // the others have done their part (the gathers)
  if (!o.save_llmc.empty()) {
    mgpu::io::write_llmc_model(o.save_llmc, config, mgpu::train::host_parameters(net, trainer.context().stream));
    std::fprintf(log, "llm.c model file written to %s\n", o.save_llmc.c_str());
  }
  if (o.sample > 0) sample(o, config, net, trainer.context(), log);

  double const tokens_per_s =
      train_seconds > 0 ? static_cast<double>(trained_steps * o.batch_size * o.block_size) / train_seconds : 0.0;
  std::string devices, peaks;
  for (std::size_t r = 0; r < allocators.size(); ++r) {
    devices += std::string(r ? ", " : "") + "\"" + trainer.group().device(static_cast<int>(r)).to_string() + "\"";
    // --eval-only trains no step: the peak of its evaluation
    std::size_t const peak = trained_steps > 0 ? step_peaks[r] : allocators[r]->stats().peak_allocated;
    peaks += (r ? ", " : "") + std::to_string(peak);
  }
  // The memory model's prediction of those peaks, for the layouts it covers.
  std::string predicted = "null";
  if (std::optional<std::vector<mgpu::parallel::GptMemory>> const memory = trainer.predicted_memory()) {
    predicted.clear();
    for (mgpu::parallel::GptMemory const& m : *memory) predicted += (predicted.empty() ? "[" : ", ") + std::to_string(m.total());
    predicted += "]";
  }
  if (world.processes > 1) {  // the world's
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
        static_cast<long long>(trainer.parameter_count()), devices.c_str(), static_cast<long long>(state.step),
        peaks.c_str(), predicted.c_str(), o.precision.c_str(), static_cast<long long>(eval_windows),
        layout.schedule.c_str(), layout.stages, layout.micro_batches, layout.dp,
        std::string(mgpu::nn::to_string(trainer.model_config().recompute)).c_str(), layout.tp,
        trainer.config().sequence_parallel ? "true" : "false", layout.zero, world.processes, train_gpt::plan_json(planned).c_str());
  } else {
    std::printf("final: train loss %.4f, val loss %.4f, %.0f tokens/s on %s\n", train_loss, val_loss, tokens_per_s,
                o.devices.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Train a GPT language model with mgpu"};
  train_gpt::Options o;
  train_gpt::add_flags(app, o);
  CLI11_PARSE(app, argc, argv);
  train_gpt::note_given(app, o);
  return examples::run_reporting("train_gpt", [&] { return run(o); });
}
