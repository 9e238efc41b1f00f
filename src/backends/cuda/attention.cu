// Kernels of the paged-KV attention family and their launchers (docs/kernels.md). kv_write: a pure scatter of
// this step's k/v rows into cache rows. attention: flash (tensor-core tiles of (token, GQA head) rows against
// 64-key tiles gathered through the block table), the same with the keys split over CTAs plus a combine
// (decode: flash-decoding), and the first simple kernel (one warp per row) as the fallback for other D.
// The launcher of attention() is the one place that picks among them.
#include "backends/cuda/attention.cuh"

#include <cuda_bf16.h>

#include <algorithm>
#include <bit>
#include <array>
#include <cmath>
#include <climits>
#include <cstdio>
#include <cstdlib>

#include "backends/cuda/check.h"
#include "backends/cuda/launch.cuh"
#include "backends/cuda/device.cuh"
#include "backends/cuda/wgmma.cuh"
#include "ops/backend.h"

namespace lmx::cuda {
namespace {

using detail::exp2_ftz;
using detail::fence_operands;
using detail::fence_proxy_async;
using detail::sw128_descriptor;
using detail::wgmma_commit;
using detail::wgmma_fence;
using detail::wgmma_m64n64k16_bf16;
using detail::wgmma_m64n128k16_f16_rs;
using detail::wgmma_m64n64k16_f16_rs;
using detail::wgmma_wait;

// ---- device helpers -----------------------------------------------------------------------------------

// 16 bytes global -> shared, asynchronous; src_bytes 0 writes zeros without reading (keys past the range).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Four 8×8 bf16 matrices; lanes 8i..8i+7 address the rows of matrix i. Plain: register i gets matrix i's
// (row lane/4, columns 2·(lane%4), +1); trans: (rows 2·(lane%4), +1, column lane/4).
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* smem) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* smem) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// d += a·b, m16n8k16, bf16 in, fp32 accumulate.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d += a·b, m16n8k16, fp16 in, fp32 accumulate: P·V. P in [0, 1] as fp16 keeps 11 significant bits (bf16
// would keep 8: measured 7.2e-3 scaled error at context 1000, too near kTolBf16Out); V's bf16 values are
// exact in fp16 between 2^-14 and 65504 (smaller ones lose bits below 2^-24, larger saturate).
__device__ __forceinline__ void mma_f16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats as an fp16 pair, x in the low half (the lower k index of an mma fragment), rounded to nearest,
// magnitudes above 65504 saturated.
__device__ __forceinline__ unsigned pack_f16(float x, float y) {
  unsigned packed;
  asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;\n" : "=r"(packed) : "f"(y), "f"(x));
  return packed;
}

// A bf16 pair (a fragment register) as the fp16 pair of the same values.
__device__ __forceinline__ unsigned bf16x2_to_f16x2(unsigned v) {
  return pack_f16(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
}

// ---- kernels ------------------------------------------------------------------------------------------

struct KvWriteKernelParams {
  const void* k;                 // [T, Hkv, D] bf16
  const void* v;                 // [T, Hkv, D] bf16
  const int32_t* kv_write_index; // [T] i32: flat cache row (page * P + offset)
  void* k_cache;                 // [pages * P, Hkv, D] bf16
  void* v_cache;                 // [pages * P, Hkv, D] bf16
  int64_t units_per_row;         // Hkv * D * 2 bytes / sizeof(Unit)
};

// Grid: x = T tokens, y = 2 (k, v), z = chunks of blockDim.x units along the row.
// PRECOND: every kv_write_index in [0, pages * P) or -1 (skipped) and distinct (two tokens never share a
// cache row); Unit is
// uint4 only if the row is a multiple of 16 bytes and every base is 16-byte aligned; caches disjoint from
// k and v.
template <typename Unit>
__global__ static void kv_write_kernel(const __grid_constant__ KvWriteKernelParams p) {
  detail::pdl_enter();  // first: launched by detail::launch (launch.cuh)
  const int64_t token = blockIdx.x;
  const int64_t cache_row = p.kv_write_index[token];
  if (cache_row < 0) return;  // a padding row (CUDA-graph batch buckets)
  const bool is_v = blockIdx.y == 1;
  const auto* src = static_cast<const Unit*>(is_v ? p.v : p.k) + token * p.units_per_row;
  auto* dst = static_cast<Unit*>(is_v ? p.v_cache : p.k_cache) + cache_row * p.units_per_row;
  detail::copy_units(dst, src, p.units_per_row, int64_t(blockIdx.z) * blockDim.x + threadIdx.x,
                     int64_t(gridDim.z) * blockDim.x);
}

struct AttentionKernelParams {
  const __nv_bfloat16* q;        // [T, Hq, D] bf16
  const __nv_bfloat16* k_cache;  // [pages * P, Hkv, D] bf16
  const __nv_bfloat16* v_cache;  // [pages * P, Hkv, D] bf16
  const int32_t* block_table;    // [B, max_pages] i32
  const int32_t* seq_start;      // [B + 1] i32
  const int32_t* positions;      // [T] i32
  const __nv_bfloat16* sinks;    // [Hq] bf16 or null
  __nv_bfloat16* out;            // [T, Hq, D] bf16
  int tokens, seqs, q_heads, kv_heads, head_dim, page_size, max_pages, sliding_window;
  float softmax_scale;
};

constexpr int kAttentionWarps = 4;  // rows (token, head) per CTA
constexpr int kKeysPerStep = 4;     // independent dot products in flight per warp

// Lane l owns dims l, l + 32, ... (kDimsPerLane of them, D <= 32 * kDimsPerLane). Per step the warp scores
// kKeysPerStep keys (interleaved shuffle reductions), then folds them into the running max m, denominator
// l and accumulator; the sink starts the softmax as a key with logit `sink` and no value, as the oracle.
// PRECOND: metadata valid (the CPU oracle's validate_attention_metadata rules); keys [lo, position] are in
// the cache; D <= 32 * kDimsPerLane.
template <int kDimsPerLane>
__global__ static void __launch_bounds__(32 * kAttentionWarps)
    attention_kernel(const __grid_constant__ AttentionKernelParams p) {
  detail::pdl_enter();  // first: launched by detail::launch (launch.cuh)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row = int64_t(blockIdx.x) * kAttentionWarps + warp;  // token * Hq + head
  if (row >= int64_t(p.tokens) * p.q_heads) return;
  const int token = int(row / p.q_heads), head = int(row % p.q_heads);
  const int kv_head = head / (p.q_heads / p.kv_heads);
  // The sequence of this token: the last b with seq_start[b] <= token (binary search over B + 1 entries).
  int lo_b = 0, hi_b = p.seqs - 1;
  while (lo_b < hi_b) {
    const int mid = (lo_b + hi_b + 1) / 2;
    if (p.seq_start[mid] <= token) lo_b = mid;
    else hi_b = mid - 1;
  }
  const int32_t* pages = p.block_table + int64_t(lo_b) * p.max_pages;
  const int position = p.positions[token];
  const int first_key = p.sliding_window > 0 ? max(0, position - p.sliding_window + 1) : 0;

  float q[kDimsPerLane], acc[kDimsPerLane];
#pragma unroll
  for (int i = 0; i < kDimsPerLane; ++i) {
    const int d = lane + 32 * i;
    q[i] = d < p.head_dim ? __bfloat162float(p.q[row * p.head_dim + d]) * p.softmax_scale : 0.0f;
    acc[i] = 0.0f;
  }
  float running_max = -INFINITY, denominator = 0.0f;
  if (p.sinks != nullptr) {
    running_max = __bfloat162float(p.sinks[head]);
    denominator = 1.0f;
  }
  const int64_t kv_row_stride = int64_t(p.kv_heads) * p.head_dim;
  for (int j0 = first_key; j0 <= position; j0 += kKeysPerStep) {
    float score[kKeysPerStep];
    const __nv_bfloat16* v_rows[kKeysPerStep];
#pragma unroll
    for (int u = 0; u < kKeysPerStep; ++u) {
      const int j = min(j0 + u, position);  // past the end: re-score the last key, dropped below
      const int64_t cache_row = int64_t(pages[j / p.page_size]) * p.page_size + j % p.page_size;
      const int64_t offset = cache_row * kv_row_stride + int64_t(kv_head) * p.head_dim;
      v_rows[u] = p.v_cache + offset;
      float partial = 0.0f;
#pragma unroll
      for (int i = 0; i < kDimsPerLane; ++i) {
        const int d = lane + 32 * i;
        if (d < p.head_dim) partial = fmaf(q[i], __bfloat162float(p.k_cache[offset + d]), partial);
      }
      score[u] = partial;
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
#pragma unroll
      for (int u = 0; u < kKeysPerStep; ++u) score[u] += __shfl_xor_sync(0xffffffffu, score[u], offset);
    }
    float step_max = running_max;
#pragma unroll
    for (int u = 0; u < kKeysPerStep; ++u) {
      if (j0 + u <= position) step_max = fmaxf(step_max, score[u]);
    }
    const float correction = __expf(running_max - step_max);  // exp(-inf) = 0 before the first key
    denominator *= correction;
#pragma unroll
    for (int i = 0; i < kDimsPerLane; ++i) acc[i] *= correction;
#pragma unroll
    for (int u = 0; u < kKeysPerStep; ++u) {
      if (j0 + u > position) break;
      const float weight = __expf(score[u] - step_max);
      denominator += weight;
#pragma unroll
      for (int i = 0; i < kDimsPerLane; ++i) {
        const int d = lane + 32 * i;
        if (d < p.head_dim) acc[i] = fmaf(weight, __bfloat162float(v_rows[u][d]), acc[i]);
      }
    }
    running_max = step_max;
  }
  const float inv = 1.0f / denominator;
#pragma unroll
  for (int i = 0; i < kDimsPerLane; ++i) {
    const int d = lane + 32 * i;
    if (d < p.head_dim) p.out[row * p.head_dim + d] = __float2bfloat16(acc[i] * inv);
  }
}

// ---- flash / split-KV kernel --------------------------------------------------------------------------

// A row tile is 16 (token, q head) rows per warp: 4 warps (64 rows: decode, splits, few tiles) or 8 (128
// rows: prefill; half the K/V reads from L2 per row, as every warp reads the whole K/V tile from shared).
constexpr int kFlashBlockN = 64;                   // keys per K/V tile
constexpr int kFlashRowPad = 8;                    // bf16 per shared row: (D + 8)·2 B is an odd count of 16 B
constexpr int kMaxSplits = kAttentionMaxSplits;    // combine: one lane per split (<= 32)
// Batches above this never split, which bounds the workspace. Splitting pays only while the row tiles × Hkv
// CTAs do not fill the GPU: GPT-OSS decode (one 64-row tile per token, Hkv 8, 4 CTAs per SM) fills one
// wave of the H200's 132 SMs at ~66 tokens.
constexpr int64_t kMaxSplitTokens = 64;
// The K/V ring depth of 64-row tiles when not pinned (AttentionLaunch::kv_stages); 128-row tiles use 2.
constexpr int kFlashDefaultStages64Rows = 2;
constexpr float kLog2e = 1.4426950408889634f;
// set_attention_one_barrier. Row tiles of 64/128 rows only: T 1600 causal 168.5 → 164.1 µs, window 128
// 41.5 → 40.0; the key split (16-row decode tiles) measured 29.6 → 31.0 µs with it, so keeps two (perf-log
// run 102).
bool one_barrier = true;

struct FlashKernelParams {
  const __nv_bfloat16* q;        // [T, Hq, D] bf16
  const __nv_bfloat16* k_cache;  // [pages * P, Hkv, D] bf16
  const __nv_bfloat16* v_cache;  // [pages * P, Hkv, D] bf16
  const int32_t* block_table;    // [B, max_pages] i32
  const int32_t* seq_start;      // [B + 1] i32
  const int32_t* positions;      // [T] i32
  const __nv_bfloat16* sinks;    // [Hq] bf16 or null
  __nv_bfloat16* out;            // [T, Hq, D] bf16, written when splits == 1
  float* partial_acc;            // [splits, T * Hq, D] f32: unnormalised Σ 2^(s - max)·v, when splits > 1
  float* partial_max;            // [splits, T * Hq] f32: running max in log2 units (-inf: no key seen)
  float* partial_sum;            // [splits, T * Hq] f32: Σ 2^(s - max)
  int tokens, seqs, q_heads, kv_heads, group, page_size, max_pages, sliding_window, splits;
  int page_shift;                // log2(page_size) when a power of two, else -1 (key → page by division)
  float scale_log2;              // softmax_scale · log2(e): scores in base-2 units, exp2f throughout
  bool one_barrier;              // a K/V tile's V converted before the loop's one barrier (set_attention_one_barrier)
  bool heads_inner;              // CTA order (set_attention_heads_inner): see flash_cta
};

// The (row tile, kv head, split) of a flash CTA. heads_inner: a 1-D grid of row tile × kv head, kv head
// fastest, so the CTAs start in order of context length over every head (each sequence's longest tiles
// first: flash_tile_setup), and the short tiles fill the last wave; otherwise (row tiles, kv heads), where
// head 0's shortest tiles start before the last head's longest.
struct FlashCta {
  int row_tile, kv_head, split;
};
__device__ __forceinline__ FlashCta flash_cta(const FlashKernelParams& p) {
  if (p.heads_inner) return {int(blockIdx.x) / p.kv_heads, int(blockIdx.x) % p.kv_heads, int(blockIdx.z)};
  return {int(blockIdx.x), int(blockIdx.y), int(blockIdx.z)};
}
inline dim3 flash_grid(const FlashKernelParams& p, unsigned row_tiles) {
  if (p.heads_inner) return dim3(row_tiles * unsigned(p.kv_heads), 1u, unsigned(p.splits));
  return dim3(row_tiles, unsigned(p.kv_heads), unsigned(p.splits));
}

// Q tile + kStages stages of a K and a V tile. Key split (16-row tiles, the warps share the rows and split
// each K/V tile's keys): the Q tile is 16 rows.
template <int D, int kWarps, int kStages, bool kKeySplit = false>
constexpr size_t flash_shared_bytes() {
  constexpr int kRows = kKeySplit ? 16 : 16 * kWarps;
  return size_t(kRows + 2 * kStages * kFlashBlockN) * (D + kFlashRowPad) * sizeof(__nv_bfloat16);
}

// The (sequence, row tile) of a flash CTA and its rows, in shared memory (both flash kernels).
// row_pos -1: a padding row, every key masked. [kv_lo, kv_hi]: the tile's keys (min window start, max
// position); min_pos / max_lo decide which K/V tiles need per-element masks.
template <int kBlockM>
struct FlashTile {
  int row_token[kBlockM], row_head[kBlockM], row_pos[kBlockM], row_lo[kBlockM];
  int seq, first_row, rows;
  int kv_lo, kv_hi, min_pos, max_lo;
};

// Row tiles are numbered sequence by sequence; within a sequence the last (longest-context) tile comes first.
// Row r of a tile is pair first_row + r of the sequence's (token, group member) pairs, group member fastest:
// q head kv_head·G + g. Fills `t` for row tile `row_tile` (flash_cta; seq -1: past the last tile).
// PRECOND: every thread of the CTA calls it (it holds two CTA barriers); blockDim.x >= kBlockM.
template <int kBlockM>
__device__ __forceinline__ void flash_tile_setup(const FlashKernelParams& p, int row_tile, int kv_head,
                                                 FlashTile<kBlockM>& t) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // 1. Which (sequence, row tile): warp 0 scans the sequences' tile counts 32 at a time.
  if (warp == 0) {
    int target = row_tile, seq = -1, rows_of_seq = 0, tile = 0;
    for (int base = 0; base < p.seqs; base += 32) {
      const int b = base + lane;
      const int rows = b < p.seqs ? (p.seq_start[b + 1] - p.seq_start[b]) * p.group : 0;
      const int tiles = (rows + kBlockM - 1) / kBlockM;
      int inclusive = tiles;
#pragma unroll
      for (int offset = 1; offset < 32; offset *= 2) {
        const int other = __shfl_up_sync(0xffffffffu, inclusive, offset);
        if (lane >= offset) inclusive += other;
      }
      const int total = __shfl_sync(0xffffffffu, inclusive, 31);
      if (target < total) {  // uniform across the warp
        const int hit = __ffs(__ballot_sync(0xffffffffu, target < inclusive)) - 1;
        const int before = __shfl_sync(0xffffffffu, inclusive - tiles, hit);
        const int hit_tiles = __shfl_sync(0xffffffffu, tiles, hit);
        seq = base + hit;
        rows_of_seq = __shfl_sync(0xffffffffu, rows, hit);
        tile = hit_tiles - 1 - (target - before);  // longest context first
        break;
      }
      target -= total;
    }
    if (lane == 0) {
      t.seq = seq;
      t.first_row = tile * kBlockM;
      t.rows = seq < 0 ? 0 : min(kBlockM, rows_of_seq - tile * kBlockM);
      t.kv_lo = INT_MAX;
      t.kv_hi = -1;
      t.min_pos = INT_MAX;
      t.max_lo = -1;
    }
  }
  __syncthreads();
  if (t.seq < 0) return;  // uniform over the CTA

  // 2. The rows' tokens, heads, positions and window starts; the tile's key range.
  if (threadIdx.x < kBlockM) {
    const int r = threadIdx.x;
    int token = -1, head = -1, position = -1, lo = 0;
    if (r < t.rows) {
      const int pair = t.first_row + r;
      token = p.seq_start[t.seq] + pair / p.group;
      head = kv_head * p.group + pair % p.group;
      position = p.positions[token];
      lo = p.sliding_window > 0 ? max(0, position - p.sliding_window + 1) : 0;
      atomicMin(&t.kv_lo, lo);
      atomicMax(&t.kv_hi, position);
      atomicMin(&t.min_pos, position);
      atomicMax(&t.max_lo, lo);
    }
    t.row_token[r] = token;
    t.row_head[r] = head;
    t.row_pos[r] = position;
    t.row_lo[r] = lo;
  }
  __syncthreads();
}

