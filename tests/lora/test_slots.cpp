// SlotTable on the CPU backend (f32 stacks, and the dense lora op run over them) and on a host backend that
// declares BF16 stacks like the CUDA one; plus make_dummy_adapter and describe_adapter.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>

#include "backends/cpu/cpu_backend.h"
#include "lora/slots.h"
#include "lora_test_util.h"

namespace lmx::lora::testing {
namespace {

// Host memory with BF16 LoRA stacks: exercises the f32 -> bf16 conversion of SlotTable::load without a GPU.
// Compute ops are never called by SlotTable.
class Bf16HostBackend final : public ops::Backend {
 public:
  Device device() const override { return Device::kCpu; }
  DType activation_dtype() const override { return DType::BF16; }
  DType lora_dtype() const override { return DType::BF16; }
  Buffer allocate(size_t bytes) override {
    allocated += bytes;
    return Buffer::host(bytes);
  }
  void copy(const Tensor& dst, const Tensor& src) override {
    ASSERT_EQ(dst.dtype, src.dtype);
    ASSERT_EQ(dst.numel(), src.numel());
    std::memcpy(dst.data, src.data, dst.nbytes());
    ++copies;
  }
  void fill_zero(const Tensor& dst) override { std::memset(dst.data, 0, dst.nbytes()); }
  void synchronize() override {}
  uint64_t available_bytes() const override { return 0; }
  void fill_generated(const Tensor&, uint64_t, float) override { std::abort(); }
  void fill_generated_mxfp4(const ops::GeneratedMxfp4Params&) override { std::abort(); }
  void embedding(const ops::EmbeddingParams&) override { std::abort(); }
  void rms_norm(const ops::RmsNormParams&) override { std::abort(); }
  void linear(const ops::LinearParams&) override { std::abort(); }
  void add(const ops::AddParams&) override { std::abort(); }
  void silu_mul(const ops::SiluMulParams&) override { std::abort(); }
  void gather_rows(const ops::GatherRowsParams&) override { std::abort(); }
  void split_columns(const ops::SplitColumnsParams&) override { std::abort(); }
  void rope(const ops::RopeParams&) override { std::abort(); }
  void kv_write(const ops::KvWriteParams&) override { std::abort(); }
  void attention(const ops::AttentionParams&) override { std::abort(); }
  void router_topk(const ops::RouterTopKParams&) override { std::abort(); }
  void moe(const ops::MoeParams&) override { std::abort(); }
  void lora(const ops::LoraParams&) override { std::abort(); }
  void sample(const ops::SamplingParams&) override { std::abort(); }
  int copies = 0;
  uint64_t allocated = 0;
};

float read_value(const Tensor& t, int64_t i) {
  if (t.dtype == DType::BF16) return bf16_to_f32(t.ptr<bf16>()[i]);
  return t.ptr<float>()[i];
}

// Every element of slot `slot` of the stack equals the pair's value (rounded to the stack dtype) inside
// rows/columns [0, r) and is zero in the padding.
void expect_slot_holds(const ops::LoraStack& st, int slot, const LoraPair* pair, bool expert, const std::string& what) {
  const int64_t E = expert ? st.a.shape[1] : 1;
  const int64_t R = st.a.dim(-2), in = st.a.dim(-1), out = st.b.dim(-2);
  const int64_t r = pair ? pair->rank : 0;
  EXPECT_EQ(st.rank.ptr<int32_t>()[slot], r) << what;
  const int64_t a_base = slot * E * R * in, b_base = slot * E * out * R;
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t k = 0; k < R; ++k)
      for (int64_t i = 0; i < in; ++i) {
        float want = k < r ? pair->a.view.ptr<float>()[(e * r + k) * in + i] : 0.0f;
        if (st.a.dtype == DType::BF16) want = round_bf16(want);
        ASSERT_EQ(read_value(st.a, a_base + (e * R + k) * in + i), want) << what << " a e=" << e << " k=" << k;
      }
    for (int64_t o = 0; o < out; ++o)
      for (int64_t k = 0; k < R; ++k) {
        float want = k < r ? pair->b.view.ptr<float>()[(e * out + o) * r + k] : 0.0f;
        if (st.b.dtype == DType::BF16) want = round_bf16(want);
        ASSERT_EQ(read_value(st.b, b_base + (e * out + o) * R + k), want) << what << " b e=" << e << " o=" << o;
      }
  }
}

