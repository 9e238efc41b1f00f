// MoE-LoRA shrink and expand kernels (moe_lora.cuh) and their launchers, on tensor cores (mma.sync). One CTA
// per (tile of 16 pairs, piece); the tile's group gives (slot, expert), so the slot is a grid dimension
// through the tile list and no CTA exists for an empty (slot, expert). 4 warps per CTA.
//  shrink: z[16, r] += x[16, k-piece]·A[s,e][r, k-piece]ᵀ, bf16 m16n8k16, fp32 accumulators. The piece is
//    walked in chunks of 64 inputs staged by cp.async in a 3-stage ring (x rows of the tile, the slot's
//    true-rank rows of A, rounded up to 16); warp w takes inputs [16w, 16w + 16) of each chunk for all
//    rank columns, the 4 warps are summed in shared memory, then fp32 atomics (split) or stores into z.
//    Run mode (large batches): a CTA takes up to 4 consecutive tiles of one (slot, expert), a tile per
//    warp over all 64 inputs of each chunk, so one staged A chunk serves 64 pairs (less L2 traffic).
//  expand: y[16, n-piece] += z[16, r]·B[s,e][n-piece, r]ᵀ, bf16 m16n8k16 twice, z split into bf16 hi + lo
//    (16 significant bits; z alone as bf16 would keep 8), B by ldmatrix with its padding ranks zero-filled
//    by cp.async, so no per-element work on B. A streaming op: the CTA walks its piece in BLOCK_N chunks through
//    a 3-stage cp.async ring (B rows of the chunk + the tile's y rows as 16-byte vectors), adds the fp32
//    accumulators into the staged y in place (one rounding) and stores it back; z is read once per CTA.
//    The first B chunks are staged before griddepcontrol.wait (PDL), y and z after it.
// Shared-memory rows are padded (shrink: 144 bytes; expand: rank tier + 8 and BLOCK_N + 8 bf16) so that
// 8 consecutive rows fall into distinct bank groups: ldmatrix and the fragment accesses are conflict-free.
// Rank capacity R up to 128 (a merged MoE gate_up is 2 × --max-lora-rank): every kernel is built for a
// compile-time rank cap the launcher picks from R, so R <= 64 runs the same code as before R 128 existed;
// the 128 caps size accumulators and shared memory for 128 (static shared memory above 48 KB goes dynamic).
#include "backends/cuda/moe_lora.cuh"

#include <cuda_bf16.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "backends/cuda/check.h"
#include "backends/cuda/device.cuh"
#include "backends/cuda/launch.cuh"

namespace lmx::cuda {
namespace {

constexpr int kBlockM = kMoeLoraBlockM;
constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kMaxRank = 128;   // the contract's R limit (rank caps 64 and 128, tiers 16 / 32 / 64 / 128)
constexpr int kChunk = 64;      // shrink: inputs per pipeline stage (16 per warp)
constexpr int kStages = 3;      // shrink: cp.async ring depth
constexpr int kRowBf16 = 72;    // shared row stride in bf16 (144 B), see the file comment
constexpr int kExpandStages = 3;  // expand: ring depth over BLOCK_N chunks (6 measured slower: perf-log run 226)
constexpr int kSms = 132;  // H200; sizes the auto split and the expand's pieces (a heuristic, not a limit; the persistent
                           // expand's grid uses the device's count, multiprocessor_count)
constexpr int kPersistentPieceChunks = 16;  // the persistent expand's chunks per piece when expand_chunks is 0

// ---- device helpers -----------------------------------------------------------------------------------

// 16 bytes global -> shared, asynchronous; src_bytes 0 writes zeros without reading (masked rows/columns).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes));
}
// 4 bytes global -> shared, asynchronous (the bf16-pair path of y when rows are not 16-byte vectors).
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// Four 8×8 bf16 matrices; lanes 8i..8i+7 address the rows of matrix i, register i gets matrix i's
// (row lane/4, columns 2·(lane%4), +1).
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* smem) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
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


// Programmatic dependent launch (sm_90): the primary lets its dependents start; the dependent waits for
// the primary's completion and memory. Both are no-ops when the launch had no PDL attribute.
__device__ __forceinline__ void pdl_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;\n" ::); }
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }

// ---- kernels ------------------------------------------------------------------------------------------

struct LoraKernelParams {
  const __nv_bfloat16* x;       // [T or T*K, in] bf16
  const __nv_bfloat16* a;       // [S, E, R, in] bf16
  const __nv_bfloat16* b;       // [S, E, out, R] bf16
  const int32_t* rank;          // [S] i32
  const int32_t* sorted_pairs;  // [capacity] i32
  const int32_t* tile_group;    // [max_tiles] i32
  const int32_t* num_tiles;     // [1] i32
  float* z;                     // [T*K, R] f32
  __nv_bfloat16* y;             // [T*K, out] bf16
  int32_t* tile_counters;       // [max_tiles] i32, or null: no self-cleaning
  int32_t* work;                // [2] i32 past the tile counters (persistent expand: the next item, the CTAs done;
                                // zero between calls), or null: items striped over the CTAs
  int pairs;                    // T*K, the sentinel
  int top_k;                    // K
  bool x_per_pair;              // x has T*K rows
  const int32_t* x_rows;        // [T*K] i32 or null: x's row of each pair (then x_per_pair is ignored)
  bool y_vector;                // out % 8 == 0 and y 16-byte aligned: 16-byte y accesses
  int experts;                  // E
  int in;                       // in
  int out;                      // out
  int capacity_rank;            // R
  int max_tiles;                // grid tiles (capacity / BLOCK_M)
  int pieces;                   // shrink: split_k; expand: ceil(chunks / chunks_per_piece)
  bool piece_fastest;           // MoeLoraCtaOrder::kPieceFastest
  int chunks_per_piece;         // expand: BLOCK_N chunks of `out` per CTA
  bool overwrite;               // expand: y = z·Bᵀ (not +=), every row of the tiles written (zeros at rank 0)
};

// (tile, piece) of this CTA under the configured order.
__device__ __forceinline__ void cta_coords(const LoraKernelParams& p, int& tile, int& piece) {
  const int linear = blockIdx.x;
  if (p.piece_fastest) {
    tile = linear / p.pieces;
    piece = linear % p.pieces;
  } else {
    tile = linear % p.max_tiles;
    piece = linear / p.max_tiles;
  }
}

// x's row of a real pair.
__device__ __forceinline__ int64_t x_row_of(const LoraKernelParams& p, int pair) {
  return p.x_rows != nullptr ? p.x_rows[pair] : p.x_per_pair ? pair : pair / p.top_k;
}

// The tile's pairs into shared memory; returns how many are real (sentinels sit at the end of a group).
__device__ __forceinline__ int load_tile_pairs(const LoraKernelParams& p, int tile, int (&pairs)[kBlockM]) {
  if (threadIdx.x < kBlockM) pairs[threadIdx.x] = p.sorted_pairs[tile * kBlockM + threadIdx.x];
  __syncthreads();
  int valid = 0;
#pragma unroll
  for (int m = 0; m < kBlockM; ++m) valid += pairs[m] != p.pairs;
  return valid;
}

template <int kRankCap>
struct ShrinkStage {
  __nv_bfloat16 x[kBlockM][kRowBf16];   // [16 pairs, 64 inputs] bf16 (+8 pad)
  __nv_bfloat16 a[kRankCap][kRowBf16];  // [rank rows, 64 inputs] bf16 (+8 pad)
};
// The reduction rows are kRankCap + 8 floats (72 / 136): the float2 stores of 8 rows × 4 lanes stay on
// distinct banks.
template <int kRankCap>
union ShrinkShared {
  ShrinkStage<kRankCap> stages[kStages];
  float reduce[kWarps][kBlockM][kRankCap + 8];  // after the main loop: each warp's partial z tile
};

// The per-tile shrink's shared memory: static at cap 64 (34.5 KB, the layout it always had), dynamic at
// cap 128 (61 KB, above the 48 KB of static shared memory; the launcher raises the kernel's limit).
template <int kRankCap>
constexpr bool shrink_shared_is_static() { return kRankCap <= 64; }
static_assert(sizeof(ShrinkShared<64>) + 64 <= 48 * 1024, "cap 64: static shared memory");
template <int kRankCap>
__device__ __forceinline__ ShrinkShared<kRankCap>& shrink_tile_shared() {
  if constexpr (shrink_shared_is_static<kRankCap>()) {
    __shared__ __align__(16) ShrinkShared<kRankCap> smem;
    return smem;
  } else {
    extern __shared__ __align__(16) unsigned char shrink_shared[];
    return *reinterpret_cast<ShrinkShared<kRankCap>*>(shrink_shared);
  }
}

