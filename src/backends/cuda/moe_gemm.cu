// Base MoE kernels (moe_gemm.cuh) and their launchers: one grouped GEMM kernel for gate_up and down, the
// activation, the combine, and moe_block which chains them with moe_align and moe_lora.
// Grouped GEMM design (mma.sync m16n8k16 bf16 -> fp32, sm_80+ instructions, fine on sm_90a):
//  - CTA = one BLOCK_M tile of moe_align (one expert) × BLOCK_N (64 or 128) output columns; grid.x = tiles (fastest),
//    grid.y = column blocks, so the CTAs resident together share a weight slice and reuse it from L2 across
//    an expert's tiles (prefill), while x rows (small) are re-read from L2 per column block.
//  - Both operands are K-contiguous (x rows, weight rows [out, in]), so both go global -> shared with 16-byte
//    cp.async over a STAGES-deep pipeline and shared -> registers with ldmatrix (non-transposed): weight rows
//    are exactly mma's "col" B operand. Shared rows are 64 bf16 = 8 chunks of 16 bytes, chunk XOR (row % 8)
//    swizzled, so every 8-lane ldmatrix phase and every cp.async row write hits 8 distinct bank groups.
//  - Decode (BLOCK_M 16): the kernel is a weight stream. BLOCK_N 64: 6 stages × 10 KB = 60 KB per CTA,
//    3 CTAs per SM, so up to ~150 KB of loads in flight per SM; gate_up at GPT-OSS-20B has 90 column blocks
//    per touched expert: 360 CTAs at T = 1, ~2500 at T = 16 (132 SMs).
//  - Gathered rows: sorted_pairs gives the pair; x row = pair / K (gate_up) or pair (down). Sentinel rows
//    and columns or inputs past the end are zero-filled by cp.async (src-size 0) and never stored.
//  - Fused activation: gate and up of one i must meet in one thread. mma's accumulator gives a thread the
//    column pair (2j, 2j+1), so logical column 2i is gate i and 2i+1 is up i: interleaved weights are read
//    as they are, halves weights are read with row map 2i -> i, 2i+1 -> I + i (free: rows load one by one).
//    The fused epilogue rounds h to bf16 before the activation, exactly like the unfused path (h stored as
//    bf16, then moe_activation), so a base token's output does not depend on whether its batch has LoRA.
//  - Hopper (sm_90a), BLOCK_M 64/128 × BLOCK_N 128: grouped_gemm_wgmma_kernel keeps the loads, layout and
//    epilogue and replaces ldmatrix + mma.sync by warpgroup MMAs (wgmma m64n128k16) reading both tiles from
//    shared memory (the swizzle above is wgmma's 128-byte swizzle); compute-bound prefill runs there.
#include "backends/cuda/moe_gemm.cuh"
#include "backends/cuda/stream_k.h"

#include <cuda.h>  // CUtensorMap (the encoder is reached through the runtime's driver entry point)
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled
#include <cuda_bf16.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "backends/cuda/check.h"
#include "backends/cuda/launch.cuh"
#include "backends/cuda/device.cuh"
#include "backends/cuda/moe_align.cuh"
#include "backends/cuda/moe_lora.cuh"
#include "backends/cuda/moe_lora_small.cuh"
#include "backends/cuda/wgmma.cuh"
#include "ops/backend.h"
#include "ops/mxfp4.h"

namespace lmx::cuda {
namespace {

using detail::exp2_ftz;
using detail::fence_operands;
using detail::rcp_approx;
using detail::fence_proxy_async;
using detail::sw128_descriptor;
using detail::wgmma_commit;
using detail::wgmma_fence;
using detail::wgmma_wait;
using detail::StreamKPlan;
using detail::stream_k_plan;
using detail::walk_units;

constexpr int kBlockK = 64;  // one shared row = 64 bf16 = 128 bytes = 8 chunks
constexpr int kChunksPerRow = kBlockK / 8;

// ---- kernels ------------------------------------------------------------------------------------------

struct GemmKernelParams {
  const __nv_bfloat16* x;       // [rows, in] bf16: x [T, H] (row = pair / K) or a [T*K, I] (row = pair)
  const __nv_bfloat16* weight;  // [E, n, in] bf16
  const __nv_bfloat16* bias;    // [E, n] bf16, or null
  const int32_t* sorted_pairs;  // [capacity] i32
  const int32_t* tile_group;    // [max_tiles] i32
  const int32_t* num_tiles;     // [1] i32
  __nv_bfloat16* out;           // [T*K, n] bf16 (h, d), or [T*K, n / 2] bf16 (a, fused activation)
  int pairs;                    // T*K, the sentinel
  int row_div;                  // K for gate_up, 1 for down
  int in;                       // reduction length (H or I)
  int n;                        // output columns = weight rows (2I or H)
  bool fuse_activation;         // out = act(gate, up) of column pairs
  bool halves;                  // fused only: logical column 2i -> weight row i, 2i+1 -> I + i
  bool gpt_oss;                 // kGptOssClamped, else kSiluGated
  float swiglu_alpha;
  float swiglu_limit;
  int cta_group;                // > 0: CTAs ordered in groups of this many tiles × every column block
  int64_t weight_rows;          // E·n, the weight's rows as one matrix
  bool weight_by_tma;           // warp-specialized kernel: weight tiles come through weight_map
  bool a_by_tma;                // warp-specialized kernel: A tiles come through a_map (rows gathered in tile order)
  int work_tiles;               // persistent kernel: tiles (max_tiles) × work_column_blocks work items
  int work_column_blocks;
  bool compact_epilogue;        // persistent kernel: the epilogue form chosen once per work item (Epilogue)
  bool out_by_row;              // persistent kernel: output row = tile row (tile order), not the pair
  bool pdl;                     // grouped_gemm_kernel: launched as a programmatic dependent (MoeGateUpParams::pdl)
  bool routing_before_wait;     // with pdl: tiles and the first weight stages are read before the wait
  bool wait_before_epilogue;    // with pdl: the whole k-loop before the wait (grouped_gemm_kernel only)
  bool early_trigger;           // with wait_before_epilogue: launch_dependents at the start (MoeGateUpParams)
  bool lora_l1_prefetch;        // persistent kernel: each warp's z rows and first slot's B slice into L1 during
                                // the item's k-loop (LoraL1Prefetch)
  bool epilogue_warps;          // persistent kernel with kEpilogueWarps: fused items' activation and stores by the
                                // producer warpgroup's idle warps (EpilogueStage)
  bool epilogue_lora;           // with epilogue_warps and kLora: the MoE-LoRA terms by those warps too
                                // (EpilogueStage::drain_lora), none by the consumers
  CUtensorMap weight_map;       // (64-byte aligned type) [E·n, in] bf16, box [BLOCK_N rows, 64], 128-byte swizzle
  CUtensorMap a_map;            // the gathered rows [capacity, in] bf16, box [BLOCK_M rows, 64], 128-byte swizzle
  const __nv_bfloat16* lora_h;  // fused activation: [T*K, n] bf16 MoE-LoRA delta (weight layout), or null
  const int32_t* token_slot;    // with lora_h: [T] i32; the delta is added where token_slot[pair / row_div] >= 0
  // MoeGemmLora (the persistent kernel's kLora form): acc[pair] += z[pair]·B[slot, expert]ᵀ before the epilogue.
  const float* lora_z;          // [T*K, R] f32, or null
  const __nv_bfloat16* lora_b;  // [S, E, n, R] bf16 (scale folded, rows in the weight's layout)
  const int32_t* lora_rank;     // [S] i32
  const int32_t* lora_slot;     // [T] i32, the slot of token pair / lora_top_k (-1: none)
  int lora_r;                   // R
  int lora_top_k;               // K
  // Persistent kernel, stream-K tail (MoeStreamK; null: off): the partial accumulators of the k-ranges of split
  // work units, [2 per CTA][consumer threads][kBlockN / 2] f32 per CTA, and per tail unit the k-tiles summed so
  // far (zero between launches: the last piece's CTA puts it back).
  float* sk_partials;
  int32_t* sk_counters;
  // Persistent kernel with kLora at BLOCK_M 128 (set_moe_lora_gemm_wgmma): the B slice [BLOCK_N, 64 ranks] of
  // each tile's main slot (lora_main_slot) comes by TMA through lora_b_map, over the stack as [S·E·n, R]
  // (box [BLOCK_N rows, 64], 128-byte swizzle, ranks past R zero), and lora_wgmma_pass adds it by warpgroup
  // MMAs; the rows of other slots still go through add_lora_terms.
  bool lora_wgmma;
  int lora_slots;  // S of lora_b (the map's rows: S · weight_rows)
  CUtensorMap lora_b_map;
  // Persistent kernel with kLora (set_moe_gemm_lora_ktile): the main slot's term as one more k-tile of the ring
  // (lora_ktile_slot), A = the slot's z rows in tile order in bf16 (z_map over MoeGemmLora::z_rows, [capacity,
  // 64], ranks past R zero) and B = B[slot, expert] by lora_b_map (columns past R zero-filled by TMA).
  bool lora_ktile;
  CUtensorMap z_map;
  __nv_bfloat16* lora_z_rows;  // MoeGemmLora::z_rows: z_rows_kernel's output, z_map's tensor (host: null = no k-tile)
  int64_t lora_z_rows_capacity;
  int32_t* lora_tile_slots;    // MoeGemmLora::tile_slots: each tile's lora_ktile_slot, written by z_rows_kernel
  int64_t lora_tile_slots_capacity;
  // The BLOCK_M 16 decode GEMM on MXFP4 experts (MoeMxfp4Weight; null: the bf16 weight): the weight in the
  // decode layout of ops/mxfp4.h, blocks [E, in/64, n, 32] and scales [E, in/64, n, 2] U8.
  const uint8_t* fp4_blocks;
  const uint8_t* fp4_scales;
};

// griddepcontrol (sm_90): no-ops in a grid launched without the programmatic attribute. Every CTA of a
// pdl GEMM waits before it triggers and before it exits, so a dependent that starts early still finds
// everything two launches back complete (the chain rule of moe_lora_small.cu).
__device__ __forceinline__ void wait_then_allow_dependents() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// The (tile, first column) of this CTA. Launch order is blockIdx.x fastest; with cta_group > 0 the linear
// CTA id is re-mapped so consecutive CTAs sweep every column block of a group of cta_group tiles, and the
// CTAs resident together share x tiles (and an expert's weight slices) in L2 instead of each wave touching
// every tile's x rows (perf-log run 17: 64% L2 hits at T 4096 in plain order).
// work_tile: the same for work item `id` of `tiles` × `column_blocks` (the persistent kernel's loop).
__device__ __forceinline__ int2 work_tile(const GemmKernelParams& p, int id, int tiles, int column_blocks, int block_n) {
  if (p.cta_group <= 0) return {id % tiles, id / tiles * block_n};
  const int group_first = id / (p.cta_group * column_blocks) * p.cta_group;
  const int group_tiles = min(p.cta_group, tiles - group_first);
  const int in_group = id - group_first * column_blocks;
  return {group_first + in_group % group_tiles, in_group / group_tiles * block_n};
}
__device__ __forceinline__ int2 cta_tile(const GemmKernelParams& p, int block_n) {
  return work_tile(p, int(blockIdx.y * gridDim.x + blockIdx.x), int(gridDim.x), int(gridDim.y), block_n);
}

// The CPU oracle's formulas (cpu_moe.cpp, cpu_util.h sigmoid/silu) with the sigmoid by the MUFU alone:
// 1 / (1 + 2^(-x·log2 e)), each step within 2 ulp of fp32, far below the bf16 rounding of the output. The IEEE
// expf and division cost gate_up's epilogue 12% of the GEMM at GPT-OSS T 1600 (perf-log run 244). x << 0:
// 2^big = inf, 1/inf = 0, so silu gives -0 as the oracle's x / inf does.
__device__ __forceinline__ float sigmoid_mufu(float x) {
  constexpr float kMinusLog2E = -1.4426950408889634f;
  return rcp_approx(1.0f + exp2_ftz(x * kMinusLog2E));
}
__device__ __forceinline__ float activate(float gate, float up, bool gpt_oss, float alpha, float limit) {
  if (!gpt_oss) return gate * sigmoid_mufu(gate) * up;
  gate = fminf(gate, limit);
  up = fminf(fmaxf(up, -limit), limit);
  return (up + 1.0f) * (gate * sigmoid_mufu(gate * alpha));
}

__device__ __forceinline__ void cp_async16(void* shared, const void* global, bool valid) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  const int src_bytes = valid ? 16 : 0;  // 0: the 16 shared bytes are zero-filled, nothing is read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(address), "l"(global), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* shared) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// The same on four scalars (accumulators of a wgmma register array, indexed by constants).
__device__ __forceinline__ void mma_bf16(float& c0, float& c1, float& c2, float& c3, const unsigned (&a)[4],
                                         unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Element offset of 16-byte chunk `chunk` of shared row `row` (rows of kBlockK bf16, XOR swizzle).
__device__ __forceinline__ int swizzled(int row, int chunk) { return row * kBlockK + ((chunk ^ (row & 7)) * 8); }

// Both kernels' epilogue for one accumulator pair: row `pair`, columns `column` (even) and column + 1, plus
// the bias, then either the fused activation (one output) or the two bf16 values, stored in output row
// `out_row` (the pair, or its tile row with out_by_row). Columns past n are dropped.
__device__ __forceinline__ void store_columns(const GemmKernelParams& p, int expert, int pair, int column, float v0,
                                              float v1, int out_row) {
  if (column >= p.n) return;
  const int64_t inter = p.n / 2;
  const bool has_second = column + 1 < p.n;
  const int64_t row0 = p.halves ? column / 2 : column;  // the two columns' weight rows
  const int64_t row1 = p.halves ? inter + column / 2 : column + 1;
  if (p.bias != nullptr) {
    const __nv_bfloat16* bias = p.bias + int64_t(expert) * p.n;
    v0 += __bfloat162float(bias[row0]);
    if (has_second) v1 += __bfloat162float(bias[row1]);
  }
  // The MoE-LoRA's delta of h (fused only), by read-only loads (__ldg) so they need not wait behind the
  // previous columns' stores to `out` (the persistent kernel's whole blocks take kFusedDelta instead).
  if (p.lora_h != nullptr && __ldg(p.token_slot + pair / p.row_div) >= 0) {
    const __nv_bfloat16* delta = p.lora_h + int64_t(pair) * p.n;
    v0 += __bfloat162float(__ldg(delta + row0));
    if (has_second) v1 += __bfloat162float(__ldg(delta + row1));
  }
  if (p.fuse_activation) {  // PRECOND n even, so has_second
    // h rounded to bf16 first, as the unfused path stores it: a batch whose tokens have no adapter gives
    // bit-identical results whether moe_block took the fused or the LoRA path.
    const float gate = __bfloat162float(__float2bfloat16_rn(v0));
    const float up = __bfloat162float(__float2bfloat16_rn(v1));
    p.out[int64_t(out_row) * inter + column / 2] =
        __float2bfloat16_rn(activate(gate, up, p.gpt_oss, p.swiglu_alpha, p.swiglu_limit));
  } else if (has_second && p.n % 2 == 0) {
    *reinterpret_cast<__nv_bfloat162*>(p.out + int64_t(out_row) * p.n + column) = __floats2bfloat162_rn(v0, v1);
  } else {
    p.out[int64_t(out_row) * p.n + column] = __float2bfloat16_rn(v0);
    if (has_second) p.out[int64_t(out_row) * p.n + column + 1] = __float2bfloat16_rn(v1);
  }
}

// The epilogue form of one work item (uniform across the CTA), chosen once per item so the executed path
// carries none of store_columns' per-column branches: kFused / kStore need every column of the block inside n,
// the interleaved layout (and for the LoRA fold BLOCK_N 128); anything else takes store_columns (kGeneral).
// kFusedDelta: kFused with the MoE-LoRA delta (lora_h) added before the activation, where the kernel has
// registers for it (delta_form: BLOCK_M 128 × BLOCK_N 128; 32 more per thread spill at BLOCK_N 256 or in
// BLOCK_M 64's 128 registers).
enum class Epilogue { kGeneral, kFused, kFusedDelta, kStore };
__device__ __forceinline__ Epilogue epilogue_case(const GemmKernelParams& p, int first_column, int block_n,
                                                  bool delta_form) {
  // halves: the tile's columns are logical (gate, up) pairs as in the interleaved layout; only the bias and the
  // delta are indexed by weight row
  if (first_column + block_n > p.n || (p.halves && (p.bias != nullptr || p.lora_h != nullptr))) return Epilogue::kGeneral;
  if (p.lora_h != nullptr) return p.fuse_activation && delta_form ? Epilogue::kFusedDelta : Epilogue::kGeneral;
  if (p.fuse_activation) return Epilogue::kFused;
  return p.n % 2 == 0 ? Epilogue::kStore : Epilogue::kGeneral;
}

// A 4 × 4 transpose among a row's four lanes (t = lane % 4) by two butterfly rounds of shuffles: v[k] holds
// element 4k + t of a group of 16 on entry, element 4t + k on exit. PRECOND: the whole warp calls.
template <typename T>
__device__ __forceinline__ void transpose_quad(T* v) {
  const int t = threadIdx.x % 4;
#pragma unroll
  for (int s = 2; s >= 1; s /= 2) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (k & s) continue;  // the pair (k, k + s)
      const bool upper = (t & s) != 0;
      const T received = __shfl_xor_sync(0xffffffffu, upper ? v[k] : v[k + s], s);
      if (upper) v[k] = received;
      else v[k + s] = received;
    }
  }
}

// The fused form's outputs of one row: lane t (= lane % 4) holds activated[j] at output column
// (column0 + 8j) / 2 = c + 4j + t (c = the block's first output column, a multiple of 64). The quad transpose
// per group of 16 columns leaves lane t with columns c + 16m + 4t .. + 3, stored as one 8-byte word instead
// of four 2-byte stores (perf-log run 65: gate_up at T 1600 536 µs, 580–649 before; at T 4096 within the
// run-to-run spread).
// PRECOND: the whole warp calls (shuffles); `store` is the same across a row's four lanes.
template <int kBlockN>
__device__ __forceinline__ void store_activated(__nv_bfloat16* out, int column0, bool store,
                                                float (&activated)[kBlockN / 8]) {
  const int t = threadIdx.x % 4;
  const int first = (column0 - 2 * t) / 2;  // c
#pragma unroll
  for (int m = 0; m < kBlockN / 32; ++m) {
    float* v = activated + 4 * m;  // lane t: columns c + 16m + 4k + t, k = 0..3
    transpose_quad(v);             // lane t: columns c + 16m + 4t + k
    if (store) {
      __nv_bfloat162 lo = __floats2bfloat162_rn(v[0], v[1]), hi = __floats2bfloat162_rn(v[2], v[3]);
      uint2 word;
      word.x = *reinterpret_cast<unsigned*>(&lo);
      word.y = *reinterpret_cast<unsigned*>(&hi);
      *reinterpret_cast<uint2*>(out + first + 16 * m + 4 * t) = word;
    }
  }
}

// The store form's outputs of one row: words[j] holds the bf16 pair of columns column0 + 8j and + 1
// (column0 = c + 2t). The quad transpose per group of 32 columns leaves lane t with columns c + 32m + 8t .. + 7,
// stored as one 16-byte word: a warp's store instruction then fills whole 32-byte sectors (8 rows × 64 bytes)
// where four 4-byte stores each wrote half of 8 sectors (perf-log run 244: down's stores cost ~8% of it). A
// last group of 16 columns (BLOCK_N 240) keeps the 4-byte stores.
// PRECOND: the whole warp calls; `store` is the same across a row's four lanes; out 16-byte aligned (n % 8 == 0)
// and c a multiple of 8.
template <int kBlockN>
__device__ __forceinline__ void store_words(__nv_bfloat16* out, int column0, bool store,
                                            unsigned (&words)[kBlockN / 8]) {
  const int t = threadIdx.x % 4;
  const int first = column0 - 2 * t;  // c
#pragma unroll
  for (int m = 0; m < kBlockN / 32; ++m) {
    unsigned* w = words + 4 * m;  // lane t: the pairs at columns c + 32m + 8k + 2t, k = 0..3
    transpose_quad(w);            // lane t: the pairs at columns c + 32m + 8t + 2k
    if (store) *reinterpret_cast<uint4*>(out + first + 32 * m + 8 * t) = make_uint4(w[0], w[1], w[2], w[3]);
  }
#pragma unroll
  for (int j = kBlockN / 32 * 4; j < kBlockN / 8; ++j) {
    if (store) *reinterpret_cast<unsigned*>(out + column0 + 8 * j) = words[j];
  }
}

// A warpgroup's 64 × kBlockN accumulators (wgmma layout: thread lane holds rows lane / 4 and + 8 of its warp's
// 16, columns 8j + 2(lane % 4) and + 1) through the kFused or kStore form; the same arithmetic as
// store_columns (bias added in fp32, h rounded to bf16 before the activation). pair[half]: the rows' pairs
// (>= p.pairs on padding, not stored); column0: the thread's first column; bias[j]: the biases of columns
// column0 + 8j and + 1 (zeros without a bias); delta[half][j] (kFusedDelta): lora_h of those columns, added
// where has_delta[half] (the row's token has a slot); out_row[half]: the rows' output rows (pair, or tile row).
template <Epilogue kCase, int kBlockN, int kDelta, bool kWide = false>
__device__ __forceinline__ void store_tile(const GemmKernelParams& p, const int (&pair)[2], const int (&out_row)[2],
                                           int column0,
                                           const __nv_bfloat162 (&bias)[kBlockN / 8],
                                           const __nv_bfloat162 (&delta)[2][kDelta], const bool (&has_delta)[2],
                                           const float (&acc)[kBlockN / 2]) {
  static_assert(kCase != Epilogue::kGeneral && (kCase != Epilogue::kFusedDelta || kDelta == kBlockN / 8));
  constexpr bool kActivated = kCase == Epilogue::kFused || kCase == Epilogue::kFusedDelta;
  constexpr bool kWideStores = kWide && !kActivated && kBlockN % 16 == 0;  // store_words: 32-column groups + 16
  const bool wide = kWideStores && p.n % 8 == 0 && reinterpret_cast<uintptr_t>(p.out) % 16 == 0;
  const int64_t out_stride = kActivated ? p.n / 2 : p.n;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    // Padding rows are computed too (the shuffles of the fused and wide forms need the whole warp) but never
    // stored; the four lanes of a row share its pair, so they skip together. A warp whose 8 rows of this half are all
    // padding (an expert's last tile) skips the half whole: the activation's arithmetic is most of the fused
    // epilogue (perf-log run 244).
    const bool store = pair[half] < p.pairs;
    if (!__any_sync(0xffffffffu, store)) continue;
    __nv_bfloat16* out = p.out + int64_t(store ? out_row[half] : 0) * out_stride;
    [[maybe_unused]] float activated[kBlockN / 8];  // kActivated: the outputs, column (column0 + 8j) / 2
    [[maybe_unused]] unsigned words[kBlockN / 8];   // wide: the bf16 pairs of columns column0 + 8j and + 1
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) {
      const int column = column0 + 8 * j;
      const float2 b = __bfloat1622float2(bias[j]);
      float v0 = acc[4 * j + 2 * half] + b.x, v1 = acc[4 * j + 2 * half + 1] + b.y;
      if constexpr (kCase == Epilogue::kFusedDelta) {
        if (has_delta[half]) {  // only with a slot: no +0 added (a -0 stays -0, as without the LoRA)
          const float2 d = __bfloat1622float2(delta[half][j]);
          v0 += d.x;
          v1 += d.y;
        }
      }
      if constexpr (kActivated) {
        const float gate = __bfloat162float(__float2bfloat16_rn(v0));
        const float up = __bfloat162float(__float2bfloat16_rn(v1));
        activated[j] = activate(gate, up, p.gpt_oss, p.swiglu_alpha, p.swiglu_limit);
      } else {
        __nv_bfloat162 bits = __floats2bfloat162_rn(v0, v1);
        if (wide) words[j] = *reinterpret_cast<unsigned*>(&bits);
        else if (store) *reinterpret_cast<__nv_bfloat162*>(out + column) = bits;
      }
    }
    if constexpr (kActivated) {
      store_activated<kBlockN>(out, column0, store, activated);
    } else if constexpr (kWideStores) {
      if (wide) store_words<kBlockN>(out, column0, store, words);
    }
  }
}

// One thread's share of a tile's global -> shared copies, for both GEMM kernels: 16-byte chunk `chunk` of
// rows load_row + kRowsPerLoadPass·j of the A tile (gathered x rows: pair / row_div; sentinel pairs
// zero-filled) and of the B tile (weight rows of the tile's expert; halves-layout columns mapped 2i -> i,
// 2i+1 -> I + i; columns past n zero-filled). load() issues one k-tile into a stage's swizzled rows.
template <int kBlockM, int kBlockN, int kThreads, bool kEvenK>
struct TileLoader {
  static constexpr int kRowsPerLoadPass = kThreads / kChunksPerRow;  // rows one pass of the block's copies covers
  static constexpr int kLoadsA = kBlockM / kRowsPerLoadPass, kLoadsB = kBlockN / kRowsPerLoadPass;
  static_assert(kBlockM % kRowsPerLoadPass == 0 && kBlockN % kRowsPerLoadPass == 0);
  const GemmKernelParams& p;
  int chunk, load_row;
  const __nv_bfloat16* a_src[kLoadsA];
  const __nv_bfloat16* b_src[kLoadsB];
  bool a_valid[kLoadsA], b_valid[kLoadsB];

  __device__ TileLoader(const GemmKernelParams& params, const int* tile_pairs, int expert, int n0)
      : p(params), chunk(threadIdx.x % kChunksPerRow), load_row(threadIdx.x / kChunksPerRow) {
#pragma unroll
    for (int j = 0; j < kLoadsA; ++j) {
      const int pair = tile_pairs[load_row + kRowsPerLoadPass * j];
      a_valid[j] = pair < p.pairs;
      a_src[j] = a_valid[j] ? p.x + int64_t(pair / p.row_div) * p.in + chunk * 8 : p.x;
    }
    const int64_t inter = p.n / 2;
#pragma unroll
    for (int j = 0; j < kLoadsB; ++j) {
      const int column = n0 + load_row + kRowsPerLoadPass * j;
      b_valid[j] = column < p.n;
      const int64_t weight_row = p.halves ? (column % 2 == 0 ? column / 2 : inter + column / 2) : column;
      b_src[j] = b_valid[j] ? p.weight + (int64_t(expert) * p.n + weight_row) * p.in + chunk * 8 : p.weight;
    }
  }

  // The k-tile at k0 into a_dst [kBlockM][kBlockK] and b_dst [kBlockN][kBlockK] (swizzled), one cp.async each.
  __device__ __forceinline__ void load(__nv_bfloat16* a_dst, __nv_bfloat16* b_dst, int k0) const {
    load_a(a_dst, k0);
    load_b(b_dst, k0);
  }
  __device__ __forceinline__ void load_a(__nv_bfloat16* a_dst, int k0) const {
    const bool k_ok = kEvenK || k0 + chunk * 8 < p.in;
#pragma unroll
    for (int j = 0; j < kLoadsA; ++j) {
      const bool ok = a_valid[j] && k_ok;
      cp_async16(a_dst + swizzled(load_row + kRowsPerLoadPass * j, chunk), ok ? a_src[j] + k0 : p.x, ok);
    }
  }
  __device__ __forceinline__ void load_b(__nv_bfloat16* b_dst, int k0) const {
    const bool k_ok = kEvenK || k0 + chunk * 8 < p.in;
#pragma unroll
    for (int j = 0; j < kLoadsB; ++j) {
      const bool ok = b_valid[j] && k_ok;
      cp_async16(b_dst + swizzled(load_row + kRowsPerLoadPass * j, chunk), ok ? b_src[j] + k0 : p.weight, ok);
    }
  }
};

// Which bits of a packed bf16 pair (ranks k, k + 1) are real ranks of a slot of rank `rank`: both, the low
// one (k + 1 == rank), or none. Padding ranks of a LoRA stack may hold anything (NaN included).
__device__ __forceinline__ unsigned rank_pair_mask(int k, int rank) {
  return k + 1 < rank ? 0xffffffffu : (k < rank ? 0x0000ffffu : 0u);
}

// The lane's two B words of one n-tile and rank step of add_lora_terms: ranks k0 + 2t, + 1 (w0) and k0 + 2t + 8,
// + 9 (w1) of output column `column` (logical; the halves layout maps it to its weight row) of the slot's
// [n, R] slice `b`. Addresses stay in bounds (ranks clamped to R - 2, columns to n - 1); what they fetch past
// the slot's rank or past n is masked to zero by the caller.
__device__ __forceinline__ void load_lora_b_words(const GemmKernelParams& p, const __nv_bfloat16* b, int column, int k0,
                                                  int t, unsigned& w0, unsigned& w1) {
  column = min(column, p.n - 1);
  const int weight_row = p.halves ? (column % 2 == 0 ? column / 2 : p.n / 2 + column / 2) : column;
  const auto* row = reinterpret_cast<const unsigned*>(b + int64_t(weight_row) * p.lora_r);
  w0 = __ldg(row + min(k0 + 2 * t, p.lora_r - 2) / 2);
  w1 = __ldg(row + min(k0 + 2 * t + 8, p.lora_r - 2) / 2);
}

// What add_lora_terms reads before z: the slots of the lane's two rows and whether each still needs a pass
// (slot >= 0 of nonzero rank). Reading the first pass's B words before the decode GEMM's k-loop as well
// measured level (perf-log run 115) and was removed. PRECOND: warp converged.
struct LoraRows {
  int slot[2];
  bool pending[2];

  __device__ __forceinline__ LoraRows(const GemmKernelParams& p, const int (&pair)[2]) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      slot[half] = pair[half] < p.pairs ? __ldg(p.lora_slot + pair[half] / p.lora_top_k) : -1;
      pending[half] = slot[half] >= 0 && __ldg(p.lora_rank + slot[half]) > 0;
    }
  }
};

// The persistent kernel's MoE-LoRA inputs of one work item pulled into L1 while its k-loop runs: add_lora_terms
// after the loop reads them with a chain of dependent L2 round trips (the rows' slots and ranks, then per rank
// step z and two batches of B words, ~0.5 µs each), which its ~28 µs per GEMM at T 1600 are made of (perf-log
// run 61). start() (before the k-loop) loads the lane's two pairs' slots; issue() (a few k-tiles in, when
// those have landed) prefetches the rows' z lines and the B slice [BLOCK_N, R] of the warp's smallest pending
// slot — the slot of its first pass — into L1 (12 KB at BLOCK_N 192, R 32; the warps of a tile mostly share
// it). Hints only: no result changes. Ranks are not read here (a rank-0 slot's slice is fetched for nothing).
struct LoraL1Prefetch {
  int pair[2], slot[2];
  int expert;

