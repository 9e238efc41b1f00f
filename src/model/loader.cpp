// load_model: Hugging Face tensor names -> LayerWeights in loramux's canonical BF16 layouts (weights.h).
// Handles F32/F16/BF16 checkpoints, per-expert and fused expert tensors, GPT-OSS's transposed fused
// experts and its MXFP4 blocks. BF16 tensors that need no rearranging stay zero-copy views of the mapping;
// converted expert tensors go to the device backend, when one is given, as soon as each is built.
#include <cstring>
#include <filesystem>
#include <set>
#include <sstream>

#include "core/log.h"
#include "io/safetensors.h"
#include "core/host_parallel.h"
#include "model/mxfp4.h"
#include "model/weights.h"
#include "ops/backend.h"

namespace lmx::model {
namespace {


bool is_float(DType d) { return d == DType::F32 || d == DType::F16 || d == DType::BF16; }

// Element i of a float tensor (F32/F16/BF16) as bf16. Unaligned-safe (memcpy), since a foreign writer may
// not have aligned the data section.
inline uint16_t load_bf16(const uint8_t* base, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::BF16: {
      uint16_t v;
      std::memcpy(&v, base + i * 2, 2);
      return v;
    }
    case DType::F16: {
      uint16_t v;
      std::memcpy(&v, base + i * 2, 2);
      return f32_to_bf16(f16_to_f32(v)).bits;
    }
    default: {
      float v;
      std::memcpy(&v, base + i * 4, 4);
      return f32_to_bf16(v).bits;
    }
  }
}

// Convert `count` elements starting at element `src_offset` of `src` into dst (bf16).
void convert_range(const Tensor& src, int64_t src_offset, int64_t count, uint16_t* dst) {
  const auto* base = static_cast<const uint8_t*>(src.data);
  if (src.dtype == DType::BF16) {
    std::memcpy(dst, base + src_offset * 2, size_t(count) * 2);
    return;
  }
  for (int64_t i = 0; i < count; ++i) dst[i] = load_bf16(base, src.dtype, src_offset + i);
}

// Reads checkpoint tensors by name with shape checks, converting to bf16 and recording what it used.
class TensorSource {
 public:
  // device: a device backend that converted expert tensors are uploaded to (nullptr: they stay on the host).
  TensorSource(const io::Checkpoint& ckpt, std::string dir, std::vector<std::shared_ptr<void>>* keep_alive,
               ops::Backend* device)
      : ckpt_(ckpt), dir_(std::move(dir)), keep_alive_(keep_alive), device_(device) {}

  bool has(const std::string& name) const { return ckpt_.contains(name); }
  const std::set<std::string>& used() const { return used_; }

  // The raw checkpoint tensor, shape-checked (any dtype among `float` ones unless raw_dtype is given).
  Result<Tensor> raw(const std::string& name, const std::vector<int64_t>& dims, bool float_only = true) {
    if (!ckpt_.contains(name))
      return not_found(dir_ + ": missing tensor '" + name + "' (expected shape " + dims_str(dims) + ")");
    LMX_ASSIGN_OR_RETURN(Tensor t, ckpt_.tensor(name));
    used_.insert(name);
    bool ok = t.ndim == int(dims.size());
    for (int i = 0; ok && i < t.ndim; ++i) ok = t.shape[i] == dims[size_t(i)];
    if (!ok)
      return invalid_argument(dir_ + ": tensor '" + name + "': expected shape " + dims_str(dims) + ", found " +
                              t.shape_str());
    if (float_only && !is_float(t.dtype))
      return invalid_argument(dir_ + ": tensor '" + name + "': expected dtype F32, F16 or BF16, found " + t.shape_str());
    return t;
  }

  // A bf16 tensor of the given shape: the mapping itself when it is already aligned bf16, else a copy.
  Result<Tensor> bf16(const std::string& name, const std::vector<int64_t>& dims) {
    LMX_ASSIGN_OR_RETURN(Tensor t, raw(name, dims));
    if (t.dtype == DType::BF16 && reinterpret_cast<uintptr_t>(t.data) % 2 == 0) return t;
    Tensor out = allocate(dims);
    const int64_t n = t.numel();
    parallel_for(n, 1 << 20, [&](int64_t begin, int64_t end) {
      convert_range(t, begin, end - begin, out.ptr<uint16_t>() + begin);
    });
    return out;
  }

