// load_profile: measured per-layer forward and backward times (spillway.profile/1) that
// calibrate the planner's layers (PlanRequest::profile).
#include "core/json_io.hpp"
#include "spillway/core/error.hpp"
#include "spillway/plan/plan.hpp"

namespace spillway {

std::vector<LayerTiming> load_profile(const std::string& path) {
  const Json doc = load_json_file(path, "profile");
  JsonObject root(doc, "profile", path);
  if (root.has("schema") && root.req_str("schema") != "spillway.profile/1") {
    root.fail("schema",
              fmt::format("is \"{}\"; must be \"spillway.profile/1\"", root.req_str("schema")));
  }
  std::vector<LayerTiming> out;
  for (const JsonObject& l : root.obj_array("layers")) {
    LayerTiming t;
    t.index = static_cast<int>(l.req_int("index", 0, 1000000));
    t.fwd_ms = l.req_num("fwd_ms", 1e-9, 1e9);
    t.bwd_ms = l.req_num("bwd_ms", 1e-9, 1e9);
    out.push_back(t);
  }
  if (out.empty() && !root.has("ops")) {
    root.fail("layers", "is missing or empty; give one entry per layer (or measured \"ops\")");
  }
  return out;
}

}  // namespace spillway
