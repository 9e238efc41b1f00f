// CPU sampler (ops/sampling.h on the cpu backend), single-threaded: ms per sampled row at Qwen3's vocabulary
// (V = 151936) for greedy, plain temperature sampling, top-k, top-p, and with logprobs (top 20). Logits are
// random normals at two scales: 2 (a flat distribution: every token above 2^-25, the sampler's worst case)
// and 8 (peaked, closer to a trained model's). Prints the median of 5 runs of `rows` rows each.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "backends/cpu/cpu_backend.h"
#include "core/rng.h"

namespace {

using Clock = std::chrono::steady_clock;
using lmx::DType;
using lmx::OwnedTensor;

struct Case {
  const char* name;
  float temperature;
  int32_t top_k;
  float top_p;
  int logprobs;  // -1 = off, else the top-N width
};

}  // namespace

int main(int argc, char** argv) {
  const int64_t vocab = argc > 1 ? std::atoll(argv[1]) : 151936;
  const int64_t rows = argc > 2 ? std::atoll(argv[2]) : 16;
  lmx::cpu::CpuBackend backend(1);
  const Case cases[] = {
      {"greedy", 0.0f, 0, 1.0f, -1},           {"T=1", 1.0f, 0, 1.0f, -1},
      {"T=0.7 top_p=0.9", 0.7f, 0, 0.9f, -1},  {"T=0.7 top_k=50", 0.7f, 50, 1.0f, -1},
      {"T=1 top_k=50 top_p=0.95", 1.0f, 50, 0.95f, -1},
      {"greedy + logprobs 20", 0.0f, 0, 1.0f, 20}, {"T=1 + logprobs 20", 1.0f, 0, 1.0f, 20},
  };
  std::printf("cpu sampler, V = %lld, %lld rows per run, 1 thread; ms per row (median of 5 runs)\n",
              (long long)vocab, (long long)rows);
  std::printf("%-28s %14s %14s\n", "case", "logits x2", "logits x8");
  lmx::Rng rng(12345);
  OwnedTensor logits[2] = {OwnedTensor::host(DType::F32, {rows, vocab}), OwnedTensor::host(DType::F32, {rows, vocab})};
  const float scales[2] = {2.0f, 8.0f};
  for (int s = 0; s < 2; ++s)
    for (int64_t i = 0; i < rows * vocab; ++i) logits[s].view.ptr<float>()[i] = scales[s] * rng.normal();
  OwnedTensor temperature = OwnedTensor::host(DType::F32, {rows}), top_p = OwnedTensor::host(DType::F32, {rows});
  OwnedTensor uniform = OwnedTensor::host(DType::F32, {rows}), top_k = OwnedTensor::host(DType::I32, {rows});
  OwnedTensor out = OwnedTensor::host(DType::I32, {rows});
  for (const Case& c : cases) {
    std::printf("%-28s", c.name);
    for (int s = 0; s < 2; ++s) {
      for (int64_t r = 0; r < rows; ++r) {
        temperature.view.ptr<float>()[r] = c.temperature;
        top_k.view.ptr<int32_t>()[r] = c.top_k;
        top_p.view.ptr<float>()[r] = c.top_p;
        uniform.view.ptr<float>()[r] = rng.uniform();
      }
      lmx::ops::SamplingParams p{.logits = logits[s].view,
                                 .temperature = temperature.view,
                                 .top_k = top_k.view,
                                 .top_p = top_p.view,
                                 .uniform = uniform.view,
                                 .out_tokens = out.view};
      OwnedTensor out_logprob = OwnedTensor::host(DType::F32, {rows});
      OwnedTensor top_ids = OwnedTensor::host(DType::I32, {rows, 20}), top_lp = OwnedTensor::host(DType::F32, {rows, 20});
      if (c.logprobs >= 0) {
        p.out_logprob = out_logprob.view;
        p.out_top_ids = top_ids.view;
        p.out_top_logprobs = top_lp.view;
      }
      std::vector<double> runs;
      for (int run = 0; run < 5; ++run) {
        auto t0 = Clock::now();
        backend.sample(p);
        runs.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count() / double(rows));
      }
      std::sort(runs.begin(), runs.end());
      std::printf(" %14.3f", runs[2]);
    }
    std::printf("\n");
  }
  return 0;
}
