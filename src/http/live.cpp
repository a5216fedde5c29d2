// Clients of a running server: live replay and the load test (spillway/http/load_clients.hpp, Note
// [Live replay], Note [Load test]).
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "spillway/catalog/model.hpp"
#include "spillway/core/error.hpp"
#include "spillway/http/load_clients.hpp"

namespace spillway::http {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

json get_json(const std::string& url, const std::string& path) {
  httplib::Client cli(url);
  cli.set_connection_timeout(5);
  cli.set_read_timeout(30);
  const httplib::Result r = cli.Get(path);
  if (!r)
    SPILLWAY_INPUT_ERROR("{}{}: no answer ({}): is `spillway serve` running there?", url, path,
                         httplib::to_string(r.error()));
  if (r->status != 200)
    SPILLWAY_INPUT_ERROR("{}{}: HTTP {} ({})", url, path, r->status, r->body.substr(0, 200));
  try {
    return json::parse(r->body);
  } catch (const json::exception& e) {
    SPILLWAY_INPUT_ERROR("{}{}: not JSON ({})", url, path, e.what());
  }
}

// The server's /metrics as name{labels} -> value.
std::map<std::string, double> scrape(const std::string& url) {
  httplib::Client cli(url);
  cli.set_connection_timeout(5);
  cli.set_read_timeout(30);
  const httplib::Result r = cli.Get("/metrics");
  if (!r || r->status != 200)
    SPILLWAY_INPUT_ERROR("{}/metrics: no metrics ({})", url,
                         r ? fmt::format("HTTP {}", r->status) : httplib::to_string(r.error()));
  std::map<std::string, double> out;
  std::istringstream in(r->body);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t sp = line.rfind(' ');
    if (sp == std::string::npos) continue;
    try {
      out[line.substr(0, sp)] = std::stod(line.substr(sp + 1));
    } catch (const std::exception&) {
    }
  }
  return out;
}

double metric(const std::map<std::string, double>& m, const std::string& key) {
  const auto it = m.find(key);
  return it == m.end() ? 0.0 : it->second;
}

// One streamed completion, timed at the client from `due` (the time it was due: its times
// include any wait before this call).
LiveOutcome stream_one(const std::string& url, const LiveRequest& q, double timeout_s,
                       Clock::time_point due) {
  LiveOutcome out;
  out.sent = true;
  json body = {{"model", q.model},
               {"prompt", q.prompt},
               {"max_tokens", q.max_tokens},
               {"temperature", q.temperature},
               {"seed", q.seed},
               {"stream", true}};
  httplib::Client cli(url);
  cli.set_connection_timeout(10);
  cli.set_read_timeout(static_cast<time_t>(timeout_s));
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = body.dump();
  req.set_header("Content-Type", "application/json");
  std::string buf, raw;
  bool finished = false, done = false;
  Clock::time_point first{}, last{};
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    raw.append(data, n);
    buf.append(data, n);
    for (size_t end; (end = buf.find("\n\n")) != std::string::npos;) {
      const std::string ev = buf.substr(0, end);
      buf.erase(0, end + 2);
      if (ev.rfind("data: ", 0) != 0) continue;
      const std::string payload = ev.substr(6);
      if (payload == "[DONE]") {
        done = true;
        continue;
      }
      json j;
      try {
        j = json::parse(payload);
      } catch (const json::exception&) {
        out.error = "an event is not JSON: " + payload.substr(0, 100);
        continue;
      }
      if (j.contains("error")) {
        out.error = j["error"].value("message", "error");
        continue;
      }
      out.id = j.value("id", "");
      const json& c = j["choices"][0];
      const auto now = Clock::now();
      for (const json& t : c["token_ids"]) {
        if (out.tokens.empty()) first = now;
        last = now;
        out.tokens.push_back(t.get<int32_t>());
      }
      if (!c["finish_reason"].is_null()) {
        finished = true;
        if (c.contains("spillway")) {
          out.switched = c["spillway"].value("switched", false);
          out.cold = c["spillway"].value("cold", false);
        }
      }
    }
    return true;
  };
  httplib::Response res;
  httplib::Error err = httplib::Error::Success;
  if (!cli.send(req, res, err)) {
    out.error = "no answer: " + httplib::to_string(err);
    return out;
  }
  out.status = res.status;
  out.e2e_ms = ms_between(due, Clock::now());
  if (res.has_header("Retry-After")) {
    try {
      out.retry_after_s = std::max(0.0, std::stod(res.get_header_value("Retry-After")));
    } catch (const std::exception&) {  // an HTTP date: not used
    }
  }
  if (res.status != 200) {
    try {
      out.error = json::parse(raw)["error"].value("message", raw);
    } catch (const json::exception&) {
      out.error = raw.substr(0, 200);
    }
    return out;
  }
  if (!out.tokens.empty()) out.ttft_ms = ms_between(due, first);
  if (out.tokens.size() >= 2)
    out.tpot_ms = ms_between(first, last) / static_cast<double>(out.tokens.size() - 1);
  out.complete = finished && done && out.error.empty() &&
                 out.tokens.size() == static_cast<size_t>(q.max_tokens);
  if (!out.complete && out.error.empty())
    out.error = fmt::format("incomplete stream: {} of {} tokens, finish {}, [DONE] {}",
                            out.tokens.size(), q.max_tokens, finished, done);
  return out;
}

}  // namespace

