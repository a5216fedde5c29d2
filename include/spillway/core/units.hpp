// Units that cannot be mixed up silently: bytes, seconds, bandwidth (GB/s), FLOPs and
// FLOP rates. Each is its own type with an explicit constructor; the only cross-unit
// operators are the physically meaningful ones (bytes / bandwidth = time, ...).
// Conventions: 1 GB = 1e9 bytes and 1 GB/s = 1e9 bytes/s (as link and HBM figures are
// quoted); 1 TFLOP/s = 1e12 FLOP/s. Bytes are exact integers; byte arithmetic that could
// overflow 64 bits goes through checked_mul/checked_add, which throw spillway::Error.
#pragma once

#include <compare>
#include <cstdint>
#include <string>

namespace spillway {

// a * b, or Error("<what> overflows 64 bits: a * b") when it does not fit.
int64_t checked_mul(int64_t a, int64_t b, const char* what);
int64_t checked_add(int64_t a, int64_t b, const char* what);

struct Bytes {
  int64_t count = 0;
  constexpr Bytes() = default;
  constexpr explicit Bytes(int64_t n) : count(n) {}
  static constexpr Bytes from_gb(double gb) { return Bytes(static_cast<int64_t>(gb * 1e9)); }
  constexpr double gb() const { return static_cast<double>(count) / 1e9; }
  constexpr double gib() const { return static_cast<double>(count) / (1024.0 * 1024.0 * 1024.0); }
  constexpr Bytes& operator+=(Bytes o) {
    count += o.count;
    return *this;
  }
  constexpr Bytes& operator-=(Bytes o) {
    count -= o.count;
    return *this;
  }
  friend constexpr Bytes operator+(Bytes a, Bytes b) { return Bytes(a.count + b.count); }
  friend constexpr Bytes operator-(Bytes a, Bytes b) { return Bytes(a.count - b.count); }
  friend constexpr Bytes operator*(Bytes a, int64_t k) { return Bytes(a.count * k); }
  // NOLINTNEXTLINE(modernize-use-nullptr): clang-tidy 14 misreads the synthesized "< 0"
  friend constexpr auto operator<=>(Bytes, Bytes) = default;
};

struct Seconds {
  double value = 0.0;
  constexpr Seconds() = default;
  constexpr explicit Seconds(double s) : value(s) {}
  static constexpr Seconds from_ms(double ms) { return Seconds(ms * 1e-3); }
  constexpr double ms() const { return value * 1e3; }
  constexpr Seconds& operator+=(Seconds o) {
    value += o.value;
    return *this;
  }
  friend constexpr Seconds operator+(Seconds a, Seconds b) { return Seconds(a.value + b.value); }
  friend constexpr Seconds operator-(Seconds a, Seconds b) { return Seconds(a.value - b.value); }
  friend constexpr Seconds operator*(Seconds a, double k) { return Seconds(a.value * k); }
  friend constexpr double operator/(Seconds a, Seconds b) { return a.value / b.value; }
  // NOLINTNEXTLINE(modernize-use-nullptr): clang-tidy 14 misreads the synthesized "< 0"
  friend constexpr auto operator<=>(Seconds, Seconds) = default;
};

// Bandwidth in GB/s (1e9 bytes per second).
struct GBps {
  double value = 0.0;
  constexpr GBps() = default;
  constexpr explicit GBps(double gbps) : value(gbps) {}
  constexpr double bytes_per_s() const { return value * 1e9; }
  friend constexpr GBps operator*(GBps a, double k) { return GBps(a.value * k); }
  friend constexpr GBps operator/(GBps a, double k) { return GBps(a.value / k); }
  // NOLINTNEXTLINE(modernize-use-nullptr): clang-tidy 14 misreads the synthesized "< 0"
  friend constexpr auto operator<=>(GBps, GBps) = default;
};

struct Flops {
  double count = 0.0;
  constexpr Flops() = default;
  constexpr explicit Flops(double n) : count(n) {}
  constexpr Flops& operator+=(Flops o) {
    count += o.count;
    return *this;
  }
  friend constexpr Flops operator+(Flops a, Flops b) { return Flops(a.count + b.count); }
  friend constexpr Flops operator*(Flops a, double k) { return Flops(a.count * k); }
  // NOLINTNEXTLINE(modernize-use-nullptr): clang-tidy 14 misreads the synthesized "< 0"
  friend constexpr auto operator<=>(Flops, Flops) = default;
};

// FLOP rate in TFLOP/s (1e12 FLOP per second).
struct TFlops {
  double value = 0.0;
  constexpr TFlops() = default;
  constexpr explicit TFlops(double t) : value(t) {}
  friend constexpr TFlops operator*(TFlops a, double k) { return TFlops(a.value * k); }
  // NOLINTNEXTLINE(modernize-use-nullptr): clang-tidy 14 misreads the synthesized "< 0"
  friend constexpr auto operator<=>(TFlops, TFlops) = default;
};

constexpr Seconds operator/(Bytes b, GBps bw) {
  return Seconds(static_cast<double>(b.count) / bw.bytes_per_s());
}
constexpr GBps operator/(Bytes b, Seconds t) {
  return GBps(static_cast<double>(b.count) / t.value / 1e9);
}
constexpr Seconds operator/(Flops f, TFlops r) {
  return Seconds(f.count / (r.value * 1e12));
}

// Human-readable forms used in reports: "4.80 GB", "26.9 ms", "180 GB/s".
std::string to_string(Bytes b);
std::string to_string(Seconds s);
std::string to_string(GBps bw);

}  // namespace spillway