  // Same, but optional: an undefined Tensor when absent.
  Result<Tensor> optional_bf16(const std::string& name, const std::vector<int64_t>& dims) {
    if (!has(name)) return Tensor();
    return bf16(name, dims);
  }

  // A new owned bf16 tensor, kept alive by the ModelWeights.
  Tensor allocate(const std::vector<int64_t>& dims) {
    OwnedTensor o;
    o.view = Tensor::with_shape(nullptr, DType::BF16, dims.data(), int(dims.size()));
    o.buffer = Buffer::host(o.view.nbytes());
    o.view.data = o.buffer.data();
    keep(o);
    return o.view;
  }
  void keep(const OwnedTensor& o) { keep_alive_->push_back(std::make_shared<Buffer>(o.buffer)); }

  // A converted tensor's home: uploaded to the device backend (the host copy is freed when `host` goes, so
  // a GPT-OSS-20B load holds one layer's experts on the host at a time, not all 48 GB), else kept on the host.
  Tensor place(const OwnedTensor& host) {
    if (device_ == nullptr) {
      keep(host);
      return host.view;
    }
    const OwnedTensor on_device = device_->upload(host.view);
    keep(on_device);
    return on_device.view;
  }

  const std::string& dir() const { return dir_; }

 private:
  const io::Checkpoint& ckpt_;
  std::string dir_;
  std::vector<std::shared_ptr<void>>* keep_alive_;
  ops::Backend* device_;
  std::set<std::string> used_;
};

// dst[e] = src[e]ᵀ: [E, R, C] (any float dtype) -> [E, C, R] bf16, in 32x32 tiles for cache locality.
void transpose_experts(const Tensor& src, const Tensor& dst) {
  const int64_t E = src.shape[0], R = src.shape[1], C = src.shape[2];
  constexpr int64_t kTile = 32;
  const int64_t row_tiles = (R + kTile - 1) / kTile;
  const auto* base = static_cast<const uint8_t*>(src.data);
  uint16_t* out = dst.ptr<uint16_t>();
  parallel_for(E * row_tiles, 4, [&](int64_t begin, int64_t end) {
    for (int64_t job = begin; job < end; ++job) {
      const int64_t e = job / row_tiles, r0 = (job % row_tiles) * kTile, r1 = std::min(R, r0 + kTile);
      for (int64_t c0 = 0; c0 < C; c0 += kTile) {
        const int64_t c1 = std::min(C, c0 + kTile);
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t c = c0; c < c1; ++c) out[(e * C + c) * R + r] = load_bf16(base, src.dtype, (e * R + r) * C + c);
      }
    }
  });
}

struct ExpertWeights {
  Tensor gate_up, gate_up_bias, down, down_bias;  // [E, 2I, H], [E, 2I], [E, H, I], [E, H]
  ops::Mxfp4Weight gate_up_mxfp4, down_mxfp4;     // with mxfp4_experts: the decode-layout copies
};

