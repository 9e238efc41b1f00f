// Entry point of the MoE sort/align on cuda: groups the (token, k) pairs of a batch by expert (base
// grouped GEMM) or by (adapter slot, expert) (MoE-LoRA) into tiles of BLOCK_M pairs, padded with a
// sentinel. Deterministic: inside a group, pairs keep increasing pair index t*K + k. Counting lives in
// global memory, so any E × S fits (512 × 64 tested); nothing is sized by shared memory.
// Callers: moe_lora (and later the base MoE GEMM), tests, bench. Host sizes come from the functions below,
// so buffers are allocated once at start-up and the call itself never allocates or synchronizes.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "core/tensor.h"

namespace lmx::cuda {

struct MoeAlignParams {
  Tensor topk_ids;    // [T, K] i32, each in [0, E)
  Tensor token_slot;  // [T] i32 in [-1, S), read only when slots > 0 (pairs of slot -1 are dropped)
  int64_t experts = 0;  // E
  int64_t slots = 0;    // S > 0: group by (slot, expert); 0: group by expert only (token_slot unused).
                        // Explicit, not token_slot.defined(): an empty batch's tensors have no data.
  int block_m = 16;     // tile height, a power of two in [1, 1024]
  // Outputs; group g = slot * E + expert (or expert); G = S * E (or E).
  Tensor sorted_pairs;   // [moe_align_capacity] i32: pair t*K + k, or T*K (the sentinel) on padding
  Tensor tile_group;     // [moe_align_capacity / block_m] i32: group of each tile, -1 past the last tile
  Tensor group_offsets;  // [G + 1] i32: first padded position of each group; [G] = tiles * block_m
  Tensor num_tiles;      // [1] i32
  Tensor workspace;      // [moe_align_workspace_bytes] U8, device scratch
  // Test/tuning knob: -1 picks by size (the tiny path up to kMoeAlignTinyPairs pairs and kMoeAlignTinyGroups
  // groups, one block up to 4096 pairs, chunks of 1024 pairs sorted in parallel up to kMoeAlignSmallPairs, the
  // device radix sort above); 0 forces the one-block path, 1 the radix-sort path, 2 the chunked path (both at most
  // kMoeAlignSmallPairs pairs), 3 the tiny path, 4 the warp path (both within their limits).
  int force_path = -1;
  // Dense LoRA (lora_dense): every token is one pair of the single expert 0 (E = 1, K = 1), T comes from
  // token_slot, topk_ids is not read. Requires slots > 0 and experts == 1.
  bool single_expert = false;
  // Tiles by expert as with slots = 0 (tile_group = expert, padding per expert, no pair dropped), and an
  // expert's pairs ordered by slot (slot -1 first), then by pair: the persistent GEMM's in-accumulator
  // MoE-LoRA (MoeGemmLora) makes one pass per distinct slot of a warp's 16 rows, so token-interleaved
  // adapters cost ~1–2 passes instead of one per adapter. Requires slots > 0. group_offsets then has
  // E·(S + 1) + 1 entries (run of (expert e, slot s) at [e·(S + 1) + s + 1]); the workspace is
  // moe_align_workspace_bytes(pairs, E·(S + 1)) and sorted_pairs moe_align_capacity(pairs, E, block_m).
  bool order_by_slot = false;
  // With order_by_slot: each (expert, slot) group of an expert starts at a multiple of this many rows (a
  // power of two <= block_m; sentinels fill the gaps) wherever the expert's tiles have room for it — the
  // rows its last tile pads anyway move between its groups; an expert whose groups padded so would need
  // another tile keeps them back to back. At 16 (a warp's rows in the persistent GEMM) a warp then holds
  // one adapter, so it makes one MoE-LoRA pass. Tiles, capacity and sizes as without it.
  int slot_group_rows = 1;
};

// The tiny path's limits (decode batches: one thread a pair; its group counters in 32 KB of shared memory).
constexpr int64_t kMoeAlignTinyPairs = 256;
constexpr int64_t kMoeAlignTinyGroups = 8192;
// The warp path's limits (past the tiny path, e.g. a 256-token chunk's 1024 MoE-LoRA pairs: one thread a pair,
// a [32, G] table of per-warp counts plus the G totals in shared memory, 198 KB at the limit).
constexpr int64_t kMoeAlignWarpPairs = 1024;
constexpr int64_t kMoeAlignWarpGroups = 1536;
// The one-block and chunked paths' limit (16 sorted items per thread of 1024; 16 chunks); larger batches take
// the radix-sort path.
constexpr int64_t kMoeAlignSmallPairs = 16384;

// Padded positions needed in the worst case: every pair plus (BLOCK_M - 1) padding per non-empty group.
int64_t moe_align_capacity(int64_t pairs, int64_t groups, int block_m);
size_t moe_align_workspace_bytes(int64_t pairs, int64_t groups);

void moe_align(const MoeAlignParams& p, cudaStream_t stream);

}  // namespace lmx::cuda
