// JobQueue: ordering, gang placement through the Scheduler, preemption, fair share, reservation
// with backfill, and the fragmentation score.
#include <mgpu/sched/job_queue.hpp>

#include <algorithm>
#include <cmath>
#include <limits>

#include <mgpu/core/error.hpp>

namespace mgpu::sched {
namespace {

// The slowest device's speed (under its power limit), and the power all the devices draw.
std::pair<double, double> job_speed_and_watts(NodeState const& server, Placement const& placement) {
  double speed = std::numeric_limits<double>::infinity();
  double watts = 0;
  for (std::size_t i = 0; i < placement.devices.size(); ++i) {
    for (auto const& d : server.devices) {
      if (d.id != placement.devices[i]) continue;
      double const limit = i < placement.power_limits.size() && placement.power_limits[i] > 0 ? placement.power_limits[i] : d.max_watts;
      speed = std::min(speed, speed_at_power(d, limit, server.power_exponent));
      watts += limit * placement.share;
    }
  }
  return {std::isfinite(speed) ? speed : 1.0, watts};
}

struct Fragmentation final : ScorePlugin {
  explicit Fragmentation(std::map<double, double> t) : typical(std::move(t)) {}
  std::string_view name() const override { return "fragmentation"; }
  // The share of a device that the typical requests could not use.
  double unusable(double free) const {
    double total = 0;
    double weight = 0;
    for (auto const& [fraction, frequency] : typical) {
      if (fraction > free + 1e-12) total += frequency * free;
      weight += frequency;
    }
    return weight > 0 ? total / weight : 0.0;
  }
  double score(Request const& r, DeviceState const& d, NodeState const&) const override {
    if (r.devices >= 1) return 0;
    return -(unusable(d.free_share - r.devices) - unusable(d.free_share));
  }
  std::map<double, double> typical;
};

}  // namespace

std::unique_ptr<ScorePlugin> fragmentation(std::map<double, double> typical) {
  return std::make_unique<Fragmentation>(std::move(typical));
}

std::vector<QueuePolicy> standard_policies() {
  std::vector<QueuePolicy> p(7);
  p[0].name = "fifo";
  p[1].name = "priority+preempt";
  p[1].preemption = true;
  p[2].name = "fair-share";
  p[2].fair_share = true;
  p[3].name = "shortest-first";
  p[3].shortest_first = true;
  p[4].name = "reserve+backfill";
  p[4].reservation = true;
  p[5].name = "all";
  p[5].preemption = p[5].fair_share = p[5].reservation = p[5].fragmentation_aware = true;
  p[6].name = "energy-aware";
  p[6].energy_aware = true;
  return p;
}

JobQueue::JobQueue(std::vector<NodeState> servers, Scheduler scheduler, QueuePolicy policy, RuntimePredictor* predictor)
    : servers_(std::move(servers)), scheduler_(std::move(scheduler)), policy_(std::move(policy)), predictor_(predictor) {
  if (servers_.empty()) throw Error(Errc::invalid_argument, "a job queue needs at least one server (got none)");
  if (policy_.energy_aware) scheduler_.add(energy(), 2.0);
  if (policy_.fragmentation_aware) {
    // Fractions as they typically come: mostly halves and quarters, some whole GPUs.
    scheduler_.add(fragmentation({{0.25, 0.3}, {0.5, 0.4}, {1.0, 0.3}}), 2.0);
  }
}

Request JobQueue::request_for(Job const& job, double remaining) const {
  Request r;
  r.name = "job " + std::to_string(job.id);
  r.devices = job.gpus;
  r.memory_bytes = job.memory_bytes;
  r.allowed_types = job.gpu_type;
  r.work_seconds = remaining;
  r.priority = job.priority;
  r.tenant = job.tenant;
  r.preemptible = job.preemptible;
  r.task_type = job.task_type;
  return r;
}

void JobQueue::submit(Job const& job) {
  Request const r = request_for(job, job.duration);
  bool fits_somewhere = false;
  std::string last_error;
  for (auto const& server : servers_) {
    try {
      validate(r, server);
      fits_somewhere = true;
    } catch (Error const& e) {
      last_error = e.what();
    }
  }
  if (!fits_somewhere) throw Error(Errc::invalid_argument, "job " + std::to_string(job.id) + " can never run: " + last_error);
  pending_.emplace_back(job, job.duration);
}

std::optional<double> JobQueue::expected_finish(int job_id) const {
  auto const it = running_.find(job_id);
  if (it == running_.end()) return std::nullopt;
  return it->second.started + it->second.remaining_at_start / it->second.speed;
}

void JobQueue::finish(int job_id, double now) {
  auto const it = running_.find(job_id);
  if (it == running_.end()) throw Error(Errc::invalid_argument, "finish of job " + std::to_string(job_id) + ", which is not running");
  Running const& run = it->second;
  unreserve(servers_[static_cast<std::size_t>(run.server)], request_for(run.job, run.remaining_at_start), run.placement);
  service_[run.job.tenant] += std::max(run.job.gpus, 0.0) * (now - run.started);
  if (predictor_ != nullptr) {
    std::string type;
    for (auto const& d : servers_[static_cast<std::size_t>(run.server)].devices) {
      if (d.id == run.placement.devices.front()) type = d.type;
    }
    predictor_->observe(run.job.task_type, type, run.remaining_at_start, now - run.started);
  }
  running_.erase(it);
}

double JobQueue::tenant_service(std::string const& tenant, double now) const {
  double service = 0;
  if (auto const it = service_.find(tenant); it != service_.end()) service = it->second;
  for (auto const& [id, run] : running_) {
    if (run.job.tenant == tenant) service += run.job.gpus * (now - run.started) + run.job.gpus;  // held GPUs count now
  }
  auto const w = policy_.tenant_weights.find(tenant);
  return service / (w == policy_.tenant_weights.end() ? 1.0 : std::max(w->second, 1e-9));
}

std::optional<std::pair<int, Placement>> JobQueue::place(Job const& job, double remaining, std::vector<int> const& reserved,
                                                         double reserved_until, double now) const {
  Request const r = request_for(job, remaining);
  std::optional<std::pair<int, Placement>> best;
  for (std::size_t s = 0; s < servers_.size(); ++s) {
    // Cheap check first: enough devices with the share the job needs.
    double const share = job.gpus < 1 ? job.gpus : 1.0;
    int room = 0;
    for (auto const& d : servers_[s].devices) room += d.free_share + 1e-12 >= share ? 1 : 0;
    if (room < std::max(1, static_cast<int>(job.gpus))) continue;
    NodeState const* view = &servers_[s];
    NodeState restricted;  // a copy only where reserved GPUs must be hidden
    if (!reserved.empty() && static_cast<int>(s) == reserved.front()) {
      // Backfill: a job may use reserved GPUs only if it ends before the reservation starts.
      double const speed = 1.0;
      bool const ends_in_time = now + remaining / speed <= reserved_until;
      if (!ends_in_time) {
        restricted = servers_[s];
        for (std::size_t k = 1; k < reserved.size(); ++k) {
          for (auto& d : restricted.devices) {
            if (d.id == reserved[k]) d.free_share = 0;
          }
        }
        view = &restricted;
      }
    }
    try {
      validate(r, *view);
    } catch (Error const&) {
      continue;  // this server is too small for the job
    }
    auto placement = scheduler_.place(r, *view);
    if (placement && (!best || placement->score > best->second.score)) best = std::pair{static_cast<int>(s), *placement};
  }
  return best;
}

void JobQueue::start(Job const& job, double remaining, int server, Placement const& placement, double now,
                     std::vector<JobEvent>& events) {
  NodeState& node = servers_[static_cast<std::size_t>(server)];
  if (!reserve(node, request_for(job, remaining), placement))
    throw Error(Errc::device, "job " + std::to_string(job.id) + ": its placement no longer fits (expected a fresh decision)");
  auto const [speed, watts] = job_speed_and_watts(node, placement);
  running_[job.id] = Running{job, server, placement, now, remaining, speed};
  events.push_back({JobEvent::start, job.id, server, placement.devices, now, watts});
}

bool JobQueue::try_preempt(Job const& job, double remaining, double now, std::vector<JobEvent>& events) {
  Request const r = request_for(job, remaining);
  std::optional<std::pair<int, std::vector<int>>> best;  // server, victims
  std::optional<Placement> best_placement;
  for (std::size_t s = 0; s < servers_.size(); ++s) {
    std::vector<Running const*> victims;
    for (auto const& [id, run] : running_) {
      if (run.server == static_cast<int>(s) && run.job.preemptible && run.job.priority < job.priority) victims.push_back(&run);
    }
    std::sort(victims.begin(), victims.end(), [](Running const* a, Running const* b) {
      return a->job.priority != b->job.priority ? a->job.priority < b->job.priority : a->started > b->started;
    });
    NodeState view = servers_[s];
    try {
      validate(r, view);
    } catch (Error const&) {
      continue;
    }
    std::vector<int> chosen;
    for (Running const* v : victims) {
      unreserve(view, request_for(v->job, v->remaining_at_start), v->placement);
      chosen.push_back(v->job.id);
      if (auto placement = scheduler_.place(r, view)) {
        if (!best || chosen.size() < best->second.size()) {
          best = std::pair{static_cast<int>(s), chosen};
          best_placement = placement;
        }
        break;
      }
    }
  }
  if (!best) return false;
  for (int victim : best->second) {
    Running const run = running_.at(victim);
    unreserve(servers_[static_cast<std::size_t>(run.server)], request_for(run.job, run.remaining_at_start), run.placement);
    double const done = (now - run.started) * run.speed;  // progress is checkpointed, nothing is lost
    service_[run.job.tenant] += run.job.gpus * (now - run.started);
    pending_.emplace_back(run.job, std::max(0.0, run.remaining_at_start - done));
    running_.erase(victim);
    ++preemptions_;
    events.push_back({JobEvent::preempt, victim, run.server, run.placement.devices, now});
  }
  start(job, remaining, best->first, *best_placement, now, events);
  return true;
}

std::vector<JobEvent> JobQueue::schedule(double now) {
  std::vector<JobEvent> events;
  auto const key = [&](std::pair<Job, double> const& p) {
    Job const& j = p.first;
    double const length = predictor_ != nullptr ? predictor_->predict(j.task_type, "", p.second) : p.second;
    return policy_.shortest_first ? length : j.submit;
  };
  std::vector<std::pair<Job, double>> queue = std::move(pending_);
  pending_.clear();
  std::stable_sort(queue.begin(), queue.end(), [&](auto const& a, auto const& b) {
    if (a.first.priority != b.first.priority) return a.first.priority > b.first.priority;
    double const ka = key(a);
    double const kb = key(b);
    if (ka != kb) return ka < kb;
    return a.first.id < b.first.id;
  });

  std::map<std::string, double> service;  // weighted service per tenant, updated as jobs start
  if (policy_.fair_share) {
    for (auto const& [job, remaining] : queue) service.try_emplace(job.tenant, tenant_service(job.tenant, now));
  }
  std::vector<bool> done(queue.size(), false);
  std::vector<int> reserved;  // server, then device ids
  double reserved_until = 0;
  for (std::size_t step = 0; step < queue.size(); ++step) {
    // Next job: in order; with fair share, within the highest waiting priority, the next job of the
    // tenant with the least weighted service.
    std::size_t pick = queue.size();
    for (std::size_t i = 0; i < queue.size(); ++i) {
      if (done[i]) continue;
      if (pick == queue.size()) {
        pick = i;
        if (!policy_.fair_share) break;
        continue;
      }
      if (queue[i].first.priority != queue[pick].first.priority) break;
      if (service[queue[i].first.tenant] < service[queue[pick].first.tenant]) pick = i;
    }
    done[pick] = true;
    auto const& [job, remaining] = queue[pick];
    auto const charge = [&, &job = job] {  // an init-capture: Clang before 16 cannot capture a structured binding
      if (!policy_.fair_share) return;
      auto const w = policy_.tenant_weights.find(job.tenant);
      service[job.tenant] += job.gpus / (w == policy_.tenant_weights.end() ? 1.0 : std::max(w->second, 1e-9));
    };
    if (auto placed = place(job, remaining, reserved, reserved_until, now)) {
      start(job, remaining, placed->first, placed->second, now, events);
      charge();
      continue;
    }
    if (policy_.preemption && try_preempt(job, remaining, now, events)) {
      charge();
      continue;
    }
    pending_.emplace_back(job, remaining);
    if (policy_.reservation && reserved.empty() && job.gpus >= 1) {
      // Reserve where the job could start soonest: free running jobs in order of expected finish.
      Request const r = request_for(job, remaining);
      double soonest = std::numeric_limits<double>::infinity();
      for (std::size_t s = 0; s < servers_.size(); ++s) {
        std::vector<std::pair<double, Running const*>> ending;
        for (auto const& [id, run] : running_) {
          if (run.server == static_cast<int>(s)) ending.push_back({run.started + run.remaining_at_start / run.speed, &run});
        }
        std::sort(ending.begin(), ending.end(), [](auto const& a, auto const& b) { return a.first < b.first; });
        NodeState view = servers_[s];
        try {
          validate(r, view);
        } catch (Error const&) {
          continue;
        }
        for (auto const& [when, run] : ending) {
          unreserve(view, request_for(run->job, run->remaining_at_start), run->placement);
          if (auto placement = scheduler_.place(r, view)) {
            if (when < soonest) {
              soonest = when;
              reserved = {static_cast<int>(s)};
              reserved.insert(reserved.end(), placement->devices.begin(), placement->devices.end());
            }
            break;
          }
        }
      }
      reserved_until = soonest;
    }
  }
  return events;
}

}  // namespace mgpu::sched
