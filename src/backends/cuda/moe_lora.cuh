// Entry points of the MoE-LoRA on cuda (design.md §6): over the (slot, expert) tiles made by moe_align,
// shrink z[pair, :r] = A[s,e][:r]·x[row(pair)] and expand y[pair, :] += B[s,e][:, :r]·z[pair], r = the
// slot's true rank (rank 0: the tile exits at once). Scaling is folded into B at load (lora/adapter.h), so
// no scale here. The router-weighted sum over k happens after the down projection, outside these ops.
// Callers: tests, bench, (later) the CUDA MoE block, once for gate_up (x = [T, H]) and once for down
// (x = the activation [T*K, I]).
#pragma once
#include <cuda_runtime_api.h>

#include "core/tensor.h"
#include "ops/lora.h"

namespace lmx::cuda {

struct MoeLoraParams {
  Tensor x;             // [T, in] (row = pair / K) or [T*K, in] (row = pair) bf16
  ops::LoraStack w;     // a [S, E, R, in] bf16, b [S, E, out, R] bf16 (scale folded), rank [S] i32
  int64_t top_k = 1;    // K
  // moe_align's outputs for token_slot grouping (G = S·E, BLOCK_M = block_m).
  Tensor sorted_pairs;  // [capacity] i32: pair t*K + k, or T*K on padding
  Tensor tile_group;    // [capacity / block_m] i32, -1 past the last tile
  Tensor num_tiles;     // [1] i32
  int block_m = 16;
  Tensor z;             // [T*K, R] f32: shrink output, expand input (only rows of pairs with a slot)
  Tensor y;             // [T*K, out] bf16, accumulated in place by the expand
  int split_k = 0;      // shrink: pieces of `in` per tile, fp32 atomics into z zeroed here; 1 = no split
                        // (plain stores, no zeroing); 0 = pick from the batch size
};

// BLOCK_M the kernels are built for (moe_align must use it).
constexpr int kMoeLoraBlockM = 16;

void moe_lora_shrink(const MoeLoraParams& p, cudaStream_t stream);
void moe_lora_expand(const MoeLoraParams& p, cudaStream_t stream);

// The split_k that split_k = 0 resolves to, for benchmarks and logs.
int moe_lora_auto_split(int64_t pairs, int64_t groups, int64_t in);

}  // namespace lmx::cuda
