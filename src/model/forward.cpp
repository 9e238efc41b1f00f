// The forward pass: embedding → per layer (norm → q/k/v (+LoRA) → [qk-norm] → RoPE → KV write → paged
// attention → o (+LoRA) → residual → norm → router top-k + MoE (+MoE-LoRA) or dense MLP (+LoRA) →
// residual) → final norm and LM head on the sampled rows only.
#include "model/forward.h"

#include <array>
#include <cmath>

namespace lmx::model {

using ops::LoraTarget;

uint64_t KvCache::bytes() const {
  uint64_t n = 0;
  for (const auto* side : {&k, &v})
    for (const OwnedTensor& t : *side) n += t.view.nbytes();
  return n;
}

KvCache KvCache::allocate(ops::Backend& backend, const ModelConfig& config, int num_pages, int page_size) {
  KvCache cache;
  cache.num_pages = num_pages;
  cache.page_size = page_size;
  for (int l = 0; l < config.num_layers; ++l) {
    cache.k.push_back(backend.empty(backend.activation_dtype(), {num_pages, page_size, config.num_kv_heads, config.head_dim}));
    cache.v.push_back(backend.empty(backend.activation_dtype(), {num_pages, page_size, config.num_kv_heads, config.head_dim}));
    backend.fill_zero(cache.k.back());
    backend.fill_zero(cache.v.back());
  }
  return cache;
}

Model::Model(const ModelWeights& weights, ops::Backend& backend, const ModelLimits& limits)
    : config_(weights.config), limits_(limits), backend_(backend) {
  LMX_CHECK(limits.max_tokens > 0 && limits.max_seqs > 0);
  // Weights: the cpu backend reads the host views directly; other backends get device copies.
  device_weights_ = weights;
  if (backend.device() != Device::kCpu) {
    bool generated_in_place = false;  // presets on a GPU: weights already live on the device
    auto up = [&](Tensor& t) {
      if (!t.defined()) return;
      if (t.device == backend.device()) {
        generated_in_place = true;
        return;
      }
      uploads_.push_back(backend.upload(t));
      t = uploads_.back().view;
    };
    up(device_weights_.embed);
    up(device_weights_.final_norm);
    if (weights.lm_head.data == weights.embed.data) device_weights_.lm_head = device_weights_.embed;
    else up(device_weights_.lm_head);
    fuse_qkv(weights);
    for (LayerWeights& lw : device_weights_.layers) {
      for (Tensor* t : {&lw.input_norm, &lw.o, &lw.o_bias,
                        &lw.q_norm, &lw.k_norm, &lw.sinks, &lw.post_attention_norm, &lw.router, &lw.router_bias,
                        &lw.gate_up, &lw.gate_up_bias, &lw.down, &lw.down_bias, &lw.mlp_gate, &lw.mlp_up,
                        &lw.mlp_down, &lw.gate_up_mxfp4.blocks, &lw.gate_up_mxfp4.scales, &lw.down_mxfp4.blocks,
                        &lw.down_mxfp4.scales})
        up(*t);
    }
    // Host buffers are not kept (their device copies are in uploads_); device-generated weights are owned here.
    if (!generated_in_place) device_weights_.keep_alive.clear();
  }

  ops::RopeTable rope = ops::make_rope_table(config_.rope, config_.head_dim);
  OwnedTensor host_inv_freq = OwnedTensor::host(DType::F32, {int64_t(rope.inv_freq.size())});
  for (size_t i = 0; i < rope.inv_freq.size(); ++i) host_inv_freq.view.ptr<float>()[i] = rope.inv_freq[i];
  inv_freq_ = backend.upload(host_inv_freq);
  rope_attention_scaling_ = rope.attention_scaling;

  const int64_t T = limits.max_tokens, B = limits.max_seqs, H = config_.hidden_size;
  const DType act = backend.activation_dtype();
  hidden_ = backend.empty(act, {T, H});
  normed_ = backend.empty(act, {T, H});
  q_ = backend.empty(act, {T, config_.q_dim()});
  k_ = backend.empty(act, {T, config_.kv_dim()});
  v_ = backend.empty(act, {T, config_.kv_dim()});
  if (!qkv_weight_.empty()) qkv_ = backend.empty(act, {T, config_.q_dim() + 2 * config_.kv_dim()});
  attn_out_ = backend.empty(act, {T, config_.q_dim()});
  block_out_ = backend.empty(act, {T, H});
  if (config_.is_moe()) {
    router_logits_ = backend.empty(DType::F32, {T, config_.num_experts});
    topk_ids_ = backend.empty(DType::I32, {T, config_.experts_per_token});
    topk_weights_ = backend.empty(DType::F32, {T, config_.experts_per_token});
  } else {
    mlp_gate_ = backend.empty(act, {T, config_.intermediate_size});
    mlp_up_ = backend.empty(act, {T, config_.intermediate_size});
  }
  sampled_ = backend.empty(act, {B, H});
  logits_ = backend.empty(DType::F32, {B, config_.vocab_size});
}

// One [Hq*D + 2*Hkv*D, H] weight (and bias) per layer on the device, q, k, v being its row blocks: one
// product instead of three, where three small ones read their weights far below bandwidth (decode). Tensors
// the preset generator already laid out back to back on the device are used in place; anything else (host
// checkpoints, scattered device tensors) is copied into one new allocation. The q/k/v views of
// device_weights_ then point into it, so nothing is uploaded twice.
void Model::fuse_qkv(const ModelWeights& weights) {
  const int64_t H = config_.hidden_size, q_dim = config_.q_dim(), kv_dim = config_.kv_dim();
  const int64_t bounds[4] = {0, q_dim, q_dim + kv_dim, q_dim + 2 * kv_dim};
  auto fuse = [&](std::array<Tensor*, 3> parts, bool matrix) -> Tensor {
    bool adjacent = true;
    for (int i = 0; i < 3; ++i) {
      adjacent = adjacent && parts[size_t(i)]->device == backend_.device();
      if (i > 0) {
        adjacent = adjacent && static_cast<char*>(parts[size_t(i) - 1]->data) + parts[size_t(i) - 1]->nbytes() ==
                                   parts[size_t(i)]->data;
      }
    }
    const int64_t rows = bounds[3];
    Tensor fused;
    if (adjacent) {
      fused = matrix ? Tensor(parts[0]->data, parts[0]->dtype, {rows, H}, backend_.device())
                     : Tensor(parts[0]->data, parts[0]->dtype, {rows}, backend_.device());
    } else {
      uploads_.push_back(matrix ? backend_.empty(parts[0]->dtype, {rows, H}) : backend_.empty(parts[0]->dtype, {rows}));
      fused = uploads_.back().view;
      for (int i = 0; i < 3; ++i) backend_.copy(fused.rows(bounds[i], bounds[i + 1]), *parts[size_t(i)]);
    }
    for (int i = 0; i < 3; ++i) *parts[size_t(i)] = fused.rows(bounds[i], bounds[i + 1]);
    return fused;
  };
  for (size_t l = 0; l < device_weights_.layers.size(); ++l) {
    LayerWeights& lw = device_weights_.layers[l];
    const LayerWeights& host = weights.layers[l];
    LMX_CHECK(host.q.defined() && host.k.defined() && host.v.defined());
    qkv_weight_.push_back(fuse({&lw.q, &lw.k, &lw.v}, true));
    qkv_bias_.push_back(lw.q_bias.defined() ? fuse({&lw.q_bias, &lw.k_bias, &lw.v_bias}, false) : Tensor{});
  }
}

void Model::dump(const char* name, int layer, const Tensor& t) const {
  if (dump_) dump_(name, layer, t);
}

// out = x·Wᵀ + b, then the adapter's LoRA for the tokens that have one (one backend call: cuda fuses them).
void Model::linear_lora(const Tensor& x, const Tensor& weight, const Tensor& bias, int layer, LoraTarget target,
                        const BatchView& batch, const LoraLookup& lora, const Tensor& out) {
  ops::LinearLoraParams p{.linear = {.x = x, .weight = weight, .bias = bias, .out = out}};
  if (batch.any_lora) {
    p.lora[0] = lora(layer, target);
    if (p.lora[0].defined()) {
      p.token_slot = batch.token_slot.rows(0, x.dim(0));
      set_runs(batch, &p);
    }
  }
  backend_.linear_lora(p);
}

// The batch's run hint, where the projection covers the whole batch.
void Model::set_runs(const BatchView& batch, ops::LinearLoraParams* p) const {
  if (p->linear.x.dim(0) != batch.num_tokens) return;
  p->runs = batch.lora_runs;
  p->rest_rows = batch.lora_rest_rows;
}

void Model::attention_block(int layer, const BatchView& batch, KvCache& cache, const LoraLookup& lora, int T) {
  const LayerWeights& w = device_weights_.layers[size_t(layer)];
  const int Hq = config_.num_heads, Hkv = config_.num_kv_heads, D = config_.head_dim;
  Tensor normed = normed_.view.rows(0, T);
  Tensor q = q_.view.rows(0, T), k = k_.view.rows(0, T), v = v_.view.rows(0, T);

  Tensor q3 = q.reshape({T, Hq, D}), k3 = k.reshape({T, Hkv, D}), v3 = v.reshape({T, Hkv, D});
  ops::RopeParams rope{.q = q3, .k = k3, .positions = batch.positions, .inv_freq = inv_freq_,
                       .attention_scaling = rope_attention_scaling_};
  if (config_.qk_norm) {  // Qwen3: per-head RMSNorm before RoPE (one kernel with the rotation on cuda)
    rope.q_norm = w.q_norm;
    rope.k_norm = w.k_norm;
    rope.norm_eps = config_.rms_norm_eps;
  }
  const ops::KvWriteParams kv{.k = k3, .v = v3, .kv_write_index = batch.kv_write_index,
                              .k_cache = cache.k[size_t(layer)], .v_cache = cache.v[size_t(layer)]};
  if (qkv_weight_.empty()) {
    linear_lora(normed, w.q, w.q_bias, layer, LoraTarget::kQ, batch, lora, q);
    linear_lora(normed, w.k, w.k_bias, layer, LoraTarget::kK, batch, lora, k);
    linear_lora(normed, w.v, w.v_bias, layer, LoraTarget::kV, batch, lora, v);
    backend_.rope_kv_write(rope, kv);
  } else {
    // One product for q|k|v, split into q, k and v with their LoRA (one group: one launch pair on cuda), then
    // the rotation and the cache write (the split folded into the rotation where no adapter applies, on cuda).
    ops::LinearLoraParams p{.linear = {.x = normed, .weight = qkv_weight_[size_t(layer)], .bias = qkv_bias_[size_t(layer)],
                                       .out = qkv_.view.rows(0, T)},
                            .parts = {q, k, v}};
    if (batch.any_lora) {
      p.lora = {lora(layer, LoraTarget::kQ), lora(layer, LoraTarget::kK), lora(layer, LoraTarget::kV)};
      if (p.lora[0].defined() || p.lora[1].defined() || p.lora[2].defined()) {
        p.token_slot = batch.token_slot.rows(0, T);
        set_runs(batch, &p);
      }
    }
    backend_.qkv_rope_kv_write(p, rope, kv);
  }
  dump("q", layer, q);
  dump("k", layer, k);
  const bool sliding = config_.sliding_window > 0 && config_.layer_sliding[size_t(layer)];
  Tensor attn = attn_out_.view.rows(0, T);
  backend_.attention({.q = q3,
                      .k_cache = cache.k[size_t(layer)],
                      .v_cache = cache.v[size_t(layer)],
                      .block_table = batch.block_table,
                      .seq_start = batch.seq_start,
                      .positions = batch.positions,
                      .sinks = w.sinks,
                      .sliding_window = sliding ? config_.sliding_window : 0,
                      .softmax_scale = 1.0f / std::sqrt(float(D)),
                      .out = attn.reshape({T, Hq, D})});
  dump("attention", layer, attn);
  linear_lora(attn, w.o, w.o_bias, layer, LoraTarget::kO, batch, lora, block_out_.view.rows(0, T));
}

void Model::mlp_block(int layer, const BatchView& batch, const LoraLookup& lora, int T) {
  const LayerWeights& w = device_weights_.layers[size_t(layer)];
  Tensor normed = normed_.view.rows(0, T);
  Tensor out = block_out_.view.rows(0, T);
  if (config_.is_moe()) {
    Tensor logits = router_logits_.view.rows(0, T);
    Tensor ids = topk_ids_.view.rows(0, T), weights = topk_weights_.view.rows(0, T);
    backend_.route({.x = normed,
                    .weight = w.router,
                    .bias = w.router_bias,
                    .logits = logits,
                    .rule = config_.routing,
                    .renormalize = config_.norm_topk_prob,
                    .top_k = config_.experts_per_token,
                    .topk_ids = ids,
                    .topk_weights = weights});
    dump("router_logits", layer, logits);
    ops::MoeParams p{.x = normed,
                     .topk_ids = ids,
                     .topk_weights = weights,
                     .gate_up = w.gate_up,
                     .gate_up_bias = w.gate_up_bias,
                     .down = w.down,
                     .down_bias = w.down_bias,
                     .activation = config_.moe_activation,
                     .layout = config_.gate_up_layout,
                     .swiglu_alpha = config_.swiglu_alpha,
                     .swiglu_limit = config_.swiglu_limit,
                     .out = out};
    p.gate_up_mxfp4 = w.gate_up_mxfp4;  // --mxfp4-experts (the CUDA decode GEMMs read them)
    p.down_mxfp4 = w.down_mxfp4;
    if (batch.any_lora) {
      p.token_slot = batch.token_slot;
      p.lora_scattered_tokens = batch.lora_scattered_tokens;
      p.lora_gate_up = lora(layer, LoraTarget::kMoeGateUp);
      p.lora_down = lora(layer, LoraTarget::kMoeDown);
    }
    backend_.moe(p);
  } else {
    Tensor gate = mlp_gate_.view.rows(0, T), up = mlp_up_.view.rows(0, T);
    linear_lora(normed, w.mlp_gate, Tensor{}, layer, LoraTarget::kGate, batch, lora, gate);
    linear_lora(normed, w.mlp_up, Tensor{}, layer, LoraTarget::kUp, batch, lora, up);
    backend_.silu_mul({.gate = gate, .up = up, .out = gate});
    linear_lora(gate, w.mlp_down, Tensor{}, layer, LoraTarget::kDown, batch, lora, out);
  }
  dump("mlp", layer, out);
}

Tensor Model::forward(const BatchView& batch, KvCache& cache, const LoraLookup& lora) {
  const int T = batch.num_tokens;
  LMX_CHECK(T > 0 && T <= limits_.max_tokens && batch.num_seqs <= limits_.max_seqs);
  LMX_CHECK(batch.num_samples <= batch.num_seqs);
  Tensor hidden = hidden_.view.rows(0, T), normed = normed_.view.rows(0, T), block_out = block_out_.view.rows(0, T);
  backend_.embedding({.table = device_weights_.embed, .token_ids = batch.token_ids, .out = hidden});
  dump("embedding", -1, hidden);
  // Each block's output joins the residual stream inside the next norm (RmsNormParams.residual: one pass
  // instead of add + norm), except with an activation dump, which wants the stream after every layer.
  const bool fuse_residual = !has_activation_dump();
  for (int layer = 0; layer < config_.num_layers; ++layer) {
    const LayerWeights& w = device_weights_.layers[size_t(layer)];
    const bool pending = fuse_residual && layer > 0;  // the previous MLP's output is not yet in hidden
    backend_.rms_norm({.x = hidden, .weight = w.input_norm, .eps = config_.rms_norm_eps, .out = normed,
                       .residual = pending ? block_out : Tensor{}});
    attention_block(layer, batch, cache, lora, T);
    if (fuse_residual) {
      backend_.rms_norm({.x = hidden, .weight = w.post_attention_norm, .eps = config_.rms_norm_eps, .out = normed,
                         .residual = block_out});
    } else {
      backend_.add({.x = block_out, .y = hidden});
      backend_.rms_norm({.x = hidden, .weight = w.post_attention_norm, .eps = config_.rms_norm_eps, .out = normed});
    }
    mlp_block(layer, batch, lora, T);
    if (!fuse_residual) {
      backend_.add({.x = block_out, .y = hidden});
      dump("residual", layer, hidden);
    }
  }
  if (fuse_residual) backend_.add({.x = block_out, .y = hidden});  // the last MLP's output
  const int S = batch.num_samples;
  if (S == 0) return logits_.view.rows(0, 0);
  Tensor sampled = sampled_.view.rows(0, S);
  backend_.gather_rows({.x = hidden, .index = batch.sample_index, .out = sampled});
  backend_.rms_norm({.x = sampled, .weight = device_weights_.final_norm, .eps = config_.rms_norm_eps, .out = sampled});
  Tensor logits = logits_.view.rows(0, S);
  backend_.linear({.x = sampled, .weight = device_weights_.lm_head, .out = logits});
  dump("logits", -1, logits);
  return logits;
}

}  // namespace lmx::model
