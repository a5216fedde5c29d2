// `spillway doctor` run as a user runs it, on this machine's path: every section answers
// (the no-device branch without a GPU: "no CUDA device" and why, never a crash), --json
// carries every field with its type, a Python that is not there or has no torch is an
// answer, exit 0; only a flag asking the impossible exits non-zero, naming the flag. No
// assertion on a measured figure (the link's GB/s vary with the machine's load).
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <nlohmann/json.hpp>
#include <string>

#include "cli/run_command.hpp"
#include "spillway/device/device.hpp"
#include "test_support.hpp"

namespace spillway {
namespace {

using cli_test::contains;
using nlohmann::json;
using spillway::testing::TempDir;

cli_test::CommandResult doctor(const std::string& args, const std::string& streams = "2>&1") {
  return cli_test::run_command(std::string("timeout 120 '") + SPILLWAY_CLI_PATH + "' doctor " +
                               args + " " + streams);
}

// A stand-in interpreter: prints the report the real one would, with a torch.
std::string fake_python(const TempDir& dir, const std::string& report) {
  static int count = 0;
  const std::string path =
      dir.write("python-fake-" + std::to_string(count++),
                "#!/bin/sh\necho 'startup noise'\ncat <<'EOF'\n" + report + "\nEOF\n");
  chmod(path.c_str(), 0755);
  return path;
}

TEST(CliDoctor, EverySectionAnswersAndDoctorExitsZero) {
  const cli_test::CommandResult r = doctor("--python /nonexistent/python");
  ASSERT_EQ(r.code, 0) << r.out;
  for (const char* section :
       {"\nspillway    0.1.0; CUDA backend ", "\nCUDA ", "\nPCI ", "\nhost link ", "\nmemlock ",
        "RLIMIT_MEMLOCK (ulimit -l): soft ", "\nNUMA ", "\nCPU ", "AdamW dispatches to ",
        "\npython      /nonexistent/python: not found: /nonexistent/python is not an executable",
        "\nPaths that run here:\n", "\n  device backend ", "\n  pinned host memory ",
        "\n  NCCL all-gather ", "\n  NUMA binding ", "\n  CPU AdamW           yes  SIMD ",
        "\n  PyTorch adapter     no   python not found"}) {
    EXPECT_TRUE(contains(r.out, section)) << section << "\n" << r.out;
  }
  const CudaInfo cuda = cuda_info();
  if (cuda.devices == 0) {
    // The no-device branch: said, with the runtime's (or the build's) reason.
    EXPECT_TRUE(contains(r.out, "            no CUDA device")) << r.out;
    EXPECT_TRUE(contains(r.out, "  device backend      no   host emulation (no CUDA device"))
        << r.out;
    EXPECT_TRUE(contains(r.out, "emulated: this machine's memcpy, not a GPU link")) << r.out;
    EXPECT_FALSE(contains(r.out, "probe failed")) << r.out;
  } else {
    EXPECT_TRUE(contains(r.out, "            cuda:0 " + cuda.gpus.at(0).name)) << r.out;
    EXPECT_TRUE(contains(r.out, "  device backend      yes  CUDA: cuda:0")) << r.out;
  }
  // Nothing on stderr but what a backend warns (none on the host path).
  if (cuda.devices == 0) {
    EXPECT_EQ(doctor("--no-probe --python /nonexistent", "2>&1 1>/dev/null").out, "");
  }
}

TEST(CliDoctor, JsonCarriesEveryFieldWithItsType) {
  const cli_test::CommandResult r = doctor("--json --python /nonexistent", "2>/dev/null");
  ASSERT_EQ(r.code, 0) << r.out;
  const json j = json::parse(r.out);  // the JSON alone on stdout: no text report mixed in
  EXPECT_EQ(j.at("schema"), "spillway.doctor/1");
  EXPECT_EQ(j.at("spillway").at("version"), "0.1.0");
  EXPECT_TRUE(j.at("spillway").at("cuda_backend_compiled").is_boolean());
  EXPECT_TRUE(j.at("spillway").at("nccl_compiled").is_boolean());
  const json& cuda = j.at("cuda");
  EXPECT_TRUE(cuda.at("devices").is_array());
  EXPECT_TRUE(cuda.at("driver_version").is_string() || cuda.at("driver_version").is_null());
  EXPECT_TRUE(cuda.at("runtime_version").is_string() || cuda.at("runtime_version").is_null());
  const CudaInfo info = cuda_info();
  ASSERT_EQ(cuda.at("devices").size(), static_cast<size_t>(info.devices));
  for (const json& g : cuda.at("devices")) {
    EXPECT_FALSE(g.at("name").get<std::string>().empty()) << g;
    EXPECT_GT(g.at("bytes_total").get<int64_t>(), 0) << g;
    EXPECT_TRUE(g.at("compute_capability").is_string()) << g;
    EXPECT_TRUE(g.at("pci_bus_id").is_string()) << g;
  }
  if (info.devices == 0) {
    EXPECT_TRUE(cuda.at("note").is_string()) << cuda;
  }
  EXPECT_TRUE(j.at("pci").at("nvidia_gpus").is_number_unsigned());
  const json& link = j.at("link");
  EXPECT_EQ(link.at("emulated").get<bool>(), info.devices == 0) << link;
  EXPECT_EQ(link.at("bytes_per_copy"), 16777216);
  EXPECT_TRUE(link.at("error").is_null()) << link;
  for (const char* k :
       {"h2d_pinned_gbps", "d2h_pinned_gbps", "h2d_pageable_gbps", "d2h_pageable_gbps"}) {
    EXPECT_GT(link.at(k).get<double>(), 0.0) << k;  // measured, whatever the figure
  }
  EXPECT_TRUE(j.at("memlock").at("error").is_null());
  for (const char* k : {"soft_bytes", "hard_bytes"}) {
    const json& v = j.at("memlock").at(k);
    EXPECT_TRUE(v.is_number_unsigned() || v.is_null()) << k << ": " << v;  // null: unlimited
  }
  EXPECT_TRUE(j.at("numa").at("available").is_boolean());
  EXPECT_GE(j.at("numa").at("nodes").get<int>(), 1);
  EXPECT_GE(j.at("cpu").at("cores").get<int>(), 1);
  const std::string target = j.at("cpu").at("adamw_simd_target");
  const json& targets = j.at("cpu").at("adamw_simd_targets");
  ASSERT_FALSE(targets.empty());
  EXPECT_EQ(targets.front(), target) << "the dispatch picks the best target";
  EXPECT_EQ(j.at("python").at("asked"), "/nonexistent");
  EXPECT_TRUE(j.at("python").at("interpreter").is_null());
  EXPECT_TRUE(contains(j.at("python").at("error").get<std::string>(), "not found"));
  std::vector<std::string> names;
  for (const json& p : j.at("paths")) {
    names.push_back(p.at("name"));
    EXPECT_TRUE(p.at("runs").is_boolean()) << p;
    EXPECT_FALSE(p.at("detail").get<std::string>().empty()) << p;
  }
  EXPECT_EQ(names,
            (std::vector<std::string>{"device backend", "pinned host memory", "NCCL all-gather",
                                      "NUMA binding", "CPU AdamW", "PyTorch adapter"}));
  EXPECT_EQ(j.at("paths").at(0).at("runs").get<bool>(), info.devices > 0);
  // --no-probe: no link measured, and the field says so.
  const json quick = json::parse(doctor("--no-probe --json - --python /x", "2>/dev/null").out);
  EXPECT_TRUE(quick.at("link").is_null());
  EXPECT_EQ(quick.at("paths").at(0).at("runs").get<bool>(), info.devices > 0);
}

TEST(CliDoctor, ThePythonsTorchAndPackageAreReportedOrSaidMissing) {
  TempDir dir;
  const std::string with_torch = fake_python(
      dir,
      R"({"python": "/opt/py/bin/python3.12", "version": "3.12.1", "torch": "2.5.1+cu124", )"
      R"("torch_cuda": "12.4", "torch_cuda_available": false, "package": "/site/spillway/__init__.py"})");
  cli_test::CommandResult r = doctor("--no-probe --python '" + with_torch + "'");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "(Python 3.12.1, running /opt/py/bin/python3.12)")) << r.out;
  EXPECT_TRUE(contains(r.out, "torch 2.5.1+cu124, built for CUDA 12.4, sees no GPU")) << r.out;
  EXPECT_TRUE(contains(r.out, "spillway package: /site/spillway/__init__.py")) << r.out;
  EXPECT_TRUE(contains(r.out,
                       "  PyTorch adapter     yes  spillway.torch with torch 2.5.1+cu124 "
                       "(CPU only: torch sees no GPU)"))
      << r.out;

