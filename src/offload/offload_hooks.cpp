// The activation offload engine on the socket (OffloadHooks in include/spillway/offload.hpp):
// the hook calls of a training loop mapped onto the engine's calls, one to one.
#include "spillway/error.hpp"
#include "spillway/offload.hpp"

namespace spillway {

OffloadHooks::OffloadHooks(OffloadEngine& engine) : engine_(engine) {}

void OffloadHooks::step_begin() {
  engine_.begin_step();
  if (reloaded_.empty()) reloaded_.resize(static_cast<size_t>(engine_.max_tensors()));
}

SavedTicket OffloadHooks::saved(int layer, std::string_view name, const SavedTensor& t) {
  if (!engine_.wants(layer, name)) return {};
  SPILLWAY_CHECK(t.give,
                 "OffloadHooks: {} of layer {} is borrowed; the engine offloads given tensors "
                 "(SavedTensor::give) through the hooks",
                 name, layer);
  DeviceTensor d;
  d.ptr = t.data;
  d.bytes = t.bytes;
  d.direct = true;  // the caller's allocation: the engine frees it through the device
  SavedTicket k;
  k.id = engine_.offload(
      d, layer, name,
      t.hold_until_forward_end ? OffloadHold::kUntilLayerEnd : OffloadHold::kUntilCopied);
  return k;
}

void OffloadHooks::forward_end(int layer) {
  engine_.end_forward_layer(layer);
}

void OffloadHooks::backward_begin(int layer) {
  for (int p = 1; p <= engine_.policy().prefetch_depth; ++p) engine_.prefetch(layer - p);
}

void* OffloadHooks::needed(const SavedTicket& ticket, void* dst) {
  SPILLWAY_CHECK(dst == nullptr,
                 "OffloadHooks: needed() into caller memory is not supported through the "
                 "hooks yet; pass dst = null (ticket {})",
                 ticket.id);
  SPILLWAY_CHECK(ticket.id >= 0 && static_cast<size_t>(ticket.id) < reloaded_.size(),
                 "OffloadHooks: unknown ticket {}", ticket.id);
  DeviceTensor t = engine_.reload(ticket.id);
  reloaded_[static_cast<size_t>(ticket.id)] = t;
  return t.ptr;
}

void OffloadHooks::done(const SavedTicket& ticket) {
  SPILLWAY_CHECK(ticket.id >= 0 && static_cast<size_t>(ticket.id) < reloaded_.size(),
                 "OffloadHooks: unknown ticket {}", ticket.id);
  DeviceTensor& t = reloaded_[static_cast<size_t>(ticket.id)];
  SPILLWAY_CHECK(t, "OffloadHooks: done() of ticket {} that needed() did not hand out", ticket.id);
  engine_.free(t);
  t = DeviceTensor{};
}

void OffloadHooks::step_end() {
  telemetry_ = engine_.end_step();
}

}  // namespace spillway
