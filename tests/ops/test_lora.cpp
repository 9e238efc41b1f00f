// The dense multi-LoRA op (ops/lora.h) on the cpu backend against merged weights: y0 + (B[s]·A[s])·x per
// token, in double. Padding past each slot's rank is NaN, so reading it shows in the output.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <vector>

#include "backends/cpu/cpu_backend.h"
#include "op_test_util.h"

namespace lmx {
namespace {

void check_lora(uint64_t seed, int tokens, int in, int out, const std::vector<int32_t>& ranks, int capacity,
                DType stack_dtype, const std::vector<int32_t>& token_slots) {
  SCOPED_TRACE("seed " + std::to_string(seed) + " T=" + std::to_string(tokens) + " in=" + std::to_string(in) +
               " out=" + std::to_string(out) + " R=" + std::to_string(capacity) +
               (stack_dtype == DType::BF16 ? " bf16 stack" : ""));
  Rng rng(seed);
  const int slots = int(ranks.size());
  OwnedTensor x = test::random_f32(rng, {tokens, in});
  OwnedTensor y = test::random_f32(rng, {tokens, out});
  OwnedTensor a = OwnedTensor::host(stack_dtype, {slots, capacity, in});
  OwnedTensor b = OwnedTensor::host(stack_dtype, {slots, out, capacity});
  auto put = [&](const OwnedTensor& t, int64_t i, float v) {
    if (stack_dtype == DType::BF16)
      t.view.ptr<bf16>()[i] = f32_to_bf16(v);
    else
      t.view.ptr<float>()[i] = v;
  };
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int s = 0; s < slots; ++s) {
    for (int r = 0; r < capacity; ++r) {
      for (int i = 0; i < in; ++i) put(a, (int64_t(s) * capacity + r) * in + i, r < ranks[s] ? rng.normal() : nan);
      for (int o = 0; o < out; ++o) put(b, (int64_t(s) * out + o) * capacity + r, r < ranks[s] ? rng.normal() : nan);
    }
  }
  OwnedTensor rank = test::i32_tensor(ranks);
  OwnedTensor token_slot = test::i32_tensor(token_slots);

