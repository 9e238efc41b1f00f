// Entry points of the direct per-pair MoE-LoRA for tiny batches (design.md §6, issue 4): no align, the grid
// runs over the T·K (token, k) pairs themselves. Same math and scale convention as moe_lora.cuh (scale folded
// into B, loops bound by the slot's true rank); only the launch shape differs. Does not cover large batches
// (moe_lora.cuh's tiled path does). Callers: tests, bench, (later) the CUDA MoE block when
// moe_lora_small_fits(T·K), once for gate_up (x = [T, H]) and once for down (x = the activation [T*K, I]).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>

#include "core/tensor.h"
#include "ops/lora.h"

namespace lmx::cuda {

struct MoeLoraSmallParams {
  Tensor x;            // [T, in] (row = pair / K) or [T*K, in] (row = pair) bf16
  Tensor topk_ids;     // [T, K] i32, every id in [0, E)
  Tensor token_slot;   // [T] i32, -1 = no adapter (the token's pairs are skipped)
  ops::LoraStack w;    // a [S, E, R, in] bf16, b [S, E, out, R] bf16 (scale folded), rank [S] i32
  // Self-cleaning scratch, shared with the tiled path's invariant: all zero before the shrink and again
  // after the expand (the expand re-zeroes each row once every CTA of the pair has read it), so no memset.
  // Allocate once, zero once (cuda::fill_bytes), then keep the pair z / z_readers for this projection.
  Tensor z;            // [T*K, R] f32: shrink output (fp32 atomics), expand input
  Tensor z_readers;    // [T*K + 1] i32: per pair, CTAs done with z this call (the last reader zeroes z);
                       // the last entry is the fused kernel's CTA ticket
  Tensor y;            // [T*K, out] bf16, accumulated in place by the expand
  // Programmatic dependent launch: the shrink loads its A rows during the previous kernel's tail, the
  // expand its B rows while the shrink runs. false = plain stream order (the before/after figure).
  // PRECOND with pdl: topk_ids, token_slot and w are not written by the kernel launched directly before the
  // shrink (they are read before its programmatic wait); x and y may be (docs/kernels.md).
  bool pdl = true;
  // With pdl, the shrink also reads x before its wait (one round trip off its critical path at T = 1).
  // PRECOND when true: x is not written by the kernel launched directly before the shrink either. True in
  // the MoE block (x and the activation are written two launches before their shrinks); false is the safe
  // default for any other caller.
  bool x_before_wait = false;
  // Launch shape; 0 = the built-in choice for the batch size (docs/kernels.md). Explicit values exist for
  // the bench's sweep and the tests; the fused kernel ignores them.
  int shrink_vectors_per_lane = 0;    // 1, 2 or 4: 16-byte vectors of `in` per lane, 256·V inputs per CTA
  int expand_vectors_per_thread = 0;  // 4 or 8: B vectors each expand thread loads before the wait
  // The epilogue of a product (lora_dense's fused linear + LoRA; expand only, not the fused kernel): with
  // base defined the expand writes EVERY pair's y, adapter or not, as
  //   y[pair] = bf16(bf16(base[pair, base_column + o] + bias[base_column + o]) + the LoRA delta),  o < out,
  // reading base after its programmatic wait (the product is the kernel just before). The bias is rounded
  // in on its own, as the product's separate bias kernel does, so the result is bit for bit that of product
  // + bias, split, then y += delta (a single rounding flipped GPT-OSS fixture tokens at router near ties,
  // perf-log run 77). base may be y itself (base_column 0); undefined = the plain y += delta.
  Tensor base{};             // [T*K, N] bf16, N >= base_column + out
  int64_t base_column = 0;
  Tensor bias{};             // [N] bf16, optional (with base only)
  // The delta alone (expand only; not with base, not the fused kernel): with delta defined the expand writes
  // delta[pair, o] = the LoRA term (fp32, before any rounding) for every pair with an adapter and leaves y and
  // the other pairs' rows untouched, so it needs no input from the product whose output the term belongs to
  // and may run beside it. The consumer adds it (bf16(y + delta) where delta != 0: the bits of y += delta) and
  // zeroes it (moe_activation / moe_combine `delta`). PRECOND: all zero on entry.
  Tensor delta{};            // [T*K, out] f32, 16-byte aligned
};

// The largest batch this path is meant for, in pairs T·K (docs/kernels.md). Measured side by side on the
// H200 by `loramux tune moe-lora` (perf-log run 10, GPT-OSS-20B layer, S8 R32): the direct path won at
// every bucket it was timed, T 32 (128 pairs) 39.9 vs 97.4 µs and T 64 (256 pairs) 68.3 vs 126.6 µs for
// the tiled path's defaults; T 128 (512 pairs) was not timed. Tuned configs may move the limit per shape.
constexpr int64_t kMoeLoraSmallMaxPairs = 256;
inline bool moe_lora_small_fits(int64_t pairs) { return pairs <= kMoeLoraSmallMaxPairs; }

// z[pair, :r] += A[s,e][:r]·x[row(pair)], s = token_slot[pair / K], e = topk_ids[pair], r = rank[s].
void moe_lora_small_shrink(const MoeLoraSmallParams& p, cudaStream_t stream);
// y[pair, :] += B[s,e][:, :r]·z[pair, :r] (or delta[pair, :] = that term, MoeLoraSmallParams::delta), then z[pair] = 0. Must follow the shrink of the same params on
// the same stream (with pdl, directly: it waits on the kernel just before it).
void moe_lora_small_expand(const MoeLoraSmallParams& p, cudaStream_t stream);
// Shrink and expand in one launch (same result and scratch invariant); the bench decides which one the
// MoE block uses per batch size.
void moe_lora_small_fused(const MoeLoraSmallParams& p, cudaStream_t stream);

// A timing diagnostic for the bench only, never for serving: the small shrinks and expands named by `mask` are
// not launched at all (bit 0: dense shrinks, 1: dense expands, 2: MoE shrinks, 3: MoE expands), so a decode
// step's time without them shows what they cost on its critical path. The results are then wrong (without
// its expand a dense projection's fused output is never written; z is never re-zeroed). 0 (default): off.
// Anything outside [0, 15] throws std::invalid_argument. Recorded graphs keep what they were captured with.
void set_small_lora_knockout(int mask);

// A group of projections that read the same x and routing (a layer's q, k and v) in one shrink and one
// expand launch instead of one pair each: at decode these kernels are launch- and latency-bound, not
// byte-bound. Each target has its own w, z, z_readers and y; x, topk_ids, token_slot, R, pdl,
// x_before_wait and the knobs must be the same in all (checked). Targets with undefined w are skipped;
// at most kMoeLoraSmallMaxTargets (a kernel-argument array; the launchers name the limit when exceeded).
constexpr int kMoeLoraSmallMaxTargets = 3;
void moe_lora_small_shrink(std::span<const MoeLoraSmallParams> targets, cudaStream_t stream);
void moe_lora_small_expand(std::span<const MoeLoraSmallParams> targets, cudaStream_t stream);

}  // namespace lmx::cuda
