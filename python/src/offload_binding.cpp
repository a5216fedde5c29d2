// The activation offload engine on the socket, driven from Python (spillway.torch's
// offload_activations): a device (the host backend for CPU tensors, CUDA for GPU ones), the
// caller's compute stream adopted (Note [Adopted streams]), the engine and its hooks. The
// adapter calls the hooks in the socket's order (spillway/device/hooks.hpp) with borrowed memory:
// a torch tensor's storage, which the adapter keeps alive until copies_done() says its copy
// is complete (never record_stream); reloads land in tensors the adapter allocated.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "adopted_device.hpp"
#include "bindings.hpp"
#include "spillway/core/error.hpp"
#include "spillway/core/policy.hpp"
#include "spillway/device/device.hpp"
#include "spillway/device/hooks.hpp"
#include "spillway/offload/offload.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace spillway::python {
namespace {

// A tensor's data pointer, as Python hands it over (Tensor.data_ptr()).
void* as_ptr(uintptr_t p) {
  return reinterpret_cast<void*>(p);  // NOLINT(performance-no-int-to-ptr)
}

// Per layer, the saved tensors by name and what happens to each: the engine offloads
// those marked "offload" (MemoryPolicy, spillway/core/policy.hpp).
MemoryPolicy make_policy(
    const std::vector<std::vector<std::pair<std::string, std::string>>>& layers,
    int prefetch_depth) {
  MemoryPolicy p;
  p.name = "python";
  p.prefetch_depth = prefetch_depth;
  for (const auto& layer : layers) {
    LayerActions a;
    for (const auto& [name, action] : layer) {
      a.tensors.push_back(name);
      if (action == "offload") {
        a.actions.push_back(Action::kOffload);
      } else if (action == "keep") {
        a.actions.push_back(Action::kKeep);
      } else if (action == "recompute") {
        a.actions.push_back(Action::kRecompute);
      } else {
        SPILLWAY_FIELD_ERROR("action", "'" + action + "'",
                             "must be 'keep', 'offload' or 'recompute' (tensor {})", name);
      }
    }
    p.layers.push_back(std::move(a));
  }
  return p;
}

// The device, the adopted compute stream, the engine and its hooks, made once and used
// every step (pools are sized here, never per tensor).
class OffloadSession {
 public:
  OffloadSession(const std::string& device, int ordinal, uintptr_t native_stream,
                 const std::vector<std::vector<std::pair<std::string, std::string>>>& layers,
                 int prefetch_depth, int64_t pinned_bytes, int64_t device_pool_bytes,
                 int64_t inflight_bound_bytes, int max_tensors, bool verify, double d2h_gbps,
                 double h2d_gbps, int copy_batch) {
    if (prefetch_depth < 1 || prefetch_depth > 64)
      SPILLWAY_FIELD_ERROR("prefetch_depth", prefetch_depth, "must be in [1, 64]");
    if (pinned_bytes < 1) SPILLWAY_FIELD_ERROR("pinned_bytes", pinned_bytes, "must be >= 1");
    if (device_pool_bytes < 1)
      SPILLWAY_FIELD_ERROR("device_pool_bytes", device_pool_bytes, "must be >= 1");
    if (inflight_bound_bytes < 0)
      SPILLWAY_FIELD_ERROR("inflight_bound_bytes", inflight_bound_bytes, "must be >= 0");
    if (max_tensors < 1) SPILLWAY_FIELD_ERROR("max_tensors", max_tensors, "must be >= 1");
    if (copy_batch < 1 || copy_batch > max_tensors)
      SPILLWAY_FIELD_ERROR("copy_batch", copy_batch, "must be in [1, max_tensors = {}]",
                           max_tensors);
    // CPU tensors: the host backend (its copies are memcpy on the copy streams' threads,
    // with the given throttles; its arena holds only the engine's own device pool) and an
    // inline compute stream: a reload's wait blocks the unpack hook until the bytes are
    // there, and nothing waits on a worker thread.
    HostDeviceOptions o;
    o.device_bytes = device_pool_bytes + (int64_t{1} << 20);
    o.d2h_gbps = d2h_gbps;
    o.h2d_gbps = h2d_gbps;
    // Both ways throttled: a link whose speed set_link_gbps changes (Note [A link that
    // changes speed]); its copies are scheduled as the stream throttles schedule them.
    if (device == "host" && d2h_gbps > 0 && h2d_gbps > 0) {
      link_ = std::make_shared<HostLink>(h2d_gbps, d2h_gbps);
      o.link = link_;
    }
    adopted_ = std::make_unique<AdoptedDevice>(device, ordinal, native_stream, o, "offload");
    device_ = adopted_->device.get();
    compute_ = adopted_->compute;
    OffloadOptions oo;
    oo.pinned_bytes = pinned_bytes;
    oo.device_pool_bytes = device_pool_bytes;
    oo.inflight_bound_bytes = inflight_bound_bytes;
    oo.max_tensors = max_tensors;
    oo.verify = verify;
    oo.copy_batch = copy_batch;
    engine_ = std::make_unique<OffloadEngine>(*device_, compute_,
                                              make_policy(layers, prefetch_depth), oo);
    hooks_ = std::make_unique<OffloadHooks>(*engine_);
    tickets_.resize(static_cast<size_t>(max_tensors));
    order_.reserve(static_cast<size_t>(max_tensors));
  }

