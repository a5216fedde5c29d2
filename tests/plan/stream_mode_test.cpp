// The stream mode choice (Note [Stream mode model]): hand-computed cases.
#include "spillway/plan/stream_mode.hpp"

#include <gtest/gtest.h>

#include "spillway/core/error.hpp"

namespace spillway {
namespace {

StreamModeInput four_layers() {
  StreamModeInput in;
  in.layer_bytes = {1'000'000'000, 1'000'000'000, 1'000'000'000, 1'000'000'000};
  in.fwd_ms = {10, 10, 10, 10};
  in.gpus_per_link = 2;
  in.link_h2d_gbps = 100;  // 1e8 bytes per ms
  in.peer_gbps = 50;
  in.depth = 2;
  return in;
}

TEST(StreamMode, TwoGpusOnOnePcieLinkShardAndGather) {
  const StreamModeChoice c = choose_stream_mode(four_layers());
  ASSERT_EQ(c.modes.size(), 3u);
  const StreamModeEstimate& full = c.modes[0];
  const StreamModeEstimate& sharded = c.modes[1];
  // Full copy: 2 GPUs x 1 GB over 100 GB/s = 20 ms per layer against 10 of compute.
  EXPECT_DOUBLE_EQ(full.step_ms, 80.0);
  EXPECT_DOUBLE_EQ(full.stall_ms, 40.0);
  EXPECT_EQ(full.link_bytes, 8'000'000'000);
  EXPECT_EQ(full.gpu_bytes, 4'000'000'000);
  // Sharded: 1 GB over the link (10 ms) and half a layer gathered at 50 GB/s (10 ms).
  EXPECT_DOUBLE_EQ(sharded.step_ms, 40.0);
  EXPECT_DOUBLE_EQ(sharded.gather_ms, 40.0);
  EXPECT_EQ(sharded.link_bytes, 4'000'000'000);
  EXPECT_EQ(sharded.gpu_bytes, 2'000'000'000);
  EXPECT_EQ(sharded.slot_bytes, 3'000'000'000);
  EXPECT_FALSE(c.modes[2].available);  // PCIe is not coherent
  EXPECT_EQ(c.chosen, "sharded");
  EXPECT_DOUBLE_EQ(c.compute_ms, 40.0);
  EXPECT_FALSE(c.weights_fit);
  EXPECT_TRUE(c.warnings.empty());
  const std::string text = explain_stream_mode(c, four_layers());
  EXPECT_NE(text.find("<- chosen"), std::string::npos);
  EXPECT_NE(text.find("in-place   not available"), std::string::npos);
}

TEST(StreamMode, WithoutAPeerPathOrASecondGpuThereIsNoSharding) {
  StreamModeInput in = four_layers();
  in.peer_gbps = 0;
  StreamModeChoice c = choose_stream_mode(in);
  EXPECT_FALSE(c.modes[1].available);
  EXPECT_EQ(c.chosen, "full-copy");
  // The link cannot hide the copies: said, with the numbers.
  ASSERT_EQ(c.warnings.size(), 1u);
  EXPECT_NE(c.warnings[0].find("40.00 ms of stalls"), std::string::npos);
  in = four_layers();
  in.gpus_per_link = 1;
  c = choose_stream_mode(in);
  EXPECT_FALSE(c.modes[1].available);
  EXPECT_DOUBLE_EQ(c.modes[0].step_ms, 40.0);  // 10 ms per layer: hidden exactly
}

TEST(StreamMode, OnASuperchipTheWeightsAreReadInPlaceAndAFitIsSaid) {
  StreamModeInput in = four_layers();
  in.gpus_per_link = 1;
  in.c2c = true;
  in.link_h2d_gbps = 400;  // 2.5 ms per layer
  in.hbm_free_bytes = 5'000'000'000;
  const StreamModeChoice c = choose_stream_mode(in);
  EXPECT_DOUBLE_EQ(c.modes[0].step_ms, 40.0);
  EXPECT_DOUBLE_EQ(c.modes[2].step_ms, 40.0);
  EXPECT_EQ(c.modes[2].slot_bytes, 0);
  EXPECT_EQ(c.chosen, "in-place");  // the tie goes to the mode without a ring
  EXPECT_TRUE(c.weights_fit);
  ASSERT_EQ(c.warnings.size(), 1u);
  EXPECT_NE(c.warnings[0].find("fit"), std::string::npos);
}

TEST(StreamMode, TrainingReloadsAllButTheTurnsLayersInBackward) {
  StreamModeInput in;
  in.layer_bytes.assign(6, 100'000'000);
  in.fwd_ms.assign(6, 1.0);
  in.bwd_ms.assign(6, 2.0);
  in.link_h2d_gbps = 50;  // 2 ms per layer
  in.depth = 2;
  const StreamModeChoice c = choose_stream_mode(in);
  const StreamModeEstimate& full = c.modes[0];
  EXPECT_EQ(full.loads, 6 + 3);
  EXPECT_DOUBLE_EQ(c.compute_ms, 18.0);
  // Forward: 6 loads of 2 ms over 1 ms of compute; backward: 3 hits, 3 loads hidden.
  EXPECT_DOUBLE_EQ(full.step_ms, 6 * 2.0 + 6 * 2.0);
  EXPECT_EQ(full.link_bytes, 900'000'000);
}

// A ring of depth + 1 slots of the largest layer that HBM cannot hold rules its mode out,
// with the numbers; the mode chosen is one that fits, and when none does, none is chosen.
TEST(StreamMode, AModeWhoseRingDoesNotFitIsNeverChosen) {
  StreamModeInput in = four_layers();  // sharded wins when it fits (3 GB ring)
  in.hbm_free_bytes = 2'500'000'000;   // 2 slots of 1 GB fit, 3 do not
  StreamModeChoice c = choose_stream_mode(in);
  EXPECT_FALSE(c.modes[0].available);
  EXPECT_FALSE(c.modes[1].available);
  EXPECT_EQ(c.modes[1].why_not,
            "its ring of 3 slots of the largest layer (1000.0 MB) is 3.00 GB, more than the "
            "2.50 GB of HBM free for weights; a prefetch depth of 1 or less fits");
  EXPECT_EQ(c.chosen, "");
  const std::string text = explain_stream_mode(c, in);
  EXPECT_NE(text.find("sharded    not available: its ring of 3 slots"), std::string::npos) << text;
  EXPECT_NE(text.find("no mode can run here"), std::string::npos) << text;
  EXPECT_EQ(text.find("<- chosen"), std::string::npos) << text;

  in.depth = 1;  // 2 slots: 2 GB fit
  c = choose_stream_mode(in);
  EXPECT_TRUE(c.modes[1].available);
  EXPECT_EQ(c.chosen, "sharded");

  in = four_layers();
  in.hbm_free_bytes = 500'000'000;  // not even one layer: no depth fits
  c = choose_stream_mode(in);
  EXPECT_NE(c.modes[0].why_not.find("not even a depth of 1"), std::string::npos)
      << c.modes[0].why_not;

  in.c2c = true;  // in place needs no ring: it runs where the rings cannot
  c = choose_stream_mode(in);
  EXPECT_EQ(c.chosen, "in-place");

  in = four_layers();  // unknown free HBM (< 0): the fit is not checked
  in.hbm_free_bytes = -1;
  EXPECT_EQ(choose_stream_mode(in).chosen, "sharded");
}

TEST(StreamMode, BadInputNamesTheField) {
  StreamModeInput in = four_layers();
  in.fwd_ms.pop_back();
  EXPECT_THROW(choose_stream_mode(in), InputError);
  in = four_layers();
  in.link_h2d_gbps = 0;
  try {
    choose_stream_mode(in);
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("link_h2d_gbps"), std::string::npos);
  }
  in = four_layers();
  in.depth = 0;
  EXPECT_THROW(choose_stream_mode(in), InputError);
}

}  // namespace
}  // namespace spillway
