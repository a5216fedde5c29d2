// The HTTP endpoint's protocol (Note [HTTP endpoints] in spillway/http/http_server.hpp): OpenAI's
// completions request checked field by field (a field it does not know, or one it does not
// implement set to other than its default, is refused naming it), and the JSON of errors and
// of responses: choices, logprobs, usage and the "spillway" extension.
#include <fmt/format.h>

#include <algorithm>
#include <mutex>
#include <random>

#include "http/http_server_impl.hpp"
#include "spillway/core/error.hpp"

namespace spillway::http::detail {

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

namespace {

std::string type_name(const json& v) {
  return v.type_name();
}

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

}  // namespace

// The completion request from its JSON body, checked field by field.
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
                   size_t first_offset) {
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

}  // namespace spillway::http::detail