// PRECOND: blockDim.x == kThreads; in % 8 == 0; x, a 16-byte aligned; R % 8 == 0, R <= kRankCap;
// sorted_pairs and tile_group from moe_align with BLOCK_M = kBlockM and G = S·E; z zero on the rows of
// this call's pairs when split (pieces) > 1; dynamic shared memory = sizeof(ShrinkShared<kRankCap>) unless
// shrink_shared_is_static. kEvenK: in % kChunk == 0 (no column masks).
template <bool kEvenK, int kRankCap>
__global__ static void __launch_bounds__(kThreads) shrink_kernel(const __grid_constant__ LoraKernelParams p) {
  pdl_launch_dependents();  // the expand may start its z-independent prologue now
  int tile, piece;
  cta_coords(p, tile, piece);
  if (tile >= *p.num_tiles) return;
  const int group = p.tile_group[tile];
  const int slot = group / p.experts;
  const int rank = p.rank[slot];
  if (rank == 0) return;
  const int chunks = (p.in + kChunk - 1) / kChunk;
  const int per_piece = (chunks + p.pieces - 1) / p.pieces;
  const int c_begin = piece * per_piece, c_end = min(c_begin + per_piece, chunks);
  if (c_begin >= c_end) return;

  __shared__ int pairs[kBlockM];
  ShrinkShared<kRankCap>& smem = shrink_tile_shared<kRankCap>();
  const int valid = load_tile_pairs(p, tile, pairs);
  const int rank16 = (rank + 15) / 16 * 16;  // A rows staged (zero-filled past the true rank)
  const __nv_bfloat16* a = p.a + int64_t(group) * p.capacity_rank * p.in;  // [R, in] of (slot, expert)
  // This thread's x row (one 16-byte vector per thread per chunk: 16 rows × 8 vectors = kThreads).
  const int x_row = threadIdx.x / 8, x_vec = threadIdx.x % 8;
  const bool x_valid = x_row < valid;
  const int x_pair = x_valid ? pairs[x_row] : 0;
  const __nv_bfloat16* x_src = p.x + (x_valid ? x_row_of(p, x_pair) : 0) * p.in + x_vec * 8;

  auto load_chunk = [&](int chunk, int stage) {
    const int k0 = chunk * kChunk;
    ShrinkStage<kRankCap>& s = smem.stages[stage];
    const bool x_in = x_valid && (kEvenK || k0 + x_vec * 8 < p.in);
    cp_async16(&s.x[x_row][x_vec * 8], x_in ? x_src + k0 : p.x, x_in ? 16 : 0);
    for (int i = threadIdx.x; i < rank16 * 8; i += kThreads) {
      const int r = i / 8, v = i % 8;
      const bool in_range = r < rank && (kEvenK || k0 + v * 8 < p.in);
      cp_async16(&s.a[r][v * 8], in_range ? a + int64_t(r) * p.in + k0 + v * 8 : a, in_range ? 16 : 0);
    }
  };

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float acc[kRankCap / 8][4] = {};  // [n-tile of 8 rank columns][mma C fragment]
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (c_begin + s < c_end) load_chunk(c_begin + s, s);
    cp_async_commit();  // empty groups keep the wait count uniform
  }
  // ldmatrix addresses inside a stage: x (A operand) rows lane%8 + 8·((lane/8)%2), column 8·(lane/16);
  // A_lora (B operand, [n][k] = col-major K×N) rows lane%8 + 8·(lane/16), column 8·((lane/8)%2).
  const int xa_row = lane % 8 + 8 * ((lane / 8) % 2), xa_col = warp * 16 + 8 * (lane / 16);
  const int ab_row = lane % 8 + 8 * (lane / 16), ab_col = warp * 16 + 8 * ((lane / 8) % 2);
  for (int c = c_begin; c < c_end; ++c) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // chunk c visible to all; every warp is done with the stage refilled below
    const int stage = (c - c_begin) % kStages;
    const ShrinkStage<kRankCap>& s = smem.stages[stage];
    unsigned frag_x[4];
    ldmatrix_x4(frag_x, &s.x[xa_row][xa_col]);
#pragma unroll
    for (int np = 0; np < kRankCap / 16; ++np) {
      if (np * 16 < rank) {
        unsigned frag_a[4];
        ldmatrix_x4(frag_a, &s.a[np * 16 + ab_row][ab_col]);
        mma_bf16(acc[2 * np], frag_x, frag_a[0], frag_a[1]);
        mma_bf16(acc[2 * np + 1], frag_x, frag_a[2], frag_a[3]);
      }
    }
    const int next = c + kStages - 1;
    if (next < c_end) load_chunk(next, (next - c_begin) % kStages);
    cp_async_commit();
  }
  cp_async_wait<0>();
  __syncthreads();  // the stages are dead: the reduction buffer overlays them

  // C fragment: (row g, columns 2t, 2t+1) and (row g + 8, same columns), g = lane/4, t = lane%4.
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int nt = 0; nt < kRankCap / 8; ++nt) {
    if (nt * 8 < rank16) {
      *reinterpret_cast<float2*>(&smem.reduce[warp][g][nt * 8 + 2 * t]) = make_float2(acc[nt][0], acc[nt][1]);
      *reinterpret_cast<float2*>(&smem.reduce[warp][g + 8][nt * 8 + 2 * t]) = make_float2(acc[nt][2], acc[nt][3]);
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < valid * rank; i += kThreads) {
    const int m = i / rank, r = i % rank;
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += smem.reduce[w][m][r];
    float* dst = p.z + int64_t(pairs[m]) * p.capacity_rank + r;
    if (p.pieces > 1) atomicAdd(dst, sum);  // relaxed: only the sum matters, read after the kernel
    else *dst = sum;
  }
}

// Shrink, run mode (large batches, several tiles per (slot, expert)): the per-tile kernel above re-reads
// the group's A chunk for every 16-pair tile; at T 2048-4096 it moves ~5 TB/s from L2 (estimated from
// the bench's per-tile bytes), so that traffic, not the math, bounds it.
// Here a CTA takes a run of up to kRunTiles tiles of one group, one tile per warp, so each staged A chunk
// serves up to 64 pairs. Runs: a tile leads if it starts its group or sits on a multiple of kRunTiles,
// and takes its group's tiles up to the next multiple; every other CTA exits at once. Each warp covers all
// 64 inputs of a chunk for its own 16 rows, so there is no cross-warp reduction.
constexpr int kRunTiles = kWarps;

template <int kRankCap>
struct ShrinkRunStage {
  __nv_bfloat16 x[kRunTiles * kBlockM][kRowBf16];  // [64 pairs, 64 inputs] bf16 (+8 pad)
  __nv_bfloat16 a[kRankCap][kRowBf16];             // [rank rows, 64 inputs] bf16 (+8 pad)
};

// The cp.async ring is kStages deep, as the tiled shrink's: 6 stages measured slower (perf-log run 115).
// PRECOND: as shrink_kernel, with R <= kRankCap (a multiple of 16) and dynamic shared memory =
// kStages · sizeof(ShrinkRunStage<kRankCap>).
template <bool kEvenK, int kRankCap>
__global__ static void __launch_bounds__(kThreads) shrink_run_kernel(const __grid_constant__ LoraKernelParams p) {
  pdl_launch_dependents();  // the expand may start its z-independent prologue now
  int tile, piece;
  cta_coords(p, tile, piece);
  const int tiles = *p.num_tiles;
  if (tile >= tiles) return;
  const int group = p.tile_group[tile];
  if (tile % kRunTiles != 0 && p.tile_group[tile - 1] == group) return;  // not a run's first tile
  const int slot = group / p.experts;
  const int rank = p.rank[slot];
  if (rank == 0) return;
  const int chunks = (p.in + kChunk - 1) / kChunk;
  const int per_piece = (chunks + p.pieces - 1) / p.pieces;
  const int c_begin = piece * per_piece, c_end = min(c_begin + per_piece, chunks);
  if (c_begin >= c_end) return;

  extern __shared__ __align__(16) unsigned char shrink_shared[];
  auto* stages = reinterpret_cast<ShrinkRunStage<kRankCap>*>(shrink_shared);  // [kStages]
  __shared__ int pairs[kRunTiles * kBlockM];  // the run's pairs; the sentinel past the run and on padding
  __shared__ int64_t x_offsets[kRunTiles * kBlockM];  // their x rows' element offsets (-1: none)
  if (threadIdx.x < kRunTiles * kBlockM) {
    const int member = tile + int(threadIdx.x) / kBlockM;  // tiles of one group are contiguous
    const bool in_run = member <= (tile | (kRunTiles - 1)) && member < tiles && p.tile_group[member] == group;
    const int pair = in_run ? p.sorted_pairs[tile * kBlockM + threadIdx.x] : p.pairs;
    pairs[threadIdx.x] = pair;
    x_offsets[threadIdx.x] = pair != p.pairs ? x_row_of(p, pair) * p.in : -1;
  }
  __syncthreads();
  const int rank16 = (rank + 15) / 16 * 16;  // A rows staged (zero-filled past the true rank)
  const __nv_bfloat16* a = p.a + int64_t(group) * p.capacity_rank * p.in;  // [R, in] of (slot, expert)

  auto load_chunk = [&](int chunk, int stage) {
    const int k0 = chunk * kChunk;
    ShrinkRunStage<kRankCap>& s = stages[stage];
    for (int i = threadIdx.x; i < kRunTiles * kBlockM * 8; i += kThreads) {
      const int m = i / 8, v = i % 8;
      const int64_t offset = x_offsets[m];
      const bool in_range = offset >= 0 && (kEvenK || k0 + v * 8 < p.in);
      const __nv_bfloat16* src = in_range ? p.x + offset + k0 + v * 8 : p.x;
      cp_async16(&s.x[m][v * 8], src, in_range ? 16 : 0);
    }
    for (int i = threadIdx.x; i < rank16 * 8; i += kThreads) {
      const int r = i / 8, v = i % 8;
      const bool in_range = r < rank && (kEvenK || k0 + v * 8 < p.in);
      cp_async16(&s.a[r][v * 8], in_range ? a + int64_t(r) * p.in + k0 + v * 8 : a, in_range ? 16 : 0);
    }
  };

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const bool warp_active = pairs[warp * kBlockM] != p.pairs;  // a member tile's first row is a real pair
  float acc[kRankCap / 8][4] = {};  // [n-tile of 8 rank columns][mma C fragment], this warp's 16 rows
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (c_begin + s < c_end) load_chunk(c_begin + s, s);
    cp_async_commit();
  }
  // ldmatrix addresses (as shrink_kernel, the k-step kk in place of the warp's slice): x rows
  // lane%8 + 8·((lane/8)%2) of the warp's tile, column 8·(lane/16); A rows lane%8 + 8·(lane/16), column
  // 8·((lane/8)%2).
  const int xa_row = warp * kBlockM + lane % 8 + 8 * ((lane / 8) % 2), xa_col = 8 * (lane / 16);
  const int ab_row = lane % 8 + 8 * (lane / 16), ab_col = 8 * ((lane / 8) % 2);
  for (int c = c_begin; c < c_end; ++c) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // chunk c visible to all; every warp is done with the stage refilled below
    const ShrinkRunStage<kRankCap>& s = stages[(c - c_begin) % kStages];
    if (warp_active) {
#pragma unroll
      for (int kk = 0; kk < kChunk / 16; ++kk) {
        unsigned frag_x[4];
        ldmatrix_x4(frag_x, &s.x[xa_row][kk * 16 + xa_col]);
#pragma unroll
        for (int np = 0; np < kRankCap / 16; ++np) {
          if (np * 16 < rank) {
            unsigned frag_a[4];
            ldmatrix_x4(frag_a, &s.a[np * 16 + ab_row][kk * 16 + ab_col]);
            mma_bf16(acc[2 * np], frag_x, frag_a[0], frag_a[1]);
            mma_bf16(acc[2 * np + 1], frag_x, frag_a[2], frag_a[3]);
          }
        }
      }
    }
    const int next = c + kStages - 1;
    if (next < c_end) load_chunk(next, (next - c_begin) % kStages);
    cp_async_commit();
  }
  cp_async_wait<0>();
  if (!warp_active) return;
  // C fragment: (row g, columns 2t, 2t+1) and (row g + 8, same columns), g = lane/4, t = lane%4.
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int nt = 0; nt < kRankCap / 8; ++nt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int pair = pairs[warp * kBlockM + g + 8 * half];
      if (nt * 8 >= rank || pair == p.pairs) continue;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int r = nt * 8 + 2 * t + j;
        if (r >= rank) continue;
        float* dst = p.z + int64_t(pair) * p.capacity_rank + r;
        if (p.pieces > 1) atomicAdd(dst, acc[nt][2 * half + j]);  // relaxed, as shrink_kernel
        else *dst = acc[nt][2 * half + j];
      }
    }
  }
}

