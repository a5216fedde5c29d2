// The simulator's result as one self-contained SVG picture (no script, no external font
// or image): GPU 0's device memory over time with the GPU's HBM and the budget as labelled
// lines (top panel) and the D2H copy backlog left at the end of each layer's forward
// (bottom panel, red from the first snowballing layer).
//
// Invariants: every axis has ticks at 1-2-5 steps starting at 0 and a unit label; every
// text written is XML-escaped; an empty or degenerate input (no memory points, no layers,
// all zeros, non-finite numbers) still draws both frames with "no data" and never divides
// by zero.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <string_view>
#include <vector>

#include "spillway/sim/sim.hpp"

namespace spillway {

namespace {

// Page and panel geometry, pixels.
constexpr double kWidth = 960.0;
constexpr double kHeight = 640.0;
constexpr double kPlotLeft = 80.0;
constexpr double kPlotRight = 930.0;
constexpr double kMemTop = 92.0;
constexpr double kMemBottom = 300.0;
constexpr double kBarTop = 392.0;
constexpr double kBarBottom = 578.0;

constexpr const char* kFont = "DejaVu Sans, Helvetica, Arial, sans-serif";
constexpr const char* kBlue = "#1f77b4";
constexpr const char* kRed = "#d62728";
constexpr const char* kOrange = "#e6780e";
constexpr const char* kGreen = "#2a8a3e";
constexpr const char* kPurple = "#7b3fa0";
constexpr const char* kInk = "#222222";
constexpr const char* kMuted = "#666666";
constexpr const char* kGrid = "#e4e4e4";

double finite_or_zero(double v) {
  return std::isfinite(v) ? v : 0.0;
}

// The length of the well-formed UTF-8 sequence starting at s[i], or 0 if it is not one.
size_t utf8_length(std::string_view s, size_t i) {
  const auto u = static_cast<unsigned char>(s[i]);
  const size_t n = u < 0x80           ? 1
                   : (u >> 5) == 0x6  ? 2
                   : (u >> 4) == 0xe  ? 3
                   : (u >> 3) == 0x1e ? 4
                                      : 0;
  if (n == 0 || i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((static_cast<unsigned char>(s[i + k]) >> 6) != 0x2) return 0;
  }
  return n;
}

// Escapes the markup characters, drops the control characters XML 1.0 forbids and
// replaces malformed UTF-8 with U+FFFD, so that any title yields a well-formed document.
std::string xml_escape(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const size_t n = utf8_length(s, i);
    if (n == 0) {
      out += "\xef\xbf\xbd";
      ++i;
      continue;
    }
    if (n > 1) {
      out.append(s.substr(i, n));
      i += n;
      continue;
    }
    const char c = s[i++];
    if (static_cast<unsigned char>(c) < 0x20 && c != '\t' && c != '\n' && c != '\r') continue;
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

// A rough text width for layout (DejaVu Sans averages ~0.56 em per character).
double text_width(std::string_view s, double font_px) {
  return static_cast<double>(s.size()) * font_px * 0.56;
}

// The 1-2-5 step giving about `target` intervals over [0, hi].
double nice_step(double hi, int target) {
  if (!(hi > 0.0) || !std::isfinite(hi)) return 1.0;
  const double raw = hi / target;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double norm = raw / mag * (1.0 + 1e-9);
  const double f = norm < 1.5 ? 1.0 : norm < 3.0 ? 2.0 : norm < 7.0 ? 5.0 : 10.0;
  return f * mag;
}

struct Axis {
  double max = 1.0;  // the axis spans [0, max], max a multiple of step
  double step = 0.2;
  int decimals = 1;
};

Axis nice_axis(double hi, int target) {
  Axis a;
  if (!(hi > 0.0) || !std::isfinite(hi)) hi = 1.0;
  a.step = nice_step(hi, target);
  a.max = std::ceil(hi / a.step - 1e-9) * a.step;
  a.decimals = std::max(0, static_cast<int>(std::ceil(-std::log10(a.step) - 1e-9)));
  return a;
}

// Three significant-ish digits for a label: 71.3 GB, 4.25 GB, 0.512 GB.
std::string format_amount(double v) {
  if (v >= 100.0) return fmt::format("{:.0f}", v);
  if (v >= 10.0) return fmt::format("{:.1f}", v);
  if (v >= 1.0) return fmt::format("{:.2f}", v);
  return fmt::format("{:.3f}", v);
}

class Svg {
 public:
  Svg() {
    fmt::format_to(std::back_inserter(out_),
                   "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" "
                   "viewBox=\"0 0 {0} {1}\" font-family=\"{2}\">\n",
                   kWidth, kHeight, kFont);
    fmt::format_to(std::back_inserter(out_),
                   "<rect x=\"0\" y=\"0\" width=\"{}\" height=\"{}\" fill=\"#ffffff\"/>\n", kWidth,
                   kHeight);
  }

  void raw(std::string_view s) { out_ += s; }

  void line(double x1, double y1, double x2, double y2, const char* stroke, double width = 1.0,
            const char* dash = nullptr) {
    fmt::format_to(std::back_inserter(out_),
                   "<line x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"{}\" "
                   "stroke-width=\"{}\"{}/>\n",
                   x1, y1, x2, y2, stroke, width,
                   dash ? fmt::format(" stroke-dasharray=\"{}\"", dash) : std::string());
  }

  void rect(double x, double y, double w, double h, const char* fill, double opacity = 1.0) {
    fmt::format_to(std::back_inserter(out_),
                   "<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" "
                   "fill=\"{}\"{}/>\n",
                   x, y, std::max(w, 0.0), std::max(h, 0.0), fill,
                   opacity < 1.0 ? fmt::format(" fill-opacity=\"{}\"", opacity) : std::string());
  }

  // anchor: "start", "middle" or "end".
  void text(double x, double y, std::string_view s, double size = 11.0,
            const char* anchor = "start", const char* fill = kInk, bool bold = false,
            double rotate = 0.0) {
    fmt::format_to(std::back_inserter(out_),
                   "<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"{}\" text-anchor=\"{}\" "
                   "fill=\"{}\"{}{}>{}</text>\n",
                   x, y, size, anchor, fill, bold ? " font-weight=\"bold\"" : "",
                   rotate != 0.0
                       ? fmt::format(" transform=\"rotate({} {:.1f} {:.1f})\"", rotate, x, y)
                       : std::string(),
                   xml_escape(s));
  }

  std::string finish() {
    out_ += "</svg>\n";
    return std::move(out_);
  }

 private:
  std::string out_;
};

// A legend laid out left to right from (x, y): swatch then label per entry.
class Legend {
 public:
  Legend(Svg& svg, double x, double y) : svg_(svg), x_(x), y_(y) {}

  void line_entry(std::string_view label, const char* stroke, const char* dash = nullptr) {
    svg_.line(x_, y_ - 4, x_ + 22, y_ - 4, stroke, 2.0, dash);
    label_after(26, label);
  }
  void tick_entry(std::string_view label, const char* stroke) {
    svg_.line(x_ + 7, y_ - 10, x_ + 7, y_ + 1, stroke, 1.5);
    label_after(14, label);
  }
  void box_entry(std::string_view label, const char* fill, double opacity = 1.0) {
    svg_.rect(x_, y_ - 10, 14, 11, fill, opacity);
    label_after(18, label);
  }

 private:
  void label_after(double swatch, std::string_view label) {
    svg_.text(x_ + swatch, y_, label, 11.0, "start", kInk);
    x_ += swatch + text_width(label, 11.0) + 18;
  }

  Svg& svg_;
  double x_;
  double y_;
};

// Frame, y grid, y ticks and the rotated y unit label of one panel.
void draw_y_axis(Svg& svg, double top, double bottom, const Axis& a, std::string_view label) {
  const int n = static_cast<int>(std::lround(a.max / a.step));
  for (int i = 0; i <= n; ++i) {
    const double v = a.step * i;
    const double y = bottom - (bottom - top) * v / a.max;
    if (i > 0) svg.line(kPlotLeft, y, kPlotRight, y, kGrid);
    svg.line(kPlotLeft - 5, y, kPlotLeft, y, kInk);
    svg.text(kPlotLeft - 8, y + 4, fmt::format("{:.{}f}", v, a.decimals), 11.0, "end");
  }
  svg.text(26, (top + bottom) / 2, label, 12.0, "middle", kInk, false, -90.0);
}

void draw_frame(Svg& svg, double top, double bottom) {
  svg.line(kPlotLeft, bottom, kPlotRight, bottom, kInk);
  svg.line(kPlotLeft, top, kPlotLeft, bottom, kInk);
}

void no_data(Svg& svg, double top, double bottom) {
  svg.text((kPlotLeft + kPlotRight) / 2, (top + bottom) / 2 + 5, "no data", 14.0, "middle", kMuted);
}

void draw_memory_panel(Svg& svg, const SimResult& r) {
  constexpr double kGB = 1e9;
  double t_end = finite_or_zero(r.summary.step_ms);
  double peak_gb = 0.0;
  for (const MemoryPoint& m : r.memory) {
    t_end = std::max(t_end, finite_or_zero(m.t_ms));
    peak_gb = std::max(peak_gb, static_cast<double>(m.bytes) / kGB);
  }
  for (const double t : r.layer_fwd_end_ms) t_end = std::max(t_end, finite_or_zero(t));
  const bool has_data = !r.memory.empty();
  // The limits of the memory verdict (0: unknown, not drawn). The axis covers the peak and
  // the GPU's HBM; a budget above the HBM is named in the legend, not drawn.
  const double cap_gb =
      std::max(finite_or_zero(static_cast<double>(r.summary.hbm_capacity_bytes) / kGB), 0.0);
  const double budget_gb =
      std::max(finite_or_zero(static_cast<double>(r.summary.hbm_budget_bytes) / kGB), 0.0);
  const double top_gb = std::max(peak_gb, cap_gb);
  const bool draw_cap = has_data && cap_gb > 0.0;
  const bool draw_budget = has_data && budget_gb > 0.0 && budget_gb <= top_gb;
  // Floors on the ranges keep tick labels short on degenerate inputs.
  const Axis xa = nice_axis(has_data ? std::max(t_end, 0.01) : 0.0, 8);
  const Axis ya = nice_axis(has_data ? std::max(top_gb * 1.08, 0.01) : 0.0, 6);
  auto px = [&](double t) {
    return kPlotLeft + (kPlotRight - kPlotLeft) * std::clamp(t / xa.max, 0.0, 1.0);
  };
  auto py = [&](double gb) {
    return kMemBottom - (kMemBottom - kMemTop) * std::clamp(gb / ya.max, 0.0, 1.0);
  };

  // Legend row, above the "forward | backward" label row.
  if (has_data) {
    Legend legend(svg, kPlotLeft, kMemTop - 26);
    legend.line_entry("GPU 0 device memory", kBlue);
    legend.line_entry("peak", kOrange, "6 4");
    if (draw_cap) legend.line_entry("GPU HBM", kRed);
    if (draw_budget) {
      legend.line_entry("budget", kPurple, "2 3");
    } else if (budget_gb > 0.0) {
      legend.line_entry(fmt::format("budget {} GB (above the HBM)", format_amount(budget_gb)),
                        kPurple, "2 3");
    }
    if (!r.layer_fwd_end_ms.empty()) {
      legend.box_entry("forward", "#8c8c8c", 0.16);
      legend.tick_entry("end of a layer's forward", kMuted);
    }
  }

  const bool has_fwd = has_data && !r.layer_fwd_end_ms.empty();
  if (has_fwd) {
    const double x_fwd = px(finite_or_zero(r.layer_fwd_end_ms.back()));
    svg.rect(kPlotLeft, kMemTop, x_fwd - kPlotLeft, kMemBottom - kMemTop, "#8c8c8c", 0.16);
  }

  draw_y_axis(svg, kMemTop, kMemBottom, ya, "device memory (GB)");

  // X ticks.
  const int nx = static_cast<int>(std::lround(xa.max / xa.step));
  for (int i = 0; i <= nx; ++i) {
    const double v = xa.step * i;
    const double x = px(v);
    svg.line(x, kMemBottom, x, kMemBottom + 5, kInk);
    svg.text(x, kMemBottom + 18, fmt::format("{:.{}f}", v, xa.decimals), 11.0, "middle");
  }
  svg.text((kPlotLeft + kPlotRight) / 2, kMemBottom + 38, "time (ms)", 12.0, "middle");

  if (!has_data) {
    draw_frame(svg, kMemTop, kMemBottom);
    no_data(svg, kMemTop, kMemBottom);
    return;
  }

  // The step curve: the value holds from one point to the next, the last until t_end.
  std::string path;
  std::string area;
  const MemoryPoint& first = r.memory.front();
  const double gb0 = static_cast<double>(first.bytes) / kGB;
  fmt::format_to(std::back_inserter(path), "M{:.1f},{:.1f}", px(finite_or_zero(first.t_ms)),
                 py(gb0));
  fmt::format_to(std::back_inserter(area), "M{:.1f},{:.1f}L{:.1f},{:.1f}",
                 px(finite_or_zero(first.t_ms)), kMemBottom, px(finite_or_zero(first.t_ms)),
                 py(gb0));
  for (size_t i = 1; i < r.memory.size(); ++i) {
    const double x = px(finite_or_zero(r.memory[i].t_ms));
    const double y = py(static_cast<double>(r.memory[i].bytes) / kGB);
    fmt::format_to(std::back_inserter(path), "H{:.1f}V{:.1f}", x, y);
    fmt::format_to(std::back_inserter(area), "H{:.1f}V{:.1f}", x, y);
  }
  fmt::format_to(std::back_inserter(path), "H{:.1f}", px(t_end));
  fmt::format_to(std::back_inserter(area), "H{:.1f}V{:.1f}Z", px(t_end), kMemBottom);
  svg.raw(fmt::format("<path d=\"{}\" fill=\"{}\" fill-opacity=\"0.12\" stroke=\"none\"/>\n", area,
                      kBlue));
  svg.raw(
      fmt::format("<path d=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"1.8\" "
                  "stroke-linejoin=\"round\"/>\n",
                  path, kBlue));

  // The GPU's HBM and the budget: lines across, labelled at the left end, the HBM above
  // its line and the budget below its own, so that close values stay readable.
  if (draw_cap) {
    const double y_cap = py(cap_gb);
    svg.line(kPlotLeft, y_cap, kPlotRight, y_cap, kRed, 1.3);
    svg.text(kPlotLeft + 4, y_cap - 4, fmt::format("GPU HBM {} GB", format_amount(cap_gb)), 11.0,
             "start", kRed, true);
  }
  if (draw_budget) {
    const double y_budget = py(budget_gb);
    svg.line(kPlotLeft, y_budget, kPlotRight, y_budget, kPurple, 1.3, "2 3");
    svg.text(kPlotLeft + 4, y_budget + 13, fmt::format("budget {} GB", format_amount(budget_gb)),
             11.0, "start", kPurple, true);
  }

  // Peak: dashed line across, labelled at the right end, where backward has freed memory;
  // the label says which limit it exceeds (Note [Simulated memory verdict]).
  const double y_peak = py(peak_gb);
  std::string over;
  if (cap_gb > 0.0 && peak_gb > cap_gb) {
    over = " > GPU HBM";
  } else if (budget_gb > 0.0 && peak_gb > budget_gb) {
    over = " > budget";
  }
  svg.line(kPlotLeft, y_peak, kPlotRight, y_peak, kOrange, 1.3, "6 4");
  svg.text(kPlotRight - 4, y_peak - 5, fmt::format("peak {} GB{}", format_amount(peak_gb), over),
           11.0, "end", over.empty() ? kOrange : kRed, true);

  // Each layer's forward end as a tick on the top edge; the last one splits the panel.
  for (const double t : r.layer_fwd_end_ms) {
    const double x = px(finite_or_zero(t));
    svg.line(x, kMemTop, x, kMemTop + 6, kMuted);
  }
  if (has_fwd) {
    const double t_fwd = finite_or_zero(r.layer_fwd_end_ms.back());
    const double x_fwd = px(t_fwd);
    svg.line(x_fwd, kMemTop - 4, x_fwd, kMemBottom, kMuted, 1.2, "3 3");
    if (t_fwd < t_end * 0.98 && x_fwd + 6 + text_width("backward", 11.0) < kWidth - 4) {
      svg.text(x_fwd - 6, kMemTop - 6, "forward", 11.0, "end", kMuted);
      svg.text(x_fwd, kMemTop - 6, "|", 11.0, "middle", kMuted);
      svg.text(x_fwd + 6, kMemTop - 6, "backward", 11.0, "start", kMuted);
    } else {
      const bool fits_left = x_fwd - text_width("forward end", 11.0) > kPlotLeft;
      svg.text(x_fwd + (fits_left ? 0 : 4), kMemTop - 6, "forward end", 11.0,
               fits_left ? "end" : "start", kMuted);
    }
  }
  draw_frame(svg, kMemTop, kMemBottom);
}

void draw_backlog_panel(Svg& svg, const SimResult& r) {
  const SimSummary& s = r.summary;
  const std::vector<int64_t>& backlog = s.backlog_bytes;
  const int n = static_cast<int>(backlog.size());
  int64_t max_bytes = 0;
  for (const int64_t b : backlog) max_bytes = std::max(max_bytes, b);
  const bool in_gb = max_bytes >= 2'000'000'000;
  const double unit = in_gb ? 1e9 : 1e6;
  const Axis ya = nice_axis(std::max(static_cast<double>(max_bytes) / unit * 1.05, 1.0), 5);
  const int first_red = s.snowball && s.snowball_first_layer ? *s.snowball_first_layer : n;

  if (n > 0) {
    Legend legend(svg, kPlotLeft, kBarTop - 12);
    legend.box_entry("D2H backlog at the end of the layer's forward", kBlue);
    if (first_red < n) legend.box_entry("snowballing", kRed);
    const std::string note =
        s.snowball ? (s.snowball_first_layer ? fmt::format("snowball from layer {}", first_red)
                                             : std::string("snowball"))
                   : std::string("no snowball");
    svg.text(kPlotRight, kBarTop - 12, note, 12.0, "end", s.snowball ? kRed : kGreen, true);
  }

  draw_y_axis(svg, kBarTop, kBarBottom, ya, in_gb ? "D2H backlog (GB)" : "D2H backlog (MB)");
  svg.text((kPlotLeft + kPlotRight) / 2, kBarBottom + 36, "layer", 12.0, "middle");
  if (n == 0) {
    draw_frame(svg, kBarTop, kBarBottom);
    no_data(svg, kBarTop, kBarBottom);
    return;
  }

  // Labels every 1, 2, 5, 10, 20, ... layers: at most ~20 of them.
  int label_every = 1;
  for (int mag = 1; n / label_every > 20; mag *= 10) {
    for (const int f : {1, 2, 5}) {
      label_every = f * mag;
      if (n / label_every <= 20) break;
    }
  }
  const double band = (kPlotRight - kPlotLeft) / n;
  const double bar_w = std::max(1.0, band * 0.72);
  for (int l = 0; l < n; ++l) {
    const double xc = kPlotLeft + band * (l + 0.5);
    const double v = static_cast<double>(backlog[l]) / unit;
    const double h = (kBarBottom - kBarTop) * std::clamp(v / ya.max, 0.0, 1.0);
    svg.rect(xc - bar_w / 2, kBarBottom - h, bar_w, h, l >= first_red ? kRed : kBlue);
    if (l % label_every == 0) {
      svg.line(xc, kBarBottom, xc, kBarBottom + 5, kInk);
      svg.text(xc, kBarBottom + 18, fmt::format("{}", l), 11.0, "middle");
    }
  }
  draw_frame(svg, kBarTop, kBarBottom);
}

}  // namespace

std::string sim_plot_svg(const SimResult& r, const std::string& title) {
  Svg svg;
  svg.raw(fmt::format("<title>{}</title>\n", xml_escape(title)));

  std::string heading = title;
  if (!r.scenario.empty()) heading += (heading.empty() ? "" : " \xc2\xb7 ") + r.scenario;
  heading += fmt::format("{}step {:.2f} ms", heading.empty() ? "" : " \xc2\xb7 ",
                         finite_or_zero(r.summary.step_ms));
  svg.text(kPlotLeft, 26, heading, 16.0, "start", kInk, true);

  const SimSummary& s = r.summary;
  svg.text(kPlotLeft, 46,
           fmt::format("{} GPU{}, {} per link \xc2\xb7 D2H {:.1f} of {:.1f} GB/s, H2D {:.1f} of "
                       "{:.1f} GB/s \xc2\xb7 compute {:.2f} ms, stall {:.2f} ms",
                       r.gpus, r.gpus == 1 ? "" : "s", r.gpus_per_link,
                       finite_or_zero(s.link_d2h_gbps), finite_or_zero(r.link_d2h_gbps),
                       finite_or_zero(s.link_h2d_gbps), finite_or_zero(r.link_h2d_gbps),
                       finite_or_zero(s.compute_ms), finite_or_zero(s.stall_ms)),
           11.0, "start", kMuted);

  draw_memory_panel(svg, r);
  draw_backlog_panel(svg, r);
  return svg.finish();
}

}  // namespace spillway