std::string server_base_url(const std::string& url, const std::string& flag) {
  auto bad = [&](const std::string& why) {
    throw InputError(flag, "'" + url + "'",
                     why + " (the URL of a `spillway serve`, e.g. http://127.0.0.1:8000 or " +
                         "http://127.0.0.1:8000/v1)");
  };
  const std::string scheme = "http://";
  if (url.rfind("https://", 0) == 0) bad("must be http://: the server speaks plain HTTP");
  if (url.rfind(scheme, 0) != 0) bad("must start with http://");
  const size_t slash = url.find('/', scheme.size());
  const std::string authority = url.substr(scheme.size(), slash - scheme.size());
  std::string path = slash == std::string::npos ? "" : url.substr(slash);
  // host, [v6 host], then :port
  const size_t close = authority.rfind(']');
  const size_t colon = authority.rfind(':');
  const bool has_port = colon != std::string::npos && (close == std::string::npos || colon > close);
  const std::string host = has_port ? authority.substr(0, colon) : authority;
  if (host.empty() || host == "[]") bad("has no host");
  if (host.find_first_of("@?#") != std::string::npos) bad("has a host that is not a host name");
  if (has_port) {
    const std::string port = authority.substr(colon + 1);
    const bool digits = !port.empty() && port.size() <= 5 &&
                        port.find_first_not_of("0123456789") == std::string::npos;
    if (!digits || std::stoi(port) < 1 || std::stoi(port) > 65535)
      bad(fmt::format("has port '{}'; must be in [1, 65535]", port));
  }
  auto strip_slashes = [&] {
    while (!path.empty() && path.back() == '/') path.pop_back();
  };
  strip_slashes();
  if (path == "/v1") path.clear();
  strip_slashes();
  if (!path.empty()) bad(fmt::format("has path '{}'; must be the server's root or /v1", path));
  return scheme + authority;
}

ServerSetup fetch_setup(const std::string& url_given) {
  const std::string url = server_base_url(url_given);
  const json j = get_json(url, "/spillway/setup");
  if (j.value("schema", "") != "spillway.serve-setup/1")
    SPILLWAY_INPUT_ERROR("{}/spillway/setup: not a spillway server's setup (schema {})", url,
                         j.value("schema", "none"));
  ServerSetup s;
  s.hardware = j["hardware"];
  s.profile = j["profile"];
  s.slices = j["slices"];
  s.rate_scale = j["rate_scale"];
  s.memory_scale = j["memory_scale"];
  s.host_budget_bytes = j["host_budget_bytes"];
  s.max_running = j["max_running"];
  s.max_context = j["max_context"];
  s.max_waiting = j["max_waiting"];
  s.ttft_ms = j["ttft_ms"];
  s.tpot_ms = j["tpot_ms"];
  s.alpha = j["alpha"];
  s.link_gbps = j["link_gbps"];
  for (const json& m : j["models"])
    s.models.push_back({m["id"], m["weight_bytes"], m["dtype"], m["vocab_size"], m["config"]});
  if (s.models.empty()) SPILLWAY_INPUT_ERROR("{}: the server serves no model", url);
  return s;
}

