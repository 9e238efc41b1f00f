// Deterministic, platform-independent random numbers for generated weights, dummy adapters, sampling and
// tests. std::normal_distribution differs between standard libraries, so the transforms are written here.
#pragma once
#include <cmath>
#include <cstdint>

namespace lmx {

// SplitMix64 finalizer: a good 64-bit mix, used to derive independent streams from (seed, key...).
inline uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(mix64(seed)) {}
  uint64_t next_u64() {
    state_ += 0x9e3779b97f4a7c15ull;
    uint64_t z = state_;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1) with 24 bits of precision.
  float uniform() { return float(next_u64() >> 40) * (1.0f / 16777216.0f); }
  // Uniform in [lo, hi).
  float uniform(float lo, float hi) { return lo + (hi - lo) * uniform(); }
  // Standard normal (Box-Muller, one value per call).
  float normal() {
    float u1 = uniform();
    float u2 = uniform();
    if (u1 < 1e-7f) u1 = 1e-7f;
    return std::sqrt(-2.0f * std::log(u1)) * std::cos(6.28318530717958647692f * u2);
  }

 private:
  uint64_t state_;
};

}  // namespace lmx
