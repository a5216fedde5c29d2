// Stream mode choice: see spillway/plan/stream_mode.hpp.
//
// Note [Stream mode model]: a step is the visits of the streamer's schedule (forward
// layers 0..L-1; training adds backward L-1..0, whose first depth + 1 visits find their
// layers still in the ring: Note [Streaming across steps]). A visit that loads costs
//   max(compute, link time, gather time)
// and one that hits costs its compute: a layer's copy overlaps the computes before it,
// and what it does not hide is a stall. This per-visit bound is exact for depth 1 and
// uniform layers; with depth >= 2 the pipeline may borrow slack across uneven layers, so
// it is an upper bound on the stall there. Per mode, with B a layer's bytes, N the GPUs on
// the link, W its host->device bandwidth, P the per-GPU peer bandwidth:
//   full copy   link time N * B / W (every GPU pulls the whole layer through the shared link)
//   sharded     link time B / W (each pulls B / N), gather (N - 1) / N * B / P (a ring
//               all-gather's volume per GPU, on its own links)
//   in place    no copy: the layer's kernels read B over the GPU's share of the link,
//               time max(compute, N * B / W), and no ring in HBM
// The choice is the least step time among the modes that can run; ties go to the mode that
// uses less (in place: no ring; sharded: fewer link bytes). Full copy and sharded hold a
// ring of depth + 1 slots of the largest layer in HBM (sharded: each slot the whole layer
// once gathered); a ring larger than the HBM free for weights rules its mode out, and when
// no mode is left nothing is chosen: the caller reports why, in numbers.
#include "spillway/plan/stream_mode.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>

#include "spillway/core/error.hpp"

