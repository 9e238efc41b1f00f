// Sampling (ops/sampling.h) on the cpu backend against a reference computed in double. Tokens must match
// exactly, so draws whose uniform number or top_p lands within fp32 noise of a CDF boundary are redrawn
// (there double and fp32 arithmetic may legitimately disagree). The selection-based sampler must also pick
// exactly what the previous full-sort sampler picked (kept below as `full_sort_token`) on every draw,
// boundaries included, and the raw logprobs match a double-precision log_softmax.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstdlib>
#include <numeric>
#include <random>
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

void check_sampling(uint64_t seed, int vocab, const std::vector<Draw>& configs, int draws_per_config,
                    float logit_scale = 2.0f) {
  SCOPED_TRACE("seed " + std::to_string(seed) + " V=" + std::to_string(vocab));
  Rng rng(seed);
  const int rows = int(configs.size()) * draws_per_config;
  OwnedTensor logits = test::random_f32(rng, {rows, vocab}, logit_scale);
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

// A seed fresh on every run unless LORAMUX_TEST_SEED pins it; tests print it in their trace.
uint64_t fresh_seed() {
  const char* pinned = std::getenv("LORAMUX_TEST_SEED");
  return pinned ? std::strtoull(pinned, nullptr, 10) : std::random_device{}();
}

// The previous CPU sampler, verbatim in its arithmetic: softmax in fp32, a partial sort of the whole
// vocabulary by (probability desc, id asc), then sequential fp32 sums. The new sampler must agree on every
// draw — not only away from CDF boundaries — because it performs the same fp32 additions.
int32_t full_sort_token(const float* logits, int64_t vocab, float temperature, int32_t top_k, float top_p, float uniform) {
  if (temperature == 0.0f) return int32_t(std::max_element(logits, logits + vocab) - logits);
  std::vector<float> probs(vocab);
  float max_scaled = -INFINITY;
  for (int64_t v = 0; v < vocab; ++v) {
    probs[v] = logits[v] / temperature;
    max_scaled = std::max(max_scaled, probs[v]);
  }
  float sum = 0.0f;
  for (int64_t v = 0; v < vocab; ++v) {
    probs[v] = std::exp(probs[v] - max_scaled);
    sum += probs[v];
  }
  for (int64_t v = 0; v < vocab; ++v) probs[v] /= sum;
  const int64_t kept = (top_k > 0 && top_k < vocab) ? top_k : vocab;
  std::vector<int32_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + kept, order.end(),
                    [&](int32_t a, int32_t b) { return probs[a] > probs[b] || (probs[a] == probs[b] && a < b); });
  float kept_mass = 0.0f;
  for (int64_t i = 0; i < kept; ++i) kept_mass += probs[order[i]];
  const float mass_needed = top_p * kept_mass;
  int64_t prefix = kept;
  float cumulative = 0.0f;
  for (int64_t i = 0; i < kept; ++i) {
    cumulative += probs[order[i]];
    if (cumulative >= mass_needed) {
      prefix = i + 1;
      break;
    }
  }
  float prefix_mass = 0.0f;
  for (int64_t i = 0; i < prefix; ++i) prefix_mass += probs[order[i]];
  const float target = uniform * prefix_mass;
  cumulative = 0.0f;
  for (int64_t i = 0; i < prefix; ++i) {
    cumulative += probs[order[i]];
    if (target < cumulative) return order[i];
  }
  return order[prefix - 1];
}

// Rows of logits of one shape: random normals at `scale`, optionally rounded to a grid so that many
// probabilities tie exactly (ties must go to the lower id in every backend).
OwnedTensor sampling_logits(Rng& rng, int64_t rows, int64_t vocab, float scale, float grid) {
  OwnedTensor logits = test::random_f32(rng, {rows, vocab}, scale);
  if (grid > 0.0f)
    for (int64_t i = 0; i < rows * vocab; ++i) logits.view.ptr<float>()[i] = std::round(logits.view.ptr<float>()[i] / grid) * grid;
  return logits;
}

