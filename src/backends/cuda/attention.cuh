// Entry points of the paged-KV attention family on cuda (contracts in ops/attention.h). For now only
// kv_write, which scatters this step's k and v rows into cache pages; paged attention comes with its issue.
// Callers: tests, bench, (later) the CUDA backend.
#pragma once
#include <cuda_runtime_api.h>

#include "ops/attention.h"

namespace lmx::cuda {

void kv_write(const ops::KvWriteParams& p, cudaStream_t stream);

}  // namespace lmx::cuda
