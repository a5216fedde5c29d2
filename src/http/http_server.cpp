// The OpenAI-compatible HTTP endpoint (spillway/http_server.hpp, Note [HTTP endpoints]).
#include "spillway/http_server.hpp"

#include <fmt/format.h>
#include <httplib.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <ctime>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <thread>

#include "core/json_keys.hpp"
#include "http/http_connection.hpp"
#include "spillway/error.hpp"

namespace spillway::http {
namespace {

using nlohmann::json;

constexpr size_t kMaxBody = size_t{1} << 20;
// A refused body of a declared length up to this is read and dropped, so that a client that
// writes all of it before reading sees its answer; a longer one ends the connection.
constexpr int64_t kMaxDiscard = int64_t{64} << 20;

std::string dump(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

void send_error(httplib::Response& res, int status, const std::string& message,
                const std::string& type, const std::string& param, const std::string& code) {
  json e = {{"message", message}, {"type", type}, {"param", nullptr}, {"code", nullptr}};
  if (!param.empty()) e["param"] = param;
  if (!code.empty()) e["code"] = code;
  res.status = status;
  res.set_content(dump(json{{"error", e}}), "application/json");
}

// A request field the server rejects, with the field's name.
struct FieldError {
  std::string field, message;
};

std::string type_name(const json& v) {
  return v.type_name();
}

// The completion request from its JSON body, checked field by field.
// The fields of OpenAI's completions request. Any other is refused, as OpenAI's API does
// (a misspelt "max_token" must not be served as the default).
constexpr const char* kKnownFields[] = {"model",
                                        "prompt",
                                        "max_tokens",
                                        "temperature",
                                        "seed",
                                        "stream",
                                        "stop",
                                        "n",
                                        "best_of",
                                        "top_p",
                                        "presence_penalty",
                                        "echo",
                                        "logprobs",
                                        "frequency_penalty",
                                        "logit_bias",
                                        "suffix",
                                        "user",
                                        "stream_options"};

// Note [Text out]: a tokenizer model's output as text while its tokens come: detokenized
// incrementally (text::StreamDecoder, special tokens left out), then held back while its end
// could begin a stop string; a stop string found ends the text before it (the request is
// then cancelled: nothing after it is generated). The pieces never split a character.
class TextOut {
 public:
  TextOut(const text::Tokenizer& t, std::vector<std::string> stops)
      : dec_(t, true), stops_(std::move(stops)) {}
  std::string push(int32_t id) { return feed(dec_.push(id), false); }
  std::string finish() { return feed(dec_.finish(), true); }
  bool stopped() const { return stopped_; }

 private:
  std::string feed(const std::string& piece, bool last) {
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
  text::StreamDecoder dec_;
  std::vector<std::string> stops_;
  std::string pending_;
  bool stopped_ = false;
};

// A request's text handling (Note [Text out]): the model's tokenizer when the model has one
// (text prompts encoded by it, the output decoded), and its stop strings.
struct TextMode {
  const inference::ModelText* model = nullptr;  // null: bytes (a byte-level model) or ids
  std::vector<std::string> stop;
};

inference::CompletionRequest parse_request(const json& body, const inference::ServingEngine& engine,
                                           bool* stream, bool* include_usage, TextMode* tm) {
  if (!body.is_object()) throw FieldError{"", "the request body must be a JSON object"};
  std::string unknown, first_unknown;
  for (const auto& [key, value] : body.items()) {
    if (std::find_if(std::begin(kKnownFields), std::end(kKnownFields),
                     [&k = key](const char* f) { return k == f; }) != std::end(kKnownFields))
      continue;
    if (first_unknown.empty()) first_unknown = key;
    unknown += (unknown.empty() ? "'" : ", '") + key + "'";
  }
  if (!unknown.empty())
    throw FieldError{first_unknown,
                     fmt::format("unrecognized request argument(s) supplied: {}", unknown)};
  inference::CompletionRequest q;
  if (!body.contains("model")) throw FieldError{"model", "'model' is required"};
  if (!body["model"].is_string())
    throw FieldError{"model", "'model' must be a string, not " + type_name(body["model"])};
  q.model = body["model"].get<std::string>();
  if (!body.contains("prompt")) throw FieldError{"prompt", "'prompt' is required"};
  const json& p = body["prompt"];
  int vocab = 0;
  try {
    vocab = engine.config(q.model).vocab;
  } catch (const Error&) {
    vocab = 0;  // the engine answers the unknown model (404)
  }
  const inference::ModelText* mt = engine.text(q.model);
  if (mt != nullptr && mt->tokenizer) {
    tm->model = mt;
    q.eos = mt->eos;  // Note [Model text]
  }
  if (p.is_string() && tm->model != nullptr) {
    // The checkpoint's own tokenizer, its special tokens (a BOS) added, as vLLM does.
    try {
      q.prompt = tm->model->tokenizer->encode(p.get<std::string>(), true);
    } catch (const Error& e) {
      throw FieldError{"prompt", e.what()};
    }
  } else if (p.is_string()) {
    if (vocab != 0 && vocab < 256)
      throw FieldError{"prompt", fmt::format("model {} has a vocabulary of {} tokens, not bytes: "
                                             "send the prompt as an array of token ids",
                                             q.model, vocab)};
    for (unsigned char ch : p.get<std::string>()) q.prompt.push_back(ch);
  } else if (p.is_array()) {
    for (size_t i = 0; i < p.size(); ++i) {
      if (p[i].is_string() || p[i].is_array())
        throw FieldError{"prompt",
                         "one prompt per request: an array of prompts (a batch) is not "
                         "supported"};
      if (!p[i].is_number_integer())
        throw FieldError{"prompt", fmt::format("prompt[{}] must be an integer token id, not {}", i,
                                               type_name(p[i]))};
      const auto v = p[i].get<int64_t>();
      if (v < 0 || v > INT32_MAX)
        throw FieldError{"prompt", fmt::format("prompt[{}] = {} is not a token id", i, v)};
      q.prompt.push_back(static_cast<int32_t>(v));
    }
  } else {
    throw FieldError{"prompt",
                     "'prompt' must be a string or an array of token ids, not " + type_name(p)};
  }
  if (body.contains("max_tokens") && !body["max_tokens"].is_null()) {
    const json& v = body["max_tokens"];
    if (!v.is_number_integer())
      throw FieldError{"max_tokens", "'max_tokens' must be an integer, not " + type_name(v)};
    const int64_t n =
        v.is_number_unsigned() && v.get<uint64_t>() > INT64_MAX ? INT64_MAX : v.get<int64_t>();
    const int64_t most = engine.options().max_context - static_cast<int64_t>(q.prompt.size());
    if (n < 1) throw FieldError{"max_tokens", fmt::format("'max_tokens' is {}; must be >= 1", n)};
    if (n > most)
      throw FieldError{"max_tokens",
                       fmt::format("'max_tokens' is {}; the maximum for this prompt is {} (the "
                                   "server holds {} tokens per request, and the prompt has {})",
                                   n, std::max<int64_t>(most, 0), engine.options().max_context,
                                   q.prompt.size())};
    q.max_tokens = static_cast<int>(n);
  }
  q.temperature = 1.0;
  if (body.contains("temperature") && !body["temperature"].is_null()) {
    const json& v = body["temperature"];
    if (!v.is_number())
      throw FieldError{"temperature", "'temperature' must be a number, not " + type_name(v)};
    q.temperature = v.get<double>();
    if (!(q.temperature >= 0.0 && q.temperature <= 2.0))
      throw FieldError{"temperature",
                       fmt::format("'temperature' is {}; must be in [0, 2]", q.temperature)};
  }
  if (body.contains("seed") && !body["seed"].is_null()) {
    const json& v = body["seed"];
    if (!v.is_number_integer())
      throw FieldError{"seed", "'seed' must be an integer, not " + type_name(v)};
    q.seed = v.is_number_unsigned() ? v.get<uint64_t>() : static_cast<uint64_t>(v.get<int64_t>());
  } else {
    static std::random_device rd;
    static std::mutex rd_mu;
    std::lock_guard lk(rd_mu);
    q.seed = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  }
  *stream = false;
  if (body.contains("stream") && !body["stream"].is_null()) {
    if (!body["stream"].is_boolean())
      throw FieldError{"stream", "'stream' must be a boolean, not " + type_name(body["stream"])};
    *stream = body["stream"].get<bool>();
  }
  *include_usage = false;
  if (body.contains("stream_options") && !body["stream_options"].is_null()) {
    const json& so = body["stream_options"];
    if (!*stream)
      throw FieldError{"stream_options", "'stream_options' is only allowed when 'stream' is true"};
    if (!so.is_object())
      throw FieldError{"stream_options",
                       "'stream_options' must be an object, not " + type_name(so)};
    for (const auto& [key, value] : so.items()) {
      if (key != "include_usage")
        throw FieldError{"stream_options",
                         fmt::format("stream_options: unrecognized argument '{}'", key)};
      if (!value.is_boolean())
        throw FieldError{
            "stream_options",
            "'stream_options.include_usage' must be a boolean, not " + type_name(value)};
      *include_usage = value.get<bool>();
    }
  }
  // Fields of the API this server does not implement: accepted only at their default.
  auto only_default = [&](const char* field, auto&& is_default) {
    if (body.contains(field) && !body[field].is_null() && !is_default(body[field]))
      throw FieldError{field, fmt::format("'{}' = {} is not supported by spillway serve (only "
                                          "its default)",
                                          field, dump(body[field]))};
  };
  auto equals = [](double d) { return [d](const json& v) { return v.is_number() && v == d; }; };
  only_default("n", equals(1));
  only_default("best_of", equals(1));
  if (body.contains("top_p") && !body["top_p"].is_null()) {  // Note [Sampling]
    const json& v = body["top_p"];
    if (!v.is_number()) throw FieldError{"top_p", "'top_p' must be a number, not " + type_name(v)};
    q.top_p = v.get<double>();
    if (!(q.top_p > 0.0 && q.top_p <= 1.0))
      throw FieldError{"top_p", fmt::format("'top_p' is {}; must be in (0, 1]", q.top_p)};
  }
  only_default("presence_penalty", equals(0));
  only_default("frequency_penalty", equals(0));
  only_default("echo", [](const json& v) { return v.is_boolean() && !v.get<bool>(); });
  if (body.contains("logprobs") && !body["logprobs"].is_null()) {  // Note [Logprobs]
    const json& v = body["logprobs"];
    if (!v.is_number_integer())
      throw FieldError{"logprobs", "'logprobs' must be an integer, not " + type_name(v)};
    const int64_t n = v.get<int64_t>();
    if (n < 0 || n > inference::kMaxLogprobs)
      throw FieldError{"logprobs", fmt::format("'logprobs' is {}; must be in [0, {}]", n,
                                               inference::kMaxLogprobs)};
    q.logprobs = static_cast<int>(n);
  }
  only_default("suffix",
               [](const json& v) { return v.is_string() && v.get<std::string>().empty(); });
  if (body.contains("stop") && !body["stop"].is_null()) {
    // A string or up to 4 of them, each its bytes as tokens (a byte-level model's); or, as
    // a prompt may be, arrays of token ids.
    const json& v = body["stop"];
    const json list = v.is_string() ? json::array({v}) : v;
    if (!list.is_array())
      throw FieldError{"stop",
                       "'stop' must be a string or an array of strings, not " + type_name(v)};
    for (size_t i = 0; i < list.size(); ++i) {
      std::vector<int32_t> seq;
      if (list[i].is_string() && tm->model != nullptr) {  // Note [Text out]: matched in text
        if (list[i].get<std::string>().empty())
          throw FieldError{"stop", fmt::format("stop[{}] is empty", i)};
        if (tm->stop.size() + q.stop.size() >= 4)
          throw FieldError{"stop", "at most 4 stop sequences"};
        tm->stop.push_back(list[i].get<std::string>());
        continue;
      }
      if (list[i].is_string()) {
        for (unsigned char ch : list[i].get<std::string>()) seq.push_back(ch);
      } else if (list[i].is_array()) {
        for (const json& t : list[i]) {
          if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() > INT32_MAX)
            throw FieldError{"stop", fmt::format("stop[{}] holds {}, not a token id", i, dump(t))};
          seq.push_back(static_cast<int32_t>(t.get<int64_t>()));
        }
      } else {
        throw FieldError{"stop", fmt::format("stop[{}] must be a string or an array of token "
                                             "ids, not {}",
                                             i, type_name(list[i]))};
      }
      if (seq.empty()) throw FieldError{"stop", fmt::format("stop[{}] is empty", i)};
      q.stop.push_back(std::move(seq));
    }
  }
  only_default("logit_bias", [](const json& v) { return v.is_object() && v.empty(); });
  return q;
}

std::string token_text(const std::vector<int32_t>& tokens, size_t from, int vocab) {
  std::string s;
  if (vocab > 256) return s;  // not a byte-level model: token_ids only
  for (size_t i = from; i < tokens.size(); ++i) s.push_back(static_cast<char>(tokens[i]));
  return s;
}

// Note [Logprobs]: OpenAI's completions logprobs of tokens[from, ...): each token's text
// (a byte-level model's byte; else "token_id:N", as vLLM writes ids), its log-probability,
// the top entries by text, and each token's offset in the returned text; the top entries
// also by id (top_logprob_ids: [[id, logprob], ...], texts of different tokens may
// coincide).
json logprobs_json(const std::vector<int32_t>& tokens, size_t from,
                   const std::vector<inference::TokenLogprobs>& lps, int vocab,
                   size_t first_offset = 0) {
  const auto text = [&](int32_t t) {
    return vocab > 256 ? fmt::format("token_id:{}", t) : token_text({t}, 0, vocab);
  };
  json toks = json::array(), lp = json::array(), top = json::array(), ids = json::array(),
       offsets = json::array();
  size_t offset = first_offset;
  for (size_t i = 0; i < lps.size() && from + i < tokens.size(); ++i) {
    const int32_t t = tokens[from + i];
    toks.push_back(text(t));
    lp.push_back(lps[i].logprob);
    json by_text = json::object(), by_id = json::array();
    for (const auto& [id, l] : lps[i].top) {
      if (!by_text.contains(text(id))) by_text[text(id)] = l;
      by_id.push_back(json::array({id, l}));
    }
    top.push_back(std::move(by_text));
    ids.push_back(std::move(by_id));
    offsets.push_back(offset);
    offset += vocab > 256 ? 0 : 1;
  }
  return {{"tokens", toks},
          {"token_logprobs", lp},
          {"top_logprobs", top},
          {"text_offset", offsets},
          {"top_logprob_ids", ids}};
}

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

// The response's "spillway" extension: how the server ran the request.
// A time not measured (TPOT with one token) is null.
json extension(const inference::Completion& c, uint64_t seed) {
  auto ms = [](double v) { return v < 0 ? json(nullptr) : json(v); };
  return {{"seed", seed},
          {"slice", c.slice()},
          {"ttft_ms", ms(c.ttft_ms())},
          {"tpot_ms", ms(c.tpot_ms())},
          {"switched", c.switched()},
          {"cold", c.cold()}};
}

// OpenAI's usage object.
json usage_json(size_t prompt_tokens, size_t completion_tokens) {
  return {{"prompt_tokens", prompt_tokens},
          {"completion_tokens", completion_tokens},
          {"total_tokens", prompt_tokens + completion_tokens}};
}

// A choice's finish reason: "stop" when a stop string ended it in text (Note [Text out]),
// else the engine's.
std::string finish_reason(const inference::Completion& c, bool text_stop) {
  return text_stop ? std::string("stop") : c.finish_reason();
}

// A whole (not streamed) response of one choice.
json whole_response(const std::string& id, const char* object, std::time_t created,
                    const std::string& model, const json& choice, json usage, json extension) {
  return {{"id", id},
          {"object", object},
          {"created", created},
          {"model", model},
          {"choices", json::array({choice})},
          {"usage", std::move(usage)},
          {"spillway", std::move(extension)}};
}

// What every event of one streamed response carries: its id, object, creation time and
// model; usage only when the request asked for it (OpenAI: null but in the last chunk).
struct EventHead {
  std::string id;
  std::string object;
  std::time_t created = 0;
  std::string model;
  bool include_usage = false;
  bool write(httplib::DataSink& sink, const json& choices, const json& usage) const {
    json ev = {{"id", id},
               {"object", object},
               {"created", created},
               {"model", model},
               {"choices", choices}};
    if (include_usage) ev["usage"] = usage;
    const std::string line = "data: " + dump(ev) + "\n\n";
    return sink.write(line.data(), line.size());
  }
  // After the last choice's event: the usage event when asked for, then [DONE].
  bool end(httplib::DataSink& sink, const inference::Completion& c, size_t prompt_tokens,
           size_t completion_tokens, bool* finished) const {
    if (include_usage && !write(sink, json::array(), usage_json(prompt_tokens, completion_tokens)))
      return false;
    return end_stream(sink, c, false, finished);
  }
};

}  // namespace

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
  bool wait_whole(httplib::Response& res, inference::Completion& c, TextOut* tout, Whole* w);
  void routes();
};

void HttpServer::Impl::completions(httplib::Response& res, const httplib::ContentReader& reader) {
  // Note [One count per request]: a refusal before the engine's submit() is counted here.
  auto refuse = [&](int status, const std::string& message, const std::string& param,
                    const std::string& code) {
    engine.count_outcome("invalid");
    send_error(res, status, message, "invalid_request_error", param, code);
  };
  // The body, at most kMaxBody bytes however it is framed (a chunked body has no length to
  // check up front); a body not read to its end closes the connection after the answer.
  std::string text;
  if (!read_body(res, reader, &text)) return;
  json body;
  try {
    body = json::parse(text);
  } catch (const json::exception& e) {
    refuse(400, fmt::format("the request body is not valid JSON: {}", e.what()), "", "");
    return;
  }
  try {
    refuse_duplicate_keys(text, "the request body", "");  // Note [Duplicate keys]
  } catch (const Error& e) {
    refuse(400, e.what(), "", "");
    return;
  }
  inference::CompletionRequest q;
  bool stream = false, include_usage = false;
  TextMode tm;
  try {
    q = parse_request(body, engine, &stream, &include_usage, &tm);
  } catch (const FieldError& e) {
    refuse(400, e.message, e.field, "");
    return;
  }
  inference::SubmitResult r = engine.submit(q);
  if (!accepted(res, r)) return;
  const int vocab = engine.config(q.model).vocab;
  const std::string id = fmt::format("cmpl-{}", next_id++);
  const std::time_t now = std::time(nullptr);
  std::shared_ptr<inference::Completion> c = r.completion;
  if (!stream) {
    std::unique_ptr<TextOut> tout;  // Note [Text out]: a tokenizer model's text
    if (tm.model != nullptr) tout = std::make_unique<TextOut>(*tm.model->tokenizer, tm.stop);
    Whole w;
    if (!wait_whole(res, *c, tout.get(), &w)) return;
    const std::vector<int32_t>& tokens = w.tokens;
    const std::string& out_text = w.text;
    const bool text_stop = w.text_stop;
    json choice = {
        {"index", 0},
        {"text", tout ? out_text : token_text(tokens, 0, vocab)},
        {"token_ids", tokens},
        {"logprobs", q.logprobs < 0
                         ? json(nullptr)
                         : logprobs_json(tokens, 0, c->logprobs(0, tokens.size()), vocab)},
        {"finish_reason", finish_reason(*c, text_stop)}};
    res.set_content(
        dump(whole_response(id, "text_completion", now, q.model, choice,
                            usage_json(q.prompt.size(), tokens.size()), extension(*c, q.seed))),
        "application/json");
    return;
  }
  // Server-sent events: one per token as it comes, a last one with the finish reason, then
  // [DONE]. The handler's thread waits on the completion; the slice never waits on it.
  begin_write();
  auto sent = std::make_shared<size_t>(0);
  auto finished = std::make_shared<bool>(false);
  std::shared_ptr<TextOut> tout;  // Note [Text out]
  if (tm.model != nullptr) tout = std::make_shared<TextOut>(*tm.model->tokenizer, tm.stop);
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      [c, sent, finished, head = EventHead{id, "text_completion", now, q.model, include_usage},
       vocab, seed = q.seed, tout, logprobs = q.logprobs,
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

bool HttpServer::Impl::read_body(httplib::Response& res, const httplib::ContentReader& reader,
                                 std::string* text) {
  bool too_large = false;
  const bool read = reader([&](const char* data, size_t n) {
    if (text->size() + n > kMaxBody) {
      too_large = true;
      return false;
    }
    text->append(data, n);
    return true;
  });
  if (read) return true;
  if (current_connection() != nullptr) current_connection()->close_after = true;
  engine.count_outcome("invalid");
  if (too_large || res.status == 413)
    send_error(res, 413, fmt::format("the request body is over {} bytes", kMaxBody),
               "invalid_request_error", "", "too_large");
  else
    send_error(res, 400, "the request body could not be read to its end", "invalid_request_error",
               "", "");
  return false;
}

bool HttpServer::Impl::wait_whole(httplib::Response& res, inference::Completion& c, TextOut* tout,
                                  Whole* w) {
  // Note [Client gone]: while it waits, the handler looks at its connection; a client that
  // went away cancels its request (the slice stops at its next iteration).
  inference::Completion::State st = inference::Completion::State::kRunning;
  ConnectionStream* conn = current_connection();
  size_t fed = 0;
  const auto feed = [&] {
    if (tout == nullptr) return;
    while (fed < w->tokens.size()) w->text += tout->push(w->tokens[fed++]);
    if (tout->stopped() && !c.cancelled()) c.cancel("stop");
  };
  while ((st = c.wait_tokens_for(w->tokens.size(), &w->tokens, std::chrono::milliseconds(50))) ==
         inference::Completion::State::kRunning) {
    feed();
    if (conn != nullptr && !c.cancelled() && conn->peer_closed()) {
      c.cancel();
      conn->close_after = true;
    }
  }
  feed();
  w->text_stop = tout != nullptr && tout->stopped();
  if (tout != nullptr && !w->text_stop) w->text += tout->finish();
  if (st == inference::Completion::State::kCancelled && !w->text_stop && conn != nullptr &&
      conn->close_after) {
    res.status = 499;  // nobody reads it: the connection is closed after it
    return false;
  }
  if (st != inference::Completion::State::kDone && !w->text_stop) {
    send_error(res, 503, c.error().empty() ? "the request did not complete" : c.error(),
               "server_unavailable", "", "unavailable");
    return false;
  }
  return true;
}

bool HttpServer::Impl::accepted(httplib::Response& res, const inference::SubmitResult& r) {
  switch (r.status) {
    case inference::SubmitStatus::kAccepted:
      return true;
    case inference::SubmitStatus::kInvalid:
      send_error(res, 400, r.message, "invalid_request_error", r.field, "");
      return false;
    case inference::SubmitStatus::kUnknownModel:
      send_error(res, 404, r.message, "invalid_request_error", "model", "model_not_found");
      return false;
    case inference::SubmitStatus::kOverloaded:
      res.set_header("Retry-After", "1");
      send_error(res, 429, r.message, "server_overloaded", "", "overloaded");
      return false;
    case inference::SubmitStatus::kDraining:
      send_error(res, 503, r.message, "server_unavailable", "", "draining");
      return false;
    case inference::SubmitStatus::kUnavailable:
      send_error(res, 503, r.message, "server_unavailable", r.field, "unavailable");
      return false;
  }
  return false;
}

// Note [Chat completions]: OpenAI's /v1/chat/completions for a model with a tokenizer and a
// chat template (Note [Model text]): the messages (and tools, and chat_template_kwargs as
// vLLM takes them) rendered by the model's template with add_generation_prompt, as
// transformers' apply_chat_template renders them, then encoded without added special
// tokens (the template writes its own BOS); the sampling fields are the completions
// endpoint's (max_completion_tokens or max_tokens; default: the rest of the context); the
// reply is the assistant's text, detokenized as it comes (Note [Text out]), ending at an EOS
// (finish_reason "stop"), a stop string ("stop") or max tokens ("length").
void HttpServer::Impl::chat_completions(httplib::Response& res,
                                        const httplib::ContentReader& reader) {
  auto refuse = [&](int status, const std::string& message, const std::string& param,
                    const std::string& code) {
    engine.count_outcome(status == 404 ? "unknown_model" : "invalid");
    send_error(res, status, message, "invalid_request_error", param, code);
  };
  std::string raw;
  if (!read_body(res, reader, &raw)) return;
  nlohmann::ordered_json body;
  try {
    body = nlohmann::ordered_json::parse(raw);
  } catch (const nlohmann::ordered_json::exception& e) {
    refuse(400, fmt::format("the request body is not valid JSON: {}", e.what()), "", "");
    return;
  }
  try {
    refuse_duplicate_keys(raw, "the request body", "");  // Note [Duplicate keys]
  } catch (const Error& e) {
    refuse(400, e.what(), "", "");
    return;
  }
  if (!body.is_object()) {
    refuse(400, "the request body must be a JSON object", "", "");
    return;
  }
  static const std::set<std::string> kChatOnly = {
      "messages",        "max_completion_tokens", "tools",
      "tool_choice",     "parallel_tool_calls",   "chat_template_kwargs",
      "response_format", "top_logprobs",          "logprobs"};
  static const std::set<std::string> kShared = {
      "model", "max_tokens",       "temperature",       "top_p",
      "seed",  "stream",           "stream_options",    "stop",
      "n",     "presence_penalty", "frequency_penalty", "logit_bias",
      "user"};
  for (const auto& [key, value] : body.items()) {
    if (kChatOnly.count(key) == 0 && kShared.count(key) == 0) {
      refuse(400, fmt::format("unrecognized request argument(s) supplied: '{}'", key), key, "");
      return;
    }
  }
  if (!body.contains("model") || !body["model"].is_string()) {
    refuse(400, "'model' is required (a string)", "model", "");
    return;
  }
  const std::string model = body["model"].get<std::string>();
  const inference::ModelText* mt = engine.text(model);
  if (mt == nullptr) {
    refuse(404, fmt::format("model '{}' is not served", model), "model", "model_not_found");
    return;
  }
  if (!mt->tokenizer || !mt->chat) {
    refuse(400,
           fmt::format("model '{}' serves no chat: {}", model,
                       !mt->tokenizer ? mt->unavailable : mt->chat_unavailable),
           "model", "");
    return;
  }
  const auto only = [&](const char* field, auto&& ok) {
    if (body.contains(field) && !body[field].is_null() && !ok(body[field])) {
      refuse(400,
             fmt::format("'{}' = {} is not supported by spillway serve (only its default)", field,
                         body[field].dump()),
             field, "");
      return false;
    }
    return true;
  };
  if (!only("logprobs", [](const auto& v) { return v.is_boolean() && !v.template get<bool>(); }) ||
      !only("top_logprobs", [](const auto& v) { return v.is_number() && v == 0; }) ||
      !only("response_format", [](const auto& v) {
        return v.is_object() && v.value("type", std::string()) == "text";
      }))
    return;
  if (!body.contains("messages") || !body["messages"].is_array() || body["messages"].empty()) {
    refuse(400, "'messages' is required: a non-empty array of messages", "messages", "");
    return;
  }
  for (size_t i = 0; i < body["messages"].size(); ++i) {
    const auto& m = body["messages"][i];
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string()) {
      refuse(400, fmt::format("messages[{}] must be an object with a string 'role'", i), "messages",
             "");
      return;
    }
  }
  // The template's context, as transformers passes it.
  nlohmann::ordered_json ctx = {
      {"messages", body["messages"]}, {"tools", body.contains("tools") ? body["tools"] : nullptr},
      {"documents", nullptr},         {"add_generation_prompt", true},
      {"bos_token", mt->bos_token},   {"eos_token", mt->eos_token}};
  if (body.contains("chat_template_kwargs") && !body["chat_template_kwargs"].is_null()) {
    if (!body["chat_template_kwargs"].is_object()) {
      refuse(400, "'chat_template_kwargs' must be an object", "chat_template_kwargs", "");
      return;
    }
    for (const auto& [k, v] : body["chat_template_kwargs"].items()) ctx[k] = v;
  }
  std::vector<int32_t> prompt;
  try {
    prompt = mt->tokenizer->encode(mt->chat->render(ctx), false);
  } catch (const Error& e) {
    refuse(400, e.what(), "messages", "");
    return;
  }
  // The sampling fields through the completions endpoint's reader.
  json completion = {{"model", model}, {"prompt", prompt}};
  for (const std::string& k : kShared)
    if (k != "model" && body.contains(k)) completion[k] = json::parse(body[k].dump());
  if (body.contains("max_completion_tokens") && !body["max_completion_tokens"].is_null())
    completion["max_tokens"] = json::parse(body["max_completion_tokens"].dump());
  if (!completion.contains("max_tokens") || completion["max_tokens"].is_null())
    completion["max_tokens"] =
        std::max<int64_t>(1, engine.options().max_context - static_cast<int64_t>(prompt.size()));
  inference::CompletionRequest q;
  bool stream = false, include_usage = false;
  TextMode tm;
  try {
    q = parse_request(completion, engine, &stream, &include_usage, &tm);
  } catch (const FieldError& e) {
    refuse(400, e.message,
           e.field == "max_tokens" && body.contains("max_completion_tokens")
               ? "max_completion_tokens"
               : e.field,
           "");
    return;
  }
  const inference::SubmitResult r = engine.submit(q);
  if (!accepted(res, r)) return;
  const std::string id = fmt::format("chatcmpl-{}", next_id++);
  const std::time_t now = std::time(nullptr);
  std::shared_ptr<inference::Completion> c = r.completion;
  auto tout = std::make_shared<TextOut>(*mt->tokenizer, tm.stop);
  if (!stream) {
    Whole w;
    if (!wait_whole(res, *c, tout.get(), &w)) return;
    const std::string& content = w.text;
    const bool text_stop = w.text_stop;
    const std::vector<int32_t>& tokens = w.tokens;
    const json choice = {{"index", 0},
                         {"message", {{"role", "assistant"}, {"content", content}}},
                         {"logprobs", nullptr},
                         {"finish_reason", finish_reason(*c, text_stop)}};
    res.set_content(
        dump(whole_response(id, "chat.completion", now, model, choice,
                            usage_json(q.prompt.size(), tokens.size()), extension(*c, q.seed))),
        "application/json");
    return;
  }
  begin_write();
  auto sent = std::make_shared<size_t>(0);
  auto finished = std::make_shared<bool>(false);
  auto started = std::make_shared<bool>(false);
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      [c, sent, finished, started,
       head = EventHead{id, "chat.completion.chunk", now, model, include_usage}, seed = q.seed,
       tout, prompt_tokens = q.prompt.size()](size_t, httplib::DataSink& sink) {
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

void HttpServer::Impl::routes() {
  svr.Post("/v1/completions",
           [this](const httplib::Request&, httplib::Response& res,
                  const httplib::ContentReader& reader) { completions(res, reader); });
  svr.Post("/v1/chat/completions",
           [this](const httplib::Request&, httplib::Response& res,
                  const httplib::ContentReader& reader) { chat_completions(res, reader); });
  auto model_object = [this](const inference::ServedModelInfo& m) {
    return json{{"id", m.name},
                {"object", "model"},
                {"created", created},
                {"owned_by", "spillway"},
                {"weight_bytes", m.weight_bytes},
                {"dtype", to_string(m.dtype)},
                {"family", m.family},
                {"vocab_size", m.vocab},
                {"layers", m.layers},
                {"resident", m.resident},
                {"text", m.text}};
  };
  svr.Get("/v1/models", [this, model_object](const httplib::Request&, httplib::Response& res) {
    json data = json::array();
    for (const inference::ServedModelInfo& m : engine.models()) data.push_back(model_object(m));
    res.set_content(dump(json{{"object", "list"}, {"data", data}}), "application/json");
  });
  // One model (the OpenAI client's models.retrieve); a model id may hold '/'.
  svr.Get(R"(/v1/models/(.+))",
          [this, model_object](const httplib::Request& req, httplib::Response& res) {
            const std::string id = req.matches[1];
            for (const inference::ServedModelInfo& m : engine.models())
              if (m.name == id) {
                res.set_content(dump(model_object(m)), "application/json");
                return;
              }
            send_error(res, 404, fmt::format("model '{}' is not served", id),
                       "invalid_request_error", "model", "model_not_found");
          });
  // The server's setup, for clients that model it (spillway replay --live).
  svr.Get("/spillway/setup", [this](const httplib::Request&, httplib::Response& res) {
    const inference::EngineOptions& eo = engine.options();
    json models = json::array();
    for (const inference::ServedModelInfo& m : engine.models())
      models.push_back({{"id", m.name},
                        {"weight_bytes", m.weight_bytes},
                        {"dtype", to_string(m.dtype)},
                        {"family", m.family},
                        {"vocab_size", m.vocab},
                        {"config", m.config_json}});
    res.set_content(dump(json{{"schema", "spillway.serve-setup/1"},
                              {"hardware", eo.hardware},
                              {"profile", eo.profile},
                              {"slices", engine.slices()},
                              {"rate_scale", eo.rate_scale},
                              {"memory_scale", eo.memory_scale},
                              {"host_budget_bytes", eo.host_budget_bytes},
                              {"max_running", eo.max_running},
                              {"max_context", eo.max_context},
                              {"max_step_tokens", eo.max_step_tokens},
                              {"max_waiting", eo.max_waiting},
                              {"ttft_ms", eo.ttft_ms},
                              {"tpot_ms", eo.tpot_ms},
                              {"alpha", eo.alpha},
                              {"link_gbps", engine.link_gbps()},
                              {"models", models}}),
                    "application/json");
  });
  svr.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(inference::prometheus_text(engine.metrics()), "text/plain; version=0.0.4");
  });
  svr.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    const bool draining = engine.draining();
    res.status = draining ? 503 : 200;
    res.set_content(draining ? "draining\n" : "ok\n", "text/plain");
  });
  // Before a body is read: a body this server would not read (compressed: its decoded size is
  // not bounded by its length; or longer than the limit) is refused at once, and the
  // connection closed after the answer (its bytes are not read).
  svr.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    // The declared length, or -1 (none, or chunked).
    int64_t length = -1;
    if (req.has_header("Content-Length")) {
      const std::string len = req.get_header_value("Content-Length");
      char* end = nullptr;
      errno = 0;
      const unsigned long long n = std::strtoull(len.c_str(), &end, 10);
      length = len.empty() || *end != '\0' || errno == ERANGE || n > INT64_MAX
                   ? INT64_MAX
                   : static_cast<int64_t>(n);
    }
    auto refuse = [&](int status, const std::string& message, const std::string& code) {
      if (req.path == "/v1/completions") engine.count_outcome("invalid");
      // The client writes its whole body before it reads an answer: a body of a bounded
      // length is read and dropped so that it sees the answer; any other ends the connection.
      ConnectionStream* conn = current_connection();
      if (conn != nullptr && !conn->discard(length, kMaxDiscard)) conn->close_after = true;
      send_error(res, status, message, "invalid_request_error", "", code);
      return httplib::Server::HandlerResponse::Handled;
    };
    const std::string encoding = req.get_header_value("Content-Encoding");
    if (!encoding.empty() && encoding != "identity")
      return refuse(415,
                    fmt::format("Content-Encoding '{}' is not accepted: send the body as it is "
                                "(at most {} bytes)",
                                encoding, kMaxBody),
                    "unsupported_encoding");
    if (length > static_cast<int64_t>(kMaxBody))
      return refuse(413,
                    fmt::format("the request body is over {} bytes (Content-Length: {})", kMaxBody,
                                req.get_header_value("Content-Length")),
                    "too_large");
    return httplib::Server::HandlerResponse::Unhandled;
  });
  svr.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;  // a handler's own error
    // A known path asked with another method: 405 with the methods it takes.
    static const std::pair<const char*, const char*> kRoutes[] = {{"/v1/completions", "POST"},
                                                                  {"/v1/models", "GET"},
                                                                  {"/spillway/setup", "GET"},
                                                                  {"/metrics", "GET"},
                                                                  {"/health", "GET"}};
    if (res.status == 404) {
      for (const auto& [path, method] : kRoutes) {
        const bool model_path = std::string_view(path) == "/v1/models" &&
                                req.path.rfind("/v1/models/", 0) == 0 && req.path.size() > 11;
        if ((req.path == path || model_path) && req.method != method) {
          res.set_header("Allow", method);
          send_error(res, 405,
                     fmt::format("{} {} is not allowed; {} takes {}", req.method, req.path,
                                 req.path, method),
                     "invalid_request_error", "", "method_not_allowed");
          return;
        }
      }
    }
    if (res.status == 404)
      send_error(res, 404, fmt::format("no endpoint {} {}", req.method, req.path),
                 "invalid_request_error", "", "not_found");
    else if (res.status == 413)
      send_error(res, 413, fmt::format("the request body is over {} bytes", kMaxBody),
                 "invalid_request_error", "", "too_large");
    else
      send_error(res, res.status, fmt::format("HTTP {}", res.status), "invalid_request_error", "",
                 "");
  });
  svr.set_exception_handler(
      [](const httplib::Request&, httplib::Response& res, const std::exception_ptr& ep) {
        std::string what = "internal error";
        try {
          std::rethrow_exception(ep);
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        send_error(res, 500, what, "server_error", "", "");
      });
}

