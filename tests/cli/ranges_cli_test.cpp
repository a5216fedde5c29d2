// Note [Every numeric flag has a range] (src/tool/ranges.cpp), proven from the outside: every
// subcommand's --help is read back, every INT, UINT and FLOAT option must state its range,
// and a value just below and just above it must be refused at once (exit 1, the flag and
// the value named), before the command does any work. A flag added without a range fails
// here, whichever subcommand it is on.
#include <gtest/gtest.h>

#include <cmath>
#include <iomanip>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "cli/run_command.hpp"

namespace spillway {
namespace {

using cli_test::contains;

std::string spillway_cmd(const std::string& args, const std::string& streams) {
  return std::string("timeout 60 '") + SPILLWAY_CLI_PATH + "' " + args + " " + streams;
}

// A numeric option as --help shows it: its name, its type, and the block of help text
// that describes it (the option line and its continuation lines).
struct HelpOption {
  std::string name;
  std::string type;  // INT, UINT, FLOAT
  std::string text;
};

std::vector<HelpOption> numeric_options(const std::string& help) {
  std::vector<HelpOption> out;
  std::istringstream in(help);
  std::string line;
  std::optional<HelpOption> cur;
  const std::regex option_line(R"(^  (?:-[a-z],)?(--[a-z0-9-]+)(?: ([A-Z]+))?)");
  auto flush = [&] {
    if (cur && (cur->type == "INT" || cur->type == "UINT" || cur->type == "FLOAT"))
      out.push_back(*cur);
    cur.reset();
  };
  while (std::getline(in, line)) {
    std::smatch m;
    if (std::regex_search(line, m, option_line)) {
      flush();
      cur = HelpOption{m[1], m[2], line};
    } else if (cur && line.rfind("      ", 0) == 0) {
      cur->text += " " + line;  // a continuation of the description
    } else {
      flush();
    }
  }
  flush();
  return out;
}

// The subcommands of `spillway --help` (the overview: a line "  NAME  summary" per command,
// Note [The overview] in src/cli/main.cpp) or of `spillway bench --help` (CLI11's
// "Subcommands:" section). A command's own --help has neither: no subcommands.
std::vector<std::string> subcommands(const std::string& help) {
  std::vector<std::string> out;
  size_t at = help.find("Subcommands:");
  if (at == std::string::npos) at = help.find("Usage: spillway COMMAND");
  if (at == std::string::npos) return out;
  std::istringstream in(help.substr(at));
  std::string line;
  const std::regex sub(R"(^  ([a-z][a-z0-9-]*)  )");
  while (std::getline(in, line)) {
    std::smatch m;
    if (std::regex_search(line, m, sub)) out.push_back(m[1]);
  }
  return out;
}

std::string number_text(double v, bool integer) {
  std::ostringstream s;
  if (integer) {
    s << std::fixed << std::setprecision(0) << v;
  } else {
    s << std::setprecision(17) << v;
  }
  return s.str();
}

TEST(CliRanges, EveryNumericFlagStatesAndEnforcesItsRange) {
  const cli_test::CommandResult top = cli_test::run_command(spillway_cmd("--help", "2>&1"));
  ASSERT_EQ(top.code, 0) << top.out;
  std::vector<std::string> commands;
  for (const std::string& s : subcommands(top.out)) {
    const cli_test::CommandResult h = cli_test::run_command(spillway_cmd(s + " --help", "2>&1"));
    ASSERT_EQ(h.code, 0) << s << "\n" << h.out;
    const std::vector<std::string> nested = subcommands(h.out);
    if (nested.empty()) {
      commands.push_back(s);
    } else {
      for (const std::string& n : nested) commands.push_back(s + " " + n);
    }
  }
  ASSERT_GE(commands.size(), 9U) << "plan, models, hardware, simulate, probe, bench x3, train";

  // The range is the last " [lo, hi]" / " (lo, hi]" of the text, then " or S".
  const std::regex range(R"(([\[(])(-?[0-9][0-9.e+-]*), ([^\]\[]+)\](?: or (-?[0-9][0-9.e+-]*))?)");
  int checked = 0;
  for (const std::string& command : commands) {
    const cli_test::CommandResult h =
        cli_test::run_command(spillway_cmd(command + " --help", "2>&1"));
    for (const HelpOption& o : numeric_options(h.out)) {
      SCOPED_TRACE(command + " " + o.name + ": " + o.text);
      std::smatch last;
      for (auto it = std::sregex_iterator(o.text.begin(), o.text.end(), range);
           it != std::sregex_iterator(); ++it)
        last = *it;
      ASSERT_FALSE(last.empty()) << "a numeric flag without a range in --help";
      const bool integer = o.type != "FLOAT";
      const bool lo_open = last[1] == "(";
      const double lo = std::stod(last[2]);
      std::optional<double> hi;
      try {
        size_t used = 0;
        const std::string h_text = last[3];
        const double v = std::stod(h_text, &used);
        if (used == h_text.size()) hi = v;
      } catch (const std::exception&) {
      }
      std::optional<double> also;
      if (last[4].matched) also = std::stod(last[4]);

      std::vector<double> outside;
      double below = lo_open ? lo : (integer || lo <= 0 ? lo - 1 : lo / 10);
      if (also && below == *also) below -= 1;
      outside.push_back(below);
      if (hi) outside.push_back(integer ? *hi + 1 : *hi * 10);
      for (double v : outside) {
        const std::string value = number_text(v, integer);
        const std::string args = command + " " + o.name + "=" + value;
        const cli_test::CommandResult r = cli_test::run_command(spillway_cmd(args, "2>&1"));
        EXPECT_EQ(r.code, 1) << args << "\n" << r.out;
        EXPECT_TRUE(contains(r.out, "spillway: error: " + o.name + " is " + value + "; must be in"))
            << args << "\n"
            << r.out;
        ++checked;
      }
    }
  }
  // The flags the issue named, at least: a parse of --help that found nothing would pass
  // vacuously.
  EXPECT_GE(checked, 100);
}

// Rates at the edge: a rate scale or an emulated link so small that its times
// run for days, or overflow the clock and wrap to no wait at all, is refused by its range.
TEST(CliRanges, RatesHaveMinimumsThatKeepEmulatedTimesFinite) {
  struct Case {
    std::string args;
    std::string says;
  };
  const std::vector<Case> cases = {
      {"serve --rate-scale 1e-30", "--rate-scale is 1e-30; must be in [1e-06, 1]"},
      {"serve --rate-scale 1e-12", "--rate-scale is 1e-12; must be in [1e-06, 1]"},
      {"serve --drain-seconds 0", "--drain-seconds is 0; must be in (0, 3600]"},
      {"bench serve --rate-scale 1e-30", "--rate-scale is 1e-30; must be in [1e-06, 1]"},
      {"bench serve-live --rate-scale 1e-12", "--rate-scale is 1e-12; must be in [1e-06, 1]"},
      {"bench stream --link-gbps 1e-20", "--link-gbps is 1e-20; must be in [0.001, 100000]"},
      {"stream --link-gbps 1e-6", "--link-gbps is 1e-6; must be in [0.001, 100000]"},
      {"stream --explain --peer-gbps 1e-300",
       "--peer-gbps is 1e-300; must be in [1e-06, 100000] or 0"},
      {"simulate --model Qwen3-30B-A3B --peer-gbps 1e-300",
       "--peer-gbps is 1e-300; must be in [1e-06, 100000]"},
      {"replay --time-scale 1e-300", "1e-300"},
  };
  for (const Case& c : cases) {
    const cli_test::CommandResult r = cli_test::run_command(spillway_cmd(c.args, "2>&1"));
    EXPECT_EQ(r.code, 1) << c.args << "\n" << r.out;
    EXPECT_TRUE(contains(r.out, c.says)) << c.args << "\n" << r.out;
  }
}

// Upper bounds that depend on the input are stated in words and checked once it is known.
TEST(CliRanges, BoundsThatDependOnTheModelAreCheckedAgainstIt) {
  struct Case {
    std::string args;
    std::string says;
  };
  const std::vector<Case> cases = {
      {"plan --keep-last 49", "--keep-last is 49; must be <= the model's layers (48)"},
      {"train --keep-last 5", "--keep-last is 5; must be <= the model's layers (4)"},
      {"train --optimizer offload --device-buckets 7",
       "--device-buckets is 7; tiny-moe has 6 optimizer buckets"},
      {"bench optim-offload --buckets 4 --device-buckets 5",
       "device_buckets (--device-buckets) is 5; must be <= buckets (4)"},
  };
  for (const Case& c : cases) {
    const cli_test::CommandResult r = cli_test::run_command(spillway_cmd(c.args, "2>&1"));
    EXPECT_EQ(r.code, 1) << c.args << "\n" << r.out;
    EXPECT_TRUE(contains(r.out, c.says)) << c.args << "\n" << r.out;
  }
}

}  // namespace
}  // namespace spillway
