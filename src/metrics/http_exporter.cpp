// The /metrics endpoint over cpp-httplib (Debian: libcpp-httplib-dev).
#include <atomic>
#include <chrono>
#include <thread>

#include <httplib.h>
#include <sys/socket.h>

#include <mgpu/core/error.hpp>
#include <mgpu/metrics/exporter.hpp>

namespace mgpu::metrics {

struct HttpExporter::Impl {
  httplib::Server server;
  std::string host;
  int port = 0;
  std::atomic<bool> ended{false};
  std::thread thread;
};

HttpExporter::HttpExporter(Registry const& registry, std::string const& host, int port)
    : impl_(std::make_unique<Impl>()) {
  if (port < 0 || port > 65535)
    throw Error(Errc::invalid_argument,
                "metrics port " + std::to_string(port) + " (expected 0 to 65535; 0: any free port)");
  if (host.empty()) throw Error(Errc::invalid_argument, "metrics host '' (expected an address such as 127.0.0.1)");
  impl_->host = host;
  // SO_REUSEADDR only: cpp-httplib's default adds SO_REUSEPORT, with which a second server binds a
  // port in use and the two share its requests.
  impl_->server.set_socket_options([](socket_t socket) {
    int const yes = 1;
    ::setsockopt(socket, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  });
  impl_->server.Get("/metrics", [&registry](httplib::Request const&, httplib::Response& response) {
    response.set_content(registry.exposition(), "text/plain; version=0.0.4; charset=utf-8");
  });
  bool bound = false;
  if (port == 0) {
    int const any = impl_->server.bind_to_any_port(host);
    bound = any > 0;
    impl_->port = any;
  } else {
    bound = impl_->server.bind_to_port(host, port);
    impl_->port = port;
  }
  if (!bound)
    throw Error(Errc::io, "metrics endpoint: cannot listen on " + host + ":" + std::to_string(port) +
                              " (expected a local address and a port no other program uses)");
  impl_->thread = std::thread([impl = impl_.get()] {
    impl->server.listen_after_bind();
    impl->ended = true;
  });
  // stop() ends only a server that runs: wait for it to run (or end), so the destructor's join
  // never waits forever.
  while (!impl_->server.is_running() && !impl_->ended) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

HttpExporter::~HttpExporter() {
  if (!impl_) return;
  impl_->server.stop();
  if (impl_->thread.joinable()) impl_->thread.join();
}

int HttpExporter::port() const noexcept { return impl_->port; }
std::string const& HttpExporter::host() const noexcept { return impl_->host; }

}  // namespace mgpu::metrics
