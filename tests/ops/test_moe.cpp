// The MoE op (ops/moe.h) on the cpu backend against a per-token dense loop in double over explicitly
// merged weights W + B·A of each (slot, expert). Rows of A and columns of B past a slot's true rank are
// NaN, so reading padding shows up as NaN in the output.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "backends/cpu/cpu_backend.h"
#include "op_test_util.h"

namespace lmx {
namespace {

using ops::GateUpLayout;
using ops::MoeActivation;

struct MoeCase {
  int tokens, hidden, inter, experts, top_k;
  MoeActivation activation = MoeActivation::kSiluGated;
  GateUpLayout layout = GateUpLayout::kHalves;
  bool biases = false;
  std::vector<int32_t> gate_up_ranks;           // per slot; empty = no gate_up LoRA
  std::vector<int32_t> down_ranks;              // per slot; empty = no down LoRA
  int gate_up_capacity = 0, down_capacity = 0;  // R of each stack
  DType lora_dtype = DType::F32;
  bool token_slot = true;  // false: token_slot undefined (only without LoRA)
  float limit = 7.0f;
};

// A slot-stacked LoRA with random entries up to each slot's rank and NaN past it.
ops::LoraStack make_stack(Rng& rng, std::vector<OwnedTensor>& keep, const std::vector<int32_t>& ranks, int experts,
                          int capacity, int in, int out, DType dtype) {
  const int slots = int(ranks.size());
  OwnedTensor a = OwnedTensor::host(dtype, {slots, experts, capacity, in});
  OwnedTensor b = OwnedTensor::host(dtype, {slots, experts, out, capacity});
  auto put = [&](const OwnedTensor& t, int64_t i, float v) {
    if (dtype == DType::BF16)
      t.view.ptr<bf16>()[i] = f32_to_bf16(v);
    else
      t.view.ptr<float>()[i] = v;
  };
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int s = 0; s < slots; ++s) {
    for (int e = 0; e < experts; ++e) {
      const int64_t matrix = int64_t(s) * experts + e;
      for (int r = 0; r < capacity; ++r) {
        for (int i = 0; i < in; ++i) {
          put(a, (matrix * capacity + r) * in + i, r < ranks[s] ? rng.normal() / std::sqrt(float(in)) : nan);
        }
      }
      for (int o = 0; o < out; ++o) {
        for (int r = 0; r < capacity; ++r) {
          put(b, (matrix * out + o) * capacity + r, r < ranks[s] ? 0.5f * rng.normal() : nan);
        }
      }
    }
  }
  OwnedTensor rank = test::i32_tensor(ranks);
  keep.insert(keep.end(), {a, b, rank});
  return {.a = a, .b = b, .rank = rank};
}

// W[e] + B[s,e][:, :r]·A[s,e][:r] as a dense [out, in] matrix in double (s = -1 or r = 0: W alone).
std::vector<double> merged(const Tensor& w, int e, const ops::LoraStack& lora, int slot, int in, int out) {
  std::vector<double> m(int64_t(out) * in);
  for (int64_t i = 0; i < int64_t(out) * in; ++i) m[i] = test::value_at(w, int64_t(e) * out * in + i);
  if (!lora.defined() || slot < 0) return m;
  const int rank = lora.rank.ptr<int32_t>()[slot], experts = int(lora.a.dim(1)), capacity = int(lora.a.dim(2));
  const int64_t matrix = int64_t(slot) * experts + e;
  for (int o = 0; o < out; ++o) {
    for (int i = 0; i < in; ++i) {
      for (int r = 0; r < rank; ++r) {
        m[int64_t(o) * in + i] += test::value_at(lora.b, (matrix * out + o) * capacity + r) *
                                  test::value_at(lora.a, (matrix * capacity + r) * in + i);
      }
    }
  }
  return m;
}

void check_moe(uint64_t seed, const MoeCase& c) {
  SCOPED_TRACE("seed " + std::to_string(seed) + " T=" + std::to_string(c.tokens) + " H=" + std::to_string(c.hidden) +
               " I=" + std::to_string(c.inter) + " E=" + std::to_string(c.experts) + " K=" + std::to_string(c.top_k));
  Rng rng(seed);
  const int T = c.tokens, H = c.hidden, I = c.inter, E = c.experts, K = c.top_k;
  std::vector<OwnedTensor> keep;
  OwnedTensor x = test::random_f32(rng, {T, H});
  OwnedTensor gate_up = test::random_bf16(rng, {E, 2 * I, H}, 1.0f / std::sqrt(float(H)));
  OwnedTensor gate_up_bias = test::random_bf16(rng, {E, 2 * I}, 0.5f);
  OwnedTensor down = test::random_bf16(rng, {E, H, I}, 1.0f / std::sqrt(float(I)));
  OwnedTensor down_bias = test::random_bf16(rng, {E, H}, 0.5f);

  // Distinct experts per token, positive weights; slots cycle through -1 and every slot.
  std::vector<int32_t> ids, slots;
  std::vector<float> weights;
  const int num_slots = int(std::max(c.gate_up_ranks.size(), c.down_ranks.size()));
  for (int t = 0; t < T; ++t) {
    std::vector<int32_t> experts = test::permutation(rng, E);
    ids.insert(ids.end(), experts.begin(), experts.begin() + K);
    for (int k = 0; k < K; ++k) weights.push_back(rng.uniform(0.1f, 1.0f));
    slots.push_back(num_slots ? int32_t(t % (num_slots + 1)) - 1 : -1);
  }
  OwnedTensor topk_ids = test::i32_tensor(ids, {T, K});
  OwnedTensor topk_weights = test::f32_tensor(weights, {T, K});
  OwnedTensor token_slot = test::i32_tensor(slots);
  ops::LoraStack lora_gate_up, lora_down;
  if (!c.gate_up_ranks.empty()) {
    lora_gate_up = make_stack(rng, keep, c.gate_up_ranks, E, c.gate_up_capacity, H, 2 * I, c.lora_dtype);
  }
  if (!c.down_ranks.empty()) {
    lora_down = make_stack(rng, keep, c.down_ranks, E, c.down_capacity, I, H, c.lora_dtype);
  }

  // Reference: per token, per k, dense products with the merged weights.
  std::vector<double> want(int64_t(T) * H, 0.0);
  for (int t = 0; t < T; ++t) {
    for (int k = 0; k < K; ++k) {
      const int e = ids[t * K + k];
      const std::vector<double> w_gu = merged(gate_up, e, lora_gate_up, slots[t], H, 2 * I);
      const std::vector<double> w_d = merged(down, e, lora_down, slots[t], I, H);
      std::vector<double> h(2 * I), a(I);
      for (int o = 0; o < 2 * I; ++o) {
        h[o] = c.biases ? test::value_at(gate_up_bias, e * 2 * I + o) : 0.0;
        for (int i = 0; i < H; ++i) h[o] += w_gu[int64_t(o) * H + i] * test::value_at(x, t * H + i);
      }
      for (int i = 0; i < I; ++i) {
        double gate = c.layout == GateUpLayout::kHalves ? h[i] : h[2 * i];
        double up = c.layout == GateUpLayout::kHalves ? h[I + i] : h[2 * i + 1];
        if (c.activation == MoeActivation::kSiluGated) {
          a[i] = test::silu_d(gate) * up;
        } else {
          gate = std::min(gate, double(c.limit));
          up = std::clamp(up, -double(c.limit), double(c.limit));
          a[i] = (up + 1.0) * gate * test::sigmoid_d(1.702 * gate);
        }
      }
      for (int o = 0; o < H; ++o) {
        double d = c.biases ? test::value_at(down_bias, e * H + o) : 0.0;
        for (int i = 0; i < I; ++i) d += w_d[int64_t(o) * I + i] * a[i];
        want[int64_t(t) * H + o] += double(weights[t * K + k]) * d;
      }
    }
  }

  OwnedTensor out = OwnedTensor::host(DType::F32, {T, H});
  test::poison(out);
  cpu::CpuBackend backend(3);
  backend.moe({.x = x,
               .topk_ids = topk_ids,
               .topk_weights = topk_weights,
               .token_slot = c.token_slot ? token_slot.view : Tensor(),
               .gate_up = gate_up,
               .gate_up_bias = c.biases ? gate_up_bias.view : Tensor(),
               .down = down,
               .down_bias = c.biases ? down_bias.view : Tensor(),
               .lora_gate_up = lora_gate_up,
               .lora_down = lora_down,
               .activation = c.activation,
               .layout = c.layout,
               .swiglu_alpha = 1.702f,
               .swiglu_limit = c.limit,
               .out = out});
  EXPECT_TRUE(test::all_close(out, want, test::kTolReduction));
}

TEST(Moe, BaseExpertsOnly) {
  check_moe(1, {.tokens = 1, .hidden = 4, .inter = 2, .experts = 1, .top_k = 1, .token_slot = false});
  check_moe(2, {.tokens = 5, .hidden = 16, .inter = 8, .experts = 4, .top_k = 2, .biases = true});
  check_moe(3, {.tokens = 9, .hidden = 24, .inter = 12, .experts = 6, .top_k = 6, .token_slot = false});
}

TEST(Moe, LayoutsAndActivations) {
  uint64_t seed = 10;
  for (GateUpLayout layout : {GateUpLayout::kHalves, GateUpLayout::kInterleaved}) {
    for (MoeActivation activation : {MoeActivation::kSiluGated, MoeActivation::kGptOssClamped}) {
      for (float limit : {7.0f, 0.6f}) {  // 0.6: most gate/up values hit the clamp
        check_moe(++seed, {.tokens = 6,
                           .hidden = 16,
                           .inter = 10,
                           .experts = 4,
                           .top_k = 2,
                           .activation = activation,
                           .layout = layout,
                           .biases = true,
                           .limit = limit});
      }
    }
  }
}

TEST(Moe, LoraPerSlotAndExpert) {
  // Slot ranks include 0 and the full capacity; tokens cycle through slot -1 and every slot.
  const MoeCase gpt_oss{.tokens = 11,
                        .hidden = 16,
                        .inter = 8,
                        .experts = 4,
                        .top_k = 2,
                        .activation = MoeActivation::kGptOssClamped,
                        .layout = GateUpLayout::kInterleaved,
                        .biases = true,
                        .gate_up_ranks = {2, 0, 8},
                        .down_ranks = {3, 1, 0},
                        .gate_up_capacity = 8,
                        .down_capacity = 4,
                        .limit = 1.5f};
  check_moe(30, gpt_oss);
  MoeCase gate_up_only = gpt_oss;
  gate_up_only.down_ranks = {};
  check_moe(31, gate_up_only);
  MoeCase down_only = gpt_oss;
  down_only.gate_up_ranks = {};
  check_moe(32, down_only);
  MoeCase bf16_stacks = gpt_oss;
  bf16_stacks.lora_dtype = DType::BF16;
  check_moe(33, bf16_stacks);
  check_moe(34, {.tokens = 1,
                 .hidden = 8,
                 .inter = 4,
                 .experts = 2,
                 .top_k = 1,
                 .gate_up_ranks = {1, 4},
                 .down_ranks = {2, 2},
                 .gate_up_capacity = 4,
                 .down_capacity = 2});
  // Larger: several threads' worth of tokens, Qwen3-like halves layout, no biases.
  check_moe(35, {.tokens = 40,
                 .hidden = 64,
                 .inter = 48,
                 .experts = 8,
                 .top_k = 4,
                 .gate_up_ranks = {16, 4, 0, 8},
                 .down_ranks = {8, 8, 8, 0},
                 .gate_up_capacity = 16,
                 .down_capacity = 8});
}

TEST(MoeDeathTest, BadIdsAbort) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  Rng rng(7);
  OwnedTensor x = test::random_f32(rng, {2, 4});
  OwnedTensor gate_up = test::random_bf16(rng, {3, 4, 4});
  OwnedTensor down = test::random_bf16(rng, {3, 4, 2});
  OwnedTensor weights = test::f32_tensor({1, 1}, {2, 1});
  OwnedTensor bad_ids = test::i32_tensor({0, 3}, {2, 1});
  OwnedTensor out = OwnedTensor::host(DType::F32, {2, 4});
  ops::MoeParams p{.x = x, .topk_ids = bad_ids, .topk_weights = weights, .gate_up = gate_up, .down = down, .out = out};
  EXPECT_DEATH(cpu::CpuBackend(1).moe(p), "moe .*topk_ids\\[1\\]\\[0\\] = 3 outside \\[0, E = 3\\)");

  std::vector<OwnedTensor> keep;
  OwnedTensor good_ids = test::i32_tensor({0, 2}, {2, 1});
  p.topk_ids = good_ids;
  p.lora_down = make_stack(rng, keep, {1, 2}, 3, 2, 2, 4, DType::F32);
  OwnedTensor bad_slot = test::i32_tensor({0, 2});
  p.token_slot = bad_slot;
  EXPECT_DEATH(cpu::CpuBackend(1).moe(p), "moe .*token_slot\\[1\\] = 2 outside \\[-1, S = 2\\)");
  OwnedTensor good_slot = test::i32_tensor({0, -1});
  p.token_slot = good_slot;
  p.lora_down.rank.ptr<int32_t>()[1] = 3;
  EXPECT_DEATH(cpu::CpuBackend(1).moe(p), "moe .*MoeParams.lora_down.rank\\[1\\] = 3 outside \\[0, R = 2\\]");
}

}  // namespace
}  // namespace lmx