  // Reference: the merged delta ΔW[s] = B[s][:, :r]·A[s][:r], then y0 + ΔW[s]·x.
  std::vector<double> want = test::to_doubles(y);
  for (int t = 0; t < tokens; ++t) {
    const int s = token_slots[t];
    if (s < 0) continue;
    for (int o = 0; o < out; ++o) {
      for (int i = 0; i < in; ++i) {
        double delta_w = 0.0;
        for (int r = 0; r < ranks[s]; ++r) {
          delta_w += test::value_at(b, (int64_t(s) * out + o) * capacity + r) *
                     test::value_at(a, (int64_t(s) * capacity + r) * in + i);
        }
        want[int64_t(t) * out + o] += delta_w * test::value_at(x, int64_t(t) * in + i);
      }
    }
  }
  cpu::CpuBackend backend(2);
  backend.lora({.x = x, .token_slot = token_slot, .w = {.a = a, .b = b, .rank = rank}, .y = y});
  EXPECT_TRUE(test::all_close(y, want, test::kTolReduction));
}

TEST(Lora, MatchesMergedWeights) {
  check_lora(1, 1, 8, 4, {2}, 2, DType::F32, {0});                           // T = 1, full rank
  check_lora(2, 1, 8, 4, {2}, 2, DType::F32, {-1});                          // base-model token
  check_lora(3, 6, 33, 17, {4, 0, 1}, 4, DType::F32, {0, 1, 2, -1, 2, 0});   // rank-0 slot
  check_lora(4, 6, 33, 17, {4, 0, 1}, 4, DType::BF16, {2, 2, 1, 0, -1, 0});  // bf16 stacks
  check_lora(5, 40, 128, 96, {16, 8, 3, 16}, 16, DType::F32,                 // several threads
             {0, 1, 2,  3, -1, 3, 2, 1, 0, 0, 1, 2,  3, -1, 3, 2, 1, 0, 0, 1,
              2, 3, -1, 3, 2,  1, 0, 0, 1, 2, 3, -1, 3, 2,  1, 0, 0, 1, 2, 3});
}

TEST(Lora, UndefinedStackLeavesYUnchanged) {
  Rng rng(9);
  OwnedTensor x = test::random_f32(rng, {3, 5});
  OwnedTensor y = test::random_f32(rng, {3, 7});
  OwnedTensor before = OwnedTensor::host(DType::F32, {3, 7});
  std::copy_n(y.view.ptr<float>(), 21, before.view.ptr<float>());
  OwnedTensor token_slot = test::i32_tensor({0, -1, 1});
  cpu::CpuBackend backend(1);
  backend.lora({.x = x, .token_slot = token_slot, .w = {}, .y = y});
  EXPECT_TRUE(test::bitwise_equal(y, before));
}

// ops::Backend::linear_lora (the composition every backend may fuse) against the merged weights, in double:
// out = x·(W + ΔW_part)ᵀ + b per token, split into q|k|v-like parts with a part without LoRA, and one output
// without a split; the contract names a stack given for an output that is not there.
TEST(LinearLora, MatchesMergedWeights) {
  Rng rng(11);
  const int tokens = 5, in = 12, capacity = 4, slots = 3;
  const std::vector<int64_t> outs = {6, 3, 3};
  const int width = 12;
  OwnedTensor x = test::random_f32(rng, {tokens, in});
  OwnedTensor weight = test::random_bf16(rng, {width, in});
  OwnedTensor bias = test::random_bf16(rng, {width});
  OwnedTensor token_slot = test::i32_tensor({0, -1, 2, 1, 2});
  OwnedTensor rank = test::i32_tensor({4, 0, 2});
  std::vector<OwnedTensor> a, b;
  for (int64_t out : outs) {
    a.push_back(test::random_f32(rng, {slots, capacity, in}));
    b.push_back(test::random_f32(rng, {slots, out, capacity}));
  }
  for (bool split : {true, false}) {
    SCOPED_TRACE(split ? "q|k|v split, k without LoRA" : "one output");
    const int parts = split ? 3 : 1;
    OwnedTensor all = OwnedTensor::host(DType::F32, {tokens, width});
    std::vector<OwnedTensor> out;
    for (int i = 0; i < parts; ++i) out.push_back(OwnedTensor::host(DType::F32, {tokens, split ? outs[size_t(i)] : width}));
    ops::LinearLoraParams p{.linear = {.x = x, .weight = weight, .bias = bias, .out = split ? all.view : out[0].view},
                            .token_slot = token_slot};
    // Without a split the one output is `width` wide: its own [S, width, R] B.
    OwnedTensor b_whole = test::random_f32(rng, {slots, width, capacity});
    for (int i = 0; i < parts; ++i) {
      if (split) p.parts[size_t(i)] = out[size_t(i)];
      if (split && i == 1) continue;  // k: no adapter targets it
      p.lora[size_t(i)] = {.a = a[size_t(i)], .b = split ? b[size_t(i)].view : b_whole.view, .rank = rank};
    }
    cpu::CpuBackend(2).linear_lora(p);
    int64_t first = 0;
    for (int i = 0; i < parts; ++i) {
      const int64_t n = out[size_t(i)].view.dim(1);
      std::vector<double> want(size_t(tokens * n));
      for (int t = 0; t < tokens; ++t) {
        const int s = token_slot.view.ptr<int32_t>()[t];
        for (int64_t o = 0; o < n; ++o) {
          double v = test::value_at(bias, first + o);
          for (int k = 0; k < in; ++k) v += test::value_at(weight, (first + o) * in + k) * test::value_at(x, t * in + k);
          if (s >= 0 && p.lora[size_t(i)].defined()) {
            const Tensor& bt = p.lora[size_t(i)].b;
            for (int r = 0; r < rank.view.ptr<int32_t>()[s]; ++r) {
              double z = 0;
              for (int k = 0; k < in; ++k) z += test::value_at(a[size_t(i)], (int64_t(s) * capacity + r) * in + k) * test::value_at(x, t * in + k);
              v += test::value_at(bt, (int64_t(s) * n + o) * capacity + r) * z;
            }
          }
          want[size_t(t * n + o)] = v;
        }
      }
      EXPECT_TRUE(test::all_close(out[size_t(i)], want, test::kTolReduction)) << "output " << i;
      first += n;
    }
  }
}

TEST(LinearLora, ContractNamesTheStackWithoutAnOutput) {
  OwnedTensor x = OwnedTensor::host(DType::F32, {2, 4});
  OwnedTensor weight = OwnedTensor::host(DType::BF16, {3, 4});
  OwnedTensor out = OwnedTensor::host(DType::F32, {2, 3});
  OwnedTensor a = OwnedTensor::host(DType::F32, {1, 2, 4});
  OwnedTensor b = OwnedTensor::host(DType::F32, {1, 3, 2});
  OwnedTensor rank = test::i32_tensor({2});
  OwnedTensor token_slot = test::i32_tensor({0, -1});
  ops::LinearLoraParams p{.linear = {.x = x, .weight = weight, .out = out}, .token_slot = token_slot};
  p.lora[1] = {.a = a, .b = b, .rank = rank};
  const Status status = ops::check(p);
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("LinearLoraParams.lora[1]: defined without parts"), std::string::npos) << status.message();
  p.lora[1] = {};
  p.lora[0] = {.a = a, .b = OwnedTensor::host(DType::F32, {1, 5, 2}).view, .rank = rank};  // B for 5 outputs, out has 3
  const Status wrong_width = ops::check(p);
  ASSERT_FALSE(wrong_width.ok());
  EXPECT_NE(wrong_width.message().find("LinearLoraParams.lora[0]"), std::string::npos) << wrong_width.message();
  p.lora[0] = {.a = a, .b = b, .rank = rank};
  EXPECT_TRUE(ops::check(p).ok()) << ops::check(p).message();
  // The run hint: rows within the batch, ascending and disjoint, a slot.
  const std::vector<ops::LoraRun> good = {{.first = 0, .tokens = 1, .slot = 0}};
  p.runs = good;
  EXPECT_TRUE(ops::check(p).ok()) << ops::check(p).message();
  const std::vector<ops::LoraRun> past_end = {{.first = 1, .tokens = 2, .slot = 0}};
  p.runs = past_end;
  ASSERT_FALSE(ops::check(p).ok());
  EXPECT_NE(ops::check(p).message().find("LinearLoraParams.runs[0]: rows [1, 3)"), std::string::npos)
      << ops::check(p).message();
  const std::vector<ops::LoraRun> overlapping = {{.first = 0, .tokens = 2, .slot = 0}, {.first = 1, .tokens = 1, .slot = 0}};
  p.runs = overlapping;
  ASSERT_FALSE(ops::check(p).ok());
  EXPECT_NE(ops::check(p).message().find("runs[1]"), std::string::npos) << ops::check(p).message();
  const std::vector<ops::LoraRun> past_slots = {{.first = 0, .tokens = 1, .slot = 1}};  // S = 1
  p.runs = past_slots;
  ASSERT_FALSE(ops::check(p).ok());
  EXPECT_NE(ops::check(p).message().find("slot 1 outside the stacks' S = 1"), std::string::npos)
      << ops::check(p).message();
  p.runs = good;
  p.rest_rows = 1;  // rows before the first run only (it starts at 0)
  ASSERT_FALSE(ops::check(p).ok());
  EXPECT_NE(ops::check(p).message().find("LinearLoraParams.rest_rows: 1"), std::string::npos) << ops::check(p).message();
  p.rest_rows = -1;
  const std::vector<ops::LoraRun> no_slot = {{.first = 0, .tokens = 1, .slot = -1}};
  p.runs = no_slot;
  ASSERT_FALSE(ops::check(p).ok());
  EXPECT_NE(ops::check(p).message().find("slot -1"), std::string::npos) << ops::check(p).message();
}

