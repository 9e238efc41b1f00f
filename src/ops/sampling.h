// Sampling contract: one token per sampled row from fp32 logits. Randomness comes in as one uniform
// number per row (drawn by the engine from the request's seed and step), so every backend samples the
// same token from the same logits.
#pragma once
#include "core/status.h"
#include "core/tensor.h"

namespace lmx::ops {

// Per row: temperature 0 = greedy (argmax, lowest id on ties). Otherwise softmax(logits / temperature),
// keep the top_k most likely (0 = all), then the smallest prefix (by descending probability) whose mass
// reaches top_p, renormalize, and invert the CDF at `uniform`.
struct SamplingParams {
  Tensor logits;       // [B, V] f32
  Tensor temperature;  // [B] f32
  Tensor top_k;        // [B] i32
  Tensor top_p;        // [B] f32 in (0, 1]
  Tensor uniform;      // [B] f32 in [0, 1)
  Tensor out_tokens;   // [B] i32
};
Status check(const SamplingParams& p);

}  // namespace lmx::ops