TEST(SlotTable, LoadClearAndStackOnCpu) {
  cpu::CpuBackend backend(1);
  BaseModelShapes base = moe_shapes("gpt_oss", 2, 3, 8, 3);
  SlotTable table(backend, base, /*num_slots=*/3, /*max_rank=*/4);
  EXPECT_EQ(table.num_slots(), 3);
  for (int t = 0; t < ops::kNumLoraTargets; ++t) EXPECT_FALSE(table.stack(0, LoraTarget(t)).defined());

  Adapter small = make_dummy_adapter("small", base, 2, 1);
  Adapter full = make_dummy_adapter("full", base, 4, 2);
  ASSERT_TRUE(table.load(1, small).ok());
  ASSERT_TRUE(table.load(2, full).ok());
  for (int layer = 0; layer < 2; ++layer) {
    for (LoraTarget t : {LoraTarget::kQ, LoraTarget::kO, LoraTarget::kMoeGateUp, LoraTarget::kMoeDown}) {
      ops::LoraStack st = table.stack(layer, t);
      ASSERT_TRUE(st.defined());
      const bool expert = t == LoraTarget::kMoeGateUp || t == LoraTarget::kMoeDown;
      EXPECT_EQ(st.a.ndim, expert ? 4 : 3);
      EXPECT_EQ(st.a.dim(-2), t == LoraTarget::kMoeGateUp ? 8 : 4);  // gate_up capacity is 2 * max_rank
      EXPECT_EQ(st.a.dtype, DType::F32);
      expect_slot_holds(st, 0, nullptr, expert, "empty slot 0");
      expect_slot_holds(st, 1, &*small.layers[size_t(layer)][size_t(t)], expert, "slot 1");
      expect_slot_holds(st, 2, &*full.layers[size_t(layer)][size_t(t)], expert, "slot 2");
    }
    EXPECT_FALSE(table.stack(layer, LoraTarget::kGate).defined());  // no dense MLP in a MoE model
  }

  // Replacing a larger adapter by a smaller one leaves no stale values in the padding.
  ASSERT_TRUE(table.load(2, small).ok());
  expect_slot_holds(table.stack(0, LoraTarget::kMoeDown), 2, &*small.layers[0][size_t(LoraTarget::kMoeDown)], true,
                    "reloaded slot 2");
  table.clear(1);
  table.clear(2);
  for (int t = 0; t < ops::kNumLoraTargets; ++t) EXPECT_FALSE(table.stack(1, LoraTarget(t)).defined());
}

TEST(SlotTable, PartialAdapterLeavesOtherTargetsUndefined) {
  cpu::CpuBackend backend(1);
  BaseModelShapes base = moe_shapes("qwen3_moe", 2, 3, 8, 3);
  SlotTable table(backend, base, 2, 4);
  Adapter a = make_dummy_adapter("a", base, 2, 7);
  for (auto& layer : a.layers)
    for (int t = 0; t < ops::kNumLoraTargets; ++t)
      if (LoraTarget(t) != LoraTarget::kV) layer[size_t(t)].reset();
  a.layers[1][size_t(LoraTarget::kV)].reset();
  ASSERT_TRUE(table.load(0, a).ok());
  EXPECT_TRUE(table.stack(0, LoraTarget::kV).defined());
  EXPECT_FALSE(table.stack(1, LoraTarget::kV).defined());
  EXPECT_FALSE(table.stack(0, LoraTarget::kQ).defined());
  // Loading a different adapter into the same slot drops the old targets.
  Adapter b = make_dummy_adapter("b", base, 2, 8);
  b.layers[0][size_t(LoraTarget::kV)].reset();
  ASSERT_TRUE(table.load(0, b).ok());
  EXPECT_FALSE(table.stack(0, LoraTarget::kV).defined());
  expect_slot_holds(table.stack(0, LoraTarget::kQ), 0, &*b.layers[0][size_t(LoraTarget::kQ)], false, "b q");
}

