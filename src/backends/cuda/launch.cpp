// The PDL knob of launch.cuh (a process-wide bench setting, like set_moe_gemm_kernel).
#include "backends/cuda/launch.cuh"

#include <cuda_runtime_api.h>

#include <atomic>

#include "backends/cuda/check.h"

namespace lmx::cuda {
namespace {
std::atomic<bool> programmatic{true};
}  // namespace

void set_programmatic_launches(bool on) { programmatic.store(on); }
bool programmatic_launches() { return programmatic.load(std::memory_order_relaxed); }

int multiprocessor_count() {
  static const int count = [] {
    int device = 0, sms = 0;
    LMX_CUDA_CHECK(cudaGetDevice(&device));
    LMX_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    return sms;
  }();
  return count;
}

}  // namespace lmx::cuda
