// The live serving engine (docs/serve.md, `spillway serve`): models from a directory of
// checkpoints in the host-resident pool, emulated MIG slices behind one shared link, the
// Scheduler placing every request, and on each slice a thread running the reference model
// in inference mode (spillway/nn/decoder.hpp) with continuous batching, every weight GEMM
// through HybridGEMM from the pool. No HTTP here (spillway/http/http_server.hpp puts it behind
// the OpenAI-compatible endpoint).
//
// Note [Serving engine]: a request is checked (model, prompt, lengths) and queued; the
// Scheduler (Note [Serving scheduler]) routes it to a slice, or it waits, never preempting
// a running one. Each slice's thread admits its routed requests into free sequences of its
// decoder and runs iterations: one prefill chunk (the Scheduler's size, never cut by the
// step's budget) for every prompt not yet read, one token for every decoding request, in
// one decoder step; a sampled token goes to the request's Completion (a channel the HTTP
// thread reads: a slow client never blocks a slice). A finished request frees its slot and
// its place in the Scheduler, which then places the waiting ones. When the slice's model
// changes it acquires the new one from the pool (a switch when resident, a cold load from
// disk otherwise; nothing copied to the device either way) and releases it when idle, so
// the pool may evict it. Overload is loud: past `max_waiting` queued requests a submit is
// refused (kOverloaded: HTTP 429), while draining (kDraining: 503); a model the pool cannot
// hold beside those in use fails its requests (kFailed, counted "unavailable": 503). Nothing
// is dropped. Note [Slice failures]: whatever throws on a slice thread (a load, a decoder,
// a step) fails only the requests it concerns, kFailed with a message naming the model and
// the reason; the slice goes on and every other request is untouched.
//
// Note [Served determinism]: a completion depends only on its request (model, prompt,
// max_tokens, temperature, seed) and the engine's chunk table, never on what it is batched
// with, which slice runs it, or alpha: the GEMMs are HybridGEMM's invariant form (Note
// [Invariant HybridGEMM]), attention reads only the request's own cache, a prefill chunk
// is never cut, and sampling draws from the request's own generator (seeded by `seed`).
// Greedy (temperature 0) picks the lowest token of the largest logit.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "spillway/catalog/inventory.hpp"
#include "spillway/nn/decoder.hpp"
#include "spillway/nn/nn.hpp"
#include "spillway/serve/serve.hpp"
#include "spillway/text/chat_template.hpp"
#include "spillway/text/tokenizer.hpp"

