// A communicator made anew in place after a failure (see renewable.hpp).
#include "comm/renewable.hpp"

#include <algorithm>
#include <utility>

#include <mgpu/core/error.hpp>

namespace mgpu::comm::detail {

namespace {
std::unique_ptr<Communicator> made(Renewable::Make const& make) {
  std::unique_ptr<Communicator> comm = make ? make() : nullptr;
  if (!comm) throw Error(Errc::invalid_argument, "a renewable communicator whose factory made none (expected a communicator)");
  return comm;
}
}  // namespace

Renewable::Renewable(Make make) : make_(std::move(make)), inner_(made(make_)) {}

Renewable::Renewable(std::unique_ptr<Communicator> first, Make make) : make_(std::move(make)), inner_(std::move(first)) {
  if (!inner_) inner_ = made(make_);
}

void Renewable::renew() {
  std::unique_ptr<Communicator> fresh = made(make_);  // when this throws, the old (aborted) one stays
  inner_ = std::move(fresh);
  std::lock_guard const lock(mutex_);
  groups_.clear();  // groups the failure left open
}

void Renewable::group_start(int rank) {
  if (timed_.load(std::memory_order_relaxed)) {
    std::lock_guard const lock(mutex_);
    ++groups_[rank].first;
  }
  inner_->group_start(rank);
}

void Renewable::group_end(int rank) {
  inner_->group_end(rank);
  if (!timed_.load(std::memory_order_relaxed)) return;
  Marks* opened = nullptr;
  {
    std::lock_guard const lock(mutex_);
    auto& [depth, marks] = groups_[rank];
    if (depth > 0 && --depth == 0) opened = std::exchange(marks, nullptr);
  }
  if (opened != nullptr) mark(*opened, *std::exchange(opened->group_stream, nullptr));
}

void Renewable::set_timed(bool on) {
  std::lock_guard const lock(mutex_);
  timed_.store(on, std::memory_order_relaxed);
  groups_.clear();
  if (!on) marks_.clear();
  for (auto& [stream, m] : marks_) m.used = 0, m.group_stream = nullptr;  // the events are reused
}

double Renewable::seconds(Stream const& stream) const {
  std::lock_guard const lock(mutex_);
  auto const found = marks_.find(&stream);
  if (found == marks_.end()) return 0;
  Marks const& m = found->second;
  double ms = 0;
  for (std::size_t k = 0; k + 1 < m.used; k += 2) ms += std::max(0.0, Event::elapsed_ms(m.events[k], m.events[k + 1]));
  return ms / 1e3;
}

Renewable::Marks* Renewable::marks_of(Stream const& stream) {
  std::lock_guard const lock(mutex_);
  return &marks_[&stream];
}

bool Renewable::in_group(int rank, Marks* m, Stream& stream) {
  std::lock_guard const lock(mutex_);
  auto const group = groups_.find(rank);
  if (group == groups_.end() || group->second.first == 0) return false;
  if (group->second.second == nullptr) {  // the group's first call: its start
    mark(*m, stream);
    m->group_stream = &stream;
    group->second.second = m;
  }
  return true;
}

void Renewable::mark(Marks& m, Stream& stream) {
  if (m.used == m.events.size()) m.events.emplace_back();
  m.events[m.used++].record(stream);
}

std::unique_ptr<Renewable> make_renewable(DeviceGroup& group,
                                          std::function<std::unique_ptr<Communicator>(DeviceGroup&, Options)> make,
                                          Options options, std::unique_ptr<Communicator> first) {
  return std::make_unique<Renewable>(std::move(first), [&group, make = std::move(make), options] {
    return make ? make(group, options) : make_communicator(group, options);
  });
}

}  // namespace mgpu::comm::detail
