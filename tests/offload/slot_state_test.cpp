// The life of an offload slot (Note [The life of a slot], src/offload/slot_state.hpp): the
// edges the engine takes, in the order it takes them, and the ones it must never take.
#include "offload/slot_state.hpp"

#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "spillway/core/error.hpp"

namespace spillway::offload {
namespace {

using S = SlotState;

const std::vector<S> kAll = {
    S::kFree,        S::kQueued,        S::kCopying,   S::kCopyingReloading, S::kCopyingTaken,
    S::kHeld,        S::kHeldReloading, S::kHeldTaken, S::kOnHost,           S::kOnHostReloading,
    S::kOnHostTaken, S::kKept,          S::kKeptTaken};

TEST(SlotState, ASlotGoesThroughItsNormalLife) {
  S st = S::kFree;
  // offload(): a pinned block, the copy queued; flush() enqueues it.
  transition(st, S::kFree, S::kQueued);
  transition(st, S::kQueued, S::kCopying);
  EXPECT_FALSE(copy_seen(st));
  EXPECT_FALSE(device_released(st));
  // poll() sees the copy's end; the device block goes back (at once, or at the layer's end).
  transition(st, st, after_copy_seen(st));
  EXPECT_EQ(st, S::kHeld);
  EXPECT_TRUE(copy_seen(st));
  EXPECT_FALSE(device_released(st));
  transition(st, st, after_device_released(st));
  EXPECT_EQ(st, S::kOnHost);
  EXPECT_TRUE(device_released(st));
  EXPECT_FALSE(reload_issued(st));
  // prefetch() issues the reload, reload() takes it, end_step() gives the slot back.
  transition(st, st, after_reload_issued(st));
  EXPECT_EQ(st, S::kOnHostReloading);
  EXPECT_TRUE(reload_issued(st));
  EXPECT_FALSE(reload_taken(st));
  transition(st, st, after_reload_taken(st));
  EXPECT_EQ(st, S::kOnHostTaken);
  EXPECT_TRUE(reload_taken(st));
  transition(st, S::kOnHostTaken, S::kFree);
  EXPECT_EQ(st, S::kFree);
}

TEST(SlotState, AReloadMayBeIssuedBeforeTheCopysEndIsSeen) {
  S st = S::kFree;
  transition(st, S::kFree, S::kQueued);
  transition(st, S::kQueued, S::kCopying);
  transition(st, st, after_reload_taken(st));  // reload() of a reload not issued
  EXPECT_EQ(st, S::kCopyingTaken);
  EXPECT_TRUE(reload_issued(st));
  transition(st, st, after_copy_seen(st));
  transition(st, st, after_device_released(st));
  EXPECT_EQ(st, S::kOnHostTaken);
}

TEST(SlotState, AKeptTensorIsTakenWithoutAReload) {
  S st = S::kFree;
  transition(st, S::kFree, S::kKept);
  EXPECT_TRUE(is_kept(st));
  EXPECT_FALSE(reload_issued(st));
  transition(st, st, after_reload_taken(st));
  EXPECT_EQ(st, S::kKeptTaken);
  EXPECT_TRUE(reload_taken(st));
  EXPECT_FALSE(reload_issued(st));
  transition(st, S::kKeptTaken, S::kFree);
}

TEST(SlotState, AnIllegalTransitionIsCaughtAndLeavesTheStateAsItWas) {
  S st = S::kFree;
  // No skipping the copy, no going back, no reload of a kept tensor, no second taking.
  EXPECT_THROW(transition(st, S::kFree, S::kOnHostTaken), Error);
  EXPECT_EQ(st, S::kFree);
  st = S::kOnHost;
  EXPECT_THROW(transition(st, S::kOnHost, S::kCopying), Error);
  EXPECT_EQ(st, S::kOnHost);
  st = S::kKept;
  EXPECT_THROW(transition(st, S::kKept, S::kOnHostReloading), Error);
  EXPECT_THROW(after_reload_issued(S::kKept), Error);
  EXPECT_THROW(after_reload_taken(S::kOnHostTaken), Error);
  EXPECT_THROW(after_copy_seen(S::kOnHost), Error);
  EXPECT_THROW(after_device_released(S::kCopying), Error);
  // A legal edge from where the slot is not.
  st = S::kQueued;
  try {
    transition(st, S::kCopying, S::kHeld, 7);
    FAIL() << "a transition from where the slot is not was let through";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("offload slot 7: is 'queued', not 'copying'"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(st, S::kQueued);
}

TEST(SlotState, TheLegalEdgesAreTheDiagramsExactly) {
  // Every state may go back to free (end_step); besides, the diagram's edges.
  const std::vector<std::pair<S, S>> edges = {
      {S::kFree, S::kQueued},
      {S::kFree, S::kKept},
      {S::kQueued, S::kCopying},
      {S::kKept, S::kKeptTaken},
      {S::kCopying, S::kCopyingReloading},
      {S::kCopying, S::kCopyingTaken},
      {S::kCopyingReloading, S::kCopyingTaken},
      {S::kHeld, S::kHeldReloading},
      {S::kHeld, S::kHeldTaken},
      {S::kHeldReloading, S::kHeldTaken},
      {S::kOnHost, S::kOnHostReloading},
      {S::kOnHost, S::kOnHostTaken},
      {S::kOnHostReloading, S::kOnHostTaken},
      {S::kCopying, S::kHeld},
      {S::kCopyingReloading, S::kHeldReloading},
      {S::kCopyingTaken, S::kHeldTaken},
      {S::kHeld, S::kOnHost},
      {S::kHeldReloading, S::kOnHostReloading},
      {S::kHeldTaken, S::kOnHostTaken},
  };
  for (S from : kAll) {
    for (S to : kAll) {
      bool want = to == S::kFree;
      for (const auto& [a, b] : edges) want = want || (a == from && b == to);
      EXPECT_EQ(legal_transition(from, to), want) << to_string(from) << " -> " << to_string(to);
    }
  }
}

}  // namespace
}  // namespace spillway::offload
