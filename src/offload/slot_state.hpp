// Where an offload slot is in its life (Note [The life of a slot]): one state per slot of
// the activation offload engine (offload_engine.cpp), and the edges it may take.
//
// Note [The life of a slot]: a slot holds one tensor offloaded in a step (Note [Offload
// lifecycle] in offload_engine.cpp gives the event protocol). Its life has two tracks, the
// copy out and the reload, and they overlap: the engine sees a copy's end only when it
// polls, and backward may issue the reload before that (the H2D stream waits on the copy:
// the device orders them, the host may learn of the copy's end later). So the state is the
// pair (copy out, reload), the reachable pairs only:
//
//                        no reload          reload issued           taken
//   kFree
//     |  offload()
//     +--> kQueued            (pinned block taken, copy queued: Note [Copies in batches])
//     |      | flush()
//     |      v
//     |    kCopying  -----------> kCopyingReloading ---> kCopyingTaken
//     |      | poll(): copy seen       | poll()               | poll()
//     |      v                         v                      v
//     |    kHeld     -----------> kHeldReloading ------> kHeldTaken
//     |      | device block back (poll(), end_forward_layer: Note [Offload hold])
//     |      v                         v                      v
//     |    kOnHost   -----------> kOnHostReloading ----> kOnHostTaken
//     |
//     +--> kKept     ------------------------------------> kKeptTaken
//          (pinned pool full: the tensor stayed where it was, Note [Caller-owned memory])
//
// Across, left to right: issue_layer() (prefetch) issues the reload, reload() and
// reload_into() take it (a reload not issued yet is issued as it is taken: no reload ->
// taken directly). Down: poll() sees the copy's end (-> held), and the device block goes
// back (-> on host) at once, or when the layer's forward ends for a tensor offloaded with
// OffloadHold::kUntilLayerEnd; a borrowed tensor has no device block, so it is held for
// no time. end_step() gives every slot back: any state -> kFree. A reload's own end is no
// state: poll() returns the pinned block then (Slot::pinned empty), and nothing asks.
// Every change of state goes through transition(), which SPILLWAY_CHECKs that the slot is
// where its caller thinks and that the edge is one of these (a spillway::Error otherwise;
// tests/offload/slot_state_test.cpp walks the diagram).
//
// What is not the slot's place in its life stays beside the state: whether the tensor is
// borrowed (the caller owns the source) or held until its layer ends (OffloadHold), whether
// its D2H and H2D events are its own to give back (owns_d2h, owns_h2d: a batch's or a
// layer's share one), whether it is verified (OffloadOptions::verify), and the orders of its
// copies and fence (d2h_seq, h2d_seq, fence_seq, fence_slot).
#pragma once

#include <cstdint>

namespace spillway::offload {

enum class SlotState : uint8_t {
  kFree,
  kQueued,
  kCopying,
  kCopyingReloading,
  kCopyingTaken,
  kHeld,
  kHeldReloading,
  kHeldTaken,
  kOnHost,
  kOnHostReloading,
  kOnHostTaken,
  kKept,
  kKeptTaken,
};

const char* to_string(SlotState s);

// Whether a slot may go from `from` to `to` (Note [The life of a slot]).
bool legal_transition(SlotState from, SlotState to);

// Moves `state` from `from` to `to`: a SPILLWAY_CHECK that it is at `from` and that the
// edge is one of the diagram's (`slot` names it in the message).
void transition(SlotState& state, SlotState from, SlotState to, int slot = -1);

// The diagram's columns and rows, read off a state.
constexpr bool is_kept(SlotState s) {
  return s == SlotState::kKept || s == SlotState::kKeptTaken;
}
// The copy out's end was seen (held or on host).
constexpr bool copy_seen(SlotState s) {
  return s == SlotState::kHeld || s == SlotState::kHeldReloading || s == SlotState::kHeldTaken ||
         s == SlotState::kOnHost || s == SlotState::kOnHostReloading ||
         s == SlotState::kOnHostTaken;
}
// The copy is done and the device block back (none: borrowed).
constexpr bool device_released(SlotState s) {
  return s == SlotState::kOnHost || s == SlotState::kOnHostReloading ||
         s == SlotState::kOnHostTaken;
}
// The reload was issued (taken or not); a kept tensor is never reloaded from the host.
constexpr bool reload_issued(SlotState s) {
  return s == SlotState::kCopyingReloading || s == SlotState::kCopyingTaken ||
         s == SlotState::kHeldReloading || s == SlotState::kHeldTaken ||
         s == SlotState::kOnHostReloading || s == SlotState::kOnHostTaken;
}
// reload() or reload_into() took it.
constexpr bool reload_taken(SlotState s) {
  return s == SlotState::kCopyingTaken || s == SlotState::kHeldTaken ||
         s == SlotState::kOnHostTaken || s == SlotState::kKeptTaken;
}

// The state one step along a track: the copy's end seen, the device block back, the reload
// issued, taken (`s` must have that edge: transition() checks).
SlotState after_copy_seen(SlotState s);
SlotState after_device_released(SlotState s);
SlotState after_reload_issued(SlotState s);
SlotState after_reload_taken(SlotState s);

}  // namespace spillway::offload