std::vector<LiveOutcome> run_live(const std::string& url_given,
                                  const std::vector<LiveRequest>& reqs, const LiveOptions& o) {
  const std::string url = server_base_url(url_given);
  if (o.max_concurrency < 1)
    SPILLWAY_FIELD_ERROR("max_concurrency", o.max_concurrency, "must be >= 1");
  if (!(o.max_seconds > 0) || !std::isfinite(o.max_seconds))
    SPILLWAY_FIELD_ERROR("max_seconds", o.max_seconds, "must be > 0 and finite");
  for (const LiveRequest& q : reqs)
    if (!(q.at_s >= 0) || !std::isfinite(q.at_s))
      SPILLWAY_FIELD_ERROR("at_s", q.at_s, "must be >= 0 and finite (a request's send time)");
  std::vector<LiveOutcome> out(reqs.size());
  std::vector<Clock::time_point> due(reqs.size());  // written before the job is queued
  std::mutex mu;
  std::condition_variable cv;
  std::deque<size_t> jobs;
  int idle = o.max_concurrency;
  bool closing = false;
  std::vector<std::thread> workers;
  workers.reserve(static_cast<size_t>(o.max_concurrency));
  for (int w = 0; w < o.max_concurrency; ++w)
    workers.emplace_back([&] {
      for (;;) {
        size_t k = 0;
        Clock::time_point at{};
        {
          std::unique_lock lk(mu);
          cv.wait(lk, [&] { return closing || !jobs.empty(); });
          if (jobs.empty()) return;
          k = jobs.front();
          jobs.pop_front();
          at = due[k];
        }
        const double late = std::max(0.0, ms_between(at, Clock::now()));
        out[k] = stream_one(url, reqs[k], o.timeout_s, at);
        out[k].late_ms = late;
        {
          std::lock_guard lk(mu);
          ++idle;
        }
        cv.notify_all();
      }
    });
  const auto start = Clock::now();
  for (size_t k = 0; k < reqs.size(); ++k) {
    if (reqs[k].at_s > o.max_seconds) break;  // the rest is not sent (sent stays false)
    const auto at = start + std::chrono::duration_cast<Clock::duration>(
                                std::chrono::duration<double>(reqs[k].at_s));
    std::this_thread::sleep_until(at);
    std::unique_lock lk(mu);
    cv.wait(lk, [&] { return idle > 0; });
    --idle;
    due[k] = at;
    jobs.push_back(k);
    cv.notify_all();
  }
  {
    std::lock_guard lk(mu);
    closing = true;
  }
  cv.notify_all();
  for (std::thread& t : workers) t.join();
  return out;
}

