// The CPU AdamW benchmark (see bench_adam.hpp for the method and Note [AdamW bytes]).
#include "bench_adam.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "bench_json.hpp"
#include "core/stats.hpp"
#include "spillway/core/error.hpp"
#include "spillway/core/units.hpp"
#include "spillway/optim/optim.hpp"

extern char** environ;

namespace spillway {

namespace {

size_t round_up(size_t n, size_t to) {
  return (n + to - 1) / to * to;
}

std::string bytes_text(double bytes) {
  return to_string(Bytes(static_cast<int64_t>(bytes)));
}

// n elements of T, 4 KiB aligned, every page touched (filled with `fill`).
template <typename T>
class HostArray {
 public:
  HostArray(size_t n, T fill, const char* what) : n_(n) {
    const size_t bytes = round_up(std::max<size_t>(n * sizeof(T), 1), 4096);
    mem_.reset(static_cast<T*>(std::aligned_alloc(4096, bytes)));
    if (!mem_) {
      SPILLWAY_INPUT_ERROR("adam bench: cannot allocate {} for {}",
                           bytes_text(static_cast<double>(bytes)), what);
    }
    std::fill(mem_.get(), mem_.get() + n, fill);
  }
  T* get() const { return mem_.get(); }
  size_t size() const { return n_; }

 private:
  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  std::unique_ptr<T, Free> mem_;
  size_t n_ = 0;
};

// splitmix64: fast, and the same stream for a seed on every platform.
struct Random {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
  // Uniform in [-scale, scale).
  float uniform(float scale) {
    const float u = static_cast<float>(next() >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    return (2.0f * u - 1.0f) * scale;
  }
};

// 128 MiB per triad array, 384 MiB in all: several times any last-level cache shared by a
// few cores (sysconf's figure is not used: in a VM it can report the whole package's).
constexpr size_t kTriadMinElements = size_t{1} << 25;

size_t last_level_cache_bytes() {
  for (int name : {_SC_LEVEL3_CACHE_SIZE, _SC_LEVEL2_CACHE_SIZE}) {
    const long v = sysconf(name);
    if (v > 0) return static_cast<size_t>(v);
  }
  return 0;
}

// Note [AdamW bytes].
double adamw_bytes_per_element(bool copy) {
  return 28.0 + (copy ? 2.0 : 0.0);
}

void validate_options(const AdamBenchOptions& o) {
  const auto at_least = [](const char* field, const char* flag, int64_t v, int64_t min) {
    if (v < min) {
      SPILLWAY_INPUT_ERROR("adam bench: {} ({}) is {}; must be >= {}", field, flag, v, min);
    }
  };
  at_least("elements", "--elements", static_cast<int64_t>(o.elements), 1);
  if (o.elements > (size_t{1} << 36)) {
    SPILLWAY_INPUT_ERROR("adam bench: elements (--elements) is {}; must be <= 2^36", o.elements);
  }
  at_least("repeats", "--repeats", o.repeats, 1);
  at_least("steps", "--steps", o.steps, 1);
  at_least("threads", "--threads", o.threads, 0);
  if (o.threads > 4096) {
    SPILLWAY_INPUT_ERROR("adam bench: threads (--threads) is {}; must be <= 4096", o.threads);
  }
  at_least("check_steps", "--check-steps", o.check_steps, 1);
  if (o.triad_elements > (size_t{1} << 36)) {
    SPILLWAY_INPUT_ERROR("adam bench: triad_elements (--triad-elements) is {}; must be <= 2^36",
                         o.triad_elements);
  }
}

// ---- the correctness check ----------------------------------------------------------

// The state of one optimizer: p, m, v and the low-precision copy (n each).
struct State {
  HostArray<float> p, m, v;
  HostArray<uint16_t> copy;
  State(size_t n, bool copy_out, uint16_t poison)
      : p(n, 0.0f, "p"), m(n, 0.0f, "m"), v(n, 0.0f, "v"), copy(copy_out ? n : 0, poison, "copy") {}
  optim::AdamWArgs args(const float* g, int64_t step) const {
    optim::AdamWArgs a;
    a.p = p.get();
    a.m = m.get();
    a.v = v.get();
    a.g = g;
    a.grad_type = optim::GradType::kFp32;
    a.n = p.size();
    a.step = step;
    if (copy.size() > 0) {
      a.copy_out = copy.get();
      a.copy_type = optim::CopyType::kBf16;
    }
    return a;
  }
};

template <typename T>
uint64_t bits_of(T x) {
  if constexpr (sizeof(T) == 4) {
    uint32_t b;
    std::memcpy(&b, &x, 4);
    return b;
  } else {
    return static_cast<uint64_t>(x);
  }
}

// Throws naming the array, the element and both values at the first differing bit.
template <typename T>
void require_equal(const HostArray<T>& ours, const HostArray<T>& ref, const char* name,
                   int64_t step) {
  // Bits, on purpose: the check is bitwise equality (NaN payloads included).
  // NOLINTBEGIN(bugprone-suspicious-memory-comparison)
  const size_t n = ours.size();
  if (std::memcmp(ours.get(), ref.get(), n * sizeof(T)) == 0) return;
  size_t i = 0;
  while (i < n && std::memcmp(ours.get() + i, ref.get() + i, sizeof(T)) == 0) ++i;
  size_t bad = 0;
  for (size_t k = i; k < n; ++k) bad += std::memcmp(ours.get() + k, ref.get() + k, sizeof(T)) != 0;
  // NOLINTEND(bugprone-suspicious-memory-comparison)
  SPILLWAY_INPUT_ERROR(
      "adam bench: the SIMD step ({}, AdamW class) and the scalar reference disagree at step "
      "{}: {} of {} elements of {} differ; first at element {}: SIMD 0x{:0{}x}, scalar "
      "0x{:0{}x}",
      optim::adamw_simd_target(), step, bad, n, name, i, bits_of(ours.get()[i]), 2 * sizeof(T),
      bits_of(ref.get()[i]), 2 * sizeof(T));
}

// ---- the triad ------------------------------------------------------------------------

// Blocks of 16 so that the compiler vectorizes at -O2; on x86-64 one clone per vector width,
// picked at load time, so that the limit is measured with the widest vectors the CPU has
// (one core of a many-core server does not reach the memory's bandwidth with narrow ones).
// Not under the sanitizers: the clones' resolver (an ifunc) runs before the ThreadSanitizer
// runtime is up and crashes the process at load.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(__SANITIZE_THREAD__) && !defined(__SANITIZE_ADDRESS__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
void triad_part(float* __restrict a, const float* __restrict b, const float* __restrict c,
                size_t begin, size_t end, float s) {
  size_t i = begin;
  for (; i + 16 <= end; i += 16) {
    for (size_t k = 0; k < 16; ++k) a[i + k] = b[i + k] + s * c[i + k];
  }
  for (; i < end; ++i) a[i] = b[i] + s * c[i];
}

// a = b + s * c over `threads` threads: workers 1..threads-1 created once, the calling thread
// takes part 0; parts are contiguous, cache-line aligned, fixed for the run.
class TriadTeam {
 public:
  static constexpr float kB = 1.0f, kC = 2.0f, kS = 3.0f, kA = kB + kS * kC;

