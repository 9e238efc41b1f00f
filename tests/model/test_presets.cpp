// Tests of the built-in presets: the published architectures' numbers, name handling, and generated
// weights that are deterministic, seed-dependent, correctly shaped and sensibly scaled.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <tuple>

#include "backends/cpu/cpu_backend.h"
#include "model/mxfp4.h"
#include "model/presets.h"

namespace lmx::model {
namespace {

TEST(Presets, GptOss20bIsThePublishedArchitecture) {
  auto r = preset_config("gpt-oss-20b");
  ASSERT_TRUE(r.ok()) << r.status().message();
  const ModelConfig& c = *r;
  EXPECT_EQ(c.family, Family::kGptOss);
  EXPECT_EQ(c.num_layers, 24);
  EXPECT_EQ(c.hidden_size, 2880);
  EXPECT_EQ(c.num_heads, 64);
  EXPECT_EQ(c.num_kv_heads, 8);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.num_experts, 32);
  EXPECT_EQ(c.experts_per_token, 4);
  EXPECT_EQ(c.moe_intermediate_size, 2880);
  EXPECT_EQ(c.vocab_size, 201088);
  EXPECT_EQ(c.sliding_window, 128);
  ASSERT_EQ(c.layer_sliding.size(), 24u);
  for (int i = 0; i < 24; ++i) EXPECT_EQ(c.layer_sliding[size_t(i)], i % 2 == 0) << i;
  EXPECT_EQ(c.rope.type, ops::RopeScaling::Type::kYarn);
  EXPECT_EQ(c.rope.theta, 150000.0);
  EXPECT_EQ(c.rope.factor, 32.0);
  EXPECT_EQ(c.rope.original_max_position, 4096);
  EXPECT_EQ(c.rope.beta_fast, 32.0);
  EXPECT_EQ(c.rope.beta_slow, 1.0);
  EXPECT_FALSE(c.rope.truncate);
  EXPECT_FLOAT_EQ(c.swiglu_limit, 7.0f);
  EXPECT_FLOAT_EQ(c.swiglu_alpha, 1.702f);
  EXPECT_EQ(c.routing, ops::RoutingRule::kTopKThenSoftmax);
  EXPECT_EQ(c.gate_up_layout, ops::GateUpLayout::kInterleaved);
  EXPECT_TRUE(c.attention_sinks && c.attention_bias && c.router_bias && c.expert_bias);
  EXPECT_EQ(c.eos_token_ids, std::vector<int>{200002});
  // 20.9B parameters as published.
  const double params = double(weight_bytes(c)) / 2;
  EXPECT_GT(params, 20.8e9);
  EXPECT_LT(params, 21.0e9);
}

TEST(Presets, OtherPublishedArchitectures) {
  auto big = preset_config("gpt-oss-120b");
  ASSERT_TRUE(big.ok()) << big.status().message();
  EXPECT_EQ(big->num_layers, 36);
  EXPECT_EQ(big->num_experts, 128);
  EXPECT_EQ(big->layer_sliding.size(), 36u);
  EXPECT_FALSE(big->layer_sliding[35]);
  EXPECT_NEAR(double(weight_bytes(*big)) / 2, 116.8e9, 0.3e9);

  auto qwen = preset_config("qwen3-30b-a3b");
  ASSERT_TRUE(qwen.ok()) << qwen.status().message();
  EXPECT_EQ(qwen->family, Family::kQwen3Moe);
  EXPECT_EQ(qwen->num_layers, 48);
  EXPECT_EQ(qwen->hidden_size, 2048);
  EXPECT_EQ(qwen->num_heads, 32);
  EXPECT_EQ(qwen->num_kv_heads, 4);
  EXPECT_EQ(qwen->head_dim, 128);
  EXPECT_EQ(qwen->num_experts, 128);
  EXPECT_EQ(qwen->experts_per_token, 8);
  EXPECT_EQ(qwen->moe_intermediate_size, 768);
  EXPECT_TRUE(qwen->norm_topk_prob);
  EXPECT_TRUE(qwen->qk_norm);
  EXPECT_EQ(qwen->rope.theta, 1e6);
  EXPECT_NEAR(double(weight_bytes(*qwen)) / 2, 30.5e9, 0.2e9);

  auto mixtral = preset_config("mixtral-8x7b");
  ASSERT_TRUE(mixtral.ok()) << mixtral.status().message();
  EXPECT_EQ(mixtral->family, Family::kMixtral);
  EXPECT_EQ(mixtral->num_layers, 32);
  EXPECT_EQ(mixtral->hidden_size, 4096);
  EXPECT_EQ(mixtral->num_experts, 8);
  EXPECT_EQ(mixtral->experts_per_token, 2);
  EXPECT_EQ(mixtral->moe_intermediate_size, 14336);
  EXPECT_EQ(mixtral->sliding_window, 0);
  EXPECT_NEAR(double(weight_bytes(*mixtral)) / 2, 46.7e9, 0.1e9);
}

TEST(Presets, NamesWithAndWithoutPrefix) {
  for (const auto& name : preset_names()) {
    auto bare = preset_config(name);
    auto prefixed = preset_config("preset:" + name);
    ASSERT_TRUE(bare.ok()) << name << ": " << bare.status().message();
    ASSERT_TRUE(prefixed.ok()) << name;
    EXPECT_EQ(bare->num_layers, prefixed->num_layers);
    EXPECT_EQ(int(bare->layer_sliding.size()), bare->num_layers) << name;
  }
  auto unknown = preset_config("preset:gpt-5");
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("'preset:gpt-5'"), std::string::npos);
  EXPECT_NE(unknown.status().message().find("gpt-oss-20b"), std::string::npos);
  EXPECT_NE(unknown.status().message().find("tiny-moe"), std::string::npos);
  EXPECT_FALSE(make_preset_model("nope", 1).ok());
}

