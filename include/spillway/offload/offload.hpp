// The activation offload engine: in forward, saved tensors are copied to pinned host
// memory on the D2H copy engine as soon as their producer has run (the copy waits on an
// event, never on the host) and their device memory is released once the copy is done;
// in backward they are reloaded ahead of use on the H2D engine, and the compute stream is
// ordered after each reload. docs/offload.md.
//
// Two ways to hand a tensor over, and two ways to get it back (Note [Caller-owned memory]):
//   offload(DeviceTensor)      the engine takes the device memory and frees it once copied;
//   offload_borrowed(ptr)      the caller keeps it; the returned event says when the copy
//                              has read it (the caller waits on it before reusing it);
//   reload(h)                  into a block of the engine's device pool, given back with free();
//   reload_into(h, dst)        into device memory the caller allocated.
// Any handle can be reloaded either way (with reload_into only, once it has a
// set_reload_target).
//
// Guarantees:
//   - every reloaded byte equals what was offloaded (verify mode checks it with checksums);
//   - in-flight D2H bytes never exceed the bound: an offload waits (back-pressure, counted
//     as stall), before its copy is enqueued, until the oldest copies leave room for it (a
//     tensor larger than the bound alone waits for all of them and goes alone);
//   - a full pinned pool falls back to keeping the tensor on the device (counted): an owned
//     tensor in the engine's hands, a borrowed one in the caller's (BorrowedOffload::kept);
//     a full device pool waits for pending frees, then falls back to a direct allocation
//     (counted): nothing crashes, nothing is dropped;
//   - pools, handle slots and events are sized once: no device or pinned allocation per
//     tensor in steady state, in either mode.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "spillway/core/policy.hpp"
#include "spillway/device/device.hpp"
#include "spillway/device/hooks.hpp"

namespace spillway {

struct OffloadOptions {
  int64_t pinned_bytes = int64_t{1} << 30;  // host pool for offloaded tensors
  int pinned_slabs = 4;
  int64_t device_pool_bytes = int64_t{256} << 20;  // device pool: reloads and allocate()
  int64_t inflight_bound_bytes = 0;                // 0: no bound on D2H bytes in flight
  bool verify = false;                             // checksums at offload, checked at reload
  int max_tensors = 1024;                          // handles alive at once (offloaded + reloaded)
  // D2H copies enqueued together after one fence on the compute stream, in [1,
  // max_tensors]: 1 enqueues each at once; n > 1 queues them until n are waiting or the
  // layer's forward ends (Note [Copies in batches]: one copy per tensor on the D2H stream
  // instead of four stream operations; BorrowedOffload::copied is then empty).
  int copy_batch = 1;
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

// What offload_borrowed() did with a tensor the caller keeps owning.
struct BorrowedOffload {
  OffloadHandle handle = -1;
  // Complete once the D2H copy has read the source: the caller waits on it (Device::wait
  // on the stream that reuses the memory, or query/synchronize on the host) before it
  // overwrites or frees the source. One of the engine's pre-sized events, valid until
  // end_step() (which completes it); it is recycled for another tensor after that, so
  // neither wait on it nor query it then. Empty (id -1) when `kept`, and when the copy is
  // queued for a batch (OffloadOptions::copy_batch > 1): then OffloadEngine::copied(handle)
  // says whether it is done, and copy_event(handle) is its event once it is enqueued.
  Event copied;
  // The pinned pool was full, nothing was copied: the engine cannot keep a tensor it does
  // not own, so the caller keeps it alive and unchanged until the compute stream has
  // passed the handle's reload()/reload_into(), which enqueue a device-to-device copy from
  // it there (a stream-ordered free right after the call is fine; if the handle is never
  // reloaded, until end_step()). Counted in StepTelemetry::fallback_kept.
  bool kept = false;
};

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
  int reloads_staged = 0;          // reload_into() of a reload prefetched into the engine's
                                   // pool: one more device-to-device copy (set_reload_target)
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
  // Forward, memory the caller owns and keeps owning (a framework's tensor): `bytes` at
  // `src`, produced by work enqueued on the compute stream before this call. The engine
  // copies it to pinned memory and never frees it; see BorrowedOffload for the event the
  // caller waits on before reusing it, and for the pinned-pool-full case.
  BorrowedOffload offload_borrowed(const void* src, size_t bytes, int layer, std::string_view name);
  void end_forward_layer(int layer);
  // Backward: issue the reloads of `layer` (normally layer - prefetch_depth ahead), after
  // those of the layers above it not issued yet (backward needs them first). A reload
  // lands in its set_reload_target() destination if it has one, else in a block of the
  // engine's device pool.
  void prefetch(int layer);
  // The tensor back on the device; work enqueued on the compute stream after this call
  // sees its bytes. The caller frees it with free() when its backward is done. Not for a
  // handle given a set_reload_target() (an error: use reload_into).
  DeviceTensor reload(OffloadHandle h);
  // The tensor back in `dst`, device memory of the handle's bytes the caller allocated;
  // work enqueued on the compute stream after this call sees the bytes; the host never
  // blocks. Whatever compute work was enqueued before this call (or before
  // set_reload_target) may still have used dst: the copy into it is ordered after that.
  // A reload prefetch() already issued without a destination landed in the engine's pool:
  // it is copied device-to-device into dst on the compute stream and its block goes back
  // (counted in reloads_staged). Note [Reload into caller memory].
  void reload_into(OffloadHandle h, void* dst);
  // The destination of `h`'s reload, known before prefetch() issues it: the H2D copy then
  // writes dst directly (no pool block, no extra copy). From this call until reload_into(h,
  // dst) the engine owns dst's bytes: compute work enqueued in between must not use it.
  // Returns false, and changes nothing, when the reload is already issued into the pool
  // or the tensor was kept on the device (reload_into copies on the compute stream then).
  bool set_reload_target(OffloadHandle h, void* dst);
  // set_reload_target() of each of `n` handles, in one call: one fence on the compute
  // stream for all of them (Note [One fence per batch]); compute work enqueued before this
  // call may still use the destinations. Returns how many got theirs (the others, issued
  // or kept, are left as set_reload_target leaves them).
  size_t set_reload_targets(const OffloadHandle* h, void* const* dst, size_t n);
  // Waits for the engine's streams, checks verify-mode checksums, returns the telemetry.
  StepTelemetry end_step();

