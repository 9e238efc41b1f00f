// loadgen statistics and schedule: percentiles (numpy's linear rule), distributions, OTPS/TPOT, run
// figures (throughput, ITL, peaks, errors, per adapter), adapter assignment and Poisson arrivals.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <random>

#include "loadgen/schedule.h"
#include "loadgen/stats.h"

namespace lmx::loadgen {
namespace {

uint64_t fresh_seed() {
  const uint64_t seed = std::random_device{}();
  std::printf("loadgen test seed %llu\n", static_cast<unsigned long long>(seed));
  return seed;
}

TEST(LoadgenStats, PercentileMatchesNumpyLinearRule) {
  // Sorted: 1, 1.5, 2.6, 3, 4, 9; rank p/100 * 5 interpolated (values worked out from numpy's definition).
  const std::vector<double> v = {3.0, 1.0, 4.0, 1.5, 9.0, 2.6};
  EXPECT_DOUBLE_EQ(percentile(v, 50), 2.8);
  EXPECT_DOUBLE_EQ(percentile(v, 90), 6.5);
  EXPECT_DOUBLE_EQ(percentile(v, 99), 8.75);
  EXPECT_DOUBLE_EQ(percentile(v, 12.5), 1.3125);
  EXPECT_DOUBLE_EQ(percentile(v, 0), 1.0);
  EXPECT_DOUBLE_EQ(percentile(v, 100), 9.0);
  EXPECT_DOUBLE_EQ(percentile({7.0}, 99), 7.0);
  EXPECT_DOUBLE_EQ(percentile({}, 50), 0.0);
}

TEST(LoadgenStats, PercentileOnFreshRandomDataAgainstBruteForce) {
  std::mt19937_64 rng(fresh_seed());
  for (int trial = 0; trial < 50; ++trial) {
    const size_t n = 1 + rng() % 200;
    std::vector<double> v(n);
    for (double& x : v) x = std::uniform_real_distribution<double>(-50, 500)(rng);
    std::vector<double> sorted = v;
    std::sort(sorted.begin(), sorted.end());
    for (double p : {1.0, 25.0, 50.0, 90.0, 99.0, 99.9}) {
      // Reference: the fraction of values at or below the answer brackets p, and the answer lies between
      // the two order statistics around rank p/100 (n-1).
      const double rank = p / 100.0 * double(n - 1);
      const double lo = sorted[size_t(std::floor(rank))], hi = sorted[size_t(std::ceil(rank))];
      const double got = percentile(v, p);
      EXPECT_GE(got, lo);
      EXPECT_LE(got, hi);
      EXPECT_NEAR(got, lo + (hi - lo) * (rank - std::floor(rank)), 1e-9 * (1 + std::abs(hi)));
    }
    if (n % 2 == 1) EXPECT_DOUBLE_EQ(summarize(v, {}).median, sorted[n / 2]);
  }
}

TEST(LoadgenStats, SummarizeMeanPopulationStdAndPercentiles) {
  const std::vector<double> v = {2, 4, 4, 4, 5, 5, 7, 9};  // mean 5, population std 2
  const std::vector<double> ps = {90, 99};
  const Distribution d = summarize(v, ps);
  EXPECT_EQ(d.count, 8u);
  EXPECT_DOUBLE_EQ(d.mean, 5.0);
  EXPECT_DOUBLE_EQ(d.std, 2.0);
  EXPECT_DOUBLE_EQ(d.median, 4.5);
  ASSERT_EQ(d.percentiles.size(), 2u);
  EXPECT_EQ(d.percentiles[0].first, 90);
  EXPECT_DOUBLE_EQ(d.percentiles[0].second, percentile(v, 90));
  const Distribution empty = summarize(std::vector<double>{}, ps);
  EXPECT_EQ(empty.count, 0u);
  EXPECT_EQ(empty.mean, 0);
  EXPECT_EQ(empty.percentiles[1].second, 0);
}

RequestOutcome streamed(const std::string& target, double start, double ttft, double gap, int chunks, int tokens_per_chunk) {
  RequestOutcome r{.target = target, .success = true, .prompt_len = 100, .output_tokens = chunks * tokens_per_chunk,
                   .expected_output_len = chunks * tokens_per_chunk, .start_s = start};
  for (int c = 0; c < chunks; ++c) {
    r.chunk_times_s.push_back(start + ttft + gap * c);
    r.chunk_tokens.push_back(tokens_per_chunk);
  }
  r.end_s = r.chunk_times_s.back();
  return r;
}

TEST(LoadgenStats, OtpsIsOutputTokensMinusOneOverDecodeTime) {
  // 601 tokens, TTFT 0.1 s, then 600 gaps of 10 ms: OTPS 100 tok/s, TPOT 10 ms.
  RequestOutcome r = streamed("a", 2.0, 0.1, 0.01, 601, 1);
  double otps = 0, tpot = 0;
  ASSERT_TRUE(request_otps(r, &otps));
  ASSERT_TRUE(request_tpot_ms(r, &tpot));
  EXPECT_NEAR(otps, 100.0, 1e-6);
  EXPECT_NEAR(tpot, 10.0, 1e-6);
  EXPECT_NEAR(r.ttft_s(), 0.1, 1e-12);
  RequestOutcome one = streamed("a", 0, 0.1, 0.01, 1, 1);
  EXPECT_FALSE(request_otps(one, &otps));  // one token: no decode time
  r.success = false;
  EXPECT_FALSE(request_otps(r, &otps));
}

TEST(LoadgenStats, FiguresCountTokensThroughputItlPeaksAndErrors) {
  std::vector<RequestOutcome> runs = {streamed("lora0", 0.0, 0.5, 0.25, 5, 1),   // chunks at 0.5 .. 1.5
                                      streamed("lora1", 0.2, 0.3, 0.5, 3, 2),    // chunks at 0.5, 1.0, 1.5
                                      streamed("base", 3.0, 0.1, 0.1, 4, 1)};    // chunks at 3.1 .. 3.4
  runs[1].output_tokens = 5;  // the server said 5 though 6 ids streamed: usage wins, and it is a mismatch
  RequestOutcome failed{.target = "lora1", .error = "HTTP 404: no such model", .start_s = 1.0, .end_s = 1.01};
  runs.push_back(failed);
  runs.push_back(failed);
  const std::vector<double> ps = {99};
  const Figures f = compute_figures(runs, 4.0, ps);
  EXPECT_EQ(f.completed, 3);
  EXPECT_EQ(f.failed, 2);
  EXPECT_EQ(f.total_input_tokens, 300);
  EXPECT_EQ(f.total_output_tokens, 5 + 5 + 4);
  EXPECT_EQ(f.output_len_mismatches, 1);
  EXPECT_DOUBLE_EQ(f.request_throughput, 3 / 4.0);
  EXPECT_DOUBLE_EQ(f.output_throughput, 14 / 4.0);
  EXPECT_DOUBLE_EQ(f.total_token_throughput, 314 / 4.0);
  EXPECT_EQ(f.itl_ms.count, size_t(4 + 2 + 3));
  EXPECT_EQ(f.ttft_ms.count, 3u);
  EXPECT_NEAR(f.ttft_ms.mean, (500 + 300 + 100) / 3.0, 1e-9);
  EXPECT_EQ(f.e2el_ms.count, 3u);
  ASSERT_EQ(f.errors.size(), 1u);
  EXPECT_EQ(f.errors.at("HTTP 404: no such model"), 2);
  // Second [1, 2): lora0 chunks at 1.0, 1.25, 1.5 (3 tokens) + lora1 chunks at 1.0, 1.5 (2 each) = 7.
  EXPECT_DOUBLE_EQ(f.max_output_tokens_per_s, 7);
  // lora0 [0, 1.5], lora1 [0.2, 1.5], the failures [1, 1.01]: four at once around t = 1.005.
  EXPECT_EQ(f.max_concurrent_requests, 4);

  const auto per = figures_per_target(runs, 4.0, ps);
  ASSERT_EQ(per.size(), 3u);
  EXPECT_EQ(per[0].first, "lora0");
  EXPECT_EQ(per[1].first, "lora1");
  EXPECT_EQ(per[1].second.completed, 1);
  EXPECT_EQ(per[1].second.failed, 2);
  EXPECT_EQ(per[2].first, "base");
  EXPECT_EQ(per[2].second.total_output_tokens, 4);
}

TEST(LoadgenSchedule, ParseAssignmentAcceptsTheThreeFormsAndNamesTheFlag) {
  EXPECT_EQ(parse_assignment("round-robin", 0)->policy, AssignmentPolicy::kRoundRobin);
  EXPECT_EQ(parse_assignment("random", 0.5)->policy, AssignmentPolicy::kRandom);
  Result<Assignment> z = parse_assignment("zipf:1.5", 0);
  ASSERT_TRUE(z.ok());
  EXPECT_EQ(z->policy, AssignmentPolicy::kZipf);
  EXPECT_DOUBLE_EQ(z->zipf_exponent, 1.5);
  for (const char* bad : {"zipf:", "zipf:0", "zipf:-1", "zipf:1x", "roundrobin", ""}) {
    Result<Assignment> r = parse_assignment(bad, 0);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find("--lora-assignment"), std::string::npos) << r.status().message();
  }
  EXPECT_FALSE(parse_assignment("random", 1.5).ok());
  EXPECT_FALSE(parse_assignment("random", -0.1).ok());
}

TEST(LoadgenSchedule, RoundRobinCyclesAdaptersAndSpreadsBaseEvenly) {
  const std::vector<int> plain = assign_targets(7, 3, parse_assignment("round-robin", 0).value(), 1);
  EXPECT_EQ(plain, (std::vector<int>{0, 1, 2, 0, 1, 2, 0}));
  // F = 1/4 of 8: requests 3 and 7 go to the base model, the rest alternate.
  const std::vector<int> mixed = assign_targets(8, 2, parse_assignment("round-robin", 0.25).value(), 1);
  EXPECT_EQ(mixed, (std::vector<int>{0, 1, 0, -1, 1, 0, 1, -1}));
  // Exactly floor(N F) base requests for any N, F.
  std::mt19937_64 rng(fresh_seed());
  for (int trial = 0; trial < 100; ++trial) {
    const int n = 1 + int(rng() % 500);
    const double f = std::uniform_real_distribution<double>(0, 1)(rng);
    const std::vector<int> t = assign_targets(n, 3, parse_assignment("round-robin", f).value(), 0);
    EXPECT_EQ(std::count(t.begin(), t.end(), -1), int64_t(std::floor(n * f))) << n << " " << f;
  }
  EXPECT_EQ(assign_targets(4, 0, parse_assignment("round-robin", 0).value(), 0), (std::vector<int>{-1, -1, -1, -1}));
  EXPECT_EQ(assign_targets(3, 2, parse_assignment("round-robin", 1.0).value(), 0), (std::vector<int>{-1, -1, -1}));
}

TEST(LoadgenSchedule, RandomAndZipfFollowTheirWeightsAndTheSeed) {
  const uint64_t seed = fresh_seed();
  const int n = 60000;
  const std::vector<int> uniform = assign_targets(n, 4, parse_assignment("random", 0.2).value(), seed);
  const std::vector<int> zipf = assign_targets(n, 3, parse_assignment("zipf:1", 0).value(), seed);
  std::map<int, int> u, z;
  for (int t : uniform) ++u[t];
  for (int t : zipf) ++z[t];
  EXPECT_NEAR(u[-1] / double(n), 0.2, 0.01);
  for (int k = 0; k < 4; ++k) EXPECT_NEAR(u[k] / double(n), 0.2, 0.01) << k;
  const double total = 1 + 0.5 + 1.0 / 3;  // Zipf S = 1 over 3 adapters
  EXPECT_EQ(z.count(-1), 0u);
  EXPECT_NEAR(z[0] / double(n), 1 / total, 0.01);
  EXPECT_NEAR(z[1] / double(n), 0.5 / total, 0.01);
  EXPECT_NEAR(z[2] / double(n), (1.0 / 3) / total, 0.01);
  EXPECT_EQ(uniform, assign_targets(n, 4, parse_assignment("random", 0.2).value(), seed));
  EXPECT_NE(uniform, assign_targets(n, 4, parse_assignment("random", 0.2).value(), seed + 1));
}

TEST(LoadgenSchedule, PoissonArrivalsHaveExponentialGapsAndRepeatForASeed) {
  const uint64_t seed = fresh_seed();
  const double rate = 8.0;
  const int n = 40000;
  const std::vector<double> t = poisson_arrivals(n, rate, seed);
  ASSERT_EQ(t.size(), size_t(n));
  EXPECT_EQ(t[0], 0.0);
  std::vector<double> gaps;
  for (int i = 1; i < n; ++i) {
    ASSERT_GE(t[i], t[i - 1]);
    gaps.push_back(t[i] - t[i - 1]);
  }
  const Distribution d = summarize(gaps, std::vector<double>{});
  EXPECT_NEAR(d.mean, 1 / rate, 0.03 / rate);    // exponential: mean 1/rate
  EXPECT_NEAR(d.std, 1 / rate, 0.03 / rate);     // and std 1/rate
  EXPECT_NEAR(d.median, std::log(2.0) / rate, 0.03 / rate);
  EXPECT_EQ(t, poisson_arrivals(n, rate, seed));
  EXPECT_NE(t, poisson_arrivals(n, rate, seed + 1));
  const std::vector<double> burst = poisson_arrivals(5, kInfiniteRate, seed);
  EXPECT_EQ(burst, std::vector<double>(5, 0.0));
}

}  // namespace
}  // namespace lmx::loadgen
