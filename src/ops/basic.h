// Contracts of the small dense ops: embedding, RMSNorm, linear (x·Wᵀ + b), residual add, SiLU-gated
// product of the dense MLP, and row gather (the sampled rows before the LM head).
// Activations are the backend's activation dtype (F32 on cpu); weights BF16.
#pragma once
#include <array>
#include "core/status.h"
#include "core/tensor.h"

namespace lmx::ops {

struct EmbeddingParams {
  Tensor table;      // [V, H] bf16
  Tensor token_ids;  // [T] i32, each in [0, V)
  Tensor out;        // [T, H]
};
Status check(const EmbeddingParams& p);

// out[n] = x[n] / sqrt(mean(x[n]^2) + eps) * weight. Used per token ([T, H]) and per head ([T*heads, D]).
// With `residual` defined, first x += residual (stored in x's dtype, exactly AddParams{residual, x}) and the
// norm reads that sum: the residual stream's add fused with the next norm (one pass instead of two).
struct RmsNormParams {
  Tensor x;         // [N, C]; written (the sum) when residual is defined
  Tensor weight;    // [C] bf16
  float eps = 1e-6f;
  Tensor out;       // [N, C], may alias x
  Tensor residual;  // [N, C], optional; disjoint from x and out
};
Status check(const RmsNormParams& p);

// out = x·weightᵀ (+ bias). fp32 accumulation.
struct LinearParams {
  Tensor x;       // [T, in]
  Tensor weight;  // [out, in] bf16
  Tensor bias;    // [out] bf16, optional
  Tensor out;     // [T, out] of x's dtype, or F32 (logits); must not alias x
};
Status check(const LinearParams& p);

// y += x
struct AddParams {
  Tensor x;  // [N, C]
  Tensor y;  // [N, C]
};
Status check(const AddParams& p);

// out = silu(gate) * up (Llama/Qwen3 dense MLP).
struct SiluMulParams {
  Tensor gate;  // [T, I]
  Tensor up;    // [T, I]
  Tensor out;   // [T, I], may alias gate
};
Status check(const SiluMulParams& p);

// out[b] = x[index[b]]
struct GatherRowsParams {
  Tensor x;      // [T, C]
  Tensor index;  // [B] i32, each in [0, T)
  Tensor out;    // [B, C]
};
Status check(const GatherRowsParams& p);

// parts[i] = x[:, c_i : c_i + C_i] with c_0 = 0, c_{i+1} = c_i + C_i: the column blocks of one fused product
// (q | k | v of a fused QKV projection) copied into their own contiguous tensors. Unused parts stay undefined.
struct SplitColumnsParams {
  Tensor x;                     // [T, C]
  std::array<Tensor, 3> parts;  // [T, C_i] of x's dtype, sum of C_i == C; disjoint from x
};
Status check(const SplitColumnsParams& p);

}  // namespace lmx::ops
