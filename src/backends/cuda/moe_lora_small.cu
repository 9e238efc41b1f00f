// The direct per-pair MoE-LoRA for tiny batches (moe_lora_small.cuh) and its launchers. No align: each CTA
// reads its pair's slot and expert itself. Latency-bound at decode sizes, so the shape is "every load of a
// CTA in flight at once, then the math": CUDA-core fp32 FMAs on 16-byte bf16 loads, no tensor cores.
//  shrink: CTA = (pair, piece of 32·V vectors of `in`, V = 1, 2 or 4); warp w owns rank rows w, w+8, ...
//    (R/8 rows); lane = V 16-byte vectors of x and of each of its A rows; warp reduction per row, relaxed
//    fp32 atomicAdd into z (z is zero between calls). Routing, rank and A are loaded before the programmatic
//    wait, x after it (before it with x_before_wait); only the atomics into z always follow the wait.
//  expand: CTA = (pair, chunk of `out` rows); a B row is read by rank/8 adjacent lanes (the pair's true
//    rank, rounded up to a power of two lanes, R/8 at most; one 16-byte vector each), reduced by shuffles;
//    the grid is sized for R, and a pair of smaller rank covers its rows with the first chunks (ExpandLanes);
//    B and y are loaded before the programmatic wait on the shrink, z after it; the last CTA of a pair
//    re-zeroes z[pair].
//  groups (q, k, v of one layer): one shrink and one expand launch for up to 3 targets that share x and
//    routing; the shrink takes the target from blockIdx.y, the expand lays each pair's chunks of every
//    target side by side (SmallGridParams). Only the launch count changes, not the per-CTA work.
//  fused: both in one launch; a CTA's role (shrink piece or expand chunk) comes from an atomic ticket, and
//    an expand CTA spins on its pair's count of finished shrink pieces (measured against shrink + expand).
// PDL chain (design.md §6): every CTA of both kernels executes griddepcontrol.wait before it exits, and each
// kernel triggers its dependents only after its own wait returned. So when a kernel starts, everything
// written two launches back is complete: the shrink reads routing, rank and A before its wait (the caller
// keeps them out of the kernel just before it, PRECOND in the header), the expand routing, B and y (written
// before the shrink); only x (shrink) and z (expand) need the wait. PRECOND for the caller: a kernel before
// the shrink that was itself launched with PDL executes griddepcontrol.wait in every CTA (else "complete"
// does not chain).
#include "backends/cuda/moe_lora_small.cuh"

#include <cuda_bf16.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "backends/cuda/check.h"
#include "backends/cuda/device.cuh"

namespace lmx::cuda {
namespace {

using detail::kBf16PerVector;
constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;          // shrink always; expand at most
constexpr int kMaxRank = 128;                  // R limit, same as the tiled path (they share z)
// R <= 64 dispatches on R / 8 exactly; R in (64, 128] (a merged MoE gate_up) on one cap-128 instantiation
// (16 A rows per warp, 16 lanes per B row) whose rows past R are clamped loads and skipped math.
constexpr int kRowsPerWarpCap128 = 128 / kWarps;
constexpr int kSmCount = 132;                  // H200; only sizes the launch shapes (a hint, not a limit)
constexpr int kOneWaveCtas = 8 * kSmCount;     // 256-thread CTAs resident at once at full occupancy
int knockout_mask = 0;                         // set_small_lora_knockout (a timing diagnostic; 0: off)

// ---- device helpers -----------------------------------------------------------------------------------

// griddepcontrol (sm_90): both are no-ops in a grid launched without the programmatic attribute.
__device__ __forceinline__ void wait_for_previous_grid() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void allow_next_grid() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// A gpu-scope acquire load: the fused kernel's spin on another CTA's release (fence + atomicAdd).
__device__ __forceinline__ int load_acquire(const int32_t* p) {
  int32_t value;
  asm volatile("ld.acquire.gpu.b32 %0, [%1];" : "=r"(value) : "l"(p) : "memory");
  return value;
}

__device__ __forceinline__ uint4 load_vector(const __nv_bfloat16* p) { return *reinterpret_cast<const uint4*>(p); }

using detail::widen8;

// ---- kernels ------------------------------------------------------------------------------------------

struct SmallKernelParams {
  const __nv_bfloat16* x;     // [T or T*K, in] bf16
  const int32_t* topk_ids;    // [T, K] i32
  const int32_t* token_slot;  // [T] i32
  const __nv_bfloat16* a;     // [S, E, R, in] bf16
  const __nv_bfloat16* b;     // [S, E, out, R] bf16
  const int32_t* rank;        // [S] i32
  float* z;                   // [T*K, R] f32, zero between calls
  int32_t* z_readers;         // [T*K + 1] i32, zero between calls
  __nv_bfloat16* y;           // [T*K, out] bf16
  const __nv_bfloat16* base;  // epilogue: [T*K, base_stride] bf16 at the part's first column, or null
  const __nv_bfloat16* bias;  // epilogue: [out] bf16 at the part's first column, or null
  int base_stride;            // base's row length N
  float* delta;               // [T*K, out] f32 or null (MoeLoraSmallParams::delta): the term alone, y untouched
  int top_k;                  // K
  int experts;                // E
  int in;
  int out;
  int capacity_rank;          // R
  bool x_per_pair;            // x has T*K rows
  bool x_before_wait;         // the shrink may read x before its programmatic wait
  int pieces;                 // shrink: CTAs per pair along `in`
  int chunks;                 // expand: CTAs per pair along `out`
};

// What one launch gets: the params of each target of a group (moe_lora_small.cuh; one target outside a
// group), identical in x, routing, in, R and pieces. The shrink grid is (pairs · pieces, targets); the
// expand runs a pair's CTAs of every target side by side: blockIdx.x = pair · chunk_begin[kMax] + c, and
// c in [chunk_begin[t], chunk_begin[t + 1]) serves target t (unused targets: empty ranges at the end).
struct SmallGridParams {
  SmallKernelParams target[kMoeLoraSmallMaxTargets];
  int chunk_begin[kMoeLoraSmallMaxTargets + 1];
};

// The pair's adapter: slot, true rank (0 when the token has no adapter, slot -1, or a rank-0 slot) and expert.
// The expert id is loaded together with the slot (independent), so the chain to the A/B address is two
// round trips (slot, then rank), not three.
struct PairAdapter {
  int slot;
  int rank;
  int expert;
};
__device__ __forceinline__ PairAdapter pair_adapter(const SmallKernelParams& p, int pair) {
  const int expert = p.topk_ids[pair];
  const int slot = p.token_slot[pair / p.top_k];
  return {slot, slot < 0 ? 0 : p.rank[slot], expert};
}

// One shrink piece: z[pair, :rank] += A[s,e][:rank, piece]·x[row, piece], the piece being 32·V·kFold vectors
// of `in` (V = kVectorsPerLane); lane l takes vectors (piece·kFold + g)·32V + 32i + l, i < V, g < kFold. Warp w
// owns rows w, w + 8, ...: kRowsPerWarp of them at kFold 1. kFold 2 is for a pair whose true rank needs at
// most half the rows (ShrinkFold): the registers of the upper half of the rows hold the piece's second run of
// vectors instead, so a CTA covers twice the `in` and the pair needs half the pieces. Split in three so the A
// loads (weights and routing, complete before the previous kernel triggered us) can be issued before the
// programmatic wait and the x loads (x may come from the kernel just before) after it, unless the caller
// vouches otherwise.
// PRECOND: blockDim.x == kThreads; in % 8 == 0; x, a 16-byte aligned; R == 8 * kRowsPerWarp, or R in (64, 128]
// with kRowsPerWarp == kRowsPerWarpCap128 (rows past R clamp like rows past the true rank); rank in [1, R],
// at most 8 * kRowsPerWarp / kFold; kRowsPerWarp % kFold == 0; topk_ids in [0, E).
template <int kRowsPerWarp, int kVectorsPerLane, int kFold = 1>
struct ShrinkPiece {
  static constexpr int kRows = kRowsPerWarp / kFold;    // rows of the warp this piece computes
  static constexpr int kRuns = kVectorsPerLane * kFold;  // vectors of `in` per lane
  uint4 a_raw[kRowsPerWarp][kVectorsPerLane];  // this lane's vectors of its warp's A rows: [g·kRows + j][i]
  uint4 x_raw[kRuns];                           // and of x: [g·V + i]
  int vector[kRuns];                            // the vectors of `in` they sit at (clamped)
  bool in_range[kRuns];                         // false: past the end of `in`, contributes 0

