// Layerwise weight streaming (docs/stream.md): the weights of a model that does not fit
// in device memory live in pinned host memory, one slab per layer, and are copied into a
// ring of d+1 device slots while the layers before them compute.
//
// The schedule is the order in which the loop visits the layers: forward only (inference:
// 0, 1, ..., L-1, then the next step's 0, 1, ...) or forward then backward (training: 0..L-1
// then L-1..0). Every visit is acquire(layer) ... compute enqueued ... release(layer), in
// schedule order; acquire returns the slot that holds the layer.
//
// Note [Ring ordering]: ordering is by events only.
//   - a copy into a slot waits on the event recorded at release() of the slot's previous
//     occupant's last visit (its last reader is done);
//   - the compute stream waits, at acquire(), on the event recorded after the copy into
//     the layer's slot (its slot is ready);
//   - nothing else synchronizes: no host synchronize, no stream-wide wait, no allocation
//     after construction.
// Prefetch: at acquire of visit k, the loads of visits up to k+d are issued (d = depth).
// The slot a load takes is the one whose layer is not used by the visits in flight and is
// needed again the latest (Belady's choice over the known schedule); a visit whose layer is
// still in a slot from an earlier visit is a hit and copies nothing (at the forward/backward
// turn of training the last d+1 layers are still there). A load is issued only once the
// release of its slot's previous occupant has been called, so the event it waits on is
// recorded (an event not yet recorded would not order anything).
//
// Note [Streaming across steps]: inference wraps around: the next step's first layers are
// prefetched while the current step's last ones compute (no drain at the boundary).
// Training: the optimizer changes the weights between steps, so the next step's loads wait
// for step_end() (the caller has written the new weights into the host slabs) and nothing
// resident is reused across the boundary. Backward re-streams the weights rather than
// keeping them from forward: keeping them would hold every layer on the device, which is
// what streaming is there to avoid; the turn's hits save d+1 of the L backward loads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "spillway/device/device.hpp"
#include "spillway/device/hooks.hpp"

namespace spillway {

struct WeightStreamOptions {
  int depth = 2;          // d: loads issued ahead of the visit computing; d+1 device slots
  bool training = false;  // the schedule: forward only, or forward then backward
  bool timing = true;     // per-layer copy and stall times (host callbacks on the streams)
  // Caller-owned pinned host slabs, one per layer (host_slab_bytes each, alive as long as
  // the streamer); empty: the streamer allocates them (MemoryKind::kPinnedHost).
  std::vector<void*> host_slabs;
  // Note [Sharded streaming]: GPUs that share one host link each copy 1/N of a layer and
  // an all-gather (the backend's collective: NCCL, or the host backend's emulation)
  // assembles it in every rank's slot, so the link carries each layer once instead of N
  // times. `group` is this rank's member of the N ranks (null: every rank copies whole
  // layers). Every rank must run the same schedule. A layer is cut in N shards of
  // ceil(bytes / N) rounded up to 256 bytes; this rank's host slab holds shard rank() of
  // every layer (zero-padded past the layer's end) and its slots N shards.
  AllGather* group = nullptr;
  // Note [Static slots]: layer l always lands in slot l % (depth + 1) instead of the slot
  // Belady's choice picks, so that a caller can bind each layer to one fixed slot (a
  // compiled graph whose weights are views of fixed buffers). Same ordering rules; when
  // depth + 1 does not divide the layers, the first layers of the next step (and, in
  // training, of backward past the turn) wait for their slot's reader to be released
  // instead of being copied ahead.
  bool static_slots = false;
  // Caller-owned device slots, depth + 1 of at least slot_bytes() each (the largest layer;
  // sharded: ranks x its largest shard), alive as long as the streamer; empty: the
  // streamer allocates them (MemoryKind::kDevice). A framework passes its own tensors.
  std::vector<void*> device_slots;
};

// Per layer, over the visits of the steps measured (since construction or reset_telemetry).
struct LayerStreamStats {
  int64_t loads = 0;      // copies into a slot
  int64_t hits = 0;       // visits that found the layer in a slot
  int64_t bytes = 0;      // copied host -> device by this rank (sharded: its shards)
  double copy_ms = 0.0;   // time the copies took on the copy stream (timing)
  double stall_ms = 0.0;  // compute waiting for the layer's slot (timing)
  double gbps = 0.0;      // bytes / copy time
};

struct WeightStreamTelemetry {
  std::vector<LayerStreamStats> layers;
  int64_t visits = 0;
  int64_t loads = 0;
  int64_t hits = 0;
  int64_t bytes = 0;
  double copy_ms = 0.0;
  double stall_ms = 0.0;
  double gbps = 0.0;  // bytes / copy_ms: the copy stream's achieved bandwidth
  // Slot occupancy: at each acquire, the slots whose load for the visits in flight (this
  // one and the next d) is issued, averaged; d+1 when prefetch keeps the ring full.
  double mean_slots_ahead = 0.0;
  int64_t late_acquires = 0;  // acquires whose slot was not ready yet (a query, no wait)
  int64_t steps = 0;          // step_end() calls
};

class WeightStreamer final : public LayerWeights {
 public:
  // `layer_bytes[i]`: layer i's packed weights. `compute` is the loop's stream. Allocates
  // the d+1 device slots (each of the largest layer) and, unless given, the host slabs:
  // everything it will ever allocate.
  WeightStreamer(Device& dev, Stream compute, std::vector<size_t> layer_bytes,
                 const WeightStreamOptions& options = {});
  ~WeightStreamer() override;
  WeightStreamer(const WeightStreamer&) = delete;
  WeightStreamer& operator=(const WeightStreamer&) = delete;

  int layers() const override;
  int depth() const;
  size_t slot_bytes() const override;  // the largest layer (sharded: N of its shards)
  // The bytes of layer i's host slab (the layer, or its shard), and where in the layer they
  // start (0, or rank * shard).
  size_t host_slab_bytes(int layer) const override;
  size_t host_slab_offset(int layer) const override;
  // Layer i's pinned host slab: the caller packs its weights here before the first visit.
  // In training it rewrites them between backward and step_end(), after the copy stream
  // has passed host_slab_read(i) (an event: wait on it from the writer's stream, or
  // synchronize it).
  void* host_slab(int layer) const override;
  Event host_slab_read(int layer) const override;

  // The next visit of the schedule, which must be of `layer` (checked, naming both): the
  // slot holding its weights. Work enqueued on the compute stream after this call reads
  // them whole.
  const void* acquire(int layer) override;
  // The compute work of the acquired visit is enqueued: its slot may be refilled after it.
  void release(int layer) override;
  // Training: the step's backward is done and the host slabs hold the next step's weights:
  // the next step's loads may start. Inference: counts the step (the ring wraps around on
  // its own).
  void step_end() override;

  // A visit ahead: the one `ahead` visits after the last acquired (1: the next), its layer
  // the slot, and the event after which the slot holds what the streamer copies for it (its layer;
  // sharded: this rank's shard). Layer -1 when that visit's load is not issued yet (beyond
  // the depth, or deferred: Note [Static slots]). For a caller that moves more data into a
  // slot before its visit: the PyTorch adapter's all-gathers (Note [Sharded streaming in
  // PyTorch]), which must neither start before the copy has landed nor wait for compute.
  struct Upcoming {
    int layer = -1;
    Event ready{-1};
    const void* slot = nullptr;
  };
  Upcoming upcoming(int ahead) const;

  // The telemetry so far: waits for the copy and compute streams when timing is on (call
  // it outside the steps being timed).
  WeightStreamTelemetry telemetry();
  void reset_telemetry();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace spillway
