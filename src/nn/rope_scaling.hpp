// Note [RoPE scaling] (rope_scaling.cpp): a config's RoPE, read into a RefConfig.
#pragma once

#include <nlohmann/json_fwd.hpp>
#include <string>

#include "spillway/nn/nn.hpp"

namespace spillway::nn {

// Sets c.rope_type, c.rope_theta, c.rope_inv_freq and c.rope_attention_factor from config
// `j` (c.head_dim already set); an unserved type is an error naming it and `file`.
void read_rope(const nlohmann::json& j, const std::string& file, RefConfig& c);

}  // namespace spillway::nn
