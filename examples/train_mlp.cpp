// train_mlp: trains a multi-layer perceptron classifier on synthetic data, a CSV file or MNIST IDX
// files, evaluates it on a held-out split, and checkpoints every epoch (resumable).
//
//   train_mlp                                             # synthetic clusters, default devices
//   train_mlp --data csv:iris.csv --layers 32,3 --epochs 50
//   train_mlp --data idx:train-images-idx3-ubyte,train-labels-idx1-ubyte --layers 128,10 --optimizer adamw
//   train_mlp --checkpoint run.ckpt --resume --json
//   train_mlp --devices host:2@speed=1,0.5 --rebalance --verbose --trace step.json
//   mpirun -np 2 train_mlp --devices host:1                 # one process per server (mgpu::dist)
//
// It trains data parallel (parallel::DataParallel) over every device of --devices: one replica
// per device, each batch sharded across them, gradients all-reduced in buckets during backward.
// Under mpirun or srun every process does so over its own --devices: each loads the same global
// batch and trains on its rows (split by the processes' device speeds; with --rebalance by their
// measured speeds, rows moving to the faster processes), the gradients are reduced
// over every device of every process, and process 0 prints. --checkpoint is then a folder of
// one shard per process (DataParallel::save), which --resume reads on any process count.
#include <CLI/CLI.hpp>

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <mgpu/mgpu.hpp>

#include "example_cli.hpp"

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::string devices;
  examples::CommonFlags common;
  int epochs = 10;
  int until_epoch = 0;  // 0: run to --epochs
  std::int64_t batch = 64;
  float lr = 0;  // 0: the optimizer's default
  std::string optimizer = "sgd";
  std::string precision = "fp32";
  std::uint64_t seed = 1;
  std::string checkpoint;
  bool resume = false;
  bool allow_fresh = false;
  bool json = false;
  bool verbose = false;
  bool rebalance = false;
  std::string trace;
  int trace_steps = 20;
  examples::MetricsFlags metrics;
};

mgpu::Tensor host_tensor(std::span<float const> values, mgpu::Shape shape, mgpu::Allocator& allocator) {
  mgpu::Tensor t = mgpu::Tensor::empty(std::move(shape), mgpu::DType::float32, allocator);
  std::copy(values.begin(), values.end(), t.host_span<float>().begin());
  return t;
}

// A float in JSON with every digit it needs to read back bit for bit (null when not finite).
std::string json_float(float value) {
  if (!std::isfinite(value)) return "null";
  char text[32];
  std::snprintf(text, sizeof text, "%.9g", static_cast<double>(value));
  return text;
}

// Progress on a terminal: one line redrawn in place.
void draw_progress(int epoch, int epochs, std::int64_t batch, std::int64_t batches, float loss, double samples_per_s) {
  int const width = 30;
  auto const filled = static_cast<int>(width * static_cast<double>(batch) / static_cast<double>(std::max<std::int64_t>(1, batches)));
  std::string bar(static_cast<std::size_t>(filled), '#');
  bar.resize(width, '.');
  std::fprintf(stderr, "\r[%s] epoch %d/%d  batch %lld/%lld  loss %.4f  %.0f samples/s   ", bar.c_str(), epoch + 1, epochs,
               static_cast<long long>(batch), static_cast<long long>(batches), loss, samples_per_s);
  std::fflush(stderr);
}

std::unique_ptr<mgpu::optim::Optimizer> make_optimizer(Options const& o) {
  if (o.optimizer == "adamw") return std::make_unique<mgpu::optim::AdamW>(mgpu::optim::AdamWOptions{.lr = o.lr > 0 ? o.lr : 1e-3f});
  return std::make_unique<mgpu::optim::SGD>(mgpu::optim::SgdOptions{.lr = o.lr > 0 ? o.lr : 0.05f, .momentum = 0.9f});
}

