// Tables and CSV of the fill and replay experiments' results.
#include <mgpu/cluster/policy.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include <mgpu/core/error.hpp>

namespace mgpu::cluster {

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
  char cell[160];
  std::vector<double> columns;
  for (int tenth = 5; tenth <= 13; ++tenth) {
    double const x = tenth / 10.0;
    bool const any =
        std::any_of(results.begin(), results.end(), [&](FillResult const& r) { return point_at(r, x) != nullptr; });
    if (any) columns.push_back(x);
  }
  auto const bound = std::find_if(results.begin(), results.end(), [](FillResult const& r) { return r.policy == "bound"; });
  FillPoint const* bound_full = bound == results.end() ? nullptr : point_at(*bound, 1.0);
  std::snprintf(cell, sizeof cell, "%-20s %-7s", "policy", "tie");
  out += cell;
  for (double x : columns) {
    std::snprintf(cell, sizeof cell, " %7.0f%%", 100 * x);
    out += cell;
  }
  out += "   frag@100%  failed@100%  moves/100 pods  GPU-s lost";
  out += bound_full ? "  gap to bound@100%  decisions/s\n" : "  decisions/s\n";
  for (FillResult const& r : results) {
    bool const is_bound = bound != results.end() && &r == &*bound;
    std::snprintf(cell, sizeof cell, "%-20s %-7s", r.policy.c_str(), r.tie.c_str());
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
    if (full && !is_bound)
      std::snprintf(cell, sizeof cell, "   %8.1f%%  %11d  %14.2f  %10.0f", 100 * full->fragmented, full->failed,
                    full->pods > 0 ? 100.0 * full->moves / full->pods : 0.0, full->gpu_seconds_lost);
    else
      std::snprintf(cell, sizeof cell, "   %9s  %11s  %14s  %10s", "-", "-", "-", "-");
    out += cell;
    if (bound_full) {
      if (full && !is_bound)
        std::snprintf(cell, sizeof cell, "  %16.1f%s", 100 * (full->unallocated - bound_full->unallocated), "pt");
      else
        std::snprintf(cell, sizeof cell, "  %18s", "-");
      out += cell;
    }
    if (is_bound)
      std::snprintf(cell, sizeof cell, "  %11s\n", "-");
    else
      std::snprintf(cell, sizeof cell, "  %11.0f\n", r.seconds > 0 ? r.decisions / r.seconds : 0.0);
    out += cell;
  }
  return out;
}

std::string fill_csv(std::vector<FillResult> const& results) {
  std::ostringstream out;
  out << "policy,tie,arrived,allocated,unallocated,fragmented,cpu_allocated,pods,failed,failed_gpu,moves,"
         "gpu_seconds_lost\n";
  for (FillResult const& r : results) {
    for (FillPoint const& p : r.points)
      out << r.policy << ',' << r.tie << ',' << p.arrived << ',' << p.allocated << ',' << p.unallocated << ','
          << p.fragmented << ',' << p.cpu_allocated << ',' << p.pods << ',' << p.failed << ',' << p.failed_gpu << ','
          << p.moves << ',' << p.gpu_seconds_lost << '\n';
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

}  // namespace mgpu::cluster
