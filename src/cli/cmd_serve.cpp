// `spillway serve`: the live OpenAI-compatible server over emulated MIG slices
// (spillway/server.hpp, spillway/http_server.hpp); `spillway checkpoint`: a reference-model
// checkpoint directory to serve.
#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <thread>

#include "cli/commands.hpp"
#include "spillway/error.hpp"
#include "spillway/http_server.hpp"
#include "spillway/live.hpp"
#include "spillway/server.hpp"

namespace spillway::cli {
namespace {

namespace fs = std::filesystem;

DType parse_dtype(const std::string& s) {
  if (s == "fp32") return DType::kFp32;
  if (s == "bf16") return DType::kBf16;
  SPILLWAY_INPUT_ERROR("--dtype: '{}'; fp32 or bf16", s);
}

}  // namespace

void add_serve_command(CLI::App& app) {
  struct State {
    server::EngineOptions o;
    server::HttpOptions http;
    std::string models;
    std::string port_file;
    double host_budget_mb = 1024;
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
      "Models: --models DIR, one subdirectory per model with config.json (a reference-model "
      "config) and model.safetensors (`spillway checkpoint` writes one); without --models, two "
      "demo models (tiny-moe, seeds 1 and 2) are written to a temporary directory.\n\n"
      "Endpoints: POST /v1/completions (model, prompt: a string of bytes or token ids, "
      "max_tokens, temperature, seed, stream), GET /v1/models, GET /metrics (Prometheus), "
      "GET /health. Bad requests: 400 naming the field; unknown model: 404; more than "
      "--max-waiting requests queued: 429; shutting down: 503. SIGTERM or Ctrl-C drains: "
      "no new request is taken and every accepted one is answered before the server exits.\n\n"
      "Examples:\n"
      "  spillway serve\n"
      "  curl -s localhost:8000/v1/completions -d '{\"model\": \"tiny-moe-a\", \"prompt\": "
      "\"Hello\", \"max_tokens\": 8, \"temperature\": 0}'\n"
      "  spillway checkpoint --config tiny-moe --seed 3 --out models/tiny-c\n"
      "  spillway serve --models models --port 0 --port-file port.txt --profile 2g.24gb");
  cmd->add_option("--models", st->models,
                  "Directory of models (subdirectories with config.json and model.safetensors)");
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
           open_closed(0, 1));
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
           closed(0, 1 << 20));
  in_range(cmd->add_option("--ttft-ms", st->o.ttft_ms, "TTFT target (scheduler, SLO)")
               ->capture_default_str(),
           open_closed(0, 1e9));
  in_range(cmd->add_option("--tpot-ms", st->o.tpot_ms, "TPOT target (scheduler, SLO)")
               ->capture_default_str(),
           open_closed(0, 1e9));
  in_range(cmd->add_option("--alpha", st->o.alpha,
                           "HybridGEMM's alpha on every slice; < 0: the controller adapts it")
               ->capture_default_str(),
           closed(-1, 1));
  cmd->callback([st]() {
    st->o.host_budget_bytes = static_cast<int64_t>(st->host_budget_mb * kMiB);
    // SIGTERM and SIGINT: a handler (whichever thread the signal lands on: libraries such as
    // OpenBLAS start threads of their own) writes the signal to a pipe; one thread reads it
    // and drains the server.
    static int signal_pipe[2] = {-1, -1};
    if (::pipe(signal_pipe) != 0) SPILLWAY_INPUT_ERROR("serve: cannot create a pipe");
    struct sigaction sa {};
    sa.sa_handler = [](int sig) {
      const unsigned char b = static_cast<unsigned char>(sig);
      (void)!::write(signal_pipe[1], &b, 1);
    };
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, nullptr);
    sigaction(SIGINT, &sa, nullptr);
    std::string dir = st->models;
    fs::path demo;
    if (dir.empty()) {
      demo = fs::temp_directory_path() / fmt::format("spillway-serve-{}", ::getpid());
      server::write_checkpoint("tiny-moe", 1, (demo / "tiny-moe-a").string(), DType::kFp32);
      server::write_checkpoint("tiny-moe", 2, (demo / "tiny-moe-b").string(), DType::kFp32);
      dir = demo.string();
      std::printf(
          "spillway serve: no --models: demo models tiny-moe-a and tiny-moe-b (the "
          "tiny-moe reference model, seeds 1 and 2) in %s\n",
          dir.c_str());
    }
    struct RemoveDemo {
      fs::path p;
      ~RemoveDemo() {
        std::error_code ec;
        if (!p.empty()) fs::remove_all(p, ec);
      }
    } remove_demo{demo};
    const std::vector<server::ModelFiles> models = server::find_models(dir);
    server::ServingEngine engine(models, st->o);
    server::HttpServer http(engine, st->http);
    for (const server::ServedModelInfo& m : engine.models())
      std::printf("  model %s: %d layers, vocab %d, %.1f MB %s\n", m.name.c_str(), m.layers,
                  m.vocab, static_cast<double>(m.weight_bytes) / 1e6, to_string(m.dtype).c_str());
    std::printf("  %d slices of %s %s, rates x %g; alpha %s\n", engine.slices(),
                st->o.hardware.c_str(), st->o.profile.c_str(), st->o.rate_scale,
                st->o.alpha < 0 ? "adaptive" : fmt::format("{}", st->o.alpha).c_str());
    std::printf(
        "spillway serve: listening on http://%s:%d (SIGTERM or Ctrl-C drains and "
        "exits)\n",
        st->http.host.c_str(), http.port());
    std::fflush(stdout);
    if (!st->port_file.empty()) {
      const std::string tmp = st->port_file + ".tmp";
      {
        std::ofstream f(tmp, std::ios::trunc);
        f << http.port() << "\n";
        if (!f) SPILLWAY_INPUT_ERROR("--port-file: cannot write {}", st->port_file);
      }
      fs::rename(tmp, st->port_file);
    }
    std::thread signals([&] {
      unsigned char b = 0;
      while (::read(signal_pipe[0], &b, 1) < 0 && errno == EINTR) {
      }
      const int sig = b;
      if (sig == 0) return;  // the server stopped by itself
      std::printf("spillway serve: %s: draining %lld requests in flight...\n",
                  sig == SIGTERM ? "SIGTERM" : "SIGINT",
                  static_cast<long long>(engine.in_flight()));
      std::fflush(stdout);
      http.shutdown();
    });
    http.run();
    if (!engine.draining()) {  // stopped without a signal: release the signal thread
      const unsigned char zero = 0;
      (void)!::write(signal_pipe[1], &zero, 1);
    }
    signals.join();
    signal(SIGTERM, SIG_DFL);
    signal(SIGINT, SIG_DFL);
    const server::EngineMetrics m = engine.metrics();
    std::printf(
        "spillway serve: drained; %lld requests answered, %lld tokens generated, %lld "
        "refused as overloaded\n",
        static_cast<long long>(m.requests.at("ok")), static_cast<long long>(m.tokens_generated),
        static_cast<long long>(m.requests.at("overloaded")));
    std::fflush(stdout);
  });
}

