// Deprecated: moved to <mgpu/optim/optim.hpp>; this forwarding header is to be removed in the
// next release.
#pragma once

#include <mgpu/optim/optim.hpp>
