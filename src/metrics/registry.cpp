// The registry's state and its Prometheus text exposition.
#include <algorithm>
#include <charconv>
#include <string_view>

#include <mgpu/core/error.hpp>
#include <mgpu/metrics/registry.hpp>

namespace mgpu::metrics {

struct Registry::State {
  // A device's counters across steps, and its last `window` steps' compute and wall seconds.
  struct Device {
    DeviceStep last;
    double compute_total = 0, wait_total = 0;
    std::int64_t rows_total = 0, tokens_total = 0;
    std::vector<double> window_compute, window_wall;  // rings of window_steps entries
    double busy_last = NAN, busy_window = NAN;
  };
  std::string job;
  Layout layout;
  std::size_t window_steps = 1;
  std::size_t ring_next = 0, ring_filled = 0;
  JobStep last;
  std::int64_t steps = 0;
  double samples_total = 0, tokens_total = 0, skipped_total = 0;
  std::vector<Device> devices;
  std::vector<std::optional<DeviceTimes>> reported;  // by rank, since the last record()
};

void read_memory(DeviceStep& d, Allocator const& allocator) {
  MemoryStats const s = allocator.stats();
  d.memory_in_use = s.allocated;
  d.memory_peak = s.peak_allocated;
  d.memory_capacity = allocator.limit();
}

Registry::Registry(std::string job, Layout layout, int window_steps) : state_(std::make_unique<State>()) {
  if (window_steps < 1)
    throw Error(Errc::invalid_argument,
                "metrics::Registry: window_steps " + std::to_string(window_steps) + " (expected at least 1)");
  state_->job = std::move(job);
  state_->layout = layout;
  state_->window_steps = static_cast<std::size_t>(window_steps);
}

Registry::~Registry() = default;

void Registry::record(JobStep const& job, std::span<DeviceStep const> devices) {
  std::lock_guard const lock(mutex_);
  State& s = *state_;
  bool same = s.devices.size() == devices.size();
  for (std::size_t i = 0; same && i < devices.size(); ++i) same = s.devices[i].last.device == devices[i].device;
  if (!same) {
    s.devices.assign(devices.size(), {});
    for (State::Device& d : s.devices)
      d.window_compute.assign(s.window_steps, 0), d.window_wall.assign(s.window_steps, 0);
    s.ring_next = s.ring_filled = 0;
  }
  s.last = job;
  s.steps += 1;
  for (auto& t : s.reported) t.reset();  // the next step's executor reports anew
  s.samples_total += static_cast<double>(job.samples);
  s.tokens_total += static_cast<double>(job.tokens);
  if (job.skipped) s.skipped_total += 1;
  std::size_t const slot = s.ring_next;
  s.ring_next = (s.ring_next + 1) % s.window_steps;
  s.ring_filled = std::min(s.ring_filled + 1, s.window_steps);
  for (std::size_t i = 0; i < devices.size(); ++i) {
    State::Device& d = s.devices[i];
    DeviceStep const& step = devices[i];
    d.last.device = step.device;  // assignments reuse the strings' storage after the first step
    d.last.kind = step.kind;
    d.last.world_rank = step.world_rank;
    d.last.compute_seconds = step.compute_seconds;
    d.last.wait_seconds = step.wait_seconds;
    d.last.rows = step.rows;
    d.last.tokens = step.tokens;
    d.last.shard_weight = step.shard_weight;
    d.last.memory_in_use = step.memory_in_use;
    d.last.memory_peak = step.memory_peak;
    d.last.memory_capacity = step.memory_capacity;
    d.last.gpu_utilization = step.gpu_utilization;
    if (step.wait_seconds) d.wait_total += *step.wait_seconds;
    d.rows_total += step.rows;
    d.tokens_total += step.tokens;
    if (!step.compute_seconds) {
      d.busy_last = d.busy_window = NAN;
      continue;
    }
    double const compute = std::max(0.0, *step.compute_seconds);
    d.compute_total += compute;
    d.window_compute[slot] = compute;
    d.window_wall[slot] = job.seconds;
    // Compute over wall time; a measurement a little over the step's wall time (clocks read on
    // different threads) counts as fully busy.
    d.busy_last = job.seconds > 0 ? std::min(1.0, compute / job.seconds) : NAN;
    double compute_sum = 0, wall_sum = 0;
    for (std::size_t k = 0; k < s.ring_filled; ++k) compute_sum += d.window_compute[k], wall_sum += d.window_wall[k];
    d.busy_window = wall_sum > 0 ? std::min(1.0, compute_sum / wall_sum) : NAN;
  }
}

void Registry::report_times(std::span<DeviceTimes const> times) {
  for (DeviceTimes const& t : times) {
    if (t.rank < 0 || !(t.compute_seconds >= 0) || (t.wait_seconds && !(*t.wait_seconds >= 0)))
      throw Error(Errc::invalid_argument,
                  "metrics::Registry::report_times: rank " + std::to_string(t.rank) + ", compute " +
                      std::to_string(t.compute_seconds) + " s, wait " +
                      (t.wait_seconds ? std::to_string(*t.wait_seconds) + " s" : std::string("none")) +
                      " (expected a rank >= 0 and times >= 0)");
  }
  std::lock_guard const lock(mutex_);
  auto& reported = state_->reported;
  for (DeviceTimes const& t : times) {
    auto const r = static_cast<std::size_t>(t.rank);
    if (r >= reported.size()) reported.resize(r + 1);
    reported[r] = t;
  }
}

std::optional<DeviceTimes> Registry::reported_times(int rank) const {
  std::lock_guard const lock(mutex_);
  auto const& reported = state_->reported;
  if (rank < 0 || static_cast<std::size_t>(rank) >= reported.size()) return std::nullopt;
  return reported[static_cast<std::size_t>(rank)];
}

std::int64_t Registry::steps_recorded() const {
  std::lock_guard const lock(mutex_);
  return state_->steps;
}

namespace {

void append_number(std::string& out, double v) {
  if (std::isnan(v)) {
    out += "NaN";
    return;
  }
  if (std::isinf(v)) {
    out += v > 0 ? "+Inf" : "-Inf";
    return;
  }
  char buffer[32];
  auto const [end, ec] = std::to_chars(buffer, buffer + sizeof buffer, v);
  out.append(buffer, ec == std::errc{} ? end : buffer);
}

// A label value with \, " and newline escaped, as the text format asks.
void append_escaped(std::string& out, std::string_view v) {
  for (char const c : v) {
    if (c == '\\' || c == '"')
      out += '\\', out += c;
    else if (c == '\n')
      out += "\\n";
    else
      out += c;
  }
}

void family(std::string& out, std::string_view name, std::string_view type, std::string_view help) {
  out.append("# HELP ").append(name).append(" ").append(help).append("\n");
  out.append("# TYPE ").append(name).append(" ").append(type).append("\n");
}

}  // namespace

std::string Registry::exposition() const {
  std::lock_guard const lock(mutex_);
  State const& s = *state_;
  std::string out;
  out.reserve(4096 + 1024 * s.devices.size());
  std::string job_labels = "job=\"";
  append_escaped(job_labels, s.job);
  job_labels += '"';
  auto const sample = [&](std::string_view name, std::string_view labels, double v) {
    out.append(name).append("{").append(labels).append("} ");
    append_number(out, v);
    out += '\n';
  };
  std::vector<std::string> device_labels;
  for (State::Device const& d : s.devices) {
    std::string l = job_labels + ",rank=\"" + std::to_string(d.last.world_rank) + "\",device=\"";
    append_escaped(l, d.last.device);
    l += "\",kind=\"";
    append_escaped(l, d.last.kind);
    l += '"';
    device_labels.push_back(std::move(l));
  }

  family(out, "mgpu_layout_info", "gauge",
         "The job's layout: data-parallel replicas, tensor-parallel ranks, pipeline stages, ZeRO stage.");
  sample("mgpu_layout_info",
         job_labels + ",dp=\"" + std::to_string(s.layout.dp) + "\",tp=\"" + std::to_string(s.layout.tp) + "\",pp=\"" +
             std::to_string(s.layout.pp) + "\",zero=\"" + std::to_string(s.layout.zero) + '"',
         1);
  if (s.steps == 0) return out;

  family(out, "mgpu_step", "gauge", "Training steps done.");
  sample("mgpu_step", job_labels, static_cast<double>(s.last.step));
  family(out, "mgpu_loss", "gauge", "The last step's training loss (NaN when it was not read).");
  sample("mgpu_loss", job_labels, s.last.loss);
  family(out, "mgpu_step_seconds", "gauge", "The last step's wall time.");
  sample("mgpu_step_seconds", job_labels, s.last.seconds);
  family(out, "mgpu_samples_total", "counter", "Samples (rows or sequences) trained on.");
  sample("mgpu_samples_total", job_labels, s.samples_total);
  family(out, "mgpu_tokens_total", "counter", "Tokens trained on.");
  sample("mgpu_tokens_total", job_labels, s.tokens_total);
  double const per_s = s.last.seconds > 0 ? 1.0 / s.last.seconds : 0.0;
  family(out, "mgpu_samples_per_second", "gauge", "Samples per second in the last step.");
  sample("mgpu_samples_per_second", job_labels, static_cast<double>(s.last.samples) * per_s);
  family(out, "mgpu_tokens_per_second", "gauge", "Tokens per second in the last step.");
  sample("mgpu_tokens_per_second", job_labels, static_cast<double>(s.last.tokens) * per_s);
  family(out, "mgpu_learning_rate", "gauge", "The last step's learning rate.");
  sample("mgpu_learning_rate", job_labels, s.last.learning_rate);
  if (s.last.loss_scale) {
    family(out, "mgpu_loss_scale", "gauge", "The dynamic loss scale (fp16).");
    sample("mgpu_loss_scale", job_labels, *s.last.loss_scale);
  }
  family(out, "mgpu_skipped_steps_total", "counter", "Steps whose update was skipped (an overflow under fp16).");
  sample("mgpu_skipped_steps_total", job_labels, s.skipped_total);
  if (s.devices.empty()) return out;

  bool const any_busy = std::any_of(s.devices.begin(), s.devices.end(),
                                    [](State::Device const& d) { return d.last.compute_seconds.has_value(); });
  if (any_busy) {
    family(out, "mgpu_device_busy_ratio", "gauge", "Compute time over wall time in the last step.");
    for (std::size_t i = 0; i < s.devices.size(); ++i)
      if (s.devices[i].last.compute_seconds) sample("mgpu_device_busy_ratio", device_labels[i], s.devices[i].busy_last);
    family(out, "mgpu_device_busy_window_ratio", "gauge",
           "Compute time over wall time in the last steps' moving window.");
    for (std::size_t i = 0; i < s.devices.size(); ++i)
      if (s.devices[i].last.compute_seconds)
        sample("mgpu_device_busy_window_ratio", device_labels[i], s.devices[i].busy_window);
    family(out, "mgpu_device_compute_seconds_total", "counter", "Seconds of forward and backward.");
    for (std::size_t i = 0; i < s.devices.size(); ++i)
      if (s.devices[i].last.compute_seconds)
        sample("mgpu_device_compute_seconds_total", device_labels[i], s.devices[i].compute_total);
    auto const waits = [](State::Device const& d) { return d.last.compute_seconds && d.last.wait_seconds; };
    if (std::any_of(s.devices.begin(), s.devices.end(), waits)) {
      family(out, "mgpu_device_collective_wait_seconds_total", "counter", "Seconds spent waiting on collectives.");
      for (std::size_t i = 0; i < s.devices.size(); ++i)
        if (waits(s.devices[i]))
          sample("mgpu_device_collective_wait_seconds_total", device_labels[i], s.devices[i].wait_total);
    }
  }
  if (std::any_of(s.devices.begin(), s.devices.end(),
                  [](State::Device const& d) { return d.last.gpu_utilization.has_value(); })) {
    family(out, "mgpu_device_gpu_utilization_ratio", "gauge",
           "NVML's share of its last sample period in which a kernel ran on the GPU.");
    for (std::size_t i = 0; i < s.devices.size(); ++i)
      if (s.devices[i].last.gpu_utilization)
        sample("mgpu_device_gpu_utilization_ratio", device_labels[i], *s.devices[i].last.gpu_utilization);
  }
  family(out, "mgpu_device_memory_bytes", "gauge",
         "Device memory: held by live buffers (in_use), their peak (peak), the allocator limit (capacity).");
  for (std::size_t i = 0; i < s.devices.size(); ++i) {
    DeviceStep const& d = s.devices[i].last;
    sample("mgpu_device_memory_bytes", device_labels[i] + ",state=\"in_use\"", static_cast<double>(d.memory_in_use));
    sample("mgpu_device_memory_bytes", device_labels[i] + ",state=\"peak\"", static_cast<double>(d.memory_peak));
    if (d.memory_capacity)
      sample("mgpu_device_memory_bytes", device_labels[i] + ",state=\"capacity\"",
             static_cast<double>(*d.memory_capacity));
  }
  family(out, "mgpu_device_rows_total", "counter", "Rows (samples or sequences) the device processed.");
  for (std::size_t i = 0; i < s.devices.size(); ++i)
    sample("mgpu_device_rows_total", device_labels[i], static_cast<double>(s.devices[i].rows_total));
  family(out, "mgpu_device_tokens_total", "counter", "Tokens the device processed.");
  for (std::size_t i = 0; i < s.devices.size(); ++i)
    sample("mgpu_device_tokens_total", device_labels[i], static_cast<double>(s.devices[i].tokens_total));
  family(out, "mgpu_device_shard_weight", "gauge", "The device's share weight of the batch's rows.");
  for (std::size_t i = 0; i < s.devices.size(); ++i)
    sample("mgpu_device_shard_weight", device_labels[i], s.devices[i].last.shard_weight);
  return out;
}

}  // namespace mgpu::metrics
