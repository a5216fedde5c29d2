// `spillway bench stream` on a tiny configuration: it runs, checks every layer it computes,
// and counts bytes exactly (timings are printed, never asserted).
#include "bench_stream.hpp"

#include <gtest/gtest.h>

#include "spillway/core/error.hpp"

namespace spillway {
namespace {

TEST(BenchStream, TinyRunCountsBytesExactly) {
  StreamBenchOptions o;
  o.layers = 4;
  o.layer_bytes = size_t{256} << 10;
  o.compute_ms = 0.2;
  o.link_gbps = 20.0;
  o.steps = 3;
  const StreamBenchResult r = run_stream_bench(o);
  EXPECT_GT(r.resident_ms, 0.0);
  EXPECT_GT(r.streamed_ms, 0.0);
  EXPECT_GT(r.achieved_gbps, 0.0);
  ASSERT_EQ(r.sharded.size(), 2u);
  for (const auto& s : r.sharded) {
    // Every rank pulls each layer per step in full copy; 1/N of it sharded (256 KiB splits
    // evenly in 256-byte shards for N = 2 and 4).
    EXPECT_DOUBLE_EQ(s.full_rank_gb, s.ranks * s.sharded_rank_gb) << s.ranks << " ranks";
  }
  const std::string text = format_stream_bench(r);
  EXPECT_NE(text.find("overhead"), std::string::npos);
  EXPECT_NE(stream_bench_json(r).find("\"sharded\""), std::string::npos);
  EXPECT_GT(r.memcpy_gbps, 0.0);
  EXPECT_NE(text.find("GB/s memcpy"), std::string::npos) << text;
}

// Note [The machine is the limit]: a link faster than this machine's memcpy (forced: the
// figures given) is said to be out of reach, naming both rates; a slower one is not.
TEST(BenchStream, ALinkFasterThanMemcpySaysTheMachineIsTheLimit) {
  StreamBenchResult r;
  r.options.link_gbps = 40.0;
  r.resident_ms = 64.0;
  r.streamed_ms = 80.0;
  r.overhead = 0.25;
  r.achieved_gbps = 9.5;
  r.memcpy_gbps = 10.0;
  const std::string text = format_stream_bench(r);
  EXPECT_NE(text.find("NOT met"), std::string::npos) << text;
  EXPECT_NE(text.find("the machine is the limit: its memcpy measured 10.00 GB/s in this run, "
                      "below the emulated link's 40.00 GB/s"),
            std::string::npos)
      << text;
  EXPECT_NE(stream_bench_json(r).find("\"machine_is_the_limit\": true"), std::string::npos);
  r.options.link_gbps = 5.0;
  EXPECT_EQ(format_stream_bench(r).find("the machine is the limit"), std::string::npos);
  EXPECT_NE(stream_bench_json(r).find("\"machine_is_the_limit\": false"), std::string::npos);
}

// The same on a real run: no machine copies 10 TB/s.
TEST(BenchStream, AnEmulatedLinkOf10TBpsIsBeyondThisMachine) {
  StreamBenchOptions o;
  o.layers = 2;
  o.layer_bytes = size_t{256} << 10;
  o.compute_ms = 0.1;
  o.link_gbps = 10000.0;
  o.steps = 2;
  o.ranks = {};
  const StreamBenchResult r = run_stream_bench(o);
  ASSERT_GT(r.memcpy_gbps, 0.0);
  EXPECT_NE(format_stream_bench(r).find("the machine is the limit"), std::string::npos)
      << format_stream_bench(r);
}

TEST(BenchStream, BadOptionsNameTheField) {
  StreamBenchOptions o;
  o.steps = 1;
  EXPECT_THROW(check_stream_bench_options(o), InputError);
  o = StreamBenchOptions{};
  o.ranks = {1};
  EXPECT_THROW(check_stream_bench_options(o), InputError);
}

}  // namespace
}  // namespace spillway
