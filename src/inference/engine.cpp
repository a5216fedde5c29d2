// The live serving engine (spillway/inference.hpp, Note [Serving engine], Note [Served
// determinism]).
#include <fmt/format.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <deque>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>
#include <thread>
#include <unordered_set>
#include <utility>

#include "core/enum_names.hpp"
#include "inference/pooled_weights.hpp"
#include "spillway/error.hpp"
#include "spillway/hardware.hpp"
#include "spillway/inference.hpp"
#include "spillway/scheduler.hpp"
#include "spillway/serve.hpp"
#include "spillway/slices.hpp"

namespace spillway::inference {
namespace {

using Clock = std::chrono::steady_clock;

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// The prefill chunk sizes the engine offers the Scheduler.
constexpr int64_t kChunkSizes[] = {16, 32, 64, 128, 256};

// Histogram upper bounds (seconds) of TTFT and TPOT.
const std::vector<double> kTtftBounds = {0.005, 0.01, 0.025, 0.05, 0.1,  0.25,
                                         0.5,   1.0,  2.5,   5.0,  10.0, 30.0};
const std::vector<double> kTpotBounds = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
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

// Publishes held token i (with its logprobs when the request asked).
void publish(Running& run, size_t i, std::chrono::steady_clock::time_point now) {
  const int k = run.r->req.logprobs;
  if (k < 0) {
    run.r->out->push(run.held[i], now);
    return;
  }
  run.r->out->push(run.held[i], run.held_lp[i], run.held_top.data() + i * static_cast<size_t>(k),
                   now);
}

// Drops the first n held tokens (published or a stop sequence's).
void drop_held(Running& run, size_t n) {
  run.held.erase(run.held.begin(), run.held.begin() + static_cast<long>(n));
  if (run.r->req.logprobs < 0) return;
  run.held_lp.erase(run.held_lp.begin(), run.held_lp.begin() + static_cast<long>(n));
  run.held_top.erase(run.held_top.begin(),
                     run.held_top.begin() + static_cast<long>(n) * run.r->req.logprobs);
}

// Note [Logprobs]: the log-softmax of `logits` at `token` and the k most likely tokens'
// (most likely first, ties by id), appended to run's held logprobs. Two passes over the
// vocabulary; nothing allocated once the held vectors have grown.
void held_logprobs(Running& run, const float* logits, int vocab, int32_t token) {
  const int k = run.r->req.logprobs;
  float mx = logits[0];
  for (int v = 1; v < vocab; ++v) mx = std::max(mx, logits[v]);
  double sum = 0.0;
  for (int v = 0; v < vocab; ++v) sum += std::exp(static_cast<double>(logits[v]) - mx);
  const double lse = mx + std::log(sum);
  run.held_lp.push_back(static_cast<float>(logits[token] - lse));
  const size_t at = run.held_top.size();
  run.held_top.resize(at + static_cast<size_t>(k), {-1, 0.0f});
  std::pair<int32_t, float>* top = run.held_top.data() + at;
  int have = 0;
  for (int v = 0; v < vocab && k > 0; ++v) {
    // Insert (v, logit) into the sorted top if it beats the last (the first seen wins ties).
    if (have == k && !(logits[v] > top[k - 1].second)) continue;
    int i = have < k ? have++ : k - 1;
    for (; i > 0 && logits[v] > top[i - 1].second; --i) top[i] = top[i - 1];
    top[i] = {v, logits[v]};
  }
  for (int i = 0; i < k; ++i)
    top[i].second = static_cast<float>(static_cast<double>(top[i].second) - lse);
}

// Note [Stop sequences]: a request with stop sequences publishes a token only once no stop
// sequence can still end on it: the last (longest - 1) tokens are held back. When the
// newest tokens equal a stop sequence, the tokens before it are published and the request
// ends with "stop" (the sequence itself is not part of the output, as OpenAI's API has it);
// at max_tokens everything held is published and it ends with "length". Returns the finish
// reason, or nullptr while it goes on.
const char* after_token(Running& run, std::chrono::steady_clock::time_point now) {
  // Note [Model text]: an end-of-sequence token ends the request, left out.
  const std::vector<int32_t>& eos = run.r->req.eos;
  if (std::find(eos.begin(), eos.end(), run.last) != eos.end()) {
    for (size_t i = 0; i < run.held.size(); ++i) publish(run, i, now);
    drop_held(run, run.held.size());
    return "stop";
  }
  run.held.push_back(run.last);
  const std::vector<std::vector<int32_t>>& stops = run.r->req.stop;
  for (const std::vector<int32_t>& st : stops) {
    if (run.held.size() < st.size() ||
        !std::equal(st.begin(), st.end(), run.held.end() - static_cast<long>(st.size())))
      continue;
    for (size_t i = 0; i + st.size() < run.held.size(); ++i) publish(run, i, now);
    drop_held(run, run.held.size());
    return "stop";
  }
  const bool last = run.generated >= run.r->req.max_tokens;
  const size_t ready =
      last ? run.held.size() : (run.held.size() > run.hold ? run.held.size() - run.hold : 0);
  for (size_t i = 0; i < ready; ++i) publish(run, i, now);
  drop_held(run, ready);
  return last ? "length" : nullptr;
}

// Whether a decoder built for a serves b: the same weights (names and shapes) and the same
// constants of its arithmetic. (Models of one architecture share a slice's decoder.)
bool same_decoder(const nn::RefConfig& a, const nn::RefConfig& b) {
  // (rope_theta is in the frequencies; biases, q/k norms, sandwich norms and shared experts
  // are weights: compared below)
  if (a.vocab != b.vocab || a.hidden != b.hidden || a.heads != b.heads ||
      a.kv_heads != b.kv_heads || a.head_dim != b.head_dim || a.rms_eps != b.rms_eps ||
      a.norm_topk != b.norm_topk || a.rope_inv_freq != b.rope_inv_freq ||
      a.rope_attention_factor != b.rope_attention_factor ||
      a.rope_local_inv_freq != b.rope_local_inv_freq ||
      a.rope_local_attention_factor != b.rope_local_attention_factor ||
      a.rope_dynamic_factor != b.rope_dynamic_factor ||
      a.rope_dynamic_length != b.rope_dynamic_length || a.norm_offset != b.norm_offset ||
      a.embed_scale != b.embed_scale || a.gelu_mlp != b.gelu_mlp || a.attn_scale != b.attn_scale ||
      a.attn_softcap != b.attn_softcap || a.final_softcap != b.final_softcap)
    return false;
  if (a.layers() != b.layers()) return false;
  for (int l = 0; l < a.layers(); ++l)  // the layers' sliding windows
    if (a.model.layers[static_cast<size_t>(l)].attn.sliding_window !=
        b.model.layers[static_cast<size_t>(l)].attn.sliding_window)
      return false;
  const std::vector<nn::WeightSpec> x = nn::weight_specs(a), y = nn::weight_specs(b);
  if (x.size() != y.size()) return false;
  for (size_t i = 0; i < x.size(); ++i)
    if (x[i].name != y[i].name || x[i].shape != y[i].shape) return false;
  return true;
}

// `what` without a leading "model NAME: " (or "model 'NAME': "): the caller names the model.
std::string without_model(const std::string& name, const std::string& what) {
  for (const std::string& prefix : {"model " + name + ": ", "model '" + name + "': "})
    if (what.compare(0, prefix.size(), prefix) == 0) return what.substr(prefix.size());
  return what;
}

// Note [Sampling]: greedy at temperature 0; else the softmax of logits / temperature, cut to
// its nucleus when top_p < 1 (the most likely tokens, by logit and then id, up to the one that
// brings their mass to top_p, as vLLM's top-p keeps them), drawn with one 53-bit uniform of
// the request's own generator. `order` is the caller's scratch (vocab entries once grown).
int32_t sample(const float* logits, int vocab, double temperature, double top_p,
               std::mt19937_64& rng, std::vector<int32_t>& order) {
  if (temperature <= 0.0) {
    int best = 0;
    for (int v = 1; v < vocab; ++v)
      if (logits[v] > logits[best]) best = v;
    return best;
  }
  const float mx = *std::max_element(logits, logits + vocab);
  double sum = 0.0;
  for (int v = 0; v < vocab; ++v) sum += std::exp((logits[v] - mx) / temperature);
  if (top_p < 1.0) {
    order.resize(static_cast<size_t>(vocab));
    for (int v = 0; v < vocab; ++v) order[static_cast<size_t>(v)] = v;
    const auto before = [&](int32_t a, int32_t b) {
      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    };
    for (size_t k = std::min<size_t>(64, order.size());; k = std::min(order.size(), k * 4)) {
      std::partial_sort(order.begin(), order.begin() + static_cast<long>(k), order.end(), before);
      double mass = 0.0;
      size_t n = 0;
      while (n < k && mass < top_p * sum) mass += std::exp((logits[order[n++]] - mx) / temperature);
      if (mass < top_p * sum && k < order.size()) continue;
      const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53 * mass;
      double acc = 0.0;
      for (size_t i = 0; i < n; ++i) {
        acc += std::exp((logits[order[i]] - mx) / temperature);
        if (u < acc) return order[i];
      }
      return order[n - 1];
    }
  }
  // One 53-bit uniform per token from the request's own generator.
  const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53 * sum;
  double acc = 0.0;
  for (int v = 0; v < vocab; ++v) {
    acc += std::exp((logits[v] - mx) / temperature);
    if (u < acc) return v;
  }
  return vocab - 1;
}

// What to change when a decoder needing `need` bytes does not fit o.profile's slices: the
// smallest of hw's MIG profiles whose slice holds it, or, when none does, the flags.
std::string fitting_profile(const HardwareProfile& hw, const EngineOptions& o, int64_t need) {
  const MigProfile* best = nullptr;
  const MigProfile* largest = nullptr;
  for (const MigProfile& p : hw.mig) {
    const auto bytes = static_cast<int64_t>(p.hbm_gb * 1e9 * o.memory_scale);
    if (largest == nullptr || p.hbm_gb > largest->hbm_gb) largest = &p;
    // The least memory; of two alike, the one cutting more slices.
    if (bytes >= need && (best == nullptr || p.hbm_gb < best->hbm_gb ||
                          (p.hbm_gb == best->hbm_gb && p.count > best->count)))
      best = &p;
  }
  if (best != nullptr)
    return fmt::format("the profile {} of {} ({} bytes a slice at this memory_scale) holds it",
                       best->profile, hw.name,
                       static_cast<int64_t>(best->hbm_gb * 1e9 * o.memory_scale));
  if (largest == nullptr) return "lower max_running or max_context";
  const auto largest_bytes = static_cast<int64_t>(largest->hbm_gb * 1e9 * o.memory_scale);
  // The memory_scale that holds it, rounded up to 3 significant digits.
  const double exact = static_cast<double>(need) / (largest->hbm_gb * 1e9);
  const double step = std::pow(10.0, std::floor(std::log10(exact)) - 2);
  const double scale = std::ceil(exact / step) * step;
  return fmt::format(
      "no MIG profile of {} holds it at this memory_scale (the largest, {}, has {} bytes): {}"
      "lower max_running or max_context",
      hw.name, largest->profile, largest_bytes,
      scale <= 1.0
          ? fmt::format("take profile {} with memory_scale >= {:.3g}, or ", largest->profile, scale)
          : std::string());
}

}  // namespace

constexpr EnumNames<SubmitStatus, 6> kSubmitStatusNames = {
    {{SubmitStatus::kAccepted, "accepted"},
     {SubmitStatus::kInvalid, "invalid"},
     {SubmitStatus::kUnknownModel, "unknown_model"},
     {SubmitStatus::kOverloaded, "overloaded"},
     {SubmitStatus::kDraining, "draining"},
     {SubmitStatus::kUnavailable, "unavailable"}}};

const char* to_string(SubmitStatus s) {
  return name_of(kSubmitStatusNames, s).data();  // a literal: null-terminated
}

// ---- Completion ---------------------------------------------------------------------------

Completion::Completion(int max_tokens, int logprobs) : top_k_(logprobs) {
  tokens_.reserve(static_cast<size_t>(max_tokens));
  if (logprobs >= 0) {
    logprob_.reserve(static_cast<size_t>(max_tokens));
    top_.reserve(static_cast<size_t>(max_tokens) * static_cast<size_t>(logprobs));
  }
}

std::vector<TokenLogprobs> Completion::logprobs(size_t from, size_t to) const {
  std::lock_guard lk(mu_);
  std::vector<TokenLogprobs> out;
  if (top_k_ < 0) return out;
  const auto k = static_cast<size_t>(top_k_);
  for (size_t i = from; i < std::min(to, logprob_.size()); ++i)
    out.push_back(
        {logprob_[i],
         {top_.begin() + static_cast<long>(i * k), top_.begin() + static_cast<long>((i + 1) * k)}});
  return out;
}

Completion::State Completion::wait_tokens(size_t have, std::vector<int32_t>* out) {
  std::unique_lock lk(mu_);
  cv_.wait(lk, [&] { return tokens_.size() > have || state_ != State::kRunning; });
  for (size_t i = have; i < tokens_.size(); ++i) out->push_back(tokens_[i]);
  return state_;
}

Completion::State Completion::wait_tokens_for(size_t have, std::vector<int32_t>* out,
                                              std::chrono::milliseconds timeout) {
  std::unique_lock lk(mu_);
  cv_.wait_for(lk, timeout, [&] { return tokens_.size() > have || state_ != State::kRunning; });
  for (size_t i = have; i < tokens_.size(); ++i) out->push_back(tokens_[i]);
  return state_;
}

Completion::State Completion::state() const {
  std::lock_guard lk(mu_);
  return state_;
}

std::string Completion::error() const {
  std::lock_guard lk(mu_);
  return state_ == State::kFailed || state_ == State::kCancelled ? why_ : std::string();
}

std::string Completion::finish_reason() const {
  std::lock_guard lk(mu_);
  return state_ == State::kDone ? why_ : std::string();
}

void Completion::cancel(std::string why) {
  std::lock_guard lk(mu_);
  cancel_ = true;
  cancel_why_ = std::move(why);
}

std::string Completion::cancel_reason() const {
  std::lock_guard lk(mu_);
  return cancel_why_;
}

void Completion::cancel() {
  std::lock_guard lk(mu_);
  cancel_ = true;
}

bool Completion::cancelled() const {
  std::lock_guard lk(mu_);
  return cancel_;
}

double Completion::ttft_ms() const {
  std::lock_guard lk(mu_);
  return tokens_.empty() ? -1.0 : ms_between(submitted, first_);
}

double Completion::tpot_ms() const {
  std::lock_guard lk(mu_);
  if (tokens_.size() < 2) return -1.0;
  return ms_between(first_, last_) / static_cast<double>(tokens_.size() - 1);
}

bool Completion::switched() const {
  std::lock_guard lk(mu_);
  return switched_;
}

bool Completion::cold() const {
  std::lock_guard lk(mu_);
  return cold_;
}

void Completion::set_start(bool switched, bool cold) {
  std::lock_guard lk(mu_);
  switched_ = switched;
  cold_ = cold;
}

int Completion::slice() const {
  std::lock_guard lk(mu_);
  return slice_;
}

void Completion::set_slice(int s) {
  std::lock_guard lk(mu_);
  slice_ = s;
}

void Completion::push(int32_t token, float logprob, const std::pair<int32_t, float>* top,
                      Clock::time_point now) {
  append(token, top_k_ >= 0 ? &logprob : nullptr, top, now);
}

void Completion::push(int32_t token, Clock::time_point now) {
  append(token, nullptr, nullptr, now);
}

// One lock a token: its logprobs (when given) land with it.
void Completion::append(int32_t token, const float* logprob, const std::pair<int32_t, float>* top,
                        Clock::time_point now) {
  {
    std::lock_guard lk(mu_);
    SPILLWAY_CHECK(tokens_.size() < tokens_.capacity(), "completion: more tokens than max_tokens");
    if (logprob != nullptr) {
      logprob_.push_back(*logprob);
      top_.insert(top_.end(), top, top + top_k_);
    }
    if (tokens_.empty()) first_ = now;
    last_ = now;
    tokens_.push_back(token);
  }
  cv_.notify_all();
}

void Completion::finish(State s, std::string why) {
  {
    std::lock_guard lk(mu_);
    state_ = s;
    why_ = std::move(why);
  }
  cv_.notify_all();
}

// ---- the engine ---------------------------------------------------------------------------

struct ServingEngine::Impl {
  EngineOptions o;
  std::vector<Registered> models;
  std::vector<RefusedModel> refused;  // Note [Refused model directories]
  SliceSetup setup;
  std::shared_ptr<HostLink> link;
  std::unique_ptr<Device> pool_device;
  std::unique_ptr<ModelPool> pool;
  std::unique_ptr<Scheduler> scheduler;
  Clock::time_point start_time = Clock::now();