  __device__ __forceinline__ void start(const GemmKernelParams& p, int2 work, int tile_row0, int lane) {
    expert = p.tile_group[work.x];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      pair[half] = p.sorted_pairs[tile_row0 + lane / 4 + 8 * half];
      slot[half] = pair[half] < p.pairs ? __ldg(p.lora_slot + pair[half] / p.lora_top_k) : -1;
    }
  }
  template <int kBlockN>
  __device__ __forceinline__ void issue(const GemmKernelParams& p, int first_column, int lane) const {
    int mine = INT_MAX;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      if (slot[half] >= 0) {
        mine = min(mine, slot[half]);
        asm volatile("prefetch.global.L1 [%0];" ::"l"(p.lora_z + int64_t(pair[half]) * p.lora_r));
      }
    }
    const int s = __reduce_min_sync(0xffffffffu, mine);
    if (s == INT_MAX) return;  // warp-uniform
    // The item's B rows: its columns' own, or with the halves layout half as many gate rows and as many up rows
    const int64_t expert_row = int64_t(s) * p.weight_rows + int64_t(expert) * p.n;
    const int columns = min(p.n - first_column, kBlockN);
    if (p.halves) {
      prefetch_rows(p, expert_row + first_column / 2, (columns + 1) / 2, lane);
      prefetch_rows(p, expert_row + p.n / 2 + first_column / 2, columns / 2, lane);
    } else {
      prefetch_rows(p, expert_row + first_column, columns, lane);
    }
  }
  // B's rows [row, row + rows) of the stack (R bf16 each, contiguous) into L1, 128 bytes a lane at a time.
  __device__ __forceinline__ static void prefetch_rows(const GemmKernelParams& p, int64_t row, int rows, int lane) {
    const auto* slice = reinterpret_cast<const char*>(p.lora_b + row * p.lora_r);
    const int64_t bytes = int64_t(rows) * p.lora_r * int64_t(sizeof(__nv_bfloat16));
    for (int64_t offset = int64_t(lane) * 128; offset < bytes; offset += 32 * 128) {
      asm volatile("prefetch.global.L1 [%0];" ::"l"(slice + offset));
    }
  }
};

// kLora (MoeGemmLora): the MoE-LoRA of one work item added into its fp32 accumulators before the epilogue,
// acc[row] += z[pair]·B[slot, expert][columns]ᵀ for every row whose token has a slot of nonzero rank, by
// mma.sync m16n8k16 on the warp's 16 rows: the wgmma accumulator layout is mma's C fragment layout
// (acc[4j .. 4j + 3]: rows lane / 4 and + 8, columns first_column + 8j + 2(lane % 4) and + 1), and so is
// a 16-row warp tile of grouped_gemm_kernel (BLOCK_M 16: acc[0][j][0..3] is acc[4j .. 4j + 3]). With the
// halves layout (decode only) logical column 2i reads B row i and 2i + 1 row n/2 + i, as the weight. No pass over
// h, no expand kernel: per slot of the warp's rows, R/16 steps of 2 · BLOCK_N / 8 small MMAs, B's fragments
// read as 4-byte words from L2 (a tile's slice is BLOCK_N · R · 2 bytes). z goes in as bf16 hi + lo (16 significant bits), B as it is. Rows of several
// slots: one pass per distinct slot, smallest first, z masked to that slot's rows, so the other rows get
// exact zeros added (a warp whose rows have no slot adds nothing: a base token's result is bit-identical to
// the GEMM without LoRA unless its accumulator is exactly -0 and shares a warp with an adapter's rows, where
// it becomes +0).
// kBatch: n-tiles whose B words are loaded before their MMAs (registers: 2 per n-tile).
template <int kBlockN, int kBatch>
__device__ __forceinline__ void add_lora_terms(const GemmKernelParams& p, int expert, int first_column,
                                               const int (&pair)[2], int lane, float (&acc)[kBlockN / 2],
                                               LoraRows rows) {
  const int g = lane / 4, t = lane % 4;
  while (true) {
    int mine = INT_MAX;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      if (rows.pending[half]) mine = min(mine, rows.slot[half]);
    }
    const int s = __reduce_min_sync(0xffffffffu, mine);  // warp-uniform from here to the loop's end
    if (s == INT_MAX) return;
    bool use[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      use[half] = rows.pending[half] && rows.slot[half] == s;
      rows.pending[half] = rows.pending[half] && !use[half];
    }
    const int rank = __ldg(p.lora_rank + s);
    const float* z_row[2] = {p.lora_z + int64_t(use[0] ? pair[0] : 0) * p.lora_r,
                             p.lora_z + int64_t(use[1] ? pair[1] : 0) * p.lora_r};
    const __nv_bfloat16* b = p.lora_b + (int64_t(s) * p.weight_rows + int64_t(expert) * p.n) * p.lora_r;
    for (int k0 = 0; k0 < rank; k0 += 16) {
      // Every load of the k-step is issued before the first MMA that needs one (16 n-tiles of B words at a
      // time): issued between the MMAs, each L2 round trip was paid in sequence (perf-log run 60: ~11 µs
      // per pass of a 128-column item).
      // A registers: (row g, ranks k0 + 2t, + 1), (row g + 8, same), (row g, + 8), (row g + 8, + 8).
      // z by __ldca (a plain coherent load, cached in L1): with wait_before_epilogue (decode) the shrink
      // writes z while this grid runs, which the read-only path's contract (__ldg: no writes during the
      // kernel) excludes; every read of z follows the programmatic wait, which makes the shrink's atomics
      // visible. __ldcg (L2 only) cost ~0.8 ms a decode step (perf-log run 76): z is re-read every pass.
      float2 z[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int k = k0 + 2 * t + 8 * (q / 2);
        z[q] = __ldca(reinterpret_cast<const float2*>(z_row[q % 2] + min(k, p.lora_r - 2)));
      }
      // B registers of n-tile j: ranks k0 + 2t, + 1 and k0 + 2t + 8, + 9 of output column first_column + 8j + g.
      const int k_lo = k0 + 2 * t, k_hi = k_lo + 8;
      const unsigned mask_lo = rank_pair_mask(k_lo, rank), mask_hi = rank_pair_mask(k_hi, rank);
      unsigned hi[4], lo[4];
#pragma unroll
      for (int j0 = 0; j0 < kBlockN / 8; j0 += kBatch) {
        unsigned b0[kBatch], b1[kBatch];
#pragma unroll
        for (int jj = 0; jj < kBatch; ++jj) {
          load_lora_b_words(p, b, first_column + 8 * (j0 + jj) + g, k0, t, b0[jj], b1[jj]);
        }
        if (j0 == 0) {
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const int half = q % 2, k = k0 + 2 * t + 8 * (q / 2);
            detail::split_bf16(use[half] && k < rank ? z[q] : make_float2(0.0f, 0.0f), hi[q], lo[q]);
          }
        }
#pragma unroll
        for (int jj = 0; jj < kBatch; ++jj) {
          const int j = j0 + jj;
          const bool in_range = first_column + 8 * j + g < p.n;
          const unsigned w0 = in_range ? b0[jj] & mask_lo : 0u, w1 = in_range ? b1[jj] & mask_hi : 0u;
          mma_bf16(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3], hi, w0, w1);
          mma_bf16(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3], lo, w0, w1);
        }
      }
    }
  }
}

// The mma.sync kernels' epilogue of one warp's kMi × 16 rows (from tile row warp_m0) and kNi × 8 columns
// (from first_column): the MoE-LoRA in the accumulators where the kernel is given z (MoeGemmLora;
// host-checked: BLOCK_M 16, so kMi == 1), then bias, activation and stores (store_columns). The LoRA's z is
// the output of the kernel just before, so callers with wait_before_epilogue wait before this.
// Accumulator element (c0, c1) is row lane/4, columns 2·(lane%4) + {0, 1}; (c2, c3) row + 8.
template <int kMi, int kNi, int kWarpN>
__device__ __forceinline__ void mma_tile_epilogue(const GemmKernelParams& p, int expert, int first_column, int warp_m0,
                                                  const int* tile_pairs, int lane, float (&acc)[kMi][kNi][4]) {
  if constexpr (kMi == 1) {
    if (p.lora_z != nullptr) {
      const int pair[2] = {tile_pairs[warp_m0 + lane / 4], tile_pairs[warp_m0 + lane / 4 + 8]};
      add_lora_terms<kWarpN, kNi>(p, expert, first_column, pair, lane, reinterpret_cast<float(&)[kWarpN / 2]>(acc[0]),
                                  LoraRows(p, pair));
    }
  }
#pragma unroll
  for (int mi = 0; mi < kMi; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int pair = tile_pairs[warp_m0 + mi * 16 + lane / 4 + 8 * half];
      if (pair >= p.pairs) continue;
#pragma unroll
      for (int nj = 0; nj < kNi; ++nj) {
        const int column = first_column + nj * 8 + 2 * (lane % 4);  // even
        store_columns(p, expert, pair, column, acc[mi][nj][2 * half], acc[mi][nj][2 * half + 1], pair);
      }
    }
  }
}

// ---- mbarriers and TMA (the decode kernel's weight by TMA, the warp-specialized and persistent kernels) ----

using detail::bulk_copy;
using detail::mbarrier_arrive;
using detail::mbarrier_arrive_expect_tx;
using detail::mbarrier_init;
using detail::mbarrier_wait;
using detail::shared_address;
// The box at (column `inner`, row `outer`) of a 2-D tensor map into shared memory; its bytes count down the
// barrier's expected transaction count when they land.
__device__ __forceinline__ void tma_load_2d(void* shared, const CUtensorMap* map, int inner, int outer, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::
          "r"(shared_address(shared)), "l"(reinterpret_cast<uint64_t>(map)), "r"(inner), "r"(outer),
      "r"(shared_address(bar))
      : "memory");
}
// The box at coordinates (c0, c1, c2, c3), innermost first, of a 4-D tensor map (tensor_map_halves).
__device__ __forceinline__ void tma_load_4d(void* shared, const CUtensorMap* map, int c0, int c1, int c2, int c3,
                                            uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::
          "r"(shared_address(shared)), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
      "r"(shared_address(bar))
      : "memory");
}
// The start of the mma.sync tile kernels (grouped_gemm_kernel, grouped_gemm_mxfp4_kernel): the PDL wait mode
// the launch asked for and the wait where that mode puts it first; then the CTA's tile (blockIdx.x): its pairs
// into tile_pairs (visible to the whole CTA) and its expert — or -1 past the tile count, where the CTA has
// waited as the chain rule wants (every CTA waits before it exits) and returns, all its threads alike.
struct DecodeTileStart {
  bool late_wait, weights_first;
  int expert;
};
template <int kBlockM>
__device__ __forceinline__ DecodeTileStart decode_tile_start(const GemmKernelParams& p, int (&tile_pairs)[kBlockM]) {
  const bool late_wait = p.pdl && p.wait_before_epilogue;
  const bool weights_first = p.pdl && p.routing_before_wait && !late_wait;
  if (p.pdl && !weights_first && !late_wait) wait_then_allow_dependents();
  // early_trigger: the dependent may become resident as this grid's last CTAs start instead of as they reach
  // their epilogue; it still finds this grid complete at its own wait (every CTA here waits before it exits).
  if (late_wait && p.early_trigger) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int tile = blockIdx.x;
  if (tile >= *p.num_tiles) {
    if (weights_first || late_wait) wait_then_allow_dependents();
    return {late_wait, weights_first, -1};
  }
  if (threadIdx.x < kBlockM) tile_pairs[threadIdx.x] = p.sorted_pairs[tile * kBlockM + threadIdx.x];
  __syncthreads();
  return {late_wait, weights_first, p.tile_group[tile]};
}

// PRECOND: blockDim.x == 32·kWarpsM·kWarpsN; dynamic shared memory = kStages·(kBlockM + kBlockN)·kBlockK bf16;
// in % 8 == 0 and x, weight 16-byte aligned; kEvenK only when in % kBlockK == 0; n even when
// fuse_activation; sorted_pairs / tile_group / num_tiles from moe_align with slots = 0, block_m = kBlockM.
// Minimum CTAs per SM in the bounds: 3 of 4 warps (≤ 168 registers: 64×128 would take 174 and fit only 2),
// 2 of 8 warps (≤ 128 registers).
// PDL (p.pdl, decode): every CTA executes griddepcontrol.wait, then launch_dependents — at its start, or with
// routing_before_wait after reading the tiles and issuing the first kStages - 1 weight stages, so a CTA
// that starts in the previous kernel's tail streams weights meanwhile. x is read and out written only
// after the wait. PRECOND with routing_before_wait: the kernel launched directly before does not write
// sorted_pairs / tile_group / num_tiles, and itself waits in every CTA before it triggers (or is a plain launch).
// wait_before_epilogue (moe_block's decode MoE-LoRA): the whole k-loop — tiles, x, weights — runs before the
// wait, so the kernel just before (the LoRA shrink writing z) runs alongside it; only z is read and out written
// after it. PRECOND: the kernel just before writes none of tiles, x, weights, bias and reads nothing of out,
// and waits in every CTA before it triggers (so tiles and x, written two launches back or earlier, are complete).
// kWeightByTma (BLOCK_M 16 only; set_moe_decode_weight_by_tma): each stage's weight tile is one TMA box through
// p.weight_map (tensor_map_2d, or tensor_map_halves for the halves layout; box kBlockN rows × 64, 128-byte
// swizzle = `swizzled`), issued by thread 0 where the cp.async copies would go and awaited on the stage's
// mbarrier; A stays on cp.async. Dynamic shared memory + 1024 (the stages 1024-byte aligned for the swizzle).
// Same k-loop, same bits.
template <int kBlockM, int kBlockN, int kWarpsM, int kWarpsN, int kStages, bool kEvenK, bool kWeightByTma = false>
__global__ static void __launch_bounds__(32 * kWarpsM * kWarpsN, kWarpsM * kWarpsN == 8 ? 2 : 3)
    grouped_gemm_kernel(const __grid_constant__ GemmKernelParams p) {
  constexpr int kThreads = 32 * kWarpsM * kWarpsN;
  constexpr int kWarpM = kBlockM / kWarpsM;  // rows of one warp's tile
  constexpr int kWarpN = kBlockN / kWarpsN;  // columns of one warp's tile
  constexpr int kMi = kWarpM / 16, kNi = kWarpN / 8;
  constexpr int kStageElems = (kBlockM + kBlockN) * kBlockK;
  static_assert(kBlockM % (16 * kWarpsM) == 0 && kBlockN % (16 * kWarpsN) == 0 && kThreads >= kBlockM);

  __shared__ int tile_pairs[kBlockM];
  const DecodeTileStart start = decode_tile_start(p, tile_pairs);
  if (start.expert < 0) return;
  const bool late_wait = start.late_wait, weights_first = start.weights_first;
  const int expert = start.expert, n0 = blockIdx.y * kBlockN;
  extern __shared__ uint4 dynamic_shared[];
  // [kStages][kBlockM + kBlockN][kBlockK]; with kWeightByTma at the first 1024-byte boundary
  auto* stages = reinterpret_cast<__nv_bfloat16*>(
      kWeightByTma ? (reinterpret_cast<uintptr_t>(dynamic_shared) + 1023) & ~uintptr_t(1023)
                   : reinterpret_cast<uintptr_t>(dynamic_shared));
  static_assert(!kWeightByTma || (kBlockM * kBlockK * 2) % 1024 == 0);  // each B tile 1024-byte aligned too
  __shared__ uint64_t weight_full[kWeightByTma ? kStages : 1];  // the stages' weight boxes landed
  if constexpr (kWeightByTma) {
    if (threadIdx.x == 0) {
      for (int s = 0; s < kStages; ++s) mbarrier_init(&weight_full[s], 1);
    }
    __syncthreads();
  }

  const TileLoader<kBlockM, kBlockN, kThreads, kEvenK> loader(p, tile_pairs, expert, n0);
  // The stage's weight tile: kBlockN rows × 64 k (k past `in` and rows past the map zero-filled; rows of the
  // next expert are columns past n, never stored).
  auto load_b = [&](int stage, int k0) {
    __nv_bfloat16* b_dst = stages + stage * kStageElems + kBlockM * kBlockK;
    if constexpr (kWeightByTma) {
      if (threadIdx.x == 0) {
        mbarrier_arrive_expect_tx(&weight_full[stage], kBlockN * kBlockK * sizeof(__nv_bfloat16));
        if (p.halves) {  // rows i of both halves, interleaved by the map's box: logical columns 2i, 2i + 1
          tma_load_4d(b_dst, &p.weight_map, k0, 0, n0 / 2, expert, &weight_full[stage]);
        } else {
          tma_load_2d(b_dst, &p.weight_map, k0, expert * p.n + n0, &weight_full[stage]);
        }
      }
    } else {
      loader.load_b(b_dst, k0);
    }
  };
  auto load_stage = [&](int stage, int k0) {
    loader.load_a(stages + stage * kStageElems, k0);
    load_b(stage, k0);
  };

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warp_m0 = (warp / kWarpsN) * kWarpM, warp_n0 = (warp % kWarpsN) * kWarpN;
  float acc[kMi][kNi][4] = {};
  const int k_tiles = (p.in + kBlockK - 1) / kBlockK;
  if (weights_first) {
    // The first stages' weight tiles before the wait; they join the first commit group, so waiting for
    // group s still covers stage s (groups after the first are subsets of what they would be).
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < k_tiles) load_b(s, s * kBlockK);
    }
    wait_then_allow_dependents();
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < k_tiles) loader.load_a(stages + s * kStageElems, s * kBlockK);
      cp_async_commit();
    }
  } else {
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < k_tiles) load_stage(s, s * kBlockK);
      cp_async_commit();  // empty groups keep the group count uniform for wait_group
    }
  }
  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<kStages - 2>();  // stage kt has landed (for this thread) ...
    __syncthreads();               // ... for every thread; and stage kt - 1 is no longer being read
    const int next = kt + kStages - 1;
    if (next < k_tiles) load_stage(next % kStages, next * kBlockK);
    cp_async_commit();
    if constexpr (kWeightByTma) mbarrier_wait(&weight_full[kt % kStages], (kt / kStages) & 1);
    const __nv_bfloat16* a_tile = stages + (kt % kStages) * kStageElems;  // [kBlockM][kBlockK] swizzled
    const __nv_bfloat16* b_tile = a_tile + kBlockM * kBlockK;            // [kBlockN][kBlockK] swizzled
#pragma unroll
    for (int kk = 0; kk < kBlockK / 16; ++kk) {
      unsigned a_frag[kMi][4];
#pragma unroll
      for (int mi = 0; mi < kMi; ++mi) {
        // x4 matrices: rows 0-7 / 8-15 at k 0-7, then at k 8-15 (mma's a0..a3)
        const int row = warp_m0 + mi * 16 + lane % 16;
        ldmatrix_x4(a_frag[mi], a_tile + swizzled(row, 2 * kk + lane / 16));
      }
#pragma unroll
      for (int nj = 0; nj < kNi; nj += 2) {
        // x4 matrices: columns 0-7 at k 0-7 / 8-15 (b0, b1 of n-tile nj), columns 8-15 likewise (nj + 1)
        unsigned b_frag[4];
        const int column = warp_n0 + nj * 8 + lane % 8 + (lane / 16) * 8;
        ldmatrix_x4(b_frag, b_tile + swizzled(column, 2 * kk + (lane / 8) % 2));
#pragma unroll
        for (int mi = 0; mi < kMi; ++mi) {
          mma_bf16(acc[mi][nj], a_frag[mi], b_frag[0], b_frag[1]);
          mma_bf16(acc[mi][nj + 1], a_frag[mi], b_frag[2], b_frag[3]);
        }
      }
    }
  }

  // late_wait: everything above read only what was complete two launches back; z (below) is the output
  // of the kernel just before, and `out` is written only after the wait.
  if (late_wait) wait_then_allow_dependents();
  mma_tile_epilogue<kMi, kNi, kWarpN>(p, expert, n0 + warp_n0, warp_m0, tile_pairs, lane, acc);
}

// The decode GEMM on MXFP4 experts (MoeMxfp4Weight; host-checked: BLOCK_M 16, in % 64 == 0, n % 8 == 0, not
// the halves layout). grouped_gemm_kernel's tiles, A ring, PDL modes and epilogue; the B ring holds each
// k-tile's weight in the decode layout of ops/mxfp4.h — kBlockN rows × 32 bytes of codes plus 2 exponent
// bytes, one contiguous span of the [E, in/64, n, ...] tensors per stage, 3.8× fewer bytes than bf16 — and
// each lane turns its column's 8 bytes into the mma B registers of the whole k-tile: per register a shift,
// two masks and one bf16x2 multiply by 2^(exponent - 1) (exact: see ops/mxfp4.h), no shared-memory pass.
// PRECOND: blockDim.x == 128; dynamic shared memory = kStages · kMxfp4StageBytes<kBlockN>.
template <int kBlockN>
constexpr int kMxfp4StageBytes = 16 * kBlockK * 2 + kBlockN * ops::mxfp4::kTileBytes + kBlockN * 2;

__device__ __forceinline__ uint32_t mul_bf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// kWeightByBulk (set_moe_mxfp4_weight_by_bulk): each stage's codes and exponents come by two bulk copies
// (cp.async.bulk, the span's rows up to n), issued by thread 0 and awaited on the stage's mbarrier, instead of
// every thread's 16-byte cp.async; rows past n keep stale bytes (their columns are never stored).
template <int kBlockN, int kStages, int kMinBlocks, bool kWeightByBulk = false>
__global__ static void __launch_bounds__(128, kMinBlocks) grouped_gemm_mxfp4_kernel(const __grid_constant__ GemmKernelParams p) {
  constexpr int kBlockM = 16, kThreads = 128, kWarpN = kBlockN / 4, kNi = kWarpN / 8;
  constexpr int kStageBytes = kMxfp4StageBytes<kBlockN>;
  constexpr int kRawBytes = kBlockN * ops::mxfp4::kTileBytes, kRawChunks = kRawBytes / 16;
  constexpr int kScaleChunks = kBlockN * 2 / 16;
  static_assert(kRawChunks % kThreads == 0 && kScaleChunks <= kThreads && kBlockN % 32 == 0);

  extern __shared__ uint4 dynamic_shared[];
  auto* stages = reinterpret_cast<char*>(dynamic_shared);  // [kStages][A 16×64 bf16 | codes | exponents]
  __shared__ int tile_pairs[kBlockM];
  const DecodeTileStart start = decode_tile_start(p, tile_pairs);
  if (start.expert < 0) return;
  const int expert = start.expert, n0 = blockIdx.y * kBlockN;
  __shared__ uint64_t weight_full[kWeightByBulk ? kStages : 1];  // the stages' bulk copies landed
  if constexpr (kWeightByBulk) {
    if (threadIdx.x == 0) {
      for (int s = 0; s < kStages; ++s) mbarrier_init(&weight_full[s], 1);
    }
    __syncthreads();
  }

  // The copies. Every source is loop-carried: it starts at k-tile 0 and each issued stage adds a fixed span,
  // so the k-loop spends no instructions on address arithmetic (perf-log run 132: it had ~80 a k-tile, a
  // quarter of the loop). Zero-filled copies (sentinel rows, rows past n) read nothing; their pointers stay on
  // bytes of the tile's first row, which exist at every k-tile.
  // A: thread i copies chunk i % 8 of row i / 8; in % 64 == 0, so every k is valid.
  const int a_row = threadIdx.x / kChunksPerRow, a_chunk = threadIdx.x % kChunksPerRow;
  const int a_pair = tile_pairs[a_row];
  const bool a_valid = a_pair < p.pairs;
  // A sentinel row's pointer walks x's first row (in = k_tiles · kBlockK values: never past it), so the step
  // is the same constant for every thread.
  const __nv_bfloat16* a_next = a_valid ? p.x + int64_t(a_pair / p.row_div) * p.in + a_chunk * 8 : p.x;
  const int k_tiles = p.in / kBlockK;
  // B: the (expert, k-tile) span starts at ((expert · k_tiles + kt) · n + n0) rows, one k-tile n rows after the
  // last. Codes: two 16-byte chunks a row; exponents: one 16-byte chunk per 8 rows (n % 8 == 0).
  constexpr int kRawLoads = kRawChunks / kThreads;
  const int rows_left = p.n - n0;
  const int64_t first_row = int64_t(expert) * k_tiles * p.n + n0;
  const int64_t code_span = int64_t(p.n) * ops::mxfp4::kTileBytes, scale_span = int64_t(p.n) * 2;
  const uint8_t* code_next[kRawLoads];
  bool code_ok[kRawLoads];
#pragma unroll
  for (int j = 0; j < kRawLoads; ++j) {
    const int chunk = threadIdx.x + kThreads * j;  // two per row
    code_ok[j] = chunk / 2 < rows_left;
    code_next[j] = p.fp4_blocks + first_row * ops::mxfp4::kTileBytes + (code_ok[j] ? chunk : chunk % 2) * 16;
  }
  const bool scale_loader = threadIdx.x < kScaleChunks;
  const bool scale_ok = scale_loader && int(threadIdx.x) * 8 < rows_left;
  const uint8_t* scale_next = p.fp4_scales + first_row * 2 + (scale_ok ? threadIdx.x * 16 : 0);
  // Shared destinations as 32-bit shared addresses: stage s of a copy is its stage-0 address + s · kStageBytes.
  const uint32_t stage0 = static_cast<uint32_t>(__cvta_generic_to_shared(stages));
  const uint32_t a_dst = stage0 + 2 * swizzled(a_row, a_chunk);
  const uint32_t code_dst = stage0 + kBlockM * kBlockK * 2 + threadIdx.x * 16;
  const uint32_t scale_dst = stage0 + kBlockM * kBlockK * 2 + kRawBytes + threadIdx.x * 16;
  // Every shared address below is a per-thread register plus a compile-time stage offset (the k-loop is
  // unrolled by kStages, so k-tile kt always sits in stage kt % kStages = the unrolled index): the loads and
  // copies take the offset as an immediate and the loop spends no instructions on stage arithmetic.
  auto copy16 = [](uint32_t shared, auto offset, const void* global, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0+%1], [%2], 16, %3;\n" ::"r"(shared), "n"(decltype(offset)::value),
                 "l"(global), "r"(valid ? 16 : 0));
  };
  // The exponent copy of the kScaleChunks loader threads, predicated (no divergent branch in the loop).
  auto copy16_if = [](uint32_t shared, auto offset, const void* global, bool valid, bool loader) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %4, 0;\n@p cp.async.cg.shared.global [%0+%1], [%2], 16, %3;\n}\n" ::"r"(shared),
        "n"(decltype(offset)::value), "l"(global), "r"(valid ? 16 : 0), "r"(int(loader)));
  };
  auto load_a = [&](auto offset) {
    copy16(a_dst, offset, a_next, a_valid);
    a_next += kBlockK;
  };
  // kWeightByBulk: thread 0's two spans a stage (rows up to n: a multiple of 8, so both sizes are of 16 bytes)
  const int bulk_rows = min(kBlockN, rows_left);
  const unsigned code_bytes = unsigned(bulk_rows) * ops::mxfp4::kTileBytes, scale_bytes = unsigned(bulk_rows) * 2;
  const uint8_t* code_span_next = p.fp4_blocks + first_row * ops::mxfp4::kTileBytes;
  const uint8_t* scale_span_next = p.fp4_scales + first_row * 2;
  auto load_b = [&](auto offset) {
    if constexpr (kWeightByBulk) {
      if (threadIdx.x == 0) {
        uint64_t* full = &weight_full[decltype(offset)::value / kStageBytes];
        const uint32_t code_stage = stage0 + kBlockM * kBlockK * 2 + decltype(offset)::value;
        mbarrier_arrive_expect_tx(full, code_bytes + scale_bytes);
        bulk_copy(code_stage, code_span_next, code_bytes, full);
        bulk_copy(code_stage + kRawBytes, scale_span_next, scale_bytes, full);
      }
      code_span_next += code_span;
      scale_span_next += scale_span;
    } else {
#pragma unroll
      for (int j = 0; j < kRawLoads; ++j) {
        copy16(code_dst + kThreads * 16 * j, offset, code_next[j], code_ok[j]);
        code_next[j] += code_span;
      }
      copy16_if(scale_dst, offset, scale_next, scale_ok, scale_loader);
      scale_next += scale_span;
    }
  };
  // Stage s's byte offset, as a type (an "n" operand of the copies).
  auto stage_offset = [](auto s) { return std::integral_constant<int, decltype(s)::value * kStageBytes>{}; };

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warp_n0 = warp * kWarpN, g = lane / 4, t = lane % 4;
  // Per-thread shared addresses in stage 0: the A fragments of each k step, each n-tile's code words and
  // exponent pair.
  uint32_t a_ld[kBlockK / 16], code_ld[kNi], exponent_ld[kNi];
#pragma unroll
  for (int kk = 0; kk < kBlockK / 16; ++kk) a_ld[kk] = stage0 + 2 * swizzled(lane % 16, 2 * kk + lane / 16);
#pragma unroll
  for (int j = 0; j < kNi; ++j) {
    const int column = warp_n0 + 8 * j + g;
    code_ld[j] = stage0 + kBlockM * kBlockK * 2 + column * ops::mxfp4::kTileBytes + 8 * t;
    exponent_ld[j] = stage0 + kBlockM * kBlockK * 2 + kRawBytes + column * 2;
  }
  float acc[1][kNi][4] = {};
  if (start.weights_first) {
    [&]<int... S>(std::integer_sequence<int, S...>) {
      ((S < k_tiles ? load_b(stage_offset(std::integral_constant<int, S>{})) : void()), ...);
    }(std::make_integer_sequence<int, kStages - 1>{});
    wait_then_allow_dependents();
    [&]<int... S>(std::integer_sequence<int, S...>) {
      ((S < k_tiles ? load_a(stage_offset(std::integral_constant<int, S>{})) : void(), cp_async_commit()), ...);
    }(std::make_integer_sequence<int, kStages - 1>{});
  } else {
    [&]<int... S>(std::integer_sequence<int, S...>) {
      (((S < k_tiles ? (load_a(stage_offset(std::integral_constant<int, S>{})),
                        load_b(stage_offset(std::integral_constant<int, S>{})))
                     : void()),
        cp_async_commit()),
       ...);
    }(std::make_integer_sequence<int, kStages - 1>{});
  }
  // One k-tile in stage S (kt % kStages == S): wait for it, refill the stage read one k-tile ago, then decode
  // each lane's B registers of the whole k-tile (per n-tile, register m is k step m / 2, b0 / b1 by m % 2)
  // and run the MMAs. Returns false past the last k-tile (the unrolled group's remaining stages are skipped).
  auto k_tile = [&](int kt, auto stage) {
    constexpr int kS = decltype(stage)::value;
    constexpr int kOffset = kS * kStageBytes;
    if (kt >= k_tiles) return false;
    cp_async_wait<kStages - 2>();
    __syncthreads();
    if (kt + kStages - 1 < k_tiles) {
      constexpr auto refill = stage_offset(std::integral_constant<int, (kS + kStages - 1) % kStages>{});
      load_a(refill);
      load_b(refill);
    }
    cp_async_commit();
    if constexpr (kWeightByBulk) mbarrier_wait(&weight_full[kS], (kt / kStages) & 1);
    uint32_t b[kNi][8];
#pragma unroll
    for (int j = 0; j < kNi; ++j) {
      uint32_t word_x, word_y, pair;
      asm volatile("ld.shared.v2.u32 {%0, %1}, [%2+%3];\n" : "=r"(word_x), "=r"(word_y) : "r"(code_ld[j]), "n"(kOffset));
      asm volatile("ld.shared.u16 %0, [%1+%2];\n" : "=r"(pair) : "r"(exponent_ld[j]), "n"(kOffset));
      const uint32_t first = ops::mxfp4::scale_multiplier(pair & 0xffu);
      const uint32_t second = ops::mxfp4::scale_multiplier(pair >> 8);
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        b[j][r] = mul_bf16x2(ops::mxfp4::decode_register(word_x, r), first);
        b[j][4 + r] = mul_bf16x2(ops::mxfp4::decode_register(word_y, r), second);
      }
    }
#pragma unroll
    for (int kk = 0; kk < kBlockK / 16; ++kk) {
      unsigned a_frag[4];
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4+%5];\n"
                   : "=r"(a_frag[0]), "=r"(a_frag[1]), "=r"(a_frag[2]), "=r"(a_frag[3])
                   : "r"(a_ld[kk]), "n"(kOffset));
