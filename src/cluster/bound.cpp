// The offline bound on the unallocated GPU share: the packing of pod types on nodes as a linear
// program (node kinds, continuous counts, with cuts) or an integer program (every node and GPU),
// solved with GLPK, and the bound at each point of the fill experiment.
#include <mgpu/cluster/bound.hpp>

#include <glpk.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <tuple>

#include <mgpu/core/error.hpp>

#include "fill_draws.hpp"
#include "placement.hpp"

namespace mgpu::cluster {
namespace {

using detail::model_allowed;

// A pod type (a distinct demand that asks for GPUs) and how many pods have it.
struct Type {
  Demand demand;
  double count;
};

std::vector<Type> gpu_types(std::span<Demand const> demands) {
  using Key = std::tuple<int, int, int, int, std::uint64_t>;
  std::map<Key, Type> by_key;
  for (Demand const& d : demands) {
    if (d.gpus == 0) continue;  // CPU-only pods add no GPU share: the best placement may leave them out
    auto [it, added] = by_key.try_emplace(Key{d.cpu_milli, d.memory_mib, d.gpus, d.gpu_milli, d.models}, Type{d, 0});
    it->second.count += 1;
  }
  std::vector<Type> out;
  for (auto& [key, type] : by_key) out.push_back(type);
  return out;
}

bool runs_on(Demand const& d, NodeSpec const& node, int model) {
  return model_allowed(d, model) && d.cpu_milli <= node.cpu_milli && d.memory_mib <= node.memory_mib &&
         d.gpus <= node.gpus;
}

// A GLPK problem being built: columns with bounds and objective, rows as sparse sums.
class Program {
 public:
  Program() : lp_(glp_create_prob(), &glp_delete_prob) { glp_set_obj_dir(lp_.get(), GLP_MAX); }

  int column(double upper, double objective, bool integer) {
    int const c = glp_add_cols(lp_.get(), 1);
    glp_set_col_bnds(lp_.get(), c, upper > 0 ? GLP_DB : GLP_FX, 0.0, std::max(upper, 0.0));
    glp_set_obj_coef(lp_.get(), c, objective);
    if (integer) {
      glp_set_col_kind(lp_.get(), c, GLP_IV);
      ++integers_;
    }
    return c;
  }
  struct Term {
    int column;
    double coefficient;
  };
  // sum of terms <= upper
  void at_most(std::vector<Term> const& terms, double upper) {
    if (terms.empty()) return;
    int const r = glp_add_rows(lp_.get(), 1);
    glp_set_row_bnds(lp_.get(), r, GLP_UP, 0.0, upper);
    for (Term const& t : terms) {
      rows_.push_back(r);
      columns_.push_back(t.column);
      values_.push_back(t.coefficient);
    }
  }
  [[nodiscard]] int integers() const noexcept { return integers_; }
  [[nodiscard]] bool empty() const { return glp_get_num_cols(lp_.get()) == 0; }

  // The optimal objective: of the LP, or of the integer program when it has integer columns.
  double solve() {
    glp_load_matrix(lp_.get(), static_cast<int>(values_.size()) - 1, rows_.data(), columns_.data(), values_.data());
    if (integers_ == 0) {
      glp_smcp parm;
      glp_init_smcp(&parm);
      parm.msg_lev = GLP_MSG_OFF;
      parm.presolve = GLP_ON;
      int const rc = glp_simplex(lp_.get(), &parm);
      if (rc != 0 || glp_get_status(lp_.get()) != GLP_OPT)
        throw Error(Errc::invalid_argument, "the bound's linear program was not solved (GLPK simplex returned " +
                                                std::to_string(rc) + ", status " +
                                                std::to_string(glp_get_status(lp_.get())) + "; expected an optimum)");
      return glp_get_obj_val(lp_.get());
    }
    glp_iocp parm;
    glp_init_iocp(&parm);
    parm.msg_lev = GLP_MSG_OFF;
    parm.presolve = GLP_ON;
    parm.tm_lim = 120000;
    int const rc = glp_intopt(lp_.get(), &parm);
    if (rc == GLP_ETMLIM)
      throw Error(Errc::timeout, "the exact bound's integer program took over 120 s (expected a small instance; the "
                                 "relaxation is for large ones)");
    if (rc != 0 || glp_mip_status(lp_.get()) != GLP_OPT)
      throw Error(Errc::invalid_argument, "the bound's integer program was not solved (GLPK returned " +
                                              std::to_string(rc) + "; expected an optimum)");
    return glp_mip_obj_val(lp_.get());
  }

