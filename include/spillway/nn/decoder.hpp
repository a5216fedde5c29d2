// The reference model in inference mode (the runtime of docs/serve.md): prefill in chunks and
// decode with a KV cache in device memory, the weights read through a WeightSource (a
// serving runtime's: HybridGEMM over host-resident weights; or the model's own, in memory),
// continuous batching of several sequences in one step.
//
// Note [Decoder steps]: a step takes at most one chunk per sequence (a prefill chunk of a
// prompt, or the one token a decoding sequence feeds back) and runs every layer once over
// all their rows: the norms, projections, MLPs and experts over the rows of all chunks
// together (one weight GEMM per weight and step, whatever the number of sequences), the
// attention per chunk against its own sequence's cache. It returns the logits of each
// chunk's last token (what greedy decoding or sampling reads). Every buffer, the KV cache
// included, is allocated once from the device at construction: a step allocates nothing.
//
// Note [Served outputs]: the decoder's logits are the reference model's forward
// (Model::forward_logits) on the same weights and tokens, up to the summation order of the
// GEMMs (HybridGEMM's tiles, or BLAS on other row counts; Note [HybridGEMM arithmetic]):
// tests hold |served - reference| <= 1e-4 * max(1, max |reference|) per position, for every
// alpha and chunking, and the greedy tokens equal wherever the reference's top two logits
// are further apart than that.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "spillway/device/device.hpp"
#include "spillway/nn/nn.hpp"

namespace spillway::nn {

// What a Decoder reads its weights through: weight i is weight_specs(config)[i].
class WeightSource {
 public:
  WeightSource() = default;
  virtual ~WeightSource() = default;
  WeightSource(const WeightSource&) = delete;
  WeightSource& operator=(const WeightSource&) = delete;
  // The fp32 values of a weight that is not a Linear's (norms, the embedding table),
  // host-addressable, valid while the source lives.
  virtual const float* values(int weight) = 0;
  // y (n, out) = x (n, in) * W^T for the Linear weight `weight` (out, in); x and y are
  // device memory.
  virtual void linear(int weight, const float* x, float* y, int n, int in, int out) = 0;
};

// The weights of a model in memory (Model::named_weights(), or any fp32 tensors in that
// order), the GEMMs by the reference model's own op.
class MemoryWeights final : public WeightSource {
 public:
  explicit MemoryWeights(std::vector<const float*> weights) : w_(std::move(weights)) {}
  const float* values(int weight) override;
  void linear(int weight, const float* x, float* y, int n, int in, int out) override;

 private:
  std::vector<const float*> w_;
};

struct DecoderOptions {
  int max_sequences = 8;      // sequences with a KV cache at once
  int max_context = 512;      // tokens a sequence may hold (prompt and output)
  int max_step_tokens = 256;  // rows of one step, all chunks together
};

struct DecodeChunk {
  int sequence = 0;                 // 0 .. max_sequences - 1
  const int32_t* tokens = nullptr;  // appended at the sequence's length
  int n = 0;                        // >= 1
  // Note [Dynamic RoPE]: the sequence length whose frequencies a dynamic RoPE rotates this
  // chunk at (a prompt's chunks: the whole prompt's, as transformers' one prefill call
  // does); 0: the sequence's length after the chunk.
  int rope_length = 0;
};

class Decoder {
 public:
  // Allocates the KV cache, the Mamba-2 layers' states (Note [Decoder state] in
  // decoder.cpp) and every step buffer from `dev` (device_bytes_for(c, o) bytes); throws
  // naming the bytes when they do not fit. Attention or Mamba-2 mixers, MoE or dense MLPs.
  Decoder(const RefConfig& c, Device& dev, const DecoderOptions& o);
  ~Decoder();
  Decoder(const Decoder&) = delete;
  Decoder& operator=(const Decoder&) = delete;

  static int64_t device_bytes_for(const RefConfig& c, const DecoderOptions& o);
  const RefConfig& config() const;
  const DecoderOptions& options() const;

  // Note [Decoder steps]: appends each chunk's tokens to its sequence and writes the logits
  // of each chunk's last token to logits (count, vocab) (host-addressable memory). Checks
  // every chunk first (sequence in range and used once, tokens in the vocabulary, the
  // context and the step's rows not exceeded) and throws naming the field, changing nothing.
  void step(const DecodeChunk* chunks, int count, WeightSource& weights, float* logits);
  int length(int sequence) const;
  // The sequence starts again: length 0, its Mamba states zero. Call before a new sequence
  // takes the slot.
  void reset(int sequence);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace spillway::nn
