// The activation offload engine: in forward, saved tensors are copied to pinned host
// memory on the D2H copy engine as soon as their producer has run (the copy waits on an
// event, never on the host) and their device memory is released once the copy is done;
// in backward they are reloaded ahead of use on the H2D engine, and the compute stream is
// ordered after each reload. DESIGN section 2.
//
// Guarantees:
//   - every reloaded byte equals what was offloaded (verify mode checks it with checksums);
//   - in-flight D2H bytes never exceed the bound: an offload waits (back-pressure, counted
//     as stall), before its copy is enqueued, until the oldest copies leave room for it (a
//     tensor larger than the bound alone waits for all of them and goes alone);
//   - a full pinned pool falls back to keeping the tensor on the device (counted); a full
//     device pool waits for pending frees, then falls back to a direct allocation
//     (counted): nothing crashes, nothing is dropped;
//   - pools, handle slots and events are sized once: no device or pinned allocation per
//     tensor in steady state.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "spillway/device.hpp"
#include "spillway/hooks.hpp"
#include "spillway/policy.hpp"

namespace spillway {

struct OffloadOptions {
  int64_t pinned_bytes = int64_t{1} << 30;  // host pool for offloaded tensors
  int pinned_slabs = 4;
  int64_t device_pool_bytes = int64_t{256} << 20;  // device pool: reloads and allocate()
  int64_t inflight_bound_bytes = 0;                // 0: no bound on D2H bytes in flight
  bool verify = false;                             // checksums at offload, checked at reload
  int max_tensors = 1024;                          // handles alive at once (offloaded + reloaded)
};

struct DeviceTensor {
  void* ptr = nullptr;
  size_t bytes = 0;
  int block_slab = -1;  // engine pool block (-1: direct allocation)
  size_t block_offset = 0;
  bool direct = false;  // allocated outside the pool (fallback)
  explicit operator bool() const { return ptr != nullptr; }
};

using OffloadHandle = int;

// When an offloaded tensor's device memory goes back (Note [Offload hold]).
enum class OffloadHold {
  kUntilCopied,    // as soon as its D2H copy is done: the caller no longer reads it
  kUntilLayerEnd,  // also not before end_forward_layer(layer): the forward still reads it
};

struct LayerTelemetry {
  int layer = 0;
  int64_t d2h_bytes = 0;
  int64_t h2d_bytes = 0;
  double d2h_gbps = 0.0;  // bytes over the time from its first copy start to its last end
  double h2d_gbps = 0.0;
  int64_t backlog_bytes = 0;  // D2H bytes not yet on the host when its forward ended
  double stall_ms = 0.0;      // compute waiting for this layer's reloads
  bool late = false;          // its copies were not done when the next layer's forward ended
};

struct StepTelemetry {
  std::vector<LayerTelemetry> layers;
  int64_t d2h_bytes = 0;
  int64_t h2d_bytes = 0;
  double d2h_gbps = 0.0;  // achieved: bytes over the sum of the layers' copy times
  double h2d_gbps = 0.0;
  double stall_ms = 0.0;  // reload waits + back-pressure
  double backpressure_ms = 0.0;
  double overlap_ratio = 1.0;  // 1 - exposed copy time / copy time
  bool snowball = false;
  std::optional<int> snowball_first_layer;
  int tensors_offloaded = 0;
  int fallback_kept = 0;           // pinned pool full: kept on the device
  int fallback_direct = 0;         // device pool full: allocated directly
  int64_t device_allocations = 0;  // Device::allocate calls during the step (all kinds)
};

class OffloadEngine {
 public:
  // Allocates the pools, handle slots and events now; creates its D2H and H2D streams.
  OffloadEngine(Device& device, Stream compute, MemoryPolicy policy, OffloadOptions options);
  ~OffloadEngine();
  OffloadEngine(const OffloadEngine&) = delete;
  OffloadEngine& operator=(const OffloadEngine&) = delete;

  // Device memory from the engine's pool (waits for pending frees when full).
  DeviceTensor allocate(size_t bytes);
  // Gives device memory back once the compute stream has reached this point.
  void free(DeviceTensor t);

  void begin_step();
  bool wants(int layer, std::string_view name) const { return policy_.wants(layer, name); }
  // Forward: call after the work producing `t` is enqueued on the compute stream. Takes
  // ownership of t (released when its copy is done, and with kUntilLayerEnd not before
  // end_forward_layer(layer), so that the rest of the layer may still read it).
  OffloadHandle offload(DeviceTensor t, int layer, std::string_view name,
                        OffloadHold hold = OffloadHold::kUntilCopied);
  void end_forward_layer(int layer);
  // Backward: issue the reloads of `layer` (normally layer - prefetch_depth ahead), after
  // those of the layers above it not issued yet (backward needs them first).
  void prefetch(int layer);
  // The tensor back on the device; work enqueued on the compute stream after this call
  // sees its bytes. The caller frees it with free() when its backward is done.
  DeviceTensor reload(OffloadHandle h);
  // Waits for the engine's streams, checks verify-mode checksums, returns the telemetry.
  StepTelemetry end_step();

  const MemoryPolicy& policy() const { return policy_; }
  // Handles alive at once (OffloadOptions::max_tensors).
  int max_tensors() const;
  // D2H bytes issued and not yet known complete (as of the last engine call).
  int64_t inflight_bytes() const;
  Stream d2h_stream() const;
  Stream h2d_stream() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  MemoryPolicy policy_;
};

// The engine on the socket (spillway/hooks.hpp): a training loop's saved tensors go to
// the engine when its policy wants them (Note [Saved tensor ownership]: given tensors
// only, freed by the engine once copied and, with hold_until_forward_end, not before the
// layer's forward ends); backward_begin(i) prefetches the layers below i, prefetch_depth
// deep; needed() hands back the reload from the engine's device pool and done() returns
// it; step_end() collects the step's telemetry.
class OffloadHooks final : public TrainingHooks {
 public:
  explicit OffloadHooks(OffloadEngine& engine);

  void step_begin() override;
  SavedTicket saved(int layer, std::string_view name, const SavedTensor& t) override;
  void forward_end(int layer) override;
  void backward_begin(int layer) override;
  void* needed(const SavedTicket& ticket, void* dst) override;
  void done(const SavedTicket& ticket) override;
  void step_end() override;

  // The telemetry of the last step_end().
  const StepTelemetry& telemetry() const { return telemetry_; }

 private:
  OffloadEngine& engine_;
  std::vector<DeviceTensor> reloaded_;  // by handle: what needed() handed out (sized once)
  StepTelemetry telemetry_;
};

}  // namespace spillway
