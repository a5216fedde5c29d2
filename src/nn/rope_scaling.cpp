// Note [RoPE scaling]: RoPE's inverse frequencies as transformers computes them for the
// rope types the decoder serves (modeling_rope_utils: default, linear, llama3, yarn, and
// dynamic, whose frequencies the decoder computes per step: Note [Dynamic RoPE]), read
// from `rope_parameters` (transformers 5: rope_theta inside; per layer type for Gemma 3) or
// `rope_scaling` (transformers 4: rope_theta beside it). longrope and partial rotation
// (partial_rotary_factor) are refused by name.
#include "nn/rope_scaling.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <numbers>

#include "spillway/core/error.hpp"

namespace spillway::nn {

namespace {

double num(const nlohmann::json& o, const char* key, double fallback) {
  const auto it = o.find(key);
  return it != o.end() && it->is_number() ? it->get<double>() : fallback;
}

struct Rope {
  std::string type = "default";
  double theta = 10000.0;
  std::vector<double> inv_freq;
  double attention_factor = 1.0;
  double dynamic_factor = 0.0;
  int dynamic_length = 0;
};

// One RoPE's frequencies from its parameters `p` (config `j` for what transformers reads
// beside them), rope_theta defaulting to `default_theta`.
Rope rope_of(const nlohmann::json& p, const nlohmann::json& j, const std::string& file,
             int head_dim, double default_theta) {
  Rope r;
  std::string type = "default";
  for (const char* key : {"rope_type", "type"})
    if (p.contains(key) && p[key].is_string()) type = p[key].get<std::string>();
  r.type = type;
  r.theta = num(p, "rope_theta", num(j, "rope_theta", default_theta));
  if (!(r.theta > 0))
    SPILLWAY_INPUT_ERROR("model config: \"rope_theta\" is {}; must be > 0 (file: {})", r.theta,
                         file);
  const double partial = num(p, "partial_rotary_factor", num(j, "partial_rotary_factor", 1.0));
  if (partial != 1.0)
    SPILLWAY_INPUT_ERROR(
        "model config: \"partial_rotary_factor\" is {}; the decoder rotates whole heads (file: "
        "{})",
        partial, file);
  const int half = head_dim / 2;
  const double dim = head_dim;
  const double base = r.theta;
  std::vector<double>& inv = r.inv_freq;
  inv.resize(static_cast<size_t>(half));
  for (int i = 0; i < half; ++i) inv[static_cast<size_t>(i)] = std::pow(base, -2.0 * i / dim);
  const auto need = [&](const char* key) {
    if (!p.contains(key) || !p[key].is_number())
      SPILLWAY_INPUT_ERROR("model config: rope type \"{}\" needs \"{}\" (file: {})", type, key,
                           file);
    return p[key].get<double>();
  };
  if (type == "default") return r;
  const double max_pos = num(j, "max_position_embeddings", 0.0);
  // transformers: the config's own original_max_position_embeddings first (Phi-3), then the
  // rope parameters', then max_position_embeddings.
  const double original = num(j, "original_max_position_embeddings",
                              num(p, "original_max_position_embeddings", max_pos));
  if (type == "dynamic") {
    // transformers' dynamic NTK: the frequencies of a longer sequence are computed when it
    // comes (Decoder: Note [Dynamic RoPE]); up to max_position_embeddings the default ones.
    r.dynamic_factor = need("factor");
    if (!(r.dynamic_factor >= 1) || !(max_pos >= 1) || max_pos > 1e9)
      SPILLWAY_INPUT_ERROR(
          "model config: dynamic RoPE needs \"factor\" >= 1 (it is {}) and "
          "max_position_embeddings >= 1 (it is {}) (file: {})",
          r.dynamic_factor, max_pos, file);
    r.dynamic_length = static_cast<int>(max_pos);
  } else if (type == "linear") {
    const double factor = need("factor");
    for (double& f : inv) f /= factor;
  } else if (type == "llama3") {
    const double factor = need("factor");
    const double low = need("low_freq_factor");
    const double high = need("high_freq_factor");
    const double old_context = need("original_max_position_embeddings");
    const double low_wavelen = old_context / low;
    const double high_wavelen = old_context / high;
    for (double& f : inv) {
      const double wavelen = 2 * std::numbers::pi / f;
      const double scaled = wavelen > low_wavelen ? f / factor : f;
      const double smooth = (old_context / wavelen - low) / (high - low);
      const bool medium = !(wavelen < high_wavelen) && !(wavelen > low_wavelen);
      f = medium ? (1 - smooth) * scaled / factor + smooth * scaled : scaled;
    }
  } else if (type == "yarn") {
    if (!(original > 0))
      SPILLWAY_INPUT_ERROR(
          "model config: rope type \"yarn\" needs original_max_position_embeddings or "
          "max_position_embeddings (file: {})",
          file);
    const double factor = p.contains("factor") && p["factor"].is_number()
                              ? p["factor"].get<double>()
                              : max_pos / original;
    const auto mscale_of = [](double scale, double m) {
      return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0;
    };
    const double mscale = num(p, "mscale", 0.0);
    const double mscale_all = num(p, "mscale_all_dim", 0.0);
    r.attention_factor = p.contains("attention_factor") && p["attention_factor"].is_number()
                             ? p["attention_factor"].get<double>()
                             : (mscale != 0 && mscale_all != 0
                                    ? mscale_of(factor, mscale) / mscale_of(factor, mscale_all)
                                    : mscale_of(factor, 1.0));
    // transformers: `beta_fast or 32`, `beta_slow or 1` (an absent, null or 0 value).
    const double fast = num(p, "beta_fast", 0.0) != 0 ? num(p, "beta_fast", 0.0) : 32.0;
    const double slow = num(p, "beta_slow", 0.0) != 0 ? num(p, "beta_slow", 0.0) : 1.0;
    const bool truncate =
        !p.contains("truncate") || !p["truncate"].is_boolean() || p["truncate"].get<bool>();
    const auto correction_dim = [&](double rotations) {
      return dim * std::log(original / (rotations * 2 * std::numbers::pi)) / (2 * std::log(base));
    };
    double lo = correction_dim(fast);
    double hi = correction_dim(slow);
    if (truncate) {
      lo = std::floor(lo);
      hi = std::ceil(hi);
    }
    lo = std::max(lo, 0.0);
    hi = std::min(hi, dim - 1);
    if (lo == hi) hi += 0.001;
    for (int i = 0; i < half; ++i) {
      const double ramp = std::clamp((i - lo) / (hi - lo), 0.0, 1.0);
      const double extrapolation = 1 - ramp;
      double& f = inv[static_cast<size_t>(i)];
      f = f / factor * (1 - extrapolation) + f * extrapolation;
    }
  } else {
    SPILLWAY_INPUT_ERROR(
        "model config: rope type \"{}\" is not served (the decoder computes default, linear, "
        "llama3, yarn and dynamic RoPE) (file: {})",
        type, file);
  }
  return r;
}

}  // namespace

void read_rope(const nlohmann::json& j, const std::string& file, RefConfig& c) {
  const auto params_at = [&]() -> nlohmann::json {
    for (const char* key : {"rope_parameters", "rope_scaling"}) {
      const auto it = j.find(key);
      if (it != j.end() && it->is_object()) return *it;
    }
    return nlohmann::json::object();
  };
  const nlohmann::json p = params_at();
  bool per_type = false;
  for (const auto& [key, value] : p.items()) {
    if (!value.is_object()) continue;
    per_type = true;
    if (key != "full_attention" && key != "sliding_attention")
      SPILLWAY_INPUT_ERROR(
          "model config: \"rope_parameters\" has RoPE parameters for layer type \"{}\"; the "
          "decoder knows full_attention and sliding_attention (file: {})",
          key, file);
  }
  // Gemma 3: a global RoPE (rope_theta, default 1,000,000, scaled by rope_scaling) and a
  // local one for the sliding layers (rope_local_base_freq, default 10,000), per layer type
  // in rope_parameters (transformers 5) or beside it.
  const bool gemma3 = c.model.model_type == "gemma3_text";
  const double global_theta = gemma3 ? 1e6 : 10000.0;
  const nlohmann::json none = nlohmann::json::object();
  nlohmann::json beside = j;  // the per-type parameters carry their own rope_theta
  beside.erase("rope_theta");
  Rope global, local;
  bool has_local = false;
  if (per_type) {
    global = rope_of(p.contains("full_attention") ? p["full_attention"] : none, beside, file,
                     c.head_dim, global_theta);
    if (p.contains("sliding_attention")) {
      local = rope_of(p["sliding_attention"], beside, file, c.head_dim, 10000.0);
      has_local = true;
    }
  } else {
    global = rope_of(p, j, file, c.head_dim, global_theta);
    if (gemma3) {
      nlohmann::json lp = nlohmann::json::object();
      lp["rope_theta"] = num(j, "rope_local_base_freq", 10000.0);
      local = rope_of(lp, beside, file, c.head_dim, 10000.0);
      has_local = true;
    }
  }
  if (has_local && local.dynamic_factor > 0)
    SPILLWAY_INPUT_ERROR(
        "model config: the sliding layers' RoPE is dynamic; the decoder runs dynamic RoPE in "
        "every layer or none (file: {})",
        file);
  if (has_local && global.dynamic_factor > 0 && local.inv_freq != global.inv_freq)
    SPILLWAY_INPUT_ERROR(
        "model config: dynamic RoPE with another RoPE in the sliding layers is not served "
        "(file: {})",
        file);
  c.rope_type = global.type;
  c.rope_theta = global.theta;
  c.rope_inv_freq = global.inv_freq;
  c.rope_attention_factor = global.attention_factor;
  c.rope_dynamic_factor = global.dynamic_factor;
  c.rope_dynamic_length = global.dynamic_length;
  c.rope_local_inv_freq.clear();
  c.rope_local_attention_factor = 1.0;
  if (has_local &&
      (local.inv_freq != global.inv_freq || local.attention_factor != global.attention_factor)) {
    c.rope_local_inv_freq = local.inv_freq;
    c.rope_local_attention_factor = local.attention_factor;
  }
}

}  // namespace spillway::nn
