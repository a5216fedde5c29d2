// The model pool (spillway/serve/serve.hpp): models registered by their checkpoints (one
// safetensors file, or an index and its shards: Note [Sharded checkpoints]), loaded on first
// use into one mapped host allocation each, every shard's tensors in it (64-byte aligned),
// kept up to the host budget, the least recently released idle model evicted first.
//
// Note [Pool switches copy nothing]: acquiring a resident model hands out pointers into its
// mapped host memory, which the device reads in place: no device allocation, no copy. The
// only bytes the pool moves are a cold load's, from the file into host memory; it never
// calls the device's copy operations (a test counts them through a forwarding device).
//
// A cold load reads the files add() (or refresh()) checked, or nothing: each file's stamp
// (device, inode, size, mtime; the index's and every shard's) must be the one recorded, else the
// acquire answers kChanged and the caller decides (Note [Checkpoints that change on disk] in
// spillway/inference/inference.hpp). Tensors are copied through the file, not the mapping, so a
// file truncated during the load fails it (kChanged) instead of raising SIGBUS.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <mutex>

#include "spillway/core/error.hpp"
#include "spillway/serve/serve.hpp"

namespace spillway {

struct PoolEntry {
  std::string model, path;            // path: the safetensors file or the index
  std::vector<std::string> paths;     // SafetensorsSet::paths() as checked
  std::vector<FileStamp> stamps;      // the files add() or refresh() checked
  int64_t bytes = 0;                  // the packed allocation
  std::vector<PooledTensor> tensors;  // empty while not resident
  void* host = nullptr;               // mapped host memory (null: not resident)
  int users = 0;
  int64_t last_use = 0;  // a tick: the least recent idle entry is evicted first
};

struct ModelPool::Impl {
  using Entry = PoolEntry;
  Device& dev;
  ModelPoolOptions opt;
  mutable std::mutex mu;
  std::vector<std::unique_ptr<Entry>> entries;  // stable addresses: handles point at them
  int64_t tick = 0;
  int64_t resident_bytes = 0;
  ModelPoolStats stats;

  Impl(Device& d, const ModelPoolOptions& o) : dev(d), opt(o) {}

  Entry* find(const std::string& model) const {
    for (const auto& e : entries)
      if (e->model == model) return e.get();
    return nullptr;
  }

  static int64_t packed_bytes(const std::vector<SafetensorsTensor>& tensors) {
    int64_t at = 0;
    for (const SafetensorsTensor& t : tensors) at += (t.bytes + 63) / 64 * 64;
    return std::max<int64_t>(at, 64);
  }

  // How the files `now` differ from those e recorded (they differ).
  static std::string change(const Entry& e, const std::vector<std::string>& paths,
                            const std::vector<FileStamp>& now) {
    if (paths != e.paths)
      return fmt::format("{} now names other shards ({} files; {} when checked)", e.path,
                         paths.size(), e.paths.size());
    for (size_t i = 0; i < now.size(); ++i) {
      const FileStamp& was = e.stamps[i];
      const FileStamp& is = now[i];
      if (is == was) continue;
      const std::string how =
          is.device != was.device || is.inode != was.inode ? "another file was put in its place"
          : is.bytes != was.bytes
              ? fmt::format("its size went from {} to {} bytes", was.bytes, is.bytes)
              : std::string("it was rewritten (another modification time)");
      return fmt::format("{} changed on disk since it was checked: {}", paths[i], how);
    }
    return fmt::format("{} changed on disk since it was checked: its tensors take another size",
                       e.path);
  }

  // Records checked files as e's (add, refresh): the next load reads them.
  void set_files(Entry& e, const std::string& model, const std::string& path,
                 const std::vector<std::string>& paths, const std::vector<FileStamp>& stamps,
                 int64_t bytes) {
    if (bytes > opt.host_budget_bytes)
      SPILLWAY_INPUT_ERROR(
          "model pool: model '{}' ({}) takes {} bytes of host memory; the pool's budget is {}",
          model, path, bytes, opt.host_budget_bytes);
    if (stamps == e.stamps && paths == e.paths && bytes == e.bytes) return;  // as checked
    if (e.host != nullptr && e.users == 0) evict(e);
    if (e.host != nullptr && bytes != e.bytes)
      SPILLWAY_INPUT_ERROR(
          "model pool: model '{}' is in use ({} bytes resident); its new file ({} bytes) is "
          "read once it is released",
          model, e.bytes, bytes);
    e.paths = paths;
    e.stamps = stamps;
    if (e.host == nullptr) e.bytes = bytes;
  }

