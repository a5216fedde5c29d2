// Every output of every subcommand, written where it cannot go: a full device (/dev/full),
// a directory, a pipe whose reader has gone, a file beyond the size limit. Each is an
// error (exit 1, never a crash signal) naming the path and the system's reason, and no
// temporary or half-written file is left behind; an existing file keeps its contents.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "cli/run_command.hpp"
#include "test_support.hpp"

namespace spillway {
namespace {

using cli_test::contains;
using cli_test::read_file;
using spillway::testing::TempDir;

// Small, quick runs of each subcommand that writes; `{}` is where an output flag goes.
const char* const kPlan = "plan --model Mistral-7B --hardware gb200";
const char* const kSimulate = "simulate --model Mistral-7B --hardware gb200";
const char* const kTrain = "train --steps 1 --micro-batch 2 --seq-len 32 --quiet";
const char* const kProbe =
    "probe --device host --device-memory-mb 64 --sizes 1M --repeats 1 --no-pageable";
const char* const kBenchOffload =
    "bench offload --layers 2 --tensors-per-layer 2 --tensor-mb 1 --steps 2 --repeats 1";
const char* const kBenchAdam =
    "bench adam --elements 4096 --repeats 1 --steps 1 --check-steps 1 --triad-elements 4096 "
    "--no-torch";
const char* const kBenchStv =
    "bench optim-offload --buckets 2 --bucket-elements 4096 --backward-ms 0.1 --repeats 1 "
    "--steps 1";

struct CliRun {
  int code = -1;
  std::string out;
};

// Runs `spillway <args> <redirections>` under sh.
CliRun run(const std::string& args, const std::string& redirections = "2>&1") {
  const cli_test::CommandResult c = cli_test::run_command(std::string("'") + SPILLWAY_CLI_PATH +
                                                          "' " + args + " " + redirections);
  return {c.code, c.out};
}

std::vector<std::string> entries(const std::filesystem::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    names.push_back(e.path().filename().string());
  return names;
}

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const std::string& x : v) s += " '" + x + "'";
  return s;
}

// /dev/full as a device. (A writer that renames a temporary file over its path would, run
// as root, replace the device with a regular file: each test checks it is still one.)
bool have_dev_full() {
  return std::filesystem::is_character_file("/dev/full");
}

TEST(CliOutput, FileOutputToAFullDeviceFailsNamingThePathAndTheReason) {
  if (!have_dev_full()) GTEST_SKIP() << "no /dev/full";
  const std::vector<std::string> cases = {
      std::string(kPlan) + " --json /dev/full",
      std::string(kSimulate) + " --json /dev/full",
      std::string(kSimulate) + " --trace /dev/full",
      std::string(kSimulate) + " --plot /dev/full",
      std::string(kTrain) + " --json /dev/full",
      std::string(kProbe) + " --json /dev/full",
      std::string(kBenchOffload) + " --json /dev/full",
      std::string(kBenchAdam) + " --json /dev/full",
      std::string(kBenchStv) + " --json /dev/full",
  };
  for (const std::string& args : cases) {
    SCOPED_TRACE(args);
    const CliRun r = run(args, "2>&1 >/dev/null");  // stderr only
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_TRUE(contains(r.out, "cannot write '/dev/full': No space left on device")) << r.out;
    ASSERT_TRUE(have_dev_full()) << "/dev/full was replaced by a file";
  }
}

