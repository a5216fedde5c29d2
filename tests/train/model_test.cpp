// The reference model under every memory policy: bitwise-identical loss and gradients
// (Note [Saved tensors]), peak device memory against keep and recompute, clear errors when
// the device memory runs out, the loss falling, and the snowball under a slow link with
// auto avoiding it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "spillway/core/error.hpp"
#include "spillway/nn/nn.hpp"
#include "spillway/offload/offload.hpp"
#include "spillway/train/train.hpp"
#include "test_support.hpp"

namespace spillway::nn {
namespace {

using namespace spillway::train;  // NOLINT: the training application over this model

constexpr int kBatch = 2;
constexpr int kSeq = 32;

std::vector<int32_t> tokens(uint32_t seed, int batch = kBatch, int seq = kSeq) {
  std::mt19937 g(seed);
  std::vector<int32_t> t(static_cast<size_t>(batch * (seq + 1)));
  for (int32_t& v : t) v = static_cast<int32_t>(g() % 256);
  return t;
}

struct PolicyRun {
  std::vector<double> losses;
  std::vector<float> grads;
  std::vector<float> params;
  int64_t peak = 0;
  int64_t pool_bytes = 0;
  int64_t max_layer_offloaded = 0;
  StepTelemetry tel;
};

// Two training steps (the second from weights the first updated) under `p`.
PolicyRun run(const RefConfig& c, const MemoryPolicy& p, int64_t device_bytes = int64_t{64} << 20,
              int batch = kBatch, int seq = kSeq) {
  auto dev = make_host_device(HostDeviceOptions{device_bytes, 0.0, 0.0});
  Model m(c, *dev, 7);
  std::unique_ptr<OffloadEngine> engine;
  std::unique_ptr<OffloadHooks> hooks;
  TrainingHooks none;
  PolicyRun r;
  if (p.any_offload()) {
    int64_t total = 0;
    for (int l = 0; l < c.layers(); ++l) {
      const std::vector<std::string> names = saved_tensor_names(c, l);
      const std::vector<int64_t> bytes = m.saved_tensor_bytes(l, batch, seq);
      int64_t layer = 0;
      for (size_t i = 0; i < names.size(); ++i) {
        if (p.layers[static_cast<size_t>(l)].actions[i] != Action::kOffload) continue;
        layer += (bytes[i] + 255) / 256 * 256;
      }
      total += layer;
      r.max_layer_offloaded = std::max(r.max_layer_offloaded, layer);
    }
    OffloadOptions o;
    o.pinned_bytes = total + (int64_t{1} << 20);
    o.device_pool_bytes = (p.prefetch_depth + 1) * r.max_layer_offloaded + (int64_t{1} << 18);
    o.max_tensors = 128;
    o.inflight_bound_bytes = r.max_layer_offloaded;  // as the trainer sets it
    r.pool_bytes = o.device_pool_bytes;
    engine = std::make_unique<OffloadEngine>(*dev, m.compute_stream(), p, o);
    hooks = std::make_unique<OffloadHooks>(*engine);
  }
  train::TextbookAdamW adam(1e-3);
  for (int s = 0; s < 2; ++s) {
    const StepStats st = m.step(tokens(100 + static_cast<uint32_t>(s), batch, seq), batch, seq, p,
                                hooks ? static_cast<TrainingHooks&>(*hooks) : none, adam.update());
    r.losses.push_back(st.loss);
    r.peak = std::max(r.peak, st.peak_device_bytes);
    if (hooks) r.tel = hooks->telemetry();
  }
  r.grads = m.gradients();
  r.params = m.parameters();
  return r;
}

MemoryPolicy uniform(const RefConfig& c, Action a, const char* name) {
  MemoryPolicy p = keep_policy(c);
  p.name = name;
  for (LayerActions& la : p.layers) {
    std::vector<Action>& l = la.actions;
    for (size_t i = 1; i < l.size(); ++i) l[i] = a;  // the layer input stays
  }
  return p;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(ReferenceModel, LossAndGradientsAreBitwiseIdenticalUnderEveryPolicy) {
  const RefConfig c = load_reference_config("tiny-moe");
  const PolicyRun keep = run(c, keep_policy(c));
  ASSERT_TRUE(std::isfinite(keep.losses[0]));
  std::vector<MemoryPolicy> policies = {uniform(c, Action::kRecompute, "recompute-all"),
                                        uniform(c, Action::kOffload, "offload-all")};
  // Random mixes, the layer input included (kept or offloaded, never recomputed).
  const uint32_t seed = 2024;
  std::cout << "seed " << seed << "\n";
  std::mt19937 g(seed);
  for (int k = 0; k < 4; ++k) {
    MemoryPolicy p = keep_policy(c);
    p.name = "mix" + std::to_string(k);
    p.prefetch_depth = k % 3;
    for (LayerActions& la : p.layers) {
      std::vector<Action>& l = la.actions;
      for (size_t i = 0; i < l.size(); ++i) {
        const auto r = g() % 3;
        l[i] = r == 0 ? Action::kKeep : r == 1 ? Action::kOffload : Action::kRecompute;
        if (i == 0 && l[i] == Action::kRecompute) l[i] = Action::kOffload;
      }
    }
    policies.push_back(p);
  }
  for (const MemoryPolicy& p : policies) {
    SCOPED_TRACE(p.name);
    const PolicyRun r = run(c, p);
    EXPECT_EQ(r.losses, keep.losses);  // exact
    EXPECT_TRUE(same_bits(r.grads, keep.grads));
    EXPECT_TRUE(same_bits(r.params, keep.params));
    if (p.any_offload()) {
      EXPECT_GT(r.tel.d2h_bytes, 0);
      EXPECT_EQ(r.tel.d2h_bytes, r.tel.h2d_bytes);
    }
  }
}

TEST(ReferenceModel, RecomputeAndOffloadNeedLessDeviceMemoryThanKeep) {
  // 8 x 128 tokens: activations outweigh the parameters and optimizer states, as in
  // real training.
  const RefConfig c = load_reference_config("tiny-moe");
  const int64_t arena = int64_t{64} << 20;
  const PolicyRun keep = run(c, keep_policy(c), arena, 8, 128);
  const PolicyRun rec = run(c, uniform(c, Action::kRecompute, "recompute-all"), arena, 8, 128);
  MemoryPolicy off = uniform(c, Action::kRecompute, "offload-mlp");
  // As the planner's offload policy: the MLP tensors go to the host, the rest recomputes;
  // the last layer keeps its tensors (no window).
  for (int l = 0; l + 1 < c.layers(); ++l) {
    const std::vector<std::string> names = saved_tensor_names(c, l);
    for (size_t i = 0; i < names.size(); ++i) {
      if (names[i] == "mlp.gate_out" || names[i] == "mlp.up_out" || names[i] == "mlp.act")
        off.layers[static_cast<size_t>(l)].actions[i] = Action::kOffload;
    }
  }
  const PolicyRun o = run(c, off, arena, 8, 128);
  std::cout << "peak bytes: keep " << keep.peak << ", recompute " << rec.peak << ", offload "
            << o.peak << " (staging pool " << o.pool_bytes << ", largest layer offloaded "
            << o.max_layer_offloaded << ")\n";
  EXPECT_LT(rec.peak, keep.peak * 7 / 10);
  EXPECT_LT(o.peak, keep.peak * 85 / 100);
  // Offload holds at most one layer's offloaded bytes in flight beyond recompute, plus
  // the engine's reload staging (Note [Train offload sizing]).
  EXPECT_LE(o.peak - rec.peak, o.max_layer_offloaded + o.pool_bytes);
}

TEST(ReferenceModel, RunningOutOfDeviceMemoryNamesThePolicyAndTheBytes) {
  const RefConfig c = load_reference_config("tiny-moe");
  const PolicyRun keep = run(c, keep_policy(c));
  try {
    run(c, keep_policy(c), keep.peak - (int64_t{1} << 16));
    FAIL() << "expected an out-of-memory error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("policy keep"), std::string::npos) << m;
    EXPECT_NE(m.find("needed"), std::string::npos) << m;
    EXPECT_NE(m.find("device memory exhausted"), std::string::npos) << m;
  }
  // Too small even for the parameters: said as such.
  try {
    run(c, keep_policy(c), int64_t{1} << 20);
    FAIL() << "expected an out-of-memory error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("parameters"), std::string::npos) << e.what();
  }
}

TEST(ReferenceModel, PlansRefusingToRecomputeTheLayerInput) {
  const RefConfig c = load_reference_config("tiny-moe");
  Plan plan;
  for (int l = 0; l < c.layers(); ++l) {
    LayerPlan lp;
    lp.index = l;
    TensorPlan t;
    t.name = "attn.input";
    t.action = Action::kRecompute;
    lp.tensors.push_back(t);
    plan.layers.push_back(lp);
  }
  EXPECT_THROW(policy_from_plan(c, plan, "bad.json"), Error);
  plan.layers.pop_back();
  EXPECT_THROW(policy_from_plan(c, plan, "short.json"), Error);
}

TEST(ReferenceModel, ConfigErrorsNameTheField) {
  EXPECT_THROW(load_reference_config("/nonexistent/config.json"), Error);
  try {
    load_reference_config("/usr/share/common-licenses/GPL-3");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("JSON"), std::string::npos) << e.what();
  }
}

TrainOptions small(const std::string& policy) {
  TrainOptions o;
  o.policy = policy;
  o.steps = 3;
  o.micro_batch = kBatch;
  o.seq_len = kSeq;
  o.device_memory_mb = 64;
  return o;
}

// A config file of the families the catalog reads (written to `dir`).
std::string write_config(const std::filesystem::path& dir, const std::string& name,
                         const std::string& json) {
  const std::filesystem::path path = dir / (name + ".json");
  std::ofstream(path) << json;
  return path.string();
}

// Qwen3 (dense, per-head q/k norms) with tied embeddings, 2 layers.
constexpr char kQwen3Tied[] = R"({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
  "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
  "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": true,
  "attention_bias": false})";

