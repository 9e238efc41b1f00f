// Sampling (ops/sampling.h) on the cpu backend against a reference computed in double. Tokens must match
// exactly, so draws whose uniform number or top_p lands within fp32 noise of a CDF boundary are redrawn
// (there double and fp32 arithmetic may legitimately disagree).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "backends/cpu/cpu_backend.h"
#include "op_test_util.h"

namespace lmx {
namespace {

struct Draw {
  float temperature;
  int32_t top_k;
  float top_p;
  float uniform;
};

// The token the contract prescribes, or -1 when the draw sits too close to a boundary to call.
int32_t reference_token(const float* logits, int vocab, const Draw& d) {
  if (d.temperature == 0.0f) return int32_t(std::max_element(logits, logits + vocab) - logits);
  std::vector<double> p(vocab);
  const double m = *std::max_element(logits, logits + vocab) / double(d.temperature);
  double sum = 0.0;
  for (int v = 0; v < vocab; ++v) sum += p[v] = std::exp(logits[v] / double(d.temperature) - m);
  for (double& x : p) x /= sum;
  std::vector<int32_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return p[a] > p[b]; });
  const int kept = (d.top_k > 0 && d.top_k < vocab) ? d.top_k : vocab;
  double kept_mass = 0.0;
  for (int i = 0; i < kept; ++i) kept_mass += p[order[i]];
  constexpr double kMargin = 1e-4;  // relative distance from a boundary below which we do not judge

  // The token for a given top-p prefix length, or -1 when the uniform number sits on a CDF boundary.
  auto pick = [&](int prefix) -> int32_t {
    double prefix_mass = 0.0;
    for (int i = 0; i < prefix; ++i) prefix_mass += p[order[i]];
    const double target = d.uniform * prefix_mass;
    double cumulative = 0.0;
    for (int i = 0; i < prefix; ++i) {
      cumulative += p[order[i]];
      if (std::abs(cumulative - target) < kMargin * prefix_mass) return -1;
      if (target < cumulative) return order[i];
    }
    return order[prefix - 1];
  };
  // Prefix lengths the top_p rule may give under fp32 rounding: the exact one, and any whose mass lies
  // within the margin of the threshold. They must all lead to the same token.
  std::vector<int> prefixes;
  double cumulative = 0.0;
  for (int i = 0; i < kept; ++i) {
    cumulative += p[order[i]];
    const double need = d.top_p * kept_mass;
    if (std::abs(cumulative - need) < kMargin * kept_mass) prefixes.push_back(i + 1);
    if (cumulative >= need) {
      prefixes.push_back(i + 1);
      break;
    }
  }
  if (prefixes.empty()) prefixes.push_back(kept);
  const int32_t token = pick(prefixes.back());
  for (int prefix : prefixes) {
    if (pick(prefix) != token) return -1;
  }
  return token;
}

void check_sampling(uint64_t seed, int vocab, const std::vector<Draw>& configs, int draws_per_config) {
  SCOPED_TRACE("seed " + std::to_string(seed) + " V=" + std::to_string(vocab));
  Rng rng(seed);
  const int rows = int(configs.size()) * draws_per_config;
  OwnedTensor logits = test::random_f32(rng, {rows, vocab}, 2.0f);
  std::vector<float> temperature, top_p, uniform;
  std::vector<int32_t> top_k, want;
  for (int row = 0; row < rows; ++row) {
    Draw d = configs[row / draws_per_config];
    const float* row_logits = logits.view.ptr<float>() + int64_t(row) * vocab;
    int32_t token = -1;
    for (int attempt = 0; attempt < 1000 && token < 0; ++attempt) {  // redraw until the reference can call it
      d.uniform = rng.uniform();
      token = reference_token(row_logits, vocab, d);
    }
    ASSERT_GE(token, 0) << "row " << row << ": no uniform number away from the CDF boundaries";
    want.push_back(token);
    temperature.push_back(d.temperature);
    top_k.push_back(d.top_k);
    top_p.push_back(d.top_p);
    uniform.push_back(d.uniform);
  }
  OwnedTensor temperature_t = test::f32_tensor(temperature), top_p_t = test::f32_tensor(top_p);
  OwnedTensor uniform_t = test::f32_tensor(uniform), top_k_t = test::i32_tensor(top_k);
  OwnedTensor out = OwnedTensor::host(DType::I32, {rows});
  test::poison(out);
  cpu::CpuBackend backend(1);
  backend.sample({.logits = logits,
                  .temperature = temperature_t,
                  .top_k = top_k_t,
                  .top_p = top_p_t,
                  .uniform = uniform_t,
                  .out_tokens = out});
  for (int row = 0; row < rows; ++row) {
    ASSERT_EQ(out.view.ptr<int32_t>()[row], want[row])
        << "row " << row << ": T=" << temperature[row] << " top_k=" << top_k[row] << " top_p=" << top_p[row]
        << " u=" << uniform[row];
  }
}

