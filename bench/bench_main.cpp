// spillway-bench (`spillway bench` runs it): the engines' benchmarks, each checked for
// correctness before it is timed and printed beside its baseline measured in the same run
// and its limit. One subcommand per engine: `offload`, `adam`, `optim-offload`, `stream`,
// `serve`, `serve-live`, `hybrid-gemm`; `gemm` measures the planner's efficiency curves. Its own
// tool, as llama-bench is: nothing under src/ includes bench/ (the layering check says so), and the
// spillway command only forwards to it (src/cli/cmd_bench.cpp).
// Exit codes as the spillway command's: 0 success, 1 an error (message on stderr), 2 a
// command-line usage error.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bench_adam.hpp"
#include "bench_gemm.hpp"
#include "bench_hybrid_gemm.hpp"
#include "bench_offload.hpp"
#include "bench_serve.hpp"
#include "bench_serve_live.hpp"
#include "bench_stream.hpp"
#include "bench_stv.hpp"
#include "spillway/core/error.hpp"
#include "spillway/plan/plan.hpp"
#include "tool/output.hpp"
#include "tool/ranges.hpp"

namespace spillway::bench {

using namespace spillway::tool;  // NOLINT(google-build-using-namespace): the tools' edge

namespace {

// Elements of AdamW state a benchmark may ask for: 2^36 (~2 TB of state).
constexpr double kMaxElements = 68719476736.0;

}  // namespace

namespace {

void add_bench_offload_command(CLI::App& bench) {
  struct State {
    OffloadBenchOptions options;
    double tensor_mib = static_cast<double>(OffloadBenchOptions{}.tensor_bytes) / (1 << 20);
    std::string backend = "host";
    std::string json_path;
  };
  auto st = std::make_shared<State>();
  CLI::App* cmd = bench.add_subcommand(
      "offload",
      "The activation offload engine on the host backend (an emulated device whose copy engines "
      "are worker threads doing memcpy): offload (D2H) and reload (H2D) throughput of a "
      "training-loop-shaped run against plain memcpy bandwidth measured in the same run (the "
      "limit), and the CPU overhead per offloaded tensor in microseconds (many 64 KiB tensors, "
      "host time inside the engine's calls). Targets: at least 0.9 x memcpy; under 2 us per "
      "tensor; no device allocation in steady state. Every reloaded byte is checked against "
      "what was written before anything is timed; memcpy and engine runs are interleaved and "
      "figures are medians. Needs about 4 x layers x tensors x tensor size of host memory, plus "
      "0.5 GB.\n"
      "--backend cuda runs it on CUDA device 0 over the real copy engines: the limit is then "
      "the pinned link, D2H and H2D, measured in the same run; the compute writes and checks "
      "the tensors with copies through pinned staging (every byte in the warm-up steps).\n\n"
      "Examples:\n"
      "  spillway bench offload\n"
      "  spillway bench offload --layers 16 --tensor-mb 4 --steps 3 --json -\n"
      "  spillway bench offload --repeats 5 --json bench_offload.json\n"
      "  spillway bench offload --backend cuda --json bench_offload_cuda.json");
  OffloadBenchOptions& o = st->options;
  cmd->add_option("--backend", st->backend, "host (an emulated device) or cuda (device 0)")
      ->check(CLI::IsMember({"host", "cuda"}))
      ->capture_default_str();
  in_range(cmd->add_option("--layers", o.layers, "Layers per step, each offloading its tensors")
               ->capture_default_str(),
           closed(1, 4096));
  in_range(
      cmd->add_option("--tensors-per-layer", o.tensors_per_layer, "Tensors offloaded per layer")
          ->capture_default_str(),
      closed(1, 4096));
  in_range(cmd->add_option("--tensor-mb", st->tensor_mib, "Size of each tensor in MiB (2^20 bytes)")
               ->capture_default_str(),
           open_closed(0, 65536));
  in_range(cmd->add_option("--steps", o.steps,
                           "Steps per repeat of each pass; the first is the warm-up (and the full "
                           "byte-for-byte check)")
               ->capture_default_str(),
           closed(2, 10000));
  in_range(cmd->add_option("--repeats", o.repeats,
                           "Times memcpy, the bandwidth pass and the overhead pass are interleaved")
               ->capture_default_str(),
           closed(1, kMaxRepeats));
  in_range(cmd->add_option("--prefetch-depth", o.prefetch_depth, "Layers backward prefetches ahead")
               ->capture_default_str(),
           closed(0, 64));
  cmd->add_option("--json", st->json_path,
                  "Write the results as JSON to FILE ('-' for stdout): offload_gbps, "
                  "reload_gbps, memcpy_gbps, overhead_us_per_tensor, allocations_steady_state, "
                  "then ratios, targets and samples");
  cmd->callback([st]() {
    OffloadBenchOptions options = st->options;
    // The ranges are checked at parse time (in_range); a tensor is at least one byte.
    const double bytes = std::max(1.0, std::round(st->tensor_mib * (1 << 20)));
    options.tensor_bytes = static_cast<size_t>(bytes);
    options.cuda = st->backend == "cuda";

    const auto say = [&](const std::string& text) { say_beside_json(st->json_path, text); };
    say(fmt::format(
        "running on {}: {} layers x {} tensors x {:g} MiB, {} steps x {} repeats ({}, bandwidth "
        "pass, overhead pass interleaved)...\n",
        st->backend, options.layers, options.tensors_per_layer, st->tensor_mib, options.steps,
        options.repeats, options.cuda ? "the link" : "memcpy"));
    const OffloadBenchResult result = run_offload_bench(options);
    say(format_offload_bench(result));
    if (!st->json_path.empty()) write_output(st->json_path, offload_bench_json(result));
  });
}

void add_bench_adam_command(CLI::App& bench) {
  struct State {
    AdamBenchOptions options;
    bool no_torch = false;
    bool no_copy = false;
    std::string json_path;
  };
  auto st = std::make_shared<State>();
  CLI::App* cmd = bench.add_subcommand(
      "adam",
      "The CPU AdamW step (SIMD, all threads): elements/s and GB/s of state traffic (28 "
      "B/element: reads p, g, m, v, writes p, m, v; + 2 for the bf16 copy of p, on by default) "
      "beside, measured in the same run: this machine's memory bandwidth by a STREAM triad with "
      "the same threads (the limit, 16 B/element), the scalar reference on one thread, and "
      "PyTorch's torch.optim.AdamW, foreach=True and fused=True (torch's fastest CPU AdamW, "
      "the baseline to quote), in a Python subprocess when `import torch` works (skipped, and "
      "said so, otherwise). Targets: at least 0.9 x the triad's bytes/s; at least 5 x torch "
      "foreach's elements/s. The SIMD step and the scalar reference must agree to the bit "
      "before anything is timed; the methods are interleaved and figures are medians. Needs "
      "about 36 bytes per element plus 12 per triad element, plus 40 per element for torch.\n\n"
      "Examples:\n"
      "  spillway bench adam\n"
      "  spillway bench adam --elements 4000000 --repeats 2\n"
      "  spillway bench adam --python ~/.cache/spillway/venv-*/bin/python   # a torch with fused\n"
      "  spillway bench adam --threads 1 --no-torch --json -\n"
      "  spillway bench adam --no-torch --passes   # what CPUAdamW's passes cost");
  AdamBenchOptions& o = st->options;
  in_range(
      cmd->add_option("--elements", o.elements, "Elements of state (n); ~30 bytes each per step")
          ->capture_default_str(),
      closed(1, kMaxElements));
  in_range(
      cmd->add_option("--repeats", o.repeats, "Times triad, ours, scalar and torch are interleaved")
          ->capture_default_str(),
      closed(1, kMaxRepeats));
  in_range(
      cmd->add_option("--steps", o.steps, "Timed calls per method and repeat (one sample each)")
          ->capture_default_str(),
      closed(1, 10000));
  in_range(cmd->add_option("--threads", o.threads,
                           "Threads of the AdamW class and of the triad (0: hardware concurrency)")
               ->capture_default_str(),
           closed(0, 4096));
  in_range(cmd->add_option("--check-steps", o.check_steps,
                           "Steps of the bitwise SIMD-vs-scalar check before timing")
               ->capture_default_str(),
           closed(1, 1000));
  in_range(cmd->add_option("--seed", o.seed, "Seed of the random inputs (0: a fresh one, printed)")
               ->capture_default_str(),
           up_to(0, "2^64 - 1"));
  in_range(cmd->add_option("--triad-elements", o.triad_elements,
                           "Elements per triad array (0: max(n, 2^25))")
               ->capture_default_str(),
           closed(0, kMaxElements));
  cmd->add_flag("--no-copy", st->no_copy, "Do not write the bf16 copy of p (28 B/element)");
  cmd->add_flag("--no-torch", st->no_torch, "Skip the PyTorch comparison");
  cmd->add_flag("--passes", o.passes,
                "Also time the passes of CPUAdamW's paths (in place with and without an fp32 "
                "copy, out of place streamed with and without it, with the norm lanes, the "
                "lanes alone) against the in-place step, interleaved (16 more bytes per "
                "element)");
  cmd->add_option("--python", o.python,
                  "Interpreter for the torch comparison (default: python3, then "
                  "/usr/bin/python3, the first that imports torch)");
  cmd->add_option("--json", st->json_path,
                  "Write the results as JSON to FILE ('-' for stdout): elements_per_s, "
                  "state_gbps, triad_gbps, fraction_of_triad, scalar_ratio, torch_ratio, "
                  "torch_fused_ratio, simd_target, threads, samples");
  cmd->callback([st]() {
    AdamBenchOptions options = st->options;
    options.torch = !st->no_torch;
    options.copy_bf16 = !st->no_copy;
    check_adam_bench_options(options);
    const auto say = [&](const std::string& text) { say_beside_json(st->json_path, text); };
    say(fmt::format(
        "running: {} elements, {} timed steps x {} repeats (triad, ours, scalar{} "
        "interleaved)...\n",
        options.elements, options.steps, options.repeats, options.torch ? ", torch" : ""));
    const AdamBenchResult result = run_adam_bench(options);
    say(format_adam_bench(result));
    if (!st->json_path.empty()) write_output(st->json_path, adam_bench_json(result));
  });
}

void add_bench_optim_offload_command(CLI::App& bench) {
  struct State {
    StvBenchOptions options;
    std::optional<double> link_gbps;  // the deprecated spelling of both throttles
    std::string json_path;
  };
  auto st = std::make_shared<State>();
  CLI::App* cmd = bench.add_subcommand(
      "optim-offload",
      "The optimizer-offload pipeline (D2H of each gradient bucket, the CPU AdamW step, the "
      "bf16 weights back up) on the host backend with a throttled link: how long the step "
      "runs past the end of backward (the tail on the critical path) with "
      "speculation-then-validation, against the same pipeline without speculation (every "
      "CPU step after the gradient norm is known), and with a GPU/CPU split chosen from "
      "timings measured in the same run. Every variant must be bitwise the non-speculative "
      "AdamW after a committed and a clipped step before anything is timed. Needs about 60 "
      "bytes per parameter per variant (3 variants).\n\n"
      "Examples:\n"
      "  spillway bench optim-offload\n"
      "  spillway bench optim-offload --buckets 16 --bucket-elements 1000000 --backward-ms 80\n"
      "  spillway bench optim-offload --d2h-gbps 400 --h2d-gbps 400 --device-buckets 2 --json -");
  StvBenchOptions& o = st->options;
  in_range(cmd->add_option("--buckets", o.buckets, "Gradient buckets per step (one per layer, say)")
               ->capture_default_str(),
           closed(1, 4096));
  in_range(cmd->add_option("--bucket-elements", o.bucket_elements, "Parameters per bucket")
               ->capture_default_str(),
           closed(1, 1e9));
  in_range(cmd->add_option("--backward-ms", o.backward_ms,
                           "Length of the emulated backward; buckets arrive evenly over it")
               ->capture_default_str(),
           closed(0, 1e6));
  // The throttles are spelled as in `spillway train`; the old --link-gbps (both at once) is
  // accepted with a deprecation line.
  const FlagRange throttle = closed_or(PlanLimits::kMinGbps, PlanLimits::kMaxGbps, 0);
  CLI::Option* d2h = in_range(
      cmd->add_option("--d2h-gbps", o.d2h_gbps,
                      "Throttle of device->host copies (the gradients) in GB/s (1e9 bytes/s; 0: "
                      "none)")
          ->capture_default_str(),
      throttle);
  CLI::Option* h2d = in_range(
      cmd->add_option("--h2d-gbps", o.h2d_gbps,
                      "Throttle of host->device copies (the weights) in GB/s (1e9 bytes/s; 0: "
                      "none)")
          ->capture_default_str(),
      throttle);
  in_range(cmd->add_option("--link-gbps", st->link_gbps,
                           "The old spelling of --d2h-gbps and --h2d-gbps together (says so "
                           "when used)")
               ->group("Deprecated")
               ->excludes(d2h)
               ->excludes(h2d),
           throttle)
      ->each([st](const std::string& v) {
        std::fprintf(stderr,
                     "spillway: --link-gbps is deprecated; write --d2h-gbps %s --h2d-gbps %s\n",
                     v.c_str(), v.c_str());
      });
  in_range(
      cmd->add_option("--device-buckets", o.device_buckets,
                      "Buckets stepped on the device in the split variant (-1: chosen from this "
                      "run's timings)")
          ->capture_default_str(),
      FlagRange{0, 0, false, -1, "--buckets"});
  in_range(
      cmd->add_option("--threads", o.threads, "Threads of the CPU AdamW (0: hardware concurrency)")
          ->capture_default_str(),
      closed(0, 4096));
  in_range(cmd->add_option("--repeats", o.repeats, "Times the variants are interleaved")
               ->capture_default_str(),
           closed(1, kMaxRepeats));
  in_range(cmd->add_option("--steps", o.steps, "Timed steps per variant and repeat")
               ->capture_default_str(),
           closed(1, 10000));
  in_range(
      cmd->add_option("--seed", o.seed, "Seed of the weights and gradients")->capture_default_str(),
      up_to(0, "2^64 - 1"));
  cmd->add_option("--json", st->json_path,
                  "Write the results as JSON to FILE ('-' for stdout): stv_tail_ratio, "
                  "stv_step_ratio, variants[] {name, step_ms, tail_ms, ...}, split");
  cmd->callback([st]() {
    StvBenchOptions options = st->options;
    if (st->link_gbps) options.d2h_gbps = options.h2d_gbps = *st->link_gbps;
    check_stv_bench_options(options);
    const auto say = [&](const std::string& text) { say_beside_json(st->json_path, text); };
    say(fmt::format(
        "running: {} buckets x {} elements, 3 variants x {} steps x {} repeats interleaved, "
        "after a bitwise check...\n",
        options.buckets, options.bucket_elements, options.steps, options.repeats));
    const StvBenchResult result = run_stv_bench(options);
    say(format_stv_bench(result));
    if (!st->json_path.empty()) write_output(st->json_path, stv_bench_json(result));
  });
}

void add_bench_gemm_command(CLI::App& bench) {
  struct State {
    GemmBenchOptions options;
    std::string json_path;
  };
  auto st = std::make_shared<State>();
  CLI::App* cmd = bench.add_subcommand(
      "gemm",
      "The GEMMs of a model's layers at the planner's shapes, on the host backend (cblas "
      "sgemm, fp32: what the reference model runs), as measured points for the planner's "
      "efficiency curves: per distinct shape its time, GFLOP/s and efficiency against the "
      "limit. Baseline in the same run: a large square GEMM (the dense GEMM the former "
      "constant stood for); limit: --peak-gflops, else the baseline's rate. Every output is "
      "checked (finite, and random elements against double dot products) before anything "
      "is timed; the baseline and the shapes are interleaved and figures are medians. "
      "--json writes a calibration profile ({\"ops\": [...]}) for `spillway plan --profile` "
      "with a hardware profile of this machine. --backend cuda is the GPU twin: cuBLAS bf16 "
      "GEMMs (fp32 accumulation) at the real workload's shapes, checked in bf16, timed with "
      "CUDA events, efficiencies against --hardware's dense bf16 peak (or --peak-gflops); "
      "without a GPU it says so and writes nothing.\n\n"
      "Examples:\n"
      "  spillway bench gemm\n"
      "  spillway bench gemm --backend cuda --hardware h100-sxm --seq-len 4096 --json h100.json\n"
      "  spillway bench gemm --model Qwen3-30B-A3B --seq-len 256 --ep 8 --json profile.json\n"
      "  spillway bench gemm --model Llama-3.1-8B --seq-len 128 --square 1024 --repeats 2");
  GemmBenchOptions& o = st->options;
  cmd->add_option("--model", o.model, "Catalog model or config.json whose GEMMs are timed")
      ->capture_default_str();
  in_range(cmd->add_option("--micro-batch", o.micro_batch, "Sequences per micro-batch")
               ->capture_default_str(),
           closed(1, 1 << 20));
  in_range(cmd->add_option("--seq-len", o.seq_len,
                           "Tokens per sequence (small by default: a CPU is ~1000x slower "
                           "than a GPU)")
               ->capture_default_str(),
           closed(1, 1 << 26));
  in_range(cmd->add_option("--tp", o.tp, "Tensor-parallel size (widths divided by it)")
               ->capture_default_str(),
           closed(1, 1 << 20));
  in_range(cmd->add_option("--ep", o.ep, "Expert-parallel size (experts per GPU divided by it)")
               ->capture_default_str(),
           closed(1, 1 << 20));
  in_range(cmd->add_option("--square", o.square, "Side of the baseline's square GEMM")
               ->capture_default_str(),
           closed(16, 16384));
  in_range(cmd->add_option("--peak-gflops", o.peak_gflops,
                           "This machine's theoretical fp32 peak, the limit efficiencies are "
                           "taken against (default: the baseline's measured rate)"),
           open_closed(0, 1e9));
  in_range(cmd->add_option("--repeats", o.repeats,
                           "Times the baseline and the shapes are "
                           "interleaved (one sample each)")
               ->capture_default_str(),
           closed(1, kMaxRepeats));
  in_range(cmd->add_option("--threads", o.threads, "OpenBLAS threads")->capture_default_str(),
           closed(1, 1024));
  in_range(cmd->add_option("--check-points", o.check_points,
                           "Output elements per GEMM checked against a double dot product")
               ->capture_default_str(),
           closed(1, 1 << 20));
  in_range(cmd->add_option("--seed", o.seed, "Seed of the inputs (0: a fresh one, printed)")
               ->capture_default_str(),
           up_to(0, "2^64 - 1"));
  cmd->add_option("--backend", o.backend,
                  "host: cblas sgemm in fp32 on this CPU (what the reference model runs); cuda: "
                  "cuBLAS bf16 on GPU 0 (what training runs)")
      ->check(CLI::IsMember({"host", "cuda"}))
      ->capture_default_str();
  cmd->add_option("--hardware", o.hardware,
                  "With --backend cuda: the hardware profile whose dense bf16 peak is the "
                  "limit (or give --peak-gflops)");
  cmd->add_option("--json", st->json_path,
                  "Write the measured points as a calibration profile (schema "
                  "spillway.profile/1, \"ops\") to FILE ('-' for stdout)");
  cmd->callback([st]() {
    const auto say = [&](const std::string& text) { say_beside_json(st->json_path, text); };
    say(fmt::format("running: the GEMMs of {} at micro-batch {} x seq {}, {} repeats...\n",
                    st->options.model, st->options.micro_batch, st->options.seq_len,
                    st->options.repeats));
    const GemmBenchResult result = run_gemm_bench(st->options);
    say(format_gemm_bench(result));
    if (!st->json_path.empty()) write_output(st->json_path, gemm_bench_json(result));
  });
}

// A whole-string number, or nothing ("0.5x", "", "nan" are not alphas).
std::optional<double> parse_number(const std::string& text) {
  try {
    size_t used = 0;
    const double v = std::stod(text, &used);
    if (used == text.size() && std::isfinite(v)) return v;
  } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): not a number, said below
  }
  return std::nullopt;
}

