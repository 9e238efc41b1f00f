// Entry points of the base MoE on cuda (design.md §6, issue 4 item 3): the grouped gate_up and down GEMMs
// over moe_align's expert tiles (tensor cores, bf16 in, fp32 accumulation, bf16 out), the activation, the
// router-weighted combine, and moe_block, the whole ops::MoeParams contract with the MoE-LoRA of
// moe_lora.cuh. Not here: routing (routing.cuh), the sort (moe_align.cuh), the LoRA kernels (moe_lora.cuh).
// Callers: the CUDA backend's MoE layer, tests/cuda/test_moe_gemm.cpp, bench/bench_moe_gemm.cpp.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "core/tensor.h"
#include "backends/cuda/moe_lora.cuh"
#include "ops/moe.h"

namespace lmx::cuda {

// BLOCK_M values the GEMM kernels are built for; moe_align (slots = 0) must use the same block_m.
constexpr int kMoeGemmBlockMDecode = 16;   // few pairs per expert: 16-row tiles waste little on padding
constexpr int kMoeGemmBlockMPrefill = 64;  // many pairs per expert: each weight tile feeds 64 rows
constexpr int kMoeGemmBlockMLarge = 128;   // large prefill (compute-bound): 128 × 128 tiles, 8 warps

// Which kernel runs BLOCK_M 64/128 tiles, process-wide (the bench's before/after rows and the tests'
// comparisons); BLOCK_M 16 always runs the mma.sync kernel.
enum class MoeGemmKernel {
  kAuto,                  // the default: per launch, the persistent warp-specialized kernel where both
                          // operands can come by TMA (the caller gave sorted_rows and the weight tile is one
                          // box: not the fused halves layout), the ring otherwise
  kMmaSync,               // ldmatrix + mma.sync, every thread copies (sm_80 instructions)
  kWgmma,                 // the ring: warpgroup MMA, every thread copies, one CTA barrier per k-tile
  kWgmmaWarpSpecialized,  // warpgroup MMA fed by a producer warpgroup through mbarriers (cp.async for an
                          // operand that cannot come by TMA)
};
void set_moe_gemm_kernel(MoeGemmKernel kernel);
// The persistent kernel at BLOCK_M 128 × BLOCK_N 128 in clusters of 2 CTAs that share each A tile by TMA
// multicast (on), or one CTA per work item (off, the default: the multicast form passed every test but
// measured 1.6–1.7× slower, perf-log run 39; kept for the benchmark's row and further work).
void set_moe_gemm_multicast(bool on);
// How many clusters of the multicast kernel the GPU holds at once (its persistent grid; the bench prints it).
int moe_gemm_multicast_clusters();
// The persistent kernel's epilogue: its form (fused activation, plain store, or the general per-column
// checks) chosen once per work item (on, the default), or the general form for every item (the bench's
// before row).
void set_moe_gemm_compact_epilogue(bool on);
// The MoE-LoRA in the persistent GEMMs' accumulators at BLOCK_M 128: each tile's main slot (that of its middle
// row, rank a multiple of 16 up to 64) added by warpgroup MMAs from a B slice the producer loads by TMA during
// the k-loop, the rows of other slots by mma.sync with B words from L2 as before (on), or every slot by
// mma.sync (off, the default until the H200 measures it). Process-wide.
void set_moe_lora_gemm_wgmma(bool on);
// moe_block's persistent GEMMs (prefill) with a stream-K tail (MoeStreamK): the partial last wave of work
// units cut along k over every CTA (on), or run whole (off, the default until the H200 measures it).
// Process-wide.
void set_moe_gemm_stream_k(bool on);
// The persistent gate_up GEMMs with the fused activation (BLOCK_M 128; not beside the stream-K tail or
// set_moe_lora_gemm_wgmma): the activation and the output stores by the producer warpgroup's idle warps from a
// shared staging tile (on, the default: perf-log run 246, GPT-OSS-20B prefill 28.5 → 28.0 ms on an H100), so the
// consumers go on to the next item's MMAs, or by the consumers (off). Process-wide.
void set_moe_gemm_epilogue_warps(bool on);
// With the epilogue warps and the MoE-LoRA in the persistent gate_up GEMM's accumulators: the LoRA terms of the
// staged items added by the epilogue warps as well (on), after the consumers staged acc + bias, so h is rounded
// to bf16 twice where a row has an adapter (NUMERICS.md), or by the consumers before staging (off, the default
// until the device measures it). Process-wide.
void set_moe_gemm_epilogue_lora(bool on);
// The persistent GEMMs' MoE-LoRA (MoeGemmLora with z_rows): each tile's main slot, where its rank is the stack's
// capacity R (a multiple of 8, at most 64), as one more k-tile of the ring — A its rows' z in bf16 in tile order
// (z_rows_kernel, from z; other slots' rows zero), B = B[slot, expert] by TMA with the ranks past R zero-filled —
// so the consumers run one more k-tile instead of add_lora_terms' pass for those rows; the other slots' rows
// still take add_lora_terms (on, the default: perf-log run 246); or add_lora_terms for every row (off). z rounds to
// bf16 once (as PEFT's LoRA layer does); not with the stream-K tail, lora_wgmma, the halves layout, or the epilogue
// warps' LoRA form (which it turns off).
void set_moe_gemm_lora_ktile(bool on);
// With the epilogue warps: the persistent GEMMs' store form (moe_block's down) through them too (on; down then
// stays at BLOCK_N 192 instead of 240, whose stages leave no room for the staging tile), or by the consumers
// (off, the default until the device measures it). Process-wide.
void set_moe_gemm_epilogue_down(bool on);
// moe_block's decode GEMMs (BLOCK_M 16) on the experts' MXFP4 copies where ops::MoeParams has them (on, the
// default), or on the bf16 weights (the bench's before row). Process-wide.
void set_moe_gemm_mxfp4(bool on);
// The MXFP4 decode GEMM's CTA shape: 64 columns with 8 cp.async stages at 6 CTAs an SM (the default since
// run 133), 12 stages at 4 or 6 at 8; or 128 columns with 4 stages at 6 (the default of runs 123-132) or 8,
// 3 stages at 8 (registers capped at 64), 5 at 6, 6 or 8 stages (bench sweeps; graphs must be recorded again). ctas_per_sm 0: the shape's first built count. Throws
// std::invalid_argument for shapes not built.
void set_moe_gemm_mxfp4_shape(int block_n, int stages, int ctas_per_sm = 0);
// moe_block's decode down GEMM on bf16 experts (BLOCK_M 16 × BLOCK_N 64): its cp.async stages, 4, 5 or 6 (0:
// the kernel's 6). Fewer stages fit more CTAs an SM (6: 3, 5: 4, 4: 5) with the same bytes in flight; down has
// half gate_up's column blocks, so its grid is short of CTAs at 3 an SM: GPT-OSS-20B T 16 down 155.4 µs at 6,
// 148.1 at 5, 146.7 at 4 on the H200 (perf-log run 175; gate_up level). The default stays 0: in the bf16
// decode step 4 stages were level to slower on an H100 (run 178) and slower on an H200 (run 179: +0.07 ms).
// Throws std::invalid_argument for other values. Graphs must be recorded again.
void set_moe_block_down_decode_stages(int stages);
// moe_block's decode GEMMs on bf16 experts (BLOCK_M 16): BLOCK_N of gate_up and of down, 64 (0: the default) or
// 128 (4 stages). Wider column blocks halve the CTAs and double each one's weight stream, for short reductions
// (Qwen3-30B-A3B's down: K 768 is 12 k-tiles, half of them the 6-stage ring's prologue). Only the column
// split changes, so the bits do not. MXFP4 experts keep set_moe_gemm_mxfp4_shape's. Throws
// std::invalid_argument for other values. Graphs must be recorded again.
void set_moe_block_decode_block_n(int gate_up, int down);
// true: the decode MoE-LoRA goes into the MXFP4 decode GEMMs' accumulators as into the bf16 ones; false (the
// default, perf-log run 118): where the decode GEMMs read MXFP4 experts, the LoRA runs as shrink + expand
// kernels around them (the before/after row; tests compare each path with its bf16 twin).
void set_moe_lora_in_mxfp4_gemm(bool on);
// The decode MoE-LoRA by the expand kernels with MoeBlockConfig::side_stream set: each shrink forked beside its
// GEMM, the expand after both (on, the default since perf-log run 135), or GEMM → shrink → expand in the chain
// (off: the bench's before row). The same bits either way. Process-wide.
void set_moe_lora_fork_shrinks(bool on);
// With the forked shrinks: the expands too run on the side stream, right after their shrinks and beside the
// GEMM, writing the LoRA term into an f32 scratch (MoeLoraSmallParams::delta) that moe_activation (gate_up)
// and moe_combine (down) add after the join; so neither expand waits for its GEMM (on), or each expand
// follows the join and adds into the GEMM's output (off; the default was off until perf-log run 149: on is
// −0.125 ms a GPT-OSS-20B MXFP4 decode step on the H100). Same bits, except
// that an element of -0 with a zero term stays -0. Process-wide; recorded graphs keep what they were
// captured with.
void set_moe_lora_side_expands(bool on);
// moe_block's decode GEMMs with the MoE-LoRA in their accumulators (wait_before_epilogue) let their dependents
// launch at their start (on) or at their wait (off, the default until the H200 measures it). Process-wide.
void set_moe_gemm_early_trigger(bool on);
// moe_block's tiled MoE-LoRA shrink as runs of one (slot, expert) group's tiles per CTA (each staged A chunk
// serves 64 pairs) where moe_lora_shrink_runs_for says so (on, the default), or by the shrink's own size rule
// (the bench's before row). A tuned config's shrink_tiles_per_cta always wins.
void set_moe_lora_shrink_runs_hint(bool on);
// With that hint, the shrink's split_k from moe_lora_run_split (on) instead of the tuned config's or the
// per-tile auto rule's (off; the tuned configs were swept in per-tile mode). On by default since perf-log run
// 117 (a mixed step's MoE block at T 1600: 1002 -> 989 us). Process-wide.
void set_moe_lora_shrink_runs_split(bool on);
// Most adapter tokens of a batch of `tokens` in long same-adapter runs (MoeParams::lora_scattered_tokens =
// `scattered` known and below T / 2), and enough of them that one adapter's run would give each of its E
// groups four 16-pair tiles: (T − scattered)·K ≥ 64·E.
bool moe_lora_shrink_runs_for(int64_t tokens, int64_t scattered, int64_t top_k, int64_t experts);
// moe_block where gate_up's fused activation runs on the persistent kernel: a written in tile order straight
// into down's A rows (MoeGateUpParams::pair_rows; on, the default), or by pair and gathered again for down
// (the bench's before row and the tests' second pass).
void set_moe_block_a_in_tile_order(bool on);
// The default BLOCK_N of BLOCK_M 128 tiles on the wgmma kernels (block_n = 0): 0 (the default: by width, 192
// where it divides the GEMM's n on the warp-specialized kernels, else 128), 128, 192 (the warp-specialized
// kernels only; the ring keeps 128) or 256 (twice the FLOPs per byte staged from L2 per CTA); mma.sync keeps
// 128. Throws std::invalid_argument otherwise.
void set_moe_gemm_large_block_n(int block_n);
// moe_block's down GEMM where it runs 128-row tiles on the persistent kernel: 0 (the default: by width, 192
// where it divides H, else 256; 240 instead of 192 where it divides H too and the down GEMM carries no LoRA
// terms or stream-K tail: GPT-OSS-20B's prefill −0.47 ms, perf-log run 187), 128, 192, 240 (192 where down
// carries LoRA terms or the stream-K tail) or 256. Throws std::invalid_argument otherwise.
void set_moe_block_down_block_n(int block_n);
// moe_block's CTA order at 128-row tiles: groups of this many tiles × every column block (default 8; 0: plain
// tile order), for the bench's before/after. Throws std::invalid_argument outside [0, 64].
void set_moe_block_cta_group(int tiles);
// moe_block's tiled gate_up MoE-LoRA folded into the fused activation (MoeGateUpParams::lora_h), or added into
// the pre-activation h before moe_activation (the default: the fold measured slower, perf-log run 35):
// process-wide, for the bench's before/after rows and the tests.
void set_moe_lora_in_epilogue(bool on);
// The fused gate_up of the halves layout (gate rows, then up rows: Qwen3, Mixtral) at 128-row tiles on the
// persistent TMA kernel, its weight tiles through a 4-D tensor map that interleaves the two halves' rows (on, the
// default), or on the ring kernel with the rows loaded one by one (the bench's before row). 64-row tiles keep the
// ring (perf-log run 201).
void set_moe_gemm_halves_by_tma(bool on);
// moe_block's MoE-LoRA of gate_up in the persistent GEMM's accumulators (MoeGemmLora) for the fused halves
// layout too, where that layout runs on the persistent kernel (128-row tiles, set_moe_gemm_halves_by_tma): a
// prompt with an adapter on Qwen3 / Mixtral then skips the pre-activation h, the expand kernel and
// moe_activation, as GPT-OSS's interleaved layout does (on, the default: perf-log run 247, Qwen3-30B-A3B's prompt
// with an adapter 55.6 → 49.4 ms on an H100); or by the expand kernels into h (off). add_lora_terms reads B's rows through the layout's map (logical column 2i → row i, 2i + 1 →
// I + i); the main slot's pass by warpgroup MMAs (set_moe_lora_gemm_wgmma) stays interleaved-only.
void set_moe_gemm_lora_halves(bool on);
// The bf16 decode GEMM's weight tiles (BLOCK_M 16 × BLOCK_N 64, every caller) by one TMA box a stage, issued by
// one thread and awaited on a per-stage mbarrier (on, the default), or by 16-byte cp.async copies from every
// thread (the before row). Same bits either way. On an H100 (perf-log run 215) the GEMMs stream ~6% faster
// by TMA: GPT-OSS-20B T 16 gate_up 352.7 → 332.0 µs, down 182.0 → 172.4; the bf16 decode step 14.65 → 13.95
// ms. BLOCK_N 128 (set_moe_block_decode_block_n) takes its weight the same way, in boxes of 128 rows.
void set_moe_decode_weight_by_tma(bool on);
// The MXFP4 decode GEMM's weight spans (codes and exponents of each stage) by two bulk copies from one thread,
// awaited on a per-stage mbarrier, instead of every thread's 16-byte cp.async (off, the default, until the
// device A/B decides). Same bits either way.
void set_moe_mxfp4_weight_by_bulk(bool on);
// moe_block's tiled MoE-LoRA (gate_up with the interleaved layout, and down) added in the GEMMs' fp32
// accumulators (MoeGemmLora: the shrink writes z, the persistent GEMM adds z·Bᵀ before its epilogue, no
// expand, no pre-activation h, no moe_activation), where moe_block runs the persistent kernel. Each warp
// makes one pass per distinct adapter among its 16 rows, so it wins where adapters come in long runs of
// tokens (one adapter per prompt: prefill of 1600 tokens with an adapter 39.4 → 38.6 ms, perf-log run 61).
// moe_block then orders each expert's rows by slot (moe_align order_by_slot), so token-interleaved adapters
// cost a warp one or two passes (8 spread, T 4096: +580 µs a layer, +1170 in token order; run 66).
enum class MoeLoraInGemm {
  kOff,          // always the expand kernels
  kLongRuns,     // the default: by moe_lora_in_gemm_for's rule on MoeParams::lora_scattered_tokens
  kAlways,       // wherever moe_block runs the persistent kernel (tests, bench rows)
};
// Process-wide, for the bench's before/after rows and the tests.
void set_moe_lora_in_gemm(MoeLoraInGemm mode);
// The persistent kernel's MoE-LoRA: during each item's k-loop every warp prefetches its rows' z and its
// first slot's B slice into L1, so add_lora_terms after the loop reads from L1 (on), or from L2 with its
// round trips in sequence (the bench's before row). Hints only: the same result bit for bit.
// GemmKernelParams carries it: record graphs again after changing it.
void set_moe_lora_l1_prefetch(bool on);
// The mode's choice for a batch of `tokens` with MoeParams::lora_scattered_tokens = `scattered` at expert
// tiles of `block_m` rows. kLongRuns: 128-row tiles with scattered known (-1 in recordings); in between
// T / 256 and T / 2 with warp groups (moe_lora_warp_groups_for). Not 16-row tiles (decode) since perf-log
// run 170: there the forked shrinks and side expands run beside the GEMMs; kAlways still puts them in (the
// direct shrink writes z, the decode GEMMs add z·Bᵀ). moe_block also needs, at 16 rows, the direct MoE-LoRA
// path (moe_lora_small_fits), at 128 the persistent kernel, and for gate_up the interleaved layout.
bool moe_lora_in_gemm_for(MoeLoraInGemm mode, int64_t tokens, int64_t scattered, int block_m);
// A warp's rows in the persistent GEMM's accumulator tile (wgmma m64: four warps of 16 rows).
constexpr int kMoeLoraWarpRows = 16;
// Whether moe_block's expert align starts each (expert, slot) group at a warp boundary where the expert's
// tiles have room (moe_align slot_group_rows = kMoeLoraWarpRows; never an extra tile), so no warp of those
// 128-row tiles holds two adapters: kLongRuns with T / 256 < scattered < T / 2 — a long run's tiles beside a
// few short runs' tokens (the yardstick's mixed step: a prompt with an adapter beside 15 decoding tokens of
// 8 adapters). Without it each expert's few short-run pairs sit at the ends of its run, so most of its tiles
// hold a warp with two or three adapters, which makes a pass for each over every column block.
bool moe_lora_warp_groups_for(MoeLoraInGemm mode, int64_t tokens, int64_t scattered, int block_m);

// The one place BLOCK_M is chosen: by the mean pairs per expert, T*K / E (host numbers, no sync).
int moe_gemm_block_m(int64_t pairs, int64_t experts);
// moe_gemm_block_m's answer wherever the mean expert holds at least 32 pairs: 0 (the rule, the default), 64 or
// 128 (the bench's comparison rows). Throws std::invalid_argument otherwise.
void set_moe_gemm_block_m_override(int block_m);

// Tiles of one expert grouping (moe_align with slots = 0, block_m = BLOCK_M).
struct MoeExpertTiles {
  Tensor sorted_pairs;  // [capacity] i32: pair t*K + k, or T*K (the sentinel) on padding
  Tensor tile_group;    // [capacity / block_m] i32: expert of each tile, -1 past the last tile
  Tensor num_tiles;     // [1] i32
  int block_m = kMoeGemmBlockMDecode;
};

// h or a = gate_up over the tiles: h[pair] = W_gu[e]·x[pair / K] + b_gu[e], e = the tile's expert.
// With `a` defined the activation is fused (a[pair] = act(h[pair]) of h rounded to bf16, bit-identical to
// h then moe_activation); otherwise the pre-activation h is written (the MoE-LoRA adds into h before
// moe_activation). Exactly one of h, a.
// The MoE-LoRA in a GEMM's accumulators (moe_gate_up / moe_down on the BLOCK_M 16 decode kernel, any layout,
// or on the persistent TMA kernel: BLOCK_M 64/128, sorted_rows given, weight not in the fused halves layout;
// anything else is refused): every row
// whose token has a slot of nonzero rank gets z[pair]·B[slot, expert]ᵀ added in fp32 before the bias and
// the epilogue (the fused activation sees h + LoRA). z [T*K, R] f32 (moe_lora_shrink's output; only the rows
// of tokens with a slot are read; the caller restores its zero invariant afterwards), b [S, E, n, R] bf16
// (scale folded, rows in the weight's layout; padding ranks may hold anything), rank [S] i32, token_slot [T]
// i32 in [-1, S). Undefined z: no LoRA term.
struct MoeGemmLora {
  Tensor z;
  Tensor b;
  Tensor rank;
  Tensor token_slot;
  // Optional scratch of set_moe_gemm_lora_ktile (undefined: that form is not taken), any contents: z_rows [at
  // least the tiles' capacity, 64] BF16 (the main slot's z rows in tile order), tile_slots [at least the tiles'
  // count] I32 (each tile's slot of that k-tile, or -1).
  Tensor z_rows;
  Tensor tile_slots;
  bool defined() const { return z.defined(); }
};

// Scratch of the persistent kernel's stream-K tail: when the work units (tiles × column blocks) are not a
// whole number of rounds of its grid, the last partial round's units are cut along k over every CTA, and the
// CTA that completes a unit sums its pieces (in a fixed order: deterministic) and runs its epilogue.
// partials: F32 of at least moe_stream_k_floats() elements (any contents); counters: I32 of at least
// moe_stream_k_counters() elements, zero on entry and left zero. Undefined: every unit whole. Taken by the
// persistent kernel at BLOCK_M 128 (not its multicast form); the other kernels ignore it.
struct MoeStreamK {
  Tensor partials;
  Tensor counters;
  bool defined() const { return partials.defined(); }
};
int64_t moe_stream_k_floats();
int64_t moe_stream_k_counters();

// The expert weight's MXFP4 copy in the decode layout of ops/mxfp4.h (blocks [E, in/64, n, 32] and scales
// [E, in/64, n, 2], U8; model/mxfp4.h packs it), which must dequantize exactly to `weight`. Taken by the
// BLOCK_M 16 decode GEMM, which then streams it instead of the bf16 weight (3.8× fewer bytes); needs in % 64
// == 0, n % 8 == 0 and, for gate_up, the interleaved layout. The other BLOCK_Ms ignore it. Undefined: bf16.
struct MoeMxfp4Weight {
  Tensor blocks;
  Tensor scales;
  bool defined() const { return blocks.defined(); }
};

struct MoeGateUpParams {
  Tensor x;             // [T, H] bf16
  Tensor weight;        // [E, 2I, H] bf16
  Tensor bias;          // [E, 2I] bf16, optional
  int64_t top_k = 1;    // K
  MoeExpertTiles tiles;
  ops::MoeActivation activation = ops::MoeActivation::kSiluGated;
  ops::GateUpLayout layout = ops::GateUpLayout::kHalves;
  float swiglu_alpha = 1.702f;
  float swiglu_limit = 7.0f;
  Tensor h;             // [T*K, 2I] bf16 pre-activation, rows of the weight's layout; or undefined
  Tensor a;             // [T*K, I] bf16 activated; or undefined
  int cta_group = 0;    // BLOCK_M 64/128 (wgmma kernels): > 0 orders CTAs in groups of this many tiles ×
                        // every column block (L2 reuse of x); 0 = column block slowest (tests, bench)
  int block_n = 0;      // output columns per CTA: 0 = the default for tiles.block_m; 64, 128 or 256 (tests,
                        // bench): BLOCK_M 16 has 64 and 128; 64/128 on the warp-specialized kernel 128 and 256;
                        // on the ring kernels 64 and 128 (BLOCK_M 64) or 128 and 256 (BLOCK_M 128, wgmma);
                        // 192 at BLOCK_M 128 on the warp-specialized kernel; 240 there for down only, on the
                        // persistent form (A rows in tile order) without lora or stream_k
  int decode_stages = 0;  // BLOCK_M 16 × BLOCK_N 64 only: shared-memory stages 4, 5 or 6 (0 = the default);
                          // fewer stages fit more CTAs per SM (6: 3, 5: 4, 4: 5), the same bytes in flight
  // Programmatic dependent launch (BLOCK_M 16 and the mma.sync kernel; ignored by the wgmma kernels): the
  // GEMM starts in the previous kernel's tail and lets its own dependents start in its tail. Every CTA
  // waits for the previous grid before it reads x or writes out. routing_before_wait: the tiles and the
  // first weight stages are read before that wait. PRECOND for it: the kernel launched directly before
  // does not write the tiles, and waits in every CTA before it triggers its dependents (or is a plain launch).
  bool pdl = false;
  bool routing_before_wait = false;
  // With pdl, BLOCK_M 16: the whole k-loop (tiles, x, weights) before the wait; only lora.z is read and the
  // output written after it, so the kernel launched directly before (the LoRA shrink that writes z) runs
  // alongside the weight stream. PRECOND: that kernel writes none of the tiles, x, weight, bias, reads
  // nothing of the output, and waits in every CTA before it triggers; tiles and x are written two or more
  // launches back. Overrides routing_before_wait.
  bool wait_before_epilogue = false;
  // With wait_before_epilogue: the GEMM lets its dependents launch at its start instead of at its wait, so the
  // next kernel's CTAs become resident as this grid's last CTAs start, not as they reach their epilogue (the
  // tail a late trigger gives up). Every CTA still waits before it exits, so the dependent's wait still finds
  // this grid and the ones before it complete. PRECOND: the dependent reads nothing before its own wait that
  // the kernel just before this GEMM writes (moe_block: the down shrink reads routing, rank and A; the
  // combine nothing).
  bool early_trigger = false;
  // Scratch [capacity of tiles.sorted_pairs, H] bf16, optional: with the warp-specialized kernel (BLOCK_M
  // 64/128; kAuto picks it when this is given and the weight is one box) x's rows are first gathered here in
  // tile order, so the A tile comes by TMA as one box per stage (padding rows left as they are: their outputs
  // are never stored); ignored by the other kernels. Undefined: the warp-specialized kernel gathers them by
  // cp.async, kAuto runs the ring.
  Tensor sorted_rows;
  // The persistent kernel's grid: at most this many SMs' worth of CTAs (0: every SM). The engine's prefill
  // lane leaves the other SMs to the decode kernels running beside it (a persistent grid holds its SMs to
  // its end, whatever the stream priorities).
  int max_sms = 0;
  // The MoE-LoRA folded into the fused activation (moe_block's tiled LoRA path): lora_h [T*K, 2I] bf16 in the
  // weight's row layout holds the LoRA's delta of h for every pair whose token has a slot (token_slot [T]
  // i32 >= 0; moe_lora_expand with overwrite writes exactly those rows); the epilogue adds it to h before
  // the activation. Only with `a` (fused); both undefined = no LoRA term.
  Tensor lora_h;
  Tensor token_slot;
  MoeGemmLora lora;  // the LoRA in the accumulators instead (not with lora_h)
  // Optional [T*K] I32: `a` is written in tile order instead — a [capacity of tiles.sorted_pairs, I], row r =
  // the pair of tile row r (padding rows not written) — and pair_rows[pair] = that row (written by the gather
  // of x's rows). moe_down then takes a as its A tiles as they are (MoeDownParams::a_in_tile_order: no gather
  // of a) and the down MoE-LoRA's shrink reads it through MoeLoraParams::x_rows. Needs the persistent kernel:
  // a (fused), sorted_rows, BLOCK_M 64/128, the interleaved layout, kAuto or the warp-specialized kernel.
  Tensor pair_rows;
  MoeStreamK stream_k;  // optional: the persistent kernel's stream-K tail
  MoeMxfp4Weight mxfp4;  // optional: the decode GEMM reads the weight's MXFP4 copy
};
void moe_gate_up(const MoeGateUpParams& p, cudaStream_t stream);

// a[pair, i] = act(gate, up) of h[pair] (same math as the fused epilogue), for every one of the P rows.
struct MoeActivationParams {
  Tensor h;  // [P, 2I] bf16
  ops::MoeActivation activation = ops::MoeActivation::kSiluGated;
  ops::GateUpLayout layout = ops::GateUpLayout::kHalves;
  float swiglu_alpha = 1.702f;
  float swiglu_limit = 7.0f;
  Tensor a;  // [P, I] bf16
  // Optional [P, 2I] f32, 16-byte aligned: a LoRA term written beside the GEMM (MoeLoraSmallParams::delta).
  // Each h element with a nonzero term becomes bf16(h + delta) before the activation (the bits of the expand's
  // h += delta), and the kernel zeroes what it read (the workspace's self-cleaning scratch).
  Tensor delta{};
};
void moe_activation(const MoeActivationParams& p, cudaStream_t stream);

// d[pair] = W_d[e]·a[pair] + b_d[e] over the tiles (rows of pairs not in any tile are not written).
struct MoeDownParams {
  Tensor a;       // [T*K, I] bf16
  Tensor weight;  // [E, H, I] bf16
  Tensor bias;    // [E, H] bf16, optional
  MoeExpertTiles tiles;
  Tensor d;       // [T*K, H] bf16
  int block_n = 0;  // as MoeGateUpParams::block_n
  int cta_group = 0;  // as MoeGateUpParams::cta_group
  int decode_stages = 0;  // as MoeGateUpParams::decode_stages
  bool pdl = false;  // as MoeGateUpParams::pdl
  bool routing_before_wait = false;  // as MoeGateUpParams::routing_before_wait
  bool wait_before_epilogue = false;  // as MoeGateUpParams::wait_before_epilogue (x is a)
  bool early_trigger = false;         // as MoeGateUpParams::early_trigger
  Tensor sorted_rows;  // [capacity, I] bf16, optional: as MoeGateUpParams::sorted_rows, for a's rows
  int max_sms = 0;     // as MoeGateUpParams::max_sms
  MoeGemmLora lora;    // as MoeGateUpParams::lora (b [S, E, H, R])
  int64_t top_k = 1;   // K, with lora only: token of pair = pair / K
  // a is [capacity of the tiles, I] in tile order (moe_gate_up with pair_rows wrote it): its boxes are the A
  // tiles as they are, with no gather; T*K comes from d. Needs the persistent kernel (BLOCK_M 64/128, kAuto
  // or warp-specialized); sorted_rows undefined.
  bool a_in_tile_order = false;
  MoeStreamK stream_k;  // optional: as MoeGateUpParams::stream_k
  MoeMxfp4Weight mxfp4;  // optional: as MoeGateUpParams::mxfp4 ([E, I/64, H, ...])
};
void moe_down(const MoeDownParams& p, cudaStream_t stream);

// out[t] = Σ_k w[t, k] · d[t*K + k], fp32 in k order, one rounding to bf16; no atomics (deterministic).
struct MoeCombineParams {
  Tensor d;             // [T*K, H] bf16
  Tensor topk_weights;  // [T, K] f32
  Tensor out;           // [T, H] bf16
  // Optional, contiguous F32 (any shape, 16-byte aligned, numel % 4 == 0): set to zero by the same kernel,
  // after its programmatic wait. moe_block's decode MoE-LoRA in the GEMM accumulators restores the
  // workspace's zero z this way (the GEMMs before it have read z), with no memset node in the chain.
  Tensor clear;
  // Optional [T*K, H] f32, 16-byte aligned: a LoRA term written beside the down GEMM; each d element with a
  // nonzero term is bf16(d + delta) before the weighted sum, and the kernel zeroes what it read (as
  // MoeActivationParams::delta).
  Tensor delta{};
};
void moe_combine(const MoeCombineParams& p, cudaStream_t stream);

// The sizes moe_block's workspace is carved for: the largest batch and the model's shapes.
struct MoeWorkspaceShape {
  int64_t max_tokens = 0;  // T
  int64_t top_k = 1;       // K
  int64_t experts = 1;     // E
  int64_t slots = 0;       // S (0: no MoE-LoRA)
  int64_t hidden = 0;      // H
  int64_t inter = 0;       // I
  int64_t max_rank = 0;    // R, the larger capacity of the two LoRA stacks (0: no MoE-LoRA)
};
size_t moe_workspace_bytes(const MoeWorkspaceShape& shape);

// Device scratch of moe_block, allocated once at start-up: U8 of at least moe_workspace_bytes(shape).
struct MoeWorkspace {
  MoeWorkspaceShape shape;
  Tensor memory;  // [bytes] U8 on cuda
};

// Launch choices of moe_block's MoE-LoRA (tuned data, ops/kernel_configs.h; defaults = built-in choices).
struct MoeBlockConfig {
  int lora_path = -1;   // -1: by size (moe_lora_small_fits), 0: direct per-pair path, 1: tiled path
  bool small_pdl = true;
  MoeLoraConfig lora;   // the tiled path's knobs
  // gate_up and down as programmatic dependents (MoeGateUpParams::pdl; down reads its tiles and first
  // weight stages before the wait): false = plain launches (the before/after figure).
  bool gemm_pdl = true;
  // The decode MoE-LoRA in the GEMM accumulators: from 32 pairs each GEMM's k-loop runs alongside the shrink
  // before it (MoeGateUpParams::wait_before_epilogue); false = the GEMM waits for the shrink first (the before row).
  bool decode_lora_overlap = true;
  int max_sms = 0;  // MoeGateUpParams::max_sms of both GEMMs (the prefill lane's backend sets it)
  // The decode MoE-LoRA by the expand kernels (MXFP4 experts, or set_moe_lora_in_gemm(kOff)): where all three
  // are set, and set_moe_lora_fork_shrinks is on, each shrink runs on side_stream beside its GEMM (fork orders it
  // after the stream's work, join the expand after it), a parallel branch in a captured graph.
  cudaStream_t side_stream = nullptr;
  cudaEvent_t fork = nullptr, join = nullptr;
};

// Zero the workspace's self-cleaning MoE-LoRA scratch (z and its counters): once after allocating (or
// poisoning) it, before the first moe_block; every call leaves it zero again.
void moe_workspace_prepare(const MoeWorkspace& workspace, cudaStream_t stream);

// The ops::MoeParams contract on cuda (x, out bf16): align by expert, gate_up, (with LoRA: align by
// (slot, expert) — or pair by pair for a tiny batch (moe_lora_small.cuh) — LoRA into h, activation), down
// (+ LoRA into d), combine. Where set_moe_lora_in_gemm's rule picks it, the LoRA goes into the GEMMs'
// accumulators instead (decode: align, shrink, gate_up with the activation fused, shrink, down, combine).
// No allocation and no host
// synchronization: capturable in a CUDA graph. T must not exceed the workspace's max_tokens.
// PRECOND (not checkable without a sync, unlike the CPU oracle): topk_ids in [0, E) (router output),
// token_slot in [-1, S), ranks in [0, R]. Shapes, dtypes and devices are checked, naming the field.
void moe_block(const ops::MoeParams& p, const MoeWorkspace& workspace, cudaStream_t stream,
               const MoeBlockConfig& config = {});

}  // namespace lmx::cuda
