// Internal to src/backends/cuda: CUDA error checks and the launcher-side contract checks shared by every
// op family. Host code only (memory.cpp includes it too); device helpers are in device.cuh.
// Not an entry-point header: nothing outside this folder includes it.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <utility>

#include "core/tensor.h"

// A failing CUDA call or launch is a programmer or environment error (bad pointer, no device, sticky
// fault): abort naming the call, like LMX_CHECK. Request-level failures never reach a kernel.
#define LMX_CUDA_CHECK(call)                                                                         \
  do {                                                                                               \
    cudaError_t lmx_cuda_err_ = (call);                                                              \
    if (lmx_cuda_err_ != cudaSuccess) {                                                              \
      std::fprintf(stderr, "loramux: CUDA error at %s:%d: %s: %s\n", __FILE__, __LINE__, #call,     \
                   cudaGetErrorString(lmx_cuda_err_));                                               \
      std::abort();                                                                                  \
    }                                                                                                \
  } while (0)

// After every launch: catches bad configurations (grid, smem) at once; faults inside the kernel surface
// at the next synchronizing call.
#define LMX_CUDA_CHECK_LAUNCH() LMX_CUDA_CHECK(cudaGetLastError())

namespace lmx::cuda::detail {

// ---- launcher-side checks (host) ----------------------------------------------------------------------

[[noreturn]] inline void contract_failure(const char* op, const char* name, const Tensor& t, const char* want) {
  std::fprintf(stderr, "loramux: cuda::%s called against its contract: %s: expected %s, found %s on %s\n", op,
               name, want, t.shape_str().c_str(), std::string(device_name(t.device)).c_str());
  std::abort();
}

// Every tensor of a CUDA op lives in device memory (ops::check only asks that they share one device).
inline void require_cuda(const char* op, std::initializer_list<std::pair<const char*, const Tensor*>> tensors) {
  for (const auto& [name, t] : tensors) {
    if (t->device != Device::kCuda) contract_failure(op, name, *t, "a tensor on cuda");
  }
}

// The one dtype dispatch of these kernels: activations are BF16 on cuda (F32 is the cpu oracle's).
inline void require_bf16_activation(const char* op, const char* name, const Tensor& t) {
  if (t.dtype != DType::BF16) contract_failure(op, name, t, "a BF16 activation (the CUDA kernels take BF16 only)");
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

inline unsigned blocks_for(int64_t items, int threads_per_block) {
  return unsigned((items + threads_per_block - 1) / threads_per_block);
}

}  // namespace lmx::cuda::detail