// The physical page holding `key`, or -1 past key_end or in a freed page (block-table entry < 0).
__device__ __forceinline__ int kv_page(const FlashKernelParams& p, const int32_t* pages, int key, int key_end) {
  if (key > key_end) return -1;
  const int page = p.page_shift >= 0 ? key >> p.page_shift : key / p.page_size;
  return max(pages[page], -1);
}

// Cache offset (elements) of 16-byte chunk `chunk` of `key`'s row of kv_head in physical page `physical`
// (kv_page's answer), or -1 where physical is.
template <int D>
__device__ __forceinline__ int64_t kv_offset_in_page(const FlashKernelParams& p, int physical, int key, int kv_head,
                                                     int chunk) {
  if (physical < 0) return -1;
  const int in_page = p.page_shift >= 0 ? key & (p.page_size - 1) : key % p.page_size;
  const int row_elems = p.kv_heads * D;  // the offset within the page in 32 bits: one wide multiply
  return int64_t(physical) * (p.page_size * row_elems) + (in_page * row_elems + kv_head * D + chunk * 8);
}

// Cache offset (elements) of 16-byte chunk `chunk` of `key`'s row of kv_head, or -1 past key_end or in a
// freed page (block-table entry < 0). The page lookup was a third of the flash loop's instructions (run 51),
// so callers compute it once per K/V tile for the K and the V copy both.
template <int D>
__device__ __forceinline__ int64_t kv_chunk_offset(const FlashKernelParams& p, const int32_t* pages, int key,
                                                   int key_end, int kv_head, int chunk) {
  return kv_offset_in_page<D>(p, kv_page(p, pages, key, key_end), key, kv_head, chunk);
}

// The online softmax state of the thread's two rows (rows r[0], r[1] of the tile) before the first key: empty,
// or where `with_sink` (split 0, once per row) the sink as a key with no value: max = sink, sum = 1 (sums
// stay split over the quad until the end, so lane 0 of the quad holds it).
template <int kBlockM>
__device__ __forceinline__ void start_softmax(const FlashKernelParams& p, const FlashTile<kBlockM>& t,
                                              const int (&r)[2], bool with_sink, float (&running_max)[2],
                                              float (&sum)[2]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    running_max[i] = -INFINITY;
    sum[i] = 0.0f;
    const int head = t.row_head[r[i]];
    if (p.sinks != nullptr && with_sink && head >= 0) {
      running_max[i] = __bfloat162float(p.sinks[head]) * kLog2e;
      sum[i] = threadIdx.x % 4 == 0 ? 1.0f : 0.0f;
    }
  }
}