  void evict(Entry& e) {
    dev.free(e.host, MemoryKind::kMappedHost);
    e.host = nullptr;
    e.tensors.clear();
    resident_bytes -= e.bytes;
    ++stats.evictions;
  }

  // Loads e from its file (the caller holds mu and made room): kOk, or kChanged / kFull
  // with *why, nothing loaded.
  PoolStatus load(Entry& e, std::string* why) {
    const auto t0 = std::chrono::steady_clock::now();
    std::unique_ptr<SafetensorsSet> f;
    try {
      f = std::make_unique<SafetensorsSet>(e.path);
    } catch (const std::exception& x) {
      *why = fmt::format(
          "model '{}': its file changed on disk since it was checked and cannot be "
          "read now: {}",
          e.model, x.what());
      return PoolStatus::kChanged;
    }
    if (f->stamps() != e.stamps || f->paths() != e.paths || packed_bytes(f->tensors()) != e.bytes) {
      *why = fmt::format("model '{}': {}", e.model, change(e, f->paths(), f->stamps()));
      return PoolStatus::kChanged;
    }
    const AllocResult r = dev.allocate(static_cast<size_t>(e.bytes), MemoryKind::kMappedHost);
    if (!r) {
      *why = fmt::format("model '{}': cannot allocate {} bytes of mapped host memory: {}", e.model,
                         e.bytes, r.reason);
      return PoolStatus::kFull;
    }
    auto* base = static_cast<std::byte*>(r.ptr);
    int64_t at = 0;
    try {
      for (const SafetensorsTensor& t : f->tensors()) {
        f->read(t, base + at);
        e.tensors.push_back({t.name, t.dtype, t.shape, base + at, t.bytes});
        at += (t.bytes + 63) / 64 * 64;
      }
    } catch (const std::exception& x) {
      e.tensors.clear();
      dev.free(r.ptr, MemoryKind::kMappedHost);
      *why = fmt::format("model '{}': {}", e.model, x.what());
      return PoolStatus::kChanged;
    }
    e.host = r.ptr;
    resident_bytes += e.bytes;
    ++stats.cold_loads;
    stats.cold_load_bytes += f->data_bytes();
    stats.cold_load_ms +=
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    return PoolStatus::kOk;
  }
};

ModelPool::ModelPool(Device& dev, const ModelPoolOptions& options)
    : impl_(std::make_unique<Impl>(dev, options)) {
  if (options.host_budget_bytes < 1)
    SPILLWAY_FIELD_ERROR("host_budget_bytes", options.host_budget_bytes, "must be >= 1");
}

ModelPool::~ModelPool() {
  for (const auto& e : impl_->entries) {
    SPILLWAY_CHECK_WARN(e->users == 0, "model pool destroyed while {} is in use ({} handles)",
                        e->model, e->users);
    if (e->host != nullptr) impl_->dev.free(e->host, MemoryKind::kMappedHost);
  }
}

void ModelPool::add(const std::string& model, const std::string& path) {
  if (model.empty()) SPILLWAY_FIELD_ERROR("model", "''", "must not be empty");
  const SafetensorsSet f(path);
  const int64_t bytes = Impl::packed_bytes(f.tensors());
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->find(model) != nullptr)
    SPILLWAY_INPUT_ERROR("model pool: model '{}' is already added", model);
  auto e = std::make_unique<Impl::Entry>();
  e->model = model;
  e->path = path;
  impl_->set_files(*e, model, path, f.paths(), f.stamps(), bytes);
  impl_->entries.push_back(std::move(e));
}

void ModelPool::refresh(const std::string& model, const SafetensorsSet& f) {
  const int64_t bytes = Impl::packed_bytes(f.tensors());
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl::Entry* e = impl_->find(model);
  if (e == nullptr) SPILLWAY_INPUT_ERROR("model pool: no model '{}' to refresh", model);
  impl_->set_files(*e, model, f.path(), f.paths(), f.stamps(), bytes);
}

void ModelPool::refresh(const std::string& model, const SafetensorsFile& f) {
  const int64_t bytes = Impl::packed_bytes(f.tensors());
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl::Entry* e = impl_->find(model);
  if (e == nullptr) SPILLWAY_INPUT_ERROR("model pool: no model '{}' to refresh", model);
  impl_->set_files(*e, model, f.path(), {f.path()}, {f.stamp()}, bytes);
}