void add_load_command(CLI::App& app) {
  struct State {
    std::string url;
    server::LoadOptions o;
  };
  auto st = std::make_shared<State>();
  CLI::App* cmd = app.add_subcommand(
      "load",
      "Load-tests a running `spillway serve`: --clients threads send --requests requests back "
      "to back, each one of --distinct (model, prompt, seed) triples sampled at temperature "
      "0.8 (each triple sent several times, batched differently each time); a 429 is retried. "
      "Checks that every request got exactly one complete answer (none lost, no response id "
      "twice) and that the answers to a triple are the same tokens; prints latency and TTFT "
      "p50/p95/p99. Exits 1 when a check fails.\n\n"
      "Example:\n"
      "  spillway serve --port 8000 &\n"
      "  spillway load http://127.0.0.1:8000 --clients 16 --requests 400");
  cmd->add_option("url", st->url, "The server (http://host:port)")->required();
  in_range(cmd->add_option("--clients", st->o.clients, "Concurrent clients")->capture_default_str(),
           closed(1, 1024));
  in_range(cmd->add_option("--requests", st->o.requests, "Requests in all")->capture_default_str(),
           closed(1, 10000000));
  in_range(cmd->add_option("--distinct", st->o.distinct, "Distinct (model, prompt, seed) triples")
               ->capture_default_str(),
           closed(1, 1000000));
  in_range(cmd->add_option("--max-tokens", st->o.max_tokens, "Tokens generated per request")
               ->capture_default_str(),
           closed(1, 1 << 20));
  in_range(cmd->add_option("--prompt-tokens", st->o.prompt_tokens, "Prompt tokens per request")
               ->capture_default_str(),
           closed(1, 1 << 20));
  in_range(cmd->add_option("--seed", st->o.seed, "Seed of the prompts and sampling seeds")
               ->capture_default_str(),
           closed(0, 4294967295.0));
  cmd->callback([st]() {
    const server::LoadReport r = server::run_load(st->url, st->o);
    std::fputs(server::format_load(r, st->o).c_str(), stdout);
    std::fflush(stdout);
    if (r.lost + r.duplicated + r.inconsistent > 0)
      SPILLWAY_INPUT_ERROR("load: {} lost, {} duplicated, {} inconsistent answers", r.lost,
                           r.duplicated, r.inconsistent);
  });
}

void add_checkpoint_command(CLI::App& app) {
  struct State {
    std::string config = "tiny-moe";
    uint64_t seed = 1;
    std::string out;
    std::string dtype = "fp32";
  };
  auto st = std::make_shared<State>();
  CLI::App* cmd = app.add_subcommand(
      "checkpoint",
      "Writes a servable checkpoint of the reference model: OUT/config.json and "
      "OUT/model.safetensors with its weights initialized from --seed (the tensors named as "
      "Hugging Face names Llama / Qwen3-MoE weights, attention's q, k, v fused). `spillway "
      "serve --models DIR` serves every such directory under DIR.\n\n"
      "Examples:\n"
      "  spillway checkpoint --out models/tiny-a\n"
      "  spillway checkpoint --config small-moe --seed 7 --dtype bf16 --out models/small-7");
  cmd->add_option("--config", st->config,
                  "An embedded reference config (tiny-moe, small-moe) or a config.json")
      ->capture_default_str();
  in_range(cmd->add_option("--seed", st->seed, "Seed of the weights")->capture_default_str(),
           closed(0, 4294967295.0));
  cmd->add_option("--out", st->out, "The model's directory (created)")->required();
  cmd->add_option("--dtype", st->dtype, "fp32 or bf16")->capture_default_str();
  cmd->callback([st]() {
    const DType dt = parse_dtype(st->dtype);
    server::write_checkpoint(st->config, st->seed, st->out, dt);
    const auto bytes = fs::file_size(fs::path(st->out) / "model.safetensors");
    std::printf("wrote %s/config.json and %s/model.safetensors (%s, %.2f MB)\n", st->out.c_str(),
                st->out.c_str(), st->dtype.c_str(), static_cast<double>(bytes) / 1e6);
  });
}

}  // namespace spillway::cli
