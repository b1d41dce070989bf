// DeviceGroup: per-rank driver threads, streams and allocators; sharding.
#include <mgpu/core/device_group.hpp>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <numeric>
#include <string>
#include <thread>
#include <utility>

#include <mgpu/core/error.hpp>

#include "core/cuda_backend.hpp"

namespace mgpu {

std::vector<std::int64_t> shard_sizes(std::int64_t rows, int parts, std::span<double const> weights) {
  if (parts < 1) throw Error(Errc::invalid_argument, "shard into " + std::to_string(parts) + " parts (expected at least 1)");
  if (rows < 0) throw Error(Errc::invalid_argument, "shard " + std::to_string(rows) + " rows (expected rows >= 0)");
  std::vector<std::int64_t> sizes(static_cast<std::size_t>(parts), 0);
  if (weights.empty()) {
    for (int p = 0; p < parts; ++p) sizes[static_cast<std::size_t>(p)] = rows / parts + (p < rows % parts ? 1 : 0);
    return sizes;
  }
  if (weights.size() != static_cast<std::size_t>(parts))
    throw Error(Errc::invalid_argument, "shard weights: got " + std::to_string(weights.size()) + " weights for " +
                                            std::to_string(parts) + " parts (expected one weight per part)");
  long double total = 0;
  for (std::size_t p = 0; p < weights.size(); ++p) {
    if (!std::isfinite(weights[p]) || weights[p] < 0)
      throw Error(Errc::invalid_argument, "shard weight " + std::to_string(p) + " is " + std::to_string(weights[p]) +
                                              " (expected a finite weight >= 0)");
    total += weights[p];
  }
  if (total <= 0) throw Error(Errc::invalid_argument, "shard weights are all 0 (expected at least one positive weight)");

  // Largest remainder: floor of each quota, then one more row to the largest fractions.
  std::vector<long double> fraction(weights.size());
  std::int64_t assigned = 0;
  for (std::size_t p = 0; p < weights.size(); ++p) {
    long double const quota = static_cast<long double>(rows) * weights[p] / total;
    sizes[p] = std::min(rows, static_cast<std::int64_t>(std::floor(quota)));
    fraction[p] = quota - static_cast<long double>(sizes[p]);
    assigned += sizes[p];
  }
  std::vector<std::size_t> order(weights.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  // Fractions are compared on a 2^-32 grid, so that exact ties which rounding split apart still go
  // to the lower part index.
  std::vector<std::int64_t> key(weights.size());
  for (std::size_t p = 0; p < weights.size(); ++p) key[p] = std::llround(fraction[p] * 4294967296.0L);
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return key[a] > key[b]; });
  for (std::size_t i = 0; assigned < rows; i = (i + 1) % order.size()) {
    if (weights[order[i]] > 0) {
      ++sizes[order[i]];
      ++assigned;
    }
  }
  for (std::size_t i = order.size(); assigned > rows;) {  // rounding overshoot: take from the smallest fractions
    i = (i == 0 ? order.size() : i) - 1;
    if (sizes[order[i]] > 0) {
      --sizes[order[i]];
      --assigned;
    }
  }
  return sizes;
}

namespace {
thread_local DeviceGroup::Impl const* running_group = nullptr;
}

struct DeviceGroup::Impl {
  explicit Impl(std::vector<Device> devs) : devices(std::move(devs)) {
    if (devices.empty()) throw Error(Errc::invalid_argument, "a device group needs at least one device (got none)");
    for (Device const d : devices) {
      if (d.kind == DeviceKind::cuda) (void)properties(d);  // validates the ordinal
      if (d.index < 0) throw Error(Errc::invalid_argument, "device " + d.to_string() + " has a negative index (expected >= 0)");
      allocators.push_back(Allocator::create(d));
      streams.push_back(std::make_unique<Stream>(d));
    }
    for (int rank = 0; rank < static_cast<int>(devices.size()); ++rank) drivers.emplace_back([this, rank] { drive(rank); });
  }

  ~Impl() {
    {
      std::lock_guard lock(mutex);
      stopping = true;
    }
    start_cv.notify_all();
    for (auto& driver : drivers) driver.join();
  }

  Impl(Impl const&) = delete;
  Impl& operator=(Impl const&) = delete;

