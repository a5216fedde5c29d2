// The serving engine's state (ServingEngine::Impl, include/spillway/inference/inference.hpp),
// shared by the files that make it up: engine.cpp (construction, submit, drain, cancel),
// slice_threads.cpp (dispatch to the slices and each slice's thread: binding a model, the
// re-reads of a changed checkpoint, admission, the decoder step), sampling.cpp (a token
// drawn from the logits, its logprobs, the stop sequences), completion.cpp (Completion) and
// metrics.cpp (EngineMetrics and the /metrics text).
#pragma once

#include <fmt/format.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <unordered_set>
#include <utility>
#include <vector>

#include "inference/pooled_weights.hpp"
#include "spillway/inference/inference.hpp"
#include "spillway/serve/scheduler.hpp"
#include "spillway/serve/serve.hpp"
#include "spillway/serve/slices.hpp"

namespace spillway::inference {
namespace detail {

using Clock = std::chrono::steady_clock;

inline double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// Histogram upper bounds (seconds) of TTFT and TPOT.
inline const std::vector<double> kTtftBounds = {0.005, 0.01, 0.025, 0.05, 0.1,  0.25,
                                                0.5,   1.0,  2.5,   5.0,  10.0, 30.0};
inline const std::vector<double> kTpotBounds = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                                0.1,   0.25,   0.5,   1.0,  2.5};

struct Registered {
  ModelFiles files;
  std::string config_text;
  nn::RefConfig config;
  ResolvedWeights parts;  // Note [Checkpoint resolution]
  int64_t weight_bytes = 0;
  DType dtype = DType::kFp32;
  std::shared_ptr<ModelText> text;  // Note [Model text]
};

struct Request {
  CompletionRequest req;
  const Registered* model = nullptr;
  std::shared_ptr<Completion> out;
  int64_t chunk = 0;
  int slice = -1;
};

// A request on a slice's decoder.
struct Running {
  std::shared_ptr<Request> r;
  int sequence = 0;
  size_t prompt_pos = 0;  // prompt tokens fed so far
  int generated = 0;
  int32_t last = 0;  // the token to feed next while decoding
  std::mt19937_64 rng;
  // Note [Stop sequences]: generated tokens not yet published (the last longest-stop - 1).
  std::vector<int32_t> held;
  size_t hold = 0;
  // Note [Logprobs]: the held tokens' log-probabilities and top entries (req.logprobs each).
  std::vector<float> held_lp;
  std::vector<std::pair<int32_t, float>> held_top;
};

// Note [Sampling] (sampling.cpp): the next token from `logits`.
int32_t sample(const float* logits, int vocab, double temperature, double top_p,
               std::mt19937_64& rng, std::vector<int32_t>& order);
// Note [Logprobs] (sampling.cpp): `token`'s log-probability and the top entries, held.
void held_logprobs(Running& run, const float* logits, int vocab, int32_t token);
// Note [Stop sequences] (sampling.cpp): publishes what may be published after run.last;
// the finish reason, or nullptr while the request goes on.
const char* after_token(Running& run, std::chrono::steady_clock::time_point now);

// `what` without a leading "model NAME: " (or "model 'NAME': "): the caller names the model.
inline std::string without_model(const std::string& name, const std::string& what) {
  for (const std::string& prefix : {"model " + name + ": ", "model '" + name + "': "})
    if (what.compare(0, prefix.size(), prefix) == 0) return what.substr(prefix.size());
  return what;
}

}  // namespace detail

struct ServingEngine::Impl {
  EngineOptions o;
  std::vector<detail::Registered> models;
  std::vector<RefusedModel> refused;  // Note [Refused model directories]
  SliceSetup setup;
  std::shared_ptr<HostLink> link;
  std::unique_ptr<Device> pool_device;
  std::unique_ptr<ModelPool> pool;
  std::unique_ptr<Scheduler> scheduler;
  detail::Clock::time_point start_time = detail::Clock::now();

  struct Slice {
    std::unique_ptr<EmulatedSlice> slice;
    std::deque<std::shared_ptr<detail::Request>> inbox;  // guarded by mu
    std::condition_variable cv;
    std::thread thread;
    // The slice thread's own.
    const detail::Registered* bound = nullptr;
    ModelHandle handle;
    std::unique_ptr<PooledWeights> weights;
    std::unique_ptr<nn::Decoder> decoder;
    const nn::RefConfig* decoder_config = nullptr;
    std::vector<int32_t> sample_order;  // Note [Sampling]: top-p's scratch, grown once
    std::vector<detail::Running> running;
    std::vector<int> free_sequences;
    std::vector<float> logits;
    std::vector<nn::DecodeChunk> chunks;
    std::vector<size_t> who;
    std::vector<std::pair<size_t, const char*>> finished;
    AlphaController controller;
    // Metrics (guarded by mu).
    std::string model;
    double alpha = 0.0;
    int64_t iterations = 0;
    int64_t link_bytes = 0;
    int64_t hbm_bytes = 0;
    int64_t running_count = 0;
  };
  std::vector<std::unique_ptr<Slice>> slices;