namespace spillway {

namespace {

struct Visit {
  int layer;
  double compute_ms;
  bool load;
};

std::vector<Visit> schedule(const StreamModeInput& in) {
  const int L = static_cast<int>(in.layer_bytes.size());
  std::vector<Visit> v;
  v.reserve(2 * in.layer_bytes.size());
  for (int l = 0; l < L; ++l) v.push_back({l, in.fwd_ms[static_cast<size_t>(l)], true});
  if (!in.bwd_ms.empty()) {
    for (int l = L - 1; l >= 0; --l) {
      // The turn: the last depth + 1 forward layers are still in the ring.
      const bool hit = l >= L - (in.depth + 1);
      v.push_back({l, in.bwd_ms[static_cast<size_t>(l)], !hit});
    }
  }
  return v;
}

}  // namespace

StreamModeChoice choose_stream_mode(const StreamModeInput& in) {
  const size_t L = in.layer_bytes.size();
  if (L == 0) SPILLWAY_FIELD_ERROR("layers", 0, "must be >= 1");
  if (in.fwd_ms.size() != L)
    SPILLWAY_FIELD_ERROR("fwd_ms", in.fwd_ms.size(), "must have one entry per layer ({})", L);
  if (!in.bwd_ms.empty() && in.bwd_ms.size() != L)
    SPILLWAY_FIELD_ERROR("bwd_ms", in.bwd_ms.size(), "must be empty or one per layer ({})", L);
  if (in.gpus_per_link < 1) SPILLWAY_FIELD_ERROR("gpus_per_link", in.gpus_per_link, "must be >= 1");
  if (!(in.link_h2d_gbps > 0.0))
    SPILLWAY_FIELD_ERROR("link_h2d_gbps", in.link_h2d_gbps, "must be > 0");
  if (in.peer_gbps < 0.0) SPILLWAY_FIELD_ERROR("peer_gbps", in.peer_gbps, "must be >= 0");
  if (in.depth < 1 || in.depth > 64) SPILLWAY_FIELD_ERROR("depth", in.depth, "must be in [1, 64]");
  const double N = in.gpus_per_link;
  const double W = in.link_h2d_gbps * 1e6;  // bytes per ms
  const double P = in.peer_gbps * 1e6;
  const std::vector<Visit> visits = schedule(in);
  StreamModeChoice c;
  c.weight_bytes = std::accumulate(in.layer_bytes.begin(), in.layer_bytes.end(), int64_t{0});
  for (const Visit& v : visits) c.compute_ms += v.compute_ms;
  c.weights_fit = c.weight_bytes <= in.hbm_free_bytes;
  const int64_t largest = *std::max_element(in.layer_bytes.begin(), in.layer_bytes.end());

  for (const char* mode : {"full-copy", "sharded", "in-place"}) {
    StreamModeEstimate e;
    e.mode = mode;
    const bool sharded = e.mode == "sharded";
    const bool in_place = e.mode == "in-place";
    if (sharded && in.gpus_per_link < 2) {
      e.available = false;
      e.why_not = "one GPU on the link: nothing to share";
    } else if (sharded && in.peer_gbps <= 0.0) {
      e.available = false;
      e.why_not = "no GPU-to-GPU path for the all-gather (--peer-gbps)";
    } else if (in_place && !in.c2c) {
      e.available = false;
      e.why_not = "the link is not coherent (kernels cannot read host memory at link speed)";
    }
    for (const Visit& v : visits) {
      const auto B = static_cast<double>(in.layer_bytes[static_cast<size_t>(v.layer)]);
      double t = v.compute_ms;
      if (in_place) {
        const double read = N * B / W;
        t = std::max(t, read);
        e.copy_ms += read;
        e.link_bytes += static_cast<int64_t>(N * B);
        e.gpu_bytes += static_cast<int64_t>(B);
      } else if (v.load) {
        const double link = sharded ? B / W : N * B / W;
        const double gather = sharded ? (N - 1.0) / N * B / P : 0.0;
        t = std::max({t, link, gather});
        e.copy_ms += link;
        e.gather_ms += gather;
        ++e.loads;
        e.link_bytes += static_cast<int64_t>(sharded ? B : N * B);
        e.gpu_bytes += static_cast<int64_t>(sharded ? B / N : B);
      }
      e.step_ms += t;
    }
    e.stall_ms = e.step_ms - c.compute_ms;
    e.slot_bytes = in_place ? 0 : (in.depth + 1) * largest;
    if (e.available && !in_place && in.hbm_free_bytes >= 0 && e.slot_bytes > in.hbm_free_bytes) {
      e.available = false;
      const int64_t slots = in.hbm_free_bytes / largest;
      e.why_not = fmt::format(
          "its ring of {} slots of the largest layer ({:.1f} MB) is {:.2f} GB, more than the "
          "{:.2f} GB of HBM free for weights; {}",
          in.depth + 1, static_cast<double>(largest) / 1e6, static_cast<double>(e.slot_bytes) / 1e9,
          static_cast<double>(in.hbm_free_bytes) / 1e9,
          slots >= 2 ? fmt::format("a prefetch depth of {} or less fits", slots - 1)
                     : std::string("not even a depth of 1 (two slots) fits"));
    }
    c.modes.push_back(e);
  }
  // The least step time; ties (within 0.1%) to the later mode in this order, which uses
  // less: full copy, sharded (fewer link bytes), in place (no ring).
  const StreamModeEstimate* best = nullptr;
  for (const StreamModeEstimate& e : c.modes) {
    if (!e.available) continue;
    if (best == nullptr || e.step_ms <= best->step_ms * 1.001) best = &e;
  }
  if (best == nullptr) return c;  // no mode fits: chosen stays empty
  c.chosen = best->mode;
  if (c.weights_fit) {
    c.warnings.push_back(fmt::format(
        "the weights ({:.2f} GB) fit in the {:.2f} GB of HBM free for them: streaming only "
        "costs time ({:.2f} ms per step against {:.2f} ms resident)",
        static_cast<double>(c.weight_bytes) / 1e9, static_cast<double>(in.hbm_free_bytes) / 1e9,
        best->step_ms, c.compute_ms));
  }
  if (best->stall_ms > 0.05 * c.compute_ms) {
    c.warnings.push_back(fmt::format(
        "the link cannot hide the copies: {:.2f} ms of stalls per step ({:.0f}% over compute)",
        best->stall_ms, 100.0 * best->stall_ms / std::max(c.compute_ms, 1e-9)));
  }
  return c;
}

std::string explain_stream_mode(const StreamModeChoice& c, const StreamModeInput& in) {
  std::string s;
  s += fmt::format(
      "weights {:.2f} GB in {} layers (largest {:.1f} MB); {} GPU(s) on one host link of "
      "{:.1f} GB/s host->device{}; peer {:.1f} GB/s per GPU; depth {}\n",
      static_cast<double>(c.weight_bytes) / 1e9, in.layer_bytes.size(),
      static_cast<double>(*std::max_element(in.layer_bytes.begin(), in.layer_bytes.end())) / 1e6,
      in.gpus_per_link, in.link_h2d_gbps, in.c2c ? " (coherent, C2C)" : "", in.peer_gbps, in.depth);
  s += fmt::format("compute per step (all weights resident): {:.2f} ms ({})\n", c.compute_ms,
                   in.bwd_ms.empty() ? "forward" : "forward and backward");
  s += fmt::format("{:<10} {:>10} {:>10} {:>10} {:>10} {:>12} {:>12} {:>10}\n", "mode", "step ms",
                   "stall ms", "link ms", "gather ms", "link GB", "per GPU GB", "ring MB");
  for (const StreamModeEstimate& e : c.modes) {
    if (!e.available) {
      s += fmt::format("{:<10} not available: {}\n", e.mode, e.why_not);
      continue;
    }
    s += fmt::format(
        "{:<10} {:>10.2f} {:>10.2f} {:>10.2f} {:>10.2f} {:>12.3f} {:>12.3f} {:>10.1f}{}\n", e.mode,
        e.step_ms, e.stall_ms, e.copy_ms, e.gather_ms, static_cast<double>(e.link_bytes) / 1e9,
        static_cast<double>(e.gpu_bytes) / 1e9, static_cast<double>(e.slot_bytes) / 1e6,
        e.mode == c.chosen ? "  <- chosen" : "");
  }
  s += "per load: full copy N*B/W on the link; sharded B/W on the link and (N-1)/N*B/P gathering; "
       "in place reads N*B/W while computing (Note [Stream mode model])\n";
  if (c.chosen.empty()) s += "no mode can run here: every one is ruled out above\n";
  for (const std::string& w : c.warnings) s += "warning: " + w + "\n";
  return s;
}

}  // namespace spillway
