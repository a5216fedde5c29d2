// The live serving engine (spillway/inference/inference.hpp, Note [Serving engine], Note [Served
// determinism]): its construction from the model directories, submit, drain and cancel. The
// slices' threads are slice_threads.cpp's, sampling sampling.cpp's (engine_impl.hpp).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <optional>
#include <sstream>

#include "core/enum_names.hpp"
#include "inference/engine_impl.hpp"
#include "spillway/catalog/hardware.hpp"
#include "spillway/core/error.hpp"

namespace spillway::inference {

using detail::Clock;
using detail::kTpotBounds;
using detail::kTtftBounds;
using detail::Registered;
using detail::Request;
using detail::without_model;

namespace {

// The prefill chunk sizes the engine offers the Scheduler.
constexpr int64_t kChunkSizes[] = {16, 32, 64, 128, 256};

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

// ---- the engine ---------------------------------------------------------------------------

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

}  // namespace spillway::inference
