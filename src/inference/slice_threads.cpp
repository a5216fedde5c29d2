// The serving engine's slices (Note [Serving engine]): placed requests dispatched to their
// slice's inbox, and each slice's thread: binding a model (with the re-read of a checkpoint
// changed on disk, Note [Checkpoints that change on disk]), admitting requests, the decoder
// step and its sampled tokens, and the end of requests (Note [Slice failures]).
#include <fmt/format.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

#include <algorithm>

#include "inference/engine_impl.hpp"
#include "spillway/core/error.hpp"

namespace spillway::inference {

using detail::after_token;
using detail::Clock;
using detail::held_logprobs;
using detail::ms_between;
using detail::Registered;
using detail::Request;
using detail::Running;
using detail::sample;
using detail::without_model;

namespace {

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

}  // namespace

void ServingEngine::Impl::dispatch_locked() {
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
    const Placement p = scheduler->place(
        r.model->files.name, static_cast<int64_t>(r.req.prompt.size()), r.req.max_tokens, overdue);
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

}  // namespace spillway::inference
