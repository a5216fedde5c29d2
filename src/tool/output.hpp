// Every byte the spillway tools (the spillway command, spillway-bench) write goes through
// here: a report on stdout, a --json, --trace or --plot file. Each write, flush and close
// is checked; a failure throws
// spillway::Error naming the path and the system's reason (strerror of the errno the
// failing call left), and a file output is never left half-written (Note [Atomic output]).
#pragma once

#include <stdexcept>
#include <string>

namespace spillway::tool {

// Thrown when stdout's reader has gone (EPIPE): main exits 1 without a message, as a
// command killed by SIGPIPE would be quiet, but with a status below 128.
class StdoutClosed : public std::runtime_error {
 public:
  StdoutClosed() : std::runtime_error("stdout: the reader has gone (EPIPE)") {}
};

// Writes `text` to `path`, or to stdout when path is "-" or "/dev/stdout" (flushed). A
// regular file is written atomically (Note [Atomic output]); an existing device, FIFO or
// socket (/dev/full, a named pipe) and any path under /dev/ or /proc/ are written in place;
// a directory is an error.
void write_output(const std::string& path, const std::string& text);
// Human-readable lines go to stdout, unless the JSON does (json_path "-": then to stderr).
void say_beside_json(const std::string& json_path, const std::string& text);

// Flushes and closes stdout at the end of main; throws as write_output("-") does.
void finish_stdout();

// A tool's main (the spillway command, spillway-bench): SIGPIPE and SIGXFSZ ignored (a
// closed pipe or a file past its size limit is an error, EPIPE or EFBIG, never a death by
// signal), `run` called, then stdout finished, so that a report lost to a full device or a
// closed pipe is not a success (exit 1; said unless `run` already failed). Returns the exit
// status.
int run_tool(int argc, char** argv, int (*run)(int, char**));

}  // namespace spillway::tool
