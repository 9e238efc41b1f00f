// Router top-k contract: router logits (the router linear's output, bias included) to expert ids and
// weights per token, by each family's rule.
#pragma once
#include "core/status.h"
#include "core/tensor.h"

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

}  // namespace lmx::ops