namespace spillway::inference {

// ---- model directories ------------------------------------------------------------------

// Note [Model directories]: a servable model is a directory holding config.json (a
// reference-model config: qwen3_moe / qwen3 / llama-like, spillway/nn/nn.hpp) and its weights,
// the tensors of weight_specs() (Note [Checkpoint names]), F32 or BF16, shaped as the config
// says: in model.safetensors, or sharded as Hugging Face saves them (model.safetensors.index.json
// and the shards it names: Note [Sharded checkpoints] in spillway/serve/serve.hpp). A directory
// with both is refused as ambiguous, naming both. The model's name is the directory's.
struct ModelFiles {
  std::string name;
  std::string dir;
  std::string config_path;   // dir/config.json
  std::string weights_path;  // dir/model.safetensors, or dir/model.safetensors.index.json
};
// Note [Checkpoints that change on disk]: a model's config.json is read once, at start; its
// weights whenever the pool loads them (the first request, and again after an eviction). A
// load reads the files the engine checked or nothing (ModelPool's stamps: device, inode,
// size, mtime of the file, or of the index and every shard). Files found changed are checked
// again there, against the config read at start: a valid checkpoint of the same tensors and
// dtype (replaced whole, by a rename; a sharded one may be re-sharded) is loaded and served
// from then on; anything else (half-written, truncated, another layout, a directory, gone, a
// shard missing) makes the model unavailable: the requests that needed the load fail
// (kFailed, naming the model and the reason) and every later submit for it stats the files:
// the same files found bad, it is refused at once (kUnavailable, the reason); others, they
// are read and checked again: still bad, refused; valid, served. A copy
// already resident keeps serving until it is evicted. Nothing else is touched, and nothing
// crashes. A file rewritten in place while a load reads it fails that load (the bytes are
// read through the file, never a mapping that could fault): replace checkpoints by rename.
//
// Note [Refused model directories]: scan_models() sorts every subdirectory of `dir` with a
// config.json (by name) into the models to serve and the refused, each with its reason: no
// weights (neither model.safetensors nor model.safetensors.index.json), both (ambiguous), a
// config.json or weights path that is not a regular file, an entry that cannot be read (the
// OS's reason). What needs the files read (a config the decoder cannot compute, a checkpoint
// that does not match its config, a missing or disagreeing shard) is refused by the engine
// when EngineOptions::skip_refused is set (ServingEngine::refused()). `spillway serve
// --models DIR` serves the rest, printing each refused one ("  refused NAME: reason"), and
// fails naming every refusal when none is left. A `dir` that is not a readable directory is
// an error.
// One piece of a served weight (Note [Checkpoint resolution]): `rows` rows from row `row` of
// checkpoint tensor `tensor`, viewed as a matrix of its last dimension's width (rows 0: the
// whole tensor).
struct WeightPart {
  std::string tensor;
  int64_t row = 0;
  int64_t rows = 0;
  WeightPart() = default;
  WeightPart(std::string t, int64_t r = 0, int64_t n = 0)  // NOLINT(google-explicit-constructor)
      : tensor(std::move(t)), row(r), rows(n) {}
  friend bool operator==(const WeightPart&, const WeightPart&) = default;
};
// Per weight of weight_specs(), its parts side by side (q, k and v: three; others one).
using ResolvedWeights = std::vector<std::vector<WeightPart>>;

struct RefusedModel {
  std::string name;  // the directory's
  std::string dir;
  std::string why;
};
struct ModelScan {
  std::vector<ModelFiles> models;     // sorted by name
  std::vector<RefusedModel> refused;  // sorted by name
};
ModelScan scan_models(const std::string& dir);
// The strict form: the models of scan_models(); its first refusal, or none found, is an
// error.
std::vector<ModelFiles> find_models(const std::string& dir);
// Note [Served attention extras] (spillway/nn/nn.hpp): whether a checkpoint of config `c` is
// served with q/k norms: its family has them (Qwen3, Qwen3-MoE) and the file holds the first
// attention layer's q_norm. A file without them (the reference model's own qwen3_moe
// checkpoints) is served without, in every layer; one that holds some is then refused by
// resolve_checkpoint, naming the tensor.
bool checkpoint_has_qk_norms(const nn::RefConfig& c, const SafetensorsSet& f);
bool checkpoint_has_qk_norms(const nn::RefConfig& c, const SafetensorsFile& f);
// Note [Checkpoint resolution]: where each weight of weight_specs(c) comes from in a
// checkpoint: its own tensor; or an MoE weight under Mixtral's names (block_sparse_moe.gate,
// experts.N.w1/w2/w3 for gate/down/up); or an expert's gate, up or down projection as rows
// of transformers 5's fused experts (mlp.experts.gate_up_proj (experts, 2 ffn, hidden): each
// expert's gate rows then its up rows; mlp.experts.down_proj (experts, hidden, ffn)), which
// save_pretrained(save_original_format=False) writes for Qwen3-MoE, Qwen2-MoE and Mixtral; or, for
// attention's fused q, k, v (weights, and biases when the config has them), Hugging Face's q_proj,
// k_proj and v_proj stacked by rows; or, for the LM head of a config with tied embeddings and no
// lm_head tensor, the embedding. One dtype (F32 or BF16) for all. Every tensor of the file must be
// read (RoPE's inv_freq aside): one the reference model has no use for (an MLP bias, q/k norms
// where the family has none) is refused, since serving would silently ignore it. Throws naming the
// model, the tensor, what was expected and what was found.
ResolvedWeights resolve_checkpoint(const std::string& model, const nn::RefConfig& c,
                                   const SafetensorsSet& f);
ResolvedWeights resolve_checkpoint(const std::string& model, const nn::RefConfig& c,
                                   const SafetensorsFile& f);
// resolve_checkpoint on the checkpoint at `weights_path` (a file or an index).
void check_checkpoint(const std::string& model, const nn::RefConfig& c,
                      const std::string& weights_path);
// A config.json whose model the reference model would compute differently: MLP biases.
// Throws naming the model and the field.
void check_servable_config(const std::string& model, const std::string& config_text);
// Writes a checkpoint of the reference model initialized from `seed` (Model's own
// initialization) into `dir` (created): config.json (the config's text as given: an
// embedded name such as "tiny-moe", or a path) and model.safetensors in `dtype` (kFp32 or
// kBf16: rounded to nearest even). Written to temporaries and renamed: nothing half-written.
void write_checkpoint(const std::string& config_name_or_path, uint64_t seed, const std::string& dir,
                      DType dtype);

// ---- the engine -------------------------------------------------------------------------

struct EngineOptions {
  std::string hardware = "gh200";
  std::string profile = "1g.12gb";  // the MIG profile every slice has
  double rate_scale = 1e-3;         // every rate of the emulated GPU times this (slices.hpp)
  double memory_scale = 1e-3;       // every slice's memory times this
  int64_t host_budget_bytes = int64_t{1} << 30;  // the pool's mapped host memory
  int max_running = 8;                           // sequences a slice decodes together
  int max_context = 512;                         // tokens of one request, prompt and output
  int max_step_tokens = 256;                     // rows of one decoder step
  int max_waiting = 64;     // requests queued and not yet running, all slices (>= 1)
  double ttft_ms = 2000.0;  // targets: the Scheduler's and the SLO of the metrics
  double tpot_ms = 100.0;
  double alpha = -1.0;  // < 0: the alpha controller adapts it per slice; else fixed
  // Note [Refused model directories]: false: a model that cannot be registered fails the
  // constructor; true: it is left out, with its reason in ServingEngine::refused(), and the
  // constructor fails (naming every refusal) only when none is left.
  bool skip_refused = false;
};

struct CompletionRequest {
  std::string model;
  std::vector<int32_t> prompt;
  int max_tokens = 16;
  double temperature = 0.0;  // 0: greedy
  double top_p = 1.0;        // Note [Sampling]: (0, 1]; < 1: the nucleus
  uint64_t seed = 0;
  // Up to 4 sequences of 1 to 64 tokens: the request ends when its output would end with
  // one, which is left out (Note [Stop sequences] in src/inference/sampling.cpp).
  std::vector<std::vector<int32_t>> stop;
  // Note [Model text]: end-of-sequence tokens (a checkpoint's generation_config.json): the
  // request ends when it samples one ("stop"), which is left out. At most 16.
  std::vector<int32_t> eos;
  // Note [Logprobs]: -1: none; 0 to kMaxLogprobs: each generated token's log-probability and
  // the `logprobs` most likely tokens' (OpenAI's completions `logprobs`).
  int logprobs = -1;
};
inline constexpr int kMaxLogprobs = 20;

// Note [Logprobs]: a generated token's log-probability under the model's distribution (the
// log-softmax of its logits, after any soft cap; before the temperature), and the most likely
// tokens' (id and log-probability, most likely first; ties by id).
struct TokenLogprobs {
  float logprob = 0.0f;
  std::vector<std::pair<int32_t, float>> top;
};

enum class SubmitStatus {
  kAccepted,
  kInvalid,       // a field is wrong (SubmitResult::field): HTTP 400
  kUnknownModel,  // HTTP 404
  kOverloaded,    // max_waiting requests already queued: HTTP 429
  kDraining,      // the engine is shutting down: HTTP 503
  kUnavailable,   // the model's checkpoint cannot be served now (Note [Checkpoints that
                  // change on disk]); the message names the model and why: HTTP 503
};
const char* to_string(SubmitStatus s);

// A request's output as it is produced (Note [Serving engine]): the slice appends, one
// reader takes. Thread-safe.
class Completion {
 public:
  enum class State { kRunning, kDone, kFailed, kCancelled };
  // `logprobs`: the request's (Note [Logprobs]); its storage is sized here.
  explicit Completion(int max_tokens, int logprobs = -1);
  // Blocks until a token after the `have` already taken exists or the request ended;
  // appends the new ones to *out and returns the state (kRunning: more may come).
  State wait_tokens(size_t have, std::vector<int32_t>* out);
  // The same, returning kRunning with nothing new once `timeout` has passed.
  State wait_tokens_for(size_t have, std::vector<int32_t>* out, std::chrono::milliseconds timeout);
  State state() const;
  // Note [Logprobs]: those of tokens [from, to) taken (requests with logprobs >= 0; else
  // empty).
  std::vector<TokenLogprobs> logprobs(size_t from, size_t to) const;
  std::string error() const;          // kFailed or kCancelled: why
  std::string finish_reason() const;  // kDone: "length", or "stop" (a stop sequence)
  // The client went away: the slice stops generating for it at its next iteration.
  void cancel();
  // The same with the reason its reader is told (error() of the cancelled completion).
  void cancel(std::string why);
  std::string cancel_reason() const;
  // The slice had to take this request's model from another (a switch: the model was in
  // host memory) or from disk (a cold start) before running it.
  bool switched() const;
  bool cold() const;
  double ttft_ms() const;  // submit to first token (-1 before it)
  double tpot_ms() const;  // mean time between tokens after the first (-1 with < 2)
  int slice() const;