 private:
  std::unique_ptr<glp_prob, decltype(&glp_delete_prob)> lp_;
  // GLPK's sparse matrix is 1-based: element 0 is unused.
  std::vector<int> rows_{0};
  std::vector<int> columns_{0};
  std::vector<double> values_{0.0};
  int integers_ = 0;
};

// The counting cuts: at most j shares above 1000 / (j + 1) on one GPU, at most j pods of more than
// G / (j + 1) GPUs on one node.
constexpr int cut_levels = 3;

// The LP over node kinds (nodes alike in model, GPUs, CPU and memory): x[t][k] pods of type t on
// kind k (continuous), W[k] of the kind's GPUs given whole.
double relaxation(Cluster const& cluster, std::vector<Type> const& types) {
  using Kind = std::tuple<int, int, int, int>;  // model, gpus, cpu, memory
  std::map<Kind, int> kinds;
  for (int n = 0; n < static_cast<int>(cluster.nodes().size()); ++n) {
    NodeSpec const& s = cluster.nodes()[static_cast<std::size_t>(n)];
    if (s.gpus > 0) ++kinds[Kind{cluster.model_of(n), s.gpus, s.cpu_milli, s.memory_mib}];
  }
  Program p;
  std::vector<std::vector<Program::Term>> per_type(types.size());
  for (auto const& [kind, count] : kinds) {
    auto const [model, gpus, cpu, memory] = kind;
    NodeSpec const spec{"", cpu, memory, gpus, ""};
    double const n = count;
    double const all_gpus = n * gpus;
    int const whole = p.column(all_gpus, 0, false);
    std::vector<Program::Term> cpu_row, memory_row, whole_row{{whole, -1}}, share_row{{whole, 1000}};
    std::vector<std::vector<Program::Term>> share_cuts(cut_levels), node_cuts(cut_levels);
    for (int j = 1; j <= cut_levels; ++j) share_cuts[static_cast<std::size_t>(j - 1)].push_back({whole, double(j)});
    for (std::size_t t = 0; t < types.size(); ++t) {
      Demand const& d = types[t].demand;
      if (!runs_on(d, spec, model)) continue;
      int const x = p.column(types[t].count, static_cast<double>(d.gpus) * d.gpu_milli, false);
      per_type[t].push_back({x, 1});
      cpu_row.push_back({x, static_cast<double>(d.cpu_milli)});
      memory_row.push_back({x, static_cast<double>(d.memory_mib)});
      if (d.gpu_milli == 1000) {
        whole_row.push_back({x, static_cast<double>(d.gpus)});
        for (int j = 1; j <= cut_levels; ++j)
          if (d.gpus * (j + 1) > gpus) node_cuts[static_cast<std::size_t>(j - 1)].push_back({x, 1});
      } else {
        share_row.push_back({x, static_cast<double>(d.gpu_milli)});
        for (int j = 1; j <= cut_levels; ++j)
          if (d.gpu_milli * (j + 1) > 1000) share_cuts[static_cast<std::size_t>(j - 1)].push_back({x, 1});
      }
    }
    p.at_most(cpu_row, n * cpu);
    p.at_most(memory_row, n * memory);
    if (whole_row.size() > 1) p.at_most(whole_row, 0);
    if (share_row.size() > 1) p.at_most(share_row, 1000 * all_gpus);
    for (int j = 1; j <= cut_levels; ++j) {
      auto const& cut = share_cuts[static_cast<std::size_t>(j - 1)];
      if (cut.size() > 1) p.at_most(cut, j * all_gpus);
      p.at_most(node_cuts[static_cast<std::size_t>(j - 1)], j * n);
    }
  }
  for (std::size_t t = 0; t < types.size(); ++t) p.at_most(per_type[t], types[t].count);
  return p.solve();
}

constexpr int max_exact_integers = 20000;

// The integer program over every node and GPU: x[t][n] pods of whole-GPU type t on node n,
// z[t][n][g] pods of fractional type t on GPU g of node n, u[n][g] = 1 when GPU g is given whole
// (the first ones: whole GPUs are alike).
double exact(Cluster const& cluster, std::vector<Type> const& types) {
  Program p;
  std::vector<std::vector<Program::Term>> per_type(types.size());
  for (int n = 0; n < static_cast<int>(cluster.nodes().size()); ++n) {
    NodeSpec const& spec = cluster.nodes()[static_cast<std::size_t>(n)];
    if (spec.gpus == 0) continue;
    std::vector<int> whole(static_cast<std::size_t>(spec.gpus));
    for (int& u : whole) u = p.column(1, 0, true);
    std::vector<Program::Term> cpu_row, memory_row, whole_row;
    std::vector<std::vector<Program::Term>> gpu_rows(static_cast<std::size_t>(spec.gpus));
    for (int g = 0; g < spec.gpus; ++g) {
      whole_row.push_back({whole[static_cast<std::size_t>(g)], -1});
      gpu_rows[static_cast<std::size_t>(g)].push_back({whole[static_cast<std::size_t>(g)], 1000});
      if (g > 0) p.at_most({{whole[static_cast<std::size_t>(g)], 1}, {whole[static_cast<std::size_t>(g - 1)], -1}}, 0);
    }
    for (std::size_t t = 0; t < types.size(); ++t) {
      Demand const& d = types[t].demand;
      if (!runs_on(d, spec, cluster.model_of(n))) continue;
      double const gain = static_cast<double>(d.gpus) * d.gpu_milli;
      if (d.gpu_milli == 1000) {
        int const x = p.column(std::min(types[t].count, double(spec.gpus / d.gpus)), gain, true);
        per_type[t].push_back({x, 1});
        cpu_row.push_back({x, static_cast<double>(d.cpu_milli)});
        memory_row.push_back({x, static_cast<double>(d.memory_mib)});
        whole_row.push_back({x, static_cast<double>(d.gpus)});
        continue;
      }
      for (int g = 0; g < spec.gpus; ++g) {
        int const z = p.column(std::min(types[t].count, double(1000 / d.gpu_milli)), gain, true);
        per_type[t].push_back({z, 1});
        cpu_row.push_back({z, static_cast<double>(d.cpu_milli)});
        memory_row.push_back({z, static_cast<double>(d.memory_mib)});
        gpu_rows[static_cast<std::size_t>(g)].push_back({z, static_cast<double>(d.gpu_milli)});
      }
      if (p.integers() > max_exact_integers)
        throw Error(Errc::invalid_argument, "an exact bound over more than " + std::to_string(max_exact_integers) +
                                                " integer variables (expected a small instance; use the relaxation)");
    }
    p.at_most(cpu_row, spec.cpu_milli);
    p.at_most(memory_row, spec.memory_mib);
    p.at_most(whole_row, 0);
    for (auto const& row : gpu_rows) p.at_most(row, 1000);
  }
  for (std::size_t t = 0; t < types.size(); ++t) p.at_most(per_type[t], types[t].count);
  if (p.empty()) return 0;
  return std::round(p.solve());
}

}  // namespace

double unallocated_bound(Cluster const& cluster, std::span<Demand const> demands, BoundMethod method) {
  double const capacity = static_cast<double>(cluster.gpu_capacity_milli());
  if (capacity <= 0) throw Error(Errc::invalid_argument, "a bound on a cluster without GPUs (expected some)");
  std::vector<Type> const types = gpu_types(demands);
  if (types.empty()) return 1.0;
  if (method == BoundMethod::exact) return std::max(0.0, 1.0 - exact(cluster, types) / capacity);
  // The simplex's optimum is a floating-point number: a little more GPU share keeps it a bound.
  double const best = relaxation(cluster, types);
  return std::max(0.0, 1.0 - (best * (1 + 1e-9) + 1e-6) / capacity);
}

FillResult fill_bound(std::vector<NodeSpec> const& nodes, std::vector<Pod> const& trace, FillOptions const& options,
                      BoundMethod method) {
  Cluster const cluster(nodes);
  detail::FillDraws const draws = detail::draw_fill(cluster, trace, options);
  std::vector<Demand> arrived;
  FillResult result;
  result.policy = "bound";
  result.tie = "-";
  std::size_t drawn = 0;
  for (detail::FillMark const& mark : draws.marks) {
    for (; drawn < mark.pods; ++drawn) arrived.push_back(draws.demands[draws.pods[drawn]]);
    FillPoint p;
    p.arrived = mark.arrived;
    p.unallocated = unallocated_bound(cluster, arrived, method);
    p.allocated = 1.0 - p.unallocated;
    p.pods = static_cast<int>(mark.pods);
    result.points.push_back(p);
  }
  return result;
}

}  // namespace mgpu::cluster