// Central differences of forward_loss at the parameter of flat index i (h: the step) against
// the step's gradient: float forward, so a documented tolerance of 3% plus 2e-4.
void expect_gradient_matches_differences(Model& m, const std::vector<int32_t>& t, int64_t i,
                                         const char* what) {
  const std::vector<float> g = m.gradients();
  auto* w = const_cast<float*>(m.named_weights().front().data) + i;  // NOLINT: the test's probe
  const float w0 = *w;
  const float h = 1e-2f;
  *w = w0 + h;
  const double up = m.forward_loss(t, kBatch, kSeq);
  *w = w0 - h;
  const double down = m.forward_loss(t, kBatch, kSeq);
  *w = w0;
  const double fd = (up - down) / (2.0 * static_cast<double>(h));
  const double grad = g[static_cast<size_t>(i)];
  EXPECT_NEAR(fd, grad, 0.03 * std::abs(grad) + 2e-4) << what << " (parameter " << i << ")";
  EXPECT_GT(std::abs(grad), 1e-4) << what << ": a gradient too small to test";
}

// A config that ties its embeddings trains one matrix for the embedding and the LM head, and
// Qwen3's q/k norms are trained: the trained model has the parameters `spillway plan` counts
// for the config (the catalog's count, transformers'), is bitwise the same under every
// policy, and its gradients (the tied matrix's summed from both uses: Note [Tied
// embeddings]; the q/k norms': Note [Q/K norms]) are the loss's central differences (on the
// dense Qwen3, whose loss is smooth).
TEST(Train, TiedEmbeddingsAndQkNormsTrainTheModelTheConfigSays) {
  spillway::testing::TempDir dir;
  std::string moe = R"({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
    "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
    "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [0],
    "vocab_size": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
    "tie_word_embeddings": true, "attention_bias": false})";
  const std::string qwen3 = write_config(dir.path(), "qwen3-tied", kQwen3Tied);
  const std::string moe_tied = write_config(dir.path(), "tiny-moe-tied", moe);
  for (const std::string& model : {std::string("tiny-moe"), moe_tied, qwen3}) {
    SCOPED_TRACE(model);
    const RefConfig c = load_reference_config(model);
    EXPECT_TRUE(c.qk_norm);
    TrainOptions o = small("keep");
    o.model = model;
    o.steps = 1;
    EXPECT_EQ(train::run(o, nullptr).parameters, parameter_count(c.model));
  }
  // tiny-moe tied: one (256, 64) matrix fewer than tiny-moe.
  EXPECT_EQ(parameter_count(load_reference_config("tiny-moe").model) -
                parameter_count(load_reference_config(moe_tied).model),
            256 * 64);
  for (const std::string& model : {moe_tied, qwen3}) {
    SCOPED_TRACE(model);
    const RefConfig c = load_reference_config(model);
    const PolicyRun keep = run(c, keep_policy(c));
    for (const MemoryPolicy& p : {uniform(c, Action::kRecompute, "recompute-all"),
                                  uniform(c, Action::kOffload, "offload-all")}) {
      const PolicyRun r = run(c, p);
      EXPECT_EQ(r.losses, keep.losses) << p.name;
      EXPECT_TRUE(same_bits(r.grads, keep.grads)) << p.name;
      EXPECT_TRUE(same_bits(r.params, keep.params)) << p.name;
    }
    auto dev = make_host_device(HostDeviceOptions{int64_t{64} << 20, 0.0, 0.0});
    Model m(c, *dev, 7);
    const std::vector<int32_t> t = tokens(5);
    TrainingHooks none;
    (void)m.step(t, kBatch, kSeq, keep_policy(c), none, {});
    const std::vector<NamedWeight> w = m.named_weights();
    const float* base = w.front().data;
    const std::vector<float> g = m.gradients();
    // The largest gradient of a tensor (flat index into the parameters).
    auto largest = [&](const std::string& name) {
      for (const NamedWeight& x : w) {
        if (x.spec.name != name) continue;
        const int64_t at = x.data - base;
        int64_t best = at;
        for (int64_t k = at; k < at + x.spec.elements(); ++k)
          if (std::abs(g[static_cast<size_t>(k)]) > std::abs(g[static_cast<size_t>(best)]))
            best = k;
        return best;
      }
      ADD_FAILURE() << "no tensor " << name;
      return int64_t{0};
    };
    EXPECT_EQ(w.back().spec.name, "lm_head.weight");
    EXPECT_EQ(w.back().data, base);  // the head is the embedding
    // Central differences through top-k routing jump where a perturbation flips a token's
    // experts: checked on the dense model.
    if (model != qwen3) continue;
    expect_gradient_matches_differences(m, t, largest("model.embed_tokens.weight"), "embedding");
    expect_gradient_matches_differences(m, t, largest("model.layers.1.self_attn.q_norm.weight"),
                                        "q_norm");
    expect_gradient_matches_differences(m, t, largest("model.layers.1.self_attn.k_norm.weight"),
                                        "k_norm");
  }
}