int train(Options const& o) {
  mgpu::dist::Session session;  // the job's processes (one without a launcher)
  mgpu::DeviceGroup group = o.devices.empty() ? mgpu::DeviceGroup() : mgpu::DeviceGroup(o.devices);
  mgpu::dist::World const world = mgpu::dist::make_world(group);
  bool const across = world.processes > 1;
  bool const speaker = world.process == 0;  // every process trains the same model; process 0 prints
  FILE* const log = o.json ? stderr : stdout;
  bool const terminal = speaker && ::isatty(STDERR_FILENO) != 0;
  if (o.resume && !std::filesystem::exists(o.checkpoint) && !o.allow_fresh)
    throw mgpu::Error(mgpu::Errc::io, "--resume: no checkpoint at '" + o.checkpoint +
                                          "' (expected what --checkpoint wrote; add --allow-fresh to start fresh when it is missing)");

  auto const all = examples::load_data(o.common.data, o.common.label_col, o.seed, 20000);
  if (all.classes() < 2)
    throw mgpu::Error(mgpu::Errc::invalid_argument, "the data has " + std::to_string(all.classes()) + " classes (expected a classification set with >= 2)");
  auto const [train_set, test_set] = mgpu::data::split(all, o.common.test_fraction, o.seed);
  mgpu::parallel::DataParallelOptions dp_options;
  dp_options.seed = o.seed;
  dp_options.compute = examples::precision(o.precision);
  if (o.precision == "fp16") dp_options.loss_scaler.emplace();
  dp_options.rebalance = o.rebalance;
  auto const timeline = o.trace.empty() ? nullptr : std::make_shared<mgpu::trace::Timeline>();
  dp_options.timeline = timeline;
  if (across) dp_options.make_communicator = mgpu::dist::communicator_factory(world);
  // The live metrics; the executor reports its devices' times there (and rebalances from them).
  examples::JobMetrics metrics(o.metrics, "train_mlp", {.dp = world.size(), .zero = dp_options.zero_stage}, world, log);
  dp_options.metrics = metrics.registry();
  mgpu::parallel::DataParallel dp(mgpu::nn::Sequential::mlp(examples::parse_widths(o.common.layers, all.features(), all.classes(), {128, 128}), o.common.activation), group,
                                  [&] { return make_optimizer(o); }, dp_options);
  mgpu::DeviceGroup& used = dp.group();
  // A device's name in the output: across processes with its process, "p1:host:0".
  auto const device_name = [&](mgpu::dist::WorldDevice const& d) {
    return (across ? "p" + std::to_string(d.process) + ":" : std::string()) + d.device.to_string();
  };
  std::string trained_on;
  if (across) {
    for (mgpu::dist::WorldDevice const& d : world.devices) trained_on += (d.rank ? "," : "") + device_name(d);
  } else {
    for (int r = 0; r < used.size(); ++r) trained_on += (r ? "," : "") + used.device(r).to_string();
  }
  // This process's rows of each global batch: shares by the processes' device speeds, or with
  // --rebalance by their measured speeds once measured.
  std::vector<double> process_weights(static_cast<std::size_t>(world.processes), 0.0);
  for (mgpu::dist::WorldDevice const& d : world.devices)
    process_weights[static_cast<std::size_t>(d.process)] += d.device.speed;
  auto const my_rows = [&](mgpu::Tensor const& batch) {
    if (!across) return batch;
    std::vector<std::int64_t> const rows = dp.process_rows(batch.dim(0), process_weights);
    std::int64_t begin = 0;
    for (int p = 0; p < world.process; ++p) begin += rows[static_cast<std::size_t>(p)];
    return batch.slice(begin, begin + rows[static_cast<std::size_t>(world.process)]);
  };

  mgpu::io::TrainingState state{.data_seed = o.seed};
  if (o.resume && std::filesystem::exists(o.checkpoint)) {
    state = dp.load(o.checkpoint);
    if (speaker)
      std::fprintf(log, "resumed from %s at epoch %lld, batch %lld (step %lld)\n", o.checkpoint.c_str(),
                   static_cast<long long>(state.epoch + 1), static_cast<long long>(state.batch),
                   static_cast<long long>(state.step));
  }

  if (speaker)
    std::fprintf(log,
                 "mgpu %s: training %lld parameters data parallel on %s (%s), %lld train / %lld test examples, %lld "
                 "features, %lld classes\n",
                 mgpu::version, static_cast<long long>(dp.replica(0).parameter_count()), trained_on.c_str(),
                 o.precision.c_str(), static_cast<long long>(train_set.size()), static_cast<long long>(test_set.size()),
                 static_cast<long long>(all.features()), static_cast<long long>(all.classes()));
  auto host = mgpu::Allocator::create(mgpu::Device{mgpu::DeviceKind::host, 0});
  auto const normalizer = o.common.data.starts_with("idx:") ? mgpu::data::Normalizer{} : mgpu::data::Normalizer::fit(train_set);
  mgpu::data::BatchLoader loader(train_set, {.batch = o.batch, .seed = state.data_seed, .normalizer = normalizer}, host,
                                 used.device(0).kind == mgpu::DeviceKind::cuda);

  // The test set, normalized with the training statistics (DataParallel evaluates on rank 0).
  std::vector<float> test_x(test_set.feature_data().begin(), test_set.feature_data().end());
  normalizer.apply(test_x);
  mgpu::Tensor const test_features = host_tensor(test_x, {test_set.size(), all.features()}, *host);
  mgpu::Tensor const test_labels = host_tensor(test_set.labels(), {test_set.size()}, *host);

  std::vector<float> epoch_losses;
  double train_seconds = 0;
  std::int64_t samples = 0;
  float epoch_loss = NAN;
  double accuracy = NAN;
  std::int64_t traced = 0;
  if (timeline) timeline->enable();
  std::vector<mgpu::Allocator*> allocators;
  for (int r = 0; r < used.size(); ++r) allocators.push_back(&used.allocator(r));
  float const base_lr = o.lr > 0 ? o.lr : o.optimizer == "adamw" ? 1e-3f : 0.05f;
  int const last = o.until_epoch > 0 ? std::min(o.until_epoch, o.epochs) : o.epochs;
  for (auto epoch = static_cast<int>(state.epoch); epoch < last; ++epoch) {
    loader.start_epoch(epoch, state.batch);
    double loss_sum = 0;
    std::int64_t steps = 0;
    std::vector<double> rows(static_cast<std::size_t>(used.size()), 0.0), compute_ms(rows), wait_ms(rows);
    auto const start = Clock::now();
    auto last_draw = start;
    std::int64_t epoch_samples = 0;
    while (auto batch = loader.next()) {
      float const lr_scale = mgpu::optim::cosine_lr(state.step, static_cast<std::int64_t>(o.epochs) * loader.batches_per_epoch(), 0.05f);
      auto const step_start = Clock::now();
      auto const result = dp.step(my_rows(batch->x), my_rows(batch->y), lr_scale);
      if (metrics) {
        auto const* scaler = dp.loss_scaler();
        metrics.record({.step = state.step + 1, .loss = result.loss, .seconds = std::chrono::duration<double>(Clock::now() - step_start).count(),
                        .samples = batch->x.dim(0), .learning_rate = base_lr * lr_scale,
                        .loss_scale = scaler ? std::optional<double>(scaler->scale()) : std::nullopt, .skipped = !result.applied},
                       metrics.devices(world, allocators, &result, dp.weights(), 0, 0));
      }
      if (timeline && ++traced == o.trace_steps) timeline->enable(false);
      loss_sum += result.loss;
      ++steps;
      for (std::size_t r = 0; r < rows.size(); ++r) {
        rows[r] += static_cast<double>(result.rows[r]);
        compute_ms[r] += result.compute_ms[r];
        wait_ms[r] += result.wait_ms[r];
      }
      epoch_samples += batch->x.dim(0);  // the global batch's
      ++state.step;
      state.batch = batch->index + 1;
      if (terminal && Clock::now() - last_draw > std::chrono::milliseconds(100)) {
        last_draw = Clock::now();
        double const seconds = std::chrono::duration<double>(last_draw - start).count();
        draw_progress(epoch, o.epochs, state.batch, loader.batches_per_epoch(), result.loss, static_cast<double>(epoch_samples) / seconds);
      }
    }
    double const seconds = std::chrono::duration<double>(Clock::now() - start).count();
    train_seconds += seconds;
    samples += epoch_samples;
    epoch_loss = static_cast<float>(loss_sum / static_cast<double>(std::max<std::int64_t>(1, steps)));
    epoch_losses.push_back(epoch_loss);
    accuracy = test_set.size() > 0 ? static_cast<double>(dp.count_correct(test_features, test_labels)) / static_cast<double>(test_set.size()) : NAN;
    if (terminal) std::fprintf(stderr, "\r%*s\r", 100, "");
    if (speaker)
      std::fprintf(log, "epoch %d/%d  loss %.4f  test accuracy %.4f  %.0f samples/s  %.2f ms/step\n", epoch + 1,
                   o.epochs, epoch_loss, accuracy, static_cast<double>(epoch_samples) / seconds,
                   1e3 * seconds / static_cast<double>(std::max<std::int64_t>(1, steps)));
    if (speaker && o.verbose && steps > 0) {  // across processes: process 0's ranks
      for (std::size_t r = 0; r < rows.size(); ++r) {
        double const n = static_cast<double>(steps);
        std::fprintf(log,
                     "  rank %zu (%s): %.1f rows/step, compute %.2f ms/step, waiting for reduces %.2f ms/step, shard "
                     "weight %.3f\n",
                     r, device_name(world.devices[r]).c_str(), rows[r] / n, compute_ms[r] / n, wait_ms[r] / n,
                     dp.weights()[r]);
      }
    }
    std::fflush(log);
    state.epoch = epoch + 1;
    state.batch = 0;
    if (!o.checkpoint.empty()) dp.save(o.checkpoint, state);
  }
  if (std::isnan(accuracy) && test_set.size() > 0)  // nothing left to train after a resume: still report
    accuracy = static_cast<double>(dp.count_correct(test_features, test_labels)) / static_cast<double>(test_set.size());
  if (timeline) {
    timeline->write_chrome_trace(o.trace);
    if (speaker)
      std::fprintf(log,
                   "timeline of the first %lld steps written to %s (open it in ui.perfetto.dev or chrome://tracing)\n",
                   static_cast<long long>(std::min<std::int64_t>(traced, o.trace_steps)), o.trace.c_str());
  }
  double const samples_per_s = train_seconds > 0 ? static_cast<double>(samples) / train_seconds : 0.0;
  auto const* scaler = dp.loss_scaler();
  if (!speaker) return 0;
  if (o.json) {
    std::string devices;  // the world's
    for (mgpu::dist::WorldDevice const& d : world.devices) devices += (d.rank ? ", \"" : "\"") + device_name(d) + "\"";
    std::string losses;  // each epoch's mean loss, to the float's last bit
    for (std::size_t e = 0; e < epoch_losses.size(); ++e) losses += (e ? ", " : "") + json_float(epoch_losses[e]);
    std::printf(
        "{\"train_loss\": %.6g, \"test_accuracy\": %.6g, \"samples_per_s\": %.6g, \"devices\": [%s], \"trained_on\": "
        "\"%s\", "
        "\"epochs\": %d, \"steps\": %lld, \"parameters\": %lld, \"precision\": \"%s\", \"skipped_steps\": %lld, "
        "\"epoch_losses\": [%s], \"processes\": %d}\n",
        std::isnan(epoch_loss) ? -1.0 : epoch_loss, std::isnan(accuracy) ? -1.0 : accuracy, samples_per_s,
        devices.c_str(), trained_on.c_str(), o.epochs, static_cast<long long>(state.step),
        static_cast<long long>(dp.replica(0).parameter_count()), o.precision.c_str(),
        static_cast<long long>(scaler != nullptr ? scaler->skipped() : 0), losses.c_str(), world.processes);
  } else {
    std::printf("final: train loss %.4f, test accuracy %.4f, %.0f samples/s on %s\n", epoch_loss, accuracy, samples_per_s, trained_on.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Train an MLP classifier with mgpu"};
  Options o;
  app.add_option("--devices", o.devices,
                 "device spec: auto, host:N, host:N@speed=1,0.5, cuda, cuda:0,1 (default: $MGPU_DEVICES or auto); trains data parallel on all");
  o.common.add_to(app, "128,128,classes");
  app.add_option("--epochs", o.epochs, "passes over the training set")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--batch", o.batch, "examples per step")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--lr", o.lr, "learning rate (default: 0.05 for sgd, 0.001 for adamw), cosine-decayed")->check(CLI::PositiveNumber);
  app.add_option("--optimizer", o.optimizer, "sgd (momentum 0.9) | adamw")->check(CLI::IsMember({"sgd", "adamw"}))->capture_default_str();
  app.add_option("--precision", o.precision, "fp32 | bf16 | fp16 (16-bit compute, float32 master weights)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}))
      ->capture_default_str();
  app.add_option("--seed", o.seed, "seed for the weights, the split and the data order")->capture_default_str();
  app.add_option("--checkpoint", o.checkpoint, "write a checkpoint here after every epoch");
  app.add_flag("--resume", o.resume, "continue from --checkpoint (an error when it does not exist, unless --allow-fresh)");
  app.add_flag("--allow-fresh", o.allow_fresh, "with --resume: start fresh when the checkpoint does not exist yet");
  app.add_option("--until-epoch", o.until_epoch, "stop after this epoch, as a time-sliced job would; --resume continues (the schedule still spans --epochs)")
      ->check(CLI::PositiveNumber);
  app.add_flag("--json", o.json, "print the final metrics as one JSON object on stdout (progress goes to stderr)");
  app.add_flag("--verbose", o.verbose, "per epoch, each rank's rows, compute and reduce-wait time per step");
  o.metrics.add_to(app);
  app.add_flag("--rebalance", o.rebalance, "re-weight shards from each device's measured compute time");
  app.add_option("--trace", o.trace, "write a Chrome/Perfetto timeline of the first --trace-steps steps to this JSON file");
  app.add_option("--trace-steps", o.trace_steps, "steps the timeline records")->check(CLI::PositiveNumber)->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (o.resume && o.checkpoint.empty()) {
    std::fprintf(stderr, "train_mlp: --resume needs --checkpoint PATH\n");
    return 2;
  }
  return examples::run_reporting("train_mlp", [&] { return train(o); });
}