  TriadTeam(int threads, size_t n)
      : a_(n, 0.0f, "triad a"),
        b_(n, kB, "triad b"),
        c_(n, kC, "triad c"),
        start_(threads),
        done_(threads) {
    const size_t chunk = round_up((n + static_cast<size_t>(threads) - 1) / threads, 16);
    for (int k = 0; k < threads; ++k) {
      const size_t begin = std::min(n, static_cast<size_t>(k) * chunk);
      parts_.push_back({begin, std::min(n, begin + chunk)});
    }
    for (int k = 1; k < threads; ++k) workers_.emplace_back([this, k] { work(k); });
  }
  ~TriadTeam() {
    stop_.store(true);
    start_.arrive_and_wait();
    for (std::thread& t : workers_) t.join();
  }
  TriadTeam(const TriadTeam&) = delete;
  TriadTeam& operator=(const TriadTeam&) = delete;

  // One pass over all parts; seconds.
  double pass() {
    const auto t0 = Clock::now();
    start_.arrive_and_wait();
    run_part(0);
    done_.arrive_and_wait();
    return seconds_since(t0);
  }
  // Every element of a holds b + s * c (the first wrong index otherwise, or -1).
  int64_t first_wrong() const {
    for (size_t i = 0; i < a_.size(); ++i) {
      if (a_.get()[i] != kA) return static_cast<int64_t>(i);
    }
    return -1;
  }
  size_t size() const { return a_.size(); }

 private:
  void run_part(int k) {
    const auto [begin, end] = parts_[static_cast<size_t>(k)];
    triad_part(a_.get(), b_.get(), c_.get(), begin, end, kS);
  }
  void work(int k) {
    for (;;) {
      start_.arrive_and_wait();
      if (stop_.load()) return;
      run_part(k);
      done_.arrive_and_wait();
    }
  }

  HostArray<float> a_, b_, c_;
  std::vector<std::pair<size_t, size_t>> parts_;
  std::barrier<> start_, done_;
  std::atomic<bool> stop_{false};
  std::vector<std::thread> workers_;
};

// ---- the torch subprocess -------------------------------------------------------------

// One Python process for the run, talking JSON lines over a socket pair on its stdin and
// stdout (a socket, so that a write to a dead child fails with EPIPE instead of SIGPIPE);
// its stderr goes to a temporary file quoted when it fails.
class TorchProcess {
 public:
  TorchProcess() = default;
  TorchProcess(const TorchProcess&) = delete;
  TorchProcess& operator=(const TorchProcess&) = delete;
  ~TorchProcess() { stop(); }

  // Starts `python -u -c script args...` and waits for its first line. Returns "" when torch
  // is ready, else why not (the process is then stopped).
  std::string start(const std::string& python, const std::vector<std::string>& args,
                    nlohmann::json* ready) {
    buffer_.clear();
    char path[] = "/tmp/spillway-bench-adam-XXXXXX";
    stderr_fd_ = mkostemp(path, O_CLOEXEC);
    if (stderr_fd_ < 0) return fmt::format("cannot create a temporary file: {}", strerror(errno));
    unlink(path);
    int fds[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) {
      return fmt::format("socketpair failed: {}", strerror(errno));
    }
    sock_ = fds[0];
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, fds[1], 0);
    posix_spawn_file_actions_adddup2(&actions, fds[1], 1);
    posix_spawn_file_actions_adddup2(&actions, stderr_fd_, 2);
    const std::string script = adam_bench_torch_script();
    std::vector<std::string> argv_s = {python, "-u", "-c", script};
    argv_s.insert(argv_s.end(), args.begin(), args.end());
    std::vector<char*> argv;
    argv.reserve(argv_s.size() + 1);
    for (std::string& s : argv_s) argv.push_back(s.data());
    argv.push_back(nullptr);
    const int rc = posix_spawnp(&pid_, python.c_str(), &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    close(fds[1]);
    if (rc != 0) {
      pid_ = -1;
      return fmt::format("cannot run {}: {}", python, strerror(rc));
    }
    // import torch, n elements of p, grad and moments, two warm-up steps.
    std::string line;
    std::string why = read_line(&line, 600);
    if (why.empty()) why = parse(line, ready);
    if (why.empty() && ready->contains("skip")) why = (*ready)["skip"].get<std::string>();
    if (why.empty() && !ready->value("ready", false)) why = "unexpected first line: " + line;
    if (!why.empty()) stop();
    return why;
  }