TEST(Train, TheLossFallsOnTheCorpus) {
  TrainOptions o = small("keep");
  o.steps = 25;
  o.lr = 3e-3;
  const TrainReport r = train::run(o, nullptr);
  ASSERT_EQ(r.policies.size(), 1u);
  const PolicyResult& p = r.policies[0];
  ASSERT_EQ(p.steps.size(), 25u);
  double first = 0, last = 0;
  for (int i = 0; i < 5; ++i) {
    first += p.steps[static_cast<size_t>(i)].loss;
    last += p.steps[20 + static_cast<size_t>(i)].loss;
  }
  EXPECT_LT(last, first - 5 * 0.3) << "mean of the last 5 steps vs the first 5";
}

TEST(Train, CompareRunsEveryPolicyBitwiseIdentically) {
  TrainOptions o = small("keep");
  o.compare = true;
  const TrainReport r = train::run(o, nullptr);
  ASSERT_EQ(r.policies.size(), 7u);
  EXPECT_TRUE(r.losses_identical);
  for (const PolicyResult& p : r.policies) {
    SCOPED_TRACE(p.name);
    EXPECT_TRUE(p.error.empty()) << p.error;
    EXPECT_GT(p.predicted_peak_bytes, 0);
    EXPECT_GT(p.predicted_step_ms, 0);
  }
  const std::string json = train_report_json(r, o);
  for (const char* key : {"\"policies\"", "\"name\"", "\"loss\"", "\"peak_device_bytes\"",
                          "\"step_ms\"", "\"offloaded_bytes\"", "\"stall_ms\"", "\"snowball\""}) {
    EXPECT_NE(json.find(key), std::string::npos) << key;
  }
}

