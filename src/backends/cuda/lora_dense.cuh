// Entry point of the dense multi-LoRA on cuda (design.md §5/§6, SGMV-style): y[t] += B[s]·(A[s]·x[t]) for
// s = token_slot[t] >= 0 over the slot's true rank (ops/lora.h's LoraParams contract). Tokens are grouped
// by slot with moe_align (single_expert: E = 1, K = 1) and run through the MoE-LoRA shrink and expand with
// the stack viewed as [S, 1, R, in] / [S, 1, out, R]. Does not handle MoE experts (moe_lora.cuh does).
// Small batches (decode) take the direct per-pair path instead (moe_lora_small.cuh, E = 1, K = 1).
// Callers: tests, bench, the CUDA backend's lora op (attention projections, dense MLP).
#pragma once
#include <cuda_runtime_api.h>

#include <span>

#include "core/tensor.h"
#include "backends/cuda/moe_lora.cuh"
#include "backends/cuda/moe_lora_small.cuh"
#include "ops/lora.h"

namespace lmx::cuda {

// Device scratch of one dense-LoRA call site, sized once at start-up for up to max_tokens tokens, S slots
// and rank capacity R, so the call never allocates. z and tile_counters are zeroed here once and stay zero
// between calls (moe_lora.cuh's self-cleaning invariant); a call uses views of the first rows.
struct LoraDenseScratch {
  int64_t max_tokens = 0, slots = 0, capacity_rank = 0;
  OwnedTensor sorted_pairs;   // [moe_align_capacity(max_tokens, S, 16)] i32
  OwnedTensor tile_group;     // [capacity / 16] i32
  OwnedTensor group_offsets;  // [S + 1] i32
  OwnedTensor num_tiles;      // [1] i32
  OwnedTensor workspace;      // [moe_align_workspace_bytes(max_tokens, S)] u8
  OwnedTensor z;              // [kMoeLoraSmallMaxTargets, max_tokens, R] f32, zero between calls: one
                              // [max_tokens, R] per target of a group (a single call uses the first)
  OwnedTensor tile_counters;  // [capacity / 16] i32, zero between calls
  OwnedTensor zero_ids;       // [max_tokens] i32, all zero: the one "expert" of the direct path's topk_ids
  OwnedTensor z_readers;      // [kMoeLoraSmallMaxTargets, max_tokens + 1] i32, zero between calls (the
                              // direct path's counters, one row per target of a group)
};
LoraDenseScratch lora_dense_scratch(int64_t max_tokens, int64_t slots, int64_t capacity_rank);

// p.x [T, in] bf16, p.token_slot [T] i32 in [-1, S), p.w.a [S, R, in] bf16, p.w.b [S, out, R] bf16 (scale
// folded), p.w.rank [S] i32, p.y [T, out] bf16 accumulated. T <= scratch.max_tokens; S and R must match
// the scratch. Undefined p.w.a: nothing is launched.
// Path: batches of up to kMoeLoraSmallMaxPairs tokens take the direct per-pair kernels (moe_lora_small.cuh:
// no align, two launches with PDL), larger ones the tiled shrink/expand; `path` 0 / 1 pins one (tests, bench).
void lora_dense(const ops::LoraParams& p, const LoraDenseScratch& scratch, const MoeLoraConfig& config,
                cudaStream_t stream, int path = -1);

// The MoeLoraConfig the CUDA backend gives the dense calls: the expand in 64-output chunks (the MoE-LoRA's
// tuned choice at every T >= 16: more CTAs in flight for the same bytes; see perf-log run 32 for dense).
constexpr MoeLoraConfig kLoraDenseConfig{.expand_block_n = 64};

// Several projections of the same x and token_slot (a layer's q, k and v; ops::Backend::lora_group): on
// the direct path one shrink and one expand launch for all of them (moe_lora_small.cuh's groups), on the
// tiled path one align for the group, then a shrink and an expand per part. Parts with undefined w.a are skipped; at most kMoeLoraSmallMaxTargets
// parts; each part as lora_dense's contract, and every part's x and token_slot the same tensor.
void lora_dense_group(std::span<const ops::LoraParams> parts, const LoraDenseScratch& scratch,
                      const MoeLoraConfig& config, cudaStream_t stream, int path = -1);

// The fused linear + LoRA of a projection at decode sizes (ops::LinearLoraParams; CudaBackend::linear_lora),
// in two halves around the product out = x·Wᵀ (+ b, or the bias left to the expand):
//   lora_dense_fused_shrink: the group's shrink (z = A·x); it needs only x, so it may run on another stream
//     beside the product (the caller orders it before the expand with an event);
//   lora_dense_fused_expand: after the product, one expand that writes every row of every part:
//     parts[i].y = out[:, columns of part i] (+ bias[same], rounded in on its own) + the LoRA delta
//     (moe_lora_small.cuh's epilogue; bias [N] or undefined).
// parts: lora_dense_group's contract, each w defined; their y widths in order cover out's columns (one part:
// y may be out itself). T <= kMoeLoraSmallMaxPairs (lora_dense_fused_fits). Plain launches for the shrink
// (no programmatic wait on another stream); the expand with config.pdl.
inline bool lora_dense_fused_fits(int64_t tokens) { return moe_lora_small_fits(tokens); }
void lora_dense_fused_shrink(std::span<const ops::LoraParams> parts, const LoraDenseScratch& scratch,
                             cudaStream_t stream);
void lora_dense_fused_expand(std::span<const ops::LoraParams> parts, const Tensor& out, const Tensor& bias,
                             const LoraDenseScratch& scratch, const MoeLoraConfig& config, cudaStream_t stream);

}  // namespace lmx::cuda