  // Every A load before any math, none under a branch (docs/perf-log.md runs 2-3): rows past the true rank
  // re-read the last true row and vectors past `in` the last vector (same addresses, no DRAM traffic for
  // the padding); both are dropped in finish().
  __device__ __forceinline__ void load_a(const SmallKernelParams& p, int pair, int piece, PairAdapter adapter) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int vectors = p.in / kBf16PerVector;
    const __nv_bfloat16* a =  // [R, in] of (slot, expert)
        p.a + (int64_t(adapter.slot) * p.experts + adapter.expert) * p.capacity_rank * p.in;
#pragma unroll
    for (int v = 0; v < kRuns; ++v) {
      const int wanted = (piece * kRuns + v) * 32 + lane;
      in_range[v] = wanted < vectors;
      vector[v] = min(wanted, vectors - 1);
    }
#pragma unroll
    for (int j = 0; j < kRowsPerWarp; ++j) {
      const int g = j / kRows;
      const __nv_bfloat16* row = a + int64_t(min(warp + kWarps * (j % kRows), adapter.rank - 1)) * p.in;
#pragma unroll
      for (int i = 0; i < kVectorsPerLane; ++i) {
        a_raw[j][i] = load_vector(row + int64_t(vector[g * kVectorsPerLane + i]) * kBf16PerVector);
      }
    }
  }

  __device__ __forceinline__ void load_x(const SmallKernelParams& p, int pair) {
    const int64_t x_row = p.x_per_pair ? pair : pair / p.top_k;
#pragma unroll
    for (int v = 0; v < kRuns; ++v) x_raw[v] = load_vector(p.x + x_row * p.in + int64_t(vector[v]) * kBf16PerVector);
  }

