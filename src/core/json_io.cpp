// JSON loading with field-by-field validation (see json_io.hpp for the message format).
#include "core/json_io.hpp"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <unordered_map>
#include <vector>

#include "core/json_keys.hpp"
#include "spillway/core/error.hpp"

namespace spillway {

namespace {

std::string file_suffix(std::string_view file) {
  return file.empty() ? std::string() : fmt::format(" (file: {})", file);
}

// Converts a byte offset in `text` to 1-based line and column.
std::pair<size_t, size_t> line_col(std::string_view text, size_t offset) {
  size_t line = 1;
  size_t col = 1;
  for (size_t i = 0; i < offset && i < text.size(); ++i) {
    if (text[i] == '\n') {
      ++line;
      col = 1;
    } else {
      ++col;
    }
  }
  return {line, col};
}

// Note [Duplicate keys]: JSON leaves a repeated key undefined; nlohmann keeps the last,
// Python's json the last, other readers the first. A config with `"hidden_size": 4096,
// "hidden_size": 8192` would plan whichever this reader picks, so every document is
// refused with both lines. The scan runs on text the parser has accepted (strings are
// well-formed, brackets balance).
struct Scope {
  bool object = false;
  bool expect_key = false;
  size_t index = 0;  // arrays: the element being read
  std::string path;  // "text_config." for a member object, "layers[2]." for an element
  std::string key;   // objects: the member being read
  std::unordered_map<std::string, size_t> lines;  // objects: key -> line
};

std::string scope_prefix(const std::vector<Scope>& stack) {
  if (stack.empty()) return {};
  const Scope& s = stack.back();
  return s.object ? s.path + s.key + "."
                  : fmt::format("{}[{}].",
                                s.path.empty() ? "" : s.path.substr(0, s.path.size() - 1), s.index);
}

}  // namespace

void refuse_duplicate_keys(std::string_view text, std::string_view what, std::string_view file) {
  std::vector<Scope> stack;
  size_t line = 1;
  for (size_t i = 0; i < text.size(); ++i) {
    const char ch = text[i];
    if (ch == '\n') {
      ++line;
    } else if (ch == '{' || ch == '[') {
      Scope s;
      s.object = ch == '{';
      s.expect_key = s.object;
      s.path = scope_prefix(stack);
      stack.push_back(std::move(s));
    } else if (ch == '}' || ch == ']') {
      if (!stack.empty()) stack.pop_back();
    } else if (ch == ',' && !stack.empty()) {
      if (stack.back().object) {
        stack.back().expect_key = true;
      } else {
        ++stack.back().index;
      }
    } else if (ch == '"') {
      const size_t start = i + 1;
      bool escaped = false;
      for (++i; i < text.size() && text[i] != '"'; ++i) {
        if (text[i] == '\\') {
          escaped = true;
          ++i;
        }
      }
      if (stack.empty() || !stack.back().object || !stack.back().expect_key) continue;
      Scope& s = stack.back();
      s.expect_key = false;
      std::string key(text.substr(start, i - start));
      if (escaped) key = Json::parse("\"" + key + "\"").get<std::string>();
      const auto [it, fresh] = s.lines.emplace(key, line);
      if (!fresh) {
        SPILLWAY_INPUT_ERROR(
            "{}: duplicate key \"{}{}\" at line {} and line {}: JSON readers disagree on which "
            "one counts, so neither is used{}",
            what, s.path, key, it->second, line, file_suffix(file));
      }
      s.key = std::move(key);
    }
  }
}

Json parse_json_text(std::string_view text, std::string_view what, std::string_view file) {
  try {
    Json j = Json::parse(text.begin(), text.end());
    refuse_duplicate_keys(text, what, file);
    return j;
  } catch (const Json::parse_error& e) {
    const size_t at = e.byte > 0 ? e.byte - 1 : 0;
    auto [line, col] = line_col(text, at);
    std::string detail = e.what();
    // nlohmann's text is "[json.exception.parse_error.101] parse error at line L, column C:
    // <reason>"; the reason may itself hold ": " (it quotes the input), so cut at the first
    // ": " after the position.
    if (auto at_pos = detail.find("parse error"); at_pos != std::string::npos) {
      if (auto pos = detail.find(": ", at_pos); pos != std::string::npos)
        detail = detail.substr(pos + 2);
    }
    SPILLWAY_INPUT_ERROR("{}: malformed JSON at line {}, column {}: {}{}", what, line, col, detail,
                         file_suffix(file));
  } catch (const Json::exception& e) {
    // Valid syntax the parser still refuses, e.g. a number beyond double range
    // ("number overflow parsing '1e400'"): locate the quoted token in the text.
    const std::string detail = e.what();
    std::string where;
    const size_t q1 = detail.find('\'');
    const size_t q2 = q1 == std::string::npos ? q1 : detail.find('\'', q1 + 1);
    if (q2 != std::string::npos) {
      const size_t at = text.find(detail.substr(q1 + 1, q2 - q1 - 1));
      if (at != std::string_view::npos) {
        auto [line, col] = line_col(text, at);
        where = fmt::format(" at line {}, column {}", line, col);
      }
    }
    const size_t cut = detail.find("] ");
    SPILLWAY_INPUT_ERROR("{}: malformed JSON{}: {}{}", what, where,
                         cut == std::string::npos ? detail : detail.substr(cut + 2),
                         file_suffix(file));
  }
}

Json load_json_file(const std::string& path, std::string_view what) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    SPILLWAY_INPUT_ERROR("{}: '{}' is a directory, not a JSON file", what, path);
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    SPILLWAY_INPUT_ERROR("{}: cannot open file '{}': {}", what, path, std::strerror(errno));
  }
  std::ostringstream buf;
  buf << in.rdbuf();
  if (in.bad()) SPILLWAY_INPUT_ERROR("{}: cannot read file '{}'", what, path);
  return parse_json_text(buf.str(), what, path);
}

