// The checking macros for CUDA runtime calls (c10's C10_CUDA_CHECK): each captures the
// call's text, file and line, and on failure reports the error's name and description.
//   SPILLWAY_CUDA_CHECK(expr)       throws spillway::Error (through throw_check_failure);
//   SPILLWAY_CUDA_CHECK_WARN(expr)  for destructors and cleanup: reports on stderr
//                                   (warn_check_failure) and carries on, never throws;
//   SPILLWAY_CUDA_LAUNCH_CHECK()    after every kernel launch (cudaGetLastError).
// A failed call's error is cleared from the runtime's "last error" once reported, so that
// a later launch check does not report it again (a sticky error cannot be cleared: every
// later call reports it anyway).
// Valid C++17 and C++20, host code only (it may be included by .cu files).
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <string>

#include "spillway/core/error.hpp"

namespace spillway::detail {

// "cudaErrorMemoryAllocation (2): out of memory"
inline std::string cuda_error_text(cudaError_t err) {
  return fmt::format("{} ({}): {}", cudaGetErrorName(err), static_cast<int>(err),
                     cudaGetErrorString(err));
}

[[noreturn]] inline void throw_cuda_failure(const char* expr, const char* file, int line,
                                            cudaError_t err) {
  (void)cudaGetLastError();
  throw_check_failure(expr, file, line, "CUDA error " + cuda_error_text(err));
}

inline void warn_cuda_failure(const char* expr, const char* file, int line,
                              cudaError_t err) noexcept {
  (void)cudaGetLastError();
  try {
    warn_check_failure(expr, file, line, "CUDA error " + cuda_error_text(err));
  } catch (...) {  // the message could not be built (no memory): say the least
    std::fprintf(stderr, "spillway: warning: CUDA error %d (check failed: %s at %s:%d)\n",
                 static_cast<int>(err), expr, file, line);
  }
}

}  // namespace spillway::detail

#define SPILLWAY_CUDA_CHECK(expr)                                                            \
  do {                                                                                       \
    const cudaError_t spillway_cuda_err_ = (expr);                                           \
    if (spillway_cuda_err_ != cudaSuccess) {                                                 \
      ::spillway::detail::throw_cuda_failure(#expr, __FILE__, __LINE__, spillway_cuda_err_); \
    }                                                                                        \
  } while (0)

#define SPILLWAY_CUDA_CHECK_WARN(expr)                                                      \
  do {                                                                                      \
    const cudaError_t spillway_cuda_err_ = (expr);                                          \
    if (spillway_cuda_err_ != cudaSuccess) {                                                \
      ::spillway::detail::warn_cuda_failure(#expr, __FILE__, __LINE__, spillway_cuda_err_); \
    }                                                                                       \
  } while (0)

// After every kernel launch: a bad launch configuration is reported here, at the launch,
// rather than by whichever CUDA call happens to come next.
#define SPILLWAY_CUDA_LAUNCH_CHECK()                                                         \
  do {                                                                                       \
    const cudaError_t spillway_cuda_err_ = cudaGetLastError();                               \
    if (spillway_cuda_err_ != cudaSuccess) {                                                 \
      ::spillway::detail::throw_cuda_failure("kernel launch (cudaGetLastError())", __FILE__, \
                                             __LINE__, spillway_cuda_err_);                  \
    }                                                                                        \
  } while (0)
