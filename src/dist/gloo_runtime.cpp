// The Gloo transport's runtime (gloo_runtime.hpp): the job's Gloo context, connected through the
// job's exchange.
#include "dist/gloo_runtime.hpp"

#include <gloo/common/error.h>
#include <gloo/context.h>
#include <gloo/transport/context.h>
#include <gloo/transport/device.h>
#include <gloo/transport/pair.h>
#include <gloo/transport/tcp/device.h>

#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>

#include <mgpu/core/error.hpp>

namespace mgpu::dist::detail {
namespace {

struct GlooGlobal {
  std::mutex mutex;
  std::shared_ptr<gloo::transport::Device> device;
  std::shared_ptr<gloo::Context> context;
};

GlooGlobal& gloo_global() {
  static GlooGlobal& g = *new GlooGlobal;  // outlives static destruction: Gloo's threads may use it
  return g;
}

// The job's context, its full mesh connected through the job's exchange: every process makes a
// pair (a listening TCP endpoint) for each other process, one all-gather shares every process's
// addresses, and each pair connects to its other end's.
class MeshContext final : public gloo::Context {
 public:
  MeshContext(int rank, int size) : gloo::Context(rank, size) {}

  void connect(std::shared_ptr<gloo::transport::Device> device, AllGather const& all_gather) {
    auto transport = device->createContext(rank, size);
    transport->setTimeout(getTimeout());
    std::vector<std::byte> mine;
    std::size_t length = 0;  // every address's bytes (one transport: the same size)
    for (int q = 0; q < size; ++q) {
      if (q == rank) continue;
      std::vector<char> const address = transport->createPair(q)->address().bytes();
      length = address.size();
      auto const* p = reinterpret_cast<std::byte const*>(address.data());
      mine.insert(mine.end(), p, p + address.size());
    }
    std::vector<std::vector<std::byte>> const all = all_gather(mine);
    for (int q = 0; q < size; ++q) {
      if (q == rank) continue;
      // Process q's addresses are for every process but q, in order: this one's is its
      // (rank - (rank > q))-th.
      std::size_t const index = static_cast<std::size_t>(rank - (rank > q ? 1 : 0));
      auto const& theirs = all[static_cast<std::size_t>(q)];
      if (theirs.size() != length * static_cast<std::size_t>(size - 1))
        throw Error(Errc::communication, "connecting Gloo: process " + std::to_string(q) + " sent " +
                                             std::to_string(theirs.size()) + " bytes of addresses (expected " +
                                             std::to_string(length * static_cast<std::size_t>(size - 1)) + ")");
      auto const* at = reinterpret_cast<char const*>(theirs.data()) + index * length;
      transport->getPair(q)->connect(std::vector<char>(at, at + length));
    }
    device_ = std::move(device);
    transportContext_ = std::move(transport);
  }
};

}  // namespace

void gloo_connect(Place const& place, std::string const& address, AllGather const& all_gather,
                  std::chrono::milliseconds timeout) {
  GlooGlobal& g = gloo_global();
  std::lock_guard lock(g.mutex);
  if (g.context) return;
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = address;
    auto device = gloo::transport::tcp::CreateDevice(attr);
    auto context = std::make_shared<MeshContext>(place.rank, place.size);
    context->setTimeout(timeout);
    context->connect(device, all_gather);
    g.device = std::move(device);
    g.context = std::move(context);
  } catch (gloo::Exception const& e) {
    throw Error(Errc::communication, "connecting Gloo (process " + std::to_string(place.rank) + " at " + address +
                                         "): " + e.what());
  }
}

bool gloo_connected() {
  GlooGlobal& g = gloo_global();
  std::lock_guard lock(g.mutex);
  return g.context != nullptr;
}

std::shared_ptr<gloo::Context> gloo_context() {
  GlooGlobal& g = gloo_global();
  std::lock_guard lock(g.mutex);
  return g.context;
}

void gloo_leave(bool failed) noexcept {
  GlooGlobal& g = gloo_global();
  std::lock_guard lock(g.mutex);
  if (failed) return;
  g.context.reset();
  g.device.reset();
}

}  // namespace mgpu::dist::detail
