// Parity of the CUDA sampler (backends/cuda/sampling.cuh) with CpuBackend::sample: greedy, temperature,
// top-k, top-p and their mixes per row in one batch; rows that are normal, peaked, spiked, flat, nearly
// flat, tied (grid and bf16 logits), partly or wholly -inf; V from 7 to 201,088; every cluster size.
//
// How a token is judged (sampling.cuh states the contract). Greedy tokens and top-N ids must equal the
// oracle's. A sampled token is judged against an exact CDF computed here in double:
//  1. The GPU token must lie in the admissible set of the GPU's order (e = m − x/T ascending, then id)
//     with the exact masses exp(−e) and the GPU's error bound (2^-21 of the mass + 2^-44 per token): the
//     positions whose CDF interval comes within twice that bound of uniform · (prefix mass), over every
//     top-p prefix the rule could give within it. Away from boundaries that is a single token.
//  2. The oracle's token must lie in the admissible set of the oracle's order (fp32 probability desc,
//     then id) with its fp32 probabilities (recomputed here exactly as cpu_sampling.cpp does) and its
//     error bound (sequential fp32 sums: (n + 2) · 2^-24 of the mass, plus the tokens below 2^-25 it
//     skips). This ties the exact CDF to the oracle's rules.
//  3. Where both sets are one token and the two orders agree up to every position that matters, the GPU
//     token must equal the oracle's. The test counts these rows and requires them to be common.
// Logprobs: within 1e-5 · (1 + |want|) of the oracle's (docs/NUMERICS.md, raw logprobs).
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "backends/cuda/sampling.cuh"
#include "cuda_test_util.h"
#include "ops/sampling.h"

