// Entry points of the MoE-LoRA on cuda (design.md §6): over the (slot, expert) tiles made by moe_align,
// shrink z[pair, :r] = A[s,e][:r]·x[row(pair)] and expand y[pair, :] += B[s,e][:, :r]·z[pair], r = the
// slot's true rank (rank 0: the tile exits at once). Scaling is folded into B at load (lora/adapter.h), so
// no scale here. The router-weighted sum over k happens after the down projection, outside these ops.
// Callers: tests, bench, lora_dense (E = K = 1), (later) the CUDA MoE block, once for gate_up (x = [T, H])
// and once for down (x = the activation [T*K, I]). Both kernels run on tensor cores (mma.sync).
#pragma once
#include <cuda_runtime_api.h>

#include "core/tensor.h"
#include "ops/lora.h"

namespace lmx::cuda {

// Order of the CTAs of one launch (the grid is tiles × pieces; pieces = splits of `in` for the shrink,
// BLOCK_N slices of `out` for the expand). Tile-fastest runs the CTAs that read the same piece of one
// (slot, expert)'s A or B next to each other (L2 reuse across the tiles of a big group); piece-fastest
// runs all pieces of one tile together (reuse of its x / z rows). A knob, measured in docs/perf-log.md.
enum class MoeLoraCtaOrder : int { kTileFastest = 0, kPieceFastest = 1 };

// The tuning knobs of both kernels in one place (a `loramux tune` sweep sets these; defaults are H200's).
struct MoeLoraConfig {
  int split_k = 0;  // shrink: pieces of `in` per tile (fp32 atomics into z); 1 = no split; 0 = by batch size
  MoeLoraCtaOrder order = MoeLoraCtaOrder::kTileFastest;
  bool pdl = true;          // launch the expand as a programmatic dependent of the shrink (sm_90)
  int expand_block_n = 128;  // expand: outputs per pipeline chunk (BLOCK_N), 64 or 128
  int expand_chunks = 0;     // expand: BLOCK_N chunks per CTA (a cp.async ring walks them); 0 = by batch size
  bool expand_bulk = true;  // expand: B chunks and y rows by bulk copies (cp.async.bulk + mbarriers) where y rows
                            // are 16-byte vectors; false: 16-byte cp.async by every thread
  bool expand_persistent = true;  // with expand_bulk: resident CTAs take the (tile, piece) items from a counter,
                                  // a producer warp keeping the ring running across them (H100 layer, N 64: T 256
                                  // 134.2 → 131.7 µs, T 4096 521.4 → 494.6; perf-log run 234)
  int shrink_tiles_per_cta = 0;  // shrink: 1 (a tile per CTA, warps split `in`) or 4 (a run of one group's
                                 // tiles, a tile per warp, A staged once); 0 = by batch size
};

// Entries of tile_counters past capacity / block_m that the persistent expand uses as its item counters.
inline constexpr int kMoeLoraWorkCounters = 2;

// The z invariant ("self-cleaning"): when `tile_counters` is given, z is all zero between calls. The shrink
// only adds into z (split-K atomics, or plain stores without split), and the last expand CTA of each tile
// (found by an arrival count in tile_counters) re-zeroes the z rows it consumed and resets its counter.
// So z and tile_counters are zeroed once at allocation and never memset again; the direct per-pair path
// keeps the same invariant, so both can share one z. Without tile_counters (an older caller), the shrink
// memsets z itself when it splits, and z holds the shrink result after the expand.
struct MoeLoraParams {
  Tensor x;             // [T, in] (row = pair / K) or [T*K, in] (row = pair) bf16; with x_rows any rows
  Tensor x_rows;        // optional [T*K] I32: x's row of each pair (moe_block's a in tile order,
                        // MoeGateUpParams::pair_rows); only pairs in the tiles are looked up
  ops::LoraStack w;     // a [S, E, R, in] bf16, b [S, E, out, R] bf16 (scale folded), rank [S] i32;
                        // R a multiple of 8 in [8, 128] (128: a merged MoE gate_up at --max-lora-rank 64)
  int64_t top_k = 1;    // K
  // moe_align's outputs for token_slot grouping (G = S·E, BLOCK_M = block_m).
  Tensor sorted_pairs;  // [capacity] i32: pair t*K + k, or T*K on padding
  Tensor tile_group;    // [capacity / block_m] i32, -1 past the last tile
  Tensor num_tiles;     // [1] i32
  int block_m = 16;
  Tensor z;             // [T*K, R] f32: shrink output, expand input (only rows of pairs with a slot)
  Tensor y;             // [T*K, out] bf16, accumulated in place by the expand
  int split_k = 0;      // kept for older callers: when nonzero it overrides config.split_k
  MoeLoraConfig config;
  Tensor tile_counters;  // [>= capacity / block_m] i32, all zero at allocation; optional (see above). With
                         // kMoeLoraWorkCounters more entries the persistent expand takes its items from a counter
                         // there (dynamic scheduling, reset by its last CTA); without them it stripes the items.
  // Expand only: y = z·Bᵀ instead of y += z·Bᵀ (y is not read): every real row of every tile is written, with
  // zeros for slots of rank 0 (moe_block's LoRA folded into the fused activation: MoeGateUpParams::lora_h).
  bool overwrite = false;
};

// BLOCK_M the kernels are built for (moe_align must use it): one mma.sync M of 16 pairs.
constexpr int kMoeLoraBlockM = 16;

void moe_lora_shrink(const MoeLoraParams& p, cudaStream_t stream);
void moe_lora_expand(const MoeLoraParams& p, cudaStream_t stream);

// Tiles of one (slot, expert) group per run-mode shrink CTA (MoeLoraConfig::shrink_tiles_per_cta's other value).
int moe_lora_run_tiles();

// The split_k for run mode where long runs dominate (moe_block's hint): about as many working CTAs as one run per
// kRunTiles tiles plus one partial run per expert, split until ~4 CTAs per SM stream `in` in parallel. A run CTA
// streams every chunk of its piece through a 3-stage ring; unsplit, the ~130 runs of a 1600-token prompt each
// walked 45 chunks with two in flight: 52 µs a shrink for ~55 MB (perf-log run 116).
int moe_lora_run_split(int64_t pairs, int64_t experts);
// The split_k that split_k = 0 resolves to (with shrink_tiles_per_cta = 0), for benchmarks and logs.
int moe_lora_auto_split(int64_t pairs, int64_t groups, int64_t in);
// The expand_chunks that 0 resolves to, for max_tiles = capacity / BLOCK_M and chunks = ceil(out / BLOCK_N), for
// the persistent expand or the others.
int moe_lora_auto_expand_chunks(int64_t max_tiles, int64_t chunks, bool persistent);

}  // namespace lmx::cuda