// GPT-OSS experts: MXFP4 blocks, or bf16/f32 fused tensors stored transposed ([E, H, 2I], [E, I, H]).
// mxfp4_experts: the MXFP4 blocks are also kept in the decode layout (refused for bf16 checkpoints).
Result<ExpertWeights> load_gpt_oss_experts(TensorSource& src, const ModelConfig& c, const std::string& prefix,
                                           bool mxfp4_experts) {
  const int64_t E = c.num_experts, H = c.hidden_size, I = c.moe_intermediate_size;
  ExpertWeights w;
  const std::string gu_blocks = prefix + "gate_up_proj_blocks", d_blocks = prefix + "down_proj_blocks";
  if (mxfp4_experts && !src.has(gu_blocks) && !src.has(d_blocks)) {
    return invalid_argument(src.dir() + ": --mxfp4-experts: the checkpoint's experts are not MXFP4 (no '" + gu_blocks +
                            "'); serve it without the flag");
  }
  if (src.has(gu_blocks) || src.has(d_blocks)) {
    if (H % 32 != 0 || I % 32 != 0)
      return invalid_argument(src.dir() + ": MXFP4 experts need hidden_size and intermediate_size divisible by 32, found " +
                              std::to_string(H) + " and " + std::to_string(I));
    LMX_ASSIGN_OR_RETURN(Tensor gub, src.raw(gu_blocks, {E, 2 * I, H / 32, 16}, false));
    LMX_ASSIGN_OR_RETURN(Tensor gus, src.raw(prefix + "gate_up_proj_scales", {E, 2 * I, H / 32}, false));
    LMX_ASSIGN_OR_RETURN(Tensor db, src.raw(d_blocks, {E, H, I / 32, 16}, false));
    LMX_ASSIGN_OR_RETURN(Tensor ds, src.raw(prefix + "down_proj_scales", {E, H, I / 32}, false));
    if (mxfp4_experts) {  // checked (and refused) before anything is converted or uploaded
      LMX_ASSIGN_OR_RETURN(Mxfp4Decode gu4, pack_mxfp4_decode(gub, gus, src.dir() + ": --mxfp4-experts: tensor '" + gu_blocks + "'"));
      LMX_ASSIGN_OR_RETURN(Mxfp4Decode d4, pack_mxfp4_decode(db, ds, src.dir() + ": --mxfp4-experts: tensor '" + d_blocks + "'"));
      w.gate_up_mxfp4 = {.blocks = src.place(gu4.blocks), .scales = src.place(gu4.scales)};
      w.down_mxfp4 = {.blocks = src.place(d4.blocks), .scales = src.place(d4.scales)};
    }
    {
      LMX_ASSIGN_OR_RETURN(OwnedTensor gu, dequantize_mxfp4(gub, gus, src.dir() + ": tensor '" + gu_blocks + "'"));
      w.gate_up = src.place(gu);  // [E, 2I, H]: the blocks' row orientation is already canonical
    }
    LMX_ASSIGN_OR_RETURN(OwnedTensor d, dequantize_mxfp4(db, ds, src.dir() + ": tensor '" + d_blocks + "'"));
    w.down = src.place(d);  // [E, H, I]
  } else {
    // transformers' GptOssExperts parameters: x @ gate_up_proj[e] with gate_up_proj [E, H, 2I].
    LMX_ASSIGN_OR_RETURN(Tensor gu, src.raw(prefix + "gate_up_proj", {E, H, 2 * I}));
    LMX_ASSIGN_OR_RETURN(Tensor d, src.raw(prefix + "down_proj", {E, I, H}));
    const OwnedTensor gate_up = OwnedTensor::host(DType::BF16, {E, 2 * I, H});
    transpose_experts(gu, gate_up.view);
    w.gate_up = src.place(gate_up);
    const OwnedTensor down = OwnedTensor::host(DType::BF16, {E, H, I});
    transpose_experts(d, down.view);
    w.down = src.place(down);
  }
  LMX_ASSIGN_OR_RETURN(w.gate_up_bias, src.bf16(prefix + "gate_up_proj_bias", {E, 2 * I}));
  LMX_ASSIGN_OR_RETURN(w.down_bias, src.bf16(prefix + "down_proj_bias", {E, H}));
  return w;
}

// Qwen3-MoE and Mixtral experts: fused (transformers 5: gate_up_proj [E, 2I, H] gate rows first, down_proj
// [E, H, I], already canonical) or one Linear per expert (gate/up/down, or Mixtral's w1/w3/w2).
Result<ExpertWeights> load_silu_experts(TensorSource& src, const ModelConfig& c, const std::string& prefix,
                                        const char* gate_name, const char* up_name, const char* down_name) {
  const int64_t E = c.num_experts, H = c.hidden_size, I = c.moe_intermediate_size;
  ExpertWeights w;
  if (src.has(prefix + "gate_up_proj") || src.has(prefix + "down_proj")) {
    LMX_ASSIGN_OR_RETURN(w.gate_up, src.bf16(prefix + "gate_up_proj", {E, 2 * I, H}));
    LMX_ASSIGN_OR_RETURN(w.down, src.bf16(prefix + "down_proj", {E, H, I}));
    return w;
  }
  const std::string first = prefix + "0." + gate_name + ".weight";
  if (!src.has(first))
    return not_found(src.dir() + ": no expert weights under '" + prefix + "': expected fused '" + prefix +
                     "gate_up_proj' [" + std::to_string(E) + ", " + std::to_string(2 * I) + ", " + std::to_string(H) +
                     "] or per-expert '" + first + "' [" + std::to_string(I) + ", " + std::to_string(H) + "]");
  // Check every expert's tensors first (errors name the first bad one), then copy experts in parallel.
  std::vector<Tensor> gates, ups, downs;
  for (int64_t e = 0; e < E; ++e) {
    const std::string ep = prefix + std::to_string(e) + ".";
    LMX_ASSIGN_OR_RETURN(Tensor gate, src.raw(ep + gate_name + ".weight", {I, H}));
    LMX_ASSIGN_OR_RETURN(Tensor up, src.raw(ep + up_name + ".weight", {I, H}));
    LMX_ASSIGN_OR_RETURN(Tensor down, src.raw(ep + down_name + ".weight", {H, I}));
    gates.push_back(gate);
    ups.push_back(up);
    downs.push_back(down);
  }
  const OwnedTensor gate_up = OwnedTensor::host(DType::BF16, {E, 2 * I, H});
  const OwnedTensor down = OwnedTensor::host(DType::BF16, {E, H, I});
  parallel_for(E, 1, [&](int64_t begin, int64_t end) {
    for (int64_t e = begin; e < end; ++e) {
      uint16_t* gu = gate_up.view.ptr<uint16_t>() + e * 2 * I * H;
      convert_range(gates[size_t(e)], 0, I * H, gu);        // rows [0, I): gate
      convert_range(ups[size_t(e)], 0, I * H, gu + I * H);  // rows [I, 2I): up
      convert_range(downs[size_t(e)], 0, H * I, down.view.ptr<uint16_t>() + e * H * I);
    }
  });
  w.gate_up = src.place(gate_up);
  w.down = src.place(down);
  return w;
}