  // Times `steps` calls of .step() of the foreach optimizer, then as many of the fused one
  // when the process has it; elements/s of each, or why it failed ("" on success).
  std::string run(std::vector<double>* rates, std::vector<double>* fused_rates) {
    static constexpr char kRun[] = "run\n";
    if (send(sock_, kRun, sizeof(kRun) - 1, MSG_NOSIGNAL) !=
        static_cast<ssize_t>(sizeof(kRun) - 1)) {
      return fmt::format("cannot write to the torch process: {}{}", strerror(errno), stderr_tail());
    }
    std::string line;
    std::string why = read_line(&line, 1800);
    nlohmann::json j;
    if (why.empty()) why = parse(line, &j);
    if (why.empty() && !(j.contains("elements_per_s") && j["elements_per_s"].is_array())) {
      why = "unexpected reply: " + line;
    }
    if (!why.empty()) return why;
    for (const auto& x : j["elements_per_s"]) rates->push_back(x.get<double>());
    if (fused_rates != nullptr && j.contains("fused_elements_per_s") &&
        j["fused_elements_per_s"].is_array()) {
      for (const auto& x : j["fused_elements_per_s"]) fused_rates->push_back(x.get<double>());
    }
    return "";
  }

  void stop() {
    if (sock_ >= 0) {
      shutdown(sock_, SHUT_RDWR);  // the script exits at end of input
      close(sock_);
      sock_ = -1;
    }
    if (pid_ > 0 && !reap(10.0)) {
      kill(pid_, SIGKILL);
      int status = 0;
      waitpid(pid_, &status, 0);
      pid_ = -1;
    }
    if (stderr_fd_ >= 0) {
      close(stderr_fd_);
      stderr_fd_ = -1;
    }
  }

 private:
  // One line from the child within timeout_s; "" on success, else why not.
  std::string read_line(std::string* line, int timeout_s) {
    const auto t0 = Clock::now();
    for (;;) {
      const size_t nl = buffer_.find('\n');
      if (nl != std::string::npos) {
        *line = buffer_.substr(0, nl);
        buffer_.erase(0, nl + 1);
        return "";
      }
      const double left_s = timeout_s - seconds_since(t0);
      if (left_s <= 0) {
        return fmt::format("no reply from the torch process within {} s{}", timeout_s,
                           stderr_tail());
      }
      pollfd pfd{sock_, POLLIN, 0};
      const int ready = poll(&pfd, 1, static_cast<int>(std::min(left_s, 1.0) * 1000) + 1);
      if (ready < 0 && errno != EINTR) return fmt::format("poll failed: {}", strerror(errno));
      if (ready <= 0) continue;
      char chunk[4096];
      const ssize_t got = recv(sock_, chunk, sizeof(chunk), 0);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) {
        return fmt::format("the torch process exited{}{}", exit_text(), stderr_tail());
      }
      buffer_.append(chunk, static_cast<size_t>(got));
    }
  }

  std::string parse(const std::string& line, nlohmann::json* out) {
    *out = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (out->is_discarded() || !out->is_object()) return "not JSON from the torch process: " + line;
    return "";
  }

