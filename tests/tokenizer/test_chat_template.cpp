// Chat templates against Python jinja2: every case of tests/tokenizer/chat_fixtures (written by
// tools/make_chat_fixtures.py through transformers) must render byte for byte, or fail where Python failed.
// Plus what fixtures cannot show: load-time errors with line numbers, template discovery, runtime error lines.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "../common/temp_dir.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/jinja.h"

namespace lmx::tokenizer {
namespace {

using ordered_json = nlohmann::ordered_json;

// A path relative to the repository root; "../shared/data/..." maps to the build's shared-data directory.
std::string source_path(const std::string& relative) {
  const std::string shared = "../shared/data/";
  if (relative.rfind(shared, 0) == 0) return std::string(LORAMUX_SHARED_DATA) + "/" + relative.substr(shared.size());
  return std::string(LORAMUX_SOURCE_DIR) + "/" + relative;
}

// The published tokenizer_config.json files live in ../shared/data; a build that found none skips.
#define LMX_NEED_SHARED_DATA()                                                                  \
  if (std::string(LORAMUX_SHARED_DATA).empty()) GTEST_SKIP() << "this build found no shared data"

ordered_json read_fixture(const std::string& name) {
  std::ifstream in(source_path("tests/tokenizer/chat_fixtures/" + name));
  EXPECT_TRUE(in) << "missing fixture " << name << " (run tools/make_chat_fixtures.py)";
  std::stringstream ss;
  ss << in.rdbuf();
  return ordered_json::parse(ss.str());
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

// The first differing byte, for readable failures on long prompts.
std::string first_difference(const std::string& want, const std::string& got) {
  std::size_t i = 0;
  while (i < want.size() && i < got.size() && want[i] == got[i]) ++i;
  auto around = [&](const std::string& s) { return s.substr(i < 40 ? 0 : i - 40, 80); };
  return "first difference at byte " + std::to_string(i) + "\n  want: ...'" + around(want) + "'\n  got:  ...'" + around(got) + "'";
}

class ChatFixtures : public ::testing::TestWithParam<std::string> {};

TEST_P(ChatFixtures, MatchesJinja2) {
  LMX_NEED_SHARED_DATA();
  ordered_json doc = read_fixture(GetParam() + ".json");
  std::string override_file = doc["template_file"].is_string() ? source_path(doc["template_file"].get<std::string>()) : "";
  auto chat = load_chat_template(source_path(doc["model_dir"].get<std::string>()), override_file);
  ASSERT_TRUE(chat.ok()) << chat.status().message();
  int checked = 0;
  for (const auto& c : doc["cases"]) {
    SCOPED_TRACE(c["name"].get<std::string>());
    auto rendered = chat->render(c["messages"], c["kwargs"]);
    if (c.contains("error")) {
      EXPECT_FALSE(rendered.ok()) << "jinja2 failed with: " << c["error"] << "\nbut we rendered:\n" << rendered.value();
    } else {
      ASSERT_TRUE(rendered.ok()) << rendered.status().message();
      std::string want = c["expected"].get<std::string>();
      EXPECT_EQ(rendered.value(), want) << first_difference(want, rendered.value());
    }
    ++checked;
  }
  EXPECT_GE(checked, 20);
}

INSTANTIATE_TEST_SUITE_P(Templates, ChatFixtures, ::testing::Values("qwen3", "deepseek-v3", "harmony"));

TEST(Jinja, FeatureCasesMatchJinja2) {
  ordered_json doc = read_fixture("jinja.json");
  for (const auto& c : doc["cases"]) {
    SCOPED_TRACE(c["name"].get<std::string>());
    auto program = jinja::parse(c["template"].get<std::string>(), c["name"].get<std::string>());
    ASSERT_TRUE(program.ok()) << program.status().message();
    jinja::Value vars = jinja::from_json(c["variables"]);
    auto rendered = jinja::render(*program.value(), *vars.object);
    if (c.contains("error")) {
      EXPECT_FALSE(rendered.ok()) << "jinja2 failed with: " << c["error"] << "\nbut we rendered: " << rendered.value();
    } else {
      ASSERT_TRUE(rendered.ok()) << rendered.status().message();
      EXPECT_EQ(rendered.value(), c["expected"].get<std::string>());
    }
  }
}

// Load-time failures name the origin, the line and the construct.
TEST(Jinja, UnsupportedSyntaxFailsAtParseWithLine) {
  struct Case {
    const char* source;
    const char* needle;
  };
  const Case cases[] = {
      {"line1\n{{ x }}\n{{ x | frobnicate }}", "t.jinja:3: unsupported filter 'frobnicate'"},
      {"\n\n\n{% include 'other.jinja' %}", "t.jinja:4: unsupported statement '{% include %}'"},
      {"{% extends 'base' %}", "t.jinja:1: unsupported statement '{% extends %}'"},
      {"{% for x in xs %}\n{{ x }}", "t.jinja:2: unexpected end of template, expected one of: else, endfor"},
      {"a\n{% if x %}\n{% endfor %}", "t.jinja:3: unexpected '{% endfor %}', expected one of: elif, else, endif"},
      {"{% endif %}", "t.jinja:1: unexpected '{% endif %}' outside any block"},
      {"{% for x in xs recursive %}{% endfor %}", "t.jinja:1: unsupported construct: recursive for loop"},
      {"\n{{ x is frob }}", "t.jinja:2: unsupported test 'frob'"},
      {"{% bogus %}", "t.jinja:1: unknown statement '{% bogus %}'"},
      {"\n\n{% break %}", "t.jinja:3: 'break' outside of a for loop"},
      {"{{ f(*args) }}", "t.jinja:1: unsupported construct: *args/**kwargs in a call"},
      {"{{ 'open", "t.jinja:1: unterminated string literal"},
      {"x\n{# never closed", "t.jinja:2: missing end of comment tag"},
      {"{{ (1 }}", "t.jinja:1: unexpected '}'"},
      {"{{ x", "t.jinja:1: unexpected end of template, expected '}}'"},
      {"{{ a ]] }}", "t.jinja:1: unexpected ']'"},
  };
  for (const auto& c : cases) {
    auto parsed = ChatTemplate::parse(c.source, "t.jinja");
    ASSERT_FALSE(parsed.ok()) << c.source;
    EXPECT_NE(parsed.status().message().find(c.needle), std::string::npos)
        << "source: " << c.source << "\nmessage: " << parsed.status().message() << "\nwanted: " << c.needle;
  }
}

TEST(Jinja, RuntimeErrorsNameTheLine) {
  auto chat = ChatTemplate::parse("{% for m in messages %}\n{% if m.role == 'bad' %}\n{{ raise_exception('no bad roles') }}\n{% endif %}\n{% endfor %}", "r.jinja");
  ASSERT_TRUE(chat.ok()) << chat.status().message();
  auto ok = chat->render(ordered_json::parse(R"([{"role": "user", "content": "x"}])"), ordered_json::object());
  ASSERT_TRUE(ok.ok()) << ok.status().message();
  auto bad = chat->render(ordered_json::parse(R"([{"role": "bad", "content": "x"}])"), ordered_json::object());
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(), "r.jinja:3: raise_exception: no bad roles");

  auto strict = ChatTemplate::parse("line one\n{{ messages[0].nope.deeper }}", "s.jinja");
  ASSERT_TRUE(strict.ok());
  auto undefined = strict->render(ordered_json::parse(R"([{"role": "user"}])"), ordered_json::object());
  ASSERT_FALSE(undefined.ok());
  EXPECT_EQ(undefined.status().message(), "s.jinja:2: 'dict object' has no attribute 'nope'");
}

TEST(ChatTemplate, RenderValidatesInput) {
  auto chat = ChatTemplate::parse("{{ messages | length }}", "v.jinja");
  ASSERT_TRUE(chat.ok());
  EXPECT_FALSE(chat->render(ordered_json::object(), ordered_json::object()).ok());
  EXPECT_FALSE(chat->render(ordered_json::array(), ordered_json::object()).ok());
  auto not_object = chat->render(ordered_json::parse(R"([{"role": "user"}, 3])"), ordered_json::object());
  ASSERT_FALSE(not_object.ok());
  EXPECT_NE(not_object.status().message().find("messages[1]"), std::string::npos);
}

// transformers drops None-valued keys and aliases reasoning; tools/documents default to None.
TEST(ChatTemplate, NormalizesLikeTransformers) {
  auto chat = ChatTemplate::parse(
      "{% for m in messages %}{{ m | tojson }};{% endfor %}{{ tools is none }}{{ documents is none }}{{ add_generation_prompt }}", "n.jinja");
  ASSERT_TRUE(chat.ok());
  auto out = chat->render(ordered_json::parse(R"([{"role": "assistant", "content": null, "reasoning": "r"}])"), ordered_json::object());
  ASSERT_TRUE(out.ok()) << out.status().message();
  EXPECT_EQ(out.value(), R"({"thinking": "r", "role": "assistant", "reasoning": "r", "reasoning_content": "r"};TrueTrueFalse)");
}

TEST(ChatTemplate, LoadsFromModelDirectories) {
  LMX_NEED_SHARED_DATA();
  auto qwen = load_chat_template(source_path("../shared/data/tokenizers/qwen3"), "");
  ASSERT_TRUE(qwen.ok()) << qwen.status().message();
  EXPECT_EQ(qwen->special_tokens().value("eos_token", ""), "<|im_end|>");
  EXPECT_FALSE(qwen->special_tokens().contains("bos_token"));  // null in the config
  auto deepseek = load_chat_template(source_path("../shared/data/tokenizers/deepseek-v3"), "");
  ASSERT_TRUE(deepseek.ok()) << deepseek.status().message();
  EXPECT_EQ(deepseek->special_tokens().value("bos_token", ""), "<｜begin▁of▁sentence｜>");  // AddedToken object

  // GPT-OSS's tokenizer_config.json has no template: a clear error, and --chat-template fixes it.
  auto gpt_oss = load_chat_template(source_path("../shared/data/tokenizers/gpt-oss"), "");
  ASSERT_FALSE(gpt_oss.ok());
  EXPECT_NE(gpt_oss.status().message().find("--chat-template"), std::string::npos);
  auto harmony = load_chat_template(source_path("../shared/data/tokenizers/gpt-oss"), source_path("templates/harmony.jinja"));
  ASSERT_TRUE(harmony.ok()) << harmony.status().message();
  EXPECT_EQ(harmony->special_tokens().value("eos_token", ""), "<|return|>");

  auto missing = load_chat_template(source_path("../shared/data/tokenizers/qwen3"), "/nonexistent/t.jinja");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("/nonexistent/t.jinja"), std::string::npos);
}

TEST(ChatTemplate, TemplateDiscoveryOrderAndNamedTemplates) {
  lmx::testing::TempDir dir("chat");
  write_file(dir.file("tokenizer_config.json"),
             R"({"eos_token": "</s>", "chat_template": [{"name": "default", "template": "D{{ eos_token }}"},
                 {"name": "tool_use", "template": "T{{ tools | length }}"}]})");
  auto listed = load_chat_template(dir.str(), "");
  ASSERT_TRUE(listed.ok()) << listed.status().message();
  ordered_json messages = ordered_json::parse(R"([{"role": "user", "content": "x"}])");
  EXPECT_EQ(listed->render(messages, ordered_json::object()).value(), "D</s>");
  EXPECT_EQ(listed->render(messages, ordered_json::parse(R"({"tools": [{}, {}]})")).value(), "T2");
  EXPECT_EQ(listed->render(messages, ordered_json::parse(R"({"eos_token": "E"})")).value(), "DE");  // kwargs win

  write_file(dir.file("chat_template.jinja"), "J{{ messages[0].content }}\n");  // takes precedence; final newline dropped
  auto file = load_chat_template(dir.str(), "");
  ASSERT_TRUE(file.ok()) << file.status().message();
  EXPECT_EQ(file->render(messages, ordered_json::object()).value(), "Jx");

  write_file(dir.file("override.jinja"), "{{ bad syntax here");
  auto bad = load_chat_template(dir.str(), dir.file("override.jinja"));
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("override.jinja:1:"), std::string::npos) << bad.status().message();

  lmx::testing::TempDir empty("chat_empty");
  auto none = load_chat_template(empty.str(), "");
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace lmx::tokenizer
