// Note [Streamed weights]: the reference model computing from a weight streamer's slots,
// on the host backend with a throttled link: a training step (forward, then backward
// re-streaming the layers, the updated weights packed for the next step) and an inference
// pass give the resident model's losses, gradients and parameters to the bit, and the
// streamer moved what its schedule says.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>

#include "spillway/core/error.hpp"
#include "spillway/nn/nn.hpp"
#include "spillway/stream/weight_streamer.hpp"
#include "spillway/train/train.hpp"

namespace spillway::nn {
namespace {

std::vector<int32_t> tokens(uint32_t seed, int batch, int seq) {
  std::mt19937 g(seed);
  std::vector<int32_t> t(static_cast<size_t>(batch * (seq + 1)));
  for (int32_t& v : t) v = static_cast<int32_t>(g() % 256);
  return t;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

struct TrainRun {
  std::vector<double> losses;
  std::vector<float> params, grads;
  WeightStreamTelemetry tel;
};

TrainRun train(const RefConfig& c, bool streamed, int depth) {
  HostDeviceOptions o;
  o.device_bytes = int64_t{96} << 20;
  o.h2d_gbps = 2.0;  // slow enough that compute waits for some copies
  auto dev = make_host_device(o);
  Model m(c, *dev, 7);
  std::unique_ptr<WeightStreamer> ws;
  if (streamed) {
    WeightStreamOptions so;
    so.depth = depth;
    so.training = true;
    ws = std::make_unique<WeightStreamer>(*dev, m.compute_stream(), m.layer_weight_bytes(), so);
    m.stream_weights(ws.get());
  }
  TrainRun r;
  TrainingHooks none;
  train::TextbookAdamW adam(1e-3);
  for (int s = 0; s < 3; ++s)
    r.losses.push_back(m.step(tokens(40 + static_cast<uint32_t>(s), 2, 16), 2, 16, keep_policy(c),
                              none, adam.update())
                           .loss);
  r.params = m.parameters();
  r.grads = m.gradients();
  if (ws) r.tel = ws->telemetry();
  m.stream_weights(nullptr);
  return r;
}

TEST(StreamedReferenceModel, TrainingStepsAreBitwiseTheResidentOnes) {
  const RefConfig c = load_reference_config("tiny-moe");
  const TrainRun want = train(c, false, 1);
  for (int depth : {1, 2}) {
    SCOPED_TRACE(::testing::Message() << "depth " << depth);
    const TrainRun got = train(c, true, depth);
    ASSERT_EQ(got.losses, want.losses);
    EXPECT_TRUE(same_bits(got.grads, want.grads));
    EXPECT_TRUE(same_bits(got.params, want.params));
    // Per step: L forward loads and L - (depth + 1) backward ones; the turn's are hits.
    const int64_t L = c.layers();
    EXPECT_EQ(got.tel.loads, 3 * (L + std::max<int64_t>(0, L - (depth + 1))));
    EXPECT_EQ(got.tel.visits, 6 * L);
  }
}

TEST(StreamedReferenceModel, InferenceIsBitwiseTheResidentPass) {
  const RefConfig c = load_reference_config("tiny-moe");
  auto dev = make_host_device(HostDeviceOptions{int64_t{96} << 20, 0.0, 2.0});
  Model m(c, *dev, 11);
  std::vector<double> want, got;
  for (int s = 0; s < 2; ++s) want.push_back(m.forward_loss(tokens(7 + s, 2, 16), 2, 16));
  WeightStreamOptions so;
  so.depth = 1;
  WeightStreamer ws(*dev, m.compute_stream(), m.layer_weight_bytes(), so);
  m.stream_weights(&ws);
  for (int s = 0; s < 2; ++s) got.push_back(m.forward_loss(tokens(7 + s, 2, 16), 2, 16));
  EXPECT_EQ(got, want);
  EXPECT_EQ(ws.telemetry().visits, 2 * c.layers());
  m.stream_weights(nullptr);
}

WeightStreamOptions depth_one() {
  WeightStreamOptions o;
  o.depth = 1;
  return o;
}

// The tiny MoE model, its resident loss, then its weights streamed through a ring of two
// slots (which cannot hold the model: every pass loads every layer again).
struct StreamedTinyMoe {
  RefConfig c = load_reference_config("tiny-moe");
  std::unique_ptr<Device> dev = make_host_device(HostDeviceOptions{int64_t{96} << 20, 0.0, 0.0});
  Model m{c, *dev, 11};
  double resident = loss();
  WeightStreamer ws{*dev, m.compute_stream(), m.layer_weight_bytes(), depth_one()};
  StreamedTinyMoe() { m.stream_weights(&ws); }
  double loss() { return m.forward_loss(tokens(3, 2, 16), 2, 16); }
};

TEST(StreamedReferenceModel, TheLayersComputeFromTheSlotsNotTheirDeviceCopy) {
  // Weights in a host slab that differ from the model's own copy change the loss: the
  // layer read the slot.
  StreamedTinyMoe t;
  EXPECT_EQ(t.loss(), t.resident);
  auto* w = static_cast<float*>(t.ws.host_slab(1));
  for (size_t i = 0; i < t.m.layer_weight_bytes()[1] / 4; ++i) w[i] *= 0.5f;
  EXPECT_NE(t.loss(), t.resident);
  t.m.stream_weights(nullptr);
  EXPECT_EQ(t.loss(), t.resident);
}

TEST(StreamedReferenceModel, NoLayerWeightIsReadFromTheModelsOwnCopy) {
  // Every weight of every layer (attention, norms, router, each expert's matrices) comes
  // from the slot: with the model's own copy of the layers' weights poisoned after the
  // slabs were packed, the streamed pass still gives the resident loss, bitwise.
  StreamedTinyMoe t;
  int poisoned = 0;
  for (const NamedWeight& nw : t.m.named_weights()) {
    if (nw.spec.name.find("layers.") == std::string::npos) continue;
    // The host backend's device memory is host memory: the test writes it in place.
    auto* data = const_cast<float*>(nw.data);  // NOLINT(cppcoreguidelines-pro-type-const-cast)
    std::fill(data, data + nw.spec.elements(), std::numeric_limits<float>::quiet_NaN());
    ++poisoned;
  }
  ASSERT_GT(poisoned, 0);
  EXPECT_EQ(t.loss(), t.resident);
}

TEST(StreamedReferenceModel, ShardedRanksOnOneLinkComputeTheResidentResults) {
  // Note [Sharded streaming]: 2 and 3 emulated GPUs behind one throttled link, each packing
  // its shard of every layer and all-gathering the rest: inference passes (each rank its
  // own batch) and training steps (the same batch) give the resident model's losses and
  // parameters to the bit, with 1/N of the layer bytes copied per rank.
  const RefConfig c = load_reference_config("tiny-moe");
  const TrainRun want = train(c, false, 1);
  for (int n : {2, 3}) {
    for (bool training : {false, true}) {
      SCOPED_TRACE(::testing::Message() << n << " ranks, training " << training);
      auto link = std::make_shared<HostLink>(2.0, 2.0);
      std::vector<std::unique_ptr<Device>> devs;
      std::vector<Device*> raw;
      for (int i = 0; i < n; ++i) {
        HostDeviceOptions o;
        o.device_bytes = int64_t{96} << 20;
        o.link = link;
        devs.push_back(make_host_device(o));
        raw.push_back(devs.back().get());
      }
      std::vector<std::unique_ptr<AllGather>> group = make_host_all_gather(raw);
      std::vector<std::vector<double>> losses(static_cast<size_t>(n));
      std::vector<std::vector<float>> params(static_cast<size_t>(n));
      std::vector<WeightStreamTelemetry> tel(static_cast<size_t>(n));
      std::vector<char> shard_ok(static_cast<size_t>(n), 1);
      std::vector<std::thread> threads;
      threads.reserve(static_cast<size_t>(n));
      for (int i = 0; i < n; ++i)
        threads.emplace_back([&, i] {
          const auto u = static_cast<size_t>(i);
          Model m(c, *raw[u], training ? 7 : 11);
          WeightStreamOptions so;
          so.depth = 1;
          so.training = training;
          so.group = group[u].get();
          WeightStreamer ws(*raw[u], m.compute_stream(), m.layer_weight_bytes(), so);
          m.stream_weights(&ws);
          TrainingHooks none;
          train::TextbookAdamW adam(1e-3);
          for (int s = 0; s < 3; ++s) {
            if (training)
              losses[u].push_back(m.step(tokens(40 + static_cast<uint32_t>(s), 2, 16), 2, 16,
                                         keep_policy(c), none, adam.update())
                                      .loss);
            else
              losses[u].push_back(m.forward_loss(tokens(100 * i + s, 2, 16), 2, 16));
          }
          params[u] = m.parameters();
          tel[u] = ws.telemetry();
          // Each load copied this rank's shard: 1/N of the layer, rounded up to 256 bytes.
          for (int l = 0; l < c.layers(); ++l) {
            const LayerStreamStats& k = tel[u].layers[static_cast<size_t>(l)];
            const size_t shard = ws.host_slab_bytes(l);
            const size_t layer = m.layer_weight_bytes()[static_cast<size_t>(l)];
            shard_ok[u] = shard_ok[u] && k.loads > 0 &&
                          k.bytes == k.loads * static_cast<int64_t>(shard) &&
                          shard * static_cast<size_t>(n) >= layer &&
                          shard < layer / static_cast<size_t>(n) + 256;
          }
          m.stream_weights(nullptr);
        });
      for (std::thread& t : threads) t.join();
      auto dev = make_host_device(HostDeviceOptions{int64_t{96} << 20, 0.0, 0.0});
      Model resident(c, *dev, 11);
      for (int i = 0; i < n; ++i) {
        const auto u = static_cast<size_t>(i);
        if (training) {
          EXPECT_EQ(losses[u], want.losses) << "rank " << i;
          EXPECT_TRUE(same_bits(params[u], want.params)) << "rank " << i;
        } else {
          for (int s = 0; s < 3; ++s)
            EXPECT_EQ(losses[u][static_cast<size_t>(s)],
                      resident.forward_loss(tokens(100 * i + s, 2, 16), 2, 16))
                << "rank " << i << " pass " << s;
        }
        EXPECT_TRUE(shard_ok[u]) << "rank " << i;
      }
    }
  }
}

TEST(StreamedReferenceModel, AStreamerOfAnotherShapeIsRefused) {
  const RefConfig c = load_reference_config("tiny-moe");
  auto dev = make_host_device(HostDeviceOptions{int64_t{96} << 20, 0.0, 0.0});
  Model m(c, *dev, 1);
  std::vector<size_t> bytes = m.layer_weight_bytes();
  bytes.back() += 4;
  WeightStreamer ws(*dev, m.compute_stream(), bytes, {});
  try {
    m.stream_weights(&ws);
    FAIL() << "a streamer of other layer sizes was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("layer " + std::to_string(c.layers() - 1)),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace spillway::nn
