// The socket's hook interface (include/spillway/device/hooks.hpp): CompositeHooks fans calls out in
// order, gives a saved tensor to the first hook that takes it and routes needed/done to that
// hook only; the default hooks take nothing.
#include "spillway/device/hooks.hpp"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace spillway {
namespace {

// Records every call; takes saved tensors whose name starts with `prefix`.
class Recorder final : public TrainingHooks {
 public:
  Recorder(std::string tag, std::string prefix, std::vector<std::string>* log)
      : tag_(std::move(tag)), prefix_(std::move(prefix)), log_(log) {}
  void step_begin() override { say("step_begin"); }
  void forward_begin(int layer) override { say("forward_begin " + std::to_string(layer)); }
  SavedTicket saved(int layer, std::string_view name, const SavedTensor& t) override {
    say("saved " + std::to_string(layer) + " " + std::string(name));
    if (prefix_.empty() || name.substr(0, prefix_.size()) != prefix_) return {};
    SavedTicket k;
    k.id = next_++;
    data_.push_back(t.data);
    return k;
  }
  void forward_end(int layer) override { say("forward_end " + std::to_string(layer)); }
  void backward_begin(int layer) override { say("backward_begin " + std::to_string(layer)); }
  void* needed(const SavedTicket& k, void* dst) override {
    say("needed " + std::to_string(k.id));
    return dst != nullptr ? dst : data_.at(static_cast<size_t>(k.id));
  }
  void done(const SavedTicket& k) override { say("done " + std::to_string(k.id)); }
  void grad_ready(int bucket) override { say("grad_ready " + std::to_string(bucket)); }
  void step_end() override { say("step_end"); }

 private:
  void say(const std::string& what) { log_->push_back(tag_ + ": " + what); }
  std::string tag_, prefix_;
  std::vector<std::string>* log_;
  std::vector<void*> data_;
  int next_ = 0;
};

TEST(CompositeHooks, FansOutInOrderAndRoutesSavedTensorsToTheirTaker) {
  std::vector<std::string> log;
  Recorder a("a", "mlp.", &log), b("b", "attn.", &log);
  CompositeHooks hooks({&a, &b});
  int x = 0, y = 0;
  hooks.step_begin();
  const SavedTicket ka = hooks.saved(0, "mlp.act", {&x, sizeof x, true, true});
  const SavedTicket kb = hooks.saved(0, "attn.input", {&y, sizeof y, true, true});
  const SavedTicket none = hooks.saved(0, "moe.topk_idx", {&y, sizeof y, true, true});
  EXPECT_TRUE(ka);
  EXPECT_EQ(ka.owner, 0);
  EXPECT_TRUE(kb);
  EXPECT_EQ(kb.owner, 1);
  EXPECT_FALSE(none);
  EXPECT_EQ(hooks.needed(ka, nullptr), &x);
  EXPECT_EQ(hooks.needed(kb, nullptr), &y);
  hooks.done(kb);
  EXPECT_EQ(hooks.needed(none, nullptr), nullptr);  // no owner: nobody answers
  hooks.grad_ready(3);
  hooks.step_end();
  const std::vector<std::string> want = {"a: step_begin",
                                         "b: step_begin",
                                         "a: saved 0 mlp.act",  // a takes it: b never sees it
                                         "a: saved 0 attn.input",
                                         "b: saved 0 attn.input",
                                         "a: saved 0 moe.topk_idx",
                                         "b: saved 0 moe.topk_idx",
                                         "a: needed 0",
                                         "b: needed 0",
                                         "b: done 0",
                                         "a: grad_ready 3",
                                         "b: grad_ready 3",
                                         "a: step_end",
                                         "b: step_end"};
  EXPECT_EQ(log, want);
}

TEST(TrainingHooks, TheDefaultsTakeNothing) {
  TrainingHooks none;
  int x = 0;
  EXPECT_FALSE(none.saved(0, "mlp.act", {&x, sizeof x, true, true}));
  SavedTicket k;
  k.id = 0;
  EXPECT_EQ(none.needed(k, nullptr), nullptr);
  CompositeHooks empty;
  EXPECT_FALSE(empty.saved(0, "mlp.act", {&x, sizeof x, true, true}));
}

}  // namespace
}  // namespace spillway
