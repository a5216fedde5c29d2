// The CPU AdamW with speculation then validation, driven from Python (spillway.torch's
// CPUAdamW, docs/optim.md, docs/python.md). One bucket per parameter; the fp32 master weights
// and moments are this object's, allocated once; each parameter's gradient is handed over
// when it is final and stepped speculatively on a worker thread (with the AdamW thread
// pool) while backward goes on; finish() validates (Note [STV exactness]).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

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
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "adopted_device.hpp"
#include "bindings.hpp"
#include "spillway/error.hpp"
#include "spillway/optim.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace spillway::python {
namespace {

using optim::AdamW;
using optim::AdamWParams;
using optim::Bucket;
using optim::StvAdamW;
using optim::StvOutcome;

// What a parameter's memory holds (torch dtypes the optimizer takes).
enum class Dtype { kFp32 = 0, kBf16 = 1 };

Dtype to_dtype(int d) {
  if (d != 0 && d != 1) SPILLWAY_FIELD_ERROR("dtype", d, "must be 0 (float32) or 1 (bfloat16)");
  return static_cast<Dtype>(d);
}

const void* as_cptr(uintptr_t p) {
  return reinterpret_cast<const void*>(p);  // NOLINT(performance-no-int-to-ptr)
}
void* as_ptr(uintptr_t p) {
  return reinterpret_cast<void*>(p);  // NOLINT(performance-no-int-to-ptr)
}

AdamWParams make_hp(double lr, double beta1, double beta2, double eps, double weight_decay) {
  AdamWParams hp;
  hp.lr = lr;
  hp.beta1 = beta1;
  hp.beta2 = beta2;
  hp.eps = eps;
  hp.weight_decay = weight_decay;
  (void)optim::adamw_step_scalars(hp, 1);  // checks the values, naming the field
  return hp;
}

size_t total_elements(const std::vector<int64_t>& sizes) {
  if (sizes.empty()) SPILLWAY_INPUT_ERROR("CPUAdamW: no parameters");
  size_t n = 0;
  for (int64_t s : sizes) {
    if (s < 1) SPILLWAY_FIELD_ERROR("size", s, "must be >= 1 (a parameter with no elements)");
    n += static_cast<size_t>(s);
  }
  return n;
}

int checked_threads(int threads) {
  if (threads < 0) SPILLWAY_FIELD_ERROR("threads", threads, "must be >= 0 (0: every core)");
  return threads;
}

nb::typed<nb::dict, nb::str, int64_t> counters_dict(const optim::StvCounters& c) {
  nb::dict d;
  d["commits"] = c.commits;
  d["replays"] = c.replays;
  d["skips"] = c.skips;
  d["deferred"] = c.deferred;
  return nb::typed<nb::dict, nb::str, int64_t>(d);
}

// The optimizer's state and its worker. Gradients handed over (grad_ready) are stepped in
// order on the worker thread; finish() waits for them, then validates.
class CpuAdamW {
 public:
  CpuAdamW(const std::vector<int64_t>& sizes, double clip, bool speculative, int threads)
      : n_(total_elements(sizes)), pool_(checked_threads(threads)) {
    std::vector<Bucket> buckets;
    size_t off = 0;
    for (int64_t s : sizes) {
      buckets.push_back({off, static_cast<size_t>(s)});
      ns_.push_back(static_cast<size_t>(s));
      off += static_cast<size_t>(s);
    }
    early_.assign(ns_.size(), 0);
    early_dst_.assign(ns_.size(), 0);
    early_dtype_.assign(ns_.size(), Dtype::kFp32);
    p_.assign(n_, 0.0f);
    m_.assign(n_, 0.0f);
    v_.assign(n_, 0.0f);
    // Non-speculative: no undo memory, so every bucket is deferred to finish() (Note
    // [Bounded undo]): the exact non-speculative optimizer, on the critical path.
    stv_ = std::make_unique<StvAdamW>(AdamWParams{}, clip, p_.data(), m_.data(), v_.data(), n_,
                                      std::move(buckets), 0, &pool_, speculative ? -1 : 0);
    worker_ = std::thread([this] { run(); });
  }

  ~CpuAdamW() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }
  CpuAdamW(const CpuAdamW&) = delete;
  CpuAdamW& operator=(const CpuAdamW&) = delete;

