// The scheduler at cluster scale: servers with CPU, memory and GPUs of a model, pods that ask for
// CPU, memory and whole, several or a fraction of one GPU (optionally of given models), their CSV
// files, a seeded synthetic generator, and the cluster's allocation state.
//
// Nodes file: one row per server with columns name, cpu_milli, memory_mib, gpus, model.
// Pods file: name, cpu_milli, memory_mib, num_gpu, gpu_milli (per GPU; 1000 = a whole GPU; below
// 1000 only with num_gpu 1), gpu_spec (allowed models, '|'-separated, empty = any), qos,
// creation_time, deletion_time (seconds). Column names are configurable (NodeColumns,
// PodColumns); the defaults are those of the GPU-cluster trace Alibaba published with Weng et al.,
// "Beware of Fragmentation" (USENIX ATC'23), except the node name ("sn" there) and GPU count
// ("gpu" there). The free functions touch only their arguments: they may run concurrently on
// different arguments.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace mgpu::cluster {

/// One server of a cluster.
struct NodeSpec {
  std::string name{};
  int cpu_milli = 0;
  int memory_mib = 0;
  int gpus = 0;
  std::string model{};  ///< GPU model; empty only when gpus is 0
};

/// One pod (task) asking for resources on a single server.
struct Pod {
  std::string name{};
  int cpu_milli = 0;
  int memory_mib = 0;
  int gpus = 0;          ///< 0: a CPU-only pod
  int gpu_milli = 0;     ///< per GPU: 1000 for whole GPUs, 1-999 for a fraction of one GPU (gpus == 1)
  std::string models{};  ///< allowed GPU models, '|'-separated; empty allows every model
  std::string qos{};
  double creation = 0;   ///< seconds
  double deletion = 0;   ///< seconds; deletion - creation is how long it runs
  std::string origin{};  ///< where the pod came from ("pods.csv:12"), for error messages

  /// The GPU share the pod asks for, in milli-GPUs (gpus x gpu_milli).
  [[nodiscard]] std::int64_t gpu_demand_milli() const noexcept { return static_cast<std::int64_t>(gpus) * gpu_milli; }
};

/// The header names of the nodes file's columns.
struct NodeColumns {
  std::string name = "name";
  std::string cpu_milli = "cpu_milli";
  std::string memory_mib = "memory_mib";
  std::string gpus = "gpus";
  std::string model = "model";
};

/// The header names of the pods file's columns; an empty name for qos, creation or deletion means
/// the file has no such column (times then default to 0).
struct PodColumns {
  std::string name = "name";
  std::string cpu_milli = "cpu_milli";
  std::string memory_mib = "memory_mib";
  std::string gpus = "num_gpu";
  std::string gpu_milli = "gpu_milli";
  std::string models = "gpu_spec";
  std::string qos = "qos";
  std::string creation = "creation_time";
  std::string deletion = "deletion_time";
};

/// Reads a nodes file. Throws Error(io) when it cannot be read and Error(corrupt_data) naming the
/// file and line for a missing column, a malformed number, a negative or zero capacity, a GPU
/// count without a model, or a duplicate name.
std::vector<NodeSpec> read_nodes_csv(std::filesystem::path const& path, NodeColumns const& columns = {});
/// Reads a pods file, in file order. Throws Error(io) or Error(corrupt_data) naming the file and
/// line for a missing column, a malformed number or a demand no pod can have (negative, a share
/// outside 1-1000, a fraction of several GPUs, GPU share without GPUs, deletion before creation).
std::vector<Pod> read_pods_csv(std::filesystem::path const& path, PodColumns const& columns = {});
/// Writes nodes and pods with the default column names. Throws Error(io) on failure.
void write_nodes_csv(std::filesystem::path const& path, std::vector<NodeSpec> const& nodes);
void write_pods_csv(std::filesystem::path const& path, std::vector<Pod> const& pods);

/// The shape of a synthetic cluster: `nodes` servers whose kinds (GPU model, GPUs, CPU, memory)
/// come in the shares of the GPU nodes of Alibaba's published cluster (1,213 nodes, 6,212 GPUs),
/// in a seeded random order.
struct ClusterShape {
  int nodes = 1213;
  unsigned seed = 1;
};
std::vector<NodeSpec> synthetic_cluster(ClusterShape const& shape);

