// The one writer of the spillway command's outputs (see output.hpp).
//
// Note [Atomic output]: a regular file is written to a temporary file in the same
// directory (".<name>.<pid>.tmp", so that the rename cannot cross file systems), closed,
// then renamed over the path. On any failure the temporary file is removed and an
// existing file at the path keeps its old contents. A path that resolves through a symlink
// is written at the symlink's target, so the link stays a link.
#include "tool/output.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>

#include "spillway/core/error.hpp"
#include "tool/output_path.hpp"

namespace spillway::tool {

namespace {

[[noreturn]] void fail(const std::string& path, int err) {
  if (err == 0) SPILLWAY_INPUT_ERROR("cannot write '{}'", path);
  SPILLWAY_INPUT_ERROR("cannot write '{}': {}", path, std::strerror(err));
}

[[noreturn]] void fail_stdout(int err) {
  if (err == EPIPE) throw StdoutClosed();
  if (err == 0) SPILLWAY_INPUT_ERROR("cannot write to stdout");
  SPILLWAY_INPUT_ERROR("cannot write to stdout: {}", std::strerror(err));
}

// Writes all of `text` to `fd`; returns 0 or the errno of the failing write.
int write_all(int fd, const std::string& text) {
  const char* p = text.data();
  size_t left = text.size();
  while (left > 0) {
    const ssize_t n = ::write(fd, p, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    p += n;
    left -= static_cast<size_t>(n);
  }
  return 0;
}

// Writes `text` to an existing file that is not a regular file (a device, a FIFO).
void write_in_place(const std::string& path, const std::string& text) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_TRUNC | O_CLOEXEC);
  if (fd < 0) fail(path, errno);
  const int err = write_all(fd, text);
  const int close_err = ::close(fd) != 0 ? errno : 0;
  if (err != 0) fail(path, err);
  if (close_err != 0 && close_err != EINTR) fail(path, close_err);
}

// `mode`: the permissions of the file being replaced, or -1 for a new file.
void write_atomically(const std::string& path, const std::string& target, const std::string& text,
                      int mode) {
  const size_t slash = target.rfind('/');
  const std::string dir = slash == std::string::npos ? "" : target.substr(0, slash + 1);
  const std::string name = slash == std::string::npos ? target : target.substr(slash + 1);
  const std::string tmp = dir + "." + name + "." + std::to_string(::getpid()) + ".tmp";
  // 0666 less the umask, as any file the user's shell would create.
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  if (fd < 0) fail(path, errno);
  int err = mode >= 0 && ::fchmod(fd, static_cast<mode_t>(mode)) != 0 ? errno : 0;
  if (err == 0) err = write_all(fd, text);
  if (::close(fd) != 0 && err == 0 && errno != EINTR) err = errno;
  if (err == 0 && ::rename(tmp.c_str(), target.c_str()) != 0) err = errno;
  if (err != 0) {
    ::unlink(tmp.c_str());
    fail(path, err);
  }
}

}  // namespace

void write_output(const std::string& path, const std::string& text) {
  if (path == "-") {
    errno = 0;
    if (std::fwrite(text.data(), 1, text.size(), stdout) != text.size()) fail_stdout(errno);
    errno = 0;
    if (std::fflush(stdout) != 0) fail_stdout(errno);
    return;
  }
  if (path == "/dev/stdout") {
    write_output("-", text);
    return;
  }
  if (path.empty()) fail(path, ENOENT);
  // Never a temporary file in /dev or /proc: their files are written where they are.
  if (path.rfind("/dev/", 0) == 0 || path.rfind("/proc/", 0) == 0) {
    write_in_place(path, text);
    return;
  }
  if (path.back() == '/') fail(path, EISDIR);
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    if (errno != ENOENT) fail(path, errno);
    // A new file; a dangling symlink is replaced by the file.
    write_atomically(path, path, text, -1);
    return;
  }
  if (S_ISDIR(st.st_mode)) fail(path, EISDIR);
  if (!S_ISREG(st.st_mode)) {
    write_in_place(path, text);
    return;
  }
  char resolved[PATH_MAX];
  if (::realpath(path.c_str(), resolved) == nullptr) fail(path, errno);
  write_atomically(path, resolved, text, static_cast<int>(st.st_mode & 07777));
}

void check_output_path(const std::string& path) {
  if (path.empty() || path == "-" || path == "/dev/stdout") return;
  if (path.back() == '/') fail(path, EISDIR);
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) fail(path, EISDIR);
    return;
  }
  if (errno != ENOENT) fail(path, errno);
  // A new file: its directory must exist.
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash + 1);
  if (::stat(dir.c_str(), &st) != 0) fail(path, errno);
  if (!S_ISDIR(st.st_mode)) fail(path, ENOTDIR);
}

void finish_stdout() {
  std::cout.flush();
  const bool failed_before = std::ferror(stdout) != 0;
  errno = 0;
  if (std::fflush(stdout) != 0) fail_stdout(errno);
  if (failed_before) fail_stdout(0);
  // Closes the descriptor, not the FILE: a file system may report a lost write only at
  // close, and the C++ streams may still flush stdout (an empty flush) after main. EBADF:
  // the command ran with stdout closed and wrote nothing there.
  if (::close(STDOUT_FILENO) != 0 && errno != EINTR && errno != EBADF) fail_stdout(errno);
}

void say_beside_json(const std::string& json_path, const std::string& text) {
  if (json_path == "-") {
    std::fputs(text.c_str(), stderr);
  } else {
    write_output("-", text);
  }
}

int run_tool(int argc, char** argv, int (*run)(int, char**)) {
  std::signal(SIGPIPE, SIG_IGN);
  std::signal(SIGXFSZ, SIG_IGN);
  int code = 1;
  try {
    code = run(argc, argv);
  } catch (...) {
    std::fprintf(stderr, "spillway: internal error while setting up the command line\n");
  }
  try {
    finish_stdout();
  } catch (const StdoutClosed&) {
    return code != 0 ? code : 1;
  } catch (const std::exception& e) {
    if (code == 0) std::fprintf(stderr, "spillway: error: %s\n", e.what());
    return code != 0 ? code : 1;
  }
  return code;
}

}  // namespace spillway::tool
