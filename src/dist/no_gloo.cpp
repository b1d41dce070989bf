// The dist module's MPI build without Gloo: no job uses the Gloo transport (gloo_wanted() refuses
// MGPU_DIST_BACKEND=gloo and never picks it), so none of these is reached.
#include <mgpu/core/error.hpp>

#include "dist/gloo_runtime.hpp"

namespace mgpu::dist::detail {

namespace {
[[noreturn]] void no_gloo() {
  throw Error(Errc::invalid_argument, "the Gloo transport in a build without Gloo (expected MGPU_WITH_GLOO)");
}
}  // namespace

void gloo_connect(Place const&, std::string const&, AllGather const&, std::chrono::milliseconds) { no_gloo(); }
bool gloo_connected() { return false; }
std::shared_ptr<gloo::Context> gloo_context() { return nullptr; }
void gloo_leave(bool) noexcept {}
std::shared_ptr<Exchange> make_gloo_exchange(Subset const&) { no_gloo(); }

}  // namespace mgpu::dist::detail