std::string json_value_text(const Json& v) {
  std::string s = v.dump();
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

JsonObject::JsonObject(const Json& json, std::string what, std::string file, std::string path)
    : json_(json), what_(std::move(what)), file_(std::move(file)), path_(std::move(path)) {
  if (!json_.is_object()) {
    if (path_.empty()) {
      SPILLWAY_INPUT_ERROR("{}: the document must be a JSON object, not {}{}", what_,
                           json_value_text(json_), file_suffix(file_));
    }
    SPILLWAY_INPUT_ERROR("{}: \"{}\" must be a JSON object, not {}{}", what_,
                         path_.substr(0, path_.size() - 1), json_value_text(json_),
                         file_suffix(file_));
  }
}

void JsonObject::fail(std::string_view key, std::string_view problem) const {
  SPILLWAY_INPUT_ERROR("{}: \"{}{}\" {}{}", what_, path_, key, problem, file_suffix(file_));
}

bool JsonObject::has(std::string_view key) const {
  note_read(key);
  auto it = json_.find(key);
  return it != json_.end() && !it->is_null();
}

const Json& JsonObject::at(std::string_view key) const {
  note_read(key);
  auto it = json_.find(key);
  if (it == json_.end() || it->is_null()) fail(key, "is missing; it is required");
  return *it;
}

int64_t JsonObject::to_int(std::string_view key, const Json& v, int64_t min, int64_t max) const {
  int64_t n = 0;
  if (v.is_number_integer()) {
    if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
      fail(key, fmt::format("is {}; it does not fit 64 bits (must be <= {})", v.dump(), max));
    }
    n = v.get<int64_t>();
  } else if (v.is_number_float()) {
    const double d = v.get<double>();
    if (!std::isfinite(d) || d != std::floor(d) || d > 9.2e18 || d < -9.2e18) {
      fail(key, fmt::format("is {}; must be an integer", v.dump()));
    }
    n = static_cast<int64_t>(d);
  } else {
    fail(key, fmt::format("is {}; must be an integer", json_value_text(v)));
  }
  if (n < min) fail(key, fmt::format("is {}; must be >= {}", n, min));
  if (n > max) fail(key, fmt::format("is {}; must be <= {}", n, max));
  return n;
}