  void drive(int rank) {
    Device const device = devices[static_cast<std::size_t>(rank)];
    std::exception_ptr bind_error;
    if (device.kind == DeviceKind::cuda) {
      try {
        detail::cuda::set_device(device.index);
      } catch (...) {
        bind_error = std::current_exception();
      }
    }
    std::uint64_t seen = 0;
    std::unique_lock lock(mutex);
    while (true) {
      start_cv.wait(lock, [&] { return stopping || generation != seen; });
      if (stopping) return;
      seen = generation;
      auto const* fn = job;
      lock.unlock();
      std::exception_ptr failure = bind_error;
      if (!failure) {
        running_group = this;
        try {
          (*fn)(rank, device, *streams[static_cast<std::size_t>(rank)]);
        } catch (...) {
          failure = std::current_exception();
        }
        running_group = nullptr;
        try {
          streams[static_cast<std::size_t>(rank)]->synchronize();
        } catch (...) {
          // The stream's own failure may be what made fn fail (a send skipped after it).
          std::exception_ptr const stream_failure = std::current_exception();
          if (!failure || rank_of_failure(stream_failure) < rank_of_failure(failure)) failure = stream_failure;
        }
      }
      if (failure) notify_failure(rank, failure);
      lock.lock();
      if (failure && (!first_error || rank_of_failure(failure) < rank_of_failure(first_error))) {
        first_error = failure;
        first_error_rank = rank;
      }
      if (--remaining == 0) done_cv.notify_all();
    }
  }

  void notify_failure(int rank, std::exception_ptr failure) {
    std::string message;
    try {
      std::rethrow_exception(failure);
    } catch (std::exception const& e) {
      message = e.what();
    } catch (...) {
      message = "a non-standard exception";
    }
    std::lock_guard lock(listeners_mutex);  // held while calling, so removal waits for running calls
    for (auto const& [id, listener] : listeners) listener(rank, message);
  }

  // How likely `failure` is to be another rank's failure seen from here rather than a cause of its
  // own: 0 for a cause (a bad argument, no memory, a deadline, ...), 1 for a device error (waiting
  // on work that failed elsewhere), 2 for a communication error (a communicator aborted because a
  // rank failed, naming it). run() reports the lowest, the first in time among equals.
  static int rank_of_failure(std::exception_ptr const& failure) noexcept {
    try {
      std::rethrow_exception(failure);
    } catch (Error const& e) {
      return e.category() == Errc::communication ? 2 : e.category() == Errc::device ? 1 : 0;
    } catch (...) {
      return 0;
    }
  }

  [[noreturn]] void rethrow_with_rank(std::exception_ptr error, int rank) const {
    std::string const where = "rank " + std::to_string(rank) + " (" + devices[static_cast<std::size_t>(rank)].to_string() + "): ";
    try {
      std::rethrow_exception(error);
    } catch (Error const& e) {
      throw Error(e.category(), where + std::string(e.message()));
    } catch (std::exception const& e) {
      throw Error(Errc::device, where + e.what());
    } catch (...) {
      throw Error(Errc::device, where + "threw a non-standard exception");
    }
  }

  std::size_t check_rank(int rank) const {
    if (rank < 0 || rank >= static_cast<int>(devices.size()))
      throw Error(Errc::invalid_argument, "rank " + std::to_string(rank) + " of a group of " +
                                              std::to_string(devices.size()) + " (expected a rank in [0, " +
                                              std::to_string(devices.size()) + "))");
    return static_cast<std::size_t>(rank);
  }

  std::vector<Device> devices;
  std::vector<std::shared_ptr<Allocator>> allocators;
  std::vector<std::unique_ptr<Stream>> streams;

  std::mutex run_mutex;  // one run() at a time
  std::mutex mutex;
  std::condition_variable start_cv;
  std::condition_variable done_cv;
  std::function<void(int, Device, Stream&)> const* job = nullptr;
  std::uint64_t generation = 0;
  int remaining = 0;
  bool stopping = false;
  std::exception_ptr first_error;
  int first_error_rank = -1;
  std::vector<std::thread> drivers;
  std::mutex listeners_mutex;
  std::vector<std::pair<int, std::function<void(int, std::string const&)>>> listeners;
  int next_listener = 0;
};

DeviceGroup::DeviceGroup() : DeviceGroup(devices_from_env()) {}
DeviceGroup::DeviceGroup(std::string_view spec) : DeviceGroup(parse_devices(spec)) {}
DeviceGroup::DeviceGroup(std::vector<Device> devices) : impl_(std::make_unique<Impl>(std::move(devices))) {}
DeviceGroup::DeviceGroup(DeviceGroup&&) noexcept = default;
DeviceGroup& DeviceGroup::operator=(DeviceGroup&&) noexcept = default;
DeviceGroup::~DeviceGroup() = default;

