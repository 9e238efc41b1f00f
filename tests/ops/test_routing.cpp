// router_topk (ops/routing.h) on the cpu backend against a reference that sorts every expert in double:
// ids must match exactly (ties to the lower id), weights to fp32 precision.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "backends/cpu/cpu_backend.h"
#include "op_test_util.h"

namespace lmx {
namespace {

using ops::RoutingRule;

// Expected (ids, weights) of one token.
std::pair<std::vector<int32_t>, std::vector<double>> reference(const float* logits, int experts, int k,
                                                               RoutingRule rule, bool renormalize) {
  std::vector<double> score(experts);
  if (rule == RoutingRule::kSoftmaxThenTopK) {
    const double m = *std::max_element(logits, logits + experts);
    double sum = 0.0;
    for (int e = 0; e < experts; ++e) sum += std::exp(double(logits[e]) - m);
    for (int e = 0; e < experts; ++e) score[e] = std::exp(double(logits[e]) - m) / sum;
  } else {
    for (int e = 0; e < experts; ++e) score[e] = logits[e];
  }
  std::vector<int32_t> order(experts);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return score[a] > score[b]; });
  order.resize(k);
  std::vector<double> weights(k);
  if (rule == RoutingRule::kSoftmaxThenTopK) {
    double kept = 0.0;
    for (int i = 0; i < k; ++i) kept += score[order[i]];
    for (int i = 0; i < k; ++i) weights[i] = renormalize ? score[order[i]] / kept : score[order[i]];
  } else {
    double sum = 0.0;
    for (int i = 0; i < k; ++i) sum += std::exp(score[order[i]] - score[order[0]]);
    for (int i = 0; i < k; ++i) weights[i] = std::exp(score[order[i]] - score[order[0]]) / sum;
  }
  return {order, weights};
}

// ties: logits drawn from a handful of integers, so many experts share a logit.
void check_router(uint64_t seed, int tokens, int experts, int k, RoutingRule rule, bool renormalize, bool ties) {
  SCOPED_TRACE("T=" + std::to_string(tokens) + " E=" + std::to_string(experts) + " K=" + std::to_string(k) +
               (rule == RoutingRule::kSoftmaxThenTopK ? " softmax-then-topk" : " topk-then-softmax") +
               (renormalize ? " renormalize" : "") + (ties ? " ties" : ""));
  Rng rng(seed);
  OwnedTensor logits = test::random_f32(rng, {tokens, experts}, 3.0f);
  if (ties) {
    for (int i = 0; i < tokens * experts; ++i) logits.view.ptr<float>()[i] = float(rng.next_u64() % 4);
  }
  OwnedTensor ids = OwnedTensor::host(DType::I32, {tokens, k});
  OwnedTensor weights = OwnedTensor::host(DType::F32, {tokens, k});
  test::poison(ids);
  test::poison(weights);
  cpu::CpuBackend backend(1);
  backend.router_topk({.logits = logits,
                       .rule = rule,
                       .renormalize = renormalize,
                       .top_k = k,
                       .topk_ids = ids,
                       .topk_weights = weights});
  std::vector<double> want_weights;
  for (int t = 0; t < tokens; ++t) {
    auto [want_ids, token_weights] = reference(logits.view.ptr<float>() + t * experts, experts, k, rule, renormalize);
    for (int i = 0; i < k; ++i)
      ASSERT_EQ(ids.view.ptr<int32_t>()[t * k + i], want_ids[i]) << "token " << t << " k " << i;
    want_weights.insert(want_weights.end(), token_weights.begin(), token_weights.end());
  }
  EXPECT_TRUE(test::all_close(weights, want_weights, test::kTolElementwise));
}

TEST(RouterTopK, MatchesSortedReference) {
  uint64_t seed = 0;
  for (RoutingRule rule : {RoutingRule::kSoftmaxThenTopK, RoutingRule::kTopKThenSoftmax}) {
    for (bool renormalize : {false, true}) {
      for (bool ties : {false, true}) {
        check_router(++seed, 1, 1, 1, rule, renormalize, ties);    // one expert
        check_router(++seed, 1, 8, 1, rule, renormalize, ties);    // T = 1, K = 1
        check_router(++seed, 9, 8, 2, rule, renormalize, ties);    // Mixtral-like
        check_router(++seed, 17, 32, 4, rule, renormalize, ties);  // GPT-OSS-20b-like
        check_router(++seed, 5, 128, 8, rule, renormalize, ties);  // Qwen3-MoE-like
        check_router(++seed, 3, 6, 6, rule, renormalize, ties);    // K = E
      }
    }
  }
}

TEST(RouterTopK, TiesGoToTheLowerExpertId) {
  OwnedTensor logits = test::f32_tensor({1, 3, 3, 0, 3, 1}, {1, 6});
  OwnedTensor ids = OwnedTensor::host(DType::I32, {1, 4});
  OwnedTensor weights = OwnedTensor::host(DType::F32, {1, 4});
  cpu::CpuBackend backend(1);
  for (RoutingRule rule : {RoutingRule::kSoftmaxThenTopK, RoutingRule::kTopKThenSoftmax}) {
    test::poison(ids);
    backend.router_topk({.logits = logits, .rule = rule, .top_k = 4, .topk_ids = ids, .topk_weights = weights});
    EXPECT_EQ(std::vector<int32_t>(ids.view.ptr<int32_t>(), ids.view.ptr<int32_t>() + 4),
              (std::vector<int32_t>{1, 2, 4, 0}));
  }
}

}  // namespace
}  // namespace lmx