// Note [The machine is the limit] (spillway/probe/probe.hpp): a run whose link asks for more than
// this machine's memcpy (forced: the figures given) says so beside its figures, naming both
// rates; one within it does not. The run measures memcpy itself.
TEST(Train, ALinkFasterThanMemcpySaysTheMachineIsTheLimit) {
  TrainOptions o = small("keep");
  o.d2h_gbps = 8.0;
  o.h2d_gbps = 8.0;
  TrainReport r;
  r.memcpy_gbps = 2.5;
  std::string text = format_train_report(r, o);
  EXPECT_NE(text.find("this machine: memcpy 2.50 GB/s"), std::string::npos) << text;
  EXPECT_NE(text.find("the machine is the limit: its memcpy measured 2.50 GB/s in this run, "
                      "below the emulated link's 8.00 GB/s"),
            std::string::npos)
      << text;
  EXPECT_NE(train_report_json(r, o).find("\"machine_is_the_limit\": true"), std::string::npos);
  o.d2h_gbps = 0;  // unthrottled: planned at 20 GB/s
  EXPECT_NE(format_train_report(r, o).find("below the emulated link's 20.00 GB/s"),
            std::string::npos);
  o.d2h_gbps = 2.0;
  o.h2d_gbps = 2.0;
  text = format_train_report(r, o);
  EXPECT_EQ(text.find("the machine is the limit"), std::string::npos) << text;
  EXPECT_NE(train_report_json(r, o).find("\"machine_is_the_limit\": false"), std::string::npos);
  o.steps = 1;
  EXPECT_GT(train::run(o, nullptr).memcpy_gbps, 0.0);
}

