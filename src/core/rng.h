// Deterministic, platform-independent random numbers for generated weights, dummy adapters, sampling and
// tests. std::normal_distribution differs between standard libraries, so the transforms are written here.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/dtype.h"

// mix64 and rng_output are callable in CUDA device code too (the CUDA backend's weight generators).
#if defined(__CUDACC__)
#define LMX_RNG_FN __host__ __device__ __forceinline__
#else
#define LMX_RNG_FN inline
#endif

namespace lmx {

// SplitMix64 finalizer: a good 64-bit mix, used to derive independent streams from (seed, key...).
LMX_RNG_FN uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Output n (0-based) of Rng(seed) without walking the stream: SplitMix64's state after n + 1 steps is
// mix64(seed) + (n + 1) · golden, and its output the finalizer of that state (mix64 of it minus golden).
LMX_RNG_FN uint64_t rng_output(uint64_t seed, uint64_t n) { return mix64(mix64(seed) + n * 0x9e3779b97f4a7c15ull); }

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

// Generated (dummy) weights, the preset generator of model/presets.cpp: value i of a tensor whose stream is
// `tensor_seed` is the sum of four 16-bit pieces of one SplitMix64 output (the stream of chunk
// i / kGeneratedChunk, step i % kGeneratedChunk), centred, times `generated_scale(stddev)`, rounded to bf16
// (nearest even). Integer math, one fp32 multiply and one rounding: every backend reproduces it bit for
// bit, so the CUDA backend generates a 21B model in place and still equals the host's copy.
constexpr int64_t kGeneratedChunk = int64_t(1) << 16;
inline float generated_scale(float stddev) { return stddev * float(std::sqrt(3.0) / 65536.0); }
inline int64_t generated_centred_sum(uint64_t u) {
  return int64_t(u & 0xffff) + int64_t((u >> 16) & 0xffff) + int64_t((u >> 32) & 0xffff) + int64_t(u >> 48) - 131070;
}
// Values [begin, end) of the tensor into out[begin, end) (bf16 bits); `begin` should start a chunk for speed.
inline void generate_weights_bf16(uint16_t* out, int64_t begin, int64_t end, uint64_t tensor_seed, float stddev) {
  const float scale = generated_scale(stddev);
  for (int64_t chunk_start = begin - begin % kGeneratedChunk; chunk_start < end; chunk_start += kGeneratedChunk) {
    Rng rng(tensor_seed + uint64_t(chunk_start / kGeneratedChunk));
    const int64_t stop = std::min(end, chunk_start + kGeneratedChunk);
    for (int64_t i = chunk_start; i < stop; ++i) {
      const uint64_t u = rng.next_u64();
      if (i >= begin) out[i] = f32_to_bf16(float(generated_centred_sum(u)) * scale).bits;
    }
  }
}

}  // namespace lmx