TEST(Presets, TinyMoeExercisesRoutingAndSlidingWindow) {
  auto c = preset_config("tiny-moe");
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(c->is_moe());
  EXPECT_GT(c->num_experts, c->experts_per_token);
  EXPECT_GT(c->experts_per_token, 1);
  EXPECT_GT(c->sliding_window, 0);
  EXPECT_EQ(c->layer_sliding, (std::vector<bool>{true, false}));
  EXPECT_EQ(c->hidden_size, 64);
  EXPECT_EQ(c->head_dim, 16);
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.same_shape(b) && a.dtype == b.dtype && std::memcmp(a.data, b.data, a.nbytes()) == 0;
}

void stats(const Tensor& t, double* mean, double* stddev, bool* finite) {
  double sum = 0, sum2 = 0;
  *finite = true;
  for (int64_t i = 0; i < t.numel(); ++i) {
    const double v = bf16_to_f32(bf16{t.ptr<uint16_t>()[i]});
    *finite = *finite && std::isfinite(v);
    sum += v;
    sum2 += v * v;
  }
  *mean = sum / double(t.numel());
  *stddev = std::sqrt(sum2 / double(t.numel()) - *mean * *mean);
}

TEST(Presets, GeneratedWeightsDeterministicShapedAndScaled) {
  auto a = make_preset_model("preset:tiny-moe", 42);
  auto b = make_preset_model("tiny-moe", 42);
  auto other = make_preset_model("tiny-moe", 43);
  ASSERT_TRUE(a.ok() && b.ok() && other.ok()) << a.status().message();
  const ModelConfig& c = a->config;
  EXPECT_TRUE(same_bytes(a->embed, b->embed));
  EXPECT_TRUE(same_bytes(a->layers[1].gate_up, b->layers[1].gate_up));
  EXPECT_FALSE(same_bytes(a->embed, other->embed));
  EXPECT_FALSE(same_bytes(a->layers[0].q, a->layers[1].q));  // tensors differ by name, not just by seed

  const LayerWeights& l = a->layers[0];
  EXPECT_EQ(a->embed.shape_str(), "[256, 64] BF16");
  EXPECT_EQ(a->lm_head.shape_str(), "[256, 64] BF16");
  EXPECT_EQ(l.q.shape_str(), "[64, 64] BF16");
  EXPECT_EQ(l.k.shape_str(), "[32, 64] BF16");
  EXPECT_EQ(l.o.shape_str(), "[64, 64] BF16");
  EXPECT_EQ(l.sinks.shape_str(), "[4] BF16");
  EXPECT_EQ(l.router.shape_str(), "[8, 64] BF16");
  EXPECT_EQ(l.router_bias.shape_str(), "[8] BF16");
  EXPECT_EQ(l.gate_up.shape_str(), "[8, 64, 64] BF16");
  EXPECT_EQ(l.gate_up_bias.shape_str(), "[8, 64] BF16");
  EXPECT_EQ(l.down.shape_str(), "[8, 64, 32] BF16");
  EXPECT_EQ(l.down_bias.shape_str(), "[8, 64] BF16");
  EXPECT_FALSE(l.q_norm.defined());
  EXPECT_FALSE(l.mlp_gate.defined());
  EXPECT_EQ(bf16_to_f32(bf16{l.input_norm.ptr<uint16_t>()[17]}), 1.0f);
  EXPECT_EQ(bf16_to_f32(bf16{a->final_norm.ptr<uint16_t>()[63]}), 1.0f);

  double mean = 0, stddev = 0;
  bool finite = false;
  stats(l.gate_up, &mean, &stddev, &finite);  // fan-in H = 64: std 1/8
  EXPECT_TRUE(finite);
  EXPECT_NEAR(mean, 0.0, 0.01);
  EXPECT_NEAR(stddev, 0.125, 0.01);
  stats(l.down, &mean, &stddev, &finite);  // fan-in I = 32
  EXPECT_NEAR(stddev, 1.0 / std::sqrt(32.0), 0.01);
  stats(a->embed, &mean, &stddev, &finite);
  EXPECT_NEAR(stddev, 1.0, 0.05);
  EXPECT_EQ(int64_t(weight_bytes(c)), [&] {
    int64_t n = 0;
    for (const auto& keep : a->keep_alive) n += int64_t(static_cast<Buffer*>(keep.get())->bytes());
    return n;
  }());
}