#pragma unroll
      for (int j = 0; j < kNi; ++j) mma_bf16(acc[0][j], a_frag, b[j][2 * kk], b[j][2 * kk + 1]);
    }
    return true;
  };
  for (int kt0 = 0; kt0 < k_tiles; kt0 += kStages) {
    [&]<int... S>(std::integer_sequence<int, S...>) {
      (k_tile(kt0 + S, std::integral_constant<int, S>{}) && ...);
    }(std::make_integer_sequence<int, kStages>{});
  }

  if (start.late_wait) wait_then_allow_dependents();
  mma_tile_epilogue<1, kNi, kWarpN>(p, expert, n0 + warp_n0, 0, tile_pairs, lane, acc);
}


// ---- Hopper path (sm_90a): warpgroup MMA ----
// The same tiles, gathered rows, cp.async ring and 128-byte XOR swizzle as grouped_gemm_kernel: a shared row
// of 64 bf16 is 128 bytes and chunk c of row r sits at chunk c ^ (r % 8), which is exactly wgmma's
// K-major SWIZZLE_128B layout (8-row atoms of 1024 bytes), so only the inner product changes: each warpgroup
// (4 warps) issues m64n128k16 wgmmas on its 64 rows of the A tile and the whole 128-column B tile, both
// read from shared memory through matrix descriptors, accumulating 64 fp32 per thread in registers.

// d[128] += A(64×16)·B(256×16)ᵀ: the same with a 256-column B tile (twice the FLOPs per byte of A and B read
// from L2 per CTA as n128 at BLOCK_M 128).
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t a, uint64_t b) {
  const int scale_d = 1;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(a), "l"(b), "r"(scale_d));
#else
  __trap();  // built for sm_90a only (CMake CUDA_ARCHITECTURES 90a); never reached on another target
#endif
}

// d[96] += A(64×16)·B(192×16)ᵀ: a 192-column B tile. 2880 and 5760 (GPT-OSS-20B's down and gate_up widths)
// are whole multiples of 192, where 256 leaves a quarter-full last block on down; 1.2× the FLOPs per byte
// staged of n128 at BLOCK_M 128.
__device__ __forceinline__ void wgmma_m64n192k16(float (&d)[96], uint64_t a, uint64_t b) {
  const int scale_d = 1;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %98, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, %96, %97, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
      : "l"(a), "l"(b), "r"(scale_d));
#else
  __trap();  // built for sm_90a only (CMake CUDA_ARCHITECTURES 90a); never reached on another target
#endif
}

// d[120] += A(64×16)·B(240×16)ᵀ: a 240-column B tile, for down at 128-row tiles where 240 divides the width
// (GPT-OSS-20B's 2880 = 12 × 240) and its fewer column blocks fill the persistent grid's last round better than
// 192's (down_block_n_for); 1.06× the FLOPs per staged byte of n192.
__device__ __forceinline__ void wgmma_m64n240k16(float (&d)[120], uint64_t a, uint64_t b) {
  const int scale_d = 1;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %122, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n240k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119}, %120, %121, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119])
      : "l"(a), "l"(b), "r"(scale_d));
#else
  __trap();  // built for sm_90a only (CMake CUDA_ARCHITECTURES 90a); never reached on another target
#endif
}

// d[64] += A(64×16, descriptor)·B(128×16, descriptor)ᵀ, bf16 in, fp32 accumulate (scale-d = 1).
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t a, uint64_t b) {
  const int scale_d = 1;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(a), "l"(b), "r"(scale_d));
#else
  __trap();  // built for sm_90a only (CMake CUDA_ARCHITECTURES 90a); never reached on another target
#endif
}

// d[128] += A(64×16, registers: bf16 pairs in mma.sync's A fragment layout)·B(256×16, descriptor, K-major)ᵀ,
// bf16 in, fp32 accumulate: the MoE-LoRA term z·Bᵀ of the persistent kernel's lora_wgmma pass.
__device__ __forceinline__ void wgmma_m64n256k16_rs(float (&d)[128], const unsigned (&a)[4], uint64_t b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, p, 1, 1, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
#else
  __trap();  // built for sm_90a only (CMake CUDA_ARCHITECTURES 90a); never reached on another target
#endif
}

// d[96] += A(64×16, registers: bf16 pairs in mma.sync's A fragment layout)·B(192×16, descriptor, K-major)ᵀ,
// bf16 in, fp32 accumulate: the MoE-LoRA term z·Bᵀ of the persistent kernel's lora_wgmma pass.
__device__ __forceinline__ void wgmma_m64n192k16_rs(float (&d)[96], const unsigned (&a)[4], uint64_t b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, {%96, %97, %98, %99}, %100, p, 1, 1, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
#else
  __trap();  // built for sm_90a only (CMake CUDA_ARCHITECTURES 90a); never reached on another target
#endif
}

// d[64] += A(64×16, registers: bf16 pairs in mma.sync's A fragment layout)·B(128×16, descriptor, K-major)ᵀ,
// bf16 in, fp32 accumulate: the MoE-LoRA term z·Bᵀ of the persistent kernel's lora_wgmma pass.
__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[64], const unsigned (&a)[4], uint64_t b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
#else
  __trap();  // built for sm_90a only (CMake CUDA_ARCHITECTURES 90a); never reached on another target
#endif
}

template <int kBlockN>
__device__ __forceinline__ void wgmma_tile_rs(float (&d)[kBlockN / 2], const unsigned (&a)[4], uint64_t b) {
  static_assert(kBlockN == 128 || kBlockN == 192 || kBlockN == 256, "register-A forms: n128, n192, n256");
  if constexpr (kBlockN == 256) wgmma_m64n256k16_rs(d, a, b);
  else if constexpr (kBlockN == 192) wgmma_m64n192k16_rs(d, a, b);
  else wgmma_m64n128k16_rs(d, a, b);
}

template <int kBlockN>
__device__ __forceinline__ void wgmma_tile(float (&d)[kBlockN / 2], uint64_t a, uint64_t b) {
  static_assert(kBlockN == 128 || kBlockN == 192 || kBlockN == 240 || kBlockN == 256);
  if constexpr (kBlockN == 256) wgmma_m64n256k16(d, a, b);
  else if constexpr (kBlockN == 240) wgmma_m64n240k16(d, a, b);
  else if constexpr (kBlockN == 192) wgmma_m64n192k16(d, a, b);
  else wgmma_m64n128k16(d, a, b);
}
// One k-tile of a warpgroup (every wgmma kernel): acc += A(64 × 64 at a_tile)·B(kBlockN ×
// 64 at b_tile)ᵀ from 128B-swizzled shared tiles, issued as one committed wgmma group.
template <int kBlockN>
__device__ __forceinline__ void wgmma_k_tile(float (&acc)[kBlockN / 2], const __nv_bfloat16* a_tile,
                                             const __nv_bfloat16* b_tile) {
  fence_operands(acc);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kBlockK / 16; ++kk) {
    wgmma_tile<kBlockN>(acc, sw128_descriptor(a_tile + kk * 16), sw128_descriptor(b_tile + kk * 16));
  }
  wgmma_commit();
}

// BLOCK_M = 64·kWarpgroups rows × kBlockN (128 or 256) columns; 128·kWarpgroups threads, all of which issue the
// cp.async copies (no producer warp: the gathered A rows need per-row addresses anyway). kStages shared
// stages of (BLOCK_M + kBlockN) × 64 bf16; tiles ahead = kStages - 2, so the stage being refilled was read by
// the wgmmas two k-tiles back, which wgmma_wait<1> (one group in flight) plus the barrier have retired.
// PRECOND: as grouped_gemm_kernel; dynamic shared memory = kStages·(BLOCK_M + kBlockN)·64 bf16 + 1024 (the base
// is rounded up to the 1024-byte swizzle atom); built for sm_90a.
template <int kWarpgroups, int kBlockN, int kStages, bool kEvenK>
__global__ static void __launch_bounds__(128 * kWarpgroups, kWarpgroups == 1 && kBlockN == 128 ? 2 : 1)
    grouped_gemm_wgmma_kernel(const __grid_constant__ GemmKernelParams p) {
  constexpr int kBlockM = 64 * kWarpgroups, kThreads = 128 * kWarpgroups, kAcc = kBlockN / 2;
  constexpr int kStageElems = (kBlockM + kBlockN) * kBlockK;
  constexpr int kAhead = kStages - 2;
  static_assert(kStages >= 3 && kThreads >= kBlockM);

  const int2 tile_n0 = cta_tile(p, kBlockN);
  const int tile = tile_n0.x, n0 = tile_n0.y;
  if (tile >= *p.num_tiles) return;
  const int expert = p.tile_group[tile];
  extern __shared__ uint4 dynamic_shared[];
  const uintptr_t base = (reinterpret_cast<uintptr_t>(dynamic_shared) + 1023) & ~uintptr_t(1023);
  auto* stages = reinterpret_cast<__nv_bfloat16*>(base);  // [kStages][kBlockM + kBlockN][kBlockK] swizzled
  __shared__ int tile_pairs[kBlockM];
  if (threadIdx.x < kBlockM) tile_pairs[threadIdx.x] = p.sorted_pairs[tile * kBlockM + threadIdx.x];
  __syncthreads();

  const TileLoader<kBlockM, kBlockN, kThreads, kEvenK> loader(p, tile_pairs, expert, n0);
  auto load_stage = [&](int stage, int k0) {
    __nv_bfloat16* a_dst = stages + stage * kStageElems;
    loader.load(a_dst, a_dst + kBlockM * kBlockK, k0);
  };

  const int warpgroup = threadIdx.x / 128;
  float acc[kAcc];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) acc[i] = 0.0f;
  const int k_tiles = (p.in + kBlockK - 1) / kBlockK;
#pragma unroll
  for (int s = 0; s < kAhead; ++s) {
    if (s < k_tiles) load_stage(s, s * kBlockK);
    cp_async_commit();
  }
  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<kAhead - 1>();  // k-tile kt has landed (for this thread) ...
    fence_proxy_async();          // ... is visible to the tensor cores' proxy ...
    __syncthreads();              // ... for every thread; and wgmmas of kt - 2 retired in every warpgroup
    const int next = kt + kAhead;
    if (next < k_tiles) load_stage(next % kStages, next * kBlockK);
    cp_async_commit();
    wgmma_k_tile<kBlockN>(acc, stages + (kt % kStages) * kStageElems + warpgroup * 64 * kBlockK,
                          stages + (kt % kStages) * kStageElems + kBlockM * kBlockK);
    wgmma_wait<1>();
    fence_operands(acc);
  }
  wgmma_wait<0>();
  fence_operands(acc);

  // Accumulator layout of m64nN: warp w of the warpgroup holds rows 16w + lane/4 (+ 8), and per n8 block j
  // acc[4j], acc[4j + 1] = columns 8j + 2·(lane % 4) + {0, 1} of the first row, acc[4j + 2, 4j + 3] of the second.
  const int lane = threadIdx.x % 32, warp_in_group = (threadIdx.x / 32) % 4;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int pair = tile_pairs[warpgroup * 64 + warp_in_group * 16 + lane / 4 + 8 * half];
    if (pair >= p.pairs) continue;
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) {
      store_columns(p, expert, pair, n0 + 8 * j + 2 * (lane % 4), acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1],
                    pair);
    }
  }
}

// ---- Hopper path, warp-specialized: a producer warpgroup feeds consumer warpgroups through mbarriers ----
// The ring kernel above stalls every warp on one barrier per k-tile and on its own cp.async latency
// (ncu, perf-log run 17: 1 CTA of 8 warps per SM, 0.49 eligible warps per scheduler, tensor pipe 38%).
// Here warpgroup 0 only copies (16-byte cp.async; gathered A rows from a per-tile row table, weight rows
// at a constant stride) and signals each stage's arrival with cp.async.mbarrier.arrive.noinc on the
// stage's `full` barrier; warpgroups 1..kConsumers only wait on `full`, issue the wgmmas on their 64 rows,
// and release the stage on its `empty` barrier once those wgmmas retired. No CTA-wide barrier in the loop.
// Registers move to the consumers (setmaxnreg) when there are two of them (128 fp32 accumulators each at
// BLOCK_N 256). Measured 10–40% SLOWER than the ring kernel (perf-log run 18): one warpgroup of 16-byte
// cp.async (with per-load address arithmetic) cannot issue a stage as fast as the consumers eat it. So the
// weight tile comes by TMA (one box per stage) unless the layout is halves (run 20: then level with the
// ring), and, when the caller gives scratch for it, the A tile too: gather_rows_kernel first copies the
// tiles' x (or a) rows into tile order, and one BLOCK_M-row box per stage reads them (one box per gathered
// row instead was correct but 2.6–5× slower: run 25). Both by TMA: one thread issues every copy.

// tma_load_2d into the same shared offset of every CTA in `cta_mask` (a thread-block cluster), each CTA's
// barrier at `bar`'s offset counting the bytes that land in it.
__device__ __forceinline__ void tma_load_2d_multicast(void* shared, const CUtensorMap* map, int inner, int outer,
                                                      uint64_t* bar, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(shared_address(shared)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(inner), "r"(outer), "r"(shared_address(bar)), "h"(cta_mask)
      : "memory");
}
// One arrival on the barrier at `bar`'s offset in CTA `cta` of this cluster. Default semantics, no
// cluster-scope release: what it orders is this warp's wgmma reads of a stage (retired by wgmma_wait)
// before the peer's TMA refills it, which the barrier itself guarantees. Run 39 used
// .release.cluster here and .acquire.cluster in the producer's wait; that build was 1.6–1.8× slower, and
// cluster-scope fences on every stage are the first suspect (not yet measured without them).
__device__ __forceinline__ void mbarrier_arrive_cluster(uint64_t* bar, unsigned cta) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(shared_address(bar)), "r"(cta));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(remote) : "memory");
}
__device__ __forceinline__ unsigned cluster_cta_rank() {
  unsigned rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  return rank;
}
// Every thread of every CTA of the cluster (no thread may have exited), shared memory ordered across it.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}
// One arrival on `bar` once every cp.async this thread issued so far has landed (counted in the init count).
__device__ __forceinline__ void cp_async_arrive_noinc(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(shared_address(bar)) : "memory");
}
template <int kRegisters>
__device__ __forceinline__ void release_registers() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
#endif
}
template <int kRegisters>
__device__ __forceinline__ void claim_registers() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
#endif
}

// PRECOND: as grouped_gemm_wgmma_kernel; blockDim.x == 128·(kConsumers + 1); dynamic shared memory =
// kStages·(64·kConsumers + kBlockN)·64 bf16 + 1024; built for sm_90a.
template <int kConsumers, int kBlockN, int kStages, bool kEvenK>
__global__ static void __launch_bounds__(128 * (kConsumers + 1), kConsumers == 1 && kBlockN == 128 ? 2 : 1)
    grouped_gemm_ws_kernel(const __grid_constant__ GemmKernelParams p) {
  constexpr int kBlockM = 64 * kConsumers, kAcc = kBlockN / 2;
  constexpr int kStageElems = (kBlockM + kBlockN) * kBlockK;
  constexpr int kRowsPerPass = 128 / kChunksPerRow;  // 16 rows per pass of the producer's 128 threads

  const int2 tile_n0 = cta_tile(p, kBlockN);
  const int tile = tile_n0.x, n0 = tile_n0.y;
  if (tile >= *p.num_tiles) return;
  const int expert = p.tile_group[tile];

  extern __shared__ uint4 dynamic_shared[];
  const uintptr_t base = (reinterpret_cast<uintptr_t>(dynamic_shared) + 1023) & ~uintptr_t(1023);
  auto* stages = reinterpret_cast<__nv_bfloat16*>(base);  // [kStages][kBlockM + kBlockN][kBlockK] swizzled
  __shared__ int tile_pairs[kBlockM];   // pair of each tile row (T*K on padding)
  __shared__ int64_t a_offsets[kBlockM];  // element offset of each row's x (or a) row, -1 on padding
  __shared__ uint64_t full[kStages], empty[kStages];
  if (threadIdx.x < kBlockM) {
    const int pair = p.sorted_pairs[tile * kBlockM + threadIdx.x];
    tile_pairs[threadIdx.x] = pair;
    a_offsets[threadIdx.x] = pair < p.pairs ? int64_t(pair / p.row_div) * p.in : -1;
  }
  // full: every producer thread's cp.async arrival while any operand is copied by cp.async, plus the TMA
  // issuer's expect_tx arrival while any comes by TMA; empty: one arrival per consumer warp.
  const bool any_cp_async = !p.a_by_tma || !p.weight_by_tma, any_tma = p.a_by_tma || p.weight_by_tma;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(&full[s], (any_cp_async ? 128 : 0) + (any_tma ? 1 : 0));
      mbarrier_init(&empty[s], 4 * kConsumers);
    }
  }
  __syncthreads();
  const int k_tiles = (p.in + kBlockK - 1) / kBlockK;

  if (threadIdx.x < 128) {  // producer warpgroup
    if constexpr (kConsumers == 2) release_registers<56>();  // 168 at launch (384 threads)
    if (!any_cp_async && threadIdx.x != 0) return;  // both operands by TMA: one thread issues everything
    const int chunk = threadIdx.x % kChunksPerRow, row0 = threadIdx.x / kChunksPerRow;
    // Weight rows of this thread: column n0 + row0 + 16j. Interleaved (or unfused) weights: row = column;
    // halves: column 2i -> i, 2i+1 -> I + i, so with n0 and 16j even the row is a fixed start + 8j.
    const int64_t inter = p.n / 2;
    const int first_column = n0 + row0;
    const int64_t first_row = p.halves ? (first_column % 2 == 0 ? first_column / 2 : inter + first_column / 2)
                                       : first_column;
    const __nv_bfloat16* b_src = p.weight + (int64_t(expert) * p.n + first_row) * p.in + chunk * 8;
    const int64_t b_step = int64_t(p.halves ? kRowsPerPass / 2 : kRowsPerPass) * p.in;
    for (int kt = 0; kt < k_tiles; ++kt) {
      const int stage = kt % kStages;
      mbarrier_wait(&empty[stage], ((kt / kStages) & 1) ^ 1);
      __nv_bfloat16* a_dst = stages + stage * kStageElems;
      __nv_bfloat16* b_dst = a_dst + kBlockM * kBlockK;
      const int k = kt * kBlockK + chunk * 8;
      const bool k_ok = kEvenK || k < p.in;
      if (any_tma && threadIdx.x == 0) {  // the bytes are announced before the boxes are issued
        constexpr unsigned kABytes = kBlockM * kBlockK * sizeof(__nv_bfloat16);
        constexpr unsigned kBBytes = kBlockN * kBlockK * sizeof(__nv_bfloat16);
        mbarrier_arrive_expect_tx(&full[stage], (p.a_by_tma ? kABytes : 0) + (p.weight_by_tma ? kBBytes : 0));
        // rows past the gathered rows, rows past E·n and k past `in` land as zeros; rows of the next expert are
        // columns past n, never stored
        if (p.a_by_tma) tma_load_2d(a_dst, &p.a_map, kt * kBlockK, tile * kBlockM, &full[stage]);
        if (p.weight_by_tma) tma_load_2d(b_dst, &p.weight_map, kt * kBlockK, expert * p.n + n0, &full[stage]);
      }
      if (!p.a_by_tma) {
#pragma unroll
        for (int j = 0; j < kBlockM / kRowsPerPass; ++j) {
          const int row = row0 + kRowsPerPass * j;
          const int64_t offset = a_offsets[row];
          const bool ok = offset >= 0 && k_ok;
          cp_async16(a_dst + swizzled(row, chunk), ok ? p.x + offset + k : p.x, ok);
        }
      }
      if (!p.weight_by_tma) {
#pragma unroll
        for (int j = 0; j < kBlockN / kRowsPerPass; ++j) {
          const bool ok = first_column + kRowsPerPass * j < p.n && k_ok;
          cp_async16(b_dst + swizzled(row0 + kRowsPerPass * j, chunk),
                     ok ? b_src + b_step * j + kt * kBlockK : p.weight, ok);
        }
      }
      if (!any_cp_async) continue;
      cp_async_arrive_noinc(&full[stage]);
    }
    cp_async_wait<0>();  // leave no copy in flight behind an exited thread
    return;
  }

  // consumer warpgroups
  if constexpr (kConsumers == 2) claim_registers<224>();  // 168 + 128·(168 - 56) / 256
  const int consumer = threadIdx.x / 128 - 1;
  const int lane = threadIdx.x % 32, warp_in_group = (threadIdx.x / 32) % 4;
  float acc[kAcc];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) acc[i] = 0.0f;
  for (int kt = 0; kt < k_tiles; ++kt) {
    const int stage = kt % kStages;
    mbarrier_wait(&full[stage], (kt / kStages) & 1);
    __syncwarp();         // converged again for the .aligned wgmma instructions
    fence_proxy_async();  // the copies' generic-proxy writes, now visible here, ordered before the wgmma reads
    wgmma_k_tile<kBlockN>(acc, stages + stage * kStageElems + consumer * 64 * kBlockK,
                          stages + stage * kStageElems + kBlockM * kBlockK);
    wgmma_wait<1>();  // the wgmmas of k-tile kt - 1 retired: their stage may be refilled
    fence_operands(acc);
    if (kt > 0 && lane == 0) mbarrier_arrive(&empty[(kt - 1) % kStages]);
  }
  wgmma_wait<0>();
  fence_operands(acc);

#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int pair = tile_pairs[consumer * 64 + warp_in_group * 16 + lane / 4 + 8 * half];
    if (pair >= p.pairs) continue;
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) {
      store_columns(p, expert, pair, n0 + 8 * j + 2 * (lane % 4), acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1],
                    pair);
    }
  }
}

// What the persistent kernel's epilogue of one work item reads from global memory, loaded in one go: at
// BLOCK_M 128 × BLOCK_N 128 before the item's k-loop, so the loads' latency hides behind its MMAs (ncu,
// perf-log run 42: L1TEX scoreboard waits were 31% of the consumers' stalls with the loads inside the
// epilogue); otherwise after it (BLOCK_N 256: 32 bias registers do not fit beside 128 accumulators; BLOCK_M
// 64 runs two CTAs per SM in 128 registers). row0: the warp's first tile row.
template <int kBlockM, int kBlockN>
struct EpilogueInputs {
  int expert, column0;
  int pair[2];     // rows row0 + lane / 4 and + 8 (>= p.pairs on padding)
  int out_row[2];  // their output rows: the pairs, or with out_by_row the tile rows
  Epilogue how;
  __nv_bfloat162 bias[kBlockN / 8];  // kFused / kStore: the thread's column pairs' biases (zeros without)
  static constexpr bool kDeltaForm = kBlockM == 128 && kBlockN == 128;
  static constexpr int kDelta = kDeltaForm ? kBlockN / 8 : 1;
  __nv_bfloat162 delta[2][kDelta];    // kFusedDelta: lora_h of those columns per row
  bool has_delta[2];                  // kFusedDelta: the row's token has a slot

  __device__ __forceinline__ EpilogueInputs(const GemmKernelParams& p, int2 work, int row0, int lane) {
    expert = p.tile_group[work.x];
    column0 = work.y + 2 * (lane % 4);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int tile_row = work.x * kBlockM + row0 + lane / 4 + 8 * half;
      pair[half] = p.sorted_pairs[tile_row];
      out_row[half] = p.out_by_row ? tile_row : pair[half];
    }
    how = p.compact_epilogue ? epilogue_case(p, work.y, kBlockN, kDeltaForm) : Epilogue::kGeneral;
    const bool load_bias = how != Epilogue::kGeneral && p.bias != nullptr;
    const __nv_bfloat16* bias_row = p.bias + (load_bias ? int64_t(expert) * p.n + column0 : 0);
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) {
      bias[j] = load_bias ? *reinterpret_cast<const __nv_bfloat162*>(bias_row + 8 * j) : __float2bfloat162_rn(0.0f);
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) has_delta[half] = false;
    if constexpr (kDeltaForm) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const bool has = how == Epilogue::kFusedDelta && pair[half] < p.pairs &&
                         __ldg(p.token_slot + pair[half] / p.row_div) >= 0;
        has_delta[half] = has;
        const __nv_bfloat16* row = p.lora_h + (has ? int64_t(pair[half]) * p.n + column0 : 0);
#pragma unroll
        for (int j = 0; j < kDelta; ++j) {
          delta[half][j] = has ? *reinterpret_cast<const __nv_bfloat162*>(row + 8 * j) : __float2bfloat162_rn(0.0f);
        }
      }
    }
  }
};

// The persistent kernel's epilogue of one work item (the form chosen per item: Epilogue). kWide: the store form
// by store_words (the kernels without the LoRA or stream-K, which have the registers for it: with them the
// words spill).
template <bool kWide, int kBlockM, int kBlockN>
__device__ __forceinline__ void persistent_epilogue(const GemmKernelParams& p, const EpilogueInputs<kBlockM, kBlockN>& in,
                                                    const float (&acc)[kBlockN / 2]) {
  using In = EpilogueInputs<kBlockM, kBlockN>;
  // store_activated's lane transpose takes groups of 32 columns: BLOCK_N 240 (down only) stores through the
  // general form should a fused item ever reach it
  if constexpr (kBlockN % 32 == 0) {
    if (in.how == Epilogue::kFused) {
      store_tile<Epilogue::kFused, kBlockN, In::kDelta>(p, in.pair, in.out_row, in.column0, in.bias, in.delta,
                                                        in.has_delta, acc);
      return;
    }
  }
  if (in.how == Epilogue::kStore) {
    store_tile<Epilogue::kStore, kBlockN, In::kDelta, kWide>(p, in.pair, in.out_row, in.column0, in.bias, in.delta,
                                                             in.has_delta, acc);
  } else if (In::kDeltaForm && in.how == Epilogue::kFusedDelta) {
    if constexpr (In::kDeltaForm) {
      store_tile<Epilogue::kFusedDelta, kBlockN, In::kDelta>(p, in.pair, in.out_row, in.column0, in.bias, in.delta,
                                                             in.has_delta, acc);
    }
  } else {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      if (in.pair[half] >= p.pairs) continue;
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) {
        store_columns(p, in.expert, in.pair[half], in.column0 + 8 * j, acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1],
                      in.out_row[half]);
      }
    }
  }
}

// The fused epilogue handed to the producer warpgroup's idle warps (set_moe_gemm_epilogue_warps). The consumers
// add the bias and round (gate, up) to bf16 as store_tile does, write the pairs into a shared staging tile and
// go straight on to the next item's wgmmas; warps 1–3 of the producer warpgroup (warp 0's lane 0 issues the
// copies) apply the activation and store the outputs 16 bytes a thread while those wgmmas run. The store form
// (down, set_moe_gemm_epilogue_down) stages its bf16 pairs the same way, and those warps only store them. Perf-log run 244:
// the activation's arithmetic was 67 of gate_up's 549 µs at GPT-OSS-20B T 1600, with the tensor cores idle.
// The staging tile: [kBlockM rows][kBlockN / 2 + 4] 32-bit words, word w of a row = the bf16 (gate, up) pair
// of output column work.y / 2 + w; the 4 words of padding put the 8 rows of a consumer store's lanes on distinct
// banks (row stride ≡ 4 words mod 32).
template <int kBlockM, int kBlockN>
struct EpilogueStage {
  static constexpr int kStride = kBlockN / 2 + 4;                    // words a staged row
  static constexpr int kBytes = kBlockM * kStride * 4;
  static constexpr int kChunks = kBlockN / 16;                       // 8-output chunks a row
  static constexpr int kThreads = 96;                                // warps 1–3 of the producer warpgroup

  // Whether the item at column block `first_column` goes through the stage: the fused form or the store form
  // (down; epilogue_case, as EpilogueInputs picks it) with 16-byte aligned output rows. Consumers and epilogue
  // warps decide alike.
  __device__ __forceinline__ static bool takes(const GemmKernelParams& p, int first_column) {
    if (!p.epilogue_warps || !p.compact_epilogue || reinterpret_cast<uintptr_t>(p.out) % 16 != 0) return false;
    const Epilogue how = epilogue_case(p, first_column, kBlockN, kBlockM == 128 && kBlockN == 128);
    return (how == Epilogue::kFused && (p.n / 2) % 8 == 0) || (how == Epilogue::kStore && p.n % 8 == 0);
  }

  // Consumer side: the thread's accumulators (rows row0 + lane / 4 and + 8) plus bias, rounded, into the stage.
  __device__ __forceinline__ static void put(uint32_t* stage, const int (&pair)[2], int pairs, int row0, int lane,
                                             const __nv_bfloat162 (&bias)[kBlockN / 8],
                                             const float (&acc)[kBlockN / 2]) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      if (pair[half] >= pairs) continue;  // padding: never read
      uint32_t* row = stage + (row0 + lane / 4 + 8 * half) * kStride + lane % 4;
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) {
        const float2 b = __bfloat1622float2(bias[j]);
        __nv_bfloat162 bits = __floats2bfloat162_rn(acc[4 * j + 2 * half] + b.x, acc[4 * j + 2 * half + 1] + b.y);
        row[4 * j] = *reinterpret_cast<uint32_t*>(&bits);
      }
    }
  }

  // Calls f(src, out_row, chunk) for thread e's staged chunks e, e + kThreads, ... of real rows (32 bytes each:
  // the 16 bf16 values of columns 16·chunk ..): src in the staging tile, out_row the row of p.out they go to.
  template <typename F>
  __device__ __forceinline__ static void for_staged_chunks(const GemmKernelParams& p, const uint32_t* stage, int2 work,
                                                           int e, F&& f) {
    for (int c = e; c < kBlockM * kChunks; c += kThreads) {
      const int row = c / kChunks, chunk = c % kChunks;
      const int tile_row = work.x * kBlockM + row;
      const int pair = p.sorted_pairs[tile_row];
      if (pair >= p.pairs) continue;
      f(reinterpret_cast<const uint4*>(stage + row * kStride + 8 * chunk),
        p.out_by_row ? int64_t(tile_row) : int64_t(pair), chunk);
    }
  }

  // Epilogue-warp side of the store form (down: the staged bf16 pairs are the outputs): thread e stores chunks e,
  // e + kThreads, ... of 16 columns, 32 bytes each.
  __device__ __forceinline__ static void drain_store(const GemmKernelParams& p, const uint32_t* stage, int2 work, int e) {
    for_staged_chunks(p, stage, work, e, [&](const uint4* src, int64_t out_row, int chunk) {
      const uint4 lo = src[0], hi = src[1];
      auto* dst = reinterpret_cast<uint4*>(p.out + out_row * p.n + work.y + 16 * chunk);
      dst[0] = lo;
      dst[1] = hi;
    });
  }

  // Epilogue-warp side: thread e (0 .. kThreads - 1) activates and stores chunks e, e + kThreads, ... of the
  // staged tile of `work`.
  __device__ __forceinline__ static void drain(const GemmKernelParams& p, const uint32_t* stage, int2 work, int e) {
    const int64_t inter = p.n / 2;
    for_staged_chunks(p, stage, work, e, [&](const uint4* src, int64_t out_row, int chunk) {
      uint32_t in[8];
      *reinterpret_cast<uint4*>(in) = src[0];
      *reinterpret_cast<uint4*>(in + 4) = src[1];
      uint32_t out[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        float a[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const float2 gu = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&in[2 * k + i]));
          a[i] = activate(gu.x, gu.y, p.gpt_oss, p.swiglu_alpha, p.swiglu_limit);
        }
        __nv_bfloat162 bits = __floats2bfloat162_rn(a[0], a[1]);
        out[k] = *reinterpret_cast<uint32_t*>(&bits);
      }
      *reinterpret_cast<uint4*>(p.out + out_row * inter + work.y / 2 + 8 * chunk) = make_uint4(out[0], out[1], out[2], out[3]);
    });
  }

  // Epilogue-warp side with the MoE-LoRA (p.epilogue_lora; the consumers staged acc + bias without it): epilogue
  // warp w (0 .. 2) takes units w, w + 3, ... of 16 rows × 32 columns. Each lane holds its unit's staged values in
  // the mma C layout (rows lane / 4 and + 8, columns 8j + 2(lane % 4) and + 1), adds z·B[slot, expert]ᵀ by
  // add_lora_terms (mma.sync, one pass per distinct slot of the 16 rows), rounds h to bf16 again, applies the
  // activation and stores through store_activated. h is rounded twice where a row has a slot (acc + bias, then
  // + the LoRA term; NUMERICS.md), as PEFT adds a LoRA layer's output to the base layer's bf16 output; rows
  // without a slot get exactly the consumers' result.
  __device__ __forceinline__ static void drain_lora(const GemmKernelParams& p, const uint32_t* stage, int2 work,
                                                    int expert, int w, int lane) {
    constexpr int kColumns = 32, kUnitsPerRowGroup = kBlockN / kColumns;
    static_assert(kBlockN % kColumns == 0);
    const int g = lane / 4, t = lane % 4;
    const int64_t inter = p.n / 2;
    for (int u = w; u < (kBlockM / 16) * kUnitsPerRowGroup; u += kThreads / 32) {
      const int rows16 = u / kUnitsPerRowGroup, c0 = (u % kUnitsPerRowGroup) * kColumns;  // c0: the unit's first column
      int pair[2], tile_row[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        tile_row[half] = work.x * kBlockM + rows16 * 16 + g + 8 * half;
        pair[half] = p.sorted_pairs[tile_row[half]];
      }
      if (!__any_sync(0xffffffffu, pair[0] < p.pairs || pair[1] < p.pairs)) continue;  // all padding
      float acc[kColumns / 2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const uint32_t* row = stage + (rows16 * 16 + g + 8 * half) * kStride + c0 / 2 + t;
#pragma unroll
        for (int j = 0; j < kColumns / 8; ++j) {
          const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(row + 4 * j));
          acc[4 * j + 2 * half] = v.x;
          acc[4 * j + 2 * half + 1] = v.y;
        }
      }
      add_lora_terms<kColumns, kColumns / 8>(p, expert, work.y + c0, pair, lane, acc, LoraRows(p, pair));
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const bool store = pair[half] < p.pairs;
        float activated[kColumns / 8];
#pragma unroll
        for (int j = 0; j < kColumns / 8; ++j) {
          const float gate = __bfloat162float(__float2bfloat16_rn(acc[4 * j + 2 * half]));
          const float up = __bfloat162float(__float2bfloat16_rn(acc[4 * j + 2 * half + 1]));
          activated[j] = activate(gate, up, p.gpt_oss, p.swiglu_alpha, p.swiglu_limit);
        }
        const int64_t out_row = p.out_by_row ? tile_row[half] : pair[half];
        store_activated<kColumns>(p.out + (store ? out_row : 0) * inter, work.y + c0 + 2 * t, store, activated);
      }
    }
  }
};

