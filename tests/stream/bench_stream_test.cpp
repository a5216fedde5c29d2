// `spillway bench stream` on a tiny configuration: it runs, checks every layer it computes,
// and counts bytes exactly (timings are printed, never asserted).
#include <gtest/gtest.h>

#include "bench_stream.hpp"
#include "spillway/error.hpp"

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