TEST(CliOutput, StdoutToAFullDeviceFails) {
  if (!have_dev_full()) GTEST_SKIP() << "no /dev/full";
  const std::vector<std::string> cases = {
      kPlan,
      std::string(kPlan) + " --json -",
      kSimulate,
      std::string(kSimulate) + " --json -",
      std::string(kSimulate) + " --trace -",
      kTrain,
      std::string(kTrain) + " --json -",
      kProbe,
      kBenchOffload,
      kBenchAdam,
      kBenchStv,
      "models",
      "hardware",
  };
  for (const std::string& args : cases) {
    SCOPED_TRACE(args);
    const CliRun r = run(args, "2>&1 >/dev/full");  // stderr to the pipe, stdout to /dev/full
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_TRUE(contains(r.out, "cannot write to stdout: No space left on device")) << r.out;
  }
  // CLI11 prints --help itself; the check at exit still sees the loss.
  const CliRun help = run("plan --help", "2>&1 >/dev/full");
  EXPECT_EQ(help.code, 1) << help.out;
  EXPECT_TRUE(contains(help.out, "cannot write to stdout")) << help.out;
  EXPECT_FALSE(contains(help.out, "Success")) << help.out;
}

TEST(CliOutput, DirectoryAsOutputPathSaysIsADirectory) {
  TempDir dir;
  const std::string d = dir.path().string();
  std::filesystem::create_directory(dir.file("out"));
  const std::string out = dir.file("out");
  const std::vector<std::string> cases = {
      std::string(kPlan) + " --json '" + out + "'",
      std::string(kPlan) + " --json '" + out + "/'",
      std::string(kSimulate) + " --trace '" + out + "'",
      std::string(kSimulate) + " --plot '" + out + "'",
      std::string(kSimulate) + " --json '" + out + "'",
      std::string(kTrain) + " --json '" + out + "'",
  };
  for (const std::string& args : cases) {
    SCOPED_TRACE(args);
    const CliRun r = run(args, "2>&1 >/dev/null");
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_TRUE(contains(r.out, "cannot write '" + out)) << r.out;
    EXPECT_TRUE(contains(r.out, "Is a directory")) << r.out;
    EXPECT_FALSE(contains(r.out, "Success")) << r.out;
    EXPECT_EQ(entries(dir.path()), std::vector<std::string>{"out"}) << joined(entries(dir.path()));
    EXPECT_TRUE(entries(out).empty()) << joined(entries(out));
  }
}

TEST(CliOutput, ADirectoryForTheJsonFailsBeforeTheReport) {
  TempDir dir;
  std::filesystem::create_directory(dir.file("out"));
  for (const std::string& args :
       {std::string(kPlan) + " --json '" + dir.file("out") + "'",
        std::string(kPlan) + " --json '" + dir.file("no/such/dir/p.json") + "'",
        std::string("replay --max-requests 10 --json '") + dir.file("out") + "'"}) {
    SCOPED_TRACE(args);
    const CliRun r = run(args);
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_TRUE(contains(r.out, "cannot write '")) << r.out;
    // Nothing of the report (plan) or of the replay's announcement was printed.
    EXPECT_FALSE(contains(r.out, "HBM")) << r.out;
    EXPECT_FALSE(contains(r.out, "replaying")) << r.out;
  }
}

TEST(CliOutput, ReplayRefusesAnUnknownModelBeforeItStarts) {
  const CliRun r = run("replay --max-requests 10 --models nosuch");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "'nosuch' is neither a catalog model")) << r.out;
  EXPECT_FALSE(contains(r.out, "replaying")) << r.out;
}

TEST(CliOutput, ClosedPipeExitsNonZeroWithoutASignal) {
  // The trace of a training step (> 128 KiB) is longer than a pipe holds (64 KiB), so spillway
  // writes after `head` has gone: EPIPE, not SIGPIPE (exit 141).
  const std::vector<std::string> cases = {
      std::string(kSimulate) + " --trace -",
      std::string(kSimulate) + " --json /dev/null --trace -",
  };
  for (const std::string& args : cases) {
    SCOPED_TRACE(args);
    const std::string cmd = std::string("bash -c \"'") + SPILLWAY_CLI_PATH + "' " + args +
                            " 2>/dev/null | head -c1 >/dev/null; exit \\${PIPESTATUS[0]}\"";
    const cli_test::CommandResult c = cli_test::run_command(cmd);
    EXPECT_EQ(c.code, 1) << cmd;
  }
  // The trace is long enough for the test to mean something.
  const CliRun full = run(std::string(kSimulate) + " --trace -", "2>/dev/null");
  EXPECT_GT(full.out.size(), size_t{128} << 10);
}

