// The serving engine when things go wrong (spillway/inference/inference.hpp): a checkpoint changed
// on disk under a running engine fails only the requests that need it and the engine goes on (Note
// [Checkpoints that change on disk], Note [Slice failures]); cancel_all and drain_for end
// every request; options that would make the server useless and requests or directories
// that are wrong are refused naming the right thing.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <chrono>
#include <filesystem>

#include "inference/served_models.hpp"
#include "spillway/catalog/hardware.hpp"
#include "spillway/core/error.hpp"
#include "spillway/inference/inference.hpp"
#include "spillway/nn/decoder.hpp"
#include "spillway/nn/nn.hpp"
#include "spillway/serve/serve.hpp"
#include "test_support.hpp"

namespace spillway::inference {
namespace {

using testing::bytes;
using testing::complete;
using testing::fast;
using testing::models;
using testing::request;

namespace fs = std::filesystem;
using spillway::testing::expect_error;
using spillway::testing::TempDir;

// Reads c to its end: the tokens, and the final state in *st.
std::vector<int32_t> read_all(Completion& c, Completion::State* st) {
  std::vector<int32_t> t;
  while ((*st = c.wait_tokens(t.size(), &t)) == Completion::State::kRunning) {
  }
  return t;
}

// A directory with tiny-a (seed 1) and tiny-b (seed 2), fp32, for a test to change.
struct OwnModels {
  TempDir dir;
  std::vector<ModelFiles> files;
  OwnModels() {
    write_checkpoint("tiny-moe", 1, (dir.path() / "tiny-a").string(), DType::kFp32);
    write_checkpoint("tiny-moe", 2, (dir.path() / "tiny-b").string(), DType::kFp32);
    files = find_models(dir.path().string());
  }
  const std::string& weights(const std::string& name) const {
    return name == "tiny-a" ? files[0].weights_path : files[1].weights_path;
  }
};

// Puts a checkpoint of tiny-moe from `seed` in `dtype` over `weights` whole, by a rename (as
// Note [Checkpoints that change on disk] asks); returns the greedy completion of q that a
// fresh engine serving only that checkpoint gives.
std::vector<int32_t> replace_by_rename(const std::string& weights, uint64_t seed, DType dtype,
                                       const CompletionRequest& q, const EngineOptions& o) {
  TempDir other;
  const fs::path dir = other.path() / q.model;
  write_checkpoint("tiny-moe", seed, dir.string(), dtype);
  std::vector<int32_t> want;
  {
    ServingEngine alone(find_models(other.path().string()), o);
    want = complete(alone, q);
  }
  const fs::path staged = weights + ".new";
  fs::copy_file(dir / "model.safetensors", staged);
  fs::rename(staged, weights);
  return want;
}

TEST(ServingEngineFailures, ACheckpointChangedOnDiskFailsOnlyItsRequestsAndTheEngineGoesOn) {
  // Two slices; tiny-b streams while tiny-a's checkpoint, not yet loaded, is cut in half on
  // disk. tiny-a's requests fail naming it; tiny-b's stream ends whole; the engine answers
  // (tiny-a refused with the reason while its file is bad, served again once it is whole).
  // Before the fix the load threw on the slice thread: std::terminate ended the process.
  OwnModels m;
  EngineOptions o = fast("3g.48gb", 0.0);
  o.rate_scale = 1e-4;  // slow: tiny-b still streams when tiny-a fails
  ServingEngine e(m.files, o);
  ASSERT_EQ(e.slices(), 2);
  SubmitResult b = e.submit(request("tiny-b", "the other stream", 80));
  ASSERT_EQ(b.status, SubmitStatus::kAccepted) << b.message;
  std::vector<int32_t> tb;
  ASSERT_EQ(b.completion->wait_tokens(0, &tb), Completion::State::kRunning);  // it streams

  const std::string a_weights = m.weights("tiny-a");
  fs::resize_file(a_weights, fs::file_size(a_weights) / 2);
  std::vector<std::shared_ptr<Completion>> failed;
  for (int i = 0; i < 2; ++i) {
    SubmitResult a = e.submit(request("tiny-a", "needs the file " + std::to_string(i), 8));
    if (i == 1 && a.status == SubmitStatus::kUnavailable) break;  // the first failed already
    ASSERT_EQ(a.status, SubmitStatus::kAccepted) << a.message;
    failed.push_back(a.completion);
  }
  for (const auto& c : failed) {
    Completion::State st;
    EXPECT_TRUE(read_all(*c, &st).empty());
    EXPECT_EQ(st, Completion::State::kFailed);
    for (const char* needle : {"model tiny-a is unavailable", "model.safetensors", "truncated"})
      EXPECT_NE(c->error().find(needle), std::string::npos) << needle << " in: " << c->error();
  }
  EXPECT_EQ(b.completion->state(), Completion::State::kRunning) << "tiny-b ended too soon";
  // The other stream is untouched: every token, "length".
  Completion::State st;
  tb = read_all(*b.completion, &st);
  EXPECT_EQ(st, Completion::State::kDone) << b.completion->error();
  EXPECT_EQ(tb.size(), 80u);
  EXPECT_EQ(b.completion->finish_reason(), "length");

  // While the file is bad: refused at once, naming the model and the reason.
  const SubmitResult refused = e.submit(request("tiny-a", "still bad", 4));
  EXPECT_EQ(refused.status, SubmitStatus::kUnavailable);
  EXPECT_EQ(refused.field, "model");
  EXPECT_NE(refused.message.find("model tiny-a is unavailable"), std::string::npos)
      << refused.message;
  EXPECT_NE(refused.message.find("truncated"), std::string::npos) << refused.message;
  EXPECT_EQ(std::string(to_string(SubmitStatus::kUnavailable)), "unavailable");
  // The engine still serves the other model.
  EXPECT_EQ(complete(e, request("tiny-b", "still here", 3)).size(), 3u);
  // A whole checkpoint renamed into place: served again, its weights.
  const CompletionRequest qa = request("tiny-a", "whole again", 8);
  const std::vector<int32_t> want = replace_by_rename(a_weights, 1, DType::kFp32, qa, o);
  EXPECT_EQ(complete(e, qa), want);
  const EngineMetrics mt = e.metrics();
  EXPECT_EQ(mt.requests.at("unavailable"), 3);  // one or two failed, the rest refused
  EXPECT_EQ(mt.requests.at("ok"), 3);
  EXPECT_EQ(e.in_flight(), 0);
}

TEST(ServingEngineFailures, AModelReloadedAfterAnEvictionReadsTheFileAsItIsNow) {
  // One slice and room for one model: every switch evicts the other and reloads from disk.
  // tiny-a replaced by another whole checkpoint of its config is served with the new
  // weights; replaced by one in another dtype it is refused (the server serves the layout it
  // started with); truncated in place its requests fail; tiny-b is served throughout.
  OwnModels m;
  EngineOptions o = fast("7g.96gb", 0.0);
  o.host_budget_bytes = SafetensorsFile(m.weights("tiny-a")).data_bytes() * 3 / 2;
  ServingEngine e(m.files, o);
  const CompletionRequest qa = request("tiny-a", "reloaded from disk", 8);
  const CompletionRequest qb = request("tiny-b", "the other model", 6);
  const std::vector<int32_t> first = complete(e, qa);
  const std::vector<int32_t> other = complete(e, qb);  // tiny-a evicted
  const std::vector<int32_t> seven = replace_by_rename(m.weights("tiny-a"), 7, DType::kFp32, qa, o);
  ASSERT_NE(seven, first);
  EXPECT_EQ(complete(e, qa), seven);
  EXPECT_EQ(complete(e, qb), other);

  auto expect_fails = [&](std::initializer_list<const char*> needles) {
    SubmitResult r = e.submit(qa);
    ASSERT_EQ(r.status, SubmitStatus::kAccepted) << r.message;
    Completion::State st;
    read_all(*r.completion, &st);
    EXPECT_EQ(st, Completion::State::kFailed);
    for (const char* needle : needles)
      EXPECT_NE(r.completion->error().find(needle), std::string::npos)
          << needle << " in: " << r.completion->error();
  };
  (void)replace_by_rename(m.weights("tiny-a"), 7, DType::kBf16, qa, o);
  expect_fails({"model tiny-a is unavailable", "another dtype", "restart"});
  EXPECT_EQ(complete(e, qb), other);
  // Back to the fp32 checkpoint, then cut in place once tiny-b has evicted it.
  (void)replace_by_rename(m.weights("tiny-a"), 7, DType::kFp32, qa, o);
  EXPECT_EQ(complete(e, qa), seven);
  EXPECT_EQ(complete(e, qb), other);
  fs::resize_file(m.weights("tiny-a"), 100);
  expect_fails({"model tiny-a is unavailable", "changed on disk", "truncated"});
  EXPECT_EQ(e.submit(qa).status, SubmitStatus::kUnavailable);
  EXPECT_EQ(complete(e, qb), other);
  EXPECT_EQ(e.in_flight(), 0);
}

TEST(ServingEngineFailures, CancelAllEndsEveryRequestWhereverItIs) {
  // One slow slice, two sequences: requests running, in the slice's inbox behind another
  // model, and queued. cancel_all ends each kCancelled (the running ones at the slice's next
  // iteration), nothing counts twice, and drain_for then finds nothing in flight.
  OwnModels m;
  EngineOptions o = fast("7g.96gb", 0.0);
  o.rate_scale = 1e-4;
  o.max_running = 2;
  ServingEngine e(m.files, o);
  std::vector<std::shared_ptr<Completion>> cs;
  for (int i = 0; i < 6; ++i) {
    SubmitResult r = e.submit(request(i < 2 ? "tiny-a" : (i % 2 ? "tiny-a" : "tiny-b"),
                                      "long request " + std::to_string(i), 60));
    ASSERT_EQ(r.status, SubmitStatus::kAccepted) << r.message;
    cs.push_back(r.completion);
  }
  std::vector<int32_t> t;
  ASSERT_EQ(cs[0]->wait_tokens(0, &t), Completion::State::kRunning);  // running
  EXPECT_EQ(e.cancel_all("the drain's deadline passed"), 6);
  for (size_t i = 0; i < cs.size(); ++i) {
    Completion::State st;
    const std::vector<int32_t> got = read_all(*cs[i], &st);
    EXPECT_EQ(st, Completion::State::kCancelled) << "request " << i;
    EXPECT_LT(got.size(), 60u) << "request " << i;
  }
  EXPECT_TRUE(e.drain_for(std::chrono::seconds(10)));
  EXPECT_EQ(e.in_flight(), 0);
  const EngineMetrics mt = e.metrics();
  EXPECT_EQ(mt.requests.at("cancelled"), 6);
  EXPECT_EQ(mt.requests.at("ok"), 0);
  EXPECT_EQ(e.cancel_all("again"), 0);
  EXPECT_EQ(e.submit(request("tiny-a", "late", 2)).status, SubmitStatus::kDraining);
  // A timed wait returns with nothing new while a request runs; drain_for times out while
  // one is in flight.
  ServingEngine f(m.files, o);
  SubmitResult r = f.submit(request("tiny-b", "timed waits", 60));
  ASSERT_EQ(r.status, SubmitStatus::kAccepted);
  t.clear();
  ASSERT_EQ(r.completion->wait_tokens(0, &t), Completion::State::kRunning);
  const size_t have = t.size();
  EXPECT_FALSE(f.drain_for(std::chrono::milliseconds(1)));
  EXPECT_EQ(r.completion->wait_tokens_for(60, &t, std::chrono::milliseconds(1)),
            Completion::State::kRunning);
  EXPECT_EQ(t.size(), have);  // nothing past token 60 (there is none)
  r.completion->cancel();
  EXPECT_TRUE(f.drain_for(std::chrono::seconds(10)));
  EXPECT_EQ(r.completion->state(), Completion::State::kCancelled);
}

TEST(ServingEngineFailures, ARequestCancelledWhileItWaitsEndsWithoutRunning) {
  // tiny-b runs on the only slice; a tiny-a request waits for it (queued, or in the inbox
  // behind it). Cancelled, it ends before tiny-b does and never runs.
  OwnModels m;
  EngineOptions o = fast("7g.96gb", 0.0);
  o.rate_scale = 1e-4;
  ServingEngine e(m.files, o);
  SubmitResult b = e.submit(request("tiny-b", "holds the slice", 60));
  ASSERT_EQ(b.status, SubmitStatus::kAccepted);
  std::vector<int32_t> t;
  ASSERT_EQ(b.completion->wait_tokens(0, &t), Completion::State::kRunning);
  SubmitResult a = e.submit(request("tiny-a", "waits", 4));
  ASSERT_EQ(a.status, SubmitStatus::kAccepted);
  a.completion->cancel();
  // Another request's submit or end runs the queue; one comes now.
  SubmitResult c = e.submit(request("tiny-b", "joins the batch", 2));
  ASSERT_EQ(c.status, SubmitStatus::kAccepted);
  Completion::State st;
  EXPECT_TRUE(read_all(*a.completion, &st).empty());
  EXPECT_EQ(st, Completion::State::kCancelled);
  EXPECT_EQ(b.completion->state(), Completion::State::kRunning);
  b.completion->cancel();
  e.drain();
  EXPECT_EQ(e.metrics().cold_loads, 1);  // tiny-b only: the cancelled tiny-a never loaded
}

TEST(ServingEngineFailures, OptionsThatMakeTheServerUselessAreRefused) {
  const auto& m = models();
  EngineOptions o = fast();
  o.max_waiting = 0;
  expect_error([&] { ServingEngine e(m.files, o); },
               {"max_waiting", "0", "every request would be refused"});
  o.max_waiting = -3;
  expect_error([&] { ServingEngine e(m.files, o); }, {"max_waiting", "-3"});
  o.max_waiting = 1;
  ServingEngine e(m.files, o);
  EXPECT_EQ(complete(e, request("tiny-a", "one may wait", 2)).size(), 2u);
}

TEST(ServingEngineFailures, ADecoderTooLargeForTheProfileNamesOneThatHoldsIt) {
  const auto& m = models();
  const nn::RefConfig c = nn::load_reference_config(m.files[0].config_path);
  EngineOptions o = fast("1g.12gb");
  const auto need = static_cast<double>(nn::Decoder::device_bytes_for(
      c, nn::DecoderOptions{o.max_running, o.max_context, o.max_step_tokens}));
  // Between a 12 GB slice and a 24 GB one: the 24 GB profile that cuts more slices.
  o.memory_scale = need / 18e9;
  expect_error([&] { ServingEngine e(m.files, o); },
               {"max_running", "1g.12gb slice", "the profile 1g.24gb of gh200", "holds it"});
  o.profile = "1g.24gb";
  EXPECT_NO_THROW({ ServingEngine ok(m.files, o); });
  // Beyond the largest: the flags to change, and the memory_scale that holds it does.
  o.profile = "1g.12gb";
  o.memory_scale = need / 200e9;
  const std::string msg = spillway::testing::error_of([&] { ServingEngine e(m.files, o); });
  for (const char* needle :
       {"no MIG profile of gh200", "7g.96gb", "memory_scale >= ", "max_running", "max_context"})
    EXPECT_NE(msg.find(needle), std::string::npos) << needle << " in: " << msg;
  const size_t at = msg.find("memory_scale >= ") + std::string("memory_scale >= ").size();
  o.profile = "7g.96gb";
  o.memory_scale = std::stod(msg.substr(at));
  EXPECT_NO_THROW({ ServingEngine ok(m.files, o); }) << msg;
}

TEST(ServingEngineFailures, LengthErrorsBlameThePromptOrSayTheMaximum) {
  const auto& m = models();
  ServingEngine e(m.files, fast());  // max_context 96
  SubmitResult r = e.submit(request("tiny-a", std::string(96, 'x'), 1));
  EXPECT_EQ(r.status, SubmitStatus::kInvalid);
  EXPECT_EQ(r.field, "prompt");
  for (const char* needle : {"96 tokens", "holds 96", "at most 95"})
    EXPECT_NE(r.message.find(needle), std::string::npos) << needle << " in: " << r.message;
  r = e.submit(request("tiny-a", std::string(120, 'x'), 16));
  EXPECT_EQ(r.field, "prompt");
  r = e.submit(request("tiny-a", std::string(90, 'x'), 10));
  EXPECT_EQ(r.status, SubmitStatus::kInvalid);
  EXPECT_EQ(r.field, "max_tokens");
  for (const char* needle : {"max_tokens is 10", "at most 6", "90 tokens"})
    EXPECT_NE(r.message.find(needle), std::string::npos) << needle << " in: " << r.message;
  EXPECT_EQ(complete(e, request("tiny-a", std::string(90, 'x'), 6)).size(), 6u);
}

TEST(ServingEngineFailures, ModelDirectoriesThatAreWrongSaySo) {
  const auto& m = models();
  const nn::RefConfig c = nn::load_reference_config(m.files[0].config_path);
  // model.safetensors a directory: named as one (it was "cannot map: No such device").
  TempDir d;
  fs::create_directories(d.path() / "m" / "model.safetensors");
  fs::copy_file(m.files[0].config_path, d.path() / "m" / "config.json");
  expect_error([&] { find_models(d.path().string()); },
               {"model.safetensors is a directory", "not a file"});
  expect_error([&] { check_checkpoint("m", c, (d.path() / "m" / "model.safetensors").string()); },
               {"model.safetensors", "is a directory"});
  // A FIFO: refused at once, not waited on.
  const fs::path fifo = d.path() / "fifo.safetensors";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  expect_error([&] { check_checkpoint("m", c, fifo.string()); }, {"not a regular file"});
  // config.json a directory.
  TempDir e;
  fs::create_directories(e.path() / "m" / "config.json");
  fs::copy_file(m.files[0].weights_path, e.path() / "m" / "model.safetensors");
  expect_error([&] { find_models(e.path().string()); }, {"config.json is a directory"});
  // --models a file.
  expect_error([&] { find_models(m.files[0].weights_path); }, {"is not a directory"});
}

}  // namespace
}  // namespace spillway::inference
