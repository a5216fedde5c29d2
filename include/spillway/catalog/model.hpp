// Model architectures as the planner and the engines see them, read from Hugging Face
// config.json files (the dense Llama/Mistral/Qwen2/Qwen3/Gemma 2-3/Phi-3 families,
// Qwen2-MoE/Qwen3-MoE, Mixtral, DeepSeek V1-V3.2 and Kimi-K2, GLM-4.5, Llama 4, GPT-OSS,
// Grok) or from the embedded catalog; docs/models.md lists the keys read per family.
//
// A ModelConfig is a list of decoder layers, each an attention spec and an MLP spec, so
// that mixed stacks (DeepSeek's first dense layers, GPT-OSS's alternating sliding
// windows, Qwen's mlp_only_layers) are exact. All sizes are validated at load; every
// product that could overflow 64 bits is checked (spillway::Error names the fields).
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

namespace spillway {

enum class AttentionKind { kGqa, kMla };

struct AttentionSpec {
  AttentionKind kind = AttentionKind::kGqa;
  int64_t heads = 0;
  int64_t kv_heads = 0;          // GQA only (MLA: every head has its own K and V)
  int64_t qk_head_dim = 0;       // per-head dim of Q and K (MLA: nope + rope)
  int64_t v_head_dim = 0;        // per-head dim of V and of the core output
  int64_t q_lora_rank = 0;       // MLA; 0 = Q projected directly from the hidden state
  int64_t kv_lora_rank = 0;      // MLA
  int64_t qk_rope_head_dim = 0;  // MLA: the shared rotary key part
  int64_t sliding_window = 0;    // 0 = full causal attention
  bool qkv_bias = false;
  bool o_bias = false;
  bool qk_norm = false;  // per-head RMSNorm of Q and K (Qwen3)
  bool sinks = false;    // learned attention sinks, one per head (GPT-OSS)
  // DeepSeek-V3.2's lightning indexer (MLA with q_lora_rank): heads and head width; its
  // parameters q_lora_rank x heads x dim + d x dim + 2 dim (LayerNorm) + d x heads.
  int64_t indexer_heads = 0;
  int64_t indexer_head_dim = 0;
  // A sigmoid gate on the core output from a second half of the Q projection (Qwen3-Next's
  // gated attention: q_proj is heads x qk_head_dim x 2 wide).
  bool output_gate = false;
  // The width the Q, K and V projections read; 0 = the hidden size. Zamba2's shared attention
  // reads the concatenated [hidden, input embedding]: 2 x hidden.
  int64_t input_width = 0;
  friend bool operator==(const AttentionSpec&, const AttentionSpec&) = default;
};

// What mixes tokens in a layer: attention, a state-space model, linear attention, or
// nothing (an MLP-only layer of Nemotron-H).
enum class MixerKind { kAttention, kMamba, kLinearAttention, kRecurrent, kNone };

// A state-space mixer (Transformers' MambaMixer / Mamba2Mixer). Mamba-1 (`version` 1;
// Jamba): a selective scan per channel, x_proj to dt_rank + 2 N, dt_proj back to the inner
// width. Mamba-2 (`version` 2; Mamba2, Nemotron-H, Granite 4.0-H): SSD over `heads` heads of
// `head_dim` (inner = heads x head_dim) with `groups` shared B/C groups, in chunks.
struct SsmSpec {
  int version = 2;
  int64_t inner = 0;     // d_inner
  int64_t state = 0;     // N, the state per channel (Mamba-1) or per head dim (Mamba-2)
  int64_t heads = 0;     // Mamba-2
  int64_t head_dim = 0;  // Mamba-2
  int64_t groups = 1;    // Mamba-2: B/C groups
  int64_t conv = 4;      // causal depthwise convolution width
  int64_t dt_rank = 0;   // Mamba-1
  int64_t chunk = 256;   // Mamba-2: SSD chunk length
  bool conv_bias = true;
  bool proj_bias = false;   // in_proj and out_proj biases
  bool gated_norm = true;   // Mamba-2: gated RMSNorm over the inner width before out_proj
  bool bcdt_norms = false;  // Jamba: RMSNorms on dt (dt_rank), B and C (N each)
  friend bool operator==(const SsmSpec&, const SsmSpec&) = default;
};

// Griffin's recurrent block (RecurrentGemma): two branches from the input, y = gelu(W_y x)
// and x' = W_x x through a causal depthwise conv and the RG-LRU (a gated linear recurrence
// of width `width`, its input and recurrence gates block-diagonal over `heads` blocks),
// multiplied and projected back; every projection with a bias.
struct RecurrentSpec {
  int64_t width = 0;  // lru_width
  int64_t heads = 1;  // the gates' diagonal blocks
  int64_t conv = 4;
  int64_t chunk = 256;  // the recurrence's state is saved every chunk tokens
  friend bool operator==(const RecurrentSpec&, const RecurrentSpec&) = default;
};

// The linear attentions spillway plans: Qwen3-Next's Gated DeltaNet, Kimi-Linear's Kimi
// Delta Attention (the delta rule with a per-channel decay), MiniMax's lightning attention
// (softmax-free attention with a fixed per-head decay, no convolution).
enum class LinearKind { kGatedDeltaNet, kKimiDelta, kLightning };

// Linear attention: q and k of k_heads x k_head_dim, v of v_heads x v_head_dim, (but
// lightning) a causal depthwise convolution over q, k and v, a recurrent state of
// k_head_dim x v_head_dim per value head, computed in chunks.
struct LinearAttentionSpec {
  LinearKind kind = LinearKind::kGatedDeltaNet;
  int64_t k_heads = 0;
  int64_t v_heads = 0;
  int64_t k_head_dim = 0;
  int64_t v_head_dim = 0;
  int64_t conv = 4;  // 0: none (lightning)
  int64_t chunk = 64;
  // Kimi Delta Attention: the rank of its low-rank decay and output-gate projections
  // (d x rank, then rank x heads x head_dim).
  int64_t gate_rank = 0;
  friend bool operator==(const LinearAttentionSpec&, const LinearAttentionSpec&) = default;
};

enum class MlpKind { kDense, kMoe, kNone };

struct MlpSpec {
  MlpKind kind = MlpKind::kDense;
  int64_t ffn = 0;           // dense: intermediate size; MoE: per routed expert
  int64_t experts = 0;       // MoE: routed experts
  int64_t top_k = 0;         // MoE: routed experts per token
  int64_t shared_ffn = 0;    // MoE: total width of the shared expert(s), 0 if none
  bool shared_gate = false;  // MoE: sigmoid gate on the shared expert (Qwen2-MoE)
  int64_t residual_ffn = 0;  // MoE: a dense MLP beside the experts (Grok), 0 if none
  bool bias = false;         // biases on the MLP/expert projections (GPT-OSS)
  bool router_bias = false;  // a bias on the router (GPT-OSS, DeepSeek-V3's correction)
  bool gated = true;         // gate, up and down (SwiGLU, GeGLU); false: up and down only
                             // (Nemotron-H's squared ReLU)
  // The width a token activates: top_k * ffn + shared_ffn + residual_ffn (dense: ffn).
  int64_t active_ffn() const;
  friend bool operator==(const MlpSpec&, const MlpSpec&) = default;
};

struct LayerSpec {
  AttentionSpec attn;  // used when mixer is kAttention
  MlpSpec mlp;         // kNone: a mixer-only layer
  MixerKind mixer = MixerKind::kAttention;
  SsmSpec ssm{};  // mixer kMamba, or beside the attention (parallel_ssm)
  // Falcon-H1: a Mamba mixer (ssm) beside the attention, both reading the input norm's
  // output, their outputs summed into the residual.
  bool parallel_ssm = false;
  // Zamba2's hybrid layers: shared transformer block number `shared_block` (attn over the
  // concatenated [hidden, input embedding] with its own 2 x hidden norm, then the MLP in mlp
  // with its norm; no residual inside) runs before the Mamba mixer, and its output, through
  // the layer's own hidden x hidden projection, is added to the mixer's input. A block's
  // weights are shared by every layer that names it: layer_parameter_count counts them in
  // each such layer (each uses them), parameter_count once. The layer's own projection and
  // LoRA adapters are in extra_params. -1: none.
  int shared_block = -1;
  LinearAttentionSpec linear{};  // mixer kLinearAttention
  RecurrentSpec recurrent{};     // mixer kRecurrent
  // RMSNorms beyond the input and post-attention ones, d parameters each (Gemma 2/3's
  // sandwich: pre- and post-feedforward norms; an MTP module's two input norms).
  int64_t extra_norms = 0;
  // A multi-token-prediction module (with_mtp_layers): the layer plus its projection of
  // the concatenated [hidden, next-token embedding] (2d x d), in extra_params.
  bool mtp = false;
  int64_t extra_params = 0;
  // Short block name used in plans: "gqa+dense", "swa+moe", "mla+moe", "gqa+moe+dense",
  // "mamba2", "mamba+moe", "gdn+moe", "kda+moe", "lightning+moe", "gqa|mamba2+dense" (a
  // parallel hybrid), "shared+mamba2" (Zamba2's hybrid layer), "dense" (an MLP-only layer).
  std::string block_name() const;
  friend bool operator==(const LayerSpec&, const LayerSpec&) = default;
};

struct ModelConfig {
  std::string name;        // catalog name or the file's stem
  std::string model_type;  // as in config.json
  std::string source;      // file path or "catalog:<file>"
  int64_t hidden = 0;
  int64_t vocab = 0;
  bool tied_embeddings = false;
  std::vector<LayerSpec> layers;
  // Multi-token-prediction layers the config declares (DeepSeek-V3, GLM-4.5): not in the
  // layers, the parameter counts or the plan (published counts leave them out).
  int64_t mtp_layers = 0;
  // What the loader decided that changes what is planned, in words (the architecture read
  // from `architectures`, a vision tower left out, MTP layers left out).
  std::vector<std::string> notes;
};

// The model with its multi-token-prediction layers appended (`spillway plan --mtp`): each
// one a copy of the last layer with the MTP module's two norms and 2d x d projection (the
// DeepSeek-V3 / GLM-4.5 module; its head is shared with the model's). Throws InputError
// when the model declares none.
ModelConfig with_mtp_layers(ModelConfig model);

// Parses a Hugging Face config.json. `name` labels the model, `file` is used in messages.
ModelConfig parse_model_config(const nlohmann::json& config, const std::string& name,
                               const std::string& file);
// A catalog name (case-insensitive, e.g. "Qwen3-30B-A3B") or a path to a config.json.
ModelConfig load_model(const std::string& name_or_path);

struct ModelCatalogEntry {
  std::string name;
  std::string file;
  std::string hf_repo;
  double published_params_b = 0.0;
  double published_active_params_b = 0.0;  // 0 when not published
  // How far the counts may be from the published figures (fractions): 1% unless the
  // catalog says why a figure is rounded further (its params_source).
  double params_tolerance = 0.01;
  double active_tolerance = 0.01;
  bool active_counts_embedding = true;  // false: the published active count leaves it out
  bool active_counts_head = true;       // false: ... and the (untied) LM head too (MiniMax)
};
std::vector<ModelCatalogEntry> model_catalog();

// The model_type values the loader knows.
const std::vector<std::string>& supported_model_types();

// Parameters of one layer (unsharded), of the whole model (embeddings, final norm and an
// untied LM head included; multi-token-prediction modules excluded), and per token.
int64_t layer_parameter_count(const LayerSpec& layer, int64_t hidden);
// The weights of a layer's shared block (LayerSpec::shared_block), 0 without one: part of
// layer_parameter_count, counted once per block by parameter_count.
int64_t shared_block_parameter_count(const LayerSpec& layer, int64_t hidden);
int64_t parameter_count(const ModelConfig& model);
int64_t active_parameter_count(const ModelConfig& model);

}  // namespace spillway