  // The dot products, one warp reduction per row, relaxed fp32 atomics into z (zero before the call).
  __device__ __forceinline__ void finish(const SmallKernelParams& p, int pair, PairAdapter adapter) const {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float xv[kRuns][8];
#pragma unroll
    for (int v = 0; v < kRuns; ++v) {
      widen8(x_raw[v], xv[v]);
#pragma unroll
      for (int k = 0; k < 8; ++k) xv[v][k] = in_range[v] ? xv[v][k] : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < kRows; ++j) {
      const int row = warp + kWarps * j;
      if (row >= adapter.rank) break;  // warp-uniform: no math on padding ranks
      float sum = 0.0f;
#pragma unroll
      for (int g = 0; g < kFold; ++g) {
#pragma unroll
        for (int i = 0; i < kVectorsPerLane; ++i) {
          float av[8];
          widen8(a_raw[g * kRows + j][i], av);
#pragma unroll
          for (int k = 0; k < 8; ++k) sum = fmaf(av[k], xv[g * kVectorsPerLane + i][k], sum);
        }
      }
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
      if (lane == 0) atomicAdd(p.z + int64_t(pair) * p.capacity_rank + row, sum);
    }
  }
};

// The epilogue's value of y[pair, row] before the LoRA delta: base, with the bias rounded in on its own
// (SmallKernelParams::base; MoeLoraSmallParams::bias says why).
__device__ __forceinline__ float epilogue_value(const SmallKernelParams& p, int pair, int row) {
  const float value = __bfloat162float(p.base[int64_t(pair) * p.base_stride + row]);
  if (p.bias == nullptr) return value;
  return __bfloat162float(__float2bfloat16_rn(value + __bfloat162float(p.bias[row])));
}

// The epilogue of a pair without an adapter: y = base (+ bias) over the chunk's rows [first, first + count).
// PRECOND: p.base is set; called after the programmatic wait.
__device__ __forceinline__ void epilogue_copy(const SmallKernelParams& p, int pair, int first, int count) {
  for (int r = int(threadIdx.x); r < count && first + r < p.out; r += int(blockDim.x)) {
    p.y[int64_t(pair) * p.out + first + r] = __float2bfloat16_rn(epilogue_value(p, pair, first + r));
  }
}

// The expand's lane map for one pair. A B row needs `lanes` = the power of two >= rank / 8 lanes (one 16-byte
// vector of ranks each), at most kLanesPerRow (sized for the capacity R). When the pair's true rank needs
// fewer, each kLanesPerRow-lane group reads kLanesPerRow / lanes rows side by side, so a CTA covers that many
// times the rows and the pair needs fewer chunks: the launch is sized for R (one graph for any adapter mix),
// the chunks past `active_chunks` exit at once (a merged gate_up at capacity 64 with rank-32 adapters: half).
// Only for R > 32 (kRankAware); smaller capacities keep kLanesPerRow lanes a row.
template <int kLanesPerRow, int kVectorsPerThread>
struct ExpandLanes {
  // R <= 32 keeps the fixed map: a runtime one costs 2-6 registers over the 40 of 6 CTAs an SM (the allocator
  // rounds 42 to 48: 5 CTAs).
  static constexpr bool kRankAware = kLanesPerRow >= 8;
  int lane_shift;     // log2 of the lanes per B row for this pair's rank
  int rows_per_pass;  // rows the CTA covers per vector step
  int active_chunks;  // chunks of `out` this pair needs
  __device__ __forceinline__ ExpandLanes(const SmallKernelParams& p, int rank) {
    if constexpr (!kRankAware) {
      lane_shift = kLanesPerRow == 1 ? 0 : kLanesPerRow == 2 ? 1 : 2;
      rows_per_pass = int(blockDim.x) >> lane_shift;
      active_chunks = p.chunks;
    } else {
      lane_shift = 0;
      while ((1 << lane_shift) < kLanesPerRow && (8 << lane_shift) < rank) ++lane_shift;
      rows_per_pass = int(blockDim.x) >> lane_shift;
      const int rows_per_chunk = rows_per_pass * kVectorsPerThread;
      active_chunks = (p.out + rows_per_chunk - 1) / rows_per_chunk;
    }
  }
  __device__ __forceinline__ int lanes() const { return 1 << lane_shift; }
};

// One expand chunk: y[pair, rows of the chunk] += B[s,e][rows, :rank]·z[pair, :rank]. B and y are loaded
// first, then wait_for_z() (the PDL wait, or the fused kernel's spin on the pair's shrink count), then z.
// z_readers[pair] counts up from `readers_before`; the CTA whose count returns readers_before +
// active_chunks - 1 is the pair's last reader: it zeroes z[pair, :rank] and the count.
// PRECOND: blockDim.x a multiple of 32 in [64, 256]; rows per CTA (at kLanesPerRow lanes a row) = blockDim.x
// / kLanesPerRow * kVectorsPerThread; kLanesPerRow = the power of two >= R / 8; R % 8 == 0, R <= 128; b, z
// 16-byte aligned; rank in [1, R]; chunk < lanes.active_chunks; every active chunk's CTA reaches this call
// (it has a barrier).
// kDelta (SmallKernelParams::delta set; its own instantiation, so the in-place kernels keep their registers):
// the term alone into delta, y neither read nor written.
template <int kLanesPerRow, int kVectorsPerThread, bool kDelta = false, typename WaitForZ>
__device__ __forceinline__ void expand_chunk(const SmallKernelParams& p, int pair, int chunk, PairAdapter adapter,
                                             ExpandLanes<kLanesPerRow, kVectorsPerThread> map, int readers_before,
                                             WaitForZ wait_for_z) {
  const int rank = adapter.rank;
  const int rows_per_pass = map.rows_per_pass;
  const int q = int(threadIdx.x) & (map.lanes() - 1);  // this lane's ranks: 8q .. 8q+7
  const int q_read = 8 * q < rank ? q : 0;     // past the true rank: re-read the row's first vector (same
                                               // sector as lane 0, no extra traffic), contribute 0
  const int first_row = chunk * rows_per_pass * kVectorsPerThread + (int(threadIdx.x) >> map.lane_shift);
  const __nv_bfloat16* b = p.b + (int64_t(adapter.slot) * p.experts + adapter.expert) * p.out * p.capacity_rank +
                           q_read * kBf16PerVector;  // [out, R] of (slot, expert), at vector q_read
  __nv_bfloat16* y = p.y + int64_t(pair) * p.out;  // [out]

  // Before the wait: B (weights) and y (complete before the shrink triggered us), all unconditional. In the
  // epilogue (p.base) the old value is the product of the kernel just before: loaded after the wait.
  uint4 b_raw[kVectorsPerThread];
  float y_old[kVectorsPerThread];
#pragma unroll
  for (int i = 0; i < kVectorsPerThread; ++i) {
    const int row = min(first_row + i * rows_per_pass, p.out - 1);
    b_raw[i] = load_vector(b + int64_t(row) * p.capacity_rank);
    if (!kDelta && p.base == nullptr) y_old[i] = __bfloat162float(y[row]);
  }

  wait_for_z();
  if (!kDelta && p.base != nullptr) {
#pragma unroll
    for (int i = 0; i < kVectorsPerThread; ++i) {
      const int row = min(first_row + i * rows_per_pass, p.out - 1);
      y_old[i] = epilogue_value(p, pair, row);
    }
  }
  float* z = p.z + int64_t(pair) * p.capacity_rank;  // [R]
  constexpr int kStagedRank = kLanesPerRow <= 8 ? 64 : 8 * kLanesPerRow;  // 64 as before R 128, else 128
  __shared__ float4 z_staged[kStagedRank / 4];
  // __ldcg: z was written by atomics in L2 (in the fused kernel, during this grid): never serve it from L1.
  if (int(threadIdx.x) < p.capacity_rank / 4) z_staged[threadIdx.x] = __ldcg(reinterpret_cast<const float4*>(z) + threadIdx.x);
  __syncthreads();  // z sits in shared memory: its loads have returned before the CTA counts as a reader
  const float4 z_lo = z_staged[2 * q_read], z_hi = z_staged[2 * q_read + 1];
  const float zv[8] = {z_lo.x, z_lo.y, z_lo.z, z_lo.w, z_hi.x, z_hi.y, z_hi.z, z_hi.w};
  if (threadIdx.x == 0 && detail::count_reader(p.z_readers + pair) == readers_before + map.active_chunks - 1) {
    for (int r = 0; r < rank; r += 4) *reinterpret_cast<float4*>(z + r) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    p.z_readers[pair] = 0;
  }

#pragma unroll
  for (int i = 0; i < kVectorsPerThread; ++i) {
    float bv[8];
    widen8(b_raw[i], bv);
    float partial = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) {  // padding ranks of B and z may hold anything (0·NaN is NaN): select, not multiply
      partial = 8 * q + k < rank ? fmaf(bv[k], zv[k], partial) : partial;
    }
#pragma unroll
    for (int offset = kLanesPerRow / 2; offset > 0; offset /= 2) {  // within the row's lanes (CTA-uniform count)
      if (offset < map.lanes()) partial += __shfl_xor_sync(0xffffffffu, partial, offset);
    }
    const int row = first_row + i * rows_per_pass;
    if (q == 0 && row < p.out) {
      if constexpr (kDelta) {
        p.delta[int64_t(pair) * p.out + row] = partial;
      } else {
        y[row] = __float2bfloat16_rn(y_old[i] + partial);
      }
    }
  }
}

