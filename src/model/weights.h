// ModelWeights: every base weight in loramux's canonical layout, ready for the forward pass. All BF16.
// Canonical layouts: linear weights [out, in]; experts gate_up [E, 2I, H] (gate/up order as the family
// stores it, see ModelConfig::gate_up_layout) and down [E, H, I]. The loader converts per-expert
// checkpoints and GPT-OSS's transposed fused tensors into this layout, and dequantizes MXFP4.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "model/config.h"
#include "ops/moe.h"

namespace lmx::ops {
class Backend;
}  // namespace lmx::ops

namespace lmx::model {

struct LayerWeights {
  Tensor input_norm;                      // [H]
  Tensor q, k, v, o;                      // [Hq*D, H], [Hkv*D, H], [Hkv*D, H], [H, Hq*D]
  Tensor q_bias, k_bias, v_bias, o_bias;  // [Hq*D], [Hkv*D], [Hkv*D], [H]; only with attention_bias
  Tensor q_norm, k_norm;                  // [D]; only with qk_norm
  Tensor sinks;                           // [Hq]; only with attention_sinks
  Tensor post_attention_norm;             // [H]
  // MoE families
  Tensor router, router_bias;             // [E, H], [E] (bias only with router_bias)
  Tensor gate_up, gate_up_bias;           // [E, 2I, H], [E, 2I] (bias only with expert_bias)
  Tensor down, down_bias;                 // [E, H, I], [E, H]
  // --mxfp4-experts (GPT-OSS): the experts' MXFP4 copies in the decode layout of ops/mxfp4.h — the
  // checkpoint's own blocks, or a preset's generated ones (gate_up / down are then their exact
  // dequantization). Undefined otherwise. Read by the CUDA decode GEMMs only.
  ops::Mxfp4Weight gate_up_mxfp4, down_mxfp4;
  // dense families
  Tensor mlp_gate, mlp_up, mlp_down;      // [I, H], [I, H], [H, I]
};

struct ModelWeights {
  ModelConfig config;
  Tensor embed;       // [V, H]
  Tensor final_norm;  // [H]
  Tensor lm_head;     // [V, H] (the embedding when tie_word_embeddings)
  std::vector<LayerWeights> layers;
  // Whatever keeps the views above alive: mapped files and converted/generated tensors.
  std::vector<std::shared_ptr<void>> keep_alive;
};

// Load a Hugging Face model directory (config.json + *.safetensors, single or sharded) on the host.
// mxfp4_experts: also keep a GPT-OSS checkpoint's MXFP4 experts in the decode layout (LayerWeights::
// gate_up_mxfp4); refused for checkpoints whose experts are not MXFP4, or do not fit the layout.
// backend (a device one): the expert tensors the loader converts (dequantized MXFP4, their decode-layout
// copies, transposed or stacked experts) are uploaded to it one by one as they are built, so host memory
// holds one layer's experts at a time; everything else stays on the host (mapped or converted) for the
// Model to upload. A cpu backend or none: everything on the host.
Result<ModelWeights> load_model(const std::string& model_dir, bool mxfp4_experts = false,
                                ops::Backend* backend = nullptr);

}  // namespace lmx::model
