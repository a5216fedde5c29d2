// The weight streamer driven from Python (spillway.torch.stream_weights): a device (the
// host backend for CPU tensors, CUDA for GPU ones) with torch's stream adopted, and a
// WeightStreamer over caller-owned memory: the pinned host slabs and the device slots are
// torch tensors the adapter allocated (docs/python.md: tensors cross as pointers).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "adopted_device.hpp"
#include "bindings.hpp"
#include "spillway/core/error.hpp"
#include "spillway/stream/weight_streamer.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace spillway::python {
namespace {

std::vector<void*> pointers(const std::vector<uintptr_t>& v) {
  std::vector<void*> out;
  out.reserve(v.size());
  for (uintptr_t p : v)
    out.push_back(reinterpret_cast<void*>(p));  // NOLINT(performance-no-int-to-ptr)
  return out;
}

class StreamSession {
 public:
  StreamSession(const std::string& device, int ordinal, uintptr_t native_stream,
                const std::vector<size_t>& layer_bytes, int depth, bool training,
                const std::vector<uintptr_t>& host_slabs, const std::vector<uintptr_t>& slots,
                double h2d_gbps, nb::object keepalive)
      : keepalive_(std::move(keepalive)) {
    HostDeviceOptions host;
    host.device_bytes = int64_t{1} << 20;  // the slots are the caller's
    host.h2d_gbps = h2d_gbps;
    dev_ = std::make_unique<AdoptedDevice>(device, ordinal, native_stream, host, "stream_weights");
    WeightStreamOptions o;
    o.depth = depth;
    o.training = training;
    o.static_slots = true;  // each layer's parameters are views of one fixed slot
    o.host_slabs = pointers(host_slabs);
    o.device_slots = pointers(slots);
    streamer_ = std::make_unique<WeightStreamer>(*dev_->device, dev_->compute, layer_bytes, o);
  }
  // streamer_ (which waits for its copies) before dev_, both before keepalive_: the owners of
  // the slabs and slots outlive every copy into them (declaration order); the adopted side
  // stream is forgotten before dev_ goes.
  ~StreamSession() {
    streamer_.reset();
    if (side_native_ != 0) dev_->device->destroy_stream(side_);
  }
  StreamSession(const StreamSession&) = delete;
  StreamSession& operator=(const StreamSession&) = delete;

  // The slot holding `layer` (its address): torch work after this call sees the weights
  // (CPU tensors: the call returns once they are there).
  uintptr_t acquire(int layer) {
    nb::gil_scoped_release release;
    return reinterpret_cast<uintptr_t>(streamer_->acquire(layer));
  }
  void release(int layer) { streamer_->release(layer); }
  // The visit `ahead` after the last acquired: its layer (-1: its copy is not issued yet),
  // once `native_stream` waits for its copy (0: the compute stream, which for CPU tensors
  // is the caller: the call returns when the copy has landed). Note [Sharded streaming in
  // PyTorch]: the adapter's all-gathers ahead of the block.
  int ahead_ready(int ahead, uintptr_t native_stream) {
    const WeightStreamer::Upcoming u = streamer_->upcoming(ahead);
    if (u.layer < 0) return -1;
    Stream s = dev_->compute;
    if (native_stream != 0) {
      if (side_native_ != native_stream) {
        if (side_native_ != 0) dev_->device->destroy_stream(side_);
        side_ = dev_->device->adopt_stream(
            reinterpret_cast<void*>(native_stream),  // NOLINT(performance-no-int-to-ptr)
            StreamRole::kCompute);
        side_native_ = native_stream;
      }
      s = side_;
    }
    nb::gil_scoped_release release;
    dev_->device->wait(s, u.ready);
    return u.layer;
  }
  void step_end() { streamer_->step_end(); }
  size_t slot_bytes() const { return streamer_->slot_bytes(); }
  nb::typed<nb::dict, nb::str, nb::object> telemetry() {
    WeightStreamTelemetry t;
    {
      nb::gil_scoped_release release;
      t = streamer_->telemetry();
    }
    nb::dict d;
    d["visits"] = t.visits;
    d["loads"] = t.loads;
    d["hits"] = t.hits;
    d["bytes"] = t.bytes;
    d["copy_ms"] = t.copy_ms;
    d["stall_ms"] = t.stall_ms;
    d["gbps"] = t.gbps;
    d["mean_slots_ahead"] = t.mean_slots_ahead;
    d["late_acquires"] = t.late_acquires;
    d["steps"] = t.steps;
    return nb::typed<nb::dict, nb::str, nb::object>(d);
  }
  std::string device_name() const { return dev_->device->name(); }

 private:
  nb::object keepalive_;                // the Python owners of the slabs and slots (destroyed last)
  std::unique_ptr<AdoptedDevice> dev_;  // outlives the streamer
  std::unique_ptr<WeightStreamer> streamer_;
  uintptr_t side_native_ = 0;  // the stream ahead_ready last adopted (CUDA: the gathers')
  Stream side_{-1};
};

}  // namespace

void bind_stream(nb::module_& m) {
  nb::class_<StreamSession>(m, "StreamSession",
                            "A WeightStreamer over torch-owned host slabs and device slots "
                            "(spillway.torch.stream_weights drives it)")
      .def(nb::init<const std::string&, int, uintptr_t, const std::vector<size_t>&, int, bool,
                    const std::vector<uintptr_t>&, const std::vector<uintptr_t>&, double,
                    nb::object>(),
           "device"_a, "ordinal"_a, "native_stream"_a, "layer_bytes"_a, "depth"_a, "training"_a,
           "host_slabs"_a, "slots"_a, "h2d_gbps"_a = 0.0, "keepalive"_a = nb::none())
      .def("acquire", &StreamSession::acquire, "layer"_a)
      .def("release", &StreamSession::release, "layer"_a)
      .def("ahead_ready", &StreamSession::ahead_ready, "ahead"_a, "native_stream"_a = 0)
      .def("step_end", &StreamSession::step_end)
      .def("telemetry", &StreamSession::telemetry)
      .def_prop_ro("slot_bytes", &StreamSession::slot_bytes)
      .def_prop_ro("device_name", &StreamSession::device_name);
}

}  // namespace spillway::python
