// The OpenAI schema layer without a server: request parsing/validation names the offending field with the
// right status, defaults follow OpenAI, responses have OpenAI's shape, and adapter paths stay inside the
// --lora-dir root (traversal and symlink escapes refused). The running server is tested in
// test_openai_client.py.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "../common/temp_dir.h"
#include "server/adapter_paths.h"
#include "server/api.h"
#include "server/metrics.h"

namespace lmx::server {
namespace {

const ModelInfo kModel{.served_name = "base", .max_model_len = 64, .vocab_size = 100};

std::optional<ApiError> parse(const std::string& body, GenerateRequest* out = nullptr, const ModelInfo& m = kModel,
                              Endpoint e = Endpoint::kCompletions) {
  GenerateRequest scratch;
  return parse_generate_request(body, e, m, out ? out : &scratch);
}

// The error's param for `body`, "ok" when it parses.
std::string param_of(const std::string& body) {
  auto e = parse(body);
  return e ? e->param : "ok";
}

TEST(ServerApi, ParsesTokenPromptsAndOptions) {
  GenerateRequest r;
  ASSERT_FALSE(parse(R"({"model": "a", "prompt": [1, 2, 3], "max_tokens": 5, "temperature": 0.5, "top_p": 0.9,
                         "top_k": -1, "seed": 42, "ignore_eos": true, "stop_token_ids": [7], "stream": true,
                         "stream_options": {"include_usage": true}, "user": "ignored"})", &r));
  EXPECT_EQ(r.model, "a");
  EXPECT_EQ(r.prompt_ids, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(r.sampling.max_tokens, 5);
  EXPECT_FLOAT_EQ(r.sampling.temperature, 0.5f);
  EXPECT_FLOAT_EQ(r.sampling.top_p, 0.9f);
  EXPECT_EQ(r.sampling.top_k, 0);  // -1 = off
  EXPECT_EQ(r.sampling.seed, 42u);
  EXPECT_TRUE(r.sampling.ignore_eos && r.stream && r.include_usage);
  EXPECT_EQ(r.sampling.stop_token_ids, (std::vector<int32_t>{7}));
  // A batch of one prompt is the prompt; max_tokens defaults to 16 for completions.
  ASSERT_FALSE(parse(R"({"prompt": [[4, 5]]})", &r));
  EXPECT_EQ(r.prompt_ids, (std::vector<int32_t>{4, 5}));
  EXPECT_EQ(r.sampling.max_tokens, 16);
  EXPECT_TRUE(r.model.empty());
}

TEST(ServerApi, InvalidParametersNameTheField) {
  EXPECT_EQ(param_of(R"({"prompt": [1], "max_tokens": 0})"), "max_tokens");
  EXPECT_EQ(param_of(R"({"prompt": [1], "max_tokens": 1.5})"), "max_tokens");
  EXPECT_EQ(param_of(R"({"prompt": [1], "temperature": -0.1})"), "temperature");
  EXPECT_EQ(param_of(R"({"prompt": [1], "temperature": "hot"})"), "temperature");
  EXPECT_EQ(param_of(R"({"prompt": [1], "top_p": 1.5})"), "top_p");
  EXPECT_EQ(param_of(R"({"prompt": [1], "top_k": -2})"), "top_k");
  EXPECT_EQ(param_of(R"({"prompt": [1], "seed": "x"})"), "seed");
  EXPECT_EQ(param_of(R"({"prompt": [1], "stop_token_ids": [100]})"), "stop_token_ids");
  EXPECT_EQ(param_of(R"({"prompt": [1], "stop_token_ids": 3})"), "stop_token_ids");
  EXPECT_EQ(param_of(R"({"prompt": [1], "ignore_eos": 1})"), "ignore_eos");
  EXPECT_EQ(param_of(R"({"prompt": [1], "n": 2})"), "n");
  EXPECT_EQ(param_of(R"({"prompt": [1], "logprobs": 21})"), "logprobs");
  EXPECT_EQ(param_of(R"({"prompt": [1], "logprobs": 0})"), "ok");
  EXPECT_EQ(param_of(R"({"prompt": [1], "echo": true})"), "echo");
  EXPECT_EQ(param_of(R"({"prompt": [1], "stream_options": {"include_usage": true}})"), "stream_options");
  EXPECT_EQ(param_of(R"({"prompt": [1], "stream": true, "stream_options": {"include_usage": 1}})"),
            "stream_options.include_usage");
  EXPECT_EQ(param_of(R"({"prompt": [1], "model": 3})"), "model");
  EXPECT_EQ(param_of(R"({"prompt": [1], "stop": "x"})"), "stop");  // needs a tokenizer
  EXPECT_EQ(param_of(R"({"prompt": [1], "stop": null, "max_tokens": null})"), "ok");
}

TEST(ServerApi, PromptRules) {
  EXPECT_EQ(param_of(R"({})"), "prompt");
  EXPECT_EQ(param_of(R"({"prompt": []})"), "prompt");
  EXPECT_EQ(param_of(R"({"prompt": [1, "a"]})"), "prompt");
  EXPECT_EQ(param_of(R"({"prompt": [[1], [2]]})"), "prompt");
  EXPECT_EQ(param_of(R"({"prompt": [1, 100]})"), "prompt");
  EXPECT_EQ(param_of(R"({"prompt": [1, -1]})"), "prompt");
  EXPECT_EQ(param_of(R"({"prompt": [1, 99999999999]})"), "prompt");
  auto text = parse(R"({"prompt": "hello"})");
  ASSERT_TRUE(text);
  EXPECT_NE(text->message.find("tokenizer"), std::string::npos);
  // With a tokenizer the text waits for encoding (finalize_prompt runs after it).
  ModelInfo with_tok = kModel;
  with_tok.has_tokenizer = true;
  GenerateRequest r;
  ASSERT_FALSE(parse(R"({"prompt": "hello", "stop": ["\n"]})", &r, with_tok));
  EXPECT_EQ(r.prompt_text, "hello");
  EXPECT_EQ(r.stop, std::vector<std::string>{"\n"});
  // Context length: prompt + max_tokens <= max_model_len, and the default max_tokens shrinks to fit.
  std::string p60 = "[" + std::string(59 * 2, ' ') + "1]";
  for (size_t i = 1; i < p60.size() - 2; i += 2) p60[i] = '1', p60[i + 1] = ',';
  ASSERT_FALSE(parse(R"({"prompt": )" + p60 + "}", &r));
  EXPECT_EQ(r.sampling.max_tokens, 4);
  auto too_long = parse(R"({"max_tokens": 5, "prompt": )" + p60 + "}");
  ASSERT_TRUE(too_long);
  EXPECT_EQ(too_long->param, "max_tokens");
  EXPECT_NE(too_long->message.find("maximum context length is 64"), std::string::npos);
}

TEST(ServerApi, MalformedBodiesAndChatWithoutTemplate) {
  EXPECT_EQ(parse("{")->status, 400);
  EXPECT_EQ(parse("[1, 2]")->status, 400);
  EXPECT_NE(parse("{\"prompt\": \"\xff\"}")->message.find("UTF-8"), std::string::npos);
  auto chat = parse(R"({"messages": [{"role": "user", "content": "hi"}]})", nullptr, kModel, Endpoint::kChat);
  ASSERT_TRUE(chat);
  EXPECT_NE(chat->message.find("no chat template"), std::string::npos);
  EXPECT_NE(chat->message.find("--tokenizer"), std::string::npos);
  ModelInfo no_template = kModel;
  no_template.has_tokenizer = true;  // a tokenizer directory without a template
  auto chat_no_template = parse(R"({"messages": [{"role": "user", "content": "hi"}]})", nullptr, no_template, Endpoint::kChat);
  ASSERT_TRUE(chat_no_template);
  EXPECT_NE(chat_no_template->message.find("--chat-template"), std::string::npos) << chat_no_template->message;
  auto bad_messages = parse(R"({"messages": [{"content": "hi"}]})", nullptr, kModel, Endpoint::kChat);
  ASSERT_TRUE(bad_messages);
  EXPECT_EQ(bad_messages->param, "messages");
  ModelInfo chat_model = kModel;
  chat_model.has_tokenizer = chat_model.has_chat_template = true;
  GenerateRequest r;
  ASSERT_FALSE(parse(R"({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
                         "max_completion_tokens": 7})", &r, chat_model, Endpoint::kChat));
  EXPECT_EQ(r.messages.size(), 1u);
  EXPECT_EQ(r.messages[0].content, "ab");
  EXPECT_EQ(r.sampling.max_tokens, 7);
}

TEST(ServerApi, AdapterRequests) {
  AdapterRequest a;
  EXPECT_FALSE(parse_adapter_request(R"({"lora_name": "x", "lora_path": "dir"})", true, kModel, &a));
  EXPECT_EQ(a.name, "x");
  EXPECT_EQ(a.path, "dir");
  EXPECT_EQ(parse_adapter_request(R"({"lora_name": "x"})", true, kModel, &a)->param, "lora_path");
  EXPECT_FALSE(parse_adapter_request(R"({"lora_name": "x"})", false, kModel, &a));
  EXPECT_EQ(parse_adapter_request(R"({"lora_name": ""})", false, kModel, &a)->param, "lora_name");
  EXPECT_EQ(parse_adapter_request(R"({"lora_name": "base"})", false, kModel, &a)->param, "lora_name");
  EXPECT_EQ(parse_adapter_request(R"({"lora_name": "a\nb"})", false, kModel, &a)->param, "lora_name");
}

TEST(ServerApi, ResponsesHaveOpenAiShape) {
  ResponseHeader h{.endpoint = Endpoint::kCompletions, .id = "cmpl-1", .created = 5, .model = "m"};
  nlohmann::json full = full_response(h, "", {3, 4}, engine::FinishReason::kLength, {.prompt_tokens = 2, .completion_tokens = 2});
  EXPECT_EQ(full["object"], "text_completion");
  EXPECT_EQ(full["choices"][0]["token_ids"], nlohmann::json({3, 4}));
  EXPECT_EQ(full["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(full["usage"]["total_tokens"], 4);
  nlohmann::json chunk = stream_chunk(h, "", {3}, engine::FinishReason::kNone, true, true);
  EXPECT_TRUE(chunk["choices"][0]["finish_reason"].is_null());
  EXPECT_TRUE(chunk.contains("usage") && chunk["usage"].is_null());
  EXPECT_EQ(usage_chunk(h, {1, 2})["choices"].size(), 0u);
  h.endpoint = Endpoint::kChat;
  nlohmann::json chat = stream_chunk(h, "hi", {3}, engine::FinishReason::kStop, false, true);
  EXPECT_EQ(chat["object"], "chat.completion.chunk");
  EXPECT_EQ(chat["choices"][0]["delta"]["role"], "assistant");
  EXPECT_FALSE(chat.contains("usage"));
  nlohmann::json err = error_json({404, "no such model", "model"});
  EXPECT_EQ(err["error"]["type"], "not_found_error");
  EXPECT_EQ(err["error"]["param"], "model");
  EXPECT_EQ(sse_event({{"a", 1}}), "data: {\"a\":1}\n\n");
  EXPECT_EQ(dump_json(std::string("\xff")), "\"\xEF\xBF\xBD\"");  // replaced, not thrown
}

TEST(ServerApi, AdapterPathsStayInsideTheRoot) {
  lmx::testing::TempDir root("lora_root"), outside("lora_outside");
  namespace fs = std::filesystem;
  fs::create_directories(root.file("good"));
  std::ofstream(root.file("good/adapter_config.json")) << "{}";
  fs::create_directories(outside.file("secret"));
  std::ofstream(outside.file("secret/adapter_config.json")) << "{}";
  fs::create_directory_symlink(outside.file("secret"), root.file("link_out"));
  fs::create_directories(root.file("file_link"));
  fs::create_symlink(outside.file("secret/adapter_config.json"), root.file("file_link/adapter_config.json"));
  fs::create_directory_symlink(root.file("good"), root.file("link_in"));

  EXPECT_EQ(resolve_adapter_dir(root.str(), "good").value(), fs::canonical(root.file("good")).string());
  EXPECT_TRUE(resolve_adapter_dir(root.str(), root.file("good")).ok());  // absolute inside
  EXPECT_TRUE(resolve_adapter_dir(root.str(), "link_in").ok());          // a link that stays inside
  EXPECT_TRUE(resolve_adapter_dir(root.str(), "good/../good").ok());
  for (const std::string& bad : {std::string("../"), std::string("good/../.."), std::string("link_out"),
                                 std::string("file_link"), outside.file("secret"), std::string("/etc")}) {
    Result<std::string> r = resolve_adapter_dir(root.str(), bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find("outside the adapter root"), std::string::npos) << r.status().message();
  }
  EXPECT_EQ(resolve_adapter_dir(root.str(), "missing").status().code(), StatusCode::kNotFound);
  // A sibling whose name extends the root's is not inside it.
  fs::create_directories(root.str() + "_sibling");
  EXPECT_FALSE(resolve_adapter_dir(root.str(), root.str() + "_sibling").ok());
  fs::remove_all(root.str() + "_sibling");
}

TEST(ServerMetrics, PrometheusText) {
  Metrics m;
  m.record_request({.model = "a\"b", .finish_reason = "length", .prompt_tokens = 3, .generation_tokens = 5,
                    .ttft_s = 0.02, .e2e_s = 0.1});
  m.record_response(200);
  EngineSnapshot s{.kv_pages_used = 2, .kv_pages_total = 8, .resident_adapters = {"x"}};
  std::string text = m.render(s);
  EXPECT_NE(text.find("loramux_kv_pages_used 2\n"), std::string::npos);
  EXPECT_NE(text.find("loramux_kv_cache_usage_perc 0.25\n"), std::string::npos);
  EXPECT_NE(text.find("loramux_adapter_resident{adapter=\"x\"} 1\n"), std::string::npos);
  EXPECT_NE(text.find("loramux_requests_total{model=\"a\\\"b\",finish_reason=\"length\"} 1\n"), std::string::npos);
  EXPECT_NE(text.find("loramux_time_to_first_token_seconds_bucket{model=\"a\\\"b\",le=\"0.025\"} 1\n"), std::string::npos);
  EXPECT_NE(text.find("loramux_time_to_first_token_seconds_bucket{model=\"a\\\"b\",le=\"0.01\"} 0\n"), std::string::npos);
  EXPECT_NE(text.find("loramux_time_per_output_token_seconds_count{model=\"a\\\"b\"} 1\n"), std::string::npos);
  EXPECT_NE(text.find("loramux_http_responses_total{status=\"200\"} 1\n"), std::string::npos);
}

}  // namespace
}  // namespace lmx::server
