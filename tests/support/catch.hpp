// The one place that names the Catch2 header, so moving from Catch2 v2 to v3 is a one-line change.
#pragma once

//
// MGPU_SKIP(reason) ends the current test case as skipped, saying why (a stream expression). Catch2
// v3 reports it as skipped (SKIP). Catch2 v2 has no skip: the test case warns "SKIPPED: reason"
// and mgpu::test::print_skipped() lists the skipped test cases at the end of a run.
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#if __has_include(<catch2/catch_all.hpp>)
#include <catch2/catch_all.hpp>
#define MGPU_TEST_CONTAINS(text) Catch::Matchers::ContainsSubstring(text)
#define MGPU_SKIP(reason) SKIP(reason)
#else
#include <catch2/catch.hpp>
#define MGPU_TEST_CONTAINS(text) Catch::Matchers::Contains(text)
#define MGPU_SKIP(reason)                                                                       \
  do {                                                                                          \
    std::ostringstream mgpu_skip_reason;                                                        \
    mgpu_skip_reason << reason;                                                                 \
    ::mgpu::test::skipped().push_back(Catch::getResultCapture().getCurrentTestName() + ": " +   \
                                      mgpu_skip_reason.str());                                  \
    WARN("SKIPPED: " << mgpu_skip_reason.str());                                                \
    return;                                                                                     \
  } while (false)
#endif

namespace mgpu::test {

/// The test cases MGPU_SKIP ended under Catch2 v2, "name: reason" each.
inline std::vector<std::string>& skipped() {
  static std::vector<std::string> names;
  return names;
}

/// Prints one "SKIPPED: name: reason" line per skipped test case (Catch2 v2; v3 reports them itself).
inline void print_skipped() {
  for (std::string const& line : skipped()) std::printf("SKIPPED: %s\n", line.c_str());
  if (!skipped().empty()) std::printf("%zu test case(s) skipped\n", skipped().size());
}

}  // namespace mgpu::test
