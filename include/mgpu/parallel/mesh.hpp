// Mesh: a comm::DeviceMesh laid over the devices, once, with each dimension's communicators made
// on first use and kept: the one place the executors and the trainer take their communicators from.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <mgpu/comm/communicator.hpp>
#include <mgpu/comm/mesh.hpp>
#include <mgpu/core/device_group.hpp>

namespace mgpu::parallel {

/// Makes a communicator over every rank, or some (across processes: the dist module's factories).
using CommunicatorFactory = std::function<std::unique_ptr<comm::Communicator>(DeviceGroup&, comm::Options)>;
using SubsetCommunicatorFactory =
    std::function<std::unique_ptr<comm::Communicator>(DeviceGroup&, std::vector<int> const&, comm::Options)>;

/// How a Mesh makes its communicators and lays out its devices.
struct MeshOptions {
  comm::Options comm{};  ///< every communicator's backend and deadline
  /// Across processes both set (dist::communicator_factory(world) and subset_communicator_factory),
  /// the ranks the world's; empty: this process's group's (comm::make_communicator).
  CommunicatorFactory make_communicator{};
  SubsetCommunicatorFactory make_subset_communicator{};
  /// In one process, with several "tp" groups of >= 2: each on the best links (sched's link matrix).
  bool place_tensor_parallel = true;
};

/// The devices laid over a comm::DeviceMesh's ranks (a DeviceGroup's, or the world's across
/// processes); each group's communicator made once, on first use, every process asking in the same
/// order. Shared by std::shared_ptr; thread-safe.
class Mesh {
 public:
  /// Builds the mesh (with place_tensor_parallel, reordering `group`'s devices) and, across
  /// processes, the communicator over every rank (collective). Throws Error(invalid_argument) when
  /// layout.size() is not the device count (the group's, or across processes the world's), when
  /// only one of the factories is set, or as the factories do.
  Mesh(DeviceGroup group, comm::DeviceMesh layout, MeshOptions options = {});
  ~Mesh();
  Mesh(Mesh const&) = delete;
  Mesh& operator=(Mesh const&) = delete;

  [[nodiscard]] comm::DeviceMesh const& layout() const noexcept { return layout_; }
  /// This process's devices, as placed.
  [[nodiscard]] DeviceGroup& group() noexcept { return group_; }
  /// The tensor-parallel groups when placement reordered the devices ("host:0, host:2 | ..."), else empty.
  [[nodiscard]] std::string const& placement() const noexcept { return placement_; }
  /// Whether the mesh spans several processes.
  [[nodiscard]] bool across() const noexcept { return across_; }
  /// The mesh rank of this process's device 0 (0 in one process).
  [[nodiscard]] int first_rank() const noexcept { return first_; }
  [[nodiscard]] bool drives(int rank) const noexcept { return rank >= first_ && rank < first_ + group_.size(); }
  /// The size of `dim`, 1 for a dimension the mesh does not have.
  [[nodiscard]] int size_or_one(std::string_view dim) const;

  /// The communicator of `rank`'s group along `dims` (comm::DeviceMesh::group): its rank i is the
  /// group's i-th rank. The first ask along `dims` makes every group's there that this process
  /// drives, in comm::DeviceMesh::groups order (across processes, the same order everywhere).
  /// Throws Error(invalid_argument) naming a dimension the mesh lacks, a rank outside it, or
  /// (across processes) a group this process drives no rank of.
  [[nodiscard]] comm::Communicator& communicator(int rank, std::span<std::string_view const> dims);
  [[nodiscard]] comm::Communicator& communicator(int rank, std::string_view dim);
  /// The communicator over every rank.
  [[nodiscard]] comm::Communicator& whole();
  /// The communicator over `ranks` (mesh ranks, in that order), made once per list.
  [[nodiscard]] comm::Communicator& over(std::vector<int> const& ranks);
  /// How many communicators the mesh has made (renewals of aborted ones included).
  [[nodiscard]] int made() const;

  /// An executor's factories: each call hands a view of whole() or over(ranks) (the group the mesh's,
  /// the options its); once the communicator was aborted, of a new one (an executor renewing).
  [[nodiscard]] static CommunicatorFactory factory(std::shared_ptr<Mesh> mesh);
  [[nodiscard]] static SubsetCommunicatorFactory subset_factory(std::shared_ptr<Mesh> mesh);

  /// Throws Error(invalid_argument), naming `who`, when `group` is not the mesh's or its layout
  /// does not group the ranks as `expected` does (the executor's dimensions, each the mesh's of
  /// that name, a missing one counting as size 1, in the order dp, tp, pp).
  void check(DeviceGroup const& group, comm::DeviceMesh const& expected, std::string_view who) const;

 private:
  std::shared_ptr<comm::Communicator> shared(std::vector<int> const& ranks);
  // shared(ranks) for a list of at least one rank; throws Error(invalid_argument) for none.
  std::shared_ptr<comm::Communicator> subset(std::vector<int> const& ranks);
  // Throws Error(invalid_argument) when a factory is asked for another group than the mesh's.
  void check_group(DeviceGroup const& group) const;

  DeviceGroup group_;
  comm::DeviceMesh layout_;
  MeshOptions options_;
  std::string placement_;
  bool across_ = false;
  int first_ = 0;
  mutable std::mutex mutex_;
  // The communicators made, by their ranks (empty: every rank).
  std::map<std::vector<int>, std::shared_ptr<comm::Communicator>> made_;
  int count_ = 0;
};

}  // namespace mgpu::parallel