  ~OffloadSession() {
    probe_.reset();
    hooks_.reset();
    engine_.reset();
  }
  OffloadSession(const OffloadSession&) = delete;
  OffloadSession& operator=(const OffloadSession&) = delete;

  void step_begin() {
    hooks_->step_begin();
    order_.clear();
    done_ = 0;
  }
  void forward_begin(int layer) { hooks_->forward_begin(layer); }
  bool wants(int layer, const std::string& name) const { return engine_->wants(layer, name); }
  // A borrowed saved tensor: the ticket id, or -1 when the engine did not take it (not
  // wanted, or the pinned pool is full: the caller keeps it).
  // (The name as a view of Python's string: a plan's names are longer than a short
  // string's buffer, and nothing is allocated per tensor.)
  int saved(int layer, std::string_view name, uintptr_t data, size_t bytes) {
    SavedTensor t;
    t.data = as_ptr(data);
    t.bytes = bytes;
    t.give = false;
    const SavedTicket k = hooks_->saved(layer, name, t);
    if (!k) return -1;
    tickets_.at(static_cast<size_t>(k.id)) = k;
    order_.push_back(k.id);  // within the capacity reserved: a step's saves <= max_tensors
    return k.id;
  }
  // How many of this step's tickets, in the order saved() handed them out, have been
  // copied, counted from the first: the adapter drops that many of the sources it holds
  // (one call for a few tensors, not one per ticket). Grows within a step.
  int copies_done() {
    while (done_ < order_.size() && engine_->copied(order_[done_])) ++done_;
    return static_cast<int>(done_);
  }
  void forward_end(int layer) { hooks_->forward_end(layer); }
  void will_need(int id, uintptr_t dst) { hooks_->will_need(ticket(id), as_ptr(dst)); }
  // will_need of each (ticket, destination) pair in order: one call per block's reloads
  // (Note [Reloads in slabs], spillway/torch/_offload_engine.py).
  void will_need_many(const std::vector<int>& ids, const std::vector<uintptr_t>& dsts) {
    SPILLWAY_CHECK(ids.size() == dsts.size(), "will_need_many: {} tickets, {} destinations",
                   ids.size(), dsts.size());
    batch_tickets_.clear();
    batch_dsts_.clear();
    for (size_t i = 0; i < ids.size(); ++i) {
      batch_tickets_.push_back(ticket(ids[i]));
      batch_dsts_.push_back(as_ptr(dsts[i]));
    }
    hooks_->will_need_many(batch_tickets_.data(), batch_dsts_.data(), ids.size());
  }
  void backward_begin(int layer) { hooks_->backward_begin(layer); }
  // The tensor of ticket `id` back in `dst` (caller-allocated, the ticket's bytes). Work on
  // the compute stream after this call sees the bytes; on the inline stream of CPU tensors
  // the call returns once they are there.
  void needed(int id, uintptr_t dst) { hooks_->needed(ticket(id), as_ptr(dst)); }
  // Ends the step: waits for the engine's streams and returns its telemetry.
  nb::typed<nb::dict, nb::str, nb::object> step_end() {
    hooks_->step_end();
    const StepTelemetry& t = hooks_->telemetry();
    nb::dict d;
    d["d2h_bytes"] = t.d2h_bytes;
    d["h2d_bytes"] = t.h2d_bytes;
    d["d2h_gbps"] = t.d2h_gbps;
    d["h2d_gbps"] = t.h2d_gbps;
    d["stall_ms"] = t.stall_ms;
    d["backpressure_ms"] = t.backpressure_ms;
    d["overlap_ratio"] = t.overlap_ratio;
    d["snowball"] = t.snowball;
    if (t.snowball_first_layer) {
      d["snowball_first_layer"] = *t.snowball_first_layer;
    } else {
      d["snowball_first_layer"] = nb::none();
    }
    d["tensors_offloaded"] = t.tensors_offloaded;
    d["fallback_kept"] = t.fallback_kept;
    d["reloads_staged"] = t.reloads_staged;
    d["fallback_direct"] = t.fallback_direct;
    d["device_allocations"] = t.device_allocations;
    nb::list layers;
    for (const LayerTelemetry& l : t.layers) {
      nb::dict ld;
      ld["layer"] = l.layer;
      ld["d2h_bytes"] = l.d2h_bytes;
      ld["h2d_bytes"] = l.h2d_bytes;
      ld["d2h_gbps"] = l.d2h_gbps;
      ld["h2d_gbps"] = l.h2d_gbps;
      ld["backlog_bytes"] = l.backlog_bytes;
      ld["stall_ms"] = l.stall_ms;
      ld["late"] = l.late;
      layers.append(ld);
    }
    d["layers"] = layers;
    return nb::typed<nb::dict, nb::str, nb::object>(d);
  }
  std::string device_name() const { return device_->name(); }
  // The emulated link's new speed, from the next copy on (a session made with both
  // throttles); between steps.
  void set_link_gbps(double d2h_gbps, double h2d_gbps) {
    if (!link_)
      SPILLWAY_INPUT_ERROR(
          "set_link_gbps: this session's link has no throttle to change (make it with d2h_gbps "
          "and h2d_gbps > 0, on CPU tensors)");
    link_->set_gbps(h2d_gbps, d2h_gbps);
  }
  // The device->host bandwidth a 1 MiB probe copy reaches now (between steps).
  double probe_d2h_gbps() {
    if (!probe_made_) {
      probe_ = UniqueStream(*device_, StreamRole::kD2H);
      probe_made_ = true;
    }
    return measure_d2h_gbps(*device_, size_t{1} << 20, probe_.get());
  }
  int64_t inflight_bytes() const { return engine_->inflight_bytes(); }
  int max_tensors() const { return engine_->max_tensors(); }

