// The live serving engine (spillway/inference/inference.hpp): checkpoints written and checked,
// served greedy completions equal to the reference model's (Note [Served outputs]), completions
// that depend only on their request whatever the slices, alpha or batching (Note [Served
// determinism]), overload refused loudly with nothing lost, drain, cancel, and the metrics.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <thread>

#include "inference/pooled_weights.hpp"
#include "inference/served_models.hpp"
#include "spillway/catalog/hardware.hpp"
#include "spillway/core/error.hpp"
#include "spillway/device/device_math.hpp"
#include "spillway/inference/inference.hpp"
#include "spillway/nn/decoder.hpp"
#include "spillway/nn/nn.hpp"
#include "spillway/serve/serve.hpp"
#include "spillway/serve/slices.hpp"
#include "test_support.hpp"

namespace spillway::inference {
namespace {

using testing::bytes;
using testing::complete;
using testing::fast;
using testing::models;
using testing::Models;
using testing::request;

namespace fs = std::filesystem;
using spillway::testing::TempDir;

TEST(Checkpoints, WrittenFoundAndChecked) {
  const Models& m = models();
  ASSERT_EQ(m.files.size(), 2u);
  EXPECT_EQ(m.files[0].name, "tiny-a");
  const nn::RefConfig c = nn::load_reference_config(m.files[0].config_path);
  EXPECT_NO_THROW(check_checkpoint("tiny-a", c, m.files[0].weights_path));
  // Its tensors are the reference model's weights, to the bit, each weight from the tensors
  // it resolves to (Note [Written checkpoints]: q, k and v apart, side by side).
  auto dev = make_host_device(HostDeviceOptions{int64_t{64} << 20, 0.0, 0.0});
  nn::Model ref(c, *dev, 1);
  SafetensorsFile st(m.files[0].weights_path);
  const ResolvedWeights parts = resolve_checkpoint("tiny-a", c, st);
  const std::vector<nn::NamedWeight> named = ref.named_weights();
  ASSERT_EQ(parts.size(), named.size());
  for (size_t i = 0; i < named.size(); ++i) {
    const nn::NamedWeight& w = named[i];
    std::vector<std::byte> bytes;
    for (const WeightPart& part : parts[i]) {
      ASSERT_EQ(part.rows, 0) << w.spec.name;  // whole tensors
      const SafetensorsTensor* t = st.find(part.tensor);
      ASSERT_NE(t, nullptr) << part.tensor;
      bytes.insert(bytes.end(), st.data(*t), st.data(*t) + t->bytes);
    }
    ASSERT_EQ(bytes.size(), static_cast<size_t>(w.spec.elements()) * 4) << w.spec.name;
    ASSERT_EQ(0, std::memcmp(bytes.data(), w.data, bytes.size())) << w.spec.name;
  }
  // A checkpoint of another config: the first missing tensor and the shape named.
  TempDir other;
  write_checkpoint("small-moe", 1, (other.path() / "small").string(), DType::kBf16);
  spillway::testing::expect_error(
      [&] { check_checkpoint("x", c, (other.path() / "small" / "model.safetensors").string()); },
      {"model x", "shape"});
  // A directory with a config and no weights; an empty directory.
  TempDir broken;
  fs::create_directories(broken.path() / "m");
  fs::copy_file(m.files[0].config_path, broken.path() / "m" / "config.json");
  spillway::testing::expect_error([&] { find_models(broken.path().string()); },
                                  {"no model.safetensors"});
  TempDir empty;
  spillway::testing::expect_error([&] { find_models(empty.path().string()); }, {"holds no model"});
}

// The reference model's greedy continuation, with the margin of each choice (its top two
// logits' gap) and the tolerance of Note [Served outputs] there.
struct Greedy {
  std::vector<int32_t> tokens;
  std::vector<float> margin, tol;
};
Greedy reference_greedy(const nn::RefConfig& c, uint64_t seed, std::vector<int32_t> seq, int n) {
  auto dev = make_host_device(HostDeviceOptions{int64_t{256} << 20, 0.0, 0.0});
  nn::Model ref(c, *dev, seed);
  Greedy g;
  for (int t = 0; t < n; ++t) {
    const std::vector<float> logits = ref.forward_logits(seq, 1, static_cast<int>(seq.size()));
    const float* last = logits.data() + (seq.size() - 1) * static_cast<size_t>(c.vocab);
    std::vector<float> row(last, last + c.vocab);
    const int best = static_cast<int>(std::max_element(row.begin(), row.end()) - row.begin());
    float top = 1.0f, second = -INFINITY;
    for (int v = 0; v < c.vocab; ++v) {
      top = std::max(top, std::fabs(row[v]));
      if (v != best) second = std::max(second, row[v]);
    }
    g.tokens.push_back(best);
    g.margin.push_back(row[best] - second);
    g.tol.push_back(1e-4f * top);
    seq.push_back(best);
  }
  return g;
}

TEST(PooledWeights, LogitsDoNotDependOnTheBatchOrAlphaToTheBit) {
  // Note [Served determinism] at its root: the decoder over the pool through HybridGEMM's
  // invariant form gives a sequence's logits to the bit whether it runs alone at alpha 0 or
  // batched with two others while alpha moves every step.
  const Models& m = models();
  const nn::RefConfig c = nn::load_reference_config(m.files[0].config_path);
  const SliceSetup setup = mig_slices(load_hardware("gh200"), "7g.96gb", 1.0, 1e-3);
  auto link = std::make_shared<HostLink>(setup.link_gbps, setup.link_gbps);
  EmulatedSlice slice(setup.slices[0], link);
  auto pool_dev = make_host_device(HostDeviceOptions{int64_t{1} << 20, 0.0, 0.0});
  ModelPool pool(*pool_dev, ModelPoolOptions{int64_t{1} << 30});
  pool.add("a", m.files[0].weights_path);
  PoolAcquire a = pool.acquire("a");
  ASSERT_EQ(a.status, PoolStatus::kOk);
  const SafetensorsFile st(m.files[0].weights_path);
  PooledWeights w(a.handle, c, slice, resolve_checkpoint("a", c, st), 32);
  nn::DecoderOptions o;
  o.max_sequences = 3;
  o.max_context = 48;
  o.max_step_tokens = 32;
  const std::vector<std::vector<int32_t>> seqs = {bytes("the first sequence"), bytes("second"),
                                                  bytes("and a third one")};
  const int V = c.vocab;
  // Alone, alpha 0: a prefill of 5, then one token at a time.
  std::vector<std::vector<float>> alone;
  for (const std::vector<int32_t>& sq : seqs) {
    nn::Decoder dec(c, slice.device(), o);
    std::vector<float> l(static_cast<size_t>(V));
    w.begin_iteration(0.0);
    nn::DecodeChunk ch{0, sq.data(), 5};
    dec.step(&ch, 1, w, l.data());
    alone.push_back(l);
    for (size_t t = 5; t < sq.size(); ++t) {
      ch = {0, sq.data() + t, 1};
      dec.step(&ch, 1, w, l.data());
      alone.push_back(l);
    }
  }
  nn::Decoder dec(c, slice.device(), o);
  std::vector<std::vector<std::vector<float>>> got(seqs.size());
  std::vector<size_t> pos(seqs.size(), 0);
  std::vector<float> l(static_cast<size_t>(3 * V));
  const double alphas[] = {0.37, 1.0, 0.0, 0.81, 0.5};
  for (int step = 0;; ++step) {
    std::vector<nn::DecodeChunk> chunks;
    std::vector<size_t> who;
    for (size_t q = 0; q < seqs.size(); ++q) {
      if (pos[q] >= seqs[q].size()) continue;
      const int take = pos[q] == 0 ? 5 : 1;
      chunks.push_back({static_cast<int>(q), seqs[q].data() + pos[q], take});
      who.push_back(q);
      pos[q] += static_cast<size_t>(take);
    }
    if (chunks.empty()) break;
    w.begin_iteration(alphas[step % 5]);
    dec.step(chunks.data(), static_cast<int>(chunks.size()), w, l.data());
    for (size_t i = 0; i < who.size(); ++i)
      got[who[i]].emplace_back(l.begin() + static_cast<long>(i) * V,
                               l.begin() + static_cast<long>(i + 1) * V);
  }
  size_t k = 0;
  for (size_t q = 0; q < seqs.size(); ++q)
    for (size_t i = 0; i < got[q].size(); ++i, ++k)
      EXPECT_EQ(0, std::memcmp(got[q][i].data(), alone[k].data(), static_cast<size_t>(V) * 4))
          << "sequence " << q << " step " << i;
  EXPECT_EQ(k, alone.size());
}

// Served greedy tokens equal the reference's up to the first position where its own choice
// is within the tolerance of a tie; there must be none on the tests' prompts and models.
void expect_reference_greedy(const std::vector<int32_t>& got, const Greedy& ref) {
  ASSERT_EQ(got.size(), ref.tokens.size());
  size_t compared = 0;
  for (; compared < got.size() && ref.margin[compared] > 2 * ref.tol[compared]; ++compared)
    EXPECT_EQ(got[compared], ref.tokens[compared]) << "token " << compared;
  EXPECT_EQ(compared, got.size());
}

TEST(ServingEngine, GreedyCompletionsAreTheReferenceModels) {
  const Models& m = models();
  const nn::RefConfig c = nn::load_reference_config(m.files[0].config_path);
  const std::string prompt = "host-resident serving, ";
  const int n = 24;
  const Greedy ref = reference_greedy(c, 1, bytes(prompt), n);
  for (double alpha : {0.0, 0.5, 1.0, -1.0}) {
    SCOPED_TRACE(::testing::Message() << "alpha " << alpha);
    ServingEngine e(m.files, fast("1g.12gb", alpha));
    expect_reference_greedy(complete(e, request("tiny-a", prompt, n)), ref);
  }
}

TEST(ServingEngine, Bf16CheckpointsServeTheirRoundedWeights) {
  // A bf16 checkpoint is the fp32 one rounded to nearest even: served greedy, it continues
  // as the decoder over the rounded weights in memory does (the reference op's GEMMs).
  TempDir dir;
  write_checkpoint("tiny-moe", 5, (dir.path() / "half").string(), DType::kBf16);
  const std::vector<ModelFiles> files = find_models(dir.path().string());
  const nn::RefConfig c = nn::load_reference_config(files[0].config_path);
  auto dev = make_host_device(HostDeviceOptions{int64_t{256} << 20, 0.0, 0.0});
  nn::Model ref(c, *dev, 5);
  std::vector<std::vector<float>> rounded;
  std::vector<const float*> ptrs;
  for (const nn::NamedWeight& w : ref.named_weights()) {
    std::vector<float> r(static_cast<size_t>(w.spec.elements()));
    for (size_t i = 0; i < r.size(); ++i) r[i] = bf16_to_float(float_to_bf16(w.data[i]));
    rounded.push_back(std::move(r));
    ptrs.push_back(rounded.back().data());
  }
  nn::MemoryWeights mw(ptrs);
  nn::DecoderOptions o;
  o.max_sequences = 1;
  o.max_context = 64;
  nn::Decoder dec(c, *dev, o);
  const std::vector<int32_t> prompt = bytes("bf16 weights");
  std::vector<float> logits(static_cast<size_t>(c.vocab));
  nn::DecodeChunk ch{0, prompt.data(), static_cast<int>(prompt.size())};
  std::vector<int32_t> want;
  std::vector<bool> clear;  // the choice is not within Note [Served outputs]' tolerance of a tie
  int32_t tok = 0;
  for (int t = 0; t < 16; ++t) {
    dec.step(&ch, 1, mw, logits.data());
    tok = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    float top = 1.0f, second = -INFINITY;
    for (int v = 0; v < c.vocab; ++v) {
      top = std::max(top, std::fabs(logits[static_cast<size_t>(v)]));
      if (v != tok) second = std::max(second, logits[static_cast<size_t>(v)]);
    }
    clear.push_back(logits[static_cast<size_t>(tok)] - second > 2e-4f * top);
    want.push_back(tok);
    ch = {0, &tok, 1};
  }
  ServingEngine e(files, fast("1g.12gb", 0.5));
  EXPECT_EQ(e.models().front().dtype, DType::kBf16);
  const std::vector<int32_t> got = complete(e, request("half", "bf16 weights", 16));
  ASSERT_EQ(got.size(), want.size());
  size_t compared = 0;
  for (; compared < want.size() && clear[compared]; ++compared)
    EXPECT_EQ(got[compared], want[compared]) << "token " << compared;
  EXPECT_EQ(compared, want.size());  // no near-tie on this prompt and model
}

// The tensors of a safetensors file, as entries to write again (edited).
std::vector<SafetensorsEntry> entries_of(const std::string& path) {
  const SafetensorsFile f(path);
  std::vector<SafetensorsEntry> out;
  for (const SafetensorsTensor& t : f.tensors()) {
    SafetensorsEntry e;
    e.name = t.name;
    e.dtype = t.dtype;
    e.shape = t.shape;
    e.bytes.assign(f.data(t), f.data(t) + t.bytes);
    out.push_back(std::move(e));
  }
  return out;
}

TEST(Checkpoints, HuggingFacesSplitQkvAndTiedHeadAreResolvedAndExtrasRefused) {
  // Note [Written checkpoints]: tiny-a as spillway checkpoint writes it, q, k, v apart as
  // Hugging Face stores them, resolved as three parts; and rewritten as spillway wrote them
  // before, q, k, v fused (self_attn.qkv_proj): read as one tensor, and served as the
  // reference model continues (both reading paths).
  const Models& m = models();
  const nn::RefConfig c = nn::load_reference_config(m.files[0].config_path);
  {
    const SafetensorsFile written(m.files[0].weights_path);
    EXPECT_EQ(written.find("model.layers.0.self_attn.qkv_proj.weight"), nullptr);
    EXPECT_EQ(resolve_checkpoint("tiny-a", c, written)[2],
              (std::vector<WeightPart>{{"model.layers.0.self_attn.q_proj.weight"},
                                       {"model.layers.0.self_attn.k_proj.weight"},
                                       {"model.layers.0.self_attn.v_proj.weight"}}));
  }
  TempDir dir;
  const fs::path split = dir.path() / "split";  // the fused (older) form, under its old name
  fs::create_directories(split);
  fs::copy_file(m.files[0].config_path, split / "config.json");
  std::vector<SafetensorsEntry> es;
  std::vector<SafetensorsEntry> qkv;
  for (SafetensorsEntry& e : entries_of(m.files[0].weights_path)) {
    const bool proj = e.name.find("self_attn.q_proj.") != std::string::npos ||
                      e.name.find("self_attn.k_proj.") != std::string::npos ||
                      e.name.find("self_attn.v_proj.") != std::string::npos;
    if (!proj) {
      es.push_back(std::move(e));
      continue;
    }
    qkv.push_back(std::move(e));
    if (qkv.size() < 3) continue;
    // Fused as q, k, v (the rows of the reference model's projection).
    const auto of = [&](const char* proj) -> const SafetensorsEntry& {
      for (const SafetensorsEntry& x : qkv)
        if (x.name.find(proj) != std::string::npos) return x;
      throw std::runtime_error(std::string("no ") + proj);
    };
    qkv = {of(".q_proj."), of(".k_proj."), of(".v_proj.")};
    SafetensorsEntry fused;
    fused.name = qkv[0].name.substr(0, qkv[0].name.find("q_proj.")) + "qkv_proj.weight";
    fused.dtype = qkv[0].dtype;
    fused.shape = {qkv[0].shape[0] + qkv[1].shape[0] + qkv[2].shape[0], qkv[0].shape[1]};
    for (const SafetensorsEntry& part : qkv)
      fused.bytes.insert(fused.bytes.end(), part.bytes.begin(), part.bytes.end());
    es.push_back(std::move(fused));
    qkv.clear();
  }
  write_safetensors((split / "model.safetensors").string(), es);
  const SafetensorsFile sf((split / "model.safetensors").string());
  const ResolvedWeights parts = resolve_checkpoint("split", c, sf);
  EXPECT_EQ(parts[2], (std::vector<WeightPart>{{"model.layers.0.self_attn.qkv_proj.weight"}}));
  const std::string prompt = "split heads";
  const Greedy ref = reference_greedy(c, 1, bytes(prompt), 12);
  ServingEngine e({{"split", split.string(), (split / "config.json").string(),
                    (split / "model.safetensors").string()}},
                  fast("7g.96gb", 0.5));
  const std::vector<int32_t> got = complete(e, request("split", prompt, 12));
  for (size_t t = 0; t < got.size() && ref.margin[t] > 2 * ref.tol[t]; ++t)
    EXPECT_EQ(got[t], ref.tokens[t]) << "token " << t;
  // A tensor the decoder would ignore is refused, named.
  std::vector<SafetensorsEntry> extra = entries_of(m.files[0].weights_path);
  SafetensorsEntry bias;
  bias.name = "model.layers.0.mlp.down_proj.bias";
  bias.shape = {c.hidden};
  bias.bytes.assign(static_cast<size_t>(c.hidden) * 4, std::byte{0});
  extra.push_back(bias);
  write_safetensors((dir.path() / "extra.safetensors").string(), extra);
  spillway::testing::expect_error(
      [&] { check_checkpoint("x", c, (dir.path() / "extra.safetensors").string()); },
      {"model x", "down_proj.bias", "no use"});
  // Note [Served attention extras]: a qwen3_moe file with q norms is served with q/k norms,
  // so a missing k_norm is named.
  extra.pop_back();
  extra.erase(std::remove_if(extra.begin(), extra.end(),
                             [](const SafetensorsEntry& x) {
                               return x.name == "model.layers.0.self_attn.k_norm.weight";
                             }),
              extra.end());
  write_safetensors((dir.path() / "extra.safetensors").string(), extra);
  spillway::testing::expect_error(
      [&] { check_checkpoint("x", c, (dir.path() / "extra.safetensors").string()); },
      {"model x", "has no tensor model.layers.0.self_attn.k_norm.weight"});
  // No lm_head: refused unless the config ties the embeddings (tiny-moe does not).
  std::vector<SafetensorsEntry> headless = entries_of(m.files[0].weights_path);
  headless.erase(
      std::remove_if(headless.begin(), headless.end(),
                     [](const SafetensorsEntry& x) { return x.name == "lm_head.weight"; }),
      headless.end());
  write_safetensors((dir.path() / "headless.safetensors").string(), headless);
  spillway::testing::expect_error(
      [&] { check_checkpoint("x", c, (dir.path() / "headless.safetensors").string()); },
      {"lm_head.weight"});
  nn::RefConfig tied = c;
  tied.model.tied_embeddings = true;
  const SafetensorsFile hf((dir.path() / "headless.safetensors").string());
  EXPECT_EQ(resolve_checkpoint("x", tied, hf).back(),
            std::vector<WeightPart>{{"model.embed_tokens.weight"}});
  // A config the decoder would compute differently (MLP biases); RoPE scaling is read with
  // the config instead (Note [RoPE scaling]; tests/nn/rope_scaling_test.cpp).
  EXPECT_NO_THROW(check_servable_config("x", R"({"rope_scaling": {"rope_type": "llama3"}})"));
  spillway::testing::expect_error(
      [&] { check_servable_config("x", R"({"quantization_config": {"quant_method": "fp8"}})"); },
      {"quantization_config", "quant_method \"fp8\""});
  spillway::testing::expect_error([&] { check_servable_config("x", R"({"mlp_bias": true})"); },
                                  {"mlp_bias"});
  EXPECT_NO_THROW(check_servable_config("x", R"({"attention_bias": true})"));  // served
  EXPECT_NO_THROW(check_servable_config("x", R"({"rope_scaling": null})"));
}

// Note [Checkpoint resolution]: transformers 5's fused experts (each MoE layer's experts in
// mlp.experts.gate_up_proj (experts, 2 ffn, hidden), gate rows then up rows, and
// mlp.experts.down_proj (experts, hidden, ffn)) are read as rows of those tensors, served as
// the per-expert checkpoint is; a fused tensor with another expert count is refused, named.
TEST(Checkpoints, FusedExpertsAreReadAsRowsOfOneTensor) {
  const Models& m = models();
  const nn::RefConfig c = nn::load_reference_config(m.files[0].config_path);
  TempDir dir;
  const fs::path fused = dir.path() / "fused";
  fs::create_directories(fused);
  fs::copy_file(m.files[0].config_path, fused / "config.json");
  std::map<std::string, SafetensorsEntry> by_name;
  for (SafetensorsEntry& e : entries_of(m.files[0].weights_path)) by_name[e.name] = std::move(e);
  std::vector<SafetensorsEntry> es;
  int64_t ffn = 0, experts = 0;
  for (int l = 0; l < c.layers(); ++l) {
    const MlpSpec& mlp = c.model.layers[static_cast<size_t>(l)].mlp;
    if (mlp.kind != MlpKind::kMoe) continue;
    ffn = mlp.ffn;
    experts = mlp.experts;
    const std::string p = fmt::format("model.layers.{}.mlp.experts.", l);
    SafetensorsEntry gate_up{p + "gate_up_proj", DType::kFp32, {experts, 2 * ffn, c.hidden}, {}};
    SafetensorsEntry down{p + "down_proj", DType::kFp32, {experts, c.hidden, ffn}, {}};
    for (int64_t e = 0; e < experts; ++e) {
      for (const char* proj : {"gate_proj", "up_proj", "down_proj"}) {
        const std::string name = fmt::format("{}{}.{}.weight", p, e, proj);
        std::vector<std::byte>& b = by_name.at(name).bytes;
        std::vector<std::byte>& into = proj[0] == 'd' ? down.bytes : gate_up.bytes;
        into.insert(into.end(), b.begin(), b.end());
        by_name.erase(name);
      }
    }
    es.push_back(std::move(gate_up));
    es.push_back(std::move(down));
  }
  ASSERT_GT(experts, 1);
  for (auto& [name, e] : by_name) es.push_back(std::move(e));
  write_safetensors((fused / "model.safetensors").string(), es);
  const SafetensorsFile sf((fused / "model.safetensors").string());
  const ResolvedWeights parts = resolve_checkpoint("fused", c, sf);
  const std::vector<nn::WeightSpec> specs = nn::weight_specs(c);
  for (size_t i = 0; i < specs.size(); ++i) {
    if (specs[i].name == "model.layers.1.mlp.experts.3.up_proj.weight") {
      EXPECT_EQ(parts[i], (std::vector<WeightPart>{{"model.layers.1.mlp.experts.gate_up_proj",
                                                    3 * 2 * ffn + ffn, ffn}}));
    }
    if (specs[i].name == "model.layers.1.mlp.experts.2.down_proj.weight") {
      EXPECT_EQ(parts[i], (std::vector<WeightPart>{
                              {"model.layers.1.mlp.experts.down_proj", 2 * c.hidden, c.hidden}}));
    }
  }
  const std::string prompt = "fused experts";
  const Greedy ref = reference_greedy(c, 1, bytes(prompt), 12);
  {
    ServingEngine e({{"fused", fused.string(), (fused / "config.json").string(),
                      (fused / "model.safetensors").string()}},
                    fast("7g.96gb", 0.5));
    const std::vector<int32_t> got = complete(e, request("fused", prompt, 12));
    size_t compared = 0;
    for (; compared < got.size() && ref.margin[compared] > 2 * ref.tol[compared]; ++compared)
      EXPECT_EQ(got[compared], ref.tokens[compared]) << "token " << compared;
    EXPECT_GT(compared, 0u);
  }
  // One expert short in layer 1: refused, naming the tensor and both shapes.
  for (SafetensorsEntry& e : es) {
    if (e.name != "model.layers.1.mlp.experts.down_proj") continue;
    e.shape[0] -= 1;
    e.bytes.resize(e.bytes.size() / static_cast<size_t>(experts) *
                   static_cast<size_t>(experts - 1));
  }
  write_safetensors((fused / "model.safetensors").string(), es);
  spillway::testing::expect_error(
      [&] { check_checkpoint("fused", c, (fused / "model.safetensors").string()); },
      {"model.layers.1.mlp.experts.down_proj",
       fmt::format("[{}, {}, {}]", experts - 1, c.hidden, ffn),
       fmt::format("needs [{}, {}, {}]", experts, c.hidden, ffn)});
}

TEST(ServingEngine, AHybridMambaModelIsServedAsTheReferenceDecodesIt) {
  // tiny-hybrid: Mamba-2 and attention layers, their states carried from chunk to chunk
  // (Note [Decoder state]); greedy as the reference model's forward, token for token.
  TempDir dir;
  write_checkpoint("tiny-hybrid", 3, (dir.path() / "hybrid").string(), DType::kFp32);
  const std::vector<ModelFiles> files = find_models(dir.path().string());
  const nn::RefConfig c = nn::load_reference_config(files[0].config_path);
  const std::string prompt = "a state space model, served: ";
  const int n = 12;
  const Greedy ref = reference_greedy(c, 3, bytes(prompt), n);
  EngineOptions o = fast("1g.12gb", -1.0);
  ServingEngine e(files, o);
  expect_reference_greedy(complete(e, request("hybrid", prompt, n)), ref);
}

TEST(ServingEngine, ACompletionDependsOnlyOnItsRequest) {
  // Note [Served determinism]: alone on one whole GPU with alpha 0, or among eleven others
  // on seven slices with the controller moving alpha: the same tokens, greedy and sampled.
  const Models& m = models();
  std::vector<CompletionRequest> reqs;
  for (int i = 0; i < 12; ++i)
    reqs.push_back(request(i % 2 ? "tiny-a" : "tiny-b", "prompt number " + std::to_string(i * 7),
                           8 + i % 5, i % 3 == 0 ? 0.0 : 0.8, 1000 + static_cast<uint64_t>(i)));
  std::vector<std::vector<int32_t>> alone;
  {
    ServingEngine e(m.files, fast("7g.96gb", 0.0));
    ASSERT_EQ(e.slices(), 1);
    for (const CompletionRequest& q : reqs) alone.push_back(complete(e, q));
  }
  ServingEngine e(m.files, fast("1g.12gb", -1.0));
  ASSERT_EQ(e.slices(), 7);
  std::vector<std::vector<int32_t>> together(reqs.size());
  std::vector<std::thread> clients;
  for (size_t i = 0; i < reqs.size(); ++i)
    clients.emplace_back([&, i] { together[i] = complete(e, reqs[i]); });
  for (std::thread& t : clients) t.join();
  for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(together[i], alone[i]) << "request " << i;
  // Sampling follows the seed: another seed, another completion (here).
  CompletionRequest other = reqs[1];
  other.seed += 1;
  EXPECT_NE(complete(e, other), alone[1]);
  const EngineMetrics mt = e.metrics();
  EXPECT_EQ(mt.requests.at("ok"), 13);
  EXPECT_GE(mt.switches + mt.cold_loads, 2);
}

TEST(ServingEngine, ASliceServesModelsOfTwoArchitecturesInTurn) {
  // One slice, tiny-moe and small-moe alternately: the slice rebuilds its decoder for each
  // architecture (and reuses it for models of the same one); each completion is what the
  // model gives when it is the only one served.
  TempDir dir;
  write_checkpoint("tiny-moe", 1, (dir.path() / "tiny").string(), DType::kFp32);
  write_checkpoint("small-moe", 1, (dir.path() / "small").string(), DType::kBf16);
  const std::vector<ModelFiles> both = find_models(dir.path().string());
  ASSERT_EQ(both.size(), 2u);
  std::vector<std::vector<int32_t>> alone;
  for (const ModelFiles& f : both) {
    ServingEngine e({f}, fast("7g.96gb", 0.0));
    alone.push_back(complete(e, request(f.name, "turn by turn", 6)));
  }
  ServingEngine e(both, fast("7g.96gb", 0.0));
  for (int round = 0; round < 2; ++round)
    for (size_t i = 0; i < both.size(); ++i)
      EXPECT_EQ(complete(e, request(both[i].name, "turn by turn", 6)), alone[i])
          << both[i].name << " round " << round;
  EXPECT_EQ(e.metrics().switches + e.metrics().cold_loads, 4);
}

TEST(ServingEngine, StopSequencesEndTheOutputBeforeThemAndHoldNothingBack) {
  // Note [Stop sequences]: the output ends before a stop sequence's first occurrence; a
  // sequence that begins to match and then does not costs nothing: its held tokens come out.
  const Models& m = models();
  ServingEngine e(m.files, fast("7g.96gb", 0.0));
  const CompletionRequest base = request("tiny-b", "stop sequences", 16);
  const std::vector<int32_t> all = complete(e, base);
  ASSERT_EQ(all.size(), 16u);
  size_t at = 0;
  while (!(all[at] == all[7] && all[at + 1] == all[8] && all[at + 2] == all[9])) ++at;
  CompletionRequest q = base;
  q.stop = {{all[7], all[8], all[9]}};
  SubmitResult r = e.submit(q);
  ASSERT_EQ(r.status, SubmitStatus::kAccepted);
  std::vector<int32_t> got;
  while (r.completion->wait_tokens(got.size(), &got) == Completion::State::kRunning) {
  }
  EXPECT_EQ(got, std::vector<int32_t>(all.begin(), all.begin() + static_cast<long>(at)));
  EXPECT_EQ(r.completion->finish_reason(), "stop");
  // A sequence whose start comes (token 3) but not the rest: everything, "length".
  q.stop = {{all[3], (all[4] + 1) % 256, 7}, {(all[0] + 5) % 256}};
  for (size_t i = 0; i < all.size(); ++i) ASSERT_NE(all[i], q.stop[1][0]) << "pick another";
  EXPECT_EQ(complete(e, q), all);
  // Bad stops are refused naming the field.
  for (const auto& bad : std::vector<std::vector<std::vector<int32_t>>>{
           {{1}, {2}, {3}, {4}, {5}}, {{}}, {{1, 300}}, {std::vector<int32_t>(65, 1)}}) {
    q.stop = bad;
    const SubmitResult x = e.submit(q);
    EXPECT_EQ(x.status, SubmitStatus::kInvalid) << x.message;
    EXPECT_EQ(x.field, "stop");
  }
}

// Note [Logprobs]: each token's log-probability and the k most likely (sorted, the greedy
// choice first and equal to its own), the same with a stop sequence holding tokens back and
// in a streaming read; logprobs outside [0, 20] refused naming the field.
TEST(ServingEngine, LogprobsComeWithTheirTokensHeldOrNot) {
  const Models& m = models();
  ServingEngine e(m.files, fast("7g.96gb", 0.0));
  CompletionRequest q = request("tiny-a", "log probabilities", 12);
  q.logprobs = 4;
  const SubmitResult r = e.submit(q);
  ASSERT_EQ(r.status, SubmitStatus::kAccepted);
  std::vector<int32_t> all;
  std::vector<TokenLogprobs> streamed;
  while (r.completion->wait_tokens(all.size(), &all) == Completion::State::kRunning) {
    const std::vector<TokenLogprobs> more = r.completion->logprobs(streamed.size(), all.size());
    streamed.insert(streamed.end(), more.begin(), more.end());
  }
  const std::vector<TokenLogprobs> lps = r.completion->logprobs(0, all.size());
  ASSERT_EQ(lps.size(), all.size());
  for (size_t t = 0; t < all.size(); ++t) {
    ASSERT_EQ(lps[t].top.size(), 4u);
    EXPECT_EQ(lps[t].top[0].first, all[t]) << t;  // greedy: the most likely
    EXPECT_EQ(lps[t].top[0].second, lps[t].logprob) << t;
    double mass = 0;
    for (size_t i = 0; i < 4; ++i) {
      mass += std::exp(lps[t].top[i].second);
      EXPECT_LE(lps[t].top[i].second, 0.0f);
      if (i > 0) {
        EXPECT_GE(lps[t].top[i - 1].second, lps[t].top[i].second);
      }
    }
    EXPECT_LE(mass, 1.0 + 1e-6);
    if (t < streamed.size()) {
      EXPECT_EQ(streamed[t].top, lps[t].top);
    }
  }
  // A stop sequence (tokens 6, 7): tokens held back keep their logprobs.
  CompletionRequest stopped = q;
  stopped.stop = {{all[6], all[7]}};
  size_t at = 0;
  while (!(all[at] == all[6] && all[at + 1] == all[7])) ++at;
  const SubmitResult s = e.submit(stopped);
  ASSERT_EQ(s.status, SubmitStatus::kAccepted);
  std::vector<int32_t> got;
  while (s.completion->wait_tokens(got.size(), &got) == Completion::State::kRunning) {
  }
  ASSERT_EQ(got.size(), at);
  const std::vector<TokenLogprobs> held = s.completion->logprobs(0, got.size());
  ASSERT_EQ(held.size(), at);
  for (size_t t = 0; t < at; ++t) {
    EXPECT_EQ(held[t].logprob, lps[t].logprob) << t;
    EXPECT_EQ(held[t].top, lps[t].top) << t;
  }
  // Without logprobs: none kept.
  const SubmitResult plain = e.submit(request("tiny-a", "log probabilities", 4));
  std::vector<int32_t> p;
  while (plain.completion->wait_tokens(p.size(), &p) == Completion::State::kRunning) {
  }
  EXPECT_TRUE(plain.completion->logprobs(0, p.size()).empty());
  for (int bad : {-2, 21}) {
    q.logprobs = bad;
    const SubmitResult x = e.submit(q);
    EXPECT_EQ(x.status, SubmitStatus::kInvalid) << bad;
    EXPECT_EQ(x.field, "logprobs");
  }
}

// Note [Sampling]: a nucleus of one token is the greedy choice at any temperature; top_p 1 is
// plain sampling (the same draws for the same seed); top_p outside (0, 1] is refused.
TEST(ServingEngine, TopPKeepsTheMostLikelyTokens) {
  const Models& m = models();
  ServingEngine e(m.files, fast("7g.96gb", 0.0));
  const std::vector<int32_t> greedy = complete(e, request("tiny-a", "nucleus", 10));
  CompletionRequest q = request("tiny-a", "nucleus", 10);
  q.temperature = 1.5;
  q.seed = 11;
  q.top_p = 1e-9;
  EXPECT_EQ(complete(e, q), greedy);
  q.top_p = 1.0;
  const std::vector<int32_t> plain = complete(e, q);
  EXPECT_EQ(complete(e, q), plain);
  EXPECT_NE(plain, greedy);  // a temperature of 1.5 over 10 tokens strays
  q.top_p = 0.9;
  EXPECT_EQ(complete(e, q), complete(e, q));  // seeded: the same draws
  for (double bad : {0.0, 1.5, -1.0}) {
    q.top_p = bad;
    const SubmitResult x = e.submit(q);
    EXPECT_EQ(x.status, SubmitStatus::kInvalid) << bad;
    EXPECT_EQ(x.field, "top_p");
  }
}

TEST(ServingEngine, ChunksThatDoNotFitAStepWaitAndChangeNothing) {
  // Steps of 8 rows, chunks of at most 4, four prompts of 20 tokens at once: not every
  // prefill chunk fits every step; those left wait for the next, and each completion is
  // still what it is alone.
  const Models& m = models();
  EngineOptions o = fast("7g.96gb", 0.0);
  o.max_step_tokens = 8;
  std::vector<CompletionRequest> reqs;
  for (int i = 0; i < 4; ++i)
    reqs.push_back(request("tiny-a", std::string(20, static_cast<char>('a' + i)), 6));
  std::vector<std::vector<int32_t>> alone;
  {
    ServingEngine e(m.files, o);
    for (const CompletionRequest& q : reqs) alone.push_back(complete(e, q));
  }
  ServingEngine e(m.files, o);
  std::vector<std::shared_ptr<Completion>> cs;
  for (const CompletionRequest& q : reqs) cs.push_back(e.submit(q).completion);
  for (size_t i = 0; i < cs.size(); ++i) {
    ASSERT_NE(cs[i], nullptr);
    std::vector<int32_t> got;
    while (cs[i]->wait_tokens(got.size(), &got) == Completion::State::kRunning) {
    }
    EXPECT_EQ(got, alone[i]) << "request " << i;
  }
}

TEST(ServingEngine, BadRequestsAreRefusedNamingTheField) {
  const Models& m = models();
  ServingEngine e(m.files, fast());
  auto refused = [&](CompletionRequest q, SubmitStatus st, const std::string& field,
                     const std::string& needle) {
    const SubmitResult r = e.submit(q);
    EXPECT_EQ(r.status, st) << r.message;
    EXPECT_EQ(r.field, field);
    EXPECT_NE(r.message.find(needle), std::string::npos) << r.message;
    EXPECT_EQ(r.completion, nullptr);
  };
  refused(request("nope", "x", 4), SubmitStatus::kUnknownModel, "model", "tiny-a, tiny-b");
  refused(request("tiny-a", "", 4), SubmitStatus::kInvalid, "prompt", "at least one");
  CompletionRequest q = request("tiny-a", "x", 4);
  q.prompt = {1, 300};
  refused(q, SubmitStatus::kInvalid, "prompt", "token 300 at position 1");
  refused(request("tiny-a", "x", 0), SubmitStatus::kInvalid, "max_tokens", ">= 1");
  refused(request("tiny-a", std::string(90, 'x'), 10), SubmitStatus::kInvalid, "max_tokens",
          "at most 6 for this prompt");
  refused(request("tiny-a", "x", 4, -1.0), SubmitStatus::kInvalid, "temperature", ">= 0");
  EXPECT_EQ(e.in_flight(), 0);
  EXPECT_EQ(e.metrics().requests.at("invalid"), 5);
}

TEST(ServingEngine, OverloadIsRefusedLoudlyAndNothingAcceptedIsLost) {
  const Models& m = models();
  EngineOptions o = fast("7g.96gb", 0.0);  // one slice
  o.rate_scale = 1e-4;                     // slow: the queue fills
  o.max_running = 2;
  o.max_waiting = 3;
  ServingEngine e(m.files, o);
  std::vector<std::shared_ptr<Completion>> accepted;
  int overloaded = 0;
  for (int i = 0; i < 20; ++i) {
    const SubmitResult r =
        e.submit(request(i % 2 ? "tiny-a" : "tiny-b", "load " + std::to_string(i), 4));
    if (r.status == SubmitStatus::kAccepted) {
      accepted.push_back(r.completion);
    } else {
      EXPECT_EQ(r.status, SubmitStatus::kOverloaded);
      EXPECT_NE(r.message.find("max_waiting 3"), std::string::npos) << r.message;
      ++overloaded;
    }
  }
  EXPECT_GT(overloaded, 0);
  e.drain();  // every accepted one ends
  for (const auto& c : accepted) {
    EXPECT_EQ(c->state(), Completion::State::kDone);
    std::vector<int32_t> t;
    EXPECT_EQ(c->wait_tokens(0, &t), Completion::State::kDone);
    EXPECT_EQ(t.size(), 4u);
  }
  const EngineMetrics mt = e.metrics();
  EXPECT_EQ(mt.requests.at("ok"), static_cast<int64_t>(accepted.size()));
  EXPECT_EQ(mt.requests.at("overloaded"), overloaded);
  // Draining: refused, loudly.
  const SubmitResult late = e.submit(request("tiny-a", "late", 2));
  EXPECT_EQ(late.status, SubmitStatus::kDraining);
}

TEST(ServingEngine, ACancelledRequestStopsAndFreesItsPlace) {
  const Models& m = models();
  EngineOptions o = fast("7g.96gb", 0.0);
  o.rate_scale = 1e-4;
  ServingEngine e(m.files, o);
  SubmitResult r = e.submit(request("tiny-a", "cancel me", 60));
  ASSERT_EQ(r.status, SubmitStatus::kAccepted);
  std::vector<int32_t> t;
  r.completion->wait_tokens(0, &t);  // it runs
  r.completion->cancel();
  while (r.completion->wait_tokens(t.size(), &t) == Completion::State::kRunning) {
  }
  EXPECT_EQ(r.completion->state(), Completion::State::kCancelled);
  EXPECT_LT(t.size(), 60u);
  EXPECT_EQ(e.in_flight(), 0);
  EXPECT_EQ(e.metrics().requests.at("cancelled"), 1);
  // The slice serves the next one.
  EXPECT_EQ(complete(e, request("tiny-a", "next", 3)).size(), 3u);
}

TEST(ServingEngine, AModelThePoolCannotHoldBesideThoseInUseFailsLoudly) {
  const Models& m = models();
  EngineOptions o = fast("1g.12gb", 0.0);
  o.rate_scale = 1e-4;
  SafetensorsFile st(m.files[0].weights_path);
  o.host_budget_bytes = st.data_bytes() * 3 / 2;  // one model at a time
  ServingEngine e(m.files, o);
  SubmitResult a = e.submit(request("tiny-a", "holds the pool", 40));
  ASSERT_EQ(a.status, SubmitStatus::kAccepted);
  std::vector<int32_t> t;
  a.completion->wait_tokens(0, &t);  // tiny-a is in use
  SubmitResult b = e.submit(request("tiny-b", "needs room", 4));
  ASSERT_EQ(b.status, SubmitStatus::kAccepted);
  std::vector<int32_t> tb;
  while (b.completion->wait_tokens(tb.size(), &tb) == Completion::State::kRunning) {
  }
  EXPECT_EQ(b.completion->state(), Completion::State::kFailed);
  EXPECT_NE(b.completion->error().find("host memory"), std::string::npos) << b.completion->error();
  e.drain();
  EXPECT_EQ(a.completion->state(), Completion::State::kDone);
  EXPECT_EQ(e.metrics().requests.at("unavailable"), 1);
}

TEST(ServingEngine, MetricsInPrometheusText) {
  const Models& m = models();
  ServingEngine e(m.files, fast("7g.96gb", 0.5));
  for (int i = 0; i < 3; ++i) complete(e, request("tiny-a", "metrics", 5));
  const EngineMetrics mt = e.metrics();
  EXPECT_EQ(mt.tokens_generated, 15);
  EXPECT_EQ(mt.ttft_n, 3);
  EXPECT_EQ(mt.tpot_n, 3);
  EXPECT_EQ(mt.ttft_counts.back(), 3);
  EXPECT_GT(mt.link_utilization, 0.0);
  EXPECT_EQ(mt.slices.size(), 1u);
  EXPECT_DOUBLE_EQ(mt.slices[0].alpha, 0.5);
  EXPECT_GT(mt.slices[0].hbm_utilization, 0.0);
  const std::string text = prometheus_text(mt);
  for (const char* needle :
       {"spillway_ttft_seconds_bucket{le=\"+Inf\"} 3", "spillway_ttft_seconds_count 3",
        "spillway_tpot_seconds_count 3", "spillway_requests_total{outcome=\"ok\"} 3",
        "spillway_generated_tokens_total 15", "spillway_slice_alpha{slice=\"0\"} 0.5",
        "# TYPE spillway_link_utilization gauge", "spillway_model_switches_total",
        "spillway_slice_hbm_utilization{slice=\"0\"}"})
    EXPECT_NE(text.find(needle), std::string::npos) << needle << "\n" << text;
}

}  // namespace
}  // namespace spillway::inference
