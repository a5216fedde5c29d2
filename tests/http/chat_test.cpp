// /v1/chat/completions (Note [Chat completions], [Text out], [Model text]) through a real
// socket: a tiny-moe checkpoint given a byte-level tokenizer (the 256 byte tokens, no merges:
// ids are bytes) and a small chat template; the reply is the engine's own completion of the
// rendered prompt, decoded, streamed or not; stop strings end it; bad requests, a template's
// raise_exception and a model without a tokenizer are refused naming the field.
// python/tests/test_openai_client.py runs a real tokenizer and template with the OpenAI client.
#include <fstream>

#include "http/http_served.hpp"
#include "spillway/text/tokenizer.hpp"
#include "test_support.hpp"
#include "text/unicode.hpp"

namespace spillway::http::testing {
namespace {

constexpr const char* kTemplate =
    "{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no bad roles here') }}"
    "{% endif %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}";

struct ChatModels {
  spillway::testing::TempDir dir;
  std::vector<ModelFiles> files;
  ChatModels() {
    write_checkpoint("tiny-moe", 1, (dir.path() / "chat").string(), DType::kFp32);
    write_checkpoint("tiny-moe", 2, (dir.path() / "plain").string(), DType::kFp32);
    json vocab = json::object();
    for (int b = 0; b < 256; ++b) vocab[text::byte_to_unicode(static_cast<uint8_t>(b))] = b;
    const json tok = {{"version", "1.0"},
                      {"added_tokens", json::array()},
                      {"normalizer", nullptr},
                      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}}},
                      {"post_processor", nullptr},
                      {"decoder", {{"type", "ByteLevel"}}},
                      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array()}}}};
    std::ofstream(dir.path() / "chat" / "tokenizer.json") << tok.dump();
    std::ofstream(dir.path() / "chat" / "tokenizer_config.json")
        << json{{"chat_template", kTemplate}}.dump();
    files = find_models(dir.path().string());
  }
};

httplib::Result chat(httplib::Client& cli, const json& body) {
  return cli.Post("/v1/chat/completions", body.dump(), "application/json");
}

TEST(ChatCompletions, TheReplyIsTheEnginesCompletionOfTheRenderedPrompt) {
  ChatModels m;
  Served s(m.files, fast("7g.96gb", 0.0));
  httplib::Client cli = s.client();
  const json messages = json::array(
      {{{"role", "system"}, {"content", "be brief"}}, {{"role", "user"}, {"content", "hi"}}});
  // The engine's own greedy completion of the rendered text's bytes, decoded.
  CompletionRequest q;
  q.model = "chat";
  q.prompt = bytes("<system>be brief\n<user>hi\n<assistant>");
  q.max_tokens = 12;
  q.temperature = 0;
  const std::vector<int32_t> ids = complete(s.engine, q);
  const std::string want = s.engine.text("chat")->tokenizer->decode(ids);

  const httplib::Result r = chat(
      cli, {{"model", "chat"}, {"messages", messages}, {"max_tokens", 12}, {"temperature", 0}});
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  ASSERT_EQ(r->status, 200) << r->body;
  const json out = json::parse(r->body);
  EXPECT_EQ(out.at("object"), "chat.completion");
  EXPECT_EQ(out.at("choices")[0].at("message").at("role"), "assistant");
  EXPECT_EQ(out.at("choices")[0].at("message").at("content"), want);
  EXPECT_EQ(out.at("choices")[0].at("finish_reason"), "length");
  EXPECT_EQ(out.at("usage").at("prompt_tokens"), q.prompt.size());
  EXPECT_EQ(out.at("usage").at("completion_tokens"), 12);

  // Streamed: the role first, the content in pieces that add up, the finish reason last.
  const httplib::Result st = chat(cli, {{"model", "chat"},
                                        {"messages", messages},
                                        {"max_completion_tokens", 12},
                                        {"temperature", 0},
                                        {"stream", true}});
  ASSERT_TRUE(st) << httplib::to_string(st.error());
  const std::vector<std::string> events = sse_payloads(st->body);
  ASSERT_GE(events.size(), 3u) << st->body;
  EXPECT_EQ(json::parse(events.front()).at("choices")[0].at("delta").at("role"), "assistant");
  std::string text;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    const json d = json::parse(events[i]).at("choices")[0].at("delta");
    if (d.contains("content")) text += d.at("content").get<std::string>();
  }
  EXPECT_EQ(text, want);
  EXPECT_EQ(json::parse(events[events.size() - 2]).at("choices")[0].at("finish_reason"), "length");
  EXPECT_EQ(events.back(), "[DONE]");

  // A stop string: the text before its first occurrence, "stop". Its byte is the reply's
  // first ASCII one (a whole character) after the start that differs from the first, so
  // that the stop is not at 0, whatever the seed's model writes.
  size_t at = 1;
  while (at < want.size() && (static_cast<unsigned char>(want[at]) >= 0x80 || want[at] == want[0]))
    ++at;
  ASSERT_LT(at, want.size()) << "the fixed seed's reply has a byte to stop at: "
                             << ::testing::PrintToString(
                                    std::vector<unsigned char>(want.begin(), want.end()));
  {
    const std::string stop(1, want[at]);
    const httplib::Result sr = chat(cli, {{"model", "chat"},
                                          {"messages", messages},
                                          {"max_tokens", 12},
                                          {"temperature", 0},
                                          {"stop", stop}});
    ASSERT_TRUE(sr);
    const json so = json::parse(sr->body);
    EXPECT_EQ(so.at("choices")[0].at("message").at("content"), want.substr(0, want.find(stop)));
    EXPECT_EQ(so.at("choices")[0].at("finish_reason"), "stop");
  }
}

