// The link probe (see include/spillway/probe/probe.hpp): for each size, one device buffer; for
// each host memory kind, one host buffer that first carries a pattern host -> device ->
// host (poisoned in between, compared bit for bit), then is timed in each direction.
//
// Note [Probe samples]: each point's samples are those of Note [Copy samples]
// (spillway/device/device.hpp: back-to-back copies lasting at least kMinCopySampleS, after a
// warm-up), calibrated by calibrate_copy_sample, whose samples are discarded.
//
// Note [Probe budget]: each point gets its share of the time left (time left / points
// left, so what a small size does not use passes to the large ones) and as many samples
// as fit in it, at least one and at most `repeats`.
#include "spillway/probe/probe.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>

#include "core/stats.hpp"
#include "spillway/core/error.hpp"

namespace spillway {

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Word i of the pattern of `seed`: distinct for every word of a buffer (so a misplaced
// or unwritten block is caught), cheap enough that verifying 256 MiB costs little more
// than copying it. The poison is the complement: it differs from the pattern in every bit.
uint64_t pattern_word(uint64_t seed, size_t i) {
  return (static_cast<uint64_t>(i) * 0x9e3779b97f4a7c15ULL) ^ seed;
}

void fill_pattern(void* ptr, size_t bytes, uint64_t seed, bool poison) {
  auto* p = static_cast<unsigned char*>(ptr);
  const uint64_t flip = poison ? ~uint64_t{0} : 0;
  const size_t words = bytes / 8;
  for (size_t i = 0; i < words; ++i) {
    const uint64_t w = pattern_word(seed, i) ^ flip;
    std::memcpy(p + i * 8, &w, 8);
  }
  if (bytes % 8 != 0) {
    const uint64_t w = pattern_word(seed, words) ^ flip;
    std::memcpy(p + words * 8, &w, bytes % 8);
  }
}

// The first byte that differs from the pattern, if any.
std::optional<size_t> first_mismatch(const void* ptr, size_t bytes, uint64_t seed) {
  const auto* p = static_cast<const unsigned char*>(ptr);
  const size_t words = bytes / 8;
  uint64_t diff = 0;  // branch-free scan of the whole words; located only on failure
  for (size_t i = 0; i < words; ++i) {
    uint64_t w = 0;
    std::memcpy(&w, p + i * 8, 8);
    diff |= w ^ pattern_word(seed, i);
  }
  uint64_t tail = 0;
  if (bytes % 8 != 0) tail = pattern_word(seed, words);
  const auto* tail_bytes = reinterpret_cast<const unsigned char*>(&tail);
  bool tail_ok = true;
  for (size_t b = 0; b < bytes % 8; ++b) tail_ok = tail_ok && p[words * 8 + b] == tail_bytes[b];
  if (diff == 0 && tail_ok) return std::nullopt;
  for (size_t i = 0; i < bytes; ++i) {
    uint64_t w = pattern_word(seed, i / 8);
    const auto* e = reinterpret_cast<const unsigned char*>(&w);
    if (p[i] != e[i % 8]) return i;
  }
  return std::nullopt;  // unreachable: some byte differed
}

// "64 KiB", "256 MiB", "1000 B".
std::string size_text(size_t bytes) {
  constexpr size_t kKiB = size_t{1} << 10, kMiB = size_t{1} << 20, kGiB = size_t{1} << 30;
  if (bytes >= kGiB && bytes % kGiB == 0) return fmt::format("{} GiB", bytes / kGiB);
  if (bytes >= kMiB && bytes % kMiB == 0) return fmt::format("{} MiB", bytes / kMiB);
  if (bytes >= kKiB && bytes % kKiB == 0) return fmt::format("{} KiB", bytes / kKiB);
  return fmt::format("{} B", bytes);
}

double gbps_of(size_t bytes, double seconds) {
  return static_cast<double>(bytes) / std::max(seconds, 1e-9) / 1e9;
}

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

const ProbePoint* find_point(const ProbeResult& r, size_t bytes, const std::string& direction,
                             const std::string& host_memory) {
  for (const ProbePoint& p : r.points) {
    if (p.bytes == bytes && p.direction == direction && p.host_memory == host_memory) return &p;
  }
  return nullptr;
}

}  // namespace

ProbeResult run_probe(Device& dev, const ProbeOptions& options) {
  if (options.sizes.empty()) {
    SPILLWAY_FIELD_ERROR("sizes", "empty", "give at least one transfer size in bytes");
  }
  for (size_t i = 0; i < options.sizes.size(); ++i) {
    if (options.sizes[i] == 0) {
      SPILLWAY_FIELD_ERROR("sizes", fmt::format("0 at index {}", i),
                           "every size must be > 0 bytes");
    }
  }
  if (options.repeats < 1) SPILLWAY_FIELD_ERROR("repeats", options.repeats, "must be >= 1");
  if (!(options.seconds_budget > 0.0)) {
    SPILLWAY_FIELD_ERROR("seconds_budget", options.seconds_budget, "must be > 0 (seconds)");
  }
  std::vector<size_t> sizes = options.sizes;
  std::sort(sizes.begin(), sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());

  struct HostKind {
    MemoryKind kind;
    const char* name;
  };
  std::vector<HostKind> host_kinds = {{MemoryKind::kPinnedHost, "pinned"}};
  if (options.pageable) host_kinds.push_back({MemoryKind::kHost, "pageable"});

  ProbeResult result;
  result.backend = dev.name();
  result.emulated = dev.emulated();

  const auto start = Clock::now();
  size_t points_left = sizes.size() * host_kinds.size() * 2;
  UniqueStream h2d(dev, StreamRole::kH2D);
  UniqueStream d2h(dev, StreamRole::kD2H);

  for (size_t bytes : sizes) {
    const UniqueMemory device(dev, bytes, MemoryKind::kDevice);
    if (device.get() == nullptr) {
      result.skipped.push_back({bytes, "", device.reason()});
      points_left -= host_kinds.size() * 2;
      continue;
    }
    for (const HostKind& hk : host_kinds) {
      const int64_t pinned_before =
          dev.memory_stats().current[static_cast<int>(MemoryKind::kPinnedHost)];
      const UniqueMemory host(dev, bytes, hk.kind);
      if (host.get() == nullptr) {
        result.skipped.push_back({bytes, hk.name, host.reason()});
        points_left -= 2;
        continue;
      }
      if (hk.kind == MemoryKind::kPinnedHost &&
          dev.memory_stats().current[static_cast<int>(MemoryKind::kPinnedHost)] <= pinned_before) {
        result.notes.push_back(
            fmt::format("the pinned {} buffer is pageable memory (the backend could not pin it)",
                        size_text(bytes)));
      }

      // Verify before timing: pattern host -> device, poison the host copy, device -> host.
      const uint64_t seed = splitmix64(bytes * 131 + static_cast<uint64_t>(hk.kind));
      fill_pattern(host.get(), bytes, seed, false);
      dev.copy_async(device.get(), host.get(), bytes, h2d.get());
      dev.synchronize(h2d.get());
      fill_pattern(host.get(), bytes, seed, true);
      dev.copy_async(host.get(), device.get(), bytes, d2h.get());
      dev.synchronize(d2h.get());
      if (const std::optional<size_t> bad = first_mismatch(host.get(), bytes, seed)) {
        SPILLWAY_INPUT_ERROR(
            "probe: {}: a {} round trip through {} host memory came back different at byte {} "
            "(host -> device -> host); the copies of this backend are broken",
            result.backend, size_text(bytes), hk.name, *bad);
      }

      for (const char* direction : {"H2D", "D2H"}) {
        const bool to_device = std::strcmp(direction, "H2D") == 0;
        void* dst = to_device ? device.get() : host.get();
        const void* src = to_device ? host.get() : device.get();
        const Stream s = to_device ? h2d.get() : d2h.get();
        // Note [Probe samples].
        const CopySample cal = calibrate_copy_sample(dev, dst, src, bytes, s);
        const int copies = cal.copies;
        const double sample_s = cal.seconds;
        // Note [Probe budget].
        const double left_s = options.seconds_budget - seconds_since(start);
        const double share_s = left_s / static_cast<double>(std::max<size_t>(points_left, 1));
        const double fit = std::floor(share_s / std::max(sample_s, 1e-9));
        const int repeats =
            static_cast<int>(std::clamp(fit, 1.0, static_cast<double>(options.repeats)));
        std::vector<double> gbps;
        gbps.reserve(static_cast<size_t>(repeats));
        const size_t sample_bytes = bytes * static_cast<size_t>(copies);
        for (int r = 0; r < repeats; ++r) {
          gbps.push_back(gbps_of(sample_bytes, time_copies(dev, dst, src, bytes, copies, s)));
        }
        ProbePoint p;
        p.direction = direction;
        p.host_memory = hk.name;
        p.bytes = bytes;
        p.gbps_median = median_of(gbps);
        p.gbps_best = *std::max_element(gbps.begin(), gbps.end());
        p.repeats = repeats;
        p.copies_per_sample = copies;
        result.points.push_back(std::move(p));
        --points_left;
      }
    }
  }
  return result;
}

std::string format_probe_report(const ProbeResult& r, const HardwareProfile* expected) {
  std::string out = fmt::format("measured: {}\n", r.backend);
  if (r.emulated) {
    out +=
        "this is the host backend (no GPU): the figures are this machine's memcpy bandwidth "
        "through the emulated copy engines, not a GPU link (its pinned and pageable host memory "
        "are the same plain memory).\n";
  }
  if (expected != nullptr) {
    out += fmt::format(
        "expected of {} ({}): D2H {:.0f} GB/s typical, {:.0f} nominal; H2D {:.0f} typical, {:.0f} "
        "nominal (one GPU alone on its link)\n",
        expected->name, expected->link_kind, expected->d2h_typical.value,
        expected->d2h_nominal.value, expected->h2d_typical.value, expected->h2d_nominal.value);
  }
  out += "\n";

  std::vector<size_t> sizes;
  for (const ProbePoint& p : r.points) {
    if (std::find(sizes.begin(), sizes.end(), p.bytes) == sizes.end()) sizes.push_back(p.bytes);
  }
  const auto cell = [](const ProbePoint* p) {
    return p == nullptr ? std::string("-")
                        : fmt::format("{:.2f} ({:.2f})", p->gbps_median, p->gbps_best);
  };
  out += fmt::format("{:>9}  {:<3}  {:>17}  {:>17}  {:>13}", "size", "dir", "pinned GB/s",
                     "pageable GB/s", "samples");
  if (expected != nullptr) {
    out += fmt::format("  {:>7}  {:>7}  {:>14}", "typical", "nominal", "pinned/typical");
  }
  out += "\n";
  for (size_t bytes : sizes) {
    for (const char* direction : {"H2D", "D2H"}) {
      const ProbePoint* pinned = find_point(r, bytes, direction, "pinned");
      const ProbePoint* pageable = find_point(r, bytes, direction, "pageable");
      if (pinned == nullptr && pageable == nullptr) continue;
      const auto samples = [](const ProbePoint* p) {
        return fmt::format("{}x{}", p->repeats, p->copies_per_sample);
      };
      std::string sampled = samples(pinned != nullptr ? pinned : pageable);
      if (pinned != nullptr && pageable != nullptr && samples(pinned) != samples(pageable)) {
        sampled += "/" + samples(pageable);
      }
      out += fmt::format("{:>9}  {:<3}  {:>17}  {:>17}  {:>13}", size_text(bytes), direction,
                         cell(pinned), cell(pageable), sampled);
      if (expected != nullptr) {
        const bool h2d = std::strcmp(direction, "H2D") == 0;
        const double typical = h2d ? expected->h2d_typical.value : expected->d2h_typical.value;
        const double nominal = h2d ? expected->h2d_nominal.value : expected->d2h_nominal.value;
        const std::string ratio = pinned != nullptr && typical > 0.0
                                      ? fmt::format("{:.2f}", pinned->gbps_median / typical)
                                      : std::string("-");
        out += fmt::format("  {:>7.0f}  {:>7.0f}  {:>14}", typical, nominal, ratio);
      }
      out += "\n";
    }
  }
  out +=
      "\nGB/s = 1e9 bytes/s, the median over samples (the best in parentheses); samples NxC: N "
      "samples of C back-to-back copies, each timed from the first enqueue to stream "
      "synchronize, after warm-up copies. Every size was verified bit for bit before it was "
      "timed.\n";
  for (const ProbeSkip& s : r.skipped) {
    out += fmt::format("skipped {}{}: {}\n", size_text(s.bytes),
                       s.host_memory.empty() ? "" : " " + s.host_memory, s.reason);
  }
  for (const std::string& n : r.notes) out += "note: " + n + "\n";
  return out;
}

std::string probe_json(const ProbeResult& r) {
  using Json = nlohmann::ordered_json;
  Json j;
  j["schema"] = "spillway.probe/1";
  j["backend"] = r.backend;
  j["emulated"] = r.emulated;
  Json points = Json::array();
  for (const ProbePoint& p : r.points) {
    points.push_back(Json{{"direction", p.direction},
                          {"host_memory", p.host_memory},
                          {"bytes", p.bytes},
                          {"gbps_median", std::isfinite(p.gbps_median) ? p.gbps_median : 0.0},
                          {"gbps_best", std::isfinite(p.gbps_best) ? p.gbps_best : 0.0},
                          {"repeats", p.repeats},
                          {"copies_per_sample", p.copies_per_sample}});
  }
  j["points"] = std::move(points);
  Json skipped = Json::array();
  for (const ProbeSkip& s : r.skipped) {
    skipped.push_back(
        Json{{"bytes", s.bytes}, {"host_memory", s.host_memory}, {"reason", s.reason}});
  }
  j["skipped"] = std::move(skipped);
  j["notes"] = r.notes;
  return j.dump(2, ' ', false, Json::error_handler_t::replace) + "\n";
}

// Note [The machine is the limit] (probe.hpp).
double measure_host_copy_gbps(size_t bytes, double seconds_budget) {
  HostDeviceOptions hd;
  hd.device_bytes = static_cast<int64_t>(bytes) + (int64_t{4} << 20);
  const std::unique_ptr<Device> dev = make_host_device(hd);
  ProbeOptions po;
  po.sizes = {bytes};
  po.repeats = 5;
  po.pageable = false;
  po.seconds_budget = seconds_budget;
  const ProbeResult r = run_probe(*dev, po);
  double gbps = 0.0;
  for (const ProbePoint& p : r.points) {
    if (p.gbps_median > 0.0) gbps = gbps > 0.0 ? std::min(gbps, p.gbps_median) : p.gbps_median;
  }
  return gbps;
}

std::string machine_limit_note(double link_gbps, double memcpy_gbps, const std::string& what) {
  if (!(memcpy_gbps > 0.0) || !(link_gbps > memcpy_gbps)) return "";
  return fmt::format(
      "the machine is the limit: its memcpy measured {:.2f} GB/s in this run, below the emulated "
      "link's {:.2f} GB/s, so the copies run at the machine's pace and {} reflect this machine, "
      "not the link (Note [The machine is the limit]); run on an idle machine or with a slower "
      "link",
      memcpy_gbps, link_gbps, what);
}

}  // namespace spillway