TEST(SlotTable, LoraOpOverTheStackMatchesTheAdapterDelta) {
  // The CPU lora op run over the slot stack gives y = Σ b·a·x per token's slot: the same delta the
  // loader produced, so slot layout and op contract agree.
  cpu::CpuBackend backend(1);
  BaseModelShapes base = moe_shapes("qwen3_moe", 1, 3, 8, 3);
  SlotTable table(backend, base, 2, 4);
  Adapter a0 = make_dummy_adapter("a0", base, 3, 11), a1 = make_dummy_adapter("a1", base, 4, 12);
  ASSERT_TRUE(table.load(0, a0).ok());
  ASSERT_TRUE(table.load(1, a1).ok());
  const int T = 3, in = 8, out = 16;
  OwnedTensor x = OwnedTensor::host(DType::F32, {T, in});
  OwnedTensor y = OwnedTensor::host(DType::F32, {T, out});
  OwnedTensor slots = OwnedTensor::host(DType::I32, {T});
  Rng rng(5);
  for (int64_t i = 0; i < T * in; ++i) x.view.ptr<float>()[i] = rng.uniform(-1, 1);
  std::memset(y.view.data, 0, y.view.nbytes());
  int32_t token_slot[T] = {1, -1, 0};
  std::memcpy(slots.view.data, token_slot, sizeof(token_slot));
  backend.lora({.x = x, .token_slot = slots, .w = table.stack(0, LoraTarget::kQ), .y = y});
  for (int t = 0; t < T; ++t) {
    const Adapter* ad = token_slot[t] == 0 ? &a0 : token_slot[t] == 1 ? &a1 : nullptr;
    for (int o = 0; o < out; ++o) {
      double want = 0;
      if (ad) {
        Delta d = delta_of(*ad->layers[0][size_t(LoraTarget::kQ)]);
        for (int i = 0; i < in; ++i) want += d.at(0, o, i) * x.view.ptr<float>()[t * in + i];
      }
      EXPECT_NEAR(y.view.ptr<float>()[t * out + o], want, 1e-5) << "token " << t << " out " << o;
    }
  }
}

TEST(SlotTable, Bf16StacksAndRefusals) {
  Bf16HostBackend backend;
  BaseModelShapes base = dense_shapes("llama", 2, 8, 12);
  SlotTable table(backend, base, 2, 2);
  Adapter a = make_dummy_adapter("a", base, 2, 3);
  ASSERT_TRUE(table.load(0, a).ok());
  for (LoraTarget t : {LoraTarget::kQ, LoraTarget::kGate, LoraTarget::kDown}) {
    ops::LoraStack st = table.stack(1, t);
    ASSERT_TRUE(st.defined());
    EXPECT_EQ(st.a.dtype, DType::BF16);
    expect_slot_holds(st, 0, &*a.layers[1][size_t(t)], false, "bf16");
  }
  EXPECT_FALSE(table.stack(0, LoraTarget::kMoeGateUp).defined());

  // Refusals leave the slot as it was.
  const int copies_before = backend.copies;
  Adapter too_big = make_dummy_adapter("big", base, 3, 4);
  Status s = table.load(0, too_big);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("adapter 'big' layer 0 q_proj: rank 3 does not fit the slot capacity 2"), std::string::npos)
      << s.message();
  EXPECT_EQ(backend.copies, copies_before);
  expect_slot_holds(table.stack(0, LoraTarget::kQ), 0, &*a.layers[0][size_t(LoraTarget::kQ)], false, "unchanged");

  Adapter moe_adapter = make_dummy_adapter("moe", moe_shapes("qwen3_moe", 2, 3, 8, 3), 2, 5);
  s = table.load(1, moe_adapter);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("experts.gate_up: the base model has no such target"), std::string::npos) << s.message();
  Adapter short_adapter = make_dummy_adapter("short", dense_shapes("llama", 1, 8, 12), 2, 6);
  s = table.load(1, short_adapter);
  EXPECT_NE(s.message().find("has 1 layers, the base model 2"), std::string::npos) << s.message();
  EXPECT_EQ(table.load(2, a).code(), StatusCode::kOutOfRange);
}

// device_bytes (the engine's start-up check) is exactly what the table allocates, dense and MoE, with the
// MoE gate_up's doubled capacity.
TEST(SlotTable, DeviceBytesMatchTheAllocation) {
  for (const BaseModelShapes& base : {dense_shapes("llama", 2, 8, 12), moe_shapes("qwen3_moe", 3, 16, 8, 4)}) {
    Bf16HostBackend backend;
    { SlotTable table(backend, base, 3, 5); }
    EXPECT_EQ(backend.allocated, SlotTable::device_bytes(base, 3, 5, DType::BF16)) << base.num_experts;
    EXPECT_EQ(SlotTable::device_bytes(base, 6, 5, DType::BF16), 2 * SlotTable::device_bytes(base, 3, 5, DType::BF16));
  }
}