// "MxNxK": rows, columns and depth of a tile, each >= 1.
GemmTiles parse_tiles(const std::string& text) {
  GemmTiles t;
  int64_t* sides[] = {&t.m, &t.n, &t.k};
  size_t at = 0;
  for (int i = 0; i < 3; ++i) {
    const size_t x = i < 2 ? text.find('x', at) : text.size();
    const std::optional<double> v =
        x == std::string::npos ? std::nullopt : parse_number(text.substr(at, x - at));
    if (!v || *v < 1 || *v > 4096 || *v != std::floor(*v))
      SPILLWAY_FIELD_ERROR("--tiles", text,
                           "must be MxNxK (rows, columns, depth of a tile), each an integer in "
                           "[1, 4096]");
    *sides[i] = static_cast<int64_t>(*v);
    at = x + 1;
  }
  return t;
}

void add_bench_hybrid_gemm_command(CLI::App& bench) {
  struct State {
    HybridGemmBenchOptions options;
    std::string dtype = "bf16";
    std::vector<std::string> alphas = {"0", "0.25", "0.5", "0.75", "1"};
    std::string tiles = "64x64x64";
    std::string json_path;
  };
  auto st = std::make_shared<State>();
  CLI::App* cmd = bench.add_subcommand(
      "hybrid-gemm",
      "HybridGEMM (O = X W^T with W in host memory the device reads over the link, Note "
      "[HybridGEMM dataflows]) per alpha, the share of W's columns on the symmetric path: the "
      "bytes the run moves over the link and to and from HBM, counted as it runs (the host "
      "backend's hybrid_gemm_host; on CUDA the counting kernels), against the closed form, "
      "which must be equal in all six figures (an error naming the alpha and both values "
      "otherwise, after the report); the time of the uncounted runs (what the server runs) and "
      "the link bandwidth they achieve, against a copy of the W bytes over the same link "
      "measured in the same run (CUDA: pinned host -> device; host: memcpy). Every output is "
      "checked against double dot products before anything is timed; the copy and the alphas "
      "are interleaved and figures are medians. The tiles and the invariant split are the "
      "serving engine's. --backend cuda runs CUDA device 0's kernels (X and O in device "
      "memory, W in mapped host memory); without a GPU it says so and writes nothing.\n\n"
      "Examples:\n"
      "  spillway bench hybrid-gemm\n"
      "  spillway bench hybrid-gemm --m 64 --n 2048 --k 2048 --dtype fp32 --json -\n"
      "  spillway bench hybrid-gemm --alphas 0,1 --tiles 32x32x64 --repeats 3\n"
      "  spillway bench hybrid-gemm --backend cuda --m 16 --n 8192 --k 8192 --json "
      "hybrid_gemm_cuda.json");
  HybridGemmBenchOptions& o = st->options;
  cmd->add_option("--backend", o.backend,
                  "host: hybrid_gemm_host on this CPU; cuda: the kernels of CUDA device 0")
      ->check(CLI::IsMember({"host", "cuda"}))
      ->capture_default_str();
  in_range(cmd->add_option("--m", o.m, "Rows of X and O (tokens; decode-sized by default)")
               ->capture_default_str(),
           closed(1, 65536));
  in_range(cmd->add_option("--n", o.n, "Columns of O (rows of W)")->capture_default_str(),
           closed(1, 1 << 20));
  in_range(cmd->add_option("--k", o.k, "Depth (columns of X and W)")->capture_default_str(),
           closed(1, 1 << 20));
  cmd->add_option("--dtype", st->dtype, "W's dtype")
      ->check(CLI::IsMember({"bf16", "fp32"}))
      ->capture_default_str();
  cmd->add_option("--alphas", st->alphas,
                  "Shares of W's columns on the symmetric path, comma-separated, each in [0, 1] "
                  "(default 0,0.25,0.5,0.75,1)")
      ->delimiter(',');
  cmd->add_option("--tiles", st->tiles,
                  "Tiles of both paths, MxNxK (the serving engine's by default)")
      ->capture_default_str();
  in_range(cmd->add_option("--repeats", o.repeats,
                           "Times the copy and every alpha's run are interleaved (one sample each)")
               ->capture_default_str(),
           closed(1, kMaxRepeats));
  cmd->add_option("--json", st->json_path,
                  "Write the results as JSON to FILE ('-' for stdout): schema "
                  "spillway.bench.hybrid-gemm/1, all_equal, limit.copy_gbps, and per alpha "
                  "counted, closed_form, equal, ms, link_gbps, fraction_of_copy");
  cmd->callback([st]() {
    HybridGemmBenchOptions options = st->options;
    options.w_dtype = st->dtype == "fp32" ? DType::kFp32 : DType::kBf16;
    options.alphas.clear();
    for (const std::string& a : st->alphas) {
      const std::optional<double> v = parse_number(a);
      if (!v || *v < 0.0 || *v > 1.0)
        SPILLWAY_FIELD_ERROR("--alphas", a, "each must be a number in [0, 1]");
      options.alphas.push_back(*v);
    }
    if (options.alphas.empty())
      SPILLWAY_FIELD_ERROR("--alphas", "empty", "give at least one alpha in [0, 1]");
    options.tiles = parse_tiles(st->tiles);
    const auto say = [&](const std::string& text) { say_beside_json(st->json_path, text); };
    say(fmt::format(
        "running on {}: {}x{}x{} {}, {} alphas, {} repeats (counted and checked first, then "
        "the copy and the uncounted runs interleaved)...\n",
        options.backend, options.m, options.n, options.k, st->dtype, options.alphas.size(),
        options.repeats));
    const HybridGemmBenchResult result = run_hybrid_gemm_bench(options);
    say(format_hybrid_gemm_bench(result));
    if (!st->json_path.empty()) write_output(st->json_path, hybrid_gemm_bench_json(result));
    check_hybrid_gemm_bench(result);
  });
}

}  // namespace

