// Sampling contract: one token per sampled row from fp32 logits, and on request the row's raw logprobs.
// Randomness comes in as one uniform number per row (drawn by the engine from the request's seed and step),
// so every backend samples the same token from the same logits. Who calls: engine::Engine::sample.
#pragma once
#include "core/status.h"
#include "core/tensor.h"

namespace lmx::ops {

// The widest top-logprobs list a request may ask for (OpenAI's and vLLM's default limit).
constexpr int kMaxTopLogprobs = 20;

// Per row: temperature 0 = greedy (argmax, lowest id on ties). Otherwise softmax(logits / temperature),
// keep the top_k most likely (0 = all), then the smallest prefix (by descending probability, ties: lower id
// first) whose running sum reaches top_p times the kept mass, renormalize, and invert the CDF at
// `uniform`. On the CPU the running sums are sequential fp32 additions in that order (tokens below 2^-25 of
// the mass can be skipped: once the sum passes 0.5 they cannot change it); the CUDA backend sums exact
// integer masses instead (backends/cuda/sampling.cuh): where uniform · mass lies within the CPU's rounding
// of a CDF boundary, the two may pick different tokens.
//
// Logprobs (optional: out_logprob undefined = none). They are the model's *raw* logprobs — log_softmax of
// the logits as given, before temperature, top-k and top-p (vLLM's default "raw_logprobs") — so they do
// not depend on the sampling settings:
//   out_logprob[b]          = log_softmax(logits[b])[out_tokens[b]]
//   out_top_ids[b, 0..N)    = the N largest logits of row b, descending, ties: lower id first
//   out_top_logprobs[b, i]  = log_softmax(logits[b])[out_top_ids[b, i]]
// With N >= 1 the greedy token is out_top_ids[b, 0]. out_top_* may be undefined (N = 0).
struct SamplingParams {
  Tensor logits;       // [B, V] f32
  Tensor temperature;  // [B] f32 >= 0
  Tensor top_k;        // [B] i32 >= 0
  Tensor top_p;        // [B] f32 in (0, 1]
  Tensor uniform;      // [B] f32 in [0, 1)
  Tensor out_tokens;   // [B] i32
  Tensor out_logprob;       // [B] f32, optional
  Tensor out_top_ids;       // [B, N] i32, optional (needs out_logprob), N <= V
  Tensor out_top_logprobs;  // [B, N] f32, given with out_top_ids
};
Status check(const SamplingParams& p);

}  // namespace lmx::ops
