// `spillway stream`'s run (include/spillway/train/train.hpp: run_streamed_reference): the
// reference model streamed from a throttled host link beside the same model resident, on
// one or more emulated GPUs, and the prediction for the same setup.
//
// Invariants: both models of a GPU start from the same seed and see the same batches, so
// their losses are bitwise equal step after step (Note [Streamed weights]); the warm-up
// step is not timed.
#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <exception>
#include <memory>
#include <random>
#include <thread>

#include "core/stats.hpp"
#include "spillway/core/error.hpp"
#include "spillway/device/device.hpp"
#include "spillway/nn/nn.hpp"
#include "spillway/plan/stream_mode.hpp"
#include "spillway/stream/weight_streamer.hpp"
#include "spillway/train/train.hpp"

namespace spillway::train {

namespace {

// The learning rate of a training run of the reference model, streamed and resident.
constexpr double kStreamRunLr = 1e-3;

// One emulated GPU of the run: its device behind the shared link, the model all-resident
// and the same model streamed.
struct RunRank {
  std::unique_ptr<Device> dev;
  std::unique_ptr<nn::Model> resident, streamed;
  double loss_res = 0, loss_str = 0;
  double ms_res = 0, ms_str = 0;
  nn::StepStats st_res;
  // Each model's own update (Note [The model's own update]).
  TextbookAdamW adam_res{kStreamRunLr}, adam_str{kStreamRunLr};
  std::unique_ptr<WeightStreamer> ws;  // last: destroyed before the models and the device
};

// fn(rank) on every rank at once, one thread each (the emulated GPUs run concurrently and
// contend for the link as GPUs would). A rank that throws calls on_error (its peers may be
// waiting for it in a collective); the first error is rethrown once all have returned.
template <typename F, typename E>
void on_all_ranks(std::vector<RunRank>& ranks, F fn, E on_error) {
  if (ranks.size() == 1) {
    fn(ranks[0]);
    return;
  }
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(ranks.size());
  threads.reserve(ranks.size());
  for (size_t i = 0; i < ranks.size(); ++i)
    threads.emplace_back([&, i] {
      try {
        fn(ranks[i]);
      } catch (...) {
        errors[i] = std::current_exception();
        on_error();
      }
    });
  for (std::thread& t : threads) t.join();
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
}

// The rate at which this machine copies a buffer of `bytes` (the emulated all-gather is
// such copies among the ranks' device buffers), GB/s: the median of 5.
double measured_memcpy_gbps(size_t bytes) {
  std::vector<std::byte> a(bytes, std::byte{1}), b(bytes);
  std::vector<double> ms;
  for (int i = 0; i < 6; ++i) {
    const auto t0 = Clock::now();
    std::memcpy(b.data(), a.data(), bytes);
    if (i > 0) ms.push_back(ms_since(t0));
  }
  return static_cast<double>(bytes) / 1e6 / std::max(median(ms), 1e-6);
}

void validate(const StreamedRunOptions& o) {
  // Errors name the StreamedRunOptions field (the CLI shows its flag).
  auto at_least = [](const char* field, double v, double lo) {
    if (!(v >= lo)) SPILLWAY_FIELD_ERROR(field, v, "must be >= {}", lo);
  };
  at_least("steps", o.steps, 2);
  at_least("micro_batch", o.micro_batch, 1);
  at_least("seq_len", o.seq_len, 1);
  at_least("prefetch_depth", o.prefetch_depth, 1);
  at_least("gpus_per_link", o.gpus_per_link, 1);
  if (!(o.link_gbps > 0)) SPILLWAY_FIELD_ERROR("link_gbps", o.link_gbps, "must be > 0");
  if (!(o.device_memory_mb > 0))
    SPILLWAY_FIELD_ERROR("device_memory_mb", o.device_memory_mb, "must be > 0");
  if (o.mode != "auto" && o.mode != "full-copy" && o.mode != "sharded")
    SPILLWAY_FIELD_ERROR("mode", fmt::format("'{}'", o.mode), "must be auto, full-copy or sharded");
  if (o.mode == "sharded" && o.gpus_per_link < 2)
    SPILLWAY_FIELD_ERROR("mode", "'sharded'", "needs gpus_per_link 2 or more");
}

}  // namespace

StreamedRunReport run_streamed_reference(const StreamedRunOptions& o,
                                         const std::function<void(const std::string&)>& progress) {
  validate(o);
  const nn::RefConfig c = nn::load_reference_config(o.ref_model);
  const int batch = o.micro_batch;
  const int seq = o.seq_len;
  const int depth = o.prefetch_depth;
  const bool training = o.training;
  const int N = o.gpus_per_link;
  auto link = std::make_shared<HostLink>(o.link_gbps, o.link_gbps);
  // Declared before the ranks: their streamers (destroyed first, each waiting for its
  // streams) may still have all-gathers of the next pass in flight.
  std::vector<std::unique_ptr<AllGather>> group;
  std::vector<RunRank> ranks(static_cast<size_t>(N));
  std::vector<Device*> devs;
  for (RunRank& r : ranks) {
    HostDeviceOptions ho;
    ho.device_bytes = static_cast<int64_t>(o.device_memory_mb * 1048576.0);
    ho.link = link;
    r.dev = make_host_device(ho);
    devs.push_back(r.dev.get());
    r.resident = std::make_unique<nn::Model>(c, *r.dev, o.seed);
    r.streamed = std::make_unique<nn::Model>(c, *r.dev, o.seed);
  }
  const MemoryPolicy policy = nn::keep_policy(c);
  TrainingHooks none;
  const double lr = training ? kStreamRunLr : 0.0;
  std::mt19937 g(static_cast<uint32_t>(o.seed));
  auto batches = [&] {
    std::vector<std::vector<int32_t>> out;
    for (int r = 0; r < (training ? 1 : N); ++r) {
      std::vector<int32_t> tokens(static_cast<size_t>(batch) * static_cast<size_t>(seq + 1));
      for (int32_t& t : tokens) t = static_cast<int32_t>(g() % static_cast<uint32_t>(c.vocab));
      out.push_back(std::move(tokens));
    }
    return out;
  };
  // One step of every rank's resident or streamed model; the step's time is the slowest
  // rank's.
  auto step_all = [&](bool streamed, const std::vector<std::vector<int32_t>>& tok, double step_lr) {
    // A failed rank aborts the all-gather group so that its peers do not wait for it.
    const auto abort_group = [&] {
      for (const std::unique_ptr<AllGather>& a : group) a->abort();
    };
    on_all_ranks(
        ranks,
        [&](RunRank& r) {
          const size_t i = static_cast<size_t>(&r - ranks.data());
          const std::vector<int32_t>& t = tok[training ? 0 : i];
          nn::Model& m = streamed ? *r.streamed : *r.resident;
          const auto t0 = Clock::now();
          double loss = 0;
          if (training) {
            TextbookAdamW& adam = streamed ? r.adam_str : r.adam_res;
            const nn::ParameterUpdate update = step_lr > 0 ? adam.update() : nn::ParameterUpdate{};
            nn::StepStats st = m.step(t, batch, seq, policy, none, update);
            loss = st.loss;
            if (!streamed) r.st_res = std::move(st);
          } else {
            loss = m.forward_loss(t, batch, seq);
          }
          (streamed ? r.ms_str : r.ms_res) = ms_since(t0);
          (streamed ? r.loss_str : r.loss_res) = loss;
        },
        abort_group);
    double slowest = 0;
    for (const RunRank& r : ranks) slowest = std::max(slowest, streamed ? r.ms_str : r.ms_res);
    return slowest;
  };
  StreamedRunReport rep;
  rep.layers = c.layers();
  const std::vector<size_t> bytes = ranks[0].resident->layer_weight_bytes();
  int64_t model_bytes = 0;
  for (size_t b : bytes) model_bytes += static_cast<int64_t>(b);
  rep.model_bytes = model_bytes;
  // Note [A run's link time]: every streamed step copies every layer once (forward)
  // through the link, N times over when each GPU copies whole layers.
  {
    const double copies = o.mode == "full-copy" ? N : 1.0;
    LinkTime need;
    need.add(static_cast<double>(o.steps) * copies * static_cast<double>(model_bytes), o.link_gbps);
    rep.link_copies = o.mode == "full-copy" ? N : 1;
    rep.min_link_bytes = need.bytes;
    rep.min_link_seconds = need.seconds;
    if (need.over(o.max_link_seconds)) {
      rep.refused = true;
      return rep;
    }
  }
  // The mode, from the arithmetic of Note [Stream mode model] over a warm-up step of the
  // resident models (learning rate 0: the weights stay the streamed models'), the link,
  // and this machine's copy rate for the emulated all-gather.
  StreamModeInput& in = rep.prediction_input;
  in.gpus_per_link = N;
  in.link_h2d_gbps = o.link_gbps;
  in.peer_gbps = N > 1 ? measured_memcpy_gbps(*std::max_element(bytes.begin(), bytes.end())) : 0;
  in.depth = depth;
  auto fill_compute = [&](double fwd_ms) {
    in.layer_bytes.clear();
    in.fwd_ms.clear();
    in.bwd_ms.clear();
    for (int l = 0; l < c.layers(); ++l) {
      const auto u = static_cast<size_t>(l);
      in.layer_bytes.push_back(static_cast<int64_t>(bytes[u]));
      in.fwd_ms.push_back(training ? ranks[0].st_res.layer_fwd_ms[u] : fwd_ms / c.layers());
      if (training) in.bwd_ms.push_back(ranks[0].st_res.layer_bwd_ms[u]);
    }
  };
  fill_compute(step_all(false, batches(), 0.0));
  std::string mode = o.mode;
  if (mode == "auto") mode = choose_stream_mode(in).chosen;
  SPILLWAY_CHECK(mode != "sharded" || N >= 2, "the sharded mode needs 2 or more GPUs per link");
  if (mode == "sharded") group = make_host_all_gather(devs);
  for (size_t i = 0; i < ranks.size(); ++i) {
    RunRank& r = ranks[i];
    WeightStreamOptions so;
    so.depth = depth;
    so.training = training;
    if (!group.empty()) so.group = group[i].get();
    r.ws = std::make_unique<WeightStreamer>(*r.dev, r.streamed->compute_stream(),
                                            r.streamed->layer_weight_bytes(), so);
    r.streamed->stream_weights(r.ws.get());
  }
  std::vector<double> t_res, t_str;
  std::vector<std::vector<double>> fwd_ms(static_cast<size_t>(c.layers())),
      bwd_ms(static_cast<size_t>(c.layers()));
  bool bitwise = true;
  for (int step = 0; step < o.steps; ++step) {
    const std::vector<std::vector<int32_t>> tok = batches();
    const double ms_res = step_all(false, tok, lr);
    const double ms_str = step_all(true, tok, lr);
    if (step > 0) {
      t_res.push_back(ms_res);
      t_str.push_back(ms_str);
    }
    if (training)
      for (int l = 0; l < c.layers(); ++l) {
        const auto u = static_cast<size_t>(l);
        fwd_ms[u].push_back(ranks[0].st_res.layer_fwd_ms[u]);
        bwd_ms[u].push_back(ranks[0].st_res.layer_bwd_ms[u]);
      }
    std::string differ;
    for (size_t i = 0; i < ranks.size(); ++i)
      if (ranks[i].loss_res != ranks[i].loss_str) differ += fmt::format(" {}", i);
    bitwise = bitwise && differ.empty();
    if (progress)
      progress(fmt::format("step {}: loss {:.6f} resident, {:.6f} streamed{}{}", step,
                           ranks[0].loss_res, ranks[0].loss_str,
                           N > 1 ? fmt::format(" (rank 0 of {})", N) : "",
                           differ.empty() ? "" : "  DIFFERENT on rank" + differ));
  }
  rep.telemetry = ranks[0].ws->telemetry();
  rep.slot_bytes = static_cast<int64_t>(ranks[0].ws->slot_bytes());
  for (RunRank& r : ranks) r.streamed->stream_weights(nullptr);
  rep.mode = mode;
  rep.resident_ms = median(t_res);
  rep.streamed_ms = median(t_str);
  rep.timed_steps = static_cast<int>(t_res.size());
  rep.bitwise_identical = bitwise;
  // The prediction for the same setup, from the measured per-layer compute (training) or
  // the resident pass spread evenly (inference: forward_loss does not time layers).
  if (training) {
    in.fwd_ms.clear();
    in.bwd_ms.clear();
    for (int l = 0; l < c.layers(); ++l) {
      in.fwd_ms.push_back(median(fwd_ms[static_cast<size_t>(l)]));
      in.bwd_ms.push_back(median(bwd_ms[static_cast<size_t>(l)]));
    }
  } else {
    fill_compute(rep.resident_ms);
  }
  rep.prediction = choose_stream_mode(in);
  const auto est = std::find_if(rep.prediction.modes.begin(), rep.prediction.modes.end(),
                                [&](const StreamModeEstimate& e) { return e.mode == mode; });
  rep.predicted_ms = est != rep.prediction.modes.end() ? est->step_ms : 0.0;
  return rep;
}

}  // namespace spillway::train
