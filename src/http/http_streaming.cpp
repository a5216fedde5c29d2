// The HTTP endpoint's streamed answers (Note [HTTP endpoints] in spillway/http/http_server.hpp): a
// tokenizer model's output as text while its tokens come (Note [Text out]), and the
// server-sent events of /v1/completions and /v1/chat/completions, a stream closed early (the
// client went away) cancelling its completion.
#include <algorithm>

#include "http/http_server_impl.hpp"

namespace spillway::http {

namespace detail {

// Note [Text out]: a tokenizer model's output as text while its tokens come: detokenized
// incrementally (text::StreamDecoder, special tokens left out), then held back while its end
// could begin a stop string; a stop string found ends the text before it (the request is
// then cancelled: nothing after it is generated). The pieces never split a character.
std::string TextOut::feed(const std::string& piece, bool last) {
  if (stopped_) return {};
  pending_ += piece;
  size_t cut = std::string::npos;
  for (const std::string& st : stops_) cut = std::min(cut, pending_.find(st));
  if (cut != std::string::npos) {
    stopped_ = true;
    std::string out = pending_.substr(0, cut);
    pending_.clear();
    return out;
  }
  size_t keep = 0;  // the longest end of pending_ that begins a stop string
  if (!last) {
    for (const std::string& st : stops_) {
      for (size_t k = std::min(st.size() - 1, pending_.size()); k > keep; --k) {
        if (pending_.compare(pending_.size() - k, k, st, 0, k) == 0) {
          keep = k;
          break;
        }
      }
    }
  }
  std::string out = pending_.substr(0, pending_.size() - keep);
  pending_.erase(0, pending_.size() - keep);
  return out;
}

namespace {

// The end of a stream of events: an error event when the request did not finish (`failed`:
// the reason), then [DONE]; *finished once all is written.
bool end_stream(httplib::DataSink& sink, const inference::Completion& c, bool failed,
                bool* finished) {
  if (failed) {
    const std::string line = "data: " +
                             dump(json{{"error",
                                        {{"message", c.error().empty() ? "cancelled" : c.error()},
                                         {"type", "server_unavailable"},
                                         {"param", nullptr},
                                         {"code", "unavailable"}}}}) +
                             "\n\n";
    if (!sink.write(line.data(), line.size())) return false;
  }
  static const std::string done = "data: [DONE]\n\n";
  if (!sink.write(done.data(), done.size())) return false;
  *finished = true;
  sink.done();
  return true;
}

}  // namespace

bool EventHead::write(httplib::DataSink& sink, const json& choices, const json& usage) const {
  json ev = {
      {"id", id}, {"object", object}, {"created", created}, {"model", model}, {"choices", choices}};
  if (include_usage) ev["usage"] = usage;
  const std::string line = "data: " + dump(ev) + "\n\n";
  return sink.write(line.data(), line.size());
}

bool EventHead::end(httplib::DataSink& sink, const inference::Completion& c, size_t prompt_tokens,
                    size_t completion_tokens, bool* finished) const {
  if (include_usage && !write(sink, json::array(), usage_json(prompt_tokens, completion_tokens)))
    return false;
  return end_stream(sink, c, false, finished);
}

}  // namespace detail

using namespace detail;  // the pieces of http_server_impl.hpp

// Server-sent events: one per token as it comes, a last one with the finish reason, then
// [DONE]. The handler's thread waits on the completion; the slice never waits on it.
void HttpServer::Impl::stream_completion(httplib::Response& res,
                                         const std::shared_ptr<inference::Completion>& c,
                                         EventHead head, const inference::CompletionRequest& q,
                                         int vocab, const TextMode& tm) {
  begin_write();
  auto sent = std::make_shared<size_t>(0);
  auto finished = std::make_shared<bool>(false);
  std::shared_ptr<TextOut> tout;  // Note [Text out]
  if (tm.model != nullptr) tout = std::make_shared<TextOut>(*tm.model->tokenizer, tm.stop);
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      [c, sent, finished, head = std::move(head), vocab, seed = q.seed, tout, logprobs = q.logprobs,
       prompt_tokens = q.prompt.size()](size_t, httplib::DataSink& sink) {
        auto event = [&](const json& choice) {
          return head.write(sink, json::array({choice}), nullptr);
        };
        std::vector<int32_t> fresh;
        inference::Completion::State st = c->wait_tokens(*sent, &fresh);
        for (int32_t t : fresh) {
          const std::vector<int32_t> one{t};
          if (tout && tout->stopped()) break;
          const std::string piece = tout ? tout->push(t) : token_text(one, 0, vocab);
          if (tout && tout->stopped() && !c->cancelled()) c->cancel("stop");
          if (!event(
                  {{"index", 0},
                   {"text", piece},
                   {"token_ids", one},
                   {"logprobs", logprobs < 0 ? json(nullptr)
                                             : logprobs_json(one, 0, c->logprobs(*sent, *sent + 1),
                                                             vocab, vocab > 256 ? 0 : *sent)},
                   {"finish_reason", nullptr}})) {
            c->cancel();  // the client went away: the slice stops generating for it
            return false;
          }
          ++*sent;
        }
        const bool text_stop = tout && tout->stopped();
        if (st == inference::Completion::State::kRunning && !text_stop) return true;
        if (st == inference::Completion::State::kDone || text_stop) {
          const std::string rest = tout && !text_stop ? tout->finish() : std::string();
          if (!event({{"index", 0},
                      {"text", rest},
                      {"token_ids", json::array()},
                      {"logprobs", nullptr},
                      {"finish_reason", finish_reason(*c, text_stop)},
                      {"spillway", extension(*c, seed)}}))
            return false;
          return head.end(sink, *c, prompt_tokens, *sent, finished.get());
        }
        return end_stream(sink, *c, true, finished.get());
      },
      stream_closed(c, finished));
}