// Full occupancy (8 CTAs of 256 threads, <= 32 registers) where ptxas fits it without spilling (R <= 32,
// V = 1: 40 registers unbounded since x_before_wait): more shrink CTAs fit beside the previous kernel's tail.
constexpr int shrink_min_ctas(int rows_per_warp, int vectors_per_lane) {
  return vectors_per_lane == 1 && rows_per_warp <= 4 ? 8 : 1;
}

// The shrink kernel's body for one piece: A before the programmatic wait, x before or after it, then the math.
template <typename Piece>
__device__ __forceinline__ void shrink_piece(const SmallKernelParams& p, int pair, int piece, PairAdapter adapter) {
  Piece work;
  work.load_a(p, pair, piece, adapter);
  if (p.x_before_wait) work.load_x(p, pair);  // uniform branch; the caller vouches x is two launches back
  wait_for_previous_grid();  // x (by default) and z's zeroing may come from the kernels before
  allow_next_grid();         // only after the wait (see the file header)
  if (!p.x_before_wait) work.load_x(p, pair);
  work.finish(p, pair, adapter);
}

// Whether the shrink kernel of this shape has a folded form (ShrinkPiece kFold 2: half the pieces, each twice
// as long, for a pair whose true rank fits in half the warp's rows): an even row count, and a register budget
// with room for the second run of x (the full-occupancy shapes, held to 32 registers, would spill).
constexpr bool shrink_can_fold(int rows_per_warp, int vectors_per_lane) {
  return rows_per_warp % 2 == 0 && shrink_min_ctas(rows_per_warp, vectors_per_lane) == 1;
}

// PRECOND: blockDim.x == kThreads; gridDim.x == T*K * pieces, pieces = ceil(in / 8 / (32 V)); gridDim.y ==
// the group's targets; ShrinkPiece's; token_slot in [-1, S); z[pair, :rank] == 0; routing and w not
// written by the kernel just before (header).
template <int kRowsPerWarp, int kVectorsPerLane>
__global__ static void __launch_bounds__(kThreads, shrink_min_ctas(kRowsPerWarp, kVectorsPerLane))
    small_shrink_kernel(const __grid_constant__ SmallGridParams g) {
  const SmallKernelParams& p = g.target[blockIdx.y];  // a __grid_constant__ reference: no copy
  const int pair = blockIdx.x / p.pieces, piece = blockIdx.x % p.pieces;
  // Before the wait, during the previous kernel's tail: routing, rank and the A rows (three dependent
  // round trips at T = 1). Every CTA waits before it exits, so this grid never completes before the previous.
  const PairAdapter adapter = pair_adapter(p, pair);
  if (adapter.rank == 0) {
    wait_for_previous_grid();
    allow_next_grid();
    return;
  }
  if constexpr (shrink_can_fold(kRowsPerWarp, kVectorsPerLane)) {
    // The launch is sized for kFold 1 (one graph for any adapter mix); a folded pair's pieces past ceil(pieces
    // / 2) have nothing to do.
    if (adapter.rank <= kWarps * kRowsPerWarp / 2) {
      if (piece >= (p.pieces + 1) / 2) {
        wait_for_previous_grid();
        allow_next_grid();
        return;
      }
      shrink_piece<ShrinkPiece<kRowsPerWarp, kVectorsPerLane, 2>>(p, pair, piece, adapter);
      return;
    }
  }
  shrink_piece<ShrinkPiece<kRowsPerWarp, kVectorsPerLane>>(p, pair, piece, adapter);
}

// PRECOND: gridDim.x == T*K * g.chunk_begin[kMax], each target's chunks = ceil(out / rows per CTA at
// kLanesPerRow lanes a row) (SmallGridParams);
// expand_chunk's; launched right after the shrink of the same call (file header); z_readers[:T*K] == 0 on entry.
template <int kLanesPerRow, int kVectorsPerThread, bool kDelta>
__global__ static void __launch_bounds__(kThreads) small_expand_kernel(const __grid_constant__ SmallGridParams g) {
  const int per_pair = g.chunk_begin[kMoeLoraSmallMaxTargets];
  const int pair = blockIdx.x / per_pair, c = blockIdx.x % per_pair;
  int t = 0;
#pragma unroll
  for (int i = 1; i < kMoeLoraSmallMaxTargets; ++i) t += c >= g.chunk_begin[i];
  const SmallKernelParams& p = g.target[t];
  const int chunk = c - g.chunk_begin[t];
  const PairAdapter adapter = pair_adapter(p, pair);
  if (adapter.rank == 0) {
    wait_for_previous_grid();  // every CTA waits, so this grid never completes before the shrink
    allow_next_grid();
    const int rows_per_chunk = int(blockDim.x) / kLanesPerRow * kVectorsPerThread;
    if (p.base != nullptr) epilogue_copy(p, pair, chunk * rows_per_chunk, rows_per_chunk);  // no adapter: the copy
    return;
  }
  const ExpandLanes<kLanesPerRow, kVectorsPerThread> map(p, adapter.rank);
  if (map.kRankAware && chunk >= map.active_chunks) {  // the pair's rank needs fewer lanes a row: nothing to do
    wait_for_previous_grid();
    allow_next_grid();
    return;
  }
  expand_chunk<kLanesPerRow, kVectorsPerThread, kDelta>(p, pair, chunk, adapter, map, 0, [] {
    wait_for_previous_grid();  // the shrink's atomics into z are complete and visible
    allow_next_grid();         // a PDL successor still waits for this whole grid before it reads anything
  });
}

