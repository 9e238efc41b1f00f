// Internal to src/backends/cuda: the device helpers the kernels share (bf16 <-> fp32, 16-byte vectors,
// block reduction, a warp's router top-k). Included by .cu files only; not an entry-point header.
#pragma once
#include <cuda_bf16.h>

#include <cfloat>
#include <climits>
#include <cstdint>

namespace lmx::cuda::detail {

// ---- device helpers -----------------------------------------------------------------------------------

// Eight consecutive bf16 values as one 16-byte access, widened to / rounded from fp32. Loaded as uint4 and
// reinterpreted in registers (copying a struct of __nv_bfloat162 member by member compiles to 4-byte
// accesses). PRECOND: p is 16-byte aligned.
constexpr int kBf16PerVector = 8;

// 2^x by the MUFU alone, results below 2^-126 flushed to 0 (exp2f adds a range test and two multiplies to
// keep them; a softmax weight that small is 0 against the row's sum of at least 1). Within 2 ulp.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// 1/x by the MUFU alone (within 1 ulp; 1/inf = 0). The IEEE division `1.0f / x` adds a Newton step, a range
// test and a slow-path call.
__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// The 8 bf16 of one 16-byte vector (already in registers) as floats.
__device__ __forceinline__ void widen8(const uint4& raw, float (&f)[8]) {
  const auto* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = __bfloat1622float2(pairs[i]);
    f[2 * i] = v.x;
    f[2 * i + 1] = v.y;
  }
}