namespace lmx::test {
namespace {

class CudaSampling : public CudaTest {};

// ---- inputs -------------------------------------------------------------------------------------------

enum LogitKind { kNormal, kPeaked, kSpike, kFlat, kNearFlat, kGrid, kBf16, kSomeNegInf, kFewFinite, kAllNegInf, kKinds };
constexpr const char* kKindNames[] = {"normal", "peaked", "spike", "flat", "near-flat", "grid", "bf16", "some -inf", "few finite", "all -inf"};

void fill_row(Rng& rng, LogitKind kind, float* x, int64_t vocab) {
  const float offset = rng.uniform(-5.0f, 5.0f);
  for (int64_t v = 0; v < vocab; ++v) {
    switch (kind) {
      case kNormal: x[v] = offset + 2.0f * rng.normal(); break;
      case kPeaked: x[v] = offset + 6.0f * rng.normal(); break;
      case kSpike: x[v] = offset + rng.normal(); break;
      case kFlat: x[v] = offset; break;
      case kNearFlat: x[v] = offset + 1e-3f * rng.normal(); break;
      case kGrid: x[v] = std::round(2.0f * rng.normal()) * 0.5f; break;  // a few distinct values: ties
      case kBf16: x[v] = bf16_to_f32(f32_to_bf16(offset + 3.0f * rng.normal())); break;
      case kSomeNegInf: x[v] = rng.uniform() < 0.4f ? -INFINITY : offset + 2.0f * rng.normal(); break;
      case kFewFinite: x[v] = -INFINITY; break;
      case kAllNegInf: x[v] = -INFINITY; break;
      default: break;
    }
  }
  if (kind == kSpike) {  // one or two tokens far above the rest
    x[rng.next_u64() % vocab] = offset + 40.0f;
    x[rng.next_u64() % vocab] = offset + 39.5f;
  }
  if (kind == kFewFinite) {
    for (int i = 0; i < 3; ++i) x[rng.next_u64() % vocab] = rng.normal();
  }
  if (kind == kSomeNegInf) x[rng.next_u64() % vocab] = offset;  // at least one finite logit
}

struct RowParams {
  float temperature;
  int32_t top_k;
  float top_p;
  float uniform;
};

// Parameter mixes, cycled over the rows of a batch.
constexpr int kParamKinds = 10;
RowParams draw_params(Rng& rng, int kind, int64_t vocab, int64_t row) {
  RowParams r{rng.uniform(0.2f, 2.0f), 0, 1.0f, rng.uniform()};
  switch (kind) {
    case 0: r.temperature = 0.0f; r.top_k = int32_t(rng.next_u64() % 50); r.top_p = 0.5f; break;  // greedy
    case 1: break;                                                                          // temperature only
    case 2: r.top_k = 2 + int32_t(rng.next_u64() % 63); break;                             // top_k only
    case 3: r.top_p = rng.uniform(0.05f, 0.99f); break;                                    // top_p only
    case 4: r.top_k = 2 + int32_t(rng.next_u64() % 2000); r.top_p = rng.uniform(0.1f, 0.99f); break;  // all three
    case 5: r.top_k = int32_t(vocab + 7); break;                                           // top_k > V
    case 6: r.top_k = 1; break;
    case 7: r.top_k = int32_t(vocab); r.top_p = 1.0f; break;
    case 8: r.top_k = int32_t(std::max<int64_t>(1, vocab / 2)); r.top_p = 0.9f; break;
    case 9: r.top_p = 1e-6f; break;
    default: break;
  }
  if (row % 13 == 5) r.uniform = 0.0f;
  if (row % 17 == 3) r.uniform = 0x1.fffffep-1f;  // the largest float below 1
  return r;
}

// ---- the exact CDF --------------------------------------------------------------------------------------

// One order over the row (position → token) and the running masses along it, in double.
struct Cdf {
  std::vector<int32_t> order;   // [V] token at each position
  std::vector<int64_t> position;  // [V] position of each token
  std::vector<double> cum;      // [V] mass of positions 0..i
};

// `keys` are (order key << 32) | id, ascending = CDF order; `mass` is per token.
Cdf make_cdf(std::vector<uint64_t> keys, const std::vector<double>& mass) {
  std::sort(keys.begin(), keys.end());
  Cdf c;
  const size_t n = keys.size();
  c.order.resize(n);
  c.position.resize(n);
  c.cum.resize(n);
  double sum = 0.0;
  for (size_t i = 0; i < n; ++i) {
    const int32_t id = int32_t(uint32_t(keys[i]));
    c.order[i] = id;
    c.position[size_t(id)] = int64_t(i);
    sum += mass[size_t(id)];
    c.cum[i] = sum;
  }
  return c;
}

// Positions [first, last] the rules may pick when every running mass is known only to within `slack`: for
// every prefix the top-p rule could give (its end within 2·slack of top_p · kept mass), the positions whose
// CDF interval comes within 2·slack of uniform · (prefix mass).
struct Admissible {
  std::vector<std::pair<int64_t, int64_t>> ranges;
  int64_t last_prefix = 0;  // the longest prefix end considered (a position)
  bool contains(int64_t position) const {
    for (const auto& [first, last] : ranges)
      if (first <= position && position <= last) return true;
    return false;
  }
  std::optional<int64_t> single() const {
    for (const auto& r : ranges)
      if (r.first != ranges.front().first || r.second != ranges.front().second || r.first != r.second) return std::nullopt;
    return ranges.front().first;
  }
};

Admissible admissible(const Cdf& c, int64_t kept, float top_p, float uniform, double slack) {
  auto first_ge = [&](double value, int64_t end) {
    return int64_t(std::lower_bound(c.cum.begin(), c.cum.begin() + end, value) - c.cum.begin());
  };
  auto first_gt = [&](double value, int64_t end) {
    return int64_t(std::upper_bound(c.cum.begin(), c.cum.begin() + end, value) - c.cum.begin());
  };
  const double kept_mass = c.cum[size_t(kept - 1)];
  int64_t cut_first = kept - 1, cut_last = kept - 1;
  if (top_p < 1.0f) {
    const double need = double(top_p) * kept_mass;
    cut_first = std::min(kept - 1, first_ge(need - 2 * slack, kept));
    cut_last = std::min(kept - 1, first_ge(need + 2 * slack, kept));
  }
  Admissible a;
  a.last_prefix = cut_last;
  for (int64_t cut = cut_first; cut <= cut_last; ++cut) {
    const double target = double(uniform) * c.cum[size_t(cut)];
    const int64_t first = std::min(cut, first_gt(target - 2 * slack, cut + 1));
    const int64_t last = std::min(cut, first_gt(target + 2 * slack, cut + 1));
    if (a.ranges.empty() || a.ranges.back() != std::pair{first, last}) a.ranges.emplace_back(first, last);
  }
  return a;
}

// The oracle's fp32 probabilities, computed exactly as cpu_sampling.cpp computes them (same operations in
// the same order on the same machine).
std::vector<float> oracle_probs(const float* x, int64_t vocab, float temperature) {
  std::vector<float> probs(static_cast<size_t>(vocab));
  float max_scaled = -INFINITY;
  for (int64_t v = 0; v < vocab; ++v) {
    probs[v] = x[v] / temperature;
    max_scaled = std::max(max_scaled, probs[v]);
  }
  float sum = 0.0f;
  for (int64_t v = 0; v < vocab; ++v) {
    probs[v] = std::exp(probs[v] - max_scaled);
    sum += probs[v];
  }
  for (int64_t v = 0; v < vocab; ++v) probs[v] /= sum;
  return probs;
}

int32_t argmax_lowest_id(const float* x, int64_t vocab) {
  int64_t best = 0;
  for (int64_t v = 1; v < vocab; ++v)
    if (x[v] > x[best]) best = v;
  return int32_t(best);
}

bool logprob_close(float got, float want) {
  if (std::isnan(want)) return std::isnan(got);
  if (std::isinf(want)) return got == want;
  return std::abs(double(got) - double(want)) <= 1e-5 * (1.0 + std::abs(double(want)));
}

struct Tally {
  int sampled = 0, exact = 0, equal = 0;
};

// Judges one sampled (temperature > 0) row; returns a failure description or "".
std::string judge_sampled_row(const float* x, int64_t vocab, const RowParams& r, int32_t gpu, int32_t cpu, Tally& tally) {
  ++tally.sampled;
  if (gpu == cpu) ++tally.equal;
  const float scaled_max = x[argmax_lowest_id(x, vocab)] / r.temperature;  // = max over v of x[v] / T
  if (!std::isfinite(scaled_max)) {  // both take the argmax
    ++tally.exact;
    const int32_t want = argmax_lowest_id(x, vocab);
    return gpu == want && cpu == want ? "" : "non-finite scaled max: want the argmax " + std::to_string(want);
  }
  const int64_t kept = (r.top_k > 0 && r.top_k < vocab) ? r.top_k : vocab;

  // 1. The GPU's order and the exact masses.
  std::vector<uint64_t> keys(static_cast<size_t>(vocab));
  std::vector<double> mass(static_cast<size_t>(vocab));
  for (int64_t v = 0; v < vocab; ++v) {
    float e = scaled_max - x[v] / r.temperature;
    if (e == 0.0f) e = 0.0f;  // +0
    keys[v] = (uint64_t(std::bit_cast<uint32_t>(e)) << 32) | uint64_t(v);
    mass[v] = std::exp(-double(e));
  }
  const Cdf exact = make_cdf(keys, mass);
  const double gpu_slack = 0x1p-21 * exact.cum.back() + double(vocab) * 0x1p-44;
  const Admissible gpu_set = admissible(exact, kept, r.top_p, r.uniform, gpu_slack);
  if (gpu < 0 || gpu >= vocab) return "GPU token " + std::to_string(gpu) + " out of range";
  const int64_t gpu_position = exact.position[size_t(gpu)];
  auto describe = [&](const Admissible& a) {
    std::string s;
    for (const auto& [first, last] : a.ranges) s += " [" + std::to_string(first) + ", " + std::to_string(last) + "]";
    return s;
  };
  if (!gpu_set.contains(gpu_position)) {
    return "GPU token " + std::to_string(gpu) + " at CDF position " + std::to_string(gpu_position) +
           " is outside the admissible positions" + describe(gpu_set) + " (slack " + std::to_string(gpu_slack) + ")";
  }

  // 2. The oracle's order and fp32 probabilities, with its error bound.
  const std::vector<float> probs = oracle_probs(x, vocab, r.temperature);
  std::vector<double> cpu_mass(static_cast<size_t>(vocab));
  for (int64_t v = 0; v < vocab; ++v) {
    keys[v] = (uint64_t(~std::bit_cast<uint32_t>(probs[v])) << 32) | uint64_t(v);
    cpu_mass[v] = probs[v];
  }
  const Cdf oracle = make_cdf(keys, cpu_mass);
  double skipped = 0.0;
  for (int64_t i = 0; i < kept; ++i)
    if (cpu_mass[size_t(oracle.order[i])] < 0x1p-25) skipped += cpu_mass[size_t(oracle.order[i])];
  const double cpu_slack = double(kept + 2) * 0x1p-24 * 1.01 * oracle.cum[size_t(kept - 1)] + skipped + gpu_slack;
  const Admissible cpu_set = admissible(oracle, kept, r.top_p, r.uniform, cpu_slack);
  if (cpu < 0 || cpu >= vocab || !cpu_set.contains(oracle.position[size_t(cpu)])) {
    return "the oracle's token " + std::to_string(cpu) + " is outside its own admissible positions" + describe(cpu_set) +
           ": the reference does not model cpu_sampling.cpp";
  }

  // 3. Unambiguous for both, in orders that agree wherever it matters: the tokens must be equal.
  const Admissible gpu_wide = admissible(exact, kept, r.top_p, r.uniform, cpu_slack);
  const std::optional<int64_t> gpu_single = gpu_wide.single(), cpu_single = cpu_set.single();
  if (gpu_single && cpu_single) {
    int64_t agree = 0;  // positions on which the two orders agree, from the start
    while (agree < vocab && exact.order[size_t(agree)] == oracle.order[size_t(agree)]) ++agree;
    const int64_t needed = std::max({*gpu_single, gpu_wide.last_prefix, cpu_set.last_prefix,
                                     r.top_k > 0 && r.top_k < vocab ? kept - 1 : int64_t(0)});
    if (agree > needed) {
      ++tally.exact;
      if (gpu != cpu) {
        return "unambiguous draw: GPU token " + std::to_string(gpu) + " but the oracle's " + std::to_string(cpu);
      }
    }
  }
  return "";
}

// ---- the check ------------------------------------------------------------------------------------------

struct Case {
  int64_t rows, vocab;
  int cluster_ctas;     // 0 = the launcher's choice
  int64_t top_n;        // -1: no logprobs at all; 0: the sampled token's only
  bool misaligned = false;  // logits one float into their buffer: the scalar loads
};

struct Outputs {
  OwnedTensor tokens, logprob, top_ids, top_logprobs;  // host
};

class Batch {
 public:
  Batch(Rng& rng, int64_t rows, int64_t vocab) : rows_(rows), vocab_(vocab) {
    logits_ = OwnedTensor::host(DType::F32, {rows, vocab});
    temperature_ = OwnedTensor::host(DType::F32, {rows});
    top_k_ = OwnedTensor::host(DType::I32, {rows});
    top_p_ = OwnedTensor::host(DType::F32, {rows});
    uniform_ = OwnedTensor::host(DType::F32, {rows});
    const uint64_t kind_offset = rng.next_u64(), param_offset = rng.next_u64();
    for (int64_t b = 0; b < rows; ++b) {
      kinds_.push_back(LogitKind((uint64_t(b) + kind_offset) % kKinds));
      fill_row(rng, kinds_.back(), row(b), vocab);
      // Cycle the parameter mixes at a different stride from the logit kinds: every pairing over the batches.
      params_.push_back(draw_params(rng, int((uint64_t(b) * 3 + param_offset) % kParamKinds), vocab, b));
      temperature_.view.ptr<float>()[b] = params_.back().temperature;
      top_k_.view.ptr<int32_t>()[b] = params_.back().top_k;
      top_p_.view.ptr<float>()[b] = params_.back().top_p;
      uniform_.view.ptr<float>()[b] = params_.back().uniform;
    }
  }
  float* row(int64_t b) const { return logits_.view.ptr<float>() + b * vocab_; }