// The hybrid stack (data/nn/tiny-hybrid: Mamba-2 and attention mixers, routed-expert MLPs)
// under random mixes of keep, offload and recompute, and under the planner's policies:
// loss, gradients and weights bitwise those of keep (Note [Saved tensors], Note [Mamba
// slots]); the block policy (recompute) never reruns a selective scan and reruns fewer
// ops than full-layer checkpointing, which reruns every Mamba layer's scan.
TEST(HybridReferenceModel, BitwiseUnderEveryPolicyAndTheScanIsNeverRerun) {
  const RefConfig c = load_reference_config("tiny-hybrid");
  ASSERT_EQ(c.layers(), 4);
  EXPECT_EQ(saved_tensor_names(c, 0)[4], "ssm.scan_out");
  EXPECT_EQ(saved_tensor_names(c, 0).back(), "ssm.out_proj_in");
  const PolicyRun keep = run(c, keep_policy(c));
  ASSERT_TRUE(std::isfinite(keep.losses[0]));
  std::vector<MemoryPolicy> policies = {uniform(c, Action::kRecompute, "recompute-all"),
                                        uniform(c, Action::kOffload, "offload-all")};
  std::mt19937 g(77);
  for (int k = 0; k < 3; ++k) {
    MemoryPolicy p = keep_policy(c);
    p.name = "mix" + std::to_string(k);
    for (LayerActions& la : p.layers) {
      for (size_t i = 1; i < la.actions.size(); ++i) {
        const auto r = g() % 3;
        la.actions[i] = r == 0 ? Action::kKeep : r == 1 ? Action::kOffload : Action::kRecompute;
      }
    }
    policies.push_back(p);
  }
  for (const MemoryPolicy& p : policies) {
    SCOPED_TRACE(p.name);
    const PolicyRun r = run(c, p);
    EXPECT_EQ(r.losses, keep.losses);
    EXPECT_TRUE(same_bits(r.grads, keep.grads));
    EXPECT_TRUE(same_bits(r.params, keep.params));
  }

  TrainOptions o;
  o.model = "tiny-hybrid";
  o.steps = 1;
  o.micro_batch = 2;
  o.seq_len = 32;
  o.compare = true;
  const TrainReport rep = train::run(o, nullptr);
  EXPECT_TRUE(rep.losses_identical);
  const PolicyResult* narrow = nullptr;
  const PolicyResult* full = nullptr;
  for (const PolicyResult& p : rep.policies) {
    EXPECT_TRUE(p.error.empty()) << p.name << ": " << p.error;
    if (p.name == "recompute") narrow = &p;
    if (p.name == "checkpoint") full = &p;
  }
  ASSERT_TRUE(narrow != nullptr && full != nullptr);
  EXPECT_EQ(narrow->recomputed_scans, 0);
  EXPECT_EQ(full->recomputed_scans, 3);  // one per Mamba layer
  EXPECT_GT(narrow->recomputed_ops, 0);
  EXPECT_LT(narrow->recomputed_ops, full->recomputed_ops);
  EXPECT_LT(full->peak_device_bytes, narrow->peak_device_bytes);  // what checkpointing buys
}