// Shrink and expand in one launch. A CTA's role comes from a ticket (z_readers[T*K], atomicAdd), not from
// blockIdx: tickets [0, T*K·pieces) are shrink pieces, the rest expand chunks. An expand CTA only waits for
// shrink CTAs that took their tickets before it, so they are resident and never wait: no deadlock whatever
// order the hardware schedules CTAs in. z_readers[pair] counts finished shrink pieces, then readers.
// PRECOND: blockDim.x == kThreads; gridDim.x == T*K * (pieces + chunks) with pieces for V = 1 and chunks for
// kThreads and kFusedVectorsPerThread; R as ShrinkPiece<kRowsPerWarp, 1>; z_readers[:T*K + 1] == 0 on entry;
// ShrinkPiece's and expand_chunk's.
constexpr int kFusedVectorsPerThread = 4;
// One target only (g.target[0]).
template <int kRowsPerWarp>
__global__ static void __launch_bounds__(kThreads) small_fused_kernel(const __grid_constant__ SmallGridParams g) {
  const SmallKernelParams& p = g.target[0];
  constexpr int kLanesPerRow =
      kRowsPerWarp <= 1 ? 1 : kRowsPerWarp <= 2 ? 2 : kRowsPerWarp <= 4 ? 4 : kRowsPerWarp <= 8 ? 8 : 16;
  wait_for_previous_grid();  // routing, x, y and the scratch's zeroing come from earlier kernels
  allow_next_grid();
  const int pairs = int(gridDim.x) / (p.pieces + p.chunks);
  int32_t* ticket_counter = p.z_readers + pairs;
  __shared__ int ticket_shared;
  if (threadIdx.x == 0) {
    const int ticket = atomicAdd(ticket_counter, 1);
    if (ticket == int(gridDim.x) - 1) *ticket_counter = 0;  // every ticket is taken: reset for the next call
    ticket_shared = ticket;
  }
  __syncthreads();
  const int ticket = ticket_shared;
  const int shrink_ctas = pairs * p.pieces;
  if (ticket < shrink_ctas) {
    const int pair = ticket / p.pieces;
    const PairAdapter adapter = pair_adapter(p, pair);
    if (adapter.rank == 0) return;
    ShrinkPiece<kRowsPerWarp, 1> work;
    work.load_a(p, pair, ticket % p.pieces, adapter);
    work.load_x(p, pair);
    work.finish(p, pair, adapter);
    __syncthreads();  // every warp's atomics into z issued before the piece counts as done
    if (threadIdx.x == 0) {
      __threadfence();
      atomicAdd(p.z_readers + pair, 1);
    }
    return;
  }
  const int pair = (ticket - shrink_ctas) / p.chunks, chunk = (ticket - shrink_ctas) % p.chunks;
  const PairAdapter adapter = pair_adapter(p, pair);
  if (adapter.rank == 0) return;
  const ExpandLanes<kLanesPerRow, kFusedVectorsPerThread> map(p, adapter.rank);
  if (map.kRankAware && chunk >= map.active_chunks) return;
  expand_chunk<kLanesPerRow, kFusedVectorsPerThread>(p, pair, chunk, adapter, map, p.pieces, [&] {
    if (threadIdx.x == 0) {
      while (load_acquire(p.z_readers + pair) < p.pieces) __nanosleep(32);
      __threadfence();
    }
    __syncthreads();
  });
}

// ---- launchers ----------------------------------------------------------------------------------------