  Outputs run_cpu(cpu::CpuBackend& cpu, int64_t top_n) const {
    Outputs o = host_outputs(top_n);
    cpu.sample({.logits = logits_, .temperature = temperature_, .top_k = top_k_, .top_p = top_p_, .uniform = uniform_,
                .out_tokens = o.tokens, .out_logprob = o.logprob, .out_top_ids = o.top_ids,
                .out_top_logprobs = o.top_logprobs});
    return o;
  }

  Outputs run_gpu(cudaStream_t stream, int64_t top_n, int cluster_ctas, bool misaligned) const {
    OwnedTensor logits = misaligned ? upload_at_offset(logits_, 1) : cuda::upload(logits_);
    OwnedTensor temperature = cuda::upload(temperature_), top_k = cuda::upload(top_k_);
    OwnedTensor top_p = cuda::upload(top_p_), uniform = cuda::upload(uniform_);
    OwnedTensor tokens = poisoned(DType::I32, {rows_});
    OwnedTensor logprob = top_n >= 0 ? poisoned(DType::F32, {rows_}) : OwnedTensor{};
    OwnedTensor top_ids = top_n > 0 ? poisoned(DType::I32, {rows_, top_n}) : OwnedTensor{};
    OwnedTensor top_logprobs = top_n > 0 ? poisoned(DType::F32, {rows_, top_n}) : OwnedTensor{};
    cuda::sample({.logits = logits, .temperature = temperature, .top_k = top_k, .top_p = top_p, .uniform = uniform,
                  .out_tokens = tokens, .out_logprob = logprob, .out_top_ids = top_ids, .out_top_logprobs = top_logprobs},
                 stream, {.cluster_ctas = cluster_ctas});
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    Outputs o;
    o.tokens = cuda::download(tokens);
    if (top_n >= 0) o.logprob = cuda::download(logprob);
    if (top_n > 0) {
      o.top_ids = cuda::download(top_ids);
      o.top_logprobs = cuda::download(top_logprobs);
    }
    return o;
  }

