// The link probe on the host backend: throttled copies measure at (not above) their
// throttle, unthrottled ones faster; sizes that do not fit are skipped, not thrown;
// corrupted copies are caught before timing; nothing stays allocated; the report and the
// JSON say what was measured.
#include "spillway/probe/probe.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <iostream>
#include <nlohmann/json.hpp>
#include <set>
#include <vector>

#include "forwarding_device.hpp"
#include "spillway/core/error.hpp"
#include "spillway/device/device.hpp"

namespace spillway {
namespace {

constexpr size_t kMiB = size_t{1} << 20;
constexpr double kD2HGbps = 2.0;
constexpr double kH2DGbps = 4.0;

std::unique_ptr<Device> host_device(double d2h_gbps, double h2d_gbps) {
  return make_host_device(HostDeviceOptions{int64_t{64} << 20, d2h_gbps, h2d_gbps});
}

ProbeOptions small_options() {
  ProbeOptions o;
  o.sizes = {1 * kMiB, 8 * kMiB};
  o.repeats = 3;
  return o;
}

void expect_nothing_allocated(const Device& dev) {
  const MemoryStats m = dev.memory_stats();
  for (int k = 0; k < kMemoryKinds; ++k) {
    EXPECT_EQ(m.current[k], 0) << to_string(static_cast<MemoryKind>(k)) << " memory left behind";
  }
}

void print_points(const char* what, const ProbeResult& r) {
  for (const ProbePoint& p : r.points) {
    std::cout << what << ": " << p.direction << " " << p.host_memory << " " << p.bytes / kMiB
              << " MiB: median " << p.gbps_median << " GB/s, best " << p.gbps_best << " GB/s ("
              << p.repeats << " samples of " << p.copies_per_sample << " copies)\n";
  }
}

const ProbePoint& point(const ProbeResult& r, size_t bytes, const std::string& direction,
                        const std::string& host_memory) {
  for (const ProbePoint& p : r.points) {
    if (p.bytes == bytes && p.direction == direction && p.host_memory == host_memory) return p;
  }
  throw std::runtime_error("no point " + direction + " " + host_memory);
}

// Best of a few plain 8 MiB memcpys, in GB/s: the speed the throttles must be well below.
double memcpy_gbps() {
  std::vector<unsigned char> a(8 * kMiB, 1), b(8 * kMiB, 2);
  double best_s = 1e9;
  unsigned sum = 0;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    std::memcpy(b.data(), a.data(), a.size());
    best_s = std::min(best_s,
                      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    sum += b[static_cast<size_t>(i) * 4096];
    a[static_cast<size_t>(i) * 4096] = static_cast<unsigned char>(i);
  }
  EXPECT_GT(sum, 0u);
  return static_cast<double>(a.size()) / best_s / 1e9;
}

// Timing checks mean nothing under ASan/TSan: there the host backend's copies run at a
// few GB/s (3.4 GB/s measured with ASan), too close to the throttles.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
#else
constexpr bool kSanitized = false;
#endif

// The throttle is a floor on a copy's time, and load only slows a copy down: that no
// sample beats its throttle holds on any host, loaded or sanitized, and is checked on all.
// (It ran only where memcpy was clear of the throttle, so a loaded host skipped it.)
ProbeResult probe_throttled(Device& dev) {
  const ProbeResult r = run_probe(dev, small_options());
  print_points("throttled", r);
  EXPECT_TRUE(r.emulated);
  EXPECT_EQ(r.backend, dev.name());
  EXPECT_TRUE(r.skipped.empty());
  EXPECT_EQ(r.points.size(), 8u);  // 2 sizes x pinned/pageable x H2D/D2H
  std::set<std::string> seen;
  for (const ProbePoint& p : r.points) {
    seen.insert(p.direction + " " + p.host_memory + " " + std::to_string(p.bytes));
    const double limit = p.direction == "H2D" ? kH2DGbps : kD2HGbps;
    // No sample beats the throttle (10% for clock slack). How close it gets is timing, not
    // correctness, and a loaded host (ctest -j, a build beside it) slows any sample
    // arbitrarily: no lower bound (8 MiB points were seen below half the throttle on a
    // loaded 2-core machine). That the throttle engages at all is the next test's.
    EXPECT_LE(p.gbps_median, 1.1 * limit) << p.direction << " " << p.host_memory << " " << p.bytes;
    EXPECT_LE(p.gbps_best, 1.1 * limit) << p.direction << " " << p.host_memory << " " << p.bytes;
    EXPECT_GE(p.gbps_best, p.gbps_median);
    EXPECT_EQ(p.repeats, 3);
    // A sample lasts >= 2 ms: one 8 MiB copy does (>= 2.1 ms, the throttle's floor).
    if (p.bytes == 8 * kMiB) {
      EXPECT_EQ(p.copies_per_sample, 1);
    }
  }
  EXPECT_EQ(seen.size(), 8u);
  return r;
}

TEST(Probe, ThrottledCopiesNeverMeasureAboveTheirThrottle) {
  auto throttled = host_device(kD2HGbps, kH2DGbps);
  probe_throttled(*throttled);
  expect_nothing_allocated(*throttled);
}

// Whether unthrottled copies beat the throttle is a measurement of the host: it needs
// memcpy well clear of the throttle, before and after (a build beside the suite once took
// memcpy down to 9 GB/s between the two, and the unthrottled copies under the
// throttle's). The one timing-dependent verdict left in this file: it skips, saying so,
// where the host cannot tell them apart (a sanitizer build, a loaded host).
TEST(Probe, ThrottledCopiesAreSlowerThanUnthrottledOnes) {
  if (kSanitized) GTEST_SKIP() << "timing checks are skipped in a sanitizer build";
  const double memcpy_limit = memcpy_gbps();
  std::cout << "plain memcpy, 8 MiB: " << memcpy_limit << " GB/s\n";
  if (memcpy_limit < 2.0 * kH2DGbps) {
    GTEST_SKIP() << "memcpy does only " << memcpy_limit << " GB/s here: too close to the "
                 << kH2DGbps << " GB/s throttle to tell them apart";
  }
  auto throttled = host_device(kD2HGbps, kH2DGbps);
  const ProbeResult r = probe_throttled(*throttled);
  ASSERT_EQ(r.points.size(), 8u);
  auto free_running = host_device(0.0, 0.0);
  ProbeOptions o = small_options();
  o.sizes = {8 * kMiB};
  o.repeats = 7;  // a loaded host (2 CPUs, ctest -j) may preempt a few samples
  const ProbeResult u = run_probe(*free_running, o);
  print_points("unthrottled", u);
  ASSERT_EQ(u.points.size(), 4u);
  const double memcpy_now = memcpy_gbps();
  if (memcpy_now < 2.0 * kH2DGbps) {
    GTEST_SKIP() << "memcpy does only " << memcpy_now << " GB/s now (host loaded): too close to "
                 << "the " << kH2DGbps << " GB/s throttle to compare the unthrottled copies";
  }
  // Best against best: a busy host can stall any one sample, not a throttle's floor.
  for (const ProbePoint& p : u.points) {
    EXPECT_GT(p.gbps_best, point(r, 8 * kMiB, p.direction, p.host_memory).gbps_best)
        << p.direction << " " << p.host_memory;
  }
  expect_nothing_allocated(*free_running);
}

TEST(Probe, ASizeBiggerThanTheDeviceIsSkippedNotThrown) {
  auto dev = host_device(0.0, 0.0);
  ProbeOptions o;
  o.sizes = {128 * kMiB, 1 * kMiB};  // the arena holds 64 MiB
  o.repeats = 2;
  o.pageable = false;
  ProbeResult r;
  ASSERT_NO_THROW(r = run_probe(*dev, o));
  ASSERT_EQ(r.points.size(), 2u);  // 1 MiB pinned, H2D and D2H
  for (const ProbePoint& p : r.points) {
    EXPECT_EQ(p.bytes, 1 * kMiB);
    EXPECT_EQ(p.host_memory, "pinned");
  }
  ASSERT_EQ(r.skipped.size(), 1u);
  EXPECT_EQ(r.skipped[0].bytes, 128 * kMiB);
  EXPECT_EQ(r.skipped[0].host_memory, "");
  EXPECT_NE(r.skipped[0].reason.find("device arena"), std::string::npos) << r.skipped[0].reason;
  const std::string report = format_probe_report(r, nullptr);
  EXPECT_NE(report.find("skipped 128 MiB"), std::string::npos) << report;
  expect_nothing_allocated(*dev);
}

TEST(Probe, JsonAndReportSayWhatWasMeasured) {
  auto dev = host_device(0.0, 0.0);
  ProbeOptions o;
  o.sizes = {64 << 10, 1 * kMiB};
  o.repeats = 2;
  const ProbeResult r = run_probe(*dev, o);

  const nlohmann::json j = nlohmann::json::parse(probe_json(r));
  EXPECT_EQ(j.at("schema"), "spillway.probe/1");
  EXPECT_EQ(j.at("backend"), dev->name());
  EXPECT_EQ(j.at("emulated"), true);
  ASSERT_EQ(j.at("points").size(), r.points.size());
  ASSERT_EQ(r.points.size(), 8u);
  for (size_t i = 0; i < r.points.size(); ++i) {
    const nlohmann::json& p = j.at("points")[i];
    EXPECT_EQ(p.at("direction"), r.points[i].direction);
    EXPECT_EQ(p.at("host_memory"), r.points[i].host_memory);
    EXPECT_EQ(p.at("bytes").get<size_t>(), r.points[i].bytes);
    EXPECT_DOUBLE_EQ(p.at("gbps_median").get<double>(), r.points[i].gbps_median);
    EXPECT_DOUBLE_EQ(p.at("gbps_best").get<double>(), r.points[i].gbps_best);
    EXPECT_EQ(p.at("repeats").get<int>(), 2);
    EXPECT_EQ(p.at("copies_per_sample").get<int>(), r.points[i].copies_per_sample);
    EXPECT_GT(p.at("gbps_median").get<double>(), 0.0);
  }

  const std::string plain = format_probe_report(r, nullptr);
  EXPECT_NE(plain.find("host backend"), std::string::npos) << plain;
  EXPECT_NE(plain.find("not a GPU link"), std::string::npos) << plain;
  EXPECT_NE(plain.find("64 KiB"), std::string::npos) << plain;
  EXPECT_EQ(plain.find("typical"), std::string::npos) << plain;

  HardwareProfile h;
  h.name = "testgpu";
  h.link_kind = "pcie-gen5-x16";
  h.d2h_nominal = GBps(64.0);
  h.h2d_nominal = GBps(63.0);
  h.d2h_typical = GBps(53.0);
  h.h2d_typical = GBps(52.0);
  const std::string compared = format_probe_report(r, &h);
  std::cout << compared;
  EXPECT_NE(compared.find("testgpu"), std::string::npos) << compared;
  EXPECT_NE(compared.find("pinned/typical"), std::string::npos) << compared;
  EXPECT_NE(compared.find("  53  "), std::string::npos) << compared;  // D2H typical column
  EXPECT_NE(compared.find("  63  "), std::string::npos) << compared;  // H2D nominal column
}

// Forwards to the host backend, but flips a bit of every copy on a D2H stream.
class CorruptingDevice final : public spillway::testing::ForwardingDevice {
 public:
  explicit CorruptingDevice(std::unique_ptr<Device> inner)
      : ForwardingDevice(*inner), owned_(std::move(inner)) {}
  std::string name() const override { return "corrupting " + inner().name(); }
  bool emulated() const override { return true; }
  Stream create_stream(StreamRole role, int priority) override {
    const Stream s = inner().create_stream(role, priority);
    if (role == StreamRole::kD2H) d2h_.insert(s.id);
    return s;
  }
  void copy_async(void* dst, const void* src, size_t bytes, Stream s) override {
    inner().copy_async(dst, src, bytes, s);
    if (d2h_.count(s.id) != 0 && bytes > 0) {
      inner().host_callback(s, [dst, bytes] { static_cast<unsigned char*>(dst)[bytes / 3] ^= 4; });
    }
  }

 private:
  std::unique_ptr<Device> owned_;
  std::set<int> d2h_;
};

TEST(Probe, CorruptedCopiesAreCaughtBeforeTimingAndNothingLeaks) {
  CorruptingDevice dev(host_device(0.0, 0.0));
  ProbeOptions o;
  o.sizes = {3000};
  o.repeats = 1;
  try {
    run_probe(dev, o);
    ADD_FAILURE() << "run_probe accepted corrupted copies";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("at byte 1000"), std::string::npos) << msg;
    EXPECT_NE(msg.find("pinned"), std::string::npos) << msg;
  }
  expect_nothing_allocated(dev);
}

TEST(Probe, BadOptionsAreErrors) {
  auto dev = host_device(0.0, 0.0);
  ProbeOptions o;
  o.repeats = 0;
  EXPECT_THROW(run_probe(*dev, o), Error);
  o = ProbeOptions{};
  o.sizes = {};
  EXPECT_THROW(run_probe(*dev, o), Error);
  o.sizes = {0};
  EXPECT_THROW(run_probe(*dev, o), Error);
  o = ProbeOptions{};
  o.seconds_budget = 0.0;
  EXPECT_THROW(run_probe(*dev, o), Error);
}

}  // namespace
}  // namespace spillway
