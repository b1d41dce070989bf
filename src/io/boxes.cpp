// Box geometry for sharded checkpoints (boxes.hpp).
#include "io/boxes.hpp"

#include <algorithm>
#include <cstring>

#include <mgpu/core/error.hpp>

namespace mgpu::io {

std::int64_t Box::numel() const noexcept {
  std::int64_t n = 1;
  for (std::int64_t e : lengths) {
    if (e < 0 || __builtin_mul_overflow(n, e, &n)) return -1;
  }
  return n;
}

std::string to_string(Box const& box) {
  std::string text = "[";
  for (std::size_t d = 0; d < box.lengths.size(); ++d) {
    std::int64_t const begin = d < box.offsets.size() ? box.offsets[d] : 0;
    text += (d ? ", " : "") + std::to_string(begin) + ":" + std::to_string(begin + box.lengths[d]);
  }
  return text + "]";
}

Box whole_box(Shape const& shape) { return Box{.offsets = std::vector<std::int64_t>(shape.size(), 0), .lengths = shape}; }

bool within(Box const& box, Shape const& shape) noexcept {
  if (box.offsets.size() != shape.size() || box.lengths.size() != shape.size()) return false;
  for (std::size_t d = 0; d < shape.size(); ++d) {
    if (box.offsets[d] < 0 || box.lengths[d] < 0 || box.offsets[d] > shape[d] || box.lengths[d] > shape[d] - box.offsets[d])
      return false;
  }
  return true;
}

}  // namespace mgpu::io

namespace mgpu::io::detail {

std::int64_t numel_of(Shape const& shape) { return Box{.offsets = {}, .lengths = shape}.numel(); }

std::vector<Run> box_runs(Shape const& shape, Box const& box) {
  std::size_t const rank = shape.size();
  std::vector<Run> runs;
  if (box.numel() <= 0) return runs;
  // The dimensions after `split` are whole in the box: a run spans them, and box.lengths[split] of dimension split.
  std::size_t split = rank == 0 ? 0 : rank - 1;
  while (split > 0 && box.offsets[split] == 0 && box.lengths[split] == shape[split]) --split;
  std::vector<std::int64_t> stride(rank, 1);
  for (std::size_t d = rank; d-- > 1;) stride[d - 1] = stride[d] * shape[d];
  std::int64_t const length = rank == 0 ? 1 : box.lengths[split] * stride[split];
  std::vector<std::int64_t> index(split, 0);  // within the box, over the dimensions before split
  for (std::int64_t local = 0;; local += length) {
    std::int64_t global = rank == 0 ? 0 : box.offsets[split] * stride[split];
    for (std::size_t d = 0; d < split; ++d) global += (box.offsets[d] + index[d]) * stride[d];
    runs.push_back({global, length, local});
    std::size_t d = split;
    while (d > 0 && ++index[d - 1] == box.lengths[d - 1]) index[--d] = 0;
    if (d == 0) break;
  }
  return runs;
}

std::int64_t copy_overlap(std::vector<Run> const& from, std::byte const* source, std::vector<Run> const& to, std::byte* destination,
                          std::size_t element) {
  std::int64_t copied = 0;
  auto a = from.begin();
  auto b = to.begin();
  while (a != from.end() && b != to.end()) {
    std::int64_t const begin = std::max(a->global, b->global);
    std::int64_t const end = std::min(a->global + a->length, b->global + b->length);
    if (begin < end && destination != nullptr) {
      std::memcpy(destination + static_cast<std::size_t>(b->local + begin - b->global) * element,
                  source + static_cast<std::size_t>(a->local + begin - a->global) * element, static_cast<std::size_t>(end - begin) * element);
    }
    if (begin < end) copied += end - begin;
    if (a->global + a->length < b->global + b->length) ++a;
    else ++b;
  }
  return copied;
}

bool overlaps(Box const& a, Box const& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  for (std::size_t d = 0; d < a.lengths.size(); ++d) {
    if (std::max(a.offsets[d], b.offsets[d]) >= std::min(a.offsets[d] + a.lengths[d], b.offsets[d] + b.lengths[d])) return false;
  }
  return true;
}

void check_tiling(std::string const& where, std::string const& name, Shape const& shape, std::vector<Box> const& boxes) {
  std::string const tensor = "tensor '" + name + "' of shape " + to_string(shape) + " in " + where;
  std::string const expected = " (expected its boxes to cover every element once)";
  std::int64_t covered = 0;
  for (std::size_t i = 0; i < boxes.size(); ++i) {
    if (!within(boxes[i], shape))
      throw Error(Errc::corrupt_data, tensor + ": box " + to_string(boxes[i]) + " lies outside it" + expected);
    for (std::size_t j = 0; j < i; ++j) {
      if (overlaps(boxes[i], boxes[j]))
        throw Error(Errc::corrupt_data, tensor + ": boxes " + to_string(boxes[j]) + " and " + to_string(boxes[i]) + " overlap" + expected);
    }
    covered += boxes[i].numel();  // disjoint boxes within the shape: no overflow
  }
  std::int64_t const whole = numel_of(shape);
  if (covered == whole) return;
  // A hole: the cells between the boxes' edges are each inside one box or none; name the first of none.
  std::size_t const rank = shape.size();
  std::vector<std::vector<std::int64_t>> edges(rank);
  double cells = 1;
  for (std::size_t d = 0; d < rank; ++d) {
    edges[d] = {0, shape[d]};
    for (Box const& b : boxes) {
      edges[d].push_back(b.offsets[d]);
      edges[d].push_back(b.offsets[d] + b.lengths[d]);
    }
    std::sort(edges[d].begin(), edges[d].end());
    edges[d].erase(std::unique(edges[d].begin(), edges[d].end()), edges[d].end());
    cells *= static_cast<double>(edges[d].size() - 1);
  }
  std::string hole = std::to_string(whole - covered) + " elements are in no box";
  if (cells <= 1 << 22) {
    std::vector<std::size_t> cell(rank, 0);
    for (bool more = true; more;) {
      Box const at{.offsets = [&] {
                     std::vector<std::int64_t> o(rank);
                     for (std::size_t d = 0; d < rank; ++d) o[d] = edges[d][cell[d]];
                     return o;
                   }(),
                   .lengths = [&] {
                     Shape l(rank);
                     for (std::size_t d = 0; d < rank; ++d) l[d] = edges[d][cell[d] + 1] - edges[d][cell[d]];
                     return l;
                   }()};
      if (std::none_of(boxes.begin(), boxes.end(), [&](Box const& b) { return overlaps(b, at); })) {
        hole = "box " + to_string(at) + " is in no shard (" + hole + ")";
        break;
      }
      std::size_t d = rank;
      while (d > 0 && ++cell[d - 1] == edges[d - 1].size() - 1) cell[--d] = 0;
      more = d > 0;
    }
  }
  throw Error(Errc::corrupt_data, tensor + ": " + hole + expected);
}

}  // namespace mgpu::io::detail