  void set_hparams(int b, double lr, double beta1, double beta2, double eps, double wd) {
    drain();
    stv_->set_hparams(b, make_hp(lr, beta1, beta2, eps, wd));
  }
  int64_t bucket_step(int b) const { return stv_->bucket_step(b); }
  void set_bucket_step(int b, int64_t t) {
    drain();
    stv_->set_bucket_step(b, t);
  }

  // The master weights of bucket b from a parameter's memory (fp32 or bf16, widened).
  void load_weights(int b, uintptr_t src, int dtype) {
    drain();
    const auto s = stv_->state(b);
    const size_t n = bucket_n(b);
    if (to_dtype(dtype) == Dtype::kFp32) {
      std::memcpy(s.p, as_cptr(src), n * sizeof(float));
    } else {
      const auto* h = static_cast<const uint16_t*>(as_cptr(src));
      for (size_t i = 0; i < n; ++i) s.p[i] = optim::bf16_to_float(h[i]);
    }
  }
  // The master weights of bucket b into a parameter's memory (bf16: rounded to nearest even).
  void store_weights(int b, uintptr_t dst, int dtype) {
    write_weights(stv_->state(b).p, bucket_n(b), dst, to_dtype(dtype));
  }
  // Every bucket's weights into its parameter, after finish(), where they are not there
  // yet (Note [Early weights]): one call, the GIL released.
  void store_all(const std::vector<uintptr_t>& dst, const std::vector<int>& dtypes) {
    SPILLWAY_CHECK(dst.size() == bucket_count() && dtypes.size() == dst.size(),
                   "store_all: {} destinations for {} buckets", dst.size(), bucket_count());
    nb::gil_scoped_release release;
    // The buckets dealt to the pool's workers in contiguous runs of about equal elements.
    struct Job {
      CpuAdamW* self;
      const std::vector<uintptr_t>* dst;
      const std::vector<int>* dtypes;
    } job{this, &dst, &dtypes};
    pool_.parallel(
        [](void* c, size_t w, size_t nw) {
          const Job& j = *static_cast<const Job*>(c);
          const size_t total = j.self->n_;
          size_t at = 0;
          for (size_t b = 0; b < j.dst->size(); ++b) {
            const size_t owner = std::min(nw - 1, (at + j.self->ns_[b] / 2) * nw / total);
            at += j.self->ns_[b];
            if (owner != w || (*j.dst)[b] == 0 || !j.self->needs_store(b)) continue;
            j.self->store_weights(static_cast<int>(b), (*j.dst)[b], (*j.dtypes)[b]);
          }
        },
        &job);
    std::fill(early_.begin(), early_.end(), 0);
  }
  // The state of bucket b (p, m, v) copied out to / in from fp32 memory of its size.
  void read_state(int b, uintptr_t p, uintptr_t m, uintptr_t v) {
    drain();
    const auto s = stv_->state(b);
    const size_t bytes = bucket_n(b) * sizeof(float);
    std::memcpy(as_ptr(p), s.p, bytes);
    std::memcpy(as_ptr(m), s.m, bytes);
    std::memcpy(as_ptr(v), s.v, bytes);
  }
  void write_state(int b, uintptr_t p, uintptr_t m, uintptr_t v) {
    drain();
    const auto s = stv_->state(b);
    const size_t bytes = bucket_n(b) * sizeof(float);
    std::memcpy(s.p, as_cptr(p), bytes);
    std::memcpy(s.m, as_cptr(m), bytes);
    std::memcpy(s.v, as_cptr(v), bytes);
  }

  // Backward: bucket b's gradient (fp32 or bf16, its size) is final; it stays valid and
  // unchanged until finish(). Queued for the worker: the call returns at once.
  // Note [Early weights]: with `dst` (the parameter's memory, of `dtype`), the worker also
  // writes the bucket's speculative weights there once its step is done, during backward;
  // after finish(), store_all() writes only what that did not get right: the buckets
  // stepped late (deferred, replayed) and, after a skip, restores those written early.
  void grad_ready(int b, uintptr_t g, int dtype, uintptr_t dst) {
    push({b, g, to_dtype(dtype), false, dst});
  }
  // Bucket b has no gradient this step.
  void absent(int b) { push({b, 0, Dtype::kFp32, true, 0}); }

