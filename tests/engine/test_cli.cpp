// The loramux CLI end to end (the binary ctest built): generate with the default preset, mixed-adapter
// --requests files with a bad line among good ones, and clear errors for bad arguments.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "../common/temp_dir.h"

namespace {

struct CliRun {
  int exit_code = -1;
  std::string out;  // stdout and stderr together
};

CliRun run_cli(const std::string& args) {
  const char* bin = std::getenv("LORAMUX_BIN");
  EXPECT_NE(bin, nullptr) << "LORAMUX_BIN not set (ctest sets it)";
  CliRun r;
  if (!bin) return r;
  std::string cmd = std::string(bin) + " " + args + " 2>&1";
  FILE* pipe = popen(cmd.c_str(), "r");
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), pipe)) > 0) r.out.append(buf.data(), n);
  int status = pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

std::vector<nlohmann::json> json_lines(const std::string& text) {
  std::vector<nlohmann::json> lines;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(pos, end - pos);
    if (!line.empty() && line[0] == '{') lines.push_back(nlohmann::json::parse(line));
    pos = end + 1;
  }
  return lines;
}

TEST(Cli, GenerateDefaultRuns) {
  CliRun r = run_cli("generate --max-tokens 5 --ignore-eos");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  auto lines = json_lines(r.out);
  ASSERT_EQ(lines.size(), 1u) << r.out;
  EXPECT_EQ(lines[0]["token_ids"].size(), 5u);
}

TEST(Cli, RequestsFileMixesAdaptersAndReportsBadLinesInOrder) {
  lmx::testing::TempDir dir("cli");
  std::string file = dir.file("requests.jsonl");
  {
    std::ofstream f(file);
    f << R"({"adapter": "lora0", "prompt_ids": [5, 6, 7], "max_tokens": 4})" << "\n"
      << R"({"adapter": null, "prompt_ids": [5, 6, 7], "max_tokens": 4})" << "\n"
      << R"({"adapter": "missing", "prompt_ids": [5, 6, 7]})" << "\n"
      << "not json\n"
      << R"({"adapter": "lora1", "prompt_ids": [5, 6, 7], "max_tokens": 4})" << "\n";
  }
  CliRun r = run_cli("generate --dummy-loras 2 --ignore-eos --requests " + file);
  EXPECT_EQ(r.exit_code, 1) << r.out;  // some requests failed
  auto lines = json_lines(r.out);
  ASSERT_EQ(lines.size(), 5u) << r.out;
  for (int i = 0; i < 5; ++i) EXPECT_EQ(lines[size_t(i)]["index"], i);
  EXPECT_EQ(lines[0]["token_ids"].size(), 4u);
  EXPECT_EQ(lines[1]["token_ids"].size(), 4u);
  EXPECT_NE(lines[2]["error"].get<std::string>().find("unknown adapter 'missing'"), std::string::npos);
  EXPECT_NE(lines[3]["error"].get<std::string>().find("line 4"), std::string::npos);
  EXPECT_EQ(lines[4]["token_ids"].size(), 4u);
  // Each adapter is used: the two adapters and the base disagree somewhere.
  EXPECT_TRUE(lines[0]["token_ids"] != lines[1]["token_ids"] || lines[4]["token_ids"] != lines[1]["token_ids"]);

  // The same requests one by one give the same tokens as the mixed batch.
  CliRun alone = run_cli("generate --dummy-loras 2 --ignore-eos --adapter lora0 --prompt-ids 5,6,7 --max-tokens 4");
  ASSERT_EQ(alone.exit_code, 0) << alone.out;
  EXPECT_EQ(json_lines(alone.out)[0]["token_ids"], lines[0]["token_ids"]);
}

