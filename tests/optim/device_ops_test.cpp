// The device operations (Note [Device operations], device.hpp) on every compiled backend
// against the CPU reference, bitwise, as ggml's test-backend-ops runs each operation on
// each backend: AdamW against optim's scalar reference (adamw_step_scalar), the norm
// lanes against STV's and a plain per-lane loop, the widening against bf16_to_float.
// Inputs are fresh random values from a printed seed, uploaded, run and downloaded on one
// stream with one synchronize (so stream order is part of every check); outputs start
// poisoned, one element past the end too, so that an unwritten or overrun element fails.
// The CUDA case skips, and says why, without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "forwarding_device.hpp"
#include "spillway/core/error.hpp"
#include "spillway/device/device.hpp"
#include "spillway/optim/optim.hpp"

namespace spillway {
namespace {

constexpr uint32_t kSeed = 20240917;
constexpr unsigned char kPoison = 0xA5;

// Device memory of one backend, filled and read back on the test's stream.
class DeviceBuffer {
 public:
  DeviceBuffer(Device& dev, size_t bytes) : dev_(dev) {
    const AllocResult r = dev.allocate(bytes, MemoryKind::kDevice);
    if (!r) throw Error("test buffer: " + r.reason);
    ptr_ = r.ptr;
  }
  ~DeviceBuffer() { dev_.free(ptr_, MemoryKind::kDevice); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }

 private:
  Device& dev_;
  void* ptr_ = nullptr;
};

class DeviceOpsParity : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (GetParam() == "host") {
      dev_ = make_host_device(HostDeviceOptions{int64_t{64} << 20, 0.0, 0.0});
    } else {
      std::string why;
      dev_ = make_cuda_device(0, &why);
      if (!dev_) GTEST_SKIP() << "CUDA backend not exercised: " << why;
    }
    stream_ = dev_->create_stream(StreamRole::kCompute);
    std::cout << "seed " << kSeed << " on " << dev_->name() << "\n";
  }
  void TearDown() override {
    if (!dev_) return;
    dev_->synchronize(stream_);
    buffers_.clear();
    dev_->destroy_stream(stream_);
    dev_.reset();
  }

  Device& dev() { return *dev_; }
  Stream stream() const { return stream_; }

  // A device copy of `host` (+ one poisoned element past its end), uploaded in stream order.
  template <typename T>
  T* upload(const std::vector<T>& host) {
    buffers_.push_back(std::make_unique<DeviceBuffer>(*dev_, (host.size() + 1) * sizeof(T)));
    T* d = buffers_.back()->as<T>();
    staged_.push_back(
        std::make_unique<std::vector<unsigned char>>((host.size() + 1) * sizeof(T), kPoison));
    std::memcpy(staged_.back()->data(), host.data(), host.size() * sizeof(T));
    dev_->copy_async(d, staged_.back()->data(), staged_.back()->size(), stream_);
    return d;
  }
  // n poisoned elements (+ one past the end) on the device.
  template <typename T>
  T* poisoned(size_t n) {
    std::vector<T> p(n);
    std::memset(static_cast<void*>(p.data()), kPoison, n * sizeof(T));
    return upload(p);
  }
  // The n elements at d (and the one past them), after everything enqueued so far.
  template <typename T>
  std::vector<T> download(const T* d, size_t n) {
    std::vector<T> out(n + 1);
    dev_->copy_async(out.data(), d, (n + 1) * sizeof(T), stream_);
    dev_->synchronize(stream_);
    return out;
  }

 private:
  std::unique_ptr<Device> dev_;
  Stream stream_;
  std::vector<std::unique_ptr<DeviceBuffer>> buffers_;
  std::vector<std::unique_ptr<std::vector<unsigned char>>> staged_;
};

template <typename T>
T poison_value() {
  T x;
  std::memset(static_cast<void*>(&x), kPoison, sizeof x);
  return x;
}

// Bitwise equality of the first n elements, and the one past them still poisoned.
template <typename T>
::testing::AssertionResult same_bits(const std::vector<T>& got, const std::vector<T>& want,
                                     size_t n) {
  if (std::memcmp(got.data(), want.data(), n * sizeof(T)) != 0) {
    for (size_t i = 0; i < n; ++i) {
      if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0)
        return ::testing::AssertionFailure() << "element " << i << " of " << n << " differs";
    }
  }
  const T past = poison_value<T>();
  if (std::memcmp(&got[n], &past, sizeof(T)) != 0)
    return ::testing::AssertionFailure() << "the element past " << n << " was written";
  return ::testing::AssertionSuccess();
}