LiveReplayReport replay_live(const std::string& url_given, const std::vector<TraceRequest>& trace,
                             const ReplayOptions& o, const LiveOptions& lo) {
  const std::string url = server_base_url(url_given);
  const ServerSetup setup = fetch_setup(url);
  if (trace.empty()) SPILLWAY_FIELD_ERROR("trace", 0, "must hold at least one request");
  if (!(o.time_scale > 0) || !std::isfinite(o.time_scale))
    SPILLWAY_FIELD_ERROR("time_scale", o.time_scale, "must be > 0 and finite");
  LiveReplayReport rep;
  rep.rate_scale = setup.rate_scale;
  // Lengths that fit the server's context.
  ReplayOptions d = o;
  d.hardware = setup.hardware;
  d.profile = setup.profile;
  d.prompt_max = std::max<int64_t>(1, std::min<int64_t>(o.prompt_max, setup.max_context / 2));
  d.prompt_min = std::min(d.prompt_min, d.prompt_max);
  d.output_max =
      std::max<int64_t>(1, std::min<int64_t>(o.output_max, setup.max_context - d.prompt_max));
  d.output_min = std::min(d.output_min, d.output_max);
  d.ttft_ms = setup.ttft_ms;
  d.tpot_ms = setup.tpot_ms;
  d.architectures.clear();
  double bytes_per_param = 2.0;
  for (const ServedModelSetup& m : setup.models) {
    json cfg;
    try {
      cfg = json::parse(m.config_json);
    } catch (const json::exception& e) {
      SPILLWAY_INPUT_ERROR("{}: model {}'s config is not JSON ({})", url, m.id, e.what());
    }
    ModelConfig mc = parse_model_config(cfg, m.id, url + "/spillway/setup");
    mc.name = m.id;
    bytes_per_param = static_cast<double>(m.weight_bytes) /
                      static_cast<double>(std::max<int64_t>(1, parameter_count(mc)));
    d.architectures.push_back(std::move(mc));
  }
  d.weight_bytes_per_param = bytes_per_param;
  // The trace's model ids by popularity, dealt over the served models.
  const std::vector<std::string> by = models_by_popularity(trace);
  std::map<std::string, size_t> served_of;
  for (size_t i = 0; i < by.size(); ++i) served_of[by[i]] = i % setup.models.size();
  const std::vector<std::pair<int64_t, int64_t>> lengths = draw_token_counts(trace.size(), d);
  std::mt19937_64 g(o.seed ^ 0x5bd1e995u);
  std::vector<LiveRequest> reqs;
  for (size_t i = 0; i < trace.size(); ++i) {
    LiveRequest q;
    q.at_s = trace[i].arrival_s / o.time_scale;
    if (!std::isfinite(q.at_s))
      SPILLWAY_FIELD_ERROR("time_scale", o.time_scale,
                           "puts request {} (at {} s in the trace) at {} s: not a finite time", i,
                           trace[i].arrival_s, q.at_s);
    const ServedModelSetup& m = setup.models[served_of[trace[i].model]];
    q.model = m.id;
    for (int64_t t = 0; t < lengths[i].first; ++t)
      q.prompt.push_back(static_cast<int32_t>(g() % static_cast<uint64_t>(m.vocab)));
    q.max_tokens = static_cast<int>(lengths[i].second);
    q.temperature = 0.0;
    reqs.push_back(std::move(q));
  }
  const std::map<std::string, double> before = scrape(url);
  const auto t0 = Clock::now();
  const std::vector<LiveOutcome> outs = run_live(url, reqs, lo);
  const double window_s = std::max(ms_between(t0, Clock::now()) / 1e3, 1e-9);
  const std::map<std::string, double> after = scrape(url);
  auto delta = [&](const std::string& k) { return metric(after, k) - metric(before, k); };

  ReplayResult live;
  live.name = "live (measured)";
  std::vector<double> ttft, tpot, sw, cold;
  int64_t within = 0;
  for (size_t i = 0; i < outs.size(); ++i) {
    const LiveOutcome& x = outs[i];
    if (!x.sent) {
      ++rep.not_sent;
      continue;
    }
    ++rep.sent;
    rep.max_late_ms = std::max(rep.max_late_ms, x.late_ms);
    if (x.status == 429) ++rep.refused_429;
    if (x.status == 503) ++rep.refused_503;
    if (!x.complete && x.status != 429 && x.status != 503) ++rep.errors;
    if (!x.complete && rep.first_error.empty())
      rep.first_error = fmt::format(
          "request {}: {}{}", i, x.status == 0 ? "" : fmt::format("HTTP {}: ", x.status), x.error);
    if (!x.complete) continue;
    ++live.completed;
    ++rep.answered;
    ttft.push_back(x.ttft_ms);
    if (x.tpot_ms >= 0) tpot.push_back(x.tpot_ms);
    if (x.switched || x.cold) sw.push_back(x.ttft_ms);  // as the simulator counts a switch
    if (x.cold) cold.push_back(x.ttft_ms);
    if (x.ttft_ms <= setup.ttft_ms && x.tpot_ms <= setup.tpot_ms) ++within;
    live.ttft_trace.emplace_back(reqs[i].at_s, x.ttft_ms);
  }
  live.requests = rep.sent;
  live.ttft_ms = latency_stats(ttft);
  live.tpot_ms = latency_stats(tpot);
  live.switch_ttft_ms = latency_stats(sw);
  live.cold_ttft_ms = latency_stats(cold);
  live.slo_attainment =
      rep.sent > 0 ? static_cast<double>(within) / static_cast<double>(rep.sent) : 0.0;
  // A switch as the simulator counts one: a slice given another model, from host memory or
  // from disk.
  live.switches = static_cast<int64_t>(delta("spillway_model_switches_total") +
                                       delta("spillway_cold_loads_total"));
  live.cold_starts = static_cast<int64_t>(delta("spillway_cold_loads_total"));
  live.link_utilization = delta("spillway_link_bytes_total") / (setup.link_gbps * 1e9 * window_s);
  double hbm = 0.0;
  for (int s = 0; s < setup.slices; ++s) {
    const std::string l = fmt::format("{{slice=\"{}\"}}", s);
    const double bw = metric(after, "spillway_slice_hbm_bandwidth_bytes_per_second" + l);
    if (bw > 0) hbm += delta("spillway_slice_hbm_bytes_total" + l) / (bw * window_s);
  }
  live.hbm_utilization = setup.slices > 0 ? hbm / setup.slices : 0.0;
  live.makespan_s = window_s;

  // The simulator on the requests sent, in GPU time, then back to the emulation's.
  ReplayOptions sim = d;
  sim.time_scale = o.time_scale / setup.rate_scale;
  sim.ttft_ms = setup.ttft_ms * setup.rate_scale;
  sim.tpot_ms = setup.tpot_ms * setup.rate_scale;
  sim.host_budget_gb = static_cast<double>(setup.host_budget_bytes) / 1e9;
  sim.disk_gbps = 2.0 / setup.rate_scale;  // a local disk at ~2 GB/s, in GPU time
  sim.efficiency = 1.0;                    // the emulated slices compute at their peak
  sim.baselines = false;
  if (rep.sent == 0)
    SPILLWAY_FIELD_ERROR("max_seconds", lo.max_seconds,
                         "no request of the trace arrives this early (time scale {})",
                         o.time_scale);
  // Requests are sent in arrival order: the ones not sent are the tail. The simulator sees
  // the served models (the trace's ids replaced by the model each was dealt), each with its
  // own architecture: the simulator deals architectures over models by popularity, so they
  // are listed in that order.
  std::vector<TraceRequest> sent(trace.begin(), trace.begin() + static_cast<long>(rep.sent));
  for (size_t i = 0; i < sent.size(); ++i) sent[i].model = reqs[i].model;
  sim.architectures.clear();
  for (const std::string& m : models_by_popularity(sent))
    for (size_t i = 0; i < setup.models.size(); ++i)
      if (setup.models[i].id == m) sim.architectures.push_back(d.architectures[i]);
  ReplayResult pred = run_replay(sent, sim).front();
  pred.name = "simulator (predicted)";
  const double k = 1.0 / setup.rate_scale;
  for (LatencyStats* l : {&pred.ttft_ms, &pred.tpot_ms, &pred.switch_ttft_ms, &pred.cold_ttft_ms})
    *l = {l->p50 * k, l->p95 * k, l->p99 * k};
  pred.makespan_s *= k;
  for (auto& [t, y] : pred.ttft_trace) {
    t *= k;
    y *= k;
  }
  rep.results = {live, pred};
  rep.sim = d;
  return rep;
}

