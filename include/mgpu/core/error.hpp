// mgpu's one exception type, its categories, and the checked wrappers for CUDA, NCCL and cuBLAS calls.
#pragma once

#include <exception>
#include <stdexcept>
#include <string>
#include <string_view>

namespace mgpu {

/// What kind of failure an Error reports.
enum class Errc {
  invalid_argument,  ///< the caller passed something the library cannot use
  out_of_memory,     ///< a device (or its configured limit) has no room for a request
  device,            ///< a device, driver or host worker failed while running work
  communication,     ///< a collective or peer transfer failed
  timeout,           ///< something did not complete before its deadline
  corrupt_data,      ///< stored data failed verification
  io,                ///< a file could not be read or written
};

/// The category's name as written in messages ("invalid_argument", "out_of_memory", ...).
std::string_view to_string(Errc category) noexcept;

/// The exception every mgpu function throws. what() reads "<category>: <message>", and the
/// message names what was wrong and what was expected. Safe to copy between threads.
class Error : public std::runtime_error {
 public:
  Error(Errc category, std::string_view message);

  /// The failure's category.
  [[nodiscard]] Errc category() const noexcept { return category_; }
  /// The message without the category prefix.
  [[nodiscard]] std::string_view message() const noexcept;

 private:
  Errc category_;
};

/// What a caught exception says: its what(), or "an unknown error" for one that is not a
/// std::exception (a failure kept to be rethrown, described in another message).
[[nodiscard]] std::string describe(std::exception_ptr const& failure);

namespace detail {
// A call site's file and line. Not std::source_location, which Clang before 15 cannot provide with
// libstdc++ (Debian 12's clang is 14): the compiler builtins it is made of work in GCC and Clang
// alike, so the library and its users agree on this type whichever compiler each uses.
struct SourceLocation {
  static constexpr SourceLocation current(char const* file = __builtin_FILE(), unsigned line = __builtin_LINE()) noexcept {
    return {file, line};
  }
  [[nodiscard]] constexpr char const* file_name() const noexcept { return file; }
  [[nodiscard]] constexpr unsigned line() const noexcept { return line_number; }
  char const* file;
  unsigned line_number;
};

// Throw an Error for a failed call; `status` is the library's own status code, `expression` the
// call as written. Compiled into the library, so this header needs no CUDA headers.
[[noreturn]] void throw_cuda_error(int status, char const* expression, SourceLocation where);
[[noreturn]] void throw_nccl_error(int status, char const* expression, SourceLocation where);
[[noreturn]] void throw_cublas_error(int status, char const* expression, SourceLocation where);
// The same report written to stderr, for destructors and other places that must not throw.
void report_cuda_error(int status, char const* expression, SourceLocation where) noexcept;
}  // namespace detail

}  // namespace mgpu

/// Evaluates a CUDA runtime call and throws mgpu::Error (naming the call, file and line) unless it
/// returned cudaSuccess. Out-of-memory statuses map to Errc::out_of_memory, others to Errc::device.
#define MGPU_CUDA_CHECK(expression)                                                               \
  do {                                                                                            \
    if (auto const mgpu_status_ = (expression); static_cast<int>(mgpu_status_) != 0)              \
      ::mgpu::detail::throw_cuda_error(static_cast<int>(mgpu_status_), #expression,               \
                                       ::mgpu::detail::SourceLocation::current());                \
  } while (false)

/// As MGPU_CUDA_CHECK, but reports to stderr instead of throwing (for destructors).
#define MGPU_CUDA_CHECK_NO_THROW(expression)                                                      \
  do {                                                                                            \
    if (auto const mgpu_status_ = (expression); static_cast<int>(mgpu_status_) != 0)              \
      ::mgpu::detail::report_cuda_error(static_cast<int>(mgpu_status_), #expression,              \
                                        ::mgpu::detail::SourceLocation::current());               \
  } while (false)

/// Evaluates an NCCL call and throws mgpu::Error (Errc::communication) unless it returned ncclSuccess.
#define MGPU_NCCL_CHECK(expression)                                                               \
  do {                                                                                            \
    if (auto const mgpu_status_ = (expression); static_cast<int>(mgpu_status_) != 0)              \
      ::mgpu::detail::throw_nccl_error(static_cast<int>(mgpu_status_), #expression,               \
                                       ::mgpu::detail::SourceLocation::current());                \
  } while (false)

/// Evaluates a cuBLAS call and throws mgpu::Error unless it returned CUBLAS_STATUS_SUCCESS.
#define MGPU_CUBLAS_CHECK(expression)                                                             \
  do {                                                                                            \
    if (auto const mgpu_status_ = (expression); static_cast<int>(mgpu_status_) != 0)              \
      ::mgpu::detail::throw_cublas_error(static_cast<int>(mgpu_status_), #expression,             \
                                         ::mgpu::detail::SourceLocation::current());              \
  } while (false)