// A Mamba layer with a dense MLP (the MoE one is tiny-hybrid's): same bits as keep.
TEST(HybridReferenceModel, MambaWithADenseMlp) {
  spillway::testing::TempDir dir;
  const std::string path = (dir.path() / "hybrid-dense.json").string();
  {
    std::ofstream f(path);
    f << R"({"model_type": "granitemoehybrid", "hidden_size": 32, "num_hidden_layers": 2,
      "layer_types": ["attention", "mamba"], "num_attention_heads": 2, "num_key_value_heads": 1,
      "head_dim": 16, "num_local_experts": 0, "shared_intermediate_size": 48,
      "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_n_groups": 2, "mamba_d_state": 8,
      "mamba_d_conv": 3, "mamba_expand": 2, "mamba_chunk_size": 8, "vocab_size": 256})";
  }
  const RefConfig c = load_reference_config(path);
  EXPECT_EQ(c.model.layers[1].block_name(), "mamba2+dense");
  const PolicyRun keep = run(c, keep_policy(c));
  const PolicyRun rec = run(c, uniform(c, Action::kRecompute, "recompute-all"));
  EXPECT_EQ(rec.losses, keep.losses);
  EXPECT_TRUE(same_bits(rec.grads, keep.grads));
}

TEST(Train, ASlowLinkSnowballsAndAutoAvoidsIt) {
  // Each layer offloads ~0.1-0.3 MB; at 0.005 GB/s that is 20-60 ms per layer against a
  // forward of ~1 ms: the copies cannot keep up.
  TrainOptions o = small("offload");
  o.d2h_gbps = 0.005;
  o.h2d_gbps = 0.005;
  const TrainReport off = train::run(o, nullptr);
  EXPECT_TRUE(off.policies[0].snowball);
  // Auto plans from a measured layer time, which a loaded machine stretches: at a link
  // 10x slower still, even the smallest tensor (2 KB of top-k indices: 4 ms) cannot fit a
  // ~1 ms forward however the calibration run went, so auto must offload nothing.
  o.policy = "auto";
  o.d2h_gbps = 0.0005;
  o.h2d_gbps = 0.0005;
  const TrainReport au = train::run(o, nullptr);
  EXPECT_FALSE(au.policies[0].snowball);
  EXPECT_EQ(au.policies[0].offloaded_bytes, 0) << au.policies[0].plan_note;
  EXPECT_EQ(au.policies[0].loss, off.policies[0].loss);  // same bits, other policy
}