// One stage of the expand's ring: a BLOCK_N chunk of the B slice and the tile's y rows over that chunk.
// Rows of kRankCap + 8 bf16 (48 / 80 / 144 / 272 B for the rank tiers 16 / 32 / 64 / 128) and of kBlockN + 8
// bf16 keep the ldmatrix rows of B and the bf16-pair y updates of 8 rows × 4 lanes on distinct banks.
template <int kRankCap, int kBlockN>
struct ExpandStage {
  __nv_bfloat16 b[kBlockN][kRankCap + 8];  // [chunk, rank] bf16
  __nv_bfloat16 y[kBlockM][kBlockN + 8];   // [pairs, chunk] bf16, updated in place, then stored
};
template <int kRankCap, int kBlockN>
struct ExpandShared {
  ExpandStage<kRankCap, kBlockN> stages[kExpandStages];
  float z[kBlockM][kRankCap + 4];  // [pairs, rank] f32 (+4: A-fragment reads on 32 banks)
  int pairs[kBlockM];
  int last_reader;
};

// ---- the expand kernels' shared steps (expand_kernel by cp.async, expand_bulk_kernel by bulk copies) --------

// An expand CTA's tile: its index, (slot, expert) group, the slot's rank and k-steps, its chunks [c_begin,
// c_end) of `out` and (threads < 16) its pair. moe_align's outputs and the ranks were complete before the shrink
// started, so all of it is read before griddepcontrol.wait; the tile count, the group and the pair are
// independent loads issued together (tile < max_tiles: in bounds past the last tile too), so the first B copies
// wait for two round trips (group, then rank). False where the CTA has nothing to do (past the last tile, or a
// slot of rank 0 unless overwrite, whose rows still get their zeros).
struct ExpandTile {
  int tile, group, rank, rank_steps, c_begin, c_end, pair;
};
__device__ __forceinline__ bool expand_tile_start(const LoraKernelParams& p, int block_n, ExpandTile& t) {
  int piece;
  cta_coords(p, t.tile, piece);
  const int tiles = *p.num_tiles;
  t.group = p.tile_group[t.tile];
  t.pair = threadIdx.x < kBlockM ? p.sorted_pairs[t.tile * kBlockM + threadIdx.x] : 0;
  if (t.tile >= tiles) return false;
  t.rank = p.rank[t.group / p.experts];
  if (t.rank == 0 && !p.overwrite) return false;
  const int chunks = (p.out + block_n - 1) / block_n;
  t.c_begin = piece * p.chunks_per_piece;
  t.c_end = min(t.c_begin + p.chunks_per_piece, chunks);
  t.rank_steps = (t.rank + 15) / 16;  // mma k-steps of 16 ranks
  return true;
}

// The tile's z into shared memory over the k-steps' ranks (zero past the true rank and on padding rows, so
// the MMAs need no masking on the z side), then — self-cleaning — this CTA's arrival on the tile's counter
// (detail::count_reader: the CTA's z reads, ordered by the barrier, happen before its count; the last of the
// tile's `pieces` CTAs zeroes z after its loop). The arrival is made by the last warp, off the bulk expand's
// producer (warp 0), whose first refill would otherwise wait for the atomic's round trip. PRECOND: pairs
// holds the tile's pairs; called by every thread, after griddepcontrol.wait.
template <int kRankCap>
__device__ __forceinline__ void expand_read_z(const LoraKernelParams& p, int tile, const int (&pairs)[kBlockM],
                                              int valid, int rank, float (&z)[kBlockM][kRankCap + 4],
                                              int& last_reader) {
  const int rank16 = (rank + 15) / 16 * 16;
  for (int i = threadIdx.x; i < kBlockM * kRankCap; i += kThreads) {  // power-of-two divisors: no division
    const int m = i / kRankCap, r = i % kRankCap;
    if (r < rank16) z[m][r] = (m < valid && r < rank) ? p.z[int64_t(pairs[m]) * p.capacity_rank + r] : 0.0f;
  }
  __syncthreads();  // z tile read by every thread of this CTA
  if (p.tile_counters != nullptr && threadIdx.x == kThreads - 32) {
    last_reader = detail::count_reader(&p.tile_counters[tile]) == p.pieces - 1;
    if (last_reader) p.tile_counters[tile] = 0;  // read again only by the next kernel
  }
}

// A fragments (z) for every k-step of 16 ranks, z split into two bf16 terms (hi, and lo = the rest): 16
// significant bits (tf32 has 11), and B goes to the MMA straight from ldmatrix. Registers of m16n8k16: rows
// g and g + 8, ranks 2t, 2t + 1 and 2t + 8, 2t + 9. mask_rank: ranks >= mask_rank read as zero (the persistent
// expand's z rows come by bulk copies of the stack's capacity, so a last k-step past it holds stale shared memory;
// the other expands zero z past the rank as they stage it and pass kRankCap).
template <int kRankCap>
__device__ __forceinline__ void expand_z_fragments(const float (&z)[kBlockM][kRankCap + 4], int rank_steps,
                                                   unsigned (&z_hi)[kRankCap / 16][4],
                                                   unsigned (&z_lo)[kRankCap / 16][4], int mask_rank = kRankCap) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int ks = 0; ks < kRankCap / 16; ++ks) {
    if (ks < rank_steps) {
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int k = ks * 16 + 2 * t + 8 * (q / 2);
        float2 v = *reinterpret_cast<const float2*>(&z[g + 8 * (q % 2)][k]);
        if (k >= mask_rank) v.x = 0.0f;
        if (k + 1 >= mask_rank) v.y = 0.0f;
        detail::split_bf16(v, z_hi[ks][q], z_lo[ks][q]);
      }
    }
  }
}

// n-tiles 2np and 2np + 1 of this warp's kBlockN / 4 outputs of z·B[chunk]ᵀ: acc[j] is n-tile 2np + j (C
// fragment: rows g and g + 8, columns 2t and 2t + 1). A pair at a time keeps the tiers 16 / 32 under 72
// registers. b_row(n, k) is the shared address of B's 8 ranks [k, k + 8) of chunk row n. mask_last: zero B's
// ranks >= rank in the last k-step (a stack's padding ranks may hold anything: 0·NaN).
template <int kRankCap, int kBlockN, typename BRow>
__device__ __forceinline__ void expand_pair_acc(int np, const unsigned (&z_hi)[kRankCap / 16][4],
                                                const unsigned (&z_lo)[kRankCap / 16][4], int rank_steps, int rank,
                                                bool mask_last, BRow&& b_row, float (&acc)[2][4]) {
  constexpr int kWarpN = kBlockN / kWarps;  // outputs per warp and chunk
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, t = lane % 4;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
#pragma unroll
    for (int q = 0; q < 4; ++q) acc[j][q] = 0.0f;
  }
#pragma unroll
  for (int ks = 0; ks < kRankCap / 16; ++ks) {
    if (ks < rank_steps) {
      // Matrices: n-tile 2np ranks [0, 8) and [8, 16) of the step, then n-tile 2np + 1 the same; register i
      // holds matrix i's row lane / 4, ranks 16ks + 8(i % 2) + 2t and + 1.
      unsigned frag_b[4];
      ldmatrix_x4(frag_b, b_row(warp * kWarpN + np * 16 + lane / 16 * 8 + lane % 8, ks * 16 + (lane / 8) % 2 * 8));
      if (mask_last && ks == rank_steps - 1) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int k = ks * 16 + (i % 2) * 8 + 2 * t;
          frag_b[i] &= (k < rank ? 0x0000ffffu : 0u) | (k + 1 < rank ? 0xffff0000u : 0u);
        }
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        mma_bf16(acc[j], z_hi[ks], frag_b[2 * j], frag_b[2 * j + 1]);
        mma_bf16(acc[j], z_lo[ks], frag_b[2 * j], frag_b[2 * j + 1]);
      }
    }
  }
}

// The staged y rows of chunk c back to y (16-byte vectors, or bf16 pairs without y_vector).
template <int kBlockN>
__device__ __forceinline__ void expand_store_chunk(const LoraKernelParams& p, int c, const int (&pairs)[kBlockM],
                                                   int valid, const __nv_bfloat16 (&y)[kBlockM][kBlockN + 8]) {
  const int n0 = c * kBlockN;
  if (p.y_vector) {
    constexpr int kVectors = kBlockN / 8;
    for (int i = threadIdx.x; i < valid * kVectors; i += kThreads) {
      const int m = i / kVectors, v = i % kVectors;
      if (n0 + v * 8 < p.out) {
        *reinterpret_cast<uint4*>(p.y + int64_t(pairs[m]) * p.out + n0 + v * 8) =
            *reinterpret_cast<const uint4*>(&y[m][v * 8]);
      }
    }
  } else {
    constexpr int kDuos = kBlockN / 2;
    for (int i = threadIdx.x; i < valid * kDuos; i += kThreads) {
      const int m = i / kDuos, d = i % kDuos;
      if (n0 + d * 2 < p.out) {
        *reinterpret_cast<__nv_bfloat162*>(p.y + int64_t(pairs[m]) * p.out + n0 + d * 2) =
            *reinterpret_cast<const __nv_bfloat162*>(&y[m][d * 2]);
      }
    }
  }
}

