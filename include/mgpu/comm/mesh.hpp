// DeviceMesh: named dimensions laid over a job's ranks, the one place that maps a rank to its
// coordinates and back and lists the ranks along a dimension (the groups each parallelism's
// communicators span).
#pragma once

#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace mgpu::comm {

/// One dimension of a mesh: a name ("dp", "tp", "pp", ...) and how many ranks it spans.
struct MeshDim {
  std::string name;
  int size = 1;
};

/// Ranks 0 .. size()-1 laid row-major over dims, the last dimension varying fastest: with dims
/// {dp 2, tp 3}, rank = dp * 3 + tp. Within one process the ranks are a DeviceGroup's; across
/// processes they are world ranks, process p driving a contiguous range of them. Immutable and
/// cheap to copy.
class DeviceMesh {
 public:
  /// Throws Error(invalid_argument) for no dimension, an empty or repeated name, or a size < 1.
  explicit DeviceMesh(std::vector<MeshDim> dims);

  /// The product of the dimensions' sizes.
  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] std::span<MeshDim const> dims() const noexcept { return dims_; }
  [[nodiscard]] bool has(std::string_view dim) const noexcept;
  /// The size of `dim`. Throws Error(invalid_argument) naming the mesh's dimensions for an unknown one.
  [[nodiscard]] int size(std::string_view dim) const;

  /// Rank's coordinate along `dim`. Throws Error(invalid_argument) for a rank outside [0, size()).
  [[nodiscard]] int coordinate(int rank, std::string_view dim) const;
  /// Rank's coordinates, one per dimension in dims() order.
  [[nodiscard]] std::vector<int> coordinates(int rank) const;
  /// The rank at `coordinates` (one per dimension, each in [0, its size)); throws Error(invalid_argument).
  [[nodiscard]] int rank(std::span<int const> coordinates) const;
  /// The rank that differs from `rank` only in its coordinate along `dim`, which is `coordinate`.
  [[nodiscard]] int with(int rank, std::string_view dim, int coordinate) const;

  /// The ranks that differ from `rank` only along `dims` (one or more of the mesh's), ordered
  /// row-major over those dimensions in the mesh's order: the group a communicator over `dims`
  /// spans, and `rank`'s index in it is its rank there (group_rank).
  [[nodiscard]] std::vector<int> group(int rank, std::span<std::string_view const> dims) const;
  [[nodiscard]] std::vector<int> group(int rank, std::string_view dim) const;
  /// Rank's index in group(rank, dims).
  [[nodiscard]] int group_rank(int rank, std::span<std::string_view const> dims) const;
  [[nodiscard]] int group_rank(int rank, std::string_view dim) const;
  /// Every group along `dims`, ordered by the coordinates of the other dimensions (row-major): the
  /// i-th group holds the ranks whose other coordinates are the i-th combination.
  [[nodiscard]] std::vector<std::vector<int>> groups(std::span<std::string_view const> dims) const;
  [[nodiscard]] std::vector<std::vector<int>> groups(std::string_view dim) const;
  /// The index of group(rank, dims) in groups(dims).
  [[nodiscard]] int group_index(int rank, std::span<std::string_view const> dims) const;
  [[nodiscard]] int group_index(int rank, std::string_view dim) const;
  /// The rank at `group_rank` in the group `group_index` along `dims`: groups(dims)[group_index][group_rank].
  [[nodiscard]] int at(std::span<std::string_view const> dims, int group_index, int group_rank) const;
  [[nodiscard]] int at(std::string_view dim, int group_index, int group_rank) const;

  /// "dp 2 x tp 3".
  [[nodiscard]] std::string to_string() const;

  friend bool operator==(DeviceMesh const& a, DeviceMesh const& b) noexcept;

 private:
  [[nodiscard]] std::size_t index_of(std::string_view dim) const;
  [[nodiscard]] std::vector<bool> mask_of(std::span<std::string_view const> dims) const;
  void check_rank(int rank) const;

  std::vector<MeshDim> dims_;
  std::vector<int> strides_;  // rank = sum of coordinate * stride
  int size_ = 1;
};

/// Whether a process driving ranks first .. first + count - 1 drives any of `ranks`.
[[nodiscard]] bool drives_any(std::span<int const> ranks, int first, int count) noexcept;

}  // namespace mgpu::comm
