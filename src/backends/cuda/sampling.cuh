// Entry point of the sampling family on cuda (contract in ops/sampling.h): one token per row of fp32 logits
// [B, V] (greedy, temperature, top-k, top-p, inverse CDF at the row's uniform number) and the raw logprobs.
// No workspace: each row is held in the shared memory of one thread-block cluster. Callers: the CUDA
// backend, tests/cuda/test_sampling.cpp, bench/bench_sampling_cuda.cpp.
#pragma once
#include <cuda_runtime_api.h>

#include "ops/sampling.h"

namespace lmx::cuda {

// How the GPU token relates to the CPU oracle's (cpu_sampling.cpp). The rules are the oracle's: temperature
// 0 = argmax (lowest id on ties); else the tokens in CDF order, the top_k first of them, the shortest
// prefix whose mass reaches top_p of the kept mass, and the first token whose running mass exceeds
// uniform · (prefix mass). The order is the oracle's too: e = fl(m − fl(x / T)) ascending, ties by id,
// where m = fl(max x / T) — e rises as the oracle's fp32 probability falls, so the two orders agree except
// where two distinct e round to one fp32 probability on the CPU (the CPU then orders them by id).
// The arithmetic differs, and is exact where the oracle's is not:
//   mass(token) = round(expf(−e) · 2^44)  an integer (the top token's is 2^44; expf is within 2 ulp);
//   every sum over tokens is an exact u64 sum, so the result depends on neither order nor launch shape;
//   prefix: the first token whose running mass is >= ceil(top_p · kept mass)   (the product in double);
//   draw:   the first token whose running mass is >  floor(uniform · prefix mass)  (the product in double).
// So the GPU's CDF is the exact (real-number) CDF within 2^-22 relative + 2^-45 per token, while the
// oracle's sequential fp32 sums drift by up to n · 2^-24 of the mass after n tokens (~1% at V = 201k in
// the worst case) and skip tokens below 2^-25 of the mass. The two tokens are equal unless uniform · mass
// (or top_p · kept mass) lies within the oracle's rounding of a CDF boundary; the test checks the GPU's
// token against an exact CDF at the GPU's bound on every draw, and against the oracle's token wherever the
// oracle's own bound leaves a single token. Logprobs: log_softmax in fp32 expf per token, the sum of
// exp(x − max) as an exact 2^-44 fixed-point integer, logit − logsumexp in double rounded once to fp32.
// Rows whose scaled maximum is not finite (an inf logit, or x / T overflowing) take the argmax, like the
// oracle. NaN logits are a precondition violation (the oracle aborts; here the token is unspecified).

constexpr int kSamplingMaxClusterCtas = 8;  // CTAs per row (portable cluster size)
constexpr int kSamplingMaxTopN = 1024;      // out_top_ids columns the kernel's merge buffer holds

struct SamplingLaunch {
  int cluster_ctas = 0;  // CTAs sharing one row: 0 = the launcher's choice, 1, 2, 4 or 8 pins it (tests)
};

// The CTAs per row the launcher picks for vocabulary V, and whether a (pinned) count can hold V's row in
// shared memory with N top-logprob columns.
int sampling_cluster_ctas(int64_t vocab);
bool sampling_fits(int64_t vocab, int cluster_ctas, int64_t top_n);

// No allocation, no host sync, no shape-dependent compilation: capturable in a CUDA graph, once one eager
// call has set the kernel's shared-memory attribute. V up to ~350k (8 CTAs of ~44k tokens each).
void sample(const ops::SamplingParams& p, cudaStream_t stream, const SamplingLaunch& launch = {});

}  // namespace lmx::cuda
