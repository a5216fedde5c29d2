// The HTTP endpoint's shared pieces (spillway/http/http_server.hpp, Note [HTTP endpoints]): the
// protocol's field checks and response JSON (http_protocol.cpp), a tokenizer model's text
// out and the server-sent events (http_streaming.cpp), and the server's state,
// HttpServer::Impl, whose handlers and routes are http_routes.cpp's and whose start and stop
// are http_server.cpp's.
#pragma once

#include <httplib.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <ctime>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "http/http_connection.hpp"
#include "spillway/http/http_server.hpp"

namespace spillway::http {
namespace detail {

using nlohmann::json;

constexpr size_t kMaxBody = size_t{1} << 20;
// A refused body of a declared length up to this is read and dropped, so that a client that
// writes all of it before reading sees its answer; a longer one ends the connection.
constexpr int64_t kMaxDiscard = int64_t{64} << 20;

// ---- the protocol (http_protocol.cpp) ---------------------------------------------------

std::string dump(const json& j);
void send_error(httplib::Response& res, int status, const std::string& message,
                const std::string& type, const std::string& param, const std::string& code);

// A request field the server rejects, with the field's name.
struct FieldError {
  std::string field, message;
};

// A request's text handling (Note [Text out]): the model's tokenizer when the model has one
// (text prompts encoded by it, the output decoded), and its stop strings.
struct TextMode {
  const inference::ModelText* model = nullptr;  // null: bytes (a byte-level model) or ids
  std::vector<std::string> stop;
};

inference::CompletionRequest parse_request(const json& body, const inference::ServingEngine& engine,
                                           bool* stream, bool* include_usage, TextMode* tm);

std::string token_text(const std::vector<int32_t>& tokens, size_t from, int vocab);
json logprobs_json(const std::vector<int32_t>& tokens, size_t from,
                   const std::vector<inference::TokenLogprobs>& lps, int vocab,
                   size_t first_offset = 0);
json extension(const inference::Completion& c, uint64_t seed);
json usage_json(size_t prompt_tokens, size_t completion_tokens);
std::string finish_reason(const inference::Completion& c, bool text_stop);
json whole_response(const std::string& id, const char* object, std::time_t created,
                    const std::string& model, const json& choice, json usage, json extension);

// ---- text out and server-sent events (http_streaming.cpp) ------------------------------

// A tokenizer model's output as text while its tokens come, ended by a stop string (Note
// [Text out] in http_streaming.cpp).
class TextOut {
 public:
  TextOut(const text::Tokenizer& t, std::vector<std::string> stops)
      : dec_(t, true), stops_(std::move(stops)) {}
  std::string push(int32_t id) { return feed(dec_.push(id), false); }
  std::string finish() { return feed(dec_.finish(), true); }
  bool stopped() const { return stopped_; }

 private:
  std::string feed(const std::string& piece, bool last);

  text::StreamDecoder dec_;
  std::vector<std::string> stops_;
  std::string pending_;
  bool stopped_ = false;
};

// What every event of one streamed response carries: its id, object, creation time and
// model; usage only when the request asked for it (OpenAI: null but in the last chunk).
struct EventHead {
  std::string id;
  std::string object;
  std::time_t created = 0;
  std::string model;
  bool include_usage = false;
  bool write(httplib::DataSink& sink, const json& choices, const json& usage) const;

  // After the last choice's event: the usage event when asked for, then [DONE].
  bool end(httplib::DataSink& sink, const inference::Completion& c, size_t prompt_tokens,
           size_t completion_tokens, bool* finished) const;
};

}  // namespace detail

struct HttpServer::Impl {
  inference::ServingEngine& engine;
  HttpOptions o;
  Server svr;
  int port = 0;
  std::atomic<int64_t> next_id{1};
  std::time_t created = std::time(nullptr);
  // Responses still being written (a stream's last bytes come after its completion ends).
  std::mutex mu;
  std::condition_variable cv;
  int64_t writing = 0;
  std::mutex run_mu;
  std::condition_variable run_cv;
  bool run_done = true;
  bool stop_requested = false;

  explicit Impl(inference::ServingEngine& e, const HttpOptions& opt) : engine(e), o(opt) {}

  void begin_write() {
    std::lock_guard lk(mu);
    ++writing;
  }
  void end_write() {
    {
      std::lock_guard lk(mu);
      --writing;
    }
    cv.notify_all();
  }
  // A streamed response's release (begin_write before it): a stream closed before its end
  // (the client went away) cancels its completion.
  auto stream_closed(std::shared_ptr<inference::Completion> c, std::shared_ptr<bool> finished) {
    return [this, c = std::move(c), finished = std::move(finished)](bool) {
      if (!*finished) c->cancel();
      end_write();
    };
  }

  void completions(httplib::Response& res, const httplib::ContentReader& reader);
  void chat_completions(httplib::Response& res, const httplib::ContentReader& reader);
  // The body, at most kMaxBody bytes, into *text; false: answered (413 or 400).
  bool read_body(httplib::Response& res, const httplib::ContentReader& reader, std::string* text);
  // Answers a refused submit; true: accepted.
  bool accepted(httplib::Response& res, const inference::SubmitResult& r);
  // A request answered whole: its tokens, and with a TextOut their text (its stop string
  // ending it: the request is then cancelled, text_stop).
  struct Whole {
    std::vector<int32_t> tokens;
    std::string text;
    bool text_stop = false;
  };
  // Waits for a request answered whole (Note [Client gone]: a client gone meanwhile cancels
  // it); false: already answered (499 for the gone client, 503 when it did not complete).
  bool wait_whole(httplib::Response& res, inference::Completion& c, detail::TextOut* tout,
                  Whole* w);
  // The server-sent events of a completion, and of a chat completion's deltas
  // (http_streaming.cpp).
  void stream_completion(httplib::Response& res, const std::shared_ptr<inference::Completion>& c,
                         detail::EventHead head, const inference::CompletionRequest& q, int vocab,
                         const detail::TextMode& tm);
  void stream_chat(httplib::Response& res, const std::shared_ptr<inference::Completion>& c,
                   detail::EventHead head, const inference::CompletionRequest& q,
                   const std::shared_ptr<detail::TextOut>& tout);
  void routes();
};

}  // namespace spillway::http