// Note [Auto covers the copies' pace]: the documented `spillway train --policy auto
// --device-memory-mb 18` fits however slowly the copies run. From step 2 on the link runs
// 2000x slower than the 20 GB/s auto planned for (the figure it also plans unthrottled
// copies with), so every offloaded tensor stays on the device as long as the engine's
// in-flight bound lets it: the worst a loaded machine can do, here made certain.
TEST(Train, AutoFitsTheArenaWhenTheCopiesLag) {
  bool roomy_offloads = false;
  for (double mb : {18.0, 20.0, 22.0, 32.0}) {
    SCOPED_TRACE("--device-memory-mb " + std::to_string(mb));
    TrainOptions o;  // tiny-moe, micro-batch 8 x seq 128, as documented
    o.policy = "auto";
    o.device_memory_mb = mb;
    o.steps = 2;
    o.d2h_gbps = 20;
    o.h2d_gbps = 20;
    o.link_schedule = {{2, 0.01}};
    const TrainReport r = train::run(o, nullptr);  // exhausting the arena throws
    ASSERT_EQ(r.policies.size(), 1u);
    const PolicyResult& p = r.policies[0];
    EXPECT_LE(p.peak_device_bytes, static_cast<int64_t>(mb * 1048576.0)) << p.plan_note;
    if (mb == 32.0) roomy_offloads = p.offloaded_bytes > 0;
  }
  // The lag is exercised: 32 MiB holds auto's own offloading plan (about 19.3 MB) plus
  // twice the in-flight bound, what auto judges when even its probe's copies lagged, so it
  // offloads however loaded the machine is (the tighter arenas' choice may depend on it).
  EXPECT_TRUE(roomy_offloads);
}

// Note [A run's link time]: a run whose copies alone would take over an hour is refused
// before its first step, naming the flag, its value and the speed that would do.
TEST(Train, ARunWhoseCopiesTakeOverAnHourIsRefusedUpFront) {
  TrainOptions o;  // tiny-moe, micro-batch 8 x seq 128, 20 steps: about 70 minutes a step
  o.policy = "offload";
  o.d2h_gbps = 0.000001;
  const std::string e = spillway::testing::error_of([&] { train::run(o, nullptr); });
  EXPECT_NE(e.find("--d2h-gbps is 1e-06"), std::string::npos) << e;
  EXPECT_NE(e.find("more than the 3600 s a run may take"), std::string::npos) << e;
  EXPECT_NE(e.find("raise --d2h-gbps to"), std::string::npos) << e;
  // The reloads are bounded the same way, and the limit counts every step.
  o = small("offload");
  o.h2d_gbps = 0.001;
  o.max_link_seconds = 0.5;
  const std::string h = spillway::testing::error_of([&] { train::run(o, nullptr); });
  EXPECT_NE(h.find("--h2d-gbps is 0.001"), std::string::npos) << h;
  EXPECT_NE(h.find("3 steps"), std::string::npos) << h;
}

TEST(Train, FusedSwigluSavesOnlyGateAndUpAndChangesNoBit) {
  TrainOptions o = small("keep");
  const TrainReport plain = train::run(o, nullptr);
  o.fused_swiglu = true;
  const TrainReport fused = train::run(o, nullptr);
  EXPECT_EQ(fused.policies[0].loss, plain.policies[0].loss);
  EXPECT_EQ(fused.policies[0].final_gradients, plain.policies[0].final_gradients);
  // mlp.act of each of the 4 layers is recomputed, everything else kept.
  EXPECT_NE(fused.policies[0].plan_note.find("4 recomputed"), std::string::npos)
      << fused.policies[0].plan_note;
  EXPECT_LT(fused.policies[0].peak_device_bytes, plain.policies[0].peak_device_bytes);
}

TEST(Train, BadOptionsAreClearErrors) {
  TrainOptions o = small("sideways");
  EXPECT_THROW(train::run(o, nullptr), Error);
  o = small("keep");
  o.device = "cuda";
  try {
    train::run(o, nullptr);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--device cuda"), std::string::npos);
  }
  o = small("keep");
  o.steps = 0;
  EXPECT_THROW(train::run(o, nullptr), Error);
  o = small("keep");
  o.corpus = "/nonexistent";
  EXPECT_THROW(train::run(o, nullptr), Error);
  o = small("auto");
  o.device_memory_mb = 2;  // below the parameters and optimizer states
  try {
    train::run(o, nullptr);
    FAIL();
  } catch (const Error& e) {
    std::cout << e.what() << "\n";
  }
}

}  // namespace
}  // namespace spillway::nn

