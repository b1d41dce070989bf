// train_mlp: trains a multi-layer perceptron classifier on synthetic data, a CSV file or MNIST IDX
// files, evaluates it on a held-out split, and checkpoints every epoch (resumable).
//
//   train_mlp                                             # synthetic clusters, default devices
//   train_mlp --data csv:iris.csv --layers 32,3 --epochs 50
//   train_mlp --data idx:train-images-idx3-ubyte,train-labels-idx1-ubyte --layers 128,10 --optimizer adamw
//   train_mlp --checkpoint run.ckpt --resume --json
//
// Until data parallelism lands it trains on the first device of --devices.
#include <CLI/CLI.hpp>

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <mgpu/mgpu.hpp>

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::string devices;
  std::string data = "synthetic";
  std::int64_t label_col = -1;
  double test_fraction = 0.2;
  std::string layers;
  std::string activation = "relu";
  int epochs = 10;
  int until_epoch = 0;  // 0: run to --epochs
  std::int64_t batch = 64;
  float lr = 0;  // 0: the optimizer's default
  std::string optimizer = "sgd";
  std::string precision = "fp32";
  std::uint64_t seed = 1;
  std::string checkpoint;
  bool resume = false;
  bool json = false;
};

mgpu::data::InMemoryDataset load(Options const& o) {
  if (o.data == "synthetic") return mgpu::data::make_clusters(20000, 32, 10, o.seed, 1.5f);
  if (o.data.starts_with("csv:")) return mgpu::data::load_csv(o.data.substr(4), {.label_column = o.label_col});
  if (o.data.starts_with("idx:")) {
    std::string const paths = o.data.substr(4);
    auto const comma = paths.find(',');
    if (comma == std::string::npos)
      throw mgpu::Error(mgpu::Errc::invalid_argument, "--data " + o.data + " (expected idx:IMAGES,LABELS)");
    return mgpu::data::load_idx(paths.substr(0, comma), paths.substr(comma + 1));
  }
  throw mgpu::Error(mgpu::Errc::invalid_argument, "--data " + o.data + " (expected synthetic, csv:PATH or idx:IMAGES,LABELS)");
}

// Input width, then --layers (hidden widths and the output, which must be the class count).
std::vector<std::int64_t> widths(Options const& o, std::int64_t features, std::int64_t classes) {
  std::vector<std::int64_t> w{features};
  if (o.layers.empty()) {
    w.insert(w.end(), {128, 128, classes});
    return w;
  }
  std::stringstream in(o.layers);
  std::string item;
  while (std::getline(in, item, ',')) {
    try {
      std::size_t used = 0;
      long long const v = std::stoll(item, &used);
      if (used != item.size() || v < 1) throw std::invalid_argument(item);
      w.push_back(v);
    } catch (std::exception const&) {
      throw mgpu::Error(mgpu::Errc::invalid_argument, "--layers " + o.layers + ": '" + item + "' (expected positive whole numbers, e.g. 64,128,10)");
    }
  }
  if (w.size() < 2 || w.back() != classes)
    throw mgpu::Error(mgpu::Errc::invalid_argument, "--layers " + o.layers + " ends in " + std::to_string(w.back()) + " but the data has " +
                                                        std::to_string(classes) + " classes (expected the last width to be " +
                                                        std::to_string(classes) + ")");
  return w;
}

mgpu::DType precision(std::string const& p) {
  if (p == "bf16") return mgpu::DType::bfloat16;
  if (p == "fp16") return mgpu::DType::float16;
  return mgpu::DType::float32;
}

// A tensor on `device` holding a host tensor's values (the host tensor itself on a host device).
mgpu::Tensor to_device(mgpu::Tensor const& host, mgpu::Device device, mgpu::Allocator& allocator, mgpu::Stream& stream) {
  if (device.kind == mgpu::DeviceKind::host) return host;
  mgpu::Tensor t = mgpu::Tensor::empty(host.shape(), host.dtype(), allocator);
  mgpu::copy_async(t, host, stream);
  return t;
}

