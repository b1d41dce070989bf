// Entry point of the CUDA tests: they are always built, and skip (exit code 77, which ctest reports
// as skipped) with a message when no GPU is visible.
#define CATCH_CONFIG_RUNNER
#include <cstdio>

#include <mgpu/config.hpp>
#include <mgpu/core/device.hpp>

#include "support/catch.hpp"

int main(int argc, char* argv[]) {
  if (mgpu::cuda_device_count() == 0) {
    std::printf("SKIPPED: no CUDA GPU is visible (%s); the CUDA tests need one\n",
                mgpu::built_with_cuda ? "built with CUDA" : "built without CUDA");
    return 77;
  }
  int const failed = Catch::Session().run(argc, argv);
  mgpu::test::print_skipped();
  return failed;
}
