// CpuBackend itself: memory (allocate, copy, fill_zero, upload), its dtypes, and the promise that results
// do not depend on the thread count (bitwise), checked on every op that splits work across threads.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "backends/cpu/cpu_backend.h"
#include "op_test_util.h"

namespace lmx {
namespace {

TEST(CpuBackend, DeviceAndDtypes) {
  cpu::CpuBackend backend(2);
  EXPECT_EQ(backend.device(), Device::kCpu);
  EXPECT_EQ(backend.activation_dtype(), DType::F32);
  EXPECT_EQ(backend.lora_dtype(), DType::F32);
  EXPECT_EQ(backend.num_threads(), 2);
  EXPECT_GE(cpu::CpuBackend().num_threads(), 1);
}

TEST(CpuBackend, AllocateCopyFillZeroUpload) {
  cpu::CpuBackend backend(1);
  Buffer buffer = backend.allocate(100);
  EXPECT_EQ(buffer.bytes(), 100u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(buffer.data()) % 64, 0u);

  Rng rng(1);
  OwnedTensor src = test::random_f32(rng, {2, 3});
  OwnedTensor dst = backend.empty(DType::F32, {6});  // same dtype and numel, another shape
  test::poison(dst);
  backend.copy(dst, src);
  EXPECT_TRUE(test::bitwise_equal(dst, src));

  OwnedTensor uploaded = backend.upload(src);
  EXPECT_NE(uploaded.view.data, src.view.data);
  EXPECT_TRUE(uploaded.view.same_shape(src.view));
  src.view.ptr<float>()[0] += 1.0f;  // the upload is a copy
  EXPECT_NE(uploaded.view.ptr<float>()[0], src.view.ptr<float>()[0]);

  backend.fill_zero(dst);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(dst.view.ptr<float>()[i], 0.0f);
  backend.synchronize();
}

TEST(CpuBackendDeathTest, CopyRefusesMismatches) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  OwnedTensor f32 = OwnedTensor::host(DType::F32, {4});
  OwnedTensor bf = OwnedTensor::host(DType::BF16, {4});
  OwnedTensor longer = OwnedTensor::host(DType::F32, {5});
  EXPECT_DEATH(cpu::CpuBackend(1).copy(f32, bf), "copy .*\\[4\\] F32 and src \\[4\\] BF16 differ");
  EXPECT_DEATH(cpu::CpuBackend(1).copy(longer, f32), "copy .*\\[5\\] F32 and src \\[4\\] F32 differ");
}

// Each op on 1 thread and on 4 threads, from the same inputs: the outputs must be bitwise equal.
TEST(CpuBackend, ResultsDoNotDependOnThreadCount) {
  cpu::CpuBackend one(1), four(4);
  Rng rng(7);
  auto fresh = [](const Tensor& like) { return OwnedTensor::host_like(like, like.dtype); };

  {  // linear: 64 output features x 32 tokens x 256 inputs
    OwnedTensor x = test::random_f32(rng, {32, 256});
    OwnedTensor w = test::random_bf16(rng, {64, 256});
    OwnedTensor b = test::random_bf16(rng, {64});
    OwnedTensor out1 = OwnedTensor::host(DType::F32, {32, 64}), out4 = fresh(out1);
    one.linear({.x = x, .weight = w, .bias = b, .out = out1});
    four.linear({.x = x, .weight = w, .bias = b, .out = out4});
    EXPECT_TRUE(test::bitwise_equal(out1, out4)) << "linear";
  }
  {  // rms_norm
    OwnedTensor x = test::random_f32(rng, {64, 2048});
    OwnedTensor w = test::random_bf16(rng, {2048});
    OwnedTensor out1 = fresh(x), out4 = fresh(x);
    one.rms_norm({.x = x, .weight = w, .out = out1});
    four.rms_norm({.x = x, .weight = w, .out = out4});
    EXPECT_TRUE(test::bitwise_equal(out1, out4)) << "rms_norm";
  }
  {  // rope
    OwnedTensor q1 = test::random_f32(rng, {64, 8, 64}), k1 = test::random_f32(rng, {64, 2, 64});
    OwnedTensor q4 = fresh(q1), k4 = fresh(k1);
    one.copy(q4, q1);
    one.copy(k4, k1);
    std::vector<int32_t> positions(64);
    for (int t = 0; t < 64; ++t) positions[t] = 1000 + 17 * t;
    OwnedTensor pos = test::i32_tensor(positions);
    OwnedTensor inv_freq = test::f32_tensor(ops::make_rope_table({.theta = 10000.0}, 64).inv_freq);
    one.rope({.q = q1, .k = k1, .positions = pos, .inv_freq = inv_freq});
    four.rope({.q = q4, .k = k4, .positions = pos, .inv_freq = inv_freq});
    EXPECT_TRUE(test::bitwise_equal(q1, q4) && test::bitwise_equal(k1, k4)) << "rope";
  }
  {  // attention: one sequence of 96 tokens, pages in order
    OwnedTensor q = test::random_f32(rng, {96, 4, 32});
    OwnedTensor k_cache = test::random_f32(rng, {6, 16, 2, 32}), v_cache = test::random_f32(rng, {6, 16, 2, 32});
    OwnedTensor table = test::i32_tensor({5, 4, 3, 2, 1, 0}, {1, 6});
    OwnedTensor seq_start = test::i32_tensor({0, 96});
    std::vector<int32_t> positions(96);
    for (int t = 0; t < 96; ++t) positions[t] = t;
    OwnedTensor pos = test::i32_tensor(positions);
    OwnedTensor sinks = test::random_bf16(rng, {4});
    OwnedTensor out1 = fresh(q), out4 = fresh(q);
    ops::AttentionParams p{.q = q,
                           .k_cache = k_cache,
                           .v_cache = v_cache,
                           .block_table = table,
                           .seq_start = seq_start,
                           .positions = pos,
                           .sinks = sinks,
                           .sliding_window = 40,
                           .softmax_scale = 0.18f,
                           .out = out1};
    one.attention(p);
    p.out = out4;
    four.attention(p);
    EXPECT_TRUE(test::bitwise_equal(out1, out4)) << "attention";
  }
  {  // moe with LoRA: 16 tokens, H = I = 64, E = 4, K = 2
    OwnedTensor x = test::random_f32(rng, {16, 64});
    std::vector<int32_t> ids;
    for (int t = 0; t < 16; ++t) ids.insert(ids.end(), {t % 4, (t + 1) % 4});
    OwnedTensor topk_ids = test::i32_tensor(ids, {16, 2});
    OwnedTensor topk_weights = test::random_f32(rng, {16, 2});
    std::vector<int32_t> slots;
    for (int t = 0; t < 16; ++t) slots.push_back(t % 3 - 1);
    OwnedTensor token_slot = test::i32_tensor(slots);
    OwnedTensor gate_up = test::random_bf16(rng, {4, 128, 64}, 0.1f), down = test::random_bf16(rng, {4, 64, 64}, 0.1f);
    OwnedTensor a_gu = test::random_f32(rng, {2, 4, 8, 64}), b_gu = test::random_f32(rng, {2, 4, 128, 8});
    OwnedTensor a_d = test::random_f32(rng, {2, 4, 8, 64}), b_d = test::random_f32(rng, {2, 4, 64, 8});
    OwnedTensor ranks = test::i32_tensor({8, 5});
    OwnedTensor out1 = fresh(x), out4 = fresh(x);
    ops::MoeParams p{.x = x,
                     .topk_ids = topk_ids,
                     .topk_weights = topk_weights,
                     .token_slot = token_slot,
                     .gate_up = gate_up,
                     .down = down,
                     .lora_gate_up = {.a = a_gu, .b = b_gu, .rank = ranks},
                     .lora_down = {.a = a_d, .b = b_d, .rank = ranks},
                     .activation = ops::MoeActivation::kGptOssClamped,
                     .layout = ops::GateUpLayout::kInterleaved,
                     .out = out1};
    one.moe(p);
    p.out = out4;
    four.moe(p);
    EXPECT_TRUE(test::bitwise_equal(out1, out4)) << "moe";
  }
  {  // lora: 64 tokens, in = 256, out = 512, R = 16
    OwnedTensor x = test::random_f32(rng, {64, 256});
    OwnedTensor a = test::random_f32(rng, {3, 16, 256}), b = test::random_f32(rng, {3, 512, 16});
    OwnedTensor ranks = test::i32_tensor({16, 0, 7});
    std::vector<int32_t> slots;
    for (int t = 0; t < 64; ++t) slots.push_back(t % 4 - 1);
    OwnedTensor token_slot = test::i32_tensor(slots);
    OwnedTensor y1 = test::random_f32(rng, {64, 512}), y4 = fresh(y1);
    one.copy(y4, y1);
    one.lora({.x = x, .token_slot = token_slot, .w = {.a = a, .b = b, .rank = ranks}, .y = y1});
    four.lora({.x = x, .token_slot = token_slot, .w = {.a = a, .b = b, .rank = ranks}, .y = y4});
    EXPECT_TRUE(test::bitwise_equal(y1, y4)) << "lora";
  }
}

}  // namespace
}  // namespace lmx