// One K/V tile's scores of the thread's two rows (row0 in score[n][0..1], row1 in [2..3]; key of score[n][e]
// = key_base + 8n + 2(lane % 4) + e % 2) folded into the online softmax: masked to -inf above a row's
// position or below its window start (needs_mask: the tile crosses some row's bound), the tile's max of the
// raw scores, the running max and sum; then score = 2^(score·scale_log2 - max) and correction = 2^(old max -
// new max), by which the caller scales its accumulator. The base-2 scale is applied per row to the max and
// inside each exponent's FMA (one instruction per score instead of a multiply and a subtract).
template <int kKeyTiles>
__device__ __forceinline__ void online_softmax(float (&score)[kKeyTiles][4], bool needs_mask, int key_base,
                                               const int (&pos)[2], const int (&lo)[2], float scale_log2,
                                               float (&running_max)[2], float (&sum)[2], float (&correction)[2]) {
  const int lane = threadIdx.x % 32;
  // The mask as a branch of its own: folded into the max loop, ptxas predicated its ~130 instructions onto
  // every tile, masked or not (a fifth of the wgmma kernel's loop; needs_mask is uniform over the CTA).
  if (needs_mask) {
#pragma unroll
    for (int n = 0; n < kKeyTiles; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = e / 2, key = key_base + n * 8 + (lane % 4) * 2 + e % 2;
        if (key > pos[i] || key < lo[i]) score[n][e] = -INFINITY;
      }
    }
  }
  // Each row's max as a tree (depth log2 of its 2·kKeyTiles scores, not a chain of them; max is exact, so
  // the same result in any order).
  float raw_max[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float part[kKeyTiles];
#pragma unroll
    for (int n = 0; n < kKeyTiles; ++n) part[n] = fmaxf(score[n][2 * i], score[n][2 * i + 1]);
#pragma unroll
    for (int len = kKeyTiles; len > 1; len = (len + 1) / 2) {
#pragma unroll
      for (int n = 0; n < len / 2; ++n) part[n] = fmaxf(part[n], part[n + (len + 1) / 2]);
    }
    raw_max[i] = part[0];
  }
  float reference[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    raw_max[i] = fmaxf(raw_max[i], __shfl_xor_sync(0xffffffffu, raw_max[i], 1));
    raw_max[i] = fmaxf(raw_max[i], __shfl_xor_sync(0xffffffffu, raw_max[i], 2));
    const float tile_max = fmaxf(running_max[i], raw_max[i] == -INFINITY ? -INFINITY : raw_max[i] * scale_log2);
    reference[i] = tile_max == -INFINITY ? 0.0f : tile_max;  // no key yet: avoid inf - inf
    correction[i] = exp2_ftz(running_max[i] - reference[i]);
    running_max[i] = tile_max;
    sum[i] *= correction[i];
  }
#pragma unroll
  for (int n = 0; n < kKeyTiles; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      score[n][e] = exp2_ftz(fmaf(score[n][e], scale_log2, -reference[e / 2]));
      sum[e / 2] += score[n][e];
    }
  }
}

// An accumulator's two rows (row0 in [n][0..1], row1 in [n][2..3]) times the softmax's correction of each.
template <int kTiles>
__device__ __forceinline__ void scale_rows(float (&acc)[kTiles][4], const float (&correction)[2]) {
#pragma unroll
  for (int n = 0; n < kTiles; ++n) {
    acc[n][0] *= correction[0];
    acc[n][1] *= correction[0];
    acc[n][2] *= correction[1];
    acc[n][3] *= correction[1];
  }
}

// The flash kernels' epilogue for the thread's two rows (rows r[0], r[1] of the tile; sum already summed over
// the quad): out (one split), or this split's unnormalised partial triple.
template <int D, int kBlockM>
__device__ __forceinline__ void store_flash_rows(const FlashKernelParams& p, const FlashTile<kBlockM>& t,
                                                 const int (&r)[2], const float (&acc)[D / 8][4],
                                                 const float (&running_max)[2], const float (&sum)[2], int split) {
  const int lane = threadIdx.x % 32;
  const int64_t rows_total = int64_t(p.tokens) * p.q_heads;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (r[i] >= t.rows) continue;
    const int64_t row = int64_t(t.row_token[r[i]]) * p.q_heads + t.row_head[r[i]];  // token * Hq + head
    if (p.splits == 1) {
      const float inv = 1.0f / sum[i];
      __nv_bfloat16* out_row = p.out + row * D;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        *reinterpret_cast<__nv_bfloat162*>(out_row + n * 8 + (lane % 4) * 2) =
            __floats2bfloat162_rn(acc[n][2 * i] * inv, acc[n][2 * i + 1] * inv);
      }
    } else {
      const int64_t partial_row = int64_t(split) * rows_total + row;
      float* acc_row = p.partial_acc + partial_row * D;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        *reinterpret_cast<float2*>(acc_row + n * 8 + (lane % 4) * 2) = make_float2(acc[n][2 * i], acc[n][2 * i + 1]);
      }
      if (lane % 4 == 0) {
        p.partial_max[partial_row] = running_max[i];
        p.partial_sum[partial_row] = sum[i];
      }
    }
  }
}

