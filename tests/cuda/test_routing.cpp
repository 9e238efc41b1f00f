// Parity of the CUDA router top-k (backends/cuda/routing.cuh) with CpuBackend::router_topk: both rules,
// renormalize on and off, E from 8 to 512 (Qwen3 128/8, GPT-OSS 32/4, a 512-expert router), K up to 32,
// a row of equal logits (ties go to the lower id). Ids exact; weights within 1e-6 absolute. And the router's
// product with its top-k fused into one kernel (LinearRunner::route) against the two kernels, bit for bit
// (T <= 16), or against router_topk on its own logits (a prompt's row blocks).
#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "backends/cuda/linear.cuh"
#include "backends/cuda/routing.cuh"
#include "cuda_test_util.h"
#include "ops/routing.h"

namespace lmx::test {
namespace {

class CudaRouting : public CudaTest {};

TEST_F(CudaRouting, MatchesCpu) {
  struct Case { int64_t tokens, experts; int top_k; };
  const std::vector<Case> cases = {{1, 8, 1},    {3, 8, 2},     {16, 32, 4},   {257, 32, 4},
                                   {64, 128, 8}, {1024, 128, 8}, {5, 512, 32}, {33, 512, 10}, {0, 32, 4},
                                   // the last E held in registers (8 a lane) and the first read every pass
                                   {7, 256, 8},  {3, 257, 4}};
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

// One router on the device for LinearRunner::route: x [T, H], W [E, H] (scaled 1/sqrt(H)), an optional bias.
struct RouteCase {
  int64_t tokens, hidden, experts;
  int top_k;
  ops::RoutingRule rule;
  bool renormalize, bias;
};
struct RouteInputs {
  RouteCase c;
  OwnedTensor x, w, bias;
  RouteInputs(Rng& rng, const RouteCase& route_case) : c(route_case) {
    x = cuda::upload(random_bf16(rng, {c.tokens, c.hidden}));
    w = cuda::upload(random_bf16(rng, {c.experts, c.hidden}, 1.0f / std::sqrt(float(c.hidden))));
    if (c.bias) bias = cuda::upload(random_bf16(rng, {c.experts}, 0.1f));
  }
  std::string describe() const {
    return "T " + std::to_string(c.tokens) + " H " + std::to_string(c.hidden) + " E " + std::to_string(c.experts) +
           " K " + std::to_string(c.top_k);
  }
  // Poisoned logits, ids and weights.
  std::tuple<OwnedTensor, OwnedTensor, OwnedTensor> outputs() const {
    return {poisoned(DType::F32, {c.tokens, c.experts}), poisoned(DType::I32, {c.tokens, c.top_k}),
            poisoned(DType::F32, {c.tokens, c.top_k})};
  }
  ops::RouteParams params(const Tensor& logits, const Tensor& ids, const Tensor& weights) const {
    return {.x = x, .weight = w, .bias = c.bias ? bias.view : Tensor(), .logits = logits, .rule = c.rule,
            .renormalize = c.renormalize, .top_k = c.top_k, .topk_ids = ids, .topk_weights = weights};
  }
};

// route() three times back to back before one sync (each launch finds its counters reset), checking each
// result with `check`, then once captured into a CUDA graph and replayed three times.
template <typename Check>
void route_and_replay(cuda::LinearRunner& runner, const RouteInputs& in, cudaStream_t stream, Check check) {
  for (int launch = 0; launch < 3; ++launch) {
    const auto [logits, ids, weights] = in.outputs();
    EXPECT_TRUE(runner.route(in.params(logits, ids, weights), stream));
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    check(logits, ids, weights, "route");
  }
  const auto [logits, ids, weights] = in.outputs();
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  EXPECT_TRUE(runner.route(in.params(logits, ids, weights), stream));
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int replay = 0; replay < 3; ++replay) ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  check(logits, ids, weights, "route in a graph, replayed");
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

using R = ops::RoutingRule;

// LinearRunner::route (the skinny product with the top-k as its grid's tail) against LinearRunner::run then
// cuda::router_topk: logits, ids and weights bit for bit. Shapes: GPT-OSS's router (E 32, K 4, bias, H 2880:
// a cluster of 8 CTAs splits `in`), Qwen3's (E 128, K 8), a narrow `in` (no cluster: every CTA counts), K 32,
// T 1 and 16. (T > 16: PromptRouteRanksItsOwnLogits.)
TEST_F(CudaRouting, FusedRouteMatchesProductThenTopK) {
  const std::vector<RouteCase> cases = {{16, 2880, 32, 4, R::kTopKThenSoftmax, true, true},
                                        {1, 2880, 32, 4, R::kTopKThenSoftmax, true, true},
                                        {11, 2048, 128, 8, R::kSoftmaxThenTopK, true, false},
                                        {16, 512, 64, 32, R::kSoftmaxThenTopK, false, true},
                                        {5, 256, 8, 2, R::kSoftmaxThenTopK, true, false}};
  cuda::LinearRunner runner;
  for (const RouteCase& c : cases) {
    const RouteInputs in(rng(), c);
    SCOPED_TRACE(in.describe());
    const auto [want_logits, want_ids, want_weights] = in.outputs();
    const ops::RouteParams two = in.params(want_logits, want_ids, want_weights);
    runner.run(two.linear(), stream_);
    cuda::router_topk(two.topk(), stream_);
    sync();
    route_and_replay(runner, in, stream_, [&](const OwnedTensor& logits, const OwnedTensor& ids,
                                              const OwnedTensor& weights, const char* what) {
      EXPECT_TRUE(bitwise_equal(cuda::download(logits), cuda::download(want_logits))) << what << ": logits";
      EXPECT_TRUE(bitwise_equal(cuda::download(ids), cuda::download(want_ids))) << what << ": ids";
      EXPECT_TRUE(bitwise_equal(cuda::download(weights), cuda::download(want_weights))) << what << ": weights";
    });
  }
}

// A prompt's route (T > 16: row blocks of 16, each ranked by its own last CTA; LinearRunner::route): the ids
// and weights are router_topk's on the kernel's own logits, bit for bit, and the logits are cuBLASLt's
// product within 1e-4 (the same sums in another order). GPT-OSS's router at T 17 and 100 (a cluster of 8 CTAs
// splits `in`) and 1600 (no split: 200 CTAs), Qwen3's E 128 K 8 at T 300, a narrow `in` with K 32 at T 40.
TEST_F(CudaRouting, PromptRouteRanksItsOwnLogits) {
  const std::vector<RouteCase> cases = {{17, 2880, 32, 4, R::kTopKThenSoftmax, true, true},
                                        {100, 2880, 32, 4, R::kTopKThenSoftmax, true, true},
                                        {1600, 2880, 32, 4, R::kTopKThenSoftmax, true, true},
                                        {300, 2048, 128, 8, R::kSoftmaxThenTopK, true, false},
                                        {1600, 2048, 128, 8, R::kSoftmaxThenTopK, true, false},
                                        {33, 2880, 200, 6, R::kTopKThenSoftmax, false, true},
                                        {40, 512, 64, 32, R::kSoftmaxThenTopK, false, true}};
  cuda::LinearRunner runner;
  for (const RouteCase& c : cases) {
    const RouteInputs in(rng(), c);
    SCOPED_TRACE(in.describe());
    const OwnedTensor product = poisoned(DType::F32, {c.tokens, c.experts});
    runner.run(in.params(product, Tensor(), Tensor()).linear(), stream_);  // cuBLASLt + the bias kernel
    sync();
    const OwnedTensor want_logits = cuda::download(product);
    route_and_replay(runner, in, stream_, [&](const OwnedTensor& logits, const OwnedTensor& ids,
                                              const OwnedTensor& weights, const char* what) {
      const OwnedTensor got = cuda::download(logits);
      double worst = 0.0;
      for (int64_t i = 0; i < got.view.numel(); ++i) {
        worst = std::max(worst, double(std::abs(got.view.ptr<float>()[i] - want_logits.view.ptr<float>()[i])));
      }
      EXPECT_LE(worst, 1e-4) << what << ": logits against cuBLASLt's product";
      const auto [unused, own_ids, own_weights] = in.outputs();
      cuda::router_topk(in.params(logits, own_ids, own_weights).topk(), stream_);
      sync();
      EXPECT_TRUE(bitwise_equal(cuda::download(ids), cuda::download(own_ids))) << what << ": ids";
      EXPECT_TRUE(bitwise_equal(cuda::download(weights), cuda::download(own_weights))) << what << ": weights";
    });
    // Over more than 32 experts a prompt's route runs 64 outputs a CTA (set_wide_route, the default) or 16:
    // the same logits, ids and weights bit for bit.
    if (c.experts > 32) {
      const auto [wide_logits, wide_ids, wide_weights] = in.outputs();
      EXPECT_TRUE(runner.route(in.params(wide_logits, wide_ids, wide_weights), stream_));
      runner.set_wide_route(false);
      const auto [narrow_logits, narrow_ids, narrow_weights] = in.outputs();
      EXPECT_TRUE(runner.route(in.params(narrow_logits, narrow_ids, narrow_weights), stream_));
      runner.set_wide_route(true);
      sync();
      EXPECT_TRUE(bitwise_equal(cuda::download(wide_logits), cuda::download(narrow_logits))) << "wide vs narrow: logits";
      EXPECT_TRUE(bitwise_equal(cuda::download(wide_ids), cuda::download(narrow_ids))) << "wide vs narrow: ids";
      EXPECT_TRUE(bitwise_equal(cuda::download(wide_weights), cuda::download(narrow_weights))) << "wide vs narrow: weights";
    }
  }
}

}  // namespace
}  // namespace lmx::test
