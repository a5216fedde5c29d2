// The edges of an offload slot's life (Note [The life of a slot], slot_state.hpp).
#include "offload/slot_state.hpp"

#include "core/enum_names.hpp"
#include "spillway/core/error.hpp"

namespace spillway::offload {
namespace {

constexpr EnumNames<SlotState, 13> kSlotStateNames = {
    {{SlotState::kFree, "free"},
     {SlotState::kQueued, "queued"},
     {SlotState::kCopying, "copying"},
     {SlotState::kCopyingReloading, "copying, reloading"},
     {SlotState::kCopyingTaken, "copying, taken"},
     {SlotState::kHeld, "held"},
     {SlotState::kHeldReloading, "held, reloading"},
     {SlotState::kHeldTaken, "held, taken"},
     {SlotState::kOnHost, "on host"},
     {SlotState::kOnHostReloading, "on host, reloading"},
     {SlotState::kOnHostTaken, "on host, taken"},
     {SlotState::kKept, "kept"},
     {SlotState::kKeptTaken, "kept, taken"}}};

// The diagram's grid: rows copying, held, on host; columns no reload, issued, taken.
constexpr SlotState kGrid[3][3] = {
    {SlotState::kCopying, SlotState::kCopyingReloading, SlotState::kCopyingTaken},
    {SlotState::kHeld, SlotState::kHeldReloading, SlotState::kHeldTaken},
    {SlotState::kOnHost, SlotState::kOnHostReloading, SlotState::kOnHostTaken}};

bool in_grid(SlotState s, int* row, int* col) {
  for (int r = 0; r < 3; ++r)
    for (int c = 0; c < 3; ++c)
      if (kGrid[r][c] == s) {
        *row = r;
        *col = c;
        return true;
      }
  return false;
}

// One step down (dr = 1) or across (dc = 1) the grid.
SlotState step(SlotState s, int dr, int dc, const char* what) {
  int r = 0, c = 0;
  SPILLWAY_CHECK(in_grid(s, &r, &c) && r + dr < 3 && c + dc < 3,
                 "offload slot: no '{}' edge from state '{}'", what, to_string(s));
  return kGrid[r + dr][c + dc];
}

}  // namespace

const char* to_string(SlotState s) {
  return name_of(kSlotStateNames, s).data();  // a literal: null-terminated
}

bool legal_transition(SlotState from, SlotState to) {
  using S = SlotState;
  if (to == S::kFree) return true;  // end_step() gives every slot back
  switch (from) {
    case S::kFree:
      return to == S::kQueued || to == S::kKept;
    case S::kQueued:
      return to == S::kCopying;
    case S::kKept:
      return to == S::kKeptTaken;
    default:
      break;
  }
  int fr = 0, fc = 0, tr = 0, tc = 0;
  if (!in_grid(from, &fr, &fc) || !in_grid(to, &tr, &tc)) return false;
  // Down one row in the same column (the copy out's track), or across to a later column in
  // the same row (the reload's).
  return (tr == fr + 1 && tc == fc) || (tr == fr && tc > fc);
}

void transition(SlotState& state, SlotState from, SlotState to, int slot) {
  SPILLWAY_CHECK(state == from, "offload slot {}: is '{}', not '{}' (on its way to '{}')", slot,
                 to_string(state), to_string(from), to_string(to));
  SPILLWAY_CHECK(legal_transition(from, to),
                 "offload slot {}: '{}' -> '{}' is no edge of its life (Note [The life of a "
                 "slot])",
                 slot, to_string(from), to_string(to));
  state = to;
}

SlotState after_copy_seen(SlotState s) {
  SPILLWAY_CHECK(s == SlotState::kCopying || s == SlotState::kCopyingReloading ||
                     s == SlotState::kCopyingTaken,
                 "offload slot: a copy seen ending in state '{}'", to_string(s));
  return step(s, 1, 0, "copy seen");
}

SlotState after_device_released(SlotState s) {
  SPILLWAY_CHECK(
      s == SlotState::kHeld || s == SlotState::kHeldReloading || s == SlotState::kHeldTaken,
      "offload slot: a device block released in state '{}'", to_string(s));
  return step(s, 1, 0, "device block released");
}

SlotState after_reload_issued(SlotState s) {
  int r = 0, c = 0;
  SPILLWAY_CHECK(in_grid(s, &r, &c) && c == 0, "offload slot: a reload issued in state '{}'",
                 to_string(s));
  return kGrid[r][1];
}

SlotState after_reload_taken(SlotState s) {
  if (s == SlotState::kKept) return SlotState::kKeptTaken;
  int r = 0, c = 0;
  SPILLWAY_CHECK(in_grid(s, &r, &c) && c < 2, "offload slot: a reload taken in state '{}'",
                 to_string(s));
  return kGrid[r][2];
}

}  // namespace spillway::offload