double JsonObject::to_num(std::string_view key, const Json& v, double min, double max) const {
  if (!v.is_number()) fail(key, fmt::format("is {}; must be a number", json_value_text(v)));
  const double d = v.get<double>();
  if (!std::isfinite(d)) fail(key, fmt::format("is {}; must be finite", v.dump()));
  if (d < min) fail(key, fmt::format("is {}; must be >= {}", v.dump(), min));
  if (d > max) fail(key, fmt::format("is {}; must be <= {}", v.dump(), max));
  return d;
}

int64_t JsonObject::req_int(std::string_view key, int64_t min, int64_t max) const {
  return to_int(key, at(key), min, max);
}

int64_t JsonObject::int_or(std::string_view key, int64_t fallback, int64_t min, int64_t max) const {
  return has(key) ? req_int(key, min, max) : fallback;
}

std::optional<int64_t> JsonObject::opt_int(std::string_view key, int64_t min, int64_t max) const {
  if (!has(key)) return std::nullopt;
  return req_int(key, min, max);
}

double JsonObject::req_num(std::string_view key, double min, double max) const {
  return to_num(key, at(key), min, max);
}

double JsonObject::num_or(std::string_view key, double fallback, double min, double max) const {
  return has(key) ? req_num(key, min, max) : fallback;
}

std::string JsonObject::req_str(std::string_view key) const {
  const Json& v = at(key);
  if (!v.is_string()) fail(key, fmt::format("is {}; must be a string", json_value_text(v)));
  return v.get<std::string>();
}

std::string JsonObject::str_or(std::string_view key, std::string fallback) const {
  return has(key) ? req_str(key) : std::move(fallback);
}

bool JsonObject::bool_or(std::string_view key, bool fallback) const {
  if (!has(key)) return fallback;
  const Json& v = at(key);
  if (!v.is_boolean()) fail(key, fmt::format("is {}; must be true or false", json_value_text(v)));
  return v.get<bool>();
}

JsonObject JsonObject::req_obj(std::string_view key) const {
  const Json& v = at(key);
  if (!v.is_object()) fail(key, fmt::format("is {}; must be a JSON object", json_value_text(v)));
  return JsonObject(v, what_, file_, fmt::format("{}{}.", path_, key));
}

std::vector<JsonObject> JsonObject::obj_array(std::string_view key) const {
  std::vector<JsonObject> out;
  if (!has(key)) return out;
  const Json& v = at(key);
  if (!v.is_array()) fail(key, fmt::format("is {}; must be an array", json_value_text(v)));
  out.reserve(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    const std::string item = fmt::format("{}[{}]", key, i);
    if (!v[i].is_object())
      fail(item, fmt::format("is {}; must be a JSON object", json_value_text(v[i])));
    out.emplace_back(v[i], what_, file_, fmt::format("{}{}.", path_, item));
  }
  return out;
}

std::vector<int64_t> JsonObject::int_array_or(std::string_view key, int64_t min,
                                              int64_t max) const {
  std::vector<int64_t> out;
  if (!has(key)) return out;
  const Json& v = at(key);
  if (!v.is_array())
    fail(key, fmt::format("is {}; must be an array of integers", json_value_text(v)));
  for (size_t i = 0; i < v.size(); ++i) {
    out.push_back(to_int(fmt::format("{}[{}]", key, i), v[i], min, max));
  }
  return out;
}

std::vector<std::string> JsonObject::str_array_or(std::string_view key) const {
  std::vector<std::string> out;
  if (!has(key)) return out;
  const Json& v = at(key);
  if (!v.is_array())
    fail(key, fmt::format("is {}; must be an array of strings", json_value_text(v)));
  for (size_t i = 0; i < v.size(); ++i) {
    if (!v[i].is_string()) {
      fail(fmt::format("{}[{}]", key, i),
           fmt::format("is {}; must be a string", json_value_text(v[i])));
    }
    out.push_back(v[i].get<std::string>());
  }
  return out;
}

}  // namespace spillway
