// The tokenizer (spillway/text/tokenizer.hpp) on three tiny tokenizer.json files written by the
// `tokenizers` package 0.23.3 (tests/text/data/, README there): a byte-level BPE with a
// special token and a BOS template; a SentencePiece-style BPE with byte fallback in Llama
// 2's legacy form (Prepend and Replace normalizers) and in the Metaspace form. The expected
// ids and texts are the package's own for the same inputs (python/tests/test_tokenizer.py
// compares real tokenizers with the package live). Also: lossy UTF-8 as Rust's, streaming
// detokenization, refusals naming the component.
#include "spillway/text/tokenizer.hpp"

#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "spillway/core/error.hpp"
#include "test_support.hpp"
#include "text/unicode.hpp"

namespace spillway::text {
namespace {

std::string data(const std::string& name) {
  return std::string(SPILLWAY_SOURCE_DIR) + "/tests/text/data/" + name;
}

std::vector<int32_t> ids(std::initializer_list<int32_t> l) {
  return l;
}

TEST(Tokenizer, ByteLevelBpeAsThePackage) {
  const Tokenizer t = Tokenizer::from_file(data("tiny_bytelevel.json"));
  EXPECT_EQ(t.encode("hello world"), ids({265, 259, 264}));
  EXPECT_EQ(t.encode("hello world", false), ids({259, 264}));
  // The special token in the text is the special token.
  EXPECT_EQ(t.encode("hello<|end|> world!"), ids({265, 259, 265, 264, 0}));
  EXPECT_EQ(t.encode("héllo wörld 🙂"),
            ids({265, 71, 127, 102, 257, 78, 260, 127, 114, 81, 75, 67, 220, 172, 253, 247, 224}));
  EXPECT_EQ(t.encode(" "), ids({265, 220}));
  EXPECT_EQ(t.encode(""), ids({265}));
  EXPECT_EQ(t.decode(t.encode("héllo wörld 🙂"), true), "héllo wörld 🙂");
  EXPECT_EQ(t.decode(ids({265, 259, 264})), "<|end|>hello world");
  EXPECT_EQ(t.decode(ids({265, 259, 264}), true), "hello world");
  // Parts of 🙂 (F0 9F 99 82): one U+FFFD per maximal ill-formed part, as Rust's lossy (the
  // package's own outputs).
  EXPECT_EQ(t.decode(ids({172, 253, 247})), "\xEF\xBF\xBD");
  EXPECT_EQ(t.decode(ids({253, 247})), "\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(t.vocab_size(), 266);
  EXPECT_EQ(t.token_to_id("<|end|>"), 265);
  EXPECT_TRUE(t.is_special(265));
  EXPECT_EQ(t.id_to_token(264), "\xC4\xA0world");    // Ġworld
  EXPECT_EQ(t.decode(ids({259, 100000})), "hello");  // an id of no token: skipped
}

TEST(Tokenizer, SentencePieceBpeWithByteFallbackAsThePackage) {
  for (const char* file : {"tiny_legacy.json", "tiny_metaspace.json"}) {
    SCOPED_TRACE(file);
    const bool legacy = std::string(file) == "tiny_legacy.json";
    const Tokenizer t = Tokenizer::from_file(data(file));
    EXPECT_EQ(t.encode("hello world"), ids({1, 275, 278, 265, 269}));
    EXPECT_EQ(t.encode("hello</s> world"),
              legacy ? ids({1, 275, 2, 259, 278, 265, 269}) : ids({1, 275, 2, 278, 265, 269}));
    EXPECT_EQ(t.encode("hé 🙂x"), ids({1, 271, 270, 259, 243, 162, 156, 133, 123}));
    EXPECT_EQ(t.encode("  ab"),
              legacy ? ids({1, 259, 259, 259, 260, 261}) : ids({1, 259, 259, 260, 261}));
    EXPECT_EQ(t.encode(""), ids({1}));
    EXPECT_EQ(t.decode(ids({1, 275, 278, 265, 269})), "<s> hello world");
    EXPECT_EQ(t.decode(ids({1, 271, 270, 259, 243, 162, 156, 133, 123})), "<s> hé 🙂x");
    EXPECT_EQ(t.decode(ids({1, 271, 270, 259, 243, 162, 156, 133, 123}), true), "hé 🙂x");
    // Byte tokens that are not whole UTF-8: one U+FFFD per byte (ByteFallback).
    EXPECT_EQ(t.decode(ids({243, 162, 156})), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
    EXPECT_EQ(t.decode(ids({243, 162, 156, 133})), "🙂");
  }
}

// Note [Streaming detokenization]: the pieces concatenate to decode() of all the ids, and
// no piece holds part of a character.
TEST(Tokenizer, StreamedPiecesAreWholeCharactersAndAddUpToTheText) {
  for (const char* file : {"tiny_bytelevel.json", "tiny_legacy.json", "tiny_metaspace.json"}) {
    SCOPED_TRACE(file);
    const Tokenizer t = Tokenizer::from_file(data(file));
    const std::vector<int32_t> all = t.encode("héllo wörld 🙂 hello 🙂🙂 ab", false);
    StreamDecoder s(t);
    std::string joined;
    for (int32_t id : all) {
      const std::string piece = s.push(id);
      EXPECT_TRUE(utf8_valid(piece));
      EXPECT_EQ(piece.find("\xEF\xBF\xBD"), std::string::npos);
      joined += piece;
    }
    joined += s.finish();
    EXPECT_EQ(joined, t.decode(all));
  }
}

TEST(Unicode, LossyDecodingReplacesMaximalIllFormedSubparts) {
  const std::string r = "\xEF\xBF\xBD";
  EXPECT_EQ(utf8_lossy("abc"), "abc");
  EXPECT_EQ(utf8_lossy("a\x80z"), "a" + r + "z");
  EXPECT_EQ(utf8_lossy("\xF0\x9F\x99"), r);           // a cut sequence: one
  EXPECT_EQ(utf8_lossy("\xF0\x9F\x99z"), r + "z");    // a broken one: one
  EXPECT_EQ(utf8_lossy("\xE0\x80"), r + r);           // E0 80: 80 is not a valid second byte
  EXPECT_EQ(utf8_lossy("\xED\xA0\x80"), r + r + r);   // a surrogate: three
  EXPECT_EQ(utf8_lossy("\xC0\xAF"), r + r);           // overlong
  EXPECT_EQ(utf8_complete_prefix("ab\xF0\x9F"), 2u);  // waits for the rest
  EXPECT_EQ(utf8_complete_prefix("ab\xF0z"), 4u);     // broken: complete (it is U+FFFD)
  EXPECT_EQ(normalize("e\xCC\x81", NormalForm::kNfc), "\xC3\xA9");
}

TEST(Tokenizer, WhatItDoesNotImplementIsRefusedNamingIt) {
  std::ifstream in(data("tiny_bytelevel.json"));
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  const auto with = [&](const std::string& from, const std::string& to) {
    std::string s = text;
    const size_t at = s.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return s.replace(at, from.size(), to);
  };
  testing::expect_error(
      [&] {
        (void)Tokenizer::from_json(with("\"type\":\"BPE\"", "\"type\":\"Unigram\""), "x.json");
      },
      {"model type \"Unigram\" is not supported", "x.json"});
  testing::expect_error(
      [&] {
        (void)Tokenizer::from_json(with("\"pre_tokenizer\":{\"type\":\"ByteLevel\"",
                                        "\"pre_tokenizer\":{\"type\":\"BertPreTokenizer\""),
                                   "x.json");
      },
      {"pre_tokenizer", "\"BertPreTokenizer\" is not supported"});
  testing::expect_error([&] { (void)Tokenizer::from_json("{", "x.json"); }, {"not valid JSON"});
  // A repeated key (here the model's type) is refused naming it: Note [Duplicate keys].
  testing::expect_error(
      [&] {
        (void)Tokenizer::from_json(with("\"type\":\"BPE\"", "\"type\":\"BPE\",\"type\":\"BPE\""),
                                   "x.json");
      },
      {"tokenizer: duplicate key \"model.type\"", "(file: x.json)"});
  const Tokenizer t = Tokenizer::from_json(text, "x.json");
  testing::expect_error([&] { (void)t.encode("ab\xFF"); }, {"not valid UTF-8", "byte 2"});
}

}  // namespace
}  // namespace spillway::text
