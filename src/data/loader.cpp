// The batch loader: a producer thread fills a bounded queue with assembled batches of the current
// epoch; next() takes them in order.
#include <mgpu/data/loader.hpp>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include <mgpu/core/error.hpp>

namespace mgpu::data {

struct BatchLoader::State {
  Dataset const& data;
  LoaderOptions options;
  std::shared_ptr<Allocator> allocator;
  bool pinned;
  std::int64_t batches = 0;

  std::mutex mutex;
  std::condition_variable changed;
  std::deque<Batch> ready;
  std::vector<std::int64_t> order;
  std::int64_t generation = 0;  // bumped by start_epoch: the producer drops work of older ones
  std::int64_t produce_next = 0;
  std::int64_t consume_next = 0;
  std::exception_ptr failure;
  bool stopping = false;
  std::thread producer;

  State(Dataset const& d, LoaderOptions o, std::shared_ptr<Allocator> a, bool p)
      : data(d), options(std::move(o)), allocator(std::move(a)), pinned(p) {}

  Batch assemble(std::vector<std::int64_t> const& rows, std::int64_t index) const {
    std::int64_t const d = data.features();
    auto const n = static_cast<std::int64_t>(rows.size());
    Batch b;
    b.index = index;
    b.x = pinned ? Tensor::empty_pinned({n, d}, DType::float32, *allocator) : Tensor::empty({n, d}, DType::float32, *allocator);
    b.y = Tensor::empty({n}, DType::float32, *allocator);
    auto x = b.x.host_span<float>();
    auto y = b.y.host_span<float>();
    for (std::int64_t i = 0; i < n; ++i)
      y[static_cast<std::size_t>(i)] = data.example(rows[static_cast<std::size_t>(i)], x.subspan(static_cast<std::size_t>(i * d), static_cast<std::size_t>(d)));
    options.normalizer.apply(x);
    return b;
  }

  void run() {
    std::unique_lock lock(mutex);
    while (true) {
      changed.wait(lock, [&] {
        return stopping || (failure == nullptr && produce_next < batches && static_cast<int>(ready.size()) < options.prefetch);
      });
      if (stopping) return;
      std::int64_t const index = produce_next++;
      std::int64_t const gen = generation;
      std::int64_t const begin = index * options.batch;
      std::int64_t const end = std::min<std::int64_t>(begin + options.batch, static_cast<std::int64_t>(order.size()));
      std::vector<std::int64_t> rows(order.begin() + begin, order.begin() + end);
      lock.unlock();
      Batch batch;
      std::exception_ptr error;
      try {
        batch = assemble(rows, index);
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      if (gen != generation) continue;  // the epoch was restarted meanwhile
      if (error) failure = error;
      else ready.push_back(std::move(batch));
      changed.notify_all();
    }
  }
};

BatchLoader::BatchLoader(Dataset const& data, LoaderOptions options, std::shared_ptr<Allocator> allocator, bool pinned) {
  if (options.batch < 1 || options.prefetch < 1)
    throw Error(Errc::invalid_argument, "a loader with batch " + std::to_string(options.batch) + " and prefetch " + std::to_string(options.prefetch) +
                                            " (expected both >= 1)");
  if (data.size() < 1) throw Error(Errc::invalid_argument, "a loader over an empty dataset (expected at least one example)");
  if (!options.normalizer.empty() && static_cast<std::int64_t>(options.normalizer.mean().size()) != data.features())
    throw Error(Errc::invalid_argument, "a normalizer for " + std::to_string(options.normalizer.mean().size()) + " features on data with " +
                                            std::to_string(data.features()) + " (expected equal)");
  state_ = std::make_unique<State>(data, std::move(options), std::move(allocator), pinned);
  State& s = *state_;
  s.batches = s.options.drop_last ? data.size() / s.options.batch : (data.size() + s.options.batch - 1) / s.options.batch;
  if (s.batches == 0)
    throw Error(Errc::invalid_argument, "drop_last with batch " + std::to_string(s.options.batch) + " over " + std::to_string(data.size()) +
                                            " examples leaves no batch (expected batch <= examples)");
  start_epoch(0);
  s.producer = std::thread([&s] { s.run(); });
}

BatchLoader::~BatchLoader() {
  {
    std::lock_guard lock(state_->mutex);
    state_->stopping = true;
  }
  state_->changed.notify_all();
  state_->producer.join();
}

std::int64_t BatchLoader::batches_per_epoch() const noexcept { return state_->batches; }

void BatchLoader::start_epoch(std::int64_t epoch, std::int64_t first) {
  State& s = *state_;
  if (epoch < 0 || first < 0 || first > s.batches)
    throw Error(Errc::invalid_argument, "start_epoch(" + std::to_string(epoch) + ", " + std::to_string(first) + ") (expected epoch >= 0 and 0 <= first <= " +
                                            std::to_string(s.batches) + ")");
  std::vector<std::int64_t> order(static_cast<std::size_t>(s.data.size()));
  std::iota(order.begin(), order.end(), 0);
  if (s.options.shuffle) {
    std::mt19937_64 rng(s.options.seed ^ (0x9E3779B97F4A7C15ull * static_cast<std::uint64_t>(epoch + 1)));
    std::shuffle(order.begin(), order.end(), rng);
  }
  {
    std::lock_guard lock(s.mutex);
    s.order = std::move(order);
    ++s.generation;
    s.ready.clear();
    s.failure = nullptr;
    s.produce_next = first;
    s.consume_next = first;
  }
  s.changed.notify_all();
}

std::optional<Batch> BatchLoader::next() {
  State& s = *state_;
  std::unique_lock lock(s.mutex);
  if (s.consume_next >= s.batches) return std::nullopt;
  s.changed.wait(lock, [&] { return !s.ready.empty() || s.failure != nullptr; });
  if (s.ready.empty()) std::rethrow_exception(s.failure);
  Batch b = std::move(s.ready.front());
  s.ready.pop_front();
  ++s.consume_next;
  s.changed.notify_all();
  return b;
}

}  // namespace mgpu::data