  // The engine's side.
  void push(int32_t token, std::chrono::steady_clock::time_point now);
  // With its logprobs: `top` holds the request's logprobs entries.
  void push(int32_t token, float logprob, const std::pair<int32_t, float>* top,
            std::chrono::steady_clock::time_point now);
  void finish(State s, std::string why);
  bool cancelled() const;
  void set_slice(int s);
  void set_start(bool switched, bool cold);
  std::chrono::steady_clock::time_point submitted;

 private:
  void append(int32_t token, const float* logprob, const std::pair<int32_t, float>* top,
              std::chrono::steady_clock::time_point now);
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<int32_t> tokens_;
  int top_k_ = -1;                              // the request's logprobs
  std::vector<float> logprob_;                  // per token
  std::vector<std::pair<int32_t, float>> top_;  // top_k_ per token
  State state_ = State::kRunning;
  std::string why_;
  bool cancel_ = false;
  std::string cancel_why_ = "cancelled";
  int slice_ = -1;
  bool switched_ = false, cold_ = false;
  std::chrono::steady_clock::time_point first_, last_;
};

struct SubmitResult {
  SubmitStatus status = SubmitStatus::kAccepted;
  std::string field;                       // kInvalid: the request field at fault
  std::string message;                     // anything but kAccepted: what and why
  std::shared_ptr<Completion> completion;  // kAccepted
};

// Note [Model text]: what a model directory carries for text, read at start: tokenizer.json
// (Tokenizer), the chat template (chat_template.jinja, or tokenizer_config.json's
// "chat_template": a string, or the "default" of a list), the BOS and EOS token strings
// (tokenizer_config.json's bos_token and eos_token, strings or {"content": ...}), and the
// EOS ids (generation_config.json's eos_token_id, an id or a list; else the EOS string's id).
// A directory without a tokenizer.json serves token ids only (its `unavailable` says why
// text is not served); one whose files cannot be read or use what the tokenizer or the
// template reader does not implement is served the same, the reason kept there (and
// printed at startup).
struct ModelText {
  std::unique_ptr<text::Tokenizer> tokenizer;  // null: token ids only
  std::unique_ptr<text::ChatTemplate> chat;    // null: no chat template
  std::string bos_token, eos_token;
  std::vector<int32_t> eos;
  std::string unavailable;       // why there is no tokenizer ("" when there is one)
  std::string chat_unavailable;  // why there is no chat template
};
// Reads the text files of model directory `dir` (Note [Model text]); never throws.
ModelText read_model_text(const std::string& dir);

struct ServedModelInfo {
  std::string name;
  int64_t weight_bytes = 0;
  DType dtype = DType::kFp32;  // the checkpoint's
  std::string family;          // its config.json's model_type
  int vocab = 0;
  int layers = 0;
  bool resident = false;
  std::string config_json;  // its config.json's text
  std::string text;         // Note [Model text]: "tokenizer and chat template", or why not
};

// Counters since start and the live state, for /metrics.
struct EngineMetrics {
  double uptime_s = 0.0;
  std::map<std::string, int64_t> requests;  // by outcome: ok, invalid, unknown_model,
                                            // overloaded, draining, unavailable, failed,
                                            // cancelled
  int64_t tokens_generated = 0;
  int64_t prompt_tokens = 0;
  std::vector<double> ttft_bounds_s, tpot_bounds_s;  // histogram upper bounds
  std::vector<int64_t> ttft_counts, tpot_counts;     // cumulative per bound, then +Inf
  double ttft_sum_s = 0.0, tpot_sum_s = 0.0;
  int64_t ttft_n = 0, tpot_n = 0;
  int64_t within_slo = 0;         // finished requests meeting both targets
  int64_t switches = 0;           // a slice took a model already resident in host memory
  int64_t cold_loads = 0;         // ... that had to be read from disk
  int64_t evictions = 0;          // models dropped from the pool
  int64_t waiting = 0;            // queued, not yet on a slice's decoder
  double link_gbps = 0.0;         // the shared link (emulated, scaled)
  int64_t link_bytes = 0;         // moved over it since start
  double link_utilization = 0.0;  // link bytes moved / (bandwidth x uptime)
  struct Slice {
    std::string model;  // active, empty when idle
    int running = 0;
    double alpha = 0.0;
    double hbm_utilization = 0.0;  // HBM bytes / (bandwidth x uptime)
    int64_t hbm_bytes = 0;         // since start
    double hbm_gbps = 0.0;         // its bandwidth (emulated, scaled)
    double link_share = 0.0;       // this slice's link bytes / (link bandwidth x uptime)
    int64_t iterations = 0;
    int64_t device_bytes_in_use = 0;
    int64_t device_bytes = 0;
  };
  std::vector<Slice> slices;
};
// The Prometheus text exposition of m (version 0.0.4).
std::string prometheus_text(const EngineMetrics& m);

class ServingEngine {
 public:
  // Registers every model (checked: config, checkpoint) and starts one thread per slice of
  // `options.profile`. Errors name the model and the field; with options.skip_refused a model
  // that cannot be registered is left out instead (refused()). `refused_already`: the
  // directories the caller refused (scan_models), listed in refused() and in the error when
  // no model is left.
  ServingEngine(const std::vector<ModelFiles>& models, const EngineOptions& options,
                std::vector<RefusedModel> refused_already = {});
  ~ServingEngine();  // drains, then stops the slices
  ServingEngine(const ServingEngine&) = delete;
  ServingEngine& operator=(const ServingEngine&) = delete;