// The run hint changes nothing on the CPU backend (it is a hint): the same outputs with and without it.
TEST(LinearLora, RunHintLeavesResultsUnchanged) {
  Rng rng(7);
  const int64_t T = 6, in = 8, N = 5, R = 2, S = 2;
  OwnedTensor x = test::random_f32(rng, {T, in});
  OwnedTensor weight = test::random_bf16(rng, {N, in});
  OwnedTensor a = test::random_f32(rng, {S, R, in}), b = test::random_f32(rng, {S, N, R});
  OwnedTensor rank = test::i32_tensor({2, 1});
  OwnedTensor token_slot = test::i32_tensor({-1, 1, 1, 1, 0, -1});
  OwnedTensor plain = OwnedTensor::host(DType::F32, {T, N}), hinted = OwnedTensor::host(DType::F32, {T, N});
  cpu::CpuBackend cpu(1);
  ops::LinearLoraParams p{.linear = {.x = x, .weight = weight, .out = plain}, .token_slot = token_slot};
  p.lora[0] = {.a = a, .b = b, .rank = rank};
  cpu.linear_lora(p);
  const std::vector<ops::LoraRun> runs = {{.first = 1, .tokens = 3, .slot = 1}};
  p.linear.out = hinted;
  p.runs = runs;
  cpu.linear_lora(p);
  EXPECT_EQ(std::memcmp(plain.view.data, hinted.view.data, plain.view.nbytes()), 0);
}

TEST(LoraDeathTest, BadSlotAborts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  OwnedTensor x = OwnedTensor::host(DType::F32, {2, 4});
  OwnedTensor y = OwnedTensor::host(DType::F32, {2, 3});
  OwnedTensor a = OwnedTensor::host(DType::F32, {2, 2, 4});
  OwnedTensor b = OwnedTensor::host(DType::F32, {2, 3, 2});
  OwnedTensor rank = test::i32_tensor({2, 1});
  OwnedTensor bad_slot = test::i32_tensor({0, -2});
  EXPECT_DEATH(cpu::CpuBackend(1).lora({.x = x, .token_slot = bad_slot, .w = {.a = a, .b = b, .rank = rank}, .y = y}),
               "lora .*token_slot\\[1\\] = -2 outside \\[-1, S = 2\\)");
}

}  // namespace
}  // namespace lmx
