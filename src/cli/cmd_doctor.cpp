// `spillway doctor`: what this machine has (CUDA devices and driver, the host link probed in
// about a second, the pinned-memory limit, NUMA nodes, the SIMD target of the CPU AdamW,
// the torch a Python interpreter sees) and which of spillway's paths will run here, as
// DeepSpeed's ds_report and `vllm collect-env` do. The report to attach to a bug.
//
// Invariants: every probe that fails is an answer, not an error: its section says why in
// one line and the others still run; the command exits 0 unless a flag asks the impossible
// (a value out of range, an output that cannot be written: exit 1, the flag named). No GPU,
// no driver, no Python and no torch are answers too.
#include <fmt/format.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cli/commands.hpp"
#include "spillway/core/error.hpp"
#include "spillway/device/device.hpp"
#include "spillway/memory/memory.hpp"
#include "spillway/optim/optim.hpp"
#include "spillway/probe/probe.hpp"

namespace spillway::cli {

namespace {

using nlohmann::json;

// The probe's one transfer size, and the emulated device's arena when there is no GPU.
constexpr size_t kProbeBytes = size_t{16} << 20;
constexpr int64_t kHostDeviceBytes = int64_t{64} << 20;
// A soft RLIMIT_MEMLOCK below this is worth a line (distributions default to 8 MiB or 64 KiB).
constexpr uint64_t kLowMemlockBytes = uint64_t{64} << 20;

// "12.4" from the runtime's 12040; "" for 0.
std::string cuda_version_text(int v) {
  return v <= 0 ? std::string() : fmt::format("{}.{}", v / 1000, (v % 1000) / 10);
}

// --- the link ---------------------------------------------------------------------------

struct LinkReport {
  std::string backend;  // Device::name()
  bool emulated = true;
  std::string device_note;  // why not CUDA, when the host backend was measured
  double h2d_pinned_gbps = 0, d2h_pinned_gbps = 0, h2d_pageable_gbps = 0, d2h_pageable_gbps = 0;
  std::vector<std::string> notes;  // the probe's (e.g. a pinned request served by pageable)
  std::string error;               // the probe failed: why
};

LinkReport probe_link(const CudaInfo& cuda, double budget_s) {
  LinkReport r;
  std::unique_ptr<Device> dev;
  if (cuda.devices > 0) dev = make_cuda_device(0, &r.device_note);
  if (!dev) {
    if (r.device_note.empty())
      r.device_note = cuda.note.empty() ? "no CUDA device" : "no CUDA device: " + cuda.note;
    HostDeviceOptions ho;
    ho.device_bytes = kHostDeviceBytes;
    dev = make_host_device(ho);
  }
  r.backend = dev->name();
  r.emulated = dev->emulated();
  ProbeOptions options;
  options.sizes = {kProbeBytes};
  options.repeats = 3;
  options.seconds_budget = budget_s;
  try {
    const ProbeResult p = run_probe(*dev, options);
    for (const ProbePoint& pt : p.points) {
      const bool pinned = pt.host_memory == "pinned";
      double& slot = pt.direction == "H2D" ? (pinned ? r.h2d_pinned_gbps : r.h2d_pageable_gbps)
                                           : (pinned ? r.d2h_pinned_gbps : r.d2h_pageable_gbps);
      slot = pt.gbps_median;
    }
    r.notes = p.notes;
    for (const ProbeSkip& s : p.skipped)
      r.notes.push_back(fmt::format("{} {} bytes skipped: {}", s.host_memory, s.bytes, s.reason));
    if (p.points.empty()) r.error = "no size could be measured";
  } catch (const std::exception& e) {
    r.error = e.what();
  }
  return r;
}

// --- the pinned-memory limit ---------------------------------------------------------------

struct MemlockReport {
  std::optional<uint64_t> soft_bytes, hard_bytes;  // nullopt: unlimited
  std::string error;
};

MemlockReport memlock_limit() {
  MemlockReport r;
  rlimit lim{};
  if (getrlimit(RLIMIT_MEMLOCK, &lim) != 0) {
    r.error = fmt::format("getrlimit(RLIMIT_MEMLOCK): {}", std::strerror(errno));
    return r;
  }
  if (lim.rlim_cur != RLIM_INFINITY) r.soft_bytes = static_cast<uint64_t>(lim.rlim_cur);
  if (lim.rlim_max != RLIM_INFINITY) r.hard_bytes = static_cast<uint64_t>(lim.rlim_max);
  return r;
}

std::string limit_text(const std::optional<uint64_t>& bytes) {
  if (!bytes) return "unlimited";
  if (*bytes >= (uint64_t{1} << 30))
    return fmt::format("{:.1f} GiB", static_cast<double>(*bytes) / 1073741824.0);
  if (*bytes >= (uint64_t{1} << 20))
    return fmt::format("{:.1f} MiB", static_cast<double>(*bytes) / 1048576.0);
  return fmt::format("{} KiB", *bytes / 1024);
}

// --- Python and torch -------------------------------------------------------------------------

struct PythonReport {
  std::string asked;        // --python, or "python3"
  std::string interpreter;  // the path run; "" when not found
  std::string executable;   // sys.executable (a pyenv shim's real interpreter)
  std::string version;
  std::string torch;  // torch.__version__; "" when torch does not import
  std::string torch_cuda;
  bool torch_cuda_available = false;
  std::string torch_note;    // why torch is not there
  std::string package;       // the spillway package's file, "" when it does not import
  std::string package_note;  // why not
  std::string error;         // the interpreter is not there or printed no report: why
};

// `name` as the shell would find it: a path with a slash as it is, else the first
// executable of that name on PATH; "" when there is none.
std::string find_program(const std::string& name) {
  if (name.find('/') != std::string::npos) return access(name.c_str(), X_OK) == 0 ? name : "";
  const char* path = std::getenv("PATH");
  std::string dirs = path != nullptr ? path : "";
  size_t start = 0;
  while (start <= dirs.size()) {
    size_t end = dirs.find(':', start);
    if (end == std::string::npos) end = dirs.size();
    const std::string dir = end > start ? dirs.substr(start, end - start) : ".";
    const std::string candidate = dir + "/" + name;
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
    start = end + 1;
  }
  return "";
}

std::string shell_quoted(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// Printed by the interpreter as one JSON line: what it is and what it imports. Neither
// import may stop the report (torch missing is an answer).
constexpr const char* kPythonScript = R"(import json, sys
r = {"python": sys.executable, "version": sys.version.split()[0]}
try:
    import torch
    r["torch"] = torch.__version__
    r["torch_cuda"] = torch.version.cuda or ""
    r["torch_cuda_available"] = bool(torch.cuda.is_available())
except Exception as e:
    r["torch_note"] = type(e).__name__ + ": " + str(e)
try:
    import spillway
    r["package"] = spillway.__file__ or ""
except Exception as e:
    r["package_note"] = type(e).__name__ + ": " + str(e)
print(json.dumps(r))
)";

PythonReport python_report(const std::string& asked, int timeout_s) {
  PythonReport r;
  r.asked = asked;
  r.interpreter = find_program(asked);
  if (r.interpreter.empty()) {
    r.error = asked.find('/') != std::string::npos
                  ? fmt::format("not found: {} is not an executable file", asked)
                  : fmt::format("not found: no {} on PATH", asked);
    return r;
  }
  const std::string cmd = fmt::format("timeout {} {} -c {} 2>/dev/null", timeout_s,
                                      shell_quoted(r.interpreter), shell_quoted(kPythonScript));
  std::fflush(stdout);
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) {
    r.error = fmt::format("could not run {}: {}", r.interpreter, std::strerror(errno));
    return r;
  }
  std::string out;
  char buf[4096];
  size_t n = 0;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int status = pclose(p);
  const int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  // The last line is the report (an interpreter's startup may print before it).
  while (!out.empty() && out.back() == '\n') out.pop_back();
  const std::string last =
      out.substr(out.rfind('\n') == std::string::npos ? 0 : out.rfind('\n') + 1);
  const json j = json::parse(last, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) {
    r.error = code == 124
                  ? fmt::format("{} ran past {} s and was stopped", r.interpreter, timeout_s)
                  : fmt::format(
                        "{} printed no report (exit status {}); is it a Python 3 "
                        "interpreter?",
                        r.interpreter, code);
    return r;
  }
  const auto text = [&](const char* key) {
    return j.contains(key) && j[key].is_string() ? j[key].get<std::string>() : std::string();
  };
  r.executable = text("python");
  r.version = text("version");
  r.torch = text("torch");
  r.torch_cuda = text("torch_cuda");
  r.torch_cuda_available = j.value("torch_cuda_available", false);
  r.torch_note = text("torch_note");
  r.package = text("package");
  r.package_note = text("package_note");
  return r;
}

// --- the report ---------------------------------------------------------------------------------

struct PathLine {
  std::string name;    // "device backend"
  bool runs = false;   // the real path (false: emulated or absent)
  std::string detail;  // what runs, and why not the real path
};

struct Report {
  CudaInfo cuda;
  HostTopology pci;
  LinkReport link;
  bool link_probed = false;
  MemlockReport memlock;
  NumaInfo numa;
  unsigned cores = 0;
  std::string simd_target;
  std::vector<std::string> simd_targets;
  PythonReport python;
  std::vector<PathLine> paths;
};

std::vector<PathLine> paths_here(const Report& r) {
  std::vector<PathLine> out;
  const bool gpu = !r.link.emulated;
  out.push_back({"device backend", gpu,
                 gpu ? fmt::format("CUDA: {}", r.link.backend)
                     : fmt::format("host emulation ({})", r.link.device_note)});
  // The probe's note when the backend served a pinned request with pageable memory.
  std::string fallback;
  for (const std::string& n : r.link.notes)
    if (fallback.empty() && n.find("could not pin") != std::string::npos) fallback = n;
  const bool pinned_fell_back = !fallback.empty();
  out.push_back({"pinned host memory", gpu && !pinned_fell_back,
                 !gpu ? std::string("emulated: ordinary host memory, no GPU to pin for")
                 : pinned_fell_back ? "pageable fallback: " + fallback
                 : r.link_probed
                     ? std::string("page-locked (cudaHostAlloc)")
                     : std::string("page-locked (cudaHostAlloc; not checked: --no-probe)")});
  const bool nccl = r.cuda.nccl_compiled && r.cuda.devices > 0;
  out.push_back({"NCCL all-gather", nccl,
                 nccl ? fmt::format("sharded weight streaming over NCCL, {} GPU(s)", r.cuda.devices)
                 : !r.cuda.compiled
                     ? std::string("host all-gather (emulated): built without the CUDA backend")
                 : !r.cuda.nccl_compiled
                     ? std::string("host all-gather (emulated): built without NCCL")
                     : std::string("host all-gather (emulated): no CUDA device")});
  out.push_back({"NUMA binding", r.numa.available && r.numa.nodes > 1,
                 !r.numa.available ? "none: " + r.numa.note
                 : r.numa.nodes > 1
                     ? fmt::format("pinned slabs bound to the GPU's node ({} nodes)", r.numa.nodes)
                     : std::string("none needed: one node")});
  out.push_back({"CPU AdamW", true, fmt::format("SIMD {} on {} cores", r.simd_target, r.cores)});
  const PythonReport& py = r.python;
  const bool adapter = py.error.empty() && !py.torch.empty() && !py.package.empty();
  std::string why;
  if (!py.error.empty()) {
    why = "python " + py.error;
  } else if (py.torch.empty()) {
    why = fmt::format("torch does not import in {} ({})", py.interpreter, py.torch_note);
  } else if (py.package.empty()) {
    why = fmt::format("the spillway package does not import in {} (pip install .)", py.interpreter);
  } else {
    why = fmt::format("spillway.torch with torch {} ({})", py.torch,
                      py.torch_cuda_available ? "CUDA" : "CPU only: torch sees no GPU");
  }
  out.push_back({"PyTorch adapter", adapter, why});
  return out;
}

std::string text_report(const Report& r) {
  std::string out =
      "spillway doctor: what this machine has, and which of spillway's paths run here\n\n";
  const auto row = [&](const char* label, const std::string& text) {
    out += fmt::format("{:<11} {}\n", label, text);
  };
  const CudaInfo& c = r.cuda;
  row("spillway",
      fmt::format(
          "{}; CUDA backend {}{}; NCCL {}", kVersion, c.compiled ? "compiled" : "not compiled",
          c.compiled ? " (runtime " + cuda_version_text(c.runtime_version) + ")" : std::string(),
          c.nccl_compiled ? "compiled" : "not compiled"));
  row("CUDA",
      c.driver_version > 0
          ? fmt::format("driver {} (CUDA {})", c.driver_version,
                        cuda_version_text(c.driver_version))
          : std::string(c.compiled ? "driver: none found" : "driver: not asked (no CUDA backend)"));
  if (c.gpus.empty()) {
    row("", "no CUDA device" + (c.note.empty() ? std::string() : ": " + c.note));
  }
  for (size_t i = 0; i < c.gpus.size(); ++i) {
    const CudaDeviceInfo& g = c.gpus[i];
    row("", fmt::format("cuda:{} {}, {:.1f} GB, compute {}.{}, PCI {}{}", i, g.name,
                        static_cast<double>(g.bytes_total) / 1e9, g.compute_major, g.compute_minor,
                        g.pci_bus_id, g.pageable_access ? ", addresses pageable memory" : ""));
  }
  row("PCI", r.pci.gpus.empty()
                 ? (r.pci.note.empty() ? std::string("no NVIDIA GPU in the PCI tree") : r.pci.note)
                 : fmt::format("{} NVIDIA GPU(s), at most {} per host link (root port)",
                               r.pci.gpus.size(), r.pci.max_gpus_per_link));
  if (!r.link_probed) {
    row("host link", "not probed (--no-probe)");
  } else if (!r.link.error.empty()) {
    row("host link", fmt::format("{}: probe failed: {}", r.link.backend, r.link.error));
  } else {
    row("host link",
        fmt::format("{}: pinned H2D {:.1f} GB/s, D2H {:.1f} GB/s; pageable H2D {:.1f}, D2H {:.1f} "
                    "(16 MiB copies, median){}",
                    r.link.backend, r.link.h2d_pinned_gbps, r.link.d2h_pinned_gbps,
                    r.link.h2d_pageable_gbps, r.link.d2h_pageable_gbps,
                    r.link.emulated ? "; emulated: this machine's memcpy, not a GPU link" : ""));
    for (const std::string& n : r.link.notes) row("", "note: " + n);
  }
  if (!r.memlock.error.empty()) {
    row("memlock", r.memlock.error);
  } else {
    const bool low = r.memlock.soft_bytes && *r.memlock.soft_bytes < kLowMemlockBytes;
    row("memlock", fmt::format("RLIMIT_MEMLOCK (ulimit -l): soft {}, hard {}{}",
                               limit_text(r.memlock.soft_bytes), limit_text(r.memlock.hard_bytes),
                               low ? "; low: page-locking with mlock or RDMA registration (NCCL "
                                     "over InfiniBand) stops there (`ulimit -l unlimited`)"
                                   : ""));
  }
  row("NUMA", r.numa.available ? fmt::format("{} node(s)", r.numa.nodes) : r.numa.note);
  std::string targets;
  for (const std::string& t : r.simd_targets) targets += (targets.empty() ? "" : ", ") + t;
  row("CPU", fmt::format("{} cores; AdamW dispatches to {} (compiled in and supported: {})",
                         r.cores, r.simd_target, targets));
  const PythonReport& py = r.python;
  if (!py.error.empty()) {
    row("python", py.asked + ": " + py.error);
  } else {
    row("python", fmt::format("{} (Python {}{})", py.interpreter, py.version,
                              py.executable.empty() || py.executable == py.interpreter
                                  ? std::string()
                                  : ", running " + py.executable));
    row("", py.torch.empty() ? "torch: not found (" + py.torch_note + ")"
                             : fmt::format("torch {}, built for CUDA {}, {}", py.torch,
                                           py.torch_cuda.empty() ? "none" : py.torch_cuda,
                                           py.torch_cuda_available ? "sees a GPU" : "sees no GPU"));
    row("", py.package.empty() ? "spillway package: not found (" + py.package_note + ")"
                               : "spillway package: " + py.package);
  }
  out += "\nPaths that run here:\n";
  for (const PathLine& p : r.paths)
    out += fmt::format("  {:<19} {:<4} {}\n", p.name, p.runs ? "yes" : "no", p.detail);
  return out;
}

json nullable(const std::string& s) {
  return s.empty() ? json(nullptr) : json(s);
}
json nullable(const std::optional<uint64_t>& v) {
  return v ? json(*v) : json(nullptr);
}

std::string json_report(const Report& r) {
  json j;
  j["schema"] = "spillway.doctor/1";
  j["spillway"] = {{"version", kVersion},
                   {"cuda_backend_compiled", r.cuda.compiled},
                   {"nccl_compiled", r.cuda.nccl_compiled}};
  json gpus = json::array();
  for (size_t i = 0; i < r.cuda.gpus.size(); ++i) {
    const CudaDeviceInfo& g = r.cuda.gpus[i];
    gpus.push_back({{"ordinal", i},
                    {"name", g.name},
                    {"pci_bus_id", g.pci_bus_id},
                    {"bytes_total", g.bytes_total},
                    {"compute_capability", fmt::format("{}.{}", g.compute_major, g.compute_minor)},
                    {"pageable_access", g.pageable_access}});
  }
  j["cuda"] = {{"driver_version", nullable(cuda_version_text(r.cuda.driver_version))},
               {"runtime_version", nullable(cuda_version_text(r.cuda.runtime_version))},
               {"devices", gpus},
               {"note", nullable(r.cuda.note)}};
  j["pci"] = {{"nvidia_gpus", r.pci.gpus.size()},
              {"max_gpus_per_link", r.pci.max_gpus_per_link},
              {"note", nullable(r.pci.note)}};
  if (r.link_probed) {
    j["link"] = {{"backend", r.link.backend},
                 {"emulated", r.link.emulated},
                 {"bytes_per_copy", kProbeBytes},
                 {"h2d_pinned_gbps", r.link.h2d_pinned_gbps},
                 {"d2h_pinned_gbps", r.link.d2h_pinned_gbps},
                 {"h2d_pageable_gbps", r.link.h2d_pageable_gbps},
                 {"d2h_pageable_gbps", r.link.d2h_pageable_gbps},
                 {"notes", r.link.notes},
                 {"error", nullable(r.link.error)}};
  } else {
    j["link"] = nullptr;
  }
  j["memlock"] = {{"soft_bytes", nullable(r.memlock.soft_bytes)},
                  {"hard_bytes", nullable(r.memlock.hard_bytes)},
                  {"error", nullable(r.memlock.error)}};
  j["numa"] = {
      {"available", r.numa.available}, {"nodes", r.numa.nodes}, {"note", nullable(r.numa.note)}};
  j["cpu"] = {{"cores", r.cores},
              {"adamw_simd_target", r.simd_target},
              {"adamw_simd_targets", r.simd_targets}};
  const PythonReport& py = r.python;
  j["python"] = {{"asked", py.asked},
                 {"interpreter", nullable(py.interpreter)},
                 {"executable", nullable(py.executable)},
                 {"version", nullable(py.version)},
                 {"torch", nullable(py.torch)},
                 {"torch_cuda", nullable(py.torch_cuda)},
                 {"torch_cuda_available", py.torch_cuda_available},
                 {"torch_note", nullable(py.torch_note)},
                 {"package", nullable(py.package)},
                 {"package_note", nullable(py.package_note)},
                 {"error", nullable(py.error)}};
  json paths = json::array();
  for (const PathLine& p : r.paths)
    paths.push_back({{"name", p.name}, {"runs", p.runs}, {"detail", p.detail}});
  j["paths"] = paths;
  return j.dump(2) + "\n";
}

}  // namespace

