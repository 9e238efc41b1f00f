// Logprobs in the OpenAI schema layer (no server): completions' `logprobs: N` and chat's `logprobs` +
// `top_logprobs` parse into SamplingOptions::logprobs or a 400 naming the field; the response JSON has the
// legacy completions shape and chat's content shape; and the per-model queue figures and histograms of
// /metrics render. The running server is tested in test_logprobs.py.
#include <gtest/gtest.h>

#include <cmath>

#include "server/api.h"
#include "server/metrics.h"

namespace lmx::server {
namespace {

const ModelInfo kModel{.served_name = "base", .max_model_len = 64, .vocab_size = 100, .has_tokenizer = true,
                       .has_chat_template = true};

// SamplingOptions::logprobs of `body`, or "param:<field>" when it is refused.
std::string logprobs_of(const std::string& body, Endpoint endpoint) {
  GenerateRequest r;
  if (auto e = parse_generate_request(body, endpoint, kModel, &r)) {
    EXPECT_EQ(e->status, 400);
    return "param:" + e->param;
  }
  return std::to_string(r.sampling.logprobs);
}

TEST(ServerLogprobs, CompletionsTakeAnIntegerWidth) {
  auto c = [](const std::string& extra) { return logprobs_of(R"({"prompt": [1, 2])" + extra + "}", Endpoint::kCompletions); };
  EXPECT_EQ(c(""), "-1");
  EXPECT_EQ(c(R"(, "logprobs": null)"), "-1");
  EXPECT_EQ(c(R"(, "logprobs": false)"), "-1");
  EXPECT_EQ(c(R"(, "logprobs": 0)"), "0");
  EXPECT_EQ(c(R"(, "logprobs": 5)"), "5");
  EXPECT_EQ(c(R"(, "logprobs": 20)"), "20");
  EXPECT_EQ(c(R"(, "logprobs": 21)"), "param:logprobs");
  EXPECT_EQ(c(R"(, "logprobs": -1)"), "param:logprobs");
  EXPECT_EQ(c(R"(, "logprobs": 2.5)"), "param:logprobs");
  EXPECT_EQ(c(R"(, "logprobs": "3")"), "param:logprobs");
  EXPECT_EQ(c(R"(, "logprobs": true)"), "param:logprobs");
  EXPECT_EQ(c(R"(, "top_logprobs": 3)"), "param:top_logprobs");
  EXPECT_EQ(c(R"(, "top_logprobs": null, "logprobs": 1)"), "1");
}

TEST(ServerLogprobs, ChatTakesAFlagAndTopLogprobs) {
  auto c = [](const std::string& extra) {
    return logprobs_of(R"({"messages": [{"role": "user", "content": "hi"}])" + extra + "}", Endpoint::kChat);
  };
  EXPECT_EQ(c(""), "-1");
  EXPECT_EQ(c(R"(, "logprobs": false)"), "-1");
  EXPECT_EQ(c(R"(, "logprobs": true)"), "0");
  EXPECT_EQ(c(R"(, "logprobs": true, "top_logprobs": 7)"), "7");
  EXPECT_EQ(c(R"(, "logprobs": true, "top_logprobs": 0)"), "0");
  EXPECT_EQ(c(R"(, "logprobs": false, "top_logprobs": 0)"), "-1");
  EXPECT_EQ(c(R"(, "top_logprobs": 3)"), "param:top_logprobs");  // needs logprobs: true
  EXPECT_EQ(c(R"(, "logprobs": true, "top_logprobs": 21)"), "param:top_logprobs");
  EXPECT_EQ(c(R"(, "logprobs": true, "top_logprobs": -1)"), "param:top_logprobs");
  EXPECT_EQ(c(R"(, "logprobs": 1)"), "param:logprobs");
  GenerateRequest r;
  auto e = parse_generate_request(R"({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3})",
                                  Endpoint::kChat, kModel, &r);
  ASSERT_TRUE(e);
  EXPECT_NE(e->message.find("logprobs: true"), std::string::npos) << e->message;
}

std::vector<TokenLogprobView> two_tokens() {
  return {{.sampled = {"He", -0.5f}, .top = {{"He", -0.5f}, {"She", -1.25f}}, .text_offset = 0},
          {.sampled = {"llo", -2.0f}, .top = {{"y", -0.25f}, {"\xe5", -INFINITY}}, .text_offset = 2}};
}

TEST(ServerLogprobs, CompletionsLegacyShape) {
  nlohmann::json j = logprobs_json(Endpoint::kCompletions, two_tokens());
  EXPECT_EQ(j["tokens"], (nlohmann::json{"He", "llo"}));
  EXPECT_EQ(j["token_logprobs"], (nlohmann::json{-0.5, -2.0}));
  EXPECT_EQ(j["text_offset"], (nlohmann::json{0, 2}));
  ASSERT_EQ(j["top_logprobs"].size(), 2u);
  EXPECT_EQ(j["top_logprobs"][0], (nlohmann::json{{"He", -0.5}, {"She", -1.25}}));
  // The sampled token is listed beside the top N; -inf becomes vLLM's -9999.0.
  EXPECT_EQ(j["top_logprobs"][1], (nlohmann::json{{"y", -0.25}, {"\xe5", -9999.0}, {"llo", -2.0}}));
  // Invalid UTF-8 in a token text is replaced when the body is written, never thrown.
  EXPECT_NE(dump_json(j).find("\xef\xbf\xbd"), std::string::npos);

  ResponseHeader h{.endpoint = Endpoint::kCompletions, .id = "cmpl-1", .created = 1, .model = "base"};
  nlohmann::json full = full_response(h, "Hello", {3, 4}, engine::FinishReason::kLength, {.prompt_tokens = 1, .completion_tokens = 2}, j);
  EXPECT_EQ(full["choices"][0]["logprobs"], j);
  nlohmann::json plain = full_response(h, "Hello", {3, 4}, engine::FinishReason::kLength, {});
  EXPECT_TRUE(plain["choices"][0]["logprobs"].is_null());
  nlohmann::json chunk = stream_chunk(h, "He", {3}, engine::FinishReason::kNone, false, false, j);
  EXPECT_EQ(chunk["choices"][0]["logprobs"], j);
}

TEST(ServerLogprobs, ChatContentShape) {
  nlohmann::json j = logprobs_json(Endpoint::kChat, two_tokens());
  ASSERT_EQ(j["content"].size(), 2u);
  EXPECT_TRUE(j["refusal"].is_null());
  const nlohmann::json& first = j["content"][0];
  EXPECT_EQ(first["token"], "He");
  EXPECT_EQ(first["logprob"], -0.5);
  EXPECT_EQ(first["bytes"], (nlohmann::json{72, 101}));
  ASSERT_EQ(first["top_logprobs"].size(), 2u);
  EXPECT_EQ(first["top_logprobs"][1], (nlohmann::json{{"token", "She"}, {"logprob", -1.25}, {"bytes", {83, 104, 101}}}));
  const nlohmann::json& second = j["content"][1];
  EXPECT_EQ(second["top_logprobs"][1]["bytes"], (nlohmann::json{229}));  // the raw byte, not U+FFFD
  EXPECT_EQ(second["top_logprobs"][1]["logprob"], -9999.0);
  ResponseHeader h{.endpoint = Endpoint::kChat, .id = "chatcmpl-1", .created = 1, .model = "base"};
  nlohmann::json chunk = stream_chunk(h, "He", {3}, engine::FinishReason::kNone, false, true, j);
  EXPECT_EQ(chunk["choices"][0]["logprobs"], j);
}

// The value of the first line starting with `series` (the exact series name and labels).
double series_value(const std::string& text, const std::string& series) {
  size_t at = text.find("\n" + series + " ");
  if (at == std::string::npos) return NAN;
  return std::stod(text.substr(at + series.size() + 2));
}

TEST(ServerLogprobs, PerModelQueueFiguresAndHistograms) {
  Metrics m;
  m.record_request({.model = "a1", .finish_reason = "length", .prompt_tokens = 4, .generation_tokens = 11,
                    .ttft_s = 0.5, .queue_s = 0.02, .e2e_s = 1.5});  // 10 tokens in 1 s: 10 OTPS
  m.record_request({.model = "a1", .finish_reason = "abort", .prompt_tokens = 4, .generation_tokens = 0, .e2e_s = 0.1});
  EngineSnapshot s{.running_by_model = {{"a1", 2}, {"base", 0}}, .waiting_by_model = {{"a1", 1}, {"base", 0}}};
  const std::string text = m.render(s);
  EXPECT_EQ(series_value(text, R"(loramux_model_requests_running{model="a1"})"), 2);
  EXPECT_EQ(series_value(text, R"(loramux_model_requests_waiting{model="a1"})"), 1);
  EXPECT_EQ(series_value(text, R"(loramux_model_requests_running{model="base"})"), 0);
  EXPECT_EQ(series_value(text, R"(loramux_request_queue_time_seconds_count{model="a1"})"), 1);  // the abort never ran
  EXPECT_EQ(series_value(text, R"(loramux_request_queue_time_seconds_bucket{model="a1",le="0.01"})"), 0);
  EXPECT_EQ(series_value(text, R"(loramux_request_queue_time_seconds_bucket{model="a1",le="0.025"})"), 1);
  EXPECT_EQ(series_value(text, R"(loramux_request_output_tokens_per_second_count{model="a1"})"), 1);
  EXPECT_DOUBLE_EQ(series_value(text, R"(loramux_request_output_tokens_per_second_sum{model="a1"})"), 10.0);
  EXPECT_EQ(series_value(text, R"(loramux_request_output_tokens_per_second_bucket{model="a1",le="5"})"), 0);
  EXPECT_EQ(series_value(text, R"(loramux_request_output_tokens_per_second_bucket{model="a1",le="10"})"), 1);
  EXPECT_NE(text.find("# TYPE loramux_request_output_tokens_per_second histogram"), std::string::npos);
}

}  // namespace
}  // namespace lmx::server