// Self-cleaning: the tile's last reader zeroes the z rows it consumed. PRECOND: every thread, after the loop.
template <int kRankCap>
__device__ __forceinline__ void expand_clean_z(const LoraKernelParams& p, const int (&pairs)[kBlockM], int valid,
                                               int rank, const int& last_reader) {
  if (p.tile_counters == nullptr) return;
  __syncthreads();  // last_reader written by the arriving thread (the loop's barriers may be none)
  if (last_reader) {
    for (int i = threadIdx.x; i < kBlockM * kRankCap; i += kThreads) {
      const int m = i / kRankCap, r = i % kRankCap;
      if (m < valid && r < rank) p.z[int64_t(pairs[m]) * p.capacity_rank + r] = 0.0f;
    }
  }
}

// The expand streams: per chunk of kBlockN outputs it gathers the tile's y rows and the B rows, adds
// z·Bᵀ and writes y back; a CTA walks `chunks_per_piece` chunks through a kExpandStages-deep cp.async
// ring, so two chunks (B + y, ~24 KB at R 32, N 128) are in flight while one is computed and stored.
// z is read once per CTA; the self-cleaning arrival happens once per CTA, right after that read. (A run
// mode that staged B once for 2 or 4 tiles of a group measured slower at every size, perf-log run 49.)
// PRECOND: blockDim.x == kThreads; out % 2 == 0; R % 8 == 0, R <= kRankCap; b 16-byte aligned, y 4-byte
// aligned (16 with out % 8 == 0 when y_vector); pieces == ceil(ceil(out / kBlockN) / chunks_per_piece);
// dynamic shared memory = sizeof(ExpandShared); z holds the shrink of every pair of the tile once
// griddepcontrol.wait returns. y is read only after that wait (its producer may precede the shrink).
// Latency-bound (a few KB in flight per CTA), so CTAs per SM matter: tiers 16 / 32 are held to 72
// registers (7 CTAs per SM, no spills; the hi/lo z fragments would otherwise take 93).
template <int kRankCap, int kBlockN>
__global__ static void __launch_bounds__(kThreads, kRankCap <= 32 ? 7 : 1)
    expand_kernel(const __grid_constant__ LoraKernelParams p) {
  constexpr int kWarpN = kBlockN / kWarps;  // outputs per warp and chunk
  constexpr int kTilesN = kWarpN / 8;       // mma n-tiles per warp
  constexpr int kRankSteps = kRankCap / 16;  // mma k-steps at the tier's full rank
  using Shared = ExpandShared<kRankCap, kBlockN>;
  extern __shared__ __align__(16) unsigned char expand_shared[];
  auto& smem = *reinterpret_cast<Shared*>(expand_shared);
  ExpandTile et;
  if (!expand_tile_start(p, kBlockN, et)) return;
  const int tile = et.tile, group = et.group, rank = et.rank, rank_steps = et.rank_steps;
  const int c_begin = et.c_begin, c_end = et.c_end, tile_pair = et.pair;
  const __nv_bfloat16* b = p.b + int64_t(group) * p.out * p.capacity_rank;  // [out, R] of (slot, expert)

  // B rows of a chunk over the k-steps' ranks: the true ranks copied, the rest of each step (ranks past
  // `rank`, which may hold anything in the stack, and rows past `out`) zero-filled by cp.async's source
  // size, so the MMAs need no masking (z is 0 there too, but 0·NaN is not 0).
  constexpr int kVectors = kRankCap / 8;  // 16-byte vectors of a staged B row
  auto load_b = [&](int chunk) {
    const int n0 = chunk * kBlockN;
    ExpandStage<kRankCap, kBlockN>& s = smem.stages[(chunk - c_begin) % kExpandStages];
    for (int i = threadIdx.x; i < kBlockN * kVectors; i += kThreads) {
      const int n = i / kVectors, v = i % kVectors;
      if (v >= 2 * rank_steps) continue;
      const int bytes = n0 + n < p.out ? 2 * min(8, max(0, rank - v * 8)) : 0;
      cp_async16(&s.b[n][v * 8], bytes > 0 ? b + int64_t(n0 + n) * p.capacity_rank + v * 8 : b, bytes);
    }
  };
  int valid = 0;                  // real pairs of the tile, known after the B prologue
  auto load_y = [&](int chunk) {  // rows of real pairs only; columns past `out` are never read
    if (p.overwrite) return;       // y is only written
    const int n0 = chunk * kBlockN;
    ExpandStage<kRankCap, kBlockN>& s = smem.stages[(chunk - c_begin) % kExpandStages];
    if (p.y_vector) {
      constexpr int kVectors = kBlockN / 8;
      for (int i = threadIdx.x; i < valid * kVectors; i += kThreads) {
        const int m = i / kVectors, c = i % kVectors;
        if (n0 + c * 8 < p.out) cp_async16(&s.y[m][c * 8], p.y + int64_t(smem.pairs[m]) * p.out + n0 + c * 8, 16);
      }
    } else {
      constexpr int kDuos = kBlockN / 2;  // out % 2 == 0: bf16 pairs, 4-byte aligned
      for (int i = threadIdx.x; i < valid * kDuos; i += kThreads) {
        const int m = i / kDuos, c = i % kDuos;
        if (n0 + c * 2 < p.out) cp_async4(&s.y[m][c * 2], p.y + int64_t(smem.pairs[m]) * p.out + n0 + c * 2);
      }
    }
  };

  // Prologue: B of the first chunks before the wait (weights, not written by the shrink), y after it.
#pragma unroll
  for (int s = 0; s < kExpandStages - 1; ++s) {
    if (c_begin + s < c_end) load_b(c_begin + s);
  }
  // The tile's pairs (sentinels on padding; real pairs come first: a group pads at its end).
  if (threadIdx.x < kBlockM) smem.pairs[threadIdx.x] = tile_pair;
  __syncthreads();
#pragma unroll
  for (int m = 0; m < kBlockM; ++m) valid += smem.pairs[m] != p.pairs;
  pdl_wait();  // z is the shrink's output; y may be its predecessor's
#pragma unroll
  for (int s = 0; s < kExpandStages - 1; ++s) {
    if (c_begin + s < c_end) load_y(c_begin + s);
    cp_async_commit();  // group s holds y of chunk s (and group 0 every prologue B): waits stay uniform
  }
  expand_read_z<kRankCap>(p, tile, smem.pairs, valid, rank, smem.z, smem.last_reader);
  unsigned z_hi[kRankSteps][4], z_lo[kRankSteps][4];
  expand_z_fragments<kRankCap>(smem.z, rank_steps, z_hi, z_lo);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  for (int c = c_begin; c < c_end; ++c) {
    cp_async_wait<kExpandStages - 2>();
    __syncthreads();  // chunk c visible to all; the stage refilled below was stored by every thread
    const int next = c + kExpandStages - 1;
    if (next < c_end) {
      load_b(next);
      load_y(next);
    }
    cp_async_commit();
    ExpandStage<kRankCap, kBlockN>& s = smem.stages[(c - c_begin) % kExpandStages];
    // B's ranks past `rank` were zero-filled by the copies: no mask. y += acc in place: one rounding of
    // fp32(y) + acc to bf16.
#pragma unroll
    for (int np = 0; np < kTilesN / 2; ++np) {
      float acc[2][4];
      expand_pair_acc<kRankCap, kBlockN>(np, z_hi, z_lo, rank_steps, rank, false,
                                         [&](int n, int k) { return &s.b[n][k]; }, acc);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int col = warp * kWarpN + (2 * np + j) * 8 + 2 * t;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int m = g + 8 * half;
          if (m >= valid) continue;
          auto* y2 = reinterpret_cast<__nv_bfloat162*>(&s.y[m][col]);
          const float2 old = p.overwrite ? make_float2(0.0f, 0.0f) : __bfloat1622float2(*y2);
          *y2 = __floats2bfloat162_rn(old.x + acc[j][2 * half], old.y + acc[j][2 * half + 1]);
        }
      }
    }
    __syncthreads();  // the updated y chunk is complete
    expand_store_chunk<kBlockN>(p, c, smem.pairs, valid, s.y);
  }
  expand_clean_z<kRankCap>(p, smem.pairs, valid, rank, smem.last_reader);
}

// y = (staged y or 0) + acc for n-tiles 2np and 2np + 1 of this warp's outputs of chunk n0, rounded once,
// from the fragments straight to global memory (the bulk expands): bf16 pairs when adding (the staged y rows
// only read); when overwriting, the quad's 16 columns regrouped by shuffles so that lane t holds [4t, 4t + 4)
// and writes them with one 8-byte store, a row's 32-byte sector by one instruction (half-sector stores of rows
// not in L2 cost a DRAM read each: run 227, T 4096 168 → 228 µs). y_row: this thread's rows g and g + 8, or null.
template <int kBlockN>
__device__ __forceinline__ void expand_store_pair(const LoraKernelParams& p, const float (&acc)[2][4], int np, int n0,
                                                  __nv_bfloat16* const (&y_row)[2],
                                                  const __nv_bfloat16 (&y)[kBlockM][kBlockN + 8]) {
  constexpr int kWarpN = kBlockN / kWarps;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  if (p.overwrite) {
    const int col = warp * kWarpN + np * 16 + 4 * t;  // this lane's first column after the regrouping
    const int quad = lane & ~3, from_a = quad + (2 * t) % 4, from_b = quad + (2 * t + 1) % 4;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      // 0 + acc, as the staged form computes it (a -0 sum becomes +0)
      const __nv_bfloat162 v0 = __floats2bfloat162_rn(0.0f + acc[0][2 * half], 0.0f + acc[0][2 * half + 1]);
      const __nv_bfloat162 v1 = __floats2bfloat162_rn(0.0f + acc[1][2 * half], 0.0f + acc[1][2 * half + 1]);
      const unsigned u0 = *reinterpret_cast<const unsigned*>(&v0), u1 = *reinterpret_cast<const unsigned*>(&v1);
      const unsigned a0 = __shfl_sync(~0u, u0, from_a), b0 = __shfl_sync(~0u, u0, from_b);
      const unsigned a1 = __shfl_sync(~0u, u1, from_a), b1 = __shfl_sync(~0u, u1, from_b);
      if (y_row[half] == nullptr || n0 + col >= p.out) continue;
      *reinterpret_cast<uint2*>(y_row[half] + n0 + col) = t < 2 ? make_uint2(a0, b0) : make_uint2(a1, b1);
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int col = warp * kWarpN + (2 * np + j) * 8 + 2 * t;
    if (n0 + col >= p.out) continue;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      if (y_row[half] == nullptr) continue;
      const float2 old = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&y[g + 8 * half][col]));
      *reinterpret_cast<__nv_bfloat162*>(y_row[half] + n0 + col) =
          __floats2bfloat162_rn(old.x + acc[j][2 * half], old.y + acc[j][2 * half + 1]);
    }
  }
}