  // Waits up to timeout_s for the child to exit; true when it did (status_ holds how).
  bool reap(double timeout_s) {
    const auto t0 = Clock::now();
    while (pid_ > 0) {
      if (waitpid(pid_, &status_, WNOHANG) == pid_) {
        pid_ = -1;
        return true;
      }
      if (seconds_since(t0) > timeout_s) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return true;
  }

  std::string exit_text() {
    if (pid_ <= 0 || !reap(5.0)) return "";
    if (WIFEXITED(status_)) return fmt::format(" with status {}", WEXITSTATUS(status_));
    if (WIFSIGNALED(status_)) return fmt::format(" on signal {}", WTERMSIG(status_));
    return "";
  }

  // The last lines of the child's stderr, as "; stderr: ...".
  std::string stderr_tail() const {
    if (stderr_fd_ < 0) return "";
    const off_t size = lseek(stderr_fd_, 0, SEEK_END);
    if (size <= 0) return "";
    const off_t from = std::max<off_t>(0, size - 600);
    std::string text(static_cast<size_t>(size - from), '\0');
    const ssize_t got = pread(stderr_fd_, text.data(), text.size(), from);
    if (got <= 0) return "";
    text.resize(static_cast<size_t>(got));
    while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
    for (char& ch : text) {
      if (ch == '\n') ch = '|';
    }
    return "; stderr: ..." + text;
  }

  pid_t pid_ = -1;
  int status_ = 0;
  int sock_ = -1;
  int stderr_fd_ = -1;
  std::string buffer_;
};

}  // namespace

std::string adam_bench_torch_script() {
  return R"PY(
# spillway bench adam: torch.optim.AdamW(foreach=True) and AdamW(fused=True) (torch's
# fastest CPU AdamW, from torch 2.4), each on its own fp32 parameter of n elements.
# argv: n threads steps lr beta1 beta2 eps weight_decay seed. Prints JSON lines: first
# {"ready": ..., "fused_skip": reason or null} (or {"skip": reason}); then, for each "run"
# line on stdin, the elements/s of `steps` timed calls of .step() of each optimizer
# (foreach first). Exits at end of input.
import json, sys, time
def say(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()
try:
    import torch
except Exception as e:
    say({"skip": "%s cannot import torch: %s: %s" % (sys.executable, type(e).__name__, e)})
    sys.exit(0)
n, threads, steps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
lr, beta1, beta2, eps, wd = (float(x) for x in sys.argv[4:9])
torch.set_num_threads(threads)
torch.manual_seed(int(sys.argv[9]) % (1 << 63))
p = torch.nn.Parameter(torch.empty(n, dtype=torch.float32).uniform_(-1.0, 1.0))
p.grad = torch.empty(n, dtype=torch.float32).uniform_(-1e-2, 1e-2)
opt = torch.optim.AdamW([p], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=wd,
                        foreach=True)
for _ in range(2):
    opt.step()
fused, fused_skip = None, None
try:
    pf = torch.nn.Parameter(p.detach().clone())
    pf.grad = p.grad.detach().clone()
    fused = torch.optim.AdamW([pf], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=wd,
                              fused=True)
    for _ in range(2):
        fused.step()
except Exception as e:
    fused, fused_skip = None, "AdamW(fused=True): %s: %s" % (type(e).__name__, e)
say({"ready": True, "torch": torch.__version__, "threads": torch.get_num_threads(),
     "python": sys.executable, "fused_skip": fused_skip})
def timed(o):
    rates = []
    for _ in range(steps):
        t0 = time.perf_counter()
        o.step()
        rates.append(n / (time.perf_counter() - t0))
    return rates
while True:
    line = sys.stdin.readline()
    if line.strip() != "run":
        break
    reply = {"elements_per_s": timed(opt)}
    if fused is not None:
        reply["fused_elements_per_s"] = timed(fused)
    say(reply)
)PY";
}

void check_adam_bench_options(const AdamBenchOptions& options) {
  validate_options(options);
}

AdamBenchResult run_adam_bench(const AdamBenchOptions& options) {
  validate_options(options);
  AdamBenchOptions o = options;
  const size_t n = o.elements;
  if (o.threads == 0)
    o.threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (o.seed == 0) {
    std::random_device rd;
    o.seed = (uint64_t{rd()} << 32 | rd()) | 1;
  }
  AdamBenchResult r;
  r.llc_bytes = last_level_cache_bytes();
  if (o.triad_elements == 0) {
    o.triad_elements = std::max(n, kTriadMinElements);
  }
  const bool copy = o.copy_bf16;
  r.bytes_per_element = adamw_bytes_per_element(copy);

  // Memory: the timed state (p, m, v, g, copy), the reference state of the check (freed
  // before timing), the triad's three arrays, and the torch process (p, grad, moments and
  // foreach temporaries, about 24 B per element, then the fused optimizer's p, grad and
  // moments, 16 more). Refuse what the machine cannot hold.
  const double state_bytes = static_cast<double>(n) * (16.0 + (copy ? 2.0 : 0.0));
  const double needed = 2.0 * state_bytes + 12.0 * static_cast<double>(o.triad_elements) +
                        (o.torch ? 40.0 * static_cast<double>(n) : 0.0) +
                        (o.passes ? 16.0 * static_cast<double>(n) : 0.0);
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) {
    const double physical = static_cast<double>(pages) * static_cast<double>(page);
    if (needed > 0.75 * physical) {
      SPILLWAY_INPUT_ERROR(
          "adam bench: {} elements need about {} of host memory (state, reference copy, triad "
          "arrays{}{}); this machine has {}: use fewer --elements",
          n, bytes_text(needed), o.torch ? ", torch process" : "",
          o.passes ? ", the passes' outputs" : "", bytes_text(physical));
    }
  }

  optim::AdamW adamw(o.threads);
  r.threads = adamw.threads();
  r.simd_target = optim::adamw_simd_target();
  const optim::AdamWParams hp;  // lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01

  // Inputs: p uniform in [-1, 1), g in [-1e-2, 1e-2), moments zero (a first step).
  HostArray<float> g(n, 0.0f, "g");
  State ours(n, copy, 0xAAAA);
  {
    Random rng{o.seed};
    for (size_t i = 0; i < n; ++i) {
      ours.p.get()[i] = rng.uniform(1.0f);
      g.get()[i] = rng.uniform(1e-2f);
    }
  }

  // Correctness before timing: all threads of the SIMD step against the scalar reference.
  int64_t step = 1;
  {
    State ref(n, copy, 0x5555);
    std::memcpy(ref.p.get(), ours.p.get(), n * sizeof(float));
    for (int s = 0; s < o.check_steps; ++s, ++step) {
      adamw.step(hp, ours.args(g.get(), step));
      optim::adamw_step_scalar(hp, ref.args(g.get(), step));
      require_equal(ours.p, ref.p, "p", step);
      require_equal(ours.m, ref.m, "m", step);
      require_equal(ours.v, ref.v, "v", step);
      if (copy) require_equal(ours.copy, ref.copy, "the bf16 copy", step);
    }
    r.elements_checked = static_cast<int64_t>(n) * o.check_steps;
    r.correct = true;
  }

