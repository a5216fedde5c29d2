// Checking an output path before the work that fills it (tool/output.hpp writes it).
#pragma once

#include <string>

namespace spillway::tool {

// Throws as write_output would when `path` cannot become a file: a directory, a missing
// parent directory. "-" (stdout) and "" (no output) pass. Called before a command runs, so
// that `--json DIR` fails before the report, not after it.
void check_output_path(const std::string& path);

}  // namespace spillway::tool
