// `spillway stream`: layerwise weight streaming (docs/stream.md). Without --explain: the
// reference model run with its weights streamed on the host backend (a throttled link),
// against the same model all-resident in the same run, beside the simulator's prediction
// (Note [Streamed weights]). --explain: the choice among full copy, sharded + all-gather
// and in-place reading for a catalog model on a machine, with the arithmetic shown (Note
// [Stream mode model]) beside the simulator's prediction.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "cli/commands.hpp"
#include "cli/plan_flags.hpp"
#include "core/stats.hpp"
#include "spillway/error.hpp"
#include "spillway/nn.hpp"
#include "spillway/probe.hpp"
#include "spillway/sim.hpp"
#include "spillway/stream.hpp"
#include "spillway/stream_mode.hpp"
#include "spillway/train.hpp"

namespace spillway::cli {

namespace {

struct RunFlags {
  std::string ref_model = "small-moe";
  int steps = 5;
  double link_gbps = 1.0;
  double device_memory_mb = 512;
  uint64_t seed = 1;
  int gpus_per_link = 1;
  std::string mode = "auto";
  bool batch_given = false;  // else 2 x 256 tokens (the planner's defaults are a GPU's)
  bool seq_given = false;
};

// One emulated GPU of the run: its device behind the shared link, the model all-resident
// and the same model streamed.
// The learning rate of a training run of the reference model, streamed and resident.
constexpr double kStreamRunLr = 1e-3;

struct RunRank {
  std::unique_ptr<Device> dev;
  std::unique_ptr<nn::Model> resident, streamed;
  double loss_res = 0, loss_str = 0;
  double ms_res = 0, ms_str = 0;
  nn::StepStats st_res;
  // Each model's own update (Note [The model's own update]).
  train::TextbookAdamW adam_res{kStreamRunLr}, adam_str{kStreamRunLr};
  std::unique_ptr<WeightStreamer> ws;  // last: destroyed before the models and the device
};

// fn(rank) on every rank at once, one thread each (the emulated GPUs run concurrently and
// contend for the link as GPUs would). A rank that throws calls on_error (its peers may be
// waiting for it in a collective); the first error is rethrown once all have returned.
template <typename F, typename E>
void on_all_ranks(std::vector<RunRank>& ranks, F fn, E on_error) {
  if (ranks.size() == 1) {
    fn(ranks[0]);
    return;
  }
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(ranks.size());
  threads.reserve(ranks.size());
  for (size_t i = 0; i < ranks.size(); ++i)
    threads.emplace_back([&, i] {
      try {
        fn(ranks[i]);
      } catch (...) {
        errors[i] = std::current_exception();
        on_error();
      }
    });
  for (std::thread& t : threads) t.join();
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
}

// The rate at which this machine copies a buffer of `bytes` (the emulated all-gather is
// such copies among the ranks' device buffers), GB/s: the median of 5.
double measured_memcpy_gbps(size_t bytes) {
  std::vector<std::byte> a(bytes, std::byte{1}), b(bytes);
  std::vector<double> ms;
  for (int i = 0; i < 6; ++i) {
    const auto t0 = Clock::now();
    std::memcpy(b.data(), a.data(), bytes);
    if (i > 0) ms.push_back(ms_since(t0));
  }
  return static_cast<double>(bytes) / 1e6 / std::max(median(ms), 1e-6);
}

// The reference model on N emulated GPUs behind one throttled link, each resident and
// streamed (same seed and batches), interleaved step by step; losses compared bit for bit.
// Inference: every rank its own batch (replicas serving); training: the same batch on
// every rank (the reference model has no gradient all-reduce, so data-parallel ranks on
// different batches would drift apart; the link traffic is the same either way).
void run_streamed_reference(const RunFlags& rf, const PlanFlags& pf, bool training,
                            const std::string& json_path) {
  const nn::RefConfig c = nn::load_reference_config(rf.ref_model);
  const int batch = static_cast<int>(rf.batch_given ? pf.micro_batch : 2);
  const int seq = static_cast<int>(rf.seq_given ? pf.seq_len : 256);
  const int depth = std::max(1, pf.prefetch_depth);
  const int N = rf.gpus_per_link;
  auto link = std::make_shared<HostLink>(rf.link_gbps, rf.link_gbps);
  // Declared before the ranks: their streamers (destroyed first, each waiting for its
  // streams) may still have all-gathers of the next pass in flight.
  std::vector<std::unique_ptr<AllGather>> group;
  std::vector<RunRank> ranks(static_cast<size_t>(N));
  std::vector<Device*> devs;
  for (RunRank& r : ranks) {
    HostDeviceOptions o;
    o.device_bytes = static_cast<int64_t>(rf.device_memory_mb * kMiB);
    o.link = link;
    r.dev = make_host_device(o);
    devs.push_back(r.dev.get());
    r.resident = std::make_unique<nn::Model>(c, *r.dev, rf.seed);
    r.streamed = std::make_unique<nn::Model>(c, *r.dev, rf.seed);
  }
  const MemoryPolicy policy = nn::keep_policy(c);
  TrainingHooks none;
  const double lr = training ? kStreamRunLr : 0.0;
  std::mt19937 g(static_cast<uint32_t>(rf.seed));
  auto batches = [&] {
    std::vector<std::vector<int32_t>> out;
    for (int r = 0; r < (training ? 1 : N); ++r) {
      std::vector<int32_t> tokens(static_cast<size_t>(batch) * static_cast<size_t>(seq + 1));
      for (int32_t& t : tokens) t = static_cast<int32_t>(g() % static_cast<uint32_t>(c.vocab));
      out.push_back(std::move(tokens));
    }
    return out;
  };
  // One step of every rank's resident or streamed model; the step's time is the slowest
  // rank's.
  auto step_all = [&](bool streamed, const std::vector<std::vector<int32_t>>& tok, double step_lr) {
    // A failed rank aborts the all-gather group so that its peers do not wait for it.
    const auto abort_group = [&] {
      for (const std::unique_ptr<AllGather>& a : group) a->abort();
    };
    on_all_ranks(
        ranks,
        [&](RunRank& r) {
          const size_t i = static_cast<size_t>(&r - ranks.data());
          const std::vector<int32_t>& t = tok[training ? 0 : i];
          nn::Model& m = streamed ? *r.streamed : *r.resident;
          const auto t0 = Clock::now();
          double loss = 0;
          if (training) {
            train::TextbookAdamW& adam = streamed ? r.adam_str : r.adam_res;
            const nn::ParameterUpdate update = step_lr > 0 ? adam.update() : nn::ParameterUpdate{};
            nn::StepStats st = m.step(t, batch, seq, policy, none, update);
            loss = st.loss;
            if (!streamed) r.st_res = std::move(st);
          } else {
            loss = m.forward_loss(t, batch, seq);
          }
          (streamed ? r.ms_str : r.ms_res) = ms_since(t0);
          (streamed ? r.loss_str : r.loss_res) = loss;
        },
        abort_group);
    double slowest = 0;
    for (const RunRank& r : ranks) slowest = std::max(slowest, streamed ? r.ms_str : r.ms_res);
    return slowest;
  };
  const std::vector<size_t> bytes = ranks[0].resident->layer_weight_bytes();
  int64_t model_bytes = 0;
  for (size_t b : bytes) model_bytes += static_cast<int64_t>(b);
  // The link time alone, at least: every streamed step copies every layer once (forward)
  // through the link, N times over when each GPU copies whole layers. A run that would
  // take longer than kMaxRunSeconds is refused now, not after hours.
  {
    const double copies = rf.mode == "full-copy" ? N : 1.0;
    const double link_bytes =
        static_cast<double>(rf.steps) * copies * static_cast<double>(model_bytes);
    const double seconds = link_bytes / (rf.link_gbps * 1e9);
    if (!(seconds <= kMaxRunSeconds))
      SPILLWAY_INPUT_ERROR(
          "--link-gbps is {}; {}", rf.link_gbps,
          fmt::format("the {} streamed steps copy at least {:.1f} MB over the link ({} steps x "
                      "{:.1f} MB of layer weights{}), {:.3g} s at {} GB/s: more than the {:.0f} s "
                      "a run may take; raise --link-gbps to {:.3g} or more, or lower --steps",
                      rf.steps, link_bytes / 1e6, rf.steps, static_cast<double>(model_bytes) / 1e6,
                      copies > 1 ? fmt::format(" x {} GPUs", N) : "", seconds, rf.link_gbps,
                      kMaxRunSeconds, link_bytes / 1e9 / kMaxRunSeconds));
  }
  // The mode, from the arithmetic of Note [Stream mode model] over a warm-up step of the
  // resident models (learning rate 0: the weights stay the streamed models'), the link,
  // and this machine's copy rate for the emulated all-gather.
  StreamModeInput in;
  in.gpus_per_link = N;
  in.link_h2d_gbps = rf.link_gbps;
  in.peer_gbps = N > 1 ? measured_memcpy_gbps(*std::max_element(bytes.begin(), bytes.end())) : 0;
  in.depth = depth;
  auto fill_compute = [&](double fwd_ms) {
    in.layer_bytes.clear();
    in.fwd_ms.clear();
    in.bwd_ms.clear();
    for (int l = 0; l < c.layers(); ++l) {
      const auto u = static_cast<size_t>(l);
      in.layer_bytes.push_back(static_cast<int64_t>(bytes[u]));
      in.fwd_ms.push_back(training ? ranks[0].st_res.layer_fwd_ms[u] : fwd_ms / c.layers());
      if (training) in.bwd_ms.push_back(ranks[0].st_res.layer_bwd_ms[u]);
    }
  };
  fill_compute(step_all(false, batches(), 0.0));
  std::string mode = rf.mode;
  if (mode == "auto") mode = choose_stream_mode(in).chosen;
  if (mode == "sharded" && N < 2)
    throw CLI::ValidationError("--mode", "sharded needs --gpus-per-link 2 or more");
  if (mode == "sharded") group = make_host_all_gather(devs);
  for (size_t i = 0; i < ranks.size(); ++i) {
    RunRank& r = ranks[i];
    WeightStreamOptions so;
    so.depth = depth;
    so.training = training;
    if (!group.empty()) so.group = group[i].get();
    r.ws = std::make_unique<WeightStreamer>(*r.dev, r.streamed->compute_stream(),
                                            r.streamed->layer_weight_bytes(), so);
    r.streamed->stream_weights(r.ws.get());
  }
  std::vector<double> t_res, t_str;
  std::vector<std::vector<double>> fwd_ms(static_cast<size_t>(c.layers())),
      bwd_ms(static_cast<size_t>(c.layers()));
  bool bitwise = true;
  for (int step = 0; step < rf.steps; ++step) {
    const std::vector<std::vector<int32_t>> tok = batches();
    const double ms_res = step_all(false, tok, lr);
    const double ms_str = step_all(true, tok, lr);
    if (step > 0) {
      t_res.push_back(ms_res);
      t_str.push_back(ms_str);
    }
    if (training)
      for (int l = 0; l < c.layers(); ++l) {
        const auto u = static_cast<size_t>(l);
        fwd_ms[u].push_back(ranks[0].st_res.layer_fwd_ms[u]);
        bwd_ms[u].push_back(ranks[0].st_res.layer_bwd_ms[u]);
      }
    std::string differ;
    for (size_t i = 0; i < ranks.size(); ++i)
      if (ranks[i].loss_res != ranks[i].loss_str) differ += fmt::format(" {}", i);
    bitwise = bitwise && differ.empty();
    say_beside_json(json_path, fmt::format("step {}: loss {:.6f} resident, {:.6f} streamed{}{}\n",
                                           step, ranks[0].loss_res, ranks[0].loss_str,
                                           N > 1 ? fmt::format(" (rank 0 of {})", N) : "",
                                           differ.empty() ? "" : "  DIFFERENT on rank" + differ));
  }
  const WeightStreamTelemetry t = ranks[0].ws->telemetry();
  for (RunRank& r : ranks) r.streamed->stream_weights(nullptr);
  const double res_ms = median(t_res), str_ms = median(t_str);
  std::string text = fmt::format(
      "{} ({} layers, {:.1f} MB of layer weights, fp32), batch {} x {} tokens{}, {}; link {:.2f} "
      "GB/s host->device, depth {} ({} device slots of {:.1f} MB)\n",
      rf.ref_model, c.layers(), static_cast<double>(model_bytes) / 1e6, batch, seq,
      N > 1 ? (training ? " (the same on every GPU)" : " per GPU") : "",
      training ? "training steps (forward, backward re-streamed, AdamW)" : "inference (forward)",
      rf.link_gbps, depth, depth + 1, static_cast<double>(ranks[0].ws->slot_bytes()) / 1e6);
  if (N == 1) {
    text += fmt::format("  mode            {} (one emulated GPU on its link)\n", mode);
  } else {
    text += fmt::format("  mode            {} ({} emulated GPUs sharing the link{}{})\n", mode, N,
                        mode == "sharded" ? ", each copying 1/N of a layer and all-gathering" : "",
                        rf.mode == "auto" ? "; chosen by the model below" : "; --mode");
  }
  text += fmt::format("  all resident    {:9.2f} ms per step (median of {}{})\n", res_ms,
                      t_res.size(), N > 1 ? ", the slowest GPU" : "");
  text += fmt::format("  streamed        {:9.2f} ms per step ({:+.1f}%)\n", str_ms,
                      100.0 * (str_ms / res_ms - 1.0));
  const double steps = static_cast<double>(std::max<int64_t>(1, t.steps));
  text += fmt::format(
      "  per step        {:.1f} MB copied {}in {:.1f} loads ({:.1f} hits), stalls {:.2f} ms, "
      "copy stream {:.2f} GB/s\n",
      static_cast<double>(t.bytes) / 1e6 / steps, N > 1 ? "by GPU 0 " : "",
      static_cast<double>(t.loads) / steps, static_cast<double>(t.hits) / steps, t.stall_ms / steps,
      t.gbps);
  if (N > 1)
    text += fmt::format("  link            {:.1f} MB per step for the {} GPUs\n",
                        static_cast<double>(t.bytes) * N / 1e6 / steps, N);
  text +=
      fmt::format("  losses          {}\n", bitwise ? "bitwise identical to the resident model's"
                                                    : "DIFFER from the resident model's");
  // The predictions for the same setup, from the measured per-layer compute (training) or
  // the resident pass spread evenly (inference: forward_loss does not time layers).
  if (training) {
    in.fwd_ms.clear();
    in.bwd_ms.clear();
    for (int l = 0; l < c.layers(); ++l) {
      in.fwd_ms.push_back(median(fwd_ms[static_cast<size_t>(l)]));
      in.bwd_ms.push_back(median(bwd_ms[static_cast<size_t>(l)]));
    }
  } else {
    fill_compute(res_ms);
  }
  const StreamModeChoice choice = choose_stream_mode(in);
  const auto est = std::find_if(choice.modes.begin(), choice.modes.end(),
                                [&](const StreamModeEstimate& e) { return e.mode == mode; });
  const double predicted = est != choice.modes.end() ? est->step_ms : 0.0;
  text += fmt::format(
      "  predicted       {:9.2f} ms per step of layers (Note [Stream mode model], {:.2f} ms of "
      "them compute{})\n",
      predicted, choice.compute_ms,
      N > 1 ? fmt::format("; peer copies at this machine's memcpy, {:.1f} GB/s", in.peer_gbps)
            : "");
  if (rf.mode == "auto" && N > 1)
    for (const StreamModeEstimate& e : choice.modes)
      if (e.available && e.mode != mode)
        text += fmt::format("                  {} would take {:.2f} ms\n", e.mode, e.step_ms);
  double sim_ms = 0.0;
  {
    Plan plan;
    for (int l = 0; l < c.layers(); ++l) {
      LayerPlan lp;
      lp.params = static_cast<int64_t>(bytes[static_cast<size_t>(l)] / 4);
      lp.fwd_ms = in.fwd_ms[static_cast<size_t>(l)];
      if (training) lp.bwd_ms = in.bwd_ms[static_cast<size_t>(l)];
      plan.layers.push_back(lp);
    }
    plan.summary.h2d_gbps = rf.link_gbps / N;  // per GPU; the link: times the GPUs on it
    plan.summary.d2h_gbps = rf.link_gbps / N;
    plan.summary.gpus_per_link = N;
    PlanRequest req;
    req.work.shape.dtype = DType::kFp32;
    StreamOptions sim_o;
    sim_o.depth = depth;
    sim_o.gpus = N;
    sim_o.gpus_per_link = N;
    sim_o.sharded = mode == "sharded";
    sim_o.peer_gbps = in.peer_gbps;
    sim_o.training = training;
    sim_o.keep_tasks = false;
    sim_ms = simulate_weight_streaming(plan, req, sim_o).summary.step_ms;
    text += fmt::format("  simulator       {:9.2f} ms per {} of the layers\n", sim_ms,
                        training ? "forward and backward" : "forward");
  }
  say_beside_json(json_path, text);
  if (!json_path.empty()) {
    nlohmann::json j;
    j["schema"] = "spillway.stream-run/1";
    j["ref_model"] = rf.ref_model;
    j["training"] = training;
    j["depth"] = depth;
    j["link_gbps"] = rf.link_gbps;
    j["gpus_per_link"] = N;
    j["mode"] = mode;
    j["resident_ms"] = res_ms;
    j["streamed_ms"] = str_ms;
    j["bytes_per_step"] = static_cast<double>(t.bytes) / steps;
    j["link_bytes_per_step"] = static_cast<double>(t.bytes) * N / steps;
    j["loads"] = t.loads;
    j["hits"] = t.hits;
    j["stall_ms"] = t.stall_ms;
    j["copy_gbps"] = t.gbps;
    j["bitwise_identical"] = bitwise;
    j["predicted_ms"] = predicted;
    if (N > 1) j["peer_gbps"] = in.peer_gbps;
    j["simulator_ms"] = sim_ms;
    write_output(json_path, j.dump(2) + "\n");
  }
  if (!bitwise)
    throw Error("spillway stream: the streamed model's losses differ from the resident one's");
}

}  // namespace

void add_stream_command(CLI::App& app) {
  struct State {
    PlanFlags flags;
    RunFlags run;
    bool explain = false;
    bool training = false;
    int gpus_per_link = 0;
    double peer_gbps = -1.0;
    std::string sysfs = "/sys";
    std::string json_path;
  };
  auto st = std::make_shared<State>();
  CLI::App* cmd = app.add_subcommand(
      "stream",
      "Layerwise weight streaming: the weights live in pinned host memory and each layer is "
      "copied into a ring of depth+1 device buffers while the layers before it compute.\n"
      "Without --explain: the reference model (--ref-model) runs with its weights streamed on "
      "the host backend through a throttled link (--link-gbps), step after step beside the same "
      "model with every layer resident, and prints both step times, the bytes, loads and "
      "stalls per step, whether the losses are bitwise equal (they must be: exit 1 if not), and "
      "the predicted and simulated times for the same setup. --training streams training steps "
      "(forward, backward re-streaming the layers in reverse, AdamW), else inference. A run "
      "uses 2 x 256 tokens unless --micro-batch / --seq-len say otherwise. The reference model "
      "computes on the host's cores, which the emulated copy engine shares: its achieved GB/s "
      "is this machine's, not a GPU's. --gpus-per-link N runs N emulated GPUs (threads) behind "
      "the one link, each with its own batch (training: the same batch), full-copy or sharded "
      "(--mode).\n"
      "--explain chooses how, for the model and machine given: every GPU copies whole layers "
      "(full-copy), the GPUs sharing one host link each copy 1/N and all-gather (sharded), or, "
      "on a coherent NVLink-C2C link, kernels read the host weights in place; it prints each "
      "mode's step time, stalls and link bytes, and the simulator's prediction.\n"
      "The GPUs per link come from the PCI tree (/sys) when NVIDIA GPUs are there, else from "
      "the hardware profile, else --gpus-per-link. A mode whose ring (prefetch-depth + 1 "
      "layers) does not fit in the HBM left for weights is ruled out, with the numbers; when "
      "none is left, --explain exits 3, as `spillway plan` does for an infeasible plan.\n\n"
      "Examples:\n"
      "  spillway stream\n"
      "  spillway stream --training --link-gbps 2 --prefetch-depth 2\n"
      "  spillway stream --gpus-per-link 4 --mode sharded\n"
      "  spillway stream --explain --model Llama-3.1-70B --hardware h100-pcie --gpus-per-link 4\n"
      "  spillway stream --explain --model Llama-3.1-70B --hardware gh200 --training");
  add_plan_flags(*cmd, st->flags);
  cmd->add_flag("--explain", st->explain, "Print the mode choice and its arithmetic")
      ->group("Streaming");
  cmd->add_flag("--training", st->training,
                "A training step: forward, then backward re-streaming the layers in reverse")
      ->group("Streaming");
  in_range(cmd->add_option("--gpus-per-link", st->gpus_per_link,
                           "GPUs sharing one host link (--explain default: detected, else the "
                           "profile's; a run: emulated GPUs behind the throttled link, 1 to 16, "
                           "default 1)")
               ->group("Streaming"),
           closed(1, 1024));
  in_range(cmd->add_option("--peer-gbps", st->peer_gbps,
                           "GPU-to-GPU bandwidth per GPU for the all-gather, GB/s (default: the "
                           "profile's NVLink, else its host link figure: PCIe peer-to-peer "
                           "through the shared switch)")
               ->group("Streaming"),
           closed_or(PlanLimits::kMinGbps, 100000, 0));
  cmd->add_option("--sysfs", st->sysfs, "Read the PCI device tree under this sysfs root")
      ->capture_default_str()
      ->group("Streaming");
  cmd->add_option("--ref-model", st->run.ref_model,
                  "Run: the reference model (tiny-moe, small-moe, or a config.json path)")
      ->capture_default_str()
      ->group("Run");
  in_range(cmd->add_option("--steps", st->run.steps,
                           "Run: steps of each model; the first is "
                           "the warm-up")
               ->capture_default_str()
               ->group("Run"),
           closed(2, 100000));
  in_range(
      cmd->add_option("--link-gbps", st->run.link_gbps, "Run: the emulated host->device link, GB/s")
          ->capture_default_str()
          ->group("Run"),
      closed(kMinRunLinkGbps, 100000));
  in_range(cmd->add_option("--device-memory-mb", st->run.device_memory_mb,
                           "Run: the emulated device's memory, MiB (2^20 bytes)")
               ->capture_default_str()
               ->group("Run"),
           closed(16, 1 << 20));
  cmd->add_option("--mode", st->run.mode,
                  "Run: auto (the mode the arithmetic of --explain picks for the measured "
                  "compute), full-copy (every GPU copies whole layers) or sharded (each of the "
                  "--gpus-per-link GPUs copies 1/N and all-gathers)")
      ->check(CLI::IsMember({"auto", "full-copy", "sharded"}))
      ->capture_default_str()
      ->group("Run");
  cmd->add_option("--json", st->json_path,
                  "Write the run or the choice as JSON to FILE ('-' for stdout)")
      ->group("Output");
  cmd->callback([st, cmd]() {
    if (!st->explain) {
      // The catalog-model flags describe --explain's machine; a run uses the reference
      // model: given here they would be silently ignored.
      for (const char* f : {"--model", "--hardware", "--peer-gbps", "--sysfs"})
        if (cmd->count(f) > 0)
          throw CLI::ValidationError(f,
                                     "applies to --explain; a run uses --ref-model and "
                                     "--link-gbps (its all-gather copies at this machine's "
                                     "memcpy speed)");
      st->run.gpus_per_link = st->gpus_per_link > 0 ? st->gpus_per_link : 1;
      if (st->run.gpus_per_link > 16)
        throw InputError("--gpus-per-link", std::to_string(st->run.gpus_per_link),
                         "must be in [1, 16] for a run (emulated GPUs, one thread each)");
      if (st->run.mode == "sharded" && st->run.gpus_per_link < 2)
        throw CLI::ValidationError("--mode", "sharded needs --gpus-per-link 2 or more");
      st->run.batch_given = cmd->count("--micro-batch") > 0;
      st->run.seq_given = cmd->count("--seq-len") > 0;
      run_streamed_reference(st->run, st->flags, st->training, st->json_path);
      return;
    }
    for (const char* f : {"--ref-model", "--steps", "--link-gbps", "--device-memory-mb", "--mode"})
      if (cmd->count(f) > 0) throw CLI::ValidationError(f, "applies to a run (without --explain)");
    const PlanRequest req = make_request(st->flags);
    const Plan plan = make_plan(req);
    const HardwareProfile& hw = req.hardware;
    const HostTopology topo = detect_host_topology(st->sysfs);
    int per_link = hw.gpus_per_link;
    std::string source = fmt::format("the {} profile", hw.name);
    if (st->gpus_per_link > 0) {
      per_link = st->gpus_per_link;
      source = "--gpus-per-link";
    } else if (topo.max_gpus_per_link > 0) {
      per_link = topo.max_gpus_per_link;
      source = fmt::format("the PCI tree ({} GPUs in {} link groups)", topo.gpus.size(),
                           topo.link_groups.size());
    }
    StreamModeInput in;
    const int64_t wbytes = req.work.shape.dtype == DType::kFp32 ? 4 : 2;
    for (const LayerPlan& lp : plan.layers) {
      in.layer_bytes.push_back(lp.params * wbytes);
      in.fwd_ms.push_back(lp.fwd_ms);
      if (st->training) in.bwd_ms.push_back(lp.bwd_ms);
    }
    in.gpus_per_link = per_link;
    in.link_h2d_gbps = plan.summary.h2d_gbps;  // one GPU alone: the link's capacity
    in.peer_gbps = st->peer_gbps >= 0.0                ? st->peer_gbps
                   : hw.interconnect.nvlink_gbps > 0.0 ? hw.interconnect.nvlink_gbps
                                                       : plan.summary.h2d_gbps;
    in.c2c = hw.link_kind == "nvlink-c2c";
    in.depth = std::max(1, req.prefetch_depth);
    const MemoryBreakdown& peak = plan.summary.peak;
    // The HBM the ring may take: the budget less the plan's activations and logits (a
    // training step's, so an upper bound for inference). Not less the plan's gradients and
    // optimizer states: those are a resident model's, sized by all its weights, while a
    // streamed model's weights, and what is updated with them, live in host memory.
    in.hbm_free_bytes =
        std::max<int64_t>(0, plan.summary.hbm_budget_bytes - peak.activations - peak.logits);
    const StreamModeChoice c = choose_stream_mode(in);
    std::string text =
        fmt::format("{} on {}: GPUs per link {} (from {}){}\n", req.model.name, hw.name, per_link,
                    source, topo.note.empty() ? "" : "; " + topo.note);
    text += explain_stream_mode(c, in);
    StreamOptions so;
    so.depth = in.depth;
    so.gpus = per_link;
    so.gpus_per_link = per_link;
    so.keep_tasks = false;
    nlohmann::json sim_json;
    if (!st->training && !c.chosen.empty()) {
      // The simulator runs the full-copy and sharded modes as events (its link: the plan's
      // per-GPU figure times the profile's GPUs per link).
      const SimResult r = simulate_weight_streaming(plan, req, so);
      text += fmt::format("simulator (full copy, {} GPUs on the link): forward {:.2f} ms\n",
                          per_link, r.summary.step_ms);
      sim_json = {{"full_copy_forward_ms", r.summary.step_ms}};
      if (per_link > 1 && in.peer_gbps > 0) {
        StreamOptions sh = so;
        sh.sharded = true;
        sh.peer_gbps = in.peer_gbps;
        const SimResult q = simulate_weight_streaming(plan, req, sh);
        text += fmt::format("simulator (sharded, {} GPUs on the link): forward {:.2f} ms\n",
                            per_link, q.summary.step_ms);
        sim_json["sharded_forward_ms"] = q.summary.step_ms;
      }
    }
    write_output("-", text);
    if (!st->json_path.empty()) {
      nlohmann::json j;
      j["schema"] = "spillway.stream-choice/1";
      j["model"] = req.model.name;
      j["hardware"] = hw.name;
      j["gpus_per_link"] = per_link;
      j["chosen"] = c.chosen.empty() ? nlohmann::json(nullptr) : nlohmann::json(c.chosen);
      j["hbm_free_bytes"] = in.hbm_free_bytes;
      j["compute_ms"] = c.compute_ms;
      j["weight_bytes"] = c.weight_bytes;
      j["weights_fit"] = c.weights_fit;
      j["warnings"] = c.warnings;
      for (const StreamModeEstimate& e : c.modes) {
        j["modes"].push_back({{"mode", e.mode},
                              {"available", e.available},
                              {"why_not", e.why_not},
                              {"step_ms", e.step_ms},
                              {"stall_ms", e.stall_ms},
                              {"link_ms", e.copy_ms},
                              {"gather_ms", e.gather_ms},
                              {"link_bytes", e.link_bytes},
                              {"gpu_bytes", e.gpu_bytes},
                              {"ring_bytes", e.slot_bytes}});
      }
      if (!sim_json.is_null()) j["simulator"] = sim_json;
      write_output(st->json_path, j.dump(2) + "\n");
    }
    // As `spillway plan` does for an infeasible plan: the reasons printed, exit 3.
    if (c.chosen.empty()) throw CLI::RuntimeError(3);
  });
}

}  // namespace spillway::cli