TEST(Sampling, MatchesReference) {
  const std::vector<Draw> configs{
      {1.0f, 0, 1.0f, 0}, {0.7f, 5, 1.0f, 0},    {1.3f, 0, 0.9f, 0},  {0.5f, 50, 0.5f, 0},
      {1.0f, 1, 1.0f, 0}, {1.0f, 1000, 1.0f, 0}, {2.0f, 0, 1e-6f, 0}, {3.0f, 20, 0.95f, 0},
      {0.0f, 0, 1.0f, 0}, {0.0f, 7, 0.3f, 0},  // greedy ignores top_k/top_p
  };
  check_sampling(1, 100, configs, 20);
  check_sampling(2, 1, configs, 2);  // V = 1: always token 0
  check_sampling(3, 3000, configs, 3);
}

TEST(Sampling, GreedyTakesTheLowestIdOnTies) {
  OwnedTensor logits = test::f32_tensor({0.5f, 2.0f, -1.0f, 2.0f, 2.0f, 1.0f, 1.0f, 0.0f}, {2, 4});
  OwnedTensor temperature = test::f32_tensor({0.0f, 0.0f}), top_p = test::f32_tensor({1.0f, 1.0f});
  OwnedTensor uniform = test::f32_tensor({0.9f, 0.1f});
  OwnedTensor top_k = test::i32_tensor({0, 0});
  OwnedTensor out = OwnedTensor::host(DType::I32, {2});
  test::poison(out);
  cpu::CpuBackend(1).sample({.logits = logits,
                             .temperature = temperature,
                             .top_k = top_k,
                             .top_p = top_p,
                             .uniform = uniform,
                             .out_tokens = out});
  EXPECT_EQ(out.view.ptr<int32_t>()[0], 1);
  EXPECT_EQ(out.view.ptr<int32_t>()[1], 0);
}

// Top-k with equal probabilities keeps the lower ids, and the CDF walks them in id order.
TEST(Sampling, TiesInTheCdfGoByTokenId) {
  OwnedTensor logits = test::f32_tensor({1.0f, 3.0f, 3.0f, 3.0f, 3.0f}, {1, 5});
  OwnedTensor temperature = test::f32_tensor({1.0f}), top_p = test::f32_tensor({1.0f});
  OwnedTensor top_k = test::i32_tensor({2});
  OwnedTensor out = OwnedTensor::host(DType::I32, {1});
  cpu::CpuBackend backend(1);
  for (auto [u, token] : {std::pair{0.0f, 1}, {0.49f, 1}, {0.51f, 2}, {0.99f, 2}}) {
    OwnedTensor uniform = test::f32_tensor({u});
    test::poison(out);
    backend.sample({.logits = logits,
                    .temperature = temperature,
                    .top_k = top_k,
                    .top_p = top_p,
                    .uniform = uniform,
                    .out_tokens = out});
    EXPECT_EQ(out.view.ptr<int32_t>()[0], token) << "u = " << u;
  }
}

TEST(SamplingDeathTest, OutOfRangeSettingsAbort) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  OwnedTensor logits = test::f32_tensor({1.0f, 2.0f}, {1, 2});
  OwnedTensor temperature = test::f32_tensor({1.0f}), uniform = test::f32_tensor({0.5f});
  OwnedTensor top_p = test::f32_tensor({0.0f});
  OwnedTensor top_k = test::i32_tensor({0});
  OwnedTensor out = OwnedTensor::host(DType::I32, {1});
  EXPECT_DEATH(cpu::CpuBackend(1).sample({.logits = logits,
                                          .temperature = temperature,
                                          .top_k = top_k,
                                          .top_p = top_p,
                                          .uniform = uniform,
                                          .out_tokens = out}),
               "sample .*top_p\\[0\\] = 0.0+ is outside \\(0, 1\\]");
  OwnedTensor nan_logits = test::f32_tensor({1.0f, NAN}, {1, 2});
  OwnedTensor good_top_p = test::f32_tensor({1.0f});
  EXPECT_DEATH(cpu::CpuBackend(1).sample({.logits = nan_logits, .temperature = temperature, .top_k = top_k,
                                          .top_p = good_top_p, .uniform = uniform, .out_tokens = out}),
               "sample .*SamplingParams.logits\\[0\\]\\[1\\] is NaN");
}

}  // namespace
}  // namespace lmx
