// The shape/dtype rules of every op contract (the check() functions declared in ops/*.h). They read only
// tensor metadata, never tensor contents (which may live on the GPU): values such as ids in range are the
// backends' business. Called by every backend op through require(), and by tests.
#include <cmath>
#include <initializer_list>
#include <string>

#include "ops/attention.h"
#include "ops/basic.h"
#include "ops/lora.h"
#include "ops/moe.h"
#include "ops/mxfp4.h"
#include "ops/rope.h"
#include "ops/routing.h"
#include "ops/sampling.h"

namespace lmx::ops {
namespace {

// A tensor is defined when it points at memory; an empty tensor (some dim 0) may carry a null pointer.
bool present(const Tensor& t) { return t.defined() || (t.ndim > 0 && t.numel() == 0); }

Status require_present(const Tensor& t, const std::string& name) {
  if (present(t)) return Status::Ok();
  return invalid_argument(name + ": required, but undefined");
}

// A required tensor of exactly one dtype and the given dims (-1 = any).
Status expect(const Tensor& t, const std::string& name, DType dtype, std::initializer_list<int64_t> dims) {
  LMX_RETURN_IF_ERROR(require_present(t, name));
  return expect_tensor(t, name, dtype, dims);
}

// A required activation tensor: F32 or BF16 (the backend decides which), with the given dims.
Status expect_activation(const Tensor& t, const std::string& name, std::initializer_list<int64_t> dims) {
  LMX_RETURN_IF_ERROR(require_present(t, name));
  if (t.dtype != DType::F32 && t.dtype != DType::BF16) {
    return invalid_argument(name + ": expected an F32 or BF16 activation, found " + t.shape_str());
  }
  return expect_tensor(t, name, t.dtype, dims);
}

// `t` must have the same dtype as the reference activation `ref` (activations of one op share a dtype).
Status expect_same_dtype(const Tensor& t, const std::string& name, const Tensor& ref, const std::string& ref_name) {
  if (t.dtype == ref.dtype) return Status::Ok();
  return invalid_argument(name + ": expected dtype " + std::string(dtype_name(ref.dtype)) + " (that of " + ref_name +
                          "), found " + t.shape_str());
}

// Every present tensor of one op lives on the same device.
Status expect_one_device(std::initializer_list<std::pair<const char*, const Tensor*>> tensors) {
  const char* first_name = nullptr;
  Device first = Device::kCpu;
  for (const auto& [name, t] : tensors) {
    if (!present(*t)) continue;
    if (!first_name) {
      first_name = name;
      first = t->device;
    } else if (t->device != first) {
      return invalid_argument(std::string(name) + ": on " + std::string(device_name(t->device)) + ", but " +
                              first_name + " is on " + std::string(device_name(first)));
    }
  }
  return Status::Ok();
}

bool overlaps(const Tensor& a, const Tensor& b) {
  if (!a.defined() || !b.defined()) return false;
  auto* a0 = static_cast<const char*>(a.data);
  auto* b0 = static_cast<const char*>(b.data);
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

// `out` may be the very same memory as `in` (in-place) but must not partially overlap it.
Status expect_same_or_disjoint(const Tensor& out, const std::string& out_name, const Tensor& in,
                               const std::string& in_name) {
  if (out.data == in.data || !overlaps(out, in)) return Status::Ok();
  return invalid_argument(out_name + ": partially overlaps " + in_name + " (only exact aliasing is allowed)");
}

Status expect_disjoint(const Tensor& out, const std::string& out_name, const Tensor& in, const std::string& in_name) {
  if (!overlaps(out, in)) return Status::Ok();
  return invalid_argument(out_name + ": must not alias " + in_name);
}

Status expect_finite(double value, const std::string& name) {
  if (std::isfinite(value)) return Status::Ok();
  return invalid_argument(name + ": expected a finite number, found " + std::to_string(value));
}

// One LoRA stack. Dense (experts = 0): a [S, R, in], b [S, out, R]; MoE: a [S, E, R, in], b [S, E, out, R].
// rank [S] i32. Undefined `a` means "no slot uses this target": then b and rank must be undefined too.
Status check_lora_stack(const LoraStack& w, const std::string& name, int64_t experts, int64_t in, int64_t out) {
  if (!w.defined()) {
    if (present(w.b) || present(w.rank)) {
      return invalid_argument(name + ".a: undefined while " + name + ".b/.rank are defined");
    }
    return Status::Ok();
  }
  const std::string a_name = name + ".a", b_name = name + ".b", rank_name = name + ".rank";
  if (w.a.dtype != DType::F32 && w.a.dtype != DType::BF16) {
    return invalid_argument(a_name + ": expected an F32 or BF16 LoRA stack, found " + w.a.shape_str());
  }
  if (experts == 0) {
    LMX_RETURN_IF_ERROR(expect(w.a, a_name, w.a.dtype, {-1, -1, in}));
    const int64_t slots = w.a.dim(0), rank = w.a.dim(1);
    LMX_RETURN_IF_ERROR(expect(w.b, b_name, w.a.dtype, {slots, out, rank}));
    LMX_RETURN_IF_ERROR(expect(w.rank, rank_name, DType::I32, {slots}));
  } else {
    LMX_RETURN_IF_ERROR(expect(w.a, a_name, w.a.dtype, {-1, experts, -1, in}));
    const int64_t slots = w.a.dim(0), rank = w.a.dim(2);
    LMX_RETURN_IF_ERROR(expect(w.b, b_name, w.a.dtype, {slots, experts, out, rank}));
    LMX_RETURN_IF_ERROR(expect(w.rank, rank_name, DType::I32, {slots}));
  }
  return Status::Ok();
}

}  // namespace

// ---- basic.h --------------------------------------------------------------------------------------------

Status check(const EmbeddingParams& p) {
  LMX_RETURN_IF_ERROR(expect(p.table, "EmbeddingParams.table", DType::BF16, {-1, -1}));
  LMX_RETURN_IF_ERROR(expect(p.token_ids, "EmbeddingParams.token_ids", DType::I32, {-1}));
  const int64_t tokens = p.token_ids.dim(0), hidden = p.table.dim(1);
  LMX_RETURN_IF_ERROR(expect_activation(p.out, "EmbeddingParams.out", {tokens, hidden}));
  return expect_one_device({{"EmbeddingParams.table", &p.table},
                            {"EmbeddingParams.token_ids", &p.token_ids},
                            {"EmbeddingParams.out", &p.out}});
}

Status check(const RmsNormParams& p) {
  LMX_RETURN_IF_ERROR(expect_activation(p.x, "RmsNormParams.x", {-1, -1}));
  const int64_t rows = p.x.dim(0), cols = p.x.dim(1);
  LMX_RETURN_IF_ERROR(expect(p.weight, "RmsNormParams.weight", DType::BF16, {cols}));
  LMX_RETURN_IF_ERROR(expect_activation(p.out, "RmsNormParams.out", {rows, cols}));
  LMX_RETURN_IF_ERROR(expect_same_dtype(p.out, "RmsNormParams.out", p.x, "RmsNormParams.x"));
  LMX_RETURN_IF_ERROR(expect_same_or_disjoint(p.out, "RmsNormParams.out", p.x, "RmsNormParams.x"));
  if (!(p.eps >= 0.0f) || !std::isfinite(p.eps)) {
    return invalid_argument("RmsNormParams.eps: expected a finite number >= 0, found " + std::to_string(p.eps));
  }
  if (p.residual.defined()) {
    LMX_RETURN_IF_ERROR(expect_activation(p.residual, "RmsNormParams.residual", {rows, cols}));
    LMX_RETURN_IF_ERROR(expect_same_dtype(p.residual, "RmsNormParams.residual", p.x, "RmsNormParams.x"));
    LMX_RETURN_IF_ERROR(expect_disjoint(p.residual, "RmsNormParams.residual", p.x, "RmsNormParams.x"));
    LMX_RETURN_IF_ERROR(expect_disjoint(p.residual, "RmsNormParams.residual", p.out, "RmsNormParams.out"));
    return expect_one_device({{"RmsNormParams.x", &p.x}, {"RmsNormParams.weight", &p.weight},
                              {"RmsNormParams.out", &p.out}, {"RmsNormParams.residual", &p.residual}});
  }
  return expect_one_device(
      {{"RmsNormParams.x", &p.x}, {"RmsNormParams.weight", &p.weight}, {"RmsNormParams.out", &p.out}});
}

Status check(const LinearParams& p) {
  LMX_RETURN_IF_ERROR(expect_activation(p.x, "LinearParams.x", {-1, -1}));
  const int64_t tokens = p.x.dim(0), in = p.x.dim(1);
  LMX_RETURN_IF_ERROR(expect(p.weight, "LinearParams.weight", DType::BF16, {-1, in}));
  const int64_t out = p.weight.dim(0);
  if (present(p.bias)) LMX_RETURN_IF_ERROR(expect_tensor(p.bias, "LinearParams.bias", DType::BF16, {out}));
  LMX_RETURN_IF_ERROR(expect_activation(p.out, "LinearParams.out", {tokens, out}));
  // F32 out from any activation dtype: the router and the LM head write f32 logits (bf16 x on cuda).
  if (p.out.dtype != DType::F32) {
    LMX_RETURN_IF_ERROR(expect_same_dtype(p.out, "LinearParams.out", p.x, "LinearParams.x"));
  }
  LMX_RETURN_IF_ERROR(expect_disjoint(p.out, "LinearParams.out", p.x, "LinearParams.x"));
  return expect_one_device({{"LinearParams.x", &p.x},
                            {"LinearParams.weight", &p.weight},
                            {"LinearParams.bias", &p.bias},
                            {"LinearParams.out", &p.out}});
}

Status check(const AddParams& p) {
  LMX_RETURN_IF_ERROR(expect_activation(p.x, "AddParams.x", {-1, -1}));
  LMX_RETURN_IF_ERROR(expect_activation(p.y, "AddParams.y", {p.x.dim(0), p.x.dim(1)}));
  LMX_RETURN_IF_ERROR(expect_same_dtype(p.y, "AddParams.y", p.x, "AddParams.x"));
  LMX_RETURN_IF_ERROR(expect_same_or_disjoint(p.y, "AddParams.y", p.x, "AddParams.x"));
  return expect_one_device({{"AddParams.x", &p.x}, {"AddParams.y", &p.y}});
}

Status check(const SiluMulParams& p) {
  LMX_RETURN_IF_ERROR(expect_activation(p.gate, "SiluMulParams.gate", {-1, -1}));
  const int64_t tokens = p.gate.dim(0), inter = p.gate.dim(1);
  LMX_RETURN_IF_ERROR(expect_activation(p.up, "SiluMulParams.up", {tokens, inter}));
  LMX_RETURN_IF_ERROR(expect_same_dtype(p.up, "SiluMulParams.up", p.gate, "SiluMulParams.gate"));
  LMX_RETURN_IF_ERROR(expect_activation(p.out, "SiluMulParams.out", {tokens, inter}));
  LMX_RETURN_IF_ERROR(expect_same_dtype(p.out, "SiluMulParams.out", p.gate, "SiluMulParams.gate"));
  LMX_RETURN_IF_ERROR(expect_same_or_disjoint(p.out, "SiluMulParams.out", p.gate, "SiluMulParams.gate"));
  LMX_RETURN_IF_ERROR(expect_same_or_disjoint(p.out, "SiluMulParams.out", p.up, "SiluMulParams.up"));
  return expect_one_device(
      {{"SiluMulParams.gate", &p.gate}, {"SiluMulParams.up", &p.up}, {"SiluMulParams.out", &p.out}});
}

Status check(const GatherRowsParams& p) {
  LMX_RETURN_IF_ERROR(expect_activation(p.x, "GatherRowsParams.x", {-1, -1}));
  LMX_RETURN_IF_ERROR(expect(p.index, "GatherRowsParams.index", DType::I32, {-1}));
  LMX_RETURN_IF_ERROR(expect_activation(p.out, "GatherRowsParams.out", {p.index.dim(0), p.x.dim(1)}));
  LMX_RETURN_IF_ERROR(expect_same_dtype(p.out, "GatherRowsParams.out", p.x, "GatherRowsParams.x"));
  LMX_RETURN_IF_ERROR(expect_disjoint(p.out, "GatherRowsParams.out", p.x, "GatherRowsParams.x"));
  return expect_one_device(
      {{"GatherRowsParams.x", &p.x}, {"GatherRowsParams.index", &p.index}, {"GatherRowsParams.out", &p.out}});
}

Status check(const SplitColumnsParams& p) {
  LMX_RETURN_IF_ERROR(expect_activation(p.x, "SplitColumnsParams.x", {-1, -1}));
  int64_t columns = 0;
  bool ended = false;
  for (size_t i = 0; i < p.parts.size(); ++i) {
    const std::string name = "SplitColumnsParams.parts[" + std::to_string(i) + "]";
    if (!p.parts[i].defined()) {
      ended = true;
      continue;
    }
    if (ended) return invalid_argument(name + ": defined after an undefined part");
    LMX_RETURN_IF_ERROR(expect_activation(p.parts[i], name, {p.x.dim(0), -1}));
    LMX_RETURN_IF_ERROR(expect_same_dtype(p.parts[i], name, p.x, "SplitColumnsParams.x"));
    LMX_RETURN_IF_ERROR(expect_disjoint(p.parts[i], name, p.x, "SplitColumnsParams.x"));
    LMX_RETURN_IF_ERROR(expect_one_device({{"SplitColumnsParams.x", &p.x}, {name.c_str(), &p.parts[i]}}));
    columns += p.parts[i].dim(1);
  }
  if (columns != p.x.dim(1)) {
    return invalid_argument("SplitColumnsParams.parts: expected columns summing to x's " + std::to_string(p.x.dim(1)) +
                            ", found " + std::to_string(columns));
  }
  return Status::Ok();
}

// ---- rope.h ---------------------------------------------------------------------------------------------

Status check(const RopeParams& p) {
  LMX_RETURN_IF_ERROR(expect_activation(p.q, "RopeParams.q", {-1, -1, -1}));
  const int64_t tokens = p.q.dim(0), head_dim = p.q.dim(2);
  if (head_dim % 2 != 0) {
    return invalid_argument("RopeParams.q: expected an even head dim D, found " + p.q.shape_str());
  }
  LMX_RETURN_IF_ERROR(expect_activation(p.k, "RopeParams.k", {tokens, -1, head_dim}));
  LMX_RETURN_IF_ERROR(expect_same_dtype(p.k, "RopeParams.k", p.q, "RopeParams.q"));
  LMX_RETURN_IF_ERROR(expect_disjoint(p.k, "RopeParams.k", p.q, "RopeParams.q"));
  LMX_RETURN_IF_ERROR(expect(p.positions, "RopeParams.positions", DType::I32, {tokens}));
  LMX_RETURN_IF_ERROR(expect(p.inv_freq, "RopeParams.inv_freq", DType::F32, {head_dim / 2}));
  LMX_RETURN_IF_ERROR(expect_finite(p.attention_scaling, "RopeParams.attention_scaling"));
  if (p.q_norm.defined() != p.k_norm.defined()) {
    return invalid_argument(std::string("RopeParams.") + (p.q_norm.defined() ? "k_norm" : "q_norm") +
                            ": expected [" + std::to_string(head_dim) + "] BF16 with the other QK-norm weight, found none");
  }
  if (p.q_norm.defined()) {
    LMX_RETURN_IF_ERROR(expect(p.q_norm, "RopeParams.q_norm", DType::BF16, {head_dim}));
    LMX_RETURN_IF_ERROR(expect(p.k_norm, "RopeParams.k_norm", DType::BF16, {head_dim}));
    if (!(p.norm_eps >= 0.0f) || !std::isfinite(p.norm_eps)) {
      return invalid_argument("RopeParams.norm_eps: expected a finite number >= 0, found " + std::to_string(p.norm_eps));
    }
    LMX_RETURN_IF_ERROR(expect_one_device({{"RopeParams.q", &p.q}, {"RopeParams.q_norm", &p.q_norm},
                                           {"RopeParams.k_norm", &p.k_norm}}));
  }
  return expect_one_device({{"RopeParams.q", &p.q},
                            {"RopeParams.k", &p.k},
                            {"RopeParams.positions", &p.positions},
                            {"RopeParams.inv_freq", &p.inv_freq}});
}

// ---- attention.h ----------------------------------------------------------------------------------------

Status check(const KvWriteParams& p) {
  LMX_RETURN_IF_ERROR(expect_activation(p.k_cache, "KvWriteParams.k_cache", {-1, -1, -1, -1}));
  const int64_t pages = p.k_cache.dim(0), page_size = p.k_cache.dim(1), kv_heads = p.k_cache.dim(2),
                head_dim = p.k_cache.dim(3);
  LMX_RETURN_IF_ERROR(expect_activation(p.v_cache, "KvWriteParams.v_cache", {pages, page_size, kv_heads, head_dim}));
  LMX_RETURN_IF_ERROR(expect_same_dtype(p.v_cache, "KvWriteParams.v_cache", p.k_cache, "KvWriteParams.k_cache"));
  LMX_RETURN_IF_ERROR(expect_activation(p.k, "KvWriteParams.k", {-1, kv_heads, head_dim}));
  const int64_t tokens = p.k.dim(0);
  LMX_RETURN_IF_ERROR(expect_same_dtype(p.k, "KvWriteParams.k", p.k_cache, "KvWriteParams.k_cache"));
  LMX_RETURN_IF_ERROR(expect_activation(p.v, "KvWriteParams.v", {tokens, kv_heads, head_dim}));
  LMX_RETURN_IF_ERROR(expect_same_dtype(p.v, "KvWriteParams.v", p.k_cache, "KvWriteParams.k_cache"));
  LMX_RETURN_IF_ERROR(expect(p.kv_write_index, "KvWriteParams.kv_write_index", DType::I32, {tokens}));
  LMX_RETURN_IF_ERROR(expect_disjoint(p.k_cache, "KvWriteParams.k_cache", p.v_cache, "KvWriteParams.v_cache"));
  return expect_one_device({{"KvWriteParams.k", &p.k},
                            {"KvWriteParams.v", &p.v},
                            {"KvWriteParams.kv_write_index", &p.kv_write_index},
                            {"KvWriteParams.k_cache", &p.k_cache},
                            {"KvWriteParams.v_cache", &p.v_cache}});
}

Status check(const AttentionParams& p) {
  LMX_RETURN_IF_ERROR(expect_activation(p.q, "AttentionParams.q", {-1, -1, -1}));
  const int64_t tokens = p.q.dim(0), q_heads = p.q.dim(1), head_dim = p.q.dim(2);
  LMX_RETURN_IF_ERROR(expect_activation(p.k_cache, "AttentionParams.k_cache", {-1, -1, -1, head_dim}));
  LMX_RETURN_IF_ERROR(expect_same_dtype(p.k_cache, "AttentionParams.k_cache", p.q, "AttentionParams.q"));
  const int64_t pages = p.k_cache.dim(0), page_size = p.k_cache.dim(1), kv_heads = p.k_cache.dim(2);
  LMX_RETURN_IF_ERROR(expect_activation(p.v_cache, "AttentionParams.v_cache", {pages, page_size, kv_heads, head_dim}));
  LMX_RETURN_IF_ERROR(expect_same_dtype(p.v_cache, "AttentionParams.v_cache", p.q, "AttentionParams.q"));
  if (kv_heads == 0 || q_heads % kv_heads != 0) {
    return invalid_argument("AttentionParams.k_cache: expected a kv head count Hkv dividing Hq = " +
                            std::to_string(q_heads) + ", found " + p.k_cache.shape_str());
  }
  LMX_RETURN_IF_ERROR(expect(p.block_table, "AttentionParams.block_table", DType::I32, {-1, -1}));
  const int64_t seqs = p.block_table.dim(0);
  LMX_RETURN_IF_ERROR(expect(p.seq_start, "AttentionParams.seq_start", DType::I32, {seqs + 1}));
  LMX_RETURN_IF_ERROR(expect(p.positions, "AttentionParams.positions", DType::I32, {tokens}));
  if (present(p.sinks)) LMX_RETURN_IF_ERROR(expect_tensor(p.sinks, "AttentionParams.sinks", DType::BF16, {q_heads}));
  if (p.sliding_window < 0) {
    return invalid_argument("AttentionParams.sliding_window: expected 0 (off) or a window > 0, found " +
                            std::to_string(p.sliding_window));
  }
  LMX_RETURN_IF_ERROR(expect_finite(p.softmax_scale, "AttentionParams.softmax_scale"));
  LMX_RETURN_IF_ERROR(expect_activation(p.out, "AttentionParams.out", {tokens, q_heads, head_dim}));
  LMX_RETURN_IF_ERROR(expect_same_dtype(p.out, "AttentionParams.out", p.q, "AttentionParams.q"));
  LMX_RETURN_IF_ERROR(expect_same_or_disjoint(p.out, "AttentionParams.out", p.q, "AttentionParams.q"));
  return expect_one_device({{"AttentionParams.q", &p.q},
                            {"AttentionParams.k_cache", &p.k_cache},
                            {"AttentionParams.v_cache", &p.v_cache},
                            {"AttentionParams.block_table", &p.block_table},
                            {"AttentionParams.seq_start", &p.seq_start},
                            {"AttentionParams.positions", &p.positions},
                            {"AttentionParams.sinks", &p.sinks},
                            {"AttentionParams.out", &p.out}});
}

// ---- routing.h ------------------------------------------------------------------------------------------

Status check(const RouterTopKParams& p) {
  LMX_RETURN_IF_ERROR(expect(p.logits, "RouterTopKParams.logits", DType::F32, {-1, -1}));
  const int64_t tokens = p.logits.dim(0), experts = p.logits.dim(1);
  if (p.top_k < 1 || p.top_k > experts) {
    return invalid_argument("RouterTopKParams.top_k: expected 1 <= top_k <= E = " + std::to_string(experts) +
                            ", found " + std::to_string(p.top_k));
  }
  LMX_RETURN_IF_ERROR(expect(p.topk_ids, "RouterTopKParams.topk_ids", DType::I32, {tokens, p.top_k}));
  LMX_RETURN_IF_ERROR(expect(p.topk_weights, "RouterTopKParams.topk_weights", DType::F32, {tokens, p.top_k}));
  return expect_one_device({{"RouterTopKParams.logits", &p.logits},
                            {"RouterTopKParams.topk_ids", &p.topk_ids},
                            {"RouterTopKParams.topk_weights", &p.topk_weights}});
}

Status check(const RouteParams& p) {
  LMX_RETURN_IF_ERROR(check(p.linear()));
  if (p.logits.dtype != DType::F32) {
    return invalid_argument("RouteParams.logits: expected F32, found " + std::string(dtype_name(p.logits.dtype)));
  }
  return check(p.topk());
}

// ---- moe.h ----------------------------------------------------------------------------------------------

Status check(const GeneratedMxfp4Params& p) {
  LMX_RETURN_IF_ERROR(expect(p.values, "GeneratedMxfp4Params.values", DType::BF16, {-1, -1, -1}));
  const int64_t experts = p.values.dim(0), rows = p.values.dim(1), k = p.values.dim(2);
  if (k % mxfp4::kTileK != 0) {
    return invalid_argument("GeneratedMxfp4Params.values: the MXFP4 decode layout needs K a multiple of 64, found " +
                            p.values.shape_str());
  }
  LMX_RETURN_IF_ERROR(expect(p.weight.blocks, "GeneratedMxfp4Params.weight.blocks", DType::U8,
                             {experts, k / mxfp4::kTileK, rows, mxfp4::kTileBytes}));
  LMX_RETURN_IF_ERROR(
      expect(p.weight.scales, "GeneratedMxfp4Params.weight.scales", DType::U8, {experts, k / mxfp4::kTileK, rows, 2}));
  if (p.scale_lo < 0 || p.scale_lo + 2 > mxfp4::kMaxDecodeScale) {
    return invalid_argument("GeneratedMxfp4Params.scale_lo: expected 0 .. " + std::to_string(mxfp4::kMaxDecodeScale - 2) +
                            ", found " + std::to_string(p.scale_lo));
  }
  return expect_one_device({{"GeneratedMxfp4Params.values", &p.values},
                            {"GeneratedMxfp4Params.weight.blocks", &p.weight.blocks},
                            {"GeneratedMxfp4Params.weight.scales", &p.weight.scales}});
}

Status check(const MoeParams& p) {
  LMX_RETURN_IF_ERROR(expect_activation(p.x, "MoeParams.x", {-1, -1}));
  const int64_t tokens = p.x.dim(0), hidden = p.x.dim(1);
  LMX_RETURN_IF_ERROR(expect(p.topk_ids, "MoeParams.topk_ids", DType::I32, {tokens, -1}));
  const int64_t top_k = p.topk_ids.dim(1);
  LMX_RETURN_IF_ERROR(expect(p.topk_weights, "MoeParams.topk_weights", DType::F32, {tokens, top_k}));
  LMX_RETURN_IF_ERROR(expect(p.gate_up, "MoeParams.gate_up", DType::BF16, {-1, -1, hidden}));
  const int64_t experts = p.gate_up.dim(0), gate_up_rows = p.gate_up.dim(1);
  if (gate_up_rows % 2 != 0) {
    return invalid_argument("MoeParams.gate_up: expected an even row count 2I, found " + p.gate_up.shape_str());
  }
  const int64_t inter = gate_up_rows / 2;
  if (present(p.gate_up_bias)) {
    LMX_RETURN_IF_ERROR(expect_tensor(p.gate_up_bias, "MoeParams.gate_up_bias", DType::BF16, {experts, 2 * inter}));
  }
  LMX_RETURN_IF_ERROR(expect(p.down, "MoeParams.down", DType::BF16, {experts, hidden, inter}));
  if (present(p.down_bias)) {
    LMX_RETURN_IF_ERROR(expect_tensor(p.down_bias, "MoeParams.down_bias", DType::BF16, {experts, hidden}));
  }
  LMX_RETURN_IF_ERROR(check_lora_stack(p.lora_gate_up, "MoeParams.lora_gate_up", experts, hidden, 2 * inter));
  LMX_RETURN_IF_ERROR(check_lora_stack(p.lora_down, "MoeParams.lora_down", experts, inter, hidden));
  if (present(p.token_slot)) {
    LMX_RETURN_IF_ERROR(expect_tensor(p.token_slot, "MoeParams.token_slot", DType::I32, {tokens}));
  } else if (p.lora_gate_up.defined() || p.lora_down.defined()) {
    return invalid_argument("MoeParams.token_slot: required when a LoRA stack is defined, but undefined");
  }
  // The MXFP4 copies: [E, K/64, N, 32] and [E, K/64, N, 2] U8 for the weights [E, N, K] above.
  const auto check_mxfp4 = [&](const Mxfp4Weight& w, const std::string& name, int64_t rows, int64_t k) -> Status {
    if (!present(w.blocks) && !present(w.scales)) return Status::Ok();
    if (k % 64 != 0) {
      return invalid_argument(name + ": the MXFP4 decode layout needs K a multiple of 64, found K = " + std::to_string(k));
    }
    LMX_RETURN_IF_ERROR(expect(w.blocks, name + ".blocks", DType::U8, {experts, k / 64, rows, 32}));
    return expect(w.scales, name + ".scales", DType::U8, {experts, k / 64, rows, 2});
  };
  LMX_RETURN_IF_ERROR(check_mxfp4(p.gate_up_mxfp4, "MoeParams.gate_up_mxfp4", 2 * inter, hidden));
  LMX_RETURN_IF_ERROR(check_mxfp4(p.down_mxfp4, "MoeParams.down_mxfp4", hidden, inter));
  LMX_RETURN_IF_ERROR(expect_finite(p.swiglu_alpha, "MoeParams.swiglu_alpha"));
  if (p.activation == MoeActivation::kGptOssClamped && !(p.swiglu_limit > 0.0f)) {
    return invalid_argument("MoeParams.swiglu_limit: expected a limit > 0, found " + std::to_string(p.swiglu_limit));
  }
  LMX_RETURN_IF_ERROR(expect_activation(p.out, "MoeParams.out", {tokens, hidden}));
  LMX_RETURN_IF_ERROR(expect_same_dtype(p.out, "MoeParams.out", p.x, "MoeParams.x"));
  LMX_RETURN_IF_ERROR(expect_disjoint(p.out, "MoeParams.out", p.x, "MoeParams.x"));
  return expect_one_device({{"MoeParams.x", &p.x},
                            {"MoeParams.topk_ids", &p.topk_ids},
                            {"MoeParams.topk_weights", &p.topk_weights},
                            {"MoeParams.token_slot", &p.token_slot},
                            {"MoeParams.gate_up", &p.gate_up},
                            {"MoeParams.gate_up_bias", &p.gate_up_bias},
                            {"MoeParams.down", &p.down},
                            {"MoeParams.down_bias", &p.down_bias},
                            {"MoeParams.lora_gate_up.a", &p.lora_gate_up.a},
                            {"MoeParams.lora_gate_up.b", &p.lora_gate_up.b},
                            {"MoeParams.lora_gate_up.rank", &p.lora_gate_up.rank},
                            {"MoeParams.lora_down.a", &p.lora_down.a},
                            {"MoeParams.lora_down.b", &p.lora_down.b},
                            {"MoeParams.lora_down.rank", &p.lora_down.rank},
                            {"MoeParams.gate_up_mxfp4.blocks", &p.gate_up_mxfp4.blocks},
                            {"MoeParams.gate_up_mxfp4.scales", &p.gate_up_mxfp4.scales},
                            {"MoeParams.down_mxfp4.blocks", &p.down_mxfp4.blocks},
                            {"MoeParams.down_mxfp4.scales", &p.down_mxfp4.scales},
                            {"MoeParams.out", &p.out}});
}

// ---- lora.h ---------------------------------------------------------------------------------------------

Status check(const LoraParams& p) {
  LMX_RETURN_IF_ERROR(expect_activation(p.x, "LoraParams.x", {-1, -1}));
  const int64_t tokens = p.x.dim(0), in = p.x.dim(1);
  LMX_RETURN_IF_ERROR(expect(p.token_slot, "LoraParams.token_slot", DType::I32, {tokens}));
  LMX_RETURN_IF_ERROR(expect_activation(p.y, "LoraParams.y", {tokens, -1}));
  LMX_RETURN_IF_ERROR(expect_same_dtype(p.y, "LoraParams.y", p.x, "LoraParams.x"));
  LMX_RETURN_IF_ERROR(expect_disjoint(p.y, "LoraParams.y", p.x, "LoraParams.x"));
  LMX_RETURN_IF_ERROR(check_lora_stack(p.w, "LoraParams.w", 0, in, p.y.dim(1)));
  return expect_one_device({{"LoraParams.x", &p.x},
                            {"LoraParams.token_slot", &p.token_slot},
                            {"LoraParams.w.a", &p.w.a},
                            {"LoraParams.w.b", &p.w.b},
                            {"LoraParams.w.rank", &p.w.rank},
                            {"LoraParams.y", &p.y}});
}

Status check(const LinearLoraParams& p) {
  LMX_RETURN_IF_ERROR(check(p.linear));
  const bool split = p.parts[0].defined();
  if (split) LMX_RETURN_IF_ERROR(check(SplitColumnsParams{.x = p.linear.out, .parts = p.parts}));
  for (size_t i = 0; i < p.lora.size(); ++i) {
    if (!p.lora[i].defined()) continue;
    const std::string name = "LinearLoraParams.lora[" + std::to_string(i) + "]";
    if (!split && i > 0) return invalid_argument(name + ": defined without parts (only lora[0] serves linear.out)");
    if (split && !p.parts[i].defined()) return invalid_argument(name + ": defined for an undefined part");
    if (!p.token_slot.defined()) continue;  // no LoRA in this batch
    const Status status = check(LoraParams{.x = p.linear.x, .token_slot = p.token_slot, .w = p.lora[i],
                                           .y = split ? p.parts[i] : p.linear.out});
    if (!status.ok()) return invalid_argument(name + ": " + status.message());
  }
  int64_t end = 0;
  for (size_t i = 0; i < p.runs.size(); ++i) {
    const LoraRun& run = p.runs[i];
    const std::string name = "LinearLoraParams.runs[" + std::to_string(i) + "]";
    const int64_t tokens = p.linear.x.dim(0);
    if (run.first < end || run.tokens < 1 || run.first + run.tokens > tokens) {
      return invalid_argument(name + ": rows [" + std::to_string(run.first) + ", " +
                              std::to_string(run.first + run.tokens) + ") must be non-empty, within [0, " +
                              std::to_string(tokens) + ") and after the previous run (which ends at " +
                              std::to_string(end) + ")");
    }
    if (run.slot < 0) return invalid_argument(name + ": slot " + std::to_string(run.slot) + " (expected >= 0)");
    for (const LoraStack& w : p.lora) {
      if (w.defined() && run.slot >= w.a.dim(0)) {
        return invalid_argument(name + ": slot " + std::to_string(run.slot) + " outside the stacks' S = " +
                                std::to_string(w.a.dim(0)));
      }
    }
    end = run.first + run.tokens;
  }
  if (!p.runs.empty() && !p.token_slot.defined()) {
    return invalid_argument("LinearLoraParams.runs: given without token_slot");
  }
  if (!p.runs.empty() && (p.rest_rows < -1 || p.rest_rows > p.runs[0].first)) {
    return invalid_argument("LinearLoraParams.rest_rows: " + std::to_string(p.rest_rows) +
                            " (expected -1, or rows [0, rest_rows) before the first run, which starts at " +
                            std::to_string(p.runs[0].first) + ")");
  }
  return Status::Ok();
}

// ---- sampling.h -----------------------------------------------------------------------------------------

Status check(const SamplingParams& p) {
  LMX_RETURN_IF_ERROR(expect(p.logits, "SamplingParams.logits", DType::F32, {-1, -1}));
  const int64_t rows = p.logits.dim(0);
  if (p.logits.dim(1) < 1) {
    return invalid_argument("SamplingParams.logits: expected a vocabulary V >= 1, found " + p.logits.shape_str());
  }
  LMX_RETURN_IF_ERROR(expect(p.temperature, "SamplingParams.temperature", DType::F32, {rows}));
  LMX_RETURN_IF_ERROR(expect(p.top_k, "SamplingParams.top_k", DType::I32, {rows}));
  LMX_RETURN_IF_ERROR(expect(p.top_p, "SamplingParams.top_p", DType::F32, {rows}));
  LMX_RETURN_IF_ERROR(expect(p.uniform, "SamplingParams.uniform", DType::F32, {rows}));
  LMX_RETURN_IF_ERROR(expect(p.out_tokens, "SamplingParams.out_tokens", DType::I32, {rows}));
  if (present(p.out_logprob)) {
    LMX_RETURN_IF_ERROR(expect_tensor(p.out_logprob, "SamplingParams.out_logprob", DType::F32, {rows}));
  } else if (present(p.out_top_ids) || present(p.out_top_logprobs)) {
    return invalid_argument("SamplingParams.out_top_ids/out_top_logprobs: given without out_logprob");
  }
  if (present(p.out_top_ids) != present(p.out_top_logprobs))
    return invalid_argument("SamplingParams.out_top_ids and out_top_logprobs: give both or neither");
  if (present(p.out_top_ids)) {
    LMX_RETURN_IF_ERROR(expect_tensor(p.out_top_ids, "SamplingParams.out_top_ids", DType::I32, {rows, -1}));
    const int64_t n = p.out_top_ids.dim(1);
    LMX_RETURN_IF_ERROR(expect_tensor(p.out_top_logprobs, "SamplingParams.out_top_logprobs", DType::F32, {rows, n}));
    if (n > p.logits.dim(1))
      return invalid_argument("SamplingParams.out_top_ids: expected at most V = " + std::to_string(p.logits.dim(1)) +
                              " columns, found " + p.out_top_ids.shape_str());
  }
  return expect_one_device({{"SamplingParams.logits", &p.logits},
                            {"SamplingParams.temperature", &p.temperature},
                            {"SamplingParams.top_k", &p.top_k},
                            {"SamplingParams.top_p", &p.top_p},
                            {"SamplingParams.uniform", &p.uniform},
                            {"SamplingParams.out_tokens", &p.out_tokens},
                            {"SamplingParams.out_logprob", &p.out_logprob},
                            {"SamplingParams.out_top_ids", &p.out_top_ids},
                            {"SamplingParams.out_top_logprobs", &p.out_top_logprobs}});
}

}  // namespace lmx::ops
