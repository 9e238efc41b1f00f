// Router top-k contract: router logits (the router linear's output, bias included) to expert ids and
// weights per token, by each family's rule.
#pragma once
#include "core/status.h"
#include "core/tensor.h"
#include "ops/basic.h"

namespace lmx::ops {

enum class RoutingRule {
  kSoftmaxThenTopK,  // Qwen3-MoE, Mixtral: softmax over all E, take top-k (renormalize if asked)
  kTopKThenSoftmax,  // GPT-OSS: take the top-k logits, softmax over those k
};

struct RouterTopKParams {
  Tensor logits;  // [T, E] f32
  RoutingRule rule = RoutingRule::kSoftmaxThenTopK;
  bool renormalize = true;  // only for kSoftmaxThenTopK
  int top_k = 1;
  Tensor topk_ids;      // [T, K] i32, in descending weight order; ties go to the lower expert id
  Tensor topk_weights;  // [T, K] f32
};
Status check(const RouterTopKParams& p);

// The router's product and its top-k as one op (Backend::route): logits = x·Wᵀ + b in f32, then the top-k
// of RouterTopKParams on them. Backends that fuse the two (cuda, at decode sizes) write the same logits, ids
// and weights as the two ops one after the other, bit for bit.
struct RouteParams {
  Tensor x;       // [T, H], the activation dtype
  Tensor weight;  // [E, H] bf16
  Tensor bias;    // [E] bf16, optional
  Tensor logits;  // [T, E] f32, written (the model's dump reads it)
  RoutingRule rule = RoutingRule::kSoftmaxThenTopK;
  bool renormalize = true;
  int top_k = 1;
  Tensor topk_ids;      // [T, K] i32
  Tensor topk_weights;  // [T, K] f32

  LinearParams linear() const { return {.x = x, .weight = weight, .bias = bias, .out = logits}; }
  RouterTopKParams topk() const {
    return {.logits = logits, .rule = rule, .renormalize = renormalize, .top_k = top_k, .topk_ids = topk_ids,
            .topk_weights = topk_weights};
  }
};
Status check(const RouteParams& p);

}  // namespace lmx::ops
