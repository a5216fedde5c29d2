// Weight streaming on CUDA devices (skips without them: none here). One GPU: the streamer's
// ring on the CUDA backend gives the host slabs' bytes in every slot it hands out. Two or
// more: sharded through NCCL's all-gather, one host thread per rank (NCCL's rule), every
// rank's slots hold the whole layers.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "spillway/device/device.hpp"
#include "spillway/stream/weight_streamer.hpp"

namespace spillway {
namespace {

int cuda_devices() {
  const CudaInfo info = cuda_info();
  return info.compiled ? info.devices : 0;
}

// Streams `layers` layers of distinct bytes for two steps; after each acquire the slot is
// copied back and compared with the layer.
void check_rank(Device& dev, AllGather* group, int layers, int* bad) {
  const Stream compute = dev.create_stream(StreamRole::kCompute);
  std::vector<size_t> bytes;
  for (int l = 0; l < layers; ++l) bytes.push_back(size_t{1} << (16 + l % 3));
  WeightStreamOptions o;
  o.depth = 2;
  o.group = group;
  {
    WeightStreamer ws(dev, compute, bytes, o);
    auto value = [](int l, size_t i) { return static_cast<unsigned char>((l * 29 + i) % 251); };
    for (int l = 0; l < layers; ++l) {
      auto* slab = static_cast<unsigned char*>(ws.host_slab(l));
      const size_t off = ws.host_slab_offset(l);
      for (size_t i = 0; i < ws.host_slab_bytes(l); ++i)
        slab[i] = off + i < bytes[static_cast<size_t>(l)] ? value(l, off + i) : 0;
    }
    std::vector<unsigned char> back(ws.slot_bytes());
    for (int step = 0; step < 2; ++step) {
      for (int l = 0; l < layers; ++l) {
        const void* slot = ws.acquire(l);
        dev.copy_async(back.data(), slot, bytes[static_cast<size_t>(l)], compute);
        dev.synchronize(compute);
        for (size_t i = 0; i < bytes[static_cast<size_t>(l)]; ++i)
          if (back[i] != value(l, i)) {
            ++*bad;
            break;
          }
        ws.release(l);
      }
      ws.step_end();
    }
  }
  dev.destroy_stream(compute);
}

TEST(WeightStreamerCuda, SlotsHoldTheHostSlabsBytes) {
  if (cuda_devices() < 1) GTEST_SKIP() << "no CUDA device";
  std::string why;
  auto dev = make_cuda_device(0, &why);
  ASSERT_TRUE(dev) << why;
  int bad = 0;
  check_rank(*dev, nullptr, 7, &bad);
  EXPECT_EQ(bad, 0);
}

TEST(WeightStreamerCuda, ShardedThroughNcclEveryRankGetsWholeLayers) {
  if (cuda_devices() < 2) GTEST_SKIP() << "fewer than 2 CUDA devices";
  const int ranks = cuda_devices();
  std::vector<std::unique_ptr<Device>> devs;
  std::vector<Device*> raw;
  std::string why;
  for (int r = 0; r < ranks; ++r) {
    devs.push_back(make_cuda_device(r, &why));
    ASSERT_TRUE(devs.back()) << why;
    raw.push_back(devs.back().get());
  }
  auto group = make_nccl_all_gather(raw, &why);
  ASSERT_EQ(static_cast<int>(group.size()), ranks) << why;
  std::vector<int> bad(static_cast<size_t>(ranks), 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      check_rank(*devs[static_cast<size_t>(r)], group[static_cast<size_t>(r)].get(), 7,
                 &bad[static_cast<size_t>(r)]);
    });
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < ranks; ++r) EXPECT_EQ(bad[static_cast<size_t>(r)], 0) << "rank " << r;
}

TEST(WeightStreamerCuda, WithoutCudaDevicesNcclSaysWhy) {
  auto host = make_host_device(HostDeviceOptions{});
  std::string why;
  EXPECT_TRUE(make_nccl_all_gather({host.get()}, &why).empty());
  EXPECT_FALSE(why.empty());
}

}  // namespace
}  // namespace spillway
