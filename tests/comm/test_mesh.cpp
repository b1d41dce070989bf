// DeviceMesh's rank arithmetic against coordinates counted out by nested loops: ranks, groups
// along one and several dimensions, and the errors for bad dimensions, ranks and coordinates.
#include <mgpu/comm/mesh.hpp>

#include <set>
#include <string_view>
#include <vector>

#include "support/catch.hpp"
#include "support/expect_error.hpp"

using mgpu::Errc;
using mgpu::comm::DeviceMesh;

namespace {

// Every rank of a 3-D mesh with its coordinates, the last dimension fastest, counted by nested loops.
struct Entry {
  int rank, a, b, c;
};

std::vector<Entry> enumerate(int na, int nb, int nc) {
  std::vector<Entry> out;
  int rank = 0;
  for (int a = 0; a < na; ++a)
    for (int b = 0; b < nb; ++b)
      for (int c = 0; c < nc; ++c) out.push_back({rank++, a, b, c});
  return out;
}

}  // namespace

TEST_CASE("DeviceMesh maps ranks to coordinates and back, the last dimension fastest", "[comm][mesh]") {
  DeviceMesh const mesh({{"dp", 2}, {"tp", 3}, {"pp", 4}});
  CHECK(mesh.size() == 24);
  CHECK(mesh.size("tp") == 3);
  CHECK(mesh.has("pp"));
  CHECK_FALSE(mesh.has("ep"));
  CHECK(mesh.to_string() == "dp 2 x tp 3 x pp 4");
  for (auto const& e : enumerate(2, 3, 4)) {
    CHECK(mesh.coordinates(e.rank) == std::vector<int>{e.a, e.b, e.c});
    CHECK(mesh.coordinate(e.rank, "dp") == e.a);
    CHECK(mesh.coordinate(e.rank, "tp") == e.b);
    CHECK(mesh.coordinate(e.rank, "pp") == e.c);
    std::vector<int> const coords{e.a, e.b, e.c};
    CHECK(mesh.rank(coords) == e.rank);
    CHECK(mesh.with(e.rank, "tp", (e.b + 1) % 3) == mesh.rank(std::vector<int>{e.a, (e.b + 1) % 3, e.c}));
  }
}

TEST_CASE("DeviceMesh groups hold the ranks that differ only along their dimensions", "[comm][mesh]") {
  DeviceMesh const mesh({{"dp", 2}, {"tp", 3}, {"pp", 4}});
  auto const all = enumerate(2, 3, 4);
  SECTION("one dimension") {
    for (auto const& e : all) {
      std::vector<int> expected;  // same dp and pp, tp counting up
      for (auto const& f : all)
        if (f.a == e.a && f.c == e.c) expected.push_back(f.rank);
      CHECK(mesh.group(e.rank, "tp") == expected);
      CHECK(mesh.group_rank(e.rank, "tp") == e.b);
      CHECK(mesh.groups("tp")[static_cast<std::size_t>(mesh.group_index(e.rank, "tp"))] == expected);
      CHECK(mesh.group_index(e.rank, "tp") == e.a * 4 + e.c);
      CHECK(mesh.at("tp", e.a * 4 + e.c, e.b) == e.rank);
    }
    CHECK(mesh.groups("dp").size() == 12);
    CHECK(mesh.groups("pp").size() == 6);
  }
  SECTION("two dimensions, row-major in the mesh's order whatever order they are named in") {
    std::vector<std::string_view> const dims{"pp", "dp"};
    for (auto const& e : all) {
      std::vector<int> expected;  // same tp; dp slower than pp
      for (auto const& f : all)
        if (f.b == e.b) expected.push_back(f.rank);
      CHECK(mesh.group(e.rank, dims) == expected);
      CHECK(mesh.group_rank(e.rank, dims) == e.a * 4 + e.c);
      CHECK(mesh.group_index(e.rank, dims) == e.b);
      CHECK(mesh.at(dims, e.b, e.a * 4 + e.c) == e.rank);
    }
  }
  SECTION("the groups along a dimension partition the ranks") {
    for (std::string_view const dim : {"dp", "tp", "pp"}) {
      std::multiset<int> seen;
      for (auto const& g : mesh.groups(dim)) {
        CHECK(static_cast<int>(g.size()) == mesh.size(dim));
        seen.insert(g.begin(), g.end());
      }
      CHECK(seen.size() == 24);
      CHECK(std::set<int>(seen.begin(), seen.end()).size() == 24);
    }
  }
  SECTION("every dimension: one group of every rank") {
    std::vector<std::string_view> const dims{"dp", "tp", "pp"};
    auto const g = mesh.group(7, dims);
    REQUIRE(g.size() == 24);
    for (int r = 0; r < 24; ++r) CHECK(g[static_cast<std::size_t>(r)] == r);
  }
}

TEST_CASE("DeviceMesh names what is wrong", "[comm][mesh]") {
  REQUIRE_MGPU_ERROR(DeviceMesh({}), Errc::invalid_argument, "no dimension");
  REQUIRE_MGPU_ERROR(DeviceMesh({{"dp", 2}, {"dp", 2}}), Errc::invalid_argument, "\"dp\" given twice");
  REQUIRE_MGPU_ERROR(DeviceMesh({{"tp", 0}}), Errc::invalid_argument, "\"tp\" of size 0 (expected a size >= 1)");
  REQUIRE_MGPU_ERROR(DeviceMesh({{"", 2}}), Errc::invalid_argument, "has no name");
  DeviceMesh const mesh({{"dp", 2}, {"tp", 2}});
  REQUIRE_MGPU_ERROR(mesh.size("pp"), Errc::invalid_argument, "no dimension \"pp\" (expected one of dp, tp)");
  REQUIRE_MGPU_ERROR(mesh.coordinates(4), Errc::invalid_argument, "rank 4 (expected a rank in [0, 4))");
  REQUIRE_MGPU_ERROR(mesh.rank(std::vector<int>{1, 2}), Errc::invalid_argument, "coordinate 2 along \"tp\" (expected one in [0, 2))");
  REQUIRE_MGPU_ERROR(mesh.rank(std::vector<int>{1}), Errc::invalid_argument, "1 coordinates (expected 2)");
  std::vector<std::string_view> const twice{"tp", "tp"};
  REQUIRE_MGPU_ERROR(mesh.at("tp", 2, 0), Errc::invalid_argument, "group 2, rank 0 (expected a group in [0, 2) and a rank in [0, 2))");
  REQUIRE_MGPU_ERROR(mesh.group(0, twice), Errc::invalid_argument, "named twice");
}

TEST_CASE("drives_any says whether a process's contiguous ranks meet a list", "[comm][mesh]") {
  std::vector<int> const ranks{1, 5};
  CHECK(mgpu::comm::drives_any(ranks, 0, 2));
  CHECK_FALSE(mgpu::comm::drives_any(ranks, 2, 3));
  CHECK(mgpu::comm::drives_any(ranks, 4, 2));
  CHECK_FALSE(mgpu::comm::drives_any(ranks, 6, 2));
}
