// The reference model's configuration (include/spillway/nn/nn.hpp): an embedded reference
// config or a config.json, read with the planner's parser and checked against what the
// reference model runs; errors name the field and the value.
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/embedded_data.hpp"
#include "core/json_keys.hpp"
#include "nn/rope_scaling.hpp"
#include "nn/slots.hpp"
#include "spillway/core/error.hpp"
#include "spillway/nn/nn.hpp"

namespace spillway::nn {

std::vector<std::string> saved_tensor_names(const RefConfig& c, int layer) {
  std::vector<std::string> names =
      is_moe(c, layer) ? std::vector<std::string>(std::begin(kMoeNames), std::end(kMoeNames))
                       : std::vector<std::string>(std::begin(kDenseNames), std::end(kDenseNames));
  if (is_mamba(c, layer)) {  // Note [Mamba slots]
    for (size_t s = 0; s < 5; ++s) names[s] = kMambaMixerNames[s];
    names.insert(names.end(), std::begin(kMambaTailNames), std::end(kMambaTailNames));
  }
  return names;
}

namespace {

// Note [Served Gemma]: Gemma 2 and Gemma 3 (text) as transformers 5 computes them
// (modeling_gemma2.py, modeling_gemma3.py): every RMSNorm, the q/k norms included, multiplies
// by (1 + w); the embedding by sqrt(hidden) (an fp32 tensor, as torch rounds it); four norms
// a layer, the attention's and the MLP's outputs normed before their residual adds; the MLP a
// GeGLU of gelu_pytorch_tanh; scores scaled by query_pre_attn_scalar^-1/2 and, as the config
// says (Gemma 2's defaults 50 and 30, Gemma 3's none), soft-capped, and the logits too.
// Gemma 3's local layers have their own RoPE (rope_scaling.cpp). Read with the activation of
// every config: hidden_act (hidden_activation for Gemma) silu or gelu_pytorch_tanh, anything
// else refused by name.
void read_gemma(const nlohmann::json& j, const std::string& file, RefConfig& c) {
  const std::string& type = c.model.model_type;
  if (type == "gemma3")
    SPILLWAY_INPUT_ERROR(
        "model config: model_type \"gemma3\" is Gemma 3's multimodal model; the decoder serves "
        "its text model (Gemma3ForCausalLM, model_type gemma3_text) (file: {})",
        file);
  const bool gemma = type == "gemma2" || type == "gemma3_text";
  std::string act = "silu";
  const char* act_key = nullptr;
  const std::array<const char*, 2> keys = {gemma ? "hidden_activation" : "hidden_act",
                                           gemma ? "hidden_act" : nullptr};
  for (const char* key : keys) {
    if (key != nullptr && j.contains(key) && j[key].is_string()) {
      act = j[key].get<std::string>();
      act_key = key;
      break;
    }
  }
  if (gemma && act_key == nullptr) act = "gelu_pytorch_tanh";
  if (act == "gelu_pytorch_tanh") {
    c.gelu_mlp = true;
  } else if (act != "silu" && act != "swish") {
    SPILLWAY_INPUT_ERROR(
        "model config: \"{}\" is \"{}\"; the decoder's gated MLPs run silu (SwiGLU) or "
        "gelu_pytorch_tanh (GeGLU) (file: {})",
        act_key, act, file);
  }
  if (!gemma) return;
  if (j.contains("use_bidirectional_attention") && j["use_bidirectional_attention"].is_boolean() &&
      j["use_bidirectional_attention"].get<bool>())
    SPILLWAY_INPUT_ERROR(
        "model config: \"use_bidirectional_attention\" is true; the decoder runs causal "
        "attention (file: {})",
        file);
  // A cap given as a number; null: none; absent: the family's default.
  const auto cap = [&](const char* key, double fallback) {
    if (!j.contains(key)) return fallback;
    if (j[key].is_null()) return 0.0;
    if (!j[key].is_number() || !(j[key].get<double>() > 0))
      SPILLWAY_INPUT_ERROR("model config: \"{}\" is {}; a number > 0 or null (file: {})", key,
                           j[key].dump(), file);
    return j[key].get<double>();
  };
  const bool gemma2 = type == "gemma2";
  c.attn_softcap = cap("attn_logit_softcapping", gemma2 ? 50.0 : 0.0);
  if (!gemma2 && c.attn_softcap > 0)
    SPILLWAY_INPUT_ERROR(
        "model config: \"attn_logit_softcapping\" is {} for Gemma 3; transformers' Gemma 3 "
        "attention does not apply it (Gemma 2's does), so what the model computes is ambiguous "
        "(file: {})",
        c.attn_softcap, file);
  c.final_softcap = cap("final_logit_softcapping", gemma2 ? 30.0 : 0.0);
  const double scalar =
      j.contains("query_pre_attn_scalar")
          ? j["query_pre_attn_scalar"].is_number() ? j["query_pre_attn_scalar"].get<double>() : -1.0
          : 256.0;
  if (!(scalar > 0))
    SPILLWAY_INPUT_ERROR("model config: \"query_pre_attn_scalar\" is {}; must be > 0 (file: {})",
                         j["query_pre_attn_scalar"].dump(), file);
  c.attn_scale = std::pow(scalar, -0.5);  // Python's scalar**-0.5
  c.norm_offset = 1.0;
  c.embed_scale = static_cast<float>(std::pow(static_cast<double>(c.hidden), 0.5));
  c.sandwich_norms = true;
}

}  // namespace

RefConfig load_reference_config(const std::string& name_or_path) {
  std::string text;
  std::string file = name_or_path;
  const EmbeddedFile* embedded = find_embedded("nn", name_or_path + ".json");
  if (embedded != nullptr) {
    text = embedded->text;
    file = "data/nn/" + name_or_path + ".json";
  } else {
    std::ifstream in(name_or_path);
    if (!in)
      SPILLWAY_INPUT_ERROR(
          "--model: '{}' is neither an embedded reference model (tiny-moe, small-moe, tiny-hybrid) "
          "nor a "
          "readable config.json",
          name_or_path);
    std::stringstream ss;
    ss << in.rdbuf();
    text = ss.str();
  }
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    SPILLWAY_INPUT_ERROR("model config: not valid JSON ({}) (file: {})", e.what(), file);
  }
  refuse_duplicate_keys(text, "model config", file);
  RefConfig c;
  const std::string stem = embedded != nullptr ? name_or_path : file;
  c.model = parse_model_config(j, stem, file);
  c.hidden = to_int(c.model.hidden, "hidden_size");
  if (c.model.vocab < 256)
    SPILLWAY_INPUT_ERROR(
        "model config: \"vocab_size\" is {}; the reference model reads byte-level tokens and "
        "needs >= 256 (file: {})",
        c.model.vocab, file);
  c.vocab = to_int(c.model.vocab, "vocab_size");
  if (c.model.layers.empty()) SPILLWAY_INPUT_ERROR("model config: no layers (file: {})", file);
  // Attention's shape from the first attention layer (a hybrid stack may start with Mamba).
  AttentionSpec a;
  for (const LayerSpec& s : c.model.layers) {
    if (s.mixer == MixerKind::kAttention) {
      a = s.attn;
      break;
    }
  }
  for (size_t l = 0; l < c.model.layers.size(); ++l) {
    const LayerSpec& s = c.model.layers[l];
    if (s.mlp.kind == MlpKind::kNone || !s.mlp.gated) {
      SPILLWAY_INPUT_ERROR(
          "model config: layer {} ({}) has no MLP or an ungated one; the reference model runs a "
          "SwiGLU MLP (dense or routed experts) in every layer (file: {})",
          l, s.block_name(), file);
    }
    // Qwen2-MoE's gated shared expert is served (RefConfig::shared_expert_ffn).
    if (s.mlp.kind == MlpKind::kMoe &&
        ((s.mlp.shared_ffn != 0) != s.mlp.shared_gate || s.mlp.residual_ffn != 0 || s.mlp.bias ||
         s.mlp.router_bias)) {
      SPILLWAY_INPUT_ERROR(
          "model config: layer {} has an ungated shared expert, a residual expert or biases; "
          "the reference model runs routed experts, with Qwen2-MoE's gated shared expert beside "
          "them (file: {})",
          l, file);
    }
    if (s.mlp.kind == MlpKind::kMoe)
      c.shared_expert_ffn = std::max(c.shared_expert_ffn, static_cast<int>(s.mlp.shared_ffn));
    if (s.mixer == MixerKind::kMamba) {
      const SsmSpec& m = s.ssm;
      if (m.version != 2 || !m.gated_norm || m.proj_bias || !m.conv_bias || s.shared_block >= 0) {
        SPILLWAY_INPUT_ERROR(
            "model config: layer {} ({}) is not supported by the reference model: it runs "
            "Mamba-2 with a gated norm, a conv bias and no projection biases, without a shared "
            "block before it (file: {})",
            l, s.block_name(), file);
      }
      (void)to_int(m.heads, "mamba heads");
      (void)to_int(m.head_dim, "mamba head_dim");
      (void)to_int(m.state, "mamba state size");
      (void)to_int(m.conv, "mamba conv kernel");
      (void)to_int(m.chunk, "mamba chunk size");
      continue;
    }
    if (s.mixer != MixerKind::kAttention) {
      SPILLWAY_INPUT_ERROR(
          "model config: layer {} ({}) is not supported by the reference model: it runs GQA "
          "attention and Mamba-2 mixers (file: {})",
          l, s.block_name(), file);
    }
    // A sliding window may differ by layer (served: Note [Served attention extras]).
    AttentionSpec same = s.attn;
    same.sliding_window = a.sliding_window;
    if (s.attn.kind != AttentionKind::kGqa || s.attn.sinks || s.attn.output_gate ||
        s.parallel_ssm || s.attn.qk_head_dim != s.attn.v_head_dim || !(same == a)) {
      SPILLWAY_INPUT_ERROR(
          "model config: layer {} ({}) is not supported by the reference model: it runs causal "
          "GQA attention without sinks or a mixer beside it, the same in every layer but its "
          "window (file: {})",
          l, s.block_name(), file);
    }
    if (s.attn.sliding_window > 0) c.sliding_window = true;
  }
  if (a.heads == 0) {
    SPILLWAY_INPUT_ERROR(
        "model config: no attention layer; the reference model needs at least one (file: {})",
        file);
  }
  read_gemma(j, file, c);  // Note [Served Gemma]
  c.heads = to_int(a.heads, "num_attention_heads");
  c.qkv_bias = a.qkv_bias;  // Note [Served attention extras]
  c.o_bias = a.o_bias;
  c.qk_norm = a.qk_norm;  // the family's (Qwen3, Qwen3-MoE); a served checkpoint may lack them
  c.kv_heads = to_int(a.kv_heads, "num_key_value_heads");
  c.head_dim = to_int(a.qk_head_dim, "head_dim");
  if (c.head_dim % 2 != 0)
    SPILLWAY_INPUT_ERROR("model config: \"head_dim\" is {}; RoPE needs an even head_dim (file: {})",
                         c.head_dim, file);
  read_rope(j, file, c);  // Note [RoPE scaling]
  c.rms_eps = j.value("rms_norm_eps", 1e-6);
  c.norm_topk = j.value("norm_topk_prob", true);
  if (!(c.rms_eps > 0))
    SPILLWAY_INPUT_ERROR("model config: \"rms_norm_eps\" is {}; must be > 0 (file: {})", c.rms_eps,
                         file);
  return c;
}

}  // namespace spillway::nn
