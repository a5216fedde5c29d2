// Choosing how to stream a model's weights (docs/stream.md): every GPU copies whole
// layers over the host link (full copy), the GPUs behind one link each copy 1/N and
// all-gather (sharded), or, on a coherent link (NVLink-C2C), kernels read the pinned host
// weights in place. Pure arithmetic over per-layer bytes and compute times, with the
// numbers kept so that `spillway stream --explain` shows why (Note [Stream mode model]).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace spillway {

struct StreamModeInput {
  std::vector<int64_t> layer_bytes;  // each layer's weights on one GPU
  std::vector<double> fwd_ms;        // each layer's forward compute
  std::vector<double> bwd_ms;        // training: each layer's backward (empty: inference)
  int gpus_per_link = 1;             // GPUs streaming through one host link
  double link_h2d_gbps = 0.0;        // the link's host->device capacity, all its GPUs
  double peer_gbps = 0.0;            // per GPU, to its peers (NVLink, PCIe P2P); 0: none
  bool c2c = false;                  // coherent link: kernels may read host memory in place
  int64_t hbm_free_bytes = -1;       // device memory the weights could use (< 0: unknown,
                                     // the ring's fit is not checked)
  int depth = 2;                     // layers copied ahead
};

struct StreamModeEstimate {
  std::string mode;  // "full-copy", "sharded", "in-place"
  bool available = true;
  std::string why_not;
  double step_ms = 0.0;    // per step (forward, or forward and backward)
  double stall_ms = 0.0;   // step_ms - compute
  double copy_ms = 0.0;    // the link's busy time per step
  double gather_ms = 0.0;  // all-gathers per step (sharded)
  int64_t loads = 0;       // layer loads per step
  int64_t link_bytes = 0;  // host->device bytes per step over the link, all its GPUs
  int64_t gpu_bytes = 0;   // of which one GPU's
  int64_t slot_bytes = 0;  // HBM the ring takes (depth + 1 slots)
};

struct StreamModeChoice {
  std::vector<StreamModeEstimate> modes;  // full-copy, sharded, in-place
  std::string chosen;       // among the available modes; empty when none is (see their why_not)
  double compute_ms = 0.0;  // all weights resident: compute only
  int64_t weight_bytes = 0;
  bool weights_fit = false;  // weight_bytes <= hbm_free_bytes: streaming only costs time
  std::vector<std::string> warnings;
};

// A mode whose ring (depth + 1 slots of the largest layer) does not fit in hbm_free_bytes is
// not available, its why_not in numbers; when no mode is, `chosen` is empty.
StreamModeChoice choose_stream_mode(const StreamModeInput& in);
std::string explain_stream_mode(const StreamModeChoice& choice, const StreamModeInput& in);

}  // namespace spillway