void add_bench_stream_command(CLI::App& bench) {
  struct State {
    StreamBenchOptions options;
    double layer_mib = static_cast<double>(StreamBenchOptions{}.layer_bytes) / (1 << 20);
    std::string json_path;
  };
  auto st = std::make_shared<State>();
  CLI::App* cmd = bench.add_subcommand(
      "stream",
      "The weight streamer on the host backend with a throttled link (an emulated device: a "
      "layer's compute is a timed wait on its compute stream, as a kernel's device time). "
      "Overhead of streaming against every layer resident, same run, when the link time per "
      "layer is below the compute time (target <= 3%); the copy stream's achieved bandwidth "
      "against the link's (target >= 0.9); and for 2 and 4 emulated GPUs behind one link, "
      "full copy against sharded + all-gather: step time and bytes per rank. Every compute "
      "checks its layer's first and last words.\n\n"
      "Examples:\n"
      "  spillway bench stream\n"
      "  spillway bench stream --layers 8 --layer-mb 4 --compute-ms 2 --json -");
  StreamBenchOptions& o = st->options;
  in_range(cmd->add_option("--layers", o.layers, "Layers per step")->capture_default_str(),
           closed(2, 4096));
  in_range(cmd->add_option("--layer-mb", st->layer_mib, "Bytes per layer in MiB (2^20 bytes)")
               ->capture_default_str(),
           open_closed(0, 65536));
  in_range(cmd->add_option("--compute-ms", o.compute_ms, "Device time of a layer's compute")
               ->capture_default_str(),
           open_closed(0, 100000));
  in_range(cmd->add_option("--link-gbps", o.link_gbps, "The host link's bandwidth, GB/s")
               ->capture_default_str(),
           closed(kMinRunLinkGbps, 100000));
  in_range(
      cmd->add_option("--prefetch-depth", o.depth, "Layers copied ahead")->capture_default_str(),
      closed(1, 64));
  in_range(cmd->add_option("--steps", o.steps, "Steps per run; the first is the warm-up")
               ->capture_default_str(),
           closed(2, 10000));
  cmd->add_option("--json", st->json_path, "Write the results as JSON to FILE ('-' for stdout)");
  cmd->callback([st]() {
    StreamBenchOptions options = st->options;
    options.layer_bytes =
        static_cast<size_t>(std::max(1024.0, std::round(st->layer_mib * (1 << 20))));
    const auto say = [&](const std::string& text) { say_beside_json(st->json_path, text); };
    say("running: resident and streamed steps interleaved, then 2 and 4 emulated GPUs on one "
        "link...\n");
    const StreamBenchResult result = run_stream_bench(options);
    say(format_stream_bench(result));
    if (!st->json_path.empty()) write_output(st->json_path, stream_bench_json(result));
  });
}

