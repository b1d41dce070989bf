// Writing a whole file atomically: checkpoints, token shards and the metrics' textfile are written
// to a temporary file in the destination's folder, synced (but for the metrics), and renamed into
// place, so a reader sees the old file or the new one, never part of one. In core, so that every
// module above (io, data, metrics) shares it.
#pragma once

#include <cstddef>
#include <filesystem>
#include <span>

namespace mgpu::detail {

/// Whether a write survives a crash of the machine: `synced` (the file and the rename flushed to
/// the disk; checkpoints, shards) or `unsynced` (readers still see the old or the new file, never
/// part of one, but a crash may lose the new one; a file rewritten every step, as the metrics).
enum class Durability { synced, unsynced };

/// Replaces `path` with `bytes`. Throws Error(io) naming the file and the system's reason; the
/// temporary file is removed on failure.
void write_file_atomically(std::filesystem::path const& path, std::span<std::byte const> bytes,
                           Durability durability = Durability::synced);

}  // namespace mgpu::detail
