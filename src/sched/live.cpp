// Node state from a DeviceGroup, peer bandwidth measurement, and the task placer.
#include <mgpu/sched/live.hpp>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <exception>
#include <map>
#include <memory>

#include <mgpu/core/error.hpp>
#include <mgpu/core/tensor.hpp>

namespace mgpu::sched {
namespace {

// "NVIDIA H200" -> "H200", "NVIDIA A100-SXM4-80GB" -> "A100": the first word with a digit, up to '-'.
std::string model_of(std::string const& name) {
  std::size_t start = 0;
  while (start < name.size()) {
    std::size_t end = name.find(' ', start);
    if (end == std::string::npos) end = name.size();
    std::string const word = name.substr(start, end - start);
    if (std::any_of(word.begin(), word.end(), [](unsigned char c) { return std::isdigit(c) != 0; })) return word.substr(0, word.find('-'));
    start = end + 1;
  }
  return name;
}

// Ranks that share memory with each rank: the same GPU, or host devices (one machine).
bool shares_memory(Device a, Device b) { return a.kind == b.kind && (a.kind == DeviceKind::host || a.index == b.index); }

}  // namespace

std::vector<std::vector<double>> measure_peer_bandwidth(DeviceGroup& group, std::size_t bytes, int repeats) {
  if (bytes < 4 || repeats < 1)
    throw Error(Errc::invalid_argument, "measure_peer_bandwidth of " + std::to_string(bytes) + " bytes x " + std::to_string(repeats) +
                                            " (expected at least 4 bytes and 1 repeat)");
  auto const n = static_cast<std::size_t>(group.size());
  auto const count = static_cast<std::int64_t>(bytes / 4);
  std::vector<Tensor> buffers;
  for (int r = 0; r < group.size(); ++r) {
    buffers.push_back(Tensor::empty({count}, DType::float32, group.allocator(r)));
    fill_async(buffers.back(), 1.0f, group.stream(r));
  }
  for (int r = 0; r < group.size(); ++r) group.stream(r).synchronize();
  std::vector<std::vector<double>> bandwidth(n, std::vector<double>(n, 0.0));
  for (std::size_t i = 0; i < n; ++i) {
    for (std::size_t j = 0; j < n; ++j) {
      if (i == j) continue;
      Stream& stream = group.stream(static_cast<int>(j));
      std::vector<double> seconds;
      for (int k = 0; k <= repeats; ++k) {  // the first copy warms up
        auto const t0 = std::chrono::steady_clock::now();
        copy_async(buffers[j], buffers[i], stream);
        stream.synchronize();
        if (k > 0) seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
      std::nth_element(seconds.begin(), seconds.begin() + static_cast<std::ptrdiff_t>(seconds.size() / 2), seconds.end());
      bandwidth[i][j] = static_cast<double>(count * 4) / std::max(seconds[seconds.size() / 2], 1e-12) * 1e-9;
    }
  }
  return bandwidth;
}

NodeState node_state(DeviceGroup const& group, std::vector<std::vector<double>> const& bandwidth) {
  auto const n = static_cast<std::size_t>(group.size());
  if (!bandwidth.empty() && (bandwidth.size() != n || std::any_of(bandwidth.begin(), bandwidth.end(), [&](auto const& row) { return row.size() != n; })))
    throw Error(Errc::invalid_argument, "a bandwidth matrix of " + std::to_string(bandwidth.size()) + " rows for a group of " + std::to_string(n) +
                                            " devices (expected " + std::to_string(n) + " x " + std::to_string(n) + ")");
  auto const peers = peer_access_matrix(group.devices());
  double best_pair = 0;
  for (std::size_t i = 0; i < bandwidth.size(); ++i)
    for (std::size_t j = 0; j < i; ++j) best_pair = std::max(best_pair, std::min(bandwidth[i][j], bandwidth[j][i]));
  std::vector<DeviceProperties> props;
  double fastest = 0;
  for (int r = 0; r < group.size(); ++r) {
    props.push_back(properties(group.device(r)));
    fastest = std::max(fastest, props.back().throughput_gflops);
  }
  NodeState node;
  for (std::size_t i = 0; i < n; ++i) {
    Device const device = group.device(static_cast<int>(i));
    DeviceState d;
    d.id = static_cast<int>(i);
    d.type = device.kind == DeviceKind::host ? "host" : model_of(props[i].name);
    int sharing = 0;
    for (Device const other : group.devices()) sharing += shares_memory(device, other) ? 1 : 0;
    d.capacity_bytes = static_cast<double>(props[i].memory_bytes) / std::max(1, sharing);
    d.free_bytes = std::max(0.0, d.capacity_bytes - static_cast<double>(group.allocator(static_cast<int>(i)).stats().reserved));
    d.speed = fastest > 0 ? props[i].throughput_gflops / fastest : 1.0;
    d.links.assign(n, 0.0);
    for (std::size_t j = 0; j < n; ++j) {
      if (j == i) continue;
      Device const other = group.device(static_cast<int>(j));
      if (best_pair > 0) d.links[j] = std::min(bandwidth[i][j], bandwidth[j][i]) / best_pair;
      else d.links[j] = shares_memory(device, other) ? 1.0 : (peers[i][j] ? 0.5 : 0.0);
    }
    node.devices.push_back(std::move(d));
  }
  return node;
}

TaskPlacer::TaskPlacer(DeviceGroup& group, Scheduler scheduler) : group_(group), scheduler_(std::move(scheduler)), node_(node_state(group)) {}

int TaskPlacer::submit(Request const& task, std::function<void(int rank, Stream& stream)> const& enqueue) {
  Request request = task;
  request.exclusive = false;  // tasks queue on a device's stream beside others
  std::optional<Placement> const placement = node_.schedule(request, scheduler_);
  if (!placement)
    throw Error(Errc::out_of_memory, "task '" + request.name + "': no device can take it now (" + std::to_string(request.memory_bytes) +
                                         " bytes, type '" + request.allowed_types + "'; expected a device passing every filter)");
  int const rank = placement->devices.front();
  Stream& stream = group_.stream(rank);
  try {
    enqueue(rank, stream);
  } catch (...) {
    node_.release(request, *placement);
    throw;
  }
  std::uint64_t id = 0;
  {
    std::lock_guard lock(mutex_);
    id = next_id_++;
    outstanding_.emplace(id, std::pair{request, *placement});
  }
  stream.enqueue([this, id] { release(id); });
  return rank;
}

void TaskPlacer::release(std::uint64_t id) {
  std::lock_guard lock(mutex_);
  auto it = outstanding_.find(id);
  if (it == outstanding_.end()) return;
  node_.release(it->second.first, it->second.second);
  outstanding_.erase(it);
}

void TaskPlacer::wait() {
  std::exception_ptr failure;
  for (int r = 0; r < group_.size(); ++r) {
    try {
      group_.stream(r).synchronize();
    } catch (...) {
      if (!failure) failure = std::current_exception();
    }
  }
  {
    std::lock_guard lock(mutex_);
    for (auto const& [id, task] : outstanding_) node_.release(task.first, task.second);
    outstanding_.clear();
  }
  if (failure) std::rethrow_exception(failure);
}

std::optional<GangPlan> TaskPlacer::plan_room(Request const& gang, int max_moves) {
  std::vector<PlacedRequest> placed;
  NodeState now;
  {
    std::lock_guard lock(mutex_);  // release() changes both under it
    for (auto const& [id, task] : outstanding_) placed.push_back({id, task.first, task.second});
    now = node_.snapshot();
  }
  return sched::plan_room(now, placed, gang, scheduler_, max_moves);
}

TaskPlacer::~TaskPlacer() {
  try {
    wait();
  } catch (...) {  // NOLINT(bugprone-empty-catch): destructors must not throw; wait() reports failures
  }
}

}  // namespace mgpu::sched