// Grid: x = row tiles of kBlockM rows (an upper bound; CTAs past the last tile exit), y = Hkv, z = splits.
// Row tiles are numbered sequence by sequence; within a sequence the last (longest-context) tile comes
// first. Row r of a tile is pair first_row + r of the sequence's (token, group member) pairs, group member
// fastest: q head kv_head·G + g. The tile's keys are [kv_lo, kv_hi] = [min window start, max position] of
// its rows, cut into 64-key tiles; split z takes a contiguous share of them. Masking (key > position or
// below the window) is done per element only on tiles that cross some row's bound.
// PRECOND: metadata valid (the CPU oracle's validate_attention_metadata rules); D ∈ {64, 128}; q, caches
// 16-byte aligned; Hq = Hkv·G; splits <= kMaxSplits; partial buffers hold splits·T·Hq rows when splits > 1.
// Block-table entries < 0 inside [kv_lo, kv_hi] (pages freed behind a window) are read as zero keys and
// must be masked for every row of the tile, which the window rule guarantees.
// Occupancy target: 16 warps per SM at D 64 (caps registers at 128), 8 at D 128 (its 204 registers).
// K/V ring of kStages stages: tile it + kStages - 1 (K and V) is requested at the top of iteration it, so
// kStages - 1 tiles are in flight while one is computed (decode: few tiles per CTA, latency-bound).
// kKeySplit (decode: a token's G ≤ 16 rows fill one 16-row tile): tiles of 16 rows; every warp computes
// those rows against its own kFlashBlockN / kWarps keys of each K/V tile (its own running max, sum and
// accumulator), and the warps' partial softmax states merge through shared memory at the end — the chain
// of mma per K/V tile a CTA waits on is a quarter as long, the loads are the same.
template <int D, int kWarps, int kStages, bool kKeySplit = false>
__global__ static void __launch_bounds__(32 * kWarps, (D == 64 ? 16 : 8) / kWarps)
    flash_attention_kernel(const __grid_constant__ FlashKernelParams p) {
  static_assert(kStages >= 2);
  constexpr int kBlockM = kKeySplit ? 16 : 16 * kWarps;  // rows per tile
  constexpr int kThreads = 32 * kWarps;
  constexpr int kStride = D + kFlashRowPad;  // bf16 per shared row
  constexpr int kChunksPerRow = D / 8;       // 16-byte chunks per row
  constexpr int kDimTiles = D / 8;           // n-tiles of the output
  constexpr int kWarpKeys = kKeySplit ? kFlashBlockN / kWarps : kFlashBlockN;  // keys of a K/V tile per warp
  constexpr int kKeyTiles = kWarpKeys / 8;
  static_assert(kWarpKeys % 16 == 0, "P·V takes keys 16 at a time");
  extern __shared__ __align__(16) unsigned char flash_smem[];
  auto* q_smem = reinterpret_cast<__nv_bfloat16*>(flash_smem);  // [kBlockM, kStride] bf16
  auto* k_smem = q_smem + kBlockM * kStride;                     // [kStages, kFlashBlockN, kStride] bf16
  auto* v_smem = k_smem + kStages * kFlashBlockN * kStride;      // [kStages, kFlashBlockN, kStride] bf16
  __shared__ FlashTile<kBlockM> tile;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const FlashCta cta = flash_cta(p);
  const int kv_head = cta.kv_head, split = cta.split;
  // Before the PDL wait (launch.cuh: reads of data complete two launches back): the tile's metadata
  // (sequence starts, positions: the step's inputs, never written by a kernel) and the block table, and an
  // L2 prefetch of the K/V rows of the split's first kStages key tiles. A prefetch brings nothing into the
  // CTA, so the rows the kernel before (rope's cache write) may still be writing are read after the wait as
  // always; the metadata's round trips and the first tiles' DRAM latency overlap that kernel's tail.
  flash_tile_setup(p, cta.row_tile, kv_head, tile);
  const int seq = tile.seq;
  const int valid_rows = tile.rows;
  const int key_begin = tile.kv_lo, key_end = tile.kv_hi;  // inclusive
  const int total_key_tiles = seq < 0 ? 0 : (key_end - key_begin + kFlashBlockN) / kFlashBlockN;
  const int tiles_per_split = (total_key_tiles + p.splits - 1) / p.splits;
  const int first_key_tile = min(total_key_tiles, split * tiles_per_split);
  const int key_tiles = min(total_key_tiles, first_key_tile + tiles_per_split) - first_key_tile;
  const int32_t* pages = p.block_table + int64_t(max(seq, 0)) * p.max_pages;
  constexpr int kLinesPerRow = D * int(sizeof(__nv_bfloat16)) / 128;  // 128-byte lines of a key's row
  for (int i = threadIdx.x; i < min(key_tiles, kStages) * kFlashBlockN; i += kThreads) {
    const int64_t offset = kv_chunk_offset<D>(p, pages, key_begin + first_key_tile * kFlashBlockN + i, key_end, kv_head, 0);
    if (offset < 0) continue;
#pragma unroll
    for (int line = 0; line < kLinesPerRow; ++line) {
      asm volatile("prefetch.global.L2 [%0];" ::"l"(p.k_cache + offset + line * 64));
      asm volatile("prefetch.global.L2 [%0];" ::"l"(p.v_cache + offset + line * 64));
    }
  }
  detail::pdl_enter();  // launched by detail::launch; every CTA waits before it exits
  if (seq < 0) return;  // past the last tile (uniform over the CTA)

  // A K/V tile is kFlashBlockN keys × kChunksPerRow 16-byte chunks; thread i copies chunks i + j·kThreads.
  // kv_offsets finds those chunks' cache offsets (-1: past the range or a freed page) once per tile.
  constexpr int kChunksPerThread = kFlashBlockN * kChunksPerRow / kThreads;
  static_assert(kFlashBlockN * kChunksPerRow % kThreads == 0);
  auto kv_offsets = [&](int key_tile, int64_t (&offset)[kChunksPerThread]) {
    const int key0 = key_begin + key_tile * kFlashBlockN;
#pragma unroll
    for (int j = 0; j < kChunksPerThread; ++j) {
      const int c = threadIdx.x + j * kThreads;
      offset[j] = kv_chunk_offset<D>(p, pages, key0 + c / kChunksPerRow, key_end, kv_head, c % kChunksPerRow);
    }
  };
  auto load_kv_tile = [&](const int64_t (&offset)[kChunksPerThread], int stage, bool values) {
    const __nv_bfloat16* cache = values ? p.v_cache : p.k_cache;
    __nv_bfloat16* dst = (values ? v_smem : k_smem) + stage * kFlashBlockN * kStride;
#pragma unroll
    for (int j = 0; j < kChunksPerThread; ++j) {
      const int c = threadIdx.x + j * kThreads;
      cp_async16(dst + (c / kChunksPerRow) * kStride + (c % kChunksPerRow) * 8,
                 offset[j] >= 0 ? cache + offset[j] : cache, offset[j] >= 0 ? 16 : 0);
    }
  };

  // K (one commit group) and V (the next) of the CTA's key tile `index` into `stage`; past the last tile both
  // groups are empty, which keeps the waits' pending counts uniform.
  auto issue_kv = [&](int index, int stage) {
    int64_t offset[kChunksPerThread];
    const bool real = index < key_tiles;
    if (real) {
      kv_offsets(first_key_tile + index, offset);
      load_kv_tile(offset, stage, false);
    }
    cp_async_commit();
    if (real) load_kv_tile(offset, stage, true);
    cp_async_commit();
  };

  if (key_tiles > 0) {
#pragma unroll
    for (int c = threadIdx.x; c < kBlockM * kChunksPerRow; c += kThreads) {
      const int r = c / kChunksPerRow, chunk = c % kChunksPerRow;
      const __nv_bfloat16* src = p.q;
      int bytes = 0;
      if (r < valid_rows) {
        src = p.q + (int64_t(tile.row_token[r]) * p.q_heads + tile.row_head[r]) * D + chunk * 8;
        bytes = 16;
      }
      cp_async16(q_smem + r * kStride + chunk * 8, src, bytes);
    }
    issue_kv(0, 0);  // groups: Q + K tile 0, V tile 0
#pragma unroll
    for (int s = 1; s < kStages - 1; ++s) issue_kv(s, s);  // groups: K tile s, V tile s
  }

  // 3. This thread's two rows (mma fragment rows lane/4 and lane/4 + 8 of the warp's 16).
  const int warp_row0 = kKeySplit ? 0 : warp * 16;       // key split: every warp has the tile's 16 rows
  const int warp_key0 = kKeySplit ? warp * kWarpKeys : 0;  // ... and its own share of each K/V tile's keys
  const int row0 = warp_row0 + lane / 4, row1 = row0 + 8;
  const bool warp_has_rows = kKeySplit || warp * 16 < valid_rows;  // warps of padding rows only load
  float running_max[2], sum[2];  // the sink (split 0) joins once: with the key split, in warp 0's state
  start_softmax(p, tile, {row0, row1}, split == 0 && (!kKeySplit || warp == 0), running_max, sum);
  const int pos[2] = {tile.row_pos[row0], tile.row_pos[row1]}, lo[2] = {tile.row_lo[row0], tile.row_lo[row1]};
  float acc[kDimTiles][4];
#pragma unroll
  for (int n = 0; n < kDimTiles; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  unsigned q_frag[D / 16][4];

  // Commit groups, oldest first: Q + K 0, V 0, K 1, V 1, ...: K of tile it has landed once at most the
  // 2·kStages - 3 groups after it (V it, and K, V of the kStages - 2 tiles ahead) are pending; V of tile it
  // once at most 2·kStages - 2 are (K, V of the kStages - 1 tiles ahead, issued at this iteration's top),
  // or, at the top before that issue, 2·kStages - 4.
  // V to fp16 in shared memory, each thread its own copies (visible to it after its wait): once per CTA
  // instead of once per warp in registers (that was the ALU pipe's largest share of the loop).
  auto convert_v = [&](int stage) {
    __nv_bfloat16* v_tile = v_smem + stage * kFlashBlockN * kStride;
#pragma unroll 1
    for (int c = threadIdx.x; c < kFlashBlockN * kChunksPerRow; c += kThreads) {  // this thread's copies
      uint4* chunk = reinterpret_cast<uint4*>(v_tile + (c / kChunksPerRow) * kStride + (c % kChunksPerRow) * 8);
      uint4 v = *chunk;
      v.x = bf16x2_to_f16x2(v.x);
      v.y = bf16x2_to_f16x2(v.y);
      v.z = bf16x2_to_f16x2(v.z);
      v.w = bf16x2_to_f16x2(v.w);
      *chunk = v;
    }
  };
  for (int it = 0; it < key_tiles; ++it) {
    const int stage = it % kStages, key_tile = first_key_tile + it;
    const int key0 = key_begin + key_tile * kFlashBlockN;
    if (p.one_barrier) {  // K and V of this tile landed, V converted: one barrier for both (uniform branch)
      cp_async_wait<2 * kStages - 4>();
      convert_v(stage);
    } else {
      cp_async_wait<2 * kStages - 3>();  // K of this tile (and Q) landed; V and the tiles ahead may be in flight
    }
    __syncthreads();                   // ... for every thread; and every warp is done with tile it - 1's stage
    const int ahead = it + kStages - 1;
    issue_kv(ahead, ahead % kStages);
    float score[kKeyTiles][4];
    if (warp_has_rows) {
      if (it == 0) {
#pragma unroll
        for (int kd = 0; kd < D / 16; ++kd) {
          ldmatrix_x4(q_frag[kd], q_smem + (warp_row0 + (lane / 8) % 2 * 8 + lane % 8) * kStride + kd * 16 +
                                      lane / 16 * 8);
        }
      }
      const __nv_bfloat16* k_tile = k_smem + stage * kFlashBlockN * kStride;
#pragma unroll
      for (int n = 0; n < kKeyTiles; ++n) score[n][0] = score[n][1] = score[n][2] = score[n][3] = 0.0f;
#pragma unroll
      for (int kd = 0; kd < D / 16; ++kd) {
#pragma unroll
        for (int np = 0; np < kKeyTiles / 2; ++np) {
          unsigned k_frag[4];  // b0, b1 of key tile 2np, then of 2np + 1
          ldmatrix_x4(k_frag, k_tile + (warp_key0 + np * 16 + lane / 16 * 8 + lane % 8) * kStride + kd * 16 +
                                  (lane / 8) % 2 * 8);
          mma_bf16(score[2 * np], q_frag[kd], k_frag[0], k_frag[1]);
          mma_bf16(score[2 * np + 1], q_frag[kd], k_frag[2], k_frag[3]);
        }
      }
      float correction[2];
      online_softmax(score, key0 + kFlashBlockN - 1 > tile.min_pos || key0 < tile.max_lo, key0 + warp_key0, pos, lo,
                     p.scale_log2, running_max, sum, correction);
      scale_rows(acc, correction);
    }
    if (!p.one_barrier) {
      cp_async_wait<2 * kStages - 2>();  // V of this tile landed; the tiles ahead may be in flight
      convert_v(stage);
      __syncthreads();
    }
    if (warp_has_rows) {
      const __nv_bfloat16* v_tile = v_smem + stage * kFlashBlockN * kStride;
#pragma unroll
      for (int kk = 0; kk < kWarpKeys / 16; ++kk) {
        // P's accumulator fragments of key tiles 2kk, 2kk + 1 are the A fragment of keys [16kk, 16kk + 16),
        // as fp16 (see mma_f16); the V tile is fp16 by now (converted in shared memory above).
        unsigned p_frag[4];
        p_frag[0] = pack_f16(score[2 * kk][0], score[2 * kk][1]);
        p_frag[1] = pack_f16(score[2 * kk][2], score[2 * kk][3]);
        p_frag[2] = pack_f16(score[2 * kk + 1][0], score[2 * kk + 1][1]);
        p_frag[3] = pack_f16(score[2 * kk + 1][2], score[2 * kk + 1][3]);
#pragma unroll
        for (int dp = 0; dp < kDimTiles / 2; ++dp) {
          unsigned v_frag[4];  // b0, b1 of dim tile 2dp, then of 2dp + 1
          ldmatrix_x4_trans(v_frag, v_tile + (warp_key0 + kk * 16 + (lane / 8) % 2 * 8 + lane % 8) * kStride +
                                        dp * 16 + lane / 16 * 8);
          mma_f16(acc[2 * dp], p_frag, v_frag[0], v_frag[1]);
          mma_f16(acc[2 * dp + 1], p_frag, v_frag[2], v_frag[3]);
        }
      }
    }
  }
  cp_async_wait<0>();

  // 4. Epilogue: the quad's partial sums, then out (one split) or the partial triple (several).
  if (!warp_has_rows) return;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    sum[i] += __shfl_xor_sync(0xffffffffu, sum[i], 1);
    sum[i] += __shfl_xor_sync(0xffffffffu, sum[i], 2);
  }
  const int64_t rows_total = int64_t(p.tokens) * p.q_heads;
  if constexpr (kKeySplit) {
    // The warps' states of the same 16 rows merge in the K/V stages (every warp is past its last tile):
    // m = max_w m_w, sum = Σ_w 2^(m_w - m)·sum_w, acc = Σ_w 2^(m_w - m)·acc_w; a warp that saw no key
    // (m_w = -inf) weighs 0. Then out, or this split's partial triple.
    static_assert(size_t(kWarps) * 16 * (D + 2) * sizeof(float) <=
                      size_t(2 * kStages * kFlashBlockN) * kStride * sizeof(__nv_bfloat16),
                  "the merge scratch fits in the K/V stages");
    __syncthreads();
    float* merge_acc = reinterpret_cast<float*>(k_smem);  // [kWarps, 16, D]
    float* merge_max = merge_acc + kWarps * 16 * D;       // [kWarps, 16]
    float* merge_sum = merge_max + kWarps * 16;           // [kWarps, 16]
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = i == 0 ? row0 : row1;
#pragma unroll
      for (int n = 0; n < kDimTiles; ++n) {
        *reinterpret_cast<float2*>(merge_acc + (warp * 16 + r) * D + n * 8 + (lane % 4) * 2) =
            make_float2(acc[n][2 * i], acc[n][2 * i + 1]);
      }
      if (lane % 4 == 0) {
        merge_max[warp * 16 + r] = running_max[i];
        merge_sum[warp * 16 + r] = sum[i];
      }
    }
    __syncthreads();
    constexpr int kThreadsPerRow = kThreads / 16, kDims = D / kThreadsPerRow;  // kThreads / 16 per row
    static_assert(kDims % 2 == 0);
    const int r = threadIdx.x / kThreadsPerRow, d0 = threadIdx.x % kThreadsPerRow * kDims;
    if (r >= valid_rows) return;
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m = fmaxf(m, merge_max[w * 16 + r]);
    float weight[kWarps], total = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float m_w = merge_max[w * 16 + r];
      weight[w] = m_w == -INFINITY ? 0.0f : exp2f(m_w - m);
      total += weight[w] * merge_sum[w * 16 + r];
    }
    float o[kDims];