void add_bench_serve_command(CLI::App& bench) {
  struct State {
    ServeBenchOptions options;
    std::string json_path;
  };
  auto st = std::make_shared<State>();
  CLI::App* cmd = bench.add_subcommand(
      "serve",
      "Host-resident serving on emulated MIG slices of a catalog GPU (every rate of the "
      "hardware times --rate-scale: the ratios of link, HBM and compute are the hardware's). "
      "A model switch (re-pointing a slice at a pooled model, no byte copied, and its first "
      "token through HybridGEMM from host memory) against reloading the same weights into "
      "device memory, same run; then one HybridGEMM on every slice of 1, 3 and 7-way MIG "
      "profiles at once (those --hardware has: on the gh200, 7g.96gb, 2g.24gb and 1g.12gb), "
      "across alpha: the slowest slice, link and HBM bytes, the best alpha per slice count. A "
      "run whose emulated link time alone would pass an hour is refused up front.\n\n"
      "Examples:\n"
      "  spillway bench serve\n"
      "  spillway bench serve --hardware h100-pcie --m 64\n"
      "  spillway bench serve --m 512 --json -");
  ServeBenchOptions& o = st->options;
  cmd->add_option("--hardware", o.hardware, "A catalog GPU with MIG profiles")
      ->capture_default_str();
  in_range(cmd->add_option("--rate-scale", o.rate_scale, "Every hardware rate times this")
               ->capture_default_str(),
           closed(kMinRateScale, 1));
  in_range(cmd->add_option("--m", o.m, "GEMM rows (tokens)")->capture_default_str(),
           closed(1, 65536));
  in_range(cmd->add_option("--n", o.n, "GEMM columns (outputs)")->capture_default_str(),
           closed(1, 65536));
  in_range(cmd->add_option("--k", o.k, "GEMM depth (inputs)")->capture_default_str(),
           closed(1, 65536));
  cmd->add_option("--json", st->json_path, "Write the results as JSON to FILE ('-' for stdout)");
  cmd->callback([st]() {
    const auto say = [&](const std::string& text) { say_beside_json(st->json_path, text); };
    say("running: a model switch against a reload, then HybridGEMM across alpha on 1, 3 and 7 "
        "slices...\n");
    const ServeBenchResult result = run_serve_bench(st->options);
    say(format_serve_bench(result));
    if (!st->json_path.empty()) write_output(st->json_path, serve_bench_json(result));
  });
}