  TriadTeam triad(r.threads, o.triad_elements);
  (void)triad.pass();  // warm-up, then its own check
  if (const int64_t at = triad.first_wrong(); at >= 0) {
    SPILLWAY_INPUT_ERROR("adam bench: the triad wrote a wrong value at element {}", at);
  }

  // PyTorch, started once; its first steps (warm-up) run before it reports ready.
  TorchProcess torch;
  if (!o.torch) {
    r.torch_skip_reason = "disabled (--no-torch)";
  } else {
    const std::vector<std::string> args = {
        std::to_string(n),         std::to_string(r.threads),          std::to_string(o.steps),
        fmt::format("{}", hp.lr),  fmt::format("{}", hp.beta1),        fmt::format("{}", hp.beta2),
        fmt::format("{}", hp.eps), fmt::format("{}", hp.weight_decay), std::to_string(o.seed)};
    std::vector<std::string> candidates;
    if (!o.python.empty()) {
      candidates = {o.python};
    } else {
      candidates = {"python3", "/usr/bin/python3"};
    }
    std::vector<std::string> reasons;
    for (const std::string& python : candidates) {
      nlohmann::json ready;
      const std::string why = torch.start(python, args, &ready);
      if (why.empty()) {
        r.torch_ran = true;
        r.torch_python = ready.value("python", python);
        r.torch_version = ready.value("torch", "");
        r.torch_threads = ready.value("threads", 0);
        r.torch_fused_ran = ready.contains("fused_skip") && ready["fused_skip"].is_null();
        r.torch_fused_skip_reason =
            r.torch_fused_ran ? ""
            : ready.contains("fused_skip") && ready["fused_skip"].is_string()
                ? ready["fused_skip"].get<std::string>()
                : "this bench script's torch process reported no fused optimizer";
        break;
      }
      reasons.push_back(why);
    }
    if (!r.torch_ran) {
      r.torch_skip_reason = reasons.front();
      for (size_t i = 1; i < reasons.size(); ++i) r.torch_skip_reason += "; " + reasons[i];
    }
  }

  // Note [The step's passes]: their outputs (the second buffer's p, m, v and an fp32
  // parameter), each at a 64-byte boundary as CPUAdamW's are, and the lanes.
  const size_t pass_n = o.passes ? n : 0;
  HostArray<float> pass_p(pass_n, 0.0f, "p_out"), pass_m(pass_n, 0.0f, "m_out"),
      pass_v(pass_n, 0.0f, "v_out"), pass_w(pass_n, 0.0f, "fp32 parameter");
  std::vector<double> lanes(o.passes ? optim::kNormLanes : 0);
  struct PassRun {
    const char* name;
    double bytes;
    bool out_of_place, fp32_copy, lanes, lanes_alone;
  };
  const PassRun pass_runs[] = {
      {"in place (DeepSpeedCPUAdam's step)", 28, false, false, false, false},
      {"in place + fp32 copy", 32, false, true, false, false},
      {"out of place, streamed", 28, true, false, false, false},
      {"out of place, streamed + fp32 copy", 32, true, true, false, false},
      {"out of place + fp32 copy + norm lanes", 32, true, true, true, false},
      {"norm lanes alone", 4, false, false, false, true},
  };
  const auto run_pass = [&](const PassRun& p, int64_t t) {
    if (p.lanes_alone) {
      optim::norm_lane_sums(&adamw, g.get(), n, lanes.data());
      return;
    }
    optim::AdamWArgs a;
    a.p = ours.p.get();
    a.m = ours.m.get();
    a.v = ours.v.get();
    a.g = g.get();
    a.n = n;
    a.step = t;
    if (p.out_of_place) {
      a.p_out = pass_p.get();
      a.m_out = pass_m.get();
      a.v_out = pass_v.get();
      a.stream = true;
    }
    if (p.fp32_copy) {
      a.copy_out = pass_w.get();
      a.copy_type = optim::CopyType::kFp32;
    }
    if (p.lanes) {
      adamw.step_and_norm_lanes(hp, a, lanes.data());
    } else {
      adamw.step(hp, a);
    }
  };
  if (o.passes) {
    for (const PassRun& p : pass_runs) r.passes.push_back({p.name, p.bytes, {}, 0.0, 0.0});
  }

