// Router top-k kernel (ops/routing.h) and its launcher: one warp per token, detail::router_topk_warp
// (device.cuh; the router product's fused tail in linear.cu runs the same function).
#include "backends/cuda/routing.cuh"

#include "backends/cuda/check.h"
#include "backends/cuda/device.cuh"
#include "backends/cuda/launch.cuh"
#include "ops/backend.h"

namespace lmx::cuda {
namespace {

// ---- kernels ------------------------------------------------------------------------------------------

constexpr int kRouterWarps = 4;

struct RouterKernelParams {
  const float* logits;  // [T, E] f32
  int32_t* topk_ids;    // [T, K] i32
  float* topk_weights;  // [T, K] f32
  int tokens;           // T
  int experts;          // E
  int top_k;            // K
  bool softmax_first;   // RoutingRule::kSoftmaxThenTopK
  bool renormalize;
};

// PRECOND: blockDim.x == 32 * kRouterWarps; 1 <= K <= min(E, kRouterMaxTopK); no NaN logits.
__global__ static void router_topk_kernel(const __grid_constant__ RouterKernelParams p) {
  detail::pdl_enter();  // first: launched by detail::launch (launch.cuh)
  const int token = blockIdx.x * kRouterWarps + threadIdx.x / 32;
  if (token >= p.tokens) return;  // whole warps leave together
  detail::router_topk_warp(p.logits + int64_t(token) * p.experts, p.experts, p.top_k, p.softmax_first,
                           p.renormalize, p.topk_ids + int64_t(token) * p.top_k,
                           p.topk_weights + int64_t(token) * p.top_k);
}

}  // namespace

// ---- launchers ----------------------------------------------------------------------------------------

void router_topk(const ops::RouterTopKParams& p, cudaStream_t stream) {
  ops::require(ops::check(p), "cuda::router_topk");
  detail::require_cuda("router_topk",
                       {{"logits", &p.logits}, {"topk_ids", &p.topk_ids}, {"topk_weights", &p.topk_weights}});
  if (p.top_k > detail::kRouterMaxTopK) {
    detail::contract_failure("router_topk", "topk_ids", p.topk_ids, "K <= 32 (one pick per lane of a warp)");
  }
  const int64_t tokens = p.logits.dim(0), experts = p.logits.dim(1);
  if (tokens == 0) return;
  LMX_CHECK(tokens <= 0x7fffffff && experts <= 0x7fffffff);
  const RouterKernelParams params{.logits = static_cast<const float*>(p.logits.data),
                                  .topk_ids = static_cast<int32_t*>(p.topk_ids.data),
                                  .topk_weights = static_cast<float*>(p.topk_weights.data),
                                  .tokens = int(tokens),
                                  .experts = int(experts),
                                  .top_k = p.top_k,
                                  .softmax_first = p.rule == ops::RoutingRule::kSoftmaxThenTopK,
                                  .renormalize = p.renormalize};
  detail::launch(router_topk_kernel, dim3(detail::blocks_for(tokens, kRouterWarps)), dim3(32 * kRouterWarps), 0, stream, params);
  LMX_CUDA_CHECK_LAUNCH();
}

}  // namespace lmx::cuda