void add_doctor_command(CLI::App& app) {
  overview_line("doctor", Group::kTools,
                "what this machine has, and which of spillway's paths run here");
  struct State {
    std::string python = "python3";
    double probe_budget_s = 1.0;
    bool no_probe = false;
    int python_timeout_s = 60;
    std::string json_path;
  };
  auto st = std::make_shared<State>();
  CLI::App* cmd = app.add_subcommand(
      "doctor",
      "What this machine has, and which of spillway's paths will run here: the report to "
      "read before a job and to attach to a bug. It names the CUDA devices and driver (or why "
      "there is none), the GPUs per host link in the PCI tree, the host link probed in about "
      "a second (the GPU's, or this machine's memcpy through the emulated device), the "
      "pinned-memory limit (RLIMIT_MEMLOCK, `ulimit -l`), the NUMA nodes, the SIMD target the "
      "CPU AdamW dispatches to, and the torch and spillway package a Python interpreter "
      "imports. Then, per path (device backend, pinned host memory, NCCL all-gather, NUMA "
      "binding, CPU AdamW, PyTorch adapter), whether the real one runs here or what runs "
      "instead, and why. A probe that fails says why in its line; doctor still exits 0.\n\n"
      "Examples:\n"
      "  spillway doctor\n"
      "  spillway doctor --json | jq '.paths[] | select(.runs | not)'\n"
      "  spillway doctor --python ~/.venv/bin/python --json doctor.json\n"
      "  spillway doctor --no-probe");
  cmd->add_option("--python", st->python,
                  "Python interpreter whose torch and spillway package to report: a name "
                  "looked up on PATH or a path (as `spillway bench adam --python` takes)")
      ->capture_default_str();
  in_range(cmd->add_option("--probe-budget-s", st->probe_budget_s,
                           "Rough bound on the link probe's wall time in seconds")
               ->capture_default_str(),
           closed(0.05, 60));
  cmd->add_flag("--no-probe", st->no_probe, "Skip the link probe (the other sections are instant)");
  in_range(cmd->add_option("--python-timeout-s", st->python_timeout_s,
                           "Stop the Python interpreter after this many seconds (importing torch "
                           "can take a while)")
               ->capture_default_str(),
           closed(1, 3600));
  cmd->add_option("--json", st->json_path,
                  "Write the report as JSON (schema spillway.doctor/1) to FILE; without FILE, or "
                  "'-', to stdout (the text report then goes nowhere)")
      ->type_name("[FILE]")
      ->expected(0, 1);
  cmd->callback([cmd, st]() {
    std::string json_path = st->json_path;
    if (cmd->count("--json") > 0 && json_path.empty()) json_path = "-";
    Report r;
    r.cuda = cuda_info();
    r.pci = detect_host_topology();
    r.link_probed = !st->no_probe;
    if (r.link_probed) {
      r.link = probe_link(r.cuda, st->probe_budget_s);
    } else {
      // Which device would run, without measuring it.
      std::string why;
      std::unique_ptr<Device> dev;
      if (r.cuda.devices > 0) dev = make_cuda_device(0, &why);
      r.link.emulated = dev == nullptr;
      r.link.backend = dev ? dev->name() : "host";
      r.link.device_note = dev                   ? std::string()
                           : !why.empty()        ? why
                           : r.cuda.note.empty() ? std::string("no CUDA device")
                                                 : "no CUDA device: " + r.cuda.note;
    }
    r.memlock = memlock_limit();
    r.numa = numa_info();
    r.cores = std::thread::hardware_concurrency();
    r.simd_target = optim::adamw_simd_target();
    r.simd_targets = optim::adamw_simd_targets();
    r.python = python_report(st->python, st->python_timeout_s);
    r.paths = paths_here(r);
    if (json_path != "-") write_output("-", text_report(r));
    if (!json_path.empty()) write_output(json_path, json_report(r));
  });
}

}  // namespace spillway::cli