TEST(Presets, OtherTinyFamilies) {
  auto q = make_preset_model("tiny-qwen3-moe", 1);
  ASSERT_TRUE(q.ok()) << q.status().message();
  EXPECT_TRUE(q->layers[0].q_norm.defined());
  EXPECT_FALSE(q->layers[0].q_bias.defined());
  EXPECT_FALSE(q->layers[0].router_bias.defined());
  EXPECT_EQ(q->layers[0].gate_up.shape_str(), "[8, 64, 64] BF16");
  auto l = make_preset_model("tiny-llama", 1);
  ASSERT_TRUE(l.ok()) << l.status().message();
  EXPECT_EQ(l->lm_head.data, l->embed.data);
  EXPECT_EQ(l->layers[1].mlp_down.shape_str(), "[64, 128] BF16");
  EXPECT_FALSE(l->layers[1].gate_up.defined());
}

TEST(Presets, RefusesWhatCannotFitBeforeAllocating) {
  ModelConfig c = preset_config("tiny-llama").value();
  c.vocab_size = 1 << 30;
  c.hidden_size = 1 << 20;  // 2^50 bf16 embeddings: 2 PiB
  auto r = make_random_weights(c, 1);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kOutOfRange);
  EXPECT_NE(r.status().message().find("MiB of host memory"), std::string::npos) << r.status().message();
}

}  // namespace
TEST(Presets, VocabOverrideResizesEmbeddingAndHead) {
  auto m = make_preset_model("tiny-moe", 1, 1000);
  ASSERT_TRUE(m.ok()) << m.status().message();
  EXPECT_EQ(m->config.vocab_size, 1000);
  EXPECT_EQ(m->embed.shape_str(), "[1000, 64] BF16");
  EXPECT_EQ(m->lm_head.shape_str(), "[1000, 64] BF16");
  EXPECT_FALSE(make_preset_model("tiny-moe", 1, -5).ok());
}

}  // namespace lmx::model