Status load_layer(TensorSource& src, const ModelConfig& c, int layer, bool mxfp4_experts, LayerWeights* w) {
  const int64_t H = c.hidden_size, D = c.head_dim, Hq = c.num_heads, Hkv = c.num_kv_heads, E = c.num_experts;
  const std::string p = "model.layers." + std::to_string(layer) + ".";
  LMX_ASSIGN_OR_RETURN(w->input_norm, src.bf16(p + "input_layernorm.weight", {H}));
  LMX_ASSIGN_OR_RETURN(w->post_attention_norm, src.bf16(p + "post_attention_layernorm.weight", {H}));

  const std::string a = p + "self_attn.";
  LMX_ASSIGN_OR_RETURN(w->q, src.bf16(a + "q_proj.weight", {Hq * D, H}));
  LMX_ASSIGN_OR_RETURN(w->k, src.bf16(a + "k_proj.weight", {Hkv * D, H}));
  LMX_ASSIGN_OR_RETURN(w->v, src.bf16(a + "v_proj.weight", {Hkv * D, H}));
  LMX_ASSIGN_OR_RETURN(w->o, src.bf16(a + "o_proj.weight", {H, Hq * D}));
  if (c.attention_bias) {
    LMX_ASSIGN_OR_RETURN(w->q_bias, src.bf16(a + "q_proj.bias", {Hq * D}));
    LMX_ASSIGN_OR_RETURN(w->k_bias, src.bf16(a + "k_proj.bias", {Hkv * D}));
    LMX_ASSIGN_OR_RETURN(w->v_bias, src.bf16(a + "v_proj.bias", {Hkv * D}));
    // Llama with attention_bias has an o_proj bias too; GPT-OSS as well.
    LMX_ASSIGN_OR_RETURN(w->o_bias, src.bf16(a + "o_proj.bias", {H}));
  }
  if (c.qk_norm) {
    LMX_ASSIGN_OR_RETURN(w->q_norm, src.bf16(a + "q_norm.weight", {D}));
    LMX_ASSIGN_OR_RETURN(w->k_norm, src.bf16(a + "k_norm.weight", {D}));
  }
  if (c.attention_sinks) {
    LMX_ASSIGN_OR_RETURN(w->sinks, src.bf16(a + "sinks", {Hq}));
  }

  ExpertWeights experts;
  switch (c.family) {
    case Family::kGptOss: {
      LMX_ASSIGN_OR_RETURN(w->router, src.bf16(p + "mlp.router.weight", {E, H}));
      LMX_ASSIGN_OR_RETURN(w->router_bias, src.bf16(p + "mlp.router.bias", {E}));
      LMX_ASSIGN_OR_RETURN(experts, load_gpt_oss_experts(src, c, p + "mlp.experts.", mxfp4_experts));
      break;
    }
    case Family::kQwen3Moe: {
      LMX_ASSIGN_OR_RETURN(w->router, src.bf16(p + "mlp.gate.weight", {E, H}));
      LMX_ASSIGN_OR_RETURN(experts, load_silu_experts(src, c, p + "mlp.experts.", "gate_proj", "up_proj", "down_proj"));
      break;
    }
    case Family::kMixtral: {
      // Original checkpoints: block_sparse_moe.{gate, experts.{e}.w1/w3/w2}; transformers 5 renames the
      // module to mlp and may save fused experts.
      const std::string moe = src.has(p + "block_sparse_moe.gate.weight") ? p + "block_sparse_moe." : p + "mlp.";
      LMX_ASSIGN_OR_RETURN(w->router, src.bf16(moe + "gate.weight", {E, H}));
      if (src.has(moe + "experts.0.w1.weight")) {
        LMX_ASSIGN_OR_RETURN(experts, load_silu_experts(src, c, moe + "experts.", "w1", "w3", "w2"));
      } else {
        LMX_ASSIGN_OR_RETURN(experts, load_silu_experts(src, c, moe + "experts.", "gate_proj", "up_proj", "down_proj"));
      }
      break;
    }
    case Family::kQwen3:
    case Family::kLlama: {
      const int64_t I = c.intermediate_size;
      LMX_ASSIGN_OR_RETURN(w->mlp_gate, src.bf16(p + "mlp.gate_proj.weight", {I, H}));
      LMX_ASSIGN_OR_RETURN(w->mlp_up, src.bf16(p + "mlp.up_proj.weight", {I, H}));
      LMX_ASSIGN_OR_RETURN(w->mlp_down, src.bf16(p + "mlp.down_proj.weight", {H, I}));
      break;
    }
  }
  if (c.is_moe()) {
    w->gate_up = experts.gate_up;
    w->gate_up_bias = experts.gate_up_bias;
    w->down = experts.down;
    w->down_bias = experts.down_bias;
    w->gate_up_mxfp4 = experts.gate_up_mxfp4;
    w->down_mxfp4 = experts.down_mxfp4;
  }
  return Status::Ok();
}

}  // namespace

