// The trace replay (Note [Replay model]): the trace CSV read by header name, sorted, rows
// without a model left out and counted, bad rows named by line; a replay of a small trace
// serves every request in every configuration, deterministically for its seed, with the
// scheduler's placements (switches, cold starts) counted; the dedicated baseline uses a GPU
// group per model; the JSON and the SVG are well formed.
#include "spillway/serve/replay.hpp"

#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "spillway/core/error.hpp"
#include "test_support.hpp"

namespace spillway {
namespace {

using spillway::testing::TempDir;

std::string trace_file(const TempDir& dir, const std::string& body) {
  const std::string p = dir.file("trace.csv");
  std::ofstream(p) << "gmt_create,predict_type,checkpoint_model_version_id\n" << body;
  return p;
}

TEST(Replay, TheTraceIsReadByHeaderNameSortedAndCounted) {
  TempDir dir;
  const std::string p = trace_file(dir,
                                   "2024-11-15 16:57:52,T,M1\n"
                                   "2024-11-15 16:57:50,T,M0\n"
                                   "2024-11-15 16:58:00,T,\n"
                                   "2024-11-15 16:59:50,T,M0\n");
  int64_t skipped = -1;
  const std::vector<TraceRequest> t = read_request_trace(p, 0, &skipped);
  ASSERT_EQ(t.size(), 3u);
  EXPECT_EQ(skipped, 1);
  EXPECT_EQ(t[0].model, "M0");
  EXPECT_DOUBLE_EQ(t[0].arrival_s, 0.0);
  EXPECT_DOUBLE_EQ(t[1].arrival_s, 2.0);
  EXPECT_DOUBLE_EQ(t[2].arrival_s, 120.0);
  EXPECT_EQ(read_request_trace(p, 2).size(), 2u);
  std::ofstream(p) << "gmt_create,checkpoint_model_version_id\nyesterday,M0\n";
  try {
    (void)read_request_trace(p, 0);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(p + ":2: gmt_create is 'yesterday'"), std::string::npos)
        << e.what();
  }
  std::ofstream(p) << "time,model\n";
  EXPECT_THROW((void)read_request_trace(p, 0), Error);
}

TEST(Replay, EveryConfigurationServesEveryRequestDeterministically) {
  std::vector<TraceRequest> trace;
  for (int i = 0; i < 120; ++i) trace.push_back({0.5 * i, "M" + std::to_string((i * 7) % 9)});
  ReplayOptions o;
  o.models = {"Llama-3.2-3B", "Llama-3.1-8B", "Qwen3-30B-A3B"};
  o.host_budget_gb = 60;  // not every model fits at once: cold starts and evictions
  o.reload_ms = {20000.0, 25000.0};
  const std::vector<ReplayResult> a = run_replay(trace, o);
  const std::vector<ReplayResult> b = run_replay(trace, o);
  ASSERT_EQ(a.size(), 6u);
  for (size_t i = 0; i < a.size(); ++i) {
    SCOPED_TRACE(a[i].name);
    EXPECT_EQ(a[i].requests, 120);
    EXPECT_EQ(a[i].completed, 120);  // nothing dropped, nothing left waiting
    EXPECT_EQ(a[i].ttft_ms.p99, b[i].ttft_ms.p99);
    EXPECT_EQ(a[i].switches, b[i].switches);
    EXPECT_GT(a[i].ttft_ms.p50, 0.0);
    EXPECT_LE(a[i].ttft_ms.p50, a[i].ttft_ms.p95);
    EXPECT_LE(a[i].ttft_ms.p95, a[i].ttft_ms.p99);
    EXPECT_GE(a[i].slo_attainment, 0.0);
    EXPECT_LE(a[i].slo_attainment, 1.0);
  }
  const ReplayResult& host = a[0];
  EXPECT_EQ(host.name, "host-resident");
  EXPECT_GT(host.switches, 0);
  EXPECT_GT(host.cold_starts, 3);  // 9 models in a 60 GB budget
  EXPECT_GT(host.link_utilization, 0.0);
  EXPECT_LE(host.link_utilization, 1.0 + 1e-9);
  const ReplayResult& dedicated = a[4];
  EXPECT_EQ(dedicated.switches, 0);
  EXPECT_EQ(dedicated.gpus, 9);  // one GPU per model: each fits in 80% of 96 GB
  const ReplayResult& shared = a[5];
  EXPECT_GT(shared.switches, 10);          // the model changes from request to request
  EXPECT_GT(shared.ttft_ms.p50, 10000.0);  // reloads of 20-25 s
  // Another seed draws other lengths.
  o.seed = 2;
  EXPECT_NE(run_replay(trace, o)[0].ttft_ms.p99, a[0].ttft_ms.p99);
}

TEST(Replay, TheReportsAreWellFormed) {
  std::vector<TraceRequest> trace;
  for (int i = 0; i < 20; ++i) trace.push_back({1.0 * i, i % 2 == 0 ? "A" : "B"});
  ReplayOptions o;
  o.models = {"Llama-3.2-3B"};
  const std::vector<ReplayResult> r = run_replay(trace, o);
  const nlohmann::json j = nlohmann::json::parse(replay_json(r, o));
  EXPECT_EQ(j["schema"], "spillway.replay/1");
  EXPECT_EQ(j["configurations"].size(), 6u);
  EXPECT_EQ(j["lengths"]["note"], "drawn: the trace has no token counts");
  const std::string svg = replay_svg(r);
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  EXPECT_NE(svg.find("host-resident"), std::string::npos);
  const std::string text = format_replay(r, o, 2);
  EXPECT_NE(text.find("token counts are not in the trace"), std::string::npos) << text;
  EXPECT_THROW((void)run_replay({}, o), InputError);
}

}  // namespace
}  // namespace spillway