namespace lmx::model {
namespace {

// --mxfp4-experts on a GPT-OSS config whose H and I fit the decode layout: the experts' bf16 weights are
// exactly the MXFP4 copies' values, spread like the bf16 preset's N(0, 1/fan_in), deterministic in the seed;
// the other weights are those of the bf16 preset. Configs that cannot have them are refused by name.
TEST(Presets, Mxfp4ExpertsAreTheBf16ExpertsValues) {
  ModelConfig c = preset_config("tiny-moe").value();
  c.moe_intermediate_size = 64;
  Result<ModelWeights> w = make_random_weights(c, 11, nullptr, true);
  ASSERT_TRUE(w.ok()) << w.status().message();
  const ModelWeights plain = make_random_weights(c, 11).value();
  for (size_t layer = 0; layer < w->layers.size(); ++layer) {
    const LayerWeights& l = w->layers[layer];
    ASSERT_EQ(l.gate_up_mxfp4.blocks.shape_str(), "[8, 1, 128, 32] U8");
    ASSERT_EQ(l.down_mxfp4.blocks.shape_str(), "[8, 1, 64, 32] U8");
    for (const auto& [copy, values, fan_in] : {std::tuple{l.gate_up_mxfp4, l.gate_up, c.hidden_size},
                                               std::tuple{l.down_mxfp4, l.down, c.moe_intermediate_size}}) {
      auto dequantized = dequantize_mxfp4_decode(copy.blocks, copy.scales, "copy");
      ASSERT_TRUE(dequantized.ok());
      ASSERT_EQ(std::memcmp(dequantized->view.data, values.data, values.nbytes()), 0) << "layer " << layer;
      double sum_squares = 0;
      for (int64_t i = 0; i < values.numel(); ++i) {
        const double v = bf16_to_f32(bf16{values.ptr<uint16_t>()[i]});
        sum_squares += v * v;
      }
      const double rms = std::sqrt(sum_squares / double(values.numel())), want = 1.0 / std::sqrt(double(fan_in));
      EXPECT_GT(rms, 0.5 * want);
      EXPECT_LT(rms, 2.0 * want);
    }
    EXPECT_EQ(std::memcmp(l.q.data, plain.layers[layer].q.data, l.q.nbytes()), 0);
    EXPECT_FALSE(plain.layers[layer].gate_up_mxfp4.defined());
  }
  const ModelWeights again = make_random_weights(c, 11, nullptr, true).value();
  EXPECT_EQ(std::memcmp(again.layers[1].down_mxfp4.blocks.data, w->layers[1].down_mxfp4.blocks.data,
                        w->layers[1].down_mxfp4.blocks.nbytes()), 0);

  auto narrow = make_preset_model("tiny-moe", 1, 0, nullptr, true);  // I 32
  ASSERT_FALSE(narrow.ok());
  EXPECT_NE(narrow.status().message().find("multiples of 64, found 64 and 32"), std::string::npos)
      << narrow.status().message();
  auto qwen = make_preset_model("tiny-qwen3-moe", 1, 0, nullptr, true);
  ASSERT_FALSE(qwen.ok());
  EXPECT_NE(qwen.status().message().find("only GPT-OSS models have MXFP4 experts"), std::string::npos)
      << qwen.status().message();
  EXPECT_GT(weight_bytes(preset_config("gpt-oss-20b").value(), true), weight_bytes(preset_config("gpt-oss-20b").value()));
}

// A backend generates the MXFP4 experts in place (fill_generated_mxfp4): the same bytes as the host path
// without a backend, which generate_mxfp4_decode and dequantize_mxfp4_decode give; streams cross chunk
// boundaries (kGeneratedUnits) in the larger shape.
TEST(Presets, Mxfp4ExpertsGeneratedByTheBackendEqualTheHostPath) {
  cpu::CpuBackend backend(3);
  for (const auto& [experts, rows, k] : {std::tuple{int64_t(3), int64_t(40), int64_t(128)},
                                          std::tuple{int64_t(2), int64_t(1500), int64_t(192)}}) {
    SCOPED_TRACE(std::to_string(experts) + " x " + std::to_string(rows) + " x " + std::to_string(k));
    for (int scale_lo : {0, 117, 126}) {
      const uint64_t seed = 0x1234 + uint64_t(scale_lo);
      const Mxfp4Decode want = generate_mxfp4_decode(experts, rows, k, seed, scale_lo);
      const OwnedTensor want_values = dequantize_mxfp4_decode(want.blocks, want.scales, "want").value();
      const OwnedTensor blocks = backend.empty(DType::U8, {experts, k / 64, rows, 32});
      const OwnedTensor scales = backend.empty(DType::U8, {experts, k / 64, rows, 2});
      const OwnedTensor values = backend.empty(DType::BF16, {experts, rows, k});
      const ops::GeneratedMxfp4Params p{.weight = {.blocks = blocks.view, .scales = scales.view},
                                        .values = values.view,
                                        .seed = seed,
                                        .scale_lo = scale_lo};
      std::memset(p.values.data, 0xff, p.values.nbytes());  // poisoned
      backend.fill_generated_mxfp4(p);
      EXPECT_EQ(std::memcmp(p.weight.blocks.data, want.blocks.view.data, want.blocks.view.nbytes()), 0);
      EXPECT_EQ(std::memcmp(p.weight.scales.data, want.scales.view.data, want.scales.view.nbytes()), 0);
      EXPECT_EQ(std::memcmp(p.values.data, want_values.view.data, want_values.view.nbytes()), 0) << scale_lo;
    }
  }
  // And through the preset generator: a backend's weights equal the host's, MXFP4 copies included.
  ModelConfig c = preset_config("tiny-moe").value();
  c.moe_intermediate_size = 64;
  const ModelWeights host = make_random_weights(c, 5, nullptr, true).value();
  const ModelWeights generated = make_random_weights(c, 5, &backend, true).value();
  for (size_t layer = 0; layer < host.layers.size(); ++layer) {
    const LayerWeights &a = host.layers[layer], &b = generated.layers[layer];
    for (const auto& [x, y] : {std::pair{a.gate_up, b.gate_up}, std::pair{a.down, b.down},
                               std::pair{a.gate_up_mxfp4.blocks, b.gate_up_mxfp4.blocks},
                               std::pair{a.down_mxfp4.scales, b.down_mxfp4.scales}}) {
      ASSERT_EQ(x.nbytes(), y.nbytes());
      EXPECT_EQ(std::memcmp(x.data, y.data, x.nbytes()), 0) << "layer " << layer << " " << x.shape_str();
    }
  }
  // Contract: K must be a multiple of 64, the copy's shape must match.
  const OwnedTensor bad_blocks = backend.empty(DType::U8, {1, 1, 8, 32});
  const OwnedTensor bad_scales = backend.empty(DType::U8, {1, 1, 8, 2});
  const OwnedTensor bad_values = backend.empty(DType::BF16, {1, 8, 96});
  const ops::GeneratedMxfp4Params bad{.weight = {.blocks = bad_blocks.view, .scales = bad_scales.view},
                                      .values = bad_values.view,
                                      .seed = 1,
                                      .scale_lo = 120};
  const Status s = ops::check(bad);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("K a multiple of 64"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace lmx::model
