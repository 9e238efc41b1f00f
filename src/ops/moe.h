// The MoE block contract: routed experts for every (token, k) pair, with the per-token adapter's LoRA on
// gate_up and down, combined by the router weights. One op, so a backend is free to sort, tile and fuse.
// For pair (t, k) with expert e and slot s:
//   h   = W_gu[e]·x[t] + b_gu[e] + B_gu[s,e]·(A_gu[s,e]·x[t])      [2I]
//   a   = act(h)                                                   [I]
//   d   = W_d[e]·a + b_d[e] + B_d[s,e]·(A_d[s,e]·a)                [H]
//   out[t] = Σ_k w[t,k] · d
#pragma once
#include "core/status.h"
#include "core/tensor.h"
#include "ops/lora.h"

namespace lmx::ops {

enum class MoeActivation {
  kSiluGated,      // silu(gate) * up
  kGptOssClamped,  // gate = min(gate, limit); up = clamp(up, -limit, limit); (up + 1) * gate * sigmoid(alpha * gate)
};
enum class GateUpLayout {
  kHalves,       // rows [0, I) gate, [I, 2I) up (Qwen3-MoE, Mixtral)
  kInterleaved,  // row 2i gate i, row 2i+1 up i (GPT-OSS)
};

// An expert weight's MXFP4 copy in the decode layout of ops/mxfp4.h: blocks [E, K/64, N, 32] and scales
// [E, K/64, N, 2], U8, for the weight [E, N, K] it dequantizes to exactly.
struct Mxfp4Weight {
  Tensor blocks;
  Tensor scales;
  bool defined() const { return blocks.defined(); }
};

// Generated (dummy) MXFP4 experts in place (presets' --mxfp4-experts): `weight` gets the bytes of
// ops/mxfp4.h's generated_unit for (seed, scale_lo) and `values` their exact bf16 dequantization, bit for bit
// the same on every backend (and as model::generate_mxfp4_decode + dequantize_mxfp4_decode on the host).
struct GeneratedMxfp4Params {
  Mxfp4Weight weight;  // blocks [E, K/64, N, 32], scales [E, K/64, N, 2] U8
  Tensor values;       // [E, N, K] bf16
  uint64_t seed = 0;
  int scale_lo = 0;    // exponents in [scale_lo, scale_lo + 2]; scale_lo + 2 <= mxfp4::kMaxDecodeScale
};
Status check(const GeneratedMxfp4Params& p);

struct MoeParams {
  Tensor x;             // [T, H]
  Tensor topk_ids;      // [T, K] i32
  Tensor topk_weights;  // [T, K] f32
  Tensor token_slot;    // [T] i32, -1 = base; may be undefined when there is no LoRA
  Tensor gate_up;       // [E, 2I, H] bf16
  Tensor gate_up_bias;  // [E, 2I] bf16, optional
  Tensor down;          // [E, H, I] bf16
  Tensor down_bias;     // [E, H] bf16, optional
  LoraStack lora_gate_up;  // a [S, E, R, H], b [S, E, 2I, R]; optional
  LoraStack lora_down;     // a [S, E, R, I], b [S, E, H, R]; optional
  MoeActivation activation = MoeActivation::kSiluGated;
  GateUpLayout layout = GateUpLayout::kHalves;
  float swiglu_alpha = 1.702f;
  float swiglu_limit = 7.0f;
  Tensor out;  // [T, H], overwritten
  // Host-side hint for the backend's choice of MoE-LoRA path: tokens with an adapter that sit in short
  // same-adapter runs (a sequence with fewer than kLoraRunTokens tokens in the batch: decode tokens, short
  // chunks), or -1 when unknown. A kernel that handles one adapter per 16 expert-sorted rows at a time
  // pays for every adapter such rows mix.
  int64_t lora_scattered_tokens = -1;
  // Optional MXFP4 copies of gate_up and down (GPT-OSS's own expert format, --mxfp4-experts), which must
  // dequantize exactly to gate_up and down: a backend may stream them instead where that pays (CUDA: the
  // decode-sized GEMMs, 3.8× fewer weight bytes) — the same values, so the same results up to the order of
  // fp32 sums. Backends without such a kernel ignore them.
  Mxfp4Weight gate_up_mxfp4, down_mxfp4;
};
// The run length (tokens of one sequence in a batch) from which lora_scattered_tokens stops counting a
// sequence: 16 expert-sorted rows span about 16·E/K tokens (GPT-OSS-20B 128, Qwen3-30B-A3B 256).
constexpr int kLoraRunTokens = 256;
Status check(const MoeParams& p);

}  // namespace lmx::ops
