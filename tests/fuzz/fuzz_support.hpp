// What the fuzzers (tests/fuzz/) share: reporting a finding, and the rule that a
// spillway::Error is an accepted outcome unless it comes from an internal check.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

#include "spillway/core/error.hpp"

namespace fuzz_support {

// Prints "<fuzzer>: <what>: <detail>" and aborts (libFuzzer records the input).
[[noreturn]] inline void finding(const char* fuzzer, const char* what, const std::string& detail) {
  std::fprintf(stderr, "%s: %s: %s\n", fuzzer, what, detail.c_str());
  std::abort();
}

// A spillway::Error is accepted unless it comes from an internal check (SPILLWAY_CHECK:
// "... (check failed: <expr> at <source file>:<line>)"): bad input must be rejected by
// validation, with a message naming the field. Error messages quote the input, so the
// check looks for the library's own source path, which the input cannot contain by chance.
inline void accept_error(const char* fuzzer, const spillway::Error& e) {
  const std::string msg = e.what();
  if (msg.empty()) finding(fuzzer, "empty error message", msg);
  const size_t at = msg.rfind("(check failed: ");
  if (at != std::string::npos &&
      msg.find(" at " SPILLWAY_SOURCE_DIR "/src/", at) != std::string::npos) {
    finding(fuzzer, "internal check on input", msg);
  }
}

}  // namespace fuzz_support