TEST(ChatCompletions, BadRequestsAreRefusedNamingTheField) {
  ChatModels m;
  Served s(m.files, fast("7g.96gb", 0.0));
  httplib::Client cli = s.client();
  const json ok = {{"model", "chat"},
                   {"messages", json::array({{{"role", "user"}, {"content", "x"}}})}};
  const auto expect = [&](const json& body, int status, const std::string& param,
                          const std::string& says) {
    const httplib::Result r = chat(cli, body);
    ASSERT_TRUE(r) << httplib::to_string(r.error());
    EXPECT_EQ(r->status, status) << r->body;
    const json e = json::parse(r->body).at("error");
    EXPECT_EQ(e.at("param"), param) << r->body;
    EXPECT_NE(e.at("message").get<std::string>().find(says), std::string::npos) << r->body;
  };
  // A repeated key is refused, not read as its last value: Note [Duplicate keys].
  for (const char* path : {"/v1/chat/completions", "/v1/completions"}) {
    const httplib::Result dup =
        cli.Post(path, R"({"model": "chat", "model": "chat", "prompt": "x", "messages": []})",
                 "application/json");
    ASSERT_TRUE(dup) << httplib::to_string(dup.error());
    EXPECT_EQ(dup->status, 400) << path << " " << dup->body;
    const std::string says = json::parse(dup->body).at("error").at("message");
    EXPECT_NE(says.find("the request body: duplicate key \"model\" at line 1 and line 1"),
              std::string::npos)
        << dup->body;
  }
  json b = ok;
  b.erase("messages");
  expect(b, 400, "messages", "'messages' is required");
  b = ok;
  b["messages"] = json::array({{{"content", "no role"}}});
  expect(b, 400, "messages", "a string 'role'");
  b = ok;
  b["messages"] = json::array({{{"role", "bad"}, {"content", "x"}}});
  expect(b, 400, "messages", "no bad roles here");  // the template's own refusal
  b = ok;
  b["functions"] = json::array();
  expect(b, 400, "functions", "unrecognized request argument");
  b = ok;
  b["model"] = "plain";
  expect(b, 400, "model", "no tokenizer.json");
  b = ok;
  b["model"] = "nope";
  expect(b, 404, "model", "not served");
  b = ok;
  b["logprobs"] = true;
  expect(b, 400, "logprobs", "not supported");
  b = ok;
  b["max_completion_tokens"] = 0;
  expect(b, 400, "max_completion_tokens", "must be >= 1");
  EXPECT_EQ(s.engine.in_flight(), 0);
}

// Note [Duplicate keys]: a model directory's tokenizer_config.json or generation_config.json
// that writes a key twice is refused naming the file, the key and both lines (it would pick
// the template, the special tokens or the EOS ids by the parser's whim).
TEST(ModelText, DuplicateKeysInTheTextConfigsAreRefused) {
  const ChatModels m;
  const std::filesystem::path chat = m.dir.path() / "chat";
  EXPECT_NO_THROW(inference::read_model_text(chat.string()));
  std::ofstream(chat / "tokenizer_config.json", std::ios::trunc)
      << "{\"chat_template\": \"a\",\n \"chat_template\": \"b\"}";
  spillway::testing::expect_error(
      [&] { inference::read_model_text(chat.string()); },
      {"tokenizer_config.json: duplicate key \"chat_template\"", "line 1 and line 2"});
  std::ofstream(chat / "tokenizer_config.json", std::ios::trunc)
      << json{{"chat_template", kTemplate}}.dump();
  std::ofstream(chat / "generation_config.json")
      << "{\"eos_token_id\": 1,\n\n \"eos_token_id\": 2}";
  spillway::testing::expect_error(
      [&] { inference::read_model_text(chat.string()); },
      {"generation_config.json: duplicate key \"eos_token_id\"", "line 1 and line 3"});
}

}  // namespace
}  // namespace spillway::http::testing