#pragma unroll
    for (int j = 0; j < kDims; ++j) {
      o[j] = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) o[j] += weight[w] * merge_acc[(w * 16 + r) * D + d0 + j];
    }
    const int64_t row = int64_t(tile.row_token[r]) * p.q_heads + tile.row_head[r];  // token * Hq + head
    if (p.splits == 1) {
      const float inv = 1.0f / total;
#pragma unroll
      for (int j = 0; j < kDims; j += 2) {
        *reinterpret_cast<__nv_bfloat162*>(p.out + row * D + d0 + j) = __floats2bfloat162_rn(o[j] * inv, o[j + 1] * inv);
      }
    } else {
      const int64_t partial_row = int64_t(split) * rows_total + row;
#pragma unroll
      for (int j = 0; j < kDims; j += 2) {
        *reinterpret_cast<float2*>(p.partial_acc + partial_row * D + d0 + j) = make_float2(o[j], o[j + 1]);
      }
      if (d0 == 0) {
        p.partial_max[partial_row] = m;
        p.partial_sum[partial_row] = total;
      }
    }
    return;
  }
  store_flash_rows<D>(p, tile, {row0, row1}, acc, running_max, sum, split);
}

// ---- flash attention by warpgroup MMAs (sm_90a): prefill's 128-row tiles at D 64 and 128 ----
// flash_attention_kernel at 128 rows is bound by its instruction stream (ncu, perf-log run 103: mma.sync issues
// one instruction per 4 K FLOP, the tensor pipe is busy a fifth of the time, 1.1 eligible warps of 3.8 per
// scheduler), and a wgmma Q·Kᵀ alone was level (run 104: each warpgroup waited for its S right after issuing
// it, with nothing to overlap). Here both products are warpgroup MMAs (FlashAttention-3's shape, without its
// producer warps: the K/V rows are gathered through the block table by every thread's cp.async, as before):
//  - S = Q·Kᵀ from the 128-byte-swizzled Q and K tiles (K-major descriptors; 4 wgmma m64n64k16 per
//    warpgroup and K/V tile), one warpgroup per 64 rows;
//  - O += P·V with P in registers: S's accumulator layout is the A fragment layout, so P goes to fp16 in
//    place (no shared-memory round trip), and the fp16 V tile is the N-major B operand (imm-trans-b; its
//    rows of 64 D values per key are the same swizzled 128-byte rows as K's).
//  - P·V is not waited for: it retires behind the next tile's copies, barrier and Q·Kᵀ (whose wait covers
//    it before the accumulator is rescaled), so a warpgroup's MMAs overlap its own loop overhead, and the
//    SM's other three warpgroups (two CTAs of two) issue their softmax while the tensor pipe runs this one's.
// FlashAttention-3's intra-warpgroup order (S of the next tile and P·V of this one issued together, the next
// softmax while P·V runs) was built and measured slower at D 64: T 1600 causal 136.6 against 125.7 µs
// (perf-log run 116); removed.
// Ring: tiles are requested kStages - 2 ahead, so the stage refilled at iteration it held tile it - 2,
// whose P·V retired at iteration it - 1's wait; one commit group per K/V tile (Q joins tile 0's).
// kOverlapKv (set_attention_wgmma_overlap_kv, the default): a thread's block-table entries for the next tile
// are loaded one tile ahead, and the copies go out after Q·Kᵀ is issued, so neither the lookup's global round
// trip nor the address math sits between the barrier and Q·Kᵀ (perf-log run 183: T 1600 causal 108.5 →
// 105.1 µs; with the mask as a branch of its own, 125.7 → 105.1).
// Tile setup, masks, softmax, sinks, splits and the epilogue are flash_attention_kernel's (same helpers), so
// the two differ only in the MMAs' accumulation order inside each 16-deep step.
// D 128 (Qwen3): every tile in two blocks of 64 columns (128-byte rows), S over 8 steps of 16 head dims, P·V
// as m64n128k16 with V's second block as the leading offset; one CTA per SM (154–158 registers).
// PRECOND: as flash_attention_kernel; blockDim.x == 256; dynamic shared memory =
// flash_wgmma_shared_bytes<D, kStages>(); built for sm_90a. D 64: 124 registers (111 in order), no spills;
// D 128: 166 (152).
constexpr int kFlashWgmmaStages = 4;  // two CTAs a SM: tiles requested 2 ahead
bool flash_wgmma = true;              // set_attention_wgmma
bool flash_wgmma_overlap_kv = true;   // set_attention_wgmma_overlap_kv
bool flash_heads_inner = true;        // set_attention_heads_inner (perf-log run 247)

template <int D, int kStages>
constexpr size_t flash_wgmma_shared_bytes() {
  return size_t(128 + 2 * kStages * kFlashBlockN) * D * sizeof(__nv_bfloat16) + 1024;  // + the 1024-byte round-up
}

