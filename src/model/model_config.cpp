// Hugging Face config.json -> ModelConfig: the registry of model families, the reading
// rules every family shares (Note [Reading a config]), the model catalog and the
// multi-token-prediction layers. Each family's parser is in families/; parameter counts are
// in parameter_count.cpp.
#include <algorithm>
#include <cctype>
#include <filesystem>
#include <optional>
#include <set>

#include "core/embedded_data.hpp"
#include "core/json_io.hpp"
#include "core/near_names.hpp"
#include "model/families/families.hpp"
#include "spillway/catalog/model.hpp"
#include "spillway/core/error.hpp"
#include "spillway/core/units.hpp"

namespace spillway {

namespace {

using families::kMaxDim;
constexpr const char* kWhat = "model config";

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

[[noreturn]] void unknown_type(const std::string& type, const std::string& wrapper,
                               const std::string& file) {
  std::string known;
  for (const std::string& t : supported_model_types()) known += (known.empty() ? "" : ", ") + t;
  SPILLWAY_INPUT_ERROR(
      "{}: model_type \"{}\"{} is not supported (supported: {}). Relabelling the config as a "
      "supported type would plan a different model (tied embeddings, sliding windows, dense "
      "first layers, shared experts, linear attention and extra norms would be lost or "
      "invented); docs/models.md says what each family reads{}",
      kWhat, type,
      wrapper.empty() || wrapper == type ? ""
                                         : fmt::format(" (the text_config of \"{}\")", wrapper),
      known, file.empty() ? "" : fmt::format(" (file: {})", file));
}

// Note [Reading a config] (docs/models.md):
//   - the language model's keys are the root's, or those of a nested `text_config` (the
//     multimodal wrappers: Gemma 3, Llama 4); a vision tower is not planned (a note says so);
//   - the family is `model_type` (the text config's, else the wrapper's text family), else
//     the one of `architectures`; when both are known and name different families, the
//     architecture wins (it is the class that holds the weights) and a note says so;
//   - a model_type spillway has no family for is refused by name before any key is read;
//   - a wrapper's own tie_word_embeddings (else its class's default) ties the head, as
//     transformers' wrapper model reads it, whatever text_config says;
//   - each family reads its keys under their transformers 4 and 5 names (alias()); keys
//     transformers 5 derives and writes beside their sources are checked against them;
//   - the generic PretrainedConfig fields (generic_pretrained_field) are ignored;
//   - after reading, a key of the language model that looks like a size, a count or a
//     layer pattern (shape_like) and that the family did not read is an error naming it:
//     an unread shape key would plan a different model silently.
//
// The registry: every model_type spillway reads, its family and the family's parser
// (families/families.hpp).
struct Family {
  const char* type;
  const char* family;
  families::Parser parse;
};
constexpr Family kFamilies[] = {
    {"llama", "llama", families::parse_llama_like},
    {"mistral", "llama", families::parse_llama_like},
    {"qwen2", "llama", families::parse_llama_like},
    {"qwen3", "llama", families::parse_llama_like},
    {"phi3", "llama", families::parse_llama_like},
    {"qwen2_moe", "qwen_moe", families::parse_qwen_moe},
    {"qwen3_moe", "qwen_moe", families::parse_qwen_moe},
    {"mixtral", "mixtral", families::parse_mixtral},
    {"deepseek", "deepseek", families::parse_deepseek},
    {"deepseek_v2", "deepseek", families::parse_deepseek},
    {"deepseek_v3", "deepseek", families::parse_deepseek},
    {"deepseek_v32", "deepseek", families::parse_deepseek},
    {"kimi_k2", "deepseek", families::parse_deepseek},
    {"gpt_oss", "gpt_oss", families::parse_gpt_oss},
    {"grok-1", "grok", families::parse_grok},
    {"grok-2", "grok", families::parse_grok},
    {"grok", "grok", families::parse_grok},
    {"gemma2", "gemma", families::parse_gemma},
    {"gemma3_text", "gemma", families::parse_gemma},
    {"glm4_moe", "glm4_moe", families::parse_glm4_moe},
    {"llama4_text", "llama4", families::parse_llama4},
    {"nemotron_h", "nemotron_h", families::parse_nemotron_h},
    {"mamba2", "mamba2", families::parse_mamba2},
    {"mamba", "mamba", families::parse_mamba1},
    {"falcon_mamba", "mamba", families::parse_mamba1},
    {"jamba", "jamba", families::parse_jamba},
    {"qwen3_next", "qwen3_next", families::parse_qwen3_next},
    {"granitemoehybrid", "granite_hybrid", families::parse_granite_hybrid},
    {"recurrent_gemma", "recurrent_gemma", families::parse_recurrent_gemma},
    {"qwen3_5_moe_text", "qwen3_next", families::parse_qwen3_next},
    {"falcon_h1", "falcon_h1", families::parse_falcon_h1},
    {"kimi_linear", "kimi_linear", families::parse_kimi_linear},
    {"minimax_m1", "minimax", families::parse_minimax},
    {"minimax_text_01", "minimax", families::parse_minimax},
    {"minimax", "minimax", families::parse_minimax},
    {"zamba2", "zamba2", families::parse_zamba2}};

const Family* find_family(const std::string& type) {
  for (const Family& f : kFamilies)
    if (type == f.type) return &f;
  return nullptr;
}

const char* family_of(const std::string& type) {
  const Family* f = find_family(type);
  return f != nullptr ? f->family : nullptr;
}

// The model_type an architecture class stands for.
std::string type_of_architecture(const std::string& arch) {
  static const std::pair<const char*, const char*> kArch[] = {
      {"LlamaForCausalLM", "llama"},
      {"MistralForCausalLM", "mistral"},
      {"Qwen2ForCausalLM", "qwen2"},
      {"Qwen3ForCausalLM", "qwen3"},
      {"Phi3ForCausalLM", "phi3"},
      {"Qwen2MoeForCausalLM", "qwen2_moe"},
      {"Qwen3MoeForCausalLM", "qwen3_moe"},
      {"MixtralForCausalLM", "mixtral"},
      {"DeepseekForCausalLM", "deepseek"},
      {"DeepseekV2ForCausalLM", "deepseek_v2"},
      {"DeepseekV3ForCausalLM", "deepseek_v3"},
      {"DeepseekV32ForCausalLM", "deepseek_v32"},
      {"GptOssForCausalLM", "gpt_oss"},
      {"Grok1ForCausalLM", "grok-1"},
      {"Grok1ModelForCausalLM", "grok-1"},
      {"GrokForCausalLM", "grok"},
      {"Gemma2ForCausalLM", "gemma2"},
      {"Gemma3ForCausalLM", "gemma3_text"},
      {"Gemma3ForConditionalGeneration", "gemma3_text"},
      {"Glm4MoeForCausalLM", "glm4_moe"},
      {"Llama4ForCausalLM", "llama4_text"},
      {"Llama4ForConditionalGeneration", "llama4_text"},
      {"NemotronHForCausalLM", "nemotron_h"},
      {"Mamba2ForCausalLM", "mamba2"},
      {"MambaForCausalLM", "mamba"},
      {"FalconMambaForCausalLM", "falcon_mamba"},
      {"JambaForCausalLM", "jamba"},
      {"Qwen3NextForCausalLM", "qwen3_next"},
      {"GraniteMoeHybridForCausalLM", "granitemoehybrid"},
      {"RecurrentGemmaForCausalLM", "recurrent_gemma"},
      {"Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe_text"},
      {"FalconH1ForCausalLM", "falcon_h1"},
      {"KimiLinearForCausalLM", "kimi_linear"},
      {"MiniMaxM1ForCausalLM", "minimax_m1"},
      {"MiniMaxText01ForCausalLM", "minimax_text_01"},
      {"MiniMaxForCausalLM", "minimax"},
      {"Zamba2ForCausalLM", "zamba2"}};
  for (const auto& [a, t] : kArch)
    if (arch == a) return t;
  return {};
}

// The text family of a multimodal wrapper's model_type.
std::string text_type_of_wrapper(const std::string& type) {
  if (type == "gemma3") return "gemma3_text";
  if (type == "qwen3_5_moe") return "qwen3_5_moe_text";
  if (type == "llama4") return "llama4_text";
  return type;
}

// transformers' default of tie_word_embeddings for a wrapper's own config class; none for a
// wrapper it does not name.
std::optional<bool> tied_default_of_wrapper(const std::string& type) {
  if (type == "gemma3" || type == "moss_transcribe_diarize") return true;
  if (type == "llama4" || type == "qwen3_5_moe") return false;
  return std::nullopt;
}

// A key that looks like a size, a count or a layer pattern.
bool shape_like(std::string_view k) {
  static constexpr std::string_view kNotShape[] = {"max_position_embeddings",
                                                   "original_max_position_embeddings",
                                                   "initializer_range",
                                                   "ep_size",
                                                   "n_group",
                                                   "topk_group",
                                                   "num_nextn_predict_layers",
                                                   "max_batch_size",
                                                   "index_topk",
                                                   "rope_scaling",
                                                   "rope_parameters",
                                                   "num_logits_to_keep",
                                                   "rope_local_base_freq",
                                                   "embeddings_scale_by_sqrt_dim",
                                                   "mtp_use_dedicated_embeddings"};
  for (std::string_view n : kNotShape)
    if (k == n) return false;
  if (k.find("eps") != std::string_view::npos) return false;  // norm epsilons
  if (k.starts_with("num_") || k.starts_with("n_")) return true;
  static constexpr std::string_view kParts[] = {
      "size",   "dim",    "heads",   "layer",    "expert", "rank",        "window",
      "period", "offset", "pattern", "interval", "freq",   "replace",     "ffn",
      "groups", "chunk",  "state",   "conv",     "expand", "block_types", "attn_type"};
  for (std::string_view p : kParts)
    if (k.find(p) != std::string_view::npos) return true;
  return false;
}

// The fields every transformers PretrainedConfig has (to_dict() writes them all, a config
// written with use_diff=False holds them): generation, labels, output switches and
// bookkeeping of transformers 4 and 5. None shapes the weights (chunk_size_feed_forward
// chunks the MLP's execution, cross_attention_hidden_size only matters with
// add_cross_attention, which decoder-only families do not build), so they are ignored.
bool generic_pretrained_field(std::string_view k) {
  static constexpr std::string_view kGeneric[] = {"_name_or_path",
                                                  "transformers_version",
                                                  "chunk_size_feed_forward",
                                                  "dtype",
                                                  "torch_dtype",
                                                  "id2label",
                                                  "label2id",
                                                  "num_labels",
                                                  "problem_type",
                                                  "is_encoder_decoder",
                                                  "is_decoder",
                                                  "add_cross_attention",
                                                  "cross_attention_hidden_size",
                                                  "tie_encoder_decoder",
                                                  "output_attentions",
                                                  "output_hidden_states",
                                                  "return_dict",
                                                  "torchscript",
                                                  "use_bfloat16",
                                                  "tf_legacy_loss",
                                                  "pruned_heads",
                                                  "finetuning_task",
                                                  "tokenizer_class",
                                                  "prefix",
                                                  "task_specific_params",
                                                  "max_length",
                                                  "min_length",
                                                  "do_sample",
                                                  "early_stopping",
                                                  "num_beams",
                                                  "num_beam_groups",
                                                  "diversity_penalty",
                                                  "temperature",
                                                  "top_k",
                                                  "top_p",
                                                  "typical_p",
                                                  "repetition_penalty",
                                                  "length_penalty",
                                                  "no_repeat_ngram_size",
                                                  "encoder_no_repeat_ngram_size",
                                                  "bad_words_ids",
                                                  "num_return_sequences",
                                                  "output_scores",
                                                  "return_dict_in_generate",
                                                  "forced_bos_token_id",
                                                  "forced_eos_token_id",
                                                  "remove_invalid_values",
                                                  "exponential_decay_length_penalty",
                                                  "suppress_tokens",
                                                  "begin_suppress_tokens",
                                                  "decoder_start_token_id",
                                                  "sep_token_id"};
  for (std::string_view g : kGeneric)
    if (k == g) return true;
  return false;
}

void refuse_unread(const JsonObject& c, const std::set<std::string, std::less<>>& reads,
                   const std::string& type) {
  for (const auto& [key, value] : c.raw().items()) {
    if (reads.count(key) != 0 || value.is_null() || value == false) continue;
    if (!shape_like(key) || generic_pretrained_field(key)) continue;
    c.fail(key, fmt::format("is {}: it looks like it shapes the model, but spillway does not read "
                            "it for model_type \"{}\", so the plan would be of another model. "
                            "docs/models.md lists the keys each family reads",
                            json_value_text(value), type));
  }
}

}  // namespace

const std::vector<std::string>& supported_model_types() {
  static const std::vector<std::string> types = [] {
    std::vector<std::string> t;
    for (const Family& f : kFamilies) t.emplace_back(f.type);
    t.emplace_back("gemma3");  // wrappers of a text_config
    t.emplace_back("llama4");
    t.emplace_back("qwen3_5_moe");
    t.emplace_back("mamba_ssm");  // the mamba_ssm package's format (no model_type)
    return t;
  }();
  return types;
}

std::string LayerSpec::block_name() const {
  if (shared_block >= 0) return ssm.version == 1 ? "shared+mamba" : "shared+mamba2";
  std::string s;
  switch (mixer) {
    case MixerKind::kAttention:
      s = attn.kind == AttentionKind::kMla ? "mla" : (attn.sliding_window > 0 ? "swa" : "gqa");
      if (parallel_ssm) s += ssm.version == 1 ? "|mamba" : "|mamba2";
      break;
    case MixerKind::kMamba:
      s = ssm.version == 1 ? "mamba" : "mamba2";
      break;
    case MixerKind::kLinearAttention:
      s = linear.kind == LinearKind::kGatedDeltaNet ? "gdn"
          : linear.kind == LinearKind::kKimiDelta   ? "kda"
                                                    : "lightning";
      break;
    case MixerKind::kRecurrent:
      s = "rglru";
      break;
    case MixerKind::kNone:
      break;
  }
  auto add = [&](const char* part) { s += s.empty() ? part : std::string("+") + part; };
  const bool is_mtp = mtp;
  if (mlp.kind == MlpKind::kMoe) {
    add("moe");
    if (mlp.residual_ffn > 0) add("dense");
  } else if (mlp.kind == MlpKind::kDense) {
    add("dense");
  }
  if (is_mtp) add("mtp");
  return s;
}

ModelConfig with_mtp_layers(ModelConfig m) {
  if (m.mtp_layers <= 0 || m.layers.empty())
    SPILLWAY_INPUT_ERROR("--mtp: {} declares no multi-token-prediction layers", m.name);
  LayerSpec l = m.layers.back();
  l.mtp = true;
  l.extra_norms += 2;  // enorm, hnorm
  l.extra_params = checked_mul(2 * m.hidden, m.hidden, "model config: MTP projection");
  for (int64_t i = 0; i < m.mtp_layers; ++i) m.layers.push_back(l);
  m.notes.push_back(fmt::format(
      "{} multi-token-prediction layer(s) planned after the last layer (--mtp), each a copy of "
      "it with the MTP module's norms and {} x {} projection",
      m.mtp_layers, 2 * m.hidden, m.hidden));
  // The notes said they were left out: no longer.
  std::erase_if(m.notes, [](const std::string& n) { return n.find("are not planned") != n.npos; });
  m.mtp_layers = 0;
  return m;
}
ModelConfig parse_model_config(const nlohmann::json& config, const std::string& name,
                               const std::string& file) {
  JsonObject root(config, kWhat, file);
  ModelConfig m;
  m.name = name;
  m.source = file;
  // The language model's object (Note [Reading a config]).
  // The mamba_ssm package's own format (no model_type, no architectures).
  if (!root.has("model_type") && !root.has("architectures") && root.has("d_model") &&
      root.has("n_layer")) {
    auto reads = std::make_shared<std::set<std::string, std::less<>>>();
    JsonObject tracked = root;
    tracked.track_reads(reads);
    m = families::parse_mamba_ssm(tracked, std::move(m));
    refuse_unread(root, *reads, "mamba_ssm");
    return m;
  }
  const bool nested = root.has("text_config") && !root.has("hidden_size");
  const JsonObject c = nested ? root.req_obj("text_config") : root;
  auto reads = std::make_shared<std::set<std::string, std::less<>>>();
  JsonObject tracked = c;
  tracked.track_reads(reads);
  const std::string root_type = root.has("model_type") ? lower(root.req_str("model_type")) : "";
  std::string type;
  if (nested) {
    type = c.has("model_type") ? lower(c.req_str("model_type")) : text_type_of_wrapper(root_type);
    if (root.has("vision_config")) {
      m.notes.push_back(
          fmt::format("the vision tower (vision_config of \"{}\") is not planned: "
                      "the language model of text_config is",
                      root_type));
    }
    if (root.has("audio_config")) {
      m.notes.push_back(
          fmt::format("the audio encoder (audio_config of \"{}\") is not planned: "
                      "the language model of text_config is",
                      root_type));
    }
  } else {
    type = root_type;
    (void)tracked.has("model_type");
  }
  const std::vector<std::string> archs = root.str_array_or("architectures");
  (void)tracked.has("architectures");
  const std::string arch_type = archs.empty() ? "" : type_of_architecture(archs.front());
  if (type.empty()) {
    if (arch_type.empty()) {
      root.fail("model_type", archs.empty()
                                  ? std::string("is missing, and so is \"architectures\"; one of "
                                                "them must say which model this is")
                                  : fmt::format("is missing, and \"architectures\" ({}) is not "
                                                "one spillway knows",
                                                archs.front()));
    }
    type = arch_type;
  } else if (type == "git" && !arch_type.empty() &&
             std::string_view(family_of(arch_type)) == "grok") {
    // xAI's Grok-2 config.json says "git", which is transformers' GIT (an image-to-text
    // model, not planned): only a Grok architecture makes it Grok.
    m.notes.push_back(fmt::format("model_type \"git\" with architectures {}: planned as \"{}\"",
                                  archs.front(), arch_type));
    type = arch_type;
  } else if (!arch_type.empty() && family_of(type) != nullptr &&
             std::string_view(family_of(type)) != family_of(arch_type)) {
    m.notes.push_back(
        fmt::format("model_type \"{}\" but architectures {}: planned as \"{}\", "
                    "the architecture's family (the class that holds the weights)",
                    type, archs.front(), arch_type));
    type = arch_type;
  }
  // As written in the config (case kept), unless the architecture decided.
  const JsonObject& typed = nested && c.has("model_type") ? c : root;
  m.model_type = typed.has("model_type") && lower(typed.req_str("model_type")) == type
                     ? typed.req_str("model_type")
                     : type;
  // An unknown type is refused before any of its keys is read: a missing "hidden_size" would
  // say less than the type.
  if (find_family(type) == nullptr) unknown_type(m.model_type, nested ? root_type : "", file);
  // From here every message names the family whose rules apply: `model config (glm4_moe):
  // "num_attention_heads" is 96; ...`.
  const JsonObject lm(c.raw(), fmt::format("{} ({})", kWhat, m.model_type), file,
                      nested ? "text_config." : "");
  JsonObject keys = lm;
  keys.track_reads(reads);
  m.hidden = keys.req_int("hidden_size", 1, kMaxDim);
  if (!keys.has("vocab_size") && type == "gemma3_text") {
    // Gemma 3's wrapper configs leave the text vocabulary at transformers' default.
    m.vocab = 262208;
    m.notes.push_back(
        "vocab_size is not given: transformers' Gemma3TextConfig default, 262,208, is used");
  } else {
    m.vocab = keys.req_int("vocab_size", 1, kMaxDim);
  }
  const char* fam = family_of(type);
  // transformers' defaults of tie_word_embeddings: true for these families' configs.
  const bool tied_default =
      fam != nullptr &&
      (std::string_view(fam) == "gemma" || std::string_view(fam) == "recurrent_gemma" ||
       std::string_view(fam) == "mamba" || std::string_view(fam) == "zamba2");
  if (nested) {
    // transformers' wrapper model (...ForConditionalGeneration) holds the head and ties it by its
    // own config's tie_word_embeddings (the wrapper class's default when the file leaves it out),
    // whatever text_config says.
    const std::optional<bool> wrapper_default = tied_default_of_wrapper(root_type);
    const bool text_tied = keys.bool_or("tie_word_embeddings", tied_default);
    m.tied_embeddings = root.has("tie_word_embeddings")
                            ? root.bool_or("tie_word_embeddings", text_tied)
                            : wrapper_default.value_or(text_tied);
    if (m.tied_embeddings != text_tied && c.has("tie_word_embeddings")) {
      m.notes.push_back(fmt::format(
          "embeddings {}: the wrapper's tie_word_embeddings ({}) rules, as transformers' \"{}\" "
          "model reads it; text_config's ({}) is not used",
          m.tied_embeddings ? "tied" : "untied",
          root.has("tie_word_embeddings")
              ? (m.tied_embeddings ? "true" : "false")
              : (m.tied_embeddings ? "true by default" : "false by default"),
          root_type, text_tied ? "true" : "false"));
    }
  } else {
    m.tied_embeddings = keys.bool_or("tie_word_embeddings", tied_default);
  }
  const Family* family = find_family(type);
  m = family->parse(keys, std::move(m), type);
  refuse_unread(lm, *reads, type);
  // Validate that the totals fit 64 bits once, here, naming the sizes and the file.
  try {
    (void)parameter_count(m);
  } catch (const Error& e) {
    const LayerSpec& l = m.layers.front();
    SPILLWAY_INPUT_ERROR(
        "{}: the parameter count does not fit 64 bits with \"hidden_size\" {}, \"vocab_size\" {}, "
        "\"num_hidden_layers\" {}, \"intermediate_size\" (or the experts' width) {}, {} experts "
        "({}){}",
        kWhat, m.hidden, m.vocab, m.layers.size(), l.mlp.ffn, l.mlp.experts, e.what(),
        file.empty() ? "" : fmt::format(" (file: {})", file));
  }
  return m;
}

std::vector<ModelCatalogEntry> model_catalog() {
  const EmbeddedFile* f = find_embedded("models", "catalog.json");
  SPILLWAY_CHECK(f != nullptr, "the embedded model catalog (data/models/catalog.json) is missing");
  const Json doc = parse_json_text(f->text, "model catalog", "data/models/catalog.json");
  JsonObject root(doc, "model catalog", "data/models/catalog.json");
  std::vector<ModelCatalogEntry> out;
  for (const JsonObject& e : root.obj_array("models")) {
    ModelCatalogEntry m;
    m.name = e.req_str("name");
    m.file = e.req_str("file");
    m.hf_repo = e.str_or("hf_repo", "");
    m.published_params_b = e.req_num("published_params_b", 0.0, 1e6);
    m.published_active_params_b = e.num_or("published_active_params_b", 0.0, 0.0, 1e6);
    m.params_tolerance = e.num_or("params_tolerance", 0.01, 0.0, 0.5);
    m.active_tolerance = e.num_or("active_tolerance", 0.01, 0.0, 0.5);
    m.active_counts_embedding = e.bool_or("active_counts_embedding", true);
    m.active_counts_head = e.bool_or("active_counts_head", true);
    out.push_back(std::move(m));
  }
  return out;
}

ModelConfig load_model(const std::string& name_or_path) {
  const std::string key = lower(name_or_path);
  for (const ModelCatalogEntry& e : model_catalog()) {
    if (lower(e.name) == key || lower(e.file) == key) {
      const EmbeddedFile* f = find_embedded("models", e.file);
      SPILLWAY_CHECK(f != nullptr, "catalog entry {} names a missing file {}", e.name, e.file);
      const std::string label = "data/models/" + e.file;
      return parse_model_config(parse_json_text(f->text, kWhat, label), e.name, label);
    }
  }
  // The reference model's embedded configs (data/nn/: tiny-moe, small-moe, tiny-hybrid, what
  // `spillway train` runs) plan by the same name.
  if (const EmbeddedFile* f = find_embedded("nn", key + ".json"); f != nullptr) {
    const std::string label = "data/nn/" + key + ".json";
    return parse_model_config(parse_json_text(f->text, kWhat, label), key, label);
  }
  std::error_code ec;
  if (!std::filesystem::exists(name_or_path, ec)) {
    std::string names;
    std::vector<std::string> known;
    std::string hub;  // a Hugging Face repo id whose config.json the catalog holds
    for (const ModelCatalogEntry& e : model_catalog()) {
      names += (names.empty() ? "" : ", ") + e.name;
      known.push_back(e.name);
      if (!e.hf_repo.empty() && lower(e.hf_repo) == key) hub = e.name;
    }
    const std::string tail = key.substr(key.rfind('/') + 1);
    const std::string hint = !hub.empty()
                                 ? fmt::format(
                                       " Did you mean {} (the catalog's copy of that Hugging Face "
                                       "repo's config.json)?",
                                       hub)
                                 : did_you_mean(tail, known);
    SPILLWAY_INPUT_ERROR(
        "model: '{}' is neither a catalog model nor an existing file.{} Catalog: {}; the "
        "reference models of `spillway train`: tiny-moe, small-moe, tiny-hybrid (or pass the path "
        "of a Hugging Face config.json, or of a directory holding one)",
        name_or_path, hint, names);
  }
  std::filesystem::path p(name_or_path);
  if (std::filesystem::is_directory(p, ec)) {
    p /= "config.json";
    if (!std::filesystem::exists(p, ec))
      SPILLWAY_INPUT_ERROR("model: '{}' is a directory without a config.json", name_or_path);
  }
  // A config.json is named after its directory, also when the path does not spell it
  // ("./config.json", "config.json": the working directory's name, not "." or "config").
  std::string stem = p.stem().string();
  if (stem == "config") {
    const std::filesystem::path dir =
        std::filesystem::absolute(p, ec).lexically_normal().parent_path();
    if (!ec && !dir.filename().empty()) stem = dir.filename().string();
  }
  return parse_model_config(load_json_file(p.string(), kWhat), stem, p.string());
}

}  // namespace spillway