TEST_P(DeviceOpsParity, AdamWStepMatchesTheCpuReferenceBitwise) {
  std::mt19937 r(kSeed);
  std::normal_distribution<float> d(0.0f, 0.1f);
  optim::AdamWParams hp;
  hp.lr = 3e-3;
  hp.weight_decay = 0.05;
  for (size_t n : {size_t{1}, size_t{7}, size_t{4099}, size_t{100003}}) {
    for (const bool bf16 : {false, true}) {
      for (const bool copy : {false, true}) {
        SCOPED_TRACE(::testing::Message()
                     << "n " << n << " bf16 gradient " << bf16 << " copy " << copy);
        std::vector<float> p(n), m(n), v(n), g32(n);
        std::vector<uint16_t> g16(n);
        for (size_t i = 0; i < n; ++i) {
          p[i] = d(r);
          m[i] = d(r) * 0.01f;
          v[i] = std::abs(d(r)) * 0.001f;
          g32[i] = d(r);
          g16[i] = optim::float_to_bf16(d(r));
        }
        DeviceAdamW op;
        op.p = upload(p);
        op.m = upload(m);
        op.v = upload(v);
        op.g = bf16 ? static_cast<const void*>(upload(g16)) : static_cast<const void*>(upload(g32));
        op.grad_bf16 = bf16;
        uint16_t* out = poisoned<uint16_t>(n);
        op.copy = copy ? out : nullptr;
        op.n = n;
        std::vector<uint16_t> want_copy(n + 1, poison_value<uint16_t>());
        for (int64_t step = 1; step <= 3; ++step) {
          op.scalars = optim::adamw_step_scalars(hp, step);
          op.grad_scale = step == 2 ? 0.75f : 1.0f;
          ASSERT_TRUE(dev().adamw_step(op, stream()));
          optim::AdamWArgs a;
          a.p = p.data();
          a.m = m.data();
          a.v = v.data();
          a.g = bf16 ? static_cast<const void*>(g16.data()) : static_cast<const void*>(g32.data());
          a.grad_type = bf16 ? optim::GradType::kBf16 : optim::GradType::kFp32;
          a.grad_scale = op.grad_scale;
          a.copy_out = copy ? want_copy.data() : nullptr;
          a.copy_type = copy ? optim::CopyType::kBf16 : optim::CopyType::kNone;
          a.n = n;
          a.step = step;
          optim::adamw_step_scalar(hp, a);
        }
        p.push_back(poison_value<float>());
        m.push_back(poison_value<float>());
        v.push_back(poison_value<float>());
        EXPECT_TRUE(same_bits(download(op.p, n), p, n)) << "p";
        EXPECT_TRUE(same_bits(download(op.m, n), m, n)) << "m";
        EXPECT_TRUE(same_bits(download(op.v, n), v, n)) << "v";
        EXPECT_TRUE(same_bits(download(out, n), want_copy, n)) << "copy";
      }
    }
  }
}

// Lane c of L sums the squares of elements c, c + L, ... in double, in index order: here a
// plain loop per lane, and for L = kNormLanes also STV's own (optim::norm_lane_sums_bf16).
TEST_P(DeviceOpsParity, NormLanesMatchTheCpuReferenceBitwise) {
  std::mt19937 r(kSeed + 1);
  std::normal_distribution<float> d(0.0f, 3.0f);
  struct Case {
    size_t n;
    size_t lanes;
  };
  for (const Case c :
       {Case{1000, optim::kNormLanes}, Case{3 * optim::kNormLanes + 11, optim::kNormLanes},
        Case{1, 5}, Case{12, 5}, Case{100001, 7}}) {
    SCOPED_TRACE(::testing::Message() << "n " << c.n << " lanes " << c.lanes);
    std::vector<uint16_t> g(c.n);
    for (uint16_t& x : g) x = optim::float_to_bf16(d(r));
    const size_t width = std::min(c.n, c.lanes);
    std::vector<double> want(width + 1, poison_value<double>());
    for (size_t lane = 0; lane < width; ++lane) {
      double s = 0.0;
      for (size_t i = lane; i < c.n; i += c.lanes) {
        const double x = optim::bf16_to_float(g[i]);
        s += x * x;
      }
      want[lane] = s;
    }
    if (c.lanes == optim::kNormLanes) {
      std::vector<double> stv(width + 1, poison_value<double>());
      optim::norm_lane_sums_bf16(g.data(), c.n, stv.data());
      ASSERT_TRUE(same_bits(stv, want, width)) << "STV's lanes";
    }
    DeviceNormLanes op;
    op.g = upload(g);
    op.n = c.n;
    op.lane_count = c.lanes;
    op.lanes = poisoned<double>(width);
    ASSERT_TRUE(dev().norm_lanes_bf16(op, stream()));
    EXPECT_TRUE(same_bits(download(op.lanes, width), want, width));
  }
}