  mutable std::mutex mu;
  std::condition_variable idle_cv;
  std::deque<std::shared_ptr<detail::Request>> pending;
  bool draining = false;
  bool stopping = false;
  int64_t in_flight = 0;
  std::unordered_set<const detail::Request*> accepted;  // in flight (guarded by mu)
  // Models whose checkpoint cannot be served now, and why (guarded by mu; Note [Checkpoints
  // that change on disk]).
  struct Unavailable {
    std::string why;
    std::vector<FileStamp> stamps;  // the files found bad (SafetensorsSet::stamps_now)
  };
  std::map<const detail::Registered*, Unavailable> unavailable;
  // Metrics (guarded by mu).
  std::map<std::string, int64_t> outcomes;
  int64_t tokens_generated = 0, prompt_tokens = 0, within_slo = 0;
  int64_t switches = 0, cold_loads = 0;
  std::vector<int64_t> ttft_hist, tpot_hist;
  double ttft_sum = 0, tpot_sum = 0;
  int64_t ttft_n = 0, tpot_n = 0;

  const detail::Registered* find(const std::string& name) const {
    for (const detail::Registered& m : models)
      if (m.files.name == name) return &m;
    return nullptr;
  }

  // Note [Serving engine]: place what waits, oldest first; a placed request goes to its
  // slice's inbox.
  void dispatch_locked();

  // A prefill chunk never takes more than half a step: the decoding requests always fit
  // beside it (max_running <= the other half, checked).
  int64_t max_chunk() const { return o.max_step_tokens / 2; }

  void record_end(const detail::Request& r, Completion::State st, const char* outcome) {
    ++outcomes[outcome];
    --in_flight;
    accepted.erase(&r);
    if (st == Completion::State::kDone) {
      const double ttft = r.out->ttft_ms(), tpot = r.out->tpot_ms();
      auto bucket = [](std::vector<int64_t>& h, const std::vector<double>& bounds, double s) {
        for (size_t i = 0; i < bounds.size(); ++i)
          if (s <= bounds[i]) ++h[i];
        ++h.back();
      };
      if (ttft >= 0) {
        bucket(ttft_hist, detail::kTtftBounds, ttft / 1e3);
        ttft_sum += ttft / 1e3;
        ++ttft_n;
      }
      if (tpot >= 0) {
        bucket(tpot_hist, detail::kTpotBounds, tpot / 1e3);
        tpot_sum += tpot / 1e3;
        ++tpot_n;
      }
      if (ttft >= 0 && ttft <= o.ttft_ms && tpot <= o.tpot_ms) ++within_slo;
    }
    idle_cv.notify_all();
  }

  // Note [Checkpoints that change on disk]: reads m's checkpoint again and checks it
  // against m's config and registered tensors: true when it may be served (the pool loads it
  // next); false with *why, the reason (the caller names the model).
  bool reread(const detail::Registered& m, std::string* why);
  // `stamps`: the files as they were before the check that failed (empty: not the files'
  // fault); a submit reads them again only once their stamps differ.
  void mark_unavailable(const detail::Registered& m, const std::string& why,
                        std::vector<FileStamp> stamps) {
    std::lock_guard lk(mu);
    unavailable[&m] = {why, std::move(stamps)};
  }

  // The slice thread (Note [Serving engine]).
  void run_slice(int index);
  // The slice's model is m from now on; *started: 1 when that took a switch, 2 a cold load.
  // May throw (a decoder, the pooled weights): the caller fails the requests (Note [Slice
  // failures]).
  bool bind(Slice& s, const detail::Registered& m, std::string* why, int* started);
  void unbind(Slice& s) {
    s.weights.reset();
    s.handle.release();
    s.bound = nullptr;
  }
  // Starts the requests taken from the inbox (one model), or ends them: cancelled ones, and
  // all of them when the model cannot be bound. Never throws.
  void admit_requests(int index, Slice& s, std::vector<std::shared_ptr<detail::Request>>& admit);
  // Ends r, placed on slice `index` and not on its decoder (mu held): scheduler, metrics,
  // completion.
  void end_placed_locked(int index, detail::Request& r, Completion::State st, const char* outcome,
                         std::string why) {
    scheduler->finish(index, static_cast<int64_t>(r.req.prompt.size()), r.req.max_tokens);
    record_end(r, st, outcome);
    r.out->finish(st, std::move(why));
  }
  void iterate(int index, Slice& s);
  void end_request(int index, Slice& s, size_t at, Completion::State st, const char* outcome,
                   std::string why);
  // Note [Slice failures]: a step threw; every request it carried fails, naming the model,
  // and the slice starts afresh (its decoder and weights rebuilt at the next bind).
  void fail_running(int index, Slice& s, const std::string& what) {
    const std::string model = s.bound != nullptr ? s.bound->files.name : std::string("?");
    for (size_t i = s.running.size(); i-- > 0;)
      end_request(index, s, i, Completion::State::kFailed, "failed",
                  fmt::format("model {}: slice {} failed: {}", model, index, what));
    unbind(s);
    s.decoder.reset();
    s.decoder_config = nullptr;
  }
};

}  // namespace spillway::inference