// Shapes, dtypes, devices and alignment of one call, named in the message; the kernel params.
SmallKernelParams check_and_pack(const MoeLoraSmallParams& p, const char* op) {
  const ops::LoraStack& w = p.w;
  detail::require_cuda(op, {{"x", &p.x}, {"topk_ids", &p.topk_ids}, {"token_slot", &p.token_slot}, {"w.a", &w.a},
                            {"w.b", &w.b}, {"w.rank", &w.rank}, {"z", &p.z}, {"z_readers", &p.z_readers}, {"y", &p.y}});
  if (w.a.dtype != DType::BF16 || w.a.ndim != 4) detail::contract_failure(op, "w.a", w.a, "[S, E, R, in] BF16");
  const int64_t slots = w.a.dim(0), experts = w.a.dim(1), capacity_rank = w.a.dim(2), in = w.a.dim(3);
  if (w.b.dtype != DType::BF16 || w.b.ndim != 4 || w.b.dim(0) != slots || w.b.dim(1) != experts ||
      w.b.dim(3) != capacity_rank) {
    detail::contract_failure(op, "w.b", w.b, "[S, E, out, R] BF16 matching w.a");
  }
  const int64_t out = w.b.dim(2);
  if (w.rank.dtype != DType::I32 || w.rank.numel() != slots) detail::contract_failure(op, "w.rank", w.rank, "[S] I32");
  if (capacity_rank < 8 || capacity_rank % 8 != 0 || capacity_rank > kMaxRank) {
    detail::contract_failure(op, "w.a", w.a, "R a multiple of 8 in [8, 128]");
  }
  if (in < 8 || in % 8 != 0 || !detail::aligned16(w.a.data)) {
    detail::contract_failure(op, "w.a", w.a, "in a positive multiple of 8, 16-byte aligned");
  }
  if (out < 1 || !detail::aligned16(w.b.data)) detail::contract_failure(op, "w.b", w.b, "out >= 1, 16-byte aligned");
  if (p.topk_ids.dtype != DType::I32 || p.topk_ids.ndim != 2 || p.topk_ids.dim(1) < 1) {
    detail::contract_failure(op, "topk_ids", p.topk_ids, "[T, K] I32, K >= 1");
  }
  const int64_t tokens = p.topk_ids.dim(0), top_k = p.topk_ids.dim(1), pairs = tokens * top_k;
  if (p.token_slot.dtype != DType::I32 || p.token_slot.ndim != 1 || p.token_slot.dim(0) != tokens) {
    detail::contract_failure(op, "token_slot", p.token_slot, "[T] I32, T = topk_ids.dim(0)");
  }
  if (p.x.dtype != DType::BF16 || p.x.ndim != 2 || p.x.dim(1) != in || (p.x.dim(0) != tokens && p.x.dim(0) != pairs) ||
      !detail::aligned16(p.x.data)) {
    detail::contract_failure(op, "x", p.x, "[T, in] or [T*K, in] BF16, 16-byte aligned, in = w.a.dim(3)");
  }
  if (p.z.dtype != DType::F32 || p.z.ndim != 2 || p.z.dim(0) != pairs || p.z.dim(1) != capacity_rank ||
      !detail::aligned16(p.z.data)) {
    detail::contract_failure(op, "z", p.z, "[T*K, R] F32, 16-byte aligned, R = w.a.dim(2)");
  }
  if (p.z_readers.dtype != DType::I32 || p.z_readers.ndim != 1 || p.z_readers.dim(0) != pairs + 1) {
    detail::contract_failure(op, "z_readers", p.z_readers, "[T*K + 1] I32");
  }
  if (p.y.dtype != DType::BF16 || p.y.ndim != 2 || p.y.dim(0) != pairs || p.y.dim(1) != out) {
    detail::contract_failure(op, "y", p.y, "[T*K, out] BF16, out = w.b.dim(2)");
  }
  if (p.base.defined()) {
    if (p.base.device != Device::kCuda || p.base.dtype != DType::BF16 || p.base.ndim != 2 || p.base.dim(0) != pairs ||
        p.base_column < 0 || p.base.dim(1) < p.base_column + out || p.base.dim(1) >= 0x7fffffff) {
      detail::contract_failure(op, "base", p.base,
                               ("[T*K, N] BF16 on cuda, N >= base_column + out = " + std::to_string(p.base_column + out))
                                   .c_str());
    }
    if (p.bias.defined() && (p.bias.device != Device::kCuda || p.bias.dtype != DType::BF16 || p.bias.ndim != 1 ||
                             p.bias.dim(0) != p.base.dim(1))) {
      detail::contract_failure(op, "bias", p.bias,
                               ("[N] BF16 on cuda, N = base.dim(1) = " + std::to_string(p.base.dim(1))).c_str());
    }
  } else if (p.bias.defined()) {
    detail::contract_failure(op, "bias", p.bias, "undefined without base (the bias belongs to the epilogue)");
  }
  if (p.delta.defined()) {
    if (p.base.defined()) detail::contract_failure(op, "delta", p.delta, "undefined with base (the epilogue writes y)");
    if (p.delta.device != Device::kCuda || p.delta.dtype != DType::F32 || p.delta.ndim != 2 || p.delta.dim(0) != pairs ||
        p.delta.dim(1) != out || !detail::aligned16(p.delta.data)) {
      detail::contract_failure(op, "delta", p.delta, ("[T*K, out] F32 on cuda, 16-byte aligned, out = " +
                                                      std::to_string(out)).c_str());
    }
  }
  if (pairs * std::max<int64_t>(in / kBf16PerVector, out) >= 0x7fffffff || slots * experts >= 0x7fffffff) {
    detail::contract_failure(op, "topk_ids", p.topk_ids, "T*K small enough for a per-pair grid (moe_lora_small_fits)");
  }
  return SmallKernelParams{.x = static_cast<const __nv_bfloat16*>(p.x.data),
                           .topk_ids = static_cast<const int32_t*>(p.topk_ids.data),
                           .token_slot = static_cast<const int32_t*>(p.token_slot.data),
                           .a = static_cast<const __nv_bfloat16*>(w.a.data),
                           .b = static_cast<const __nv_bfloat16*>(w.b.data),
                           .rank = static_cast<const int32_t*>(w.rank.data),
                           .z = static_cast<float*>(p.z.data),
                           .z_readers = static_cast<int32_t*>(p.z_readers.data),
                           .y = static_cast<__nv_bfloat16*>(p.y.data),
                           .base = p.base.defined() ? static_cast<const __nv_bfloat16*>(p.base.data) + p.base_column : nullptr,
                           .bias = p.bias.defined() ? static_cast<const __nv_bfloat16*>(p.bias.data) + p.base_column : nullptr,
                           .base_stride = p.base.defined() ? int(p.base.dim(1)) : 0,
                           .delta = p.delta.defined() ? static_cast<float*>(p.delta.data) : nullptr,
                           .top_k = int(top_k),
                           .experts = int(experts),
                           .in = int(in),
                           .out = int(out),
                           .capacity_rank = int(capacity_rank),
                           .x_per_pair = p.x.dim(0) == pairs && pairs != tokens,
                           .x_before_wait = p.x_before_wait,
                           .pieces = 0,
                           .chunks = 0};
}

// A launch-shape field out of its set: the same message shape as detail::contract_failure (a programmer
// error: the fields are the bench's and the tests' knobs, 0 for everyone else).
[[noreturn]] void knob_failure(const char* op, const char* field, int found, const char* want) {
  std::fprintf(stderr, "loramux: cuda::%s called against its contract: MoeLoraSmallParams.%s: expected %s, found %d\n",
               op, field, want, found);
  std::abort();
}

// One launch through cudaLaunchKernelEx, with the programmatic-serialization attribute when pdl is set
// (captured into a graph as a programmatic edge).
template <typename Kernel>
void launch(Kernel kernel, dim3 blocks, unsigned threads, bool pdl, cudaStream_t stream, const SmallGridParams& params) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = blocks;
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = pdl ? 1 : 0;
  LMX_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, params));
}

// Lanes per B row of the expand: R / 8 vectors rounded up to a power of two (the shuffle reduction stays
// inside the group), 1 to 16.
int lanes_per_row(int vectors_per_row) {
  int lanes = 1;
  while (lanes < vectors_per_row) lanes *= 2;
  return lanes;
}

int shrink_pieces(int in, int vectors_per_lane) {
  const int per_cta = 32 * vectors_per_lane;
  return (in / kBf16PerVector + per_cta - 1) / per_cta;
}

// Whether set_small_lora_knockout drops this launch: bit 0 dense shrinks, 1 dense expands, 2 MoE shrinks, 3 MoE
// expands (dense = one expert: lora_dense's launches).
bool knocked_out(const SmallGridParams& grid, bool expand) {
  if (knockout_mask == 0) return false;
  const int bit = (grid.target[0].experts == 1 ? 0 : 2) + (expand ? 1 : 0);
  return (knockout_mask >> bit & 1) != 0;
}

// The defined targets of a group (one target outside a group), each checked alone and against the first:
// the launch's params. `first` supplies what every target shares (pdl, knobs, pair count).
struct Group {
  SmallGridParams grid{};
  int targets = 0;
  int64_t pairs = 0;
  const MoeLoraSmallParams* first = nullptr;
};