std::vector<std::string> ModelPool::models() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::vector<std::string> out;
  for (const auto& e : impl_->entries) out.push_back(e->model);
  return out;
}

bool ModelPool::resident(const std::string& model) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const Impl::Entry* e = impl_->find(model);
  return e != nullptr && e->host != nullptr;
}

PoolAcquire ModelPool::acquire(const std::string& model) {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.mu);
  Impl::Entry* e = s.find(model);
  if (e == nullptr) {
    std::string names;
    for (const auto& x : s.entries) names += (names.empty() ? "" : ", ") + x->model;
    SPILLWAY_INPUT_ERROR("model pool: no model '{}' (the pool has: {})", model,
                         names.empty() ? "none" : names);
  }
  PoolAcquire out;
  if (e->host == nullptr) {
    // Room: the least recently used idle models go (their files stay on disk).
    while (s.resident_bytes + e->bytes > s.opt.host_budget_bytes) {
      Impl::Entry* victim = nullptr;
      for (const auto& x : s.entries)
        if (x->host != nullptr && x->users == 0 &&
            (victim == nullptr || x->last_use < victim->last_use))
          victim = x.get();
      if (victim == nullptr) {
        std::string busy;
        for (const auto& x : s.entries)
          if (x->host != nullptr)
            busy += fmt::format("{}{} ({} bytes, {} in use)", busy.empty() ? "" : ", ", x->model,
                                x->bytes, x->users);
        out.status = PoolStatus::kFull;
        out.why = fmt::format(
            "model '{}' needs {} bytes; the budget is {} and the models in use hold {}: {}", model,
            e->bytes, s.opt.host_budget_bytes, s.resident_bytes, busy);
        ++s.stats.refused;
        return out;
      }
      s.evict(*victim);
    }
    out.status = s.load(*e, &out.why);
    if (out.status != PoolStatus::kOk) {
      ++s.stats.refused;
      return out;
    }
    out.cold = true;
  } else {
    ++s.stats.hits;
  }
  ++e->users;
  e->last_use = ++s.tick;
  ++s.stats.acquires;
  out.handle.pool_ = this;
  out.handle.entry_ = e;
  return out;
}

ModelPoolStats ModelPool::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  ModelPoolStats st = impl_->stats;
  st.resident_bytes = impl_->resident_bytes;
  st.resident_models = 0;
  for (const auto& e : impl_->entries) st.resident_models += e->host != nullptr ? 1 : 0;
  return st;
}

// ---- handles ------------------------------------------------------------------------------

ModelHandle::~ModelHandle() {
  release();
}

ModelHandle::ModelHandle(ModelHandle&& o) noexcept : pool_(o.pool_), entry_(o.entry_) {
  o.pool_ = nullptr;
  o.entry_ = nullptr;
}

ModelHandle& ModelHandle::operator=(ModelHandle&& o) noexcept {
  if (this != &o) {
    release();
    pool_ = o.pool_;
    entry_ = o.entry_;
    o.pool_ = nullptr;
    o.entry_ = nullptr;
  }
  return *this;
}

void ModelHandle::release() {
  if (pool_ == nullptr) return;
  ModelPool::Impl& s = *pool_->impl_;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    --entry_->users;
    entry_->last_use = ++s.tick;
  }
  pool_ = nullptr;
  entry_ = nullptr;
}

const std::string& ModelHandle::model() const {
  SPILLWAY_CHECK(pool_ != nullptr, "an empty ModelHandle has no model");
  return entry_->model;
}

const std::vector<PooledTensor>& ModelHandle::tensors() const {
  SPILLWAY_CHECK(pool_ != nullptr, "an empty ModelHandle has no tensors");
  return entry_->tensors;
}

const PooledTensor& ModelHandle::tensor(const std::string& name) const {
  for (const PooledTensor& t : tensors())
    if (t.name == name) return t;
  SPILLWAY_INPUT_ERROR("model '{}' has no tensor '{}'", model(), name);
}

int64_t ModelHandle::weight_bytes() const {
  SPILLWAY_CHECK(pool_ != nullptr, "an empty ModelHandle has no weights");
  return entry_->bytes;
}

}  // namespace spillway