  // One untimed round of the timed paths (first calls; the first passes after the
  // allocations and the torch start run measurably slower), then the repeats.
  for (int s = 0; s < o.steps; ++s) (void)triad.pass();
  for (int s = 0; s < o.steps; ++s) adamw.step(hp, ours.args(g.get(), step++));
  optim::adamw_step_scalar(hp, ours.args(g.get(), step++));
  if (o.passes) {
    for (const PassRun& p : pass_runs) run_pass(p, step++);
  }
  const double elements = static_cast<double>(n);
  for (int rep = 0; rep < o.repeats; ++rep) {
    for (int s = 0; s < o.steps; ++s) {
      const double t = triad.pass();
      r.samples_triad_gbps.push_back(r.triad_bytes_per_element *
                                     static_cast<double>(o.triad_elements) / t / 1e9);
    }
    for (int s = 0; s < o.steps; ++s) {
      const optim::AdamWArgs a = ours.args(g.get(), step++);
      const auto t0 = Clock::now();
      adamw.step(hp, a);
      r.samples_elements_per_s.push_back(elements / seconds_since(t0));
    }
    for (int s = 0; s < o.steps; ++s) {
      const optim::AdamWArgs a = ours.args(g.get(), step++);
      const auto t0 = Clock::now();
      optim::adamw_step_scalar(hp, a);
      r.samples_scalar_elements_per_s.push_back(elements / seconds_since(t0));
    }
    for (size_t k = 0; k < r.passes.size(); ++k) {
      for (int s = 0; s < o.steps; ++s) {
        const int64_t t = step++;
        const auto t0 = Clock::now();
        run_pass(pass_runs[k], t);
        r.passes[k].samples_ms.push_back(seconds_since(t0) * 1e3);
      }
    }
    if (r.torch_ran) {
      const std::string why =
          torch.run(&r.samples_torch_elements_per_s,
                    r.torch_fused_ran ? &r.samples_torch_fused_elements_per_s : nullptr);
      if (!why.empty()) {
        r.torch_ran = false;
        r.torch_skip_reason = "failed during the run: " + why;
        r.samples_torch_elements_per_s.clear();
        r.torch_fused_ran = false;
        r.torch_fused_skip_reason = r.torch_skip_reason;
        r.samples_torch_fused_elements_per_s.clear();
        torch.stop();
      }
    }
  }
  torch.stop();
  if (const int64_t at = triad.first_wrong(); at >= 0) {
    SPILLWAY_INPUT_ERROR("adam bench: the triad wrote a wrong value at element {}", at);
  }
  for (size_t i = 0; i < n; ++i) {  // the timed steps kept the state finite
    if (!std::isfinite(ours.p.get()[i]) || !std::isfinite(ours.v.get()[i])) {
      SPILLWAY_INPUT_ERROR("adam bench: p or v of element {} is not finite after {} steps", i,
                           step - 1);
    }
  }

