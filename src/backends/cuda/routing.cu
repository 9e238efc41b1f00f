// Router top-k kernel (ops/routing.h) and its launcher. One warp per token: a max pass, a sum-of-exp pass
// (softmax-then-top-k only), then K selection passes, each a warp argmax over the logits strictly after
// the previous pick in the total order (logit descending, id ascending) — no per-token scratch, so any E.
// The order is taken on the logits for both rules: softmax is monotone, so it is the oracle's order
// unless two probabilities round to the same fp32 value (docs/NUMERICS.md).
#include "backends/cuda/routing.cuh"

#include <cfloat>

#include "backends/cuda/check.h"
#include "backends/cuda/launch.cuh"
#include "ops/backend.h"

namespace lmx::cuda {
namespace {

// ---- kernels ------------------------------------------------------------------------------------------

constexpr int kMaxTopK = 32;  // the chosen logits of a token live in one register per lane
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

// (value, id) ranks before (other_value, other_id): the oracle's order.
__device__ __forceinline__ bool ranks_before(float value, int id, float other_value, int other_id) {
  return value > other_value || (value == other_value && id < other_id);
}

// PRECOND: blockDim.x == 32 * kRouterWarps; 1 <= K <= min(E, kMaxTopK); no NaN logits (the oracle
// rejects them; a NaN never ranks before anything, so it is never picked here).
__global__ static void router_topk_kernel(const __grid_constant__ RouterKernelParams p) {
  detail::pdl_enter();  // first: launched by detail::launch (launch.cuh)
  const int lane = threadIdx.x % 32;
  const int token = blockIdx.x * kRouterWarps + threadIdx.x / 32;
  if (token >= p.tokens) return;  // whole warps leave together
  const float* logits = p.logits + int64_t(token) * p.experts;

  float max_logit = -FLT_MAX;
  for (int e = lane; e < p.experts; e += 32) max_logit = fmaxf(max_logit, logits[e]);
  for (int offset = 16; offset > 0; offset /= 2) max_logit = fmaxf(max_logit, __shfl_xor_sync(~0u, max_logit, offset));
  float sum_exp = 0.0f;
  if (p.softmax_first) {
    for (int e = lane; e < p.experts; e += 32) sum_exp += expf(logits[e] - max_logit);
    for (int offset = 16; offset > 0; offset /= 2) sum_exp += __shfl_xor_sync(~0u, sum_exp, offset);
  }

  // Lane k keeps the k-th pick's logit and id.
  float prev_value = FLT_MAX, my_value = 0.0f;
  int prev_id = -1, my_id = 0;
  for (int k = 0; k < p.top_k; ++k) {
    float best_value = -FLT_MAX;
    int best_id = INT_MAX;
    for (int e = lane; e < p.experts; e += 32) {
      const float v = logits[e];
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
  if (p.softmax_first) {
    weight = expf(my_value - max_logit) / sum_exp;
    if (p.renormalize) {
      float chosen_sum = 0.0f;
      for (int k = 0; k < p.top_k; ++k) chosen_sum += __shfl_sync(~0u, weight, k);
      weight /= chosen_sum;
    }
  } else {
    const float top = __shfl_sync(~0u, my_value, 0);
    weight = expf(my_value - top);
    float sum = 0.0f;
    for (int k = 0; k < p.top_k; ++k) sum += __shfl_sync(~0u, weight, k);
    weight /= sum;
  }
  if (lane < p.top_k) {
    p.topk_ids[int64_t(token) * p.top_k + lane] = my_id;
    p.topk_weights[int64_t(token) * p.top_k + lane] = weight;
  }
}

}  // namespace

// ---- launchers ----------------------------------------------------------------------------------------

void router_topk(const ops::RouterTopKParams& p, cudaStream_t stream) {
  ops::require(ops::check(p), "cuda::router_topk");
  detail::require_cuda("router_topk",
                       {{"logits", &p.logits}, {"topk_ids", &p.topk_ids}, {"topk_weights", &p.topk_weights}});
  if (p.top_k > kMaxTopK) {
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