// The expand by bulk copies (MoeLoraConfig::expand_bulk; y rows of 16-byte vectors): the same ring and math
// as expand_kernel, but each chunk's B arrives by one cp.async.bulk (rows [n0, n0 + kBlockN) of the group's
// [out, R] block are contiguous) or, for a slot whose k-steps do not span the capacity R, one bulk copy of
// each row's first ranks; each y row of the tile by one bulk copy; all awaited on the stage's mbarrier. Run
// 226 (ncu) found expand_kernel bound by its instruction stream (~2,300 warp instructions per 8 KB chunk:
// per-16-byte cp.async with index, mask and size arithmetic) at 34–40% of issue slots with ~4 warps a
// scheduler; here warp 0 issues a chunk's copies in a few instructions, and y goes from the fragments to global
// memory (expand_store_pair), so no generic write touches a stage and the loop has no block barrier (each warp
// releases a stage on its `empty` mbarrier; warp 0 waits for it before refilling). B lands unpadded (row stride
// round_up(R, 16)): ldmatrix meets 4-way bank conflicts at R 32, a few wavefronts a chunk. Ranks past the
// true rank are not zero-filled by the copy; the last k-step's B fragments are masked instead.
template <int kRankCap, int kBlockN>
struct alignas(16) ExpandBulkStage {
  __nv_bfloat16 b[kBlockN * kRankCap];    // [chunk rows, stride round_up(R, 16)] bf16, as in global memory
  __nv_bfloat16 y[kBlockM][kBlockN + 8];  // [pairs, chunk] bf16 (rows 16-byte aligned), read when adding
};
// One chunk of a bulk expand's ring (expand_bulk_kernel, expand_stream_kernel), by one warp: wait for the
// stage's copies (full, at `parity`), y = (staged y or 0) + z·B[chunk c]ᵀ over the warp's outputs straight from
// the fragments, then release the stage to the producer (empty).
template <int kRankCap, int kBlockN>
__device__ __forceinline__ void expand_bulk_chunk(const LoraKernelParams& p, const ExpandBulkStage<kRankCap, kBlockN>& s,
                                                  uint64_t* full, uint64_t* empty, unsigned parity, int c, int stride,
                                                  const unsigned (&z_hi)[kRankCap / 16][4],
                                                  const unsigned (&z_lo)[kRankCap / 16][4], int rank_steps, int rank,
                                                  bool mask_last, __nv_bfloat16* const (&y_row)[2]) {
  constexpr int kWarpN = kBlockN / kWarps;
  detail::mbarrier_wait(full, parity);
  const int n0 = c * kBlockN;
#pragma unroll
  for (int np = 0; np < kWarpN / 16; ++np) {
    float acc[2][4];
    expand_pair_acc<kRankCap, kBlockN>(np, z_hi, z_lo, rank_steps, rank, mask_last,
                                       [&](int n, int k) { return s.b + n * stride + k; }, acc);
    expand_store_pair<kBlockN>(p, acc, np, n0, y_row, s.y);
  }
  __syncwarp();  // the warp's reads of the stage are done
  if (threadIdx.x % 32 == 0) detail::mbarrier_arrive(empty);
}

template <int kRankCap, int kBlockN>
struct ExpandBulkShared {
  ExpandBulkStage<kRankCap, kBlockN> stages[kExpandStages];
  float z[kBlockM][kRankCap + 4];
  uint64_t full[kExpandStages];   // the stage's copies landed
  uint64_t empty[kExpandStages];  // every warp is done reading the stage (one arrival a warp)
  int pairs[kBlockM];
  int last_reader;
};

// PRECOND: as expand_kernel, with y_vector (out % 8 == 0, y 16-byte aligned); dynamic shared memory =
// sizeof(ExpandBulkShared).
template <int kRankCap, int kBlockN>
__global__ static void __launch_bounds__(kThreads, kRankCap <= 32 ? 7 : 1)
    expand_bulk_kernel(const __grid_constant__ LoraKernelParams p) {
  constexpr int kRankSteps = kRankCap / 16;
  using Shared = ExpandBulkShared<kRankCap, kBlockN>;
  extern __shared__ __align__(16) unsigned char expand_shared[];
  auto& smem = *reinterpret_cast<Shared*>(expand_shared);
  ExpandTile et;
  if (!expand_tile_start(p, kBlockN, et)) return;
  const int tile = et.tile, group = et.group, rank = et.rank, rank_steps = et.rank_steps;
  const int c_begin = et.c_begin, c_end = et.c_end, tile_pair = et.pair;
  const int capacity = p.capacity_rank;
  const int stride = (capacity + 15) / 16 * 16;  // B's shared row stride: whole k-steps
  // One copy a chunk where the rows are contiguous in both memories and the k-steps need all R ranks.
  const bool whole_chunk = stride == capacity && rank_steps * 16 == capacity;
  const unsigned row_b_bytes = unsigned(min(rank_steps * 16, capacity)) * 2;  // per-row copies
  const __nv_bfloat16* b = p.b + int64_t(group) * p.out * capacity;          // [out, R] of (slot, expert)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kExpandStages; ++s) {
      detail::mbarrier_init(&smem.full[s], 1);
      detail::mbarrier_init(&smem.empty[s], kWarps);
    }
  }
  // The tile's pairs (sentinels on padding; real pairs come first: a group pads at its end).
  if (threadIdx.x < kBlockM) smem.pairs[threadIdx.x] = tile_pair;
  __syncthreads();  // the barriers and the pairs
  int valid = 0;
#pragma unroll
  for (int m = 0; m < kBlockM; ++m) valid += smem.pairs[m] != p.pairs;

  // Warp 0 issues a chunk: lane 0 arrives expecting every byte of it, then B's copies (lane 0, or a row a
  // lane) and, unless overwrite, a y row a lane (after the PDL wait: y may be the previous kernel's output).
  auto chunk_rows = [&](int chunk) { return min(kBlockN, p.out - chunk * kBlockN); };
  auto expect = [&](int chunk) {
    const int rows = chunk_rows(chunk);
    const unsigned b_bytes = rank_steps == 0 ? 0u : whole_chunk ? unsigned(rows * capacity * 2) : unsigned(rows) * row_b_bytes;
    const unsigned y_bytes = p.overwrite ? 0u : unsigned(valid * rows * 2);
    if (lane == 0) detail::mbarrier_arrive_expect_tx(&smem.full[(chunk - c_begin) % kExpandStages], b_bytes + y_bytes);
    __syncwarp();
  };
  auto copy_b = [&](int chunk) {
    if (rank_steps == 0) return;
    const int stage = (chunk - c_begin) % kExpandStages, rows = chunk_rows(chunk);
    ExpandBulkStage<kRankCap, kBlockN>& s = smem.stages[stage];
    const __nv_bfloat16* src = b + int64_t(chunk) * kBlockN * capacity;
    if (whole_chunk) {
      if (lane == 0) detail::bulk_copy(detail::shared_address(s.b), src, unsigned(rows * capacity * 2), &smem.full[stage]);
    } else {
      for (int n = lane; n < rows; n += 32) {
        detail::bulk_copy(detail::shared_address(s.b + n * stride), src + int64_t(n) * capacity, row_b_bytes,
                          &smem.full[stage]);
      }
    }
  };
  auto copy_y = [&](int chunk) {
    if (p.overwrite || lane >= valid) return;
    const int stage = (chunk - c_begin) % kExpandStages;
    detail::bulk_copy(detail::shared_address(&smem.stages[stage].y[lane][0]),
                      p.y + int64_t(smem.pairs[lane]) * p.out + int64_t(chunk) * kBlockN,
                      unsigned(chunk_rows(chunk) * 2), &smem.full[stage]);
  };

  // Prologue: B of the first chunks before the wait (weights, not written by the shrink), y after it.
  if (warp == 0) {
    for (int s = 0; s < kExpandStages - 1 && c_begin + s < c_end; ++s) {
      expect(c_begin + s);
      copy_b(c_begin + s);
    }
  }
  pdl_wait();  // z is the shrink's output; y may be its predecessor's
  if (warp == 0) {
    for (int s = 0; s < kExpandStages - 1 && c_begin + s < c_end; ++s) copy_y(c_begin + s);
  }
  expand_read_z<kRankCap>(p, tile, smem.pairs, valid, rank, smem.z, smem.last_reader);
  unsigned z_hi[kRankSteps][4], z_lo[kRankSteps][4];
  expand_z_fragments<kRankCap>(smem.z, rank_steps, z_hi, z_lo);
  const bool mask_last = rank % 16 != 0;
  // This thread's rows of the C fragment (g and g + 8) and their y rows, if real.
  const int g = lane / 4;
  __nv_bfloat16* y_row[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int m = g + 8 * half;
    y_row[half] = m < valid ? p.y + int64_t(smem.pairs[m]) * p.out : nullptr;
  }

  for (int c = c_begin; c < c_end; ++c) {
    const int i = c - c_begin, stage = i % kExpandStages;
    // Warp 0 refills chunk c - 1's stage once every warp has released it (B read by ldmatrix, y by ld.shared;
    // no generic write ever touches a stage, so the copies need no proxy fence). The other warps never wait
    // for each other: no block barrier in the loop.
    const int next = c + kExpandStages - 1;
    if (warp == 0 && next < c_end) {
      if (i > 0) detail::mbarrier_wait(&smem.empty[(i - 1) % kExpandStages], unsigned((i - 1) / kExpandStages) & 1u);
      expect(next);
      copy_b(next);
      copy_y(next);
    }
    // y = (staged y or 0) + acc, rounded once, straight from the fragments to global memory.
    expand_bulk_chunk<kRankCap, kBlockN>(p, smem.stages[stage], &smem.full[stage], &smem.empty[stage],
                                         unsigned(i / kExpandStages) & 1u, c, stride, z_hi, z_lo, rank_steps, rank,
                                         mask_last, y_row);
  }
  expand_clean_z<kRankCap>(p, smem.pairs, valid, rank, smem.last_reader);
}

