// The activation offload engine on the socket (OffloadHooks in
// include/spillway/offload/offload.hpp): the hook calls of a training loop mapped onto the engine's
// calls, one to one.
#include <algorithm>

#include "spillway/core/error.hpp"
#include "spillway/offload/offload.hpp"

namespace spillway {

OffloadHooks::OffloadHooks(OffloadEngine& engine) : engine_(engine) {}

void OffloadHooks::step_begin() {
  engine_.begin_step();
  if (reloaded_.empty()) reloaded_.resize(static_cast<size_t>(engine_.max_tensors()));
}

SavedTicket OffloadHooks::saved(int layer, std::string_view name, const SavedTensor& t) {
  if (!engine_.wants(layer, name)) return {};
  SavedTicket k;
  if (!t.give) {
    // Borrowed (Note [Saved tensor ownership]): the caller waits on `copied` before it
    // reuses the memory; a full pinned pool leaves it with the caller, not taken.
    const BorrowedOffload b = engine_.offload_borrowed(t.data, t.bytes, layer, name);
    if (b.kept) return {};
    k.id = b.handle;
    k.copied = b.copied;
  } else {
    DeviceTensor d;
    d.ptr = t.data;
    d.bytes = t.bytes;
    d.direct = true;  // the caller's allocation: the engine frees it through the device
    k.id = engine_.offload(
        d, layer, name,
        t.hold_until_forward_end ? OffloadHold::kUntilLayerEnd : OffloadHold::kUntilCopied);
  }
  if (static_cast<size_t>(k.id) < reloaded_.size()) reloaded_[static_cast<size_t>(k.id)] = {};
  return k;
}

void OffloadHooks::forward_end(int layer) {
  engine_.end_forward_layer(layer);
}

void OffloadHooks::backward_begin(int layer) {
  for (int p = 1; p <= engine_.policy().prefetch_depth; ++p) engine_.prefetch(layer - p);
}

void OffloadHooks::will_need(const SavedTicket& ticket, void* dst) {
  SPILLWAY_CHECK(ticket.id >= 0 && static_cast<size_t>(ticket.id) < reloaded_.size(),
                 "OffloadHooks: unknown ticket {}", ticket.id);
  SPILLWAY_CHECK(dst != nullptr, "OffloadHooks: will_need() of ticket {} with no destination",
                 ticket.id);
  // Too late (already prefetched into staging) is fine: needed() copies from there.
  (void)engine_.set_reload_target(ticket.id, dst);
}

void OffloadHooks::will_need_many(const SavedTicket* tickets, void* const* dsts, size_t n) {
  // Note [One fence per batch]: the handles (ticket ids) in one engine call. A block's
  // reloads are a few dozen: a fixed buffer, refilled, so nothing is allocated per call.
  constexpr size_t kChunk = 64;
  OffloadHandle ids[kChunk];
  for (size_t at = 0; at < n; at += kChunk) {
    const size_t k = std::min(kChunk, n - at);
    for (size_t i = 0; i < k; ++i) {
      const SavedTicket& t = tickets[at + i];
      SPILLWAY_CHECK(t.id >= 0 && static_cast<size_t>(t.id) < reloaded_.size(),
                     "OffloadHooks: unknown ticket {}", t.id);
      SPILLWAY_CHECK(dsts[at + i] != nullptr,
                     "OffloadHooks: will_need_many() of ticket {} with no destination", t.id);
      ids[i] = t.id;
    }
    (void)engine_.set_reload_targets(ids, dsts + at, k);
  }
}

void* OffloadHooks::needed(const SavedTicket& ticket, void* dst) {
  SPILLWAY_CHECK(ticket.id >= 0 && static_cast<size_t>(ticket.id) < reloaded_.size(),
                 "OffloadHooks: unknown ticket {}", ticket.id);
  Reloaded& r = reloaded_[static_cast<size_t>(ticket.id)];
  if (dst != nullptr) {
    engine_.reload_into(ticket.id, dst);
    r.into_caller = true;
    return dst;
  }
  r.engine = engine_.reload(ticket.id);
  r.into_caller = false;
  return r.engine.ptr;
}

void OffloadHooks::done(const SavedTicket& ticket) {
  SPILLWAY_CHECK(ticket.id >= 0 && static_cast<size_t>(ticket.id) < reloaded_.size(),
                 "OffloadHooks: unknown ticket {}", ticket.id);
  Reloaded& r = reloaded_[static_cast<size_t>(ticket.id)];
  if (r.into_caller) return;  // the caller's memory: nothing to give back
  SPILLWAY_CHECK(r.engine, "OffloadHooks: done() of ticket {} that needed() did not hand out",
                 ticket.id);
  engine_.free(r.engine);
  r.engine = DeviceTensor{};
}

void OffloadHooks::step_end() {
  telemetry_ = engine_.end_step();
}

}  // namespace spillway
