// The first usage snippet of docs/getting-started.md (extracted by tests/CMakeLists.txt), run on
// host devices and checked against the batch it scatters.
#include <mgpu/mgpu.hpp>

#include <numeric>
#include <vector>

#include "support/catch.hpp"

TEST_CASE("README usage snippet: host batch scattered by speed, converted on every rank", "[readme]") {
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"  // the snippet names the lambda's parameters for readers
#include "readme_usage.inc"
#pragma GCC diagnostic pop
  group.synchronize();
  REQUIRE(batch.pinned());  // host memory whatever the group's devices, so host_span works on "cuda" too
  auto const sizes = mgpu::shard_sizes(batch.dim(0), group.size(), speed);
  REQUIRE(shards.size() == sizes.size());
  std::int64_t row = 0;
  for (std::size_t r = 0; r < shards.size(); ++r) {
    INFO("rank " << r);
    REQUIRE(shards[r].shape() == mgpu::Shape{sizes[r], 784});
    auto const got = shards[r].host_span<float>();
    for (std::size_t i = 0; i < got.size(); ++i) REQUIRE(got[i] == static_cast<float>(row * 784 + static_cast<std::int64_t>(i)));
    row += sizes[r];
  }
  REQUIRE(row == 1024);
}