Group check_and_pack_group(std::span<const MoeLoraSmallParams> parts, const char* op) {
  Group g;
  for (const MoeLoraSmallParams& p : parts) {
    if (!p.w.defined()) continue;  // no resident adapter targets this projection
    if (g.targets == kMoeLoraSmallMaxTargets) {
      std::fprintf(stderr,
                   "loramux: cuda::%s called against its contract: a group holds at most %d targets with w "
                   "defined (kMoeLoraSmallMaxTargets), found more among %zu\n",
                   op, kMoeLoraSmallMaxTargets, parts.size());
      std::abort();
    }
    const SmallKernelParams packed = check_and_pack(p, op);
    if (g.first != nullptr) {
      const SmallKernelParams& f = g.grid.target[0];
      const MoeLoraSmallParams& q = *g.first;
      if (packed.x != f.x || p.x.dim(0) != q.x.dim(0) || packed.in != f.in) {
        detail::contract_failure(op, "x", p.x, ("the group's x, " + q.x.shape_str() + " at the same address").c_str());
      }
      if (packed.topk_ids != f.topk_ids || p.topk_ids.dim(0) != q.topk_ids.dim(0) || packed.top_k != f.top_k) {
        detail::contract_failure(op, "topk_ids", p.topk_ids, "the group's topk_ids (the same tensor in every target)");
      }
      if (packed.token_slot != f.token_slot) {
        detail::contract_failure(op, "token_slot", p.token_slot, "the group's token_slot (the same tensor in every target)");
      }
      if (packed.capacity_rank != f.capacity_rank) {
        detail::contract_failure(op, "w.a", p.w.a, ("the group's rank capacity R " + std::to_string(f.capacity_rank)).c_str());
      }
      if (p.pdl != q.pdl) knob_failure(op, "pdl", int(p.pdl), "the same in every target of a group");
      if (p.x_before_wait != q.x_before_wait) {
        knob_failure(op, "x_before_wait", int(p.x_before_wait), "the same in every target of a group");
      }
      if (p.shrink_vectors_per_lane != q.shrink_vectors_per_lane) {
        knob_failure(op, "shrink_vectors_per_lane", p.shrink_vectors_per_lane, "the same in every target of a group");
      }
      if (p.expand_vectors_per_thread != q.expand_vectors_per_thread) {
        knob_failure(op, "expand_vectors_per_thread", p.expand_vectors_per_thread, "the same in every target of a group");
      }
      if (p.delta.defined() != q.delta.defined()) {
        detail::contract_failure(op, "delta", p.delta, "defined in every target of a group or in none");
      }
    } else {
      g.first = &p;
      g.pairs = p.z.dim(0);
    }
    g.grid.target[g.targets++] = packed;
  }
  return g;
}

// The shrink's one dispatch: rows per warp = R / 8 warps, vectors per lane V.
template <int kVectorsPerLane>
void launch_shrink(const Group& g, dim3 blocks, cudaStream_t stream) {
  const bool pdl = g.first->pdl;
  switch (g.grid.target[0].capacity_rank / kWarps) {
    case 1: launch(small_shrink_kernel<1, kVectorsPerLane>, blocks, kThreads, pdl, stream, g.grid); break;
    case 2: launch(small_shrink_kernel<2, kVectorsPerLane>, blocks, kThreads, pdl, stream, g.grid); break;
    case 3: launch(small_shrink_kernel<3, kVectorsPerLane>, blocks, kThreads, pdl, stream, g.grid); break;
    case 4: launch(small_shrink_kernel<4, kVectorsPerLane>, blocks, kThreads, pdl, stream, g.grid); break;
    case 5: launch(small_shrink_kernel<5, kVectorsPerLane>, blocks, kThreads, pdl, stream, g.grid); break;
    case 6: launch(small_shrink_kernel<6, kVectorsPerLane>, blocks, kThreads, pdl, stream, g.grid); break;
    case 7: launch(small_shrink_kernel<7, kVectorsPerLane>, blocks, kThreads, pdl, stream, g.grid); break;
    case 8: launch(small_shrink_kernel<8, kVectorsPerLane>, blocks, kThreads, pdl, stream, g.grid); break;
    default:  // R in (64, 128] (check_and_pack); V = 4 is refused there (64 A vectors per lane in registers)
      if constexpr (kVectorsPerLane <= 2) {
        launch(small_shrink_kernel<kRowsPerWarpCap128, kVectorsPerLane>, blocks, kThreads, pdl, stream, g.grid);
      } else {
        knob_failure("moe_lora_small_shrink", "shrink_vectors_per_lane", kVectorsPerLane, "0, 1 or 2 at R > 64");
      }
  }
}

template <int kLanesPerRow, bool kDelta>
void launch_expand(const Group& g, int vectors_per_thread, dim3 blocks, unsigned threads, cudaStream_t stream) {
  if (vectors_per_thread == 8) {
    launch(small_expand_kernel<kLanesPerRow, 8, kDelta>, blocks, threads, g.first->pdl, stream, g.grid);
  } else {
    launch(small_expand_kernel<kLanesPerRow, 4, kDelta>, blocks, threads, g.first->pdl, stream, g.grid);
  }
}
template <int kLanesPerRow>
void launch_expand(const Group& g, int vectors_per_thread, dim3 blocks, unsigned threads, cudaStream_t stream) {
  if (g.grid.target[0].delta != nullptr) {
    launch_expand<kLanesPerRow, true>(g, vectors_per_thread, blocks, threads, stream);
  } else {
    launch_expand<kLanesPerRow, false>(g, vectors_per_thread, blocks, threads, stream);
  }
}

}  // namespace

void moe_lora_small_shrink(std::span<const MoeLoraSmallParams> targets, cudaStream_t stream) {
  Group g = check_and_pack_group(targets, "moe_lora_small_shrink");
  if (g.targets == 0 || g.pairs == 0) return;  // no resident adapter targets these projections, or no pairs
  if (knocked_out(g.grid, false)) return;
  const int in = g.grid.target[0].in, capacity_rank = g.grid.target[0].capacity_rank;
  int vectors_per_lane = g.first->shrink_vectors_per_lane;
  if (vectors_per_lane == 0) {
    // One 16-byte vector per lane (the most CTAs, so the most SMs pulling A) while the grid fits in one wave;
    // two above it (GPT-OSS: T·K > 88), where fewer, longer CTAs save the per-CTA routing round trips.
    vectors_per_lane = g.pairs * shrink_pieces(in, 1) * g.targets <= kOneWaveCtas ? 1 : 2;
  }
  if (vectors_per_lane != 1 && vectors_per_lane != 2 && vectors_per_lane != 4) {
    knob_failure("moe_lora_small_shrink", "shrink_vectors_per_lane", vectors_per_lane, "0, 1, 2 or 4");
  }
  if (vectors_per_lane == 4 && capacity_rank > 64) {  // 16 rows × 4 vectors: 256 registers of A alone
    knob_failure("moe_lora_small_shrink", "shrink_vectors_per_lane", vectors_per_lane, "0, 1 or 2 at R > 64");
  }
  const int pieces = shrink_pieces(in, vectors_per_lane);
  for (int t = 0; t < g.targets; ++t) g.grid.target[t].pieces = pieces;
  const dim3 blocks(unsigned(g.pairs * pieces), unsigned(g.targets));
  switch (vectors_per_lane) {
    case 1: launch_shrink<1>(g, blocks, stream); break;
    case 2: launch_shrink<2>(g, blocks, stream); break;
    default: launch_shrink<4>(g, blocks, stream); break;
  }
}