std::string format_live_replay(const LiveReplayReport& r, int64_t distinct_models) {
  if (r.answered == 0)  // nothing measured: no TTFT, TPOT or SLO figure to print
    return fmt::format(
        "live: {} sent ({} not sent: past --max-seconds), none answered: {} refused 429, {} "
        "refused 503, {} errors; nothing measured\n",
        r.sent, r.not_sent, r.refused_429, r.refused_503, r.errors);
  std::string s = format_replay(r.results, r.sim, distinct_models);
  s += fmt::format(
      "live: {} sent ({} not sent: past --max-seconds), {} answered, {} refused 429, {} "
      "refused 503, {} errors (each not answered is an SLO miss); TTFT from each request's "
      "arrival time, including up to {:.1f} ms waiting for a client thread "
      "(--max-concurrency)\n"
      "predicted: the simulator on the same requests and setup at the GPU's rates, its times "
      "divided by the server's rate scale ({:g})\n",
      r.sent, r.not_sent, r.answered, r.refused_429, r.refused_503, r.errors, r.max_late_ms,
      r.rate_scale);
  return s;
}

std::string live_replay_failure(const LiveReplayReport& r) {
  if (r.answered == r.sent) return {};
  std::vector<std::string> why;
  if (r.refused_429 > 0)
    why.push_back(
        fmt::format("{} refused with 429 (the server's queue was full: its "
                    "--max-waiting; requests are not retried in a replay)",
                    r.refused_429));
  if (r.refused_503 > 0) why.push_back(fmt::format("{} refused with 503", r.refused_503));
  if (r.errors > 0) why.push_back(fmt::format("{} failed", r.errors));
  return fmt::format("replay --live: {} of {} requests sent were not answered: {}; first: {}",
                     r.sent - r.answered, r.sent, fmt::join(why, ", "), r.first_error);
}

