// Prometheus exporters of a Registry: an HTTP endpoint and a textfile (see docs/metrics.md).
#pragma once

#include <filesystem>
#include <memory>
#include <string>

#include <mgpu/metrics/registry.hpp>

namespace mgpu::metrics {

/// Serves `registry.exposition()` at http://HOST:PORT/metrics from its own thread while it lives.
/// The registry must outlive it. Throws Error(invalid_argument) without cpp-httplib in the build.
class HttpExporter {
 public:
  /// Listens on `host` and `port` (0: any free one). Throws Error(invalid_argument) for a port
  /// outside 0 to 65535, Error(io) naming host and port when it cannot listen there.
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

/// Replaces `path` with `registry.exposition()` atomically (renamed into place, not synced).
/// Throws Error(invalid_argument) unless the name ends in ".prom", Error(io) when it cannot write.
void write_textfile(Registry const& registry, std::filesystem::path const& path);

}  // namespace mgpu::metrics