  struct Slice {
    std::unique_ptr<EmulatedSlice> slice;
    std::deque<std::shared_ptr<Request>> inbox;  // guarded by mu
    std::condition_variable cv;
    std::thread thread;
    // The slice thread's own.
    const Registered* bound = nullptr;
    ModelHandle handle;
    std::unique_ptr<PooledWeights> weights;
    std::unique_ptr<nn::Decoder> decoder;
    const nn::RefConfig* decoder_config = nullptr;
    std::vector<int32_t> sample_order;  // Note [Sampling]: top-p's scratch, grown once
    std::vector<Running> running;
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
  std::deque<std::shared_ptr<Request>> pending;
  bool draining = false;
  bool stopping = false;
  int64_t in_flight = 0;
  std::unordered_set<const Request*> accepted;  // in flight (guarded by mu)
  // Models whose checkpoint cannot be served now, and why (guarded by mu; Note [Checkpoints
  // that change on disk]).
  struct Unavailable {
    std::string why;
    std::vector<FileStamp> stamps;  // the files found bad (SafetensorsSet::stamps_now)
  };
  std::map<const Registered*, Unavailable> unavailable;
  // Metrics (guarded by mu).
  std::map<std::string, int64_t> outcomes;
  int64_t tokens_generated = 0, prompt_tokens = 0, within_slo = 0;
  int64_t switches = 0, cold_loads = 0;
  std::vector<int64_t> ttft_hist, tpot_hist;
  double ttft_sum = 0, tpot_sum = 0;
  int64_t ttft_n = 0, tpot_n = 0;

