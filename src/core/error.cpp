// Out-of-line failure paths of the checking macros (kept cold and out of callers).
#include "spillway/core/error.hpp"

#include <cstdio>

namespace spillway::detail {

void throw_check_failure(const char* expr, const char* file, int line, const std::string& message) {
  throw Error(fmt::format("{} (check failed: {} at {}:{})", message, expr, file, line));
}

void warn_check_failure(const char* expr, const char* file, int line,
                        const std::string& message) noexcept {
  std::fprintf(stderr, "spillway: warning: %s (check failed: %s at %s:%d)\n", message.c_str(), expr,
               file, line);
}

}  // namespace spillway::detail
