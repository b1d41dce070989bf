// mgpu::Error and the reports of failed CUDA, NCCL and cuBLAS calls.
#include <mgpu/core/error.hpp>

#include <cstdio>
#include <string>

#include "core/cuda_backend.hpp"

namespace mgpu {

std::string_view to_string(Errc category) noexcept {
  switch (category) {
    case Errc::invalid_argument: return "invalid_argument";
    case Errc::out_of_memory: return "out_of_memory";
    case Errc::device: return "device";
    case Errc::communication: return "communication";
    case Errc::timeout: return "timeout";
    case Errc::corrupt_data: return "corrupt_data";
    case Errc::io: return "io";
  }
  return "unknown";
}

Error::Error(Errc category, std::string_view message)
    : std::runtime_error(std::string(to_string(category)) + ": " + std::string(message)), category_(category) {}

std::string_view Error::message() const noexcept {
  std::string_view text = what();
  return text.substr(to_string(category_).size() + 2);
}

std::string describe(std::exception_ptr const& failure) {
  try {
    if (failure) std::rethrow_exception(failure);
  } catch (std::exception const& e) {
    return e.what();
  } catch (...) {  // not a std::exception: nothing to say of it
  }
  return "an unknown error";
}

namespace detail {
namespace {
std::string call_report(char const* library, std::string const& status_text, char const* expression,
                        SourceLocation where) {
  return std::string(library) + " call " + expression + " failed with " + status_text + " at " +
         where.file_name() + ":" + std::to_string(where.line()) + " (expected success)";
}
}  // namespace

void throw_cuda_error(int status, char const* expression, SourceLocation where) {
  throw Error(cuda::is_out_of_memory(status) ? Errc::out_of_memory : Errc::device,
              call_report("CUDA", cuda::error_string(status), expression, where));
}

void throw_nccl_error(int status, char const* expression, SourceLocation where) {
  throw Error(Errc::communication, call_report("NCCL", cuda::nccl_error_string(status), expression, where));
}

void throw_cublas_error(int status, char const* expression, SourceLocation where) {
  throw Error(Errc::device, call_report("cuBLAS", cuda::cublas_error_string(status), expression, where));
}

void report_cuda_error(int status, char const* expression, SourceLocation where) noexcept {
  try {
    std::fprintf(stderr, "mgpu: %s\n", call_report("CUDA", cuda::error_string(status), expression, where).c_str());
  } catch (...) {
    std::fprintf(stderr, "mgpu: CUDA call %s failed with status %d\n", expression, status);
  }
}
}  // namespace detail

}  // namespace mgpu
