// Host-resident serving (docs/serve.md): every model's weights stay in pinned,
// device-mapped host memory; a GPU or a MIG slice computes on any of them without loading
// weights into HBM, which holds only activations and KV cache.
//
// This header: the safetensors reader (the real format: an 8-byte little-endian header
// length, a JSON header, then the raw tensors) and the model pool (models loaded once into
// mapped host memory up to a host budget, least recently used idle models evicted, a
// switch re-pointing a caller at another model's weights with no weight byte copied).
//
// Note [Safetensors checks]: a file is checked whole before any tensor is used: the header
// length fits the file and the limit (100 MiB, as the format's reference reader), the
// header is a JSON object, every tensor has a known dtype (BF16, F32; others are refused by
// name), a shape whose element count times the dtype's size equals its data_offsets span,
// offsets inside the data region, and no two tensors overlap. Each error names the file,
// the tensor and the offset.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "spillway/catalog/inventory.hpp"
#include "spillway/device/device.hpp"

namespace spillway {

struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::kFp32;  // kBf16 or kFp32
  std::vector<int64_t> shape;
  int64_t offset = 0;  // from the start of the data region
  int64_t bytes = 0;
  int shard = 0;  // SafetensorsSet: the index of the file holding it (0 for a single file)
};

inline constexpr int64_t kSafetensorsMaxHeaderBytes = int64_t{100} << 20;

// Which file a path named when it was opened: one renamed over it, rewritten or resized
// since has another stamp (Note [Checkpoints that change on disk] in
// spillway/inference/inference.hpp).
struct FileStamp {
  uint64_t device = 0, inode = 0;
  int64_t bytes = 0;
  int64_t mtime_ns = 0;
  bool operator==(const FileStamp&) const = default;
};
// The file at `path` as stat() sees it now; FileStamp{} when it cannot be stat'ed.
FileStamp file_stamp(const std::string& path);

// A safetensors file, memory-mapped read-only and checked (Note [Safetensors checks]). The
// header is read through the file, not the mapping, and read() copies a tensor the same way:
// a file truncated meanwhile is an error naming it, never a SIGBUS. A path that is not a
// regular file (a directory, a FIFO) is refused naming what it is.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  int64_t file_bytes() const { return file_bytes_; }
  int64_t data_bytes() const;  // the tensors' bytes, the header excluded
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }  // by offset
  const SafetensorsTensor* find(const std::string& name) const;               // null: none
  // The tensor's bytes in the mapping (valid while this object lives).
  const std::byte* data(const SafetensorsTensor& t) const;
  // Copies the tensor's bytes to dst through the file (pread); throws naming the file and
  // the tensor when it has been truncated since it was opened.
  void read(const SafetensorsTensor& t, std::byte* dst) const;
  const FileStamp& stamp() const { return stamp_; }  // the file as it was opened

 private:
  std::string path_;
  int fd_ = -1;
  FileStamp stamp_;
  int64_t file_bytes_ = 0;
  int64_t data_start_ = 0;
  void* map_ = nullptr;
  std::vector<SafetensorsTensor> tensors_;
};

// Note [Sharded checkpoints]: a checkpoint is one safetensors file, or Hugging Face's
// index (a file named *.index.json: {"metadata": {...}, "weight_map": {tensor: shard file}})
// and the shards it names, read as one file. The index is a JSON object whose weight_map is
// an object of strings (metadata is not read); each shard is a plain file name in the
// index's directory (a path with '/', "." or ".." is refused: a shard never escapes the
// directory) and is checked whole (Note [Safetensors checks]). The index must agree with the
// shards: a tensor mapped to a shard that does not hold it, a tensor held by a shard other
// than the one it is mapped to (a tensor in two shards), and a shard of a save
// (model-*-of-*.safetensors) in the directory that the index does not name are refused, each
// naming the tensor and the files; other safetensors files (Mistral's consolidated.safetensors)
// are not the checkpoint and are not read, as transformers does not read them.
// A missing shard is an error naming it and the index. Tensors are looked up by name across
// the shards; each change-on-disk stamp covers the index and every shard.
class SafetensorsSet {
 public:
  // `path`: a safetensors file, or an index (a name ending in ".index.json") and its shards.
  explicit SafetensorsSet(const std::string& path);
  ~SafetensorsSet();
  SafetensorsSet(const SafetensorsSet&) = delete;
  SafetensorsSet& operator=(const SafetensorsSet&) = delete;

  const std::string& path() const { return path_; }  // the file or the index
  bool sharded() const { return sharded_; }
  // The files read, in stamps() order: the index (when sharded), then each shard by name.
  const std::vector<std::string>& paths() const { return paths_; }
  const std::vector<std::unique_ptr<SafetensorsFile>>& shards() const { return shards_; }
  // Every tensor, shard by shard, each shard's by offset (SafetensorsTensor::shard).
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  const SafetensorsTensor* find(const std::string& name) const;  // null: none
  const std::string& file_of(const SafetensorsTensor& t) const;  // the shard's path
  // Copies the tensor's bytes through its shard (SafetensorsFile::read).
  void read(const SafetensorsTensor& t, std::byte* dst) const;
  int64_t data_bytes() const;  // all shards' tensors, headers excluded
  // The files as they were opened, paths() order.
  const std::vector<FileStamp>& stamps() const { return stamps_; }
  // The stamps `path` has now, as stamps() would give them (an index that cannot be read:
  // its own stamp alone; a file that cannot be stat'ed: FileStamp{}). Reads only the index.
  static std::vector<FileStamp> stamps_now(const std::string& path);

