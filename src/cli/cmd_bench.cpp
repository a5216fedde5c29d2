// `spillway bench ...`: the benchmarks are their own tool, spillway-bench (bench/, a leaf
// nothing under src/ includes, as llama-bench is llama.cpp's). This subcommand runs it from
// beside this binary with the same arguments (exec: its output, exit status and signals are
// the command's), so `spillway bench offload` and `spillway bench --help` work as before.
// A build that has only the CLI (`make run`) says how to build it.
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cli/commands.hpp"
#include "spillway/core/error.hpp"

namespace spillway::cli {

namespace {

// The folder of the running binary (/proc/self/exe), or "." when it cannot be read.
std::string own_folder() {
  char buf[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return ".";
  const std::string path(buf, static_cast<size_t>(n));
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

}  // namespace

void add_bench_command(CLI::App& app) {
  overview_line("bench", Group::kTools, "the benchmarks: each checks its results, then times");
  CLI::App* bench = app.add_subcommand(
      "bench",
      "Benchmarks of spillway's engines on this machine (offload, adam, optim-offload, gemm, "
      "hybrid-gemm, stream, serve, serve-live): each checks its results before it times, and "
      "prints its baseline measured in the same run and the physical limit. Runs "
      "spillway-bench, the benchmarks' own tool beside this command: `spillway bench --help` "
      "lists them.");
  bench->prefix_command();  // every argument after `bench` is spillway-bench's
  bench->set_help_flag();   // --help included
  bench->callback([bench]() {
    std::string tool = own_folder() + "/spillway-bench";
    std::vector<std::string> args = bench->remaining();
    if (access(tool.c_str(), X_OK) != 0)
      SPILLWAY_INPUT_ERROR(
          "spillway bench runs {}, which is not there ({}): this build has the CLI alone; "
          "build the benchmarks with `make build` or `cmake --build build --target "
          "spillway_bench_tool`",
          tool, std::strerror(errno));
    std::vector<char*> argv;
    argv.push_back(tool.data());
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::fflush(stdout);  // what this command printed (nothing, so far) before the tool's
    execv(tool.c_str(), argv.data());
    SPILLWAY_INPUT_ERROR("spillway bench: could not run {}: {}", tool, std::strerror(errno));
  });
}

}  // namespace spillway::cli
