// The reference model forward only (include/spillway/nn/nn.hpp: forward_loss, forward_logits):
// every layer under a policy that recomputes everything, with no hooks, so that a layer's
// tensors are freed as soon as the next layer has its input.
#include "nn/model_impl.hpp"
#include "nn/ops.hpp"
#include "nn/slots.hpp"
#include "spillway/core/error.hpp"

namespace spillway::nn {

float* Model::Impl::forward_inference(const std::vector<int32_t>& in, int batch, int seq) {
  const int T = batch * seq;
  MemoryPolicy none = keep_policy(c);
  none.name = "forward";
  for (LayerActions& la : none.layers)
    for (size_t s = 1; s < la.actions.size(); ++s) la.actions[s] = Action::kRecompute;
  TrainingHooks no_hooks;
  policy_name = none.name;
  at(-1, "embedding", "at the");
  float* x = alloc_n<float>(static_cast<size_t>(T) * static_cast<size_t>(d));
  embedding_fwd(in.data(), w + embed, x, T, d);
  for (int l = 0; l < c.layers(); ++l) {
    float* y = nullptr;
    visit_begin(l);
    forward_layer(l, x, &y, batch, seq, none, no_hooks);
    visit_end(l);
    release(x);
    saved[static_cast<size_t>(l)][kInput].p = nullptr;
    x = y;
  }
  return x;
}

double Model::forward_loss(const std::vector<int32_t>& tokens, int batch, int seq) {
  Impl& m = *impl_;
  SPILLWAY_CHECK(batch > 0 && seq > 0, "forward_loss: batch {} and seq {} must be > 0", batch, seq);
  SPILLWAY_CHECK(tokens.size() == static_cast<size_t>(batch) * static_cast<size_t>(seq + 1),
                 "forward_loss: {} tokens for batch {} x (seq {} + 1)", tokens.size(), batch, seq);
  const int T = batch * seq;
  std::vector<int32_t> in, target;
  split_tokens(tokens, batch, seq, m.c.vocab, &in, &target);
  float* x = m.forward_inference(in, batch, seq);
  float* fn = nullptr;
  float* logits = m.head_forward(x, T, &fn);
  const size_t tv = static_cast<size_t>(T) * static_cast<size_t>(m.c.vocab);
  float* dlogits = m.alloc_n<float>(tv);
  const double loss = cross_entropy(logits, target.data(), dlogits, T, m.c.vocab);
  for (float* p : {dlogits, logits, fn, x}) m.release(p);
  if (m.streamer != nullptr) m.streamer->step_end();
  return loss;
}

std::vector<float> Model::forward_logits(const std::vector<int32_t>& tokens, int batch, int seq) {
  Impl& m = *impl_;
  SPILLWAY_CHECK(batch > 0 && seq > 0, "forward_logits: batch {} and seq {} must be > 0", batch,
                 seq);
  SPILLWAY_CHECK(tokens.size() == static_cast<size_t>(batch) * static_cast<size_t>(seq),
                 "forward_logits: {} tokens for batch {} x seq {}", tokens.size(), batch, seq);
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] < 0 || tokens[i] >= m.c.vocab)
      SPILLWAY_INPUT_ERROR("token {} at position {} is outside the vocabulary [0, {})", tokens[i],
                           i, m.c.vocab);
  const int T = batch * seq;
  float* x = m.forward_inference(tokens, batch, seq);
  float* fn = nullptr;
  float* logits = m.head_forward(x, T, &fn);
  std::vector<float> out(logits, logits + static_cast<size_t>(T) * static_cast<size_t>(m.c.vocab));
  for (float* p : {logits, fn, x}) m.release(p);
  if (m.streamer != nullptr) m.streamer->step_end();
  return out;
}

}  // namespace spillway::nn
