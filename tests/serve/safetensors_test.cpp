// The safetensors reader (Note [Safetensors checks]): files written by write_safetensors read
// back bit for bit; a file produced by the format's own library (a fixed byte string here:
// header, padding and data as safetensors' Python package writes them) reads; every kind of
// bad file is refused with an error that names the tensor and the offset.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <string>

#include "spillway/core/error.hpp"
#include "spillway/serve/serve.hpp"
#include "test_support.hpp"

namespace spillway {
namespace {

using spillway::testing::TempDir;

std::vector<std::byte> floats(std::initializer_list<float> v) {
  std::vector<std::byte> b(v.size() * 4);
  std::memcpy(b.data(), v.begin(), b.size());
  return b;
}

// A file from a header text and data bytes, as the format lays them out.
void raw_file(const std::string& path, const std::string& header, const std::string& data,
              uint64_t declared = UINT64_MAX) {
  std::ofstream out(path, std::ios::binary);
  const uint64_t n = declared == UINT64_MAX ? header.size() : declared;
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>((n >> (8 * i)) & 0xff));
  out << header << data;
}

std::string error_of(const std::string& path) {
  try {
    SafetensorsFile f(path);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Safetensors, WrittenTensorsReadBackBitForBit) {
  TempDir dir;
  const std::string path = dir.file("m.safetensors");
  std::vector<std::byte> bf(6);
  for (size_t i = 0; i < bf.size(); ++i) bf[i] = static_cast<std::byte>(i * 37 + 1);
  write_safetensors(path, {{"a.weight", DType::kFp32, {2, 2}, floats({1, 2, 3, 4})},
                           {"b.bias", DType::kBf16, {3}, bf},
                           {"empty", DType::kFp32, {0, 4}, {}}});
  SafetensorsFile f(path);
  ASSERT_EQ(f.tensors().size(), 3u);
  const SafetensorsTensor* a = f.find("a.weight");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->dtype, DType::kFp32);
  EXPECT_EQ(a->shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(std::memcmp(f.data(*a), floats({1, 2, 3, 4}).data(), 16), 0);
  const SafetensorsTensor* b = f.find("b.bias");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->dtype, DType::kBf16);
  EXPECT_EQ(std::memcmp(f.data(*b), bf.data(), 6), 0);
  EXPECT_EQ(f.data_bytes(), 22);
  EXPECT_EQ(f.find("none"), nullptr);
}

TEST(Safetensors, AFileInTheFormatsOwnLayoutReads) {
  // What safetensors' save_file writes for {"x": tensor([[1., 2.]], dtype=float32)}: the
  // header padded with spaces to a multiple of 8, then the data; __metadata__ is skipped.
  TempDir dir;
  const std::string path = dir.file("x.safetensors");
  const std::string header =
      R"({"__metadata__":{"format":"pt"},"x":{"dtype":"F32","shape":[1,2],"data_offsets":[0,8]}})";
  std::string padded = header + std::string((8 - header.size() % 8) % 8, ' ');
  const std::vector<std::byte> d = floats({1.0f, 2.0f});
  raw_file(path, padded, std::string(reinterpret_cast<const char*>(d.data()), d.size()));
  SafetensorsFile f(path);
  ASSERT_EQ(f.tensors().size(), 1u);
  float v[2];
  std::memcpy(v, f.data(f.tensors()[0]), 8);
  EXPECT_EQ(v[0], 1.0f);
  EXPECT_EQ(v[1], 2.0f);
}

TEST(Safetensors, BadFilesAreRefusedNamingTheTensorAndTheOffset) {
  TempDir dir;
  const std::string p = dir.file("bad.safetensors");
  const std::string eight(8, 'x');
  struct Case {
    const char* what;
    std::string header, data;
    uint64_t declared;
    std::vector<std::string> said;
  };
  const std::vector<Case> cases = {
      {"truncated data",
       R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})",
       eight,
       UINT64_MAX,
       {"'w'", "ends at offset 16", "8 bytes", "truncated"}},
      {"overlap",
       R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
       std::string(12, 'x'),
       UINT64_MAX,
       {"'a' [0, 8)", "'b' [4, 12)", "overlap at offset 4"}},
      {"shape mismatch",
       R"({"w":{"dtype":"BF16","shape":[3],"data_offsets":[0,8]}})",
       eight,
       UINT64_MAX,
       {"'w' at offset 0", "shape [3] of BF16 is 6 bytes", "span 8"}},
      {"dtype",
       R"({"w":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}})",
       eight,
       UINT64_MAX,
       {"'w'", "'I64'", "BF16 and F32"}},
      {"header too large", "{}", "", uint64_t{200} << 20, {"header too large", "209715200"}},
      {"header past the end", "{}", "", 64, {"the header is 64 bytes", "truncated"}},
      {"not JSON", "{not json", "", UINT64_MAX, {"not a JSON object", "at offset 8"}},
      {"duplicate tensor",
       R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
       eight,
       UINT64_MAX,
       {"the header: duplicate key \"w\""}},
      {"end before begin",
       R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})",
       eight,
       UINT64_MAX,
       {"'w'", "[8, 0)", "before the begin"}},
      {"negative dim",
       R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,0]}})",
       "",
       UINT64_MAX,
       {"'w'", "-1", ">= 0"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    raw_file(p, c.header, c.data, c.declared);
    const std::string msg = error_of(p);
    ASSERT_FALSE(msg.empty()) << "accepted";
    EXPECT_NE(msg.find(p), std::string::npos) << msg;
    for (const std::string& s : c.said) EXPECT_NE(msg.find(s), std::string::npos) << msg;
  }
  std::ofstream(p, std::ios::trunc) << "abc";
  EXPECT_NE(error_of(p).find("8-byte header length"), std::string::npos);
  EXPECT_NE(error_of(dir.file("absent")).find("cannot open"), std::string::npos);
}

TEST(Safetensors, WritingRefusesBytesThatDoNotMatchTheShape) {
  TempDir dir;
  EXPECT_THROW(write_safetensors(dir.file("w"), {{"w", DType::kFp32, {3}, floats({1, 2})}}),
               InputError);
  EXPECT_THROW(write_safetensors(dir.file("w"), {{"w", DType::kFp16, {1}, floats({1})}}),
               InputError);
}

}  // namespace
}  // namespace spillway
