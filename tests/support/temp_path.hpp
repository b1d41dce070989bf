// A path in the system's temporary folder that no other process uses: `name` with this process's
// id, so test runs side by side (two checkouts, or a test binary run twice at once) do not share
// files.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <string>

namespace mgpu::test {

inline std::filesystem::path temp_path(std::string const& name) {
  return std::filesystem::temp_directory_path() / (name + "-" + std::to_string(::getpid()));
}

}  // namespace mgpu::test