  const Registered* find(const std::string& name) const {
    for (const Registered& m : models)
      if (m.files.name == name) return &m;
    return nullptr;
  }

  // Note [Serving engine]: place what waits, oldest first; a placed request goes to its
  // slice's inbox.
  void dispatch_locked() {
    const auto now = Clock::now();
    for (auto it = pending.begin(); it != pending.end();) {
      Request& r = **it;
      if (r.out->cancelled()) {  // its client left while it waited: it ends here
        record_end(r, Completion::State::kCancelled, "cancelled");
        r.out->finish(Completion::State::kCancelled, r.out->cancel_reason());
        it = pending.erase(it);
        continue;
      }
      const bool overdue = ms_between(r.out->submitted, now) > o.ttft_ms;
      const Placement p =
          scheduler->place(r.model->files.name, static_cast<int64_t>(r.req.prompt.size()),
                           r.req.max_tokens, overdue);
      if (p.outcome == PlaceOutcome::kWait) {
        ++it;
        continue;
      }
      r.slice = p.slice;
      r.chunk = std::clamp<int64_t>(p.chunk_tokens, 1, max_chunk());
      r.out->set_slice(p.slice);
      Slice& s = *slices[static_cast<size_t>(p.slice)];
      s.inbox.push_back(*it);
      s.cv.notify_one();
      it = pending.erase(it);
    }
  }

  // A prefill chunk never takes more than half a step: the decoding requests always fit
  // beside it (max_running <= the other half, checked).
  int64_t max_chunk() const { return o.max_step_tokens / 2; }

