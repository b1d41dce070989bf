// Deprecated: moved to <mgpu/pipeline/pipeline.hpp>; this forwarding header is to be removed in the
// next release.
#pragma once

#include <mgpu/pipeline/pipeline.hpp>
