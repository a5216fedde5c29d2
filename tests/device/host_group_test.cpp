// The host backend's multi-device emulation: a host link shared by several emulated
// devices (Note [Shared host links]) and the all-gather of a device group (Note [Device
// groups]). The link's bandwidth is a schedule, so its checks are lower bounds: copies can
// be slower than it on a loaded machine, never faster.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "spillway/core/error.hpp"
#include "spillway/device/device.hpp"

namespace spillway {
namespace {

TEST(HostLink, DevicesSharingALinkShareItsBandwidth) {
  const size_t bytes = size_t{4} << 20;
  for (int devices : {1, 2, 3}) {
    SCOPED_TRACE(::testing::Message() << devices << " devices");
    auto link = std::make_shared<HostLink>(1.0, 1.0);  // 1 GB/s each way
    std::vector<std::unique_ptr<Device>> devs;
    std::vector<Stream> streams;
    std::vector<std::vector<char>> src;
    std::vector<void*> dst;
    for (int d = 0; d < devices; ++d) {
      HostDeviceOptions o;
      o.device_bytes = int64_t{16} << 20;
      o.h2d_gbps = 1000.0;  // ignored: the link throttles
      o.link = link;
      devs.push_back(make_host_device(o));
      streams.push_back(devs.back()->create_stream(StreamRole::kH2D));
      src.emplace_back(bytes, static_cast<char>(d + 1));
      dst.push_back(devs.back()->allocate(bytes, MemoryKind::kDevice).ptr);
    }
    const auto t0 = std::chrono::steady_clock::now();
    for (int d = 0; d < devices; ++d)
      devs[static_cast<size_t>(d)]->copy_async(dst[static_cast<size_t>(d)],
                                               src[static_cast<size_t>(d)].data(), bytes,
                                               streams[static_cast<size_t>(d)]);
    for (int d = 0; d < devices; ++d)
      devs[static_cast<size_t>(d)]->synchronize(streams[static_cast<size_t>(d)]);
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // N copies over one 1 GB/s link take N times one copy's time at least.
    EXPECT_GE(secs, 0.99 * static_cast<double>(devices * bytes) / 1e9);
    EXPECT_EQ(link->h2d_bytes(), static_cast<int64_t>(devices * bytes));
    EXPECT_EQ(link->d2h_bytes(), 0);
    for (int d = 0; d < devices; ++d) {
      EXPECT_EQ(static_cast<char*>(dst[static_cast<size_t>(d)])[bytes - 1],
                static_cast<char>(d + 1));
      devs[static_cast<size_t>(d)]->free(dst[static_cast<size_t>(d)], MemoryKind::kDevice);
      devs[static_cast<size_t>(d)]->destroy_stream(streams[static_cast<size_t>(d)]);
    }
  }
  EXPECT_THROW(HostLink(0.0, 1.0), InputError);
}

TEST(HostAllGather, EveryRankGetsEveryPartInRankOrderCallAfterCall) {
  for (int ranks : {1, 2, 4}) {
    SCOPED_TRACE(::testing::Message() << ranks << " ranks");
    std::vector<std::unique_ptr<Device>> devs;
    std::vector<Device*> raw;
    for (int r = 0; r < ranks; ++r) {
      HostDeviceOptions o;
      o.device_bytes = int64_t{4} << 20;
      devs.push_back(make_host_device(o));
      raw.push_back(devs.back().get());
    }
    auto group = make_host_all_gather(raw);
    const size_t part = 1000;
    std::vector<Stream> streams;
    std::vector<std::vector<char>> buf;  // per rank, two buffers alternating
    for (int r = 0; r < ranks; ++r) {
      EXPECT_EQ(group[static_cast<size_t>(r)]->rank(), r);
      EXPECT_EQ(group[static_cast<size_t>(r)]->ranks(), ranks);
      streams.push_back(devs[static_cast<size_t>(r)]->create_stream(StreamRole::kCompute));
      buf.emplace_back(2 * part * static_cast<size_t>(ranks));
    }
    auto value = [](int call, int r, size_t i) {
      return static_cast<char>((call * 31 + r * 7 + static_cast<int>(i)) % 127);
    };
    const int calls = 300;
    for (int call = 0; call < calls; ++call) {
      for (int r = 0; r < ranks; ++r) {
        // Each rank writes its part on its stream (so the write is ordered before its
        // gather and after its previous gather of this buffer), then gathers.
        char* b = buf[static_cast<size_t>(r)].data() +
                  static_cast<size_t>(call % 2) * part * static_cast<size_t>(ranks);
        Device& dev = *devs[static_cast<size_t>(r)];
        dev.host_callback(streams[static_cast<size_t>(r)], [b, r, call, part, value] {
          for (size_t i = 0; i < part; ++i)
            b[static_cast<size_t>(r) * part + i] = value(call, r, i);
        });
        group[static_cast<size_t>(r)]->all_gather_in_place(b, part,
                                                           streams[static_cast<size_t>(r)]);
      }
      if (call % 50 == 49) {
        // Only once every rank has enqueued its gather (one that waited alone would wait
        // for ever, as with NCCL).
        for (int r = 0; r < ranks; ++r)
          devs[static_cast<size_t>(r)]->synchronize(streams[static_cast<size_t>(r)]);
        for (int r = 0; r < ranks; ++r) {
          const char* b = buf[static_cast<size_t>(r)].data() +
                          static_cast<size_t>(call % 2) * part * static_cast<size_t>(ranks);
          for (int q = 0; q < ranks; ++q)
            for (size_t i = 0; i < part; i += 37)
              ASSERT_EQ(b[static_cast<size_t>(q) * part + i], value(call, q, i))
                  << "rank " << r << " part " << q << " call " << call;
        }
      }
    }
    for (int r = 0; r < ranks; ++r)
      devs[static_cast<size_t>(r)]->destroy_stream(streams[static_cast<size_t>(r)]);
  }
}

TEST(HostAllGather, AbortReleasesTheRanksWaitingForAPeerThatFailed) {
  // Rank 1 never calls (it failed): rank 0's gathers would wait for ever; abort() lets its
  // stream drain, its own part untouched, and later calls return at once.
  std::vector<std::unique_ptr<Device>> devs;
  std::vector<Device*> raw;
  for (int r = 0; r < 2; ++r) {
    devs.push_back(make_host_device(HostDeviceOptions{int64_t{4} << 20, 0.0, 0.0}));
    raw.push_back(devs.back().get());
  }
  auto group = make_host_all_gather(raw);
  const Stream s = devs[0]->create_stream(StreamRole::kCompute);
  std::vector<char> buf(2 * 64, 'a');
  group[0]->all_gather_in_place(buf.data(), 64, s);
  group[0]->all_gather_in_place(buf.data(), 64, s);
  std::thread aborter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    group[1]->abort();  // any rank, any thread
  });
  devs[0]->synchronize(s);  // returns: the waits gave up
  aborter.join();
  group[0]->all_gather_in_place(buf.data(), 64, s);
  devs[0]->synchronize(s);
  EXPECT_EQ(buf[0], 'a');
  devs[0]->destroy_stream(s);
}

TEST(HostAllGather, AGroupOfNonHostDevicesOrNoneIsRefused) {
  EXPECT_THROW(make_host_all_gather({}), InputError);
  EXPECT_THROW(make_host_all_gather({nullptr}), Error);
}

}  // namespace
}  // namespace spillway
