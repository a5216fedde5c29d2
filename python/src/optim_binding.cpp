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
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "adopted_device.hpp"
#include "bindings.hpp"
#include "spillway/core/error.hpp"
#include "spillway/optim/optim.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace spillway::python {
namespace {

using optim::AdamW;
using optim::AdamWParams;
using optim::Bucket;
using optim::StvAdamW;
using optim::StvOutcome;

// What a parameter's memory holds (torch dtypes the optimizer takes): 0 float32, 1 bfloat16.
optim::ParamDtype to_dtype(int d) {
  if (d != 0 && d != 1) SPILLWAY_FIELD_ERROR("dtype", d, "must be 0 (float32) or 1 (bfloat16)");
  return static_cast<optim::ParamDtype>(d);
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

nb::typed<nb::dict, nb::str, int64_t> counters_dict(const optim::StvCounters& c) {
  nb::dict d;
  d["commits"] = c.commits;
  d["replays"] = c.replays;
  d["skips"] = c.skips;
  d["deferred"] = c.deferred;
  d["unspeculated_steps"] = c.unspeculated_steps;
  return nb::typed<nb::dict, nb::str, int64_t>(d);
}

const char* outcome_name(StvOutcome o) {
  return o == StvOutcome::kCommit ? "commit" : o == StvOutcome::kReplay ? "replay" : "skip";
}

// spillway::optim::SpeculativeCpuAdamW for Python (Note [Speculative CPU AdamW over
// parameters]): addresses and dtype codes become pointers and ParamDtype, and every call
// that waits for the worker releases the GIL.
class CpuAdamW {
 public:
  CpuAdamW(const std::vector<int64_t>& sizes, double clip, bool speculative, int threads)
      : opt_(sizes, clip, speculative, threads) {}

  void set_hparams(int b, double lr, double beta1, double beta2, double eps, double wd) {
    const AdamWParams hp = make_hp(lr, beta1, beta2, eps, wd);
    nb::gil_scoped_release release;
    opt_.set_hparams(b, hp);
  }
  int64_t bucket_step(int b) const { return opt_.bucket_step(b); }
  void set_bucket_step(int b, int64_t t) {
    nb::gil_scoped_release release;
    opt_.set_bucket_step(b, t);
  }
  void load_weights(int b, uintptr_t src, int dtype) {
    const optim::ParamDtype d = to_dtype(dtype);
    nb::gil_scoped_release release;
    opt_.load_weights(b, as_cptr(src), d);
  }
  void store_weights(int b, uintptr_t dst, int dtype) {
    opt_.store_weights(b, as_ptr(dst), to_dtype(dtype));
  }
  void store_all(const std::vector<uintptr_t>& dst, const std::vector<int>& dtypes) {
    std::vector<void*> ptrs;
    std::vector<optim::ParamDtype> types;
    ptrs.reserve(dst.size());
    types.reserve(dtypes.size());
    for (uintptr_t d : dst) ptrs.push_back(as_ptr(d));
    for (int t : dtypes) types.push_back(to_dtype(t));
    nb::gil_scoped_release release;
    opt_.store_all(ptrs, types);
  }
  // Note [Weights shared with the parameters].
  std::pair<uintptr_t, uintptr_t> weight_buffers(int b) {
    nb::gil_scoped_release release;
    const auto [first, second] = opt_.weight_buffers(b);
    return {reinterpret_cast<uintptr_t>(first), reinterpret_cast<uintptr_t>(second)};
  }
  nb::bytes current_buffers() {
    std::vector<uint8_t> cur;
    {
      nb::gil_scoped_release release;
      cur = opt_.current_buffers();
    }
    return nb::bytes(reinterpret_cast<const char*>(cur.data()), cur.size());
  }
  void read_state(int b, uintptr_t p, uintptr_t m, uintptr_t v) {
    nb::gil_scoped_release release;
    opt_.read_state(b, static_cast<float*>(as_ptr(p)), static_cast<float*>(as_ptr(m)),
                    static_cast<float*>(as_ptr(v)));
  }
  void write_state(int b, uintptr_t p, uintptr_t m, uintptr_t v) {
    nb::gil_scoped_release release;
    opt_.write_state(b, static_cast<const float*>(as_cptr(p)),
                     static_cast<const float*>(as_cptr(m)), static_cast<const float*>(as_cptr(v)));
  }
  void grad_ready(int b, uintptr_t g, int dtype, uintptr_t dst) {
    opt_.grad_ready(b, as_cptr(g), to_dtype(dtype), as_ptr(dst));
  }
  void absent(int b) { opt_.absent(b); }
  // (outcome, the gradient scale, ms the worker spent on this step's buckets, ms finish()
  // took).
  std::tuple<std::string, float, double, double> finish(std::optional<double> global_sq) {
    optim::CpuStepResult r;
    {
      nb::gil_scoped_release release;
      r = opt_.finish(global_sq);
    }
    return {outcome_name(r.outcome), r.scale, r.worker_ms, r.finish_ms};
  }
  double sum_of_squares() {
    nb::gil_scoped_release release;
    return opt_.sum_of_squares();
  }
  double arrived_sum_of_squares() {
    nb::gil_scoped_release release;
    return opt_.arrived_sum_of_squares();
  }
  void abort() {
    nb::gil_scoped_release release;
    opt_.abort();
  }
  int64_t step() const { return opt_.step(); }
  nb::typed<nb::dict, nb::str, int64_t> counters() const { return counters_dict(opt_.counters()); }
  int threads() const { return opt_.threads(); }
  int64_t state_bytes() const { return opt_.state_bytes(); }
  int64_t undo_bytes() const { return opt_.undo_bytes(); }

 private:
  optim::SpeculativeCpuAdamW opt_;
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
        n_(optim::parameter_elements(sizes)),
        pool_(optim::pool_threads(threads)) {
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
    if (to_dtype(dtype) != optim::ParamDtype::kBf16 || grad != grads_ + at * 2)
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
  // call took); with the global sum of squares under FSDP2 (Note [Sharded norms]).
  std::tuple<std::string, float, double, double> finish(std::optional<double> global_sq) {
    nb::gil_scoped_release release;
    const auto t0 = std::chrono::steady_clock::now();
    const StvOutcome o = pipe_->end_step(global_sq);
    const double call_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    const char* name = o == StvOutcome::kCommit   ? "commit"
                       : o == StvOutcome::kReplay ? "replay"
                                                  : "skip";
    return {name, pipe_->last_scale(), pipe_->last_cpu_ms(), call_ms};
  }
  // This process's sum of squares once every gradient was handed over (FSDP2 all-reduces
  // it and passes the sum to finish()).
  double sum_of_squares() {
    nb::gil_scoped_release release;
    return pipe_->sum_of_squares();
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
      .def("weight_buffers", &CpuAdamW::weight_buffers, "bucket"_a,
           "Bucket b's two fp32 weight buffers' addresses (the second 0 where it has none)")
      .def("current_buffers", &CpuAdamW::current_buffers,
           "Per bucket, which weight buffer is current (0 or 1), as bytes")
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
      .def("sum_of_squares", &OffloadAdamW::sum_of_squares)
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
