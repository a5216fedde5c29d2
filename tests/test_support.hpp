// Helpers shared by the spillway tests: temporary files that clean up after themselves,
// the check that a call fails with spillway::Error (never anything else) whose message
// holds given substrings, and a seeded generator for randomized tests.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <iostream>
#include <random>
#include <string>
#include <string_view>
#include <system_error>

#include "spillway/core/error.hpp"

namespace spillway::testing {

// A fresh directory under the system temp dir, removed (with its contents) on scope exit.
class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    const auto now = std::chrono::steady_clock::now().time_since_epoch().count();
    for (int attempt = 0; attempt < 100; ++attempt) {
      path_ = std::filesystem::temp_directory_path() /
              ("spillway-test-" + std::to_string(::getpid()) + "-" + std::to_string(now) + "-" +
               std::to_string(counter++));
      std::error_code ec;
      if (std::filesystem::create_directory(path_, ec)) return;
    }
    throw std::runtime_error("cannot create a temporary directory");
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  // Writes `text` to `name` inside the directory and returns the file's path.
  std::string write(const std::string& name, std::string_view text) const {
    const std::filesystem::path p = path_ / name;
    std::filesystem::create_directories(p.parent_path());
    std::ofstream out(p, std::ios::binary | std::ios::trunc);
    out << text;
    out.close();
    if (!out) throw std::runtime_error("cannot write " + p.string());
    return p.string();
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

// Runs `f`; it must throw spillway::Error. Returns the message (empty when it did not
// throw Error; the failure is then recorded). Any other exception is a failure too.
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const spillway::Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected spillway::Error, got another exception: " << e.what();
    return {};
  } catch (...) {
    ADD_FAILURE() << "expected spillway::Error, got a non-std exception";
    return {};
  }
  ADD_FAILURE() << "expected spillway::Error, but the call succeeded";
  return {};
}

// `f` throws spillway::Error whose message contains every one of `parts`.
inline void expect_error(const std::function<void()>& f,
                         std::initializer_list<std::string_view> parts) {
  const std::string msg = error_of(f);
  for (std::string_view p : parts) {
    EXPECT_NE(msg.find(p), std::string::npos)
        << "the message should contain [" << p << "]\n  message: " << msg;
  }
}

// Runs `f` in a forked child and returns its verdict: what `f` returned ("" = fine), or
// how the child died. For inputs whose bug is undefined behaviour: under the sanitizers
// (make test-asan) the child aborts with a report on stderr and the test can say so
// instead of taking the whole test binary down.
inline std::string verdict_in_child(const std::function<std::string()>& f) {
  int fds[2];
  if (pipe(fds) != 0) return "pipe failed";
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = fork();
  if (pid < 0) return "fork failed";
  if (pid == 0) {
    close(fds[0]);
    std::string v;
    try {
      v = f();
    } catch (const std::exception& e) {
      v = std::string("threw ") + e.what();
    } catch (...) {
      v = "threw a non-std exception";
    }
    const char* p = v.data();
    size_t left = v.size();
    while (left > 0) {
      const ssize_t n = write(fds[1], p, left);
      if (n <= 0) break;
      p += n;
      left -= static_cast<size_t>(n);
    }
    close(fds[1]);
    _exit(0);
  }
  close(fds[1]);
  std::string out;
  char buf[4096];
  ssize_t n = 0;
  while ((n = read(fds[0], buf, sizeof buf)) > 0) out.append(buf, static_cast<size_t>(n));
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (WIFSIGNALED(status)) {
    return "the call died of signal " + std::to_string(WTERMSIG(status)) +
           " (a sanitizer report, if any, is above)";
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) != 0) {
    return "the call exited with status " + std::to_string(WEXITSTATUS(status)) +
           " (a sanitizer report, if any, is above)";
  }
  return out;
}

// The seed of the randomized tests: SPILLWAY_TEST_SEED when set, else a fresh one per
// process.
inline uint32_t test_seed() {
  static const uint32_t s = [] {
    if (const char* env = std::getenv("SPILLWAY_TEST_SEED")) {
      return static_cast<uint32_t>(std::strtoul(env, nullptr, 10));
    }
    return std::random_device{}();
  }();
  return s;
}

// A generator seeded with test_seed(), which it prints with the running test's name and
// how to rerun with it.
inline std::mt19937 make_rng() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::cout << "[ seed ] " << info->name() << ": " << test_seed()
            << " (rerun with SPILLWAY_TEST_SEED=" << test_seed() << ")\n";
  return std::mt19937(test_seed());
}

}  // namespace spillway::testing
