// The one error type of spillway and the checking macros.
//
// spillway::Error is thrown for programming errors and for bad input that the caller
// cannot continue from (a malformed config, an unknown model). Expected outcomes
// ("infeasible", "pool full", "no GPU") are values, never exceptions.
// A message names what was wrong and the value, e.g.
//   model config: "num_experts_per_tok" is 0; must be >= 1 (file: qwen3.json)
// Bad input in a field of a request or options struct is an InputError naming the field
// by its C++ name (micro_batch, efficiency.gemm), never by a command-line flag: a library
// caller has no flags; the CLI rewrites the names it knows into its flags.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>
#include <utility>

namespace spillway {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Bad input in one field: what() is exactly "<field> is <value>; <rule>". The field is
// the C++ member name (micro_batch, seq_len, efficiency.gemm, d2h_gbps), and a rule that
// mentions another field names it the same way ("must divide seq_len (8192)").
class InputError : public Error {
 public:
  InputError(std::string field, std::string value, std::string rule)
      : Error(field + " is " + value + "; " + rule),
        field_(std::move(field)),
        value_(std::move(value)),
        rule_(std::move(rule)) {}
  const std::string& field() const { return field_; }
  const std::string& value() const { return value_; }  // as written in the message
  const std::string& rule() const { return rule_; }

 private:
  std::string field_;
  std::string value_;
  std::string rule_;
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

// Bad input in one field: throws spillway::InputError "<field> is <value>; <rule>", the
// value formatted with "{}" and the rule from the remaining format arguments, e.g.
//   SPILLWAY_FIELD_ERROR("cp", s.cp, "must divide seq_len ({})", s.seq_len);
#define SPILLWAY_FIELD_ERROR(field, value, ...) \
  throw ::spillway::InputError(field, ::fmt::format("{}", value), ::fmt::format(__VA_ARGS__))