  // Waits for the queued steps, validates; returns (outcome, the gradient scale, ms the
  // worker spent on this step's buckets, ms finish() took).
  std::tuple<std::string, float, double, double> finish(std::optional<double> global_sq) {
    nb::gil_scoped_release release;
    drain();
    const auto t0 = std::chrono::steady_clock::now();
    const StvOutcome o = global_sq ? stv_->finish(*global_sq) : stv_->finish();
    last_ = o;
    const double finish_ms = ms_since(t0);
    const double worker_ms = worker_ms_;
    worker_ms_ = 0.0;
    const char* name = o == StvOutcome::kCommit   ? "commit"
                       : o == StvOutcome::kReplay ? "replay"
                                                  : "skip";
    return {name, stv_->last_scale(), worker_ms, finish_ms};
  }
  // This process's sum of squares of the step's gradients, once all were handed over
  // (sharded training all-reduces it and passes the sum to finish()).
  double sum_of_squares() {
    nb::gil_scoped_release release;
    drain();
    return stv_->sum_of_squares();
  }
  // The sum of squares of the gradients handed over so far, once their steps are done
  // (Note [Clips the speculation saw]).
  double arrived_sum_of_squares() {
    nb::gil_scoped_release release;
    drain();
    return stv_->arrived_sum_of_squares();
  }
  // The step cannot complete: the speculative buckets are undone, nothing is stepped.
  // Early weights already written are restored from the untouched state.
  void abort() {
    nb::gil_scoped_release release;
    drain();
    stv_->abort();
    for (size_t b = 0; b < early_.size(); ++b) {
      if (early_[b] != 0)
        write_weights(stv_->state(static_cast<int>(b)).p, ns_[b], early_dst_[b], early_dtype_[b]);
    }
    std::fill(early_.begin(), early_.end(), 0);
  }

  int64_t step() const { return stv_->step(); }
  nb::typed<nb::dict, nb::str, int64_t> counters() const { return counters_dict(stv_->counters()); }
  int threads() const { return pool_.threads(); }
  int64_t state_bytes() const { return static_cast<int64_t>(3 * n_ * sizeof(float)); }
  int64_t undo_bytes() const { return stv_->undo_bytes(); }

 private:
  struct Job {
    int bucket = 0;
    uintptr_t grad = 0;
    Dtype dtype = Dtype::kFp32;
    bool absent = false;
    uintptr_t dst = 0;  // Note [Early weights]
  };

