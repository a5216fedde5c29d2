// The safetensors reader and writer (spillway/serve/serve.hpp, Note [Safetensors checks]): the
// file is memory-mapped read-only; the header is parsed and every tensor checked before the
// object exists, so a caller never sees a half-checked file.
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "core/json_keys.hpp"
#include "spillway/core/error.hpp"
#include "spillway/serve/serve.hpp"

namespace spillway {
namespace {

DType dtype_of(const std::string& file, const std::string& tensor, const std::string& s) {
  if (s == "BF16") return DType::kBf16;
  if (s == "F32") return DType::kFp32;
  SPILLWAY_INPUT_ERROR("{}: tensor '{}' has dtype '{}'; spillway serves BF16 and F32", file, tensor,
                       s);
}

const char* dtype_name(DType t) {
  return t == DType::kBf16 ? "BF16" : "F32";
}

uint64_t read_le64(const std::byte* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint64_t>(p[i]);
  return v;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// One header entry, checked against the data region's size.
SafetensorsTensor parse_entry(const std::string& file, const std::string& name,
                              const nlohmann::json& e, int64_t data_bytes) {
  if (!e.is_object())
    SPILLWAY_INPUT_ERROR("{}: tensor '{}' is not a JSON object in the header", file, name);
  SafetensorsTensor t;
  t.name = name;
  if (!e.contains("dtype") || !e["dtype"].is_string())
    SPILLWAY_INPUT_ERROR("{}: tensor '{}' has no \"dtype\" string", file, name);
  t.dtype = dtype_of(file, name, e["dtype"].get<std::string>());
  if (!e.contains("shape") || !e["shape"].is_array())
    SPILLWAY_INPUT_ERROR("{}: tensor '{}' has no \"shape\" array", file, name);
  int64_t elements = 1;
  for (const nlohmann::json& d : e["shape"]) {
    if (!d.is_number_integer() || d.get<int64_t>() < 0)
      SPILLWAY_INPUT_ERROR("{}: tensor '{}' has a shape entry {}; must be an integer >= 0", file,
                           name, d.dump());
    const int64_t n = d.get<int64_t>();
    if (n > 0 && elements > std::numeric_limits<int64_t>::max() / 4 / n)
      SPILLWAY_INPUT_ERROR("{}: tensor '{}' has a shape too large to address", file, name);
    t.shape.push_back(n);
    elements *= n;
  }
  const nlohmann::json& off = e.contains("data_offsets") ? e["data_offsets"] : nlohmann::json();
  if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() ||
      !off[1].is_number_unsigned())
    SPILLWAY_INPUT_ERROR("{}: tensor '{}' has data_offsets {}; must be [begin, end]", file, name,
                         off.dump());
  const uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
  if (end < begin)
    SPILLWAY_INPUT_ERROR("{}: tensor '{}' has data_offsets [{}, {}): the end is before the begin",
                         file, name, begin, end);
  if (end > static_cast<uint64_t>(data_bytes))
    SPILLWAY_INPUT_ERROR(
        "{}: tensor '{}' ends at offset {} but the data region holds {} bytes (the file is "
        "truncated)",
        file, name, end, data_bytes);
  t.offset = static_cast<int64_t>(begin);
  t.bytes = static_cast<int64_t>(end - begin);
  const int64_t want = elements * dtype_bytes(t.dtype);
  if (want != t.bytes)
    SPILLWAY_INPUT_ERROR(
        "{}: tensor '{}' at offset {}: shape {} of {} is {} bytes, but its data_offsets span {}",
        file, name, t.offset, shape_text(t.shape), dtype_name(t.dtype), want, t.bytes);
  return t;
}

FileStamp stamp_from(const struct stat& st) {
  return {static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino),
          static_cast<int64_t>(st.st_size),
          static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec};
}

// Reads exactly `bytes` at `offset` of fd into dst; false when the file ends first.
bool read_at(int fd, int64_t offset, void* dst, int64_t bytes) {
  auto* out = static_cast<char*>(dst);
  while (bytes > 0) {
    const ssize_t n = ::pread(fd, out, static_cast<size_t>(bytes), static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    out += n;
    offset += n;
    bytes -= n;
  }
  return true;
}

}  // namespace

FileStamp file_stamp(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? stamp_from(st) : FileStamp{};
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  // O_NONBLOCK: a FIFO at the path must not block the open (it is refused below).
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd_ < 0) SPILLWAY_INPUT_ERROR("{}: cannot open: {}", path, std::strerror(errno));
  auto fail_closed = [&] {
    ::close(fd_);
    fd_ = -1;
  };
  struct stat st {};
  if (::fstat(fd_, &st) != 0) {
    const int err = errno;
    fail_closed();
    SPILLWAY_INPUT_ERROR("{}: cannot stat: {}", path, std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    fail_closed();
    SPILLWAY_INPUT_ERROR("{}: is {}, not a safetensors file", path,
                         S_ISDIR(st.st_mode) ? "a directory" : "not a regular file");
  }
  stamp_ = stamp_from(st);
  file_bytes_ = static_cast<int64_t>(st.st_size);
  if (file_bytes_ < 8) {
    fail_closed();
    SPILLWAY_INPUT_ERROR("{}: {} bytes; a safetensors file starts with an 8-byte header length",
                         path, file_bytes_);
  }
  map_ = ::mmap(nullptr, static_cast<size_t>(file_bytes_), PROT_READ, MAP_PRIVATE, fd_, 0);
  const int map_err = errno;
  if (map_ == MAP_FAILED) {  // NOLINT(performance-no-int-to-ptr): the POSIX constant
    map_ = nullptr;
    fail_closed();
    SPILLWAY_INPUT_ERROR("{}: cannot map: {}", path, std::strerror(map_err));
  }
  try {
    std::byte len[8];
    if (!read_at(fd_, 0, len, 8))
      SPILLWAY_INPUT_ERROR("{}: cannot read the header length (truncated)", path);
    const uint64_t n = read_le64(len);
    if (n > static_cast<uint64_t>(kSafetensorsMaxHeaderBytes))
      SPILLWAY_INPUT_ERROR("{}: the header is {} bytes; the limit is {} (header too large)", path,
                           n, kSafetensorsMaxHeaderBytes);
    if (n > static_cast<uint64_t>(file_bytes_ - 8))
      SPILLWAY_INPUT_ERROR(
          "{}: the header is {} bytes but the file has {} after the length (truncated)", path, n,
          file_bytes_ - 8);
    data_start_ = 8 + static_cast<int64_t>(n);
    std::string text(static_cast<size_t>(n), '\0');
    if (!read_at(fd_, 8, text.data(), static_cast<int64_t>(n)))
      SPILLWAY_INPUT_ERROR("{}: cannot read the {}-byte header at offset 8 (truncated)", path, n);
    nlohmann::json h = nlohmann::json::parse(text, nullptr, false);
    if (h.is_discarded() || !h.is_object())
      SPILLWAY_INPUT_ERROR("{}: the {}-byte header at offset 8 is not a JSON object", path, n);
    refuse_duplicate_keys(text, fmt::format("{}: the header", path), "");
    const int64_t data = file_bytes_ - data_start_;
    for (auto it = h.begin(); it != h.end(); ++it) {
      if (it.key() == "__metadata__") continue;
      tensors_.push_back(parse_entry(path, it.key(), it.value(), data));
    }
    std::sort(tensors_.begin(), tensors_.end(),
              [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
                return a.offset != b.offset ? a.offset < b.offset : a.bytes < b.bytes;
              });
    for (size_t i = 1; i < tensors_.size(); ++i) {
      const SafetensorsTensor& a = tensors_[i - 1];
      const SafetensorsTensor& b = tensors_[i];
      if (b.offset < a.offset + a.bytes && b.bytes > 0 && a.bytes > 0)
        SPILLWAY_INPUT_ERROR("{}: tensors '{}' [{}, {}) and '{}' [{}, {}) overlap at offset {}",
                             path, a.name, a.offset, a.offset + a.bytes, b.name, b.offset,
                             b.offset + b.bytes, b.offset);
    }
  } catch (...) {
    ::munmap(map_, static_cast<size_t>(file_bytes_));
    map_ = nullptr;
    fail_closed();
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) ::munmap(map_, static_cast<size_t>(file_bytes_));
  if (fd_ >= 0) ::close(fd_);
}

void SafetensorsFile::read(const SafetensorsTensor& t, std::byte* dst) const {
  if (!read_at(fd_, data_start_ + t.offset, dst, t.bytes))
    SPILLWAY_INPUT_ERROR(
        "{}: tensor '{}' at offset {} cannot be read whole: the file was truncated after it was "
        "opened ({} bytes then)",
        path_, t.name, data_start_ + t.offset, file_bytes_);
}

int64_t SafetensorsFile::data_bytes() const {
  return file_bytes_ - data_start_;
}

const SafetensorsTensor* SafetensorsFile::find(const std::string& name) const {
  for (const SafetensorsTensor& t : tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

const std::byte* SafetensorsFile::data(const SafetensorsTensor& t) const {
  return static_cast<const std::byte*>(map_) + data_start_ + t.offset;
}

void write_safetensors(const std::string& path, const std::vector<SafetensorsEntry>& tensors) {
  nlohmann::json h = nlohmann::json::object();
  uint64_t at = 0;
  for (const SafetensorsEntry& t : tensors) {
    if (t.dtype != DType::kBf16 && t.dtype != DType::kFp32)
      SPILLWAY_FIELD_ERROR("dtype", to_string(t.dtype), "must be bf16 or fp32 (tensor '{}')",
                           t.name);
    int64_t elements = 1;
    for (int64_t d : t.shape) elements *= d;
    if (static_cast<int64_t>(t.bytes.size()) != elements * dtype_bytes(t.dtype))
      SPILLWAY_FIELD_ERROR("bytes", t.bytes.size(), "must be {} for tensor '{}' of shape {}",
                           elements * dtype_bytes(t.dtype), t.name, shape_text(t.shape));
    h[t.name] = {{"dtype", dtype_name(t.dtype)},
                 {"shape", t.shape},
                 {"data_offsets", {at, at + t.bytes.size()}}};
    at += t.bytes.size();
  }
  std::string text = h.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data region starts 8-byte aligned
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) SPILLWAY_INPUT_ERROR("{}: cannot write: {}", path, std::strerror(errno));
  char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<char>((text.size() >> (8 * i)) & 0xff);
  out.write(len, 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const SafetensorsEntry& t : tensors)
    out.write(reinterpret_cast<const char*>(t.bytes.data()),
              static_cast<std::streamsize>(t.bytes.size()));
  out.flush();
  if (!out) SPILLWAY_INPUT_ERROR("{}: write failed: {}", path, std::strerror(errno));
}

}  // namespace spillway