// The slot whose B slice lora_wgmma_pass adds for a tile of kBlockM rows: that of its middle row (a prompt's
// run fills it), else of its first; -1 where neither has one, or where that slot's rank is not a nonzero
// multiple of 16 up to 64 (the pass takes whole k16 steps of the 64-rank box, and a stack's padding ranks may
// hold anything). Producer and consumers call it on the same tile, so they agree on every load.
template <int kBlockM>
__device__ __forceinline__ int lora_main_slot(const GemmKernelParams& p, int tile) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int pair = p.sorted_pairs[tile * kBlockM + (i == 0 ? kBlockM / 2 : 0)];
    if (pair >= p.pairs) continue;
    const int slot = __ldg(p.lora_slot + pair / p.lora_top_k);
    if (slot < 0) continue;
    const int rank = __ldg(p.lora_rank + slot);
    return rank > 0 && rank % 16 == 0 && rank <= 64 ? slot : -1;
  }
  return -1;
}

// lora_ktile: the slot whose term a tile of kBlockM rows adds as one more k-tile, or -1: its main slot where that
// slot's rank is the stack's whole capacity R (B's ranks past a smaller rank may hold anything, NaN included, and
// the k-tile multiplies all 64 columns; those tiles keep add_lora_terms). The producer and the consumers ask it
// alike (through z_rows_kernel's lora_tile_slots), so both see the same k-tile count.
template <int kBlockM>
__device__ __forceinline__ int lora_ktile_slot(const GemmKernelParams& p, int tile) {
  const int slot = lora_main_slot<kBlockM>(p, tile);
  return slot >= 0 && __ldg(p.lora_rank + slot) == p.lora_r ? slot : -1;
}

// lora_ktile's A operand: row r of the tiles (8 threads a row, 8 ranks each) = z[pair] in bf16 at ranks < R where
// the row's slot is its tile's lora_ktile_slot, zeros elsewhere (rows of other slots or none, padding rows, ranks
// R .. 63); and each tile's lora_ktile_slot into lora_tile_slots, which the GEMM's producer and consumers read
// (one load an item instead of lora_main_slot's chain of three). Rows of tiles past num_tiles are left alone.
// PRECOND: R % 8 == 0, R <= 64; lora_z 8-byte aligned; lora_z_rows 16-byte aligned; blockDim.x == 256.
template <int kBlockM>
__global__ static void __launch_bounds__(256) z_rows_kernel(const __grid_constant__ GemmKernelParams p) {
  detail::pdl_enter();  // first: launched by detail::launch (launch.cuh), behind the shrink that wrote z
  const int row = int(blockIdx.x) * 32 + int(threadIdx.x) / 8, chunk = int(threadIdx.x) % 8;
  if (row >= *p.num_tiles * kBlockM) return;
  const int slot = lora_ktile_slot<kBlockM>(p, row / kBlockM);
  if (row % kBlockM == 0 && chunk == 0) p.lora_tile_slots[row / kBlockM] = slot;
  const int pair = p.sorted_pairs[row];
  const bool take = slot >= 0 && pair < p.pairs && __ldg(p.lora_slot + pair / p.lora_top_k) == slot;
  uint32_t words[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int k = chunk * 8 + 2 * i;
    const float2 v = take && k < p.lora_r ? *reinterpret_cast<const float2*>(p.lora_z + int64_t(pair) * p.lora_r + k)
                                          : make_float2(0.0f, 0.0f);
    const __nv_bfloat162 bits = __floats2bfloat162_rn(v.x, v.y);
    words[i] = *reinterpret_cast<const uint32_t*>(&bits);
  }
  *reinterpret_cast<uint4*>(p.lora_z_rows + int64_t(row) * 64 + chunk * 8) = make_uint4(words[0], words[1], words[2],
                                                                                         words[3]);
}

// acc += z·B[slot]ᵀ for the warp's rows of `slot` (rank `rank`, a multiple of 16), B from the tile's TMA'd
// slice b_tile [kBlockN, 64] (128-byte swizzle, K-major); the rows of other slots, without one, or padding add
// exact zeros. z goes in as bf16 hi + lo (16 significant bits), as in add_lora_terms: per 16 ranks two
// m64nNk16 wgmmas with A from registers (mma.sync's A fragment layout) instead of 2 · BLOCK_N / 8 mma.syncs a
// warp with B words from L2. PRECOND: every thread of the warpgroup, converged; the slice has landed.
template <int kBlockN>
__device__ __forceinline__ void lora_wgmma_pass(const GemmKernelParams& p, const int (&pair)[2], const LoraRows& rows,
                                                int slot, int rank, int lane, const __nv_bfloat16* b_tile,
                                                float (&acc)[kBlockN / 2]) {
  const int t = lane % 4;
  bool use[2];
  const float* z_row[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    use[half] = rows.slot[half] == slot;
    z_row[half] = p.lora_z + int64_t(use[half] ? pair[half] : 0) * p.lora_r;
  }
  for (int k0 = 0; k0 < rank; k0 += 16) {
    unsigned hi[4], lo[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int half = q % 2, k = k0 + 2 * t + 8 * (q / 2);
      const float2 z = use[half] ? __ldca(reinterpret_cast<const float2*>(z_row[half] + k)) : make_float2(0.0f, 0.0f);
      detail::split_bf16(z, hi[q], lo[q]);
    }
    fence_operands(acc);
    wgmma_fence();
    wgmma_tile_rs<kBlockN>(acc, hi, sw128_descriptor(b_tile + k0));
    wgmma_tile_rs<kBlockN>(acc, lo, sw128_descriptor(b_tile + k0));
    wgmma_commit();
    wgmma_wait<0>();  // hi and lo are rewritten by the next step
    fence_operands(acc);
  }
}

// The persistent kernel's stream-K tail (GemmKernelParams::sk_partials set). With `units` work units on a grid
// of G CTAs, units / G full rounds run as before, one whole unit at a time (data-parallel); the last
// `tail` = units mod G units — the partial last wave that left most SMs idle (GPT-OSS-20B T 1600: down 960
// units = 7.27 rounds on 132 SMs, gate_up 14.55) — are cut along k: their tail · k_tiles k-tiles are split
// evenly over `ctas` CTAs (>= tail, so each CTA's range touches at most two units, and at least
// kStreamKMinTiles k-tiles each where there are that many). A unit whose k-range spans several CTAs
// ("pieces") is finished by the CTA whose piece completes its k-tile count: it sums every piece's partial
// from global memory in CTA order (deterministic, whichever CTA comes last), then adds the LoRA terms and
// runs the epilogue as for a whole unit. No CTA waits for another, so there is no co-residency assumption.
// The partition itself (StreamKPlan, walk_units) is in stream_k.h, checked on the CPU.
constexpr int kStreamKCounters = 1024;  // tail units of one launch (< grid CTAs), the counters' length

// The consumer warpgroups' own barrier (the producer warpgroup never joins it).
template <int kThreads>
__device__ __forceinline__ void consumer_barrier() {
  asm volatile("bar.sync 1, %0;" ::"n"(kThreads) : "memory");
}

// A tail piece of unit `tail_unit` (its k-tiles [kb, ke)) into sk_partials, then its count. Returns whether this
// CTA completed the unit; if so acc holds the sum of every piece (in CTA order) and the counter is zero again.
// t: the consumer thread (0 .. kThreads - 1). PRECOND: every consumer thread calls it (two barriers).
template <int kThreads, int kAcc>
__device__ __forceinline__ bool stream_k_merge(const GemmKernelParams& p, const StreamKPlan& plan, float (&acc)[kAcc],
                                               int tail_unit, int piece, int cta, int kb, int ke, int k_tiles, int t,
                                               int* last_flag) {
  auto partial = [&](int c, int slot) { return p.sk_partials + (int64_t(c) * 2 + slot) * kThreads * kAcc + t; };
  float* mine = partial(cta, piece);
#pragma unroll
  for (int i = 0; i < kAcc; ++i) __stcg(mine + i * kThreads, acc[i]);
  __threadfence();  // each thread's partial is visible device-wide before the count says so
  consumer_barrier<kThreads>();
  if (t == 0) {
    const int done = atomicAdd(p.sk_counters + tail_unit, ke - kb) + (ke - kb);
    const bool last = done == k_tiles;
    if (last) p.sk_counters[tail_unit] = 0;  // every piece has counted: clean for the next launch
    *last_flag = last;
    __threadfence();
  }
  consumer_barrier<kThreads>();
  if (!*last_flag) return false;
  const int64_t begin = int64_t(tail_unit) * k_tiles;
  const int c0 = plan.cta_of(begin), c1 = plan.cta_of(begin + k_tiles - 1);
#pragma unroll
  for (int i = 0; i < kAcc; ++i) acc[i] = 0.0f;
  for (int c = c0; c <= c1; ++c) {
    const float* piece_of_c = partial(c, plan.piece_of(c, begin));
#pragma unroll
    for (int i = 0; i < kAcc; ++i) acc[i] += __ldcg(piece_of_c + i * kThreads);
  }
  return true;
}

// Persistent form of the warp-specialized kernel for both operands by TMA (the A rows gathered into tile
// order, weights not in the halves layout): a grid of about one wave; each CTA walks the work items
// blockIdx.x, blockIdx.x + gridDim.x, ... (tile × column block, mapped as cta_tile maps CTAs). One producer
// thread keeps one ring of kStages stages running across its items, so the next item's first stages load
// while the consumers store the current one's outputs: no per-tile prologue (barrier init, the row table,
// the first copies' latency) and no drained pipeline behind each epilogue, which the one-tile-per-CTA kernel
// pays for every 128 × 128 tile (~6 µs of wgmmas at K 2880; perf-log run 26: 36% of the FLOP floor).
// Stage use number `it` counts over all the CTA's k-tiles in order: stage it % kStages, phase (it / kStages) & 1,
// the same sequence for producer and consumers. A consumer releases a stage once the wgmmas reading it
// retired: the previous k-tile's after each wgmma_wait<1>, the item's last one after its wgmma_wait<0>.
// The epilogue reads each row's pair straight from sorted_pairs (two loads per thread, L2 hits).
// kClusterA (BLOCK_M 128 × BLOCK_N 128 only): CTA pairs of a thread-block cluster share the A tile. The
// persistent loop walks units of one tile × two column blocks; cluster CTA r takes column block 2u + r, and
// its producer loads A rows [64r, 64r + 64) of the tile once, multicast into both CTAs' stage, plus its own
// weight box. Per CTA and k-tile that is 24 KB through L2 instead of 32: the kernel is bound by L2 → SM
// bandwidth (ncu, perf-log run 38: 7.2–7.6 TB/s of L2 traffic at 45% of the FLOP floor, where cuBLASLt's
// 192 × 192 tiles in clusters of 2 need 6.0–6.4 TB/s at 94%). A stage may be refilled only once the
// consumers of both CTAs released it (each consumer warp arrives on its own and on the peer's `empty`), and
// no thread exits before the closing cluster barrier (a peer may still write into this CTA's shared memory
// or arrive on its barriers). An odd last column block makes rank 1 compute a block past `n`, never stored.
// kLora: add_lora_terms between each item's k-loop and its epilogue (p.lora_z etc. set).
// kEpilogueWarps with p.epilogue_warps: the fused items' epilogue through EpilogueStage (one staging tile after the
// stages: the consumers wait for it to be drained, ~one item ago, then fill it; warps 1–3 of the producer warpgroup
// walk the same units, wait for it to be filled, drain it, then release it).
// PRECOND: as grouped_gemm_ws_kernel with a_by_tma and weight_by_tma; work_tiles == the tiles' max_tiles,
// work_column_blocks == ceil(n / kBlockN); kClusterA: launched in clusters of 2 along x (gridDim.x even) and
// a_map's box is 64 rows; kLora: lora_* set, lora_r even.
template <int kConsumers, int kBlockN, int kStages, bool kClusterA = false, bool kLora = false, bool kStreamK = false,
          bool kEpilogueWarps = false>
__global__ static void __launch_bounds__(128 * (kConsumers + 1), kConsumers == 1 && kBlockN == 128 ? 2 : 1)
    grouped_gemm_persistent_kernel(const __grid_constant__ GemmKernelParams p) {
  constexpr int kBlockM = 64 * kConsumers, kAcc = kBlockN / 2;
  constexpr int kStageElems = (kBlockM + kBlockN) * kBlockK;
  constexpr int kCtas = kClusterA ? 2 : 1;  // CTAs sharing a stage's A tile
  // add_lora_terms' B words in flight: 16 n-tiles where the accumulators leave the registers (no spills,
  // ptxas -v), 8 with 128 accumulators (BLOCK_N 256) or at two CTAs per SM (BLOCK_M 64 × 128)
  constexpr int kLoraBatch = kConsumers == 2 && kBlockN == 128 ? 16 : 8;
  constexpr int kLoraPrefetchAt = 4;  // the k-tile after whose wgmmas LoraL1Prefetch issues (~2 µs into the item)
  // LoraL1Prefetch's few registers only where they do not add spills (ptxas: BLOCK_M 64 and BLOCK_N 256 spill
  // in their LoRA section already)
  constexpr bool kLoraL1 = kLora && kConsumers == 2 && kBlockN <= 192;
  // lora_wgmma's B slice buffer exists in the BLOCK_M 128 LoRA kernels (prepared_persistent_kernel sizes it),
  // except with kEpilogueWarps (the staging tile takes that shared memory)
  constexpr bool kLoraWgmma = kLora && kConsumers == 2 && !kClusterA && !kEpilogueWarps;
  constexpr unsigned kLoraTileBytes = kBlockN * kBlockK * sizeof(__nv_bfloat16);
  static_assert(!kClusterA || (kConsumers == 2 && kBlockN == 128), "multicast A: BLOCK_M 128 × BLOCK_N 128");
  static_assert(!kStreamK || !kClusterA, "stream-K: one CTA per unit");
  static_assert(!kEpilogueWarps || (kConsumers == 2 && !kClusterA && !kStreamK && kBlockN % 32 == 0),
                "epilogue warps: the BLOCK_M 128 kernel without multicast or stream-K");
  using Stage = EpilogueStage<kBlockM, kBlockN>;
  extern __shared__ uint4 dynamic_shared[];
  const uintptr_t base = (reinterpret_cast<uintptr_t>(dynamic_shared) + 1023) & ~uintptr_t(1023);
  auto* stages = reinterpret_cast<__nv_bfloat16*>(base);  // [kStages][kBlockM + kBlockN][kBlockK] swizzled
  __nv_bfloat16* lora_b_tile = stages + kStages * kStageElems;  // kLoraWgmma: [kBlockN][kBlockK] swizzled
  auto* epilogue_stage = reinterpret_cast<uint32_t*>(stages + kStages * kStageElems);  // kEpilogueWarps: Stage
  __shared__ uint64_t full[kStages], empty[kStages];
  __shared__ uint64_t stage_full, stage_empty;  // kEpilogueWarps: the staging tile filled / drained
  __shared__ uint64_t lora_full, lora_empty;  // kLoraWgmma: lora_b_tile loaded / released by every consumer warp
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(&full[s], 1);                         // the TMA issuer's expect_tx arrival
      mbarrier_init(&empty[s], 4 * kConsumers * kCtas);  // one arrival per consumer warp (of each CTA)
    }
    if constexpr (kLoraWgmma) {
      mbarrier_init(&lora_full, 1);
      mbarrier_init(&lora_empty, 4 * kConsumers);
    }
    if constexpr (kEpilogueWarps) {
      mbarrier_init(&stage_full, 128 * kConsumers);  // every consumer thread after its stores
      mbarrier_init(&stage_empty, Stage::kThreads);  // every epilogue thread after its reads
    }
    if constexpr (kClusterA) asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  if constexpr (kClusterA) cluster_sync();  // the peer's barriers exist before anything arrives on them
  else __syncthreads();
  const int k_tiles = (p.in + kBlockK - 1) / kBlockK;
  const int num_tiles = *p.num_tiles;
  const unsigned rank = kClusterA ? cluster_cta_rank() : 0;
  // Work units: tile × column block, or with kClusterA tile × pair of column blocks (one per cluster).
  const int unit_columns = kClusterA ? (p.work_column_blocks + 1) / 2 : p.work_column_blocks;
  const int first = int(blockIdx.x) / kCtas, stride = int(gridDim.x) / kCtas;
  // Stream-K tail: units are the real tiles' (num_tiles × column blocks), all of them work; otherwise
  // max_tiles' and the units past num_tiles are skipped.
  const bool stream_k = kStreamK && p.sk_partials != nullptr;
  const bool lora_wgmma = kLoraWgmma && p.lora_wgmma;
  const int unit_tiles = stream_k ? num_tiles : p.work_tiles;
  const int units = unit_tiles * unit_columns;
  const StreamKPlan plan = stream_k ? stream_k_plan(units, stride, k_tiles) : StreamKPlan{};
  __shared__ int sk_last;  // stream_k_merge's answer for every consumer thread
  auto work_of = [&](int id) {
    int2 work = work_tile(p, id, unit_tiles, unit_columns, kBlockN * kCtas);
    work.y += int(rank) * kBlockN;
    return work;
  };

  if (threadIdx.x < 128) {  // producer warpgroup: one thread issues every copy
    if constexpr (kConsumers == 2) release_registers<56>();  // .sync.aligned: the whole warpgroup
    if (threadIdx.x == 0) {
      constexpr unsigned kStageBytes = (kBlockM + kBlockN) * kBlockK * sizeof(__nv_bfloat16);
      int it = 0, lora_loads = 0;
      walk_units(stream_k, plan, first, stride, units, k_tiles, [&](int id, int kb, int ke, int piece) {
        const int2 work = work_of(id);
        if (work.x >= num_tiles) return;  // the same tile for both CTAs of a cluster: both skip
        const int expert = p.tile_group[work.x];
        // lora_wgmma: the unit's main slot, read now (the ring is full, so this wait hides behind the
        // consumers' work) and loaded after its k-tiles
        const int lora_slot = lora_wgmma && piece < 0 ? lora_main_slot<kBlockM>(p, work.x) : -1;
        for (int kt = kb; kt < ke; ++kt, ++it) {
          const int stage = it % kStages;
          __nv_bfloat16* a_dst = stages + stage * kStageElems;
          mbarrier_wait(&empty[stage], ((it / kStages) & 1) ^ 1);  // with kClusterA: both CTAs' consumers
          // A's bytes count here whichever CTA's copy writes them (the peer's may land before this arrival:
          // the phase cannot complete without it)
          mbarrier_arrive_expect_tx(&full[stage], kStageBytes);
          // k past `in`, rows past E·n: zeros; rows of the next expert are columns past n, never stored
          if constexpr (kClusterA) {
            tma_load_2d_multicast(a_dst + rank * 64 * kBlockK, &p.a_map, kt * kBlockK, work.x * kBlockM + int(rank) * 64,
                                  &full[stage], uint16_t(0b11));
          } else {
            tma_load_2d(a_dst, &p.a_map, kt * kBlockK, work.x * kBlockM, &full[stage]);
          }
          if (p.halves) {  // rows i of both halves, interleaved by the map's box: logical columns 2i, 2i + 1
            tma_load_4d(a_dst + kBlockM * kBlockK, &p.weight_map, kt * kBlockK, 0, work.y / 2, expert, &full[stage]);
          } else {
            tma_load_2d(a_dst + kBlockM * kBlockK, &p.weight_map, kt * kBlockK, expert * p.n + work.y, &full[stage]);
          }
        }
        // lora_ktile: the main slot's term as one more k-tile (whole units only, as the consumers)
        if constexpr (kLora) {
          const int ktile_slot = p.lora_ktile && piece < 0 ? p.lora_tile_slots[work.x] : -1;
          if (ktile_slot >= 0) {
            const int stage = it % kStages;
            __nv_bfloat16* a_dst = stages + stage * kStageElems;
            mbarrier_wait(&empty[stage], ((it / kStages) & 1) ^ 1);
            mbarrier_arrive_expect_tx(&full[stage], kStageBytes);
            tma_load_2d(a_dst, &p.z_map, 0, work.x * kBlockM, &full[stage]);
            tma_load_2d(a_dst + kBlockM * kBlockK, &p.lora_b_map, 0,
                        int(ktile_slot * p.weight_rows + int64_t(expert) * p.n + work.y), &full[stage]);
            ++it;
          }
        }
        // lora_wgmma: the main slot's B slice of this whole unit, issued once its k-tiles are (the consumers
        // are then about kStages k-tiles from needing it; they released the previous unit's long before)
        if (lora_slot >= 0) {
          mbarrier_wait(&lora_empty, (lora_loads & 1) ^ 1);
          mbarrier_arrive_expect_tx(&lora_full, kLoraTileBytes);
          tma_load_2d(lora_b_tile, &p.lora_b_map, 0, int(lora_slot * p.weight_rows + int64_t(expert) * p.n + work.y),
                      &lora_full);
          ++lora_loads;
        }
      });
    } else if (kEpilogueWarps && p.epilogue_warps && threadIdx.x >= 32) {  // warps 1–3: the staged epilogues
      int drained = 0;
      for (int id = first; id < units; id += stride) {
        const int2 work = work_of(id);
        if (work.x >= num_tiles || !Stage::takes(p, work.y)) continue;
        mbarrier_wait(&stage_full, drained & 1);
        bool lora_drained = false;
        if constexpr (kLora) {
          if (p.epilogue_lora) {
            Stage::drain_lora(p, epilogue_stage, work, p.tile_group[work.x], int(threadIdx.x) / 32 - 1,
                              int(threadIdx.x) % 32);
            lora_drained = true;
          }
        }
        if (!lora_drained) {
          if (p.fuse_activation) Stage::drain(p, epilogue_stage, work, int(threadIdx.x) - 32);
          else Stage::drain_store(p, epilogue_stage, work, int(threadIdx.x) - 32);
        }
        mbarrier_arrive(&stage_empty);
        ++drained;
      }
    }
  } else {  // consumer warpgroups
    if constexpr (kConsumers == 2) claim_registers<224>();  // 168 + 128·(168 - 56) / 256
    const int consumer = threadIdx.x / 128 - 1;
    const int lane = threadIdx.x % 32, warp_in_group = (threadIdx.x / 32) % 4;
    auto release = [&](int stage) {
      if (lane != 0) return;
      mbarrier_arrive(&empty[stage]);
      if constexpr (kClusterA) mbarrier_arrive_cluster(&empty[stage], rank ^ 1u);
    };
    const int row0 = consumer * 64 + warp_in_group * 16;
    int it = 0, lora_loads = 0, staged = 0;
    // One k-tile of the item in `acc`: issue() waits for its stage and issues its wgmmas; retire(), after
    // whatever runs while they are in flight, releases the previous k-tile's stage once its wgmmas retired.
    auto issue = [&](float (&acc)[kAcc]) {
      const int stage = it % kStages;
      mbarrier_wait(&full[stage], (it / kStages) & 1);
      __syncwarp();  // converged again for the .aligned wgmma instructions
      wgmma_k_tile<kBlockN>(acc, stages + stage * kStageElems + consumer * 64 * kBlockK,
                            stages + stage * kStageElems + kBlockM * kBlockK);
    };
    // kt: the k-tile's index within this piece of the unit (0: no previous k-tile of it in flight)
    auto retire = [&](float (&acc)[kAcc], int kt) {
      wgmma_wait<1>();  // the wgmmas of the previous k-tile retired: its stage may be refilled
      fence_operands(acc);
      if (kt > 0) release((it - 1) % kStages);
      ++it;
    };
    auto finish = [&](float (&acc)[kAcc]) {
      wgmma_wait<0>();
      fence_operands(acc);
      release((it - 1) % kStages);  // the item's last stage
    };
    walk_units(stream_k, plan, first, stride, units, k_tiles, [&](int id, int kb, int ke, int piece) {
      const int2 work = work_of(id);
      if (work.x >= num_tiles) return;
      float acc[kAcc];
#pragma unroll
      for (int i = 0; i < kAcc; ++i) acc[i] = 0.0f;
      // kLora with lora_l1_prefetch: the item's LoRA inputs into L1 from k-tile kLoraPrefetchAt on (the slots
      // loaded before the loop have landed by then); whole units only
      LoraL1Prefetch lora_l1;
      const bool l1_prefetch = kLoraL1 && p.lora_l1_prefetch && piece < 0;
      if (l1_prefetch) lora_l1.start(p, work, work.x * kBlockM + row0, lane);
      // lora_wgmma: the tile's main slot (as the producer chose it) and its rank, read while the k-loop runs
      const int main_slot = lora_wgmma && piece < 0 ? lora_main_slot<kBlockM>(p, work.x) : -1;
      const int main_rank = main_slot >= 0 ? __ldg(p.lora_rank + main_slot) : 0;
      // lora_ktile: the slot whose term runs as the item's last k-tile (the producer's rule), read before the loop
      const int ktile_slot = kLora && p.lora_ktile && piece < 0 ? p.lora_tile_slots[work.x] : -1;
      // kLora: the main slot's rows by warpgroup MMAs (lora_wgmma), then every other slot's by add_lora_terms
      auto add_lora = [&](const EpilogueInputs<kBlockM, kBlockN>& in) {
        LoraRows rows(p, in.pair);
        if constexpr (kLoraWgmma) {
          if (main_slot >= 0) {
            mbarrier_wait(&lora_full, lora_loads & 1);
            __syncwarp();  // converged again for the .aligned wgmma instructions
            lora_wgmma_pass<kBlockN>(p, in.pair, rows, main_slot, main_rank, lane, lora_b_tile, acc);
            if (lane == 0) mbarrier_arrive(&lora_empty);
            ++lora_loads;
#pragma unroll
            for (int half = 0; half < 2; ++half) rows.pending[half] = rows.pending[half] && rows.slot[half] != main_slot;
          }
        }
        if (ktile_slot >= 0) {  // those rows' term came with the k-loop
#pragma unroll
          for (int half = 0; half < 2; ++half) rows.pending[half] = rows.pending[half] && rows.slot[half] != ktile_slot;
        }
        add_lora_terms<kBlockN, kLoraBatch>(p, in.expert, work.y, in.pair, lane, acc, rows);
      };
      auto k_loop = [&]() {
        for (int kt = kb; kt < ke; ++kt) {
          issue(acc);
          if (l1_prefetch && kt == min(kLoraPrefetchAt, k_tiles - 1)) lora_l1.issue<kBlockN>(p, work.y, lane);
          retire(acc, kt - kb);
        }
        if (ktile_slot >= 0) {  // z·B[slot, expert]ᵀ of the main slot's rows as one more k-tile
          issue(acc);
          retire(acc, ke - kb);
        }
      };
      // A stream-K piece: whether this CTA finishes the unit (acc then holds every piece's sum)
      auto completes = [&]() {
        if constexpr (!kStreamK) return true;
        else return piece < 0 || stream_k_merge<128 * kConsumers>(p, plan, acc, id - plan.dp_units, piece, first, kb,
                                                                  ke, k_tiles, int(threadIdx.x) - 128, &sk_last);
      };
      // kEpilogueWarps with p.epilogue_lora: the item's LoRA terms are the epilogue warps' (EpilogueStage::drain_lora)
      auto lora_by_epilogue_warps = [&]() { return kEpilogueWarps && p.epilogue_lora && Stage::takes(p, work.y); };
      // kEpilogueWarps: a fused item's outputs into the staging tile (drained by now, normally long since) for
      // the epilogue warps; whether it went there
      auto staged_epilogue = [&](const EpilogueInputs<kBlockM, kBlockN>& in) {
        if constexpr (kEpilogueWarps) {
          if (!Stage::takes(p, work.y)) return false;
          mbarrier_wait(&stage_empty, (staged & 1) ^ 1);
          Stage::put(epilogue_stage, in.pair, p.pairs, row0, lane, in.bias, acc);
          mbarrier_arrive(&stage_full);
          ++staged;
          return true;
        }
        return false;
      };
      // The epilogue's inputs before the k-loop where the registers allow (BLOCK_N 128; with kEpilogueWarps at 192
      // too, whose consumers hold no activation: ptxas, no spills), else after it
      if constexpr ((kBlockN == 128 || kEpilogueWarps) && kConsumers == 2) {
        const EpilogueInputs<kBlockM, kBlockN> in(p, work, row0, lane);  // in flight through the k-loop
        k_loop();
        finish(acc);
        if (!completes()) return;
        if constexpr (kLora) {
          if (!lora_by_epilogue_warps()) add_lora(in);
        }
        if (staged_epilogue(in)) return;
        persistent_epilogue<!kLora && !kStreamK>(p, in, acc);
      } else {
        k_loop();
        finish(acc);
        if (!completes()) return;
        const EpilogueInputs<kBlockM, kBlockN> in(p, work, row0, lane);
        if constexpr (kLora) {
          if (!lora_by_epilogue_warps()) add_lora(in);
        }
        if (staged_epilogue(in)) return;
        persistent_epilogue<!kLora && !kStreamK>(p, in, acc);
      }
    });
  }
  if constexpr (kClusterA) cluster_sync();  // the peer is done writing into this CTA and arriving on it
}

