// loadgen stream and data: SSE framing under every byte split, OpenAI chunk interpretation, request
// bodies, the random/JSONL/sonnet datasets (sonnet with the real GPT-OSS tokenizer from ../shared/data)
// and the report's JSON fields and text layout.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>

#include "loadgen/client.h"
#include "loadgen/dataset.h"
#include "loadgen/report.h"
#include "loadgen/sse.h"

namespace lmx::loadgen {
namespace {

uint64_t fresh_seed() {
  const uint64_t seed = std::random_device{}();
  std::printf("loadgen test seed %llu\n", static_cast<unsigned long long>(seed));
  return seed;
}

TEST(LoadgenSse, EventsSurviveAnySplitOfTheBytes) {
  const std::string stream =
      ": keep-alive comment\n\n"
      "data: {\"a\":1}\n\n"
      "event: message\r\ndata: {\"b\":\r\ndata:2}\r\n\r\n"
      "id: 7\nretry: 10\n\n"  // no data: no event
      "data: [DONE]\n\n"
      "data: tail";  // unterminated
  const std::vector<std::string> expected = {"{\"a\":1}", "{\"b\":\n2}", "[DONE]"};
  SseParser whole;
  EXPECT_EQ(whole.feed(stream), expected);
  EXPECT_TRUE(whole.has_partial_event());
  std::mt19937_64 rng(fresh_seed());
  for (int trial = 0; trial < 200; ++trial) {
    SseParser parser;
    std::vector<std::string> got;
    size_t at = 0;
    while (at < stream.size()) {
      const size_t take = std::min(stream.size() - at, size_t(rng() % 7));
      for (std::string& e : parser.feed(std::string_view(stream).substr(at, take))) got.push_back(std::move(e));
      at += take;
    }
    EXPECT_EQ(got, expected);
  }
}

TEST(LoadgenSse, ChunksGiveTokensTextUsageErrorsAndDone) {
  StreamChunk ids = parse_stream_chunk(R"({"choices":[{"index":0,"text":"","token_ids":[5,6,7],"finish_reason":null}],"usage":null})");
  EXPECT_TRUE(ids.has_output);
  EXPECT_TRUE(ids.tokens_from_ids);
  EXPECT_EQ(ids.tokens, 3);
  EXPECT_FALSE(ids.completion_tokens);

  StreamChunk text = parse_stream_chunk(R"({"choices":[{"index":0,"text":" thee"}]})");
  EXPECT_TRUE(text.has_output);
  EXPECT_FALSE(text.tokens_from_ids);
  EXPECT_EQ(text.tokens, 1);
  EXPECT_EQ(text.text, " thee");

  StreamChunk chat = parse_stream_chunk(R"({"choices":[{"index":0,"delta":{"role":"assistant","content":"Hi"}}]})");
  EXPECT_TRUE(chat.has_output);
  EXPECT_EQ(chat.text, "Hi");
  StreamChunk role_only = parse_stream_chunk(R"({"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]})");
  EXPECT_FALSE(role_only.has_output);
  StreamChunk finish = parse_stream_chunk(R"({"choices":[{"index":0,"text":"","token_ids":[],"finish_reason":"length"}]})");
  EXPECT_FALSE(finish.has_output);

  StreamChunk usage = parse_stream_chunk(R"({"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":34,"total_tokens":46}})");
  EXPECT_FALSE(usage.has_output);
  EXPECT_EQ(usage.prompt_tokens, 12);
  EXPECT_EQ(usage.completion_tokens, 34);

  EXPECT_TRUE(parse_stream_chunk("[DONE]").done);
  StreamChunk error = parse_stream_chunk(R"({"error":{"message":"adapter evicted","type":"server_error","code":500}})");
  ASSERT_TRUE(error.error);
  EXPECT_EQ(*error.error, "adapter evicted");
  StreamChunk junk = parse_stream_chunk("not json");
  ASSERT_TRUE(junk.error);
  EXPECT_NE(junk.error->find("not a JSON object"), std::string::npos);
}

