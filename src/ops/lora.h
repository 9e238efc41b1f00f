// LoRA op contracts: the targets loramux knows, the slot-stacked weight layout every backend reads, and
// the dense multi-LoRA op (y += (x·Aᵀ)·Bᵀ per token by adapter slot). The MoE LoRA travels inside
// MoeParams (ops/moe.h). Scaling (alpha/r or alpha/sqrt(r)) is folded into B when an adapter is loaded.
#pragma once
#include <array>
#include <cstdint>
#include <span>
#include <string_view>

#include "core/status.h"
#include "core/tensor.h"
#include "ops/basic.h"

namespace lmx::ops {

// Every place a LoRA can attach. Per-expert gate/up adapters are merged into kMoeGateUp at load
// (block-diagonal A/B, so exact); dense-MLP gate/up stay separate like the base weights.
enum class LoraTarget : int { kQ, kK, kV, kO, kGate, kUp, kDown, kMoeGateUp, kMoeDown, kCount };
constexpr int kNumLoraTargets = int(LoraTarget::kCount);
std::string_view lora_target_name(LoraTarget target);  // "q_proj", ..., "experts.gate_up", "experts.down"

// One target of one layer for all S adapter slots. Undefined `a` = no slot has this target (skip it).
struct LoraStack {
  Tensor a;     // dense: [S, R, in]; MoE: [S, E, R, in]   (backend's lora dtype)
  Tensor b;     // dense: [S, out, R]; MoE: [S, E, out, R] (scale already folded in)
  Tensor rank;  // [S] i32: the true rank of the slot's adapter here, 0 = slot has no LoRA on this target
  std::span<const int32_t> host_rank;  // optional: rank's [S] values in host memory (the slot table's mirror)
  bool defined() const { return a.defined(); }
};

// Consecutive tokens of one adapter slot in a batch (a prompt's chunk): rows [first, first + tokens) of
// token_slot all equal `slot`. A host-side hint the engine gives eager steps, so a backend may treat a long
// run as a dense product (cuda: two cuBLASLt products per output instead of the grouped kernels).
struct LoraRun {
  int64_t first = 0, tokens = 0;
  int32_t slot = -1;
};

struct LoraParams {
  Tensor x;           // [T, in]  activations
  Tensor token_slot;  // [T] i32  adapter slot per token, -1 = base model
  LoraStack w;
  Tensor y;           // [T, out] accumulated: y[t] += B[s]·(A[s]·x[t]) over the slot's true rank
};
Status check(const LoraParams& p);

// A projection and its LoRA in one call (the model's every dense projection): out = x·Wᵀ + b, optionally
// split into column parts (a fused q|k|v product; split_columns' contract), then each output's LoRA for the
// tokens with an adapter (LoraParams' math on linear.x). A backend may fuse the steps (cuda at decode sizes:
// the shrink beside the product, then one expand that also splits, adds the bias and the LoRA).
// Default (ops::Backend::linear_lora): linear, split_columns, lora_group.
struct LinearLoraParams {
  LinearParams linear;              // the product into linear.out [T, N]; with parts, the split's source
  std::array<Tensor, 3> parts;      // optional: [T, N_i] in order, sum N_i = N; parts[0] undefined = no split
  Tensor token_slot;                // [T] i32; undefined = no LoRA in this batch (lora is then ignored)
  std::array<LoraStack, 3> lora;    // per output: parts[i], or lora[0] for linear.out itself; undefined = none
  // Optional hint (host memory, ascending, disjoint): runs of token_slot (LoraRun), and where the tokens with
  // a slot outside them lie: all in rows [0, rest_rows) (0: the runs hold every one), or -1: anywhere.
  // Results are the same with or without it.
  std::span<const LoraRun> runs;
  int64_t rest_rows = -1;
};
Status check(const LinearLoraParams& p);

}  // namespace lmx::ops
