// spillway.plan(): the planner from Python, the plan in the CLI's JSON schema
// (spillway.plan/1, docs/plan-schema.md). The keyword names are the library's field names
// (PlanRequest), the values the CLI flags' values.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <string>
#include <vector>

#include "bindings.hpp"
#include "spillway/catalog/hardware.hpp"
#include "spillway/catalog/inventory.hpp"
#include "spillway/catalog/model.hpp"
#include "spillway/core/error.hpp"
#include "spillway/plan/plan.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace spillway::python {
namespace {

std::string plan_json(const std::string& model, const std::string& hardware, int64_t micro_batch,
                      int64_t seq_len, const std::string& dtype, int64_t tp, int64_t ep, int64_t cp,
                      int64_t pp, int64_t dp, int64_t grad_accum, bool fused_swiglu, bool mtp,
                      const std::string& policy, double margin, std::optional<double> layer_fwd_ms,
                      const std::string& profile, std::optional<double> hbm_budget_gb,
                      std::optional<double> d2h_gbps, std::optional<double> h2d_gbps, int keep_last,
                      int prefetch_depth, int zero, const std::string& optimizer, bool grad_offload,
                      int64_t loss_chunk, std::optional<double> cpu_adam_gbps,
                      const std::vector<std::string>& offload_tensors,
                      const std::vector<std::vector<std::pair<std::string, int64_t>>>& saved) {
  PlanRequest r;
  r.work.shape.micro_batch = micro_batch;
  r.work.shape.seq_len = seq_len;
  r.work.shape.dtype = parse_dtype(dtype);
  r.work.shape.tp = tp;
  r.work.shape.ep = ep;
  r.work.shape.cp = cp;
  r.work.shape.fused_swiglu = fused_swiglu;
  r.work.pp = pp;
  r.work.dp = dp;
  r.work.grad_accum = grad_accum;
  r.strategy = parse_policy(policy, "policy");
  if (!(margin >= 0.0 && margin <= 10.0))
    SPILLWAY_FIELD_ERROR("margin", margin, "must be in [0, 10]");
  r.margin = margin;
  r.layer_fwd_ms = layer_fwd_ms;
  r.hbm_budget_gb = hbm_budget_gb;
  r.d2h_gbps = d2h_gbps;
  r.h2d_gbps = h2d_gbps;
  r.keep_last_layers = keep_last;
  r.prefetch_depth = prefetch_depth;
  r.zero = zero;
  if (optimizer != "device" && optimizer != "offload")
    SPILLWAY_FIELD_ERROR("optimizer", "'" + optimizer + "'", "must be 'device' or 'offload'");
  r.optimizer_offload = optimizer == "offload";
  r.grad_offload = grad_offload;
  r.loss_chunk = loss_chunk;
  r.cpu_adam_gbps = cpu_adam_gbps;
  r.offload_tensors = offload_tensors;
  for (const auto& layer : saved) {  // Note [A model as PyTorch runs it]
    std::vector<SavedTensorBytes>& out = r.saved_as_run.emplace_back();
    for (const auto& [name, bytes] : layer) out.push_back({name, bytes});
  }
  r.model = load_model(model);
  if (mtp) r.model = with_mtp_layers(std::move(r.model));
  r.hardware = load_hardware(hardware);
  if (!profile.empty()) {
    r.profile = load_profile(profile);
    r.efficiency.measured = load_profile_ops(profile);
  }
  const Plan plan = make_plan(r);
  return plan_to_json(plan, r);
}

}  // namespace

void bind_plan(nb::module_& m) {
  m.def("plan_json", &plan_json, "model"_a, "hardware"_a, "micro_batch"_a, "seq_len"_a, "dtype"_a,
        "tp"_a, "ep"_a, "cp"_a, "pp"_a, "dp"_a, "grad_accum"_a, "fused_swiglu"_a, "mtp"_a,
        "policy"_a, "margin"_a, "layer_fwd_ms"_a.none(), "profile"_a, "hbm_budget_gb"_a.none(),
        "d2h_gbps"_a.none(), "h2d_gbps"_a.none(), "keep_last"_a, "prefetch_depth"_a, "zero"_a,
        "optimizer"_a, "grad_offload"_a, "loss_chunk"_a, "cpu_adam_gbps"_a.none(),
        "offload_tensors"_a, "saved"_a,
        "The plan as JSON (schema spillway.plan/1); spillway.plan() is the Python face.");
  m.def("offload_tensor_groups", &offload_tensor_groups,
        "The group names --offload-tensors takes (Note [Named offload tensors]).");
  m.def("in_offload_group", &in_offload_group, "group"_a, "tensor"_a,
        "Whether the saved tensor `tensor` is a member of the group `group`.");
}

}  // namespace spillway::python