TEST(Sampling, SameTokensAsTheFullSortSamplerOnEveryDraw) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with LORAMUX_TEST_SEED)");
  Rng rng(seed);
  struct Shape {
    int64_t vocab;
    float scale, grid;
  };
  // Flat (scale 0.5: every token above 2^-25), peaked (scale 8, 20: most tokens below it), and tied.
  const Shape shapes[] = {{1, 1.0f, 0.0f},      {7, 2.0f, 0.0f},       {100, 2.0f, 0.5f},   {3000, 0.5f, 0.0f},
                          {3000, 8.0f, 0.0f},   {5000, 2.0f, 0.25f},   {151936, 0.5f, 0.0f}, {151936, 2.0f, 0.0f},
                          {151936, 8.0f, 0.0f}, {151936, 20.0f, 0.0f}, {151936, 3.0f, 1.0f}};
  const float temperatures[] = {0.3f, 1.0f, 2.5f};
  const int32_t top_ks[] = {0, 1, 50, 3000, 200000};
  const float top_ps[] = {1.0f, 0.95f, 0.5f, 1e-6f};
  cpu::CpuBackend backend(1);
  for (const Shape& shape : shapes) {
    const int64_t rows = shape.vocab >= 100000 ? 12 : 60;
    OwnedTensor logits = sampling_logits(rng, rows, shape.vocab, shape.scale, shape.grid);
    std::vector<float> temperature, top_p, uniform;
    std::vector<int32_t> top_k;
    for (int64_t r = 0; r < rows; ++r) {
      temperature.push_back(temperatures[rng.next_u64() % 3]);
      top_k.push_back(top_ks[rng.next_u64() % 5]);
      top_p.push_back(top_ps[rng.next_u64() % 4]);
      uniform.push_back(rng.uniform());
    }
    OwnedTensor temperature_t = test::f32_tensor(temperature), top_p_t = test::f32_tensor(top_p);
    OwnedTensor uniform_t = test::f32_tensor(uniform), top_k_t = test::i32_tensor(top_k);
    OwnedTensor out = OwnedTensor::host(DType::I32, {rows});
    test::poison(out);
    backend.sample({.logits = logits, .temperature = temperature_t, .top_k = top_k_t, .top_p = top_p_t,
                    .uniform = uniform_t, .out_tokens = out});
    for (int64_t r = 0; r < rows; ++r) {
      const int32_t want = full_sort_token(logits.view.ptr<float>() + r * shape.vocab, shape.vocab, temperature[r],
                                           top_k[r], top_p[r], uniform[r]);
      ASSERT_EQ(out.view.ptr<int32_t>()[r], want)
          << "V=" << shape.vocab << " scale " << shape.scale << " grid " << shape.grid << " row " << r
          << ": T=" << temperature[r] << " top_k=" << top_k[r] << " top_p=" << top_p[r] << " u=" << uniform[r];
    }
  }
}

// Uniform numbers at the very edges of the CDF: the top of [0, 1) and 0, for flat and peaked rows.
TEST(Sampling, CdfEdgesMatchTheFullSortSampler) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with LORAMUX_TEST_SEED)");
  Rng rng(seed);
  cpu::CpuBackend backend(1);
  for (float scale : {0.5f, 8.0f}) {
    OwnedTensor logits = sampling_logits(rng, 4, 151936, scale, 0.0f);
    OwnedTensor temperature = test::f32_tensor({1.0f, 1.0f, 0.7f, 1.0f}), top_p = test::f32_tensor({1.0f, 0.9f, 1.0f, 1.0f});
    OwnedTensor uniform = test::f32_tensor({0.99999994f, 0.99999994f, 0.0f, 0.5f});
    OwnedTensor top_k = test::i32_tensor({0, 0, 40, 151936});
    OwnedTensor out = OwnedTensor::host(DType::I32, {4});
    test::poison(out);
    backend.sample({.logits = logits, .temperature = temperature, .top_k = top_k, .top_p = top_p, .uniform = uniform,
                    .out_tokens = out});
    for (int r = 0; r < 4; ++r) {
      EXPECT_EQ(out.view.ptr<int32_t>()[r],
                full_sort_token(logits.view.ptr<float>() + r * 151936, 151936, temperature.view.ptr<float>()[r],
                                top_k.view.ptr<int32_t>()[r], top_p.view.ptr<float>()[r], uniform.view.ptr<float>()[r]))
          << "scale " << scale << " row " << r;
    }
  }
}

