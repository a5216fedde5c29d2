// `spillway serve`: the live OpenAI-compatible server over emulated MIG slices
// (spillway/inference/inference.hpp, spillway/http/http_server.hpp); `spillway checkpoint`: a
// reference-model checkpoint directory to serve.
#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <thread>

#include "cli/commands.hpp"
#include "spillway/core/error.hpp"
#include "spillway/http/http_server.hpp"
#include "spillway/http/load_clients.hpp"
#include "spillway/inference/inference.hpp"

namespace spillway::cli {
namespace {

namespace fs = std::filesystem;

DType parse_dtype(const std::string& s) {
  if (s == "fp32") return DType::kFp32;
  if (s == "bf16") return DType::kBf16;
  SPILLWAY_INPUT_ERROR("--dtype: '{}'; fp32 or bf16", s);
}

// The signals that drain the server (Note [Serve signals]); kDrainDone is no signal.
constexpr int kDrainSignals[] = {SIGTERM, SIGINT, SIGHUP};
constexpr unsigned char kDrainDone = 255;

const char* signal_name(int sig) {
  switch (sig) {
    case SIGTERM:
      return "SIGTERM";
    case SIGINT:
      return "SIGINT";
    case SIGHUP:
      return "SIGHUP";
    default:
      return "a signal";
  }
}

// An address as a URL writes it: an IPv6 one in brackets (http://[::1]:8000).
std::string url_host(const std::string& host) {
  if (host.find(':') != std::string::npos && host.front() != '[') return "[" + host + "]";
  return host;
}

// Note [Checkpoint --out]: a checkpoint goes into a new or empty directory. One that holds
// a model (config.json or model.safetensors) is replaced only with --force, and then only
// those two files; a directory holding anything else is refused even with --force (it is
// not a model's: `--out /` or `--out ~` would scatter the files among the user's), as is
// the root itself.
void check_checkpoint_out(const std::string& out, bool force) {
  std::error_code ec;
  const fs::file_status status = fs::status(out, ec);
  if (ec && ec != std::errc::no_such_file_or_directory)
    SPILLWAY_INPUT_ERROR("--out: cannot read '{}': {}", out, ec.message());
  if (!fs::exists(status)) return;  // created
  if (!fs::is_directory(status))
    SPILLWAY_INPUT_ERROR("--out: '{}' exists and is not a directory", out);
  const fs::path canonical = fs::weakly_canonical(out, ec);
  if (!ec && canonical == canonical.root_path())
    SPILLWAY_INPUT_ERROR("--out: '{}' is the root directory; give a new directory for the model",
                         out);
  bool model = false;
  std::vector<std::string> others;
  for (fs::directory_iterator it(out, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name == "config.json" || name == "model.safetensors") {
      model = true;
    } else {
      others.push_back(name);
    }
  }
  if (ec) SPILLWAY_INPUT_ERROR("--out: cannot list '{}': {}", out, ec.message());
  if (!model && others.empty()) return;  // empty
  if (!model) {
    std::sort(others.begin(), others.end());
    SPILLWAY_INPUT_ERROR(
        "--out: '{}' is not empty and holds no model (it has '{}'{}); give a new or empty "
        "directory (--force replaces only a model directory's config.json and "
        "model.safetensors)",
        out, others.front(),
        others.size() > 1 ? fmt::format(" and {} more", others.size() - 1) : "");
  }
  if (!force)
    SPILLWAY_INPUT_ERROR(
        "--out: '{}' already holds a model (config.json, model.safetensors); --force replaces "
        "it",
        out);
}

void remove_demo_dir(const fs::path& p) {
  std::error_code ec;
  if (!p.empty()) fs::remove_all(p, ec);
}

}  // namespace

void add_serve_command(CLI::App& app) {
  overview_line("serve", Group::kServe,
                "serve models over HTTP (OpenAI API), weights in host memory");
  struct State {
    inference::EngineOptions o;
    http::HttpOptions http;
    std::string models;
    std::string port_file;
    double host_budget_mb = 1024;
    double drain_seconds = 30;
  };
  auto st = std::make_shared<State>();
  CLI::App* cmd = app.add_subcommand(
      "serve",
      "Serves models over HTTP with the OpenAI completions API, host-resident: every model's "
      "weights stay in host memory (the pool), and each MIG slice of the emulated GPU computes "
      "from them in place with HybridGEMM (no weight is loaded into the slice's memory, which "
      "holds the KV cache). The Scheduler places each request on a slice (routing, link "
      "demand, eviction of idle models, prefill chunk), each slice batches its requests "
      "continuously, and the alpha controller tunes HybridGEMM per slice. The slices and the "
      "link are emulated on this machine with every rate times --rate-scale: times are the "
      "GPU's divided by it.\n\n"
      "Models: --models DIR, one subdirectory per model with config.json and its weights "
      "(model.safetensors, or model.safetensors.index.json and its shards): Hugging Face "
      "directories as downloaded (Llama, Qwen2/3, Qwen MoE, Mistral, Mixtral, Gemma 2/3; "
      "with tokenizer.json and a chat template they serve text and chat) or `spillway "
      "checkpoint`'s; a directory that cannot be served is listed with the reason and the "
      "rest are served. Without --models, two demo models (tiny-moe, seeds 1 and 2) are "
      "written to a temporary directory.\n\n"
      "Endpoints: POST /v1/chat/completions (messages, tools, max_tokens or "
      "max_completion_tokens, temperature, top_p, seed, stop, stream: for models with a "
      "tokenizer and a chat template; the OpenAI client works), POST /v1/completions (model, "
      "prompt: text (a byte-level model's bytes, or the model's tokenizer) or token ids, "
      "max_tokens, temperature, top_p, seed, stop, logprobs, stream, stream_options), GET "
      "/v1/models, GET "
      "/v1/models/{id}, GET /metrics (Prometheus), GET /health. Bad requests: 400 naming the "
      "field (an unknown field too); unknown model: 404; wrong method: 405; a body over 1 MiB: "
      "413; a compressed body: 415; more than --max-waiting requests queued: 429; shutting "
      "down, or a model whose checkpoint changed on disk and cannot be served: 503 with the "
      "reason. SIGTERM, SIGHUP or Ctrl-C "
      "drains: no new request is taken and every accepted one is answered before the server "
      "exits, for up to --drain-seconds; what is still running then is cut (its client sees "
      "the stream end with an error, or a 503), and a second signal cuts at once (exit 128 + "
      "the signal). The demo models' temporary directory is removed at exit.\n\n"
      "Examples:\n"
      "  spillway serve\n"
      "  curl -s localhost:8000/v1/completions -d '{\"model\": \"tiny-moe-a\", \"prompt\": "
      "\"Hello\", \"max_tokens\": 8, \"temperature\": 0}'\n"
      "  spillway checkpoint --config tiny-moe --seed 3 --out models/tiny-c\n"
      "  spillway serve --models models --port 0 --port-file port.txt --profile 3g.48gb");
  cmd->add_option("--models", st->models,
                  "Directory of models (subdirectories with config.json and their weights)");
  cmd->add_option("--host", st->http.host, "Address to listen on")->capture_default_str();
  in_range(
      cmd->add_option("--port", st->http.port, "Port (0: any free port)")->capture_default_str(),
      closed(0, 65535));
  cmd->add_option("--port-file", st->port_file,
                  "Write the port listened on to FILE once listening (with --port 0)");
  in_range(cmd->add_option("--threads", st->http.threads,
                           "Connection threads (0: slices x max-running + max-waiting + 8)")
               ->capture_default_str(),
           closed(0, 4096));
  cmd->add_option("--hardware", st->o.hardware, "The GPU (catalog name)")->capture_default_str();
  cmd->add_option("--profile", st->o.profile,
                  "The MIG profile every slice has (7g.96gb: the whole GPU)")
      ->capture_default_str();
  in_range(cmd->add_option("--rate-scale", st->o.rate_scale,
                           "Every emulated rate (link, HBM, compute) times this")
               ->capture_default_str(),
           closed(kMinRateScale, 1));
  in_range(cmd->add_option("--memory-scale", st->o.memory_scale, "Every slice's memory times this")
               ->capture_default_str(),
           open_closed(0, 1));
  in_range(cmd->add_option("--host-budget-mb", st->host_budget_mb,
                           "Host memory for the models' weights, MiB (least recently used idle "
                           "models are evicted)")
               ->capture_default_str(),
           open_closed(0, 1e9));
  in_range(cmd->add_option("--max-running", st->o.max_running, "Requests a slice decodes together")
               ->capture_default_str(),
           closed(1, 1024));
  in_range(cmd->add_option("--max-context", st->o.max_context,
                           "Tokens of one request (prompt and output)")
               ->capture_default_str(),
           closed(2, 1 << 20));
  in_range(cmd->add_option("--max-step-tokens", st->o.max_step_tokens,
                           "Tokens of one decoder step (>= 2 x max-running)")
               ->capture_default_str(),
           closed(2, 1 << 20));
  in_range(cmd->add_option("--max-waiting", st->o.max_waiting,
                           "Requests queued for a slice before new ones get 429")
               ->capture_default_str(),
           closed(1, 1 << 20));
  in_range(cmd->add_option("--ttft-ms", st->o.ttft_ms, "TTFT target (scheduler, SLO)")
               ->capture_default_str(),
           open_closed(0, 1e9));
  in_range(cmd->add_option("--tpot-ms", st->o.tpot_ms, "TPOT target (scheduler, SLO)")
               ->capture_default_str(),
           open_closed(0, 1e9));
  in_range(cmd->add_option("--drain-seconds", st->drain_seconds,
                           "On SIGTERM, SIGHUP or Ctrl-C: the longest the requests in flight may "
                           "take to finish; those left are then cut (a second signal cuts at "
                           "once)")
               ->capture_default_str(),
           open_closed(0, 3600));
  in_range(cmd->add_option("--alpha", st->o.alpha,
                           "HybridGEMM's alpha on every slice; < 0: the controller adapts it")
               ->capture_default_str(),
           closed(-1, 1));
  cmd->callback([st]() {
    st->o.host_budget_bytes = static_cast<int64_t>(st->host_budget_mb * kMiB);
    // Note [Serve signals]: SIGTERM, SIGINT and SIGHUP drain. A handler (whichever thread the
    // signal lands on: libraries such as OpenBLAS start threads of their own) writes the
    // signal to a pipe; one thread reads it and starts the drain, bounded by
    // --drain-seconds (Note [Bounded drain] in spillway/http/http_server.hpp), then reads on: a
    // second signal before the drain has ended exits at once (128 + the signal), saying
    // how many requests it cut; kDrainDone says the drain ended by itself.
    static int signal_pipe[2] = {-1, -1};
    if (::pipe(signal_pipe) != 0)
      SPILLWAY_INPUT_ERROR("serve: cannot create a pipe: {}", std::strerror(errno));
    struct sigaction sa {};
    sa.sa_handler = [](int sig) {
      const int saved = errno;
      const unsigned char b = static_cast<unsigned char>(sig);
      (void)!::write(signal_pipe[1], &b, 1);
      errno = saved;
    };
    sigemptyset(&sa.sa_mask);
    for (int sig : kDrainSignals) sigaction(sig, &sa, nullptr);
    std::string dir = st->models;
    fs::path demo;
    struct RemoveDemo {
      fs::path p;
      ~RemoveDemo() { remove_demo_dir(p); }
    } remove_demo{};
    if (dir.empty()) {
      demo = fs::temp_directory_path() / fmt::format("spillway-serve-{}", ::getpid());
      remove_demo.p = demo;
      inference::write_checkpoint("tiny-moe", 1, (demo / "tiny-moe-a").string(), DType::kFp32);
      inference::write_checkpoint("tiny-moe", 2, (demo / "tiny-moe-b").string(), DType::kFp32);
      dir = demo.string();
      std::printf(
          "spillway serve: no --models: demo models tiny-moe-a and tiny-moe-b (the "
          "tiny-moe reference model, seeds 1 and 2) in %s (removed at exit)\n",
          dir.c_str());
    }
    // Note [Refused model directories]: the servable models are served, each refused one is
    // listed with its reason; none servable is an error listing them all.
    inference::ModelScan scan = inference::scan_models(dir);
    if (scan.models.empty() && scan.refused.empty()) (void)inference::find_models(dir);  // why
    inference::EngineOptions engine_options = st->o;
    engine_options.skip_refused = true;
    inference::ServingEngine engine(scan.models, engine_options, std::move(scan.refused));
    http::HttpServer http(engine, st->http);
    for (const inference::ServedModelInfo& m : engine.models())
      std::printf("  model %s: %s, %d layers, vocab %d, %.1f MB %s; text: %s\n", m.name.c_str(),
                  m.family.c_str(), m.layers, m.vocab, static_cast<double>(m.weight_bytes) / 1e6,
                  to_string(m.dtype).c_str(), m.text.c_str());
    for (const inference::RefusedModel& r : engine.refused())
      std::printf("  refused %s: %s\n", r.name.c_str(), r.why.c_str());
    std::printf("  %d slices of %s %s, rates x %g; alpha %s\n", engine.slices(),
                st->o.hardware.c_str(), st->o.profile.c_str(), st->o.rate_scale,
                st->o.alpha < 0 ? "adaptive" : fmt::format("{}", st->o.alpha).c_str());
    // The port file before the line that says the server listens: a port file that cannot
    // be written (a directory, a full disk) stops the server, naming the path and why.
    if (!st->port_file.empty()) {
      try {
        write_output(st->port_file, fmt::format("{}\n", http.port()));
      } catch (const Error& e) {
        SPILLWAY_INPUT_ERROR("--port-file: {}", e.what());
      }
    }
    std::printf(
        "spillway serve: listening on http://%s:%d (SIGTERM, SIGHUP or Ctrl-C drains for up "
        "to %g s and exits)\n",
        url_host(st->http.host).c_str(), http.port(), st->drain_seconds);
    std::fflush(stdout);
    const auto deadline = std::chrono::milliseconds(static_cast<int64_t>(st->drain_seconds * 1e3));
    http::HttpServer::DrainReport report;
    int drain_signal = 0;
    std::thread signals([&] {
      const auto read_byte = [] {
        unsigned char b = 0;
        while (::read(signal_pipe[0], &b, 1) < 0 && errno == EINTR) {
        }
        return static_cast<int>(b);
      };
      const int sig = read_byte();
      if (sig == 0) return;  // the server stopped by itself
      drain_signal = sig;
      std::printf(
          "spillway serve: %s: draining %lld requests in flight (up to %g s, --drain-seconds; "
          "a second signal ends at once)...\n",
          signal_name(sig), static_cast<long long>(engine.in_flight()), st->drain_seconds);
      std::fflush(stdout);
      std::thread drainer([&] {
        report = http.shutdown(deadline);
        const unsigned char done = kDrainDone;
        (void)!::write(signal_pipe[1], &done, 1);
      });
      for (;;) {
        const int next = read_byte();
        if (next == kDrainDone) break;
        if (next == 0) continue;  // run() returned: the drain's own stop; its end follows
        // A second signal: the drain is abandoned, and so is every request still in it.
        std::printf(
            "spillway serve: a second signal (%s) during the drain: exiting at once, cutting "
            "%lld requests in flight\n",
            signal_name(next), static_cast<long long>(engine.in_flight()));
        std::fflush(stdout);
        remove_demo_dir(demo);
        std::_Exit(128 + next);
      }
      drainer.join();
    });
    http.run();
    if (!engine.draining()) {  // stopped without a signal: release the signal thread
      const unsigned char zero = 0;
      (void)!::write(signal_pipe[1], &zero, 1);
    }
    signals.join();
    for (int sig : kDrainSignals) signal(sig, SIG_DFL);
    if (drain_signal != 0) {
      if (report.cut == 0) {
        std::printf("spillway serve: drained all %lld requests that were in flight\n",
                    static_cast<long long>(report.in_flight));
      } else {
        std::printf(
            "spillway serve: cut %lld of the %lld requests in flight at the %g s deadline "
            "(--drain-seconds)\n",
            static_cast<long long>(report.cut), static_cast<long long>(report.in_flight),
            st->drain_seconds);
      }
    }
    const inference::EngineMetrics m = engine.metrics();
    std::printf(
        "spillway serve: drained; %lld requests answered, %lld tokens generated, %lld "
        "refused as overloaded\n",
        static_cast<long long>(m.requests.at("ok")), static_cast<long long>(m.tokens_generated),
        static_cast<long long>(m.requests.at("overloaded")));
    std::fflush(stdout);
  });
}

// `spillway load` (a client of the server, beside `replay --live`): cmd_replay.cpp.

void add_checkpoint_command(CLI::App& app) {
  overview_line("checkpoint", Group::kServe, "write a servable checkpoint of the reference model");
  struct State {
    std::string config = "tiny-moe";
    uint64_t seed = 1;
    std::string out;
    std::string dtype = "fp32";
    bool force = false;
  };
  auto st = std::make_shared<State>();
  CLI::App* cmd = app.add_subcommand(
      "checkpoint",
      "Writes a servable checkpoint of the reference model: OUT/config.json and "
      "OUT/model.safetensors with its weights initialized from --seed (the tensors named as "
      "transformers names them for the config's architecture: q, k, v apart, a tied head left "
      "to the embedding; transformers' from_pretrained loads it). `spillway "
      "serve --models DIR` serves every such directory under DIR. OUT must be new or empty; "
      "one that already holds a model (config.json, model.safetensors) is replaced only with "
      "--force, and a directory holding anything else (or /) never.\n\n"
      "Examples:\n"
      "  spillway checkpoint --out models/tiny-a\n"
      "  spillway checkpoint --config small-moe --seed 7 --dtype bf16 --out models/small-7");
  cmd->add_option("--config", st->config,
                  "An embedded reference config (tiny-moe, small-moe) or a config.json")
      ->capture_default_str();
  in_range(cmd->add_option("--seed", st->seed, "Seed of the weights")->capture_default_str(),
           closed(0, 4294967295.0));
  cmd->add_option("--out", st->out, "The model's directory (created; new or empty)")->required();
  cmd->add_option("--dtype", st->dtype, "fp32 or bf16")->capture_default_str();
  cmd->add_flag("--force", st->force,
                "Replace the model (config.json, model.safetensors) already in --out");
  cmd->callback([st]() {
    const DType dt = parse_dtype(st->dtype);
    check_checkpoint_out(st->out, st->force);
    inference::write_checkpoint(st->config, st->seed, st->out, dt);
    const auto bytes = fs::file_size(fs::path(st->out) / "model.safetensors");
    std::printf("wrote %s/config.json and %s/model.safetensors (%s, %.2f MB)\n", st->out.c_str(),
                st->out.c_str(), st->dtype.c_str(), static_cast<double>(bytes) / 1e6);
  });
}

}  // namespace spillway::cli