Result<ModelWeights> load_model(const std::string& model_dir, bool mxfp4_experts, ops::Backend* backend) {
  LMX_ASSIGN_OR_RETURN(ModelConfig config, load_model_config(model_dir));
  if (mxfp4_experts && config.family != Family::kGptOss) {
    return invalid_argument(model_dir + ": --mxfp4-experts: only GPT-OSS checkpoints store MXFP4 experts, this is " +
                            std::string(family_name(config.family)));
  }
  LMX_ASSIGN_OR_RETURN(io::Checkpoint ckpt, io::Checkpoint::open(model_dir));
  ModelWeights weights;
  weights.config = config;
  for (auto& m : ckpt.mappings()) weights.keep_alive.push_back(m);
  TensorSource src(ckpt, model_dir, &weights.keep_alive,
                   backend != nullptr && backend->device() != Device::kCpu ? backend : nullptr);

  const int64_t V = config.vocab_size, H = config.hidden_size;
  LMX_ASSIGN_OR_RETURN(weights.embed, src.bf16("model.embed_tokens.weight", {V, H}));
  LMX_ASSIGN_OR_RETURN(weights.final_norm, src.bf16("model.norm.weight", {H}));
  if (config.tie_word_embeddings) {
    weights.lm_head = weights.embed;
    if (src.has("lm_head.weight")) {  // transformers ignores it when tied; still check its shape
      LMX_ASSIGN_OR_RETURN(Tensor ignored_head, src.raw("lm_head.weight", {V, H}));
      (void)ignored_head;
    }
  } else {
    LMX_ASSIGN_OR_RETURN(weights.lm_head, src.bf16("lm_head.weight", {V, H}));
  }
  weights.layers.resize(size_t(config.num_layers));
  for (int layer = 0; layer < config.num_layers; ++layer)
    LMX_RETURN_IF_ERROR(load_layer(src, config, layer, mxfp4_experts, &weights.layers[size_t(layer)]));

  // Tensors nobody asked for are usually harmless (rotary caches, biases a config switched off), but a
  // long list points at a config/checkpoint mismatch, so name a few.
  std::vector<std::string> unused;
  for (const auto& name : ckpt.names())
    if (!src.used().count(name)) unused.push_back(name);
  if (!unused.empty()) {
    std::string list;
    for (size_t i = 0; i < unused.size() && i < 5; ++i) list += (i ? ", " : "") + unused[i];
    log_warn(model_dir + ": " + std::to_string(unused.size()) + " checkpoint tensors unused (" + list +
             (unused.size() > 5 ? ", ..." : "") + ")");
  }
  log_info(model_dir + ": loaded " + std::string(family_name(config.family)) + " model, " +
           std::to_string(config.num_layers) + " layers");
  return weights;
}

}  // namespace lmx::model
