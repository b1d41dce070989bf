// Shared by the fuzz targets: input bytes written to a per-process file (the readers take paths),
// and the contract every target checks: an input either loads or raises mgpu::Error whose message
// names the file; any other exception is a finding and aborts.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#include <unistd.h>

#include <mgpu/core/error.hpp>

namespace mgpu::fuzz {

/// A file under the temporary folder, named for this process and `tag`, holding `bytes`.
inline std::filesystem::path write_input(char const* tag, std::uint8_t const* bytes, std::size_t size) {
  std::filesystem::path const path =
      std::filesystem::temp_directory_path() / ("mgpu-fuzz-" + std::to_string(::getpid()) + "-" + tag);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<char const*>(bytes), static_cast<std::streamsize>(size));
  if (!out) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    std::abort();
  }
  return path;
}

/// Runs `read`; returns normally when it loads or throws mgpu::Error whose message contains
/// `place` (empty: any message); aborts on any other outcome.
template <class Read>
void expect_load_or_error(std::string_view place, Read&& read) {
  try {
    read();
  } catch (mgpu::Error const& e) {
    if (place.empty() || std::string_view(e.what()).find(place) != std::string_view::npos) return;
    std::fprintf(stderr, "mgpu::Error without the place '%.*s': %s\n", static_cast<int>(place.size()), place.data(), e.what());
    std::abort();
  } catch (std::exception const& e) {
    std::fprintf(stderr, "not an mgpu::Error: %s\n", e.what());
    std::abort();
  }
}

}  // namespace mgpu::fuzz
