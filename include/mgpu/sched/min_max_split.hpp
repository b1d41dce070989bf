// The pipeline planner's dynamic program, shared by sched::partition (stages on a node's devices)
// and pipeline::partition (a model's chunks for a schedule).
#pragma once

#include <algorithm>
#include <cstddef>
#include <limits>
#include <vector>

namespace mgpu::sched {

/// The split of items [0, items) into `parts` contiguous non-empty parts that minimizes the
/// largest cost(p, begin, end) among the splits where every part is allowed(p, begin, end): each
/// part's first item, then `items` (parts + 1 entries); empty when no split is allowed (or
/// 1 <= parts <= items does not hold). Exact: best[p][i], the smallest largest cost over the
/// allowed splits of items [0, i) into parts [0, p), is the minimum over the last part's first
/// item j of max(best[p - 1][j], cost(p - 1, j, i)), since a split's largest cost is its last
/// part's or the largest of the split before it. Of equal splits, the one whose last parts start
/// earliest wins. O(parts * items^2) calls of cost and allowed.
template <class Cost, class Allowed>
std::vector<int> min_max_split(int items, int parts, Cost const& cost, Allowed const& allowed) {
  if (parts < 1 || parts > items) return {};
  auto const at = [](int i) { return static_cast<std::size_t>(i); };
  double const unlimited = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(at(parts) + 1, std::vector<double>(at(items) + 1, unlimited));
  std::vector<std::vector<int>> last_first(at(parts) + 1, std::vector<int>(at(items) + 1, -1));
  best[0][0] = -unlimited;  // max's neutral element: no part yet
  for (int p = 1; p <= parts; ++p) {
    for (int i = p; i <= items - (parts - p); ++i) {
      for (int j = p - 1; j < i; ++j) {
        double const before = best[at(p) - 1][at(j)];
        if (before == unlimited || !allowed(p - 1, j, i)) continue;
        double const worst = std::max(before, static_cast<double>(cost(p - 1, j, i)));
        if (worst < best[at(p)][at(i)]) {
          best[at(p)][at(i)] = worst;
          last_first[at(p)][at(i)] = j;
        }
      }
    }
  }
  if (best[at(parts)][at(items)] == unlimited) return {};
  std::vector<int> first(at(parts) + 1, items);
  for (int p = parts, i = items; p > 0; --p) {
    i = last_first[at(p)][at(i)];
    first[at(p) - 1] = i;
  }
  return first;
}

}  // namespace mgpu::sched
