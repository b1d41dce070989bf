// The two cluster experiments: fill (pods drawn and placed without departures until their GPU
// demand reaches a share of the capacity, optionally with migration) and replay (arrivals and
// departures at the pods' times).
#include <mgpu/cluster/policy.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>
#include <queue>
#include <random>

#include <mgpu/cluster/defrag.hpp>
#include <mgpu/core/error.hpp>

#include "fill_draws.hpp"

namespace mgpu::cluster {

namespace {

std::vector<Demand> demands_of(Cluster const& cluster, std::vector<Pod> const& pods) {
  std::vector<Demand> out;
  out.reserve(pods.size());
  for (Pod const& p : pods) out.push_back(cluster.demand_of(p));
  return out;
}

}  // namespace

namespace detail {

FillDraws draw_fill(Cluster const& cluster, std::vector<Pod> const& trace, FillOptions const& options) {
  if (trace.empty()) throw Error(Errc::invalid_argument, "fill with an empty pod list (expected pods to draw from)");
  if (!(options.step > 0) || !(options.max_arrived > 0) || !std::isfinite(options.max_arrived))
    throw Error(Errc::invalid_argument, "fill step " + std::to_string(options.step) + ", up to " +
                                            std::to_string(options.max_arrived) + " (expected both > 0)");
  FillDraws out;
  out.demands = demands_of(cluster, trace);
  std::int64_t trace_gpu = 0;
  for (Pod const& p : trace) trace_gpu += p.gpu_demand_milli();
  if (trace_gpu == 0)
    throw Error(Errc::invalid_argument, "fill with pods that ask for no GPU (expected some GPU demand to arrive)");
  if (cluster.gpu_capacity_milli() == 0)
    throw Error(Errc::invalid_argument, "fill on a cluster without GPUs (expected some)");
  std::mt19937_64 draw(options.seed);
  std::uniform_int_distribution<std::size_t> pick(0, trace.size() - 1);
  double const capacity = static_cast<double>(cluster.gpu_capacity_milli());
  auto const limit = static_cast<std::int64_t>(std::ceil(options.max_arrived * capacity));
  std::int64_t arrived = 0;
  int mark = 1;
  while (arrived < limit) {
    std::size_t const i = pick(draw);
    arrived += trace[i].gpu_demand_milli();
    out.pods.push_back(i);
    while (mark * options.step <= options.max_arrived + 1e-9 &&
           static_cast<double>(arrived) >= mark * options.step * capacity - 1e-6) {
      out.marks.push_back({out.pods.size(), mark * options.step});
      ++mark;
    }
  }
  return out;
}

}  // namespace detail

FillResult fill(std::vector<NodeSpec> const& nodes, std::vector<Pod> const& trace, FillOptions const& options) {
  Cluster cluster(nodes);
  detail::FillDraws const draws = detail::draw_fill(cluster, trace, options);
  Placer placer(options.policy, options.tie, target_workload(cluster, trace, options.target),
                options.seed * 2654435761u + 1);
  MigrationOptions const& migration = options.migration;
  std::optional<Defragmenter> defragmenter;
  if (migration.enabled) defragmenter.emplace(migration);
  double const capacity = static_cast<double>(cluster.gpu_capacity_milli());
  FillResult result;
  result.policy = std::string(name_of(options.policy)) + (migration.enabled ? "+migration" : "");
  result.tie = std::string(name_of(options.tie));
  std::int64_t failed_gpu = 0;
  int failed = 0;
  int moves = 0;
  double lost = 0;
  std::size_t next_mark = 0;
  std::chrono::duration<double> spent{0};
  // The cap: after `pods` arrivals, moves_per_100_pods x pods / 100 moves in all.
  auto const moves_left = [&](std::size_t pods) {
    return static_cast<int>(std::floor(migration.moves_per_100_pods * static_cast<double>(pods) / 100 + 1e-9)) - moves;
  };
  for (std::size_t k = 0; k < draws.pods.size(); ++k) {
    std::size_t const i = draws.pods[k];
    Demand const& d = draws.demands[i];
    auto const t0 = std::chrono::steady_clock::now();
    std::optional<Allocation> a = placer.choose(cluster, d);
    if (a) {
      cluster.allocate(*a);
    } else if (defragmenter && moves_left(k + 1) > 0) {
      if (auto room = defragmenter->make_room(cluster, placer, d, moves_left(k + 1))) {
        a = std::move(room->placed);
        moves += static_cast<int>(room->moves.size());
        for (Move const& m : room->moves) lost += m.gpu_seconds;
      }
    }
    if (a && defragmenter) defragmenter->track(static_cast<int>(k), d, *a);
    if (defragmenter && migration.every > 0 && (k + 1) % static_cast<std::size_t>(migration.every) == 0) {
      for (Move const& m : defragmenter->consolidate(cluster, placer, moves_left(k + 1))) {
        ++moves;
        lost += m.gpu_seconds;
      }
    }
    spent += std::chrono::steady_clock::now() - t0;
    ++result.decisions;
    if (!a) {
      ++failed;
      failed_gpu += trace[i].gpu_demand_milli();
    }
    for (; next_mark < draws.marks.size() && draws.marks[next_mark].pods == k + 1; ++next_mark) {
      FillPoint p;
      p.arrived = draws.marks[next_mark].arrived;
      p.allocated = static_cast<double>(cluster.gpu_allocated_milli()) / capacity;
      p.unallocated = 1.0 - p.allocated;
      p.fragmented = placer.cluster_fragmentation(cluster) / capacity;
      p.cpu_allocated =
          static_cast<double>(cluster.cpu_allocated_milli()) / static_cast<double>(cluster.cpu_capacity_milli());
      p.pods = static_cast<int>(k + 1);
      p.failed = failed;
      p.failed_gpu = static_cast<double>(failed_gpu) / capacity;
      p.moves = moves;
      p.gpu_seconds_lost = lost;
      result.points.push_back(p);
    }
  }
  result.seconds = spent.count();
  return result;
}

ReplayResult replay(std::vector<NodeSpec> const& nodes, std::vector<Pod> const& pods, FitPolicy policy, TieRule tie,
                    TargetOptions const& target, unsigned seed) {
  if (pods.empty()) throw Error(Errc::invalid_argument, "replay of an empty pod list (expected pods)");
  Cluster cluster(nodes);
  std::vector<Demand> const demands = demands_of(cluster, pods);
  Placer placer(policy, tie, target_workload(cluster, pods, target), seed);
  std::vector<std::size_t> order(pods.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return pods[a].creation < pods[b].creation; });
  using Finish = std::pair<double, std::size_t>;
  std::priority_queue<Finish, std::vector<Finish>, std::greater<>> running;
  std::vector<Allocation> allocation(pods.size());
  std::vector<double> start(pods.size(), -1);
  std::vector<double> finish(pods.size(), -1);
  std::vector<std::size_t> pending;
  std::size_t next = 0;
  double const first = pods[order.front()].creation;
  double last_event = first;
  double busy = 0;  // milli-GPU seconds
  ReplayResult r;
  r.policy = std::string(name_of(policy));
  r.pods = static_cast<int>(pods.size());
  double end = first;
  while (true) {
    double const arrival = next < order.size() ? pods[order[next]].creation : std::numeric_limits<double>::infinity();
    double const departure = running.empty() ? std::numeric_limits<double>::infinity() : running.top().first;
    double const now = std::min(arrival, departure);
    if (!std::isfinite(now)) break;
    busy += static_cast<double>(cluster.gpu_allocated_milli()) * (now - last_event);
    last_event = now;
    while (!running.empty() && running.top().first <= now) {
      std::size_t const i = running.top().second;
      running.pop();
      cluster.release(allocation[i]);
      finish[i] = now;
      end = std::max(end, now);
    }
    while (next < order.size() && pods[order[next]].creation <= now) pending.push_back(order[next++]);
    std::vector<Demand const*> failed_now;  // a demand that failed in this pass fails again
    std::erase_if(pending, [&](std::size_t i) {
      Demand const& d = demands[i];
      for (Demand const* f : failed_now) {
        if (f->cpu_milli == d.cpu_milli && f->memory_mib == d.memory_mib && f->gpus == d.gpus &&
            f->gpu_milli == d.gpu_milli && f->models == d.models)
          return false;
      }
      std::optional<Allocation> a = placer.choose(cluster, d);
      if (!a) {
        failed_now.push_back(&d);
        return false;
      }
      cluster.allocate(*a);
      allocation[i] = std::move(*a);
      start[i] = now;
      running.emplace(now + (pods[i].deletion - pods[i].creation), i);
      return true;
    });
    r.peak_pending = std::max(r.peak_pending, static_cast<int>(pending.size()));
  }
  std::vector<double> waits;
  double jct = 0;
  for (std::size_t i = 0; i < pods.size(); ++i) {
    if (start[i] < 0) {
      ++r.never_started;
      continue;
    }
    waits.push_back(start[i] - pods[i].creation);
    jct += finish[i] - pods[i].creation;
  }
  if (!waits.empty()) {
    double sum = 0;
    for (double w : waits) sum += w;
    r.mean_wait = sum / static_cast<double>(waits.size());
    r.mean_jct = jct / static_cast<double>(waits.size());
    std::sort(waits.begin(), waits.end());
    r.p95_wait = waits[std::min(waits.size() - 1,
                                static_cast<std::size_t>(std::ceil(0.95 * static_cast<double>(waits.size()))) - 1)];
  }
  r.makespan = end - first;
  r.gpu_utilization = r.makespan > 0 && cluster.gpu_capacity_milli() > 0
                          ? busy / (static_cast<double>(cluster.gpu_capacity_milli()) * r.makespan)
                          : 0;
  return r;
}

}  // namespace mgpu::cluster
