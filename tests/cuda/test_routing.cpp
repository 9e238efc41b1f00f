// Parity of the CUDA router top-k (backends/cuda/routing.cuh) with CpuBackend::router_topk: both rules,
// renormalize on and off, E from 8 to 512 (Qwen3 128/8, GPT-OSS 32/4, a 512-expert router), K up to 32,
// a row of equal logits (ties go to the lower id). Ids exact; weights within 1e-6 absolute.
#include <cmath>
#include <vector>

#include "backends/cuda/routing.cuh"
#include "cuda_test_util.h"
#include "ops/routing.h"

namespace lmx::test {
namespace {

class CudaRouting : public CudaTest {};

TEST_F(CudaRouting, MatchesCpu) {
  struct Case { int64_t tokens, experts; int top_k; };
  const std::vector<Case> cases = {{1, 8, 1},    {3, 8, 2},     {16, 32, 4},   {257, 32, 4},
                                   {64, 128, 8}, {1024, 128, 8}, {5, 512, 32}, {33, 512, 10}, {0, 32, 4}};
  const std::vector<std::pair<ops::RoutingRule, bool>> rules = {{ops::RoutingRule::kSoftmaxThenTopK, true},
                                                                 {ops::RoutingRule::kSoftmaxThenTopK, false},
                                                                 {ops::RoutingRule::kTopKThenSoftmax, true}};
  for (const Case& c : cases) {
    for (const auto& [rule, renormalize] : rules) {
      SCOPED_TRACE("T " + std::to_string(c.tokens) + " E " + std::to_string(c.experts) + " K " +
                   std::to_string(c.top_k) + " rule " + std::to_string(int(rule)) + " renorm " +
                   std::to_string(renormalize));
      OwnedTensor logits = OwnedTensor::host(DType::F32, {c.tokens, c.experts});
      for (int64_t i = 0; i < logits.view.numel(); ++i) logits.view.ptr<float>()[i] = 2.0f * rng().normal();
      if (c.tokens > 1) {  // one row of equal logits and one with a repeated maximum: the tie rule
        for (int64_t e = 0; e < c.experts; ++e) logits.view.ptr<float>()[e] = 0.5f;
        float* row = logits.view.ptr<float>() + c.experts;
        row[c.experts - 1] = row[c.experts / 2] = 9.0f;
      }
      OwnedTensor want_ids = OwnedTensor::host(DType::I32, {c.tokens, c.top_k});
      OwnedTensor want_weights = OwnedTensor::host(DType::F32, {c.tokens, c.top_k});
      cpu_.router_topk({.logits = logits, .rule = rule, .renormalize = renormalize, .top_k = c.top_k,
                        .topk_ids = want_ids, .topk_weights = want_weights});

      OwnedTensor d_logits = cuda::upload(logits);
      OwnedTensor d_ids = poisoned(DType::I32, {c.tokens, c.top_k});
      OwnedTensor d_weights = poisoned(DType::F32, {c.tokens, c.top_k});
      cuda::router_topk({.logits = d_logits, .rule = rule, .renormalize = renormalize, .top_k = c.top_k,
                         .topk_ids = d_ids, .topk_weights = d_weights},
                        stream_);
      sync();
      EXPECT_TRUE(bitwise_equal(cuda::download(d_ids), want_ids)) << "ids";
      OwnedTensor got_weights = cuda::download(d_weights);
      int64_t bad = 0;
      for (int64_t i = 0; i < got_weights.view.numel(); ++i) {
        const float g = got_weights.view.ptr<float>()[i], w = want_weights.view.ptr<float>()[i];
        if (!(std::abs(g - w) <= 1e-6f) && bad++ < 5) ADD_FAILURE() << "weight [" << i << "] got " << g << " want " << w;
      }
      EXPECT_EQ(bad, 0);
    }
  }
}

}  // namespace
}  // namespace lmx::test
