// Fuzz target: read_token_shard and the token loader (src/data/tokens.cpp). The input is the shard
// file; one that loads is drawn from, sampled and sequential, and every row's targets checked.
#include <mgpu/data/tokens.hpp>

#include <algorithm>
#include <cstdlib>

#include "fuzz_support.hpp"

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size) {
  auto const path = mgpu::fuzz::write_input("tokens", data, size);
  mgpu::fuzz::expect_load_or_error(path.string(), [&] {
    auto const tokens = mgpu::data::read_token_shard(path, 50257);
    static auto const allocator = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
    auto const block = std::min<std::int64_t>(static_cast<std::int64_t>(tokens.size()) - 1, 8);
    if (block < 1) return;
    for (bool const sequential : {false, true}) {
      mgpu::data::TokenLoader loader(std::vector<std::vector<std::uint16_t>>{tokens}, 50257,
                                     {.batch = 3, .block = block, .seed = size, .sequential = sequential});
      auto const batch = loader.next(*allocator);
      auto const x = batch.x.host_span<std::int32_t>();
      auto const y = batch.y.host_span<std::int32_t>();
      for (std::int64_t r = 0; r < 3; ++r)
        for (std::int64_t t = 0; t + 1 < block; ++t)
          if (y[static_cast<std::size_t>(r * block + t)] != x[static_cast<std::size_t>(r * block + t + 1)]) std::abort();
    }
  });
  return 0;
}