  void record_end(const Request& r, Completion::State st, const char* outcome) {
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
        bucket(ttft_hist, kTtftBounds, ttft / 1e3);
        ttft_sum += ttft / 1e3;
        ++ttft_n;
      }
      if (tpot >= 0) {
        bucket(tpot_hist, kTpotBounds, tpot / 1e3);
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
  bool reread(const Registered& m, std::string* why);
  // `stamps`: the files as they were before the check that failed (empty: not the files'
  // fault); a submit reads them again only once their stamps differ.
  void mark_unavailable(const Registered& m, const std::string& why,
                        std::vector<FileStamp> stamps) {
    std::lock_guard lk(mu);
    unavailable[&m] = {why, std::move(stamps)};
  }

  // The slice thread (Note [Serving engine]).
  void run_slice(int index);
  // The slice's model is m from now on; *started: 1 when that took a switch, 2 a cold load.
  // May throw (a decoder, the pooled weights): the caller fails the requests (Note [Slice
  // failures]).
  bool bind(Slice& s, const Registered& m, std::string* why, int* started);
  void unbind(Slice& s) {
    s.weights.reset();
    s.handle.release();
    s.bound = nullptr;
  }
  // Starts the requests taken from the inbox (one model), or ends them: cancelled ones, and
  // all of them when the model cannot be bound. Never throws.
  void admit_requests(int index, Slice& s, std::vector<std::shared_ptr<Request>>& admit);
  // Ends r, placed on slice `index` and not on its decoder (mu held): scheduler, metrics,
  // completion.
  void end_placed_locked(int index, Request& r, Completion::State st, const char* outcome,
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

bool ServingEngine::Impl::bind(Slice& s, const Registered& m, std::string* why, int* started) {
  *started = 0;
  if (s.bound == &m && s.handle) return true;
  const Registered* was = s.bound;  // kept while idle: taking it again is no switch
  unbind(s);
  PoolAcquire a = pool->acquire(m.files.name);
  std::vector<FileStamp> checked;
  if (a.status == PoolStatus::kChanged) {
    // Note [Checkpoints that change on disk]: checked again; served when it still may be.
    checked = SafetensorsSet::stamps_now(m.files.weights_path);
    std::string reason;
    if (!reread(m, &reason)) {
      *why = fmt::format("model {} is unavailable: {}; {}", m.files.name,
                         without_model(m.files.name, a.why), reason);
      mark_unavailable(m, *why, checked);
      return false;
    }
    a = pool->acquire(m.files.name);
  }
  if (a.status == PoolStatus::kChanged) {
    *why = fmt::format("model {} is unavailable: {}", m.files.name,
                       without_model(m.files.name, a.why));
    mark_unavailable(m, *why, checked);
    return false;
  }
  if (a.status != PoolStatus::kOk) {
    *why = fmt::format("model {}: host memory for the pool is full: {}", m.files.name, a.why);
    return false;
  }
  {
    std::lock_guard lk(mu);
    if (a.cold) {
      ++cold_loads;
      *started = 2;
    } else if (was != &m) {
      ++switches;
      *started = 1;
    }
    s.model = m.files.name;
    unavailable.erase(&m);  // its weights are resident: servable
  }
  s.handle = std::move(a.handle);
  if (s.decoder == nullptr || s.decoder_config == nullptr ||
      !same_decoder(*s.decoder_config, m.config)) {
    s.decoder.reset();
    nn::DecoderOptions d;
    d.max_sequences = o.max_running;
    d.max_context = o.max_context;
    d.max_step_tokens = o.max_step_tokens;
    s.decoder = std::make_unique<nn::Decoder>(m.config, s.slice->device(), d);
    s.decoder_config = &m.config;
  }
  s.weights =
      std::make_unique<PooledWeights>(s.handle, m.config, *s.slice, m.parts, o.max_step_tokens);
  s.bound = &m;
  s.logits.resize(static_cast<size_t>(o.max_running) * static_cast<size_t>(m.config.vocab));
  return true;
}

bool ServingEngine::Impl::reread(const Registered& m, std::string* why) {
  try {
    const SafetensorsSet f(m.files.weights_path);
    const ResolvedWeights parts = resolve_checkpoint(m.files.name, m.config, f);
    const DType dtype = f.tensors().empty() ? DType::kFp32 : f.tensors().front().dtype;
    if (parts != m.parts || dtype != m.dtype) {
      *why = fmt::format(
          "{} now stores the weights in other tensors or another dtype ({}; it was {}); the "
          "server serves only the layout it started with: restart it to serve this one",
          m.files.weights_path, to_string(dtype), to_string(m.dtype));
      return false;
    }
    pool->refresh(m.files.name, f);
    return true;
  } catch (const std::exception& e) {
    *why = without_model(m.files.name, e.what());
    return false;
  }
}

void ServingEngine::Impl::admit_requests(int index, Slice& s,
                                         std::vector<std::shared_ptr<Request>>& admit) {
  auto end_unstarted = [&](Request& r, Completion::State st, const char* outcome,
                           const std::string& why) {
    std::lock_guard lk(mu);
    end_placed_locked(index, r, st, outcome, why);
    --s.running_count;
    dispatch_locked();
  };
  // A request cancelled before it starts (a client gone, cancel_all) ends without a load.
  size_t kept = 0;
  for (std::shared_ptr<Request>& r : admit) {
    if (r->out->cancelled())
      end_unstarted(*r, Completion::State::kCancelled, "cancelled", r->out->cancel_reason());
    else
      admit[kept++] = std::move(r);
  }
  admit.resize(kept);
  if (admit.empty()) return;
  const Registered& m = *admit.front()->model;  // one model (run_slice)
  std::string why;
  int started = 0;
  bool bound = false;
  try {
    bound = bind(s, m, &why, &started);
  } catch (const std::exception& e) {
    // Note [Slice failures]: a decoder or the pooled weights could not be built.
    unbind(s);
    s.decoder.reset();
    s.decoder_config = nullptr;
    why = fmt::format("model {} is unavailable: {}", m.files.name,
                      without_model(m.files.name, e.what()));
    mark_unavailable(m, why, {});
  }
  for (std::shared_ptr<Request>& r : admit) {
    if (!bound) {
      end_unstarted(*r, Completion::State::kFailed, "unavailable", why);
      continue;
    }
    r->out->set_start(started == 1, started == 2);
    started = 0;  // the batch's first request took the switch
    try {
      Running run;
      run.r = r;
      run.sequence = s.free_sequences.back();
      run.rng.seed(r->req.seed);
      for (const std::vector<int32_t>& st : r->req.stop)
        run.hold = std::max(run.hold, st.size() - 1);
      run.held.reserve(run.hold + 1);
      s.decoder->reset(run.sequence);
      s.running.push_back(std::move(run));
      s.free_sequences.pop_back();
    } catch (const std::exception& e) {
      end_unstarted(*r, Completion::State::kFailed, "failed",
                    fmt::format("model {}: slice {}: {}", m.files.name, index, e.what()));
    }
  }
}

void ServingEngine::Impl::end_request(int index, Slice& s, size_t at, Completion::State st,
                                      const char* outcome, std::string why) {
  Running& run = s.running[at];
  s.free_sequences.push_back(run.sequence);
  {
    // Counted before the completion ends: whoever sees it end sees it in the metrics.
    std::lock_guard lk(mu);
    scheduler->finish(index, static_cast<int64_t>(run.r->req.prompt.size()), run.r->req.max_tokens);
    record_end(*run.r, st, outcome);
    run.r->out->finish(st, std::move(why));
    --s.running_count;
    dispatch_locked();
  }
  s.running.erase(s.running.begin() + static_cast<long>(at));
}

void ServingEngine::Impl::iterate(int index, Slice& s) {
  const nn::RefConfig& c = s.bound->config;
  // Cancelled requests leave first.
  for (size_t i = s.running.size(); i-- > 0;)
    if (s.running[i].r->out->cancelled())
      end_request(index, s, i, Completion::State::kCancelled, "cancelled",
                  s.running[i].r->out->cancel_reason());
  if (s.running.empty()) return;
  s.chunks.clear();
  s.who.clear();
  // A chunk that does not fit beside the earlier ones waits for the next step (a prefill
  // chunk is never cut; at most half a step, it fits once the prompts before it are read).
  int rows = 0;
  for (size_t i = 0; i < s.running.size(); ++i) {
    Running& run = s.running[i];
    const std::vector<int32_t>& prompt = run.r->req.prompt;
    const bool prefill = run.prompt_pos < prompt.size();
    const int n = prefill ? static_cast<int>(std::min<int64_t>(
                                run.r->chunk, static_cast<int64_t>(prompt.size() - run.prompt_pos)))
                          : 1;
    if (rows + n > o.max_step_tokens) continue;
    // Note [Dynamic RoPE]: a prompt's chunks rotate at the whole prompt's length.
    s.chunks.push_back({run.sequence, prefill ? prompt.data() + run.prompt_pos : &run.last, n,
                        prefill ? static_cast<int>(prompt.size()) : 0});
    s.who.push_back(i);
    rows += n;
  }
  const double alpha = o.alpha >= 0 ? o.alpha : s.controller.alpha();
  s.weights->begin_iteration(alpha);
  const auto t0 = Clock::now();
  s.decoder->step(s.chunks.data(), static_cast<int>(s.chunks.size()), *s.weights, s.logits.data());
  const auto t1 = Clock::now();
  const IterationTraffic it = s.weights->iteration();
  int64_t new_tokens = 0;
  // (index into running, finish reason), indices ascending.
  std::vector<std::pair<size_t, const char*>>& finished = s.finished;
  finished.clear();
  for (size_t k = 0; k < s.chunks.size(); ++k) {
    Running& run = s.running[s.who[k]];
    const bool prefill = run.prompt_pos < run.r->req.prompt.size();
    if (prefill) {
      run.prompt_pos += static_cast<size_t>(s.chunks[k].n);
      if (run.prompt_pos < run.r->req.prompt.size()) continue;  // more of the prompt to read
    }
    const float* logits = s.logits.data() + k * static_cast<size_t>(c.vocab);
    run.last =
        sample(logits, c.vocab, run.r->req.temperature, run.r->req.top_p, run.rng, s.sample_order);
    if (run.r->req.logprobs >= 0) held_logprobs(run, logits, c.vocab, run.last);
    ++run.generated;
    ++new_tokens;
    if (const char* why = after_token(run, t1)) finished.push_back({s.who[k], why});
  }
  {
    std::lock_guard lk(mu);
    ++s.iterations;
    s.link_bytes += it.link_bytes;
    s.hbm_bytes += it.hbm_bytes;
    s.alpha = alpha;
    tokens_generated += new_tokens;
  }
  if (o.alpha < 0) {
    const double elapsed = std::max(ms_between(t0, t1), 1e-6);
    s.controller.update(elapsed, std::min(1.0, it.hbm_ms / elapsed),
                        std::min(1.0, it.link_ms / elapsed));
  }
  for (size_t i = finished.size(); i-- > 0;)
    end_request(index, s, finished[i].first, Completion::State::kDone, "ok", finished[i].second);
}

void ServingEngine::Impl::run_slice(int index) {
  Slice& s = *slices[static_cast<size_t>(index)];
#ifdef __linux__
  // The emulated kernels wait out their time in sleeps of microseconds (Note [Emulated MIG
  // slices]); Linux's default timer slack (50 us) would add that much to every GEMM's wait,
  // about a hundred of them a decoder step. This thread asks for 1 us.
  prctl(PR_SET_TIMERSLACK, 1000UL);
#endif
  std::vector<std::shared_ptr<Request>> admit;
  for (;;) {
    admit.clear();
    {
      std::unique_lock lk(mu);
      s.cv.wait(lk, [&] { return stopping || !s.inbox.empty() || !s.running.empty(); });
      if (stopping && s.inbox.empty() && s.running.empty()) return;
      // A request cancelled while it waits in the inbox ends now, even behind another
      // model's batch (cancel_all, a client gone).
      bool ended = false;
      for (auto it = s.inbox.begin(); it != s.inbox.end();) {
        if ((*it)->out->cancelled()) {
          end_placed_locked(index, **it, Completion::State::kCancelled, "cancelled",
                            (*it)->out->cancel_reason());
          it = s.inbox.erase(it);
          ended = true;
        } else {
          ++it;
        }
      }
      if (ended) dispatch_locked();
      // Admit into free sequences; a request of another model only when nothing runs (the
      // Scheduler moves a slice to another model only then).
      while (!s.inbox.empty() &&
             static_cast<int>(s.running.size() + admit.size()) < o.max_running) {
        const Registered* m = s.inbox.front()->model;
        const Registered* current = !s.running.empty()
                                        ? s.running.front().r->model
                                        : (!admit.empty() ? admit.front()->model : nullptr);
        if (current != nullptr && current != m) break;
        admit.push_back(s.inbox.front());
        s.inbox.pop_front();
        ++s.running_count;
      }
    }
    // Note [Slice failures]: nothing thrown here leaves the thread (std::terminate would end
    // every stream); admit_requests catches its own.
    if (!admit.empty()) admit_requests(index, s, admit);
    if (!s.running.empty()) {
      try {
        iterate(index, s);
      } catch (const std::exception& e) {
        fail_running(index, s, e.what());
      } catch (...) {
        fail_running(index, s, "an unknown exception");
      }
    }
    bool idle = false;
    {
      std::lock_guard lk(mu);
      idle = s.running.empty() && s.inbox.empty();
    }
    if (idle && s.handle) {  // the pool may evict the model now
      s.weights.reset();
      s.handle.release();
    }
  }
}

ServingEngine::ServingEngine(const std::vector<ModelFiles>& models, const EngineOptions& options,
                             std::vector<RefusedModel> refused_already)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.o = options;
  m.refused = std::move(refused_already);
  const EngineOptions& o = m.o;
  if (models.empty() && m.refused.empty())
    SPILLWAY_FIELD_ERROR("models", 0, "at least one model to serve");
  if (o.max_running < 1) SPILLWAY_FIELD_ERROR("max_running", o.max_running, "must be >= 1");
  if (o.max_context < 2) SPILLWAY_FIELD_ERROR("max_context", o.max_context, "must be >= 2");
  if (o.max_step_tokens < 2 * o.max_running)
    SPILLWAY_FIELD_ERROR("max_step_tokens", o.max_step_tokens,
                         "must be >= 2 x max_running ({}): a prefill chunk takes at most half a "
                         "step, the decoding requests the other half",
                         2 * o.max_running);
  if (o.max_waiting < 1)
    SPILLWAY_FIELD_ERROR("max_waiting", o.max_waiting,
                         "must be >= 1: a request waits in the queue before a slice takes it, so "
                         "with no room to wait every request would be refused");
  if (!(o.ttft_ms > 0)) SPILLWAY_FIELD_ERROR("ttft_ms", o.ttft_ms, "must be > 0");
  if (!(o.tpot_ms > 0)) SPILLWAY_FIELD_ERROR("tpot_ms", o.tpot_ms, "must be > 0");
  if (o.alpha > 1) SPILLWAY_FIELD_ERROR("alpha", o.alpha, "must be in [0, 1], or < 0 to adapt");
  const HardwareProfile hw = load_hardware(o.hardware);
  m.setup = mig_slices(hw, o.profile, o.rate_scale, o.memory_scale);
  m.link = std::make_shared<HostLink>(m.setup.link_gbps, m.setup.link_gbps);
  m.pool_device = make_host_device(HostDeviceOptions{int64_t{1} << 20, 0.0, 0.0});
  m.pool = std::make_unique<ModelPool>(*m.pool_device, ModelPoolOptions{o.host_budget_bytes});

  // The Scheduler sees each slice's KV capacity as its HBM (the decoder's buffers are
  // allocated up front: a chunk needs no more), so its placements hold the real cache.
  std::vector<SliceSpec> sched_slices;
  // Note [Refused model directories]: each model is checked whole before it is added to the
  // pool (the last step that may fail), so a refused one leaves nothing behind.
  const SliceSpec& first_slice = m.setup.slices.front();  // every slice has the profile
  const nn::DecoderOptions decoder_options{o.max_running, o.max_context, o.max_step_tokens};
  for (const ModelFiles& f : models) {
    if (m.find(f.name) != nullptr) SPILLWAY_FIELD_ERROR("model", f.name, "is listed twice");
    Registered r;
    r.files = f;
    try {
      r.config = nn::load_reference_config(f.config_path);
      {
        std::ifstream in(f.config_path, std::ios::binary);
        std::stringstream ss;
        ss << in.rdbuf();
        r.config_text = ss.str();
      }
      check_servable_config(f.name, r.config_text);
      {
        const SafetensorsSet st(f.weights_path);  // Note [Sharded checkpoints]
        r.config.qk_norm = checkpoint_has_qk_norms(r.config, st);
        r.parts = resolve_checkpoint(f.name, r.config, st);
        r.weight_bytes = st.data_bytes();
        r.dtype = st.tensors().empty() ? DType::kFp32 : st.tensors().front().dtype;
      }
      const int64_t need = nn::Decoder::device_bytes_for(r.config, decoder_options);
      if (need > first_slice.hbm_bytes)
        SPILLWAY_FIELD_ERROR("max_running", o.max_running,
                             "model {}: the decoder needs {} bytes of slice memory ({} sequences "
                             "of {} tokens); a {} slice has {} (memory_scale {}); {}",
                             f.name, need, o.max_running, o.max_context, first_slice.profile,
                             first_slice.hbm_bytes, o.memory_scale, fitting_profile(hw, o, need));
      m.pool->add(f.name, f.weights_path);
      r.text = std::make_shared<ModelText>(read_model_text(f.dir));
    } catch (const std::exception& e) {
      if (!o.skip_refused) throw;
      m.refused.push_back({f.name, f.dir, without_model(f.name, e.what())});
      continue;
    }
    m.models.push_back(std::move(r));
  }
  std::stable_sort(m.refused.begin(), m.refused.end(),
                   [](const RefusedModel& a, const RefusedModel& b) { return a.name < b.name; });
  if (m.models.empty()) {
    std::string all;
    for (const RefusedModel& x : m.refused) all += fmt::format("\n  refused {}: {}", x.name, x.why);
    SPILLWAY_INPUT_ERROR("no model can be served:{}", all);
  }
  int64_t kv_capacity = 0;
  for (const Registered& r : m.models) {
    const nn::RefConfig& c = r.config;
    const int64_t kv_per_token = int64_t{2} * c.layers() * c.kv_heads * c.head_dim * 4;
    kv_capacity = std::max(kv_capacity, kv_per_token * o.max_running * o.max_context);
  }
  for (SliceSpec sp : m.setup.slices) {
    sp.hbm_bytes = kv_capacity;
    sched_slices.push_back(sp);
  }
  m.scheduler = std::make_unique<Scheduler>(sched_slices, m.setup.link_gbps);
  const SliceSpec& spec = m.setup.slices.front();
  for (const Registered& r : m.models) {
    const nn::RefConfig& c = r.config;
    ServedModel sm;
    sm.name = r.files.name;
    sm.weight_bytes = r.weight_bytes;
    sm.tpot_ms = o.tpot_ms;
    sm.ttft_ms = o.ttft_ms;
    sm.kv_bytes_per_token = int64_t{2} * c.layers() * c.kv_heads * c.head_dim * 4;
    // A chunk's time on the slice: its weights over the link (once per step) or its FLOPs,
    // whichever is longer; no HBM beyond the decoder's buffers.
    const double params =
        static_cast<double>(r.weight_bytes) / static_cast<double>(dtype_bytes(r.dtype));
    for (int64_t t : kChunkSizes) {
      if (t > m.max_chunk()) break;
      const double link_ms = static_cast<double>(r.weight_bytes) / (m.setup.link_gbps * 1e6);
      const double flop_ms = 2.0 * params * static_cast<double>(t) / (spec.gflops * 1e6);
      sm.chunks.push_back({t, std::max(link_ms, flop_ms), 0});
    }
    if (sm.chunks.empty()) sm.chunks.push_back({m.max_chunk(), 1.0, 0});
    m.scheduler->add_model(sm);
  }
  m.ttft_hist.assign(kTtftBounds.size() + 1, 0);
  m.tpot_hist.assign(kTpotBounds.size() + 1, 0);
  for (size_t i = 0; i < m.setup.slices.size(); ++i) {
    auto s = std::make_unique<Impl::Slice>();
    s->slice = std::make_unique<EmulatedSlice>(m.setup.slices[i], m.link);
    AlphaControllerOptions ac;
    ac.latency_budget_ms = o.tpot_ms;
    s->controller = AlphaController(ac);
    for (int q = o.max_running - 1; q >= 0; --q) s->free_sequences.push_back(q);
    s->alpha = o.alpha >= 0 ? o.alpha : 0.0;
    m.slices.push_back(std::move(s));
  }
  for (size_t i = 0; i < m.slices.size(); ++i)
    m.slices[i]->thread = std::thread([&m, i] { m.run_slice(static_cast<int>(i)); });
}

ServingEngine::~ServingEngine() {
  Impl& m = *impl_;
  drain();
  {
    std::lock_guard lk(m.mu);
    m.stopping = true;
  }
  for (auto& s : m.slices) s->cv.notify_all();
  for (auto& s : m.slices)
    if (s->thread.joinable()) s->thread.join();
  for (auto& s : m.slices) {
    s->weights.reset();
    s->handle.release();
    s->decoder.reset();
  }
}

SubmitResult ServingEngine::submit(const CompletionRequest& q) {
  Impl& m = *impl_;
  SubmitResult res;
  auto refuse = [&](SubmitStatus st, std::string field, std::string msg) {
    res.status = st;
    res.field = std::move(field);
    res.message = std::move(msg);
    std::lock_guard lk(m.mu);
    ++m.outcomes[to_string(st)];
    return res;
  };
  const Registered* model = m.find(q.model);
  if (model == nullptr) {
    std::string names;
    for (const Registered& r : m.models) names += (names.empty() ? "" : ", ") + r.files.name;
    return refuse(SubmitStatus::kUnknownModel, "model",
                  fmt::format("model '{}' is not served; served: {}", q.model, names));
  }
  if (q.prompt.empty())
    return refuse(SubmitStatus::kInvalid, "prompt", "prompt must hold at least one token");
  const int vocab = model->config.vocab;
  for (size_t i = 0; i < q.prompt.size(); ++i)
    if (q.prompt[i] < 0 || q.prompt[i] >= vocab)
      return refuse(SubmitStatus::kInvalid, "prompt",
                    fmt::format("token {} at position {} is outside the vocabulary [0, {}) of {}",
                                q.prompt[i], i, vocab, q.model));
  // The prompt alone must leave room for one token; then max_tokens is what is left.
  const auto prompt_tokens = static_cast<int64_t>(q.prompt.size());
  if (prompt_tokens >= m.o.max_context)
    return refuse(SubmitStatus::kInvalid, "prompt",
                  fmt::format("the prompt has {} tokens; this server holds {} per request, prompt "
                              "and output, so a prompt may have at most {}",
                              prompt_tokens, m.o.max_context, m.o.max_context - 1));
  if (q.logprobs < -1 || q.logprobs > std::min(kMaxLogprobs, vocab))
    return refuse(SubmitStatus::kInvalid, "logprobs",
                  fmt::format("logprobs is {}; must be in [0, {}]", q.logprobs,
                              std::min(kMaxLogprobs, vocab)));
  if (q.max_tokens < 1)
    return refuse(SubmitStatus::kInvalid, "max_tokens",
                  fmt::format("max_tokens is {}; must be >= 1", q.max_tokens));
  if (prompt_tokens + q.max_tokens > m.o.max_context)
    return refuse(
        SubmitStatus::kInvalid, "max_tokens",
        fmt::format("max_tokens is {}; at most {} for this prompt of {} tokens (the "
                    "context holds {} per request, prompt and output)",
                    q.max_tokens, m.o.max_context - prompt_tokens, prompt_tokens, m.o.max_context));
  if (q.eos.size() > 16)
    return refuse(SubmitStatus::kInvalid, "eos",
                  fmt::format("{} EOS tokens; at most 16", q.eos.size()));
  if (q.stop.size() > 4)
    return refuse(SubmitStatus::kInvalid, "stop",
                  fmt::format("{} stop sequences; at most 4", q.stop.size()));
  for (size_t i = 0; i < q.stop.size(); ++i) {
    if (q.stop[i].empty() || q.stop[i].size() > 64)
      return refuse(SubmitStatus::kInvalid, "stop",
                    fmt::format("stop sequence {} has {} tokens; 1 to 64", i, q.stop[i].size()));
    for (int32_t t : q.stop[i])
      if (t < 0 || t >= vocab)
        return refuse(SubmitStatus::kInvalid, "stop",
                      fmt::format("stop sequence {}: token {} is outside the vocabulary [0, {})", i,
                                  t, vocab));
  }
  if (!(q.top_p > 0.0 && q.top_p <= 1.0))
    return refuse(SubmitStatus::kInvalid, "top_p",
                  fmt::format("top_p is {}; must be in (0, 1]", q.top_p));
  if (!(q.temperature >= 0.0) || !std::isfinite(q.temperature))
    return refuse(SubmitStatus::kInvalid, "temperature",
                  fmt::format("temperature is {}; must be >= 0", q.temperature));
  // Note [Checkpoints that change on disk]: an unavailable model's file is checked again
  // once it is not the file found bad (a stat per request; the file is read only then).
  std::optional<Impl::Unavailable> bad;
  {
    std::lock_guard lk(m.mu);
    if (auto it = m.unavailable.find(model); it != m.unavailable.end()) bad = it->second;
  }
  if (bad) {
    const std::vector<FileStamp> now = SafetensorsSet::stamps_now(model->files.weights_path);
    std::string why = bad->why;
    const bool ok = now != bad->stamps && m.reread(*model, &why);
    std::lock_guard lk(m.mu);
    if (ok) {
      m.unavailable.erase(model);
    } else {
      if (now != bad->stamps)
        why = fmt::format("model {} is unavailable: {}", model->files.name, why);
      m.unavailable[model] = {why, now};
      ++m.outcomes[to_string(SubmitStatus::kUnavailable)];
      res.status = SubmitStatus::kUnavailable;
      res.field = "model";
      res.message = std::move(why);
      return res;
    }
  }
  auto r = std::make_shared<Request>();
  r->req = q;
  r->model = model;
  r->out = std::make_shared<Completion>(q.max_tokens, q.logprobs);
  r->out->submitted = Clock::now();
  std::lock_guard lk(m.mu);
  if (m.draining) {
    ++m.outcomes["draining"];
    res.status = SubmitStatus::kDraining;
    res.message = "the server is shutting down and takes no new requests";
    return res;
  }
  if (static_cast<int64_t>(m.pending.size()) >= m.o.max_waiting) {
    ++m.outcomes["overloaded"];
    res.status = SubmitStatus::kOverloaded;
    res.message =
        fmt::format("{} requests are already waiting for a slice (max_waiting {}); retry later",
                    m.pending.size(), m.o.max_waiting);
    return res;
  }
  ++m.in_flight;
  m.accepted.insert(r.get());
  m.prompt_tokens += static_cast<int64_t>(q.prompt.size());
  m.pending.push_back(r);
  m.dispatch_locked();
  res.completion = r->out;
  return res;
}

const std::vector<RefusedModel>& ServingEngine::refused() const {
  return impl_->refused;
}

std::vector<ServedModelInfo> ServingEngine::models() const {
  std::vector<ServedModelInfo> out;
  for (const Registered& r : impl_->models) {
    const ModelText* t = r.text.get();
    const std::string text = t == nullptr || !t->tokenizer ? (t == nullptr ? "" : t->unavailable)
                             : t->chat                     ? "tokenizer and chat template"
                                       : "tokenizer; no chat template: " + t->chat_unavailable;
    out.push_back({r.files.name, r.weight_bytes, r.dtype, r.config.model.model_type, r.config.vocab,
                   r.config.layers(), impl_->pool->resident(r.files.name), r.config_text, text});
  }
  return out;
}

const ModelText* ServingEngine::text(const std::string& model) const {
  const Registered* r = impl_->find(model);
  return r == nullptr ? nullptr : r->text.get();
}

const nn::RefConfig& ServingEngine::config(const std::string& model) const {
  const Registered* r = impl_->find(model);
  if (r == nullptr) SPILLWAY_FIELD_ERROR("model", model, "is not served");
  return r->config;
}

double ServingEngine::link_gbps() const {
  return impl_->setup.link_gbps;
}

int ServingEngine::slices() const {
  return static_cast<int>(impl_->slices.size());
}
const EngineOptions& ServingEngine::options() const {
  return impl_->o;
}

int64_t ServingEngine::in_flight() const {
  std::lock_guard lk(impl_->mu);
  return impl_->in_flight;
}

bool ServingEngine::draining() const {
  std::lock_guard lk(impl_->mu);
  return impl_->draining;
}

void ServingEngine::drain() {
  Impl& m = *impl_;
  std::unique_lock lk(m.mu);
  m.draining = true;
  m.idle_cv.wait(lk, [&] { return m.in_flight == 0; });
}

bool ServingEngine::drain_for(std::chrono::milliseconds deadline) {
  Impl& m = *impl_;
  std::unique_lock lk(m.mu);
  m.draining = true;
  return m.idle_cv.wait_for(lk, deadline, [&] { return m.in_flight == 0; });
}

int64_t ServingEngine::cancel_all(const std::string& why) {
  Impl& m = *impl_;
  std::lock_guard lk(m.mu);
  // Every accepted request is cancelled; a queued one ends here, one on a slice (its inbox or
  // its decoder) at that slice's next iteration (Impl::iterate: cancelled requests leave first).
  for (const Request* r : m.accepted) r->out->cancel(why);
  const int64_t n = static_cast<int64_t>(m.accepted.size());
  for (const std::shared_ptr<Request>& r : m.pending) {
    m.record_end(*r, Completion::State::kCancelled, "cancelled");
    r->out->finish(Completion::State::kCancelled, why);
  }
  m.pending.clear();
  for (auto& s : m.slices) s->cv.notify_all();
  return n;
}

void ServingEngine::count_outcome(const std::string& outcome) {
  std::lock_guard lk(impl_->mu);
  ++impl_->outcomes[outcome];
}

EngineMetrics ServingEngine::metrics() const {
  const Impl& m = *impl_;
  EngineMetrics e;
  const double up = std::max(ms_between(m.start_time, Clock::now()) / 1e3, 1e-9);
  const ModelPoolStats ps = m.pool->stats();
  std::lock_guard lk(m.mu);
  e.uptime_s = up;
  e.requests = m.outcomes;
  for (const char* k : {"ok", "invalid", "unknown_model", "overloaded", "draining", "unavailable",
                        "failed", "cancelled"})
    e.requests.emplace(k, 0);
  e.tokens_generated = m.tokens_generated;
  e.prompt_tokens = m.prompt_tokens;
  e.ttft_bounds_s = kTtftBounds;
  e.tpot_bounds_s = kTpotBounds;
  e.ttft_counts = m.ttft_hist;
  e.tpot_counts = m.tpot_hist;
  e.ttft_sum_s = m.ttft_sum;
  e.tpot_sum_s = m.tpot_sum;
  e.ttft_n = m.ttft_n;
  e.tpot_n = m.tpot_n;
  e.within_slo = m.within_slo;
  e.switches = m.switches;
  e.cold_loads = m.cold_loads;
  e.evictions = ps.evictions;
  e.waiting = static_cast<int64_t>(m.pending.size());
  e.link_gbps = m.setup.link_gbps;
  int64_t link_bytes = 0;
  for (size_t i = 0; i < m.slices.size(); ++i) {
    const Impl::Slice& s = *m.slices[i];
    EngineMetrics::Slice x;
    x.model = s.model;
    x.running = static_cast<int>(s.running_count);
    x.alpha = s.alpha;
    x.hbm_utilization = static_cast<double>(s.hbm_bytes) / (m.setup.slices[i].hbm_gbps * 1e9 * up);
    x.link_share = static_cast<double>(s.link_bytes) / (m.setup.link_gbps * 1e9 * up);
    x.iterations = s.iterations;
    x.hbm_bytes = s.hbm_bytes;
    x.hbm_gbps = m.setup.slices[i].hbm_gbps;
    const MemoryStats ms = s.slice->device().memory_stats();
    x.device_bytes_in_use = ms.current[0];
    x.device_bytes = m.setup.slices[i].hbm_bytes;
    e.waiting += static_cast<int64_t>(s.inbox.size());
    link_bytes += s.link_bytes;
    e.slices.push_back(x);
  }
  e.link_bytes = link_bytes;
  e.link_utilization = static_cast<double>(link_bytes) / (m.setup.link_gbps * 1e9 * up);
  return e;
}

}  // namespace spillway::inference