TEST(Cli, BadArgumentsFailWithMessage) {
  CliRun bad_model = run_cli("generate --model /nonexistent/model");
  EXPECT_NE(bad_model.exit_code, 0);
  EXPECT_NE(bad_model.out.find("/nonexistent/model"), std::string::npos) << bad_model.out;
  CliRun bad_preset = run_cli("generate --model preset:nope");
  EXPECT_NE(bad_preset.exit_code, 0);
  EXPECT_NE(bad_preset.out.find("nope"), std::string::npos) << bad_preset.out;
  CliRun bad_lora = run_cli("generate --lora justaname");
  EXPECT_NE(bad_lora.exit_code, 0);
  EXPECT_NE(bad_lora.out.find("NAME=DIR"), std::string::npos) << bad_lora.out;
  CliRun bad_ids = run_cli("generate --prompt-ids 1,x");
  EXPECT_NE(bad_ids.exit_code, 0);
  EXPECT_NE(bad_ids.out.find("'x'"), std::string::npos) << bad_ids.out;
  CliRun both_mxfp4 = run_cli("generate --model preset:tiny-moe --mxfp4-experts --no-mxfp4-experts");
  EXPECT_NE(both_mxfp4.exit_code, 0);
  EXPECT_NE(both_mxfp4.out.find("excludes"), std::string::npos) << both_mxfp4.out;
  CliRun forced_mxfp4 = run_cli("generate --model preset:tiny-moe --mxfp4-experts --prompt-ids 1,2 --max-tokens 1");
  EXPECT_NE(forced_mxfp4.exit_code, 0);  // forced on: tiny-moe's experts do not fit the decode layout
  EXPECT_NE(forced_mxfp4.out.find("--mxfp4-experts"), std::string::npos) << forced_mxfp4.out;
  CliRun bad_device = run_cli("generate --device tpu");
  EXPECT_NE(bad_device.exit_code, 0);
  EXPECT_NE(bad_device.out.find("tpu"), std::string::npos) << bad_device.out;
}

}  // namespace

namespace {

std::string fixture(const std::string& rel) { return std::string(LORAMUX_SOURCE_DIR) + "/tests/fixtures/" + rel; }

TEST(Cli, InspectDescribesModelsAndAdapters) {
  CliRun model = run_cli("inspect " + fixture("gpt_oss/model"));
  ASSERT_EQ(model.exit_code, 0) << model.out;
  EXPECT_NE(model.out.find("GptOssForCausalLM"), std::string::npos) << model.out;
  EXPECT_NE(model.out.find("MXFP4"), std::string::npos) << model.out;

  CliRun adapter = run_cli("inspect " + fixture("gpt_oss/adapters/mixed_rank") + " --model " + fixture("gpt_oss/model"));
  ASSERT_EQ(adapter.exit_code, 0) << adapter.out;
  EXPECT_NE(adapter.out.find("target_parameters"), std::string::npos) << adapter.out;
  EXPECT_NE(adapter.out.find("experts.gate_up"), std::string::npos) << adapter.out;
  EXPECT_NE(adapter.out.find("content hash"), std::string::npos) << adapter.out;

  CliRun per_expert = run_cli("inspect " + fixture("mixtral/adapters/attn_w123") + " --model " + fixture("mixtral/model"));
  ASSERT_EQ(per_expert.exit_code, 0) << per_expert.out;
  EXPECT_NE(per_expert.out.find("experts.gate_up"), std::string::npos) << per_expert.out;
}

TEST(Cli, InspectRejectsAdapterOfAnotherArchitecture) {
  CliRun r = run_cli("inspect " + fixture("mixtral/adapters/attn_w123") + " --model " + fixture("gpt_oss/model"));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.out.find("another architecture"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("adapter_model.safetensors"), std::string::npos) << r.out;
  CliRun no_base = run_cli("inspect " + fixture("gpt_oss/adapters/attn"));
  EXPECT_NE(no_base.exit_code, 0);
  EXPECT_NE(no_base.out.find("--model"), std::string::npos) << no_base.out;
}

TEST(Cli, GenerateWithPeftAdapterDirectory) {
  std::string model = fixture("llama/model");
  CliRun r = run_cli("generate --model " + model + " --lora q=" + fixture("llama/adapters/qv_r16") +
                     " --adapter q --prompt-ids 3,4,5,6,7 --max-tokens 3 --ignore-eos");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("\"adapter\":\"q\""), std::string::npos) << r.out;
  CliRun bad = run_cli("generate --model " + model + " --lora q=/nonexistent/adapter");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.out.find("/nonexistent/adapter"), std::string::npos) << bad.out;
}

}  // namespace

