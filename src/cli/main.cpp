// The spillway command: plan, models, hardware (more engines add subcommands).
// Exit codes: 0 success, 1 an error in the input or the run (message on stderr), 2 a
// command-line usage error. An output that cannot be written (a full device, a directory,
// a closed pipe) is an error: exit 1, the message naming the path and the system's reason.
// When stdout's reader has gone (`spillway models | head -c1`) the command exits 1 without
// a message: SIGPIPE is ignored, so it never dies of the signal (status 141).
#include <cstdio>

#include "cli/commands.hpp"
#include "cli/plan_flags.hpp"
#include "spillway/error.hpp"
#include "tool/output.hpp"

namespace {

bool known_subcommand(CLI::App& app, const char* name) {
  for (const CLI::App* sub : app.get_subcommands({}))
    if (sub->check_name(name)) return true;
  return false;
}

int run(int argc, char** argv) {
  CLI::App app{fmt::format(
      "spillway: move what does not fit in GPU memory into CPU memory, and bring it back in "
      "time.\n\nStart with:\n  spillway plan {}\n  spillway models      (the model catalog)\n  "
      "spillway hardware    (the hardware profiles)\n\nUnits: flags ending in -mb are MiB (2^20 "
      "bytes), -gb GB (1e9 bytes), -gbps GB/s (1e9 bytes/s).\n",
      spillway::cli::kPlanExampleArgs)};
  app.require_subcommand(1);
  app.set_version_flag("--version", "spillway 0.1.0");
  spillway::cli::add_plan_command(app);
  spillway::cli::add_models_command(app);
  spillway::cli::add_hardware_command(app);
  spillway::cli::add_simulate_command(app);
  spillway::cli::add_probe_command(app);
  spillway::cli::add_bench_command(app);
  spillway::cli::add_train_command(app);
  spillway::cli::add_stream_command(app);
  spillway::cli::add_replay_command(app);
  spillway::cli::add_serve_command(app);
  spillway::cli::add_checkpoint_command(app);
  spillway::cli::add_load_command(app);
  spillway::cli::add_tokenize_command(app);
  spillway::cli::add_chat_template_command(app);
  // A first word that names no subcommand: say which ones exist (CLI11 would only say that
  // one is required).
  if (argc >= 2 && argv[1][0] != '-' && !known_subcommand(app, argv[1])) {
    std::string names;
    for (const CLI::App* sub : app.get_subcommands({}))
      names += (names.empty() ? "" : ", ") + sub->get_name();
    std::fprintf(stderr,
                 "spillway: error: unknown subcommand '%s'; the subcommands are %s (spillway "
                 "--help)\n",
                 argv[1], names.c_str());
    return 2;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version exit 0; an infeasible plan exits 3 (a RuntimeError thrown by
    // the command); every other command-line error is a usage error: 2.
    const int code = app.exit(e);
    return code == 0 || code == 3 ? code : 2;
  } catch (const spillway::tool::StdoutClosed&) {
    return 1;
  } catch (const spillway::InputError& e) {
    // The library names the field; the user gave a flag (Note [Field names and flags]).
    std::fprintf(stderr, "spillway: error: %s\n", spillway::cli::message_with_flags(e).c_str());
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

}  // namespace

int main(int argc, char** argv) {
  return spillway::tool::run_tool(argc, argv, run);
}