template <int D, int kStages, bool kOverlapKv>
__global__ static void __launch_bounds__(256, D == 64 ? 2 : 1) flash_wgmma_kernel(const __grid_constant__ FlashKernelParams p) {
  detail::pdl_enter();  // first: launched by detail::launch (launch.cuh)
  static_assert(kStages >= 3 && (D == 64 || D == 128));
  constexpr int kBlockM = 128, kThreads = 256;
  constexpr int kChunksPerRow = D / 8, kKeyTiles = kFlashBlockN / 8, kDimTiles = D / 8;
  constexpr int kTileElems = kFlashBlockN * D;  // one K or V stage: 64 keys × D (D / 64 blocks of 128-byte rows)
  constexpr int kChunksPerThread = kFlashBlockN * kChunksPerRow / kThreads;
  static_assert(kFlashBlockN * kChunksPerRow % kThreads == 0 && kBlockM * kChunksPerRow % kThreads == 0);
  extern __shared__ __align__(16) unsigned char flash_wgmma_smem[];
  // 1024-byte aligned: every tile below starts on a swizzle atom. Offset from the shared array itself (not
  // through an integer), so the compiler keeps the shared state space: convert_v's loads and stores were
  // generic LD/ST before.
  const unsigned misalignment = unsigned(__cvta_generic_to_shared(flash_wgmma_smem)) & 1023u;
  auto* q_smem = reinterpret_cast<__nv_bfloat16*>(flash_wgmma_smem + ((1024u - misalignment) & 1023u));
  // [D / 64][128 rows][64] bf16, swizzled
  __nv_bfloat16* k_smem = q_smem + kBlockM * D;           // [kStages][D / 64][64 keys][64] bf16, swizzled
  __nv_bfloat16* v_smem = k_smem + kStages * kTileElems;  // the same for V, fp16 once converted
  __shared__ FlashTile<kBlockM> tile;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warpgroup = warp / 4;
  const FlashCta cta = flash_cta(p);
  const int kv_head = cta.kv_head, split = cta.split;
  flash_tile_setup(p, cta.row_tile, kv_head, tile);
  if (tile.seq < 0) return;  // past the last tile (uniform over the CTA)
  const int key_begin = tile.kv_lo, key_end = tile.kv_hi;  // inclusive
  const int total_key_tiles = (key_end - key_begin + kFlashBlockN) / kFlashBlockN;
  const int tiles_per_split = (total_key_tiles + p.splits - 1) / p.splits;
  const int first_key_tile = min(total_key_tiles, split * tiles_per_split);
  const int key_tiles = min(total_key_tiles, first_key_tile + tiles_per_split) - first_key_tile;
  const int32_t* pages = p.block_table + int64_t(tile.seq) * p.max_pages;

  // Element offset of 16-byte chunk `chunk` (of D / 8) of row `row` of a tile of `rows` rows in wgmma's
  // 128-byte swizzle: columns in blocks of 64 (128-byte rows), each block all the tile's rows.
  auto swizzled = [](int rows, int row, int chunk) {
    return (chunk / 8) * rows * 64 + row * 64 + (((chunk % 8) ^ (row & 7)) * 8);
  };
  auto tile_key0 = [&](int index) { return key_begin + (first_key_tile + index) * kFlashBlockN; };
  // kOverlapKv: the physical pages of this thread's rows of the next tile to issue, loaded one issue ahead
  // (in the loop the block-table load was a dependent global round trip between the barrier and Q·Kᵀ).
  int next_page[kChunksPerThread] = {};
  auto load_pages = [&](int index) {
#pragma unroll
    for (int j = 0; j < kChunksPerThread; ++j) {
      const int row = (int(threadIdx.x) + j * kThreads) / kChunksPerRow;
      next_page[j] = index < key_tiles ? kv_page(p, pages, tile_key0(index) + row, key_end) : -1;
    }
  };
  if constexpr (kOverlapKv) load_pages(0);
  // Tile `index` of the CTA's keys into stage index % kStages (K and V, one commit group; empty past the last).
  // PRECOND with kOverlapKv: tiles are issued in order 0, 1, 2, ... (next_page holds tile index's pages).
  auto issue_kv = [&](int index) {
    if (index < key_tiles) {
      const int key0 = tile_key0(index);
      const int stage_offset = (index % kStages) * kTileElems;
      int page[kChunksPerThread];
#pragma unroll
      for (int j = 0; j < kChunksPerThread; ++j) page[j] = next_page[j];
      if constexpr (kOverlapKv) load_pages(index + 1);
#pragma unroll
      for (int j = 0; j < kChunksPerThread; ++j) {
        const int c = threadIdx.x + j * kThreads, row = c / kChunksPerRow, chunk = c % kChunksPerRow;
        const int64_t offset = kOverlapKv ? kv_offset_in_page<D>(p, page[j], key0 + row, kv_head, chunk)
                                          : kv_chunk_offset<D>(p, pages, key0 + row, key_end, kv_head, chunk);
        const int bytes = offset >= 0 ? 16 : 0;
        const int at = stage_offset + swizzled(kFlashBlockN, row, chunk);
        cp_async16(k_smem + at, p.k_cache + max(offset, int64_t(0)), bytes);
        cp_async16(v_smem + at, p.v_cache + max(offset, int64_t(0)), bytes);
      }
    }
    cp_async_commit();
  };
  // This thread's V chunks of a stage to fp16 (its own copies: visible to it after its wait).
  auto convert_v = [&](int stage) {
#pragma unroll
    for (int j = 0; j < kChunksPerThread; ++j) {
      const int c = threadIdx.x + j * kThreads;
      uint4* chunk = reinterpret_cast<uint4*>(v_smem + stage * kTileElems +
                                              swizzled(kFlashBlockN, c / kChunksPerRow, c % kChunksPerRow));
      uint4 v = *chunk;
      v.x = bf16x2_to_f16x2(v.x);
      v.y = bf16x2_to_f16x2(v.y);
      v.z = bf16x2_to_f16x2(v.z);
      v.w = bf16x2_to_f16x2(v.w);
      *chunk = v;
    }
  };

  if (key_tiles > 0) {
#pragma unroll
    for (int c = threadIdx.x; c < kBlockM * kChunksPerRow; c += kThreads) {
      const int r = c / kChunksPerRow, chunk = c % kChunksPerRow;
      const bool real = r < tile.rows;
      const __nv_bfloat16* src =
          real ? p.q + (int64_t(tile.row_token[r]) * p.q_heads + tile.row_head[r]) * D + chunk * 8 : p.q;
      cp_async16(q_smem + swizzled(kBlockM, r, chunk), src, real ? 16 : 0);
    }
#pragma unroll
    for (int s = 0; s < kStages - 2; ++s) issue_kv(s);  // groups: Q + tile 0, tile 1, ...
  }

  // The thread's two rows: the wgmma accumulator layout is mma.sync's per 16-row warp slab.
  const int row0 = warp * 16 + lane / 4, row1 = row0 + 8;
  float running_max[2], sum[2];
  start_softmax(p, tile, {row0, row1}, split == 0, running_max, sum);
  const int pos[2] = {tile.row_pos[row0], tile.row_pos[row1]}, lo[2] = {tile.row_lo[row0], tile.row_lo[row1]};
  float acc[kDimTiles][4] = {};
  auto& acc_flat = reinterpret_cast<float(&)[4 * kDimTiles]>(acc);
  // P of the last K/V tile, read by its P·V wgmmas until the next wait retires them: kept live until then.
  unsigned p_frag[kFlashBlockN / 16][4] = {};
  auto& p_flat = reinterpret_cast<unsigned(&)[kFlashBlockN / 4]>(p_frag);
  const __nv_bfloat16* q_tile = q_smem + warpgroup * 64 * 64;  // this warpgroup's rows of the first column block

  // S = Q·Kᵀ of the K tile in `stage` into `score`, issued as one committed group (every warpgroup runs the
  // MMAs, a last tile's padding rows included: their keys are all masked, so they add zeros; wgmma in a
  // branch the compiler cannot prove warpgroup-uniform is serialized, ptxas C7518).
  auto issue_s = [&](int stage, float (&score_flat)[4 * kKeyTiles]) {
    const __nv_bfloat16* k_tile = k_smem + stage * kTileElems;
    wgmma_fence();
#pragma unroll
    for (int kd = 0; kd < D / 16; ++kd) {  // 16 head dims a step: column block kd / 4, 32 bytes into its rows
      const int block = kd / 4, step = kd % 4;
      wgmma_m64n64k16_bf16(score_flat, sw128_descriptor(q_tile + block * kBlockM * 64 + step * 16),
                           sw128_descriptor(k_tile + block * kFlashBlockN * 64 + step * 16), kd > 0);
    }
    wgmma_commit();
  };
  // The accumulator rescaled by the softmax's correction; P of `score` to fp16 in registers (key tiles 2kk,
  // 2kk + 1 of S are the A fragment of keys [16kk, 16kk + 16)); O += P·V of the V tile in `stage`, issued as
  // one committed group. PRECOND of the first two: the previous P·V retired (acc and p_frag are free).
  auto rescale = [&](const float (&correction)[2]) { scale_rows(acc, correction); };
  auto pack_p = [&](const float (&score)[kKeyTiles][4]) {
#pragma unroll
    for (int kk = 0; kk < kFlashBlockN / 16; ++kk) {
      p_frag[kk][0] = pack_f16(score[2 * kk][0], score[2 * kk][1]);
      p_frag[kk][1] = pack_f16(score[2 * kk][2], score[2 * kk][3]);
      p_frag[kk][2] = pack_f16(score[2 * kk + 1][0], score[2 * kk + 1][1]);
      p_frag[kk][3] = pack_f16(score[2 * kk + 1][2], score[2 * kk + 1][3]);
    }
  };
  auto issue_pv = [&](int stage) {
    const __nv_bfloat16* v_tile = v_smem + stage * kTileElems;
    fence_operands(acc_flat);
    fence_operands(p_flat);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kFlashBlockN / 16; ++kk) {  // 16 keys a step: 2048 bytes into each column block
      if constexpr (D == 64) {
        wgmma_m64n64k16_f16_rs(acc_flat, p_frag[kk], sw128_descriptor(v_tile + kk * 16 * 64));
      } else {  // n 128: the second 64 head dims one column block (64 keys × 128 bytes) further
        wgmma_m64n128k16_f16_rs(acc_flat, p_frag[kk],
                                sw128_descriptor(v_tile + kk * 16 * 64, kFlashBlockN * 64 * sizeof(__nv_bfloat16)));
      }
    }
    wgmma_commit();
  };
  auto needs_mask = [&](int key0) { return key0 + kFlashBlockN - 1 > tile.min_pos || key0 < tile.max_lo; };

  for (int it = 0; it < key_tiles; ++it) {
    const int stage = it % kStages;
    const int key0 = key_begin + (first_key_tile + it) * kFlashBlockN;
    cp_async_wait<kStages - 3>();  // tile it (and Q) landed for this thread: kStages - 3 tiles ahead may be in flight
    convert_v(stage);
    fence_proxy_async();  // the copies and the conversion, made visible to the MMAs' async proxy ...
    __syncthreads();      // ... for every thread's chunks
    if constexpr (!kOverlapKv) issue_kv(it + kStages - 2);
    float score[kKeyTiles][4];
    auto& score_flat = reinterpret_cast<float(&)[4 * kKeyTiles]>(score);
    issue_s(stage, score_flat);
    // kOverlapKv: the next copies are issued while Q·Kᵀ runs (its stage held tile it - 2, whose P·V retired)
    if constexpr (kOverlapKv) issue_kv(it + kStages - 2);
    wgmma_wait<0>();  // S, and the previous tile's P·V: acc and p_frag are free again
    fence_operands(score_flat);
    fence_operands(acc_flat);
    fence_operands(p_flat);
    float correction[2];
    online_softmax(score, needs_mask(key0), key0, pos, lo, p.scale_log2, running_max, sum, correction);
    rescale(correction);
    pack_p(score);
    issue_pv(stage);
  }
  cp_async_wait<0>();
  wgmma_wait<0>();
  fence_operands(acc_flat);
  fence_operands(p_flat);
  if (warpgroup * 64 >= tile.rows) return;  // padding rows only

  // Epilogue: the quad's partial sums, then out (one split) or the partial triple (several).
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    sum[i] += __shfl_xor_sync(0xffffffffu, sum[i], 1);
    sum[i] += __shfl_xor_sync(0xffffffffu, sum[i], 2);
  }
  store_flash_rows<D>(p, tile, {row0, row1}, acc, running_max, sum, split);
}

struct CombineKernelParams {
  const float* partial_acc;  // [splits, T * Hq, D] f32
  const float* partial_max;  // [splits, T * Hq] f32, log2 units
  const float* partial_sum;  // [splits, T * Hq] f32
  __nv_bfloat16* out;        // [T, Hq, D] bf16
  int64_t rows;              // T * Hq
  int splits, head_dim;
};

constexpr int kCombineWarps = 4;

// One warp per (token, head) row: lane s < splits holds split s's (max, sum); the row's result is
// Σ_s 2^(m_s - M)·acc_s / Σ_s 2^(m_s - M)·sum_s with M the max over splits (empty splits: m = -inf, weight 0).
// Every load of a lane is issued first: its split's (max, sum) and the acc of the first kCombineSplits splits
// at its dims d = lane + 32 j, j < kDims (addresses clamped into the row; what is past `splits` or D is
// dropped): one round trip. (The loop that loaded acc only where a weight was nonzero waited one round trip
// per split and dim, ~8 at 4 splits and D 64: 4.9 µs a call on the H100, perf-log session of 2026-12-06.)
// Splits past kCombineSplits and dims past 32 · kDims take a loop; the sum runs in split order either way.
// PRECOND: splits in [1, 32]; every real row has a finite max in some split (its own key is in one of them).
constexpr int kCombineSplits = 8;
template <int kDims>
__global__ static void __launch_bounds__(32 * kCombineWarps, 4)  // a minimum, or ptxas splits the loads
    attention_combine_kernel(const __grid_constant__ CombineKernelParams p) {
  detail::pdl_enter();  // first: launched by detail::launch (launch.cuh)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row = int64_t(blockIdx.x) * kCombineWarps + warp;
  if (row >= p.rows) return;  // warp-uniform
  const int split_at = min(lane, p.splits - 1);
  float split_max = p.partial_max[split_at * p.rows + row];
  float split_sum = p.partial_sum[split_at * p.rows + row];
  float acc[kDims][kCombineSplits];
#pragma unroll
  for (int j = 0; j < kDims; ++j) {
    const int d = min(lane + 32 * j, p.head_dim - 1);
#pragma unroll
    for (int u = 0; u < kCombineSplits; ++u) {
      acc[j][u] = p.partial_acc[(min(u, p.splits - 1) * p.rows + row) * p.head_dim + d];
    }
  }
  if (lane >= p.splits) split_max = -INFINITY, split_sum = 0.0f;
  float row_max = split_max;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, offset));
  }
  const float weight = split_max == -INFINITY ? 0.0f : exp2f(split_max - row_max);
  float denominator = weight * split_sum;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) denominator += __shfl_xor_sync(0xffffffffu, denominator, offset);
  const float inv = 1.0f / denominator;
  float w[kCombineSplits];  // split u's weight (0 past `splits`: lanes past it hold 0)
#pragma unroll
  for (int u = 0; u < kCombineSplits; ++u) w[u] = __shfl_sync(0xffffffffu, weight, u);
  // Empty splits' acc may hold anything (0·NaN is NaN): select, not multiply.
#pragma unroll
  for (int j = 0; j < kDims; ++j) {
    const int d = lane + 32 * j;
    float value = 0.0f;
#pragma unroll
    for (int u = 0; u < kCombineSplits; ++u) value = w[u] != 0.0f ? fmaf(w[u], acc[j][u], value) : value;
    for (int s = kCombineSplits; s < p.splits; ++s) {
      const float ws = __shfl_sync(0xffffffffu, weight, s);
      if (ws != 0.0f && d < p.head_dim) value = fmaf(ws, p.partial_acc[(s * p.rows + row) * p.head_dim + d], value);
    }
    if (d < p.head_dim) p.out[row * p.head_dim + d] = __float2bfloat16(value * inv);
  }
  for (int d0 = 32 * kDims; d0 < p.head_dim; d0 += 32) {  // dims past 32 · kDims (none at D <= 32 · kDims)
    const int d = d0 + lane;
    float value = 0.0f;
    for (int s = 0; s < p.splits; ++s) {
      const float ws = __shfl_sync(0xffffffffu, weight, s);
      if (ws != 0.0f && d < p.head_dim) value = fmaf(ws, p.partial_acc[(s * p.rows + row) * p.head_dim + d], value);
    }
    if (d < p.head_dim) p.out[row * p.head_dim + d] = __float2bfloat16(value * inv);
  }
}

// ---- launchers ----------------------------------------------------------------------------------------

