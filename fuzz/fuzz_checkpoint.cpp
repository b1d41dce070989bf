// Fuzz target: Checkpoint::load, and Checkpoint::index with read_record of every entry it lists
// (src/io/checkpoint.cpp; the sharded checkpoint's lazy reader). An input whose first byte is odd is the
// file as it is; otherwise the rest is the body after the version and gets a valid header and
// trailer (magic, version 1, whole-file checksum, end marker), so the fuzzer reaches the records.
#include <mgpu/io/checkpoint.hpp>

#include <cstring>
#include <vector>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "fuzz_support.hpp"

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size) {
  if (size < 1) return 0;
  std::vector<std::uint8_t> file;
  if (data[0] & 1) {
    file.assign(data + 1, data + size);
  } else {
    char const magic[] = "MGPUCKPT";
    file.assign(magic, magic + 8);
    std::uint32_t const version = mgpu::io::checkpoint_version;
    file.insert(file.end(), reinterpret_cast<std::uint8_t const*>(&version), reinterpret_cast<std::uint8_t const*>(&version) + 4);
    file.insert(file.end(), data + 1, data + size);
    std::uint64_t const sum = XXH64(file.data(), file.size(), 0);
    file.insert(file.end(), reinterpret_cast<std::uint8_t const*>(&sum), reinterpret_cast<std::uint8_t const*>(&sum) + 8);
    char const end[] = "MGPU-END";
    file.insert(file.end(), end, end + 8);
  }
  auto const path = mgpu::fuzz::write_input("checkpoint", file.data(), file.size());
  mgpu::fuzz::expect_load_or_error(path.string(), [&] {
    auto const checkpoint = mgpu::io::Checkpoint::load(path);
    for (auto const& r : checkpoint.records()) (void)checkpoint.get(r.name);
  });
  mgpu::fuzz::expect_load_or_error(path.string(), [&] {
    for (auto const& entry : mgpu::io::Checkpoint::index(path)) (void)mgpu::io::Checkpoint::read_record(path, entry);
  });
  return 0;
}
