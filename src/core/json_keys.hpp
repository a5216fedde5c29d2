// Duplicate keys in a JSON text (Note [Duplicate keys] in json_io.cpp).
#pragma once

#include <string_view>

namespace spillway {

// Refuses a JSON text (one the parser accepted) in which an object repeats a key, naming
// the key, its path and both lines. parse_json_text and load_json_file call it; a reader
// that parses JSON by other means calls it on the same text.
void refuse_duplicate_keys(std::string_view text, std::string_view what, std::string_view file);

}  // namespace spillway