mgpu::Tensor host_tensor(std::span<float const> values, mgpu::Shape shape, mgpu::Allocator& allocator) {
  mgpu::Tensor t = mgpu::Tensor::empty(std::move(shape), mgpu::DType::float32, allocator);
  std::copy(values.begin(), values.end(), t.host_span<float>().begin());
  return t;
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

int train(Options const& o) {
  mgpu::DeviceGroup group = o.devices.empty() ? mgpu::DeviceGroup() : mgpu::DeviceGroup(o.devices);
  mgpu::Device const device = group.device(0);
  mgpu::nn::Context ctx{group.allocator(0), group.stream(0)};
  FILE* const log = o.json ? stderr : stdout;
  bool const terminal = ::isatty(STDERR_FILENO) != 0;

  auto const all = load(o);
  if (all.classes() < 2)
    throw mgpu::Error(mgpu::Errc::invalid_argument, "the data has " + std::to_string(all.classes()) + " classes (expected a classification set with >= 2)");
  auto const [train_set, test_set] = mgpu::data::split(all, o.test_fraction, o.seed);
  auto model = mgpu::nn::Sequential::mlp(widths(o, all.features(), all.classes()), o.activation);
  model.materialize(ctx, o.seed, precision(o.precision));
  std::unique_ptr<mgpu::optim::Optimizer> optimizer;
  if (o.optimizer == "adamw") {
    optimizer = std::make_unique<mgpu::optim::AdamW>(mgpu::optim::AdamWOptions{.lr = o.lr > 0 ? o.lr : 1e-3f});
  } else {
    optimizer = std::make_unique<mgpu::optim::SGD>(mgpu::optim::SgdOptions{.lr = o.lr > 0 ? o.lr : 0.05f, .momentum = 0.9f});
  }
  mgpu::optim::LossScaler scaler;
  mgpu::nn::StepOptions step_options{.scaler = o.precision == "fp16" ? &scaler : nullptr};

  mgpu::io::TrainingState state{.data_seed = o.seed};
  if (o.resume && !o.checkpoint.empty() && std::filesystem::exists(o.checkpoint)) {
    state = mgpu::io::load_training(o.checkpoint, model, *optimizer, ctx.allocator, ctx.stream);
    std::fprintf(log, "resumed from %s at epoch %lld, batch %lld (step %lld)\n", o.checkpoint.c_str(), static_cast<long long>(state.epoch + 1),
                 static_cast<long long>(state.batch), static_cast<long long>(state.step));
  }

  std::fprintf(log, "mgpu %s: training %lld parameters on %s (%s), %lld train / %lld test examples, %lld features, %lld classes\n", mgpu::version,
               static_cast<long long>(model.parameter_count()), device.to_string().c_str(), o.precision.c_str(),
               static_cast<long long>(train_set.size()), static_cast<long long>(test_set.size()), static_cast<long long>(all.features()),
               static_cast<long long>(all.classes()));
  auto host = mgpu::Allocator::create(mgpu::Device{mgpu::DeviceKind::host, 0});
  auto const normalizer = o.data.starts_with("idx:") ? mgpu::data::Normalizer{} : mgpu::data::Normalizer::fit(train_set);
  mgpu::data::BatchLoader loader(train_set, {.batch = o.batch, .seed = state.data_seed, .normalizer = normalizer}, host,
                                 device.kind == mgpu::DeviceKind::cuda);

  // The test set, normalized with the training statistics, on the device.
  std::vector<float> test_x(test_set.feature_data().begin(), test_set.feature_data().end());
  normalizer.apply(test_x);
  mgpu::Tensor const test_features = to_device(host_tensor(test_x, {test_set.size(), all.features()}, *host), device, ctx.allocator, ctx.stream);
  mgpu::Tensor const test_labels = to_device(host_tensor(test_set.labels(), {test_set.size()}, *host), device, ctx.allocator, ctx.stream);

  double train_seconds = 0;
  std::int64_t samples = 0;
  float epoch_loss = NAN;
  double accuracy = NAN;
  int const last = o.until_epoch > 0 ? std::min(o.until_epoch, o.epochs) : o.epochs;
  for (auto epoch = static_cast<int>(state.epoch); epoch < last; ++epoch) {
    loader.start_epoch(epoch, state.batch);
    std::vector<mgpu::Tensor> losses;
    auto const start = Clock::now();
    auto last_draw = start;
    std::int64_t epoch_samples = 0;
    while (auto batch = loader.next()) {
      mgpu::Tensor const x = to_device(batch->x, device, ctx.allocator, ctx.stream);
      mgpu::Tensor const y = to_device(batch->y, device, ctx.allocator, ctx.stream);
      step_options.lr_scale = mgpu::optim::cosine_lr(state.step, static_cast<std::int64_t>(o.epochs) * loader.batches_per_epoch(), 0.05f);
      auto const result = mgpu::nn::classification_step(model, *optimizer, x, y, ctx, step_options);
      losses.push_back(result.loss);
      epoch_samples += batch->x.dim(0);
      ++state.step;
      state.batch = batch->index + 1;
      if (terminal && Clock::now() - last_draw > std::chrono::milliseconds(100)) {
        last_draw = Clock::now();
        double const seconds = std::chrono::duration<double>(last_draw - start).count();
        draw_progress(epoch, o.epochs, state.batch, loader.batches_per_epoch(), mgpu::ops::item(result.loss, ctx.stream),
                      static_cast<double>(epoch_samples) / seconds);
      }
    }
    ctx.stream.synchronize();
    double const seconds = std::chrono::duration<double>(Clock::now() - start).count();
    train_seconds += seconds;
    samples += epoch_samples;
    double sum = 0;
    for (auto const& l : losses) sum += mgpu::ops::item(l, ctx.stream);
    epoch_loss = static_cast<float>(sum / static_cast<double>(std::max<std::size_t>(1, losses.size())));
    accuracy = test_set.size() > 0
                   ? static_cast<double>(mgpu::nn::count_correct(model, test_features, test_labels, ctx)) / static_cast<double>(test_set.size())
                   : NAN;
    if (terminal) std::fprintf(stderr, "\r%*s\r", 100, "");
    std::fprintf(log, "epoch %d/%d  loss %.4f  test accuracy %.4f  %.0f samples/s\n", epoch + 1, o.epochs, epoch_loss, accuracy,
                 static_cast<double>(epoch_samples) / seconds);
    std::fflush(log);
    state.epoch = epoch + 1;
    state.batch = 0;
    if (!o.checkpoint.empty()) mgpu::io::save_training(o.checkpoint, model, *optimizer, state, ctx.stream);
  }
  if (std::isnan(accuracy) && test_set.size() > 0)  // nothing left to train after a resume: still report
    accuracy = static_cast<double>(mgpu::nn::count_correct(model, test_features, test_labels, ctx)) / static_cast<double>(test_set.size());
  double const samples_per_s = train_seconds > 0 ? static_cast<double>(samples) / train_seconds : 0.0;
  if (o.json) {
    std::string devices;
    for (int r = 0; r < group.size(); ++r) devices += (r ? ", \"" : "\"") + group.device(r).to_string() + "\"";
    std::printf("{\"train_loss\": %.6g, \"test_accuracy\": %.6g, \"samples_per_s\": %.6g, \"devices\": [%s], \"trained_on\": \"%s\", "
                "\"epochs\": %d, \"steps\": %lld, \"parameters\": %lld, \"precision\": \"%s\", \"skipped_steps\": %lld}\n",
                std::isnan(epoch_loss) ? -1.0 : epoch_loss, std::isnan(accuracy) ? -1.0 : accuracy, samples_per_s, devices.c_str(),
                device.to_string().c_str(), o.epochs, static_cast<long long>(state.step), static_cast<long long>(model.parameter_count()),
                o.precision.c_str(), static_cast<long long>(scaler.skipped()));
  } else {
    std::printf("final: train loss %.4f, test accuracy %.4f, %.0f samples/s on %s\n", epoch_loss, accuracy, samples_per_s, device.to_string().c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Train an MLP classifier with mgpu"};
  Options o;
  app.add_option("--devices", o.devices, "device spec: auto, host:N, cuda, cuda:0,1 (default: $MGPU_DEVICES or auto); trains on the first");
  app.add_option("--data", o.data, "synthetic | csv:PATH | idx:IMAGES,LABELS")->capture_default_str();
  app.add_option("--label-col", o.label_col, "CSV label column, 0-based; negative counts from the end (default: last)");
  app.add_option("--test-fraction", o.test_fraction, "share of examples held out for testing")->check(CLI::Range(0.0, 0.99))->capture_default_str();
  app.add_option("--layers", o.layers, "hidden widths and the output width (= classes), e.g. 64,128,10 (default: 128,128,classes)");
  app.add_option("--activation", o.activation, "relu | gelu")->check(CLI::IsMember({"relu", "gelu"}))->capture_default_str();
  app.add_option("--epochs", o.epochs, "passes over the training set")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--batch", o.batch, "examples per step")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--lr", o.lr, "learning rate (default: 0.05 for sgd, 0.001 for adamw), cosine-decayed")->check(CLI::PositiveNumber);
  app.add_option("--optimizer", o.optimizer, "sgd (momentum 0.9) | adamw")->check(CLI::IsMember({"sgd", "adamw"}))->capture_default_str();
  app.add_option("--precision", o.precision, "fp32 | bf16 | fp16 (16-bit compute, float32 master weights)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}))
      ->capture_default_str();
  app.add_option("--seed", o.seed, "seed for the weights, the split and the data order")->capture_default_str();
  app.add_option("--checkpoint", o.checkpoint, "write a checkpoint here after every epoch");
  app.add_flag("--resume", o.resume, "continue from --checkpoint when it exists");
  app.add_option("--until-epoch", o.until_epoch, "stop after this epoch, as a time-sliced job would; --resume continues (the schedule still spans --epochs)")
      ->check(CLI::PositiveNumber);
  app.add_flag("--json", o.json, "print the final metrics as one JSON object on stdout (progress goes to stderr)");
  CLI11_PARSE(app, argc, argv);
  if (o.resume && o.checkpoint.empty()) {
    std::fprintf(stderr, "train_mlp: --resume needs --checkpoint PATH\n");
    return 2;
  }
  try {
    return train(o);
  } catch (mgpu::Error const& e) {
    std::fprintf(stderr, "\ntrain_mlp: %s\n", e.what());
    return 2;
  }
}