  const MemoryPolicy& policy() const { return policy_; }
  // Handles alive at once (OffloadOptions::max_tensors).
  int max_tensors() const;
  // Whether the D2H copy of `h` (offloaded this step) has read its source: false while it
  // is queued for a batch and for a kept tensor (Note [Copies in batches]).
  bool copied(OffloadHandle h) const;
  // The event after `h`'s D2H copy (BorrowedOffload::copied, valid as long): empty while
  // the copy is queued for a batch (it is enqueued by end_forward_layer of its layer at the
  // latest) and for a kept tensor.
  Event copy_event(OffloadHandle h) const;
  // D2H bytes issued and not yet known complete (as of the last engine call).
  int64_t inflight_bytes() const;
  Stream d2h_stream() const;
  Stream h2d_stream() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  MemoryPolicy policy_;
};

// The engine on the socket (spillway/device/hooks.hpp): a training loop's saved tensors go to
// the engine when its policy wants them (Note [Saved tensor ownership]): a given tensor
// with offload() (freed by the engine once copied and, with hold_until_forward_end, not
// before the layer's forward ends), a borrowed one with offload_borrowed() (the ticket's
// `copied` is its BorrowedOffload::copied, valid until step_end(); when the pinned pool is
// full the ticket is empty: not taken, the loop keeps the tensor, counted in
// fallback_kept); backward_begin(i) prefetches the layers below i, prefetch_depth deep;
// needed(ticket, null) hands back the reload from the engine's device pool and done()
// returns it; needed(ticket, dst) reloads with reload_into() (a reload already prefetched
// is copied from the pool into dst: the socket names no destination ahead of needed()),
// and done() then has nothing to give back; step_end() collects the step's telemetry.
class OffloadHooks final : public TrainingHooks {
 public:
  explicit OffloadHooks(OffloadEngine& engine);

  void step_begin() override;
  SavedTicket saved(int layer, std::string_view name, const SavedTensor& t) override;
  void forward_end(int layer) override;
  void backward_begin(int layer) override;
  void will_need(const SavedTicket& ticket, void* dst) override;
  void will_need_many(const SavedTicket* tickets, void* const* dsts, size_t n) override;
  void* needed(const SavedTicket& ticket, void* dst) override;
  void done(const SavedTicket& ticket) override;
  void step_end() override;

  // The telemetry of the last step_end().
  const StepTelemetry& telemetry() const { return telemetry_; }

 private:
  OffloadEngine& engine_;
  // By handle (sized once): what needed() handed out, the engine's memory or the caller's.
  struct Reloaded {
    DeviceTensor engine;  // needed(ticket, null): given back with done()
    bool into_caller = false;
  };
  std::vector<Reloaded> reloaded_;
  StepTelemetry telemetry_;
};

}  // namespace spillway
