// `loramux generate` with the adapter tiers and prefix caching flags, end to end through the binary: a
// requests file over more dummy adapters than slots and host entries, with shared prefixes, gives the same
// tokens as a roomy run without prefix caching; bad --pin-lora / --max-cpu-loras values fail by name.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
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

TEST(CliTiers, TieredAndCachedRunEqualsRoomyUncachedRun) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  lmx::testing::TempDir dir("cli_tiers");
  const std::string file = dir.file("requests.jsonl");
  {
    std::vector<int> system(20);
    for (int& t : system) t = int(1 + rng() % 250);
    std::ofstream f(file);
    for (int i = 0; i < 12; ++i) {
      nlohmann::json prompt = system;
      for (int k = 0; k < 1 + i % 4; ++k) prompt.push_back(int(1 + rng() % 250));
      nlohmann::json line = {{"prompt_ids", prompt}, {"max_tokens", 3 + i % 3}};
      line["adapter"] = i % 5 == 4 ? nlohmann::json(nullptr) : nlohmann::json("lora" + std::to_string(i % 5));
      f << line.dump() << "\n";
    }
  }
  const std::string common = "generate --dummy-loras 4 --ignore-eos --page-size 4 --requests " + file;
  CliRun roomy = run_cli(common + " --max-loras 4 --no-enable-prefix-caching");
  ASSERT_EQ(roomy.exit_code, 0) << roomy.out;
  CliRun tiered = run_cli(common + " --max-loras 2 --max-cpu-loras 2 --pin-lora lora3 --max-num-seqs 3");
  ASSERT_EQ(tiered.exit_code, 0) << tiered.out;
  std::vector<nlohmann::json> a = json_lines(roomy.out), b = json_lines(tiered.out);
  ASSERT_EQ(a.size(), 12u) << roomy.out;
  ASSERT_EQ(b.size(), 12u) << tiered.out;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i]["token_ids"], b[i]["token_ids"]) << "request " << i;
    EXPECT_EQ(a[i]["adapter"], b[i]["adapter"]) << "request " << i;
  }
}

TEST(CliTiers, BadTierFlagsFailWithMessage) {
  CliRun pin = run_cli("generate --dummy-loras 2 --pin-lora nope --max-tokens 2");
  EXPECT_EQ(pin.exit_code, 1) << pin.out;
  EXPECT_NE(pin.out.find("--pin-lora 'nope' names no --lora or --dummy-loras adapter"), std::string::npos) << pin.out;
  CliRun host = run_cli("generate --dummy-loras 2 --max-loras 2 --max-cpu-loras 1 --max-tokens 2");
  EXPECT_EQ(host.exit_code, 1) << host.out;
  EXPECT_NE(host.out.find("max_cpu_loras 1 must be 0 (no limit) or >= max_loras 2"), std::string::npos) << host.out;
  CliRun all_pinned = run_cli("generate --dummy-loras 2 --max-loras 1 --pin-lora lora0 --pin-lora lora1 --max-tokens 2");
  EXPECT_EQ(all_pinned.exit_code, 1) << all_pinned.out;
  EXPECT_NE(all_pinned.out.find("cannot pin adapter 'lora1'"), std::string::npos) << all_pinned.out;
}

}  // namespace
