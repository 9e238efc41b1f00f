// CPU reference of ops/sampling.h: greedy or temperature / top-k / top-p sampling of one token per row from
// fp32 logits, inverting the CDF at the row's uniform number, and the row's raw logprobs when asked. The CDF
// walks tokens in descending probability (ties: lower id first), so every backend maps one uniform number
// to the same token. Nothing sorts the whole vocabulary: tokens too small to move an fp32 sum are dropped
// first, top-k is a selection, and what remains is ordered by a radix sort (linear in V).
#include <algorithm>
#include <bit>
#include <cmath>
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

// Up to this top_k, selection is a bounded heap during the scan (a few comparisons per token); above it, a
// linear-time nth_element over the collected candidates.
constexpr int64_t kHeapSelectMax = 1024;

// Scratch reused across the rows of one call: nothing of size V is allocated per row.
struct Scratch {
  std::vector<float> probs;     // [V] f32
  std::vector<uint64_t> keys;   // [V] candidates as rank keys (see rank_key)
  std::vector<uint64_t> spare;  // [V] radix sort ping-pong buffer
};

// One integer whose ascending order is the CDF order: probability descending, then token id ascending.
// Probabilities are >= +0, whose IEEE bits order like the values; the complement turns that around.
uint64_t rank_key(float prob, int32_t id) {
  return (uint64_t(~std::bit_cast<uint32_t>(prob)) << 32) | uint32_t(id);
}
float key_prob(uint64_t key) { return std::bit_cast<float>(~uint32_t(key >> 32)); }
int32_t key_id(uint64_t key) { return int32_t(uint32_t(key)); }

// Ascending sort of `keys` (distinct: the id is in them). Small sets go to std::sort; large ones to an LSD
// radix sort over bytes that skips every byte position all keys share (the id's high bytes, usually the
// exponent byte), so a 151k-token vocabulary takes ~5 passes instead of a comparison sort's ~17.
void sort_keys(std::vector<uint64_t>& keys, size_t n, std::vector<uint64_t>& spare) {
  if (n <= 2048) {
    std::sort(keys.begin(), keys.begin() + n);
    return;
  }
  spare.resize(keys.size());
  std::vector<uint32_t> counts(8 * 256, 0);  // [byte position][byte value]
  for (size_t i = 0; i < n; ++i)
    for (int b = 0; b < 8; ++b) ++counts[b * 256 + ((keys[i] >> (8 * b)) & 0xff)];
  uint64_t* src = keys.data();
  uint64_t* dst = spare.data();
  for (int b = 0; b < 8; ++b) {
    uint32_t* count = counts.data() + b * 256;
    if (std::find(count, count + 256, uint32_t(n)) != count + 256) continue;  // one value: order unchanged
    uint32_t offset = 0;
    for (int v = 0; v < 256; ++v) {
      const uint32_t c = count[v];
      count[v] = offset;
      offset += c;
    }
    for (size_t i = 0; i < n; ++i) dst[count[(src[i] >> (8 * b)) & 0xff]++] = src[i];
    std::swap(src, dst);
  }
  if (src != keys.data()) std::copy(src, src + n, keys.data());
}

