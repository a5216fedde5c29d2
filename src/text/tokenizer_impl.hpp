// The tokenizer's components (Note [Tokenizer pipeline] in tokenizer.cpp), made from their
// objects of a tokenizer.json by tokenizer_components.cpp for the Tokenizer (tokenizer.cpp)
// to run: the normalizer, the pre-tokenizer and the decoder.
#pragma once

#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

namespace spillway::text::detail {

using json = nlohmann::json;

// Refuses the file `source`: at `where` (a path in it), `what`.
[[noreturn]] void refuse(const std::string& source, const std::string& where,
                         const std::string& what);
// A component object's "type".
std::string type_of(const json& j, const std::string& source, const std::string& where);

// ---- normalizers ---------------------------------------------------------------------

struct Normalizer {
  virtual ~Normalizer() = default;
  virtual std::string apply(std::string s) const = 0;
};

std::unique_ptr<Normalizer> make_normalizer(const json& j, const std::string& source,
                                            const std::string& where);

// ---- pre-tokenizers ------------------------------------------------------------------

struct Piece {
  std::string text;
  bool at_start = false;  // begins at offset 0 of the original text
};

struct PreTokenizer {
  virtual ~PreTokenizer() = default;
  virtual void apply(std::vector<Piece>& pieces) const = 0;
};

std::unique_ptr<PreTokenizer> make_pre_tokenizer(const json& j, const std::string& source,
                                                 const std::string& where);

// ---- decoders ------------------------------------------------------------------------

struct Decoder {
  virtual ~Decoder() = default;
  virtual void apply(std::vector<std::string>& tokens) const = 0;
};

std::unique_ptr<Decoder> make_decoder(const json& j, const std::string& source,
                                      const std::string& where);

// <0xXX> tokens as bytes: a run of them that is well-formed UTF-8 is its text, else one
// U+FFFD per byte (the package's ByteFallback).
struct ByteFallbackDec : Decoder {
  static int byte_of(const std::string& t);
  void apply(std::vector<std::string>& tokens) const override;
};

}  // namespace spillway::text::detail
