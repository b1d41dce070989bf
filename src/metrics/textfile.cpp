// node_exporter's textfile collector: the exposition written atomically to NAME.prom.
#include <mgpu/core/error.hpp>
#include <mgpu/metrics/exporter.hpp>

#include "core/atomic_file.hpp"

namespace mgpu::metrics {

void write_textfile(Registry const& registry, std::filesystem::path const& path) {
  if (path.extension() != ".prom" || path.stem().empty())
    throw Error(Errc::invalid_argument,
                "metrics file " + path.string() +
                    " (expected a name ending in .prom, which node_exporter's textfile collector reads)");
  std::string const text = registry.exposition();
  // Rewritten every step: readers need the rename's atomicity, not the disk flushes.
  detail::write_file_atomically(path, std::as_bytes(std::span(text.data(), text.size())), detail::Durability::unsynced);
}

}  // namespace mgpu::metrics
