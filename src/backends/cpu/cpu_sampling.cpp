// CPU reference of ops/sampling.h: greedy or temperature / top-k / top-p sampling of one token per row from
// fp32 logits, inverting the CDF at the row's uniform number. The CDF walks tokens in descending
// probability (ties: lower id first), so every backend maps one uniform number to the same token.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/cpu_util.h"

namespace lmx::cpu {
namespace {

int32_t argmax_lowest_id(const float* logits, int64_t vocab) {
  int64_t best = 0;
  for (int64_t v = 1; v < vocab; ++v) {
    if (logits[v] > logits[best]) best = v;
  }
  return int32_t(best);
}

// One row: probs = softmax(logits / temperature); keep the top_k most likely (0 = all); of those, the
// smallest prefix whose share of the kept mass reaches top_p (at least one token); invert the CDF of the
// renormalised prefix at `uniform`.
int32_t sample_row(const float* logits, int64_t vocab, float temperature, int32_t top_k, float top_p, float uniform) {
  std::vector<float> probs(vocab);  // [V] f32
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
  std::vector<int32_t> order(vocab);  // token ids by descending probability, ties to the lower id
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + kept, order.end(),
                    [&](int32_t a, int32_t b) { return probs[a] > probs[b] || (probs[a] == probs[b] && a < b); });

  // top_p is measured against the mass the top-k filter kept (the distribution renormalised after top-k).
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

  // Inverse CDF of the prefix renormalised: the first token whose cumulative mass exceeds uniform·mass.
  float prefix_mass = 0.0f;
  for (int64_t i = 0; i < prefix; ++i) prefix_mass += probs[order[i]];
  const float target = uniform * prefix_mass;
  cumulative = 0.0f;
  for (int64_t i = 0; i < prefix; ++i) {
    cumulative += probs[order[i]];
    if (target < cumulative) return order[i];
  }
  return order[prefix - 1];  // rounding left the target at the very top of the CDF
}

}  // namespace

void CpuBackend::sample(const ops::SamplingParams& p) {
  ops::require(ops::check(p), "sample");
  require_host_f32(p.logits, "SamplingParams.logits", "sample");
  const int64_t rows = p.logits.dim(0), vocab = p.logits.dim(1);
  const float* logits = p.logits.ptr<float>();            // [B, V] f32
  const float* temperature = p.temperature.ptr<float>();  // [B] f32
  const int32_t* top_k = p.top_k.ptr<int32_t>();          // [B] i32
  const float* top_p = p.top_p.ptr<float>();              // [B] f32
  const float* uniform = p.uniform.ptr<float>();          // [B] f32
  int32_t* out_tokens = p.out_tokens.ptr<int32_t>();      // [B] i32
  for (int64_t b = 0; b < rows; ++b) {
    auto fail = [&](const char* field, double value, const char* rule) {
      contract_violation("sample",
                         std::string(field) + "[" + std::to_string(b) + "] = " + std::to_string(value) + " " + rule);
    };
    if (!(temperature[b] >= 0.0f) || !std::isfinite(temperature[b])) {
      fail("temperature", temperature[b], "is not a finite number >= 0");
    }
    if (top_k[b] < 0) fail("top_k", top_k[b], "is negative");
    if (!(top_p[b] > 0.0f && top_p[b] <= 1.0f)) fail("top_p", top_p[b], "is outside (0, 1]");
    if (!(uniform[b] >= 0.0f && uniform[b] < 1.0f)) fail("uniform", uniform[b], "is outside [0, 1)");
    const float* row_logits = logits + b * vocab;
    require_no_nan(row_logits, vocab, "SamplingParams.logits", b, "sample");
    out_tokens[b] = temperature[b] == 0.0f
                        ? argmax_lowest_id(row_logits, vocab)
                        : sample_row(row_logits, vocab, temperature[b], top_k[b], top_p[b], uniform[b]);
  }
}

}  // namespace lmx::cpu
