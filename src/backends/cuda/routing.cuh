// Entry point of the router top-k on cuda (contract in ops/routing.h): router logits [T, E] f32 to expert
// ids and weights [T, K], by either RoutingRule. The router linear itself (a GEMV/GEMM) is not here.
// Callers: tests, bench, (later) the CUDA backend's MoE block.
#pragma once
#include <cuda_runtime_api.h>

#include "ops/routing.h"

namespace lmx::cuda {

// One warp per token; any E, K <= 32. Ids match the CPU oracle exactly (same order: descending logit,
// ties to the lower id); weights within docs/NUMERICS.md's router row.
void router_topk(const ops::RouterTopKParams& p, cudaStream_t stream);

}  // namespace lmx::cuda
