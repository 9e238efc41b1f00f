// Kernels of the paged-KV attention family and their launchers. kv_write: token t's k and v rows
// ([Hkv, D], contiguous) are copied to flat cache row kv_write_index[t] of k_cache and v_cache — a pure
// scatter, 16-byte units when the row allows it. Paged attention joins this file with its issue.
#include "backends/cuda/attention.cuh"

#include <cuda_bf16.h>

#include <algorithm>

#include "backends/cuda/check.h"
#include "backends/cuda/device.cuh"
#include "ops/backend.h"

namespace lmx::cuda {
namespace {

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
// PRECOND: every kv_write_index in [0, pages * P) and distinct (two tokens never share a cache row); Unit is
// uint4 only if the row is a multiple of 16 bytes and every base is 16-byte aligned; caches disjoint from
// k and v.
template <typename Unit>
__global__ static void kv_write_kernel(const __grid_constant__ KvWriteKernelParams p) {
  const int64_t token = blockIdx.x;
  const int64_t cache_row = p.kv_write_index[token];
  const bool is_v = blockIdx.y == 1;
  const auto* src = static_cast<const Unit*>(is_v ? p.v : p.k) + token * p.units_per_row;
  auto* dst = static_cast<Unit*>(is_v ? p.v_cache : p.k_cache) + cache_row * p.units_per_row;
  detail::copy_units(dst, src, p.units_per_row, int64_t(blockIdx.z) * blockDim.x + threadIdx.x,
                     int64_t(gridDim.z) * blockDim.x);
}

// ---- launchers ----------------------------------------------------------------------------------------

// GPT-OSS rows (Hkv 8, D 64) are 1 KB = 64 units: one block of 64 threads per (token, k|v).
constexpr int kMaxKvWriteThreads = 128;

}  // namespace

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
    kv_write_kernel<uint4><<<grid, threads, 0, stream>>>(params);
  } else {
    kv_write_kernel<uint16_t><<<grid, threads, 0, stream>>>(params);
  }
  LMX_CUDA_CHECK_LAUNCH();
}

}  // namespace lmx::cuda
