// The one error type of spillway and the checking macros.
//
// spillway::Error is thrown for programming errors and for bad input that the caller
// cannot continue from (a malformed config, an unknown model). Expected outcomes
// ("infeasible", "pool full", "no GPU") are values, never exceptions.
// A message names what was wrong and the value, e.g.
//   model config: "num_experts_per_tok" is 0; must be >= 1 (file: qwen3.json)
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace spillway {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
// Throws Error with the failed expression, its location and the message.
[[noreturn]] void throw_check_failure(const char* expr, const char* file, int line,
                                      const std::string& message);
// Prints the same to stderr without throwing (for destructors).
void warn_check_failure(const char* expr, const char* file, int line,
                        const std::string& message) noexcept;
}  // namespace detail

}  // namespace spillway

// Internal invariant: throws spillway::Error naming the expression, file and line.
#define SPILLWAY_CHECK(cond, ...)                                          \
  do {                                                                     \
    if (!(cond)) {                                                         \
      ::spillway::detail::throw_check_failure(#cond, __FILE__, __LINE__,   \
                                              ::fmt::format(__VA_ARGS__)); \
    }                                                                      \
  } while (0)

// Same check for destructors and cleanup paths: reports and carries on.
#define SPILLWAY_CHECK_WARN(cond, ...)                                    \
  do {                                                                    \
    if (!(cond)) {                                                        \
      ::spillway::detail::warn_check_failure(#cond, __FILE__, __LINE__,   \
                                             ::fmt::format(__VA_ARGS__)); \
    }                                                                     \
  } while (0)

// Bad user input: throws spillway::Error with exactly the formatted message (no source
// location: the user needs the field and the value, not our line numbers).
#define SPILLWAY_INPUT_ERROR(...) throw ::spillway::Error(::fmt::format(__VA_ARGS__))
