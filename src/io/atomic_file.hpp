// Writing a whole file atomically: checkpoints and token shards are written to a temporary file in
// the destination's folder, synced, and renamed into place, so a reader sees the old file or the
// new one, never part of one.
#pragma once

#include <cstddef>
#include <filesystem>
#include <span>

namespace mgpu::detail {

/// Replaces `path` with `bytes`. Throws Error(io) naming the file and the system's reason; the
/// temporary file is removed on failure.
void write_file_atomically(std::filesystem::path const& path, std::span<std::byte const> bytes);

}  // namespace mgpu::detail