std::string live_replay_json(const LiveReplayReport& r) {
  json j = json::parse(replay_json(r.results, r.sim));
  j["schema"] = "spillway.replay-live/1";
  j["live"] = {{"sent", r.sent},
               {"not_sent", r.not_sent},
               {"refused_429", r.refused_429},
               {"refused_503", r.refused_503},
               {"errors", r.errors},
               {"answered", r.answered},
               {"max_late_ms", r.max_late_ms},
               {"rate_scale", r.rate_scale}};
  if (r.answered == 0)  // nothing measured live: no figure
    for (const char* k : {"ttft_ms", "tpot_ms", "slo_attainment", "switch_ttft_ms", "cold_ttft_ms"})
      j["configurations"][0][k] = nullptr;
  return j.dump(2) + "\n";
}

LoadReport run_load(const std::string& url_given, const LoadOptions& o) {
  const std::string url = server_base_url(url_given);
  if (o.clients < 1) SPILLWAY_FIELD_ERROR("clients", o.clients, "must be >= 1");
  if (o.requests < 1) SPILLWAY_FIELD_ERROR("requests", o.requests, "must be >= 1");
  if (o.distinct < 1) SPILLWAY_FIELD_ERROR("distinct", o.distinct, "must be >= 1");
  if (o.max_retries < 0) SPILLWAY_FIELD_ERROR("max_retries", o.max_retries, "must be >= 0");
  if (!(o.max_retry_s >= 0) || !std::isfinite(o.max_retry_s))
    SPILLWAY_FIELD_ERROR("max_retry_s", o.max_retry_s, "must be >= 0 and finite");
  if (!(o.timeout_s > 0) || !std::isfinite(o.timeout_s))
    SPILLWAY_FIELD_ERROR("timeout_s", o.timeout_s, "must be > 0 and finite");
  const ServerSetup setup = fetch_setup(url);
  if (static_cast<int64_t>(o.prompt_tokens) + o.max_tokens > setup.max_context)
    SPILLWAY_FIELD_ERROR("prompt_tokens", o.prompt_tokens,
                         "+ max_tokens {} exceeds the server's context of {}", o.max_tokens,
                         setup.max_context);
  // The distinct (model, prompt, seed) triples.
  std::vector<LiveRequest> triples;
  for (int i = 0; i < o.distinct; ++i) {
    LiveRequest q;
    const ServedModelSetup& m = setup.models[static_cast<size_t>(i) % setup.models.size()];
    q.model = m.id;
    std::mt19937_64 g(o.seed * 1000003u + static_cast<uint64_t>(i));
    for (int t = 0; t < o.prompt_tokens; ++t)
      q.prompt.push_back(static_cast<int32_t>(g() % static_cast<uint64_t>(m.vocab)));
    q.max_tokens = o.max_tokens;
    q.temperature = 0.8;
    q.seed = o.seed * 7919u + static_cast<uint64_t>(i);
    triples.push_back(std::move(q));
  }
  std::vector<LiveOutcome> outs(static_cast<size_t>(o.requests));
  std::atomic<int> next{0};
  // Requests in a row that gave up on 429 (Note [Load test]); a complete answer resets it.
  std::atomic<int> gave_up_in_a_row{0};
  std::atomic<bool> stop{false};
  const auto t0 = Clock::now();
  std::vector<std::thread> clients;
  clients.reserve(static_cast<size_t>(o.clients));
  for (int c = 0; c < o.clients; ++c)
    clients.emplace_back([&] {
      for (int k; !stop && (k = next++) < o.requests;) {
        const LiveRequest& q = triples[static_cast<size_t>(k % o.distinct)];
        LiveOutcome x;
        const auto first_try = Clock::now();
        int retries = 0;
        for (;; ++retries) {
          x = stream_one(url, q, o.timeout_s, first_try);
          if (x.status != 429) break;
          if (retries >= o.max_retries) {
            x.error = fmt::format("still 429 after {} retries (--max-retries {}): {}", retries,
                                  o.max_retries, x.error);
            break;
          }
          double wait_ms = std::min(20.0 * std::pow(2.0, std::min(retries, 10)), 1000.0);
          if (x.retry_after_s >= 0) wait_ms = std::min(wait_ms, x.retry_after_s * 1e3);
          const double tried_ms = ms_between(first_try, Clock::now());
          if (tried_ms + wait_ms > o.max_retry_s * 1e3) {
            x.error =
                fmt::format("still 429 after {} retries in {:.1f} s (--max-retry-seconds {:g}): {}",
                            retries, tried_ms / 1e3, o.max_retry_s, x.error);
            break;
          }
          std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(wait_ms));
        }
        x.retries = retries;
        if (x.complete) {
          gave_up_in_a_row = 0;
        } else if (x.status == 429 && ++gave_up_in_a_row >= o.clients) {
          stop = true;
        }
        outs[static_cast<size_t>(k)] = std::move(x);
      }
    });
  for (std::thread& t : clients) t.join();
  LoadReport r;
  r.seconds = ms_between(t0, Clock::now()) / 1e3;
  r.requests = o.requests;
  std::set<std::string> ids;
  std::map<int, const LiveOutcome*> first;
  std::set<int> repeated;
  std::vector<double> lat, ttft;
  auto problem = [&](std::string p) {
    if (r.problems.size() < 10) r.problems.push_back(std::move(p));
  };
  for (int k = 0; k < o.requests; ++k) {
    const LiveOutcome& x = outs[static_cast<size_t>(k)];
    r.retries_429 += x.retries;
    r.max_retries_used = std::max(r.max_retries_used, x.retries);
    if (!x.complete) {
      ++r.lost;
      if (!x.sent) {
        ++r.not_sent;
        continue;
      }
      if (x.status == 429) ++r.refused_429;
      problem(fmt::format("request {}: {}{}", k,
                          x.status == 0 ? "" : fmt::format("HTTP {}: ", x.status), x.error));
      continue;
    }
    ++r.answered;
    if (!ids.insert(x.id).second) {
      ++r.duplicated;
      problem(fmt::format("request {}: response id {} seen twice", k, x.id));
    }
    lat.push_back(x.e2e_ms);
    ttft.push_back(x.ttft_ms);
    const int t = k % o.distinct;
    const auto it = first.find(t);
    if (it == first.end()) {
      first[t] = &x;
      continue;
    }
    ++r.answers_compared;
    repeated.insert(t);
    if (it->second->tokens != x.tokens) {
      ++r.inconsistent;
      problem(
          fmt::format("request {}: tokens differ from the first answer to the same model, "
                      "prompt and seed",
                      k));
    }
  }
  r.triples_compared = static_cast<int64_t>(repeated.size());
  if (r.not_sent > 0)
    r.stopped = fmt::format(
        "{} requests in a row were still refused with 429 after their retries: the server "
        "refuses everything (is its --max-waiting too small?), so the last {} were not sent",
        o.clients, r.not_sent);
  r.latency_ms = latency_stats(lat);
  r.ttft_ms = latency_stats(ttft);
  return r;
}