HttpServer::HttpServer(inference::ServingEngine& engine, const HttpOptions& options)
    : impl_(std::make_unique<Impl>(engine, options)) {
  Impl& m = *impl_;
  // A client gone mid-response must be a failed write (the request is cancelled), not a
  // SIGPIPE that ends the process: the library's sends do not ask for MSG_NOSIGNAL.
  ::signal(SIGPIPE, SIG_IGN);
  if (options.port < 0 || options.port > 65535)
    SPILLWAY_FIELD_ERROR("port", options.port, "must be in [0, 65535]");
  int threads = options.threads;
  if (threads <= 0)
    threads = engine.slices() * engine.options().max_running + engine.options().max_waiting + 8;
  m.svr.new_task_queue = [threads] {
    return new httplib::ThreadPool(static_cast<size_t>(threads));
  };
  m.svr.set_payload_max_length(kMaxBody);
  m.svr.set_keep_alive_timeout(2);
  m.routes();
  if (options.port == 0) {
    m.port = m.svr.bind_to_any_port(options.host);
    if (m.port < 0) SPILLWAY_INPUT_ERROR("cannot bind {} to any port", options.host);
  } else {
    if (!m.svr.bind_to_port(options.host, options.port))
      SPILLWAY_INPUT_ERROR("cannot listen on {}:{}: {}", options.host, options.port,
                           bind_error(options.host, options.port));
    m.port = options.port;
  }
  m.svr.deepen_backlog();
}