struct GatherRowsKernelParams {
  const __nv_bfloat16* x;       // [rows, in] bf16: x (row = pair / K) or a (row = pair)
  const int32_t* sorted_pairs;  // [capacity] i32
  const int32_t* num_tiles;     // [1] i32
  __nv_bfloat16* out;           // [capacity, in] bf16: row r = the x row of tile row r; padding rows untouched
  int32_t* pair_rows;           // [pairs] i32 or null: pair_rows[pair] = its tile row
  int pairs, row_div, in, block_m;
};

// A warp per tile row (kGatherRowsPerCta rows a CTA; rows of tiles past num_tiles exit), each lane copying
// 16-byte chunks lane, lane + 32, ... four loads in flight before their stores. (One CTA per 128 chunks of a
// row took 22.7 µs at GPT-OSS-20B T 1600 with or without its padding rows: ~31 K CTAs of 2 KB each, perf-log
// run 189.) Padding rows (a tile's rows past its expert's pairs) are not written: a GEMM output row depends on
// its own A row only, and the padding rows' outputs are never stored (gate_up's a in tile order leaves them
// unwritten for down the same way). At GPT-OSS-20B T 1600 they are 22% of the rows.
// PRECOND: in % 8 == 0; x and out 16-byte aligned; blockDim.x == 32 · kGatherRowsPerCta.
constexpr int kGatherRowsPerCta = 8;
__global__ static void __launch_bounds__(32 * kGatherRowsPerCta) gather_rows_kernel(const __grid_constant__ GatherRowsKernelParams p) {
  detail::pdl_enter();  // first: launched by detail::launch (launch.cuh), behind the align that wrote sorted_pairs
  const int row = int(blockIdx.x) * kGatherRowsPerCta + int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  if (row >= *p.num_tiles * p.block_m) return;
  const int pair = p.sorted_pairs[row];
  if (pair >= p.pairs) return;  // padding
  if (p.pair_rows != nullptr && lane == 0) p.pair_rows[pair] = row;
  const uint4* src = reinterpret_cast<const uint4*>(p.x + int64_t(pair / p.row_div) * p.in);
  uint4* dst = reinterpret_cast<uint4*>(p.out + int64_t(row) * p.in);
  const int chunks = p.in / 8;
  for (int c0 = lane; c0 < chunks; c0 += 4 * 32) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int c = c0 + 32 * u;
      if (c < chunks) v[u] = src[c];
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int c = c0 + 32 * u;
      if (c < chunks) dst[c] = v[u];
    }
  }
}

struct ActivationKernelParams {
  const __nv_bfloat16* h;  // [P, 2I] bf16
  __nv_bfloat16* a;        // [P, I] bf16
  int64_t rows;            // P
  int64_t inter;           // I
  bool halves;
  bool gpt_oss;
  float swiglu_alpha;
  float swiglu_limit;
  float* delta;            // [P, 2I] f32 or null (MoeActivationParams::delta)
};

// v = bf16(v + term) where the term is nonzero (v holds a bf16 value; the expand's y += delta rounding): the 8
// f32 terms at `terms` (16-byte aligned). Loads only: the caller zeroes the terms after all its loads
// (zero8), so that no store sits between loads the compiler could otherwise issue together (a store there
// made each a round trip of its own: the combine 4.5 → 13.1 µs a call, perf-log run 153).
__device__ __forceinline__ void add_terms8(const float* terms, float (&v)[8]) {
  const float4 lo = reinterpret_cast<const float4*>(terms)[0], hi = reinterpret_cast<const float4*>(terms)[1];
  const float t[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = t[j] != 0.0f ? __bfloat162float(__float2bfloat16_rn(v[j] + t[j])) : v[j];
}
__device__ __forceinline__ void zero8(float* terms) {
  reinterpret_cast<float4*>(terms)[0] = reinterpret_cast<float4*>(terms)[1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
}
__device__ __forceinline__ float add_term(float term, float v) {
  return term != 0.0f ? __bfloat162float(__float2bfloat16_rn(v + term)) : v;
}

// One thread per kOut (8, or 4 with kTerms) consecutive outputs of a row. Its inputs are two runs of kOut h
// elements (halves: the gates, then the ups; interleaved: the 2·kOut values g0 u0 g1 u1 ... in two halves),
// with kTerms (p.delta set) also their 2·kOut f32 terms; every load is issued before any value is used, then
// the terms are zeroed and the kOut outputs stored as one vector. kOut 4 with the terms: at 8 (six 16-byte
// loads) ptxas issued the last load only after the first had returned and been used, a DRAM round trip of
// its own (8.1 µs a call against 3.75 without terms, perf-log run 154); at 4 the four loads go out together
// and twice the threads share the work (360 CTAs at 64 pairs).
// PRECOND: I % 8 == 0, h and a 16-byte aligned (delta as MoeActivationParams says); rows·inter / kOut < 2^31.
constexpr int kActivationThreads = 128;
template <bool kTerms, int kOut>
__global__ static void __launch_bounds__(kActivationThreads) activation_vec_kernel(const __grid_constant__ ActivationKernelParams p) {
  static_assert(kOut == 4 || kOut == 8);
  using Raw = std::conditional_t<kOut == 8, uint4, uint2>;  // kOut bf16
  detail::pdl_enter();  // first: launched by detail::launch (launch.cuh)
  const int per_row = int(p.inter / kOut);
  const int index = int(blockIdx.x) * kActivationThreads + int(threadIdx.x);
  if (index >= int(p.rows) * per_row) return;
  const int row = index / per_row, i0 = (index - row * per_row) * kOut;
  const int64_t first = int64_t(row) * 2 * p.inter + (p.halves ? i0 : 2 * i0);  // elements of h and delta
  const int64_t second = p.halves ? first + p.inter : first + kOut;
  const Raw raw0 = *reinterpret_cast<const Raw*>(p.h + first), raw1 = *reinterpret_cast<const Raw*>(p.h + second);
  float4 term[kOut / 2];
  if constexpr (kTerms) {
#pragma unroll
    for (int j = 0; j < kOut / 4; ++j) {
      term[j] = reinterpret_cast<const float4*>(p.delta + first)[j];
      term[kOut / 4 + j] = reinterpret_cast<const float4*>(p.delta + second)[j];
    }
  }
  float v[2 * kOut];  // the first run, then the second
  const auto* pairs0 = reinterpret_cast<const __nv_bfloat162*>(&raw0);
  const auto* pairs1 = reinterpret_cast<const __nv_bfloat162*>(&raw1);
#pragma unroll
  for (int j = 0; j < kOut / 2; ++j) {
    const float2 a = __bfloat1622float2(pairs0[j]), b = __bfloat1622float2(pairs1[j]);
    v[2 * j] = a.x, v[2 * j + 1] = a.y, v[kOut + 2 * j] = b.x, v[kOut + 2 * j + 1] = b.y;
  }
  if constexpr (kTerms) {
    const float* t = reinterpret_cast<const float*>(term);
#pragma unroll
    for (int j = 0; j < 2 * kOut; ++j) v[j] = add_term(t[j], v[j]);
#pragma unroll
    for (int j = 0; j < kOut / 4; ++j) {
      reinterpret_cast<float4*>(p.delta + first)[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      reinterpret_cast<float4*>(p.delta + second)[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
  }
  Raw packed;
  auto* out_pairs = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
  for (int j = 0; j < kOut / 2; ++j) {
    float o[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {  // output i: halves gate v[i], up v[kOut + i]; interleaved v[2i], v[2i + 1]
      const int i = 2 * j + e;
      const float gate = p.halves ? v[i] : v[2 * i], up = p.halves ? v[kOut + i] : v[2 * i + 1];
      o[e] = activate(gate, up, p.gpt_oss, p.swiglu_alpha, p.swiglu_limit);
    }
    out_pairs[j] = __floats2bfloat162_rn(o[0], o[1]);  // round to nearest even, as store8
  }
  *reinterpret_cast<Raw*>(p.a + int64_t(row) * p.inter + i0) = packed;
}

// One thread per output element (any I or alignment). PRECOND: grid covers rows·inter.
__global__ static void activation_kernel(const __grid_constant__ ActivationKernelParams p) {
  detail::pdl_enter();  // first: launched by detail::launch (launch.cuh)
  const int64_t index = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= p.rows * p.inter) return;
  const int64_t row = index / p.inter, i = index % p.inter;
  const __nv_bfloat16* h = p.h + row * 2 * p.inter;
  const int64_t gate_at = p.halves ? i : 2 * i, up_at = p.halves ? p.inter + i : 2 * i + 1;
  float gate = __bfloat162float(h[gate_at]), up = __bfloat162float(h[up_at]);
  if (p.delta != nullptr) {
    float* terms = p.delta + row * 2 * p.inter;
    gate = add_term(terms[gate_at], gate);
    up = add_term(terms[up_at], up);
    terms[gate_at] = terms[up_at] = 0.0f;
  }
  p.a[index] = __float2bfloat16_rn(activate(gate, up, p.gpt_oss, p.swiglu_alpha, p.swiglu_limit));
}

struct CombineKernelParams {
  const __nv_bfloat16* d;     // [T*K, H] bf16
  const float* topk_weights;  // [T, K] f32
  __nv_bfloat16* out;         // [T, H] bf16
  int64_t tokens;             // T
  int64_t hidden;             // H
  int top_k;                  // K
  float4* clear;              // MoeCombineParams::clear, or null
  int64_t clear_vectors;      // its numel / 4
  float* delta;               // [T*K, H] f32 or null (MoeCombineParams::delta)
};

// One thread per kVec consecutive outputs of one token; Σ_k in k order, fp32. kTopK > 0: K known at compile
// time (2, 4, 8), so the k loop unrolls and every load of it (weights, d rows, terms) is in flight at once; 0:
// p.top_k at run time. kTerms: p.delta is set (the terms are added, then zeroed after all the loads). The
// terms come from DRAM (the down GEMM's weights stream through L2 after the side expand wrote them), so a k
// loop of one round trip per k was 13 µs a call against 4.5 without terms (perf-log runs 153–154).
// PRECOND: kVec == 1, or H % 8 == 0 and d, out 16-byte aligned (kVec == 8); kTopK 0 or p.top_k.
// 128-thread CTAs (45 at T 16, where 256 left 23 SMs with work); the launch bounds' minimum of 4 CTAs an SM
// gives ptxas a budget of 128 registers: without one it kept the kernel small and split the kTopK = 4 loads
// with terms (16 a thread) into several groups, each a round trip (perf-log run 157).
constexpr int kCombineThreads = 128;
template <int kVec, int kTopK, bool kTerms>
__global__ static void __launch_bounds__(kCombineThreads, 4) combine_kernel(const __grid_constant__ CombineKernelParams p) {
  detail::pdl_enter();  // first: launched by detail::launch (launch.cuh)
  const int top_k = kTopK > 0 ? kTopK : p.top_k;
  const int64_t per_token = p.hidden / kVec;
  const int64_t index = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index < p.clear_vectors) p.clear[index] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (index >= p.tokens * per_token) return;
  const int64_t t = index / per_token, h0 = (index % per_token) * kVec;
  float acc[kVec] = {};
  if constexpr (kTopK > 0 && kVec == 8) {
    // Every load first (raw), then the math: one round trip for the thread.
    uint4 raw[kTopK];
    float4 terms[kTerms ? 2 * kTopK : 1];
    float w[kTopK];
#pragma unroll
    for (int k = 0; k < kTopK; ++k) {
      const int64_t row = t * kTopK + k;
      w[k] = p.topk_weights[row];
      raw[k] = *reinterpret_cast<const uint4*>(p.d + row * p.hidden + h0);
      if constexpr (kTerms) {
        terms[2 * k] = reinterpret_cast<const float4*>(p.delta + row * p.hidden + h0)[0];
        terms[2 * k + 1] = reinterpret_cast<const float4*>(p.delta + row * p.hidden + h0)[1];
      }
    }
#pragma unroll
    for (int k = 0; k < kTopK; ++k) {
      float v[8];
      detail::widen8(raw[k], v);
      if constexpr (kTerms) {
        const float4 lo = terms[2 * k], hi = terms[2 * k + 1];
        const float tk[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = add_term(tk[j], v[j]);
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] += w[k] * v[j];
    }
  } else {
#pragma unroll
  for (int k = 0; k < top_k; ++k) {
    const float w = p.topk_weights[t * top_k + k];
    const __nv_bfloat16* d = p.d + (t * top_k + k) * p.hidden + h0;
    float v[kVec];
    if constexpr (kVec == 8) {
      detail::load8(d, v);
      if constexpr (kTerms) add_terms8(p.delta + (t * top_k + k) * p.hidden + h0, v);
    } else {
      v[0] = __bfloat162float(d[0]);
      if constexpr (kTerms) v[0] = add_term(p.delta[(t * top_k + k) * p.hidden + h0], v[0]);
    }
#pragma unroll
    for (int j = 0; j < kVec; ++j) acc[j] += w * v[j];
  }
  }
  if constexpr (kTerms) {  // after every load of the loops above
#pragma unroll
    for (int k = 0; k < top_k; ++k) {
      float* terms = p.delta + (t * top_k + k) * p.hidden + h0;
      if constexpr (kVec == 8) {
        zero8(terms);
      } else {
        terms[0] = 0.0f;
      }
    }
  }
  if constexpr (kVec == 8) {
    detail::store8(p.out + t * p.hidden + h0, acc);
  } else {
    p.out[t * p.hidden + h0] = __float2bfloat16_rn(acc[0]);
  }
}

template <int kVec, int kTopK>
void launch_combine(bool terms, unsigned blocks, cudaStream_t stream, const CombineKernelParams& params) {
  if (terms) {
    detail::launch(combine_kernel<kVec, kTopK, true>, dim3(blocks), dim3(kCombineThreads), 0, stream, params);
  } else {
    detail::launch(combine_kernel<kVec, kTopK, false>, dim3(blocks), dim3(kCombineThreads), 0, stream, params);
  }
}
template <int kVec>
void launch_combine(int top_k, bool terms, unsigned blocks, cudaStream_t stream, const CombineKernelParams& params) {
  switch (top_k) {
    case 2: launch_combine<kVec, 2>(terms, blocks, stream, params); break;
    case 4: launch_combine<kVec, 4>(terms, blocks, stream, params); break;
    case 8: launch_combine<kVec, 8>(terms, blocks, stream, params); break;
    default: launch_combine<kVec, 0>(terms, blocks, stream, params); break;
  }
}

// ---- launchers ----------------------------------------------------------------------------------------

[[noreturn]] void fail(const char* op, const std::string& message) {
  std::fprintf(stderr, "loramux: cuda::%s called against its contract: %s\n", op, message.c_str());
  std::abort();
}

bool is_bf16_matrix(const Tensor& t, int64_t rows, int64_t cols) {
  return t.dtype == DType::BF16 && t.ndim == 2 && t.dim(0) == rows && t.dim(1) == cols;
}

std::string dims(std::initializer_list<int64_t> values) {
  std::string s = "[";
  for (int64_t v : values) s += (s.size() > 1 ? ", " : "") + std::to_string(v);
  return s + "]";
}

// The tiles' tensors: I32 on cuda, sizes consistent with block_m; returns max_tiles.
int64_t check_tiles(const char* op, const MoeExpertTiles& t) {
  detail::require_cuda(op, {{"tiles.sorted_pairs", &t.sorted_pairs}, {"tiles.tile_group", &t.tile_group},
                            {"tiles.num_tiles", &t.num_tiles}});
  if (t.block_m != kMoeGemmBlockMDecode && t.block_m != kMoeGemmBlockMPrefill && t.block_m != kMoeGemmBlockMLarge) {
    fail(op, "tiles.block_m = " + std::to_string(t.block_m) + ": the GEMM is built for BLOCK_M 16, 64 or 128 only");
  }
  const int64_t max_tiles = t.tile_group.numel();
  if (t.tile_group.dtype != DType::I32) detail::contract_failure(op, "tiles.tile_group", t.tile_group, "I32");
  if (t.sorted_pairs.dtype != DType::I32 || t.sorted_pairs.numel() < max_tiles * t.block_m) {
    detail::contract_failure(op, "tiles.sorted_pairs", t.sorted_pairs,
                             ("I32 with at least tile_group.numel() * block_m = " +
                              std::to_string(max_tiles * t.block_m) + " elements").c_str());
  }
  if (t.num_tiles.dtype != DType::I32 || t.num_tiles.numel() != 1) {
    detail::contract_failure(op, "tiles.num_tiles", t.num_tiles, "[1] I32");
  }
  LMX_CHECK(max_tiles < 0x7fffffff);
  return max_tiles;
}

// Weight [E, n, in] and optional bias [E, n], bf16 on cuda, 16-byte aligned, in % 8 == 0.
void check_weight(const char* op, const char* name, const Tensor& w, const char* bias_name, const Tensor& bias,
                  int64_t n, int64_t in) {
  if (w.dtype != DType::BF16 || w.ndim != 3 || w.dim(1) != n || w.dim(2) != in || !detail::aligned16(w.data)) {
    detail::contract_failure(op, name, w, ("[E, " + std::to_string(n) + ", " + std::to_string(in) +
                                           "] BF16, 16-byte aligned").c_str());
  }
  detail::require_cuda(op, {{name, &w}});
  if (bias.defined()) {
    if (bias.dtype != DType::BF16 || bias.ndim != 2 || bias.dim(0) != w.dim(0) || bias.dim(1) != n) {
      detail::contract_failure(op, bias_name, bias, dims({w.dim(0), n}).append(" BF16").c_str());
    }
    detail::require_cuda(op, {{bias_name, &bias}});
  }
}

MoeGemmKernel gemm_kernel = MoeGemmKernel::kAuto;  // set_moe_gemm_kernel
bool gemm_multicast = false;                        // set_moe_gemm_multicast (measured slower: run 39)
bool gemm_compact_epilogue = true;                  // set_moe_gemm_compact_epilogue
bool gemm_stream_k = false;                         // set_moe_gemm_stream_k
bool gemm_epilogue_warps = true;   // set_moe_gemm_epilogue_warps (perf-log run 246: prefill −0.4…−0.6 ms, H100)
bool gemm_epilogue_lora = false;                    // set_moe_gemm_epilogue_lora
bool gemm_lora_ktile = true;       // set_moe_gemm_lora_ktile (run 246: gate_up T 1600 one adapter 630 → 567 µs)
bool gemm_epilogue_down = false;                    // set_moe_gemm_epilogue_down
bool gemm_mxfp4 = true;                             // set_moe_gemm_mxfp4
int gemm_mxfp4_block_n = 64, gemm_mxfp4_stages = 8, gemm_mxfp4_ctas = 6;  // set_moe_gemm_mxfp4_shape (runs 132-133)
bool lora_in_mxfp4_gemm = false;                    // set_moe_lora_in_mxfp4_gemm
bool lora_fork_shrinks = true;                      // set_moe_lora_fork_shrinks (perf-log run 135)
bool lora_side_expands = true;                      // set_moe_lora_side_expands (perf-log run 149)
bool gemm_early_trigger = false;                    // set_moe_gemm_early_trigger
bool lora_gemm_wgmma = false;                       // set_moe_lora_gemm_wgmma
bool a_in_tile_order = true;                        // set_moe_block_a_in_tile_order
bool shrink_runs_hint = true;                       // set_moe_lora_shrink_runs_hint
bool shrink_runs_split = true;  // set_moe_lora_shrink_runs_split (run 117: block 1002 -> 989 us at T 1600)
int gemm_large_block_n = 0;                         // set_moe_gemm_large_block_n (0: large_block_n_for)
// moe_block's down GEMM at BLOCK_M 128 on the persistent kernel (0: large_block_n_for): BLOCK_N 256 took
// GPT-OSS-20B T 1600 down 335 → 289 µs, T 4096 667 → 657 (perf-log run 43; gate_up stayed at 128: 552 vs 624).
int block_down_block_n = 0;                         // set_moe_block_down_block_n
int block_cta_group = 8;                            // set_moe_block_cta_group
int block_down_decode_stages = 0;                   // set_moe_block_down_decode_stages (perf-log runs 175-179)
int block_decode_block_n[2] = {0, 0};               // set_moe_block_decode_block_n: gate_up, down (0: 64)

// BLOCK_N of 128-row tiles on the warp-specialized kernels by the output width n: 192 where n is a multiple
// of it (GPT-OSS-20B's 5760 and 2880: 1.2× the FLOPs per staged byte of 128 with no partial column block;
// T 4096 gate_up 1271 → 1155 µs, down 660 → 599 against 256, prefill 31.05 → 29.19 ms, perf-log run 91),
// else `otherwise` (gate_up 128, down 256, as before).
int large_block_n_for(int64_t n, int otherwise) { return n % 192 == 0 ? 192 : otherwise; }
// moe_block's down at 128-row tiles on the persistent kernel without LoRA terms or the stream-K tail: 240
// instead of 192 where both divide n (GPT-OSS-20B's 2880 = 12 × 240): 1.06× the FLOPs per staged byte, and at
// T 1600 64 tiles × 12 blocks are 5.8 rounds of 132 CTAs (6 paid) where × 15 blocks of 192 are 7.3 (8 paid).
// Measured on an H100 (perf-log run 187, three rounds each): block T 1600 896 → 877 µs, T 4096 1870 → 1851,
// T 3072 1443 → 1419, T 2048 level; prefill of one 1600-token prompt 30.38 → 29.91 ms.
// With the epilogue warps on down (set_moe_gemm_epilogue_down) it stays at 192: 240's 4 stages of 47 KB leave no
// room for the staging tile.
int down_block_n_for(int64_t n, bool plain) {
  const int by_width = large_block_n_for(n, 256);
  const bool staged = gemm_epilogue_warps && gemm_epilogue_down;
  return plain && by_width == 192 && n % 240 == 0 && !staged ? 240 : by_width;
}
// The fold measured slower with the per-column epilogue (perf-log runs 34-35: prefill 1600 with an adapter
// 53.4 ms folded vs 47.6 added into h) and level with its kFusedDelta form (run 46: 42.63 vs 42.65 ms), so
// it is off unless a bench or test asks for it.
bool lora_in_epilogue = false;                     // set_moe_lora_in_epilogue
MoeLoraInGemm lora_in_gemm = MoeLoraInGemm::kLongRuns;  // set_moe_lora_in_gemm
bool lora_l1_prefetch = true;                      // set_moe_lora_l1_prefetch
bool halves_by_tma = true;                         // set_moe_gemm_halves_by_tma
bool lora_halves = true;           // set_moe_gemm_lora_halves (run 247: Qwen3 prompt with an adapter 55.6 → 49.4 ms)
bool decode_weight_by_tma = true;                   // set_moe_decode_weight_by_tma (perf-log run 215)
bool mxfp4_weight_by_bulk = false;                  // set_moe_mxfp4_weight_by_bulk

// The kernel one launch runs (BLOCK_M 64/128): kAuto takes the persistent warp-specialized kernel when both
// operands can come by TMA — the A rows gathered (sorted_rows given) and a weight tile of one box (not the
// fused halves layout) — and the ring otherwise. GPT-OSS-20B T 4096 block 2659 → 2360 µs, prefill 38.9 →
// 35.7 ms (perf-log run 30).
// The fused halves layout (Qwen3, Mixtral: gate rows, then up rows) comes by TMA too at 128-row tiles with
// halves_by_tma (the default; tensor_map_halves). Not at 64: Qwen3-30B-A3B's T 1600 (BLOCK_M 64) gate_up took
// ~490 µs a layer on the one-consumer persistent kernel against the ring's 380 (perf-log run 201).
bool halves_on_tma(int block_m) { return halves_by_tma && block_m == kMoeGemmBlockMLarge; }
// Whether the persistent kernel adds MoE-LoRA terms (MoeGemmLora) for a weight in the fused halves layout.
bool lora_on_halves(int block_m) { return lora_halves && halves_on_tma(block_m); }
MoeGemmKernel kernel_for(int block_m, bool gathered, bool halves) {
  if (gemm_kernel != MoeGemmKernel::kAuto || block_m == kMoeGemmBlockMDecode) return gemm_kernel;
  return gathered && (!halves || halves_on_tma(block_m)) ? MoeGemmKernel::kWgmmaWarpSpecialized : MoeGemmKernel::kWgmma;
}

// Optional scratch for the gathered A rows: [capacity of the tiles, in] BF16 on cuda, 16-byte aligned.
void check_sorted_rows(const char* op, const Tensor& sorted_rows, const MoeExpertTiles& tiles, int64_t in) {
  if (!sorted_rows.defined()) return;
  const int64_t capacity = tiles.sorted_pairs.dim(0);
  if (!is_bf16_matrix(sorted_rows, capacity, in) || !detail::aligned16(sorted_rows.data) ||
      sorted_rows.device != Device::kCuda) {
    detail::contract_failure(op, "sorted_rows", sorted_rows,
                             (dims({capacity, in}) + " BF16 on cuda (capacity of the tiles), 16-byte aligned").c_str());
  }
}

// Whether launch_gemm runs the persistent kernel: BLOCK_M 64/128, the A rows gathered (or given) in tile order,
// the weight one TMA box (not the fused halves layout), and kAuto or the warp-specialized kernel.
bool runs_persistent(int block_m, bool gathered, bool halves) {
  return block_m != kMoeGemmBlockMDecode && gathered && (!halves || halves_on_tma(block_m)) &&
         kernel_for(block_m, gathered, halves) == MoeGemmKernel::kWgmmaWarpSpecialized;
}

void check_decode_stages(const char* op, int decode_stages) {
  if (decode_stages != 0 && (decode_stages < 4 || decode_stages > 6)) {
    fail(op, "decode_stages = " + std::to_string(decode_stages) + ": built for 4, 5 or 6 (0 = default)");
  }
}

void check_block_n(const char* op, int block_n, int block_m, MoeGemmKernel kernel) {
  if (block_n != 0 && block_n != 64 && block_n != 128 && block_n != 192 && block_n != 240 && block_n != 256) {
    fail(op, "block_n = " + std::to_string(block_n) +
                 ": the GEMM is built for BLOCK_N 64, 128, 192, 240 (down only) or 256 (0 = default)");
  }
  if (block_n == 240 && !(block_m == kMoeGemmBlockMLarge && kernel == MoeGemmKernel::kWgmmaWarpSpecialized)) {
    fail(op, "block_n = 240: built only for tiles.block_m 128 on the warp-specialized wgmma kernel");
  }
  if (block_n == 192 && !(block_m == kMoeGemmBlockMLarge && kernel == MoeGemmKernel::kWgmmaWarpSpecialized)) {
    fail(op, "block_n = 192: built only for tiles.block_m 128 on the warp-specialized wgmma kernel");
  }
  if (block_m == kMoeGemmBlockMLarge && block_n == 64) {
    fail(op, "block_n = 64 with tiles.block_m = 128: BLOCK_M 128 is built for BLOCK_N 128 or 256 only");
  }
  if (block_n == 256 && !(block_m == kMoeGemmBlockMLarge && kernel == MoeGemmKernel::kWgmma) &&
      !(block_m != kMoeGemmBlockMDecode && kernel == MoeGemmKernel::kWgmmaWarpSpecialized)) {
    fail(op, "block_n = 256: built only for tiles.block_m 64 and 128 on the warp-specialized wgmma kernel and "
             "tiles.block_m 128 on the wgmma ring kernel");
  }
  if (block_n == 64 && block_m != kMoeGemmBlockMDecode && kernel == MoeGemmKernel::kWgmmaWarpSpecialized) {
    fail(op, "block_n = 64: the warp-specialized wgmma kernel (tiles.block_m 64/128) is built for BLOCK_N 128 or "
             "256 only");
  }
}

using GemmKernel = void (*)(GemmKernelParams);
struct PreparedKernel {
  GemmKernel kernel;
  int threads;
  size_t shared_bytes;
};

template <int kBlockM, int kBlockN, int kWarpsM, int kWarpsN, int kStages, bool kEvenK, bool kWeightByTma = false>
PreparedKernel prepared_kernel() {
  const size_t shared_bytes =
      size_t(kStages) * (kBlockM + kBlockN) * kBlockK * sizeof(__nv_bfloat16) + (kWeightByTma ? 1024 : 0);
  GemmKernel kernel = grouped_gemm_kernel<kBlockM, kBlockN, kWarpsM, kWarpsN, kStages, kEvenK, kWeightByTma>;
  // Once per instantiation and process (before any graph capture: the first launch is never captured
  // in our callers, who warm up first).
  static const bool attribute_set = [&] {
    LMX_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared_bytes)));
    return true;
  }();
  (void)attribute_set;
  return {kernel, 32 * kWarpsM * kWarpsN, shared_bytes};
}

// The MXFP4 decode GEMM's shapes (set_moe_gemm_mxfp4_shape). 128 columns × 8 stages: 51 KB a CTA, 4 CTAs an
// SM, ~120 KB of weight in flight — Nsight (perf-log run 121): 16 warps an SM issue on 54% of the cycles,
// DRAM at 41%: latency-bound. The others trade stages for resident warps: 128 × 4 (the default since run
// 123) and 128 × 5 at 6 CTAs (80 registers), 128 × 4 and 128 × 3 at 8 (64 registers, a 4-byte spill: slower,
// run 125). Since the cheaper decode (run 132) 64 columns × 8 stages at 6 CTAs is the default (twice the CTAs,
// half the B registers a lane); 64 × 12 at 4 CTAs and 64 × 6 at 8 are its neighbours for the sweep.
template <int kBlockN, int kStages, int kMinBlocks, bool kWeightByBulk>
PreparedKernel prepared_mxfp4_kernel() {
  const size_t shared_bytes = size_t(kStages) * kMxfp4StageBytes<kBlockN>;
  GemmKernel kernel = grouped_gemm_mxfp4_kernel<kBlockN, kStages, kMinBlocks, kWeightByBulk>;
  static const bool attribute_set = [&] {
    LMX_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared_bytes)));
    return true;
  }();
  (void)attribute_set;
  return {kernel, 128, shared_bytes};
}
template <bool kWeightByBulk>
PreparedKernel prepared_mxfp4_kernel(int block_n, int stages, int ctas_per_sm) {
  if (block_n == 64) {
    if (stages == 12) return prepared_mxfp4_kernel<64, 12, 4, kWeightByBulk>();
    return stages == 6 ? prepared_mxfp4_kernel<64, 6, 8, kWeightByBulk>() : prepared_mxfp4_kernel<64, 8, 6, kWeightByBulk>();
  }
  if (stages == 3) return prepared_mxfp4_kernel<128, 3, 8, kWeightByBulk>();
  if (stages == 5) return prepared_mxfp4_kernel<128, 5, 6, kWeightByBulk>();
  if (stages == 4) {
    return ctas_per_sm == 8 ? prepared_mxfp4_kernel<128, 4, 8, kWeightByBulk>()
                            : prepared_mxfp4_kernel<128, 4, 6, kWeightByBulk>();
  }
  if (stages == 6) return prepared_mxfp4_kernel<128, 6, 5, kWeightByBulk>();
  return prepared_mxfp4_kernel<128, 8, 4, kWeightByBulk>();
}