/// The shape of a synthetic pod list, after the statistics of Alibaba's published default pod
/// list (8,152 pods): 13.3% CPU-only, 37.8% fractional, 48.0% one whole GPU and 0.9% multi-GPU
/// pods; fractional shares, CPU and memory from the trace's most frequent values per class;
/// `constrained_share` of the GPU pods restricted to models in the shares of the published
/// constrained variant (33% in production); Poisson arrivals and log-normal run times fitted to the
/// trace (median 540 s, 90th percentile 6,580 s).
struct PodShape {
  int pods = 8152;
  double constrained_share = 0.33;
  double mean_interarrival_seconds = 350;
  unsigned seed = 1;
  /// A constraint is drawn only among those some node here could satisfy for the pod (default:
  /// the published cluster's node kinds); unconstrained pods are drawn all the same.
  std::vector<NodeSpec> nodes{};
};
std::vector<Pod> synthetic_pods(PodShape const& shape);

/// A pod's demand in the form placement works on: the allowed models as a bit mask over the
/// cluster's models.
struct Demand {
  int cpu_milli = 0;
  int memory_mib = 0;
  int gpus = 0;
  int gpu_milli = 0;
  std::uint64_t models = ~std::uint64_t{0};
};

/// Where a pod went: a node and the GPUs it holds there (gpu_milli of each).
struct Allocation {
  int node = -1;
  std::vector<int> gpus{};
  int gpu_milli = 0;
  int cpu_milli = 0;
  int memory_mib = 0;
};

/// A cluster's servers and what is allocated on them. Not synchronized: one thread at a time.
class Cluster {
 public:
  /// Throws Error(invalid_argument) for an empty cluster, a node with no CPU or memory, negative
  /// GPUs, a GPU count without a model, or more than 64 GPU models.
  explicit Cluster(std::vector<NodeSpec> nodes);

  /// The pod's demand. Throws Error(invalid_argument) naming the pod's origin for a model the
  /// cluster does not have (listing those it has) and for a demand no node could hold even empty.
  [[nodiscard]] Demand demand_of(Pod const& pod) const;
  /// Checks every pod as demand_of() does; throws for the first bad one.
  void check(std::vector<Pod> const& pods) const;

  [[nodiscard]] std::vector<NodeSpec> const& nodes() const noexcept { return nodes_; }
  [[nodiscard]] int model_of(int node) const { return model_[static_cast<std::size_t>(node)]; }
  [[nodiscard]] std::vector<std::string> const& models() const noexcept { return models_; }
  [[nodiscard]] int free_cpu(int node) const { return free_cpu_[static_cast<std::size_t>(node)]; }
  [[nodiscard]] int free_memory(int node) const { return free_memory_[static_cast<std::size_t>(node)]; }
  /// The free milli-GPUs of each GPU of `node` (1000 = untouched).
  [[nodiscard]] std::vector<int> const& free_gpus(int node) const { return free_gpu_[static_cast<std::size_t>(node)]; }
  [[nodiscard]] std::int64_t gpu_capacity_milli() const noexcept { return gpu_capacity_; }
  [[nodiscard]] std::int64_t gpu_allocated_milli() const noexcept { return gpu_allocated_; }
  [[nodiscard]] std::int64_t cpu_capacity_milli() const noexcept { return cpu_capacity_; }
  [[nodiscard]] std::int64_t cpu_allocated_milli() const noexcept { return cpu_allocated_; }
  /// A number that changes whenever `node`'s allocations change (for caches).
  [[nodiscard]] std::uint64_t version(int node) const { return version_[static_cast<std::size_t>(node)]; }

  /// Whether `node` can take `demand` now (CPU, memory, model, and GPUs with room).
  [[nodiscard]] bool fits(Demand const& demand, int node) const;
  /// Takes an allocation's resources. Throws Error(invalid_argument) and changes nothing when it
  /// would exceed a GPU's 1000 milli, the node's CPU or memory, or names a GPU twice.
  void allocate(Allocation const& allocation);
  /// Returns an allocation's resources. Throws Error(invalid_argument) and changes nothing when the
  /// node does not hold them (more than its capacity would be free).
  void release(Allocation const& allocation);

 private:
  // Throws for a node, GPU or share no allocation can have; returns "allocation on node 'name'".
  std::string check_shape(Allocation const& allocation) const;
  std::vector<NodeSpec> nodes_;
  std::vector<std::string> models_;
  std::vector<int> model_;
  std::vector<int> free_cpu_;
  std::vector<int> free_memory_;
  std::vector<std::vector<int>> free_gpu_;
  std::vector<std::uint64_t> version_;
  std::uint64_t changes_ = 0;
  std::int64_t gpu_capacity_ = 0;
  std::int64_t gpu_allocated_ = 0;
  std::int64_t cpu_capacity_ = 0;
  std::int64_t cpu_allocated_ = 0;
};

}  // namespace mgpu::cluster
