// Hardware profile loading (schema spillway.hardware/1) with field-by-field validation.
#include "spillway/catalog/hardware.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "core/embedded_data.hpp"
#include "core/json_io.hpp"
#include "core/near_names.hpp"
#include "spillway/core/error.hpp"

namespace spillway {

namespace {
constexpr const char* kWhat = "hardware profile";
constexpr const char* kSchema = "spillway.hardware/1";

// The "interconnect" object: every field optional (the Interconnect defaults), each in its
// physical range; an NVLink bandwidth and a domain of more than one GPU go together.
Interconnect parse_interconnect(const JsonObject& o) {
  Interconnect ic;
  ic.nvlink_gbps = o.num_or("nvlink_gbps", ic.nvlink_gbps, 0.0, 1e6);
  ic.gpus_per_nvlink_domain = static_cast<int>(
      o.int_or("gpus_per_nvlink_domain", ic.gpus_per_nvlink_domain, 1, int64_t{1} << 20));
  ic.network_gbps = o.num_or("network_gbps", ic.network_gbps, 0.001, 1e6);
  ic.collective_latency_us = o.num_or("collective_latency_us", ic.collective_latency_us, 0.0, 1e6);
  if (ic.nvlink_gbps > 0.0 && ic.gpus_per_nvlink_domain < 2) {
    o.fail("gpus_per_nvlink_domain",
           fmt::format("is {}; an NVLink of {} GB/s (\"nvlink_gbps\") joins at least 2 GPUs",
                       ic.gpus_per_nvlink_domain, ic.nvlink_gbps));
  }
  if (ic.nvlink_gbps == 0.0 && ic.gpus_per_nvlink_domain > 1) {
    o.fail("gpus_per_nvlink_domain",
           fmt::format("is {}; with \"nvlink_gbps\" 0 (no NVLink) it must be 1",
                       ic.gpus_per_nvlink_domain));
  }
  return ic;
}

// "efficiency.<key>": [[x, eff], ...], checked point by point (Note [Efficiency curves]).
EfficiencyCurve parse_curve(const JsonObject& obj, const char* key) {
  const Json& arr = obj.raw().at(key);
  if (!arr.is_array() || arr.empty()) {
    obj.fail(key, fmt::format("is {}; must be a non-empty array of [abscissa, efficiency] pairs",
                              json_value_text(arr)));
  }
  EfficiencyCurve c;
  for (size_t i = 0; i < arr.size(); ++i) {
    const Json& p = arr[i];
    const std::string at = fmt::format("{}[{}]", key, i);
    if (!p.is_array() || p.size() != 2 || !p[0].is_number() || !p[1].is_number()) {
      obj.fail(at, fmt::format("is {}; must be [abscissa, efficiency], two numbers",
                               json_value_text(p)));
    }
    const double x = p[0].get<double>();
    const double e = p[1].get<double>();
    if (!(std::isfinite(x) && x > 0.0))
      obj.fail(at, fmt::format("has abscissa {}; must be > 0", x));
    if (!(e > 0.0 && e <= 1.0))
      obj.fail(at, fmt::format("has efficiency {}; must be in (0, 1]", e));
    if (!c.points.empty() && !(x > c.points.back().first)) {
      obj.fail(at, fmt::format("has abscissa {}; must be above the previous point's ({}): "
                               "abscissae increase strictly",
                               x, c.points.back().first));
    }
    c.points.emplace_back(x, e);
  }
  return c;
}

EfficiencyCurves parse_efficiency(const JsonObject& root) {
  EfficiencyCurves c;
  if (!root.has("efficiency")) return c;
  const JsonObject eff = root.req_obj("efficiency");
  for (const auto& [key, value] : eff.raw().items()) {
    if (key != "gemm" && key != "grouped_gemm" && key != "attention" && key != "hbm")
      eff.fail(key, "is not a known curve; use gemm, grouped_gemm, attention, hbm");
  }
  if (eff.has("gemm")) c.gemm = parse_curve(eff, "gemm");
  // Without its own curve, a grouped GEMM runs as a dense one.
  c.grouped_gemm = eff.has("grouped_gemm") ? parse_curve(eff, "grouped_gemm") : c.gemm;
  if (eff.has("attention")) c.attention = parse_curve(eff, "attention");
  c.hbm = eff.num_or("hbm", c.hbm, 1e-6, 1.0);
  return c;
}

}  // namespace

double EfficiencyCurve::at(double x) const {
  SPILLWAY_CHECK(!points.empty(), "an efficiency curve has at least one point");
  if (!(x > points.front().first)) return points.front().second;
  if (x >= points.back().first) return points.back().second;
  size_t hi = 1;
  while (points[hi].first < x) ++hi;
  const auto& [x0, e0] = points[hi - 1];
  const auto& [x1, e1] = points[hi];
  const double t = (std::log(x) - std::log(x0)) / (std::log(x1) - std::log(x0));
  return e0 + t * (e1 - e0);
}

void check_efficiency_curve(const EfficiencyCurve& curve, const std::string& field) {
  if (curve.points.empty()) SPILLWAY_FIELD_ERROR(field, "empty", "must have at least one point");
  for (size_t i = 0; i < curve.points.size(); ++i) {
    const auto& [x, e] = curve.points[i];
    const std::string at = fmt::format("{}[{}]", field, i);
    if (!(std::isfinite(x) && x > 0.0)) SPILLWAY_FIELD_ERROR(at, x, "abscissa must be > 0");
    if (!(e > 0.0 && e <= 1.0)) SPILLWAY_FIELD_ERROR(at, e, "efficiency must be in (0, 1]");
    if (i > 0 && !(x > curve.points[i - 1].first)) {
      SPILLWAY_FIELD_ERROR(at, x, "abscissa must be above the previous point's ({})",
                           curve.points[i - 1].first);
    }
  }
}

HardwareProfile parse_hardware_profile(const nlohmann::json& doc, const std::string& file) {
  JsonObject root(doc, kWhat, file);
  const std::string schema = root.req_str("schema");
  if (schema != kSchema)
    root.fail("schema", fmt::format("is \"{}\"; must be \"{}\"", schema, kSchema));
  HardwareProfile h;
  h.source = file;
  h.name = root.req_str("name");
  h.description = root.str_or("description", "");
  h.projected = root.bool_or("projected", false);
  h.notes = root.str_or("notes", "");
  const JsonObject gpu = root.req_obj("gpu");
  h.hbm_gb = gpu.req_num("hbm_gb", 0.001, 1e6);
  h.hbm_tbps = gpu.req_num("hbm_tbps", 0.001, 1e4);
  h.sms = static_cast<int>(gpu.req_int("sms", 1, 1 << 20));
  h.bf16_dense = TFlops(gpu.req_num("bf16_dense_tflops", 0.001, 1e7));
  h.fp8_dense = TFlops(gpu.num_or("fp8_dense_tflops", h.bf16_dense.value, 0.001, 1e7));
  const JsonObject link = root.req_obj("host_link");
  h.link_kind = link.req_str("kind");
  h.d2h_nominal = GBps(link.req_num("d2h_nominal_gbps", 0.001, 1e6));
  h.h2d_nominal = GBps(link.req_num("h2d_nominal_gbps", 0.001, 1e6));
  h.d2h_typical = GBps(link.req_num("d2h_typical_gbps", 0.001, 1e6));
  h.h2d_typical = GBps(link.req_num("h2d_typical_gbps", 0.001, 1e6));
  if (h.d2h_typical > h.d2h_nominal) {
    link.fail("d2h_typical_gbps",
              fmt::format("is {}; a measured figure cannot exceed \"d2h_nominal_gbps\" ({})",
                          h.d2h_typical.value, h.d2h_nominal.value));
  }
  if (h.h2d_typical > h.h2d_nominal) {
    link.fail("h2d_typical_gbps",
              fmt::format("is {}; a measured figure cannot exceed \"h2d_nominal_gbps\" ({})",
                          h.h2d_typical.value, h.h2d_nominal.value));
  }
  h.gpus_per_link = static_cast<int>(link.int_or("gpus_per_link", 1, 1, 1024));
  if (root.has("interconnect")) h.interconnect = parse_interconnect(root.req_obj("interconnect"));
  const JsonObject host = root.req_obj("host");
  h.host_memory_gb = host.req_num("memory_gb", 0.001, 1e7);
  h.gpus_per_host_memory = static_cast<int>(host.int_or("gpus_per_host_memory", 1, 1, 1024));
  h.efficiency = parse_efficiency(root);
  for (const JsonObject& m : root.obj_array("mig")) {
    MigProfile p;
    p.profile = m.req_str("profile");
    p.count = static_cast<int>(m.req_int("count", 1, 64));
    p.hbm_gb = m.req_num("hbm_gb", 0.001, 1e6);
    p.sms = static_cast<int>(m.req_int("sms", 1, 1 << 20));
    p.hbm_tbps = m.req_num("hbm_tbps", 0.001, 1e4);
    h.mig.push_back(std::move(p));
  }
  return h;
}

std::string describe_interconnect(const Interconnect& ic) {
  const std::string nvlink =
      ic.nvlink_gbps > 0.0
          ? fmt::format("NVLink {:g} GB/s x {} GPUs", ic.nvlink_gbps, ic.gpus_per_nvlink_domain)
          : std::string("no NVLink");
  return fmt::format("{}, network {:g} GB/s, {:g} us/step", nvlink, ic.network_gbps,
                     ic.collective_latency_us);
}

std::vector<std::string> hardware_names() {
  std::vector<std::string> out;
  for (const EmbeddedFile& f : embedded_files()) {
    if (std::string_view(f.kind) != "hardware") continue;
    std::string n = f.name;
    if (n.size() > 5 && n.ends_with(".json")) out.push_back(n.substr(0, n.size() - 5));
  }
  std::sort(out.begin(), out.end());
  return out;
}

HardwareProfile load_hardware(const std::string& name_or_path) {
  // Catalog names ignore case, as model names do.
  const std::vector<std::string> names = hardware_names();
  for (const std::string& n : names) {
    if (lower_ascii(n) != lower_ascii(name_or_path)) continue;
    const EmbeddedFile* f = find_embedded("hardware", n + ".json");
    const std::string label = "data/hardware/" + n + ".json";
    return parse_hardware_profile(parse_json_text(f->text, kWhat, label), label);
  }
  std::error_code ec;
  if (std::filesystem::is_directory(name_or_path, ec)) {
    SPILLWAY_INPUT_ERROR("hardware: '{}' is a directory; a profile is a JSON file (schema {})",
                         name_or_path, kSchema);
  }
  if (!std::filesystem::is_regular_file(name_or_path, ec)) {
    std::string list;
    for (const std::string& n : names) list += (list.empty() ? "" : ", ") + n;
    SPILLWAY_INPUT_ERROR(
        "hardware: '{}' is neither a catalog profile nor an existing file.{} Catalog: {} (or "
        "pass the path of a profile JSON, schema {})",
        name_or_path, did_you_mean(name_or_path, names), list, kSchema);
  }
  return parse_hardware_profile(load_json_file(name_or_path, kWhat), name_or_path);
}

}  // namespace spillway
