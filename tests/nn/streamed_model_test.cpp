// Note [Streamed weights]: the reference model computing from a weight streamer's slots,
// on the host backend with a throttled link: a training step (forward, then backward
// re-streaming the layers, the updated weights packed for the next step) and an inference
// pass give the resident model's losses, gradients and parameters to the bit, and the
// streamer moved what its schedule says.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "spillway/error.hpp"
#include "spillway/nn.hpp"
#include "spillway/stream.hpp"

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
  for (int s = 0; s < 3; ++s)
    r.losses.push_back(
        m.step(tokens(40 + static_cast<uint32_t>(s), 2, 16), 2, 16, keep_policy(c), none, 1e-3)
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
    EXPECT_EQ(got.tel.visits, 3 * 2 * L);
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

TEST(StreamedReferenceModel, TheLayersComputeFromTheSlotsNotTheirDeviceCopy) {
  // Weights in a host slab that differ from the model's own copy change the loss: the
  // layer read the slot.
  const RefConfig c = load_reference_config("tiny-moe");
  auto dev = make_host_device(HostDeviceOptions{int64_t{96} << 20, 0.0, 0.0});
  Model m(c, *dev, 11);
  const double resident = m.forward_loss(tokens(3, 2, 16), 2, 16);
  WeightStreamOptions so;
  so.depth = 1;
  WeightStreamer ws(*dev, m.compute_stream(), m.layer_weight_bytes(), so);
  m.stream_weights(&ws);
  const double same = m.forward_loss(tokens(3, 2, 16), 2, 16);
  EXPECT_EQ(same, resident);
  auto* w = static_cast<float*>(ws.host_slab(1));
  for (size_t i = 0; i < m.layer_weight_bytes()[1] / 4; ++i) w[i] *= 0.5f;
  // The next pass loads layer 1 again (the ring of 2 slots cannot hold the model).
  const double changed = m.forward_loss(tokens(3, 2, 16), 2, 16);
  EXPECT_NE(changed, resident);
  m.stream_weights(nullptr);
  EXPECT_EQ(m.forward_loss(tokens(3, 2, 16), 2, 16), resident);
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