int DeviceGroup::size() const noexcept { return static_cast<int>(impl_->devices.size()); }
Device DeviceGroup::device(int rank) const { return impl_->devices[impl_->check_rank(rank)]; }
std::vector<Device> const& DeviceGroup::devices() const noexcept { return impl_->devices; }
Stream& DeviceGroup::stream(int rank) const { return *impl_->streams[impl_->check_rank(rank)]; }
Stream DeviceGroup::make_stream(int rank) const { return Stream(device(rank)); }
Allocator& DeviceGroup::allocator(int rank) const { return *impl_->allocators[impl_->check_rank(rank)]; }

void DeviceGroup::run(std::function<void(int rank, Device device, Stream& stream)> const& fn) {
  if (running_group == impl_.get())
    throw Error(Errc::invalid_argument, "DeviceGroup::run called from inside its own run() (expected calls from outside the group's ranks)");
  if (!fn) throw Error(Errc::invalid_argument, "DeviceGroup::run got an empty function (expected a callable)");
  std::lock_guard run_lock(impl_->run_mutex);
  std::unique_lock lock(impl_->mutex);
  impl_->job = &fn;
  impl_->remaining = size();
  impl_->first_error = nullptr;
  impl_->first_error_rank = -1;
  ++impl_->generation;
  impl_->start_cv.notify_all();
  impl_->done_cv.wait(lock, [&] { return impl_->remaining == 0; });
  impl_->job = nullptr;
  if (impl_->first_error) impl_->rethrow_with_rank(std::exchange(impl_->first_error, nullptr), impl_->first_error_rank);
}

int DeviceGroup::add_failure_listener(std::function<void(int rank, std::string const& message)> fn) {
  std::lock_guard lock(impl_->listeners_mutex);
  impl_->listeners.emplace_back(impl_->next_listener, std::move(fn));
  return impl_->next_listener++;
}

void DeviceGroup::remove_failure_listener(int id) noexcept {
  std::lock_guard lock(impl_->listeners_mutex);
  std::erase_if(impl_->listeners, [id](auto const& entry) { return entry.first == id; });
}

void DeviceGroup::drain() noexcept {
  for (int rank = 0; rank < size(); ++rank) {
    try {
      stream(rank).synchronize();
    } catch (...) {  // the failure's own consequences, reported by the caller
    }
  }
}

void DeviceGroup::synchronize() {
  std::exception_ptr first;
  int first_rank = -1;
  for (int rank = 0; rank < size(); ++rank) {
    try {
      stream(rank).synchronize();
    } catch (...) {
      if (!first) {
        first = std::current_exception();
        first_rank = rank;
      }
    }
  }
  if (first) impl_->rethrow_with_rank(first, first_rank);
}

std::vector<Tensor> DeviceGroup::shard(Tensor const& batch, std::span<double const> weights) const {
  return shard(batch, shard_sizes(batch.dim(0), size(), weights));
}

std::vector<Tensor> DeviceGroup::shard(Tensor const& batch, std::span<std::int64_t const> rows) const {
  std::int64_t const total = batch.rank() > 0 ? batch.dim(0) : 0;
  bool const counts_fit = rows.size() == static_cast<std::size_t>(size()) &&
                          std::none_of(rows.begin(), rows.end(), [](std::int64_t r) { return r < 0; }) &&
                          std::accumulate(rows.begin(), rows.end(), std::int64_t{0}) == total;
  if (!counts_fit)
    throw Error(Errc::invalid_argument, "DeviceGroup::shard of " + std::to_string(total) + " rows into " + std::to_string(rows.size()) +
                                            " row counts (expected " + std::to_string(size()) + " counts >= 0, one per rank, summing to " +
                                            std::to_string(total) + ")");
  std::vector<Tensor> shards;
  std::int64_t begin = 0;
  for (std::int64_t const count : rows) {
    shards.push_back(batch.slice(begin, begin + count));
    begin += count;
  }
  return shards;
}

std::vector<Tensor> DeviceGroup::scatter(Tensor const& batch, std::span<double const> weights) {
  return scatter(batch, shard_sizes(batch.dim(0), size(), weights));
}

std::vector<Tensor> DeviceGroup::scatter(Tensor const& batch, std::span<std::int64_t const> rows) {
  std::vector<Tensor> const views = shard(batch, rows);
  std::vector<Tensor> copies;
  for (int rank = 0; rank < size(); ++rank) {
    Tensor const& view = views[static_cast<std::size_t>(rank)];
    Tensor local = Tensor::empty(view.shape(), view.dtype(), allocator(rank));
    copy_async(local, view, stream(rank));
    copies.push_back(std::move(local));
  }
  return copies;
}

}  // namespace mgpu
