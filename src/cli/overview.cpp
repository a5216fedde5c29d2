// `spillway` alone and `spillway --help`: the overview, taken from the subcommands.
//
// Note [The overview]: `spillway` with no arguments and `spillway --help` print the same
// short page: each command in one line, in groups, then where to start and how to get a
// command's flags (`spillway COMMAND --help`). No arguments is a question, not a mistake:
// exit 0, as cargo and docker do. Each subcommand gives its group and its line where it is
// made (overview_line, in its add_*_command), so a command cannot be missing from the page;
// the groups are in a fixed order and the commands in each in the order main() registers
// them (Cli.TheOverviewNamesEveryCommandInOneLine checks it from the outside).
#include <fmt/format.h>

#include <string>
#include <vector>

#include "cli/commands.hpp"
#include "spillway/core/error.hpp"

namespace spillway::cli {

namespace {

struct Line {
  std::string name;
  Group group;
  std::string summary;
};

std::vector<Line>& lines() {
  static std::vector<Line> all;
  return all;
}

constexpr const char* kGroupTitles[] = {"Plan and simulate", "Train and stream",
                                        "Serve, replay and load", "Tools"};

}  // namespace

void overview_line(std::string name, Group group, std::string summary) {
  lines().push_back({std::move(name), group, std::move(summary)});
}

std::string overview(const CLI::App& app) {
  const std::vector<const CLI::App*> subs = app.get_subcommands({});
  std::vector<const Line*> of(subs.size(), nullptr);
  for (size_t i = 0; i < subs.size(); ++i) {
    for (const Line& l : lines()) {
      if (l.name == subs[i]->get_name()) of[i] = &l;
    }
    SPILLWAY_CHECK(of[i] != nullptr, "subcommand {} has no line in the overview",
                   subs[i]->get_name());
  }
  SPILLWAY_CHECK(lines().size() == subs.size(), "{} overview lines for {} subcommands",
                 lines().size(), subs.size());
  std::string out =
      "spillway: move what does not fit in GPU memory into CPU memory, and bring it back in "
      "time.\n\nUsage: spillway COMMAND [FLAGS]\n";
  for (size_t g = 0; g < std::size(kGroupTitles); ++g) {
    bool titled = false;
    for (const Line* l : of) {
      if (static_cast<size_t>(l->group) != g) continue;
      if (!titled) out += fmt::format("\n{}:\n", kGroupTitles[g]);
      titled = true;
      out += fmt::format("  {:<15}{}\n", l->name, l->summary);
    }
  }
  out += fmt::format(
      "\nStart with:\n  spillway plan {}\n  spillway doctor      (what this machine has, and which "
      "paths run here)\n\n"
      "Units: flags ending in -mb are MiB (2^20 bytes), -gb GB (1e9 bytes), -gbps GB/s (1e9 "
      "bytes/s).\nRun `spillway COMMAND --help` for a command's flags and examples.\n",
      kPlanExampleArgs);
  return out;
}

}  // namespace spillway::cli