// The persistent expand (MoeLoraConfig::expand_persistent, the default where bulk copies apply): the bulk expand's
// per-CTA prologue was ~38% of its instructions at T 256 (perf-log run 229: tile start, barrier init, the first
// copies, z, the self-cleaning arrival, for 4–7 chunks a CTA). Here a grid of about as many CTAs as fit walks the
// (tile, piece) items, and a producer warp (warp 4) keeps the chunk ring running across items: for each item it
// reads the tile's group, rank and pairs itself, publishes them with the item's z rows (bulk copies) in a
// two-item ring (item_full / item_empty), then issues the item's chunks into the chunk ring (full / empty). The
// four consumer warps never wait on a tile start: an item's z and pairs land while they finish the previous one.
// Warp 3 makes the self-cleaning arrival and, as the tile's last reader, zeroes its z rows after the item.
constexpr int kStreamThreads = kThreads + 32;  // 4 consumer warps + the producer warp

// 16-byte aligned: z's rows are bulk-copy destinations, and items[1] must start on a 16-byte boundary too.
template <int kRankCap>
struct alignas(16) StreamItem {
  float z[kBlockM][kRankCap + 4];  // the tile's z rows (rows of real pairs; past them stale, never stored)
  int pairs[kBlockM];
  int tile, rank, c_begin, c_end, valid;
};
template <int kRankCap, int kBlockN>
struct ExpandStreamShared {
  ExpandBulkStage<kRankCap, kBlockN> stages[kExpandStages];
  StreamItem<kRankCap> items[2];
  uint64_t full[kExpandStages], empty[kExpandStages];
  uint64_t item_full[2], item_empty[2];
};

// Item w of `tiles` × p.pieces in the configured order.
__device__ __forceinline__ void stream_item_coords(const LoraKernelParams& p, int w, int tiles, int& tile, int& piece) {
  if (p.piece_fastest) {
    tile = w / p.pieces;
    piece = w % p.pieces;
  } else {
    tile = w % tiles;
    piece = w / tiles;
  }
}

// PRECOND: as expand_bulk_kernel, blockDim.x == kStreamThreads, dynamic shared memory = sizeof(ExpandStreamShared).
// Items come from p.work's counter (each producer takes the next one; the last CTA to run out resets both
// counters), or, without it, w = blockIdx.x + k · gridDim.x. The producer streams the first item's first B chunks
// before the programmatic wait (weights: the shrink never writes them), as the bulk expand does.
template <int kRankCap, int kBlockN>
__global__ static void __launch_bounds__(kStreamThreads, 1)
    expand_stream_kernel(const __grid_constant__ LoraKernelParams p) {
  constexpr int kRankSteps = kRankCap / 16;
  using Shared = ExpandStreamShared<kRankCap, kBlockN>;
  extern __shared__ __align__(16) unsigned char expand_shared[];
  auto& smem = *reinterpret_cast<Shared*>(expand_shared);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kExpandStages; ++s) {
      detail::mbarrier_init(&smem.full[s], 1);
      detail::mbarrier_init(&smem.empty[s], kWarps);
    }
    for (int k = 0; k < 2; ++k) {
      detail::mbarrier_init(&smem.item_full[k], 1);
      detail::mbarrier_init(&smem.item_empty[k], kWarps);
    }
  }
  __syncthreads();
  const int tiles = *p.num_tiles;  // moe_align's output: complete before the shrink started
  const int total = tiles * p.pieces;
  const int chunks = (p.out + kBlockN - 1) / kBlockN;
  const int capacity = p.capacity_rank;
  const int stride = (capacity + 15) / 16 * 16;  // B's shared row stride: whole k-steps

  if (warp == kWarps) {  // ---- producer ----
    // The item this CTA takes k-th (the same value in every lane). Before the wait too: the counters were
    // reset by the previous expand, which had completed before the shrink before this kernel started.
    auto take_item = [&](int k) {
      if (p.work == nullptr) return int(blockIdx.x) + k * int(gridDim.x);
      int w = 0;
      if (lane == 0) w = atomicAdd(&p.work[0], 1);
      return __shfl_sync(~0u, w, 0);
    };
    // An item's coordinates, read by the producer alone (align's outputs and the slots' ranks: no wait needed).
    struct Meta {
      int tile, group, rank, pair, valid, c_begin, c_end, rank_steps;
    };
    auto meta_of = [&](int w) {
      Meta m;
      int piece;
      stream_item_coords(p, w, tiles, m.tile, piece);
      m.group = p.tile_group[m.tile];
      m.rank = p.rank[m.group / p.experts];
      m.pair = lane < kBlockM ? p.sorted_pairs[m.tile * kBlockM + lane] : p.pairs;
      m.valid = __popc(__ballot_sync(~0u, m.pair != p.pairs));
      const bool skip = m.rank == 0 && !p.overwrite;  // nothing to add; overwrite still writes zeros
      m.c_begin = piece * p.chunks_per_piece;
      m.c_end = skip ? m.c_begin : min(m.c_begin + p.chunks_per_piece, chunks);
      m.rank_steps = (m.rank + 15) / 16;
      return m;
    };
    const bool whole_rank = stride == capacity;
    auto chunk_rows = [&](int c) { return min(kBlockN, p.out - c * kBlockN); };
    // Chunk c of item m into stage `stage`: the expected bytes (B and y), then B's copies.
    auto expect_and_copy_b = [&](const Meta& m, int c, int stage) {
      const bool whole_chunk = whole_rank && m.rank_steps * 16 == capacity;
      const unsigned row_b_bytes = unsigned(min(m.rank_steps * 16, capacity)) * 2;
      const int rows = chunk_rows(c);
      const unsigned b_bytes = m.rank_steps == 0 ? 0u : whole_chunk ? unsigned(rows * capacity * 2) : unsigned(rows) * row_b_bytes;
      const unsigned y_bytes = p.overwrite ? 0u : unsigned(m.valid * rows * 2);
      if (lane == 0) detail::mbarrier_arrive_expect_tx(&smem.full[stage], b_bytes + y_bytes);
      __syncwarp();
      if (m.rank_steps == 0) return;
      ExpandBulkStage<kRankCap, kBlockN>& s = smem.stages[stage];
      const __nv_bfloat16* src = p.b + (int64_t(m.group) * p.out + int64_t(c) * kBlockN) * capacity;
      if (whole_chunk) {
        if (lane == 0) detail::bulk_copy(detail::shared_address(s.b), src, b_bytes, &smem.full[stage]);
      } else {
        for (int n = lane; n < rows; n += 32) {
          detail::bulk_copy(detail::shared_address(s.b + n * stride), src + int64_t(n) * capacity, row_b_bytes,
                            &smem.full[stage]);
        }
      }
    };
    auto copy_y = [&](const Meta& m, int c, int stage) {
      if (p.overwrite || lane >= m.valid) return;
      detail::bulk_copy(detail::shared_address(&smem.stages[stage].y[lane][0]),
                        p.y + int64_t(m.pair) * p.out + int64_t(c) * kBlockN, unsigned(chunk_rows(c) * 2),
                        &smem.full[stage]);
    };

    int w = take_item(0);
    Meta m = w < total ? meta_of(w) : Meta{};
    int prefetched = 0;  // the first item's chunks whose B went out before the wait
    if (w < total) {
      for (int c = m.c_begin; c < m.c_end && prefetched < kExpandStages; ++c, ++prefetched) {
        expect_and_copy_b(m, c, prefetched);
      }
    }
    pdl_wait();  // z is the shrink's output; y may be its predecessor's
    int q = 0;   // chunks issued, over all items
    for (int k = 0;; ++k) {
      if (k > 0) {
        w = take_item(k);
        if (w < total) m = meta_of(w);
      }
      const int slot = k % 2;
      if (k >= 2) detail::mbarrier_wait(&smem.item_empty[slot], unsigned(k / 2 - 1) & 1u);
      StreamItem<kRankCap>& item = smem.items[slot];
      if (w >= total) {  // no more items: tell the consumers, then count this CTA out
        if (lane == 0) {
          item.tile = -1;
          detail::mbarrier_arrive(&smem.item_full[slot]);
          if (p.work != nullptr && atomicAdd(&p.work[1], 1) == int(gridDim.x) - 1) {
            p.work[0] = 0;  // every CTA has taken its last item: no atomic on work[0] follows in this launch
            p.work[1] = 0;
          }
        }
        break;
      }
      if (lane < kBlockM) item.pairs[lane] = m.pair;
      if (lane == 0) {
        item.tile = m.tile;
        item.rank = m.rank;
        item.c_begin = m.c_begin;
        item.c_end = m.c_end;
        item.valid = m.valid;
      }
      __syncwarp();  // the item's fields before the arrival that publishes them
      const unsigned z_row = unsigned(min(m.rank_steps * 16, capacity)) * 4;
      const bool copy_z = m.c_end > m.c_begin && m.rank_steps > 0;
      if (lane == 0) detail::mbarrier_arrive_expect_tx(&smem.item_full[slot], copy_z ? unsigned(m.valid) * z_row : 0u);
      __syncwarp();
      if (copy_z && lane < m.valid) {
        detail::bulk_copy(detail::shared_address(&item.z[lane][0]), p.z + int64_t(m.pair) * capacity, z_row,
                          &smem.item_full[slot]);
      }
      // The item's chunks into the ring (the first item's first ones have their B in flight already).
      for (int c = m.c_begin; c < m.c_end; ++c, ++q) {
        const int stage = q % kExpandStages;
        if (k == 0 && q < prefetched) {
          copy_y(m, c, stage);
          continue;
        }
        if (q >= kExpandStages) detail::mbarrier_wait(&smem.empty[stage], unsigned(q / kExpandStages - 1) & 1u);
        expect_and_copy_b(m, c, stage);
        copy_y(m, c, stage);
      }
    }
    return;
  }

  // ---- consumers (warps 0-3) ----
  const int g = lane / 4;
  int q = 0;  // chunks consumed, over all items
  for (int k = 0;; ++k) {
    const int slot = k % 2;
    detail::mbarrier_wait(&smem.item_full[slot], unsigned(k / 2) & 1u);
    const StreamItem<kRankCap>& item = smem.items[slot];
    if (item.tile < 0) break;  // the producer ran out of items
    const int rank = item.rank, valid = item.valid, c_begin = item.c_begin, c_end = item.c_end;
    const int rank_steps = (rank + 15) / 16;
    unsigned z_hi[kRankSteps][4], z_lo[kRankSteps][4];
    expand_z_fragments<kRankCap>(item.z, rank_steps, z_hi, z_lo, rank);
    // Self-cleaning: the arrival once the item's z has landed (its bulk copies read global z); the tile's last
    // reader zeroes the rows after the item.
    int last_reader = 0;
    if (p.tile_counters != nullptr && c_end > c_begin && warp == kWarps - 1) {
      if (lane == 0) last_reader = detail::count_reader(&p.tile_counters[item.tile]) == p.pieces - 1;
      last_reader = __shfl_sync(~0u, last_reader, 0);
    }
    __nv_bfloat16* y_row[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int m = g + 8 * half;
      y_row[half] = m < valid ? p.y + int64_t(item.pairs[m]) * p.out : nullptr;
    }
    const bool mask_last = rank % 16 != 0;
    for (int c = c_begin; c < c_end; ++c, ++q) {
      const int stage = q % kExpandStages;
      expand_bulk_chunk<kRankCap, kBlockN>(p, smem.stages[stage], &smem.full[stage], &smem.empty[stage],
                                           unsigned(q / kExpandStages) & 1u, c, stride, z_hi, z_lo, rank_steps, rank,
                                           mask_last, y_row);
    }
    if (last_reader) {  // warp 3: z rows of this tile back to zero (every reader has counted)
      for (int i = lane; i < kBlockM * kRankCap; i += 32) {
        const int m = i / kRankCap, r = i % kRankCap;
        if (m < valid && r < rank) p.z[int64_t(item.pairs[m]) * capacity + r] = 0.0f;
      }
      if (lane == 0) p.tile_counters[item.tile] = 0;
    }
    __syncwarp();  // the warp is done with the item (z fragments, pairs)
    if (lane == 0) detail::mbarrier_arrive(&smem.item_empty[slot]);
  }
}

