// Cluster placement policies, FGD's fragmentation measure, and the fill and replay experiments.
#include <mgpu/sched/cluster_policy.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <queue>
#include <sstream>
#include <tuple>

#include <mgpu/core/error.hpp>

namespace mgpu::sched {
namespace {

constexpr FitPolicy policies[] = {FitPolicy::random,    FitPolicy::first_fit,   FitPolicy::best_fit,
                                  FitPolicy::worst_fit, FitPolicy::dot_product, FitPolicy::gpu_packing,
                                  FitPolicy::fgd};
constexpr TieRule rules[] = {TieRule::first, TieRule::random, TieRule::packed};

bool model_allowed(Demand const& d, int model) { return model >= 0 && (d.models >> model & 1); }

int free_sum(std::span<int const> gpus) {
  int s = 0;
  for (int g : gpus) s += g;
  return s;
}

}  // namespace

std::string_view name_of(FitPolicy policy) noexcept {
  switch (policy) {
    case FitPolicy::random:
      return "random";
    case FitPolicy::first_fit:
      return "first-fit";
    case FitPolicy::best_fit:
      return "best-fit";
    case FitPolicy::worst_fit:
      return "worst-fit";
    case FitPolicy::dot_product:
      return "dot-product";
    case FitPolicy::gpu_packing:
      return "gpu-packing";
    case FitPolicy::fgd:
      return "fgd";
  }
  return "?";
}

std::string_view name_of(TieRule rule) noexcept {
  switch (rule) {
    case TieRule::first:
      return "first";
    case TieRule::random:
      return "random";
    case TieRule::packed:
      return "packed";
  }
  return "?";
}

FitPolicy fit_policy_named(std::string_view name) {
  std::string list;
  for (FitPolicy p : policies) {
    if (name_of(p) == name) return p;
    list += (list.empty() ? "" : ", ") + std::string(name_of(p));
  }
  throw Error(Errc::invalid_argument,
              "no placement policy named '" + std::string(name) + "' (expected one of: " + list + ")");
}

TieRule tie_rule_named(std::string_view name) {
  std::string list;
  for (TieRule r : rules) {
    if (name_of(r) == name) return r;
    list += (list.empty() ? "" : ", ") + std::string(name_of(r));
  }
  throw Error(Errc::invalid_argument, "no tie rule named '" + std::string(name) + "' (expected one of: " + list + ")");
}

std::vector<FitPolicy> all_fit_policies() { return {std::begin(policies), std::end(policies)}; }

std::vector<PodType> target_workload(Cluster const& cluster, std::vector<Pod> const& pods,
                                     TargetOptions const& options) {
  if (pods.empty()) throw Error(Errc::invalid_argument, "a target workload from no pods (expected at least one)");
  if (!(options.coverage > 0 && options.coverage <= 1))
    throw Error(Errc::invalid_argument,
                "target coverage " + std::to_string(options.coverage) + " (expected a share in (0, 1])");
  using Key = std::tuple<int, int, int, int, std::uint64_t>;
  std::map<Key, int> counts;
  for (Pod const& p : pods) {
    Demand const d = cluster.demand_of(p);
    ++counts[options.cpu_and_memory ? Key{d.cpu_milli, d.memory_mib, d.gpus, d.gpu_milli, d.models}
                                    : Key{0, 0, d.gpus, d.gpu_milli, d.models}];
  }
  std::vector<std::pair<Key, int>> sorted(counts.begin(), counts.end());
  std::stable_sort(sorted.begin(), sorted.end(), [](auto const& a, auto const& b) { return a.second > b.second; });
  std::vector<PodType> types;
  double covered = 0;
  for (auto const& [key, count] : sorted) {
    if (covered >= options.coverage * static_cast<double>(pods.size()) - 1e-9) break;
    auto const [cpu, memory, gpus, milli, models] = key;
    types.push_back({Demand{cpu, memory, gpus, milli, models}, static_cast<double>(count)});
    covered += count;
  }
  for (PodType& t : types) t.share /= covered;
  return types;
}

double node_fragmentation(std::vector<PodType> const& target, int model, int free_cpu, int free_memory,
                          std::span<int const> free_gpus) {
  double const all = free_sum(free_gpus);
  double total = 0;
  for (PodType const& t : target) {
    Demand const& d = t.demand;
    double f = all;  // CPU-only types, and types that cannot run here, can use none of it
    if (d.gpus > 0 && model_allowed(d, model) && free_cpu >= d.cpu_milli && free_memory >= d.memory_mib) {
      int room = 0;
      double unusable = 0;
      for (int g : free_gpus) {
        if (g >= d.gpu_milli)
          ++room;
        else
          unusable += g;
      }
      if (room >= d.gpus) f = unusable;
    }
    total += t.share * f;
  }
  return total;
}

Placer::Placer(FitPolicy policy, TieRule tie, std::vector<PodType> target, unsigned seed)
    : policy_(policy), tie_(tie), target_(std::move(target)), rng_(seed) {
  if (policy_ == FitPolicy::fgd && target_.empty())
    throw Error(Errc::invalid_argument, "the fgd policy without a target workload (expected at least one pod type)");
}

void Placer::index_target(Cluster const& cluster) {
  by_model_.assign(cluster.models().size(), ModelTypes{});
  for (std::size_t m = 0; m < by_model_.size(); ++m) {
    ModelTypes& view = by_model_[m];
    for (PodType const& t : target_) {
      Demand const& d = t.demand;
      if (d.gpus == 0 || !model_allowed(d, static_cast<int>(m))) {
        view.unable_share += t.share;
        continue;
      }
      auto it = std::find_if(view.groups.begin(), view.groups.end(),
                             [&](Group const& g) { return g.gpus == d.gpus && g.gpu_milli == d.gpu_milli; });
      if (it == view.groups.end()) it = view.groups.insert(view.groups.end(), Group{d.gpus, d.gpu_milli, 0.0, {}});
      it->share += t.share;
      it->members.push_back({d.cpu_milli, d.memory_mib, t.share});
    }
    for (Group& g : view.groups)
      std::sort(g.members.begin(), g.members.end(),
                [](Member const& a, Member const& b) { return a.cpu_milli < b.cpu_milli; });
  }
  before_.assign(cluster.nodes().size(), 0.0);
  before_version_.assign(cluster.nodes().size(), 0);
  indexed_ = true;
}

// node_fragmentation(), by group: a group's types share one GPU test; only CPU and memory differ.
double Placer::fragmentation(int model, int free_cpu, int free_memory, std::span<int const> free_gpus) const {
  double const all = free_sum(free_gpus);
  if (all == 0 || model < 0) return 0;
  ModelTypes const& view = by_model_[static_cast<std::size_t>(model)];
  double total = view.unable_share * all;
  for (Group const& g : view.groups) {
    int room = 0;
    double unusable = 0;
    for (int free : free_gpus) {
      if (free >= g.gpu_milli)
        ++room;
      else
        unusable += free;
    }
    if (room < g.gpus) {
      total += g.share * all;
      continue;
    }
    double able = 0;
    for (Member const& m : g.members) {
      if (m.cpu_milli > free_cpu) break;
      if (m.memory_mib <= free_memory) able += m.share;
    }
    total += able * unusable + (g.share - able) * all;
  }
  return total;
}

double Placer::fragmentation_before(Cluster const& cluster, int node) {
  auto const n = static_cast<std::size_t>(node);
  if (before_version_[n] != cluster.version(node) + 1) {
    before_[n] = fragmentation(cluster.model_of(node), cluster.free_cpu(node), cluster.free_memory(node),
                               cluster.free_gpus(node));
    before_version_[n] = cluster.version(node) + 1;
  }
  return before_[n];
}

double Placer::cluster_fragmentation(Cluster const& cluster) {
  if (!indexed_) index_target(cluster);
  double total = 0;
  for (int n = 0; n < static_cast<int>(cluster.nodes().size()); ++n) total += fragmentation_before(cluster, n);
  return total;
}

Placer::Candidate Placer::rate(Cluster const& cluster, Demand const& d, int node) {
  std::vector<int> const& free = cluster.free_gpus(node);
  NodeSpec const& spec = cluster.nodes()[static_cast<std::size_t>(node)];
  Candidate c;
  // The GPUs: whole GPUs are all alike (the first free ones); a fraction goes where the policy says.
  if (d.gpus > 1 || d.gpu_milli == 1000) {
    for (int g = 0; g < static_cast<int>(free.size()) && static_cast<int>(c.gpus.size()) < d.gpus; ++g)
      if (free[static_cast<std::size_t>(g)] >= d.gpu_milli) c.gpus.push_back(g);
  } else if (d.gpus == 1) {
    int pick = -1;
    int fitting = 0;
    double best_after = std::numeric_limits<double>::infinity();
    for (int g = 0; g < static_cast<int>(free.size()); ++g) {
      int const f = free[static_cast<std::size_t>(g)];
      if (f < d.gpu_milli) continue;
      ++fitting;
      int const current = pick < 0 ? 0 : free[static_cast<std::size_t>(pick)];
      switch (policy_) {
        case FitPolicy::first_fit:
          if (pick < 0) pick = g;
          break;
        case FitPolicy::worst_fit:
          if (pick < 0 || f > current) pick = g;
          break;
        case FitPolicy::random:  // reservoir: each fitting GPU equally likely
          if (std::uniform_int_distribution<int>(0, fitting - 1)(rng_) == 0) pick = g;
          break;
        case FitPolicy::fgd: {
          if (pick >= 0 && f == current) break;  // the same free share: the same outcome
          after_.assign(free.begin(), free.end());
          after_[static_cast<std::size_t>(g)] -= d.gpu_milli;
          double const after = fragmentation(cluster.model_of(node), cluster.free_cpu(node) - d.cpu_milli,
                                             cluster.free_memory(node) - d.memory_mib, after_);
          if (after < best_after - 1e-9 || (after <= best_after + 1e-9 && f < current)) {
            best_after = after;
            pick = g;
          }
          break;
        }
        default:  // best-fit, dot-product, gpu-packing: the fullest GPU that fits
          if (pick < 0 || f < current) pick = g;
          break;
      }
    }
    c.gpus.push_back(pick);
    if (policy_ == FitPolicy::fgd) {
      c.score = best_after - fragmentation_before(cluster, node);
      return c;
    }
  }
  double const cpu_left = static_cast<double>(cluster.free_cpu(node) - d.cpu_milli) / spec.cpu_milli;
  double const memory_left = static_cast<double>(cluster.free_memory(node) - d.memory_mib) / spec.memory_mib;
  double const gpu_capacity = 1000.0 * std::max(spec.gpus, 1);
  double const gpu_free = free_sum(free);
  double const gpu_asked = static_cast<double>(d.gpus) * d.gpu_milli;
  switch (policy_) {
    case FitPolicy::random:
      c.score = std::uniform_real_distribution<double>(0.0, 1.0)(rng_);
      break;
    case FitPolicy::first_fit:
      c.score = node;
      break;
    case FitPolicy::best_fit:
      c.score = cpu_left + memory_left + (gpu_free - gpu_asked) / gpu_capacity;
      break;
    case FitPolicy::worst_fit:
      c.score = -(cpu_left + memory_left + (gpu_free - gpu_asked) / gpu_capacity);
      break;
    case FitPolicy::dot_product:
      c.score = -(static_cast<double>(d.cpu_milli) * cluster.free_cpu(node) /
                      (static_cast<double>(spec.cpu_milli) * spec.cpu_milli) +
                  static_cast<double>(d.memory_mib) * cluster.free_memory(node) /
                      (static_cast<double>(spec.memory_mib) * spec.memory_mib) +
                  gpu_asked * gpu_free / (gpu_capacity * gpu_capacity));
      break;
    case FitPolicy::gpu_packing: {
      bool const used = gpu_free < 1000.0 * spec.gpus || (spec.gpus == 0 && cluster.free_cpu(node) < spec.cpu_milli);
      bool const shares_gpu =
          d.gpus == 1 && d.gpu_milli < 1000 && free[static_cast<std::size_t>(c.gpus.front())] < 1000;
      c.score = shares_gpu ? 0 : used ? 1 : 2;
      break;
    }
    case FitPolicy::fgd: {  // whole GPUs or CPU-only
      after_.assign(free.begin(), free.end());
      for (int g : c.gpus) after_[static_cast<std::size_t>(g)] -= d.gpu_milli;
      c.score = fragmentation(cluster.model_of(node), cluster.free_cpu(node) - d.cpu_milli,
                              cluster.free_memory(node) - d.memory_mib, after_) -
                fragmentation_before(cluster, node);
      break;
    }
  }
  return c;
}

std::optional<Allocation> Placer::choose(Cluster const& cluster, Demand const& d) {
  if (!indexed_) index_target(cluster);
  int best = -1;
  Candidate best_candidate;
  int ties = 0;
  for (int n = 0; n < static_cast<int>(cluster.nodes().size()); ++n) {
    if (!cluster.fits(d, n)) continue;
    Candidate c = rate(cluster, d, n);
    double const eps = 1e-9 * std::max(1.0, std::abs(best_candidate.score));
    bool take = false;
    if (best < 0 || c.score < best_candidate.score - eps) {
      take = true;
      ties = 1;
    } else if (c.score <= best_candidate.score + eps) {
      ++ties;
      switch (tie_) {
        case TieRule::first:
          break;
        case TieRule::random:
          take = std::uniform_int_distribution<int>(0, ties - 1)(rng_) == 0;
          break;
        case TieRule::packed:
          take = free_sum(cluster.free_gpus(n)) < free_sum(cluster.free_gpus(best));
          break;
      }
    }
    if (take) {
      best = n;
      best_candidate = std::move(c);
    }
  }
  if (best < 0) return std::nullopt;
  return Allocation{best, std::move(best_candidate.gpus), d.gpus > 0 ? d.gpu_milli : 0, d.cpu_milli, d.memory_mib};
}

namespace {

std::vector<Demand> demands_of(Cluster const& cluster, std::vector<Pod> const& pods) {
  std::vector<Demand> out;
  out.reserve(pods.size());
  for (Pod const& p : pods) out.push_back(cluster.demand_of(p));
  return out;
}

}  // namespace

FillResult fill(std::vector<NodeSpec> const& nodes, std::vector<Pod> const& trace, FillOptions const& options) {
  if (trace.empty()) throw Error(Errc::invalid_argument, "fill with an empty pod list (expected pods to draw from)");
  if (!(options.step > 0) || !(options.max_arrived > 0) || !std::isfinite(options.max_arrived))
    throw Error(Errc::invalid_argument, "fill step " + std::to_string(options.step) + ", up to " +
                                            std::to_string(options.max_arrived) + " (expected both > 0)");
  Cluster cluster(nodes);
  std::vector<Demand> const demands = demands_of(cluster, trace);
  std::int64_t trace_gpu = 0;
  for (Pod const& p : trace) trace_gpu += p.gpu_demand_milli();
  if (trace_gpu == 0)
    throw Error(Errc::invalid_argument, "fill with pods that ask for no GPU (expected some GPU demand to arrive)");
  if (cluster.gpu_capacity_milli() == 0)
    throw Error(Errc::invalid_argument, "fill on a cluster without GPUs (expected some)");
  Placer placer(options.policy, options.tie, target_workload(cluster, trace, options.target),
                options.seed * 2654435761u + 1);
  std::mt19937_64 draw(options.seed);
  std::uniform_int_distribution<std::size_t> pick(0, trace.size() - 1);
  double const capacity = static_cast<double>(cluster.gpu_capacity_milli());
  FillResult result;
  result.policy = std::string(name_of(options.policy));
  result.tie = std::string(name_of(options.tie));
  std::int64_t arrived = 0;
  std::int64_t failed_gpu = 0;
  int pods = 0;
  int failed = 0;
  int mark = 1;
  std::chrono::duration<double> spent{0};
  auto const limit = static_cast<std::int64_t>(std::ceil(options.max_arrived * capacity));
  while (arrived < limit) {
    std::size_t const i = pick(draw);
    Demand const& d = demands[i];
    arrived += trace[i].gpu_demand_milli();
    ++pods;
    auto const t0 = std::chrono::steady_clock::now();
    std::optional<Allocation> a = placer.choose(cluster, d);
    if (a) cluster.allocate(*a);
    spent += std::chrono::steady_clock::now() - t0;
    ++result.decisions;
    if (!a) {
      ++failed;
      failed_gpu += trace[i].gpu_demand_milli();
    }
    while (mark * options.step <= options.max_arrived + 1e-9 &&
           static_cast<double>(arrived) >= mark * options.step * capacity - 1e-6) {
      FillPoint p;
      p.arrived = mark * options.step;
      p.allocated = static_cast<double>(cluster.gpu_allocated_milli()) / capacity;
      p.unallocated = 1.0 - p.allocated;
      p.fragmented = placer.cluster_fragmentation(cluster) / capacity;
      p.cpu_allocated =
          static_cast<double>(cluster.cpu_allocated_milli()) / static_cast<double>(cluster.cpu_capacity_milli());
      p.pods = pods;
      p.failed = failed;
      p.failed_gpu = static_cast<double>(failed_gpu) / capacity;
      result.points.push_back(p);
      ++mark;
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

namespace {

FillPoint const* point_at(FillResult const& r, double arrived) {
  for (FillPoint const& p : r.points) {
    if (std::abs(p.arrived - arrived) < 1e-9) return &p;
  }
  return nullptr;
}

}  // namespace

std::string format_fill(std::vector<FillResult> const& results) {
  std::string out = "unallocated GPU share when the arrived GPU demand reached each share of the capacity:\n";
  char cell[96];
  std::vector<double> columns;
  for (int tenth = 5; tenth <= 13; ++tenth) {
    double const x = tenth / 10.0;
    bool const any =
        std::any_of(results.begin(), results.end(), [&](FillResult const& r) { return point_at(r, x) != nullptr; });
    if (any) columns.push_back(x);
  }
  std::snprintf(cell, sizeof cell, "%-12s %-7s", "policy", "tie");
  out += cell;
  for (double x : columns) {
    std::snprintf(cell, sizeof cell, " %7.0f%%", 100 * x);
    out += cell;
  }
  out += "   frag@100%  failed@100%  decisions/s\n";
  for (FillResult const& r : results) {
    std::snprintf(cell, sizeof cell, "%-12s %-7s", r.policy.c_str(), r.tie.c_str());
    out += cell;
    for (double x : columns) {
      FillPoint const* p = point_at(r, x);
      if (p)
        std::snprintf(cell, sizeof cell, " %7.1f%%", 100 * p->unallocated);
      else
        std::snprintf(cell, sizeof cell, " %8s", "-");
      out += cell;
    }
    FillPoint const* full = point_at(r, 1.0);
    if (full)
      std::snprintf(cell, sizeof cell, "   %8.1f%%  %11d", 100 * full->fragmented, full->failed);
    else
      std::snprintf(cell, sizeof cell, "   %9s  %11s", "-", "-");
    out += cell;
    std::snprintf(cell, sizeof cell, "  %11.0f\n", r.seconds > 0 ? r.decisions / r.seconds : 0.0);
    out += cell;
  }
  return out;
}

std::string fill_csv(std::vector<FillResult> const& results) {
  std::ostringstream out;
  out << "policy,tie,arrived,allocated,unallocated,fragmented,cpu_allocated,pods,failed,failed_gpu\n";
  for (FillResult const& r : results) {
    for (FillPoint const& p : r.points)
      out << r.policy << ',' << r.tie << ',' << p.arrived << ',' << p.allocated << ',' << p.unallocated << ','
          << p.fragmented << ',' << p.cpu_allocated << ',' << p.pods << ',' << p.failed << ',' << p.failed_gpu << '\n';
  }
  return out.str();
}

std::string format_replay(std::vector<ReplayResult> const& results) {
  std::string out;
  char line[256];
  std::snprintf(line, sizeof line, "%-12s %6s %9s %11s %11s %11s %12s %7s %8s\n", "policy", "pods", "unstarted",
                "mean wait", "p95 wait", "mean JCT", "makespan", "GPU use", "pending");
  out += line;
  for (ReplayResult const& r : results) {
    std::snprintf(line, sizeof line, "%-12s %6d %9d %9.0f s %9.0f s %9.0f s %10.0f s %6.1f%% %8d\n", r.policy.c_str(),
                  r.pods, r.never_started, r.mean_wait, r.p95_wait, r.mean_jct, r.makespan, 100 * r.gpu_utilization,
                  r.peak_pending);
    out += line;
  }
  return out;
}

std::string replay_csv(std::vector<ReplayResult> const& results) {
  std::ostringstream out;
  out << "policy,pods,never_started,mean_wait_s,p95_wait_s,mean_jct_s,makespan_s,gpu_utilization,peak_pending\n";
  for (ReplayResult const& r : results)
    out << r.policy << ',' << r.pods << ',' << r.never_started << ',' << r.mean_wait << ',' << r.p95_wait << ','
        << r.mean_jct << ',' << r.makespan << ',' << r.gpu_utilization << ',' << r.peak_pending << '\n';
  return out.str();
}

}  // namespace mgpu::sched
