// Note [RoPE scaling]: RoPE's inverse frequencies as transformers computes them for the
// rope types the decoder serves (modeling_rope_utils: default, linear, llama3, yarn), read
// from `rope_parameters` (transformers 5: rope_theta inside) or `rope_scaling` (transformers
// 4: rope_theta beside it). Types whose frequencies change with the sequence (dynamic,
// longrope) or that rotate part of a head (partial_rotary_factor) are refused by name.
#include "nn/rope_scaling.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <numbers>

#include "spillway/error.hpp"

namespace spillway::nn {

namespace {

double num(const nlohmann::json& o, const char* key, double fallback) {
  const auto it = o.find(key);
  return it != o.end() && it->is_number() ? it->get<double>() : fallback;
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
  for (const auto& [key, value] : p.items()) {
    if (value.is_object())
      SPILLWAY_INPUT_ERROR(
          "model config: \"rope_parameters\" has RoPE parameters per layer type (\"{}\"); the "
          "decoder runs one RoPE in every layer (file: {})",
          key, file);
  }
  std::string type = "default";
  for (const char* key : {"rope_type", "type"})
    if (p.contains(key) && p[key].is_string()) type = p[key].get<std::string>();
  c.rope_type = type;
  c.rope_theta = num(p, "rope_theta", num(j, "rope_theta", 10000.0));
  if (!(c.rope_theta > 0))
    SPILLWAY_INPUT_ERROR("model config: \"rope_theta\" is {}; must be > 0 (file: {})", c.rope_theta,
                         file);
  const double partial = num(p, "partial_rotary_factor", num(j, "partial_rotary_factor", 1.0));
  if (partial != 1.0)
    SPILLWAY_INPUT_ERROR(
        "model config: \"partial_rotary_factor\" is {}; the decoder rotates whole heads (file: "
        "{})",
        partial, file);
  const int half = c.head_dim / 2;
  const double dim = c.head_dim;
  const double base = c.rope_theta;
  std::vector<double>& inv = c.rope_inv_freq;
  inv.resize(static_cast<size_t>(half));
  for (int i = 0; i < half; ++i) inv[static_cast<size_t>(i)] = std::pow(base, -2.0 * i / dim);
  c.rope_attention_factor = 1.0;
  const auto need = [&](const char* key) {
    if (!p.contains(key) || !p[key].is_number())
      SPILLWAY_INPUT_ERROR("model config: rope type \"{}\" needs \"{}\" (file: {})", type, key,
                           file);
    return p[key].get<double>();
  };
  if (type == "default") return;
  const double max_pos = num(j, "max_position_embeddings", 0.0);
  // transformers: the config's own original_max_position_embeddings first (Phi-3), then the
  // rope parameters', then max_position_embeddings.
  const double original = num(j, "original_max_position_embeddings",
                              num(p, "original_max_position_embeddings", max_pos));
  if (type == "linear") {
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
    c.rope_attention_factor = p.contains("attention_factor") && p["attention_factor"].is_number()
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
        "llama3 and yarn RoPE; dynamic and longrope change their frequencies with the "
        "sequence) (file: {})",
        type, file);
  }
}

}  // namespace spillway::nn
