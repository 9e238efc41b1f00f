// Adapters saved by real PEFT (tools/make_lora_test_adapters.py, peft 0.21.2) next to the delta weights
// PEFT's own get_delta_weight computed: b·a of every loaded pair must reproduce them. This is where our
// reading of PEFT's layouts (fused experts in both generations, nesting, patterns, rsLoRA) meets PEFT.
#include <gtest/gtest.h>

#include <set>

#include "io/safetensors.h"
#include "lora/adapter.h"
#include "lora_test_util.h"

namespace lmx::lora::testing {
namespace {

std::string fixture(const std::string& name) { return std::string(LORAMUX_SOURCE_DIR) + "/tests/lora/data/" + name; }

// The tiny models of the generator script, as loramux describes them.
BaseModelShapes attention(BaseModelShapes s, int H, int q_out, int kv_out) {
  set_target(s, LoraTarget::kQ, H, q_out);
  set_target(s, LoraTarget::kK, H, kv_out);
  set_target(s, LoraTarget::kV, H, kv_out);
  set_target(s, LoraTarget::kO, q_out, H);
  return s;
}

BaseModelShapes moe(const std::string& family, int layers, int E, int H, int I, int q_out, int kv_out) {
  BaseModelShapes s = moe_shapes(family, layers, E, H, I);
  return attention(s, H, q_out, kv_out);
}

// Compare every (layer, target) of the adapter with expected_delta.safetensors, both ways.
void check_against_peft(const std::string& name, const BaseModelShapes& base, double tol) {
  auto adapter = load_adapter(fixture(name), name, base, AdapterLimits{.max_rank = 8});
  ASSERT_TRUE(adapter.ok()) << adapter.status().message();
  auto expected = io::SafetensorsFile::open(fixture(name) + "/expected_delta.safetensors");
  ASSERT_TRUE(expected.ok()) << expected.status().message();
  std::set<std::string> seen;
  for (size_t l = 0; l < adapter->layers.size(); ++l) {
    for (int t = 0; t < ops::kNumLoraTargets; ++t) {
      const auto& pair = adapter->layers[l][size_t(t)];
      if (!pair) continue;
      static const char* kWords[] = {"q_proj",        "k_proj",      "v_proj",          "o_proj",      "mlp.gate_proj",
                                     "mlp.up_proj",   "mlp.down_proj", "experts.gate_up", "experts.down"};
      std::string key = "layers." + std::to_string(l) + "." + kWords[t];
      seen.insert(key);
      auto want_t = expected->tensor(key);
      ASSERT_TRUE(want_t.ok()) << name << ": loaded " << key << " which PEFT did not adapt";
      const Tensor& w = *want_t;
      ASSERT_EQ(w.dtype, DType::F32);
      Delta want;
      want.experts = w.ndim == 3 ? w.shape[0] : 1;
      want.out = w.shape[w.ndim - 2];
      want.in = w.shape[w.ndim - 1];
      want.values.resize(size_t(w.numel()));
      for (int64_t i = 0; i < w.numel(); ++i) {
        float v;
        std::memcpy(&v, static_cast<const char*>(w.data) + 4 * i, 4);
        want.values[size_t(i)] = v;
      }
      expect_delta_near(delta_of(*pair), want, tol, name + " " + key);
    }
  }
  for (const auto& [key, info] : expected->tensors())
    EXPECT_TRUE(seen.count(key)) << name << ": PEFT adapted " << key << " but loramux loaded nothing there";
}

// GPT-OSS: H=16, I=6, E=3, 2 heads of 8 (q 16), 1 kv head (kv 8); experts stored [E, in, out].
TEST(PeftFixtures, GptOssFusedExperts) {
  check_against_peft("peft_gpt_oss_fused", moe("gpt_oss", 2, 3, 16, 6, 16, 8), 1e-5);
}

// Qwen3-MoE (transformers 5 fused [E, out, in]): H=16, I=6, E=4; bf16 weights, rsLoRA, patterns.
TEST(PeftFixtures, Qwen3MoeFusedExpertsCurrentLayout) {
  check_against_peft("peft_qwen3_moe_fused", moe("qwen3_moe", 2, 4, 16, 6, 16, 8), 1e-5);
}

TEST(PeftFixtures, Qwen3MoeFusedExpertsPeft018Layout) {
  check_against_peft("peft_qwen3_moe_fused_v018_layout", moe("qwen3_moe", 2, 4, 16, 6, 16, 8), 1e-5);
}

// 2I == H = 12: only peft_version tells the two files apart.
TEST(PeftFixtures, SquareGateUpDecidedByPeftVersion) {
  check_against_peft("peft_qwen3_moe_square_gate_up", moe("qwen3_moe", 1, 3, 12, 6, 16, 8), 1e-5);
  check_against_peft("peft_qwen3_moe_square_gate_up_v018_layout", moe("qwen3_moe", 1, 3, 12, 6, 16, 8), 1e-5);
}

// Llama: H=16, I=24, 3 layers, layers_to_transform [0, 2], f16 weights.
TEST(PeftFixtures, LlamaDenseWithPatterns) {
  BaseModelShapes base = attention(dense_shapes("llama", 3, 16, 24), 16, 16, 8);
  check_against_peft("peft_llama_dense", base, 1e-5);
}

}  // namespace
}  // namespace lmx::lora::testing