TEST_P(DeviceOpsParity, WideningIsExactForEveryBf16Pattern) {
  std::vector<uint16_t> all(65536);
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i);
  std::vector<float> want(all.size() + 1, poison_value<float>());
  for (size_t i = 0; i < all.size(); ++i) want[i] = optim::bf16_to_float(all[i]);
  DeviceWidenBf16 op;
  op.src = upload(all);
  op.dst = poisoned<float>(all.size());
  op.n = all.size();
  ASSERT_TRUE(dev().widen_bf16(op, stream()));
  EXPECT_TRUE(same_bits(download(op.dst, all.size()), want, all.size()));
}

// n = 0 only answers (no pointer is read); n > 0 with a missing array is an error at the
// call, before anything is enqueued.
TEST_P(DeviceOpsParity, ZeroElementsOnlyAnswerAndMissingArraysAreErrors) {
  EXPECT_TRUE(dev().adamw_step(DeviceAdamW{}, stream()));
  EXPECT_TRUE(dev().norm_lanes_bf16(DeviceNormLanes{}, stream()));
  EXPECT_TRUE(dev().widen_bf16(DeviceWidenBf16{}, stream()));
  DeviceAdamW a;
  a.n = 4;
  EXPECT_THROW(dev().adamw_step(a, stream()), Error);
  DeviceNormLanes l;
  l.n = 4;
  EXPECT_THROW(dev().norm_lanes_bf16(l, stream()), Error);
  DeviceWidenBf16 w;
  w.n = 4;
  EXPECT_THROW(dev().widen_bf16(w, stream()), Error);
  EXPECT_THROW(dev().widen_bf16(DeviceWidenBf16{}, Stream{12345}), Error);
}

INSTANTIATE_TEST_SUITE_P(EveryBackend, DeviceOpsParity, ::testing::Values("host", "cuda"),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

// A backend that offers no device operation: the interface's defaults say so, and enqueue
// nothing.
class NoOpsDevice final : public spillway::testing::ForwardingDevice {
 public:
  using ForwardingDevice::ForwardingDevice;
  bool adamw_step(const DeviceAdamW& a, Stream s) override {
    return DeviceBackend::adamw_step(a, s);
  }
  bool norm_lanes_bf16(const DeviceNormLanes& a, Stream s) override {
    return DeviceBackend::norm_lanes_bf16(a, s);
  }
  bool widen_bf16(const DeviceWidenBf16& a, Stream s) override {
    return DeviceBackend::widen_bf16(a, s);
  }
};

TEST(DeviceOps, TheDefaultIsNotOffered) {
  auto host = make_host_device(HostDeviceOptions{int64_t{1} << 20, 0.0, 0.0});
  NoOpsDevice dev(*host);
  const Stream s = dev.create_stream(StreamRole::kCompute, 0);
  std::vector<uint16_t> src(4, 0x3F80);
  std::vector<float> dst(4, -1.0f);
  EXPECT_FALSE(dev.widen_bf16(DeviceWidenBf16{src.data(), dst.data(), 4}, s));
  EXPECT_FALSE(dev.adamw_step(DeviceAdamW{}, s));
  EXPECT_FALSE(dev.norm_lanes_bf16(DeviceNormLanes{}, s));
  dev.synchronize(s);
  EXPECT_EQ(dst, std::vector<float>(4, -1.0f));
  dev.destroy_stream(s);
}

// The host backend's native_stream is a host stream another host device can adopt.
TEST(DeviceOps, AHostDevicesNativeStreamIsAdoptedByAnother) {
  auto a = make_host_device(HostDeviceOptions{int64_t{1} << 20, 0.0, 0.0});
  auto b = make_host_device(HostDeviceOptions{int64_t{1} << 20, 0.0, 0.0});
  const Stream sa = a->create_stream(StreamRole::kCompute);
  ASSERT_NE(a->native_stream(sa), nullptr);
  const Stream sb = b->adopt_stream(a->native_stream(sa), StreamRole::kCompute);
  EXPECT_EQ(b->native_stream(sb), a->native_stream(sa));
  std::vector<int> order;
  a->host_callback(sa, [&] { order.push_back(1); });
  b->host_callback(sb, [&] { order.push_back(2); });
  a->host_callback(sa, [&] { order.push_back(3); });
  b->synchronize(sb);
  EXPECT_EQ(order, (std::vector<int>{1, 2, 3}));
  b->destroy_stream(sb);
  a->destroy_stream(sa);
}

}  // namespace
}  // namespace spillway
