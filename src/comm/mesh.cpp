#include <mgpu/comm/mesh.hpp>
#include <mgpu/core/error.hpp>

#include <algorithm>
#include <limits>

namespace mgpu::comm {

namespace {

std::string names_of(std::vector<MeshDim> const& dims) {
  std::string out;
  for (auto const& d : dims) out += (out.empty() ? "" : ", ") + d.name;
  return out;
}

}  // namespace

DeviceMesh::DeviceMesh(std::vector<MeshDim> dims) : dims_(std::move(dims)) {
  if (dims_.empty()) throw Error(Errc::invalid_argument, "DeviceMesh: no dimension (expected at least one, e.g. {\"dp\", 2})");
  long long total = 1;
  for (std::size_t i = 0; i < dims_.size(); ++i) {
    auto const& d = dims_[i];
    if (d.name.empty()) throw Error(Errc::invalid_argument, "DeviceMesh: dimension " + std::to_string(i) + " has no name (expected a name such as \"dp\")");
    for (std::size_t j = 0; j < i; ++j)
      if (dims_[j].name == d.name)
        throw Error(Errc::invalid_argument, "DeviceMesh: dimension \"" + d.name + "\" given twice (expected each name once)");
    if (d.size < 1)
      throw Error(Errc::invalid_argument, "DeviceMesh: dimension \"" + d.name + "\" of size " + std::to_string(d.size) + " (expected a size >= 1)");
    total *= d.size;
    if (total > std::numeric_limits<int>::max())
      throw Error(Errc::invalid_argument, "DeviceMesh: " + std::to_string(total) + "+ ranks (expected at most " +
                                              std::to_string(std::numeric_limits<int>::max()) + ")");
  }
  size_ = static_cast<int>(total);
  strides_.assign(dims_.size(), 1);
  for (std::size_t i = dims_.size() - 1; i > 0; --i) strides_[i - 1] = strides_[i] * dims_[i].size;
}

bool DeviceMesh::has(std::string_view dim) const noexcept {
  return std::any_of(dims_.begin(), dims_.end(), [&](MeshDim const& d) { return d.name == dim; });
}

std::size_t DeviceMesh::index_of(std::string_view dim) const {
  for (std::size_t i = 0; i < dims_.size(); ++i)
    if (dims_[i].name == dim) return i;
  throw Error(Errc::invalid_argument, "DeviceMesh " + to_string() + ": no dimension \"" + std::string(dim) +
                                          "\" (expected one of " + names_of(dims_) + ")");
}

int DeviceMesh::size(std::string_view dim) const { return dims_[index_of(dim)].size; }

void DeviceMesh::check_rank(int rank) const {
  if (rank < 0 || rank >= size_)
    throw Error(Errc::invalid_argument, "DeviceMesh " + to_string() + ": rank " + std::to_string(rank) +
                                            " (expected a rank in [0, " + std::to_string(size_) + "))");
}

int DeviceMesh::coordinate(int rank, std::string_view dim) const {
  check_rank(rank);
  auto const i = index_of(dim);
  return rank / strides_[i] % dims_[i].size;
}

std::vector<int> DeviceMesh::coordinates(int rank) const {
  check_rank(rank);
  std::vector<int> out(dims_.size());
  for (std::size_t i = 0; i < dims_.size(); ++i) out[i] = rank / strides_[i] % dims_[i].size;
  return out;
}

int DeviceMesh::rank(std::span<int const> coordinates) const {
  if (coordinates.size() != dims_.size())
    throw Error(Errc::invalid_argument, "DeviceMesh " + to_string() + ": " + std::to_string(coordinates.size()) +
                                            " coordinates (expected " + std::to_string(dims_.size()) + ")");
  int out = 0;
  for (std::size_t i = 0; i < dims_.size(); ++i) {
    if (coordinates[i] < 0 || coordinates[i] >= dims_[i].size)
      throw Error(Errc::invalid_argument, "DeviceMesh " + to_string() + ": coordinate " + std::to_string(coordinates[i]) +
                                              " along \"" + dims_[i].name + "\" (expected one in [0, " +
                                              std::to_string(dims_[i].size) + "))");
    out += coordinates[i] * strides_[i];
  }
  return out;
}

int DeviceMesh::with(int rank, std::string_view dim, int coordinate) const {
  auto c = coordinates(rank);
  c[index_of(dim)] = coordinate;
  return this->rank(c);
}

std::vector<bool> DeviceMesh::mask_of(std::span<std::string_view const> dims) const {
  std::vector<bool> mask(dims_.size(), false);
  for (auto const d : dims) {
    auto const i = index_of(d);
    if (mask[i]) throw Error(Errc::invalid_argument, "DeviceMesh " + to_string() + ": dimension \"" + std::string(d) + "\" named twice in a group");
    mask[i] = true;
  }
  return mask;
}

std::vector<int> DeviceMesh::group(int rank, std::span<std::string_view const> dims) const {
  auto const mask = mask_of(dims);
  auto const base = coordinates(rank);
  // The group's ranks row-major over the masked dimensions: count through them as a mixed-radix
  // number, the last masked dimension fastest.
  std::vector<int> c = base;
  int count = 1;
  for (std::size_t i = 0; i < dims_.size(); ++i)
    if (mask[i]) {
      c[i] = 0;
      count *= dims_[i].size;
    }
  std::vector<int> out;
  out.reserve(static_cast<std::size_t>(count));
  for (int k = 0; k < count; ++k) {
    out.push_back(this->rank(c));
    for (std::size_t i = dims_.size(); i-- > 0;) {
      if (!mask[i]) continue;
      if (++c[i] < dims_[i].size) break;
      c[i] = 0;
    }
  }
  return out;
}

std::vector<int> DeviceMesh::group(int rank, std::string_view dim) const { return group(rank, std::span(&dim, 1)); }

int DeviceMesh::group_rank(int rank, std::span<std::string_view const> dims) const {
  auto const mask = mask_of(dims);
  auto const c = coordinates(rank);
  int out = 0;
  for (std::size_t i = 0; i < dims_.size(); ++i)
    if (mask[i]) out = out * dims_[i].size + c[i];
  return out;
}

int DeviceMesh::group_rank(int rank, std::string_view dim) const { return group_rank(rank, std::span(&dim, 1)); }

int DeviceMesh::group_index(int rank, std::span<std::string_view const> dims) const {
  auto const mask = mask_of(dims);
  auto const c = coordinates(rank);
  int out = 0;
  for (std::size_t i = 0; i < dims_.size(); ++i)
    if (!mask[i]) out = out * dims_[i].size + c[i];
  return out;
}

int DeviceMesh::group_index(int rank, std::string_view dim) const { return group_index(rank, std::span(&dim, 1)); }

int DeviceMesh::at(std::span<std::string_view const> dims, int group_index, int group_rank) const {
  auto const mask = mask_of(dims);
  int inside = 1;
  for (std::size_t i = 0; i < dims_.size(); ++i)
    if (mask[i]) inside *= dims_[i].size;
  int const outside = size_ / inside;
  if (group_index < 0 || group_index >= outside || group_rank < 0 || group_rank >= inside)
    throw Error(Errc::invalid_argument, "DeviceMesh " + to_string() + ": group " + std::to_string(group_index) + ", rank " +
                                            std::to_string(group_rank) + " (expected a group in [0, " + std::to_string(outside) +
                                            ") and a rank in [0, " + std::to_string(inside) + "))");
  // Both indices are mixed-radix numbers, the last dimension fastest: peel their digits off from the end.
  std::vector<int> c(dims_.size());
  for (std::size_t i = dims_.size(); i-- > 0;) {
    int& from = mask[i] ? group_rank : group_index;
    c[i] = from % dims_[i].size;
    from /= dims_[i].size;
  }
  return rank(c);
}

int DeviceMesh::at(std::string_view dim, int group_index, int group_rank) const { return at(std::span(&dim, 1), group_index, group_rank); }

std::vector<std::vector<int>> DeviceMesh::groups(std::span<std::string_view const> dims) const {
  auto const mask = mask_of(dims);
  // One representative per group: the rank with every masked coordinate 0, in row-major order of
  // the others.
  std::vector<std::vector<int>> out;
  for (int r = 0; r < size_; ++r) {
    auto const c = coordinates(r);
    bool first = true;
    for (std::size_t i = 0; i < dims_.size(); ++i)
      if (mask[i] && c[i] != 0) first = false;
    if (first) out.push_back(group(r, dims));
  }
  return out;
}

std::vector<std::vector<int>> DeviceMesh::groups(std::string_view dim) const { return groups(std::span(&dim, 1)); }

std::string DeviceMesh::to_string() const {
  std::string out;
  for (auto const& d : dims_) out += (out.empty() ? "" : " x ") + d.name + " " + std::to_string(d.size);
  return out;
}

bool operator==(DeviceMesh const& a, DeviceMesh const& b) noexcept {
  if (a.dims_.size() != b.dims_.size()) return false;
  for (std::size_t i = 0; i < a.dims_.size(); ++i)
    if (a.dims_[i].name != b.dims_[i].name || a.dims_[i].size != b.dims_[i].size) return false;
  return true;
}

bool drives_any(std::span<int const> ranks, int first, int count) noexcept {
  return std::any_of(ranks.begin(), ranks.end(), [&](int r) { return r >= first && r < first + count; });
}

}  // namespace mgpu::comm
