// REQUIRE_MGPU_ERROR(expr, category, text): expr throws mgpu::Error of that category whose
// message contains text.
#pragma once

#include <string>

#include <mgpu/core/error.hpp>

#include "support/catch.hpp"

#define REQUIRE_MGPU_ERROR(expression, errc, text)                                   \
  do {                                                                               \
    bool mgpu_thrown_ = false;                                                       \
    try {                                                                            \
      (void)(expression);                                                            \
    } catch (::mgpu::Error const& mgpu_error_) {                                     \
      mgpu_thrown_ = true;                                                           \
      INFO("message: " << mgpu_error_.what());                                       \
      CHECK(mgpu_error_.category() == (errc));                                       \
      CHECK_THAT(std::string(mgpu_error_.what()), MGPU_TEST_CONTAINS(text));          \
    }                                                                                \
    if (!mgpu_thrown_) FAIL("expected mgpu::Error from " #expression);               \
  } while (false)