template <int kBlockM, int kBlockN, int kWarpsM, int kWarpsN, int kStages, bool kWeightByTma = false>
PreparedKernel prepared_kernel(bool even_k) {
  return even_k ? prepared_kernel<kBlockM, kBlockN, kWarpsM, kWarpsN, kStages, true, kWeightByTma>()
                : prepared_kernel<kBlockM, kBlockN, kWarpsM, kWarpsN, kStages, false, kWeightByTma>();
}
// The bf16 decode GEMM (BLOCK_M 16 × BLOCK_N 64) at 4, 5 or 6 stages, its weight by cp.async or by TMA.
template <bool kWeightByTma>
PreparedKernel prepared_decode_kernel(int decode_stages, bool even_k) {
  if (decode_stages == 4) return prepared_kernel<16, 64, 1, 4, 4, kWeightByTma>(even_k);
  if (decode_stages == 5) return prepared_kernel<16, 64, 1, 4, 5, kWeightByTma>(even_k);
  return prepared_kernel<16, 64, 1, 4, 6, kWeightByTma>(even_k);
}

template <int kWarpgroups, int kBlockN, int kStages, bool kEvenK>
PreparedKernel prepared_wgmma_kernel() {
  const size_t shared_bytes = size_t(kStages) * (64 * kWarpgroups + kBlockN) * kBlockK * sizeof(__nv_bfloat16) + 1024;
  GemmKernel kernel = grouped_gemm_wgmma_kernel<kWarpgroups, kBlockN, kStages, kEvenK>;
  static const bool attribute_set = [&] {
    LMX_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared_bytes)));
    return true;
  }();
  (void)attribute_set;
  return {kernel, 128 * kWarpgroups, shared_bytes};
}

template <int kConsumers, int kBlockN, int kStages, bool kEvenK>
PreparedKernel prepared_ws_kernel() {
  const size_t shared_bytes = size_t(kStages) * (64 * kConsumers + kBlockN) * kBlockK * sizeof(__nv_bfloat16) + 1024;
  GemmKernel kernel = grouped_gemm_ws_kernel<kConsumers, kBlockN, kStages, kEvenK>;
  static const bool attribute_set = [&] {
    LMX_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared_bytes)));
    return true;
  }();
  (void)attribute_set;
  return {kernel, 128 * (kConsumers + 1), shared_bytes};
}

// The persistent kernel and how many of its CTAs fit one SM (occupancy, asked once per instantiation).
struct PreparedPersistentKernel {
  PreparedKernel kernel;
  int ctas_per_sm;
};
template <int kConsumers, int kBlockN, int kStages, bool kLora = false, bool kStreamK = false,
          bool kEpilogueWarps = false>
PreparedPersistentKernel prepared_persistent_kernel() {
  // + the BLOCK_M 128 LoRA kernels' B slice buffer (lora_wgmma): 16–32 KB, within the 227 KB a CTA may hold
  const size_t lora_tile_bytes =
      kLora && kConsumers == 2 && !kEpilogueWarps ? size_t(kBlockN) * kBlockK * sizeof(__nv_bfloat16) : 0;
  // + the epilogue warps' staging tile (EpilogueStage: 51 KB at BLOCK_N 192, 35 KB at 128), in place of that slice
  const size_t stage_bytes = kEpilogueWarps ? size_t(EpilogueStage<64 * kConsumers, kBlockN>::kBytes) : 0;
  const size_t shared_bytes = size_t(kStages) * (64 * kConsumers + kBlockN) * kBlockK * sizeof(__nv_bfloat16) +
                              lora_tile_bytes + stage_bytes + 1024;
  GemmKernel kernel = grouped_gemm_persistent_kernel<kConsumers, kBlockN, kStages, false, kLora, kStreamK, kEpilogueWarps>;
  constexpr int kThreads = 128 * (kConsumers + 1);
  static const int ctas_per_sm = [&] {
    LMX_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared_bytes)));
    int blocks = 0;
    LMX_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, shared_bytes));
    return std::max(blocks, 1);
  }();
  return {{kernel, kThreads, shared_bytes}, ctas_per_sm};
}

// The multicast-A persistent kernel (BLOCK_M 128 × BLOCK_N 128, clusters of 2) and how many of its
// clusters are resident at once (asked once).
struct PreparedClusterKernel {
  PreparedKernel kernel;
  int clusters;
};
// The launch configuration of `clusters` clusters of 2 CTAs along x.
struct ClusterPairLaunch {
  cudaLaunchAttribute attribute{};
  cudaLaunchConfig_t config{};
  ClusterPairLaunch(const PreparedKernel& k, unsigned clusters, cudaStream_t stream) {
    attribute.id = cudaLaunchAttributeClusterDimension;
    attribute.val.clusterDim.x = 2;
    attribute.val.clusterDim.y = 1;
    attribute.val.clusterDim.z = 1;
    config.gridDim = dim3(2 * clusters);
    config.blockDim = dim3(unsigned(k.threads));
    config.dynamicSmemBytes = k.shared_bytes;
    config.stream = stream;
    config.attrs = &attribute;
    config.numAttrs = 1;
  }
  ClusterPairLaunch(const ClusterPairLaunch&) = delete;  // config.attrs points into this object
  ClusterPairLaunch& operator=(const ClusterPairLaunch&) = delete;
};
PreparedClusterKernel prepared_cluster_kernel() {
  constexpr int kStages = 6, kThreads = 384;
  const size_t shared_bytes = size_t(kStages) * (128 + 128) * kBlockK * sizeof(__nv_bfloat16) + 1024;
  GemmKernel kernel = grouped_gemm_persistent_kernel<2, 128, kStages, true>;
  static const int clusters = [&] {
    LMX_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared_bytes)));
    ClusterPairLaunch launch({kernel, kThreads, shared_bytes}, unsigned(multiprocessor_count()), nullptr);
    int n = 0;
    LMX_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&n, kernel, &launch.config));
    return std::max(n, 1);
  }();
  return {{kernel, kThreads, shared_bytes}, clusters};
}


template <int kConsumers, int kBlockN, int kStages>
PreparedKernel prepared_ws_kernel(bool even_k) {
  return even_k ? prepared_ws_kernel<kConsumers, kBlockN, kStages, true>()
                : prepared_ws_kernel<kConsumers, kBlockN, kStages, false>();
}

template <int kWarpgroups, int kBlockN, int kStages>
PreparedKernel prepared_wgmma_kernel(bool even_k) {
  return even_k ? prepared_wgmma_kernel<kWarpgroups, kBlockN, kStages, true>()
                : prepared_wgmma_kernel<kWarpgroups, kBlockN, kStages, false>();
}

// A row-major bf16 matrix [rows, in] as a 2-D tensor map for the warp-specialized kernel's TMA: boxes of
// box_rows × 64 k, 128-byte swizzle (the layout the wgmma descriptors expect), zeros out of bounds: the
// weight [E, n, in] as [E·n, in] (boxes of BLOCK_N rows), the gathered A rows (boxes of BLOCK_M rows).
// Encoded per launch on the host (a pure function of the pointer and shape; no device work), so graphs
// capture it as a kernel parameter.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    LMX_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
    LMX_CHECK(found == cudaDriverEntryPointSuccess && fn != nullptr);
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

CUtensorMap tensor_map_2d(const __nv_bfloat16* data, int64_t rows, int64_t in, int box_rows, const char* what) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  CUtensorMap map{};
  const cuuint64_t dims[2] = {cuuint64_t(in), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(in) * sizeof(__nv_bfloat16)};
  const cuuint32_t box[2] = {cuuint32_t(kBlockK), cuuint32_t(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult status = encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<__nv_bfloat16*>(data), dims,
                                 strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                 CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                 CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (status != CUDA_SUCCESS) {
    fail("moe_gemm", "cuTensorMapEncodeTiled failed (" + std::to_string(int(status)) + ") for " + what + " [" +
                         std::to_string(rows) + ", " + std::to_string(in) + "]");
  }
  return map;
}

// The fused halves layout's weight [E, 2I, in] as 4 dimensions, innermost first: k (in), half (gate 0 / up 1, a
// stride of I rows), i (I rows), expert (2I rows). A box {64, 2, box_rows / 2, 1} lands in shared memory as
// box_rows rows ordered (i, half): gate row i, up row i, gate row i + 1, ... — the interleaved layout's
// logical columns 2i, 2i + 1, with the same 128-byte swizzle per 64-element row as tensor_map_2d's box. Rows
// of i past I are zero-filled (a partial last column block never reads the next expert's rows).
CUtensorMap tensor_map_halves(const __nv_bfloat16* data, int64_t experts, int64_t inter, int64_t in, int box_rows) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  CUtensorMap map{};
  const cuuint64_t row = cuuint64_t(in) * sizeof(__nv_bfloat16);
  const cuuint64_t dims[4] = {cuuint64_t(in), 2, cuuint64_t(inter), cuuint64_t(experts)};
  const cuuint64_t strides[3] = {row * cuuint64_t(inter), row, row * 2 * cuuint64_t(inter)};
  const cuuint32_t box[4] = {cuuint32_t(kBlockK), 2, cuuint32_t(box_rows / 2), 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUresult status = encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, const_cast<__nv_bfloat16*>(data), dims,
                                 strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                 CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                 CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (status != CUDA_SUCCESS) {
    fail("moe_gemm", "cuTensorMapEncodeTiled failed (" + std::to_string(int(status)) + ") for the halves weight [" +
                         std::to_string(experts) + ", 2 x " + std::to_string(inter) + ", " + std::to_string(in) + "]");
  }
  return map;
}

// The one dispatch on tile configuration (BLOCK_N 0 = the default of the BLOCK_M):
//  BLOCK_M 16: BLOCK_N 64 (default; 1×4 warps of 16×16, 6 stages, 60 KB, 3 CTAs per SM: twice the CTAs of
//    BLOCK_N 128 for the few tiles of T = 1, and 50 KB in flight per CTA when there are only ~1.4 CTAs per
//    SM, as for down at T = 1) or 128 (16×32 warp tiles, 4 stages, 72 KB, 3 CTAs per SM);
//  BLOCK_M 64: BLOCK_N 128 (default; 2×2 warps of 32×64, 3 stages, 72 KB, 3 CTAs per SM at ≤ 168 registers)
//    or 64 (2×2 warps of 32×32, 4 stages, 64 KB);
//  BLOCK_M 128: BLOCK_N 128 only (8 warps, 2×4 of 64×32, 3 stages, 96 KB, 2 CTAs per SM): half the shared
//    memory traffic per FLOP of 64×128, for compute-bound prefill.
//  The above with MoeGemmKernel::kMmaSync. kWgmma (the ring): one warpgroup per 64 rows. BLOCK_M
//    64 × BLOCK_N 128: 4 stages, 97 KB, 2 CTAs per SM; BLOCK_M 128 × 128: 5 stages, 161 KB, 1 CTA per SM;
//    BLOCK_M 128 × 256 (explicit block_n only): 4 stages, 193 KB — twice the FLOPs per byte read from L2,
//    but measured 15–20% slower than 128 × 128 (perf-log run 16: one CTA of 184–198 registers per SM).
//  kWgmmaWarpSpecialized (kAuto's choice where both operands come by TMA, then persistent: about one wave
//    of CTAs, each keeps one TMA ring across its work items): a producer warpgroup + one consumer warpgroup
//    per 64 rows. BLOCK_M 64: BLOCK_N 128 (default; 4 stages, 97 KB, 2 CTAs per SM) or 256 (5 stages,
//    201 KB); BLOCK_M 128: BLOCK_N 128 (default; 6 stages, 193 KB), 192 (5 stages, 201 KB; 96 accumulators)
//    or 256 (4 stages, 193 KB; 128 accumulators per consumer thread, which setmaxnreg gives 224 registers).
// Defaults are first guesses until the H200 bench (bench_moe_gemm) decides; tuned configs become data.
// sorted_rows: the A rows in tile order for the warp-specialized kernel, gathered here first unless
// `rows_ready` (moe_gate_up wrote them so: MoeDownParams::a_in_tile_order); pair_rows (or null): the gather
// records each pair's tile row there (MoeGateUpParams::pair_rows).
void launch_gemm(const GemmKernelParams& given, int block_m, int block_n, int decode_stages, int64_t max_tiles,
                 const Tensor& sorted_rows, bool rows_ready, int32_t* pair_rows, int max_sms, cudaStream_t stream) {
  GemmKernelParams params = given;  // + the weight's tensor map where the decode kernel takes it by TMA
  const MoeGemmKernel kernel = kernel_for(block_m, sorted_rows.defined(), params.halves);
  const bool mxfp4 = params.fp4_blocks != nullptr;  // host-checked: BLOCK_M 16
  if (mxfp4) block_n = gemm_mxfp4_block_n;
  if (block_n == 0) {  // the defaults, in one place
    block_n = block_m == kMoeGemmBlockMDecode                                    ? 64
              : block_m == kMoeGemmBlockMLarge && kernel == MoeGemmKernel::kWgmmaWarpSpecialized
                  ? (gemm_large_block_n != 0 ? gemm_large_block_n : large_block_n_for(params.n, 128))
              : block_m == kMoeGemmBlockMLarge && kernel == MoeGemmKernel::kWgmma
                  ? (gemm_large_block_n == 256 ? 256 : 128)  // the ring: 128 or 256 built
                                                                                 : 128;
  }
  if (max_tiles == 0 || params.pairs == 0 || params.n == 0) return;
  const int64_t column_blocks = (params.n + block_n - 1) / block_n;
  LMX_CHECK(column_blocks <= 65535);
  const dim3 grid{unsigned(max_tiles), unsigned(column_blocks), 1};
  const bool even_k = params.in % kBlockK == 0;
  PreparedKernel k{};
  const bool use_wgmma = kernel == MoeGemmKernel::kWgmma;
  // PDL is built into grouped_gemm_kernel only (BLOCK_M 16, and every BLOCK_M on mma.sync); the wgmma
  // kernels never wait, so they run as plain launches whatever params.pdl says.
  const bool pdl_kernel = block_m == kMoeGemmBlockMDecode || kernel == MoeGemmKernel::kMmaSync;
  if (mxfp4) {
    LMX_CHECK(block_m == kMoeGemmBlockMDecode && even_k);
    k = mxfp4_weight_by_bulk ? prepared_mxfp4_kernel<true>(gemm_mxfp4_block_n, gemm_mxfp4_stages, gemm_mxfp4_ctas)
                             : prepared_mxfp4_kernel<false>(gemm_mxfp4_block_n, gemm_mxfp4_stages, gemm_mxfp4_ctas);
  } else if (block_m == kMoeGemmBlockMDecode) {
    if (decode_weight_by_tma) {
      params.weight_by_tma = true;
      params.weight_map = params.halves ? tensor_map_halves(params.weight, params.weight_rows / params.n, params.n / 2,
                                                            params.in, block_n)
                                        : tensor_map_2d(params.weight, params.weight_rows, params.in, block_n, "the weight");
      k = block_n == 128 ? prepared_kernel<16, 128, 1, 4, 4, true>(even_k) : prepared_decode_kernel<true>(decode_stages, even_k);
    } else {
      k = block_n == 128 ? prepared_kernel<16, 128, 1, 4, 4>(even_k) : prepared_decode_kernel<false>(decode_stages, even_k);
    }
  } else if (kernel == MoeGemmKernel::kWgmmaWarpSpecialized) {
    if (block_m == kMoeGemmBlockMPrefill) {
      k = block_n == 256 ? prepared_ws_kernel<1, 256, 5>(even_k) : prepared_ws_kernel<1, 128, 4>(even_k);
    } else {
      k = block_n == 256   ? prepared_ws_kernel<2, 256, 4>(even_k)
          : block_n == 192 ? prepared_ws_kernel<2, 192, 5>(even_k)
                           : prepared_ws_kernel<2, 128, 6>(even_k);
    }
  } else if (use_wgmma && block_n == 256) {
    k = prepared_wgmma_kernel<2, 256, 4>(even_k);
  } else if (use_wgmma && block_n == 128) {
    k = block_m == kMoeGemmBlockMPrefill ? prepared_wgmma_kernel<1, 128, 4>(even_k)
                                         : prepared_wgmma_kernel<2, 128, 5>(even_k);
  } else if (block_m == kMoeGemmBlockMPrefill) {
    k = block_n == 64 ? prepared_kernel<64, 64, 2, 2, 4>(even_k) : prepared_kernel<64, 128, 2, 2, 3>(even_k);
  } else {
    LMX_CHECK(block_m == kMoeGemmBlockMLarge && block_n == 128);
    k = prepared_kernel<128, 128, 2, 4, 3>(even_k);
  }
  if (kernel == MoeGemmKernel::kWgmmaWarpSpecialized && block_m != kMoeGemmBlockMDecode) {
    GemmKernelParams with_maps = params;
    with_maps.a_by_tma = sorted_rows.defined();
    // The fused halves layout by TMA: the persistent kernel only (A gathered too), with LoRA terms only where
    // lora_on_halves (add_lora_terms maps B's rows as the layout does); otherwise its rows come one by one by
    // cp.async.
    const bool halves_map = params.halves && halves_on_tma(block_m) && with_maps.a_by_tma &&
                            (params.lora_z == nullptr || lora_on_halves(block_m)) && block_n % 16 == 0;
    with_maps.weight_by_tma = !params.halves || halves_map;
    if (halves_map) {
      with_maps.weight_map = tensor_map_halves(params.weight, params.weight_rows / params.n, params.n / 2, params.in,
                                               block_n);
    } else if (with_maps.weight_by_tma) {
      with_maps.weight_map = tensor_map_2d(params.weight, params.weight_rows, params.in, block_n, "the weight");
    }
    CUtensorMap half_tile_map{};  // the gathered rows in boxes of 64: the multicast kernel's A halves
    if (with_maps.a_by_tma) {  // the tiles' rows gathered into tile order first, then one box per stage
      auto* sorted = static_cast<__nv_bfloat16*>(sorted_rows.data);
      const int64_t capacity = sorted_rows.dim(0);
      if (!rows_ready) {
        const GatherRowsKernelParams gather{.x = params.x, .sorted_pairs = params.sorted_pairs,
                                            .num_tiles = params.num_tiles, .out = sorted, .pair_rows = pair_rows,
                                            .pairs = params.pairs, .row_div = params.row_div, .in = params.in,
                                            .block_m = block_m};
        const unsigned ctas = unsigned((max_tiles * block_m + kGatherRowsPerCta - 1) / kGatherRowsPerCta);
        detail::launch(gather_rows_kernel, dim3(ctas), dim3(32 * kGatherRowsPerCta), 0, stream, gather);
        LMX_CUDA_CHECK_LAUNCH();
      }
      with_maps.a_map = tensor_map_2d(sorted, capacity, params.in, block_m, "the gathered rows");
      if (block_m == kMoeGemmBlockMLarge) half_tile_map = tensor_map_2d(sorted, capacity, params.in, 64, "the gathered rows");
    }
    if (with_maps.a_by_tma && with_maps.weight_by_tma) {  // both by TMA: the persistent form, about one wave
      const bool large = block_m == kMoeGemmBlockMLarge, lora = params.lora_z != nullptr;
      LMX_CHECK(block_n != 240 || (large && !lora && with_maps.sk_partials == nullptr));  // moe_down's checks
      // MoeStreamK at 128-row tiles only (its own instantiations: the merge's registers stay out of the others)
      if (!large) with_maps.sk_partials = nullptr, with_maps.sk_counters = nullptr;
      const bool sk = with_maps.sk_partials != nullptr;
      // set_moe_lora_gemm_wgmma: the main slot's LoRA term by warpgroup MMAs from a TMA'd B slice (BLOCK_M 128;
      // the map's rows are 16-byte strided: R a multiple of 8, as every stack the loader pads; its box is B's
      // rows in the weight's order, so not for the halves layout)
      if (lora && large && lora_gemm_wgmma && params.lora_r % 8 == 0 && !params.halves) {
        const int64_t b_rows = int64_t(params.lora_slots) * params.weight_rows;
        LMX_CHECK(b_rows < 0x7fffffff);
        with_maps.lora_wgmma = true;
        with_maps.lora_b_map = tensor_map_2d(params.lora_b, b_rows, params.lora_r, block_n, "the MoE-LoRA B stack");
      }
      // set_moe_gemm_lora_ktile: each tile's main slot of full rank as one more k-tile of the ring (whole units: not
      // with the stream-K tail; R a multiple of 8 up to 64 for the maps' rows; not beside lora_wgmma), its A rows
      // written by z_rows_kernel first
      if (lora && gemm_lora_ktile && params.lora_z_rows != nullptr && !sk && !params.halves && params.lora_r % 8 == 0 &&
          params.lora_r <= 64 && !with_maps.lora_wgmma) {
        if (params.lora_z_rows_capacity < max_tiles * block_m) {
          fail("moe_gemm", "lora.z_rows has " + std::to_string(params.lora_z_rows_capacity) +
                               " rows, expected at least the tiles' capacity " + std::to_string(max_tiles * block_m));
        }
        if (params.lora_tile_slots_capacity < max_tiles) {
          fail("moe_gemm", "lora.tile_slots has " + std::to_string(params.lora_tile_slots_capacity) +
                               " entries, expected at least the tiles' count " + std::to_string(max_tiles));
        }
        const int64_t b_rows = int64_t(params.lora_slots) * params.weight_rows;
        LMX_CHECK(b_rows < 0x7fffffff);
        with_maps.lora_ktile = true;
        with_maps.lora_b_map = tensor_map_2d(params.lora_b, b_rows, params.lora_r, block_n, "the MoE-LoRA B stack");
        with_maps.z_map = tensor_map_2d(params.lora_z_rows, params.lora_z_rows_capacity, 64, block_m,
                                        "the main slot's z rows");
        const unsigned ctas = unsigned((max_tiles * block_m + 31) / 32);
        if (large) detail::launch(z_rows_kernel<kMoeGemmBlockMLarge>, dim3(ctas), dim3(256), 0, stream, with_maps);
        else detail::launch(z_rows_kernel<kMoeGemmBlockMPrefill>, dim3(ctas), dim3(256), 0, stream, with_maps);
        LMX_CUDA_CHECK_LAUNCH();
      }
      // set_moe_gemm_epilogue_warps: the fused activation by the producer warpgroup's idle warps, at one stage
      // fewer (the staging tile takes its place in shared memory)
      // (with LoRA terms, not beside the main slot's B slice: lora_wgmma)
      // (set_moe_gemm_epilogue_down: the store form too)
      with_maps.epilogue_warps = gemm_epilogue_warps && large && !sk && (params.fuse_activation || gemm_epilogue_down) &&
                                 (block_n == 192 || block_n == 128) && !with_maps.lora_wgmma;
      // set_moe_gemm_epilogue_lora: the LoRA terms of the staged items by those warps too (fused form only)
      with_maps.epilogue_lora =
          with_maps.epilogue_warps && lora && gemm_epilogue_lora && params.fuse_activation && !with_maps.lora_ktile;
      const PreparedPersistentKernel pk =
          with_maps.epilogue_warps
              ? (lora ? (block_n == 192 ? prepared_persistent_kernel<2, 192, 4, true, false, true>()
                                        : prepared_persistent_kernel<2, 128, 5, true, false, true>())
                      : (block_n == 192 ? prepared_persistent_kernel<2, 192, 4, false, false, true>()
                                        : prepared_persistent_kernel<2, 128, 5, false, false, true>()))
          : sk ? (lora ? (block_n == 256   ? prepared_persistent_kernel<2, 256, 4, true, true>()
                        : block_n == 192 ? prepared_persistent_kernel<2, 192, 5, true, true>()
                                         : prepared_persistent_kernel<2, 128, 6, true, true>())
                     : (block_n == 256   ? prepared_persistent_kernel<2, 256, 4, false, true>()
                        : block_n == 192 ? prepared_persistent_kernel<2, 192, 5, false, true>()
                                         : prepared_persistent_kernel<2, 128, 6, false, true>()))
          : lora ? (large ? (block_n == 256   ? prepared_persistent_kernel<2, 256, 4, true>()
                             : block_n == 192 ? prepared_persistent_kernel<2, 192, 5, true>()
                                              : prepared_persistent_kernel<2, 128, 6, true>())
                          : (block_n == 256 ? prepared_persistent_kernel<1, 256, 5, true>()
                                            : prepared_persistent_kernel<1, 128, 4, true>()))
          : large ? (block_n == 256   ? prepared_persistent_kernel<2, 256, 4>()
                     : block_n == 240 ? prepared_persistent_kernel<2, 240, 4>()
                     : block_n == 192 ? prepared_persistent_kernel<2, 192, 5>()
                                      : prepared_persistent_kernel<2, 128, 6>())
                  : (block_n == 256 ? prepared_persistent_kernel<1, 256, 5>() : prepared_persistent_kernel<1, 128, 4>());
      with_maps.work_tiles = int(max_tiles);
      with_maps.compact_epilogue = gemm_compact_epilogue;
      with_maps.work_column_blocks = int(column_blocks);
      if (large && block_n == 128 && gemm_multicast && !lora && !sk) {  // CTA pairs share each A tile (multicast)
        const PreparedClusterKernel ck = prepared_cluster_kernel();
        GemmKernelParams cluster_params = with_maps;
        cluster_params.a_map = half_tile_map;
        const int64_t units = max_tiles * ((column_blocks + 1) / 2);
        ClusterPairLaunch launch(ck.kernel, unsigned(std::min<int64_t>(units, ck.clusters)), stream);
        LMX_CUDA_CHECK(cudaLaunchKernelEx(&launch.config, ck.kernel.kernel, cluster_params));
        LMX_CUDA_CHECK_LAUNCH();
        return;
      }
      const int64_t items = max_tiles * column_blocks;
      const int64_t sms = max_sms > 0 ? std::min(max_sms, multiprocessor_count()) : multiprocessor_count();
      const unsigned ctas = unsigned(std::min<int64_t>(items, sms * pk.ctas_per_sm));
      if (with_maps.sk_partials != nullptr) {  // MoeStreamK's sizes hold this grid: two pieces a CTA, a counter a unit
        const int64_t consumers = large ? 2 : 1;
        LMX_CHECK(int64_t(ctas) * 2 * 128 * consumers * (block_n / 2) <= moe_stream_k_floats() &&
                  ctas <= unsigned(kStreamKCounters));
      }
      pk.kernel.kernel<<<ctas, pk.kernel.threads, pk.kernel.shared_bytes, stream>>>(with_maps);
    } else {
      LMX_CHECK(!params.out_by_row && !rows_ready);  // the persistent kernel's forms (callers check)
      k.kernel<<<grid, k.threads, k.shared_bytes, stream>>>(with_maps);
    }
  } else if (params.pdl && pdl_kernel) {
    LMX_CHECK(!params.out_by_row && !rows_ready);
    cudaLaunchAttribute attribute{};
    attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config{};
    config.gridDim = grid;
    config.blockDim = dim3(unsigned(k.threads));
    config.dynamicSmemBytes = k.shared_bytes;
    config.stream = stream;
    config.attrs = &attribute;
    config.numAttrs = 1;
    LMX_CUDA_CHECK(cudaLaunchKernelEx(&config, k.kernel, params));
  } else {
    LMX_CHECK(!params.out_by_row && !rows_ready);
    GemmKernelParams plain = params;
    plain.pdl = false;
    k.kernel<<<grid, k.threads, k.shared_bytes, stream>>>(plain);
  }
  LMX_CUDA_CHECK_LAUNCH();
}

GemmKernelParams pack_tiles(GemmKernelParams params, const MoeExpertTiles& tiles) {
  params.sorted_pairs = static_cast<const int32_t*>(tiles.sorted_pairs.data);
  params.tile_group = static_cast<const int32_t*>(tiles.tile_group.data);
  params.num_tiles = static_cast<const int32_t*>(tiles.num_tiles.data);
  return params;
}

}  // namespace