TEST(LoadgenClient, RequestBodiesStreamWithUsageAndIgnoreEos) {
  BenchPrompt ids{.prompt_ids = {3, 4, 5}, .uses_ids = true, .input_len = 3, .output_len = 9};
  BenchPrompt text{.prompt_text = "Shall I compare thee", .input_len = 4, .output_len = 7};
  ClientOptions o{.ignore_eos = true};
  const nlohmann::json completion = nlohmann::json::parse(request_body(o, {.prompt = &ids, .model = "lora1"}).value());
  EXPECT_EQ(completion["model"], "lora1");
  EXPECT_EQ(completion["prompt"], nlohmann::json({3, 4, 5}));
  EXPECT_EQ(completion["max_tokens"], 9);
  EXPECT_EQ(completion["stream"], true);
  EXPECT_EQ(completion["stream_options"]["include_usage"], true);
  EXPECT_EQ(completion["ignore_eos"], true);
  EXPECT_EQ(completion["temperature"], 0.0);

  o.endpoint = "/v1/chat/completions";
  o.ignore_eos = false;
  EXPECT_TRUE(is_chat_endpoint(o.endpoint));
  const nlohmann::json chat = nlohmann::json::parse(request_body(o, {.prompt = &text, .model = "base"}).value());
  EXPECT_EQ(chat["messages"][0]["role"], "user");
  EXPECT_EQ(chat["messages"][0]["content"], "Shall I compare thee");
  EXPECT_EQ(chat["max_completion_tokens"], 7);
  EXPECT_FALSE(chat.contains("ignore_eos"));
  Result<std::string> refused = request_body(o, {.prompt = &ids, .model = "base"});
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("/v1/completions"), std::string::npos);
}

TEST(LoadgenDataset, RandomPromptsHaveTheirLengthsAndIdsInRange) {
  const uint64_t seed = fresh_seed();
  DatasetOptions o{.name = "random", .num_prompts = 40, .input_len = 33, .output_len = 17, .random_vocab_size = 300, .seed = seed};
  Result<std::vector<BenchPrompt>> fixed = build_dataset(o);
  ASSERT_TRUE(fixed.ok()) << fixed.status().message();
  ASSERT_EQ(fixed->size(), 40u);
  std::vector<int> seen(300, 0);
  for (const BenchPrompt& p : *fixed) {
    EXPECT_TRUE(p.uses_ids);
    EXPECT_EQ(p.prompt_ids.size(), 33u);
    EXPECT_EQ(p.input_len, 33);
    EXPECT_EQ(p.output_len, 17);
    for (int32_t id : p.prompt_ids) {
      ASSERT_GE(id, 0);
      ASSERT_LT(id, 300);
      ++seen[size_t(id)];
    }
  }
  EXPECT_GT(std::count_if(seen.begin(), seen.end(), [](int c) { return c > 0; }), 250);  // 1320 draws cover most ids
  EXPECT_NE((*fixed)[0].prompt_ids, (*fixed)[1].prompt_ids);
  EXPECT_EQ(build_dataset(o).value()[5].prompt_ids, (*fixed)[5].prompt_ids);
  o.range_ratio = 0.5;
  const std::vector<BenchPrompt> ranged = build_dataset(o).value();
  for (const BenchPrompt& p : ranged) {
    EXPECT_GE(p.input_len, 16);
    EXPECT_LE(p.input_len, 50);
    EXPECT_EQ(int(p.prompt_ids.size()), p.input_len);
    EXPECT_GE(p.output_len, 8);
    EXPECT_LE(p.output_len, 26);
  }
  o.range_ratio = 1.0;
  EXPECT_FALSE(build_dataset(o).ok());
}

std::string write_temp(const std::string& name, const std::string& text) {
  const std::filesystem::path path = std::filesystem::temp_directory_path() / name;
  std::ofstream(path) << text;
  return path.string();
}