// GPT-OSS rows (Hkv 8, D 64) are 1 KB = 64 units: one block of 64 threads per (token, k|v).
constexpr int kMaxKvWriteThreads = 128;

// Bytes of one split's partials for `rows` (token, head) rows: acc [rows, D] + max [rows] + sum [rows], f32.
int64_t split_bytes(int64_t rows, int64_t head_dim) { return rows * (head_dim + 2) * int64_t(sizeof(float)); }

// Sets a flash kernel's shared-memory attribute and returns how many of its CTAs one SM holds.
template <int D, int kWarps, int kStages, bool kKeySplit = false>
int prepare_flash_kernel() {
  constexpr size_t shared_bytes = flash_shared_bytes<D, kWarps, kStages, kKeySplit>();
  LMX_CUDA_CHECK(cudaFuncSetAttribute(flash_attention_kernel<D, kWarps, kStages, kKeySplit>,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared_bytes)));
  int ctas = 0;
  LMX_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &ctas, flash_attention_kernel<D, kWarps, kStages, kKeySplit>, 32 * kWarps, shared_bytes));
  return std::max(ctas, 1);
}

// Resident CTAs per SM of the flash kernel for (D, warps, K/V stages, key split). All configurations are
// prepared together on the first flash call, once per process: that call must be eager (not captured), as
// the callers' warm-up is. Built: 2 stages at every (D, warps); 3 stages at 4 warps (decode, split-KV); the
// key split at 4 warps, 2 stages.
int flash_ctas_per_sm(int64_t head_dim, int warps, int stages, bool key_split = false) {
  static const std::array<int, 8> resident = {
      prepare_flash_kernel<64, 4, 2>(),        prepare_flash_kernel<64, 8, 2>(),
      prepare_flash_kernel<128, 4, 2>(),       prepare_flash_kernel<128, 8, 2>(),
      prepare_flash_kernel<64, 4, 3>(),        prepare_flash_kernel<128, 4, 3>(),
      prepare_flash_kernel<64, 4, 2, true>(),  prepare_flash_kernel<128, 4, 2, true>()};
  if (key_split) return resident[size_t(head_dim == 64 ? 6 : 7)];
  if (stages == 3) return resident[size_t(head_dim == 64 ? 4 : 5)];
  return resident[size_t((head_dim == 64 ? 0 : 2) + (warps == 8 ? 1 : 0))];
}

template <int D, int kWarps, int kStages, bool kKeySplit = false>
void launch_flash(const FlashKernelParams& params, unsigned row_tiles, cudaStream_t stream) {
  (void)flash_ctas_per_sm(D, kWarps, kStages, kKeySplit);
  detail::launch(flash_attention_kernel<D, kWarps, kStages, kKeySplit>, flash_grid(params, row_tiles),
                 dim3(32 * kWarps), flash_shared_bytes<D, kWarps, kStages, kKeySplit>(), stream, params);
  LMX_CUDA_CHECK_LAUNCH();
}

// flash_wgmma_kernel: its shared-memory attribute set once per form (the first 128-row call of that D and
// knob, eager like every first call of a shape), then the launch.
template <int D, int kStages, bool kOverlapKv>
void launch_flash_wgmma(const FlashKernelParams& params, unsigned row_tiles, cudaStream_t stream) {
  constexpr size_t shared_bytes = flash_wgmma_shared_bytes<D, kStages>();
  static const bool prepared = [] {
    LMX_CUDA_CHECK(cudaFuncSetAttribute(flash_wgmma_kernel<D, kStages, kOverlapKv>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared_bytes)));
    return true;
  }();
  (void)prepared;
  detail::launch(flash_wgmma_kernel<D, kStages, kOverlapKv>, flash_grid(params, row_tiles), dim3(256), shared_bytes,
                 stream, params);
  LMX_CUDA_CHECK_LAUNCH();
}
template <int D>
void launch_flash_wgmma(const FlashKernelParams& params, unsigned row_tiles, cudaStream_t stream) {
  if (flash_wgmma_overlap_kv) launch_flash_wgmma<D, kFlashWgmmaStages, true>(params, row_tiles, stream);
  else launch_flash_wgmma<D, kFlashWgmmaStages, false>(params, row_tiles, stream);
}

void launch_simple(const ops::AttentionParams& p, cudaStream_t stream) {
  const int64_t tokens = p.q.dim(0), q_heads = p.q.dim(1), head_dim = p.q.dim(2);
  LMX_CHECK(tokens * q_heads < 0x7fffffffLL * kAttentionWarps);
  const AttentionKernelParams params{.q = static_cast<const __nv_bfloat16*>(p.q.data),
                                     .k_cache = static_cast<const __nv_bfloat16*>(p.k_cache.data),
                                     .v_cache = static_cast<const __nv_bfloat16*>(p.v_cache.data),
                                     .block_table = static_cast<const int32_t*>(p.block_table.data),
                                     .seq_start = static_cast<const int32_t*>(p.seq_start.data),
                                     .positions = static_cast<const int32_t*>(p.positions.data),
                                     .sinks = p.sinks.defined() ? static_cast<const __nv_bfloat16*>(p.sinks.data) : nullptr,
                                     .out = static_cast<__nv_bfloat16*>(p.out.data),
                                     .tokens = int(tokens),
                                     .seqs = int(p.block_table.dim(0)),
                                     .q_heads = int(q_heads),
                                     .kv_heads = int(p.k_cache.dim(2)),
                                     .head_dim = int(head_dim),
                                     .page_size = int(p.k_cache.dim(1)),
                                     .max_pages = int(p.block_table.dim(1)),
                                     .sliding_window = p.sliding_window,
                                     .softmax_scale = p.softmax_scale};
  const unsigned blocks = detail::blocks_for(tokens * q_heads, kAttentionWarps);
  const int threads = 32 * kAttentionWarps;
  // The simple kernel's own dispatch on the head dim: dims per lane.
  if (head_dim <= 32) detail::launch(attention_kernel<1>, dim3(blocks), dim3(threads), 0, stream, params);
  else if (head_dim <= 64) detail::launch(attention_kernel<2>, dim3(blocks), dim3(threads), 0, stream, params);
  else if (head_dim <= 128) detail::launch(attention_kernel<4>, dim3(blocks), dim3(threads), 0, stream, params);
  else detail::launch(attention_kernel<8>, dim3(blocks), dim3(threads), 0, stream, params);
  LMX_CUDA_CHECK_LAUNCH();
}

const char* kernel_name(AttentionKernel kernel) {
  switch (kernel) {
    case AttentionKernel::kAuto: return "auto";
    case AttentionKernel::kSimple: return "simple";
    case AttentionKernel::kFlash: return "flash";
    case AttentionKernel::kSplitKv: return "split-KV";
  }
  return "?";
}

}  // namespace

size_t attention_workspace_bytes(int64_t max_tokens, int64_t q_heads, int64_t head_dim) {
  LMX_CHECK(max_tokens >= 0 && q_heads >= 0 && head_dim >= 0);
  return size_t(kMaxSplits * split_bytes(std::min(max_tokens, kMaxSplitTokens) * q_heads, head_dim));
}

void kv_write(const ops::KvWriteParams& p, cudaStream_t stream) {
  ops::require(ops::check(p), "cuda::kv_write");
  detail::require_cuda("kv_write", {{"k", &p.k},
                                    {"v", &p.v},
                                    {"kv_write_index", &p.kv_write_index},
                                    {"k_cache", &p.k_cache},
                                    {"v_cache", &p.v_cache}});
  detail::require_bf16_activation("kv_write", "k_cache", p.k_cache);
  const int64_t tokens = p.k.dim(0);
  const int64_t row_bytes = p.k.dim(1) * p.k.dim(2) * int64_t(sizeof(__nv_bfloat16));
  if (tokens == 0 || row_bytes == 0) return;
  LMX_CHECK(tokens <= 0x7fffffff);
  const bool vector = row_bytes % 16 == 0 && detail::aligned16(p.k.data) && detail::aligned16(p.v.data) &&
                      detail::aligned16(p.k_cache.data) && detail::aligned16(p.v_cache.data);
  const int64_t units = vector ? row_bytes / 16 : row_bytes / 2;
  const int threads = int(std::clamp<int64_t>((units + 31) / 32 * 32, 32, kMaxKvWriteThreads));
  const dim3 grid(unsigned(tokens), 2, detail::blocks_for(units, threads));
  const KvWriteKernelParams params{.k = p.k.data,
                                   .v = p.v.data,
                                   .kv_write_index = static_cast<const int32_t*>(p.kv_write_index.data),
                                   .k_cache = p.k_cache.data,
                                   .v_cache = p.v_cache.data,
                                   .units_per_row = units};
  if (vector) {
    detail::launch(kv_write_kernel<uint4>, dim3(grid), dim3(threads), 0, stream, params);
  } else {
    detail::launch(kv_write_kernel<uint16_t>, dim3(grid), dim3(threads), 0, stream, params);
  }
  LMX_CUDA_CHECK_LAUNCH();
}

// The one dispatch of attention, by shape:
//  - D ∉ {64, 128}, or a pointer not 16-byte aligned: simple (tiny presets, D 16: their cost is launch-bound).
//  - otherwise flash over row tiles of 128 rows (prefill: full tiles that fill the GPU) or 64; when the
//    (row tile, kv head) CTAs do not fill one wave (decode, short chunks) and T <= 64, the tile's keys split
//    over up to kMaxSplits CTAs, as many as the workspace holds and the context bound (block-table width,
//    or the window) makes worth it.
// launch.kernel / flash_rows pin a path (tests, bench); pinning flash/split-KV on a shape they cannot run is
// an error.
void set_attention_one_barrier(bool on) { one_barrier = on; }
void set_attention_wgmma(bool on) { flash_wgmma = on; }
void set_attention_wgmma_overlap_kv(bool on) { flash_wgmma_overlap_kv = on; }
void set_attention_heads_inner(bool on) { flash_heads_inner = on; }

