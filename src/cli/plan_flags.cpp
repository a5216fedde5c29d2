// Shared planning flags -> PlanRequest.
#include "cli/plan_flags.hpp"

#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "spillway/core/error.hpp"
#include "tool/ranges.hpp"

namespace spillway::cli {

using namespace spillway::tool;  // NOLINT(google-build-using-namespace): the tools' ranges

namespace {

// Note [Field names and flags]: the library names bad input by the C++ field of its
// request or options struct (spillway::InputError: "micro_batch is 0; must be >= 1"), a
// library caller having no flags; the CLI user reads the flag that sets the field. This
// is the one table between the two. A field whose flag is in another unit has no row
// (inflight_bound_bytes: --inflight-bound-mb; device_bytes: --device-memory-mb), so the
// message keeps the field and the value stays true.
struct FieldFlag {
  std::string_view field;
  std::string_view flag;
};
constexpr FieldFlag kFieldFlags[] = {
    // PlanRequest, its Workload and ShardShape
    {"micro_batch", "--micro-batch"},
    {"seq_len", "--seq-len"},
    {"dtype", "--dtype"},
    {"tp", "--tp"},
    {"ep", "--ep"},
    {"cp", "--cp"},
    {"pp", "--pp"},
    {"dp", "--dp"},
    {"grad_accum", "--grad-accum"},
    {"strategy", "--policy"},
    {"zero", "--zero"},
    {"optimizer_offload", "--optimizer offload"},
    {"grad_offload", "--grad-offload"},
    {"loss_chunk", "--loss-chunk"},
    {"offload_tensors", "--offload-tensors"},
    {"margin", "--margin"},
    {"layer_fwd_ms", "--layer-fwd-ms"},
    {"profile", "--profile"},
    {"hbm_budget_gb", "--hbm-budget-gb"},
    {"d2h_gbps", "--d2h-gbps"},
    {"h2d_gbps", "--h2d-gbps"},
    {"efficiency.gemm", "--gemm-efficiency"},
    {"efficiency.attention", "--attention-efficiency"},
    {"efficiency.hbm", "--hbm-efficiency"},
    {"keep_last_layers", "--keep-last"},
    {"prefetch_depth", "--prefetch-depth"},
    // plan_optimizer_split
    {"cpu_adam_gbps", "--cpu-adam-gbps"},
    {"explain", "--explain"},
    // SimOptions, StreamOptions
    {"gpus", "--gpus"},
    {"gpus_per_link", "--gpus-per-link"},
    {"depth", "--prefetch-depth"},
    // ProbeOptions
    {"sizes", "--sizes"},
    {"repeats", "--repeats"},
    {"seconds_budget", "--budget-s"},
    // OptimOffloadOptions
    {"device_buckets", "--device-buckets"},
    // train::TrainOptions (the rest share the names above)
    {"steps", "--steps"},
    {"device_memory_mb", "--device-memory-mb"},
    {"keep_last", "--keep-last"},
    {"link_schedule", "--link-schedule"},
    {"lr", "--lr"},
    {"clip", "--clip"},
    {"undo_mb", "--undo-mb"},
};
// Fields whose names are also common words ("device", "optimizer"): mapped to their flag
// only as the subject of a message, never inside a rule's text.
constexpr FieldFlag kSubjectFlags[] = {
    {"device", "--device"},
    {"optimizer", "--optimizer"},
};

// A character that continues a name on its left (so "--tp" or "x.tp" is no field "tp").
bool joins_left(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '_' || c == '-' || c == '.';
}
// A character that continues a name on its right ("seq_len." ends at the full stop).
bool joins_right(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '_' || c == '-';
}

// A link flag as the request takes it: 0 (not throttled) is the profile's figure, as unset.
std::optional<double> throttle(const std::optional<double>& gbps) {
  return gbps && *gbps > 0 ? gbps : std::nullopt;
}

}  // namespace

std::string_view flag_of_field(std::string_view field) {
  for (const FieldFlag& f : kFieldFlags) {
    if (f.field == field) return f.flag;
  }
  for (const FieldFlag& f : kSubjectFlags) {
    if (f.field == field) return f.flag;
  }
  return {};
}

std::string with_flags(std::string_view text) {
  std::string out;
  size_t i = 0;
  while (i < text.size()) {
    const FieldFlag* match = nullptr;
    if (i == 0 || !joins_left(text[i - 1])) {
      for (const FieldFlag& f : kFieldFlags) {
        const size_t end = i + f.field.size();
        if (text.substr(i, f.field.size()) == f.field &&
            (end == text.size() || !joins_right(text[end])) &&
            (match == nullptr || f.field.size() > match->field.size())) {
          match = &f;
        }
      }
    }
    if (match != nullptr) {
      out += match->flag;
      i += match->field.size();
    } else {
      out += text[i++];
    }
  }
  return out;
}

std::string message_with_flags(const InputError& e) {
  const std::string_view flag = flag_of_field(e.field());
  return fmt::format("{} is {}; {}", flag.empty() ? std::string_view(e.field()) : flag, e.value(),
                     with_flags(e.rule()));
}

void add_plan_flags(CLI::App& cmd, PlanFlags& f) {
  using L = PlanLimits;
  const auto size = [&](const char* name, int64_t& v, const std::string& what, int64_t hi) {
    in_range(cmd.add_option(name, v, what)->capture_default_str()->group("Workload"),
             closed(1, static_cast<double>(hi)));
  };
  cmd.add_option("--model", f.model,
                 "Catalog name (see `spillway models`) or path to a Hugging Face config.json")
      ->capture_default_str()
      ->group("Model and hardware");
  cmd.add_option("--hardware", f.hardware,
                 "Catalog profile (see `spillway hardware`) or path to a profile JSON")
      ->capture_default_str()
      ->group("Model and hardware");
  size("--micro-batch", f.micro_batch, "Sequences per micro-batch", L::kMaxMicroBatch);
  size("--seq-len", f.seq_len, "Tokens per sequence", L::kMaxSeqLen);
  cmd.add_option("--dtype", f.dtype, "Activation dtype: bf16, fp16, fp8, fp32")
      ->capture_default_str()
      ->group("Workload");
  size("--tp", f.tp, "Tensor-parallel size (with sequence parallelism)", L::kMaxGroup);
  size("--ep", f.ep, "Expert-parallel size", L::kMaxGroup);
  size("--cp", f.cp, "Context-parallel size (splits the sequence)", L::kMaxGroup);
  size("--pp", f.pp, "Pipeline-parallel size (the first 1F1B stage is planned)", L::kMaxGroup);
  size("--dp", f.dp, "Data-parallel size (shards the optimizer states)", L::kMaxGroup);
  size("--grad-accum", f.grad_accum, "Micro-batches per optimizer step", L::kMaxGroup);
  cmd.add_flag("--fused-swiglu", f.fused_swiglu,
               "SwiGLU backward recomputes silu(g)*u in-kernel: only gate and up outputs are saved")
      ->group("Workload");
  cmd.add_flag("--mtp", f.mtp,
               "Plan the model's multi-token-prediction layers too (DeepSeek-V3, GLM-4.5, Qwen3.5: "
               "num_nextn_predict_layers), each after the last layer; without it they are "
               "counted apart and left out, as published parameter counts leave them out")
      ->group("Workload");
  CLI::Option* policy =
      cmd.add_option("--policy", f.strategy,
                     "auto (fastest feasible mix, layer by layer), keep, recompute, offload, "
                     "selective, hybrid, checkpoint (full-layer: only the layer input kept) "
                     "(applied to every layer, then judged); as for `spillway "
                     "train --policy`")
          ->capture_default_str()
          ->group("Policy");
  // The old spelling (the plan JSON's field is still "strategy"): accepted, said once.
  cmd.add_option("--strategy", f.strategy, "The old spelling of --policy (says so when used)")
      ->group("Deprecated")
      ->excludes(policy)
      ->each([](const std::string& v) {
        std::fprintf(stderr, "spillway: --strategy is deprecated; write --policy %s\n", v.c_str());
      });
  in_range(cmd.add_option("--zero", f.zero,
                          "ZeRO stage over the --dp group: 0 nothing sharded, 1 the optimizer "
                          "states (12 bytes per parameter), 2 also the gradients, 3 also the "
                          "weights (gathered layer by layer: 2 layers of buffers)")
               ->capture_default_str()
               ->group("Training state"),
           closed(0, 3));
  cmd.add_flag("--fsdp", f.fsdp, "Fully sharded data parallel: the same as --zero 3")
      ->group("Training state");
  cmd.add_option("--optimizer", f.optimizer,
                 "device: AdamW on the GPU after backward; offload: fp32 master weights and "
                 "moments in host memory, the CPU AdamW per layer during backward (STV, the "
                 "GPU/CPU split), as `spillway train --optimizer offload`")
      ->capture_default_str()
      ->check(CLI::IsMember({"device", "offload"}))
      ->group("Training state");
  cmd.add_flag("--grad-offload", f.grad_offload,
               "With --optimizer offload: gradient buckets stream to the host as they become "
               "final, so no full gradient stays in HBM")
      ->group("Training state");
  in_range(cmd.add_option("--loss-chunk", f.loss_chunk,
                          "Tokens per loss chunk: the fp32 logits of one chunk at a time, "
                          "recomputed in backward (0: the planner's choice, unchunked when the "
                          "logits take at most 2% of the budget)")
               ->capture_default_str()
               ->group("Training state"),
           closed(0, static_cast<double>(L::kMaxLossChunk)));
  cmd.add_option("--offload-tensors", f.offload_tensors,
                 "State the experiment: exactly these saved tensors are offloaded in every layer "
                 "that offloads (names of docs/plan-schema.md, comma-separated, or groups: attn, "
                 "mlp = mlp.gate_out,mlp.up_out,mlp.act, moe, ssm, lin, rec); the rest follows "
                 "--policy: keep keeps it, recompute and offload recompute it by the block "
                 "policy, auto chooses per layer. Unknown names are refused with the model's")
      ->delimiter(',')
      ->group("Policy");
  cmd.add_option("--margin", f.margin,
                 "Headroom a copy must leave in its window: '10%' or 0.1 (copies share HBM "
                 "bandwidth with kernels) [0%, 1000%]")
      ->capture_default_str()
      ->group("Policy");
  in_range(cmd.add_option("--hbm-budget-gb", f.hbm_budget_gb,
                          "HBM the plan may use in GB (1e9 bytes; default: the profile's HBM "
                          "minus 5% reserve)")
               ->group("Policy"),
           closed(L::kMinBudgetGb, L::kMaxBudgetGb));
  in_range(cmd.add_option("--keep-last", f.keep_last, "Layers at the end that never offload")
               ->capture_default_str()
               ->group("Policy"),
           up_to(1, "the model's layers"));
  in_range(cmd.add_option("--prefetch-depth", f.prefetch_depth,
                          "Backward reloads issued this many layers ahead")
               ->capture_default_str()
               ->group("Policy"),
           closed(1, L::kMaxPrefetchDepth));
  // One meaning per flag: 0 is the link unthrottled, at its own speed, for every command
  // with the flag (here the profile's figure; spillway train and bench: memcpy speed).
  in_range(cmd.add_option("--d2h-gbps", f.d2h_gbps,
                          "Device->host GB/s per GPU (1e9 bytes/s; default or 0: not throttled, "
                          "the link's own speed: the profile's typical measured figure, shared "
                          "by the GPUs on one link; never the nominal peak)")
               ->group("Link"),
           closed_or(L::kMinGbps, L::kMaxGbps, 0));
  in_range(cmd.add_option("--h2d-gbps", f.h2d_gbps,
                          "Host->device GB/s per GPU (default or 0: as --d2h-gbps)")
               ->group("Link"),
           closed_or(L::kMinGbps, L::kMaxGbps, 0));
  auto* fwd = in_range(cmd.add_option("--layer-fwd-ms", f.layer_fwd_ms,
                                      "Calibration: measured forward time of the repeating "
                                      "layer; all modelled times are scaled to it")
                           ->group("Calibration"),
                       closed(L::kMinLayerMs, L::kMaxLayerMs));
  cmd.add_option("--profile", f.profile,
                 "Calibration: JSON with measured per-layer times "
                 "{\"layers\": [{\"index\", \"fwd_ms\", \"bwd_ms\"}]} and/or measured kernels "
                 "{\"ops\": [...]} (spillway bench gemm --json) merged into the efficiency curves")
      ->excludes(fwd)
      ->group("Calibration");
  in_range(cmd.add_option("--gemm-efficiency", f.gemm_eff,
                          "Fraction of dense peak reached by GEMMs, a constant for every shape "
                          "(default: the hardware profile's curves)")
               ->group("Calibration"),
           open_closed(0, 1));
  in_range(cmd.add_option("--attention-efficiency", f.attention_eff,
                          "Fraction of dense peak reached by fused attention, a constant "
                          "(default: the hardware profile's curve)")
               ->group("Calibration"),
           open_closed(0, 1));
  in_range(cmd.add_option("--hbm-efficiency", f.hbm_eff,
                          "Fraction of HBM bandwidth reached by memory-bound kernels "
                          "(default: the hardware profile's, 0.80 in the catalog)")
               ->group("Calibration"),
           open_closed(0, 1));
}

double parse_margin(const std::string& text) {
  std::string s = text;
  bool percent = false;
  if (!s.empty() && s.back() == '%') {
    percent = true;
    s.pop_back();
  }
  size_t used = 0;
  double v = 0.0;
  try {
    v = std::stod(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != s.size() || !std::isfinite(v)) {
    SPILLWAY_INPUT_ERROR("--margin is '{}'; write a percentage like 10% or a fraction like 0.1",
                         text);
  }
  if (percent) v /= 100.0;
  if (!percent && v > 1.0) {
    SPILLWAY_INPUT_ERROR("--margin is '{}'; a fraction above 1 is ambiguous: write {}% or {}", text,
                         text, v / 100.0);
  }
  if (v < 0.0 || v > 10.0) {
    SPILLWAY_INPUT_ERROR("--margin is '{}'; must be between 0% and 1000%", text);
  }
  return v;
}

PlanRequest make_request(const PlanFlags& f) {
  PlanRequest r;
  r.work.shape.micro_batch = f.micro_batch;
  r.work.shape.seq_len = f.seq_len;
  r.work.shape.dtype = parse_dtype(f.dtype);
  r.work.shape.tp = f.tp;
  r.work.shape.ep = f.ep;
  r.work.shape.cp = f.cp;
  r.work.shape.fused_swiglu = f.fused_swiglu;
  r.work.pp = f.pp;
  r.work.dp = f.dp;
  r.work.grad_accum = f.grad_accum;
  r.strategy = parse_policy(f.strategy);
  r.margin = parse_margin(f.margin);
  r.layer_fwd_ms = f.layer_fwd_ms;
  r.hbm_budget_gb = f.hbm_budget_gb;
  r.d2h_gbps = throttle(f.d2h_gbps);
  r.h2d_gbps = throttle(f.h2d_gbps);
  if (f.gemm_eff) r.efficiency.gemm = *f.gemm_eff;
  if (f.attention_eff) r.efficiency.attention = *f.attention_eff;
  if (f.hbm_eff) r.efficiency.hbm = *f.hbm_eff;
  r.keep_last_layers = f.keep_last;
  r.prefetch_depth = f.prefetch_depth;
  if (f.fsdp && f.zero != 1 && f.zero != 3)
    SPILLWAY_INPUT_ERROR("--fsdp is --zero 3; --zero {} contradicts it", f.zero);
  r.zero = f.fsdp ? 3 : f.zero;
  r.optimizer_offload = f.optimizer == "offload";
  r.grad_offload = f.grad_offload;
  r.loss_chunk = f.loss_chunk;
  r.offload_tensors = f.offload_tensors;
  r.model = load_model(f.model);
  if (f.mtp) r.model = with_mtp_layers(std::move(r.model));
  r.hardware = load_hardware(f.hardware);
  if (!f.profile.empty()) {
    r.profile = load_profile(f.profile);
    r.efficiency.measured = load_profile_ops(f.profile);
  }
  return r;
}

void refuse_flags_beside_plan(const CLI::App& cmd, const PlanFlags& f, const Plan& plan,
                              const PlanRequest& planned, const std::string& plan_path) {
  const auto given = [&](const char* flag) { return cmd.count(flag) > 0; };
  const auto agree = [&](const char* flag, std::string_view field, const auto& value,
                         const auto& in_plan) {
    if (given(flag) && !(value == in_plan)) {
      SPILLWAY_INPUT_ERROR(
          "{} is {}; the plan {} was made for {} {} (drop {} or plan again with it)", flag, value,
          plan_path, field, in_plan, flag);
    }
  };
  for (const char* flag : {"--layer-fwd-ms", "--profile", "--gemm-efficiency",
                           "--attention-efficiency", "--hbm-efficiency"}) {
    if (given(flag)) {
      SPILLWAY_INPUT_ERROR(
          "{} has no effect with --plan {}: the plan's times are already calibrated (plan again "
          "with {})",
          flag, plan_path, flag);
    }
  }
  const ShardShape& s = planned.work.shape;
  agree("--micro-batch", "micro_batch", f.micro_batch, s.micro_batch);
  agree("--seq-len", "seq_len", f.seq_len, s.seq_len);
  if (given("--dtype"))
    agree("--dtype", "dtype", to_string(parse_dtype(f.dtype)), to_string(s.dtype));
  agree("--tp", "tp", f.tp, s.tp);
  agree("--ep", "ep", f.ep, s.ep);
  agree("--cp", "cp", f.cp, s.cp);
  agree("--pp", "pp", f.pp, planned.work.pp);
  agree("--dp", "dp", f.dp, planned.work.dp);
  agree("--grad-accum", "grad_accum", f.grad_accum, planned.work.grad_accum);
  agree("--fused-swiglu", "fused_swiglu", f.fused_swiglu, s.fused_swiglu);
  for (const char* flag : {"--policy", "--strategy"}) {
    if (given(flag))
      agree(flag, "strategy", to_string(parse_policy(f.strategy)), to_string(planned.strategy));
  }
  if (given("--margin")) {
    const double m = parse_margin(f.margin);
    if (std::abs(m - planned.margin) > 1e-12) {
      agree("--margin", "margin", f.margin, fmt::format("{}", planned.margin));
    }
  }
  agree("--keep-last", "keep_last_layers", f.keep_last, planned.keep_last_layers);
  agree("--zero", "zero", f.zero, planned.zero);
  if (given("--fsdp")) agree("--fsdp", "zero", 3, planned.zero);
  if (given("--optimizer"))
    agree("--optimizer", "optimizer", f.optimizer,
          std::string(planned.optimizer_offload ? "offload" : "device"));
  agree("--grad-offload", "grad_offload", f.grad_offload, planned.grad_offload);
  agree("--loss-chunk", "loss_chunk", f.loss_chunk, planned.loss_chunk);
  agree("--prefetch-depth", "prefetch_depth", f.prefetch_depth, planned.prefetch_depth);
  if (given("--offload-tensors")) {
    // The given names, groups expanded over the tensors the plan's layers save.
    std::vector<std::string> named;
    for (const LayerPlan& l : plan.layers) {
      for (const TensorPlan& t : l.tensors) {
        const bool hit = std::any_of(
            f.offload_tensors.begin(), f.offload_tensors.end(),
            [&](const std::string& n) { return n == t.name || in_offload_group(n, t.name); });
        if (hit && std::find(named.begin(), named.end(), t.name) == named.end())
          named.push_back(t.name);
      }
    }
    std::sort(named.begin(), named.end());
    std::vector<std::string> in_plan = planned.offload_tensors;
    std::sort(in_plan.begin(), in_plan.end());
    agree("--offload-tensors", "offload_tensors", fmt::format("{}", fmt::join(named, ",")),
          in_plan.empty() ? std::string("the planner's choice")
                          : fmt::format("{}", fmt::join(in_plan, ",")));
  }
  if (throttle(f.d2h_gbps)) agree("--d2h-gbps", "d2h_gbps", *f.d2h_gbps, plan.summary.d2h_gbps);
  if (throttle(f.h2d_gbps)) agree("--h2d-gbps", "h2d_gbps", *f.h2d_gbps, plan.summary.h2d_gbps);
  if (f.hbm_budget_gb &&
      std::llabs(std::llround(*f.hbm_budget_gb * 1e9) - plan.summary.hbm_budget_bytes) > 1) {
    agree("--hbm-budget-gb", "hbm_budget_gb", *f.hbm_budget_gb,
          static_cast<double>(plan.summary.hbm_budget_bytes) / 1e9);
  }
  if (given("--hardware")) {
    agree("--hardware", "hardware", load_hardware(f.hardware).name, planned.hardware.name);
  }
  if (given("--model")) {
    PlanRequest used = planned;
    used.model = load_model(f.model);
    if (f.mtp) used.model = with_mtp_layers(std::move(used.model));
    agree("--model", "model", used.model.name, planned.model.name);
    check_plan_matches(plan, planned, used, plan_path);
  }
}

}  // namespace spillway::cli
