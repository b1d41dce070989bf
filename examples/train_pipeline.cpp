// train_pipeline: trains an MLP classifier split into pipeline stages over several devices, with
// any schedule, optionally replicated data-parallel (a data x pipeline grid). Without --cuts, the
// model is cut for the devices: layers profiled on rank 0, each stage's device speed and free
// memory (heterogeneous groups get uneven stages). Prints the plan (layers, predicted time and
// memory per chunk), the simulated and the measured bubble of a step, and the test accuracy;
// --trace writes the last step's timeline (Chrome/Perfetto JSON).
//
//   train_pipeline --schedule 1f1b --stages 4 --micro-batches 8
//   train_pipeline --schedule 1f1b --stages 2 --devices host:2@speed=1,0.5
//   train_pipeline --schedule gpipe --stages 2 --cuts 0,6,16
//   train_pipeline --schedule zb --stages 4 --micro-batches 8 --trace zb.json
//   train_pipeline --schedule 1f1b --stages 4 --micro-batches 8 --precision bf16
//   train_pipeline --schedule interleaved --chunks 2 --stages 2 --micro-batches 4 --dp 2
//   train_pipeline --data csv:iris.csv --layers 32,32,3 --schedule gpipe --stages 2
//   mpirun -np 2 train_pipeline --stages 2 --devices host:1     # a stage per process (mgpu::dist)
//   mpirun -np 2 train_pipeline --stages 2 --dp 2 --devices host:2  # a replica per process
//
// Under mpirun or srun the grid spans every process's --devices (world rank g runs stage
// g % stages of replica g / stages): every process loads the same data and passes the same
// batches, the model is cut as process 0 profiled it, and process 0 prints.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <mgpu/mgpu.hpp>

#include "example_cli.hpp"