std::string format_load(const LoadReport& r, const LoadOptions& o) {
  std::string s = fmt::format(
      "load: {} requests from {} clients ({} distinct model/prompt/seed triples sampled at "
      "temperature 0.8, {} prompt tokens, {} new) in {:.2f} s\n"
      "  answered {} / {}, lost {}, duplicated {}, inconsistent {}, 429s retried {} (at most "
      "{} for one request; --max-retries {}, --max-retry-seconds {:g})\n",
      r.requests, o.clients, o.distinct, o.prompt_tokens, o.max_tokens, r.seconds, r.answered,
      r.requests, r.lost, r.duplicated, r.inconsistent, r.retries_429, r.max_retries_used,
      o.max_retries, o.max_retry_s);
  if (r.answered > 0)
    s += fmt::format(
        "  from each request's first try: latency ms p50 {:.1f}  p95 {:.1f}  p99 {:.1f};  TTFT "
        "ms p50 {:.1f}  p95 {:.1f}  p99 {:.1f}\n",
        r.latency_ms.p50, r.latency_ms.p95, r.latency_ms.p99, r.ttft_ms.p50, r.ttft_ms.p95,
        r.ttft_ms.p99);
  for (const std::string& p : r.problems) s += "  problem: " + p + "\n";
  if (!r.stopped.empty()) s += "  stopped: " + r.stopped + "\n";
  const std::string failure = load_failure(r, o);
  if (!failure.empty()) return s + "  FAILED: " + failure + "\n";
  s += "  every request answered once; ";
  s += r.triples_compared > 0
           ? fmt::format(
                 "{} triples answered more than once: every one of their {} repeated answers "
                 "the same tokens as the triple's first\n",
                 r.triples_compared, r.answers_compared)
           : fmt::format(
                 "no triple was answered twice (--distinct {} with --requests {}): the "
                 "answers' determinism was NOT checked\n",
                 o.distinct, o.requests);
  return s;
}

std::string load_failure(const LoadReport& r, const LoadOptions& o) {
  std::vector<std::string> why;
  if (r.lost > 0) {
    std::vector<std::string> lost;
    if (r.refused_429 > 0)
      lost.push_back(
          fmt::format("{} refused with 429 after their retries (--max-retries {}, "
                      "--max-retry-seconds {:g})",
                      r.refused_429, o.max_retries, o.max_retry_s));
    const int64_t failed = r.lost - r.refused_429 - r.not_sent;
    if (failed > 0) lost.push_back(fmt::format("{} failed (see the problems)", failed));
    if (r.not_sent > 0)
      lost.push_back(fmt::format("{} not sent (the server refused everything)", r.not_sent));
    why.push_back(fmt::format("{} of {} requests not answered: {}", r.lost, r.requests,
                              fmt::join(lost, ", ")));
  }
  if (r.duplicated > 0) why.push_back(fmt::format("{} response ids seen twice", r.duplicated));
  if (r.inconsistent > 0)
    why.push_back(fmt::format("{} answers differ from their triple's first", r.inconsistent));
  return fmt::format("{}", fmt::join(why, "; "));
}

}  // namespace spillway::http
