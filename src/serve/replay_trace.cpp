// The trace replay's inputs (spillway/serve/replay.hpp): the request trace and the measured
// reload latencies read from their CSV files, the drawn token counts (the trace has
// none: Note [Replay model]) and the trace's models by popularity.
#include <algorithm>
#include <cmath>
#include <ctime>
#include <fstream>
#include <iomanip>
#include <map>
#include <random>
#include <sstream>

#include "spillway/core/error.hpp"
#include "spillway/serve/replay.hpp"

namespace spillway {
namespace {

std::vector<std::string> split_csv(const std::string& line) {
  std::vector<std::string> out;
  std::string cur;
  for (char ch : line) {
    if (ch == ',') {
      out.push_back(cur);
      cur.clear();
    } else if (ch != '\r') {
      cur += ch;
    }
  }
  out.push_back(cur);
  return out;
}

int column(const std::vector<std::string>& header, const std::string& name,
           const std::string& path) {
  for (size_t i = 0; i < header.size(); ++i)
    if (header[i] == name) return static_cast<int>(i);
  SPILLWAY_INPUT_ERROR("{}: no column '{}' in the header", path, name);
}

// "YYYY-MM-DD HH:MM:SS" as seconds (UTC).
double parse_time(const std::string& s, const std::string& path, int64_t line) {
  std::tm tm{};
  std::istringstream in(s);
  in >> std::get_time(&tm, "%Y-%m-%d %H:%M:%S");
  if (in.fail())
    SPILLWAY_INPUT_ERROR("{}:{}: gmt_create is '{}'; expected YYYY-MM-DD HH:MM:SS", path, line, s);
  return static_cast<double>(timegm(&tm));
}

}  // namespace

std::vector<TraceRequest> read_request_trace(const std::string& path, int64_t max_requests,
                                             int64_t* skipped) {
  if (skipped != nullptr) *skipped = 0;
  std::ifstream in(path);
  if (!in) SPILLWAY_INPUT_ERROR("{}: cannot open the request trace", path);
  std::string line;
  if (!std::getline(in, line)) SPILLWAY_INPUT_ERROR("{}: empty (no header)", path);
  const std::vector<std::string> header = split_csv(line);
  const int tcol = column(header, "gmt_create", path);
  const int mcol = column(header, "checkpoint_model_version_id", path);
  std::vector<std::pair<double, std::string>> rows;
  int64_t n = 1;
  while (std::getline(in, line)) {
    ++n;
    if (line.empty()) continue;
    const std::vector<std::string> f = split_csv(line);
    if (static_cast<int>(f.size()) <= std::max(tcol, mcol))
      SPILLWAY_INPUT_ERROR("{}:{}: {} fields; the header has {}", path, n, f.size(), header.size());
    if (f[static_cast<size_t>(mcol)].empty()) {  // a request with no model (PENDING rows)
      if (skipped != nullptr) ++*skipped;
      continue;
    }
    rows.emplace_back(parse_time(f[static_cast<size_t>(tcol)], path, n),
                      f[static_cast<size_t>(mcol)]);
  }
  std::stable_sort(rows.begin(), rows.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  if (max_requests > 0 && static_cast<int64_t>(rows.size()) > max_requests)
    rows.resize(static_cast<size_t>(max_requests));
  std::vector<TraceRequest> out;
  out.reserve(rows.size());
  for (const auto& [t, m] : rows) out.push_back({t - rows.front().first, m});
  return out;
}

std::vector<double> read_reload_latencies_ms(const std::string& path) {
  std::ifstream in(path);
  if (!in) SPILLWAY_INPUT_ERROR("{}: cannot open the reload latencies", path);
  std::string line;
  if (!std::getline(in, line)) SPILLWAY_INPUT_ERROR("{}: empty (no header)", path);
  const int vcol = column(split_csv(line), "value", path);
  std::vector<double> out;
  int64_t n = 1;
  while (std::getline(in, line)) {
    ++n;
    if (line.empty()) continue;
    const std::vector<std::string> f = split_csv(line);
    try {
      out.push_back(std::stod(f.at(static_cast<size_t>(vcol))));
    } catch (const std::exception&) {
      SPILLWAY_INPUT_ERROR("{}:{}: value is not a number", path, n);
    }
  }
  return out;
}

std::vector<std::pair<int64_t, int64_t>> draw_token_counts(size_t n, const ReplayOptions& o) {
  if (o.prompt_min < 1 || o.prompt_max < o.prompt_min)
    SPILLWAY_FIELD_ERROR("prompt_max", o.prompt_max, "must be >= prompt_min ({}) >= 1",
                         o.prompt_min);
  if (o.output_min < 1 || o.output_max < o.output_min)
    SPILLWAY_FIELD_ERROR("output_max", o.output_max, "must be >= output_min ({}) >= 1",
                         o.output_min);
  std::mt19937_64 g(o.seed);
  std::lognormal_distribution<double> prompt(std::log(o.prompt_median), o.prompt_sigma);
  std::lognormal_distribution<double> output(std::log(o.output_median), o.output_sigma);
  std::vector<std::pair<int64_t, int64_t>> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t p = std::clamp<int64_t>(std::llround(prompt(g)), o.prompt_min, o.prompt_max);
    const int64_t q = std::clamp<int64_t>(std::llround(output(g)), o.output_min, o.output_max);
    out.emplace_back(p, q);
  }
  return out;
}

std::vector<std::string> models_by_popularity(const std::vector<TraceRequest>& trace) {
  std::map<std::string, int64_t> count;
  for (const TraceRequest& t : trace) ++count[t.model];
  std::vector<std::pair<int64_t, std::string>> by;
  by.reserve(count.size());
  for (const auto& [m, c] : count) by.emplace_back(-c, m);
  std::sort(by.begin(), by.end());
  std::vector<std::string> out;
  out.reserve(by.size());
  for (auto& [c, m] : by) out.push_back(std::move(m));
  return out;
}

}  // namespace spillway