TEST(CliOutput, FailedWriteLeavesNoTemporaryAndKeepsTheOldFile) {
  // A file size limit of 1 block (512 or 1024 bytes): every output here is larger, so the
  // write fails with EFBIG ("File too large"), not SIGXFSZ.
  TempDir dir;
  const std::vector<std::pair<std::string, std::string>> cases = {
      {kPlan, "--json"},     {kSimulate, "--json"}, {kSimulate, "--trace"},
      {kSimulate, "--plot"}, {kTrain, "--json"},    {kProbe, "--json"},
  };
  for (const auto& [args, flag] : cases) {
    SCOPED_TRACE(args + " " + flag);
    const std::string out = dir.write("out.json", "old");
    const std::string cmd = std::string("sh -c \"ulimit -f 1; exec '") + SPILLWAY_CLI_PATH + "' " +
                            args + " " + flag + " '" + out + "' 2>&1 >/dev/null\"";
    const cli_test::CommandResult c = cli_test::run_command(cmd);
    EXPECT_EQ(c.code, 1) << c.out;
    EXPECT_TRUE(contains(c.out, "cannot write '" + out + "': File too large")) << c.out;
    EXPECT_EQ(read_file(out), "old");
    EXPECT_EQ(entries(dir.path()), std::vector<std::string>{"out.json"})
        << joined(entries(dir.path()));
  }
}

TEST(CliOutput, SuccessfulWriteReplacesTheFileAndKeepsItsModeAndSymlink) {
  TempDir dir;
  const std::string out = dir.write("plan.json", "old");
  std::filesystem::permissions(out, std::filesystem::perms::owner_read |
                                        std::filesystem::perms::owner_write |
                                        std::filesystem::perms::group_read);
  const std::string link = dir.file("link.json");
  std::filesystem::create_symlink(out, link);
  const CliRun r = run(std::string(kPlan) + " --json '" + link + "'", "2>&1 >/dev/null");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(std::filesystem::is_symlink(link));
  EXPECT_TRUE(contains(read_file(out), "\"summary\"")) << read_file(out).substr(0, 200);
  EXPECT_EQ(std::filesystem::status(out).permissions() & std::filesystem::perms::all,
            std::filesystem::perms::owner_read | std::filesystem::perms::owner_write |
                std::filesystem::perms::group_read);
  std::vector<std::string> names = entries(dir.path());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"link.json", "plan.json"})) << joined(names);
}

TEST(CliOutput, DevStdoutIsStdoutAndDevFilesAreWrittenInPlace) {
  TempDir dir;
  const std::string out = dir.file("out.txt");
  const CliRun r = run(std::string(kPlan) + " --json /dev/stdout", "> '" + out + "' 2>&1");
  EXPECT_EQ(r.code, 0) << r.out;
  const std::string text = read_file(out);
  EXPECT_TRUE(contains(text, "spillway plan:")) << text.substr(0, 300);
  EXPECT_TRUE(contains(text, "\"summary\"")) << text.substr(0, 300);
  EXPECT_TRUE(std::filesystem::is_symlink("/dev/stdout") ||
              std::filesystem::is_character_file("/dev/stdout"));
  // No temporary file is made in /dev, and none is created there.
  const CliRun nope = run(std::string(kPlan) + " --json /dev/spillway-no-such-file", "2>&1");
  EXPECT_EQ(nope.code, 1) << nope.out;
  EXPECT_TRUE(contains(nope.out, "No such file or directory")) << nope.out;
  EXPECT_FALSE(std::filesystem::exists("/dev/spillway-no-such-file"));
}

}  // namespace
}  // namespace spillway