// prepare() lays an adapter out once (any thread); load() of the image only copies, and refuses an image
// laid out for another table (here: a larger rank capacity) before touching the slot.
TEST(SlotTable, PreparedImageLoadsAndForeignImageIsRefused) {
  Bf16HostBackend backend;
  BaseModelShapes base = moe_shapes("gpt_oss", 2, 3, 8, 3);
  SlotTable table(backend, base, 2, 2), wider(backend, base, 1, 4);
  Adapter a = make_dummy_adapter("a", base, 2, 7);
  Result<SlotImage> image = table.prepare(a);
  ASSERT_TRUE(image.ok()) << image.status().message();
  EXPECT_GT(image->bytes(), 0u);
  ASSERT_TRUE(table.load(1, *image).ok());
  for (int t = 0; t < ops::kNumLoraTargets; ++t) {
    if (!a.layers[1][size_t(t)]) continue;
    const ops::LoraStack st = table.stack(1, LoraTarget(t));
    expect_slot_holds(st, 1, &*a.layers[1][size_t(t)], t == int(LoraTarget::kMoeGateUp) || t == int(LoraTarget::kMoeDown), "image");
  }
  Result<SlotImage> foreign = wider.prepare(a);
  ASSERT_TRUE(foreign.ok());
  const int copies_before = backend.copies;
  Status s = table.load(0, *foreign);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("was not prepared for this table"), std::string::npos) << s.message();
  EXPECT_EQ(backend.copies, copies_before);
  EXPECT_EQ(table.stack(0, LoraTarget::kQ).rank.ptr<int32_t>()[0], 0);
}

// DummyTargets: attention only or the MLP only; the targets in the content hash.
TEST(DummyAdapter, TargetsAttentionOrMlpOnly) {
  BaseModelShapes base = moe_shapes("gpt_oss", 2, 3, 8, 3);
  const Adapter all = make_dummy_adapter("all", base, 4, 42);
  const Adapter attention = make_dummy_adapter("attention", base, 4, 42, DummyTargets::kAttention);
  const Adapter mlp = make_dummy_adapter("mlp", base, 4, 42, DummyTargets::kMlp);
  const std::vector<LoraTarget> attention_targets = {LoraTarget::kQ, LoraTarget::kK, LoraTarget::kV, LoraTarget::kO};
  for (size_t l = 0; l < 2; ++l) {
    for (int t = 0; t < ops::kNumLoraTargets; ++t) {
      const bool is_attention =
          std::find(attention_targets.begin(), attention_targets.end(), LoraTarget(t)) != attention_targets.end();
      EXPECT_EQ(attention.layers[l][size_t(t)].has_value(), all.layers[l][size_t(t)].has_value() && is_attention) << t;
      EXPECT_EQ(mlp.layers[l][size_t(t)].has_value(), all.layers[l][size_t(t)].has_value() && !is_attention) << t;
    }
    EXPECT_TRUE(mlp.layers[l][size_t(LoraTarget::kMoeGateUp)].has_value());
  }
  EXPECT_NE(all.content_hash, attention.content_hash);
  EXPECT_NE(attention.content_hash, mlp.content_hash);
  // A dense model's MLP targets are gate, up and down.
  const Adapter dense_mlp = make_dummy_adapter("dense", dense_shapes("llama", 1, 8, 12), 2, 6, DummyTargets::kMlp);
  EXPECT_TRUE(dense_mlp.layers[0][size_t(LoraTarget::kUp)].has_value());
  EXPECT_FALSE(dense_mlp.layers[0][size_t(LoraTarget::kQ)].has_value());
}

