// Cluster nodes and pods: their files, the synthetic generator, and the allocation state.
#include <mgpu/cluster/cluster.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <set>

#include <mgpu/core/error.hpp>

#include "csv.hpp"

namespace mgpu::cluster {
namespace {

using detail::corrupt;

// A whole number in [lo, hi], else corrupt() naming the column and what was expected.
int whole(std::filesystem::path const& path, std::size_t line, std::string const& column, std::string const& text,
          int lo, int hi) {
  double const v = detail::number(path, line, column, text);
  if (v != std::floor(v) || v < lo || v > hi)
    corrupt(path, line,
            "column '" + column + "' is '" + text + "' (expected a whole number from " + std::to_string(lo) + " to " +
                std::to_string(hi) + ")");
  return static_cast<int>(v);
}

constexpr int max_int = std::numeric_limits<int>::max();
constexpr int max_gpus_per_node = 64;

// Reads the CSV file of `what` ("nodes", "pods") at `path`: `columns` is called with its header
// (to look up column indices), then `row` with each non-empty row's line number and fields, which
// are checked to fill the header.
template <class Columns, class Row>
void read_csv(std::filesystem::path const& path, char const* what, Columns const& columns, Row const& row) {
  std::ifstream in(path);
  if (!in) throw Error(Errc::io, std::string("cannot read ") + what + " file " + path.string() + " (expected a readable CSV file)");
  std::string line;
  if (!std::getline(in, line)) corrupt(path, 1, "the file is empty (expected a header row)");
  detail::CsvHeader const header(path, line);
  columns(header);
  for (std::size_t n = 2; std::getline(in, line); ++n) {
    if (line.empty() || line == "\r") continue;
    std::vector<std::string> const f = detail::split_csv(line);
    if (f.size() < header.size())
      corrupt(path, n, "has " + std::to_string(f.size()) + " fields (expected " + std::to_string(header.size()) + ")");
    row(n, f);
  }
}

std::vector<std::string_view> split_models(std::string_view models) {
  std::vector<std::string_view> out;
  while (!models.empty()) {
    auto const bar = models.find('|');
    if (bar != 0) out.push_back(models.substr(0, bar));
    if (bar == std::string_view::npos) break;
    models.remove_prefix(bar + 1);
  }
  return out;
}

}  // namespace

std::vector<NodeSpec> read_nodes_csv(std::filesystem::path const& path, NodeColumns const& columns) {
  int name = 0, cpu = 0, memory = 0, gpus = 0, model = 0;
  std::vector<NodeSpec> nodes;
  std::set<std::string> names;
  auto const find_columns = [&](detail::CsvHeader const& header) {
    name = header.column(columns.name, true);
    cpu = header.column(columns.cpu_milli, true);
    memory = header.column(columns.memory_mib, true);
    gpus = header.column(columns.gpus, true);
    model = header.column(columns.model, true);
  };
  read_csv(path, "nodes", find_columns, [&](std::size_t n, std::vector<std::string> const& f) {
    auto const at = [&](int i) { return f[static_cast<std::size_t>(i)]; };
    NodeSpec node;
    node.name = at(name);
    if (node.name.empty()) corrupt(path, n, "column '" + columns.name + "' is empty (expected the node's name)");
    if (!names.insert(node.name).second)
      corrupt(path, n, "node '" + node.name + "' appears twice (expected unique names)");
    node.cpu_milli = whole(path, n, columns.cpu_milli, at(cpu), 1, max_int);
    node.memory_mib = whole(path, n, columns.memory_mib, at(memory), 1, max_int);
    node.gpus = whole(path, n, columns.gpus, at(gpus), 0, max_gpus_per_node);
    node.model = at(model);
    if (node.model == "nan") node.model.clear();  // how some exports write an empty field
    if (node.gpus > 0 && node.model.empty())
      corrupt(path, n,
              "node '" + node.name + "' has " + std::to_string(node.gpus) + " GPUs but no model (expected one)");
    if (node.model.find('|') != std::string::npos)
      corrupt(path, n, "model '" + node.model + "' (expected one model, without '|')");
    nodes.push_back(std::move(node));
  });
  if (nodes.empty()) corrupt(path, 2, "no nodes (expected at least one row)");
  return nodes;
}

std::vector<Pod> read_pods_csv(std::filesystem::path const& path, PodColumns const& columns) {
  int name = 0, cpu = 0, memory = 0, gpus = 0, milli = 0, models = -1, qos = -1, creation = -1, deletion = -1;
  std::vector<Pod> pods;
  auto const find_columns = [&](detail::CsvHeader const& header) {
    name = header.column(columns.name, true);
    cpu = header.column(columns.cpu_milli, true);
    memory = header.column(columns.memory_mib, true);
    gpus = header.column(columns.gpus, true);
    milli = header.column(columns.gpu_milli, true);
    models = header.column(columns.models, false);
    qos = header.column(columns.qos, false);
    creation = header.column(columns.creation, false);
    deletion = header.column(columns.deletion, false);
  };
  read_csv(path, "pods", find_columns, [&](std::size_t n, std::vector<std::string> const& f) {
    auto const at = [&](int i) { return f[static_cast<std::size_t>(i)]; };
    Pod pod;
    pod.origin = path.string() + ":" + std::to_string(n);
    pod.name = at(name);
    pod.cpu_milli = whole(path, n, columns.cpu_milli, at(cpu), 0, max_int);
    pod.memory_mib = whole(path, n, columns.memory_mib, at(memory), 0, max_int);
    pod.gpus = whole(path, n, columns.gpus, at(gpus), 0, max_gpus_per_node);
    pod.gpu_milli = whole(path, n, columns.gpu_milli, at(milli), 0, 1000);
    if (pod.gpus == 0 && pod.gpu_milli != 0)
      corrupt(path, n,
              "asks for " + at(milli) + " milli-GPU on 0 GPUs (expected 0 for a CPU-only pod, or num_gpu >= 1)");
    if (pod.gpus > 0 && pod.gpu_milli == 0)
      corrupt(path, n, "asks for " + at(gpus) + " GPUs with a share of 0 (expected a share from 1 to 1000 milli)");
    if (pod.gpus > 1 && pod.gpu_milli != 1000)
      corrupt(path, n,
              "asks for " + at(milli) + " milli of each of " + at(gpus) +
                  " GPUs (expected 1000: fractions only of one GPU)");
    if (pod.gpus == 0 && pod.cpu_milli == 0 && pod.memory_mib == 0)
      corrupt(path, n, "asks for nothing (expected CPU, memory or GPUs)");
    if (models >= 0) {
      pod.models = at(models);
      if (pod.models == "nan") pod.models.clear();
    }
    if (qos >= 0) pod.qos = at(qos);
    if (creation >= 0) pod.creation = detail::number(path, n, columns.creation, at(creation));
    pod.deletion = pod.creation;
    if (deletion >= 0) pod.deletion = detail::number(path, n, columns.deletion, at(deletion));
    if (pod.deletion < pod.creation)
      corrupt(path, n,
              "is deleted at " + at(deletion) + " before its creation at " + at(creation) +
                  " (expected deletion >= creation)");
    pods.push_back(std::move(pod));
  });
  return pods;
}

void write_nodes_csv(std::filesystem::path const& path, std::vector<NodeSpec> const& nodes) {
  std::ofstream out(path);
  if (!out) throw Error(Errc::io, "cannot write nodes file " + path.string());
  out << "name,cpu_milli,memory_mib,gpus,model\n";
  for (NodeSpec const& n : nodes)
    out << n.name << ',' << n.cpu_milli << ',' << n.memory_mib << ',' << n.gpus << ',' << n.model << '\n';
  if (!out) throw Error(Errc::io, "writing nodes file " + path.string() + " failed");
}

void write_pods_csv(std::filesystem::path const& path, std::vector<Pod> const& pods) {
  std::ofstream out(path);
  if (!out) throw Error(Errc::io, "cannot write pods file " + path.string());
  out.precision(17);
  out << "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,creation_time,deletion_time\n";
  for (Pod const& p : pods)
    out << p.name << ',' << p.cpu_milli << ',' << p.memory_mib << ',' << p.gpus << ',' << p.gpu_milli << ',' << p.models
        << ',' << p.qos << ',' << p.creation << ',' << p.deletion << '\n';
  if (!out) throw Error(Errc::io, "writing pods file " + path.string() + " failed");
}

namespace {

// The kinds of GPU node in Alibaba's published cluster (openb_node_list_gpu_node.csv, 1,213 nodes)
// and how many of each there are.
struct NodeKind {
  char const* model;
  int gpus;
  int cpu_milli;
  int memory_mib;
  int count;
};
constexpr NodeKind node_kinds[] = {
    {"G2", 8, 96000, 393216, 549},     {"T4", 2, 104000, 524288, 387},    {"P100", 2, 16000, 122880, 107},
    {"G3", 8, 128000, 786432, 39},     {"V100M16", 4, 32000, 131072, 28}, {"P100", 2, 64000, 262144, 22},
    {"V100M32", 8, 96000, 786432, 21}, {"V100M16", 1, 8000, 32768, 19},   {"T4", 4, 96000, 393216, 17},
    {"V100M32", 4, 48000, 376832, 9},  {"V100M16", 8, 64000, 262144, 7},  {"P100", 1, 8000, 61440, 3},
    {"P100", 2, 8000, 61440, 2},       {"A10", 1, 128000, 1048576, 2},    {"V100M16", 8, 82000, 344064, 1},
};

// The most frequent pod demands of the published default pod list (openb_pod_list_default.csv,
// 8,152 pods): its 40 most frequent (CPU, memory, GPUs, share) rows, 91% of the pods, and its four
// most frequent multi-GPU rows, with their counts. Pods are drawn by class (CPU-only, fractional,
// one GPU, several) in the trace's class shares, then by row within the class.
struct PodKind {
  int cpu_milli;
  int memory_mib;
  int gpus;
  int gpu_milli;
  int count;
};
constexpr PodKind pod_kinds[] = {
    {3152, 5600, 1, 810, 1047},   {11300, 49152, 1, 1000, 857}, {11400, 48128, 1, 1000, 534},
    {3152, 5600, 1, 1000, 470},   {11908, 47104, 1, 470, 388},  {12500, 57344, 0, 0, 364},
    {8000, 30517, 1, 470, 360},   {32000, 49152, 0, 0, 284},    {18708, 64512, 1, 1000, 255},
    {11908, 47104, 1, 650, 237},  {9810, 41560, 1, 1000, 195},  {8000, 30517, 0, 0, 163},
    {12000, 24576, 1, 1000, 158}, {15700, 58368, 1, 1000, 158}, {11908, 47104, 1, 1000, 153},
    {15400, 51200, 0, 0, 120},    {4000, 22888, 1, 320, 111},   {16000, 32768, 1, 1000, 108},
    {8000, 16384, 1, 1000, 104},  {4000, 24576, 1, 1000, 104},  {12000, 16384, 1, 1000, 99},
    {16500, 51200, 0, 0, 95},     {14200, 58368, 1, 1000, 93},  {4000, 30517, 1, 230, 84},
    {24200, 93184, 1, 1000, 84},  {4000, 15258, 1, 320, 78},    {3152, 5600, 1, 590, 75},
    {8000, 30517, 1, 320, 72},    {4152, 10600, 1, 550, 72},    {11400, 77824, 1, 1000, 65},
    {8000, 32768, 1, 1000, 55},   {4000, 15258, 1, 160, 53},    {6000, 6144, 1, 460, 51},
    {11900, 77824, 1, 1000, 51},  {4152, 10600, 1, 370, 45},    {12000, 15360, 1, 1000, 44},
    {4000, 30517, 1, 320, 43},    {8200, 33792, 1, 1000, 41},   {4000, 31250, 1, 1000, 40},
    {15200, 80896, 1, 1000, 36},  {88000, 327680, 8, 1000, 18}, {64200, 263168, 8, 1000, 18},
    {32200, 132096, 4, 1000, 9},  {16200, 66560, 2, 1000, 7},
};
// The trace's class shares: 1,088 CPU-only, 3,078 fractional, 3,911 one-GPU and 75 multi-GPU pods.
constexpr double class_shares[] = {1088, 3078, 3911, 75};
int class_of(PodKind const& k) { return k.gpus == 0 ? 0 : k.gpu_milli < 1000 ? 1 : k.gpus == 1 ? 2 : 3; }

// GPU model constraints of constrained GPU pods, in the shares of the published variant with 33%
// constrained GPU pods (openb_pod_list_gpuspec33.csv; its seven most frequent constraints).
struct Constraint {
  char const* models;
  double share;
};
constexpr Constraint constraints[] = {
    {"T4", 18.28},
    {"G2", 4.69},
    {"P100", 3.95},
    {"V100M16|V100M32", 2.00},
    {"P100|V100M16|V100M32", 1.46},
    {"G3", 1.22},
    {"G2|P100|T4|V100M16|V100M32", 0.55},
};

}  // namespace

std::vector<NodeSpec> synthetic_cluster(ClusterShape const& shape) {
  if (shape.nodes < 1)
    throw Error(Errc::invalid_argument,
                "a synthetic cluster of " + std::to_string(shape.nodes) + " nodes (expected at least 1)");
  // Largest remainder: each kind gets its share of the nodes, rounded so that the total is exact.
  double total = 0;
  for (NodeKind const& k : node_kinds) total += k.count;
  std::vector<int> counts;
  std::vector<std::pair<double, std::size_t>> remainders;
  int given = 0;
  for (std::size_t i = 0; i < std::size(node_kinds); ++i) {
    double const exact = shape.nodes * node_kinds[i].count / total;
    counts.push_back(static_cast<int>(exact));
    given += counts.back();
    remainders.emplace_back(exact - std::floor(exact), i);
  }
  std::stable_sort(remainders.begin(), remainders.end(),
                   [](auto const& a, auto const& b) { return a.first > b.first; });
  for (std::size_t r = 0; given < shape.nodes; ++r, ++given) ++counts[remainders[r % remainders.size()].second];
  std::vector<NodeKind const*> kinds;
  for (std::size_t i = 0; i < counts.size(); ++i)
    kinds.insert(kinds.end(), static_cast<std::size_t>(counts[i]), &node_kinds[i]);
  std::mt19937_64 rng(shape.seed);
  std::shuffle(kinds.begin(), kinds.end(), rng);
  std::vector<NodeSpec> nodes;
  for (std::size_t i = 0; i < kinds.size(); ++i) {
    char name[32];
    std::snprintf(name, sizeof name, "node-%04zu", i);
    nodes.push_back({name, kinds[i]->cpu_milli, kinds[i]->memory_mib, kinds[i]->gpus, kinds[i]->model});
  }
  return nodes;
}

std::vector<Pod> synthetic_pods(PodShape const& shape) {
  if (shape.pods < 1 || !(shape.constrained_share >= 0 && shape.constrained_share <= 1) ||
      !(shape.mean_interarrival_seconds > 0))
    throw Error(Errc::invalid_argument, "synthetic pods: " + std::to_string(shape.pods) + " pods, constrained share " +
                                            std::to_string(shape.constrained_share) + ", mean interarrival " +
                                            std::to_string(shape.mean_interarrival_seconds) +
                                            " s (expected >= 1 pod, a share in [0, 1], an interarrival > 0)");
  std::mt19937_64 rng(shape.seed);
  std::discrete_distribution<int> pick_class(std::begin(class_shares), std::end(class_shares));
  std::vector<std::vector<PodKind const*>> by_class(4);
  std::vector<std::vector<double>> weights(4);
  for (PodKind const& k : pod_kinds) {
    by_class[static_cast<std::size_t>(class_of(k))].push_back(&k);
    weights[static_cast<std::size_t>(class_of(k))].push_back(k.count);
  }
  std::vector<std::discrete_distribution<std::size_t>> pick_kind;
  for (auto const& w : weights) pick_kind.emplace_back(w.begin(), w.end());
  // Per pod kind, the constraints some node could satisfy (an 8-GPU pod never asks for T4): the
  // given nodes, else the published cluster's node kinds.
  std::vector<NodeSpec> servers = shape.nodes;
  if (servers.empty()) {
    for (NodeKind const& n : node_kinds) servers.push_back({"", n.cpu_milli, n.memory_mib, n.gpus, n.model});
  }
  // Each constraint names only the models the servers have.
  std::vector<std::string> constraint_models;
  for (Constraint const& c : constraints) {
    std::string present;
    for (std::string_view m : split_models(c.models)) {
      bool const has = std::any_of(servers.begin(), servers.end(), [&](NodeSpec const& n) { return n.model == m; });
      if (has) present += (present.empty() ? "" : "|") + std::string(m);
    }
    constraint_models.push_back(present);
  }
  std::map<PodKind const*, std::discrete_distribution<std::size_t>> pick_constraint;
  for (PodKind const& k : pod_kinds) {
    std::vector<double> w;
    for (Constraint const& c : constraints) {
      auto const listed_models = split_models(c.models);
      bool possible = false;
      for (NodeSpec const& n : servers) {
        bool const listed =
            std::find(listed_models.begin(), listed_models.end(), std::string_view(n.model)) != listed_models.end();
        possible =
            possible || (listed && n.gpus >= k.gpus && n.cpu_milli >= k.cpu_milli && n.memory_mib >= k.memory_mib);
      }
      w.push_back(possible ? c.share : 0.0);
    }
    if (std::any_of(w.begin(), w.end(), [](double x) { return x > 0; }))
      pick_constraint.emplace(&k, std::discrete_distribution<std::size_t>(w.begin(), w.end()));
  }
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::exponential_distribution<double> gap(1.0 / shape.mean_interarrival_seconds);
  // Run times: log-normal through the trace's median (540 s) and 90th percentile (6,580 s).
  double const sigma = std::log(6580.0 / 540.0) / 1.2815516;
  std::lognormal_distribution<double> run_time(std::log(540.0), sigma);
  std::vector<Pod> pods;
  double t = 0;
  for (int i = 0; i < shape.pods; ++i) {
    auto const c = static_cast<std::size_t>(pick_class(rng));
    PodKind const& k = *by_class[c][pick_kind[c](rng)];
    Pod p;
    char name[32];
    std::snprintf(name, sizeof name, "pod-%05d", i);
    p.name = name;
    p.origin = "synthetic pod " + std::to_string(i);
    p.cpu_milli = k.cpu_milli;
    p.memory_mib = k.memory_mib;
    p.gpus = k.gpus;
    p.gpu_milli = k.gpu_milli;
    if (p.gpus > 0 && u(rng) < shape.constrained_share) {
      auto const it = pick_constraint.find(&k);
      if (it != pick_constraint.end()) p.models = constraint_models[it->second(rng)];
    }
    double const q = u(rng);  // the trace's QoS classes: 57.0% LS, 41.7% BE, 1.2% Burstable, 0.1% Guaranteed
    p.qos = q < 0.570 ? "LS" : q < 0.987 ? "BE" : q < 0.999 ? "Burstable" : "Guaranteed";
    t += gap(rng);
    p.creation = std::round(t);
    p.deletion = p.creation + std::max(1.0, std::round(run_time(rng)));
    pods.push_back(std::move(p));
  }
  return pods;
}

Cluster::Cluster(std::vector<NodeSpec> nodes) : nodes_(std::move(nodes)) {
  if (nodes_.empty()) throw Error(Errc::invalid_argument, "a cluster needs at least one node (got none)");
  std::map<std::string, int> ids;
  for (NodeSpec const& n : nodes_) {
    if (n.cpu_milli <= 0 || n.memory_mib <= 0 || n.gpus < 0 || n.gpus > max_gpus_per_node ||
        (n.gpus > 0 && n.model.empty()))
      throw Error(Errc::invalid_argument,
                  "node '" + n.name + "': " + std::to_string(n.cpu_milli) + " milli-CPU, " +
                      std::to_string(n.memory_mib) + " MiB, " + std::to_string(n.gpus) + " GPUs of model '" + n.model +
                      "' (expected CPU and memory > 0, 0 to 64 GPUs, a model when there are GPUs)");
    int id = -1;
    if (n.gpus > 0) {
      auto const [it, added] = ids.try_emplace(n.model, static_cast<int>(models_.size()));
      if (added) models_.push_back(n.model);
      id = it->second;
    }
    model_.push_back(id);
    free_cpu_.push_back(n.cpu_milli);
    free_memory_.push_back(n.memory_mib);
    free_gpu_.emplace_back(static_cast<std::size_t>(n.gpus), 1000);
    gpu_capacity_ += 1000LL * n.gpus;
    cpu_capacity_ += n.cpu_milli;
  }
  if (models_.size() > 64)
    throw Error(Errc::invalid_argument,
                "the cluster has " + std::to_string(models_.size()) + " GPU models (expected at most 64)");
  version_.assign(nodes_.size(), 0);
}

Demand Cluster::demand_of(Pod const& pod) const {
  std::string const who = "pod '" + pod.name + "' (" + pod.origin + ")";
  if (pod.cpu_milli < 0 || pod.memory_mib < 0 || pod.gpus < 0 || pod.gpu_milli < 0 || pod.gpu_milli > 1000 ||
      (pod.gpus == 0) != (pod.gpu_milli == 0) || (pod.gpus > 1 && pod.gpu_milli != 1000))
    throw Error(Errc::invalid_argument,
                who + ": " + std::to_string(pod.gpus) + " GPUs of " + std::to_string(pod.gpu_milli) +
                    " milli (expected 0 GPUs and 0 milli, 1 GPU of 1-1000 milli, or several whole GPUs)");
  Demand d{pod.cpu_milli, pod.memory_mib, pod.gpus, pod.gpu_milli, ~std::uint64_t{0}};
  if (!pod.models.empty() && pod.gpus > 0) {
    d.models = 0;
    for (std::string_view m : split_models(pod.models)) {
      auto const it = std::find(models_.begin(), models_.end(), m);
      if (it == models_.end()) {
        std::string list;
        for (auto const& name : models_) list += (list.empty() ? "" : ", ") + name;
        throw Error(Errc::invalid_argument,
                    who + ": GPU model '" + std::string(m) + "' is not in the cluster (expected one of: " + list + ")");
      }
      d.models |= std::uint64_t{1} << (it - models_.begin());
    }
  }
  bool possible = false;
  for (std::size_t n = 0; n < nodes_.size() && !possible; ++n) {
    NodeSpec const& node = nodes_[n];
    bool const model_ok = d.gpus == 0 || (model_[n] >= 0 && (d.models >> model_[n] & 1));
    possible = model_ok && node.cpu_milli >= d.cpu_milli && node.memory_mib >= d.memory_mib && node.gpus >= d.gpus;
  }
  if (!possible)
    throw Error(Errc::invalid_argument,
                who + ": " + std::to_string(pod.cpu_milli) + " milli-CPU, " + std::to_string(pod.memory_mib) +
                    " MiB and " + std::to_string(pod.gpus) + " GPUs" + (pod.models.empty() ? "" : " of " + pod.models) +
                    " fit no node even when it is empty (expected a demand some node can hold)");
  return d;
}

void Cluster::check(std::vector<Pod> const& pods) const {
  for (Pod const& p : pods) (void)demand_of(p);
}

bool Cluster::fits(Demand const& d, int node) const {
  auto const n = static_cast<std::size_t>(node);
  if (free_cpu_[n] < d.cpu_milli || free_memory_[n] < d.memory_mib) return false;
  if (d.gpus == 0) return true;
  if (model_[n] < 0 || !(d.models >> model_[n] & 1)) return false;
  int room = 0;
  for (int g : free_gpu_[n]) room += g >= d.gpu_milli ? 1 : 0;
  return room >= d.gpus;
}

std::string Cluster::check_shape(Allocation const& a) const {
  if (a.node < 0 || a.node >= static_cast<int>(nodes_.size()))
    throw Error(Errc::invalid_argument, "allocation on node " + std::to_string(a.node) + " (expected 0 to " +
                                            std::to_string(nodes_.size() - 1) + ")");
  auto const n = static_cast<std::size_t>(a.node);
  std::string where = "allocation on node '" + nodes_[n].name + "'";
  if (a.cpu_milli < 0 || a.memory_mib < 0 || a.gpu_milli < 0 || a.gpu_milli > 1000 ||
      (a.gpus.empty() != (a.gpu_milli == 0)))
    throw Error(Errc::invalid_argument,
                where + ": negative CPU or memory, or a GPU share outside 1-1000 milli (expected a valid demand)");
  std::size_t const gpus = free_gpu_[n].size();
  for (std::size_t i = 0; i < a.gpus.size(); ++i) {
    int const g = a.gpus[i];
    auto const before = a.gpus.begin() + static_cast<std::ptrdiff_t>(i);
    if (g < 0 || g >= static_cast<int>(gpus) || std::find(a.gpus.begin(), before, g) != before)
      throw Error(Errc::invalid_argument, where + " names GPU " + std::to_string(g) +
                                              " (expected distinct GPUs from 0 to " + std::to_string(gpus) + " - 1)");
  }
  return where;
}

void Cluster::allocate(Allocation const& a) {
  std::string const where = check_shape(a);
  auto const n = static_cast<std::size_t>(a.node);
  if (free_cpu_[n] < a.cpu_milli || free_memory_[n] < a.memory_mib)
    throw Error(Errc::invalid_argument, where + " asks for " + std::to_string(a.cpu_milli) + " milli-CPU and " +
                                            std::to_string(a.memory_mib) + " MiB, " + std::to_string(free_cpu_[n]) +
                                            " and " + std::to_string(free_memory_[n]) + " are free (expected no more)");
  for (int g : a.gpus) {
    int const free = free_gpu_[n][static_cast<std::size_t>(g)];
    if (free < a.gpu_milli)
      throw Error(Errc::invalid_argument, where + " asks for " + std::to_string(a.gpu_milli) + " milli of GPU " +
                                              std::to_string(g) + ", " + std::to_string(free) +
                                              " are free (expected no more)");
  }
  free_cpu_[n] -= a.cpu_milli;
  free_memory_[n] -= a.memory_mib;
  for (int g : a.gpus) free_gpu_[n][static_cast<std::size_t>(g)] -= a.gpu_milli;
  gpu_allocated_ += static_cast<std::int64_t>(a.gpus.size()) * a.gpu_milli;
  cpu_allocated_ += a.cpu_milli;
  version_[n] = ++changes_;
}

void Cluster::release(Allocation const& a) {
  std::string const where = check_shape(a);
  auto const n = static_cast<std::size_t>(a.node);
  bool held = free_cpu_[n] + static_cast<std::int64_t>(a.cpu_milli) <= nodes_[n].cpu_milli &&
              free_memory_[n] + static_cast<std::int64_t>(a.memory_mib) <= nodes_[n].memory_mib;
  for (int g : a.gpus) held = held && free_gpu_[n][static_cast<std::size_t>(g)] + a.gpu_milli <= 1000;
  if (!held)
    throw Error(Errc::invalid_argument,
                "release of an " + where + " that the node does not hold (expected an allocation made before)");
  free_cpu_[n] += a.cpu_milli;
  free_memory_[n] += a.memory_mib;
  for (int g : a.gpus) free_gpu_[n][static_cast<std::size_t>(g)] += a.gpu_milli;
  gpu_allocated_ -= static_cast<std::int64_t>(a.gpus.size()) * a.gpu_milli;
  cpu_allocated_ -= a.cpu_milli;
  version_[n] = ++changes_;
}

}  // namespace mgpu::cluster
