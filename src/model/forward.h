// Model: the batched forward pass of design.md §3, written once against ops::Backend. It owns the base
// weights on the backend's device and every scratch buffer (sized at construction from the limits; nothing
// allocates per step). One call runs the flat batch — prefill chunks and decode tokens of many sequences,
// each token with its own adapter slot — and returns logits of the sampled rows only.
// Who calls: the engine's runner. Does not schedule, sample or own the KV cache.
#pragma once
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "model/weights.h"
#include "ops/backend.h"

namespace lmx::model {

// One engine step as device tensors (design.md §3). T tokens of B sequences; S = number of sampled rows.
struct BatchView {
  int num_tokens = 0;   // T
  int num_seqs = 0;     // B
  int num_samples = 0;  // S <= B: sequences whose last scheduled token is sampled
  Tensor token_ids;       // [T] i32
  Tensor positions;       // [T] i32
  Tensor token_slot;      // [T] i32, adapter slot per token, -1 = base
  Tensor seq_start;       // [B+1] i32
  Tensor block_table;     // [B, max_pages] i32
  Tensor kv_write_index;  // [T] i32
  Tensor sample_index;    // [S] i32 rows of the flat batch whose logits are wanted
  bool any_lora = false;  // false: no token has an adapter, so no LoRA op is launched at all
  int64_t lora_scattered_tokens = -1;  // ops::MoeParams::lora_scattered_tokens of this batch (-1: unknown)
  // Long runs of one slot in token_slot (host memory; empty in recordings) and the rows holding every other
  // token with a slot: ops::LinearLoraParams::runs / rest_rows for the dense projections.
  std::span<const ops::LoraRun> lora_runs;
  int64_t lora_rest_rows = -1;
};

// Paged cache of every layer, [pages, P, Hkv, D] in the backend's activation dtype.
struct KvCache {
  int num_pages = 0;
  int page_size = 0;  // P
  std::vector<OwnedTensor> k, v;
  static KvCache allocate(ops::Backend& backend, const ModelConfig& config, int num_pages, int page_size);
  uint64_t bytes() const;  // every layer's K and V pages
};

// The LoRA stacks the forward pass reads: lora(layer, target); undefined stack = nothing to apply.
using LoraLookup = std::function<ops::LoraStack(int layer, ops::LoraTarget target)>;

// Called with (name, layer, tensor) after each named stage when set: `--dump-activations` and debugging
// a failing parity test (layer -1 for whole-model stages). The tensor lives on the backend's device.
using ActivationDump = std::function<void(const std::string& name, int layer, const Tensor& value)>;

struct ModelLimits {
  int max_tokens = 0;  // T per step
  int max_seqs = 0;    // B per step
};

class Model {
 public:
  // Uploads `weights` to the backend (the cpu backend keeps using the host views).
  Model(const ModelWeights& weights, ops::Backend& backend, const ModelLimits& limits);
  const ModelConfig& config() const { return config_; }
  const ModelLimits& limits() const { return limits_; }
  // The weights as this model uses them (on its backend's device): another Model on a second backend of the
  // same device (the engine's prefill lane) is built from these and uploads nothing.
  const ModelWeights& device_weights() const { return device_weights_; }

  // Runs the batch and returns logits [S, V] (f32, a view of an internal buffer valid until the next call).
  Tensor forward(const BatchView& batch, KvCache& cache, const LoraLookup& lora);

  void set_activation_dump(ActivationDump dump) { dump_ = std::move(dump); }
  bool has_activation_dump() const { return bool(dump_); }

 private:
  void attention_block(int layer, const BatchView& batch, KvCache& cache, const LoraLookup& lora, int T);
  void mlp_block(int layer, const BatchView& batch, const LoraLookup& lora, int T);
  void set_runs(const BatchView& batch, ops::LinearLoraParams* p) const;
  void linear_lora(const Tensor& x, const Tensor& weight, const Tensor& bias, int layer, ops::LoraTarget target,
                   const BatchView& batch, const LoraLookup& lora, const Tensor& out);
  void dump(const char* name, int layer, const Tensor& t) const;
  void fuse_qkv(const ModelWeights& weights);

  ModelConfig config_;
  ModelLimits limits_;
  ops::Backend& backend_;
  ModelWeights device_weights_;       // views on the backend's device
  std::vector<OwnedTensor> uploads_;  // owns device copies (empty on cpu)
  OwnedTensor inv_freq_;              // [D/2] f32
  float rope_attention_scaling_ = 1.0f;
  // scratch, sized for limits_.max_tokens rows
  OwnedTensor hidden_;        // [T, H] residual stream
  OwnedTensor normed_;        // [T, H]
  OwnedTensor q_, k_, v_;     // [T, Hq*D], [T, Hkv*D], [T, Hkv*D]
  // Fused q|k|v projection (every backend but the cpu one): per layer the weights [Hq*D + 2*Hkv*D, H] and
  // biases as one tensor (q, k, v of device_weights_ are row views of it), and the product's scratch.
  std::vector<Tensor> qkv_weight_, qkv_bias_;
  OwnedTensor qkv_;           // [T, Hq*D + 2*Hkv*D]
  OwnedTensor attn_out_;      // [T, Hq*D]
  OwnedTensor block_out_;     // [T, H] output of attention o-proj / MLP
  OwnedTensor router_logits_; // [T, E] f32
  OwnedTensor topk_ids_;      // [T, K] i32
  OwnedTensor topk_weights_;  // [T, K] f32
  OwnedTensor mlp_gate_, mlp_up_;  // [T, I] dense families
  OwnedTensor sampled_;       // [B, H]
  OwnedTensor logits_;        // [B, V] f32
  ActivationDump dump_;
};

}  // namespace lmx::model
