// The op contracts' check() rules (ops/*.h): a valid Params passes, and every rule, when broken, fails
// with a message naming the Params field. Also the abort path (require) of a backend op and
// lora_target_name. Metadata only: no op runs here except in the death tests.
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "backends/cpu/cpu_backend.h"
#include "op_test_util.h"
#include "ops/backend.h"

namespace lmx {
namespace {

using ops::check;

Tensor reshaped(const Tensor& t, std::initializer_list<int64_t> dims) {
  return Tensor::with_shape(t.data, t.dtype, dims.begin(), int(dims.size()), t.device);
}
Tensor retyped(Tensor t, DType dtype) {
  t.dtype = dtype;
  return t;
}
Tensor on_cuda(Tensor t) {
  t.device = Device::kCuda;
  return t;
}
// A view of the same buffer shifted by one element: overlaps the original without being it.
Tensor shifted(const Tensor& t) {
  Tensor s = t;
  s.data = static_cast<char*>(t.data) + dtype_size(t.dtype);
  return s;
}

// Copy the valid params into `p`, apply the mutation, and expect check(p) to fail naming `field`.
#define EXPECT_REJECTS(valid, field, ...)                                                       \
  do {                                                                                          \
    auto p = (valid);                                                                           \
    __VA_ARGS__;                                                                                \
    const Status status = check(p);                                                             \
    EXPECT_FALSE(status.ok()) << "accepted after: " #__VA_ARGS__;                               \
    EXPECT_NE(status.message().find(field), std::string::npos)                                  \
        << "message of [" #__VA_ARGS__ "] does not name " << field << ": " << status.message(); \
  } while (0)

struct Holder {  // keeps the buffers behind a Params alive
  std::vector<OwnedTensor> owned;
  Tensor f32(std::initializer_list<int64_t> dims) { return keep(OwnedTensor::host(DType::F32, dims)); }
  Tensor bf(std::initializer_list<int64_t> dims) { return keep(OwnedTensor::host(DType::BF16, dims)); }
  Tensor i32(std::initializer_list<int64_t> dims) { return keep(OwnedTensor::host(DType::I32, dims)); }
  Tensor u8(std::initializer_list<int64_t> dims) { return keep(OwnedTensor::host(DType::U8, dims)); }
  Tensor keep(OwnedTensor o) {
    owned.push_back(o);
    return o.view;
  }
};

TEST(OpChecks, Embedding) {
  Holder m;
  const ops::EmbeddingParams valid{.table = m.bf({50, 8}), .token_ids = m.i32({3}), .out = m.f32({3, 8})};
  EXPECT_TRUE(check(valid).ok()) << check(valid).message();
  EXPECT_REJECTS(valid, "EmbeddingParams.table", p.table = Tensor());
  EXPECT_REJECTS(valid, "EmbeddingParams.table", p.table = retyped(p.table, DType::F32));
  EXPECT_REJECTS(valid, "EmbeddingParams.table", p.table = reshaped(p.table, {400}));
  EXPECT_REJECTS(valid, "EmbeddingParams.token_ids", p.token_ids = retyped(p.token_ids, DType::F32));
  EXPECT_REJECTS(valid, "EmbeddingParams.token_ids", p.token_ids = reshaped(p.token_ids, {3, 1}));
  EXPECT_REJECTS(valid, "EmbeddingParams.out", p.out = reshaped(p.out, {3, 4}));
  EXPECT_REJECTS(valid, "EmbeddingParams.out", p.out = reshaped(p.out, {2, 8}));
  EXPECT_REJECTS(valid, "EmbeddingParams.out", p.out = retyped(p.out, DType::I32));
  EXPECT_REJECTS(valid, "EmbeddingParams.out", p.out = on_cuda(p.out));
}

TEST(OpChecks, RmsNorm) {
  Holder m;
  const ops::RmsNormParams valid{.x = m.f32({4, 16}), .weight = m.bf({16}), .eps = 1e-6f, .out = m.f32({4, 16})};
  EXPECT_TRUE(check(valid).ok()) << check(valid).message();
  auto in_place = valid;
  in_place.out = in_place.x;
  EXPECT_TRUE(check(in_place).ok()) << check(in_place).message();
  EXPECT_REJECTS(valid, "RmsNormParams.x", p.x = retyped(p.x, DType::I32));
  EXPECT_REJECTS(valid, "RmsNormParams.x", p.x = reshaped(p.x, {64}));
  EXPECT_REJECTS(valid, "RmsNormParams.weight", p.weight = reshaped(p.weight, {8}));
  EXPECT_REJECTS(valid, "RmsNormParams.weight", p.weight = retyped(p.weight, DType::F32));
  EXPECT_REJECTS(valid, "RmsNormParams.weight", p.weight = Tensor());
  EXPECT_REJECTS(valid, "RmsNormParams.out", p.out = reshaped(p.out, {16, 4}));
  EXPECT_REJECTS(valid, "RmsNormParams.out", p.out = retyped(p.out, DType::BF16));
  EXPECT_REJECTS(valid, "RmsNormParams.out", p.out = shifted(p.x));
  EXPECT_REJECTS(valid, "RmsNormParams.eps", p.eps = -1.0f);
  EXPECT_REJECTS(valid, "RmsNormParams.eps", p.eps = NAN);
  EXPECT_REJECTS(valid, "RmsNormParams.weight", p.weight = on_cuda(p.weight));
  auto fused = valid;
  fused.residual = m.f32({4, 16});
  EXPECT_TRUE(check(fused).ok()) << check(fused).message();
  EXPECT_REJECTS(fused, "RmsNormParams.residual", p.residual = reshaped(p.residual, {16, 4}));
  EXPECT_REJECTS(fused, "RmsNormParams.residual", p.residual = retyped(p.residual, DType::BF16));
  EXPECT_REJECTS(fused, "RmsNormParams.residual", p.residual = p.x);
  EXPECT_REJECTS(fused, "RmsNormParams.residual", p.residual = p.out);
  EXPECT_REJECTS(fused, "RmsNormParams.residual", p.residual = on_cuda(p.residual));
}

TEST(OpChecks, Linear) {
  Holder m;
  const ops::LinearParams valid{.x = m.f32({5, 12}), .weight = m.bf({7, 12}), .bias = m.bf({7}), .out = m.f32({5, 7})};
  EXPECT_TRUE(check(valid).ok()) << check(valid).message();
  auto no_bias = valid;
  no_bias.bias = Tensor();
  EXPECT_TRUE(check(no_bias).ok());
  auto bf16_activations = valid;
  bf16_activations.x = retyped(valid.x, DType::BF16);
  bf16_activations.out = retyped(valid.out, DType::BF16);
  EXPECT_TRUE(check(bf16_activations).ok()) << "activations may be BF16 (the backend decides)";
  EXPECT_REJECTS(valid, "LinearParams.x", p.x = reshaped(p.x, {60}));
  EXPECT_REJECTS(valid, "LinearParams.x", p.x = retyped(p.x, DType::F16));
  EXPECT_REJECTS(valid, "LinearParams.x", p.x = Tensor());
  EXPECT_REJECTS(valid, "LinearParams.weight", p.weight = reshaped(p.weight, {12, 7}));
  EXPECT_REJECTS(valid, "LinearParams.weight", p.weight = retyped(p.weight, DType::F32));
  EXPECT_REJECTS(valid, "LinearParams.bias", p.bias = reshaped(p.bias, {1, 7}));
  EXPECT_REJECTS(valid, "LinearParams.bias", p.bias = retyped(p.bias, DType::F32));
  EXPECT_REJECTS(valid, "LinearParams.out", p.out = reshaped(p.out, {7, 5}));
  EXPECT_REJECTS(valid, "LinearParams.out", p.out = retyped(p.out, DType::BF16));
  EXPECT_REJECTS(valid, "LinearParams.out", p.out = reshaped(p.x, {5, 7}));  // aliases x
  EXPECT_REJECTS(valid, "LinearParams.bias", p.bias = on_cuda(p.bias));
}

TEST(OpChecks, Add) {
  Holder m;
  const ops::AddParams valid{.x = m.f32({3, 6}), .y = m.f32({3, 6})};
  EXPECT_TRUE(check(valid).ok());
  EXPECT_REJECTS(valid, "AddParams.x", p.x = reshaped(p.x, {18}));
  EXPECT_REJECTS(valid, "AddParams.y", p.y = reshaped(p.y, {6, 3}));
  EXPECT_REJECTS(valid, "AddParams.y", p.y = retyped(p.y, DType::BF16));
  EXPECT_REJECTS(valid, "AddParams.y", p.y = shifted(p.x));
  EXPECT_REJECTS(valid, "AddParams.y", p.y = on_cuda(p.y));
}

TEST(OpChecks, SiluMul) {
  Holder m;
  const ops::SiluMulParams valid{.gate = m.f32({2, 10}), .up = m.f32({2, 10}), .out = m.f32({2, 10})};
  EXPECT_TRUE(check(valid).ok());
  auto in_place = valid;
  in_place.out = in_place.gate;
  EXPECT_TRUE(check(in_place).ok());
  EXPECT_REJECTS(valid, "SiluMulParams.gate", p.gate = retyped(p.gate, DType::I32));
  EXPECT_REJECTS(valid, "SiluMulParams.up", p.up = reshaped(p.up, {10, 2}));
  EXPECT_REJECTS(valid, "SiluMulParams.up", p.up = retyped(p.up, DType::BF16));
  EXPECT_REJECTS(valid, "SiluMulParams.out", p.out = reshaped(p.out, {20, 1}));
  EXPECT_REJECTS(valid, "SiluMulParams.out", p.out = shifted(p.up));
}

TEST(OpChecks, GatherRows) {
  Holder m;
  const ops::GatherRowsParams valid{.x = m.f32({6, 4}), .index = m.i32({2}), .out = m.f32({2, 4})};
  EXPECT_TRUE(check(valid).ok());
  EXPECT_REJECTS(valid, "GatherRowsParams.x", p.x = reshaped(p.x, {24}));
  EXPECT_REJECTS(valid, "GatherRowsParams.index", p.index = retyped(p.index, DType::I64));
  EXPECT_REJECTS(valid, "GatherRowsParams.out", p.out = reshaped(p.out, {2, 3}));
  EXPECT_REJECTS(valid, "GatherRowsParams.out", p.out = reshaped(p.x, {2, 4}));
}

TEST(OpChecks, SplitColumns) {
  Holder m;
  const ops::SplitColumnsParams valid{.x = m.f32({3, 10}), .parts = {m.f32({3, 6}), m.f32({3, 2}), m.f32({3, 2})}};
  EXPECT_TRUE(check(valid).ok());
  EXPECT_REJECTS(valid, "SplitColumnsParams.x", p.x = reshaped(p.x, {30}));
  EXPECT_REJECTS(valid, "SplitColumnsParams.parts[1]", p.parts[1] = reshaped(p.parts[1], {2, 3}));
  EXPECT_REJECTS(valid, "SplitColumnsParams.parts: expected columns summing to x's 10, found 8", p.parts[2] = Tensor{});
  EXPECT_REJECTS(valid, "SplitColumnsParams.parts[2]: defined after", p.parts[1] = Tensor{});
  EXPECT_REJECTS(valid, "SplitColumnsParams.parts[0]", p.parts[0] = retyped(p.parts[0], DType::I32));
  EXPECT_REJECTS(valid, "SplitColumnsParams.parts[0]", p.parts[0] = Tensor(p.x.data, DType::F32, {3, 6}));
}

TEST(OpChecks, Rope) {
  Holder m;
  const ops::RopeParams valid{.q = m.f32({3, 4, 8}),
                              .k = m.f32({3, 2, 8}),
                              .positions = m.i32({3}),
                              .inv_freq = m.f32({4}),
                              .attention_scaling = 1.0f};
  EXPECT_TRUE(check(valid).ok()) << check(valid).message();
  EXPECT_REJECTS(valid, "RopeParams.q", p.q = reshaped(p.q, {3, 32}));
  EXPECT_REJECTS(valid, "RopeParams.q", p.q = reshaped(p.q, {3, 4, 7}));
  EXPECT_REJECTS(valid, "RopeParams.k", p.k = reshaped(p.k, {2, 3, 8}));
  EXPECT_REJECTS(valid, "RopeParams.k", p.k = reshaped(p.k, {3, 4, 4}));
  EXPECT_REJECTS(valid, "RopeParams.k", p.k = retyped(p.k, DType::BF16));
  EXPECT_REJECTS(valid, "RopeParams.k", p.k = reshaped(p.q, {3, 2, 8}));
  EXPECT_REJECTS(valid, "RopeParams.positions", p.positions = reshaped(p.positions, {1}));
  EXPECT_REJECTS(valid, "RopeParams.positions", p.positions = retyped(p.positions, DType::F32));
  EXPECT_REJECTS(valid, "RopeParams.inv_freq", p.inv_freq = reshaped(p.inv_freq, {2}));
  EXPECT_REJECTS(valid, "RopeParams.inv_freq", p.inv_freq = retyped(p.inv_freq, DType::BF16));
  EXPECT_REJECTS(valid, "RopeParams.attention_scaling", p.attention_scaling = INFINITY);
  EXPECT_REJECTS(valid, "RopeParams.inv_freq", p.inv_freq = on_cuda(p.inv_freq));
  // The QK-norm: both [D] bf16 weights or neither, a finite eps >= 0.
  ops::RopeParams normed = valid;
  normed.q_norm = m.bf({8});
  normed.k_norm = m.bf({8});
  EXPECT_TRUE(check(normed).ok()) << check(normed).message();
  EXPECT_REJECTS(normed, "RopeParams.k_norm: expected [8] BF16 with the other QK-norm weight", p.k_norm = Tensor{});
  EXPECT_REJECTS(normed, "RopeParams.q_norm: expected [8] BF16 with the other QK-norm weight", p.q_norm = Tensor{});
  EXPECT_REJECTS(normed, "RopeParams.q_norm", p.q_norm = m.bf({4}));
  EXPECT_REJECTS(normed, "RopeParams.k_norm", p.k_norm = m.f32({8}));
  EXPECT_REJECTS(normed, "RopeParams.norm_eps", p.norm_eps = -1.0f);
}

TEST(OpChecks, KvWrite) {
  Holder m;
  const ops::KvWriteParams valid{.k = m.f32({5, 2, 8}),
                                 .v = m.f32({5, 2, 8}),
                                 .kv_write_index = m.i32({5}),
                                 .k_cache = m.f32({3, 4, 2, 8}),
                                 .v_cache = m.f32({3, 4, 2, 8})};
  EXPECT_TRUE(check(valid).ok()) << check(valid).message();
  EXPECT_REJECTS(valid, "KvWriteParams.k_cache", p.k_cache = reshaped(p.k_cache, {12, 2, 8}));
  EXPECT_REJECTS(valid, "KvWriteParams.v_cache", p.v_cache = reshaped(p.v_cache, {4, 3, 2, 8}));
  EXPECT_REJECTS(valid, "KvWriteParams.v_cache", p.v_cache = retyped(p.v_cache, DType::BF16));
  EXPECT_REJECTS(valid, "KvWriteParams.v_cache", p.v_cache = p.k_cache);
  EXPECT_REJECTS(valid, "KvWriteParams.k", p.k = reshaped(p.k, {5, 1, 16}));
  EXPECT_REJECTS(valid, "KvWriteParams.k", p.k = retyped(p.k, DType::BF16));
  EXPECT_REJECTS(valid, "KvWriteParams.v", p.v = reshaped(p.v, {4, 2, 8}));
  EXPECT_REJECTS(valid, "KvWriteParams.kv_write_index", p.kv_write_index = reshaped(p.kv_write_index, {4}));
  EXPECT_REJECTS(valid, "KvWriteParams.kv_write_index", p.kv_write_index = retyped(p.kv_write_index, DType::F32));
  EXPECT_REJECTS(valid, "KvWriteParams.kv_write_index", p.kv_write_index = on_cuda(p.kv_write_index));
}

TEST(OpChecks, Attention) {
  Holder m;
  const ops::AttentionParams valid{.q = m.f32({5, 4, 8}),
                                   .k_cache = m.f32({6, 4, 2, 8}),
                                   .v_cache = m.f32({6, 4, 2, 8}),
                                   .block_table = m.i32({2, 3}),
                                   .seq_start = m.i32({3}),
                                   .positions = m.i32({5}),
                                   .sinks = m.bf({4}),
                                   .sliding_window = 0,
                                   .softmax_scale = 0.25f,
                                   .out = m.f32({5, 4, 8})};
  EXPECT_TRUE(check(valid).ok()) << check(valid).message();
  auto no_sinks = valid;
  no_sinks.sinks = Tensor();
  EXPECT_TRUE(check(no_sinks).ok());
  EXPECT_REJECTS(valid, "AttentionParams.q", p.q = reshaped(p.q, {5, 32}));
  EXPECT_REJECTS(valid, "AttentionParams.q", p.q = retyped(p.q, DType::I32));
  EXPECT_REJECTS(valid, "AttentionParams.k_cache", p.k_cache = reshaped(p.k_cache, {6, 4, 4, 4}));
  EXPECT_REJECTS(valid, "AttentionParams.k_cache", p.k_cache = retyped(p.k_cache, DType::BF16));
  EXPECT_REJECTS(valid, "AttentionParams.k_cache", p.k_cache = reshaped(p.k_cache, {8, 4, 3, 8});
                 p.v_cache = reshaped(p.v_cache, {8, 4, 3, 8}));  // Hkv = 3 does not divide Hq = 4
  EXPECT_REJECTS(valid, "AttentionParams.v_cache", p.v_cache = reshaped(p.v_cache, {4, 6, 2, 8}));
  EXPECT_REJECTS(valid, "AttentionParams.v_cache", p.v_cache = retyped(p.v_cache, DType::BF16));
  EXPECT_REJECTS(valid, "AttentionParams.block_table", p.block_table = retyped(p.block_table, DType::I64));
  EXPECT_REJECTS(valid, "AttentionParams.block_table", p.block_table = reshaped(p.block_table, {6}));
  EXPECT_REJECTS(valid, "AttentionParams.seq_start", p.seq_start = reshaped(p.seq_start, {2}));
  EXPECT_REJECTS(valid, "AttentionParams.positions", p.positions = reshaped(p.positions, {4}));
  EXPECT_REJECTS(valid, "AttentionParams.sinks", p.sinks = reshaped(p.sinks, {2}));
  EXPECT_REJECTS(valid, "AttentionParams.sinks", p.sinks = retyped(p.sinks, DType::F32));
  EXPECT_REJECTS(valid, "AttentionParams.sliding_window", p.sliding_window = -1);
  EXPECT_REJECTS(valid, "AttentionParams.softmax_scale", p.softmax_scale = NAN);
  EXPECT_REJECTS(valid, "AttentionParams.out", p.out = reshaped(p.out, {5, 2, 16}));
  EXPECT_REJECTS(valid, "AttentionParams.out", p.out = retyped(p.out, DType::BF16));
  EXPECT_REJECTS(valid, "AttentionParams.out", p.out = shifted(p.q));
  EXPECT_REJECTS(valid, "AttentionParams.sinks", p.sinks = on_cuda(p.sinks));
}

TEST(OpChecks, RouterTopK) {
  Holder m;
  const ops::RouterTopKParams valid{
      .logits = m.f32({4, 8}), .top_k = 2, .topk_ids = m.i32({4, 2}), .topk_weights = m.f32({4, 2})};
  EXPECT_TRUE(check(valid).ok());
  EXPECT_REJECTS(valid, "RouterTopKParams.logits", p.logits = retyped(p.logits, DType::BF16));
  EXPECT_REJECTS(valid, "RouterTopKParams.logits", p.logits = reshaped(p.logits, {32}));
  EXPECT_REJECTS(valid, "RouterTopKParams.top_k", p.top_k = 0);
  EXPECT_REJECTS(valid, "RouterTopKParams.top_k", p.top_k = 9);
  EXPECT_REJECTS(valid, "RouterTopKParams.topk_ids", p.topk_ids = reshaped(p.topk_ids, {2, 4}));
  EXPECT_REJECTS(valid, "RouterTopKParams.topk_ids", p.topk_ids = retyped(p.topk_ids, DType::F32));
  EXPECT_REJECTS(valid, "RouterTopKParams.topk_weights", p.topk_weights = reshaped(p.topk_weights, {8}));
  EXPECT_REJECTS(valid, "RouterTopKParams.topk_weights", p.topk_weights = retyped(p.topk_weights, DType::BF16));
  EXPECT_REJECTS(valid, "RouterTopKParams.topk_weights", p.topk_weights = on_cuda(p.topk_weights));
}

// T = 3, H = 8, E = 4, I = 6, K = 2, S = 2, R = 4 (gate_up) / 2 (down).
ops::MoeParams valid_moe(Holder& m) {
  return ops::MoeParams{.x = m.f32({3, 8}),
                        .topk_ids = m.i32({3, 2}),
                        .topk_weights = m.f32({3, 2}),
                        .token_slot = m.i32({3}),
                        .gate_up = m.bf({4, 12, 8}),
                        .gate_up_bias = m.bf({4, 12}),
                        .down = m.bf({4, 8, 6}),
                        .down_bias = m.bf({4, 8}),
                        .lora_gate_up = {.a = m.f32({2, 4, 4, 8}), .b = m.f32({2, 4, 12, 4}), .rank = m.i32({2})},
                        .lora_down = {.a = m.f32({2, 4, 2, 6}), .b = m.f32({2, 4, 8, 2}), .rank = m.i32({2})},
                        .activation = ops::MoeActivation::kGptOssClamped,
                        .layout = ops::GateUpLayout::kInterleaved,
                        .out = m.f32({3, 8})};
}

TEST(OpChecks, Moe) {
  Holder m;
  const ops::MoeParams valid = valid_moe(m);
  EXPECT_TRUE(check(valid).ok()) << check(valid).message();
  auto no_lora = valid;
  no_lora.lora_gate_up = {};
  no_lora.lora_down = {};
  no_lora.token_slot = Tensor();
  no_lora.gate_up_bias = Tensor();
  no_lora.down_bias = Tensor();
  EXPECT_TRUE(check(no_lora).ok()) << check(no_lora).message();
  EXPECT_REJECTS(valid, "MoeParams.x", p.x = reshaped(p.x, {24}));
  EXPECT_REJECTS(valid, "MoeParams.topk_ids", p.topk_ids = reshaped(p.topk_ids, {2, 3}));
  EXPECT_REJECTS(valid, "MoeParams.topk_ids", p.topk_ids = retyped(p.topk_ids, DType::F32));
  EXPECT_REJECTS(valid, "MoeParams.topk_weights", p.topk_weights = reshaped(p.topk_weights, {6, 1}));
  EXPECT_REJECTS(valid, "MoeParams.topk_weights", p.topk_weights = retyped(p.topk_weights, DType::BF16));
  EXPECT_REJECTS(valid, "MoeParams.gate_up", p.gate_up = reshaped(p.gate_up, {4, 8, 12}));
  EXPECT_REJECTS(valid, "MoeParams.gate_up", p.gate_up = reshaped(p.gate_up, {4, 11, 8}));
  EXPECT_REJECTS(valid, "MoeParams.gate_up", p.gate_up = retyped(p.gate_up, DType::F32));
  EXPECT_REJECTS(valid, "MoeParams.gate_up_bias", p.gate_up_bias = reshaped(p.gate_up_bias, {4, 6}));
  EXPECT_REJECTS(valid, "MoeParams.down", p.down = reshaped(p.down, {4, 6, 8}));
  EXPECT_REJECTS(valid, "MoeParams.down", p.down = retyped(p.down, DType::F32));
  EXPECT_REJECTS(valid, "MoeParams.down_bias", p.down_bias = reshaped(p.down_bias, {3, 8}));
  EXPECT_REJECTS(valid, "MoeParams.down_bias", p.down_bias = retyped(p.down_bias, DType::F32));
  EXPECT_REJECTS(valid, "MoeParams.lora_gate_up.a", p.lora_gate_up.a = reshaped(p.lora_gate_up.a, {2, 4, 4, 6}));
  EXPECT_REJECTS(valid, "MoeParams.lora_gate_up.a", p.lora_gate_up.a = reshaped(p.lora_gate_up.a, {2, 2, 8, 8}));
  EXPECT_REJECTS(valid, "MoeParams.lora_gate_up.a", p.lora_gate_up.a = retyped(p.lora_gate_up.a, DType::I32));
  EXPECT_REJECTS(valid, "MoeParams.lora_gate_up.b", p.lora_gate_up.b = reshaped(p.lora_gate_up.b, {2, 4, 16, 3}));
  EXPECT_REJECTS(valid, "MoeParams.lora_gate_up.b", p.lora_gate_up.b = retyped(p.lora_gate_up.b, DType::BF16));
  EXPECT_REJECTS(valid, "MoeParams.lora_gate_up.rank", p.lora_gate_up.rank = reshaped(p.lora_gate_up.rank, {1}));
  EXPECT_REJECTS(valid, "MoeParams.lora_gate_up.rank", p.lora_gate_up.rank = Tensor());
  EXPECT_REJECTS(valid, "MoeParams.lora_gate_up.a", p.lora_gate_up.a = Tensor());  // b, rank still defined
  EXPECT_REJECTS(valid, "MoeParams.lora_down.a", p.lora_down.a = reshaped(p.lora_down.a, {2, 4, 2, 8}));
  EXPECT_REJECTS(valid, "MoeParams.lora_down.b", p.lora_down.b = reshaped(p.lora_down.b, {2, 4, 6, 2}));
  EXPECT_REJECTS(valid, "MoeParams.lora_down.rank", p.lora_down.rank = retyped(p.lora_down.rank, DType::F32));
  EXPECT_REJECTS(valid, "MoeParams.token_slot", p.token_slot = reshaped(p.token_slot, {1}));
  EXPECT_REJECTS(valid, "MoeParams.token_slot", p.token_slot = Tensor());
  EXPECT_REJECTS(valid, "MoeParams.swiglu_limit", p.swiglu_limit = 0.0f);
  EXPECT_REJECTS(valid, "MoeParams.swiglu_alpha", p.swiglu_alpha = NAN);
  EXPECT_REJECTS(valid, "MoeParams.out", p.out = reshaped(p.out, {8, 3}));
  EXPECT_REJECTS(valid, "MoeParams.out", p.out = retyped(p.out, DType::BF16));
  EXPECT_REJECTS(valid, "MoeParams.out", p.out = p.x);
  EXPECT_REJECTS(valid, "MoeParams.lora_down.b", p.lora_down.b = on_cuda(p.lora_down.b));
}

// The MXFP4 copies (ops/mxfp4.h's decode layout) of a layer with H = 128, I = 64, E = 4: gate_up [4, 128, 128]
// is blocks [4, 2, 128, 32], down [4, 128, 64] is blocks [4, 1, 128, 32].
TEST(OpChecks, MoeMxfp4Copies) {
  Holder m;
  ops::MoeParams valid{.x = m.f32({3, 128}), .topk_ids = m.i32({3, 2}), .topk_weights = m.f32({3, 2}),
                       .gate_up = m.bf({4, 128, 128}), .down = m.bf({4, 128, 64}),
                       .activation = ops::MoeActivation::kGptOssClamped, .layout = ops::GateUpLayout::kInterleaved,
                       .out = m.f32({3, 128})};
  valid.gate_up_mxfp4 = {.blocks = m.u8({4, 2, 128, 32}), .scales = m.u8({4, 2, 128, 2})};
  valid.down_mxfp4 = {.blocks = m.u8({4, 1, 128, 32}), .scales = m.u8({4, 1, 128, 2})};
  EXPECT_TRUE(check(valid).ok()) << check(valid).message();
  EXPECT_REJECTS(valid, "MoeParams.gate_up_mxfp4.blocks", p.gate_up_mxfp4.blocks = reshaped(p.gate_up_mxfp4.blocks, {4, 128, 2, 32}));
  EXPECT_REJECTS(valid, "MoeParams.gate_up_mxfp4.scales", p.gate_up_mxfp4.scales = Tensor());
  EXPECT_REJECTS(valid, "MoeParams.down_mxfp4.blocks", p.down_mxfp4.blocks = retyped(p.down_mxfp4.blocks, DType::I32));
  EXPECT_REJECTS(valid, "MoeParams.down_mxfp4.scales", p.down_mxfp4.scales = reshaped(p.down_mxfp4.scales, {4, 1, 64, 4}));
  EXPECT_REJECTS(valid, "MoeParams.down_mxfp4.blocks", p.down_mxfp4.blocks = on_cuda(p.down_mxfp4.blocks));
  // K not a multiple of 64: the layout cannot hold it
  ops::MoeParams odd = valid;  // I = 96
  odd.gate_up = m.bf({4, 192, 128});
  odd.gate_up_mxfp4 = {.blocks = m.u8({4, 2, 192, 32}), .scales = m.u8({4, 2, 192, 2})};
  odd.down = m.bf({4, 128, 96});
  odd.down_mxfp4 = {.blocks = m.u8({4, 1, 128, 32}), .scales = m.u8({4, 1, 128, 2})};
  EXPECT_FALSE(check(odd).ok());
  EXPECT_NE(check(odd).message().find("MoeParams.down_mxfp4: the MXFP4 decode layout needs K a multiple of 64, found K = 96"),
            std::string::npos) << check(odd).message();
}

TEST(OpChecks, Lora) {
  Holder m;
  const ops::LoraParams valid{.x = m.f32({4, 10}),
                              .token_slot = m.i32({4}),
                              .w = {.a = m.f32({3, 2, 10}), .b = m.f32({3, 6, 2}), .rank = m.i32({3})},
                              .y = m.f32({4, 6})};
  EXPECT_TRUE(check(valid).ok()) << check(valid).message();
  auto no_stack = valid;
  no_stack.w = {};
  EXPECT_TRUE(check(no_stack).ok()) << "an undefined stack means: nothing to add";
  auto bf16_stack = valid;
  bf16_stack.w.a = retyped(valid.w.a, DType::BF16);
  bf16_stack.w.b = retyped(valid.w.b, DType::BF16);
  EXPECT_TRUE(check(bf16_stack).ok());
  EXPECT_REJECTS(valid, "LoraParams.x", p.x = reshaped(p.x, {40}));
  EXPECT_REJECTS(valid, "LoraParams.token_slot", p.token_slot = reshaped(p.token_slot, {3}));
  EXPECT_REJECTS(valid, "LoraParams.token_slot", p.token_slot = Tensor());
  EXPECT_REJECTS(valid, "LoraParams.y", p.y = reshaped(p.y, {6, 4}));
  EXPECT_REJECTS(valid, "LoraParams.y", p.y = retyped(p.y, DType::BF16));
  EXPECT_REJECTS(valid, "LoraParams.y", p.y = reshaped(p.x, {4, 10}));
  EXPECT_REJECTS(valid, "LoraParams.w.a", p.w.a = reshaped(p.w.a, {3, 4, 5}));
  EXPECT_REJECTS(valid, "LoraParams.w.a", p.w.a = reshaped(p.w.a, {60}));
  EXPECT_REJECTS(valid, "LoraParams.w.b", p.w.b = reshaped(p.w.b, {3, 4, 3}));
  EXPECT_REJECTS(valid, "LoraParams.w.b", p.w.b = reshaped(p.w.b, {2, 9, 2}));
  EXPECT_REJECTS(valid, "LoraParams.w.b", p.w.b = retyped(p.w.b, DType::BF16));  // a is F32
  EXPECT_REJECTS(valid, "LoraParams.w.rank", p.w.rank = reshaped(p.w.rank, {1}));
  EXPECT_REJECTS(valid, "LoraParams.w.rank", p.w.rank = retyped(p.w.rank, DType::I64));
  EXPECT_REJECTS(valid, "LoraParams.w.a", p.w.a = Tensor());
  EXPECT_REJECTS(valid, "LoraParams.w.rank", p.w.rank = on_cuda(p.w.rank));
}

TEST(OpChecks, Sampling) {
  Holder m;
  const ops::SamplingParams valid{.logits = m.f32({2, 100}),
                                  .temperature = m.f32({2}),
                                  .top_k = m.i32({2}),
                                  .top_p = m.f32({2}),
                                  .uniform = m.f32({2}),
                                  .out_tokens = m.i32({2})};
  EXPECT_TRUE(check(valid).ok());
  EXPECT_REJECTS(valid, "SamplingParams.logits", p.logits = retyped(p.logits, DType::BF16));
  EXPECT_REJECTS(valid, "SamplingParams.logits", p.logits = reshaped(p.logits, {2, 0}));
  EXPECT_REJECTS(valid, "SamplingParams.temperature", p.temperature = reshaped(p.temperature, {1}));
  EXPECT_REJECTS(valid, "SamplingParams.top_k", p.top_k = retyped(p.top_k, DType::F32));
  EXPECT_REJECTS(valid, "SamplingParams.top_p", p.top_p = reshaped(p.top_p, {2, 1}));
  EXPECT_REJECTS(valid, "SamplingParams.uniform", p.uniform = retyped(p.uniform, DType::I32));
  EXPECT_REJECTS(valid, "SamplingParams.out_tokens", p.out_tokens = retyped(p.out_tokens, DType::F32));
  EXPECT_REJECTS(valid, "SamplingParams.out_tokens", p.out_tokens = Tensor());
  EXPECT_REJECTS(valid, "SamplingParams.out_tokens", p.out_tokens = on_cuda(p.out_tokens));
}

TEST(OpChecks, MessageSaysExpectedAndFound) {
  Holder m;
  ops::LinearParams p{.x = m.f32({5, 12}), .weight = m.bf({7, 11}), .out = m.f32({5, 7})};
  const Status status = check(p);
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.message(), "LinearParams.weight: expected [*, 12] BF16, found [7, 11] BF16");
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
}

TEST(OpChecks, LoraTargetNames) {
  EXPECT_EQ(ops::lora_target_name(ops::LoraTarget::kQ), "q_proj");
  EXPECT_EQ(ops::lora_target_name(ops::LoraTarget::kK), "k_proj");
  EXPECT_EQ(ops::lora_target_name(ops::LoraTarget::kV), "v_proj");
  EXPECT_EQ(ops::lora_target_name(ops::LoraTarget::kO), "o_proj");
  EXPECT_EQ(ops::lora_target_name(ops::LoraTarget::kGate), "gate_proj");
  EXPECT_EQ(ops::lora_target_name(ops::LoraTarget::kUp), "up_proj");
  EXPECT_EQ(ops::lora_target_name(ops::LoraTarget::kDown), "down_proj");
  EXPECT_EQ(ops::lora_target_name(ops::LoraTarget::kMoeGateUp), "experts.gate_up");
  EXPECT_EQ(ops::lora_target_name(ops::LoraTarget::kMoeDown), "experts.down");
  std::set<std::string_view> names;
  for (int i = 0; i < ops::kNumLoraTargets; ++i) names.insert(ops::lora_target_name(ops::LoraTarget(i)));
  EXPECT_EQ(int(names.size()), ops::kNumLoraTargets);
}

// A backend op called against its contract aborts, naming the op and the field.
TEST(OpChecksDeathTest, BackendOpAbortsNamingOpAndField) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  Holder m;
  ops::LinearParams p{.x = m.f32({5, 12}), .weight = m.bf({7, 11}), .out = m.f32({5, 7})};
  EXPECT_DEATH(cpu::CpuBackend(1).linear(p), "linear called against its contract: LinearParams.weight");
  ops::RopeParams r{.q = m.f32({3, 4, 8}), .k = m.f32({3, 2, 8}), .positions = m.i32({3}), .inv_freq = m.f32({3})};
  EXPECT_DEATH(cpu::CpuBackend(1).rope(r), "rope called against its contract: RopeParams.inv_freq");
}

// The cpu backend computes in F32: BF16 activations pass check() but not the cpu op.
TEST(OpChecksDeathTest, CpuBackendNeedsF32Activations) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  Holder m;
  ops::LinearParams p{.x = m.keep(OwnedTensor::host(DType::BF16, {5, 12})),
                      .weight = m.bf({7, 12}),
                      .out = m.keep(OwnedTensor::host(DType::BF16, {5, 7}))};
  ASSERT_TRUE(check(p).ok());
  EXPECT_DEATH(cpu::CpuBackend(1).linear(p), "LinearParams.x: the cpu backend computes in F32");
}

}  // namespace
}  // namespace lmx
