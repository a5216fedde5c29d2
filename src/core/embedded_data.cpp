// Lookup over the generated table of embedded catalog files.
#include "core/embedded_data.hpp"

namespace spillway {

const EmbeddedFile* find_embedded(std::string_view kind, std::string_view name) {
  for (const EmbeddedFile& f : embedded_files()) {
    if (kind == f.kind && name == f.name) return &f;
  }
  return nullptr;
}

}  // namespace spillway
