// A model's chat template (the `chat_template` of its tokenizer_config.json, or a .jinja
// file), rendered as transformers' apply_chat_template renders it with jinja2 (Note [Chat
// templates] in src/text/chat_template.cpp): the subset of Jinja real templates use, with
// transformers' environment (trim_blocks, lstrip_blocks, loop controls, its tojson,
// raise_exception, strftime_now, namespace). A template that uses something outside the
// subset is refused when it is parsed, naming the construct and its line.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace spillway::text {

class ChatTemplate {
 public:
  // Parses `source`; `name` labels it in errors. Throws spillway::Error naming what is not
  // supported and where.
  ChatTemplate(std::string_view source, const std::string& name);
  ~ChatTemplate();
  ChatTemplate(ChatTemplate&&) noexcept;
  ChatTemplate& operator=(ChatTemplate&&) noexcept;
  ChatTemplate(const ChatTemplate&) = delete;
  ChatTemplate& operator=(const ChatTemplate&) = delete;

  // The text for `context` (an object: messages, add_generation_prompt, bos_token,
  // eos_token, tools, ...; its keys' order kept, as tojson shows it). A raise_exception()
  // of the template, or an error of the render (an undefined value used as a string's
  // attribute, a wrong type), throws spillway::Error with the template's message.
  std::string render(const nlohmann::ordered_json& context) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace spillway::text
