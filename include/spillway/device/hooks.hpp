// The socket (docs/architecture.md): the calls a training loop makes to tell spillway what
// happens, nothing more. The reference model (src/nn), the PyTorch adapter and any other
// loop call these; each engine implements the part it needs (the activation offload
// engine: saved/needed; the optimizer pipeline: grad_ready/step_end) and CompositeHooks
// fans one loop's calls out to several. A loop that names no engine type can be driven
// by any of them.
//
// One training step, in order (Note [Hook sequence]):
//   step_begin
//   for each layer i, in order:     forward_begin(i), saved(i, ...)..., forward_end(i)
//   (optional, any time before)     will_need(ticket, dst)...
//   for each layer i, in reverse:   backward_begin(i), needed(ticket)..., done(ticket)...,
//                                   grad_ready(bucket)... (whenever a bucket is final)
//   step_end                        (the engines finish: telemetry, the optimizer validates)
// `saved` is called after the work producing the tensor is enqueued on the loop's compute
// stream; `needed` returns memory that work enqueued on the compute stream afterwards may
// read; `grad_ready(b)` is called once the work producing bucket b's gradients is enqueued.
//
// Memory (Note [Saved tensor ownership]): a saved tensor is either
//   - given (SavedTensor::give): device memory from Device::allocate(kDevice) that the
//     hook takes over and frees itself once it no longer needs it (the loop forgets it;
//     with SavedTensor::hold_until_forward_end not before forward_end(layer), since the
//     layer's forward may still read it); or
//   - borrowed: the caller owns it and keeps owning it; the ticket's `copied` event says
//     when the hook is done reading it (wait on it, or query it, before reusing or freeing
//     the memory). The event is the hook's and stays valid until step_end(), which
//     completes it; it may be recycled after that. A hook that cannot copy a borrowed
//     tensor now (its host memory is full) does not take it: the ticket is empty and the
//     loop keeps the tensor, as it keeps one no hook wants.
// `needed` reloads into memory the caller allocated (dst non-null: compute work the caller
// enqueued before the call may still have used dst, work it enqueues after sees the bytes;
// done() is then optional, nothing goes back) or into the hook's own (dst null; returned,
// and given back with done()).
#pragma once

#include <cstddef>
#include <string_view>
#include <utility>
#include <vector>

#include "spillway/device/device.hpp"

namespace spillway {

// A run of elements of one flat parameter (or gradient, or state) array: an optimizer
// bucket (grad_ready(bucket) names its index), a layer's weights. The vocabulary models and
// engines share.
struct Bucket {
  size_t offset = 0;  // into the flat array
  size_t n = 0;       // elements
};

struct SavedTensor {
  void* data = nullptr;  // device memory
  size_t bytes = 0;
  bool give = false;                   // the hook takes ownership (see the note above)
  bool hold_until_forward_end = true;  // given: not freed before forward_end(layer)
};

// What a hook did with a saved tensor: `id` < 0 when no hook took it (the loop keeps it).
struct SavedTicket {
  int id = -1;
  int owner = -1;  // set by CompositeHooks: which of its hooks took it
  Event copied;    // borrowed: complete once the hook no longer reads the source (valid
                   // until step_end())
  explicit operator bool() const { return id >= 0; }
};

class TrainingHooks {
 public:
  virtual ~TrainingHooks() = default;

