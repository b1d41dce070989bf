// What the training examples share: their data and model flags, --precision, and the live metrics
// (--metrics-port, --metrics-host, --metrics-file).
#pragma once

#include <algorithm>
#include <cstdio>
#include <memory>
#include <optional>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>

#include <mgpu/core/dtype.hpp>
#include <mgpu/core/error.hpp>
#include <mgpu/data/dataset.hpp>
#include <mgpu/dist/dist.hpp>
#include <mgpu/metrics/exporter.hpp>
#include <mgpu/metrics/nvml.hpp>
#include <mgpu/metrics/registry.hpp>
#include <mgpu/parallel/data_parallel.hpp>
#include <mgpu/pipeline/pipeline.hpp>

namespace examples {

/// The data and model flags of the training examples: --data, --label-col, --test-fraction,
/// --layers and --activation.
struct CommonFlags {
  std::string data = "synthetic";
  std::int64_t label_col = -1;
  double test_fraction = 0.2;
  std::string layers;
  std::string activation = "relu";

  /// Registers the flags on `app`; `default_layers` says what an empty --layers means.
  void add_to(CLI::App& app, std::string const& default_layers) {
    app.add_option("--data", data, "synthetic | csv:PATH | idx:IMAGES,LABELS")->capture_default_str();
    app.add_option("--label-col", label_col, "CSV label column, 0-based; negative counts from the end (default: last)");
    app.add_option("--test-fraction", test_fraction, "share of examples held out for testing")->check(CLI::Range(0.0, 0.99))->capture_default_str();
    app.add_option("--layers", layers, "hidden widths and the output width (= classes), e.g. 64,128,10 (default: " + default_layers + ")");
    app.add_option("--activation", activation, "relu | gelu")->check(CLI::IsMember({"relu", "gelu"}))->capture_default_str();
  }
};

/// Runs `body`, a training example's work, and returns its exit code: on an mgpu::Error, 2, after
/// "\n<name>: <what>" on stderr; on any other exception, 1, after "\n<name>: unexpected error: <what>".
template <class Body>
int run_reporting(char const* name, Body&& body) {
  try {
    return body();
  } catch (mgpu::Error const& e) {
    std::fprintf(stderr, "\n%s: %s\n", name, e.what());
    return 2;
  } catch (std::exception const& e) {
    std::fprintf(stderr, "\n%s: unexpected error: %s\n", name, e.what());
    return 1;
  }
}

/// --precision: "fp32", "bf16" or "fp16" (16-bit compute with float32 master weights; CLI11
/// checks the spelling).
inline mgpu::DType precision(std::string const& p) {
  if (p == "bf16") return mgpu::DType::bfloat16;
  if (p == "fp16") return mgpu::DType::float16;
  return mgpu::DType::float32;
}

/// A device's name in the examples' output: across processes with its process, "p1:host:0".
inline std::string device_name(mgpu::dist::World const& world, mgpu::dist::WorldDevice const& d) {
  return (world.processes > 1 ? "p" + std::to_string(d.process) + ":" : std::string()) + d.device.to_string();
}

/// --data: "synthetic" (clusters of `synthetic_rows` examples, 32 features, 10 classes), "csv:PATH"
/// (label in `label_col`) or "idx:IMAGES,LABELS".
inline mgpu::data::InMemoryDataset load_data(std::string const& data, std::int64_t label_col, std::uint64_t seed,
                                             std::int64_t synthetic_rows) {
  if (data == "synthetic") return mgpu::data::make_clusters(synthetic_rows, 32, 10, seed, 1.5f);
  if (data.starts_with("csv:")) return mgpu::data::load_csv(data.substr(4), {.label_column = label_col});
  if (data.starts_with("idx:")) {
    std::string const paths = data.substr(4);
    auto const comma = paths.find(',');
    if (comma == std::string::npos) throw mgpu::Error(mgpu::Errc::invalid_argument, "--data " + data + " (expected idx:IMAGES,LABELS)");
    return mgpu::data::load_idx(paths.substr(0, comma), paths.substr(comma + 1));
  }
  throw mgpu::Error(mgpu::Errc::invalid_argument, "--data " + data + " (expected synthetic, csv:PATH or idx:IMAGES,LABELS)");
}

/// --layers: the input width, then the listed hidden widths and the output, which must be the class
/// count (`hidden` when the list is empty).
inline std::vector<std::int64_t> parse_widths(std::string const& layers, std::int64_t features, std::int64_t classes,
                                              std::vector<std::int64_t> const& hidden) {
  std::vector<std::int64_t> w{features};
  if (layers.empty()) {
    w.insert(w.end(), hidden.begin(), hidden.end());
    w.push_back(classes);
    return w;
  }
  std::stringstream in(layers);
  std::string item;
  while (std::getline(in, item, ',')) {
    try {
      std::size_t used = 0;
      long long const v = std::stoll(item, &used);
      if (used != item.size() || v < 1) throw std::invalid_argument(item);
      w.push_back(v);
    } catch (std::exception const&) {
      throw mgpu::Error(mgpu::Errc::invalid_argument, "--layers " + layers + ": '" + item + "' (expected positive whole numbers, e.g. 64,128,10)");
    }
  }
  if (w.size() < 2 || w.back() != classes)
    throw mgpu::Error(mgpu::Errc::invalid_argument, "--layers " + layers + " ends in " + std::to_string(w.back()) + " but the data has " +
                                                        std::to_string(classes) + " classes (expected the last width to be " +
                                                        std::to_string(classes) + ")");
  return w;
}

/// --metrics-port, --metrics-host and --metrics-file: where a trainer's live metrics go.
struct MetricsFlags {
  std::optional<int> port;
  std::string host = "127.0.0.1";
  std::string file;

