// Tokenizer encode throughput on the CPU, single-threaded: the sonnets (../shared/data/sonnet.txt)
// encoded whole and line by line with each real tokenizer; prints bytes, MB/s and tokens/s. The HF
// `tokenizers` figure to compare with comes from the Python snippet in docs/benchmarks.md.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace {

using Clock = std::chrono::steady_clock;

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

int main(int argc, char** argv) {
  // argv[1]: the shared data directory (default ../shared/data relative to the repository root).
  const std::string data = argc > 1 ? argv[1] : std::string(LORAMUX_SOURCE_DIR) + "/../shared/data";
  const int iterations = argc > 2 ? std::atoi(argv[2]) : 200;
  const std::string sonnet = read_file(data + "/sonnet.txt");
  if (sonnet.empty()) {
    std::fprintf(stderr, "bench_tokenizer: cannot read %s/sonnet.txt\n", data.c_str());
    return 1;
  }
  std::vector<std::string> lines;
  for (size_t start = 0;;) {
    const size_t end = sonnet.find('\n', start);
    lines.push_back(sonnet.substr(start, end == std::string::npos ? std::string::npos : end - start));
    if (end == std::string::npos) break;
    start = end + 1;
  }
  std::printf("sonnet.txt: %zu bytes, %zu lines, %d iterations, 1 thread\n", sonnet.size(), lines.size(), iterations);
  std::printf("%-12s %-10s %10s %10s %12s %10s\n", "tokenizer", "mode", "tokens", "MB/s", "Mtokens/s", "first ms");
  for (const char* name : {"gpt-oss", "qwen3", "deepseek-v3"}) {
    lmx::Result<lmx::tokenizer::Tokenizer> tok = lmx::tokenizer::Tokenizer::load(data + "/tokenizers/" + name);
    if (!tok.ok()) {
      std::fprintf(stderr, "bench_tokenizer: %s\n", tok.status().message().c_str());
      return 1;
    }
    // The first encode runs with an empty pre-token cache (the cold figure); the timed loop then sees
    // the warm cache, as HF's own BPE cache does in the Python comparison.
    auto t0 = Clock::now();
    size_t tokens = tok->encode(sonnet, false).size();
    const double first_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    t0 = Clock::now();
    size_t total = 0;
    for (int i = 0; i < iterations; ++i) total += tok->encode(sonnet, false).size();
    double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    std::printf("%-12s %-10s %10zu %10.1f %12.2f %10.2f\n", name, "whole", tokens,
                double(sonnet.size()) * iterations / seconds / 1e6, double(total) / seconds / 1e6, first_ms);
    t0 = Clock::now();
    total = 0;
    for (int i = 0; i < iterations; ++i)
      for (const std::string& line : lines) total += tok->encode(line, false).size();
    seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    std::printf("%-12s %-10s %10zu %10.1f %12.2f %10s\n", name, "per-line", total / size_t(iterations),
                double(sonnet.size() - (lines.size() - 1)) * iterations / seconds / 1e6, double(total) / seconds / 1e6, "");
  }
  return 0;
}
