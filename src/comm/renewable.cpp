// A communicator made anew in place after a failure (see renewable.hpp).
#include "comm/renewable.hpp"

#include <utility>

#include <mgpu/core/error.hpp>

namespace mgpu::comm::detail {

namespace {
std::unique_ptr<Communicator> made(Renewable::Make const& make) {
  std::unique_ptr<Communicator> comm = make ? make() : nullptr;
  if (!comm) throw Error(Errc::invalid_argument, "a renewable communicator whose factory made none (expected a communicator)");
  return comm;
}
}  // namespace

Renewable::Renewable(Make make) : make_(std::move(make)), inner_(made(make_)) {}

Renewable::Renewable(std::unique_ptr<Communicator> first, Make make) : make_(std::move(make)), inner_(std::move(first)) {
  if (!inner_) inner_ = made(make_);
}

void Renewable::renew() {
  std::unique_ptr<Communicator> fresh = made(make_);  // when this throws, the old (aborted) one stays
  inner_ = std::move(fresh);
}

std::unique_ptr<Renewable> make_renewable(DeviceGroup& group,
                                          std::function<std::unique_ptr<Communicator>(DeviceGroup&, Options)> make,
                                          Options options, std::unique_ptr<Communicator> first) {
  return std::make_unique<Renewable>(std::move(first), [&group, make = std::move(make), options] {
    return make ? make(group, options) : make_communicator(group, options);
  });
}

}  // namespace mgpu::comm::detail