  void add_to(CLI::App& app) {
    app.add_option("--metrics-port", port, "serve Prometheus metrics at http://HOST:N/metrics (0: any free port; process p of several: N + p)");
    app.add_option("--metrics-host", host, "the address --metrics-port listens on (0.0.0.0: every interface)")->capture_default_str();
    app.add_option("--metrics-file", file, "write the metrics to this NAME.prom after every step, atomically, for node_exporter's textfile collector (process p of several: NAME.pP.prom)");
  }
};

/// A trainer's live metrics as MetricsFlags asks: the registry, its HTTP endpoint, its textfile.
/// The registry is there whatever the flags say: the executors report their devices' times to it
/// (registry(), their options' `metrics`), and devices() reads them back. Exports nothing when
/// neither --metrics-port nor --metrics-file was given. Bad flags throw mgpu::Error (a port outside
/// 0 to 65535, a port in use, a file not named .prom or not writable).
class JobMetrics {
 public:
  /// Prints where the metrics go on `log` (the endpoint on stderr when `log` is null).
  JobMetrics(MetricsFlags const& flags, std::string const& job, mgpu::metrics::Layout layout, mgpu::dist::World const& world, std::FILE* log)
      : JobMetrics(flags, std::make_shared<mgpu::metrics::Registry>(job, layout), world, log) {}
  /// As above, exporting `registry` (a trainer's).
  JobMetrics(MetricsFlags const& flags, std::shared_ptr<mgpu::metrics::Registry> registry, mgpu::dist::World const& world, std::FILE* log)
      : registry_(std::move(registry)) {
    if (!flags.port && flags.host != "127.0.0.1")
      throw mgpu::Error(mgpu::Errc::invalid_argument, "--metrics-host " + flags.host + " without --metrics-port (expected both)");
    if (!flags.port && flags.file.empty()) return;
    exporting_ = true;
    for (mgpu::dist::WorldDevice const& d : world.devices) {  // this process's GPUs: NVML's utilisation by PCI bus id
      if (d.process != world.process || d.device.kind != mgpu::DeviceKind::cuda) continue;
      if (!nvml_) nvml_ = std::make_unique<mgpu::metrics::Nvml>();
      bus_ids_[d.device.index] = mgpu::metrics::cuda_pci_bus_id(d.device.index);
    }
    if (nvml_ && !nvml_->available()) std::fprintf(log != nullptr ? log : stderr, "metrics: %s\n", nvml_->reason().c_str());
    if (!flags.file.empty()) {
      file_ = flags.file;
      if (world.processes > 1) file_.replace_extension(".p" + std::to_string(world.process) + file_.extension().string());
      mgpu::metrics::write_textfile(*registry_, file_);  // a bad name or folder fails before training
      if (log != nullptr) std::fprintf(log, "metrics: %s after every step\n", file_.c_str());
    }
    if (flags.port) {
      int const port = *flags.port > 0 ? *flags.port + world.process : *flags.port;
      exporter_ = std::make_unique<mgpu::metrics::HttpExporter>(*registry_, flags.host, port);
      std::fprintf(log != nullptr ? log : stderr, "metrics: http://%s:%d/metrics\n", flags.host.c_str(), exporter_->port());
      std::fflush(log != nullptr ? log : stderr);  // a scraper waiting for the line reads it at once
    }
  }

  /// Whether the metrics are exported (--metrics-port or --metrics-file).
  [[nodiscard]] explicit operator bool() const noexcept { return exporting_; }
  /// Where the executors report their devices' times.
  [[nodiscard]] std::shared_ptr<mgpu::metrics::Registry> const& registry() const noexcept { return registry_; }