  const std::string without = fake_python(
      dir,
      R"({"python": "/usr/bin/python3", "version": "3.11.2", "torch_note": "ModuleNotFoundError: No module named 'torch'", "package_note": "ModuleNotFoundError: No module named 'spillway'"})");
  r = doctor("--no-probe --json - --python '" + without + "'", "2>/dev/null");
  ASSERT_EQ(r.code, 0) << r.out;
  const json j = json::parse(r.out);
  EXPECT_TRUE(j.at("python").at("torch").is_null());
  EXPECT_EQ(j.at("python").at("torch_note"), "ModuleNotFoundError: No module named 'torch'");
  EXPECT_EQ(
      j.at("paths").at(5).at("detail"),
      "torch does not import in " + without + " (ModuleNotFoundError: No module named 'torch')");

  // Not a Python: it prints no report; said in one line, still exit 0.
  r = doctor("--no-probe --python /bin/true");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "python      /bin/true: /bin/true printed no report (exit status 0)"))
      << r.out;
  // A name looked up on PATH that is not there.
  r = doctor("--no-probe --python no-such-python-xyz");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "no-such-python-xyz: not found: no no-such-python-xyz on PATH"))
      << r.out;
}

TEST(CliDoctor, OnlyTheImpossibleFailsAndHelpTeaches) {
  cli_test::CommandResult r = doctor("--probe-budget-s 0 --python /x");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "--probe-budget-s")) << r.out;
  TempDir dir;
  r = doctor("--no-probe --python /x --json '" + dir.path().string() + "'");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, dir.path().string())) << r.out;
  r = doctor("--help");
  EXPECT_EQ(r.code, 0) << r.out;
  for (const char* s : {"Examples:", "spillway doctor --json", "--python", "--no-probe",
                        "RLIMIT_MEMLOCK", "per path", "doctor still exits 0"}) {
    EXPECT_TRUE(contains(r.out, s)) << s << "\n" << r.out;
  }
}

}  // namespace
}  // namespace spillway
