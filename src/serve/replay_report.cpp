// The trace replay's report (spillway/serve/replay.hpp): the table (format_replay), the JSON
// (replay_json) and the SVG of TTFT over the replay (replay_svg) of run_replay's results.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "serve/replay_impl.hpp"
#include "spillway/catalog/model.hpp"
#include "spillway/serve/replay.hpp"

namespace spillway {

using serve::detail::percentile;

namespace {
std::vector<std::string> model_names(const ReplayOptions& o) {
  if (o.architectures.empty()) return o.models;
  std::vector<std::string> n;
  for (const ModelConfig& m : o.architectures) n.push_back(m.name);
  return n;
}
}  // namespace

std::string format_replay(const std::vector<ReplayResult>& r, const ReplayOptions& o,
                          int64_t distinct_models) {
  std::string s = fmt::format(
      "{} requests of {} trace models on {} ({} slices), models dealt over {}; arrivals x{:g}\n"
      "token counts are not in the trace: prompts log-normal (median {:g}, sigma {:g}, {}-{}), "
      "outputs log-normal (median {:g}, sigma {:g}, {}-{}), seed {}\n"
      "SLO: TTFT <= {:g} ms and TPOT <= max({:g} ms, 1.25 x weights / link)\n",
      r.empty() ? 0 : r[0].requests, distinct_models, o.hardware, o.profile,
      fmt::join(model_names(o), ", "), o.time_scale, o.prompt_median, o.prompt_sigma, o.prompt_min,
      o.prompt_max, o.output_median, o.output_sigma, o.output_min, o.output_max, o.seed, o.ttft_ms,
      o.tpot_ms);
  s += fmt::format("{:<24} {:>5} {:>27} {:>22} {:>6} {:>8} {:>12} {:>5} {:>12} {:>6} {:>6}\n", "",
                   "GPUs", "TTFT ms p50/p95/p99", "TPOT ms p50/p95/p99", "SLO", "switches",
                   "switch TTFT", "cold", "cold TTFT", "link", "HBM");
  for (const ReplayResult& x : r)
    s += fmt::format(
        "{:<24} {:>5} {:>9.0f}/{:>8.0f}/{:>8.0f} {:>7.1f}/{:>6.1f}/{:>7.1f} {:>5.1f}% {:>8} "
        "{:>10.0f}ms {:>5} {:>10.0f}ms {:>5.1f}% {:>5.1f}%\n",
        x.name, x.gpus, x.ttft_ms.p50, x.ttft_ms.p95, x.ttft_ms.p99, x.tpot_ms.p50, x.tpot_ms.p95,
        x.tpot_ms.p99, 100.0 * x.slo_attainment, x.switches, x.switch_ttft_ms.p50, x.cold_starts,
        x.cold_ttft_ms.p50, 100.0 * x.link_utilization, 100.0 * x.hbm_utilization);
  s += "switch TTFT, cold TTFT: the median TTFT of the requests that gave a slice another "
       "model, and of those whose model was loaded from disk first\n";
  return s;
}

std::string replay_json(const std::vector<ReplayResult>& r, const ReplayOptions& o) {
  nlohmann::json j;
  j["schema"] = "spillway.replay/1";
  j["hardware"] = o.hardware;
  j["profile"] = o.profile;
  j["models"] = model_names(o);
  j["time_scale"] = o.time_scale;
  j["seed"] = o.seed;
  j["lengths"] = {{"prompt_median", o.prompt_median},
                  {"prompt_sigma", o.prompt_sigma},
                  {"output_median", o.output_median},
                  {"output_sigma", o.output_sigma},
                  {"note", "drawn: the trace has no token counts"}};
  for (const ReplayResult& x : r) {
    auto st = [](const LatencyStats& l) {
      return nlohmann::json{{"p50", l.p50}, {"p95", l.p95}, {"p99", l.p99}};
    };
    j["configurations"].push_back({{"name", x.name},
                                   {"gpus", x.gpus},
                                   {"requests", x.requests},
                                   {"completed", x.completed},
                                   {"ttft_ms", st(x.ttft_ms)},
                                   {"tpot_ms", st(x.tpot_ms)},
                                   {"slo_attainment", x.slo_attainment},
                                   {"switches", x.switches},
                                   {"switch_ttft_ms", st(x.switch_ttft_ms)},
                                   {"cold_starts", x.cold_starts},
                                   {"cold_ttft_ms", st(x.cold_ttft_ms)},
                                   {"link_utilization", x.link_utilization},
                                   {"hbm_utilization", x.hbm_utilization},
                                   {"makespan_s", x.makespan_s}});
  }
  return j.dump(2) + "\n";
}

std::string replay_svg(const std::vector<ReplayResult>& r) {
  // Per configuration, the TTFT's median and 95th percentile over the requests arriving in
  // each of kBins slices of the replay (log scale): compact whatever the trace's length.
  constexpr int kBins = 60;
  const double w = 900, h = 420, left = 70, right = 200, top = 30, bottom = 50;
  double tmax = 1e-9, ymin = 1e9, ymax = 1.0;
  for (const ReplayResult& x : r)
    for (const auto& [t, y] : x.ttft_trace) {
      tmax = std::max(tmax, t);
      ymin = std::min(ymin, std::max(y, 1.0));
      ymax = std::max(ymax, y);
    }
  ymin = std::pow(10.0, std::floor(std::log10(std::max(ymin, 1.0))));
  ymax = std::pow(10.0, std::ceil(std::log10(std::max(ymax, 10.0))));
  auto X = [&](double t) { return left + (w - left - right) * t / tmax; };
  auto Y = [&](double y) {
    return top +
           (h - top - bottom) * (1.0 - (std::log10(std::max(y, ymin)) - std::log10(ymin)) /
                                           std::max(1e-9, std::log10(ymax) - std::log10(ymin)));
  };
  static const char* colors[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"};
  std::string s = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" "
      "fill=\"white\"/>\n<text x=\"{}\" y=\"18\">TTFT over the replay: median (solid) and "
      "95th percentile (dashed) of the requests arriving in each of {} intervals</text>\n",
      w, h, left, kBins);
  for (double d = ymin; d <= ymax * 1.001; d *= 10)
    s += fmt::format(
        "<line x1=\"{0}\" x2=\"{1}\" y1=\"{2:.1f}\" y2=\"{2:.1f}\" stroke=\"#ddd\"/><text "
        "x=\"5\" y=\"{3:.1f}\">{4:g} ms</text>\n",
        left, w - right, Y(d), Y(d) + 4, d);
  s += fmt::format("<text x=\"{}\" y=\"{}\">arrival (s of the replay, {:.0f} s)</text>\n", left,
                   h - 15, tmax);
  for (size_t i = 0; i < r.size(); ++i) {
    const char* c = colors[i % 6];
    std::vector<std::vector<double>> bins(kBins);
    for (const auto& [t, y] : r[i].ttft_trace) {
      const int b = std::min(kBins - 1, static_cast<int>(t / tmax * kBins));
      bins[static_cast<size_t>(b)].push_back(y);
    }
    for (double q : {0.5, 0.95}) {
      std::string pts;
      for (int b = 0; b < kBins; ++b) {
        const std::vector<double>& v = bins[static_cast<size_t>(b)];
        if (v.empty()) continue;
        pts += fmt::format("{:.1f},{:.1f} ", X((b + 0.5) * tmax / kBins), Y(percentile(v, q)));
      }
      s += fmt::format(
          "<polyline points=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"1.5\"{}/>\n", pts, c,
          q > 0.5 ? " stroke-dasharray=\"4 3\"" : "");
    }
    s += fmt::format(
        "<rect x=\"{}\" y=\"{}\" width=\"10\" height=\"10\" fill=\"{}\"/><text x=\"{}\" "
        "y=\"{}\">{}</text>\n",
        w - right + 10, top + 20.0 * static_cast<double>(i), c, w - right + 25,
        top + 20.0 * static_cast<double>(i) + 10, r[i].name);
  }
  return s + "</svg>\n";
}

}  // namespace spillway
