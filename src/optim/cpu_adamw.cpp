// The CPU AdamW over a framework's parameters (spillway.torch's CPUAdamW on its CPU path,
// include/spillway/optim/optim.hpp, Note [Speculative CPU AdamW over parameters]): one bucket per
// parameter; the fp32 master weights and moments are this object's, allocated once; each
// parameter's gradient is handed over when it is final and stepped speculatively on a
// worker thread (with the AdamW thread pool) while the caller goes on; finish() validates
// (Note [STV exactness]). Moved here from the Python binding, which is now a thin wrapper.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "spillway/core/error.hpp"
#include "spillway/optim/optim.hpp"

namespace spillway::optim {

size_t parameter_elements(const std::vector<int64_t>& sizes) {
  if (sizes.empty()) SPILLWAY_INPUT_ERROR("CPUAdamW: no parameters");
  size_t n = 0;
  for (int64_t s : sizes) {
    if (s < 1) SPILLWAY_FIELD_ERROR("size", s, "must be >= 1 (a parameter with no elements)");
    n += static_cast<size_t>(s);
  }
  return n;
}

int pool_threads(int threads) {
  if (threads < 0) SPILLWAY_FIELD_ERROR("threads", threads, "must be >= 0 (0: every core)");
  return threads;
}

// The optimizer's state and its worker. Gradients handed over (grad_ready) are stepped in
// order on the worker thread; finish() waits for them, then validates.
struct SpeculativeCpuAdamW::Impl {
  Impl(const std::vector<int64_t>& sizes, double clip, bool speculative, int threads)
      : speculative_(speculative), n_(parameter_elements(sizes)), pool_(pool_threads(threads)) {
    // Each parameter's state starts at a kStateAlignFloats boundary, as its second buffer
    // does: its step streams whole vectors from its first element (Note [Streamed stores]).
    std::vector<Bucket> buckets;
    size_t off = 0;
    for (int64_t s : sizes) {
      buckets.push_back({off, static_cast<size_t>(s)});
      ns_.push_back(static_cast<size_t>(s));
      off += state_padded(static_cast<size_t>(s));
    }
    padded_ = off;
    early_.assign(ns_.size(), 0);
    early_dst_.assign(ns_.size(), nullptr);
    early_dtype_.assign(ns_.size(), ParamDtype::kFp32);
    p_.assign(padded_ + kStateAlignFloats, 0.0f);
    m_.assign(padded_ + kStateAlignFloats, 0.0f);
    v_.assign(padded_ + kStateAlignFloats, 0.0f);
    // Non-speculative: no undo memory, so every bucket is deferred to finish() (Note
    // [Bounded undo]): the exact non-speculative optimizer, on the critical path.
    stv_ = std::make_unique<StvAdamW>(AdamWParams{}, clip, state_aligned(p_), state_aligned(m_),
                                      state_aligned(v_), padded_, std::move(buckets), 0, &pool_,
                                      speculative ? -1 : 0);
    worker_ = std::thread([this] { run(); });
  }

  ~Impl() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;

  void set_hparams(int b, const AdamWParams& hp) {
    drain();
    stv_->set_hparams(b, hp);
  }
  int64_t bucket_step(int b) const { return stv_->bucket_step(b); }
  void set_bucket_step(int b, int64_t t) {
    drain();
    stv_->set_bucket_step(b, t);
  }