namespace {

namespace pp = mgpu::pipeline;
using Clock = std::chrono::steady_clock;

struct Options {
  std::string devices;
  examples::CommonFlags common;
  int epochs = 3;
  std::int64_t batch = 256;
  float lr = 0.05f;
  std::uint64_t seed = 1;
  std::string schedule = "1f1b";
  int stages = 2;
  int micro_batches = 4;
  int chunks = 2;
  int dp = 1;
  std::vector<std::size_t> cuts;
  std::string precision = "fp32";
  std::string trace;
  bool json = false;
  examples::MetricsFlags metrics;
};

pp::Schedule make_schedule(Options const& o) {
  if (o.schedule == "layer-split") {
    if (o.micro_batches != 1)
      throw mgpu::Error(mgpu::Errc::invalid_argument, "--schedule layer-split with --micro-batches " + std::to_string(o.micro_batches) +
                                                          " (expected 1: layer split runs the batch whole)");
    return pp::layer_split(o.stages);
  }
  return pp::make_schedule(o.schedule, o.stages, o.micro_batches, o.chunks);
}

// The measured bubble of the spans recorded for one step: 1 - compute time / (ranks x makespan).
double measured_bubble(mgpu::trace::Timeline const& timeline, int ranks) {
  auto const spans = timeline.spans();
  if (spans.empty()) return NAN;
  std::int64_t begin = spans.front().begin_ns;
  std::int64_t end = begin;
  double busy = 0;
  for (auto const& s : spans) {
    begin = std::min(begin, s.begin_ns);
    end = std::max(end, s.end_ns);
    if (s.lane == mgpu::trace::compute) busy += static_cast<double>(s.end_ns - s.begin_ns);
  }
  return 1.0 - busy / (static_cast<double>(ranks) * static_cast<double>(end - begin));
}

// A float in JSON with every digit it needs to read back bit for bit (null when not finite).
std::string json_float(double value) {
  if (!std::isfinite(value)) return "null";
  char text[32];
  std::snprintf(text, sizeof text, "%.17g", value);
  return text;
}

// Across processes each process's own timings would cut the model differently: process 0's
// profile, broadcast over the world, is every process's (rounded to float32 on every process).
void share_profile(pp::LayerProfile& profile, mgpu::dist::World const& world, mgpu::DeviceGroup& group) {
  auto const comm = mgpu::dist::make_communicator(world, group);
  std::vector<double>* const parts[] = {&profile.seconds, &profile.parameter_bytes, &profile.activation_bytes};
  std::int64_t const n = static_cast<std::int64_t>(profile.seconds.size());
  group.run([&](int local, mgpu::Device, mgpu::Stream& stream) {
    mgpu::Tensor const values = mgpu::Tensor::empty({3 * n}, mgpu::DType::float32, group.allocator(local));
    auto const span = values.host_span<float>();  // host devices: the only ones across processes
    for (std::size_t k = 0; k < 3; ++k)
      for (std::size_t i = 0; i < static_cast<std::size_t>(n); ++i)
        span[k * static_cast<std::size_t>(n) + i] = static_cast<float>((*parts[k])[i]);
    comm->broadcast(world.rank_of(local), values, 0, stream);
    stream.synchronize();
    if (local != 0) return;
    for (std::size_t k = 0; k < 3; ++k)
      for (std::size_t i = 0; i < static_cast<std::size_t>(n); ++i)
        (*parts[k])[i] = span[k * static_cast<std::size_t>(n) + i];
  });
  comm->finalize();
}

// The plan of --cuts: each chunk's profiled time on its device (memory not modelled).
pp::Partition given(std::vector<std::size_t> const& cuts, pp::Schedule const& schedule, pp::LayerProfile const& profile,
                    std::vector<pp::StageDevice> const& devices) {
  if (cuts.size() != static_cast<std::size_t>(schedule.chunks()) + 1)
    throw mgpu::Error(mgpu::Errc::invalid_argument, "--cuts with " + std::to_string(cuts.size()) + " values (expected " +
                                                        std::to_string(schedule.chunks() + 1) + ": where each of the " +
                                                        std::to_string(schedule.chunks()) + " chunks starts, then the layer count)");
  pp::Partition plan{cuts, {}, {}, {}, {}};
  for (int c = 0; c + 1 < static_cast<int>(cuts.size()); ++c) {
    double seconds = 0;
    for (std::size_t l = cuts[static_cast<std::size_t>(c)]; l < cuts[static_cast<std::size_t>(c) + 1] && l < profile.seconds.size(); ++l)
      seconds += profile.seconds[l];
    plan.device.push_back(schedule.device_of(c));
    plan.chunk_seconds.push_back(seconds / devices[static_cast<std::size_t>(schedule.device_of(c))].speed);
    plan.chunk_bytes.push_back(0.0);
    plan.free_bytes.push_back(INFINITY);
  }
  return plan;
}

int train(Options const& o) {
  mgpu::dist::Session session;  // the job's processes (one without a launcher)
  int const processes = session.place().size;
  std::string const spec =
      !o.devices.empty() ? o.devices : "host:" + std::to_string(std::max(1, o.stages * o.dp / processes));
  mgpu::DeviceGroup group(spec);
  mgpu::dist::World const world = mgpu::dist::make_world(group);
  bool const across = world.processes > 1;
  bool const speaker = world.process == 0;  // every process trains its stages; process 0 prints
  pp::Schedule const schedule = make_schedule(o);
  auto const all = examples::load_data(o.common.data, o.common.label_col, o.seed, 8192);
  auto const [train_set, test_set] = mgpu::data::split(all, o.common.test_fraction, o.seed);
  auto const model = mgpu::nn::Sequential::mlp(examples::parse_widths(o.common.layers, all.features(), all.classes(), {128, 128, 128, 128, 128, 128, 128}), o.common.activation);
  std::int64_t const micro_rows = std::max<std::int64_t>(1, o.batch / (o.micro_batches * o.dp));

  // Profiled layers; the plan for the devices (or the --cuts given, with their predicted times),
  // and the simulator's per-chunk costs (a third forward, two thirds backward) from it.
  pp::LayerProfile profile = pp::profile_layers(model, group, {micro_rows, all.features()});
  if (world.size() != schedule.devices * o.dp)
    throw mgpu::Error(mgpu::Errc::invalid_argument,
                      "--devices " + spec + " has " + std::to_string(world.size()) + " devices" +
                          (across ? " over the " + std::to_string(world.processes) + " processes" : "") +
                          " (expected --stages x --dp = " + std::to_string(schedule.devices * o.dp) + ")");
  if (across) share_profile(profile, world, group);
  std::vector<pp::StageDevice> const devices =
      across ? mgpu::train::stage_devices(world, schedule.devices) : pp::stage_devices(group, schedule.devices);
  pp::Partition const plan = o.cuts.empty() ? pp::partition(model, schedule, profile, devices) : given(o.cuts, schedule, profile, devices);
  std::vector<pp::ActionCosts> costs;
  for (double const s : plan.chunk_seconds) costs.push_back({s / 3, s / 3, s / 3, 0.0});
  pp::Simulation const predicted = pp::simulate(schedule, costs);

  auto timeline = std::make_shared<mgpu::trace::Timeline>();
  std::unique_ptr<mgpu::optim::Optimizer> (*const sgd)() = [] {
    return std::unique_ptr<mgpu::optim::Optimizer>(std::make_unique<mgpu::optim::SGD>(mgpu::optim::SgdOptions{.lr = 1, .momentum = 0.9f}));
  };
  FILE* const log = !speaker ? nullptr : o.json ? stderr : stdout;
  // The live metrics; the executor reports its devices' times there when they are exported.
  examples::JobMetrics metrics(o.metrics, "train_pipeline", {.dp = o.dp, .pp = schedule.devices}, world, log);
  pp::ExecutorOptions options{.seed = o.seed, .data_parallel = o.dp, .compute = examples::precision(o.precision), .timeline = timeline};
  if (metrics) options.metrics = metrics.registry();  // timing costs ~0.2 us an action: only when exported
  if (o.precision == "fp16") options.loss_scaler.emplace();
  if (across) {  // the pipelines' transfers, and the replicas' gradient sync
    options.make_communicator = mgpu::dist::communicator_factory(world);
    options.make_subset_communicator = mgpu::dist::subset_communicator_factory(world);
  }
  pp::Executor executor(model, group, plan.cuts, schedule, sgd, std::move(options));

  std::string trained_on = spec;
  if (across) {
    trained_on.clear();
    for (mgpu::dist::WorldDevice const& d : world.devices)
      trained_on += (d.rank ? "," : "") + examples::device_name(world, d);
  }
  auto const say = [log](auto... args) {
    if (log != nullptr) std::fprintf(log, args...);
  };
  say("mgpu %s: %s, %d stage(s) x %d chunk(s) x %d replica(s) on %s, %d micro-batches of ~%lld rows, %s\n",
      mgpu::version, schedule.name.c_str(), schedule.devices, schedule.chunks_per_device, o.dp, trained_on.c_str(),
      schedule.micro_batches, static_cast<long long>(micro_rows), o.precision.c_str());
  say("plan (%s; one micro-batch's forward + backward per chunk, its peak memory):\n",
      o.cuts.empty()
          ? (across ? "for the devices' speed, process 0's profile" : "for the devices' speed and free memory")
          : "--cuts");
  std::string const report = pp::to_string(plan);
  for (std::size_t begin = 0, end; (end = report.find('\n', begin)) != std::string::npos; begin = end + 1)
    say("  %s\n", report.substr(begin, end - begin).c_str());

  auto host = mgpu::Allocator::create(mgpu::Device{mgpu::DeviceKind::host, 0});
  auto const normalizer = o.common.data.starts_with("idx:") ? mgpu::data::Normalizer{} : mgpu::data::Normalizer::fit(train_set);
  mgpu::data::BatchLoader loader(train_set, {.batch = o.batch, .seed = o.seed, .drop_last = true, .normalizer = normalizer}, host);
  double train_seconds = 0;
  std::int64_t samples = 0;
  std::int64_t step = 0;
  double loss = NAN;
  double bubble = NAN;
  std::vector<double> epoch_losses;
  std::vector<mgpu::Allocator*> allocators;
  for (int r = 0; r < group.size(); ++r) allocators.push_back(&group.allocator(r));
  for (int epoch = 0; epoch < o.epochs; ++epoch) {
    loader.start_epoch(epoch);
    double sum = 0;
    int count = 0;
    auto const start = Clock::now();
    while (auto batch = loader.next()) {
      timeline->clear();
      timeline->enable(epoch + 1 == o.epochs);  // record the last epoch, keep its last step
      float const lr = o.lr * mgpu::optim::cosine_lr(step++, static_cast<std::int64_t>(o.epochs) * loader.batches_per_epoch(), 0.05f);
      auto const step_start = Clock::now();
      double const step_loss = executor.step(batch->x, batch->y, lr);
      sum += step_loss;
      if (metrics)  // each device runs its replica's rows
        metrics.record({.step = step, .loss = step_loss, .seconds = std::chrono::duration<double>(Clock::now() - step_start).count(),
                        .samples = batch->x.dim(0), .learning_rate = lr, .loss_scale = std::nullopt, .skipped = false},
                       metrics.devices(world, allocators, nullptr, {}, batch->x.dim(0) / o.dp, 0));
      ++count;
      samples += batch->x.dim(0);
    }
    timeline->enable(false);
    train_seconds += std::chrono::duration<double>(Clock::now() - start).count();
    loss = sum / std::max(1, count);
    bubble = measured_bubble(*timeline, group.size());  // this process's ranks
    epoch_losses.push_back(loss);
    say("epoch %d/%d  loss %.4f\n", epoch + 1, o.epochs, loss);
    if (log != nullptr) std::fflush(log);  // progress, also through a pipe
  }

  // Evaluate the unsplit model, its float32 weights gathered from the chunks.
  mgpu::nn::Context ctx{group.allocator(0), group.stream(0)};
  auto whole = model.clone();
  whole.materialize(ctx, o.seed);
  executor.gather_parameters(whole, ctx.stream);  // from every process
  if (!speaker) return 0;
  std::vector<float> test_x(test_set.feature_data().begin(), test_set.feature_data().end());
  normalizer.apply(test_x);
  mgpu::Tensor const tx = mgpu::Tensor::empty({test_set.size(), all.features()}, mgpu::DType::float32, *host);
  std::copy(test_x.begin(), test_x.end(), tx.host_span<float>().begin());
  mgpu::Tensor const ty = mgpu::Tensor::empty({test_set.size()}, mgpu::DType::float32, *host);
  std::copy(test_set.labels().begin(), test_set.labels().end(), ty.host_span<float>().begin());
  mgpu::Tensor const dx = mgpu::Tensor::empty(tx.shape(), tx.dtype(), ctx.allocator);
  mgpu::Tensor const dy = mgpu::Tensor::empty(ty.shape(), ty.dtype(), ctx.allocator);
  mgpu::copy_async(dx, tx, ctx.stream);
  mgpu::copy_async(dy, ty, ctx.stream);
  double const accuracy = test_set.size() > 0 ? static_cast<double>(mgpu::nn::count_correct(whole, dx, dy, ctx)) / static_cast<double>(test_set.size()) : NAN;
  if (!o.trace.empty()) timeline->write_chrome_trace(o.trace);
  double const samples_per_s = train_seconds > 0 ? static_cast<double>(samples) / train_seconds : 0.0;
  if (o.json) {
    auto const* scaler = executor.loss_scaler();
    std::string devices;  // the world's
    for (mgpu::dist::WorldDevice const& d : world.devices)
      devices += (d.rank ? ", \"" : "\"") + examples::device_name(world, d) + "\"";
    std::string losses;  // each epoch's mean loss, to the last bit
    for (std::size_t e = 0; e < epoch_losses.size(); ++e) losses += (e ? ", " : "") + json_float(epoch_losses[e]);
    std::printf(
        "{\"schedule\": \"%s\", \"stages\": %d, \"micro_batches\": %d, \"dp\": %d, \"bubble_predicted\": %.6g, "
        "\"bubble_measured\": %.6g, "
        "\"train_loss\": %.6g, \"test_accuracy\": %.6g, \"samples_per_s\": %.6g, \"precision\": \"%s\", "
        "\"skipped_steps\": %lld, "
        "\"devices\": [%s], \"processes\": %d, \"epoch_losses\": [%s]}\n",
        schedule.name.c_str(), o.stages, o.micro_batches, o.dp, predicted.bubble_fraction, bubble, loss, accuracy,
        samples_per_s, o.precision.c_str(), static_cast<long long>(scaler != nullptr ? scaler->skipped() : 0),
        devices.c_str(), world.processes, losses.c_str());
  } else {
    std::printf("bubble: simulated %.3f, measured %.3f (last step)\nfinal: train loss %.4f, test accuracy %.4f, %.0f samples/s\n",
                predicted.bubble_fraction, bubble, loss, accuracy, samples_per_s);
    if (!o.trace.empty()) std::printf("timeline of the last step: %s\n", o.trace.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Train an MLP classifier split into pipeline stages with mgpu"};
  Options o;
  app.add_option("--devices", o.devices,
                 "this process's device spec; every process's together: stages x dp devices (default: host:stages*dp / "
                 "processes)");
  o.common.add_to(app, "seven of 128, then classes");
  app.add_option("--epochs", o.epochs, "passes over the training set")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--batch", o.batch, "examples per step (over all micro-batches and replicas)")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--lr", o.lr, "SGD learning rate (momentum 0.9), cosine-decayed")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--seed", o.seed, "seed for the weights, the split and the data order")->capture_default_str();
  app.add_option("--schedule", o.schedule, "layer-split | gpipe | 1f1b | interleaved | zb")
      ->check(CLI::IsMember({"layer-split", "gpipe", "1f1b", "interleaved", "zb"}))
      ->capture_default_str();
  app.add_option("--stages", o.stages, "pipeline devices P")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--micro-batches", o.micro_batches, "micro-batches M per step")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--chunks", o.chunks, "model chunks per device for --schedule interleaved")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--dp", o.dp, "data-parallel replicas of the pipeline")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--cuts", o.cuts, "layer indices where chunks start, then the layer count, e.g. 0,6,16 (default: planned for the devices)")
      ->delimiter(',');
  app.add_option("--precision", o.precision, "fp32 | bf16 | fp16 (16-bit compute and transfers, float32 master weights)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}))
      ->capture_default_str();
  app.add_option("--trace", o.trace, "write the last step's timeline here (Chrome/Perfetto trace JSON)");
  o.metrics.add_to(app);
  app.add_flag("--json", o.json, "print the final metrics as one JSON object on stdout");
  CLI11_PARSE(app, argc, argv);
  try {
    return train(o);
  } catch (mgpu::Error const& e) {
    std::fprintf(stderr, "train_pipeline: %s\n", e.what());
    return 2;
  }
}