  virtual void step_begin() {}
  virtual void forward_begin(int layer) { (void)layer; }
  // A saved tensor of `layer`, by the planner's name (docs/plan-schema.md). Default: not
  // taken.
  virtual SavedTicket saved(int layer, std::string_view name, const SavedTensor& t) {
    (void)layer;
    (void)name;
    (void)t;
    return {};
  }
  virtual void forward_end(int layer) { (void)layer; }
  // Backward reaches `layer` (reloads for the layers below it start here).
  virtual void backward_begin(int layer) { (void)layer; }
  // The tensor of `ticket` back on the device: in `dst` (bytes of it, caller-allocated) or,
  // dst null, in memory of the hook's that the caller gives back with done(). Only the
  // hook that took the ticket answers; default: nothing (null).
  virtual void* needed(const SavedTicket& ticket, void* dst) {
    (void)ticket;
    (void)dst;
    return nullptr;
  }
  // (optional) Where the tensor of `ticket` will be needed: caller-allocated device memory
  // that needed(ticket, dst) will name. Called before backward_begin prefetches it, the
  // reload lands there directly (no staging copy); the hook may write `dst` from then on.
  // Default: ignored (needed() still fills dst).
  virtual void will_need(const SavedTicket& ticket, void* dst) {
    (void)ticket;
    (void)dst;
  }
  // (optional) will_need() of `n` tickets at once (a block's reloads): a hook may order
  // them all after one point of the compute stream. Default: will_need() of each, in order.
  virtual void will_need_many(const SavedTicket* tickets, void* const* dsts, size_t n) {
    for (size_t i = 0; i < n; ++i) will_need(tickets[i], dsts[i]);
  }
  // The caller no longer reads what needed() returned for `ticket`.
  virtual void done(const SavedTicket& ticket) { (void)ticket; }
  // The gradients of optimizer bucket `bucket` are final (their producer is enqueued).
  virtual void grad_ready(int bucket) { (void)bucket; }
  virtual void step_end() {}
};

// Fans every call out to its hooks, in order (step_end too: an offload engine before an
// optimizer). saved() goes to each in turn until one takes the tensor; needed() and done()
// to the one that took it (SavedTicket::owner).
class CompositeHooks final : public TrainingHooks {
 public:
  CompositeHooks() = default;
  explicit CompositeHooks(std::vector<TrainingHooks*> hooks) : hooks_(std::move(hooks)) {}
  void add(TrainingHooks* h) {
    if (h != nullptr) hooks_.push_back(h);
  }

  void step_begin() override {
    for (TrainingHooks* h : hooks_) h->step_begin();
  }
  void forward_begin(int layer) override {
    for (TrainingHooks* h : hooks_) h->forward_begin(layer);
  }
  SavedTicket saved(int layer, std::string_view name, const SavedTensor& t) override {
    for (size_t i = 0; i < hooks_.size(); ++i) {
      SavedTicket k = hooks_[i]->saved(layer, name, t);
      if (k) {
        k.owner = static_cast<int>(i);
        return k;
      }
    }
    return {};
  }
  void forward_end(int layer) override {
    for (TrainingHooks* h : hooks_) h->forward_end(layer);
  }
  void backward_begin(int layer) override {
    for (TrainingHooks* h : hooks_) h->backward_begin(layer);
  }
  void* needed(const SavedTicket& ticket, void* dst) override {
    TrainingHooks* h = owner(ticket);
    return h != nullptr ? h->needed(ticket, dst) : nullptr;
  }
  void will_need(const SavedTicket& ticket, void* dst) override {
    if (TrainingHooks* h = owner(ticket)) h->will_need(ticket, dst);
  }
  void done(const SavedTicket& ticket) override {
    if (TrainingHooks* h = owner(ticket)) h->done(ticket);
  }
  void grad_ready(int bucket) override {
    for (TrainingHooks* h : hooks_) h->grad_ready(bucket);
  }
  void step_end() override {
    for (TrainingHooks* h : hooks_) h->step_end();
  }

 private:
  TrainingHooks* owner(const SavedTicket& t) const {
    if (t.owner < 0 || static_cast<size_t>(t.owner) >= hooks_.size()) return nullptr;
    return hooks_[static_cast<size_t>(t.owner)];
  }
  std::vector<TrainingHooks*> hooks_;
};

// Note [Layer weight sources]: where a model's layers read their weights when not from
// their own copy: a weight streamer's ring of device slots (spillway/stream/weight_streamer.hpp),
// or any source that keeps a layer's packed weights in host slabs and hands out a device copy per
// visit. The model packs its weights into the slabs and visits its layers in the source's
// schedule (forward, then backward in reverse in training); the source orders its copies
// by events on the model's compute stream.
class LayerWeights {
 public:
  virtual ~LayerWeights() = default;
  virtual int layers() const = 0;
  // The largest layer's bytes a visit can hand out (sharded: the ranks' shards end to end).
  virtual size_t slot_bytes() const = 0;
  // The bytes of layer i's host slab (the layer, or this rank's shard of it) and where in
  // the layer they start.
  virtual size_t host_slab_bytes(int layer) const = 0;
  virtual size_t host_slab_offset(int layer) const = 0;
  // Layer i's host slab, and the event after which the source no longer reads it (the
  // writer waits on it before packing new weights).
  virtual void* host_slab(int layer) const = 0;
  virtual Event host_slab_read(int layer) const = 0;
  // The next visit, which must be of `layer`: the device copy of its weights, read by work
  // enqueued on the compute stream after this call.
  virtual const void* acquire(int layer) = 0;
  // The visit's work is enqueued: the copy may be reused after it.
  virtual void release(int layer) = 0;
  // The step is over; in training the slabs hold the next step's weights.
  virtual void step_end() = 0;
};

}  // namespace spillway
