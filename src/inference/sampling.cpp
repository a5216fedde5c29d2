// Sampling in the serving engine: a token drawn from a step's logits (Note [Sampling]), its
// log-probabilities (Note [Logprobs]), and what a request may publish of the tokens it
// generated (Note [Stop sequences]).
#include <algorithm>
#include <cmath>

#include "inference/engine_impl.hpp"

namespace spillway::inference::detail {
namespace {

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

}  // namespace

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

}  // namespace spillway::inference::detail