// One row: probs = softmax(logits / temperature); keep the top_k most likely (0 = all); of those, the
// smallest prefix whose share of the kept mass reaches top_p (at least one token); invert the CDF of the
// renormalised prefix at `uniform`. Every fp32 sum runs over the tokens in CDF order, as the contract says.
int32_t sample_row(const float* logits, int64_t vocab, float temperature, int32_t top_k, float top_p, float uniform,
                   Scratch& scratch) {
  std::vector<float>& probs = scratch.probs;  // [V] f32
  probs.resize(size_t(vocab));
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

  // Candidates: tokens of probability >= 2^-25. Why the rest cannot change the result: every fp32 sum below
  // walks the CDF order, so a dropped token is added only after every larger one; by then the sum holds
  // all but the dropped tokens' mass (< V * 2^-25, 0.005 at V = 151k), i.e. it is >= 0.5, where half an
  // ulp is >= 2^-25 and adding anything smaller rounds back to the same sum. The kept mass is checked
  // below; where the argument would not hold (a vocabulary of many millions) every token is a candidate.
  const int64_t kept = (top_k > 0 && top_k < vocab) ? top_k : vocab;
  float threshold = 0x1p-25f;
  std::vector<uint64_t>& keys = scratch.keys;
  keys.reserve(size_t(vocab));
  for (int attempt = 0;; ++attempt) {
    // Every dropped token ranks below every candidate, so top-k of the vocabulary is top-k of these. A small
    // k keeps a bounded max-heap of the k best keys while scanning; otherwise all candidates are collected
    // and, beyond k, cut by a selection.
    keys.clear();
    if (kept <= kHeapSelectMax) {
      float worst = threshold;  // once the heap is full: the probability of its worst key
      for (int64_t v = 0; v < vocab; ++v) {
        if (!(probs[v] >= worst)) continue;  // below the k-th best so far (or the threshold)
        const uint64_t key = rank_key(probs[v], int32_t(v));
        if (int64_t(keys.size()) < kept) {
          keys.push_back(key);
          std::push_heap(keys.begin(), keys.end());
        } else if (key < keys.front()) {
          std::pop_heap(keys.begin(), keys.end());
          keys.back() = key;
          std::push_heap(keys.begin(), keys.end());
        } else {
          continue;
        }
        if (int64_t(keys.size()) == kept) worst = std::max(threshold, key_prob(keys.front()));
      }
    } else {
      for (int64_t v = 0; v < vocab; ++v)
        if (probs[v] >= threshold) keys.push_back(rank_key(probs[v], int32_t(v)));
      if (int64_t(keys.size()) > kept) {
        std::nth_element(keys.begin(), keys.begin() + kept, keys.end());
        keys.resize(size_t(kept));
      }
    }
    const size_t n = keys.size();
    if (n == 0) return argmax_lowest_id(logits, vocab);  // only NaN probabilities (an inf logit): no CDF to walk
    sort_keys(keys, n, scratch.spare);

    // top_p is measured against the mass the top-k filter kept (the distribution renormalised after top-k).
    float kept_mass = 0.0f;
    for (size_t i = 0; i < n; ++i) kept_mass += key_prob(keys[i]);
    const bool dropped_some = int64_t(n) < kept;
    if (dropped_some && !(kept_mass >= 0.5f) && attempt == 0) {
      threshold = 0.0f;  // the skipping argument needs a sum >= 0.5 before the dropped tokens: keep all
      continue;
    }
    const float mass_needed = top_p * kept_mass;
    size_t prefix = n;
    float cumulative = 0.0f;
    for (size_t i = 0; i < n; ++i) {
      cumulative += key_prob(keys[i]);
      if (cumulative >= mass_needed) {
        prefix = i + 1;
        break;
      }
    }

    // Inverse CDF of the prefix renormalised: the first token whose cumulative mass exceeds uniform·mass.
    float prefix_mass = 0.0f;
    for (size_t i = 0; i < prefix; ++i) prefix_mass += key_prob(keys[i]);
    const float target = uniform * prefix_mass;
    cumulative = 0.0f;
    for (size_t i = 0; i < prefix; ++i) {
      cumulative += key_prob(keys[i]);
      if (target < cumulative) return key_id(keys[i]);
    }
    return key_id(keys[prefix - 1]);  // rounding left the target at the very top of the CDF
  }
}

// Raw logprobs of one row: log_softmax(logits) (temperature 1, no filtering) at the sampled token, and the
// `top_n` largest logits (descending, ties: lower id first) with theirs. Each exp is fp32, their sum is
// accumulated in double; each logprob is logit - logsumexp in double, rounded once to fp32.
void raw_logprobs(const float* logits, int64_t vocab, int32_t sampled, int64_t top_n, float* out_logprob,
                  int32_t* top_ids, float* top_logprobs) {
  const float max_logit = *std::max_element(logits, logits + vocab);
  double sum = 0.0;
  for (int64_t v = 0; v < vocab; ++v) sum += double(std::exp(logits[v] - max_logit));
  // PRECOND: logits hold no NaN (checked); +inf or an all -inf row gives NaN logprobs, not a crash.
  const double log_normaliser = double(max_logit) + std::log(sum);
  *out_logprob = float(double(logits[sampled]) - log_normaliser);
  if (top_n == 0) return;
  // Bounded insertion: the list stays sorted; a token enters only when it beats the current last entry
  // (an equal logit with a higher id ranks below it), so random rows touch the list rarely.
  int64_t filled = 0;
  for (int64_t v = 0; v < vocab; ++v) {
    const float x = logits[v];
    if (filled == top_n && !(x > logits[top_ids[filled - 1]])) continue;
    int64_t pos = filled < top_n ? filled++ : top_n - 1;
    while (pos > 0 && x > logits[top_ids[pos - 1]]) {
      top_ids[pos] = top_ids[pos - 1];
      --pos;
    }
    top_ids[pos] = int32_t(v);
  }
  for (int64_t i = 0; i < top_n; ++i) top_logprobs[i] = float(double(logits[top_ids[i]]) - log_normaliser);
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
  float* out_logprob = p.out_logprob.defined() ? p.out_logprob.ptr<float>() : nullptr;  // [B] f32
  const int64_t top_n = p.out_top_ids.ndim == 2 ? p.out_top_ids.dim(1) : 0;
  int32_t* top_ids = top_n > 0 ? p.out_top_ids.ptr<int32_t>() : nullptr;         // [B, N] i32
  float* top_logprobs = top_n > 0 ? p.out_top_logprobs.ptr<float>() : nullptr;   // [B, N] f32
  Scratch scratch;
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
                        : sample_row(row_logits, vocab, temperature[b], top_k[b], top_p[b], uniform[b], scratch);
    if (out_logprob) {
      raw_logprobs(row_logits, vocab, out_tokens[b], top_n, out_logprob + b,
                   top_ids ? top_ids + b * top_n : nullptr, top_logprobs ? top_logprobs + b * top_n : nullptr);
    }
  }
}

}  // namespace lmx::cpu