  // The master weights of bucket b from a parameter's memory (fp32 or bf16, widened).
  void load_weights(int b, const void* src, ParamDtype dtype) {
    drain();
    const auto s = stv_->state(b);
    const size_t n = bucket_n(b);
    if (dtype == ParamDtype::kFp32) {
      if (src != s.p) std::memcpy(s.p, src, n * sizeof(float));  // a shared parameter: itself
    } else {
      const auto* h = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) s.p[i] = bf16_to_float(h[i]);
    }
  }
  // The master weights of bucket b into a parameter's memory (bf16: rounded to nearest even).
  void store_weights(int b, void* dst, ParamDtype dtype) {
    const float* p = stv_->state(b).p;
    if (dst == p && dtype == ParamDtype::kFp32) return;  // a shared parameter: already there
    write_weights(p, bucket_n(b), dst, dtype);
  }
  // Every bucket's weights into its parameter, after finish(), where they are not there
  // yet (Note [Early weights]): one call.
  void store_all(const std::vector<void*>& dst, const std::vector<ParamDtype>& dtypes) {
    SPILLWAY_CHECK(dst.size() == bucket_count() && dtypes.size() == dst.size(),
                   "store_all: {} destinations for {} buckets", dst.size(), bucket_count());
    // The buckets dealt to the pool's workers in contiguous runs of about equal elements.
    struct StoreJob {
      Impl* self;
      const std::vector<void*>* dst;
      const std::vector<ParamDtype>* dtypes;
    } job{this, &dst, &dtypes};
    pool_.parallel(
        [](void* c, size_t w, size_t nw) {
          const StoreJob& j = *static_cast<const StoreJob*>(c);
          const size_t total = j.self->n_;
          size_t at = 0;
          for (size_t b = 0; b < j.dst->size(); ++b) {
            const size_t owner = std::min(nw - 1, (at + j.self->ns_[b] / 2) * nw / total);
            at += j.self->ns_[b];
            if (owner != w || (*j.dst)[b] == nullptr || !j.self->needs_store(b)) continue;
            j.self->store_weights(static_cast<int>(b), (*j.dst)[b], (*j.dtypes)[b]);
          }
        },
        &job);
    std::fill(early_.begin(), early_.end(), 0);
  }
  // The state of bucket b (p, m, v) copied out to / in from fp32 memory of its size.
  void read_state(int b, float* p, float* m, float* v) {
    drain();
    const auto s = stv_->state(b);
    const size_t bytes = bucket_n(b) * sizeof(float);
    if (p != s.p) std::memcpy(p, s.p, bytes);  // a shared parameter: itself
    std::memcpy(m, s.m, bytes);
    std::memcpy(v, s.v, bytes);
  }
  void write_state(int b, const float* p, const float* m, const float* v) {
    drain();
    const auto s = stv_->state(b);
    const size_t bytes = bucket_n(b) * sizeof(float);
    if (p != s.p) std::memcpy(s.p, p, bytes);  // a shared parameter: itself
    std::memcpy(s.m, m, bytes);
    std::memcpy(s.v, v, bytes);
  }

  // Backward: bucket b's gradient (fp32 or bf16, its size) is final; it stays valid and
  // unchanged until finish(). Queued for the worker: the call returns at once.
  // Note [Early weights]: with `dst` (the parameter's memory, of `dtype`), the worker also
  // writes the bucket's speculative weights there once its step is done, during backward;
  // after finish(), store_all() writes only what that did not get right: the buckets
  // stepped late (deferred, replayed) and, after a skip, restores those written early.
  void grad_ready(int b, const void* g, ParamDtype dtype, void* dst) {
    push({b, g, dtype, false, dst});
  }
  // Bucket b has no gradient this step.
  void absent(int b) { push({b, nullptr, ParamDtype::kFp32, true, nullptr}); }

  // Waits for the queued steps, validates; returns (outcome, the gradient scale, ms the
  // worker spent on this step's buckets, ms finish() took).
  CpuStepResult finish(std::optional<double> global_sq) {
    drain();
    const auto t0 = std::chrono::steady_clock::now();
    const StvOutcome o = global_sq ? stv_->finish(*global_sq) : stv_->finish();
    last_ = o;
    // Note [Speculation after a clip]: a step that clipped predicts the next one will (a
    // clip bound under the gradients' norm early in training): it defers its buckets, one
    // pass each in finish() instead of a speculative pass and a replay; a step that did not
    // clip turns speculation back on. Never on for a non-speculative optimizer.
    if (speculative_ && o != StvOutcome::kSkip) stv_->set_speculation(o != StvOutcome::kReplay);
    const double finish_ms = ms_since(t0);
    const double worker_ms = worker_ms_;
    worker_ms_ = 0.0;
    return {o, stv_->last_scale(), worker_ms, finish_ms};
  }
  // This process's sum of squares of the step's gradients, once all were handed over
  // (sharded training all-reduces it and passes the sum to finish()).
  double sum_of_squares() {
    drain();
    return stv_->sum_of_squares();
  }
  // The sum of squares of the gradients handed over so far, once their steps are done
  // (Note [Clips the speculation saw]).
  double arrived_sum_of_squares() {
    drain();
    return stv_->arrived_sum_of_squares();
  }
  // The step cannot complete: the speculative buckets are undone, nothing is stepped.
  // Early weights already written are restored from the untouched state.
  void abort() {
    drain();
    stv_->abort();
    for (size_t b = 0; b < early_.size(); ++b) {
      if (early_[b] != 0)
        write_weights(stv_->state(static_cast<int>(b)).p, ns_[b], early_dst_[b], early_dtype_[b]);
    }
    std::fill(early_.begin(), early_.end(), 0);
  }

