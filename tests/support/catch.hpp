// The one place that names the Catch2 header, so moving from Catch2 v2 to v3 is a one-line change.
#pragma once

#if __has_include(<catch2/catch_all.hpp>)
#include <catch2/catch_all.hpp>
#else
#include <catch2/catch.hpp>
#endif
