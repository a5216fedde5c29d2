// The catalogs of data/ (models, hardware) compiled into the binary by
// cmake/embed_data.cmake, so `spillway` finds them from any working directory.
#pragma once

#include <string_view>
#include <vector>

namespace spillway {

struct EmbeddedFile {
  const char* kind;  // "models", "hardware" or "nn" (the reference model's configs)
  const char* name;  // file name, e.g. "qwen3-30b-a3b.json"
  const char* text;  // the file's bytes
};

// Every embedded file, sorted by kind then name.
const std::vector<EmbeddedFile>& embedded_files();
// The file of that kind and name, or nullptr.
const EmbeddedFile* find_embedded(std::string_view kind, std::string_view name);

}  // namespace spillway
