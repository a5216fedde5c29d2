// hybrid_gemm_on_device and hybrid_gemm_counted_on_device (spillway/serve/hybrid_gemm.hpp): the
// problem checked as on the host, then the device's HybridGEMM operation (Note [HybridGEMM
// as a device operation]), counted or not.
#include <fmt/format.h>

#include <array>
#include <exception>
#include <string>

#include "spillway/core/error.hpp"
#include "spillway/serve/hybrid_gemm.hpp"

namespace spillway {
namespace {

// The device operation's arguments for a checked problem (t: its closed form).
DeviceHybridGemm device_args(const HybridGemmProblem& p, const HybridGemmTraffic& t, const float* x,
                             const void* w, float* o) {
  DeviceHybridGemm a;
  a.m = p.m;
  a.n = p.n;
  a.k = p.k;
  a.n_symmetric = t.n_symmetric;
  a.w_bf16 = p.w_dtype == DType::kBf16;
  a.symmetric = {p.symmetric.m, p.symmetric.n, p.symmetric.k};
  a.asymmetric = {p.asymmetric.m, p.asymmetric.n, p.asymmetric.k};
  a.x = x;
  a.w = w;
  a.o = o;
  return a;
}

void say_no_operation(const Device& device, std::string* why) {
  if (why != nullptr)
    *why = fmt::format(
        "{} has no HybridGEMM operation (the host backend computes it with "
        "hybrid_gemm_host)",
        device.name());
}

// DeviceHybridGemm::traffic's six counters in device memory, with the host arrays the
// zeroing copies from and the counts come back to. Whatever path leaves the scope, the
// stream's work that uses them has run before they are freed (free() is not stream-ordered).
class TrafficCounters {
 public:
  static constexpr size_t kCount = 6;
  TrafficCounters(Device& device, Stream s)
      : device_(device), s_(s), mem_(device, kCount * sizeof(int64_t), MemoryKind::kDevice) {}
  ~TrafficCounters() {
    if (!mem_ || !enqueued_) return;
    try {
      device_.synchronize(s_);
    } catch (const std::exception& e) {
      SPILLWAY_CHECK_WARN(false, "hybrid_gemm_counted_on_device: freeing the counters: {}",
                          e.what());
    }
  }
  TrafficCounters(const TrafficCounters&) = delete;
  TrafficCounters& operator=(const TrafficCounters&) = delete;

  explicit operator bool() const { return static_cast<bool>(mem_); }
  const std::string& reason() const { return mem_.reason(); }
  int64_t* get() const { return static_cast<int64_t*>(mem_.get()); }
  void zero() {
    enqueued_ = true;
    device_.copy_async(mem_.get(), zeros_.data(), sizeof zeros_, s_);
  }
  // The counts, once the stream has run everything enqueued before.
  const std::array<int64_t, kCount>& read_back() {
    enqueued_ = true;
    device_.copy_async(counts_.data(), mem_.get(), sizeof counts_, s_);
    device_.synchronize(s_);
    enqueued_ = false;
    return counts_;
  }

 private:
  Device& device_;
  Stream s_;
  UniqueMemory mem_;  // (6) int64, device memory
  bool enqueued_ = false;
  std::array<int64_t, kCount> zeros_{};
  std::array<int64_t, kCount> counts_{};
};

}  // namespace

bool hybrid_gemm_on_device(Device& device, const HybridGemmProblem& p, const float* x,
                           const void* w, float* o, Stream s, std::string* why) {
  const HybridGemmTraffic t = hybrid_gemm_traffic(p);  // checks the problem
  if (device.hybrid_gemm(device_args(p, t, x, w, o), s)) return true;
  say_no_operation(device, why);
  return false;
}

bool hybrid_gemm_counted_on_device(Device& device, const HybridGemmProblem& p, const float* x,
                                   const void* w, float* o, Stream s, HybridGemmTraffic* counted,
                                   std::string* why) {
  SPILLWAY_CHECK(counted != nullptr, "hybrid_gemm_counted_on_device: counted is null");
  const HybridGemmTraffic t = hybrid_gemm_traffic(p);  // checks the problem
  TrafficCounters counters(device, s);
  if (!counters) {
    if (why != nullptr)
      *why = fmt::format("{}: cannot allocate HybridGEMM's traffic counters: {}", device.name(),
                         counters.reason());
    return false;
  }
  counters.zero();
  DeviceHybridGemm a = device_args(p, t, x, w, o);
  a.traffic = counters.get();
  if (!device.hybrid_gemm(a, s)) {
    say_no_operation(device, why);
    return false;
  }
  const std::array<int64_t, TrafficCounters::kCount>& c = counters.read_back();
  counted->n_symmetric = t.n_symmetric;
  counted->symmetric = {c[0], c[1], c[2]};
  counted->asymmetric = {c[3], c[4], c[5]};
  return true;
}

}  // namespace spillway