void add_bench_serve_live_command(CLI::App& bench) {
  struct State {
    ServeLiveBenchOptions options;
    std::string json_path;
  };
  auto st = std::make_shared<State>();
  CLI::App* cmd = bench.add_subcommand(
      "serve-live",
      "The live serving engine (the one `spillway serve` runs) on one emulated MIG slice: the "
      "same requests decoded with continuous batching against one request at a time, same "
      "run: tokens/s of each, the ratio, TTFT p99, and the limit (every decoder step reads "
      "the model's weights once over the link). Checks that both runs give the same tokens.\n\n"
      "Examples:\n"
      "  spillway bench serve-live\n"
      "  spillway bench serve-live --config small-moe --max-running 16 --json -");
  ServeLiveBenchOptions& o = st->options;
  cmd->add_option("--config", o.config, "The reference model served (embedded or a path)")
      ->capture_default_str();
  cmd->add_option("--hardware", o.hardware, "A catalog GPU with MIG profiles")
      ->capture_default_str();
  cmd->add_option("--profile", o.profile, "The slice's MIG profile")->capture_default_str();
  in_range(cmd->add_option("--rate-scale", o.rate_scale, "Every hardware rate times this")
               ->capture_default_str(),
           closed(kMinRateScale, 1));
  in_range(cmd->add_option("--requests", o.requests, "Requests")->capture_default_str(),
           closed(1, 100000));
  in_range(cmd->add_option("--prompt-tokens", o.prompt_tokens, "Prompt tokens per request")
               ->capture_default_str(),
           closed(1, 65536));
  in_range(cmd->add_option("--output-tokens", o.output_tokens, "Tokens generated per request")
               ->capture_default_str(),
           closed(1, 65536));
  in_range(cmd->add_option("--max-running", o.max_running, "Requests batched together")
               ->capture_default_str(),
           closed(2, 1024));
  cmd->add_option("--json", st->json_path, "Write the results as JSON to FILE ('-' for stdout)");
  cmd->callback([st]() {
    say_beside_json(st->json_path,
                    "running: the same requests one at a time, then with continuous batching...\n");
    const ServeLiveBenchResult r = run_serve_live_bench(st->options);
    say_beside_json(st->json_path, format_serve_live_bench(r));
    if (!st->json_path.empty()) write_output(st->json_path, serve_live_bench_json(r));
    if (!r.same_tokens) SPILLWAY_INPUT_ERROR("bench serve-live: the two runs' completions differ");
  });
}

