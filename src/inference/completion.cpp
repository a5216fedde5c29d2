// Completion (spillway/inference/inference.hpp): a request's output as the engine publishes it,
// token by token, and how it ended.
#include <algorithm>

#include "inference/engine_impl.hpp"
#include "spillway/core/error.hpp"

namespace spillway::inference {

using detail::Clock;
using detail::ms_between;

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

}  // namespace spillway::inference
