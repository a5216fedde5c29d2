// The model/hardware/workload/calibration flags shared by every command that plans
// (plan today; simulate and train reuse them), and their translation to a PlanRequest.
#pragma once

#include <CLI/CLI.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "spillway/core/error.hpp"
#include "spillway/plan/plan.hpp"

namespace spillway::cli {

struct PlanFlags {
  std::string model = "Qwen3-30B-A3B";
  std::string hardware = "gh200";
  int64_t micro_batch = 1;
  int64_t seq_len = 4096;
  std::string dtype = "bf16";
  int64_t tp = 1, ep = 1, cp = 1, pp = 1, dp = 1;
  int64_t grad_accum = 1;
  bool fused_swiglu = false;
  bool mtp = false;
  std::string strategy = "auto";
  std::string margin = "10%";
  std::optional<double> layer_fwd_ms;
  std::string profile;
  std::optional<double> hbm_budget_gb;
  std::optional<double> d2h_gbps;
  std::optional<double> h2d_gbps;
  std::optional<double> gemm_eff;  // unset: the hardware profile's curves
  std::optional<double> attention_eff;
  std::optional<double> hbm_eff;
  int keep_last = 1;
  int prefetch_depth = 1;
  int zero = 1;
  bool fsdp = false;
  std::string optimizer = "device";
  bool grad_offload = false;
  int64_t loss_chunk = 0;
  std::vector<std::string> offload_tensors;  // Note [Named offload tensors]
};

void add_plan_flags(CLI::App& cmd, PlanFlags& f);
// Loads the model, the hardware profile and the calibration; validates every value.
PlanRequest make_request(const PlanFlags& f);
// Note [Flags beside a plan file]: a command given a plan file (simulate --plan) takes the
// model, the workload and the options from the plan; a plan flag given beside it must
// agree with the plan's value (an equal one is fine), else it would be silently ignored.
// A flag the plan does not record (calibration) is refused. With --model, the plan is
// also checked against that model (check_plan_matches). Throws spillway::Error naming the
// flag and both values.
void refuse_flags_beside_plan(const CLI::App& cmd, const PlanFlags& f, const Plan& plan,
                              const PlanRequest& planned, const std::string& plan_path);
// "10%" -> 0.10, "0.1" -> 0.10; anything else is an error naming --margin.
double parse_margin(const std::string& text);

// The flag that sets a library field ("micro_batch" -> "--micro-batch"), or "" when no flag
// sets it in the same unit. See Note [Field names and flags] in plan_flags.cpp.
std::string_view flag_of_field(std::string_view field);
// `text` with every whole-word field name that has a flag replaced by the flag.
std::string with_flags(std::string_view text);
// An InputError as the CLI user reads it: "--micro-batch is 0; must be >= 1".
std::string message_with_flags(const InputError& e);

}  // namespace spillway::cli
