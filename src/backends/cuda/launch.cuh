// Internal to src/backends/cuda: programmatic dependent launch (PDL) of the small kernels a decode step is
// made of. A kernel launched through detail::launch() may become resident while the kernel before it on the
// stream still runs (in its tail), so its launch latency and ramp-up hide behind that kernel instead of
// leaving the GPU idle between the two. Included by .cu files only; the knob is for the bench's before/after.
// PRECOND of every kernel launched this way: each thread executes detail::pdl_enter() before it writes global
// memory or reads anything the kernel just before it may write, and before it exits: griddepcontrol.wait
// returns once every kernel before it on the stream is complete and visible, and only then does the kernel
// allow its own dependents to start, so the chain holds for kernels that read data written several launches
// back before their own wait (moe_lora_small; flash_attention_kernel's metadata and block table). Most call
// it as their first statement.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>

#include "backends/cuda/check.h"

namespace lmx::cuda {

// false: every kernel of detail::launch() goes out as a plain launch (bench before/after; default true).
void set_programmatic_launches(bool on);
bool programmatic_launches();

// The current device's SM count, read once (the process serves one device).
int multiprocessor_count();

namespace detail {

#ifdef __CUDACC__
__device__ __forceinline__ void pdl_enter() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
#endif

// kernel<<<grid, block, shared_bytes, stream>>>(params), with the programmatic-serialization attribute
// unless the knob is off (captured into a graph as a programmatic edge).
template <typename Params>
void launch(void (*kernel)(Params), dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream,
            const Params& params) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = programmatic_launches() ? 1 : 0;
  LMX_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, params));
}

}  // namespace detail
}  // namespace lmx::cuda