// ---- launchers ----------------------------------------------------------------------------------------

struct Checked {
  LoraKernelParams params;
  int max_tiles;
};

// Shapes, dtypes, devices and alignment of one call, named in the message; the kernel params.
Checked check_and_pack(const MoeLoraParams& p, const char* op) {
  const ops::LoraStack& w = p.w;
  detail::require_cuda(op, {{"x", &p.x}, {"w.a", &w.a}, {"w.b", &w.b}, {"w.rank", &w.rank},
                            {"sorted_pairs", &p.sorted_pairs}, {"tile_group", &p.tile_group},
                            {"num_tiles", &p.num_tiles}, {"z", &p.z}, {"y", &p.y}});
  if (w.a.dtype != DType::BF16 || w.a.ndim != 4) detail::contract_failure(op, "w.a", w.a, "[S, E, R, in] BF16");
  const int64_t slots = w.a.dim(0), experts = w.a.dim(1), capacity_rank = w.a.dim(2), in = w.a.dim(3);
  if (w.b.dtype != DType::BF16 || w.b.ndim != 4 || w.b.dim(0) != slots || w.b.dim(1) != experts ||
      w.b.dim(3) != capacity_rank) {
    detail::contract_failure(op, "w.b", w.b, "[S, E, out, R] BF16 matching w.a");
  }
  const int64_t out = w.b.dim(2);
  if (w.rank.dtype != DType::I32 || w.rank.numel() != slots) detail::contract_failure(op, "w.rank", w.rank, "[S] I32");
  if (capacity_rank % 8 != 0 || capacity_rank > kMaxRank || capacity_rank < 8) {
    detail::contract_failure(op, "w.a", w.a, "R a multiple of 8 in [8, 128]");
  }
  if (in % 8 != 0 || !detail::aligned16(w.a.data)) detail::contract_failure(op, "w.a", w.a, "in % 8 == 0, 16-byte aligned");
  if (out % 2 != 0 || !detail::aligned16(w.b.data)) detail::contract_failure(op, "w.b", w.b, "out % 2 == 0, 16-byte aligned");
  if (p.top_k < 1) detail::contract_failure(op, "z", p.z, "top_k >= 1");
  if (p.z.dtype != DType::F32 || p.z.ndim != 2 || p.z.dim(1) != capacity_rank || p.z.dim(0) % p.top_k != 0) {
    detail::contract_failure(op, "z", p.z, "[T*K, R] F32");
  }
  const int64_t pairs = p.z.dim(0), tokens = pairs / p.top_k;
  const bool by_rows = p.x_rows.defined();
  if (p.x.dtype != DType::BF16 || p.x.ndim != 2 || p.x.dim(1) != in ||
      (!by_rows && p.x.dim(0) != tokens && p.x.dim(0) != pairs) || !detail::aligned16(p.x.data)) {
    detail::contract_failure(op, "x", p.x,
                             by_rows ? "[rows, in] BF16 (rows picked by x_rows), 16-byte aligned, in = w.a.dim(3)"
                                     : "[T, in] or [T*K, in] BF16, 16-byte aligned, in = w.a.dim(3)");
  }
  if (by_rows) {
    detail::require_cuda(op, {{"x_rows", &p.x_rows}});
    if (p.x_rows.dtype != DType::I32 || p.x_rows.ndim != 1 || p.x_rows.dim(0) != pairs) {
      detail::contract_failure(op, "x_rows", p.x_rows, ("[" + std::to_string(pairs) + "] I32 (T*K)").c_str());
    }
  }
  if (p.y.dtype != DType::BF16 || p.y.ndim != 2 || p.y.dim(0) != pairs || p.y.dim(1) != out ||
      (reinterpret_cast<uintptr_t>(p.y.data) & 3u) != 0) {
    detail::contract_failure(op, "y", p.y, "[T*K, out] BF16, 4-byte aligned, out = w.b.dim(2)");
  }
  if (p.block_m != kBlockM) detail::contract_failure(op, "sorted_pairs", p.sorted_pairs, "moe_align with block_m 16");
  const int64_t max_tiles = p.tile_group.numel();
  if (p.tile_group.dtype != DType::I32 || p.sorted_pairs.dtype != DType::I32 ||
      p.sorted_pairs.numel() < max_tiles * kBlockM || p.num_tiles.dtype != DType::I32) {
    detail::contract_failure(op, "sorted_pairs", p.sorted_pairs, "moe_align's I32 outputs (tile_group, num_tiles)");
  }
  if (p.tile_counters.defined()) {
    detail::require_cuda(op, {{"tile_counters", &p.tile_counters}});
    if (p.tile_counters.dtype != DType::I32 || p.tile_counters.numel() < max_tiles) {
      detail::contract_failure(op, "tile_counters", p.tile_counters,
                               ("I32 with >= tile_group.numel() = " + std::to_string(max_tiles) + " elements").c_str());
    }
  }
  const MoeLoraConfig& config = p.config;
  if (config.expand_block_n != 64 && config.expand_block_n != 128) {
    detail::contract_failure(op, "config.expand_block_n", p.y,
                             ("64 or 128, found " + std::to_string(config.expand_block_n)).c_str());
  }
  if (config.shrink_tiles_per_cta != 0 && config.shrink_tiles_per_cta != 1 &&
      config.shrink_tiles_per_cta != kRunTiles) {
    detail::contract_failure(op, "config.shrink_tiles_per_cta", p.x,
                             ("0 (auto), 1 or " + std::to_string(kRunTiles) + ", found " +
                              std::to_string(config.shrink_tiles_per_cta)).c_str());
  }
  if (config.expand_chunks < 0) {
    detail::contract_failure(op, "config.expand_chunks", p.y,
                             (">= 0 (0 = by batch size), found " + std::to_string(config.expand_chunks)).c_str());
  }
  if (config.order != MoeLoraCtaOrder::kTileFastest && config.order != MoeLoraCtaOrder::kPieceFastest) {
    detail::contract_failure(op, "config.order", p.y, "kTileFastest or kPieceFastest");
  }
  LMX_CHECK(pairs < 0x7fffffff && max_tiles < 0x7fffffff && slots * experts < 0x7fffffff);
  const LoraKernelParams params{
      .x = static_cast<const __nv_bfloat16*>(p.x.data),
      .a = static_cast<const __nv_bfloat16*>(w.a.data),
      .b = static_cast<const __nv_bfloat16*>(w.b.data),
      .rank = static_cast<const int32_t*>(w.rank.data),
      .sorted_pairs = static_cast<const int32_t*>(p.sorted_pairs.data),
      .tile_group = static_cast<const int32_t*>(p.tile_group.data),
      .num_tiles = static_cast<const int32_t*>(p.num_tiles.data),
      .z = static_cast<float*>(p.z.data),
      .y = static_cast<__nv_bfloat16*>(p.y.data),
      .tile_counters = p.tile_counters.defined() ? static_cast<int32_t*>(p.tile_counters.data) : nullptr,
      .work = p.tile_counters.defined() && p.tile_counters.numel() >= max_tiles + kMoeLoraWorkCounters
                  ? static_cast<int32_t*>(p.tile_counters.data) + max_tiles
                  : nullptr,
      .pairs = int(pairs),
      .top_k = int(p.top_k),
      .x_per_pair = p.x.dim(0) == pairs,
      .x_rows = by_rows ? static_cast<const int32_t*>(p.x_rows.data) : nullptr,
      .y_vector = out % 8 == 0 && detail::aligned16(p.y.data),
      .experts = int(experts),
      .in = int(in),
      .out = int(out),
      .capacity_rank = int(capacity_rank),
      .max_tiles = int(max_tiles),
      .pieces = 1,
      .piece_fastest = config.order == MoeLoraCtaOrder::kPieceFastest,
      .chunks_per_piece = 1,
      .overwrite = p.overwrite};
  return {params, int(max_tiles)};
}

unsigned grid_of(const Checked& c) {
  const int64_t ctas = int64_t(c.max_tiles) * c.params.pieces;
  LMX_CHECK(ctas < 0x7fffffff, "moe_lora: %lld CTAs", (long long)ctas);
  return unsigned(ctas);
}

}  // namespace