namespace spillway::nn {
namespace {

using namespace spillway::train;  // NOLINT: the training application over this model

// Optimizer offload in training (--optimizer offload): any split and any undo memory limit
// give bitwise the same losses and master weights; the loss falls; the moments leave the
// device; every policy still agrees bit for bit.
TEST(TrainOptimizerOffload, AnySplitAndUndoLimitTrainBitwiseTheSame) {
  TrainOptions o = small("keep");
  o.optimizer = "offload";
  o.steps = 6;
  o.clip = 0.5;  // the first steps clip: replays too
  const TrainReport base = train::run(o, nullptr);
  const PolicyResult& b = base.policies[0];
  EXPECT_GT(b.optimizer_counters.commits + b.optimizer_counters.replays, 0);
  EXPECT_GT(b.optimizer_counters.replays, 0) << "the test wants clipped steps";
  ASSERT_EQ(b.final_master_weights.size(), static_cast<size_t>(base.parameters));
  // tiny-moe: 4 layers, so 6 buckets (embedding, 4 layers, head).
  struct Variant {
    int split;
    double undo_mb;
  };
  for (const Variant& v :
       {Variant{1, -1}, Variant{3, -1}, Variant{6, -1}, Variant{0, 0}, Variant{2, 0.05}}) {
    SCOPED_TRACE(::testing::Message() << "split " << v.split << " undo " << v.undo_mb);
    TrainOptions ov = o;
    ov.device_buckets = v.split;
    ov.undo_mb = v.undo_mb;
    const TrainReport r = train::run(ov, nullptr);
    const PolicyResult& p = r.policies[0];
    ASSERT_EQ(p.steps.size(), b.steps.size());
    for (size_t s = 0; s < p.steps.size(); ++s)
      ASSERT_EQ(p.steps[s].loss, b.steps[s].loss) << "step " << s;
    EXPECT_TRUE(same_bits(p.final_master_weights, b.final_master_weights));
    EXPECT_TRUE(same_bits(p.final_gradients, b.final_gradients));
    if (v.undo_mb >= 0 && v.split < 6) {
      EXPECT_GT(p.optimizer_counters.deferred, 0);
    }
  }
}

TEST(TrainOptimizerOffload, TheLossFallsAndTheMomentsLeaveTheDevice) {
  TrainOptions o = small("keep");
  o.steps = 25;
  o.lr = 3e-3;
  o.optimizer = "offload";
  const TrainReport r = train::run(o, nullptr);
  const PolicyResult& p = r.policies[0];
  double first = 0, last = 0;
  for (int i = 0; i < 5; ++i) {
    first += p.steps[static_cast<size_t>(i)].loss;
    last += p.steps[20 + static_cast<size_t>(i)].loss;
  }
  EXPECT_LT(last, first - 5 * 0.3) << "mean of the last 5 steps vs the first 5";
  // Device: no moments (8 B/param) but bf16 weights and gradients (4 B/param).
  TrainOptions d = o;
  d.optimizer = "device";
  d.steps = 2;
  o.steps = 2;
  const int64_t on_device = train::run(d, nullptr).policies[0].peak_device_bytes;
  const int64_t offloaded = train::run(o, nullptr).policies[0].peak_device_bytes;
  EXPECT_LT(offloaded, on_device - 3 * r.parameters) << on_device << " vs " << offloaded;
}

TEST(TrainOptimizerOffload, CompareStaysBitwiseAndBadOptionsAreErrors) {
  TrainOptions o = small("keep");
  o.compare = true;
  o.optimizer = "offload";
  o.device_buckets = 1;
  const TrainReport r = train::run(o, nullptr);
  EXPECT_TRUE(r.losses_identical);
  EXPECT_NE(train_report_json(r, o).find("\"commits\""), std::string::npos);
  auto expect_error = [](const TrainOptions& t, std::string_view flag) {
    spillway::testing::expect_error([&] { train::run(t, nullptr); }, {flag});
  };
  TrainOptions bad = small("keep");
  bad.optimizer = "cpu";
  expect_error(bad, "optimizer is 'cpu'");
  bad = small("keep");
  bad.device_buckets = 2;  // without --optimizer offload
  expect_error(bad, "--optimizer offload");
  bad.optimizer = "offload";
  bad.device_buckets = 7;  // tiny-moe has 6 buckets
  expect_error(bad, "device_buckets is 7");
  bad.device_buckets = 0;
  bad.clip = -1;
  expect_error(bad, "clip is -1");
}

}  // namespace
}  // namespace spillway::nn
