// MoE-LoRA shrink and expand kernels (moe_lora.cuh) and their launchers. CUDA-core fp32 FMAs over 16-byte
// bf16 loads: at rank <= 64 both ops are bandwidth-bound on the touched A/B slices at decode sizes; tensor
// cores (mma.sync) for prefill come later. One CTA per (tile, piece): the tile's group gives (slot, expert),
// so the slot is a grid dimension through the tile list and no CTA exists for an empty (slot, expert).
//  shrink: CTA = one tile × one split of `in`; warp w owns rank rows w, w+8, ...; each lane reads 8
//    consecutive inputs of an A row and of each of the tile's x rows (x hits L1 across the 8 warps);
//    fp32 partial sums per (row, pair) in registers, one warp reduction at the end, then an fp32 atomic
//    add (split) or a store (no split) into z.
//  expand: CTA = one tile × 512 outputs; thread = 2 output rows, B read 8 ranks at a time, z of the tile
//    staged in shared memory, y read-add-written once per (pair, output) as bf16 pairs.
#include "backends/cuda/moe_lora.cuh"

#include <cuda_bf16.h>

#include <algorithm>

#include "backends/cuda/check.h"
#include "backends/cuda/device.cuh"

namespace lmx::cuda {
namespace {

using detail::kBf16PerVector;
constexpr int kBlockM = kMoeLoraBlockM;
constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kExpandOutPerThread = 2;
constexpr int kExpandOutPerCta = kThreads * kExpandOutPerThread;
constexpr int kMaxRank = 64;
constexpr int kPairsPerPass = 4;  // shrink: accumulators per rank row (registers, see shrink_kernel)

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
  int pairs;                    // T*K, the sentinel
  int top_k;                    // K
  bool x_per_pair;              // x has T*K rows
  int experts;                  // E
  int in;                       // in
  int out;                      // out
  int capacity_rank;            // R
  int split_k;
};

// The tile's pairs into shared memory; returns how many are real (sentinels sit at the end of a group).
__device__ __forceinline__ int load_tile_pairs(const LoraKernelParams& p, int tile, int (&pairs)[kBlockM]) {
  if (threadIdx.x < kBlockM) pairs[threadIdx.x] = p.sorted_pairs[tile * kBlockM + threadIdx.x];
  __syncthreads();
  int valid = 0;
#pragma unroll
  for (int m = 0; m < kBlockM; ++m) valid += pairs[m] != p.pairs;
  return valid;
}

// PRECOND: blockDim.x == kThreads; in % 8 == 0; x, a 16-byte aligned; R <= 8 * kRowsPerWarp; sorted_pairs
// and tile_group from moe_align with BLOCK_M = kBlockM and G = S·E; z zeroed when split_k > 1.
template <int kRowsPerWarp>
__global__ static void __launch_bounds__(kThreads) shrink_kernel(const __grid_constant__ LoraKernelParams p) {
  const int tile = blockIdx.x;
  if (tile >= *p.num_tiles) return;
  const int group = p.tile_group[tile];
  const int slot = group / p.experts;
  const int rank = p.rank[slot];
  if (rank == 0) return;
  __shared__ int pairs[kBlockM];
  const int valid = load_tile_pairs(p, tile, pairs);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int vectors = p.in / kBf16PerVector;
  const int per_split = (vectors + p.split_k - 1) / p.split_k;
  const int v_begin = blockIdx.y * per_split, v_end = min(v_begin + per_split, vectors);
  const __nv_bfloat16* a = p.a + int64_t(group) * p.capacity_rank * p.in;  // [R, in] of (slot, expert)

  // The tile's pairs in passes of kPairsPerPass: 4 accumulators per rank row keep the kernel near 100
  // registers (2+ CTAs per SM); a later pass re-reads the CTA's A piece from L1/L2, not DRAM.
  for (int m0 = 0; m0 < valid; m0 += kPairsPerPass) {
    float acc[kRowsPerWarp][kPairsPerPass] = {};
    for (int v = v_begin + lane; v < v_end; v += 32) {
      float av[kRowsPerWarp][8];
#pragma unroll
      for (int j = 0; j < kRowsPerWarp; ++j) {
        const int r = warp + kWarps * j;
        if (r < rank) detail::load8(a + int64_t(r) * p.in + v * kBf16PerVector, av[j]);
      }
#pragma unroll
      for (int m = 0; m < kPairsPerPass; ++m) {
        if (m0 + m < valid) {
          const int pair = pairs[m0 + m];
          const int row = p.x_per_pair ? pair : pair / p.top_k;
          float xv[8];
          detail::load8(p.x + int64_t(row) * p.in + v * kBf16PerVector, xv);
#pragma unroll
          for (int j = 0; j < kRowsPerWarp; ++j) {
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[j][m] = fmaf(av[j][i], xv[i], acc[j][m]);
          }
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kRowsPerWarp; ++j) {
      const int r = warp + kWarps * j;
      if (r >= rank) break;
#pragma unroll
      for (int m = 0; m < kPairsPerPass; ++m) {
        if (m0 + m < valid) {
          float sum = acc[j][m];
          for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(~0u, sum, offset);
          if (lane == 0) {
            float* dst = p.z + int64_t(pairs[m0 + m]) * p.capacity_rank + r;
            if (p.split_k > 1) atomicAdd(dst, sum);
            else *dst = sum;
          }
        }
      }
    }
  }
}

// PRECOND: blockDim.x == kThreads; out % 2 == 0; R % 8 == 0, R <= kMaxRank; b 16-byte aligned, y 4-byte
// aligned; z holds the shrink of every pair of the tile.
__global__ static void __launch_bounds__(kThreads) expand_kernel(const __grid_constant__ LoraKernelParams p) {
  const int tile = blockIdx.x;
  if (tile >= *p.num_tiles) return;
  const int group = p.tile_group[tile];
  const int slot = group / p.experts;
  const int rank = p.rank[slot];
  if (rank == 0) return;
  __shared__ int pairs[kBlockM];
  __shared__ float zs[kBlockM][kMaxRank];
  const int valid = load_tile_pairs(p, tile, pairs);
  const int rank_padded = (rank + 7) / 8 * 8;
  for (int i = threadIdx.x; i < kBlockM * rank_padded; i += kThreads) {
    const int m = i / rank_padded, r = i % rank_padded;
    zs[m][r] = (m < valid && r < rank) ? p.z[int64_t(pairs[m]) * p.capacity_rank + r] : 0.0f;
  }
  __syncthreads();
  const int o = blockIdx.y * kExpandOutPerCta + threadIdx.x * kExpandOutPerThread;
  if (o >= p.out) return;
  const __nv_bfloat16* b = p.b + (int64_t(group) * p.out + o) * p.capacity_rank;  // rows o, o+1 of [out, R]
  float acc[kBlockM][kExpandOutPerThread] = {};
  for (int r0 = 0; r0 < rank_padded; r0 += 8) {
    float b0[8], b1[8];
    detail::load8(b + r0, b0);
    detail::load8(b + p.capacity_rank + r0, b1);
#pragma unroll
    for (int i = 0; i < 8; ++i) {  // padding ranks of B may hold anything; zs is 0 there, but 0·NaN is not
      if (r0 + i >= rank) b0[i] = b1[i] = 0.0f;
    }
#pragma unroll
    for (int m = 0; m < kBlockM; ++m) {
      if (m < valid) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          acc[m][0] = fmaf(b0[i], zs[m][r0 + i], acc[m][0]);
          acc[m][1] = fmaf(b1[i], zs[m][r0 + i], acc[m][1]);
        }
      }
    }
  }
#pragma unroll
  for (int m = 0; m < kBlockM; ++m) {
    if (m < valid) {
      auto* y = reinterpret_cast<__nv_bfloat162*>(p.y + int64_t(pairs[m]) * p.out + o);
      const float2 old = __bfloat1622float2(*y);
      *y = __floats2bfloat162_rn(old.x + acc[m][0], old.y + acc[m][1]);
    }
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
  if (capacity_rank % 8 != 0 || capacity_rank > kMaxRank) {
    detail::contract_failure(op, "w.a", w.a, "R a multiple of 8, at most 64");
  }
  if (in % 8 != 0 || !detail::aligned16(w.a.data)) detail::contract_failure(op, "w.a", w.a, "in % 8 == 0, 16-byte aligned");
  if (out % 2 != 0 || !detail::aligned16(w.b.data)) detail::contract_failure(op, "w.b", w.b, "out % 2 == 0, 16-byte aligned");
  if (p.top_k < 1) detail::contract_failure(op, "z", p.z, "top_k >= 1");
  if (p.z.dtype != DType::F32 || p.z.ndim != 2 || p.z.dim(1) != capacity_rank || p.z.dim(0) % p.top_k != 0) {
    detail::contract_failure(op, "z", p.z, "[T*K, R] F32");
  }
  const int64_t pairs = p.z.dim(0), tokens = pairs / p.top_k;
  if (p.x.dtype != DType::BF16 || p.x.ndim != 2 || p.x.dim(1) != in || (p.x.dim(0) != tokens && p.x.dim(0) != pairs) ||
      !detail::aligned16(p.x.data)) {
    detail::contract_failure(op, "x", p.x, "[T, in] or [T*K, in] BF16, 16-byte aligned, in = w.a.dim(3)");
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
  LMX_CHECK(pairs < 0x7fffffff && max_tiles < 0x7fffffff && slots * experts < 0x7fffffff);
  const LoraKernelParams params{.x = static_cast<const __nv_bfloat16*>(p.x.data),
                                .a = static_cast<const __nv_bfloat16*>(w.a.data),
                                .b = static_cast<const __nv_bfloat16*>(w.b.data),
                                .rank = static_cast<const int32_t*>(w.rank.data),
                                .sorted_pairs = static_cast<const int32_t*>(p.sorted_pairs.data),
                                .tile_group = static_cast<const int32_t*>(p.tile_group.data),
                                .num_tiles = static_cast<const int32_t*>(p.num_tiles.data),
                                .z = static_cast<float*>(p.z.data),
                                .y = static_cast<__nv_bfloat16*>(p.y.data),
                                .pairs = int(pairs),
                                .top_k = int(p.top_k),
                                .x_per_pair = p.x.dim(0) == pairs,
                                .experts = int(experts),
                                .in = int(in),
                                .out = int(out),
                                .capacity_rank = int(capacity_rank),
                                .split_k = 1};
  return {params, int(max_tiles)};
}

}  // namespace

int moe_lora_auto_split(int64_t pairs, int64_t groups, int64_t in) {
  // Expected tiles: one per touched group plus one per BLOCK_M pairs; aim for ~8 CTAs per SM on 132 SMs,
  // each piece at least 32 vectors (256 inputs) long.
  const int64_t tiles = std::max<int64_t>(1, std::min(pairs, groups) + pairs / kBlockM);
  const int64_t max_split = std::max<int64_t>(1, in / kBf16PerVector / 32);
  return int(std::clamp<int64_t>((8 * 132 + tiles - 1) / tiles, 1, max_split));
}

void moe_lora_shrink(const MoeLoraParams& p, cudaStream_t stream) {
  if (!p.w.defined()) return;  // no resident adapter targets these experts: nothing is launched
  Checked c = check_and_pack(p, "moe_lora_shrink");
  if (c.max_tiles == 0 || c.params.pairs == 0) return;
  const int64_t groups = p.w.a.dim(0) * p.w.a.dim(1);
  int split = p.split_k > 0 ? p.split_k : moe_lora_auto_split(c.params.pairs, groups, c.params.in);
  split = std::clamp(split, 1, std::max(1, c.params.in / kBf16PerVector));
  c.params.split_k = split;
  if (split > 1) LMX_CUDA_CHECK(cudaMemsetAsync(p.z.data, 0, p.z.nbytes(), stream));
  const dim3 grid(unsigned(c.max_tiles), unsigned(split));
  // The one dispatch on the rank capacity: rows per warp = R / 8 warps.
  switch (c.params.capacity_rank / kWarps) {
    case 1: shrink_kernel<1><<<grid, kThreads, 0, stream>>>(c.params); break;
    case 2: shrink_kernel<2><<<grid, kThreads, 0, stream>>>(c.params); break;
    case 3: shrink_kernel<3><<<grid, kThreads, 0, stream>>>(c.params); break;
    case 4: shrink_kernel<4><<<grid, kThreads, 0, stream>>>(c.params); break;
    case 5: shrink_kernel<5><<<grid, kThreads, 0, stream>>>(c.params); break;
    case 6: shrink_kernel<6><<<grid, kThreads, 0, stream>>>(c.params); break;
    case 7: shrink_kernel<7><<<grid, kThreads, 0, stream>>>(c.params); break;
    case 8: shrink_kernel<8><<<grid, kThreads, 0, stream>>>(c.params); break;
    default: detail::contract_failure("moe_lora_shrink", "w.a", p.w.a, "R in {8, 16, ..., 64}");
  }
  LMX_CUDA_CHECK_LAUNCH();
}

void moe_lora_expand(const MoeLoraParams& p, cudaStream_t stream) {
  if (!p.w.defined()) return;
  const Checked c = check_and_pack(p, "moe_lora_expand");
  if (c.max_tiles == 0 || c.params.pairs == 0 || c.params.out == 0) return;
  const dim3 grid(unsigned(c.max_tiles), detail::blocks_for(c.params.out, kExpandOutPerCta));
  expand_kernel<<<grid, kThreads, 0, stream>>>(c.params);
  LMX_CUDA_CHECK_LAUNCH();
}

}  // namespace lmx::cuda
