// What the server tests share: two tiny-moe checkpoints written once per test binary, and
// an engine setup fast enough for unit tests.
#pragma once

#include <string>
#include <vector>

#include "spillway/inference/inference.hpp"
#include "test_support.hpp"

namespace spillway::inference::testing {

// Two tiny-moe checkpoints (seeds 1 and 2), fp32, in one models directory.
struct Models {
  spillway::testing::TempDir dir;
  std::vector<ModelFiles> files;
  Models() {
    write_checkpoint("tiny-moe", 1, (dir.path() / "tiny-a").string(), DType::kFp32);
    write_checkpoint("tiny-moe", 2, (dir.path() / "tiny-b").string(), DType::kFp32);
    files = find_models(dir.path().string());
  }
};

inline Models& models() {
  static Models m;
  return m;
}

// Small and quick: rates x 1e-2, 4 sequences of 96 tokens per slice; alpha < 0 adapts.
inline EngineOptions fast(const std::string& profile = "1g.12gb", double alpha = -1.0) {
  EngineOptions o;
  o.profile = profile;
  o.rate_scale = 1e-2;
  o.memory_scale = 1e-3;
  o.max_running = 4;
  o.max_context = 96;
  o.max_step_tokens = 64;
  o.alpha = alpha;
  return o;
}

inline std::vector<int32_t> bytes(const std::string& s) {
  return {s.begin(), s.end()};
}

// A greedy (by default) request of `prompt`'s bytes.
inline CompletionRequest request(const std::string& model, const std::string& prompt,
                                 int max_tokens, double temperature = 0.0, uint64_t seed = 0) {
  CompletionRequest q;
  q.model = model;
  q.prompt = bytes(prompt);
  q.max_tokens = max_tokens;
  q.temperature = temperature;
  q.seed = seed;
  return q;
}

// The engine's completion of q, submitted directly and read to its end (expected done).
inline std::vector<int32_t> complete(ServingEngine& e, const CompletionRequest& q) {
  SubmitResult r = e.submit(q);
  EXPECT_EQ(r.status, SubmitStatus::kAccepted) << r.message;
  if (r.status != SubmitStatus::kAccepted) return {};
  std::vector<int32_t> toks;
  Completion::State st;
  while ((st = r.completion->wait_tokens(toks.size(), &toks)) == Completion::State::kRunning) {
  }
  EXPECT_EQ(st, Completion::State::kDone) << r.completion->error();
  EXPECT_EQ(r.completion->finish_reason(), "length");
  return toks;
}

}  // namespace spillway::inference::testing
