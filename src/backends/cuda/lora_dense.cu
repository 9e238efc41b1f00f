// Dense multi-LoRA (lora_dense.cuh): the launcher only. It checks the LoraParams contract for the CUDA
// dtypes, groups tokens by slot with moe_align (single_expert) and runs moe_lora's tensor-core shrink and
// expand over the stack viewed with one expert; no kernel of its own (one op family per .cu: moe_lora.cu).
#include "backends/cuda/lora_dense.cuh"

#include <string>

#include "backends/cuda/check.h"
#include "backends/cuda/memory.h"
#include "backends/cuda/moe_align.cuh"
#include "backends/cuda/moe_lora_small.cuh"

namespace lmx::cuda {

LoraDenseScratch lora_dense_scratch(int64_t max_tokens, int64_t slots, int64_t capacity_rank) {
  LMX_CHECK(max_tokens >= 0 && slots > 0 && capacity_rank > 0, "lora_dense_scratch: T %lld, S %lld, R %lld",
            (long long)max_tokens, (long long)slots, (long long)capacity_rank);
  const int64_t capacity = moe_align_capacity(max_tokens, slots, kMoeLoraBlockM);
  LoraDenseScratch s;
  s.max_tokens = max_tokens;
  s.slots = slots;
  s.capacity_rank = capacity_rank;
  s.sorted_pairs = empty(DType::I32, {capacity});
  s.tile_group = empty(DType::I32, {capacity / kMoeLoraBlockM});
  s.group_offsets = empty(DType::I32, {slots + 1});
  s.num_tiles = empty(DType::I32, {1});
  s.workspace = empty(DType::U8, {int64_t(moe_align_workspace_bytes(max_tokens, slots))});
  s.z = empty(DType::F32, {kMoeLoraSmallMaxTargets, std::max<int64_t>(max_tokens, 1), capacity_rank});
  s.tile_counters = empty(DType::I32, {capacity / kMoeLoraBlockM});
  s.zero_ids = empty(DType::I32, {std::max<int64_t>(max_tokens, 1)});
  s.z_readers = empty(DType::I32, {kMoeLoraSmallMaxTargets, max_tokens + 1});
  fill_bytes(s.zero_ids.view, 0);
  fill_bytes(s.z_readers.view, 0);
  fill_bytes(s.z.view, 0);  // the only zeroing: the kernels keep both zero between calls
  fill_bytes(s.tile_counters.view, 0);
  return s;
}

namespace {

// The LoraParams contract for the CUDA dtypes and the scratch's sizes, each violation named.
// PRECOND: p.w is defined.
void check_part(const ops::LoraParams& p, const LoraDenseScratch& scratch, const char* op) {
  detail::require_cuda(op, {{"x", &p.x}, {"token_slot", &p.token_slot}, {"y", &p.y}});
  if (p.x.dtype != DType::BF16 || p.x.ndim != 2) detail::contract_failure(op, "x", p.x, "[T, in] BF16");
  const int64_t tokens = p.x.dim(0), in = p.x.dim(1);
  if (p.token_slot.dtype != DType::I32 || p.token_slot.ndim != 1 || p.token_slot.dim(0) != tokens) {
    detail::contract_failure(op, "token_slot", p.token_slot, "[T] I32, T = x.dim(0)");
  }
  if (p.w.a.dtype != DType::BF16 || p.w.a.ndim != 3 || p.w.a.dim(2) != in) {
    detail::contract_failure(op, "w.a", p.w.a, "[S, R, in] BF16, in = x.dim(1)");
  }
  const int64_t slots = p.w.a.dim(0), capacity_rank = p.w.a.dim(1);
  if (p.w.b.dtype != DType::BF16 || p.w.b.ndim != 3 || p.w.b.dim(0) != slots || p.w.b.dim(2) != capacity_rank) {
    detail::contract_failure(op, "w.b", p.w.b, "[S, out, R] BF16 matching w.a");
  }
  const int64_t out = p.w.b.dim(1);
  if (p.y.dtype != DType::BF16 || p.y.ndim != 2 || p.y.dim(0) != tokens || p.y.dim(1) != out) {
    detail::contract_failure(op, "y", p.y, "[T, out] BF16, out = w.b.dim(1)");
  }
  if (tokens > scratch.max_tokens || slots != scratch.slots || capacity_rank != scratch.capacity_rank) {
    detail::contract_failure(op, "x", p.x,
                             ("T <= " + std::to_string(scratch.max_tokens) + " with S = " +
                              std::to_string(scratch.slots) + ", R = " + std::to_string(scratch.capacity_rank) +
                              " (the scratch's sizes; w.a is " + p.w.a.shape_str() + ")")
                                 .c_str());
  }
}

// The stack viewed with one expert: [S, 1, R, in] / [S, 1, out, R].
ops::LoraStack one_expert(const ops::LoraStack& w) {
  const int64_t slots = w.a.dim(0), capacity_rank = w.a.dim(1), in = w.a.dim(2), out = w.b.dim(1);
  return {.a = w.a.reshape({slots, 1, capacity_rank, in}), .b = w.b.reshape({slots, 1, out, capacity_rank}),
          .rank = w.rank};
}

// The direct path's params of part `target` of a call: one pair per token, its "expert" 0, the target's own
// rows of the scratch's z and z_readers. topk_ids, token_slot and w are never written by the kernel before
// (PDL's precondition); x is (the projection's norm or attention), so it is read after the wait.
MoeLoraSmallParams direct_params(const ops::LoraParams& p, const LoraDenseScratch& scratch, int target, bool pdl) {
  const int64_t tokens = p.x.dim(0), capacity_rank = p.w.a.dim(1);
  auto* z = static_cast<float*>(scratch.z.view.data) + int64_t(target) * scratch.z.view.dim(1) * capacity_rank;
  auto* z_readers = static_cast<int32_t*>(scratch.z_readers.view.data) + int64_t(target) * scratch.z_readers.view.dim(1);
  return {.x = p.x,
          .topk_ids = Tensor(scratch.zero_ids.view.data, DType::I32, {tokens, 1}, Device::kCuda),
          .token_slot = p.token_slot,
          .w = one_expert(p.w),
          .z = Tensor(z, DType::F32, {tokens, capacity_rank}, Device::kCuda),
          .z_readers = Tensor(z_readers, DType::I32, {tokens + 1}, Device::kCuda),
          .y = p.y,
          .pdl = pdl};
}

// The expand's chunks per CTA for one part when the config leaves them to the batch size: the MoE rule
// (~8 waves of 4 CTAs per SM) gives a dense prefill's few tiles pieces of 1–2 chunks, CTAs that are mostly
// prologue; wide outputs at prefill sizes take 4 (run 53, T 1600, 8 adapters: q_proj 46.1 → 39.5 µs,
// o_proj 39.7 → 37.2). Narrow ones (k, v: 512 outputs, 8 chunks) keep the rule: a q|k|v group with 8
// chunks for every part was 7 µs slower than the rule, all of it in k and v's fewer CTAs.
MoeLoraConfig dense_part_config(MoeLoraConfig config, int64_t tokens, int64_t out) {
  if (config.expand_chunks == 0 && tokens >= 1024 && out >= 2048) config.expand_chunks = 4;
  return config;
}

// The tiled path of one part: (align by slot, unless `aligned` says this batch's tiles are already in the
// scratch) + shrink + expand.
void tiled_part(const ops::LoraParams& p, const LoraDenseScratch& scratch, const MoeLoraConfig& config,
                cudaStream_t stream, bool aligned) {
  const int64_t tokens = p.x.dim(0), slots = p.w.a.dim(0), capacity_rank = p.w.a.dim(1);
  const Tensor z(scratch.z.view.data, DType::F32, {tokens, capacity_rank}, Device::kCuda);
  // Views of the scratch for this T (moe_align wants its outputs sized for exactly this batch).
  const int64_t capacity = moe_align_capacity(tokens, slots, kMoeLoraBlockM);
  const Tensor sorted_pairs(scratch.sorted_pairs.view.data, DType::I32, {capacity}, Device::kCuda);
  const Tensor tile_group(scratch.tile_group.view.data, DType::I32, {capacity / kMoeLoraBlockM}, Device::kCuda);
  if (!aligned) {
    moe_align({.token_slot = p.token_slot,
               .experts = 1,
               .slots = slots,
               .block_m = kMoeLoraBlockM,
               .sorted_pairs = sorted_pairs,
               .tile_group = tile_group,
               .group_offsets = scratch.group_offsets,
               .num_tiles = scratch.num_tiles,
               .workspace = scratch.workspace,
               .single_expert = true},
              stream);
  }
  const MoeLoraParams params{
      .x = p.x,
      .w = one_expert(p.w),
      .top_k = 1,
      .sorted_pairs = sorted_pairs,
      .tile_group = tile_group,
      .num_tiles = scratch.num_tiles,
      .block_m = kMoeLoraBlockM,
      .z = z,
      .y = p.y,
      .config = dense_part_config(config, tokens, p.y.dim(1)),
      .tile_counters = scratch.tile_counters};
  moe_lora_shrink(params, stream);
  moe_lora_expand(params, stream);
}

// The direct path's params of a group's defined parts (lora_dense_group's checks, each violation named):
// the number of targets, and the group's T in *tokens (-1 when no part is defined).
int pack_group(std::span<const ops::LoraParams> parts, const LoraDenseScratch& scratch, bool pdl, const char* op,
               MoeLoraSmallParams (&direct)[kMoeLoraSmallMaxTargets], int64_t* tokens) {
  if (parts.size() > size_t(kMoeLoraSmallMaxTargets)) {
    detail::contract_failure(op, "x", parts[0].x,
                             ("at most " + std::to_string(kMoeLoraSmallMaxTargets) + " parts in a group, found " +
                              std::to_string(parts.size()))
                                 .c_str());
  }
  int targets = 0;
  *tokens = -1;
  for (const ops::LoraParams& p : parts) {
    if (!p.w.defined()) continue;
    check_part(p, scratch, op);
    if (*tokens < 0) *tokens = p.x.dim(0);
    const ops::LoraParams& first = parts[0];
    if (p.x.data != first.x.data || p.x.dim(0) != first.x.dim(0) || p.x.dim(1) != first.x.dim(1)) {
      detail::contract_failure(op, "x", p.x, ("the group's x, " + first.x.shape_str() + " at the same address").c_str());
    }
    if (p.token_slot.data != first.token_slot.data) {
      detail::contract_failure(op, "token_slot", p.token_slot, "the group's token_slot (the same tensor in every part)");
    }
    direct[targets] = direct_params(p, scratch, targets, pdl);
    ++targets;
  }
  return targets;
}

}  // namespace

void lora_dense(const ops::LoraParams& p, const LoraDenseScratch& scratch, const MoeLoraConfig& config,
                cudaStream_t stream, int path) {
  if (!p.w.defined()) return;  // no resident adapter targets this projection: nothing is launched
  check_part(p, scratch, "lora_dense");
  const int64_t tokens = p.x.dim(0);
  if (tokens == 0) return;
  if (path == 0 || (path < 0 && moe_lora_small_fits(tokens))) {
    const MoeLoraSmallParams small = direct_params(p, scratch, 0, config.pdl);
    moe_lora_small_shrink(small, stream);
    moe_lora_small_expand(small, stream);
    return;
  }
  tiled_part(p, scratch, config, stream, false);
}

void lora_dense_group(std::span<const ops::LoraParams> parts, const LoraDenseScratch& scratch,
                      const MoeLoraConfig& config, cudaStream_t stream, int path) {
  const char* op = "lora_dense_group";
  MoeLoraSmallParams direct[kMoeLoraSmallMaxTargets];
  int64_t tokens = -1;
  const int targets = pack_group(parts, scratch, config.pdl, op, direct, &tokens);
  if (targets == 0 || tokens == 0) return;
  if (path == 0 || (path < 0 && moe_lora_small_fits(tokens))) {
    moe_lora_small_shrink(std::span<const MoeLoraSmallParams>(direct, size_t(targets)), stream);
    moe_lora_small_expand(std::span<const MoeLoraSmallParams>(direct, size_t(targets)), stream);
    return;
  }
  // Tiled: the parts share x and token_slot, and their stacks the slot count, so one align serves all.
  bool aligned = false;
  int64_t slots = -1;
  for (const ops::LoraParams& p : parts) {
    if (!p.w.defined()) continue;
    if (slots >= 0 && p.w.a.dim(0) != slots) {
      detail::contract_failure(op, "w.a", p.w.a, ("the group's slot count S = " + std::to_string(slots)).c_str());
    }
    slots = p.w.a.dim(0);
    tiled_part(p, scratch, config, stream, aligned);
    aligned = true;
  }
}

// The fused linear + LoRA's halves (lora_dense.cuh). Every part must carry a stack: a part without one
// would get no expand CTA to write it.
namespace {
int pack_fused(std::span<const ops::LoraParams> parts, const LoraDenseScratch& scratch, bool pdl, const char* op,
               MoeLoraSmallParams (&direct)[kMoeLoraSmallMaxTargets]) {
  for (const ops::LoraParams& p : parts) {
    if (!p.w.defined()) detail::contract_failure(op, "w.a", p.w.a, "defined in every part of the fused form");
  }
  int64_t tokens = -1;
  const int targets = pack_group(parts, scratch, pdl, op, direct, &tokens);
  if (tokens > kMoeLoraSmallMaxPairs) {
    detail::contract_failure(op, "x", parts[0].x,
                             ("T <= " + std::to_string(kMoeLoraSmallMaxPairs) + " (lora_dense_fused_fits)").c_str());
  }
  return targets;
}
}  // namespace

void lora_dense_fused_shrink(std::span<const ops::LoraParams> parts, const LoraDenseScratch& scratch,
                             cudaStream_t stream) {
  MoeLoraSmallParams direct[kMoeLoraSmallMaxTargets];
  const int targets = pack_fused(parts, scratch, false, "lora_dense_fused_shrink", direct);
  if (targets == 0 || parts[0].x.dim(0) == 0) return;
  moe_lora_small_shrink(std::span<const MoeLoraSmallParams>(direct, size_t(targets)), stream);
}

void lora_dense_fused_expand(std::span<const ops::LoraParams> parts, const Tensor& out, const Tensor& bias,
                             const LoraDenseScratch& scratch, const MoeLoraConfig& config, cudaStream_t stream) {
  const char* op = "lora_dense_fused_expand";
  MoeLoraSmallParams direct[kMoeLoraSmallMaxTargets];
  const int targets = pack_fused(parts, scratch, config.pdl, op, direct);
  if (targets == 0 || parts[0].x.dim(0) == 0) return;
  int64_t column = 0;
  for (int t = 0; t < targets; ++t) {
    direct[t].base = out;
    direct[t].base_column = column;
    direct[t].bias = bias;
    column += parts[size_t(t)].y.dim(1);
  }
  if (column != out.dim(1)) {
    detail::contract_failure(op, "out", out, ("the parts' columns in order, " + std::to_string(column) + " in all").c_str());
  }
  moe_lora_small_expand(std::span<const MoeLoraSmallParams>(direct, size_t(targets)), stream);
}

}  // namespace lmx::cuda