void attention(const ops::AttentionParams& p, cudaStream_t stream, const AttentionLaunch& launch) {
  ops::require(ops::check(p), "cuda::attention");
  detail::require_cuda("attention", {{"q", &p.q},
                                     {"k_cache", &p.k_cache},
                                     {"v_cache", &p.v_cache},
                                     {"block_table", &p.block_table},
                                     {"seq_start", &p.seq_start},
                                     {"positions", &p.positions},
                                     {"out", &p.out}});
  detail::require_bf16_activation("attention", "q", p.q);
  detail::require_bf16_activation("attention", "k_cache", p.k_cache);
  detail::require_bf16_activation("attention", "v_cache", p.v_cache);
  detail::require_bf16_activation("attention", "out", p.out);
  if (p.sinks.defined() && (p.sinks.device != Device::kCuda || p.sinks.dtype != DType::BF16)) {
    detail::contract_failure("attention", "sinks", p.sinks, "[Hq] BF16 on cuda");
  }
  const int64_t tokens = p.q.dim(0), q_heads = p.q.dim(1), head_dim = p.q.dim(2);
  if (tokens == 0) return;
  constexpr int kMaxHeadDim = 256;
  if (head_dim > kMaxHeadDim) detail::contract_failure("attention", "q", p.q, "head dim D <= 256");
  const int64_t kv_heads = p.k_cache.dim(2), seqs = p.block_table.dim(0);
  const int64_t page_size = p.k_cache.dim(1), max_pages = p.block_table.dim(1);
  const int64_t group = q_heads / kv_heads;

  const bool flash_shape = (head_dim == 64 || head_dim == 128) && detail::aligned16(p.q.data) &&
                           detail::aligned16(p.k_cache.data) && detail::aligned16(p.v_cache.data) &&
                           detail::aligned16(p.out.data);
  if (launch.kernel == AttentionKernel::kSimple || (launch.kernel == AttentionKernel::kAuto && !flash_shape)) {
    launch_simple(p, stream);
    return;
  }
  if (!flash_shape) {
    std::fprintf(stderr, "loramux: cuda::attention: the %s kernel needs D 64 or 128 and 16-byte aligned q, "
                 "k_cache, v_cache, out; found D %lld\n", kernel_name(launch.kernel), static_cast<long long>(head_dim));
    std::abort();
  }

  // Row tiles of 16, 64 or 128 rows: Σ_b ceil(rows_b / M) <= ceil(T·G / M) + B, and never more than T·G.
  // 128 (8 warps) when sequences average a full tile and those tiles alone fill the GPU (prefill);
  // 16 with the key split (4 warps share the rows, each takes a quarter of every K/V tile's keys) when the
  // sequences average at most 16 rows and T is in the split-KV range (decode: G rows per token); 64 (4
  // warps) otherwise: short chunks, and the split needs CTAs, not rows.
  const int64_t rows = tokens * group;
  auto row_tiles_of = [&](int64_t block_m) { return std::min(rows, (rows + block_m - 1) / block_m + seqs); };
  const int64_t sms = multiprocessor_count();
  int warps = 4;
  bool key_split = false;
  if (launch.flash_rows == 128) {
    warps = 8;
  } else if (launch.flash_rows == 16) {
    key_split = true;
  } else if (launch.flash_rows == 0) {
    if (rows >= 128 * seqs && row_tiles_of(128) * kv_heads >= sms * flash_ctas_per_sm(head_dim, 8, 2)) warps = 8;
    else if (rows <= 16 * seqs && tokens <= kMaxSplitTokens && launch.kv_stages != 3) key_split = true;
  } else if (launch.flash_rows != 64) {
    std::fprintf(stderr, "loramux: cuda::attention: AttentionLaunch.flash_rows: expected 0, 16, 64 or 128, found %d\n",
                 launch.flash_rows);
    std::abort();
  }
  // K/V ring depth of 64-row tiles (decode and short chunks: few key tiles per CTA, so the tiles in flight,
  // not the math, bound it): kv_stages pins it; 128-row tiles always use 2 (3 is not built for them).
  if (launch.kv_stages != 0 && launch.kv_stages != 2 && launch.kv_stages != 3) {
    std::fprintf(stderr, "loramux: cuda::attention: AttentionLaunch.kv_stages: expected 0, 2 or 3, found %d\n",
                 launch.kv_stages);
    std::abort();
  }
  if (launch.kv_stages == 3 && (launch.flash_rows == 128 || launch.flash_rows == 16)) {
    std::fprintf(stderr, "loramux: cuda::attention: AttentionLaunch.kv_stages 3 is built for 64-row tiles only, "
                 "found flash_rows %d\n", launch.flash_rows);
    std::abort();
  }
  int stages = warps == 8 || key_split ? 2 : launch.kv_stages != 0 ? launch.kv_stages : kFlashDefaultStages64Rows;
  const int64_t row_tiles = row_tiles_of(key_split ? 16 : 16 * warps);
  LMX_CHECK(row_tiles * kv_heads <= 0x7fffffffLL && kv_heads <= 65535 && tokens * q_heads <= 0x7fffffffLL);

  int splits = 1;
  const int64_t per_split = split_bytes(tokens * q_heads, head_dim);
  const int64_t fit =
      launch.workspace == nullptr ? 0 : std::min<int64_t>(kMaxSplits, int64_t(launch.workspace_bytes) / per_split);
  if (launch.workspace != nullptr && !detail::aligned16(launch.workspace)) {
    std::fprintf(stderr, "loramux: cuda::attention: workspace must be 16-byte aligned\n");
    std::abort();
  }
  if (launch.kernel == AttentionKernel::kSplitKv) {
    if (fit < 2) {
      std::fprintf(stderr, "loramux: cuda::attention: the split-KV kernel needs a workspace of at least %lld bytes "
                   "(2 splits of T %lld x Hq %lld rows, D %lld), found %zu\n", static_cast<long long>(2 * per_split),
                   static_cast<long long>(tokens), static_cast<long long>(q_heads), static_cast<long long>(head_dim),
                   launch.workspace_bytes);
      std::abort();
    }
    // Pinned: as many splits as fit (empty splits included: the tests want them), or the bench's count.
    splits = int(launch.splits > 0 ? std::clamp<int64_t>(launch.splits, 2, fit) : fit);
  } else if (launch.kernel == AttentionKernel::kAuto && fit >= 2 && tokens <= kMaxSplitTokens) {
    // Split when the CTAs do not fill one wave; then aim at two waves (the quantisation of a partial last
    // wave stays small), with at least two key tiles per split so each CTA keeps its two-stage ring busy.
    // CTAs that do work: the grid's row tiles are an upper bound (ceil(T·G / M) + B) that counts a partial
    // tile per sequence; with the key split (M 16) sequences of equal rows (decode: G rows each) hold
    // B · ceil(rows / (B · 16)) tiles — GPT-OSS-20B decode 16, not the bound's 24.
    const int64_t work_tiles =
        key_split ? std::min(row_tiles, seqs * ((rows + 16 * seqs - 1) / (16 * seqs))) : row_tiles;
    const int64_t ctas = work_tiles * kv_heads;
    const int64_t slots = sms * flash_ctas_per_sm(head_dim, warps, stages, key_split);
    const int64_t context = p.sliding_window > 0 ? std::min<int64_t>(p.sliding_window + tokens, max_pages * page_size)
                                                 : max_pages * page_size;
    const int64_t key_tiles = (context + kFlashBlockN - 1) / kFlashBlockN;
    // The key split aims at one full wave (floor, not ceil: a few CTAs of a second wave would cost a whole
    // CTA's latency): its CTAs are four times quicker per K/V tile, so a second wave only adds metadata and Q
    // latency (GPT-OSS-20B decode 16 × 2000, 4 CTAs per SM: x4 37.5 µs, x8 41.3, x6 46.2 — uneven shares of
    // 32 tiles — x2 63.7, against 64-row tiles' best 45.1; perf-log runs 32–33).
    if (ctas < slots) {
      const int64_t wanted = key_split ? slots / ctas : (2 * slots + ctas - 1) / ctas;
      splits = int(std::clamp<int64_t>(std::min(wanted, key_tiles / 2), 1, fit));
    }
  }

  auto* workspace = static_cast<float*>(launch.workspace);
  const int64_t rows_total = tokens * q_heads;
  const FlashKernelParams params{
      .q = static_cast<const __nv_bfloat16*>(p.q.data),
      .k_cache = static_cast<const __nv_bfloat16*>(p.k_cache.data),
      .v_cache = static_cast<const __nv_bfloat16*>(p.v_cache.data),
      .block_table = static_cast<const int32_t*>(p.block_table.data),
      .seq_start = static_cast<const int32_t*>(p.seq_start.data),
      .positions = static_cast<const int32_t*>(p.positions.data),
      .sinks = p.sinks.defined() ? static_cast<const __nv_bfloat16*>(p.sinks.data) : nullptr,
      .out = static_cast<__nv_bfloat16*>(p.out.data),
      .partial_acc = splits > 1 ? workspace : nullptr,
      .partial_max = splits > 1 ? workspace + splits * rows_total * head_dim : nullptr,
      .partial_sum = splits > 1 ? workspace + splits * rows_total * (head_dim + 1) : nullptr,
      .tokens = int(tokens),
      .seqs = int(seqs),
      .q_heads = int(q_heads),
      .kv_heads = int(kv_heads),
      .group = int(group),
      .page_size = int(page_size),
      .max_pages = int(max_pages),
      .sliding_window = p.sliding_window,
      .splits = splits,
      .page_shift = (page_size & (page_size - 1)) == 0 ? std::countr_zero(uint64_t(page_size)) : -1,
      .scale_log2 = p.softmax_scale * kLog2e,
      .one_barrier = one_barrier && !key_split,
      .heads_inner = flash_heads_inner};
  if (key_split) {
    if (head_dim == 64) launch_flash<64, 4, 2, true>(params, unsigned(row_tiles), stream);
    else launch_flash<128, 4, 2, true>(params, unsigned(row_tiles), stream);
  } else if (head_dim == 64 && warps == 4) {
    if (stages == 3) launch_flash<64, 4, 3>(params, unsigned(row_tiles), stream);
    else launch_flash<64, 4, 2>(params, unsigned(row_tiles), stream);
  } else if (head_dim == 64) {
    if (flash_wgmma) launch_flash_wgmma<64>(params, unsigned(row_tiles), stream);
    else launch_flash<64, 8, 2>(params, unsigned(row_tiles), stream);
  } else if (warps == 4) {
    if (stages == 3) launch_flash<128, 4, 3>(params, unsigned(row_tiles), stream);
    else launch_flash<128, 4, 2>(params, unsigned(row_tiles), stream);
  } else if (flash_wgmma) {
    launch_flash_wgmma<128>(params, unsigned(row_tiles), stream);
  } else {
    launch_flash<128, 8, 2>(params, unsigned(row_tiles), stream);
  }
  if (splits > 1) {
    const CombineKernelParams combine{.partial_acc = params.partial_acc,
                                      .partial_max = params.partial_max,
                                      .partial_sum = params.partial_sum,
                                      .out = params.out,
                                      .rows = rows_total,
                                      .splits = splits,
                                      .head_dim = int(head_dim)};
    const dim3 blocks(detail::blocks_for(rows_total, kCombineWarps)), threads(32 * kCombineWarps);
    if (combine.head_dim <= 64) {
      detail::launch(attention_combine_kernel<2>, blocks, threads, 0, stream, combine);
    } else {
      detail::launch(attention_combine_kernel<4>, blocks, threads, 0, stream, combine);
    }
    LMX_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace lmx::cuda