TEST(DummyAdapter, SeededNonzeroAndDistinct) {
  BaseModelShapes base = moe_shapes("gpt_oss", 2, 3, 8, 3);
  Adapter a = make_dummy_adapter("a", base, 4, 42), b = make_dummy_adapter("b", base, 4, 42);
  Adapter c = make_dummy_adapter("c", base, 4, 43);
  EXPECT_EQ(a.content_hash, b.content_hash);
  EXPECT_NE(a.content_hash, c.content_hash);
  EXPECT_EQ(a.max_rank, 4);
  for (size_t l = 0; l < 2; ++l) {
    for (LoraTarget t : {LoraTarget::kQ, LoraTarget::kK, LoraTarget::kV, LoraTarget::kO, LoraTarget::kMoeGateUp,
                         LoraTarget::kMoeDown}) {
      ASSERT_TRUE(a.layers[l][size_t(t)].has_value());
      const LoraPair& p = *a.layers[l][size_t(t)];
      EXPECT_EQ(p.rank, 4);
      EXPECT_FLOAT_EQ(p.scaling, 2.0f);
      // Same seed, same values; another seed, other values; B is not zero.
      EXPECT_EQ(std::memcmp(p.b.view.data, b.layers[l][size_t(t)]->b.view.data, p.b.view.nbytes()), 0);
      EXPECT_NE(std::memcmp(p.b.view.data, c.layers[l][size_t(t)]->b.view.data, p.b.view.nbytes()), 0);
      double norm = 0;
      for (int64_t i = 0; i < p.b.view.numel(); ++i) norm += std::fabs(p.b.view.ptr<float>()[i]);
      EXPECT_GT(norm, 0.0);
      const float bound = 1.0f / std::sqrt(float(base.in_features[size_t(t)]));
      for (int64_t i = 0; i < p.a.view.numel(); ++i) ASSERT_LE(std::fabs(p.a.view.ptr<float>()[i]), bound);
    }
    EXPECT_FALSE(a.layers[l][size_t(LoraTarget::kGate)].has_value());
  }
  // Layers differ from one another.
  EXPECT_NE(std::memcmp(a.layers[0][0]->a.view.data, a.layers[1][0]->a.view.data, a.layers[0][0]->a.view.nbytes()), 0);
  Adapter dense = make_dummy_adapter("d", dense_shapes("qwen3", 1, 8, 12), 2, 1);
  EXPECT_TRUE(dense.layers[0][size_t(LoraTarget::kGate)].has_value());
  EXPECT_TRUE(dense.layers[0][size_t(LoraTarget::kDown)].has_value());
}

TEST(DescribeAdapter, SummarisesTargetsPerLayerRun) {
  BaseModelShapes base = moe_shapes("gpt_oss", 3, 3, 8, 3);
  Adapter a = make_dummy_adapter("bench", base, 4, 1);
  a.layers[2][size_t(LoraTarget::kMoeDown)].reset();
  std::string text = describe_adapter(a);
  EXPECT_NE(text.find("adapter:      bench"), std::string::npos) << text;
  EXPECT_NE(text.find("content hash: " + a.content_hash), std::string::npos) << text;
  EXPECT_NE(text.find("layers 0-1: q_proj r=4 scale=2, k_proj r=4 scale=2, v_proj r=4 scale=2, o_proj r=4 scale=2, "
                      "experts.gate_up r=4 scale=2, experts.down r=4 scale=2"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("layer 2: q_proj"), std::string::npos) << text;
  EXPECT_NE(text.find("parameters:"), std::string::npos) << text;
  EXPECT_NE(text.find("max rank:     4"), std::string::npos) << text;
}

TEST(DescribeAdapter, LoadedFixture) {
  BaseModelShapes base = moe_shapes("gpt_oss", 2, 3, 16, 6);
  set_target(base, LoraTarget::kQ, 16, 16);
  set_target(base, LoraTarget::kK, 16, 8);
  set_target(base, LoraTarget::kV, 16, 8);
  set_target(base, LoraTarget::kO, 16, 16);
  auto a = load_adapter(std::string(LORAMUX_SOURCE_DIR) + "/tests/lora/data/peft_gpt_oss_fused", "fx", base, {});
  ASSERT_TRUE(a.ok()) << a.status().message();
  std::string text = describe_adapter(*a);
  EXPECT_NE(text.find("fused expert parameters (target_parameters)"), std::string::npos) << text;
  EXPECT_NE(text.find("layers 0-1: q_proj r=2 scale=2, v_proj r=2 scale=2, experts.gate_up r=2 scale=2, "
                      "experts.down r=3 scale=3"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("file bytes:   5824"), std::string::npos) << text;
}

}  // namespace
}  // namespace lmx::lora::testing
