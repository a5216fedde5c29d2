// Units: the cross-unit operators give the physically right figure, units that must not mix
// do not compile, and checked byte arithmetic throws spillway::Error instead of wrapping.
#include "spillway/core/units.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <type_traits>

#include "test_support.hpp"

namespace spillway {
namespace {

template <class A, class B>
concept Addable = requires(A a, B b) {
  a + b;
};
template <class A, class B>
concept Divisible = requires(A a, B b) {
  a / b;
};

// Only the meaningful cross-unit operators exist.
static_assert(!Addable<Bytes, Seconds>);
static_assert(!Addable<Bytes, GBps>);
static_assert(!Addable<Seconds, GBps>);
static_assert(!Addable<Bytes, int64_t>);
static_assert(!Divisible<Seconds, Bytes>);
static_assert(!Divisible<GBps, Bytes>);
static_assert(std::is_same_v<decltype(Bytes(1) / GBps(1.0)), Seconds>);
static_assert(std::is_same_v<decltype(Bytes(1) / Seconds(1.0)), GBps>);
static_assert(std::is_same_v<decltype(Flops(1.0) / TFlops(1.0)), Seconds>);
static_assert(std::is_same_v<decltype(Seconds(1.0) / Seconds(1.0)), double>);
// No silent conversion from a bare number.
static_assert(!std::is_convertible_v<int64_t, Bytes>);
static_assert(!std::is_convertible_v<double, Seconds>);
static_assert(!std::is_convertible_v<double, GBps>);

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
constexpr int64_t kMin = std::numeric_limits<int64_t>::min();

TEST(Units, BytesOverBandwidthIsSeconds) {
  // 1 GB = 1e9 bytes and 1 GB/s = 1e9 bytes/s.
  EXPECT_DOUBLE_EQ((Bytes(4'800'000'000) / GBps(160.0)).value, 0.03);
  EXPECT_DOUBLE_EQ((Bytes(1'000'000'000) / GBps(1.0)).value, 1.0);
  EXPECT_DOUBLE_EQ((Bytes(170'000'000) / GBps(170.0)).ms(), 1.0);
  EXPECT_DOUBLE_EQ((Bytes(0) / GBps(52.0)).value, 0.0);
  // Twice the bytes take twice the time; twice the bandwidth half the time.
  const Seconds t = Bytes(123'456'789) / GBps(52.0);
  EXPECT_DOUBLE_EQ((Bytes(246'913'578) / GBps(52.0)).value, 2.0 * t.value);
  EXPECT_DOUBLE_EQ((Bytes(123'456'789) / GBps(104.0)).value, 0.5 * t.value);
}

TEST(Units, BytesOverSecondsIsBandwidth) {
  EXPECT_DOUBLE_EQ((Bytes(1'000'000'000) / Seconds(0.5)).value, 2.0);
  EXPECT_DOUBLE_EQ((Bytes(450'000'000) / Seconds::from_ms(10.0)).value, 45.0);
  // Round trip: bytes / (bytes / bw) == bw.
  const Bytes b(987'654'321);
  const GBps bw(185.0);
  EXPECT_DOUBLE_EQ((b / (b / bw)).value, bw.value);
  EXPECT_DOUBLE_EQ(bw.bytes_per_s(), 185e9);
}

TEST(Units, FlopsOverRateIsSeconds) {
  EXPECT_DOUBLE_EQ((Flops(2e12) / TFlops(1.0)).value, 2.0);
  EXPECT_DOUBLE_EQ((Flops(989e12) / TFlops(989.0)).value, 1.0);
  EXPECT_DOUBLE_EQ((Flops(1e12) / (TFlops(1000.0) * 0.5)).ms(), 2.0);
}

TEST(Units, ArithmeticWithinAUnit) {
  Bytes b(100);
  b += Bytes(23);
  EXPECT_EQ(b.count, 123);
  b -= Bytes(3);
  EXPECT_EQ(b.count, 120);
  EXPECT_EQ((Bytes(7) + Bytes(8)).count, 15);
  EXPECT_EQ((Bytes(7) - Bytes(8)).count, -1);
  EXPECT_EQ((Bytes(7) * 3).count, 21);
  EXPECT_LT(Bytes(1), Bytes(2));
  EXPECT_EQ(Bytes::from_gb(4.8).count, 4'800'000'000);
  EXPECT_EQ(Bytes::from_gb(1.5).count, 1'500'000'000);
  EXPECT_DOUBLE_EQ(Bytes(2'500'000'000).gb(), 2.5);
  EXPECT_DOUBLE_EQ(Bytes(1LL << 30).gib(), 1.0);

  Seconds s = Seconds::from_ms(26.9);
  EXPECT_DOUBLE_EQ(s.value, 0.0269);
  EXPECT_DOUBLE_EQ(s.ms(), 26.9);
  s += Seconds(1.0);
  EXPECT_DOUBLE_EQ(s.value, 1.0269);
  EXPECT_DOUBLE_EQ((Seconds(3.0) - Seconds(1.0)).value, 2.0);
  EXPECT_DOUBLE_EQ((Seconds(3.0) * 2.0).value, 6.0);
  EXPECT_DOUBLE_EQ(Seconds(3.0) / Seconds(1.5), 2.0);
  EXPECT_GT(Seconds(2.0), Seconds(1.0));

  EXPECT_DOUBLE_EQ((GBps(170.0) / 1.1).value, 170.0 / 1.1);
  EXPECT_DOUBLE_EQ((GBps(52.0) * 0.5).value, 26.0);
  EXPECT_DOUBLE_EQ((Flops(1.0) + Flops(2.0)).count, 3.0);
  EXPECT_DOUBLE_EQ((TFlops(989.0) * 0.7).value, 692.3);
}

TEST(Units, HumanReadableForms) {
  EXPECT_EQ(to_string(Bytes(4'800'000'000)), "4.80 GB");
  EXPECT_EQ(to_string(Bytes(1'000'000'000)), "1.00 GB");
  EXPECT_EQ(to_string(Bytes(512'000'000)), "512.0 MB");
  EXPECT_EQ(to_string(Bytes(0)), "0.0 MB");
  EXPECT_EQ(to_string(Seconds::from_ms(26.9)), "26.9 ms");
  EXPECT_EQ(to_string(Seconds(1.5)), "1.50 s");
  EXPECT_EQ(to_string(GBps(180.0)), "180 GB/s");
  EXPECT_EQ(to_string(GBps(52.4)), "52 GB/s");
}

TEST(Units, CheckedMulExactWhenItFits) {
  EXPECT_EQ(checked_mul(0, kMax, "x"), 0);
  EXPECT_EQ(checked_mul(kMax, 1, "x"), kMax);
  EXPECT_EQ(checked_mul(-1, kMax, "x"), -kMax);
  EXPECT_EQ(checked_mul(1LL << 31, 1LL << 31, "x"), 1LL << 62);
  EXPECT_EQ(checked_mul(4096, 14336, "x"), 58'720'256);
  EXPECT_EQ(checked_add(kMax - 1, 1, "x"), kMax);
  EXPECT_EQ(checked_add(kMin, 0, "x"), kMin);
}

TEST(Units, CheckedMulOverflowThrows) {
  using spillway::testing::expect_error;
  expect_error([] { (void)checked_mul(kMax, 2, "activation size"); },
               {"activation size overflows 64 bits", std::to_string(kMax), "* 2"});
  expect_error([] { (void)checked_mul(1LL << 32, 1LL << 31, "weights"); },
               {"weights overflows 64 bits: 4294967296 * 2147483648"});
  expect_error([] { (void)checked_mul(-1, kMin, "negated"); }, {"negated overflows 64 bits"});
  expect_error([] { (void)checked_mul(kMin, 2, "low"); }, {"low overflows 64 bits"});
  expect_error([] { (void)checked_add(kMax, 1, "sum"); },
               {"sum overflows 64 bits: " + std::to_string(kMax) + " + 1"});
  expect_error([] { (void)checked_add(kMin, -1, "neg sum"); }, {"neg sum overflows 64 bits"});
}

}  // namespace
}  // namespace spillway
