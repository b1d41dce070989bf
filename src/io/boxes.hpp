// Box geometry for sharded checkpoints: a box's elements as runs of a row-major tensor, the copy
// of the overlap of two such regions, and the check that boxes tile a tensor exactly once.
// Internal: not installed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <mgpu/io/sharded_checkpoint.hpp>

namespace mgpu::io::detail {

/// Consecutive elements [global, global + length) of a row-major tensor, the `local`-th onwards of a
/// region's elements in its own row-major order.
struct Run {
  std::int64_t global = 0;
  std::int64_t length = 0;
  std::int64_t local = 0;
};

/// The elements of `box` (within `shape`) as runs, in increasing order; none for an empty box.
std::vector<Run> box_runs(Shape const& shape, Box const& box);

/// Copies every element two regions share, as runs from box_runs (or one run for a range of the
/// flattened tensor): from `source` (the elements of `from` in its order) into `destination` (those
/// of `to`); `element` bytes each. Returns the elements they share (a null `destination`: counts only).
std::int64_t copy_overlap(std::vector<Run> const& from, std::byte const* source, std::vector<Run> const& to, std::byte* destination,
                          std::size_t element);

/// Whether two boxes of the same rank share an element.
bool overlaps(Box const& a, Box const& b);

/// The boxes (each within `shape`, of its rank) cover every element of `shape` exactly once; throws
/// Error(corrupt_data) naming `where`, the tensor `name` and an overlap's two boxes or a hole's box.
void check_tiling(std::string const& where, std::string const& name, Shape const& shape, std::vector<Box> const& boxes);

/// The number of elements of `shape`, or -1 for a negative extent or a count past int64.
std::int64_t numel_of(Shape const& shape);

}  // namespace mgpu::io::detail
