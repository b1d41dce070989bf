// mgpu::Error and the checked-call macros.
#include <mgpu/core/error.hpp>

#include <string>

#include "support/catch.hpp"
#include "support/expect_error.hpp"

namespace {
int failing_call() { return 2; }  // cudaErrorMemoryAllocation, ncclUnhandledCudaError, CUBLAS_STATUS_ALLOC_FAILED... all non-zero
int succeeding_call() { return 0; }
}  // namespace

TEST_CASE("Error carries its category and a prefixed message", "[core][error]") {
  mgpu::Error const error(mgpu::Errc::timeout, "all_reduce waited 5 s for ranks 2, 3");
  CHECK(error.category() == mgpu::Errc::timeout);
  CHECK(std::string(error.what()) == "timeout: all_reduce waited 5 s for ranks 2, 3");
  CHECK(error.message() == "all_reduce waited 5 s for ranks 2, 3");
  CHECK(mgpu::to_string(mgpu::Errc::corrupt_data) == "corrupt_data");
  CHECK(mgpu::to_string(mgpu::Errc::out_of_memory) == "out_of_memory");
}

TEST_CASE("Check macros pass on success and name the call, file and line on failure", "[core][error]") {
  CHECK_NOTHROW([] { MGPU_CUDA_CHECK(succeeding_call()); }());
  CHECK_NOTHROW([] { MGPU_NCCL_CHECK(succeeding_call()); }());
  CHECK_NOTHROW([] { MGPU_CUBLAS_CHECK(succeeding_call()); }());

  REQUIRE_MGPU_ERROR([] { MGPU_CUDA_CHECK(failing_call()); }(), mgpu::Errc::out_of_memory, "CUDA call failing_call() failed");
  REQUIRE_MGPU_ERROR([] { MGPU_CUDA_CHECK(failing_call()); }(), mgpu::Errc::out_of_memory, "test_error.cpp:");
  REQUIRE_MGPU_ERROR([] { MGPU_NCCL_CHECK(failing_call()); }(), mgpu::Errc::communication, "NCCL call failing_call() failed");
  REQUIRE_MGPU_ERROR([] { MGPU_CUBLAS_CHECK(failing_call()); }(), mgpu::Errc::device, "cuBLAS call failing_call() failed");
  REQUIRE_MGPU_ERROR([] { MGPU_CUDA_CHECK(1); }(), mgpu::Errc::device, "CUDA call 1 failed");
  CHECK_NOTHROW([] { MGPU_CUDA_CHECK_NO_THROW(failing_call()); }());
}