void add_bench_commands(CLI::App& bench) {
  bench.require_subcommand(1);
  add_bench_offload_command(bench);
  add_bench_adam_command(bench);
  add_bench_optim_offload_command(bench);
  add_bench_serve_command(bench);
  add_bench_serve_live_command(bench);
  add_bench_gemm_command(bench);
  add_bench_stream_command(bench);
  add_bench_hybrid_gemm_command(bench);
}

int run(int argc, char** argv) {
  CLI::App app{
      "Benchmarks of spillway's engines on this machine: each checks its results before it "
      "times, and prints its baseline measured in the same run and the physical limit.\n\n"
      "Examples:\n"
      "  spillway bench offload\n"
      "  spillway bench offload --layers 16 --tensor-mb 4 --json -\n"
      "  spillway bench adam --elements 4000000 --repeats 2\n"
      "  spillway bench optim-offload\n"
      "  spillway bench gemm --json profile.json\n"
      "  spillway bench stream\n"
      "  spillway bench serve\n"
      "  spillway bench serve-live\n"
      "  spillway bench hybrid-gemm --json -",
      "spillway bench"};
  add_bench_commands(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;
  } catch (const StdoutClosed&) {
    return 1;
  } catch (const spillway::Error& e) {
    std::fprintf(stderr, "spillway: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "spillway: internal error: %s\n", e.what());
    return 1;
  }
  return 0;
}

}  // namespace spillway::bench

int main(int argc, char** argv) {
  return spillway::tool::run_tool(argc, argv, spillway::bench::run);
}
