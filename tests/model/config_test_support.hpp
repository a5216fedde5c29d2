// Helpers of the config-reading tests: an embedded catalog config, and the error a config
// is refused with.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "core/embedded_data.hpp"
#include "core/json_io.hpp"
#include "spillway/catalog/model.hpp"
#include "spillway/core/error.hpp"

namespace spillway::testing {

inline Json embedded(const char* file) {
  const EmbeddedFile* f = find_embedded("models", file);
  EXPECT_NE(f, nullptr) << file;
  return Json::parse(f->text);
}

// What parse_model_config refuses `j` with, or "(no error)".
inline std::string config_error(const Json& j) {
  try {
    (void)parse_model_config(j, "m", "m.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace spillway::testing