namespace {

// Tiles per shrink CTA when config.shrink_tiles_per_cta is 0: runs of kRunTiles once the (slot, expert)
// groups hold kRunTiles or more tiles on average (the per-tile kernel's A re-reads then dominate). At two
// tiles a group the runs were slower (perf-log run 36, GPT-OSS-20B T 2048: gate_up 55.1 vs 34.3 µs per
// tile, down 47.8 vs 35.6); at four they break even (T 4096: gate_up 73.3 vs 67.0, down 61.7 vs 69.0).
int auto_shrink_tiles(int64_t pairs, int64_t groups) {
  return pairs >= kRunTiles * kBlockM * std::max<int64_t>(1, std::min(pairs, groups)) ? kRunTiles : 1;
}

int auto_split_for(int64_t pairs, int64_t groups, int64_t in, int tiles_per_cta) {
  // Expected working CTAs per piece: one tile per touched group plus one per BLOCK_M pairs (per-tile
  // mode), or one run per touched group plus one per kRunTiles tiles (run mode); aim for ~4 CTAs of 128
  // threads per SM on 132 SMs (decode batches need many loads in flight), each piece >= one 64-input chunk.
  const int64_t touched = std::min(pairs, groups);
  const int64_t ctas = std::max<int64_t>(1, tiles_per_cta == 1 ? touched + pairs / kBlockM
                                                                : touched + pairs / (kBlockM * kRunTiles));
  const int64_t max_split = std::max<int64_t>(1, (in + kChunk - 1) / kChunk);
  return int(std::clamp<int64_t>((4 * kSms + ctas - 1) / ctas, 1, max_split));
}

}  // namespace

int moe_lora_run_tiles() { return kRunTiles; }

int moe_lora_run_split(int64_t pairs, int64_t experts) {
  const int64_t ctas = std::max<int64_t>(1, pairs / (kBlockM * kRunTiles) + experts);
  return int(std::clamp<int64_t>((4 * kSms + ctas - 1) / ctas, 1, 16));  // moe_lora_shrink clamps to the chunks
}

int moe_lora_auto_split(int64_t pairs, int64_t groups, int64_t in) {
  return auto_split_for(pairs, groups, in, auto_shrink_tiles(pairs, groups));
}

int moe_lora_auto_expand_chunks(int64_t max_tiles, int64_t chunks, bool persistent) {
  // The persistent expand pays no per-CTA prologue for a piece, only the item's z: long pieces won at both sizes
  // measured (H100, GPT-OSS-20B N 64, chunks 16 against this rule's 7 / 23: T 256 gate_up 46.0 vs 48.7 µs, down
  // 25.1 vs 27.6; T 4096 gate_up 229.7 vs 236.6, down 122.1 vs 119.1; perf-log run 232).
  if (persistent) return int(std::min<int64_t>(kPersistentPieceChunks, std::max<int64_t>(chunks, 1)));
  // Otherwise: enough CTAs for ~8 waves of 4 resident CTAs per SM (tail under ~1/8), but as few pieces as that
  // allows: each piece re-reads z, pays one arrival and fills the ring once.
  const int64_t target = int64_t(kSms) * 4 * 8;
  const int64_t pieces = std::clamp<int64_t>((target + max_tiles - 1) / std::max<int64_t>(max_tiles, 1), 1,
                                             std::max<int64_t>(chunks, 1));
  return int((chunks + pieces - 1) / pieces);
}

void moe_lora_shrink(const MoeLoraParams& p, cudaStream_t stream) {
  if (!p.w.defined()) return;  // no resident adapter targets these experts: nothing is launched
  Checked c = check_and_pack(p, "moe_lora_shrink");
  // out == 0: the expand launches nothing, so nothing would clean z (and y gets no term anyway).
  if (c.max_tiles == 0 || c.params.pairs == 0 || c.params.out == 0) return;
  const int64_t groups = p.w.a.dim(0) * p.w.a.dim(1);
  const int tiles_per_cta = p.config.shrink_tiles_per_cta != 0 ? p.config.shrink_tiles_per_cta
                                                                : auto_shrink_tiles(c.params.pairs, groups);
  const int requested = p.split_k != 0 ? p.split_k : p.config.split_k;
  int split = requested > 0 ? requested : auto_split_for(c.params.pairs, groups, c.params.in, tiles_per_cta);
  const int chunks = (c.params.in + kChunk - 1) / kChunk;
  split = std::clamp(split, 1, std::max(1, chunks));
  // Pieces of whole chunks: drop splits that would be empty.
  split = (chunks + (chunks + split - 1) / split - 1) / ((chunks + split - 1) / split);
  c.params.pieces = split;
  if (split > 1 && c.params.tile_counters == nullptr) {
    LMX_CUDA_CHECK(cudaMemsetAsync(p.z.data, 0, p.z.nbytes(), stream));  // no self-cleaning invariant
  }
  const bool even_k = c.params.in % kChunk == 0;
  const int rank_cap = c.params.capacity_rank;
  if (tiles_per_cta == 1) {
    // Per-tile mode: the one dispatch on EVEN_K × rank cap (64, or 128 for R > 64, in dynamic shared memory).
    if (rank_cap <= 64) {
      if (even_k) shrink_kernel<true, 64><<<grid_of(c), kThreads, 0, stream>>>(c.params);
      else shrink_kernel<false, 64><<<grid_of(c), kThreads, 0, stream>>>(c.params);
    } else {
      static_assert(!shrink_shared_is_static<128>());
      auto tile = [&](auto kernel) {
        constexpr size_t shared_bytes = sizeof(ShrinkShared<128>);
        LMX_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared_bytes)));
        kernel<<<grid_of(c), kThreads, shared_bytes, stream>>>(c.params);
      };
      if (even_k) tile(shrink_kernel<true, 128>);
      else tile(shrink_kernel<false, 128>);
    }
    LMX_CUDA_CHECK_LAUNCH();
    return;
  }
  auto run = [&](auto kernel, size_t stage_bytes) {
    const size_t shared_bytes = size_t(kStages) * stage_bytes;
    LMX_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared_bytes)));
    kernel<<<grid_of(c), kThreads, shared_bytes, stream>>>(c.params);
  };
  // Run mode: the one dispatch on EVEN_K × rank tier (capacity R rounded up to 16 / 32 / 64 / 128).
  auto tier = [&](auto cap) {
    constexpr int kCap = decltype(cap)::value;
    constexpr size_t kStageBytes = sizeof(ShrinkRunStage<kCap>);
    if (even_k) run(shrink_run_kernel<true, kCap>, kStageBytes);
    else run(shrink_run_kernel<false, kCap>, kStageBytes);
  };
  if (rank_cap <= 16) tier(std::integral_constant<int, 16>{});
  else if (rank_cap <= 32) tier(std::integral_constant<int, 32>{});
  else if (rank_cap <= 64) tier(std::integral_constant<int, 64>{});
  else tier(std::integral_constant<int, 128>{});
  LMX_CUDA_CHECK_LAUNCH();
}

// The expand of rank tier kCap at kBlockN: persistent (bulk copies, a producer warp), by bulk copies, or by
// cp.async.
template <int kCap, int kBlockN, typename Run>
void run_expand_tier(Run&& run, bool bulk, bool persistent) {
  if (persistent) run(expand_stream_kernel<kCap, kBlockN>, sizeof(ExpandStreamShared<kCap, kBlockN>));
  else if (bulk) run(expand_bulk_kernel<kCap, kBlockN>, sizeof(ExpandBulkShared<kCap, kBlockN>));
  else run(expand_kernel<kCap, kBlockN>, sizeof(ExpandShared<kCap, kBlockN>));
}

void moe_lora_expand(const MoeLoraParams& p, cudaStream_t stream) {
  if (!p.w.defined()) return;
  Checked c = check_and_pack(p, "moe_lora_expand");
  if (c.max_tiles == 0 || c.params.pairs == 0 || c.params.out == 0) return;
  const int block_n = p.config.expand_block_n;
  const int chunks = (c.params.out + block_n - 1) / block_n;
  const bool bulk = p.config.expand_bulk && c.params.y_vector;  // bulk copies need 16-byte y rows
  const bool persistent = bulk && p.config.expand_persistent;
  int per_piece = p.config.expand_chunks > 0 ? p.config.expand_chunks
                                             : moe_lora_auto_expand_chunks(c.max_tiles, chunks, persistent);
  per_piece = std::clamp(per_piece, 1, chunks);
  c.params.chunks_per_piece = per_piece;
  c.params.pieces = (chunks + per_piece - 1) / per_piece;  // every piece holds at least one chunk
  cudaLaunchConfig_t launch = {};
  launch.gridDim = dim3(grid_of(c));
  launch.blockDim = dim3(kThreads);
  launch.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  launch.attrs = attribute;
  launch.numAttrs = p.config.pdl ? 1 : 0;
  auto run = [&](auto kernel, size_t shared_bytes) {
    LMX_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared_bytes)));
    launch.dynamicSmemBytes = shared_bytes;
    if (persistent) {  // as many CTAs as are resident at once, each walking items (never more than the items)
      // Once per kernel (each instantiation of this lambda has its own static): not a query every launch.
      static const int per_sm = [&] {
        int n = 0;
        LMX_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kStreamThreads, shared_bytes));
        return n;
      }();
      launch.blockDim = dim3(kStreamThreads);
      launch.gridDim =
          dim3(unsigned(std::clamp<int64_t>(int64_t(std::max(per_sm, 1)) * multiprocessor_count(), 1, grid_of(c))));
    }
    LMX_CUDA_CHECK(cudaLaunchKernelEx(&launch, kernel, c.params));
  };
  // The one dispatch on the tile config: rank tier (the capacity R rounded up to 16 / 32 / 64 / 128) × BLOCK_N.
  // Tier 128 stages 2× the B bytes per chunk of tier 64: 126 KB at BLOCK_N 128 (one CTA per SM), 68 KB at 64.
  const int rank_cap = c.params.capacity_rank;
  if (rank_cap <= 16) {
    if (block_n == 128) run_expand_tier<16, 128>(run, bulk, persistent);
    else run_expand_tier<16, 64>(run, bulk, persistent);
  } else if (rank_cap <= 32) {
    if (block_n == 128) run_expand_tier<32, 128>(run, bulk, persistent);
    else run_expand_tier<32, 64>(run, bulk, persistent);
  } else if (rank_cap <= 64) {
    if (block_n == 128) run_expand_tier<64, 128>(run, bulk, persistent);
    else run_expand_tier<64, 64>(run, bulk, persistent);
  } else {
    if (block_n == 128) run_expand_tier<128, 128>(run, bulk, persistent);
    else run_expand_tier<128, 64>(run, bulk, persistent);
  }
  LMX_CUDA_CHECK_LAUNCH();
}

}  // namespace lmx::cuda
