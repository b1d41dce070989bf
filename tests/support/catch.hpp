// The one place that names the Catch2 header, so moving from Catch2 v2 to v3 is a one-line change.
#pragma once

#if __has_include(<catch2/catch_all.hpp>)
#include <catch2/catch_all.hpp>
#define MGPU_TEST_CONTAINS(text) Catch::Matchers::ContainsSubstring(text)
#else
#include <catch2/catch.hpp>
#define MGPU_TEST_CONTAINS(text) Catch::Matchers::Contains(text)
#endif
