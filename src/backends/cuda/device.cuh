// Internal to src/backends/cuda: the device helpers the kernels share (bf16 <-> fp32, 16-byte vectors,
// block reduction). Included by .cu files only; not an entry-point header.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

namespace lmx::cuda::detail {

// ---- device helpers -----------------------------------------------------------------------------------

// Eight consecutive bf16 values as one 16-byte access, widened to / rounded from fp32. Loaded as uint4 and
// reinterpreted in registers (copying a struct of __nv_bfloat162 member by member compiles to 4-byte
// accesses). PRECOND: p is 16-byte aligned.
constexpr int kBf16PerVector = 8;

__device__ __forceinline__ void load8(const __nv_bfloat16* p, float (&f)[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const auto* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = __bfloat1622float2(pairs[i]);
    f[2 * i] = v.x;
    f[2 * i + 1] = v.y;
  }
}

__device__ __forceinline__ void store8(__nv_bfloat16* p, const float (&f)[8]) {
  uint4 raw;
  auto* pairs = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) pairs[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);  // round to nearest even
  *reinterpret_cast<uint4*>(p) = raw;
}

// Two fp32 values as packed bf16 pairs hi + lo with hi = bf16(v), lo = bf16(v - hi): 16 significant bits
// (v - hi is exact in fp32), so a product against a bf16 operand through two bf16 MMAs loses ~2⁻¹⁷. The
// lower-indexed value (x) sits in the low halves, as an mma fragment register wants it.
__device__ __forceinline__ void split_bf16(float2 v, unsigned& hi, unsigned& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(v.x, v.y);
  const float2 back = __bfloat1622float2(h);
  const __nv_bfloat162 l = __floats2bfloat162_rn(v.x - back.x, v.y - back.y);
  hi = *reinterpret_cast<const unsigned*>(&h);
  lo = *reinterpret_cast<const unsigned*>(&l);
}

// Sum over the block; every thread gets the result. PRECOND: blockDim.x is a multiple of 32, at most 1024;
// every thread of the block calls it, at most once per kernel (its shared scratch is not re-synchronised).
__device__ __forceinline__ float block_sum(float value) {
  __shared__ float warp_sums[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
  if (warps == 1) return value;
  if (lane == 0) warp_sums[warp] = value;
  __syncthreads();
  value = lane < warps ? warp_sums[lane] : 0.0f;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

// Prefetch [bytes_begin, bytes_begin + bytes) into L2 with bulk prefetches (cp.async.bulk.prefetch.L2, no
// registers, no completion to wait for): thread i of the block takes the i-th 16 KB, so one call covers at
// most blockDim.x · 16 KB. PRECOND: address and bytes multiples of 16.
constexpr int64_t kPrefetchBytesPerThread = 16 << 10;
__device__ __forceinline__ void prefetch_l2(const void* bytes_begin, int64_t bytes) {
  const int64_t offset = int64_t(threadIdx.x) * kPrefetchBytesPerThread;
  if (offset >= bytes) return;
  const unsigned size = unsigned(min(kPrefetchBytesPerThread, bytes - offset));
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(static_cast<const char*>(bytes_begin) + offset),
               "r"(size) : "memory");
}

// Copy one row of `units` Units (uint4 = 16 bytes, or a 2-byte scalar) with the block's threads: this thread
// takes units first, first + stride, ... (a 2-D grid splits a long row over blocks). kCopyUnroll loads are
// issued before their stores, so several are in flight per thread. The loads are unconditional (past-the-
// end ones re-read the last unit): a load inside a divergent `if` makes the compiler wait for it where the
// branch rejoins, which serialized the loads (measured on the H200, docs/perf-log.md).
constexpr int kCopyUnroll = 4;

template <typename Unit>
__device__ __forceinline__ void copy_units(Unit* dst, const Unit* src, int64_t units, int64_t first, int64_t stride) {
  for (int64_t base = first; base < units; base += kCopyUnroll * stride) {
    Unit staged[kCopyUnroll];
#pragma unroll
    for (int j = 0; j < kCopyUnroll; ++j) staged[j] = src[min(base + j * stride, units - 1)];
#pragma unroll
    for (int j = 0; j < kCopyUnroll; ++j) {
      if (base + j * stride < units) dst[base + j * stride] = staged[j];
    }
  }
}

}  // namespace lmx::cuda::detail
