// The two ways Prometheus reads a training job's Registry: an HTTP endpoint it scrapes
// (/metrics), and a file node_exporter's textfile collector reads (NAME.prom, replaced atomically).
#pragma once

#include <filesystem>
#include <memory>
#include <string>

#include <mgpu/metrics/registry.hpp>

namespace mgpu::metrics {

/// Serves `registry.exposition()` at http://HOST:PORT/metrics from a thread of its own, from
/// construction until destruction. The registry must outlive the exporter. Built on cpp-httplib;
/// a library built without it (mgpu::built_with_metrics_http false) throws Error(invalid_argument)
/// saying so.
class HttpExporter {
 public:
  /// Listens on `host` (an address, e.g. "127.0.0.1", or "0.0.0.0" for every interface) and `port`
  /// (0: any free port, see port()). Throws Error(invalid_argument) for a port outside 0 to 65535,
  /// Error(io) naming host and port when it cannot listen there.
  HttpExporter(Registry const& registry, std::string const& host, int port);
  HttpExporter(HttpExporter const&) = delete;
  HttpExporter& operator=(HttpExporter const&) = delete;
  /// Stops listening and waits for the serving thread. Never throws.
  ~HttpExporter();

  /// The port it listens on.
  [[nodiscard]] int port() const noexcept;
  /// The address it listens on.
  [[nodiscard]] std::string const& host() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Replaces `path` with `registry.exposition()` atomically (a temporary file in the same folder,
/// renamed into place; not synced to the disk, as it is rewritten every step), so node_exporter's
/// textfile collector never reads part of one. Throws Error(invalid_argument) when the name does
/// not end in ".prom" (the collector reads only those), Error(io) naming the file when it cannot
/// be written.
void write_textfile(Registry const& registry, std::filesystem::path const& path);

}  // namespace mgpu::metrics
