// The HTTP endpoint's routes and handlers (Note [HTTP endpoints] in spillway/http/http_server.hpp):
// /v1/completions and /v1/chat/completions (read, checked, submitted to the engine and
// answered whole; a stream's events are http_streaming.cpp's), the models, the setup, the
// metrics and health, and the refusals before a body is read and of unknown paths.
#include <fmt/format.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <set>

#include "core/json_keys.hpp"
#include "http/http_server_impl.hpp"
#include "spillway/core/error.hpp"

namespace spillway::http {

using namespace detail;  // the pieces of http_server_impl.hpp

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
  stream_completion(res, c, EventHead{id, "text_completion", now, q.model, include_usage}, q, vocab,
                    tm);
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
  stream_chat(res, c, EventHead{id, "chat.completion.chunk", now, model, include_usage}, q, tout);
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

}  // namespace spillway::http
