// Efficiency curves at plan time: measured kernels (a calibration profile's "ops") merged
// into the hardware profile's curves, and the efficiency of one op's shape (Note
// [Efficiency curves], spillway/catalog/hardware.hpp).
//
// Invariants: every curve handed to the cost model has at least one point, strictly
// increasing abscissae and efficiencies in (0, 1]; a constant the caller gives
// (EfficiencyFactor::given) always wins over a curve and over measured points.
#include <algorithm>
#include <cmath>
#include <map>

#include "core/enum_names.hpp"
#include "core/json_io.hpp"
#include "plan/cost_model.hpp"
#include "spillway/core/error.hpp"
#include "spillway/plan/plan.hpp"

namespace spillway {

constexpr EnumNames<MeasuredKind, 3> kMeasuredKindNames = {
    {{MeasuredKind::kGemm, "gemm"},
     {MeasuredKind::kGroupedGemm, "grouped_gemm"},
     {MeasuredKind::kAttention, "attention"}}};

std::string to_string(MeasuredKind k) {
  return std::string(name_of(kMeasuredKindNames, k));
}

MeasuredKind parse_measured_kind(const std::string& s) {
  if (const std::optional<MeasuredKind> k = value_of(kMeasuredKindNames, s)) return *k;
  SPILLWAY_FIELD_ERROR("kind", fmt::format("\"{}\"", s), "must be gemm, grouped_gemm or attention");
}

double curve_abscissa(MeasuredKind kind, const OpShape& s) {
  switch (kind) {
    case MeasuredKind::kGemm:
      return static_cast<double>(s.min_dim());
    case MeasuredKind::kGroupedGemm:
      return std::min({s.tokens_per_expert, static_cast<double>(s.n), static_cast<double>(s.k)});
    case MeasuredKind::kAttention:
      return s.keys;
  }
  return 0.0;
}

namespace {

double measured_flops(const MeasuredOp& op) {
  if (op.flops > 0.0) return op.flops;
  const OpShape& s = op.shape;
  const double per_gemm = 2.0 * static_cast<double>(s.n) * static_cast<double>(s.k);
  if (op.kind == MeasuredKind::kGroupedGemm)
    return per_gemm * s.tokens_per_expert * static_cast<double>(s.experts);
  return per_gemm * static_cast<double>(s.m);
}

// Replaces the points of `curve` inside [lo, hi] by `points` (sorted, one per abscissa).
void merge_points(EfficiencyCurve& curve, const std::map<double, std::vector<double>>& measured) {
  if (measured.empty()) return;
  const double lo = measured.begin()->first;
  const double hi = measured.rbegin()->first;
  std::vector<std::pair<double, double>> out;
  for (const auto& p : curve.points) {
    if (p.first < lo || p.first > hi) out.push_back(p);
  }
  for (const auto& [x, effs] : measured) {
    double sum = 0.0;
    for (double e : effs) sum += e;
    out.emplace_back(x, sum / static_cast<double>(effs.size()));
  }
  std::sort(out.begin(), out.end());
  curve.points = std::move(out);
}

}  // namespace

EfficiencyCurves effective_curves(const HardwareProfile& hw, const Efficiency& eff) {
  EfficiencyCurves c = hw.efficiency;
  std::map<MeasuredKind, std::map<double, std::vector<double>>> by_kind;
  for (size_t i = 0; i < eff.measured.size(); ++i) {
    const MeasuredOp& op = eff.measured[i];
    const std::string field = fmt::format("efficiency.measured[{}]", i);
    const double x = curve_abscissa(op.kind, op.shape);
    if (!(std::isfinite(x) && x > 0.0)) {
      SPILLWAY_FIELD_ERROR(field + " abscissa", x, "must be > 0 (a {} needs its shape: {})",
                           to_string(op.kind),
                           op.kind == MeasuredKind::kAttention ? "keys" : "m or tokens, n, k");
    }
    double e = op.efficiency;
    if (e <= 0.0) {
      const double flops = measured_flops(op);
      if (!(op.ms > 0.0 && flops > 0.0)) {
        SPILLWAY_FIELD_ERROR(field, fmt::format("ms {} flops {}", op.ms, flops),
                             "needs an efficiency, or ms > 0 and flops > 0");
      }
      e = flops / (op.ms * 1e-3 * peak_tflops(hw, op.dtype) * 1e12);
    }
    if (!(e > 0.0 && e <= 1.0)) {
      SPILLWAY_FIELD_ERROR(field + ".efficiency", e,
                           "must be in (0, 1] of the {} peak of {} ({} TFLOPS); was it measured "
                           "on other hardware?",
                           to_string(op.dtype), hw.name, peak_tflops(hw, op.dtype));
    }
    by_kind[op.kind][x].push_back(e);
  }
  merge_points(c.gemm, by_kind[MeasuredKind::kGemm]);
  merge_points(c.grouped_gemm, by_kind[MeasuredKind::kGroupedGemm]);
  merge_points(c.attention, by_kind[MeasuredKind::kAttention]);
  check_efficiency_curve(c.gemm, "efficiency.gemm");
  check_efficiency_curve(c.grouped_gemm, "efficiency.grouped_gemm");
  check_efficiency_curve(c.attention, "efficiency.attention");
  return c;
}

double hbm_efficiency(const HardwareProfile& hw, const Efficiency& eff) {
  return eff.hbm.given() ? eff.hbm.value() : hw.efficiency.hbm;
}

double compute_efficiency(const OpCost& op, const EfficiencyCurves& curves, const Efficiency& eff) {
  if (op.kind == OpKind::kAttention) {
    if (eff.attention.given()) return eff.attention.value();
    // An op without its shape (a caller's own OpCost) runs at the curve's top.
    return op.shape.keys > 0.0 ? curves.attention.at(op.shape.keys)
                               : curves.attention.points.back().second;
  }
  if (eff.gemm.given()) return eff.gemm.value();
  if (op.shape.grouped()) {
    return curves.grouped_gemm.at(curve_abscissa(MeasuredKind::kGroupedGemm, op.shape));
  }
  if (op.shape.min_dim() > 0) return curves.gemm.at(static_cast<double>(op.shape.min_dim()));
  return curves.gemm.points.back().second;
}

std::vector<MeasuredOp> load_profile_ops(const std::string& path) {
  const Json doc = load_json_file(path, "profile");
  JsonObject root(doc, "profile", path);
  std::vector<MeasuredOp> out;
  constexpr int64_t kMaxDim = int64_t{1} << 40;
  for (const JsonObject& o : root.obj_array("ops")) {
    MeasuredOp op;
    const std::string kind = o.req_str("kind");
    if (kind != "gemm" && kind != "grouped_gemm" && kind != "attention")
      o.fail("kind", fmt::format("is \"{}\"; must be gemm, grouped_gemm or attention", kind));
    op.kind = parse_measured_kind(kind);
    if (op.kind == MeasuredKind::kAttention) {
      op.shape.keys = o.req_num("keys", 1e-3, 1e12);
    } else {
      op.shape.n = o.req_int("n", 1, kMaxDim);
      op.shape.k = o.req_int("k", 1, kMaxDim);
      if (op.kind == MeasuredKind::kGroupedGemm) {
        op.shape.experts = o.req_int("experts", 1, 1 << 20);
        op.shape.tokens_per_expert = o.req_num("tokens_per_expert", 1e-3, 1e12);
        op.shape.m = static_cast<int64_t>(std::ceil(op.shape.tokens_per_expert));
      } else {
        op.shape.m = o.req_int("m", 1, kMaxDim);
      }
    }
    const std::string dtype = o.str_or("dtype", "bf16");
    if (dtype != "bf16" && dtype != "fp16" && dtype != "fp8" && dtype != "fp32")
      o.fail("dtype", fmt::format("is \"{}\"; must be one of bf16, fp16, fp8, fp32", dtype));
    op.dtype = parse_dtype(dtype);
    op.efficiency = o.num_or("efficiency", 0.0, 1e-9, 1.0);
    op.ms = o.num_or("ms", 0.0, 1e-9, 1e9);
    op.flops = o.num_or("flops", 0.0, 1.0, 1e30);
    if (!o.has("efficiency") && !o.has("ms"))
      o.fail("ms", "is missing; give \"ms\" (measured time of one call) or \"efficiency\"");
    if (op.kind == MeasuredKind::kAttention && !o.has("efficiency") && !o.has("flops"))
      o.fail("flops", "is missing; an attention point with \"ms\" needs its \"flops\"");
    out.push_back(op);
  }
  return out;
}

}  // namespace spillway