void set_moe_gemm_kernel(MoeGemmKernel kernel) { gemm_kernel = kernel; }
void set_moe_gemm_multicast(bool on) { gemm_multicast = on; }
void set_moe_gemm_compact_epilogue(bool on) { gemm_compact_epilogue = on; }
void set_moe_gemm_stream_k(bool on) { gemm_stream_k = on; }
void set_moe_gemm_epilogue_warps(bool on) { gemm_epilogue_warps = on; }
void set_moe_gemm_epilogue_lora(bool on) { gemm_epilogue_lora = on; }
void set_moe_gemm_lora_ktile(bool on) { gemm_lora_ktile = on; }
void set_moe_gemm_epilogue_down(bool on) { gemm_epilogue_down = on; }
void set_moe_gemm_mxfp4(bool on) { gemm_mxfp4 = on; }
void set_moe_lora_in_mxfp4_gemm(bool on) { lora_in_mxfp4_gemm = on; }
void set_moe_lora_fork_shrinks(bool on) { lora_fork_shrinks = on; }
void set_moe_lora_side_expands(bool on) { lora_side_expands = on; }
void set_moe_gemm_mxfp4_shape(int block_n, int stages, int ctas_per_sm) {
  struct Shape {
    int block_n, stages, ctas;
  };
  constexpr Shape kBuilt[] = {{128, 8, 4}, {128, 6, 5}, {128, 5, 6}, {128, 4, 6}, {128, 4, 8}, {128, 3, 8},
                               {64, 8, 6}, {64, 12, 4}, {64, 6, 8}};
  for (const Shape& shape : kBuilt) {  // the first of a (columns, stages) pair is its default CTA count
    if (shape.block_n == block_n && shape.stages == stages && (ctas_per_sm == 0 || ctas_per_sm == shape.ctas)) {
      gemm_mxfp4_block_n = block_n;
      gemm_mxfp4_stages = stages;
      gemm_mxfp4_ctas = shape.ctas;
      return;
    }
  }
  throw std::invalid_argument("set_moe_gemm_mxfp4_shape: built shapes (columns x stages @ CTAs an SM) are 128x8@4, "
                              "128x6@5, 128x5@6, 128x4@6, 128x4@8, 128x3@8, 64x8@6, 64x12@4 and 64x6@8, got " + std::to_string(block_n) + "x" +
                              std::to_string(stages) + (ctas_per_sm ? "@" + std::to_string(ctas_per_sm) : ""));
}
void set_moe_gemm_early_trigger(bool on) { gemm_early_trigger = on; }
void set_moe_lora_gemm_wgmma(bool on) { lora_gemm_wgmma = on; }
// The most partial accumulators one SM's persistent CTAs hold: two pieces × 256 consumer threads × 128 (BLOCK_M
// 128 × BLOCK_N 256), or two CTAs of half that (BLOCK_M 64).
int64_t moe_stream_k_floats() { return int64_t(multiprocessor_count()) * 2 * 256 * 128; }
int64_t moe_stream_k_counters() { return kStreamKCounters; }
void set_moe_block_a_in_tile_order(bool on) { a_in_tile_order = on; }
void set_moe_lora_shrink_runs_hint(bool on) { shrink_runs_hint = on; }
void set_moe_lora_shrink_runs_split(bool on) { shrink_runs_split = on; }
bool moe_lora_shrink_runs_for(int64_t tokens, int64_t scattered, int64_t top_k, int64_t experts) {
  // Most adapter pairs in long same-adapter runs (a prompt's chunk), and those runs' tokens alone enough for
  // kRunTiles tiles per (slot, expert) group if one adapter held them: the tiled shrink's own rule counts every
  // S·E group as touched (T 1600 with one adapter: 6400 pairs < 64 · 256, so a tile per CTA re-reading its
  // group's A for every 16 pairs, where the prompt's 32 groups hold ~13 tiles each).
  return shrink_runs_hint && scattered >= 0 && scattered < tokens / 2 &&
         (tokens - scattered) * top_k >= int64_t(moe_lora_run_tiles()) * kMoeLoraBlockM * experts;
}
void set_moe_block_down_block_n(int block_n) {
  if (block_n != 0 && block_n != 128 && block_n != 192 && block_n != 240 && block_n != 256) {
    throw std::invalid_argument("set_moe_block_down_block_n: block_n = " + std::to_string(block_n) +
                                ", expected 0 (by width and rounds), 128, 192, 240 or 256");
  }
  block_down_block_n = block_n;
}
void set_moe_block_cta_group(int tiles) {
  if (tiles < 0 || tiles > 64) {
    throw std::invalid_argument("set_moe_block_cta_group: tiles = " + std::to_string(tiles) +
                                ", expected 0 (plain tile order) to 64");
  }
  block_cta_group = tiles;
}
void set_moe_block_down_decode_stages(int stages) {
  if (stages != 0 && (stages < 4 || stages > 6)) {
    throw std::invalid_argument("set_moe_block_down_decode_stages: stages = " + std::to_string(stages) +
                                ", expected 0 (the kernel's 6), 4, 5 or 6");
  }
  block_down_decode_stages = stages;
}
void set_moe_block_decode_block_n(int gate_up, int down) {
  for (const int block_n : {gate_up, down}) {
    if (block_n != 0 && block_n != 64 && block_n != 128) {
      throw std::invalid_argument("set_moe_block_decode_block_n: block_n = " + std::to_string(block_n) +
                                  ", expected 0 (the default, 64), 64 or 128");
    }
  }
  block_decode_block_n[0] = gate_up;
  block_decode_block_n[1] = down;
}
void set_moe_gemm_large_block_n(int block_n) {
  if (block_n != 0 && block_n != 128 && block_n != 192 && block_n != 256) {
    throw std::invalid_argument("set_moe_gemm_large_block_n: block_n = " + std::to_string(block_n) +
                                ", expected 0 (by width), 128, 192 or 256 (the wgmma kernels' BLOCK_N at BLOCK_M 128; "
                                "192 on the warp-specialized kernels only)");
  }
  gemm_large_block_n = block_n;
}
int moe_gemm_multicast_clusters() { return prepared_cluster_kernel().clusters; }
void set_moe_lora_in_epilogue(bool on) { lora_in_epilogue = on; }
void set_moe_lora_in_gemm(MoeLoraInGemm mode) { lora_in_gemm = mode; }
void set_moe_lora_l1_prefetch(bool on) { lora_l1_prefetch = on; }
void set_moe_gemm_halves_by_tma(bool on) { halves_by_tma = on; }
void set_moe_gemm_lora_halves(bool on) { lora_halves = on; }
void set_moe_decode_weight_by_tma(bool on) { decode_weight_by_tma = on; }
void set_moe_mxfp4_weight_by_bulk(bool on) { mxfp4_weight_by_bulk = on; }
bool moe_lora_in_gemm_for(MoeLoraInGemm mode, int64_t /*tokens*/, int64_t scattered, int block_m) {
  if (mode == MoeLoraInGemm::kAlways) return true;
  // kLongRuns, GPT-OSS-20B, 8 adapters of rank 32 (perf-log runs 64–66, 106):
  //  - 128-row tiles only: at 64 (T 256) the accumulator path costs more per layer with one adapter (+112 µs
  //    vs +68 by the expand kernels) and with 8 interleaved (+301 vs +146).
  //  - long runs (at most one adapter token in 256 in a short run): a prompt with an adapter gains ~1.2 ms.
  //  - at least half of the adapter tokens in short runs (many short prompts or decode tokens): rows
  //    ordered by slot leave a warp one or two adapters, and the expand kernels pay for every pair. Layer
  //    cost T 1600 +301 µs vs +370, T 4096 +580 vs +645.
  //  - in between, with each slot's rows starting at a warp boundary (moe_lora_warp_groups_for): without
  //    it a 1600-token prompt beside 15 decoding tokens took 42.1–42.5 ms here, 40.7–41.2 by the expand
  //    kernels, because those few tokens put a second or third adapter into a warp of most tiles.
  //  - 16-row tiles (decode): not since perf-log run 170. There the accumulator path (a warp's one or two
  //    passes of R/16 small MMAs per column block) had saved the two expand kernels, the activation kernel
  //    and h's round trip of the chained expand path (run 68); the forked shrinks and side expands (runs
  //    135, 149) now run the LoRA beside the GEMMs instead: bf16 decode step 14.11 → 14.00 ms (H100).
  return mode == MoeLoraInGemm::kLongRuns && block_m == kMoeGemmBlockMLarge && scattered >= 0;
}
bool moe_lora_warp_groups_for(MoeLoraInGemm mode, int64_t tokens, int64_t scattered, int block_m) {
  return mode == MoeLoraInGemm::kLongRuns && block_m == kMoeGemmBlockMLarge && scattered > tokens / 256 &&
         scattered < tokens / 2;
}

int block_m_override = 0;  // set_moe_gemm_block_m_override
void set_moe_gemm_block_m_override(int block_m) {
  if (block_m != 0 && block_m != kMoeGemmBlockMPrefill && block_m != kMoeGemmBlockMLarge) {
    throw std::invalid_argument("set_moe_gemm_block_m_override: block_m = " + std::to_string(block_m) +
                                ", expected 0 (the rule), 64 or 128");
  }
  block_m_override = block_m;
}
int moe_gemm_block_m(int64_t pairs, int64_t experts) {
  // 16-row tiles until the mean expert holds 32 pairs: below that the 64-row tile is mostly padding and
  // the GEMM streams weights anyway; above it, 64 rows per weight tile cut the L2 -> SM weight traffic 4×;
  // 128-row tiles (one CTA per SM, run in CTA groups by moe_block) from 96 pairs per expert: GPT-OSS-20B T 800
  // (100 per expert) gate_up 488 → 437 µs, down 253 → 226; T 1600 916 → 782, 447 → 392; prefill 42.0 → 40.4
  // ms (perf-log run 27). Qwen3-30B-A3B (I 768) had measured 50.8 → 53.0 ms with 128-row tiles at T 1600 on
  // the ring kernels then, so reductions shorter than 2048 kept 64-row tiles up to 256 per expert; on the
  // persistent kernels, with the halves layout's gate_up by TMA, its prefill of 1600 tokens went 44.4 → 39.0
  // ms at 128 (perf-log run 206, H100), and that condition is gone.
  const int64_t per_expert = pairs / std::max<int64_t>(experts, 1);
  if (block_m_override != 0 && per_expert >= 32) return block_m_override;
  if (per_expert >= 96) return kMoeGemmBlockMLarge;
  return per_expert >= 32 ? kMoeGemmBlockMPrefill : kMoeGemmBlockMDecode;
}

namespace {

// MoeStreamK's contract; its pointers into params.
void pack_stream_k(const char* op, const MoeStreamK& sk, GemmKernelParams& params) {
  if (!sk.defined()) return;
  detail::require_cuda(op, {{"stream_k.partials", &sk.partials}, {"stream_k.counters", &sk.counters}});
  if (sk.partials.dtype != DType::F32 || sk.partials.numel() < moe_stream_k_floats()) {
    detail::contract_failure(op, "stream_k.partials", sk.partials,
                             ("F32 of at least moe_stream_k_floats() = " +
                              std::to_string(moe_stream_k_floats()) + " elements").c_str());
  }
  if (sk.counters.dtype != DType::I32 || sk.counters.numel() < moe_stream_k_counters()) {
    detail::contract_failure(op, "stream_k.counters", sk.counters,
                             ("I32 of at least moe_stream_k_counters() = " +
                              std::to_string(moe_stream_k_counters()) + " elements, zero").c_str());
  }
  params.sk_partials = static_cast<float*>(sk.partials.data);
  params.sk_counters = static_cast<int32_t*>(sk.counters.data);
}

// MoeMxfp4Weight's contract for a weight [E, n, in] taken by the BLOCK_M 16 kernel; its pointers into params
// (other BLOCK_Ms ignore it, as documented).
void pack_mxfp4(const char* op, const MoeMxfp4Weight& w, int64_t experts, int64_t n, int64_t in, int block_m,
                bool halves, GemmKernelParams& params) {
  if (!w.defined() || block_m != kMoeGemmBlockMDecode) return;
  if (in % ops::mxfp4::kTileK != 0 || n % 8 != 0) {
    fail(op, "mxfp4: the decode layout needs in % 64 == 0 and n % 8 == 0, got in " + std::to_string(in) + ", n " +
                 std::to_string(n));
  }
  if (halves) fail(op, "mxfp4: the halves gate/up layout is not supported (GPT-OSS's interleaved one is)");
  const int64_t tiles = in / ops::mxfp4::kTileK;
  const auto shaped = [&](const Tensor& t, int64_t last) {
    return t.dtype == DType::U8 && t.ndim == 4 && t.dim(0) == experts && t.dim(1) == tiles && t.dim(2) == n &&
           t.dim(3) == last && detail::aligned16(t.data);
  };
  if (!shaped(w.blocks, ops::mxfp4::kTileBytes)) {
    detail::contract_failure(op, "mxfp4.blocks", w.blocks,
                             (dims({experts, tiles, n, ops::mxfp4::kTileBytes}) + " U8, 16-byte aligned").c_str());
  }
  if (!shaped(w.scales, 2)) {
    detail::contract_failure(op, "mxfp4.scales", w.scales, (dims({experts, tiles, n, 2}) + " U8, 16-byte aligned").c_str());
  }
  detail::require_cuda(op, {{"mxfp4.blocks", &w.blocks}, {"mxfp4.scales", &w.scales}});
  params.fp4_blocks = static_cast<const uint8_t*>(w.blocks.data);
  params.fp4_scales = static_cast<const uint8_t*>(w.scales.data);
}

// MoeGemmLora's contract for a GEMM of `pairs` rows over `tokens` tokens, E experts and n outputs, on the
// kernel this call will run (the persistent one, or the BLOCK_M 16 decode kernel); its pointers into params.
void pack_gemm_lora(const char* op, const MoeGemmLora& lora, int64_t tokens, int64_t pairs, int64_t experts,
                    int64_t n, int block_m, bool gathered, bool halves, GemmKernelParams& params) {
  if (!lora.defined()) return;
  const bool persistent = block_m != kMoeGemmBlockMDecode &&
                          kernel_for(block_m, gathered, halves) == MoeGemmKernel::kWgmmaWarpSpecialized && gathered &&
                          (!halves || lora_on_halves(block_m));
  if (block_m != kMoeGemmBlockMDecode && !persistent) {
    fail(op, "lora.z is added by the BLOCK_M 16 decode kernel or the persistent TMA kernel only: BLOCK_M 16, or 64 / "
             "128 (got " + std::to_string(block_m) + ") with sorted_rows given (" + (gathered ? "yes" : "no") +
             "), the weight not in the fused halves layout (" + (halves ? "halves" : "ok") +
             "; allowed at BLOCK_M 128 with set_moe_gemm_lora_halves and set_moe_gemm_halves_by_tma on) and the "
             "kAuto or warp-specialized kernel");
  }
  if (lora.b.dtype != DType::BF16 || lora.b.ndim != 4 || lora.b.dim(1) != experts || lora.b.dim(2) != n ||
      lora.b.dim(3) % 2 != 0 || lora.b.dim(3) < 2) {
    detail::contract_failure(op, "lora.b", lora.b, ("[S, " + std::to_string(experts) + ", " + std::to_string(n) +
                                                    ", R] BF16, R even").c_str());
  }
  const int64_t slots = lora.b.dim(0), rank_cap = lora.b.dim(3);
  if (lora.z.dtype != DType::F32 || lora.z.ndim != 2 || lora.z.dim(0) != pairs || lora.z.dim(1) != rank_cap ||
      (reinterpret_cast<uintptr_t>(lora.z.data) & 7u) != 0) {
    detail::contract_failure(op, "lora.z", lora.z, (dims({pairs, rank_cap}) + " F32, 8-byte aligned").c_str());
  }
  if (lora.rank.dtype != DType::I32 || lora.rank.ndim != 1 || lora.rank.dim(0) != slots) {
    detail::contract_failure(op, "lora.rank", lora.rank, ("[" + std::to_string(slots) + "] I32").c_str());
  }
  if (lora.token_slot.dtype != DType::I32 || lora.token_slot.ndim != 1 || lora.token_slot.dim(0) != tokens) {
    detail::contract_failure(op, "lora.token_slot", lora.token_slot, ("[" + std::to_string(tokens) + "] I32").c_str());
  }
  detail::require_cuda(op, {{"lora.z", &lora.z}, {"lora.b", &lora.b}, {"lora.rank", &lora.rank},
                            {"lora.token_slot", &lora.token_slot}});
  params.lora_z = static_cast<const float*>(lora.z.data);
  params.lora_b = static_cast<const __nv_bfloat16*>(lora.b.data);
  params.lora_rank = static_cast<const int32_t*>(lora.rank.data);
  params.lora_slot = static_cast<const int32_t*>(lora.token_slot.data);
  params.lora_r = int(rank_cap);
  params.lora_top_k = int(pairs / std::max<int64_t>(tokens, 1));
  params.lora_slots = int(lora.b.dim(0));
  params.lora_l1_prefetch = lora_l1_prefetch;
  if (lora.z_rows.defined()) {  // set_moe_gemm_lora_ktile's scratch (used where launch_gemm takes that form)
    if (lora.z_rows.dtype != DType::BF16 || lora.z_rows.ndim != 2 || lora.z_rows.dim(1) != 64 ||
        !detail::aligned16(lora.z_rows.data)) {
      detail::contract_failure(op, "lora.z_rows", lora.z_rows, "[capacity, 64] BF16, 16-byte aligned");
    }
    if (lora.tile_slots.dtype != DType::I32 || lora.tile_slots.ndim != 1) {
      detail::contract_failure(op, "lora.tile_slots", lora.tile_slots, "[tiles] I32 (with z_rows)");
    }
    detail::require_cuda(op, {{"lora.z_rows", &lora.z_rows}, {"lora.tile_slots", &lora.tile_slots}});
    params.lora_z_rows = static_cast<__nv_bfloat16*>(lora.z_rows.data);
    params.lora_z_rows_capacity = lora.z_rows.dim(0);
    params.lora_tile_slots = static_cast<int32_t*>(lora.tile_slots.data);
    params.lora_tile_slots_capacity = lora.tile_slots.dim(0);
  }
}

}  // namespace

void moe_gate_up(const MoeGateUpParams& p, cudaStream_t stream) {
  const char* op = "moe_gate_up";
  if (p.x.dtype != DType::BF16 || p.x.ndim != 2 || p.x.dim(1) % 8 != 0 || !detail::aligned16(p.x.data)) {
    detail::contract_failure(op, "x", p.x, "[T, H] BF16, H % 8 == 0, 16-byte aligned");
  }
  const int64_t tokens = p.x.dim(0), hidden = p.x.dim(1);
  if (p.weight.ndim != 3 || p.weight.dim(1) % 2 != 0) detail::contract_failure(op, "weight", p.weight, "[E, 2I, H]");
  const int64_t rows2 = p.weight.dim(1), inter = rows2 / 2;
  check_weight(op, "weight", p.weight, "bias", p.bias, rows2, hidden);
  if (p.top_k < 1) fail(op, "top_k = " + std::to_string(p.top_k) + ", expected >= 1");
  const int64_t pairs = tokens * p.top_k;
  if (p.h.defined() == p.a.defined()) {
    fail(op, "exactly one of h (pre-activation) and a (fused activation) must be defined");
  }
  const Tensor& out = p.h.defined() ? p.h : p.a;
  const int64_t out_cols = p.h.defined() ? rows2 : inter;
  const int64_t max_tiles = check_tiles(op, p.tiles);
  const bool fuse = p.a.defined(), by_row = p.pair_rows.defined();
  if (by_row) {  // a in tile order: [capacity of the tiles, I], the pairs' rows recorded in pair_rows
    if (!fuse || !runs_persistent(int(p.tiles.block_m), p.sorted_rows.defined(),
                                  p.layout == ops::GateUpLayout::kHalves)) {
      fail(op, "pair_rows (a written in tile order) needs the persistent TMA kernel: a (the fused activation), "
               "sorted_rows, BLOCK_M 64 or 128 (got " + std::to_string(p.tiles.block_m) +
               "), the interleaved layout and the kAuto or warp-specialized kernel");
    }
    if (p.pair_rows.dtype != DType::I32 || p.pair_rows.ndim != 1 || p.pair_rows.dim(0) != pairs) {
      detail::contract_failure(op, "pair_rows", p.pair_rows, ("[" + std::to_string(pairs) + "] I32 (T*K)").c_str());
    }
    detail::require_cuda(op, {{"pair_rows", &p.pair_rows}});
  }
  const int64_t out_rows = by_row ? p.tiles.sorted_pairs.dim(0) : pairs;
  if (!is_bf16_matrix(out, out_rows, out_cols) || (reinterpret_cast<uintptr_t>(out.data) & 3u) != 0) {
    detail::contract_failure(op, p.h.defined() ? "h" : "a", out,
                             (dims({out_rows, out_cols}) +
                              (by_row ? " BF16 (the tiles' capacity: a in tile order)" : " BF16 (T*K rows)") +
                              ", 4-byte aligned").c_str());
  }
  detail::require_cuda(op, {{"x", &p.x}, {p.h.defined() ? "h" : "a", &out}});
  if (p.lora_h.defined()) {
    if (!fuse) fail(op, "lora_h is added before the fused activation: it needs a, not h");
    if (!is_bf16_matrix(p.lora_h, pairs, rows2) || (reinterpret_cast<uintptr_t>(p.lora_h.data) & 3u) != 0) {
      detail::contract_failure(op, "lora_h", p.lora_h,
                               (dims({pairs, rows2}) + " BF16 (T*K rows), 4-byte aligned").c_str());
    }
    if (p.token_slot.dtype != DType::I32 || p.token_slot.ndim != 1 || p.token_slot.dim(0) != tokens) {
      detail::contract_failure(op, "token_slot", p.token_slot, ("[" + std::to_string(tokens) + "] I32").c_str());
    }
    detail::require_cuda(op, {{"lora_h", &p.lora_h}, {"token_slot", &p.token_slot}});
  }
  check_block_n(op, p.block_n, p.tiles.block_m,
                kernel_for(p.tiles.block_m, p.sorted_rows.defined(), fuse && p.layout == ops::GateUpLayout::kHalves));
  if (p.block_n == 240) fail(op, "block_n = 240: built for down only (the fused activation stores 32-column groups)");
  check_decode_stages(op, p.decode_stages);
  LMX_CHECK(pairs < 0x7fffffff && hidden < 0x7fffffff && rows2 < 0x7fffffff);
  GemmKernelParams params{.x = static_cast<const __nv_bfloat16*>(p.x.data),
                          .weight = static_cast<const __nv_bfloat16*>(p.weight.data),
                          .bias = p.bias.defined() ? static_cast<const __nv_bfloat16*>(p.bias.data) : nullptr,
                          .sorted_pairs = nullptr,
                          .tile_group = nullptr,
                          .num_tiles = nullptr,
                          .out = static_cast<__nv_bfloat16*>(out.data),
                          .pairs = int(pairs),
                          .row_div = int(p.top_k),
                          .in = int(hidden),
                          .n = int(rows2),
                          .fuse_activation = fuse,
                          .halves = fuse && p.layout == ops::GateUpLayout::kHalves,
                          .gpt_oss = p.activation == ops::MoeActivation::kGptOssClamped,
                          .swiglu_alpha = p.swiglu_alpha,
                          .swiglu_limit = p.swiglu_limit,
                          .cta_group = p.cta_group,
                          .weight_rows = p.weight.dim(0) * rows2,
                          .weight_by_tma = false,
                          .a_by_tma = false,
                          .work_tiles = 0,
                          .work_column_blocks = 0,
                          .pdl = p.pdl,
                          .routing_before_wait = p.routing_before_wait,
                          .wait_before_epilogue = p.wait_before_epilogue,
                          .early_trigger = p.early_trigger,
                          .weight_map = {},
                          .a_map = {},
                          .lora_h = p.lora_h.defined() ? static_cast<const __nv_bfloat16*>(p.lora_h.data) : nullptr,
                          .token_slot = p.lora_h.defined() ? static_cast<const int32_t*>(p.token_slot.data) : nullptr};
  params.out_by_row = by_row;
  check_sorted_rows(op, p.sorted_rows, p.tiles, hidden);
  if (p.lora.defined() && p.lora_h.defined()) fail(op, "lora (in the accumulators) and lora_h are exclusive");
  pack_gemm_lora(op, p.lora, tokens, pairs, p.weight.dim(0), rows2, int(p.tiles.block_m), p.sorted_rows.defined(),
                 params.halves, params);
  pack_stream_k(op, p.stream_k, params);
  pack_mxfp4(op, p.mxfp4, p.weight.dim(0), rows2, hidden, int(p.tiles.block_m), params.halves, params);
  launch_gemm(pack_tiles(params, p.tiles), p.tiles.block_m, p.block_n, p.decode_stages, max_tiles, p.sorted_rows,
              false, by_row ? static_cast<int32_t*>(p.pair_rows.data) : nullptr, p.max_sms, stream);
}

void moe_activation(const MoeActivationParams& p, cudaStream_t stream) {
  const char* op = "moe_activation";
  if (p.h.dtype != DType::BF16 || p.h.ndim != 2 || p.h.dim(1) % 2 != 0) {
    detail::contract_failure(op, "h", p.h, "[P, 2I] BF16");
  }
  const int64_t rows = p.h.dim(0), inter = p.h.dim(1) / 2;
  if (!is_bf16_matrix(p.a, rows, inter)) detail::contract_failure(op, "a", p.a, (dims({rows, inter}) + " BF16").c_str());
  detail::require_cuda(op, {{"h", &p.h}, {"a", &p.a}});
  if (p.delta.defined()) {
    if (p.delta.dtype != DType::F32 || p.delta.ndim != 2 || p.delta.dim(0) != rows || p.delta.dim(1) != 2 * inter ||
        !detail::aligned16(p.delta.data)) {
      detail::contract_failure(op, "delta", p.delta, (dims({rows, 2 * inter}) + " F32, 16-byte aligned").c_str());
    }
    detail::require_cuda(op, {{"delta", &p.delta}});
  }
  if (rows * inter == 0) return;
  const ActivationKernelParams params{.h = static_cast<const __nv_bfloat16*>(p.h.data),
                                      .a = static_cast<__nv_bfloat16*>(p.a.data),
                                      .rows = rows,
                                      .inter = inter,
                                      .halves = p.layout == ops::GateUpLayout::kHalves,
                                      .gpt_oss = p.activation == ops::MoeActivation::kGptOssClamped,
                                      .swiglu_alpha = p.swiglu_alpha,
                                      .swiglu_limit = p.swiglu_limit,
                                      .delta = p.delta.defined() ? static_cast<float*>(p.delta.data) : nullptr};
  constexpr int kThreads = 256;  // the scalar kernel's blocks
  if (inter % 8 == 0 && detail::aligned16(p.h.data) && detail::aligned16(p.a.data) && rows * inter / 4 < INT32_MAX) {
    const dim3 threads(kActivationThreads);
    if (params.delta != nullptr) {
      detail::launch(activation_vec_kernel<true, 4>, dim3(detail::blocks_for(rows * inter / 4, kActivationThreads)),
                     threads, 0, stream, params);
    } else {
      detail::launch(activation_vec_kernel<false, 8>, dim3(detail::blocks_for(rows * inter / 8, kActivationThreads)),
                     threads, 0, stream, params);
    }
  } else {
    detail::launch(activation_kernel, dim3(detail::blocks_for(rows * inter, kThreads)), dim3(kThreads), 0, stream, params);
  }
  LMX_CUDA_CHECK_LAUNCH();
}

void moe_down(const MoeDownParams& p, cudaStream_t stream) {
  const char* op = "moe_down";
  if (p.a.dtype != DType::BF16 || p.a.ndim != 2 || p.a.dim(1) % 8 != 0 || !detail::aligned16(p.a.data)) {
    detail::contract_failure(op, "a", p.a,
                             p.a_in_tile_order ? "[capacity of the tiles, I] BF16 (tile order), I % 8 == 0, 16-byte aligned"
                                               : "[T*K, I] BF16, I % 8 == 0, 16-byte aligned");
  }
  if (p.d.ndim != 2) detail::contract_failure(op, "d", p.d, "[T*K, H] BF16");
  const int64_t pairs = p.a_in_tile_order ? p.d.dim(0) : p.a.dim(0), inter = p.a.dim(1);
  if (p.weight.ndim != 3) detail::contract_failure(op, "weight", p.weight, "[E, H, I]");
  const int64_t hidden = p.weight.dim(1);
  check_weight(op, "weight", p.weight, "bias", p.bias, hidden, inter);
  if (!is_bf16_matrix(p.d, pairs, hidden) || (reinterpret_cast<uintptr_t>(p.d.data) & 3u) != 0) {
    detail::contract_failure(op, "d", p.d, (dims({pairs, hidden}) + " BF16, 4-byte aligned").c_str());
  }
  detail::require_cuda(op, {{"a", &p.a}, {"d", &p.d}});
  const int64_t max_tiles = check_tiles(op, p.tiles);
  if (p.a_in_tile_order) {
    if (p.sorted_rows.defined()) fail(op, "a_in_tile_order: a is the A rows in tile order; sorted_rows must be undefined");
    if (!runs_persistent(int(p.tiles.block_m), true, false)) {
      fail(op, "a_in_tile_order needs the persistent TMA kernel: BLOCK_M 64 or 128 (got " +
                   std::to_string(p.tiles.block_m) + ") and the kAuto or warp-specialized kernel");
    }
    if (p.a.dim(0) != p.tiles.sorted_pairs.dim(0)) {
      detail::contract_failure(op, "a", p.a, (dims({p.tiles.sorted_pairs.dim(0), inter}) +
                                              " BF16: a_in_tile_order, one row per tile row (the tiles' capacity)").c_str());
    }
  }
  const Tensor& a_rows = p.a_in_tile_order ? p.a : p.sorted_rows;  // the A rows in tile order, if any
  check_block_n(op, p.block_n, p.tiles.block_m,
                kernel_for(p.tiles.block_m, p.sorted_rows.defined() || p.a_in_tile_order, false));
  if (p.block_n == 240 && (p.lora.defined() || p.stream_k.defined() || !(p.sorted_rows.defined() || p.a_in_tile_order))) {
    fail(op, "block_n = 240: built only for the persistent kernel (A rows in tile order, sorted_rows or "
             "a_in_tile_order) without lora or stream_k");
  }
  check_decode_stages(op, p.decode_stages);
  LMX_CHECK(pairs < 0x7fffffff && hidden < 0x7fffffff && inter < 0x7fffffff);
  GemmKernelParams params{.x = static_cast<const __nv_bfloat16*>(p.a.data),
                          .weight = static_cast<const __nv_bfloat16*>(p.weight.data),
                          .bias = p.bias.defined() ? static_cast<const __nv_bfloat16*>(p.bias.data) : nullptr,
                          .sorted_pairs = nullptr,
                          .tile_group = nullptr,
                          .num_tiles = nullptr,
                          .out = static_cast<__nv_bfloat16*>(p.d.data),
                          .pairs = int(pairs),
                          .row_div = 1,
                          .in = int(inter),
                          .n = int(hidden),
                          .fuse_activation = false,
                          .halves = false,
                          .gpt_oss = false,
                          .swiglu_alpha = 0.0f,
                          .swiglu_limit = 0.0f,
                          .cta_group = p.cta_group,
                          .weight_rows = p.weight.dim(0) * hidden,
                          .weight_by_tma = false,
                          .a_by_tma = false,
                          .work_tiles = 0,
                          .work_column_blocks = 0,
                          .pdl = p.pdl,
                          .routing_before_wait = p.routing_before_wait,
                          .wait_before_epilogue = p.wait_before_epilogue,
                          .early_trigger = p.early_trigger,
                          .weight_map = {},
                          .a_map = {},
                          .lora_h = nullptr,
                          .token_slot = nullptr};
  check_sorted_rows(op, p.sorted_rows, p.tiles, inter);
  if (p.lora.defined()) {
    if (p.top_k < 1 || pairs % p.top_k != 0) fail(op, "top_k = " + std::to_string(p.top_k) + " does not divide T*K = " + std::to_string(pairs));
    pack_gemm_lora(op, p.lora, pairs / p.top_k, pairs, p.weight.dim(0), hidden, int(p.tiles.block_m),
                   a_rows.defined(), false, params);
  }
  pack_stream_k(op, p.stream_k, params);
  pack_mxfp4(op, p.mxfp4, p.weight.dim(0), hidden, inter, int(p.tiles.block_m), false, params);
  launch_gemm(pack_tiles(params, p.tiles), p.tiles.block_m, p.block_n, p.decode_stages, max_tiles, a_rows,
              p.a_in_tile_order, nullptr, p.max_sms, stream);
}

void moe_combine(const MoeCombineParams& p, cudaStream_t stream) {
  const char* op = "moe_combine";
  if (p.topk_weights.dtype != DType::F32 || p.topk_weights.ndim != 2) {
    detail::contract_failure(op, "topk_weights", p.topk_weights, "[T, K] F32");
  }
  const int64_t tokens = p.topk_weights.dim(0), top_k = p.topk_weights.dim(1);
  if (p.out.dtype != DType::BF16 || p.out.ndim != 2 || p.out.dim(0) != tokens) {
    detail::contract_failure(op, "out", p.out, "[T, H] BF16 with T = topk_weights.dim(0)");
  }
  const int64_t hidden = p.out.dim(1);
  if (!is_bf16_matrix(p.d, tokens * top_k, hidden)) {
    detail::contract_failure(op, "d", p.d, (dims({tokens * top_k, hidden}) + " BF16").c_str());
  }
  detail::require_cuda(op, {{"d", &p.d}, {"topk_weights", &p.topk_weights}, {"out", &p.out}});
  if (p.clear.defined()) {
    if (p.clear.dtype != DType::F32 || p.clear.numel() % 4 != 0 || !detail::aligned16(p.clear.data)) {
      detail::contract_failure(op, "clear", p.clear, "F32, numel a multiple of 4, 16-byte aligned");
    }
    detail::require_cuda(op, {{"clear", &p.clear}});
  }
  if (p.delta.defined()) {
    if (p.delta.dtype != DType::F32 || p.delta.ndim != 2 || p.delta.dim(0) != tokens * top_k ||
        p.delta.dim(1) != hidden || !detail::aligned16(p.delta.data)) {
      detail::contract_failure(op, "delta", p.delta, (dims({tokens * top_k, hidden}) + " F32, 16-byte aligned").c_str());
    }
    detail::require_cuda(op, {{"delta", &p.delta}});
  }
  const int64_t clear_vectors = p.clear.defined() ? p.clear.numel() / 4 : 0;
  if (tokens * hidden == 0 && clear_vectors == 0) return;
  LMX_CHECK(top_k < 0x7fffffff);
  const CombineKernelParams params{.d = static_cast<const __nv_bfloat16*>(p.d.data),
                                   .topk_weights = static_cast<const float*>(p.topk_weights.data),
                                   .out = static_cast<__nv_bfloat16*>(p.out.data),
                                   .tokens = tokens,
                                   .hidden = hidden,
                                   .top_k = int(top_k),
                                   .clear = static_cast<float4*>(p.clear.data),
                                   .clear_vectors = clear_vectors,
                                   .delta = p.delta.defined() ? static_cast<float*>(p.delta.data) : nullptr};
  const bool terms = p.delta.defined();
  if (hidden % 8 == 0 && detail::aligned16(p.d.data) && detail::aligned16(p.out.data)) {
    const int64_t threads = std::max(tokens * hidden / 8, clear_vectors);
    launch_combine<8>(int(top_k), terms, detail::blocks_for(threads, kCombineThreads), stream, params);
  } else {
    const int64_t threads = std::max(tokens * hidden, clear_vectors);
    launch_combine<1>(int(top_k), terms, detail::blocks_for(threads, kCombineThreads), stream, params);
  }
  LMX_CUDA_CHECK_LAUNCH();
}