HttpServer::~HttpServer() {
  stop();
}

int HttpServer::port() const {
  return impl_->port;
}

void HttpServer::run() {
  Impl& m = *impl_;
  {
    std::lock_guard lk(m.run_mu);
    if (m.stop_requested) return;  // stopped before it ran
    m.run_done = false;
  }
  m.svr.listen_after_bind();
  {
    std::lock_guard lk(m.run_mu);
    m.run_done = true;
  }
  m.run_cv.notify_all();
}

int64_t HttpServer::shutdown() {
  Impl& m = *impl_;
  const int64_t drained = m.engine.in_flight();
  m.engine.drain();
  {
    std::unique_lock lk(m.mu);
    m.cv.wait_for(lk, std::chrono::seconds(30), [&] { return m.writing == 0; });
  }
  stop();
  return drained;
}

HttpServer::DrainReport HttpServer::shutdown(std::chrono::milliseconds deadline) {
  Impl& m = *impl_;
  DrainReport r;
  const auto until = std::chrono::steady_clock::now() + deadline;
  r.in_flight = m.engine.in_flight();
  if (!m.engine.drain_for(deadline)) {
    r.cut = m.engine.cancel_all(fmt::format(
        "cancelled: the server shut down and its drain deadline ({} ms) passed", deadline.count()));
    m.engine.drain_for(std::chrono::seconds(5));
  }
  {
    std::unique_lock lk(m.mu);
    m.cv.wait_until(lk, std::max(until, std::chrono::steady_clock::now() + std::chrono::seconds(1)),
                    [&] { return m.writing == 0; });
  }
  stop();
  return r;
}

void HttpServer::stop() {
  Impl& m = *impl_;
  std::unique_lock lk(m.run_mu);
  m.stop_requested = true;
  // httplib's stop() does nothing until its loop runs: repeat it until run() has returned.
  while (!m.run_done) {
    m.svr.stop();
    m.run_cv.wait_for(lk, std::chrono::milliseconds(10));
  }
}

}  // namespace spillway::http