  r.options = o;
  r.elements_per_s = median(r.samples_elements_per_s);
  r.state_gbps = r.elements_per_s * r.bytes_per_element / 1e9;
  r.triad_gbps = median(r.samples_triad_gbps);
  r.fraction_of_triad = r.triad_gbps > 0.0 ? r.state_gbps / r.triad_gbps : 0.0;
  r.scalar_elements_per_s = median(r.samples_scalar_elements_per_s);
  r.scalar_gbps = r.scalar_elements_per_s * r.bytes_per_element / 1e9;
  r.scalar_ratio = r.scalar_elements_per_s > 0.0 ? r.elements_per_s / r.scalar_elements_per_s : 0.0;
  if (r.torch_ran) {
    r.torch_elements_per_s = median(r.samples_torch_elements_per_s);
    r.torch_ratio = r.torch_elements_per_s > 0.0 ? r.elements_per_s / r.torch_elements_per_s : 0.0;
  }
  if (r.torch_fused_ran) {
    r.torch_fused_elements_per_s = median(r.samples_torch_fused_elements_per_s);
    r.torch_fused_ratio =
        r.torch_fused_elements_per_s > 0.0 ? r.elements_per_s / r.torch_fused_elements_per_s : 0.0;
  }
  for (AdamPass& p : r.passes) {
    p.ms = median(p.samples_ms);
    p.relative = r.passes.front().ms > 0.0 ? p.ms / r.passes.front().ms : 0.0;
  }
  return r;
}

std::string adam_bench_json(const AdamBenchResult& r) {
  using bench_json::finite;
  using bench_json::finite_all;
  using bench_json::Json;
  const AdamBenchOptions& o = r.options;
  Json j;
  j["schema"] = "spillway.bench.adam/1";
  j["elements_per_s"] = finite(r.elements_per_s);
  j["state_gbps"] = finite(r.state_gbps);
  j["triad_gbps"] = finite(r.triad_gbps);
  j["fraction_of_triad"] = finite(r.fraction_of_triad);
  j["scalar_ratio"] = finite(r.scalar_ratio);
  j["torch_ratio"] = r.torch_ran ? Json(finite(r.torch_ratio)) : Json(nullptr);
  j["torch_fused_ratio"] = r.torch_fused_ran ? Json(finite(r.torch_fused_ratio)) : Json(nullptr);
  j["simd_target"] = r.simd_target;
  j["threads"] = r.threads;
  j["samples"] =
      Json{{"elements_per_s", finite_all(r.samples_elements_per_s)},
           {"triad_gbps", finite_all(r.samples_triad_gbps)},
           {"scalar_elements_per_s", finite_all(r.samples_scalar_elements_per_s)},
           {"torch_elements_per_s", finite_all(r.samples_torch_elements_per_s)},
           {"torch_fused_elements_per_s", finite_all(r.samples_torch_fused_elements_per_s)}};
  j["targets"] = Json{{"min_fraction_of_triad", r.target_fraction_of_triad},
                      {"min_torch_ratio", r.target_torch_ratio}};
  j["meets_targets"] = Json{{"triad", r.meets_triad_target()},
                            {"torch", r.torch_ran ? Json(r.meets_torch_target()) : Json(nullptr)}};
  j["scalar_elements_per_s"] = finite(r.scalar_elements_per_s);
  j["scalar_gbps"] = finite(r.scalar_gbps);
  j["scalar_threads"] = 1;
  j["torch"] = Json{
      {"ran", r.torch_ran},
      {"skip_reason", r.torch_ran ? Json(nullptr) : Json(r.torch_skip_reason)},
      {"elements_per_s", r.torch_ran ? Json(finite(r.torch_elements_per_s)) : Json(nullptr)},
      {"version", r.torch_version},
      {"python", r.torch_python},
      {"threads", r.torch_threads},
      {"optimizer", "torch.optim.AdamW(foreach=True), fp32, no low-precision copy"},
      {"fused",
       Json{{"ran", r.torch_fused_ran},
            {"skip_reason", r.torch_fused_ran ? Json(nullptr) : Json(r.torch_fused_skip_reason)},
            {"elements_per_s",
             r.torch_fused_ran ? Json(finite(r.torch_fused_elements_per_s)) : Json(nullptr)},
            {"optimizer", "torch.optim.AdamW(fused=True), fp32, no low-precision copy"}}}};
  j["bytes_per_element"] = r.bytes_per_element;
  j["triad_bytes_per_element"] = r.triad_bytes_per_element;
  j["bytes_convention"] =
      "AdamW: 28 B/element (read p, g, m, v; write p, m, v) + 2 for the bf16 copy; triad: 16 "
      "B/element (read b, c; write a + its write-allocate read); GB/s = 1e9 bytes/s";
  j["correct"] = r.correct;
  j["elements_checked"] = r.elements_checked;
  if (!r.passes.empty()) {
    Json passes = Json::array();
    for (const AdamPass& p : r.passes) {
      passes.push_back(Json{{"name", p.name},
                            {"bytes_per_element", p.bytes_per_element},
                            {"ms", finite(p.ms)},
                            {"relative_to_in_place", finite(p.relative)},
                            {"samples_ms", finite_all(p.samples_ms)}});
    }
    j["passes"] = passes;
  }
  j["workload"] = Json{{"elements", o.elements},
                       {"state_bytes", static_cast<double>(o.elements) * r.bytes_per_element},
                       {"copy", o.copy_bf16 ? "bf16" : "none"},
                       {"grad", "fp32"},
                       {"repeats", o.repeats},
                       {"steps_per_repeat", o.steps},
                       {"check_steps", o.check_steps},
                       {"seed", o.seed},
                       {"triad_elements", o.triad_elements},
                       {"llc_bytes", r.llc_bytes}};
  return j.dump(2, ' ', false, Json::error_handler_t::replace) + "\n";
}

std::string format_adam_bench(const AdamBenchResult& r) {
  const AdamBenchOptions& o = r.options;
  const auto verdict = [](bool ok) { return ok ? "ok" : "MISSED"; };
  const double n = static_cast<double>(o.elements);
  std::string out;
  out += fmt::format("CPU AdamW benchmark: SIMD target {}, {} threads (AdamW class)\n",
                     r.simd_target, r.threads);
  out += fmt::format(
      "workload: {} elements, fp32 p/m/v/g{}, {} of state traffic per step ({:g} B/element); "
      "{} timed steps per method x {} repeats, triad / ours / scalar{} interleaved; figures are "
      "medians\n",
      o.elements, o.copy_bf16 ? " + bf16 copy of p" : ", no low-precision copy",
      bytes_text(n * r.bytes_per_element), r.bytes_per_element, o.steps, o.repeats,
      r.torch_ran ? " / torch" : "");
  out += fmt::format(
      "correctness: SIMD ({} threads) and scalar reference bitwise equal on p, m, v{} over {} "
      "steps x {} elements (seed {}), before timing\n\n",
      r.threads, o.copy_bf16 ? " and the bf16 copy" : "", o.check_steps, o.elements, o.seed);

  out += fmt::format("{:<34} {:>10} {:>22} {:>7}  {:<18} {}\n", "", "measured", "baseline", "ratio",
                     "target", "");
  out += fmt::format("{:<34} {:>10.2f} {:>22} {:>7.3f}  {:<18} {}\n", "state traffic GB/s",
                     r.state_gbps, fmt::format("{:.2f} (triad)", r.triad_gbps), r.fraction_of_triad,
                     fmt::format(">= {:.2f} x triad", r.target_fraction_of_triad),
                     verdict(r.meets_triad_target()));
  out += fmt::format("{:<34} {:>10.1f} {:>22} {:>7.2f}  {:<18} {}\n", "Melements/s vs scalar",
                     r.elements_per_s / 1e6,
                     fmt::format("{:.1f} (scalar, 1 thr)", r.scalar_elements_per_s / 1e6),
                     r.scalar_ratio, "-", "");
  if (r.torch_ran) {
    out += fmt::format(
        "{:<34} {:>10.1f} {:>22} {:>7.2f}  {:<18} {}\n", "Melements/s vs torch",
        r.elements_per_s / 1e6,
        fmt::format("{:.1f} (torch, {} thr)", r.torch_elements_per_s / 1e6, r.torch_threads),
        r.torch_ratio, fmt::format(">= {:g} x torch", r.target_torch_ratio),
        verdict(r.meets_torch_target()));
    // torch's strongest CPU AdamW: the baseline to quote (the target above is foreach's).
    if (r.torch_fused_ran) {
      out += fmt::format("{:<34} {:>10.1f} {:>22} {:>7.2f}  {:<18} {}\n",
                         "Melements/s vs torch fused", r.elements_per_s / 1e6,
                         fmt::format("{:.1f} (fused, {} thr)", r.torch_fused_elements_per_s / 1e6,
                                     r.torch_threads),
                         r.torch_fused_ratio, "-", "");
    } else {
      out += fmt::format("{:<34} {:>10.1f} {:>22} {:>7}  {:<18} {}\n", "Melements/s vs torch fused",
                         r.elements_per_s / 1e6, "skipped", "-", "-", "skipped");
    }
  } else {
    out += fmt::format("{:<34} {:>10.1f} {:>22} {:>7}  {:<18} {}\n", "Melements/s vs torch",
                       r.elements_per_s / 1e6, "skipped", "-",
                       fmt::format(">= {:g} x torch", r.target_torch_ratio), "skipped");
  }
  out += "\n";
  out += fmt::format(
      "bytes: AdamW {:g} B/element (reads p, g, m, v; writes p, m, v: 28{}); the triad 16 "
      "B/element (reads b, c; writes a, plus the write-allocate read of a). GB/s = 1e9 "
      "bytes/s; the fraction compares the two on that basis{}.\n",
      r.bytes_per_element, o.copy_bf16 ? "; + 2 for the bf16 copy" : "",
      o.copy_bf16 ? " (the copy's own write-allocate read, 2 B/element if its stores are not "
                    "streaming, is not counted: the fraction is conservative)"
                  : "");
  const double state_footprint = n * (16.0 + (o.copy_bf16 ? 2.0 : 0.0));
  const double triad_footprint = 12.0 * static_cast<double>(o.triad_elements);
  if (state_footprint < triad_footprint) {
    out += fmt::format(
        "note: the AdamW state ({}) is smaller than the triad's arrays ({}): part of it may be "
        "served from cache; --elements {} or more compares like footprints.\n",
        bytes_text(state_footprint), bytes_text(triad_footprint),
        static_cast<uint64_t>(std::ceil(triad_footprint / (state_footprint / n))));
  } else if (r.fraction_of_triad > 1.0) {
    out +=
        "note: a fraction above 1: AdamW's eight streams (in-place read-modify-write, no "
        "write-allocate) likely keep more misses in flight per core than the triad's three, so "
        "the triad understates this machine's limit here.\n";
  }
  out += fmt::format(
      "scalar: optim::adamw_step_scalar on one thread (ours: {} threads), the same buffers.\n",
      r.threads);
  if (r.torch_ran) {
    out += fmt::format(
        "torch: {} {}, torch.optim.AdamW(foreach=True) on one fp32 parameter of {} elements, "
        "torch.set_num_threads({}) -> {} threads, no low-precision copy (ours writes one), one "
        "Python process for the run, warmed up by two steps; .step() timed by "
        "time.perf_counter.\n",
        r.torch_python, r.torch_version, o.elements, r.threads, r.torch_threads);
    if (r.torch_fused_ran) {
      out += fmt::format(
          "torch fused: torch.optim.AdamW(fused=True) (torch's fastest CPU AdamW) on its own fp32 "
          "parameter of {} elements in the same process, timed after the foreach steps of each "
          "repeat, no low-precision copy: the baseline to quote ({:.2f}x); the >= {:g}x target "
          "is foreach's.\n",
          o.elements, r.torch_fused_ratio, r.target_torch_ratio);
    } else {
      out += fmt::format("torch fused: skipped: {}\n", r.torch_fused_skip_reason);
    }
  } else {
    out += fmt::format("torch: skipped: {}\n", r.torch_skip_reason);
  }
  const auto list = [](const std::vector<double>& v, double scale, const char* f) {
    std::string s;
    for (double x : v) s += (s.empty() ? "" : " ") + fmt::format(fmt::runtime(f), x / scale);
    return s;
  };
  out += fmt::format("samples: triad GB/s [{}]\n", list(r.samples_triad_gbps, 1.0, "{:.2f}"));
  out += fmt::format("         ours Melements/s [{}]\n",
                     list(r.samples_elements_per_s, 1e6, "{:.1f}"));
  out += fmt::format("         scalar Melements/s [{}]\n",
                     list(r.samples_scalar_elements_per_s, 1e6, "{:.1f}"));
  if (r.torch_ran) {
    out += fmt::format("         torch Melements/s [{}]\n",
                       list(r.samples_torch_elements_per_s, 1e6, "{:.1f}"));
  }
  if (r.torch_fused_ran) {
    out += fmt::format("         torch fused Melements/s [{}]\n",
                       list(r.samples_torch_fused_elements_per_s, 1e6, "{:.1f}"));
  }
  if (!r.passes.empty()) {
    out += fmt::format(
        "passes (Note [The step's passes]): the passes of CPUAdamW's paths over the same {} "
        "fp32 elements, {} threads, interleaved with the above; median ms per step and the "
        "ratio to the in-place step (DeepSpeedCPUAdam's):\n",
        o.elements, r.threads);
    for (const AdamPass& p : r.passes) {
      out += fmt::format("  {:<40} {:>4g} B/element {:>9.2f} ms {:>6.2f}x  [{}]\n", p.name,
                         p.bytes_per_element, p.ms, p.relative, list(p.samples_ms, 1.0, "{:.1f}"));
    }
  }
  out += fmt::format(
      "limit: this machine's memory bandwidth, the triad a = b + s * c over three arrays of {} "
      "({} elements; sysconf reports a last-level cache of {}) with {} threads (std::thread, "
      "static partition, widest vectors the CPU has, ordinary stores): at most {:.1f} "
      "Melements/s of AdamW at {:g} B/element.\n",
      bytes_text(4.0 * static_cast<double>(o.triad_elements)), o.triad_elements,
      r.llc_bytes > 0 ? bytes_text(static_cast<double>(r.llc_bytes)) : std::string("?"), r.threads,
      r.triad_gbps * 1e9 / r.bytes_per_element / 1e6, r.bytes_per_element);
  return out;
}

}  // namespace spillway