  SubmitResult submit(const CompletionRequest& request);
  std::vector<ServedModelInfo> models() const;
  // The models left out (EngineOptions::skip_refused, refused_already), by name, with why.
  const std::vector<RefusedModel>& refused() const;
  const nn::RefConfig& config(const std::string& model) const;  // throws naming it if absent
  // Note [Model text]: the model's tokenizer and chat template; null for a model not served.
  const ModelText* text(const std::string& model) const;
  EngineMetrics metrics() const;
  int slices() const;
  const EngineOptions& options() const;
  double link_gbps() const;  // the emulated shared link's bandwidth (scaled)

  // Refuses new requests from now on (kDraining) and waits until every accepted one has
  // ended (finished, failed or cancelled).
  void drain();
  // The same, for at most `deadline`: returns true when every accepted request ended in
  // time; false when some are still in flight (draining stays on).
  bool drain_for(std::chrono::milliseconds deadline);
  // Cancels every accepted request not yet ended (queued or running), each ending
  // kCancelled with `why`; returns how many. Used when a drain's deadline passes.
  int64_t cancel_all(const std::string& why);
  // Note [One count per request]: every request the server answers is counted once, by
  // outcome (EngineMetrics::requests). submit() counts its own; a request refused before it
  // reaches submit() (malformed JSON, a bad field, a body too large) is counted here.
  void count_outcome(const std::string& outcome);
  bool draining() const;
  int64_t in_flight() const;  // accepted and not yet ended

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace spillway::inference