void moe_lora_small_expand(std::span<const MoeLoraSmallParams> targets, cudaStream_t stream) {
  Group g = check_and_pack_group(targets, "moe_lora_small_expand");
  if (g.targets == 0 || g.pairs == 0) return;
  if (knocked_out(g.grid, true)) return;
  const int lanes = lanes_per_row(g.grid.target[0].capacity_rank / kBf16PerVector);
  int vectors_per_thread = g.first->expand_vectors_per_thread;
  if (vectors_per_thread == 0) {
    // 4 (40 registers, 6 CTAs per SM; capped at 32 it spills). 8 pays the per-CTA z load, barrier and reader
    // count half as often but needs 64-90 registers, which halves the CTAs per SM and so the room for the
    // next kernel's early CTAs; the bench's shape sweep decides whether it ever wins.
    vectors_per_thread = 4;
  }
  if (vectors_per_thread != 4 && vectors_per_thread != 8) {
    knob_failure("moe_lora_small_expand", "expand_vectors_per_thread", vectors_per_thread, "0, 4 or 8");
  }
  auto chunks_for = [&](const SmallKernelParams& target, int threads) {
    const int rows_per_cta = threads / lanes * vectors_per_thread;
    return (target.out + rows_per_cta - 1) / rows_per_cta;
  };
  auto chunks_per_pair = [&](int threads) {
    int64_t sum = 0;
    for (int t = 0; t < g.targets; ++t) sum += chunks_for(g.grid.target[t], threads);
    return sum;
  };
  // Tiny batches get smaller CTAs, so the few pairs still spread over ~2 CTAs per SM.
  int threads = kThreads;
  while (threads > 64 && g.pairs * chunks_per_pair(threads) < 2 * kSmCount) threads /= 2;
  int begin = 0;
  for (int t = 0; t < kMoeLoraSmallMaxTargets; ++t) {
    g.grid.chunk_begin[t] = begin;  // past the group's targets: empty ranges at the end
    if (t < g.targets) {
      g.grid.target[t].chunks = chunks_for(g.grid.target[t], threads);
      begin += g.grid.target[t].chunks;
    }
  }
  g.grid.chunk_begin[kMoeLoraSmallMaxTargets] = begin;
  const dim3 blocks(unsigned(g.pairs * begin));
  switch (lanes) {
    case 1: launch_expand<1>(g, vectors_per_thread, blocks, unsigned(threads), stream); break;
    case 2: launch_expand<2>(g, vectors_per_thread, blocks, unsigned(threads), stream); break;
    case 4: launch_expand<4>(g, vectors_per_thread, blocks, unsigned(threads), stream); break;
    case 8: launch_expand<8>(g, vectors_per_thread, blocks, unsigned(threads), stream); break;
    default: launch_expand<16>(g, vectors_per_thread, blocks, unsigned(threads), stream); break;
  }
}

void moe_lora_small_shrink(const MoeLoraSmallParams& p, cudaStream_t stream) {
  moe_lora_small_shrink(std::span<const MoeLoraSmallParams>(&p, 1), stream);
}

void moe_lora_small_expand(const MoeLoraSmallParams& p, cudaStream_t stream) {
  moe_lora_small_expand(std::span<const MoeLoraSmallParams>(&p, 1), stream);
}

void set_small_lora_knockout(int mask) {
  if (mask < 0 || mask > 15) throw std::invalid_argument("set_small_lora_knockout: a mask of 4 bits, got " + std::to_string(mask));
  knockout_mask = mask;
}

void moe_lora_small_fused(const MoeLoraSmallParams& p, cudaStream_t stream) {
  if (p.base.defined()) {
    detail::contract_failure("moe_lora_small_fused", "base", p.base, "undefined (the epilogue is the expand's alone)");
  }
  if (p.delta.defined()) {
    detail::contract_failure("moe_lora_small_fused", "delta", p.delta, "undefined (the delta alone is the expand's)");
  }
  Group g = check_and_pack_group(std::span<const MoeLoraSmallParams>(&p, 1), "moe_lora_small_fused");
  if (g.targets == 0 || g.pairs == 0) return;
  SmallKernelParams& params = g.grid.target[0];
  params.pieces = shrink_pieces(params.in, 1);
  const int lanes = lanes_per_row(params.capacity_rank / kBf16PerVector);
  const int rows_per_cta = kThreads / lanes * kFusedVectorsPerThread;  // one CTA size for both roles
  params.chunks = (params.out + rows_per_cta - 1) / rows_per_cta;
  const dim3 blocks(unsigned(g.pairs * (params.pieces + params.chunks)));
  switch (params.capacity_rank / kWarps) {
    case 1: launch(small_fused_kernel<1>, blocks, kThreads, p.pdl, stream, g.grid); break;
    case 2: launch(small_fused_kernel<2>, blocks, kThreads, p.pdl, stream, g.grid); break;
    case 3: launch(small_fused_kernel<3>, blocks, kThreads, p.pdl, stream, g.grid); break;
    case 4: launch(small_fused_kernel<4>, blocks, kThreads, p.pdl, stream, g.grid); break;
    case 5: launch(small_fused_kernel<5>, blocks, kThreads, p.pdl, stream, g.grid); break;
    case 6: launch(small_fused_kernel<6>, blocks, kThreads, p.pdl, stream, g.grid); break;
    case 7: launch(small_fused_kernel<7>, blocks, kThreads, p.pdl, stream, g.grid); break;
    case 8: launch(small_fused_kernel<8>, blocks, kThreads, p.pdl, stream, g.grid); break;
    default: launch(small_fused_kernel<kRowsPerWarpCap128>, blocks, kThreads, p.pdl, stream, g.grid); break;
  }
}

}  // namespace lmx::cuda