// ---- moe_block ----------------------------------------------------------------------------------------

namespace {

constexpr size_t kCarveAlign = 256;
size_t round_up(size_t bytes) { return (bytes + kCarveAlign - 1) / kCarveAlign * kCarveAlign; }

// Byte offsets of moe_block's buffers for a batch of `tokens` with expert tiles of `block_m`. The same
// function sizes the workspace (at max_tokens, both block_m) and carves it per call, so they agree.
struct WorkspaceLayout {
  int64_t expert_capacity = 0, lora_capacity = 0;
  // Self-cleaning MoE-LoRA scratch at fixed offsets (sized for max T; zeroed once by moe_workspace_prepare):
  size_t z = 0, tile_counters = 0, z_readers = 0, stream_k_counters = 0, clean_end = 0;
  size_t delta_gate_up = 0, delta_down = 0;  // the side expands' terms: [pairs, 2I] and [pairs, H] f32
  // Per call (offsets depend on T and BLOCK_M):
  size_t expert_sorted = 0, expert_tiles = 0, expert_offsets = 0, expert_count = 0, expert_scratch = 0;
  size_t lora_sorted = 0, lora_tiles = 0, lora_offsets = 0, lora_count = 0, lora_scratch = 0;
  size_t h = 0, a = 0, d = 0;
  size_t sorted_x = 0, sorted_a = 0;  // BLOCK_M 64/128: the warp-specialized kernel's gathered A rows
  size_t pair_rows = 0;               // BLOCK_M 64/128: each pair's row in sorted_a (a in tile order)
  size_t stream_k_partials = 0;       // BLOCK_M 64/128: MoeStreamK::partials (set_moe_gemm_stream_k)
  size_t z_rows = 0, tile_slots = 0;  // BLOCK_M 64/128 with LoRA: MoeGemmLora::z_rows / tile_slots
  size_t total = 0;
};

WorkspaceLayout layout_for(const MoeWorkspaceShape& s, int64_t tokens, int block_m) {
  WorkspaceLayout l;
  const int64_t pairs = tokens * s.top_k, lora_groups = s.slots * s.experts;
  const bool lora = s.slots > 0 && s.max_rank > 0;
  size_t offset = 0;
  auto take = [&](size_t bytes) {
    const size_t at = offset;
    offset += round_up(bytes);
    return at;
  };
  if (lora) {
    const int64_t max_pairs = s.max_tokens * s.top_k;
    const int64_t max_tiles = moe_align_capacity(max_pairs, lora_groups, kMoeLoraBlockM) / kMoeLoraBlockM;
    // The decode MoE-LoRA in the GEMM accumulators holds gate_up's z and down's side by side until the
    // combine clears both: room for two of the direct path's largest batch.
    const int64_t z_rows = std::max(max_pairs, 2 * std::min(max_pairs, kMoeLoraSmallMaxPairs));
    l.z = take(size_t(z_rows) * s.max_rank * 4);
    l.tile_counters = take(size_t(max_tiles + kMoeLoraWorkCounters) * 4);  // + the persistent expand's
    l.z_readers = take(size_t(max_pairs + 1) * 4);
    // set_moe_lora_side_expands (the direct path's batches only)
    const int64_t delta_rows = std::min(max_pairs, kMoeLoraSmallMaxPairs);
    l.delta_gate_up = take(size_t(delta_rows) * 2 * s.inter * 4);
    l.delta_down = take(size_t(delta_rows) * s.hidden * 4);
  }
  l.stream_k_counters = take(size_t(moe_stream_k_counters()) * 4);
  l.clean_end = offset;
  // With LoRA the expert align may order each expert's pairs by slot (E·(S + 1) groups in runs of S + 1).
  const int64_t expert_groups = lora ? s.experts * (s.slots + 1) : s.experts;
  l.expert_capacity = moe_align_capacity(pairs, s.experts, block_m);
  l.expert_sorted = take(size_t(l.expert_capacity) * 4);
  l.expert_tiles = take(size_t(l.expert_capacity / block_m) * 4);
  l.expert_offsets = take(size_t(expert_groups + 1) * 4);
  l.expert_count = take(4);
  l.expert_scratch = take(moe_align_workspace_bytes(pairs, expert_groups));
  l.a = take(size_t(pairs) * s.inter * 2);
  l.d = take(size_t(pairs) * s.hidden * 2);
  if (block_m != kMoeGemmBlockMDecode) {
    l.sorted_x = take(size_t(l.expert_capacity) * s.hidden * 2);
    l.sorted_a = take(size_t(l.expert_capacity) * s.inter * 2);
    l.pair_rows = take(size_t(pairs) * 4);
    l.stream_k_partials = take(size_t(moe_stream_k_floats()) * 4);
  }
  if (lora) {
    l.lora_capacity = moe_align_capacity(pairs, lora_groups, kMoeLoraBlockM);
    l.lora_sorted = take(size_t(l.lora_capacity) * 4);
    l.lora_tiles = take(size_t(l.lora_capacity / kMoeLoraBlockM) * 4);
    l.lora_offsets = take(size_t(lora_groups + 1) * 4);
    l.lora_count = take(4);
    l.lora_scratch = take(moe_align_workspace_bytes(pairs, lora_groups));
    l.h = take(size_t(pairs) * 2 * s.inter * 2);
    if (block_m != kMoeGemmBlockMDecode) {
      l.z_rows = take(size_t(l.expert_capacity) * 64 * 2);
      l.tile_slots = take(size_t(l.expert_capacity / block_m) * 4);
    }
  }
  l.total = offset;
  return l;
}

}  // namespace

size_t moe_workspace_bytes(const MoeWorkspaceShape& shape) {
  size_t bytes = 0;
  for (int block_m : {kMoeGemmBlockMDecode, kMoeGemmBlockMPrefill, kMoeGemmBlockMLarge}) {
    bytes = std::max(bytes, layout_for(shape, shape.max_tokens, block_m).total);
  }
  return bytes;
}

void moe_workspace_prepare(const MoeWorkspace& workspace, cudaStream_t stream) {
  detail::require_cuda("moe_workspace_prepare", {{"workspace.memory", &workspace.memory}});
  const size_t clean = layout_for(workspace.shape, workspace.shape.max_tokens, kMoeGemmBlockMDecode).clean_end;
  if (workspace.memory.nbytes() < clean) {
    detail::contract_failure("moe_workspace_prepare", "workspace.memory", workspace.memory,
                             "at least moe_workspace_bytes(shape) bytes");
  }
  if (clean > 0) LMX_CUDA_CHECK(cudaMemsetAsync(workspace.memory.data, 0, clean, stream));
}

void moe_block(const ops::MoeParams& p, const MoeWorkspace& workspace, cudaStream_t stream,
               const MoeBlockConfig& config) {
  const char* op = "moe_block";
  ops::require(ops::check(p), op);
  detail::require_bf16_activation(op, "MoeParams.x", p.x);
  detail::require_cuda(op, {{"MoeParams.x", &p.x}, {"workspace.memory", &workspace.memory}});
  const int64_t tokens = p.x.dim(0), hidden = p.x.dim(1), top_k = p.topk_ids.dim(1);
  const int64_t experts = p.gate_up.dim(0), inter = p.down.dim(2), pairs = tokens * top_k;
  const bool lora_gu = p.lora_gate_up.defined(), lora_down = p.lora_down.defined(), lora = lora_gu || lora_down;
  const int64_t slots = lora_gu ? p.lora_gate_up.a.dim(0) : lora_down ? p.lora_down.a.dim(0) : 0;
  if (lora_gu && lora_down && p.lora_down.a.dim(0) != slots) {
    fail(op, "MoeParams.lora_gate_up and lora_down have different slot counts S: " + std::to_string(slots) +
                 " vs " + std::to_string(p.lora_down.a.dim(0)));
  }
  const int64_t max_rank = std::max(lora_gu ? p.lora_gate_up.b.dim(-1) : 0, lora_down ? p.lora_down.b.dim(-1) : 0);
  const MoeWorkspaceShape& s = workspace.shape;
  if (tokens > s.max_tokens || top_k != s.top_k || experts != s.experts || hidden != s.hidden || inter != s.inter ||
      (lora && (slots != s.slots || max_rank > s.max_rank))) {
    fail(op, "the batch (T " + std::to_string(tokens) + ", K " + std::to_string(top_k) + ", E " +
                 std::to_string(experts) + ", H " + std::to_string(hidden) + ", I " + std::to_string(inter) + ", S " +
                 std::to_string(slots) + ", R " + std::to_string(max_rank) +
                 ") does not fit the workspace shape (max T " + std::to_string(s.max_tokens) + ", K " +
                 std::to_string(s.top_k) + ", E " + std::to_string(s.experts) + ", H " + std::to_string(s.hidden) +
                 ", I " + std::to_string(s.inter) + ", S " + std::to_string(s.slots) + ", max R " +
                 std::to_string(s.max_rank) + ")");
  }
  if (tokens == 0) return;
  const int block_m = moe_gemm_block_m(pairs, experts);
  const WorkspaceLayout l = layout_for(s, tokens, block_m);
  if (workspace.memory.nbytes() < l.total) {
    detail::contract_failure(op, "workspace.memory", workspace.memory,
                             ("at least " + std::to_string(l.total) + " bytes (moe_workspace_bytes)").c_str());
  }
  char* base = static_cast<char*>(workspace.memory.data);
  auto view = [&](size_t offset, DType dtype, std::initializer_list<int64_t> shape) {
    return Tensor(base + offset, dtype, shape, Device::kCuda);
  };

  // The MoE-LoRA's launch shape: a tiny batch goes pair by pair (no second align); otherwise tiles by
  // (slot, expert). Both keep z (and their counters) zero between calls, so nothing is memset here.
  const bool small = lora && (config.lora_path == 0 || (config.lora_path < 0 && moe_lora_small_fits(pairs)));
  // The warp-specialized kernel (BLOCK_M 64/128) reads both operands by TMA from rows gathered into tile order.
  // kAuto gathers only where the weight is one TMA box too (not the fused halves layout; see kernel_for).
  const bool gather_rows = block_m != kMoeGemmBlockMDecode && (gemm_kernel == MoeGemmKernel::kAuto ||
                                                                gemm_kernel == MoeGemmKernel::kWgmmaWarpSpecialized);
  // Where moe_lora_in_gemm_for picks it (set_moe_lora_in_gemm: by default for long same-adapter runs) the
  // tiled MoE-LoRA goes into the persistent GEMMs' accumulators (MoeGemmLora): gate_up where its fused
  // output runs there (interleaved layout), down always; the shrink writes z, the GEMM reads it, and z is
  // zeroed after (the tiled shrink's invariant: z zero between calls).
  const bool in_gemm = moe_lora_in_gemm_for(lora_in_gemm, tokens, p.lora_scattered_tokens, block_m);
  const bool gemm_lora_gu = lora_gu && !small && in_gemm && gather_rows &&
                            (p.layout == ops::GateUpLayout::kInterleaved || lora_on_halves(block_m));
  const bool gemm_lora_down = lora_down && !small && in_gemm && gather_rows;
  // Decode (16-row tiles, the direct path): the direct shrinks write z, the decode GEMMs add z·Bᵀ (any
  // layout), gate_up keeps its fused activation, and the combine clears z. Without it: gate_up → h, shrink,
  // expand, activation, down, shrink, expand — three launches and h's round trip more.
  // Not where the decode GEMMs read MXFP4 experts (unless set_moe_lora_in_mxfp4_gemm): their k-loops are ~2x
  // shorter, so the LoRA pass after them weighs more than the expand kernels' launches (perf-log run 118:
  // decode step 7.49 ms in the accumulators, 7.13 by the expand kernels).
  const bool mxfp4_decode = block_m == kMoeGemmBlockMDecode && gemm_mxfp4 &&
                            (p.gate_up_mxfp4.defined() || p.down_mxfp4.defined());
  const bool decode_gemm_lora = lora && small && moe_lora_small_fits(pairs) && in_gemm &&
                                block_m == kMoeGemmBlockMDecode && (!mxfp4_decode || lora_in_mxfp4_gemm);  // z's room
  // Then each expert's pairs are ordered by slot (moe_align order_by_slot), so a warp's 16 rows hold one or
  // two adapters even where adapters interleave token by token; where moe_lora_warp_groups_for says so, each
  // slot's rows start at a warp boundary where the expert's tiles have room, so no warp holds two.
  const bool order_by_slot = gemm_lora_gu || gemm_lora_down;
  const int slot_group_rows =
      order_by_slot && moe_lora_warp_groups_for(lora_in_gemm, tokens, p.lora_scattered_tokens, block_m)
          ? kMoeLoraWarpRows
          : 1;

  // 1. Tiles by expert.
  const int64_t expert_groups = order_by_slot ? experts * (slots + 1) : experts;
  const MoeExpertTiles tiles{.sorted_pairs = view(l.expert_sorted, DType::I32, {l.expert_capacity}),
                             .tile_group = view(l.expert_tiles, DType::I32, {l.expert_capacity / block_m}),
                             .num_tiles = view(l.expert_count, DType::I32, {1}),
                             .block_m = block_m};
  const int64_t expert_scratch = int64_t(moe_align_workspace_bytes(pairs, expert_groups));
  moe_align({.topk_ids = p.topk_ids, .token_slot = order_by_slot ? p.token_slot : Tensor(), .experts = experts,
             .slots = order_by_slot ? slots : 0, .block_m = block_m, .sorted_pairs = tiles.sorted_pairs,
             .tile_group = tiles.tile_group, .group_offsets = view(l.expert_offsets, DType::I32, {expert_groups + 1}),
             .num_tiles = tiles.num_tiles, .workspace = view(l.expert_scratch, DType::U8, {expert_scratch}),
             .order_by_slot = order_by_slot, .slot_group_rows = slot_group_rows},
            stream);
  const Tensor a = view(l.a, DType::BF16, {pairs, inter});  // [T*K, I] bf16
  const Tensor d = view(l.d, DType::BF16, {pairs, hidden});  // [T*K, H] bf16

  // 2. The MoE-LoRA's (slot, expert) tiles.
  Tensor lora_sorted, lora_tiles, lora_count, tile_counters;
  if (lora && !small) {
    const int64_t groups = slots * experts;
    lora_sorted = view(l.lora_sorted, DType::I32, {l.lora_capacity});
    lora_tiles = view(l.lora_tiles, DType::I32, {l.lora_capacity / kMoeLoraBlockM});
    lora_count = view(l.lora_count, DType::I32, {1});
    tile_counters = view(l.tile_counters, DType::I32, {l.lora_capacity / kMoeLoraBlockM + kMoeLoraWorkCounters});
    const int64_t lora_scratch = int64_t(moe_align_workspace_bytes(pairs, groups));
    moe_align({.topk_ids = p.topk_ids, .token_slot = p.token_slot, .experts = experts, .slots = slots,
               .block_m = kMoeLoraBlockM, .sorted_pairs = lora_sorted, .tile_group = lora_tiles,
               .group_offsets = view(l.lora_offsets, DType::I32, {groups + 1}), .num_tiles = lora_count,
               .workspace = view(l.lora_scratch, DType::U8, {lora_scratch})},
              stream);
  }
  // The tiled shrink's tiles per CTA: runs of one group's tiles where long same-adapter runs dominate
  // (moe_lora_shrink_runs_for), unless the tuned config fixes it.
  MoeLoraConfig lora_config = config.lora;
  if (lora_config.shrink_tiles_per_cta == 0 && moe_lora_shrink_runs_for(tokens, p.lora_scattered_tokens, top_k, experts)) {
    lora_config.shrink_tiles_per_cta = moe_lora_run_tiles();
    if (shrink_runs_split) lora_config.split_k = moe_lora_run_split(pairs, experts);
  }
  // y += B·(A·x) for every pair with a slot, by the path chosen above.
  // overwrite (tiled path only): y = B·(A·x) on those pairs instead of +=.
  auto apply_lora = [&](const ops::LoraStack& w, const Tensor& x, const Tensor& y, bool overwrite = false,
                        const Tensor& x_rows = Tensor()) {
    const Tensor z = view(l.z, DType::F32, {pairs, w.b.dim(-1)});
    if (small) {
      const MoeLoraSmallParams sp{.x = x, .topk_ids = p.topk_ids, .token_slot = p.token_slot, .w = w, .z = z,
                                  .z_readers = view(l.z_readers, DType::I32, {pairs + 1}), .y = y,
                                  .pdl = config.small_pdl};
      moe_lora_small_shrink(sp, stream);
      moe_lora_small_expand(sp, stream);
      return;
    }
    const MoeLoraParams lp{.x = x, .x_rows = x_rows, .w = w, .top_k = top_k, .sorted_pairs = lora_sorted,
                           .tile_group = lora_tiles,
                           .num_tiles = lora_count, .block_m = kMoeLoraBlockM, .z = z, .y = y,
                           .config = lora_config, .tile_counters = tile_counters, .overwrite = overwrite};
    moe_lora_shrink(lp, stream);
    moe_lora_expand(lp, stream);
  };

  // 3. gate_up: fused activation unless the LoRA must add into h first. 128-row tiles (large prefill) run
  // in groups of 8 tiles × every column block (set_moe_block_cta_group): GPT-OSS-20B T 4096 gate_up 1866 →
  // 1787 µs, down 1053 → 915 (perf-log run 19); at 64-row tiles the figures were within the run's noise, so
  // plain order stays.
  const int cta_group = block_m == kMoeGemmBlockMLarge ? block_cta_group : 0;
  // PDL (config.gemm_pdl): gate_up waits at its start (align, directly before, writes its tiles) but lets
  // its dependents (down, or the LoRA shrink) start in its tail; down reads the tiles and streams its first
  // weight stages before its wait — the kernel before it (gate_up with pdl, or the plain activation) never
  // writes the tiles and waits in every CTA before it triggers.
  MoeGateUpParams gate_up{.x = p.x, .weight = p.gate_up, .bias = p.gate_up_bias, .top_k = top_k, .tiles = tiles,
                          .activation = p.activation, .layout = p.layout, .swiglu_alpha = p.swiglu_alpha,
                          .swiglu_limit = p.swiglu_limit, .cta_group = cta_group,
                          .pdl = config.gemm_pdl && programmatic_launches()};
  gate_up.max_sms = config.max_sms;
  if (block_m == kMoeGemmBlockMDecode) gate_up.block_n = block_decode_block_n[0];  // MXFP4 keeps its own shape
  // --mxfp4-experts: the decode GEMMs (BLOCK_M 16) stream the experts' MXFP4 copies (interleaved gate/up only)
  const bool mxfp4 = block_m == kMoeGemmBlockMDecode && gemm_mxfp4;
  if (mxfp4 && p.layout == ops::GateUpLayout::kInterleaved && p.gate_up_mxfp4.defined()) {
    gate_up.mxfp4 = {.blocks = p.gate_up_mxfp4.blocks, .scales = p.gate_up_mxfp4.scales};
  }
  // set_moe_gemm_stream_k: both persistent GEMMs cut their partial last round along k (prefill tiles only;
  // the counters live in the self-cleaning scratch)
  const MoeStreamK stream_k =
      gemm_stream_k && block_m != kMoeGemmBlockMDecode
          ? MoeStreamK{.partials = view(l.stream_k_partials, DType::F32, {moe_stream_k_floats()}),
                       .counters = view(l.stream_k_counters, DType::I32, {moe_stream_k_counters()})}
          : MoeStreamK{};
  gate_up.stream_k = stream_k;
  // With set_moe_lora_in_epilogue(true) the tiled MoE-LoRA of gate_up folds into the fused activation: its
  // expand writes the delta into h (overwrite: every pair with a slot), and the gate_up epilogue adds it before
  // the activation — no pre-activation h round trip, no moe_activation. Measured slower than adding into h
  // (the default; see lora_in_epilogue), so kept as a bench row. The small path always adds into h.
  // y: the GEMM's output as the shrink's contract wants it (the shrink does not touch it).
  auto gemm_lora = [&](const ops::LoraStack& w, const Tensor& x, const Tensor& y, const Tensor& x_rows = Tensor()) {
    const Tensor z = view(l.z, DType::F32, {pairs, w.b.dim(-1)});
    moe_lora_shrink({.x = x, .x_rows = x_rows, .w = w, .top_k = top_k, .sorted_pairs = lora_sorted,
                     .tile_group = lora_tiles,
                     .num_tiles = lora_count, .block_m = kMoeLoraBlockM, .z = z, .y = y,
                     .config = lora_config, .tile_counters = tile_counters},
                    stream);
    return MoeGemmLora{.z = z, .b = w.b, .rank = w.rank, .token_slot = p.token_slot,
                       .z_rows = view(l.z_rows, DType::BF16, {l.expert_capacity, 64}),
                       .tile_slots = view(l.tile_slots, DType::I32, {l.expert_capacity / block_m})};
  };
  auto zero_z = [&](const MoeGemmLora& lora) {
    LMX_CUDA_CHECK(cudaMemsetAsync(lora.z.data, 0, lora.z.nbytes(), stream));
  };
  // The decode path's z: gate_up's [pairs, R_gu] then down's [pairs, R_down], side by side (the
  // workspace's z has room for both), cleared together by the combine.
  const int64_t rank_gu = lora_gu ? p.lora_gate_up.b.dim(-1) : 0, rank_down = lora_down ? p.lora_down.b.dim(-1) : 0;
  auto decode_lora = [&](const ops::LoraStack& w, const Tensor& x, const Tensor& y, int64_t z_offset, bool x_before_wait) {
    const Tensor z(base + l.z + size_t(z_offset) * 4, DType::F32, {pairs, w.b.dim(-1)}, Device::kCuda);
    moe_lora_small_shrink({.x = x, .topk_ids = p.topk_ids, .token_slot = p.token_slot, .w = w, .z = z,
                           .z_readers = view(l.z_readers, DType::I32, {pairs + 1}), .y = y,
                           .pdl = config.small_pdl, .x_before_wait = x_before_wait},
                          stream);
    return MoeGemmLora{.z = z, .b = w.b, .rank = w.rank, .token_slot = p.token_slot};
  };
  const bool fold_lora = lora_gu && !small && lora_in_epilogue && !gemm_lora_gu;
  const bool fused = !lora_gu || fold_lora || gemm_lora_gu || decode_gemm_lora;
  const bool fused_halves = fused && p.layout == ops::GateUpLayout::kHalves;
  if (gather_rows && (gemm_kernel != MoeGemmKernel::kAuto || !fused_halves || halves_on_tma(block_m))) {
    gate_up.sorted_rows = view(l.sorted_x, DType::BF16, {l.expert_capacity, hidden});
  }
  // Where gate_up's fused output runs on the persistent kernel it writes a straight into down's A rows in tile
  // order (MoeGateUpParams::pair_rows), so down needs no gather of a; the down MoE-LoRA's shrink then reads a
  // through pair_rows. Not with the direct per-pair LoRA path, which reads a by pair.
  const bool a_by_row =
      a_in_tile_order && fused && (!fused_halves || halves_on_tma(block_m)) && gate_up.sorted_rows.defined() && !small;
  const Tensor a_rows = a_by_row ? view(l.sorted_a, DType::BF16, {l.expert_capacity, inter}) : a;
  const Tensor pair_rows = a_by_row ? view(l.pair_rows, DType::I32, {pairs}) : Tensor();
  if (a_by_row) gate_up.pair_rows = pair_rows;
  const Tensor h = view(l.h, DType::BF16, {pairs, 2 * inter});  // [T*K, 2I] bf16
  // With config.decode_lora_overlap each decode GEMM runs its whole k-loop alongside the shrink launched
  // just before it (wait_before_epilogue: tiles and x are two launches back, the shrink touches neither them
  // nor the GEMM's output), and waits only to read z; otherwise the GEMM streams its first weight stages
  // during the shrink (routing_before_wait) and waits for it before its k-loop. Only from 32 pairs: GPT-OSS-20B
  // T 16 403.9 vs 407.8 µs, but T 1 (one wave of GEMM CTAs, nothing to hide the shrink behind) 74.6 vs 72.7
  // (perf-log run 70).
  constexpr int64_t kDecodeLoraOverlapMinPairs = 32;
  const bool overlap = config.decode_lora_overlap && pairs >= kDecodeLoraOverlapMinPairs;
  // The decode MoE-LoRA by the expand kernels (MXFP4 experts; set_moe_lora_in_gemm(kOff)), forked: each shrink on
  // the side stream beside its GEMM — it needs only the GEMM's input — and the expand after both, reading the
  // GEMM's output after its programmatic wait (base = y: the same bits as y += delta). In the chain (GEMM →
  // shrink → expand) both shrinks, ~10 µs each at T 16, sat on the critical path (perf-log run 133); a shrink
  // launched before its GEMM stalled it instead (run 134: the MXFP4 GEMM fills every SM while its CTAs wait
  // for the shrink's).
  const bool fork_shrinks = lora && small && !decode_gemm_lora && lora_fork_shrinks && config.side_stream != nullptr &&
                            config.fork != nullptr && config.join != nullptr && block_m == kMoeGemmBlockMDecode;
  // With set_moe_lora_side_expands the expand follows its shrink on the side stream, writing the term into
  // `delta` (the workspace's self-cleaning scratch) for moe_activation / moe_combine to add after the join.
  const bool side_expands = fork_shrinks && lora_side_expands && moe_lora_small_fits(pairs);  // the scratch's rows
  const Tensor delta_gate_up = side_expands ? view(l.delta_gate_up, DType::F32, {pairs, 2 * inter}) : Tensor();
  const Tensor delta_down = side_expands ? view(l.delta_down, DType::F32, {pairs, hidden}) : Tensor();
  auto forked_shrink = [&](const ops::LoraStack& w, const Tensor& x, const Tensor& y, const Tensor& delta) {
    const MoeLoraSmallParams sp{.x = x, .topk_ids = p.topk_ids, .token_slot = p.token_slot, .w = w,
                                .z = view(l.z, DType::F32, {pairs, w.b.dim(-1)}),
                                .z_readers = view(l.z_readers, DType::I32, {pairs + 1}), .y = y,
                                .pdl = config.small_pdl, .base = delta.defined() ? Tensor() : y, .delta = delta};
    MoeLoraSmallParams side = sp;
    side.pdl = false;  // on the side stream: a plain launch after the fork
    LMX_CUDA_CHECK(cudaEventRecord(config.fork, stream));
    LMX_CUDA_CHECK(cudaStreamWaitEvent(config.side_stream, config.fork, 0));
    moe_lora_small_shrink(side, config.side_stream);
    if (delta.defined()) moe_lora_small_expand(sp, config.side_stream);  // directly after its shrink (pdl)
    LMX_CUDA_CHECK(cudaEventRecord(config.join, config.side_stream));
    return sp;
  };
  auto joined_expand = [&](const MoeLoraSmallParams& sp) {
    LMX_CUDA_CHECK(cudaStreamWaitEvent(stream, config.join, 0));
    if (!sp.delta.defined()) moe_lora_small_expand(sp, stream);  // else it ran on the side stream
  };
  if (decode_gemm_lora) {
    // The shrink reads x before its wait (x is the router's input, written three launches back).
    gate_up.a = a;
    if (lora_gu) {
      gate_up.lora = decode_lora(p.lora_gate_up, p.x, h, 0, true);
      gate_up.routing_before_wait = gate_up.pdl && !overlap;
      gate_up.wait_before_epilogue = gate_up.pdl && overlap;
      gate_up.early_trigger = gemm_early_trigger;
    }
    moe_gate_up(gate_up, stream);
  } else if (gemm_lora_gu) {
    gate_up.a = a_rows;
    gate_up.lora = gemm_lora(p.lora_gate_up, p.x, view(l.h, DType::BF16, {pairs, 2 * inter}));
    moe_gate_up(gate_up, stream);
    zero_z(gate_up.lora);
  } else if (fold_lora) {
    apply_lora(p.lora_gate_up, p.x, h, true);
    gate_up.a = a_rows;
    gate_up.lora_h = h;
    gate_up.token_slot = p.token_slot;
    moe_gate_up(gate_up, stream);
  } else if (lora_gu && fork_shrinks) {
    const MoeLoraSmallParams sp = forked_shrink(p.lora_gate_up, p.x, h, delta_gate_up);
    gate_up.h = h;
    moe_gate_up(gate_up, stream);
    joined_expand(sp);
    moe_activation({.h = h, .activation = p.activation, .layout = p.layout, .swiglu_alpha = p.swiglu_alpha,
                    .swiglu_limit = p.swiglu_limit, .a = a, .delta = delta_gate_up},
                   stream);
  } else if (lora_gu) {
    gate_up.h = h;
    moe_gate_up(gate_up, stream);
    apply_lora(p.lora_gate_up, p.x, h);
    moe_activation({.h = h, .activation = p.activation, .layout = p.layout, .swiglu_alpha = p.swiglu_alpha,
                    .swiglu_limit = p.swiglu_limit, .a = a},
                   stream);
  } else {
    gate_up.a = a_rows;
    moe_gate_up(gate_up, stream);
  }

  // 4. down (+ LoRA into d), 5. combine.
  const MoeGemmLora down_lora = gemm_lora_down                 ? gemm_lora(p.lora_down, a_rows, d, pair_rows)
                                : decode_gemm_lora && lora_down ? decode_lora(p.lora_down, a, d, pairs * rank_gu, false)
                                                                : MoeGemmLora{};
  const bool fork_down = fork_shrinks && lora_down;
  const MoeLoraSmallParams down_small = fork_down ? forked_shrink(p.lora_down, a, d, delta_down) : MoeLoraSmallParams{};
  moe_down({.a = a_rows, .weight = p.down, .bias = p.down_bias, .tiles = tiles, .d = d,
            .block_n = block_m == kMoeGemmBlockMLarge && gather_rows
                           ? (block_down_block_n != 0
                                  ? (block_down_block_n == 240 && (down_lora.defined() || stream_k.defined())
                                         ? 192  // 240 is built without LoRA terms or the stream-K tail
                                         : block_down_block_n)
                                  : down_block_n_for(p.down.dim(1), !down_lora.defined() && !stream_k.defined()))
                       : block_m == kMoeGemmBlockMDecode ? block_decode_block_n[1]
                                                         : 0,
            .cta_group = cta_group,
            .decode_stages = block_m == kMoeGemmBlockMDecode ? block_down_decode_stages : 0,
            .pdl = config.gemm_pdl && programmatic_launches(), .routing_before_wait = true,
            .wait_before_epilogue = decode_gemm_lora && lora_down && overlap,
            .early_trigger = gemm_early_trigger,
            .sorted_rows = gather_rows && !a_by_row ? view(l.sorted_a, DType::BF16, {l.expert_capacity, inter})
                                                    : Tensor(),
            .max_sms = config.max_sms, .lora = down_lora, .top_k = top_k, .a_in_tile_order = a_by_row,
            .stream_k = stream_k,
            .mxfp4 = mxfp4 && p.down_mxfp4.defined()
                         ? MoeMxfp4Weight{.blocks = p.down_mxfp4.blocks, .scales = p.down_mxfp4.scales}
                         : MoeMxfp4Weight{}},
           stream);
  if (gemm_lora_down) zero_z(down_lora);
  else if (fork_down) joined_expand(down_small);
  else if (lora_down && !decode_gemm_lora) apply_lora(p.lora_down, a_rows, d, false, pair_rows);
  const Tensor clear = decode_gemm_lora ? view(l.z, DType::F32, {pairs * (rank_gu + rank_down)}) : Tensor();
  moe_combine({.d = d, .topk_weights = p.topk_weights, .out = p.out, .clear = clear,
               .delta = fork_down ? delta_down : Tensor()},
              stream);
}

}  // namespace lmx::cuda