  std::pair<float*, float*> weight_buffers(int b) {
    drain();
    (void)bucket_n(b);  // checks b
    return stv_->weight_buffers(b);
  }
  std::vector<uint8_t> current_buffers() {
    drain();
    std::vector<uint8_t> out(ns_.size());
    for (size_t b = 0; b < ns_.size(); ++b)
      out[b] = static_cast<uint8_t>(stv_->current_buffer(static_cast<int>(b)));
    return out;
  }

  int64_t step() const { return stv_->step(); }
  const StvCounters& counters() const { return stv_->counters(); }
  int threads() const { return pool_.threads(); }
  int64_t state_bytes() const { return static_cast<int64_t>(3 * padded_ * sizeof(float)); }
  int64_t undo_bytes() const { return stv_->undo_bytes(); }

 private:
  struct Job {
    int bucket = 0;
    const void* grad = nullptr;
    ParamDtype dtype = ParamDtype::kFp32;
    bool absent = false;
    void* dst = nullptr;  // Note [Early weights]
  };

  static void write_weights(const float* src, size_t n, void* dst, ParamDtype dtype) {
    optim::write_weights(src, dst, dtype, n);
  }
  bool needs_store(size_t b) const {
    if (last_ == StvOutcome::kSkip) return early_[b] != 0;        // restore what was written early
    if (stv_->published_late(static_cast<int>(b))) return false;  // the late pass wrote them
    return early_[b] == 0 || stv_->stepped_late(static_cast<int>(b));
  }

  static double ms_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  }
  size_t bucket_count() const { return ns_.size(); }
  size_t bucket_n(int b) const {
    if (b < 0 || static_cast<size_t>(b) >= ns_.size())
      SPILLWAY_FIELD_ERROR("bucket", b, "must be in [0, {})", ns_.size());
    return ns_[static_cast<size_t>(b)];
  }

  void push(Job j) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (error_) std::rethrow_exception(error_);
      jobs_.push_back(j);
      ++pushed_;
    }
    cv_.notify_one();
  }
  // Waits until the worker has run every job pushed so far; rethrows its error.
  void drain() {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return done_ == pushed_; });
    if (error_) {
      std::exception_ptr e = error_;
      error_ = nullptr;
      std::rethrow_exception(e);
    }
  }
  void run() {
    for (;;) {
      Job j;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
        if (jobs_.empty()) return;
        j = jobs_.front();
        jobs_.pop_front();
      }
      const auto t0 = std::chrono::steady_clock::now();
      try {
        if (j.absent) {
          stv_->on_absent_bucket(j.bucket);
        } else {
          // Note [Early weights]: a speculated bucket's step writes them in its pass.
          const bool speculated = stv_->admit(j.bucket);
          if (j.dtype == ParamDtype::kBf16) {
            stv_->on_bucket_bf16(j.bucket, static_cast<const uint16_t*>(j.grad), j.dst);
          } else {
            stv_->on_bucket(j.bucket, static_cast<const float*>(j.grad), j.dst);
          }
          if (speculated && j.dst != nullptr) {
            const auto b = static_cast<size_t>(j.bucket);
            early_[b] = 1;
            early_dst_[b] = j.dst;
            early_dtype_[b] = j.dtype;
          }
        }
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu_);
        if (!error_) error_ = std::current_exception();
      }
      const double ms = ms_since(t0);
      {
        std::lock_guard<std::mutex> lock(mu_);
        worker_ms_ += ms;
        ++done_;
      }
      done_cv_.notify_all();
    }
  }

 private:
  std::vector<size_t> ns_;  // elements per bucket
  // Note [Early weights], per bucket: written early this step, where, as what. The worker
  // writes them, finish()/store_all()/abort() read them after drain().
  std::vector<char> early_;
  std::vector<void*> early_dst_;
  std::vector<ParamDtype> early_dtype_;
  StvOutcome last_ = StvOutcome::kCommit;
  bool speculative_;
  size_t n_;
  size_t padded_ = 0;  // the state arrays' elements: each parameter's padded
  AdamW pool_;
  std::vector<float> p_, m_, v_;
  std::unique_ptr<StvAdamW> stv_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable done_cv_;
  std::deque<Job> jobs_;
  uint64_t pushed_ = 0;
  uint64_t done_ = 0;
  double worker_ms_ = 0.0;
  std::exception_ptr error_;
  bool stop_ = false;
  std::thread worker_;  // last: starts after the members it uses
};

