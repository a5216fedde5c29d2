// JSON loading with field-by-field validation.
//
// Every reader error names the document ("model config"), the field, the offending value
// and the rule, then the file: `model config: "num_experts_per_tok" is 0; must be >= 1
// (file: qwen3.json)`. Numbers must be finite and within the stated range; integers must
// be integral and fit 64 bits. Nothing here ever crashes on hostile input: every path
// ends in a value or a spillway::Error.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace spillway {

using Json = nlohmann::json;

// Parses `text`; malformed JSON becomes Error("<what>: malformed JSON at line L, column C:
// ... (file: F)").
Json parse_json_text(std::string_view text, std::string_view what, std::string_view file);
// Reads and parses a file; a missing/unreadable file is Error naming the path.
Json load_json_file(const std::string& path, std::string_view what);

// A validated view of one JSON object.
class JsonObject {
 public:
  // `what` names the document in messages ("model config"); `file` where it came from;
  // `path` the object's position inside it ("" for the root, "host_link." for a member).
  JsonObject(const Json& json, std::string what, std::string file, std::string path = "");

  bool has(std::string_view key) const;
  const Json& raw() const { return json_; }
  // Records every key looked at (has, and each getter) into `reads`, for a loader that
  // must refuse the keys it did not read. Objects made from this one do not inherit it.
  void track_reads(std::shared_ptr<std::set<std::string, std::less<>>> reads) {
    reads_ = std::move(reads);
  }
  const std::string& file() const { return file_; }

  int64_t req_int(std::string_view key, int64_t min, int64_t max) const;
  int64_t int_or(std::string_view key, int64_t fallback, int64_t min, int64_t max) const;
  std::optional<int64_t> opt_int(std::string_view key, int64_t min, int64_t max) const;
  double req_num(std::string_view key, double min, double max) const;
  double num_or(std::string_view key, double fallback, double min, double max) const;
  std::string req_str(std::string_view key) const;
  std::string str_or(std::string_view key, std::string fallback) const;
  bool bool_or(std::string_view key, bool fallback) const;
  JsonObject req_obj(std::string_view key) const;
  // An array of objects (may be empty); each element is validated as an object.
  std::vector<JsonObject> obj_array(std::string_view key) const;
  std::vector<int64_t> int_array_or(std::string_view key, int64_t min, int64_t max) const;
  std::vector<std::string> str_array_or(std::string_view key) const;

  // Error naming this document and field: `<what>: "<path><key>" <problem> (file: F)`.
  [[noreturn]] void fail(std::string_view key, std::string_view problem) const;

 private:
  const Json& at(std::string_view key) const;
  int64_t to_int(std::string_view key, const Json& v, int64_t min, int64_t max) const;
  double to_num(std::string_view key, const Json& v, double min, double max) const;

  void note_read(std::string_view key) const {
    if (reads_) reads_->emplace(key);
  }

  const Json& json_;
  std::shared_ptr<std::set<std::string, std::less<>>> reads_;
  std::string what_;
  std::string file_;
  std::string path_;
};

// Short JSON rendering of a value for messages (strings quoted, long values cut).
std::string json_value_text(const Json& v);

}  // namespace spillway