// The double-precision reference sampler at Qwen3's vocabulary (151936). Peaked logits (scale 8, like a
// trained model's): with flat ones nearly every uniform number lies within the reference's margin of some
// CDF boundary and cannot be judged; the full-sort comparison above covers flat rows exactly.
TEST(Sampling, MatchesReferenceAt151kVocabulary) {
  const std::vector<Draw> configs{
      {1.0f, 0, 1.0f, 0}, {0.7f, 50, 1.0f, 0}, {1.3f, 0, 0.9f, 0}, {0.6f, 20, 0.8f, 0}, {0.0f, 0, 1.0f, 0}};
  check_sampling(fresh_seed(), 151936, configs, 1, 8.0f);
}

// Raw logprobs against log_softmax in double: the sampled token's, and the top N (ids exact: the N largest
// logits, ties to the lower id). Sampling settings must not change them; the greedy token is the top-1.
TEST(Sampling, RawLogprobsMatchDoubleLogSoftmax) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with LORAMUX_TEST_SEED)");
  Rng rng(seed);
  cpu::CpuBackend backend(1);
  struct Shape {
    int64_t vocab;
    int64_t top_n;
    float scale, grid;
  };
  for (const Shape& shape : {Shape{1, 1, 1.0f, 0.0f}, Shape{5, 5, 2.0f, 0.0f}, Shape{100, 0, 2.0f, 0.0f},
                             Shape{100, 20, 2.0f, 0.5f}, Shape{3000, 3, 8.0f, 0.0f}, Shape{151936, 20, 2.0f, 0.0f},
                             Shape{151936, 1, 20.0f, 0.0f}}) {
    SCOPED_TRACE("V=" + std::to_string(shape.vocab) + " N=" + std::to_string(shape.top_n));
    const int64_t rows = 6;
    OwnedTensor logits = sampling_logits(rng, rows, shape.vocab, shape.scale, shape.grid);
    OwnedTensor temperature = test::f32_tensor({0.0f, 1.0f, 0.5f, 2.0f, 0.0f, 1.0f});
    OwnedTensor top_k = test::i32_tensor({0, 0, 3, 0, 0, 1});
    OwnedTensor top_p = test::f32_tensor({1.0f, 0.9f, 1.0f, 0.5f, 1.0f, 1.0f});
    std::vector<float> u;
    for (int r = 0; r < rows; ++r) u.push_back(rng.uniform());
    OwnedTensor uniform = test::f32_tensor(u);
    OwnedTensor out = OwnedTensor::host(DType::I32, {rows}), out_logprob = OwnedTensor::host(DType::F32, {rows});
    OwnedTensor top_ids = OwnedTensor::host(DType::I32, {rows, shape.top_n});
    OwnedTensor top_logprobs = OwnedTensor::host(DType::F32, {rows, shape.top_n});
    for (const OwnedTensor* t : {&out, &out_logprob, &top_ids, &top_logprobs}) test::poison(t->view);
    ops::SamplingParams p{.logits = logits, .temperature = temperature, .top_k = top_k, .top_p = top_p,
                          .uniform = uniform, .out_tokens = out, .out_logprob = out_logprob};
    if (shape.top_n > 0) {
      p.out_top_ids = top_ids.view;
      p.out_top_logprobs = top_logprobs.view;
    }
    backend.sample(p);
    // The same rows without logprobs sample the same tokens (logprobs never change the output).
    OwnedTensor plain = OwnedTensor::host(DType::I32, {rows});
    test::poison(plain);
    backend.sample({.logits = logits, .temperature = temperature, .top_k = top_k, .top_p = top_p, .uniform = uniform,
                    .out_tokens = plain});
    for (int64_t r = 0; r < rows; ++r) {
      SCOPED_TRACE("row " + std::to_string(r));
      const float* row = logits.view.ptr<float>() + r * shape.vocab;
      const int32_t token = out.view.ptr<int32_t>()[r];
      ASSERT_EQ(token, plain.view.ptr<int32_t>()[r]);
      ASSERT_GE(token, 0);
      ASSERT_LT(token, shape.vocab);
      const double max_logit = *std::max_element(row, row + shape.vocab);
      double sum = 0.0;
      for (int64_t v = 0; v < shape.vocab; ++v) sum += std::exp(double(row[v]) - max_logit);
      const double lse = max_logit + std::log(sum);
      // docs/NUMERICS.md "raw logprobs": fp32 exps summed in double, one fp32 rounding of logit - lse.
      auto expect_logprob = [&](float got, int32_t id) {
        const double want = double(row[id]) - lse;
        EXPECT_NEAR(got, want, 1e-5 * (1.0 + std::abs(want))) << "token " << id;
      };
      expect_logprob(out_logprob.view.ptr<float>()[r], token);
      std::vector<int32_t> order(shape.vocab);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return row[a] > row[b]; });
      double mass = 0.0;
      for (int64_t i = 0; i < shape.top_n; ++i) {
        const int32_t id = top_ids.view.ptr<int32_t>()[r * shape.top_n + i];
        ASSERT_EQ(id, order[i]) << "top " << i;
        const float lp = top_logprobs.view.ptr<float>()[r * shape.top_n + i];
        expect_logprob(lp, id);
        if (i > 0) {
          EXPECT_LE(lp, top_logprobs.view.ptr<float>()[r * shape.top_n + i - 1]);
        }
        mass += std::exp(double(lp));
      }
      EXPECT_LE(mass, 1.0 + 1e-5);
      if (temperature.view.ptr<float>()[r] == 0.0f && shape.top_n > 0) {
        EXPECT_EQ(token, top_ids.view.ptr<int32_t>()[r * shape.top_n]);  // greedy = the top-1 alternative
        EXPECT_EQ(out_logprob.view.ptr<float>()[r], top_logprobs.view.ptr<float>()[r * shape.top_n]);
      }
    }
  }
}