 private:
  std::shared_ptr<HostLink> link_;  // before the device, which copies through it
  UniqueStream probe_;              // probe_d2h_gbps's stream, made at its first use
  bool probe_made_ = false;
  const SavedTicket& ticket(int id) const {
    if (id < 0 || static_cast<size_t>(id) >= tickets_.size() || !tickets_[static_cast<size_t>(id)])
      SPILLWAY_FIELD_ERROR("ticket", id, "is not a ticket of this step");
    return tickets_[static_cast<size_t>(id)];
  }
  std::unique_ptr<AdoptedDevice> adopted_;
  Device* device_ = nullptr;  // adopted_'s
  Stream compute_;
  std::unique_ptr<OffloadEngine> engine_;
  std::unique_ptr<OffloadHooks> hooks_;
  std::vector<SavedTicket> tickets_;  // by id (sized once: max_tensors)
  std::vector<int> order_;            // this step's ticket ids as saved() handed them out
  size_t done_ = 0;                   // how many of order_ copies_done() saw copied
  // will_need_many's arguments (grown to a block's reloads once, then reused).
  std::vector<SavedTicket> batch_tickets_;
  std::vector<void*> batch_dsts_;
};

// MemAvailable of /proc/meminfo in bytes (-1 when unknown): the adapter refuses a pinned
// pool larger than the host can give. C stdio, no iostreams: on the GPU machine (g++ 13,
// Ubuntu 24.04, torch loaded) `ifstream >> long` in this module crashed inside the locale's
// num_get facet (docs/gpu.md, the first run), and stdio needs no locale facets.
int64_t host_available_bytes() {
  std::FILE* f = std::fopen("/proc/meminfo", "r");
  if (f == nullptr) return -1;
  char line[256];
  int64_t out = -1;
  while (std::fgets(line, sizeof line, f) != nullptr) {
    if (std::strncmp(line, "MemAvailable:", 13) == 0) {
      char* end = nullptr;
      const long long kb = std::strtoll(line + 13, &end, 10);
      if (end != line + 13 && kb >= 0) out = static_cast<int64_t>(kb) * 1024;
      break;
    }
  }
  std::fclose(f);
  return out;
}

}  // namespace

