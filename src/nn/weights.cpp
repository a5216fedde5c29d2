// Note [Checkpoint names] (spillway/nn/nn.hpp): the reference model's weights by name, in the
// order of its parameters in memory (layout_parameters, parameter_layout.cpp, lays them out
// in this walk).
#include <fmt/format.h>

#include <cstdint>
#include <string>
#include <vector>

#include "spillway/catalog/model.hpp"
#include "spillway/nn/nn.hpp"

namespace spillway::nn {

std::vector<WeightSpec> weight_specs(const RefConfig& c) {
  std::vector<WeightSpec> out;
  auto add = [&](std::string name, std::vector<int64_t> shape, bool linear) {
    out.push_back({std::move(name), std::move(shape), linear});
  };
  const int64_t d = c.hidden;
  const int64_t q_dim = int64_t{c.heads} * c.head_dim;
  const int64_t qkv_dim = int64_t{c.heads + 2 * c.kv_heads} * c.head_dim;
  add("model.embed_tokens.weight", {c.vocab, d}, false);
  for (int l = 0; l < c.layers(); ++l) {
    const LayerSpec& spec = c.model.layers[static_cast<size_t>(l)];
    const std::string p = fmt::format("model.layers.{}.", l);
    add(p + "input_layernorm.weight", {d}, false);
    if (spec.mixer == MixerKind::kMamba) {
      const SsmSpec& s = spec.ssm;
      const int64_t inner = s.heads * s.head_dim;
      const int64_t conv_dim = inner + 2 * s.groups * s.state;
      add(p + "mixer.in_proj.weight", {inner + conv_dim + s.heads, d}, true);
      add(p + "mixer.conv1d.weight", {conv_dim, s.conv}, false);
      add(p + "mixer.conv1d.bias", {conv_dim}, false);
      add(p + "mixer.dt_bias", {s.heads}, false);
      add(p + "mixer.A_log", {s.heads}, false);
      add(p + "mixer.D", {s.heads}, false);
      add(p + "mixer.norm.weight", {inner}, false);
      add(p + "mixer.out_proj.weight", {d, inner}, true);
    } else {
      add(p + "self_attn.qkv_proj.weight", {qkv_dim, d}, true);
      if (c.qkv_bias) add(p + "self_attn.qkv_proj.bias", {qkv_dim}, false);
      if (c.qk_norm) {  // Note [Served attention extras]
        add(p + "self_attn.q_norm.weight", {c.head_dim}, false);
        add(p + "self_attn.k_norm.weight", {c.head_dim}, false);
      }
      add(p + "self_attn.o_proj.weight", {d, q_dim}, true);
      if (c.o_bias) add(p + "self_attn.o_proj.bias", {d}, false);
    }
    // The MLP's norm; Gemma's sandwich (Note [Served Gemma]) norms the attention's output
    // with post_attention_layernorm and the MLP's input with pre_feedforward_layernorm.
    add(p + "post_attention_layernorm.weight", {d}, false);
    if (c.sandwich_norms) add(p + "pre_feedforward_layernorm.weight", {d}, false);
    const MlpSpec& mlp = spec.mlp;
    if (mlp.kind == MlpKind::kMoe) {
      add(p + "mlp.gate.weight", {mlp.experts, d}, true);
      for (const char* proj : {"gate_proj", "up_proj", "down_proj"}) {
        const bool down = proj[0] == 'd';
        for (int64_t e = 0; e < mlp.experts; ++e)
          add(fmt::format("{}mlp.experts.{}.{}.weight", p, e, proj),
              down ? std::vector<int64_t>{d, mlp.ffn} : std::vector<int64_t>{mlp.ffn, d}, true);
      }
      if (mlp.shared_ffn > 0) {  // Qwen2-MoE's gated shared expert
        add(p + "mlp.shared_expert.gate_proj.weight", {mlp.shared_ffn, d}, true);
        add(p + "mlp.shared_expert.up_proj.weight", {mlp.shared_ffn, d}, true);
        add(p + "mlp.shared_expert.down_proj.weight", {d, mlp.shared_ffn}, true);
        add(p + "mlp.shared_expert_gate.weight", {1, d}, true);
      }
    } else {
      add(p + "mlp.gate_proj.weight", {mlp.ffn, d}, true);
      add(p + "mlp.up_proj.weight", {mlp.ffn, d}, true);
      add(p + "mlp.down_proj.weight", {d, mlp.ffn}, true);
    }
    if (c.sandwich_norms) add(p + "post_feedforward_layernorm.weight", {d}, false);
  }
  add("model.norm.weight", {d}, false);
  add("lm_head.weight", {c.vocab, d}, true);
  return out;
}

}  // namespace spillway::nn