namespace {

TEST(Cli, DumpActivationsWritesEveryLayerPerStep) {
  lmx::testing::TempDir dir("dump");
  CliRun r = run_cli("generate --max-tokens 2 --ignore-eos --dump-activations " + dir.str());
  ASSERT_EQ(r.exit_code, 0) << r.out;
  for (const char* step : {"step0.safetensors", "step1.safetensors"}) {
    std::ifstream f(dir.file(step), std::ios::binary);
    ASSERT_TRUE(f.good()) << step;
    std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    for (const char* name : {"\"embedding\"", "\"layer0.attention\"", "\"layer1.mlp\"", "\"logits\""})
      EXPECT_NE(bytes.find(name), std::string::npos) << step << " lacks " << name;
  }
}

}  // namespace

namespace {

// Text in: --prompt is encoded with the tokenizer (a preset then takes the tokenizer's vocabulary), so it
// generates exactly what the same ids given with --prompt-ids generate; --messages goes through the chat
// template. Needs the published Qwen3 tokenizer from ../shared/data.
TEST(Cli, GenerateFromTextAndMessages) {
  const std::string shared = LORAMUX_SHARED_DATA;
  if (shared.empty()) GTEST_SKIP() << "this build found no shared data (../shared/data)";
  const std::string tok = shared + "/tokenizers/qwen3";
  const std::string common = "generate --model preset:tiny-moe --tokenizer " + tok + " --max-tokens 4 --ignore-eos ";

  lmx::testing::TempDir dir("text");
  std::ofstream(dir.file("line.txt")) << "\"Shall I compare thee to a summer day?\"\n";
  CliRun ids = run_cli("tokenize --model " + tok + " < " + dir.file("line.txt"));
  ASSERT_EQ(ids.exit_code, 0) << ids.out;
  std::string id_list = nlohmann::json::parse(ids.out).dump();
  id_list = id_list.substr(1, id_list.size() - 2);  // "[1,2,3]" -> "1,2,3"

  CliRun text = run_cli(common + "--prompt 'Shall I compare thee to a summer day?'");
  ASSERT_EQ(text.exit_code, 0) << text.out;
  CliRun by_ids = run_cli(common + "--prompt-ids " + id_list);
  ASSERT_EQ(by_ids.exit_code, 0) << by_ids.out;
  auto t = json_lines(text.out), b = json_lines(by_ids.out);
  ASSERT_EQ(t.size(), 1u);
  ASSERT_EQ(b.size(), 1u);
  EXPECT_EQ(t[0]["token_ids"].size(), 4u);
  EXPECT_EQ(t[0]["token_ids"], b[0]["token_ids"]);
  EXPECT_TRUE(t[0]["text"].is_string());

  std::ofstream(dir.file("chat.json")) << R"([{"role": "user", "content": "Name a sonnet."}])";
  CliRun chat = run_cli(common + "--messages " + dir.file("chat.json"));
  ASSERT_EQ(chat.exit_code, 0) << chat.out;
  EXPECT_EQ(json_lines(chat.out)[0]["token_ids"].size(), 4u);

  std::ofstream(dir.file("bad.json")) << R"({"role": "user"})";
  CliRun bad = run_cli(common + "--messages " + dir.file("bad.json"));
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.out.find("expected a JSON array of messages"), std::string::npos) << bad.out;
  CliRun no_tok = run_cli("generate --model preset:tiny-moe --prompt hello");
  EXPECT_NE(no_tok.exit_code, 0);
  EXPECT_NE(no_tok.out.find("--tokenizer"), std::string::npos) << no_tok.out;
}

}  // namespace