 private:
  std::string path_;
  bool sharded_ = false;
  std::vector<std::string> paths_;
  std::vector<FileStamp> stamps_;
  std::vector<std::unique_ptr<SafetensorsFile>> shards_;
  std::vector<SafetensorsTensor> tensors_;
  std::vector<std::pair<std::string, size_t>> by_name_;  // sorted: name, index in tensors_
};

// Writes tensors as a safetensors file (for tests and demos): names, dtypes, shapes and
// bytes (each bytes.size() must equal the shape's element count times the dtype's size).
struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kFp32;
  std::vector<int64_t> shape;
  std::vector<std::byte> bytes;
};
void write_safetensors(const std::string& path, const std::vector<SafetensorsEntry>& tensors);

// ---- the model pool ---------------------------------------------------------------------

struct ModelPoolOptions {
  int64_t host_budget_bytes = int64_t{1} << 30;  // mapped host memory for weights, all models
};

// A model resident in the pool: its tensors in mapped host memory, addressable by the
// device (a kernel reads them in place; on the host backend the same pointers).
struct PooledTensor {
  std::string name;
  DType dtype = DType::kFp32;
  std::vector<int64_t> shape;
  const std::byte* host = nullptr;  // mapped host memory (device-addressable)
  int64_t bytes = 0;
};

struct ModelPoolStats {
  int64_t resident_models = 0;
  int64_t resident_bytes = 0;   // mapped host memory the resident models take
  int64_t acquires = 0;         // acquire() calls that returned a model
  int64_t hits = 0;             // ...that found it resident
  int64_t cold_loads = 0;       // loads from disk
  int64_t cold_load_bytes = 0;  // bytes read from disk into the pool
  double cold_load_ms = 0.0;    // time those loads took
  int64_t evictions = 0;        // models dropped to make room (their files stay on disk)
  int64_t refused = 0;          // acquire() calls answered kFull or kChanged
};

class ModelPool;
struct PoolEntry;  // a model's place in its pool (src/serve/model_pool.cpp)

// A model in use: its weights stay resident until the handle is released (destroyed).
class ModelHandle {
 public:
  ModelHandle() = default;
  ~ModelHandle();
  ModelHandle(ModelHandle&& o) noexcept;
  ModelHandle& operator=(ModelHandle&& o) noexcept;
  ModelHandle(const ModelHandle&) = delete;
  ModelHandle& operator=(const ModelHandle&) = delete;

  explicit operator bool() const { return pool_ != nullptr; }
  const std::string& model() const;
  const std::vector<PooledTensor>& tensors() const;
  const PooledTensor& tensor(const std::string& name) const;  // throws naming it if absent
  int64_t weight_bytes() const;
  void release();

 private:
  friend class ModelPool;
  ModelPool* pool_ = nullptr;
  PoolEntry* entry_ = nullptr;
};

enum class PoolStatus {
  kOk,
  kFull,     // every resident model is in use and the model does not fit beside them
  kChanged,  // the file is no longer the one add() checked (Note [Checkpoints that change
             // on disk] in spillway/inference/inference.hpp), or it cannot be read: nothing loaded
};

struct PoolAcquire {
  PoolStatus status = PoolStatus::kOk;
  ModelHandle handle;  // set when kOk
  bool cold = false;   // loaded from disk by this call
  std::string why;     // kFull: what is in use and what was needed; kChanged: how it changed
};

class ModelPool {
 public:
  ModelPool(Device& dev, const ModelPoolOptions& options);
  ~ModelPool();  // every handle must be released first (checked)
  ModelPool(const ModelPool&) = delete;
  ModelPool& operator=(const ModelPool&) = delete;

  // Registers a model by its checkpoint, a safetensors file or an index and its shards
  // (SafetensorsSet, Note [Sharded checkpoints]): opened and checked now (Note [Safetensors
  // checks]); its weights are loaded at the first acquire, every shard into one allocation.
  // A model larger than the whole budget is refused here, naming both.
  void add(const std::string& model, const std::string& path);
  std::vector<std::string> models() const;
  bool resident(const std::string& model) const;

  // The model's weights, resident: at once if they are (a switch: nothing copied), else
  // loaded from disk after evicting the least recently used idle models until they fit;
  // kFull when the models in use leave no room. Thread-safe.
  // A cold load first checks that the files are still the ones add() (or refresh()) checked:
  // the same stamps (the index and every shard); otherwise kChanged, naming the model, the
  // file and what changed.
  PoolAcquire acquire(const std::string& model);
  // The model's file is now `f` (opened from its path and checked by the caller): the next
  // load reads it. A resident copy that is idle is dropped; one in use stays until released
  // (throws naming the model when f's size would differ from it). f larger than the whole
  // budget is refused as in add().
  void refresh(const std::string& model, const SafetensorsSet& f);
  void refresh(const std::string& model, const SafetensorsFile& f);  // a single file
  ModelPoolStats stats() const;

 private:
  friend class ModelHandle;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace spillway
