// Rotary position embedding: the scaling rules (default, YaRN, Llama-3) turned into a table of inverse
// frequencies on the host, and the op that rotates q and k in place (rotate-half / NeoX layout, which
// every supported family uses). Who calls: model forward; RopeScaling is filled by the config parser.
#pragma once
#include <string>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"

namespace lmx::ops {

struct RopeScaling {
  enum class Type { kDefault, kYarn, kLlama3 } type = Type::kDefault;
  double theta = 10000.0;
  double factor = 1.0;
  int original_max_position = 0;  // YaRN and Llama-3
  // YaRN
  double beta_fast = 32.0, beta_slow = 1.0;
  double attention_factor = 0.0;  // 0 = derive (0.1*ln(factor)+1)
  bool truncate = true;           // GPT-OSS sets false
  // Llama-3
  double low_freq_factor = 1.0, high_freq_factor = 4.0;
};

// inv_freq[D/2] and the factor applied to cos/sin (YaRN's attention scaling, 1 otherwise).
struct RopeTable {
  std::vector<float> inv_freq;
  float attention_scaling = 1.0f;
};
// Matches transformers' rope initialisation functions for head dim D (rotary dim = D).
RopeTable make_rope_table(const RopeScaling& scaling, int head_dim);

struct RopeParams {
  Tensor q;          // [T, Hq, D], rotated in place
  Tensor k;          // [T, Hkv, D], rotated in place
  Tensor positions;  // [T] i32
  Tensor inv_freq;   // [D/2] f32
  float attention_scaling = 1.0f;
  // Optional, both or neither (Qwen3's QK-norm): every head of q and of k is first RMS-normalized over its D
  // values with these [D] bf16 weights and norm_eps, exactly as rms_norm on the [T·H, D] view would (rounded
  // to q's dtype), and then rotated. Backends may fuse the two (cuda: one kernel with the rotation).
  Tensor q_norm;
  Tensor k_norm;
  float norm_eps = 1e-6f;
  bool has_qk_norm() const { return q_norm.defined(); }
};
Status check(const RopeParams& p);
// p without its QK-norm (the rotation alone).
RopeParams without_qk_norm(const RopeParams& p);

}  // namespace lmx::ops