  /// Each of this process's first `allocators.size()` devices in the step just run: its memory,
  /// the compute and wait times its executor reported to registry() this step (none: not
  /// exported), its rows from `dp` (a data-parallel step), else `rows_each`; `tokens_per_row`
  /// tokens per row; `weights` per device.
  [[nodiscard]] std::vector<mgpu::metrics::DeviceStep> devices(mgpu::dist::World const& world, std::vector<mgpu::Allocator*> const& allocators,
                                                               mgpu::parallel::DataParallelResult const* dp, std::vector<double> const& weights,
                                                               std::int64_t rows_each, std::int64_t tokens_per_row) const {
    std::vector<mgpu::metrics::DeviceStep> out(allocators.size());
    for (std::size_t r = 0; r < allocators.size(); ++r) {
      mgpu::dist::WorldDevice const& d = world.devices[static_cast<std::size_t>(world.rank_of(static_cast<int>(r)))];
      mgpu::metrics::DeviceStep& s = out[r];
      s.device = device_name(world, d);
      s.kind = d.device.kind == mgpu::DeviceKind::host ? "host" : "cuda";
      s.world_rank = d.rank;
      s.rows = dp != nullptr && r < dp->rows.size() ? dp->rows[r] : rows_each;
      if (std::optional<mgpu::metrics::DeviceTimes> const times = registry_->reported_times(static_cast<int>(r))) {
        s.compute_seconds = times->compute_seconds;
        s.wait_seconds = times->wait_seconds;
      }
      s.tokens = s.rows * tokens_per_row;
      s.shard_weight = r < weights.size() ? weights[r] : 1.0;
      mgpu::metrics::read_memory(s, *allocators[r]);
      if (auto const id = bus_ids_.find(d.device.index); d.device.kind == mgpu::DeviceKind::cuda && id != bus_ids_.end())
        s.gpu_utilization = nvml_->busy_ratio(id->second);
    }
    return out;
  }

  /// Records a step, then replaces the textfile.
  void record(mgpu::metrics::JobStep const& job, std::vector<mgpu::metrics::DeviceStep> const& devices) {
    registry_->record(job, devices);  // forgets the reported times: the next step's are its own
    if (!file_.empty()) mgpu::metrics::write_textfile(*registry_, file_);
  }

 private:
  std::shared_ptr<mgpu::metrics::Registry> registry_;
  bool exporting_ = false;
  std::unique_ptr<mgpu::metrics::HttpExporter> exporter_;
  std::filesystem::path file_;
  std::unique_ptr<mgpu::metrics::Nvml> nvml_;  // with GPUs
  std::map<int, std::string> bus_ids_;         // PCI bus id by CUDA ordinal, this process's GPUs
};

/// A person's live view on a terminal (train_gpt --progress): a bar with the step, loss, tokens/s
/// and the time left, and below it one line per device of the step just run (busy share, memory
/// in use and its peak, rows and tokens per second), redrawn in place on stderr with ANSI cursor
/// movement. clear_progress() erases it before a log line.
inline void draw_progress(std::int64_t step, std::int64_t steps, float loss, double tokens_per_s, double left_s,
                          std::vector<mgpu::metrics::DeviceStep> const& devices, double step_s) {
  std::size_t const width = 30;
  double const done = static_cast<double>(step) / static_cast<double>(std::max<std::int64_t>(1, steps));
  std::string bar(std::min(width, static_cast<std::size_t>(static_cast<double>(width) * done)), '#');
  bar.resize(width, '.');
  auto const left = static_cast<long long>(std::max(0.0, left_s));
  std::fprintf(stderr, "\r[%s] step %lld/%lld  loss %.4f  %.0f tokens/s  %lldm%02llds left\x1b[K", bar.c_str(),
               static_cast<long long>(step), static_cast<long long>(steps), static_cast<double>(loss), tokens_per_s,
               left / 60, left % 60);
  double const per_s = step_s > 0 ? 1.0 / step_s : 0.0;
  for (mgpu::metrics::DeviceStep const& d : devices) {
    char busy[16] = "   -";
    if (d.compute_seconds) std::snprintf(busy, sizeof busy, "%3.0f%%", 100.0 * std::min(1.0, *d.compute_seconds * per_s));
    std::fprintf(stderr, "\n  %-12s busy %s  memory %.2f MiB (peak %.2f MiB)  %.0f rows/s  %.0f tokens/s\x1b[K",
                 d.device.c_str(), busy, static_cast<double>(d.memory_in_use) / (1 << 20),
                 static_cast<double>(d.memory_peak) / (1 << 20), static_cast<double>(d.rows) * per_s,
                 static_cast<double>(d.tokens) * per_s);
  }
  if (!devices.empty()) std::fprintf(stderr, "\x1b[%zuA", devices.size());
  std::fflush(stderr);
}

/// Erases what draw_progress() drew.
inline void clear_progress() { std::fputs("\r\x1b[J", stderr); }

}  // namespace examples
