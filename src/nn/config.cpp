// The reference model's configuration (include/spillway/nn.hpp): an embedded reference
// config or a config.json, read with the planner's parser and checked against what the
// reference model runs; errors name the field and the value.
#include <fmt/format.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/embedded_data.hpp"
#include "nn/rope_scaling.hpp"
#include "nn/slots.hpp"
#include "spillway/error.hpp"
#include "spillway/nn.hpp"

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
    if (s.mlp.kind == MlpKind::kMoe && (s.mlp.shared_ffn != 0 || s.mlp.residual_ffn != 0 ||
                                        s.mlp.bias || s.mlp.router_bias || s.mlp.shared_gate)) {
      SPILLWAY_INPUT_ERROR(
          "model config: layer {} has a shared or residual expert, or biases; the reference "
          "model runs routed experts only (file: {})",
          l, file);
    }
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
  c.heads = to_int(a.heads, "num_attention_heads");
  c.qkv_bias = a.qkv_bias;  // Note [Served attention extras]
  c.o_bias = a.o_bias;
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
