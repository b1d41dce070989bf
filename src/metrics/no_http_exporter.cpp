// The /metrics endpoint in a library built without cpp-httplib: construction says so.
#include <mgpu/core/error.hpp>
#include <mgpu/metrics/exporter.hpp>

namespace mgpu::metrics {

struct HttpExporter::Impl {
  std::string host;
};

HttpExporter::HttpExporter(Registry const&, std::string const& host, int port) {
  throw Error(Errc::invalid_argument,
              "metrics endpoint " + host + ":" + std::to_string(port) +
                  ": mgpu was built without cpp-httplib (expected libcpp-httplib-dev at configure time; "
                  "--metrics-file writes the same metrics for node_exporter)");
}

HttpExporter::~HttpExporter() = default;
int HttpExporter::port() const noexcept { return 0; }
std::string const& HttpExporter::host() const noexcept {
  static std::string const none;
  return none;
}

}  // namespace mgpu::metrics
