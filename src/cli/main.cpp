// The spillway command: one subcommand per engine (plan, simulate, train, stream, serve, ...).
// `spillway` alone and `spillway --help` print the overview (Note [The overview]); each
// subcommand's --help is its own.
// Exit codes: 0 success (and `spillway` alone: the overview), 1 an error in the input or the
// run (message on stderr), 2 a command-line usage error. An output that cannot be written (a full
// device, a directory, a closed pipe) is an error: exit 1, the message naming the path and the
// system's reason. When stdout's reader has gone (`spillway models | head -c1`) the command exits 1
// without a message: SIGPIPE is ignored, so it never dies of the signal (status 141).
#include <cstdio>

#include "cli/commands.hpp"
#include "cli/plan_flags.hpp"
#include "spillway/core/error.hpp"
#include "tool/output.hpp"

namespace {

bool known_subcommand(CLI::App& app, const char* name) {
  for (const CLI::App* sub : app.get_subcommands({}))
    if (sub->check_name(name)) return true;
  return false;
}

int run(int argc, char** argv) {
  CLI::App app{"spillway: move what does not fit in GPU memory into CPU memory."};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("spillway ") + spillway::cli::kVersion);
  // In the overview's order within each group (Note [The overview]).
  spillway::cli::add_plan_command(app);
  spillway::cli::add_models_command(app);
  spillway::cli::add_hardware_command(app);
  spillway::cli::add_simulate_command(app);
  spillway::cli::add_train_command(app);
  spillway::cli::add_stream_command(app);
  spillway::cli::add_serve_command(app);
  spillway::cli::add_replay_command(app);
  spillway::cli::add_load_command(app);
  spillway::cli::add_checkpoint_command(app);
  spillway::cli::add_doctor_command(app);
  spillway::cli::add_probe_command(app);
  spillway::cli::add_bench_command(app);
  spillway::cli::add_tokenize_command(app);
  spillway::cli::add_chat_template_command(app);
  // Set after the subcommands exist, so that only the top level's --help is the overview
  // (a subcommand keeps the formatter it was created with).
  app.formatter_fn([&app](const CLI::App*, const std::string&, CLI::AppFormatMode) {
    return spillway::cli::overview(app);
  });
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
    if (argc == 1) {
      spillway::tool::write_output("-", spillway::cli::overview(app));
      return 0;
    }
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