// A chat completion's events: the assistant's role, then its text as it comes (Note [Chat
// completions]).
void HttpServer::Impl::stream_chat(httplib::Response& res,
                                   const std::shared_ptr<inference::Completion>& c, EventHead head,
                                   const inference::CompletionRequest& q,
                                   const std::shared_ptr<TextOut>& tout) {
  begin_write();
  auto sent = std::make_shared<size_t>(0);
  auto finished = std::make_shared<bool>(false);
  auto started = std::make_shared<bool>(false);
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      [c, sent, finished, started, head = std::move(head), seed = q.seed, tout,
       prompt_tokens = q.prompt.size()](size_t, httplib::DataSink& sink) {
        auto delta = [&](const json& d, const json& finish) {
          return head.write(
              sink,
              json::array(
                  {{{"index", 0}, {"delta", d}, {"logprobs", nullptr}, {"finish_reason", finish}}}),
              nullptr);
        };
        if (!*started) {  // the assistant's role first, as OpenAI's stream does
          if (!delta({{"role", "assistant"}, {"content", ""}}, nullptr)) {
            c->cancel();
            return false;
          }
          *started = true;
        }
        std::vector<int32_t> fresh;
        const inference::Completion::State st = c->wait_tokens(*sent, &fresh);
        for (int32_t t : fresh) {
          if (tout->stopped()) break;
          const std::string piece = tout->push(t);
          if (tout->stopped() && !c->cancelled()) c->cancel("stop");
          ++*sent;
          if (!piece.empty() && !delta({{"content", piece}}, nullptr)) {
            c->cancel();
            return false;
          }
        }
        const bool text_stop = tout->stopped();
        if (st == inference::Completion::State::kRunning && !text_stop) return true;
        if (st == inference::Completion::State::kDone || text_stop) {
          const std::string rest = text_stop ? std::string() : tout->finish();
          if (!rest.empty() && !delta({{"content", rest}}, nullptr)) return false;
          json last = {{"index", 0},
                       {"delta", json::object()},
                       {"logprobs", nullptr},
                       {"finish_reason", finish_reason(*c, text_stop)},
                       {"spillway", extension(*c, seed)}};
          if (!head.write(sink, json::array({last}), nullptr)) return false;
          return head.end(sink, *c, prompt_tokens, *sent, finished.get());
        }
        return end_stream(sink, *c, true, finished.get());
      },
      stream_closed(c, finished));
}

}  // namespace spillway::http