SpeculativeCpuAdamW::SpeculativeCpuAdamW(const std::vector<int64_t>& sizes, double clip,
                                         bool speculative, int threads)
    : impl_(std::make_unique<Impl>(sizes, clip, speculative, threads)) {}
SpeculativeCpuAdamW::~SpeculativeCpuAdamW() = default;

void SpeculativeCpuAdamW::set_hparams(int b, const AdamWParams& hp) {
  impl_->set_hparams(b, hp);
}
int64_t SpeculativeCpuAdamW::bucket_step(int b) const {
  return impl_->bucket_step(b);
}
void SpeculativeCpuAdamW::set_bucket_step(int b, int64_t t) {
  impl_->set_bucket_step(b, t);
}
void SpeculativeCpuAdamW::load_weights(int b, const void* src, ParamDtype dtype) {
  impl_->load_weights(b, src, dtype);
}
void SpeculativeCpuAdamW::store_weights(int b, void* dst, ParamDtype dtype) {
  impl_->store_weights(b, dst, dtype);
}
void SpeculativeCpuAdamW::store_all(const std::vector<void*>& dst,
                                    const std::vector<ParamDtype>& dtypes) {
  impl_->store_all(dst, dtypes);
}
void SpeculativeCpuAdamW::read_state(int b, float* p, float* m, float* v) {
  impl_->read_state(b, p, m, v);
}
void SpeculativeCpuAdamW::write_state(int b, const float* p, const float* m, const float* v) {
  impl_->write_state(b, p, m, v);
}
void SpeculativeCpuAdamW::grad_ready(int b, const void* g, ParamDtype dtype, void* dst) {
  impl_->grad_ready(b, g, dtype, dst);
}
void SpeculativeCpuAdamW::absent(int b) {
  impl_->absent(b);
}
CpuStepResult SpeculativeCpuAdamW::finish(std::optional<double> global_sum_of_squares) {
  return impl_->finish(global_sum_of_squares);
}
double SpeculativeCpuAdamW::sum_of_squares() {
  return impl_->sum_of_squares();
}
double SpeculativeCpuAdamW::arrived_sum_of_squares() {
  return impl_->arrived_sum_of_squares();
}
void SpeculativeCpuAdamW::abort() {
  impl_->abort();
}
std::pair<float*, float*> SpeculativeCpuAdamW::weight_buffers(int b) {
  return impl_->weight_buffers(b);
}
std::vector<uint8_t> SpeculativeCpuAdamW::current_buffers() {
  return impl_->current_buffers();
}
int64_t SpeculativeCpuAdamW::step() const {
  return impl_->step();
}
const StvCounters& SpeculativeCpuAdamW::counters() const {
  return impl_->counters();
}
int SpeculativeCpuAdamW::threads() const {
  return impl_->threads();
}
int64_t SpeculativeCpuAdamW::state_bytes() const {
  return impl_->state_bytes();
}
int64_t SpeculativeCpuAdamW::undo_bytes() const {
  return impl_->undo_bytes();
}

}  // namespace spillway::optim