  int64_t rows_, vocab_;
  OwnedTensor logits_, temperature_, top_k_, top_p_, uniform_;
  std::vector<LogitKind> kinds_;
  std::vector<RowParams> params_;

 private:
  Outputs host_outputs(int64_t top_n) const {
    Outputs o;
    o.tokens = OwnedTensor::host(DType::I32, {rows_});
    if (top_n >= 0) o.logprob = OwnedTensor::host(DType::F32, {rows_});
    if (top_n > 0) {
      o.top_ids = OwnedTensor::host(DType::I32, {rows_, top_n});
      o.top_logprobs = OwnedTensor::host(DType::F32, {rows_, top_n});
    }
    return o;
  }
};

// The log-softmax of token `id` in double (fp32 exps, as the oracle): the expectation for the GPU token's
// logprob when it differs from the oracle's token.
float raw_logprob(const float* x, int64_t vocab, int32_t id) {
  const float max_logit = *std::max_element(x, x + vocab);
  double sum = 0.0;
  for (int64_t v = 0; v < vocab; ++v) sum += double(std::exp(x[v] - max_logit));
  return float(double(x[id]) - (double(max_logit) + std::log(sum)));
}

void check_against_oracle(const Batch& batch, const Outputs& gpu, const Outputs& cpu, int64_t top_n, Tally& tally) {
  for (int64_t b = 0; b < batch.rows_; ++b) {
    const RowParams& r = batch.params_[size_t(b)];
    SCOPED_TRACE("row " + std::to_string(b) + " (" + kKindNames[batch.kinds_[size_t(b)]] + ", T " +
                 std::to_string(r.temperature) + ", top_k " + std::to_string(r.top_k) + ", top_p " +
                 std::to_string(r.top_p) + ", u " + std::to_string(r.uniform) + ")");
    const float* x = batch.row(b);
    const int32_t g = gpu.tokens.view.ptr<int32_t>()[b], c = cpu.tokens.view.ptr<int32_t>()[b];
    if (r.temperature == 0.0f) {
      EXPECT_EQ(g, c) << "greedy";
    } else {
      const std::string failure = judge_sampled_row(x, batch.vocab_, r, g, c, tally);
      EXPECT_TRUE(failure.empty()) << failure;
    }
    if (top_n < 0 || g < 0 || g >= batch.vocab_) continue;
    const float want_logprob = g == c ? cpu.logprob.view.ptr<float>()[b] : raw_logprob(x, batch.vocab_, g);
    EXPECT_TRUE(logprob_close(gpu.logprob.view.ptr<float>()[b], want_logprob))
        << "logprob " << gpu.logprob.view.ptr<float>()[b] << " vs " << want_logprob;
    for (int64_t i = 0; i < top_n; ++i) {
      const int64_t at = b * top_n + i;
      ASSERT_EQ(gpu.top_ids.view.ptr<int32_t>()[at], cpu.top_ids.view.ptr<int32_t>()[at]) << "top id " << i;
      EXPECT_TRUE(logprob_close(gpu.top_logprobs.view.ptr<float>()[at], cpu.top_logprobs.view.ptr<float>()[at]))
          << "top logprob " << i << ": " << gpu.top_logprobs.view.ptr<float>()[at] << " vs "
          << cpu.top_logprobs.view.ptr<float>()[at];
    }
  }
}

void report(const Tally& t) {
  std::printf("  sampled rows %d: GPU == oracle on %d; unambiguous (judged for equality) %d\n", t.sampled, t.equal, t.exact);
  // Without enough unambiguous rows the equality check would be idle; the parameter mixes make most
  // rows unambiguous (small top_k, top_k = 1, tiny top_p, peaked and spiked rows).
  if (t.sampled >= 32) {
    EXPECT_GE(t.exact * 5, t.sampled) << "too few unambiguous rows for the equality check to mean anything";
  }
}

bool same_bits(const Tensor& a, const Tensor& b) { return bitwise_equal(a, b); }

void run_cases(CudaSampling& self, Rng& rng, cpu::CpuBackend& cpu, cudaStream_t stream, const std::vector<Case>& cases) {
  for (const Case& k : cases) {
    SCOPED_TRACE("B " + std::to_string(k.rows) + " V " + std::to_string(k.vocab) + " ctas " +
                 std::to_string(k.cluster_ctas) + " N " + std::to_string(k.top_n) + (k.misaligned ? " misaligned" : ""));
    if (k.cluster_ctas > 0 && !cuda::sampling_fits(k.vocab, k.cluster_ctas, std::max<int64_t>(k.top_n, 0))) {
      ADD_FAILURE() << "case does not fit shared memory";
      continue;
    }
    const Batch batch(rng, k.rows, k.vocab);
    const Outputs want = batch.run_cpu(cpu, k.top_n);
    const Outputs got = batch.run_gpu(stream, k.top_n, k.cluster_ctas, k.misaligned);
    Tally tally;
    check_against_oracle(batch, got, want, k.top_n, tally);
    report(tally);
  }
  (void)self;
}

TEST_F(CudaSampling, MatchesOracleSmallVocabEveryClusterSize) {
  std::vector<Case> cases;
  for (int ctas : {0, 1, 2, 4, 8}) cases.push_back({64, 1000, ctas, 20});
  cases.push_back({16, 1000, 8, 1000});  // N = V: every token listed
  cases.push_back({3, 1000, 2, -1});     // no logprobs
  cases.push_back({1, 1000, 0, 0});      // the sampled token's logprob only
  cases.push_back({16, 1001, 0, 5, true});  // odd V, misaligned rows: scalar loads
  cases.push_back({16, 1001, 8, 5, true});
  cases.push_back({16, 7, 8, 7});        // most CTAs of the cluster hold no token
  cases.push_back({16, 1, 0, 1});        // V = 1
  run_cases(*this, rng(), cpu_, stream_, cases);
}

TEST_F(CudaSampling, MatchesOracleQwen3Vocab) {
  run_cases(*this, rng(), cpu_, stream_, {{3, 151936, 0, 5}, {16, 151936, 4, 20}, {1, 151936, 8, -1}});
}

TEST_F(CudaSampling, MatchesOracleGptOssVocab) {
  run_cases(*this, rng(), cpu_, stream_, {{1, 201088, 0, 20}, {16, 201088, 0, 20}, {64, 201088, 0, 0}});
}

// Integer sums make the result independent of the launch shape and of the run: every cluster size gives
// the same bits, and so does a replay of a captured graph.
TEST_F(CudaSampling, BitwiseAcrossClusterSizesRunsAndGraphReplay) {
  const int64_t rows = 32, vocab = 4096, top_n = 20;
  const Batch batch(rng(), rows, vocab);
  const Outputs first = batch.run_gpu(stream_, top_n, 0, false);
  for (int ctas : {0, 1, 2, 4, 8}) {
    SCOPED_TRACE("ctas " + std::to_string(ctas));
    const Outputs again = batch.run_gpu(stream_, top_n, ctas, false);
    EXPECT_TRUE(same_bits(again.tokens.view, first.tokens.view));
    EXPECT_TRUE(same_bits(again.logprob.view, first.logprob.view));
    EXPECT_TRUE(same_bits(again.top_ids.view, first.top_ids.view));
    EXPECT_TRUE(same_bits(again.top_logprobs.view, first.top_logprobs.view));
  }

  // Graph capture: the launcher allocates nothing and never synchronizes.
  OwnedTensor logits = cuda::upload(batch.logits_), temperature = cuda::upload(batch.temperature_);
  OwnedTensor top_k = cuda::upload(batch.top_k_), top_p = cuda::upload(batch.top_p_), uniform = cuda::upload(batch.uniform_);
  OwnedTensor tokens = poisoned(DType::I32, {rows}), logprob = poisoned(DType::F32, {rows});
  OwnedTensor top_ids = poisoned(DType::I32, {rows, top_n}), top_logprobs = poisoned(DType::F32, {rows, top_n});
  const ops::SamplingParams params{.logits = logits, .temperature = temperature, .top_k = top_k, .top_p = top_p,
                                   .uniform = uniform, .out_tokens = tokens, .out_logprob = logprob,
                                   .out_top_ids = top_ids, .out_top_logprobs = top_logprobs};
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  cuda::sample(params, stream_);
  ASSERT_EQ(cudaStreamEndCapture(stream_, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, stream_), cudaSuccess);
  sync();
  EXPECT_TRUE(same_bits(cuda::download(tokens).view, first.tokens.view));
  EXPECT_TRUE(same_bits(cuda::download(logprob).view, first.logprob.view));
  EXPECT_TRUE(same_bits(cuda::download(top_ids).view, first.top_ids.view));
  EXPECT_TRUE(same_bits(cuda::download(top_logprobs).view, first.top_logprobs.view));
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
}

// Hand-made rows whose answer is known: ties go by id in top-k and in the CDF, the inverse CDF at chosen
// uniform numbers, top_p keeping exactly the first token, greedy on a repeated maximum.
TEST_F(CudaSampling, KnownAnswers) {
  struct Row {
    std::vector<float> logits;
    RowParams params;
    int32_t want;
  };
  const float l3 = std::log(3.0f);
  const std::vector<Row> rows = {
      {{1.0f, 3.0f, 3.0f, 3.0f, 3.0f}, {1.0f, 2, 1.0f, 0.0f}, 1},
      {{1.0f, 3.0f, 3.0f, 3.0f, 3.0f}, {1.0f, 2, 1.0f, 0.49f}, 1},
      {{1.0f, 3.0f, 3.0f, 3.0f, 3.0f}, {1.0f, 2, 1.0f, 0.51f}, 2},
      {{1.0f, 3.0f, 3.0f, 3.0f, 3.0f}, {1.0f, 2, 1.0f, 0.99f}, 2},
      // Masses 1/3 : 1 : 1/3 : 0 : 1/3 (CDF order 1, 0, 2, 4, 3): running 1, 4/3, 5/3, 2 of 2.
      {{0.0f, l3, 0.0f, -INFINITY, 0.0f}, {1.0f, 0, 1.0f, 0.45f}, 1},
      {{0.0f, l3, 0.0f, -INFINITY, 0.0f}, {1.0f, 0, 1.0f, 0.55f}, 0},  // next after the top token: id 0
      {{0.0f, l3, 0.0f, -INFINITY, 0.0f}, {1.0f, 0, 1.0f, 0.75f}, 2},
      {{0.0f, l3, 0.0f, -INFINITY, 0.0f}, {1.0f, 0, 1.0f, 0.9f}, 4},
      {{0.0f, l3, 0.0f, -INFINITY, 0.0f}, {1.0f, 0, 0.4f, 0.99f}, 1},  // top_p 0.4: the top token alone
      {{0.0f, l3, 0.0f, -INFINITY, 0.0f}, {1.0f, 3, 0.7f, 0.99f}, 0},  // top_k 3, top_p 0.7 of 5/3: tokens 1, 0
      {{2.0f, 5.0f, -1.0f, 5.0f, 5.0f}, {0.0f, 0, 1.0f, 0.7f}, 1},     // greedy: the lowest id of the maximum
      {{-INFINITY, -INFINITY, -INFINITY}, {1.0f, 0, 1.0f, 0.3f}, 0},   // nothing finite: the argmax, id 0
  };
  for (int ctas : {1, 2}) {
    for (size_t i = 0; i < rows.size(); ++i) {
      SCOPED_TRACE("row " + std::to_string(i) + " ctas " + std::to_string(ctas));
      const Row& r = rows[i];
      const int64_t vocab = int64_t(r.logits.size());
      OwnedTensor logits = OwnedTensor::host(DType::F32, {1, vocab});
      std::copy(r.logits.begin(), r.logits.end(), logits.view.ptr<float>());
      auto scalar_f = [](float v) { OwnedTensor t = OwnedTensor::host(DType::F32, {1}); t.view.ptr<float>()[0] = v; return cuda::upload(t); };
      OwnedTensor top_k_host = OwnedTensor::host(DType::I32, {1});
      top_k_host.view.ptr<int32_t>()[0] = r.params.top_k;
      OwnedTensor d_logits = cuda::upload(logits), temperature = scalar_f(r.params.temperature);
      OwnedTensor top_k = cuda::upload(top_k_host), top_p = scalar_f(r.params.top_p), uniform = scalar_f(r.params.uniform);
      OwnedTensor tokens = poisoned(DType::I32, {1});
      cuda::sample({.logits = d_logits, .temperature = temperature, .top_k = top_k, .top_p = top_p, .uniform = uniform,
                    .out_tokens = tokens},
                   stream_, {.cluster_ctas = ctas});
      sync();
      EXPECT_EQ(cuda::download(tokens).view.ptr<int32_t>()[0], r.want);
    }
  }
}

}  // namespace
}  // namespace lmx::test
