// Internal to src/backends/cuda: the Hopper warpgroup-MMA helpers the sm_90a kernels share (shared-memory
// matrix descriptors, fences, commit / wait, and the flash attention kernel's m64n64k16 / m64n128k16 shapes).
// The MoE GEMM's wider bf16 shapes (n128 / n192 / n256) stay in moe_gemm.cu, their only user. Included by
// .cu files only; every MMA here traps on a target without the sm_90a features (never reached: CMake builds
// 90a).
#pragma once
#include <cstdint>

namespace lmx::cuda::detail {

// Matrix descriptor of a SWIZZLE_128B tile starting at `shared` (1024-byte aligned atoms of 8 rows × 128 bytes).
// Fields: start address >> 4 (bits 0-13), leading byte offset >> 4 (16-29), stride byte offset >> 4
// (32-45; 1024: the next 8 rows of 128 bytes), swizzle mode (62-63; 1 = 128 bytes).
//  - K-major (rows of 64 bf16 along k; the MoE GEMM's tiles, Q and K of attention): advancing the start by
//    32 bytes steps k by 16 inside the atom, the hardware applies the swizzle to the address; the leading
//    byte offset is unused (1).
//  - MN-major (attention's V as B of P·V with imm-trans-b = 1: rows of 64 D values along n, one row per key
//    along k): the stride offset is the next 8 keys (1024 bytes), the leading offset the next 64 columns of
//    n — never used at n 64, where one atom holds every column.
__device__ __forceinline__ uint64_t sw128_descriptor(const void* shared) {
  const auto address = static_cast<uint32_t>(__cvta_generic_to_shared(shared));
  return uint64_t((address & 0x3ffff) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

// The same with the leading byte offset set: an MN-major operand wider than one atom (attention's V at D 128:
// the second 64 columns of n start `leading_bytes` after the first).
__device__ __forceinline__ uint64_t sw128_descriptor(const void* shared, uint32_t leading_bytes) {
  return (sw128_descriptor(shared) & ~(uint64_t(0x3fff) << 16)) | (uint64_t((leading_bytes >> 4) & 0x3fff) << 16);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Pins registers in program order around the asynchronous MMAs (the asm statements that issue and wait do
// not name them, so without this the compiler could move their uses across a wait).
template <int kCount>
__device__ __forceinline__ void fence_operands(float (&d)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int kCount>
__device__ __forceinline__ void fence_operands(unsigned (&r)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// cp.async and plain stores write shared memory through the generic proxy; wgmma reads it through the async
// proxy. Each writing thread fences before the barrier that publishes its writes to the MMAs.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// d[32] = (accumulate ? d : 0) + A(64×16, descriptor, K-major)·B(64×16, descriptor, K-major)ᵀ, bf16 in, fp32
// out: attention's S = Q·Kᵀ, 16 head dims at a time (d: rows lane / 4 and + 8 of the warp's 16, columns
// 8j + 2(lane % 4) and + 1 in d[4j .. 4j + 3], mma.sync's C fragment layout).
__device__ __forceinline__ void wgmma_m64n64k16_bf16(float (&d)[32], uint64_t a, uint64_t b, bool accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "
      "%23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(a), "l"(b), "r"(int(accumulate)));
#else
  __trap();
#endif
}

// d[32] += A(64×16, registers: four f16 pairs in mma.sync's A fragment layout)·B(16×64, descriptor, MN-major:
// imm-trans-b = 1), f16 in, fp32 accumulate: attention's O += P·V, 16 keys at a time.
__device__ __forceinline__ void wgmma_m64n64k16_f16_rs(float (&d)[32], const unsigned (&a)[4], uint64_t b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "
      "%23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
#else
  __trap();
#endif
}

// d[64] += A(64×16, registers: f16 pairs in mma.sync's A fragment layout)·B(16×128, descriptor, N-major:
// imm-trans-b = 1), f16 in, fp32 accumulate: attention's O += P·V at D 128.
__device__ __forceinline__ void wgmma_m64n128k16_f16_rs(float (&d)[64], const unsigned (&a)[4], uint64_t b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "
      "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, "
      "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n"
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
  __trap();
#endif
}

}  // namespace lmx::cuda::detail