__device__ __forceinline__ void load8(const __nv_bfloat16* p, float (&f)[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);  // a copy: widen8 on the dereference itself bound its
  widen8(raw, f);                                         // reference to global memory (four 4-byte loads)
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

// ---- router top-k of one token (routing.cu's kernel; the router product's fused tail in linear.cu) -----

constexpr int kRouterMaxTopK = 32;  // the chosen logits of a token live in one register per lane

// (value, id) ranks before (other_value, other_id): the oracle's order (logit descending, ties to the lower id).
__device__ __forceinline__ bool ranks_before(float value, int id, float other_value, int other_id) {
  return value > other_value || (value == other_value && id < other_id);
}

// One token's top-k by the whole warp: a max pass, a sum-of-exp pass (softmax-then-top-k only), then K
// selection passes, each a warp argmax over the logits strictly after the previous pick in the total order —
// no per-token scratch, so any E. The order is taken on the logits for both rules: softmax is monotone, so it
// is the oracle's order unless two probabilities round to the same fp32 value (docs/NUMERICS.md). Logits are
// read through L2 (ld.global.cg), so values other CTAs of the same grid wrote before a fence are seen; up to
// 32 · kRouterCachedPerLane experts they are read once, all at once, into registers (each pass re-reading
// them was a round trip to L2 of its own: five at K 4), beyond that every pass reads them again.
// PRECOND: all 32 lanes call it; 1 <= K <= min(E, kRouterMaxTopK); no NaN logits (the oracle rejects them; a
// NaN never ranks before anything, so it is never picked here).
constexpr int kRouterCachedPerLane = 8;  // E <= 256 (DeepSeek-V3's router) from registers
__device__ __forceinline__ void router_topk_warp(const float* logits, int experts, int top_k, bool softmax_first,
                                                 bool renormalize, int32_t* ids, float* weights) {
  const int lane = threadIdx.x % 32;
  const bool cached = experts <= 32 * kRouterCachedPerLane;
  float cache[kRouterCachedPerLane];
#pragma unroll
  for (int j = 0; j < kRouterCachedPerLane; ++j) {
    const int e = lane + 32 * j;
    cache[j] = cached && e < experts ? __ldcg(logits + e) : -FLT_MAX;
  }
  // Logit e = lane + 32·j of this lane (j the loop's step count).
  auto logit = [&](int j, int e) {
    if (!cached) return __ldcg(logits + e);
    float v = cache[0];
#pragma unroll
    for (int i = 1; i < kRouterCachedPerLane; ++i) v = j == i ? cache[i] : v;
    return v;
  };
  float max_logit = -FLT_MAX;
  for (int e = lane, j = 0; e < experts; e += 32, ++j) max_logit = fmaxf(max_logit, logit(j, e));
  for (int offset = 16; offset > 0; offset /= 2) max_logit = fmaxf(max_logit, __shfl_xor_sync(~0u, max_logit, offset));
  float sum_exp = 0.0f;
  if (softmax_first) {
    for (int e = lane, j = 0; e < experts; e += 32, ++j) sum_exp += expf(logit(j, e) - max_logit);
    for (int offset = 16; offset > 0; offset /= 2) sum_exp += __shfl_xor_sync(~0u, sum_exp, offset);
  }

  // Lane k keeps the k-th pick's logit and id.
  float prev_value = FLT_MAX, my_value = 0.0f;
  int prev_id = -1, my_id = 0;
  for (int k = 0; k < top_k; ++k) {
    float best_value = -FLT_MAX;
    int best_id = INT_MAX;
    for (int e = lane, j = 0; e < experts; e += 32, ++j) {
      const float v = logit(j, e);
      if (ranks_before(prev_value, prev_id, v, e) && ranks_before(v, e, best_value, best_id)) {
        best_value = v;
        best_id = e;
      }
    }
    for (int offset = 16; offset > 0; offset /= 2) {
      const float other_value = __shfl_xor_sync(~0u, best_value, offset);
      const int other_id = __shfl_xor_sync(~0u, best_id, offset);
      if (ranks_before(other_value, other_id, best_value, best_id)) {
        best_value = other_value;
        best_id = other_id;
      }
    }
    if (lane == k) {
      my_value = best_value;
      my_id = best_id;
    }
    prev_value = best_value;
    prev_id = best_id;
  }

  // Weights in the oracle's order of operations (sequential sums over k).
  float weight = 0.0f;
  if (softmax_first) {
    weight = expf(my_value - max_logit) / sum_exp;
    if (renormalize) {
      float chosen_sum = 0.0f;
      for (int k = 0; k < top_k; ++k) chosen_sum += __shfl_sync(~0u, weight, k);
      weight /= chosen_sum;
    }
  } else {
    const float top = __shfl_sync(~0u, my_value, 0);
    weight = expf(my_value - top);
    float sum = 0.0f;
    for (int k = 0; k < top_k; ++k) sum += __shfl_sync(~0u, weight, k);
    weight /= sum;
  }
  if (lane < top_k) {
    ids[lane] = my_id;
    weights[lane] = weight;
  }
}

// *counter += 1 with acquire-release semantics at gpu scope, returning the old count (the self-cleaning z
// readers' arrival). Release: this CTA's reads of z (staged before a barrier) happen before its count; acquire:
// the last reader's zeroing happens after every other reader's count. One instruction instead of fence +
// relaxed atomic + fence (a fence.sc waits for every outstanding access of the thread).
__device__ __forceinline__ int count_reader(int32_t* counter) {
  int32_t earlier;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(earlier) : "l"(counter) : "memory");
  return earlier;
}

// ---- mbarriers and bulk copies (sm_90: the persistent GEMMs' and the MoE-LoRA expand's rings) ----------

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// Generic-proxy accesses to shared memory (this thread's, and those a barrier ordered before) before the
// async proxy's (bulk copies, TMA, wgmma) to the same bytes.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(shared_address(bar)), "r"(count) : "memory");
}
// Blocks until the barrier's phase with this parity has completed (a fresh barrier counts parity 1 done).
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, unsigned parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(shared_address(bar)), "r"(parity)
        : "memory");
  }
}
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(shared_address(bar)) : "memory");
}
// One arrival that also expects `bytes` of asynchronous (TMA) writes before the phase can complete.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(shared_address(bar)), "r"(bytes)
               : "memory");
}
// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global memory to the shared address `shared`
// by one bulk copy, counted down on the barrier's expected transaction count when they land.
__device__ __forceinline__ void bulk_copy(uint32_t shared, const void* global, unsigned bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(shared),
               "l"(global), "r"(bytes), "r"(shared_address(bar))
               : "memory");
}

}  // namespace lmx::cuda::detail