  static void write_weights(const float* src, size_t n, uintptr_t dst, Dtype dtype) {
    if (dtype == Dtype::kFp32) {
      std::memcpy(as_ptr(dst), src, n * sizeof(float));
    } else {
      auto* h = static_cast<uint16_t*>(as_ptr(dst));
      for (size_t i = 0; i < n; ++i) h[i] = optim::float_to_bf16(src[i]);
    }
  }
  bool needs_store(size_t b) const {
    if (last_ == StvOutcome::kSkip) return early_[b] != 0;  // restore what was written early
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
          const bool speculated = stv_->admit(j.bucket);
          if (j.dtype == Dtype::kBf16) {
            stv_->on_bucket_bf16(j.bucket, static_cast<const uint16_t*>(as_cptr(j.grad)));
          } else {
            stv_->on_bucket(j.bucket, static_cast<const float*>(as_cptr(j.grad)));
          }
          if (speculated && j.dst != 0) {
            const auto b = static_cast<size_t>(j.bucket);
            write_weights(stv_->speculative_state(j.bucket).p, ns_[b], j.dst, j.dtype);
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
  std::vector<uintptr_t> early_dst_;
  std::vector<Dtype> early_dtype_;
  StvOutcome last_ = StvOutcome::kCommit;
  size_t n_;
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

// Note [The device path of CPUAdamW]: parameters in device memory (GPU bfloat16, or CPU
// bfloat16 on the host backend, which emulates a GPU) step through the optimizer-offload
// pipeline (spillway::optim::OptimizerOffload): the adapter lays the parameters and their
// gradients out in two flat bf16 buffers it owns (each parameter a view), so the pipeline
// works on caller-owned device memory; one bucket per parameter. A gradient handed over is
// copied to pinned staging on the pipeline's D2H stream after the work enqueued so far on
// torch's stream (an event, never a synchronize), stepped on the CPU, and its bf16 weights
// uploaded on the H2D stream while backward goes on; end_step validates and corrects, and
// orders torch's stream after the uploads. The interface is CpuAdamW's, so the Python
// optimizer drives either.
class OffloadAdamW {
 public:
  OffloadAdamW(const std::string& device, int ordinal, uintptr_t native_stream,
               const std::vector<int64_t>& sizes, uintptr_t weights, uintptr_t grads, double clip,
               bool speculative, int threads, nb::object keepalive)
      : keepalive_(std::move(keepalive)),
        n_(total_elements(sizes)),
        pool_(checked_threads(threads)) {
    if (weights == 0 || grads == 0)
      SPILLWAY_INPUT_ERROR("CPUAdamW: the flat weights and gradients must be device memory");
    HostDeviceOptions host;
    host.device_bytes = int64_t{1} << 20;  // the pipeline allocates no device memory here
    dev_ = std::make_unique<AdoptedDevice>(device, ordinal, native_stream, host, "CPUAdamW");
    std::vector<Bucket> buckets;
    size_t off = 0;
    for (int64_t k : sizes) {
      buckets.push_back({off, static_cast<size_t>(k)});
      offsets_.push_back(off);
      off += static_cast<size_t>(k);
    }
    grads_ = grads;
    // The fp32 master weights start as the bf16 weights widened (exact).
    std::vector<uint16_t> w16(n_);
    dev_->device->copy_async(w16.data(), as_cptr(weights), n_ * 2, dev_->compute);
    dev_->device->synchronize(dev_->compute);
    std::vector<float> w32(n_);
    for (size_t i = 0; i < n_; ++i) w32[i] = optim::bf16_to_float(w16[i]);
    optim::OptimOffloadOptions o;
    o.clip = clip;
    o.cast = optim::CastSite::kHost;  // bf16 on the link; the step widens in its own pass
    o.undo_limit_bytes = speculative ? -1 : 0;
    o.device_weights = static_cast<uint16_t*>(as_ptr(weights));
    o.device_grads = static_cast<uint16_t*>(as_ptr(grads));
    pipe_ = std::make_unique<optim::OptimizerOffload>(*dev_->device, dev_->compute, w32.data(), n_,
                                                      std::move(buckets), o, &pool_);
  }
  // pipe_ (which waits for its streams) before dev_ and pool_, all before keepalive_: the
  // owners of the flat buffers outlive every copy (declaration order).
  ~OffloadAdamW() = default;
  OffloadAdamW(const OffloadAdamW&) = delete;
  OffloadAdamW& operator=(const OffloadAdamW&) = delete;

  void set_hparams(int b, double lr, double beta1, double beta2, double eps, double wd) {
    pipe_->set_hparams(b, make_hp(lr, beta1, beta2, eps, wd));
  }
  int64_t bucket_step(int b) const { return pipe_->bucket_step(b); }
  void read_state(int b, uintptr_t p, uintptr_t m, uintptr_t v) {
    nb::gil_scoped_release release;
    pipe_->read_bucket(b, static_cast<float*>(as_ptr(p)), static_cast<float*>(as_ptr(m)),
                       static_cast<float*>(as_ptr(v)));
  }
  // A checkpoint's state of bucket b and its step; its bf16 weights are uploaded.
  void write_state(int b, uintptr_t p, uintptr_t m, uintptr_t v, int64_t step) {
    nb::gil_scoped_release release;
    pipe_->write_bucket(b, static_cast<const float*>(as_cptr(p)),
                        static_cast<const float*>(as_cptr(m)),
                        static_cast<const float*>(as_cptr(v)), step);
  }
  // Backward: bucket b's gradient is final in the flat gradient buffer once the work
  // enqueued so far on the compute stream has run (`grad` must be its slice there).
  void grad_ready(int b, uintptr_t grad, int dtype, uintptr_t /*dst*/) {
    const size_t at = offset(b);
    if (to_dtype(dtype) != Dtype::kBf16 || grad != grads_ + at * 2)
      SPILLWAY_INPUT_ERROR(
          "CPUAdamW: the gradient of parameter {} must be its bfloat16 slice of the flat "
          "gradient buffer",
          b);
    nb::gil_scoped_release release;
    pipe_->on_bucket_grad(b);
  }
  void absent(int b) {
    (void)offset(b);
    pipe_->on_bucket_absent(b);
  }
  // As CpuAdamW::finish: (outcome, scale, CPU ms of the bucket steps and validation, ms the
  // call took). Sharded norms are not supported here (the caller refuses DTensors).
  std::tuple<std::string, float, double, double> finish(std::optional<double> global_sq) {
    if (global_sq)
      SPILLWAY_INPUT_ERROR("CPUAdamW: a sharded global norm on the device path is not supported");
    nb::gil_scoped_release release;
    const auto t0 = std::chrono::steady_clock::now();
    const StvOutcome o = pipe_->end_step();
    const double call_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    const char* name = o == StvOutcome::kCommit   ? "commit"
                       : o == StvOutcome::kReplay ? "replay"
                                                  : "skip";
    return {name, pipe_->last_scale(), pipe_->last_cpu_ms(), call_ms};
  }
  // As CpuAdamW::arrived_sum_of_squares (every bucket is a CPU bucket here).
  double arrived_sum_of_squares() {
    nb::gil_scoped_release release;
    return pipe_->arrived_cpu_sum_of_squares();
  }
  void abort() {
    nb::gil_scoped_release release;
    pipe_->abort_step();
  }
  int64_t step() const { return pipe_->step(); }
  nb::typed<nb::dict, nb::str, int64_t> counters() const {
    return counters_dict(pipe_->counters());
  }
  int threads() const { return pool_.threads(); }
  int64_t state_bytes() const { return static_cast<int64_t>(3 * n_ * sizeof(float)); }
  int64_t undo_bytes() const { return pipe_->undo_bytes(); }
  std::string device_name() const { return dev_->device->name(); }

 private:
  size_t offset(int b) const {
    if (b < 0 || static_cast<size_t>(b) >= offsets_.size())
      SPILLWAY_FIELD_ERROR("bucket", b, "must be in [0, {})", offsets_.size());
    return offsets_[static_cast<size_t>(b)];
  }

  nb::object keepalive_;  // the Python owners of the flat buffers (destroyed last)
  size_t n_;
  std::vector<size_t> offsets_;  // per bucket, in elements
  uintptr_t grads_ = 0;
  AdamW pool_;
  std::unique_ptr<AdoptedDevice> dev_;  // before pipe_: outlives it
  std::unique_ptr<optim::OptimizerOffload> pipe_;
};

// The project's non-speculative reference (spillway::optim::reference_adamw_step) over
// fp32 arrays: one bucket per entry of `sizes`. Returns the outcome and the new step.
std::pair<std::string, int64_t> reference_step(double lr, double beta1, double beta2, double eps,
                                               double weight_decay, double clip, uintptr_t p,
                                               uintptr_t m, uintptr_t v, uintptr_t g,
                                               const std::vector<int64_t>& sizes, int64_t step) {
  std::vector<Bucket> buckets;
  size_t off = 0;
  for (int64_t s : sizes) {
    buckets.push_back({off, static_cast<size_t>(s)});
    off += static_cast<size_t>(s);
  }
  const StvOutcome o = optim::reference_adamw_step(
      make_hp(lr, beta1, beta2, eps, weight_decay), clip, static_cast<float*>(as_ptr(p)),
      static_cast<float*>(as_ptr(m)), static_cast<float*>(as_ptr(v)),
      static_cast<const float*>(as_cptr(g)), buckets, &step);
  return {o == StvOutcome::kCommit ? "commit" : o == StvOutcome::kReplay ? "replay" : "skip", step};
}

}  // namespace

void bind_optim(nb::module_& m) {
  nb::class_<CpuAdamW>(m, "CpuAdamW",
                       "The CPU AdamW with speculation then validation, one bucket per "
                       "parameter (spillway.torch.CPUAdamW drives it)")
      .def(nb::init<const std::vector<int64_t>&, double, bool, int>(), "sizes"_a, "clip"_a,
           "speculative"_a, "threads"_a)
      .def("set_hparams", &CpuAdamW::set_hparams, "bucket"_a, "lr"_a, "beta1"_a, "beta2"_a, "eps"_a,
           "weight_decay"_a)
      .def("bucket_step", &CpuAdamW::bucket_step, "bucket"_a)
      .def("set_bucket_step", &CpuAdamW::set_bucket_step, "bucket"_a, "step"_a)
      .def("load_weights", &CpuAdamW::load_weights, "bucket"_a, "src"_a, "dtype"_a)
      .def("store_weights", &CpuAdamW::store_weights, "bucket"_a, "dst"_a, "dtype"_a)
      .def("store_all", &CpuAdamW::store_all, "dst"_a, "dtypes"_a)
      .def("read_state", &CpuAdamW::read_state, "bucket"_a, "p"_a, "m"_a, "v"_a)
      .def("write_state", &CpuAdamW::write_state, "bucket"_a, "p"_a, "m"_a, "v"_a)
      .def("grad_ready", &CpuAdamW::grad_ready, "bucket"_a, "grad"_a, "dtype"_a, "dst"_a = 0)
      .def("absent", &CpuAdamW::absent, "bucket"_a)
      .def("finish", &CpuAdamW::finish, "global_sum_of_squares"_a = nb::none())
      .def("sum_of_squares", &CpuAdamW::sum_of_squares)
      .def("arrived_sum_of_squares", &CpuAdamW::arrived_sum_of_squares)
      .def("abort", &CpuAdamW::abort)
      .def("counters", &CpuAdamW::counters)
      .def_prop_ro("step", &CpuAdamW::step)
      .def_prop_ro("threads", &CpuAdamW::threads)
      .def_prop_ro("state_bytes", &CpuAdamW::state_bytes)
      .def_prop_ro("undo_bytes", &CpuAdamW::undo_bytes);
  nb::class_<OffloadAdamW>(m, "OffloadAdamW",
                           "CPUAdamW's device path: the optimizer-offload pipeline on flat "
                           "bf16 device buffers the caller owns (Note [The device path of "
                           "CPUAdamW])")
      .def(nb::init<const std::string&, int, uintptr_t, const std::vector<int64_t>&, uintptr_t,
                    uintptr_t, double, bool, int, nb::object>(),
           "device"_a, "ordinal"_a, "native_stream"_a, "sizes"_a, "weights"_a, "grads"_a, "clip"_a,
           "speculative"_a, "threads"_a, "keepalive"_a = nb::none())
      .def("set_hparams", &OffloadAdamW::set_hparams, "bucket"_a, "lr"_a, "beta1"_a, "beta2"_a,
           "eps"_a, "weight_decay"_a)
      .def("bucket_step", &OffloadAdamW::bucket_step, "bucket"_a)
      .def("read_state", &OffloadAdamW::read_state, "bucket"_a, "p"_a, "m"_a, "v"_a)
      .def("write_state", &OffloadAdamW::write_state, "bucket"_a, "p"_a, "m"_a, "v"_a, "step"_a)
      .def("grad_ready", &OffloadAdamW::grad_ready, "bucket"_a, "grad"_a, "dtype"_a, "dst"_a = 0)
      .def("absent", &OffloadAdamW::absent, "bucket"_a)
      .def("finish", &OffloadAdamW::finish, "global_sum_of_squares"_a = nb::none())
      .def("arrived_sum_of_squares", &OffloadAdamW::arrived_sum_of_squares)
      .def("abort", &OffloadAdamW::abort)
      .def("counters", &OffloadAdamW::counters)
      .def_prop_ro("step", &OffloadAdamW::step)
      .def_prop_ro("threads", &OffloadAdamW::threads)
      .def_prop_ro("state_bytes", &OffloadAdamW::state_bytes)
      .def_prop_ro("undo_bytes", &OffloadAdamW::undo_bytes)
      .def_prop_ro("device_name", &OffloadAdamW::device_name);
  m.def("reference_adamw_step", &reference_step, "lr"_a, "beta1"_a, "beta2"_a, "eps"_a,
        "weight_decay"_a, "clip"_a, "p"_a, "m"_a, "v"_a, "g"_a, "sizes"_a, "step"_a,
        "spillway::optim::reference_adamw_step over fp32 arrays (tests)");
}

}  // namespace spillway::python