void bind_offload(nb::module_& m) {
  nb::class_<OffloadSession>(m, "OffloadSession",
                             "The activation offload engine and its hooks on one device "
                             "(spillway.torch.offload_activations drives it)")
      .def(nb::init<const std::string&, int, uintptr_t,
                    const std::vector<std::vector<std::pair<std::string, std::string>>>&, int,
                    int64_t, int64_t, int64_t, int, bool, double, double, int>(),
           "device"_a, "ordinal"_a, "native_stream"_a, "layers"_a, "prefetch_depth"_a,
           "pinned_bytes"_a, "device_pool_bytes"_a, "inflight_bound_bytes"_a, "max_tensors"_a,
           "verify"_a, "d2h_gbps"_a, "h2d_gbps"_a, "copy_batch"_a = 1)
      .def("step_begin", &OffloadSession::step_begin)
      .def("forward_begin", &OffloadSession::forward_begin, "layer"_a)
      .def("wants", &OffloadSession::wants, "layer"_a, "name"_a)
      .def("saved", &OffloadSession::saved, "layer"_a, "name"_a, "data"_a, "bytes"_a)
      .def("copies_done", &OffloadSession::copies_done)
      .def("forward_end", &OffloadSession::forward_end, "layer"_a)
      .def("will_need", &OffloadSession::will_need, "ticket"_a, "dst"_a)
      .def("will_need_many", &OffloadSession::will_need_many, "tickets"_a, "dsts"_a)
      .def("backward_begin", &OffloadSession::backward_begin, "layer"_a)
      .def("needed", &OffloadSession::needed, "ticket"_a, "dst"_a)
      .def("step_end", &OffloadSession::step_end)
      .def("set_link_gbps", &OffloadSession::set_link_gbps, "d2h_gbps"_a, "h2d_gbps"_a)
      .def("probe_d2h_gbps", &OffloadSession::probe_d2h_gbps)
      .def_prop_ro("device_name", &OffloadSession::device_name)
      .def_prop_ro("inflight_bytes", &OffloadSession::inflight_bytes)
      .def_prop_ro("max_tensors", &OffloadSession::max_tensors);
  m.def("host_available_bytes", &host_available_bytes,
        "MemAvailable of /proc/meminfo in bytes, -1 when unknown");
}

}  // namespace spillway::python