TEST(Sampling, LogprobOutputsAreCheckedByName) {
  OwnedTensor logits = test::f32_tensor({1.0f, 2.0f, 3.0f, 4.0f}, {2, 2});
  OwnedTensor temperature = test::f32_tensor({0.0f, 0.0f}), top_p = test::f32_tensor({1.0f, 1.0f});
  OwnedTensor uniform = test::f32_tensor({0.5f, 0.5f}), top_k = test::i32_tensor({0, 0});
  OwnedTensor out = OwnedTensor::host(DType::I32, {2}), logprob = OwnedTensor::host(DType::F32, {2});
  OwnedTensor ids = OwnedTensor::host(DType::I32, {2, 2}), lps = OwnedTensor::host(DType::F32, {2, 2});
  OwnedTensor wide_ids = OwnedTensor::host(DType::I32, {2, 3}), wide_lps = OwnedTensor::host(DType::F32, {2, 3});
  OwnedTensor short_lps = OwnedTensor::host(DType::F32, {2, 1});
  ops::SamplingParams base{.logits = logits, .temperature = temperature, .top_k = top_k, .top_p = top_p,
                           .uniform = uniform, .out_tokens = out};
  auto message = [](const ops::SamplingParams& p) {
    Status s = ops::check(p);
    return s.ok() ? std::string("ok") : s.message();
  };
  ops::SamplingParams p = base;
  p.out_top_ids = ids.view;
  p.out_top_logprobs = lps.view;
  EXPECT_NE(message(p).find("given without out_logprob"), std::string::npos) << message(p);
  p.out_logprob = logprob.view;
  EXPECT_EQ(message(p), "ok");
  p.out_top_logprobs = Tensor();
  EXPECT_NE(message(p).find("give both or neither"), std::string::npos) << message(p);
  p.out_top_logprobs = short_lps.view;
  EXPECT_NE(message(p).find("SamplingParams.out_top_logprobs"), std::string::npos) << message(p);
  p.out_top_ids = wide_ids.view;
  p.out_top_logprobs = wide_lps.view;
  EXPECT_NE(message(p).find("at most V = 2"), std::string::npos) << message(p);
  p = base;
  p.out_logprob = ids.view;
  EXPECT_NE(message(p).find("SamplingParams.out_logprob"), std::string::npos) << message(p);
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
