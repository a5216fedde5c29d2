// spillway as a library, from its installed headers and package alone: (a) a buffer the
// caller allocated on the device goes to pinned host memory through the activation
// offload engine, which only borrows it, and comes back bitwise into another buffer the
// caller allocated; (b) the CPU AdamW steps the caller's arrays,
// checked to the bit against the update written out below and against its thread pool.
// Runs on the host backend (an emulated GPU): no GPU needed. Exits 1 on any mismatch.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <random>
#include <spillway/core/policy.hpp>
#include <spillway/device/device.hpp>
#include <spillway/offload/offload.hpp>
#include <spillway/optim/optim.hpp>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using spillway::Device;
using spillway::MemoryKind;
using spillway::Stream;

int failures = 0;

void check(bool ok, const char* what) {
  std::printf("%s: %s\n", ok ? "ok  " : "FAIL", what);
  if (!ok) ++failures;
}

// Device memory the caller allocated and owns.
class DeviceBuffer {
 public:
  DeviceBuffer(Device& dev, size_t bytes) : dev_(dev), bytes_(bytes) {
    const spillway::AllocResult a = dev.allocate(bytes, MemoryKind::kDevice);
    if (!a) throw std::runtime_error("device allocation failed: " + a.reason);
    ptr_ = a.ptr;
  }
  ~DeviceBuffer() { dev_.free(ptr_, MemoryKind::kDevice); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }

