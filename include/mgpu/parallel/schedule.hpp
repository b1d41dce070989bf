// Deprecated: moved to <mgpu/pipeline/schedule.hpp>; this forwarding header is to be removed in the
// next release.
#pragma once

#include <mgpu/pipeline/schedule.hpp>