TEST(LoadgenDataset, JsonlTakesTextAndIdPromptsWithOptionalOutputLen) {
  const std::string path = write_temp("loramux_loadgen_ok.jsonl",
                                      "{\"prompt\": \"hello\"}\n\n{\"prompt\": [1, 2, 3], \"output_len\": 5}\n");
  DatasetOptions o{.name = "jsonl", .path = path, .num_prompts = 5, .output_len = 11};
  Result<std::vector<BenchPrompt>> p = build_dataset(o);
  ASSERT_TRUE(p.ok()) << p.status().message();
  ASSERT_EQ(p->size(), 5u);  // two lines, cycled
  EXPECT_EQ((*p)[0].prompt_text, "hello");
  EXPECT_FALSE((*p)[0].uses_ids);
  EXPECT_EQ((*p)[0].input_len, 0);  // no tokenizer: the server's usage counts it
  EXPECT_EQ((*p)[0].output_len, 11);
  EXPECT_EQ((*p)[1].prompt_ids, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ((*p)[1].output_len, 5);
  EXPECT_EQ((*p)[4].prompt_text, "hello");
  std::filesystem::remove(path);

  const std::vector<std::pair<std::string, std::string>> bad = {
      {"{\"prompt\": 5}\n", ":1: \"prompt\" must be"},
      {"{\"text\": \"x\"}\n", ":1: missing \"prompt\""},
      {"{\"prompt\": \"a\"}\nnot json\n", ":2: expected a JSON object"},
      {"{\"prompt\": [1, -2]}\n", "non-negative int32"},
      {"{\"prompt\": \"a\", \"output_len\": 0}\n", "\"output_len\" must be a positive integer"},
      {"\n\n", "holds no prompts"}};
  for (const auto& [text, message] : bad) {
    o.path = write_temp("loramux_loadgen_bad.jsonl", text);
    Result<std::vector<BenchPrompt>> r = build_dataset(o);
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_NE(r.status().message().find(message), std::string::npos) << r.status().message();
    std::filesystem::remove(o.path);
  }
  o.path = "/nonexistent/loramux.jsonl";
  EXPECT_NE(build_dataset(o).status().message().find("cannot be opened"), std::string::npos);
}

TEST(LoadgenDataset, SonnetFillsToInputLenWithTheRealTokenizer) {
  const std::string data = LORAMUX_SHARED_DATA;
  if (data.empty() || !std::filesystem::exists(data + "/sonnet.txt") || !std::filesystem::exists(data + "/tokenizers/gpt-oss"))
    GTEST_SKIP() << "SKIPPED LOUDLY: no ../shared/data (sonnet.txt, tokenizers/gpt-oss) — the sonnet dataset is untested";
  Result<tokenizer::Tokenizer> tok = tokenizer::Tokenizer::load(data + "/tokenizers/gpt-oss");
  ASSERT_TRUE(tok.ok()) << tok.status().message();
  std::vector<std::string> file_lines;
  {
    std::ifstream in(data + "/sonnet.txt");
    for (std::string l; std::getline(in, l);) file_lines.push_back(l);
  }
  for (int input_len : {40, 300, 1600}) {
    DatasetOptions o{.name = "sonnet", .path = data + "/sonnet.txt", .num_prompts = 12, .input_len = input_len,
                     .output_len = 600, .seed = fresh_seed(), .tokenizer = &*tok};
    Result<std::vector<BenchPrompt>> prompts = build_dataset(o);
    ASSERT_TRUE(prompts.ok()) << prompts.status().message();
    int exact = 0;
    for (const BenchPrompt& p : *prompts) {
      EXPECT_FALSE(p.uses_ids);
      EXPECT_EQ(p.output_len, 600);
      EXPECT_EQ(p.prompt_text.rfind(kSonnetInstruction, 0), 0u);
      EXPECT_EQ(p.input_len, int(tok->encode(p.prompt_text, false).size()));  // the count is the real one
      EXPECT_LE(p.input_len, input_len);
      EXPECT_GE(p.input_len, input_len - 2);  // a cut word can end one or two tokens short
      exact += p.input_len == input_len;
      // Every whole line after the instruction is a line of the file.
      std::string body = p.prompt_text.substr(std::string(kSonnetInstruction).size());
      for (size_t nl; (nl = body.find('\n')) != std::string::npos; body = body.substr(nl + 1))
        EXPECT_NE(std::find(file_lines.begin(), file_lines.end(), body.substr(0, nl)), file_lines.end()) << body.substr(0, nl);
    }
    EXPECT_GE(exact, 10) << "most prompts should hit input_len exactly (" << input_len << ")";
    EXPECT_NE((*prompts)[0].prompt_text, (*prompts)[1].prompt_text);
  }
  DatasetOptions too_short{.name = "sonnet", .path = data + "/sonnet.txt", .num_prompts = 1, .input_len = 5,
                           .output_len = 1, .tokenizer = &*tok};
  EXPECT_NE(build_dataset(too_short).status().message().find("--input-len"), std::string::npos);
  too_short.tokenizer = nullptr;
  too_short.input_len = 100;
  EXPECT_NE(build_dataset(too_short).status().message().find("--tokenizer"), std::string::npos);
}

TEST(LoadgenReport, JsonUsesVllmNamesAndHasEveryAdapter) {
  RunSettings s{.model = "base-model", .dataset_name = "random", .num_prompts = 3, .request_rate = 4.0,
                .lora_modules = {"a", "b"}, .percentiles = {90, 99, 99.9}};
  RequestOutcome ok{.target = "a", .success = true, .prompt_len = 10, .output_tokens = 3, .expected_output_len = 3,
                    .start_s = 0, .chunk_times_s = {0.1, 0.2, 0.3}, .chunk_tokens = {1, 1, 1}, .end_s = 0.3};
  RequestOutcome base = ok;
  base.target = "base-model";
  base.is_base = true;
  RequestOutcome bad{.target = "b", .error = "HTTP 500: boom", .expected_output_len = 3, .start_s = 0, .end_s = 0.1};
  const BenchReport r = make_report(s, {ok, base, bad}, 1.0, {{"a", 1}, {"b", 1}, {"base-model", 1}});
  const nlohmann::json j = report_json(r, /*detailed=*/true);
  for (const char* key : {"completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
                          "output_throughput", "total_token_throughput", "duration", "mean_ttft_ms", "median_ttft_ms",
                          "p90_ttft_ms", "p99_ttft_ms", "p99.9_ttft_ms", "std_tpot_ms", "median_itl_ms", "p99_e2el_ms",
                          "median_otps", "max_output_tokens_per_s", "max_concurrent_requests", "request_rate",
                          "max_concurrency", "per_adapter", "error_counts", "input_lens", "itls", "errors"})
    EXPECT_TRUE(j.contains(key)) << key;
  EXPECT_EQ(j["completed"], 2);
  EXPECT_EQ(j["failed"], 1);
  EXPECT_EQ(j["total_output_tokens"], 6);
  EXPECT_EQ(j["error_counts"]["HTTP 500: boom"], 1);
  EXPECT_EQ(j["per_adapter"].size(), 3u);
  EXPECT_EQ(j["per_adapter"]["b"]["failed"], 1);
  EXPECT_EQ(j["per_adapter"]["b"]["num_requests"], 1);
  EXPECT_EQ(j["per_adapter"]["base-model"]["is_base"], true);
  EXPECT_NEAR(j["per_adapter"]["a"]["median_otps"].get<double>(), 10.0, 1e-9);  // 2 tokens in 0.2 s
  EXPECT_EQ(j["errors"][2], "HTTP 500: boom");
  EXPECT_FALSE(report_json(r, false).contains("itls"));

  const std::string text = format_report(r);
  for (const char* line : {"============ Serving Benchmark Result ============", "Successful requests:",
                           "Failed requests:", "Total generated tokens:", "Mean TTFT (ms):", "P99.9 TTFT (ms):",
                           "Median OTPS (tok/s):", "Per Adapter", "base-model (base)", "HTTP 500: boom"})
    EXPECT_NE(text.find(line), std::string::npos) << line << "\n" << text;
}

}  // namespace
}  // namespace lmx::loadgen