 private:
  Device& dev_;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// The engine's part, kept in one place: one training step in which `buf` (its bytes
// already enqueued on `compute`) is offloaded as layer 0's "mlp.act" and reloaded in
// backward. The caller owns both buffers (Note [Saved tensor ownership] in
// spillway/device/hooks.hpp): offload_borrowed() copies from `buf` and returns the event after
// which `buf` may be reused (overwritten here, to prove it), and reload_into() fills
// `dst`, which the caller allocated. Returns dst's bytes, read back to the host.
std::vector<unsigned char> offload_and_reload(spillway::OffloadEngine& engine, Device& dev,
                                              Stream compute, DeviceBuffer& buf, DeviceBuffer& dst,
                                              spillway::StepTelemetry* telemetry) {
  const size_t bytes = buf.bytes();
  engine.begin_step();
  // Forward: layer 0 saves the tensor, layer 1 (kept by the policy) saves nothing.
  const spillway::BorrowedOffload off = engine.offload_borrowed(buf.get(), bytes, 0, "mlp.act");
  check(!off.kept, "the pinned pool had room: the tensor went to the host");
  // The source is the caller's again once its copy has read it: reuse it at once.
  dev.wait(compute, off.copied);
  std::vector<unsigned char> junk(bytes, 0xA5);
  dev.copy_async(buf.get(), junk.data(), bytes, compute);
  engine.end_forward_layer(0);
  engine.end_forward_layer(1);
  // Backward: layer 1, then layer 0 needs its tensor back, in the caller's `dst`.
  engine.prefetch(0);
  engine.reload_into(off.handle, dst.get());
  std::vector<unsigned char> host(bytes);
  dev.copy_async(host.data(), dst.get(), bytes, compute);
  dev.synchronize(compute);
  *telemetry = engine.end_step();
  return host;
}

void offload_round_trip() {
  std::unique_ptr<Device> dev = spillway::make_host_device(spillway::HostDeviceOptions{
      int64_t{64} << 20, /*d2h_gbps=*/4.0, /*h2d_gbps=*/4.0});  // throttled like a PCIe link
  const Stream compute = dev->create_stream(spillway::StreamRole::kCompute);

  // (layers) 0 offloads "mlp.act", the last layer keeps everything.
  const spillway::MemoryPolicy policy = spillway::MemoryPolicy::uniform(2, {"mlp.act"});
  spillway::OffloadOptions options;
  options.pinned_bytes = int64_t{16} << 20;
  options.device_pool_bytes = int64_t{16} << 20;
  spillway::OffloadEngine engine(*dev, compute, policy, options);
  check(engine.wants(0, "mlp.act") && !engine.wants(1, "mlp.act"),
        "uniform policy: layer 0 offloads mlp.act, layer 1 keeps it");

  // (bytes) an odd size, filled with a pattern in stream order on the compute stream.
  const size_t bytes = (size_t{3} << 20) + 13;
  std::vector<unsigned char> pattern(bytes);
  std::mt19937 rng(2024);
  for (unsigned char& b : pattern) b = static_cast<unsigned char>(rng());
  DeviceBuffer buf(*dev, bytes);
  dev->copy_async(buf.get(), pattern.data(), bytes, compute);
  DeviceBuffer dst(*dev, bytes);  // poisoned: an unwritten byte fails the comparison
  std::vector<unsigned char> poison(bytes);
  for (size_t i = 0; i < bytes; ++i) poison[i] = static_cast<unsigned char>(~pattern[i]);
  dev->copy_async(dst.get(), poison.data(), bytes, compute);

  spillway::StepTelemetry t;
  const std::vector<unsigned char> back = offload_and_reload(engine, *dev, compute, buf, dst, &t);
  check(back.size() == bytes && std::memcmp(back.data(), pattern.data(), bytes) == 0,
        "offloaded and reloaded bytes equal the pattern bitwise");
  check(t.tensors_offloaded == 1 && t.d2h_bytes == static_cast<int64_t>(bytes) &&
            t.h2d_bytes == static_cast<int64_t>(bytes),
        "telemetry: one tensor, its bytes down and up");
}

// The update of include/spillway/optim/optim.hpp, written out: the per-step scalars in double
// rounded to float, then each line in that order, every operation rounded on its own.
void reference_adamw(const spillway::optim::AdamWParams& hp, int64_t step, float* p, float* m,
                     float* v, const float* g, size_t n) {
  const double bc1 = 1.0 - std::pow(hp.beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(hp.beta2, static_cast<double>(step));
  const auto step_size = static_cast<float>(hp.lr / bc1);
  const auto inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  const auto decay = static_cast<float>(1.0 - hp.lr * hp.weight_decay);
  const auto b1 = static_cast<float>(hp.beta1);
  const auto one_minus_b1 = static_cast<float>(1.0 - hp.beta1);
  const auto b2 = static_cast<float>(hp.beta2);
  const auto one_minus_b2 = static_cast<float>(1.0 - hp.beta2);
  const auto eps = static_cast<float>(hp.eps);
  for (size_t i = 0; i < n; ++i) {
    const float pi = p[i] * decay;
    m[i] = b1 * m[i] + one_minus_b1 * g[i];
    v[i] = b2 * v[i] + one_minus_b2 * (g[i] * g[i]);
    const float denom = std::sqrt(v[i]) * inv_sqrt_bc2 + eps;
    p[i] = pi - step_size * (m[i] / denom);
  }
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

void adamw_steps() {
  namespace optim = spillway::optim;
  const uint32_t seed = 7;
  std::printf("adamw seed %u\n", seed);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);

  // (n) fp32 each, the caller's; n spans several of the pool's tiles and a SIMD tail.
  const size_t n = size_t{40000} + 7;
  std::vector<float> p(n), m(n, 0.0f), v(n, 0.0f), g(n);
  for (float& x : p) x = u(rng);
  std::vector<float> ref_p = p, ref_m = m, ref_v = v;
  std::vector<float> pool_p = p, pool_m = m, pool_v = v;
  std::vector<uint16_t> pool_bf16(n, 0xFFFF);  // poisoned: an unwritten element shows

  optim::AdamWParams hp;
  hp.lr = 1e-2;
  hp.weight_decay = 0.1;
  optim::AdamW pool(2);
  bool scalar_ok = true;
  bool pool_ok = true;
  bool copy_ok = true;
  for (int64_t step = 1; step <= 5; ++step) {
    for (float& x : g) x = u(rng);
    optim::AdamWArgs a;
    a.p = p.data();
    a.m = m.data();
    a.v = v.data();
    a.g = g.data();
    a.n = n;
    a.step = step;
    optim::adamw_step_scalar(hp, a);

    optim::AdamWArgs b = a;
    b.p = pool_p.data();
    b.m = pool_m.data();
    b.v = pool_v.data();
    b.copy_out = pool_bf16.data();
    b.copy_type = optim::CopyType::kBf16;
    pool.step(hp, b);

    reference_adamw(hp, step, ref_p.data(), ref_m.data(), ref_v.data(), g.data(), n);
    scalar_ok = scalar_ok && same_bits(p, ref_p) && same_bits(m, ref_m) && same_bits(v, ref_v);
    pool_ok = pool_ok && same_bits(pool_p, p) && same_bits(pool_m, m) && same_bits(pool_v, v);
    for (size_t i = 0; i < n; ++i) copy_ok = copy_ok && pool_bf16[i] == optim::float_to_bf16(p[i]);
  }
  check(scalar_ok, "adamw_step_scalar equals the written-out update bitwise (5 steps)");
  check(pool_ok, "AdamW pool (SIMD, 2 threads) equals adamw_step_scalar bitwise");
  check(copy_ok, "AdamW pool's bf16 copy is the updated weights rounded");
  std::printf("adamw SIMD target %s\n", optim::adamw_simd_target());
}

}  // namespace

int main() {
  try {
    offload_round_trip();
    adamw_steps();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FAIL: %s\n", e.what());
    return 1;
  }
  if (failures > 0) {
    std::fprintf(stderr, "FAIL: %d check(s) failed\n", failures);
    return 1;
  }
  std::printf("all checks passed\n");
  return 0;
}
