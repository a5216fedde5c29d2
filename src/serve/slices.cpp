// Emulated MIG slices (spillway/serve/slices.hpp, Note [Emulated MIG slices]).
#include "spillway/serve/slices.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <thread>

#include "spillway/core/error.hpp"

namespace spillway {

namespace {
constexpr int kLinkChunks = 16;  // a GEMM's link bytes stream in this many bookings
}  // namespace

SliceSetup mig_slices(const HardwareProfile& hw, const std::string& profile, double rate_scale,
                      double memory_scale) {
  if (!(rate_scale > 0.0 && rate_scale <= 1.0))
    SPILLWAY_FIELD_ERROR("rate_scale", rate_scale, "must be in (0, 1]");
  if (!(memory_scale > 0.0 && memory_scale <= 1.0))
    SPILLWAY_FIELD_ERROR("memory_scale", memory_scale, "must be in (0, 1]");
  const MigProfile* mig = nullptr;
  std::string names;
  for (const MigProfile& m : hw.mig) {
    names += (names.empty() ? "" : ", ") + m.profile;
    if (m.profile == profile) mig = &m;
  }
  if (mig == nullptr)
    SPILLWAY_FIELD_ERROR("profile", "'" + profile + "'", "{} has {}", hw.name,
                         names.empty() ? "no MIG profiles" : "the MIG profiles " + names);
  if (hw.sms <= 0) SPILLWAY_FIELD_ERROR("sms", hw.sms, "must be > 0 ({})", hw.name);
  SliceSetup s;
  s.rate_scale = rate_scale;
  s.link_gbps = hw.h2d_typical.value * rate_scale;
  for (int i = 0; i < mig->count; ++i) {
    SliceSpec k;
    k.profile = mig->profile;
    k.hbm_bytes = static_cast<int64_t>(mig->hbm_gb * 1e9 * memory_scale);
    k.hbm_gbps = mig->hbm_tbps * 1e3 * rate_scale;
    k.gflops = hw.bf16_dense.value * 1e3 * mig->sms / hw.sms * rate_scale;
    s.slices.push_back(k);
  }
  return s;
}

EmulatedSlice::EmulatedSlice(const SliceSpec& spec, std::shared_ptr<HostLink> link)
    : spec_(spec), link_(std::move(link)) {
  if (link_ == nullptr) SPILLWAY_FIELD_ERROR("link", "null", "a slice needs its shared link");
  if (spec.hbm_bytes < 1) SPILLWAY_FIELD_ERROR("hbm_bytes", spec.hbm_bytes, "must be >= 1");
  if (!(spec.hbm_gbps > 0)) SPILLWAY_FIELD_ERROR("hbm_gbps", spec.hbm_gbps, "must be > 0");
  if (!(spec.gflops > 0)) SPILLWAY_FIELD_ERROR("gflops", spec.gflops, "must be > 0");
  HostDeviceOptions o;
  o.device_bytes = spec.hbm_bytes;
  o.link = link_;
  dev_ = make_host_device(o);
}

EmulatedSlice::~EmulatedSlice() = default;

SliceGemmTiming EmulatedSlice::gemm(const HybridGemmProblem& p, const float* x, const void* w,
                                    float* o) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  SliceGemmTiming t;
  t.traffic = hybrid_gemm_host(p, x, w, o);
  const GemmTraffic total = t.traffic.total();
  const auto ms = [&](Clock::time_point e) {
    return std::chrono::duration<double, std::milli>(e - start).count();
  };
  t.hbm_ms = static_cast<double>(total.hbm_bytes()) / (spec_.hbm_gbps * 1e6);
  t.compute_ms = 2.0 * static_cast<double>(p.m * p.n * p.k) / (spec_.gflops * 1e6);
  const double real_ms = ms(Clock::now());
  // The link bytes stream in chunks from the start, interleaving with the other slices'.
  auto end = start;
  const int64_t chunk = (total.link_bytes + kLinkChunks - 1) / kLinkChunks;
  for (int64_t sent = 0; sent < total.link_bytes; sent += chunk) {
    const int64_t n = std::min(chunk, total.link_bytes - sent);
    end = link_->book(true, static_cast<size_t>(n), std::max(end, start));
    std::this_thread::sleep_until(end);
  }
  t.link_ms = ms(end);
  const double emulated = std::max({t.link_ms, t.hbm_ms, t.compute_ms});
  t.overrun = real_ms > emulated;
  const auto until =
      start + std::chrono::duration_cast<Clock::duration>(
                  std::chrono::duration<double, std::milli>(std::max(emulated, real_ms)));
  std::this_thread::sleep_until(until);
  t.elapsed_ms = ms(Clock::now());
  return t;
}

}  // namespace spillway
