// load_adapter on adapters written here, one per PEFT format: every canonical pair's b·a is checked
// against the delta PEFT defines for that format (re-stated in lora_test_util.h), and every validation
// error is checked for the file/tensor/field it must name.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>

#include "lora/adapter.h"
#include "lora_test_util.h"

namespace lmx::lora::testing {
namespace {

constexpr double kTol = 1e-5;

std::string layer_module(int layer, const std::string& rest) { return "model.layers." + std::to_string(layer) + "." + rest; }

const LoraPair& pair_at(const Adapter& a, int layer, LoraTarget t) {
  EXPECT_TRUE(a.layers.at(size_t(layer))[size_t(t)].has_value()) << "layer " << layer << " target " << int(t);
  return *a.layers.at(size_t(layer))[size_t(t)];
}

// ---------------------------------------------------------------------------------------------------
// Module formats

TEST(AdapterLoad, AttentionOnlyF32) {
  BaseModelShapes base = moe_shapes("qwen3_moe", 2, 3, 8, 3);
  AdapterDir d("attn");
  d.config()["target_modules"] = {"q_proj", "k_proj", "v_proj", "o_proj"};
  struct Want { int layer; LoraTarget t; std::string leaf; };
  std::vector<Want> wants = {{0, LoraTarget::kQ, "q_proj"}, {0, LoraTarget::kK, "k_proj"}, {0, LoraTarget::kV, "v_proj"},
                             {0, LoraTarget::kO, "o_proj"}, {1, LoraTarget::kQ, "q_proj"}};
  std::vector<std::pair<Stored, Stored>> stored;
  for (size_t i = 0; i < wants.size(); ++i)
    stored.push_back(d.add_pair(layer_module(wants[i].layer, "self_attn." + wants[i].leaf), 2,
                                base.in_features[size_t(wants[i].t)], base.out_features[size_t(wants[i].t)], 100 + i));
  auto r = load(d.write(), base);
  ASSERT_TRUE(r.ok()) << r.status().message();
  const Adapter& a = *r;
  EXPECT_EQ(a.format, AdapterFormat::kModules);
  EXPECT_EQ(a.max_rank, 2);
  EXPECT_EQ(a.layers.size(), 2u);
  for (size_t i = 0; i < wants.size(); ++i) {
    const LoraPair& p = pair_at(a, wants[i].layer, wants[i].t);
    EXPECT_EQ(p.rank, 2);
    EXPECT_FLOAT_EQ(p.scaling, 2.0f);  // alpha 4 / r 2
    expect_delta_near(delta_of(p), linear_delta(stored[i].first, stored[i].second, 2.0), kTol, wants[i].leaf);
  }
  EXPECT_FALSE(a.layers[1][size_t(LoraTarget::kK)].has_value());
  EXPECT_FALSE(a.layers[0][size_t(LoraTarget::kMoeGateUp)].has_value());
}

TEST(AdapterLoad, DenseMlpF16WithRankAndAlphaPatterns) {
  BaseModelShapes base = dense_shapes("llama", 2, 8, 12);
  AdapterDir d("dense");
  d.config()["rank_pattern"] = {{"o_proj", 4}, {"model.layers.1.mlp.down_proj", 3}};
  d.config()["alpha_pattern"] = {{"layers\\.1\\..*up_proj", 10}};
  struct Want { int layer; LoraTarget t; std::string module; int r; double scaling; };
  std::vector<Want> wants = {
      {0, LoraTarget::kO, "self_attn.o_proj", 4, 1.0},      // rank_pattern o_proj: 4 / 4
      {0, LoraTarget::kGate, "mlp.gate_proj", 2, 2.0},
      {1, LoraTarget::kUp, "mlp.up_proj", 2, 5.0},          // alpha_pattern: 10 / 2
      {1, LoraTarget::kDown, "mlp.down_proj", 3, 4.0 / 3},  // rank_pattern full name: 4 / 3
      {1, LoraTarget::kGate, "mlp.gate_proj", 2, 2.0}};
  std::vector<std::pair<Stored, Stored>> stored;
  for (size_t i = 0; i < wants.size(); ++i)
    stored.push_back(d.add_pair(layer_module(wants[i].layer, wants[i].module), wants[i].r,
                                base.in_features[size_t(wants[i].t)], base.out_features[size_t(wants[i].t)], 200 + i,
                                DType::F16));
  auto r = load(d.write(), base);
  ASSERT_TRUE(r.ok()) << r.status().message();
  for (size_t i = 0; i < wants.size(); ++i) {
    const LoraPair& p = pair_at(*r, wants[i].layer, wants[i].t);
    EXPECT_EQ(p.rank, wants[i].r) << wants[i].module;
    EXPECT_NEAR(p.scaling, wants[i].scaling, 1e-6) << wants[i].module;
    expect_delta_near(delta_of(p), linear_delta(stored[i].first, stored[i].second, wants[i].scaling), kTol,
                      wants[i].module);
  }
}

TEST(AdapterLoad, RsLoraBf16) {
  BaseModelShapes base = dense_shapes("qwen3", 1, 8, 12);
  AdapterDir d("rslora");
  d.config()["r"] = 4;
  d.config()["lora_alpha"] = 8;
  d.config()["use_rslora"] = true;
  auto [a, b] = d.add_pair(layer_module(0, "self_attn.v_proj"), 4, 8, 4, 300, DType::BF16);
  auto r = load(d.write(), base);
  ASSERT_TRUE(r.ok()) << r.status().message();
  const LoraPair& p = pair_at(*r, 0, LoraTarget::kV);
  EXPECT_FLOAT_EQ(p.scaling, 4.0f);  // 8 / sqrt(4)
  expect_delta_near(delta_of(p), linear_delta(a, b, 4.0), kTol, "v_proj");
}

TEST(AdapterLoad, LayersToTransformSelectsLayers) {
  BaseModelShapes base = dense_shapes("llama", 3, 8, 12);
  AdapterDir d("ltt");
  d.config()["layers_to_transform"] = 1;  // an int, as PEFT allows
  d.config()["layers_pattern"] = "layers";
  auto [a, b] = d.add_pair(layer_module(1, "self_attn.q_proj"), 2, 8, 16, 310);
  auto r = load(d.write(), base);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_TRUE(r->layers[1][size_t(LoraTarget::kQ)].has_value());
  EXPECT_FALSE(r->layers[0][size_t(LoraTarget::kQ)].has_value());
  expect_delta_near(delta_of(pair_at(*r, 1, LoraTarget::kQ)), linear_delta(a, b, 2.0), kTol, "q_proj");
}

TEST(AdapterLoad, TensorOutsideLayersToTransformIsAnError) {
  BaseModelShapes base = dense_shapes("llama", 3, 8, 12);
  AdapterDir d("ltt_bad");
  d.config()["layers_to_transform"] = {0, 1};
  d.add_pair(layer_module(2, "self_attn.q_proj"), 2, 8, 16, 311);
  std::string e = load_error(d.write(), base);
  EXPECT_NE(e.find("layers_to_transform [0, 1]"), std::string::npos) << e;
  EXPECT_NE(e.find("layers.2.self_attn.q_proj.lora_A.weight"), std::string::npos) << e;
}

// ---------------------------------------------------------------------------------------------------
// Per-expert Linear modules, merged into experts.gate_up block-diagonally

// Expected merged gate_up [E, 2I, H] from per-expert gate/up deltas, rows as the family stores them.
void add_rows(Delta& merged, const Delta& part, int64_t e, bool up, bool interleaved) {
  const int64_t I = part.out;
  for (int64_t i = 0; i < I; ++i) {
    int64_t row = interleaved ? 2 * i + (up ? 1 : 0) : (up ? I + i : i);
    for (int64_t h = 0; h < part.in; ++h) merged.at(e, row, h) = part.at(0, i, h);
  }
}

void per_expert_case(const std::string& family, bool interleaved, const std::string& prefix,
                     const std::array<std::string, 3>& leaves) {
  const int E = 3, H = 8, I = 3;
  BaseModelShapes base = moe_shapes(family, 2, E, H, I);
  base.gate_up_interleaved = interleaved;
  AdapterDir d("experts_" + family);
  // Expert 1's up projection of layer 0 has rank 3 (rank_pattern), so layer 0 pads to R_up = 3.
  d.config()["rank_pattern"] = {{layer_module(0, prefix + ".1." + leaves[1]), 3}};
  Delta gate_up0 = zero_delta(E, 2 * I, H), down0 = zero_delta(E, H, I), gate_up1 = zero_delta(E, 2 * I, H);
  uint64_t seed = 400;
  for (int e = 0; e < E; ++e) {
    auto [ga, gb] = d.add_pair(layer_module(0, prefix + "." + std::to_string(e) + "." + leaves[0]), 2, H, I, seed++);
    int up_rank = e == 1 ? 3 : 2;
    auto [ua, ub] = d.add_pair(layer_module(0, prefix + "." + std::to_string(e) + "." + leaves[1]), up_rank, H, I, seed++);
    auto [da, db] = d.add_pair(layer_module(0, prefix + "." + std::to_string(e) + "." + leaves[2]), 2, I, H, seed++);
    add_rows(gate_up0, linear_delta(ga, gb, 2.0), e, false, interleaved);
    add_rows(gate_up0, linear_delta(ua, ub, 4.0 / up_rank), e, true, interleaved);
    Delta dd = linear_delta(da, db, 2.0);
    for (int o = 0; o < H; ++o)
      for (int i = 0; i < I; ++i) down0.at(e, o, i) = dd.at(0, o, i);
  }
  // Layer 1: only the gate projection of experts 0 and 2 (a regex target can pick a subset).
  for (int e : {0, 2}) {
    auto [ga, gb] = d.add_pair(layer_module(1, prefix + "." + std::to_string(e) + "." + leaves[0]), 2, H, I, seed++);
    add_rows(gate_up1, linear_delta(ga, gb, 2.0), e, false, interleaved);
  }
  auto r = load(d.write(), base);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->format, AdapterFormat::kModules);
  const LoraPair& gu0 = pair_at(*r, 0, LoraTarget::kMoeGateUp);
  EXPECT_EQ(gu0.rank, 2 + 3);  // R_gate + R_up
  EXPECT_EQ(gu0.a.view.shape_str(), "[3, 5, 8] F32");
  EXPECT_EQ(gu0.b.view.shape_str(), "[3, 6, 5] F32");
  EXPECT_EQ(gu0.scaling, 0.0f);  // gate and up were scaled differently (2 and 4/3)
  expect_delta_near(delta_of(gu0), gate_up0, kTol, family + " layer 0 gate_up");
  expect_delta_near(delta_of(pair_at(*r, 0, LoraTarget::kMoeDown)), down0, kTol, family + " layer 0 down");
  const LoraPair& gu1 = pair_at(*r, 1, LoraTarget::kMoeGateUp);
  EXPECT_EQ(gu1.rank, 2);
  expect_delta_near(delta_of(gu1), gate_up1, kTol, family + " layer 1 gate only");
  EXPECT_FALSE(r->layers[1][size_t(LoraTarget::kMoeDown)].has_value());
  EXPECT_EQ(r->max_rank, 5);
}

TEST(AdapterLoad, PerExpertQwen3MoeMergesGateUpAsHalves) {
  per_expert_case("qwen3_moe", false, "mlp.experts", {"gate_proj", "up_proj", "down_proj"});
}

TEST(AdapterLoad, PerExpertMixtralW1W3W2) {
  per_expert_case("mixtral", false, "block_sparse_moe.experts", {"w1", "w3", "w2"});
}

TEST(AdapterLoad, PerExpertMergeFollowsInterleavedLayout) {
  per_expert_case("qwen3_moe", true, "mlp.experts", {"gate_proj", "up_proj", "down_proj"});
}

// ---------------------------------------------------------------------------------------------------
// Fused 3D expert parameters (target_parameters)

struct FusedWrite {
  Stored a, b;
};

// Writes a fused pair under mlp.experts (depth 0) or mlp.experts.base_layer (depth 1), with lora_A
// [r·E, x] and lora_B [y, r·E].
FusedWrite add_fused(AdapterDir& d, int layer, bool base_layer, int64_t rE, int64_t x, int64_t y, uint64_t seed,
                     DType dtype = DType::F32) {
  std::string m = "base_model.model." + layer_module(layer, std::string("mlp.experts") + (base_layer ? ".base_layer" : ""));
  Stored a = d.add(m + ".lora_A.weight", {rE, x}, seed, dtype);
  Stored b = d.add(m + ".lora_B.weight", {y, rE}, seed + 1, dtype);
  return {a, b};
}

TEST(AdapterLoad, FusedGptOssBothParameters) {
  const int E = 3, H = 8, I = 3, r = 2;
  BaseModelShapes base = moe_shapes("gpt_oss", 2, E, H, I);
  AdapterDir d("fused_gptoss");
  d.config()["target_modules"] = nlohmann::json::array();
  d.config()["target_parameters"] = {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"};
  d.config()["rank_pattern"] = {{"down_proj", 4}};  // PEFT key: model.layers.{l}.mlp.experts.down_proj
  std::vector<FusedWrite> gu, dn;
  for (int l = 0; l < 2; ++l) {
    // GPT-OSS stores gate_up_proj [E, H, 2I] (in, out): PEFT (any version, is_transposed) sizes lora_A by H.
    gu.push_back(add_fused(d, l, true, r * E, H, 2 * I, 500 + 10 * l, DType::BF16));
    dn.push_back(add_fused(d, l, false, 4 * E, I, H, 505 + 10 * l, DType::BF16));
  }
  auto res = load(d.write(), base);
  ASSERT_TRUE(res.ok()) << res.status().message();
  EXPECT_EQ(res->format, AdapterFormat::kFusedParameters);
  for (int l = 0; l < 2; ++l) {
    // PEFT's delta is in the parameter layout [E, in, out]; the true map is its transpose.
    Delta want_gu = transpose_experts(peft_param_delta(gu[l].a, gu[l].b, E, /*swapped=*/false, 4.0 / 2));
    Delta want_dn = transpose_experts(peft_param_delta(dn[l].a, dn[l].b, E, /*swapped=*/false, 4.0 / 4));
    const LoraPair& pgu = pair_at(*res, l, LoraTarget::kMoeGateUp);
    EXPECT_EQ(pgu.rank, 2);
    EXPECT_EQ(pgu.a.view.shape_str(), "[3, 2, 8] F32");
    EXPECT_EQ(pgu.b.view.shape_str(), "[3, 6, 2] F32");
    expect_delta_near(delta_of(pgu), want_gu, kTol, "gpt_oss gate_up");
    const LoraPair& pdn = pair_at(*res, l, LoraTarget::kMoeDown);
    EXPECT_EQ(pdn.rank, 4);
    expect_delta_near(delta_of(pdn), want_dn, kTol, "gpt_oss down");
  }
}

// transformers-5 Qwen3-MoE/Mixtral: gate_up_proj [E, 2I, H], down_proj [E, H, I] (out, in).
void fused_non_transposed_case(const std::string& family, const std::string& peft_version, bool legacy_layout,
                               bool omit_version = false) {
  const int E = 3, H = 8, I = 3, r = 2;
  BaseModelShapes base = moe_shapes(family, 1, E, H, I);
  AdapterDir d("fused_" + family);
  d.config()["target_parameters"] = {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"};
  if (omit_version) d.config().erase("peft_version");
  else d.config()["peft_version"] = peft_version;
  // PEFT >= 0.19.1 swaps in/out for [E, out, in] parameters: lora_A [rE, in]; older: lora_A [rE, d1 = out].
  FusedWrite gu = legacy_layout ? add_fused(d, 0, true, r * E, 2 * I, H, 600) : add_fused(d, 0, true, r * E, H, 2 * I, 600);
  FusedWrite dn = legacy_layout ? add_fused(d, 0, false, r * E, H, I, 610) : add_fused(d, 0, false, r * E, I, H, 610);
  auto res = load(d.write(), base);
  ASSERT_TRUE(res.ok()) << res.status().message();
  // The parameter layout is already the true [E, out, in].
  Delta want_gu = peft_param_delta(gu.a, gu.b, E, /*swapped=*/!legacy_layout, 2.0);
  Delta want_dn = peft_param_delta(dn.a, dn.b, E, /*swapped=*/!legacy_layout, 2.0);
  expect_delta_near(delta_of(pair_at(*res, 0, LoraTarget::kMoeGateUp)), want_gu, kTol, family + " fused gate_up");
  expect_delta_near(delta_of(pair_at(*res, 0, LoraTarget::kMoeDown)), want_dn, kTol, family + " fused down");
}

TEST(AdapterLoad, FusedQwen3MoeCurrentPeftLayout) { fused_non_transposed_case("qwen3_moe", "0.21.2", false); }
TEST(AdapterLoad, FusedMixtralCurrentPeftLayout) { fused_non_transposed_case("mixtral", "0.20.0", false); }
TEST(AdapterLoad, FusedQwen3MoePeft018Layout) { fused_non_transposed_case("qwen3_moe", "0.18.1", true); }
// Shapes decide when they can, whatever the version says.
TEST(AdapterLoad, FusedLayoutFromShapesOverridesVersion) { fused_non_transposed_case("qwen3_moe", "0.21.2", true); }
TEST(AdapterLoad, FusedLayoutWithoutVersion) { fused_non_transposed_case("qwen3_moe", "", true, true); }

TEST(AdapterLoad, FusedSingleParameterIsNotNested) {
  const int E = 3, H = 8, I = 3;
  BaseModelShapes base = moe_shapes("qwen3_moe", 1, E, H, I);
  AdapterDir d("fused_down_only");
  d.config()["target_parameters"] = {"mlp.experts.down_proj"};
  FusedWrite dn = add_fused(d, 0, false, 2 * E, I, H, 620);
  auto res = load(d.write(), base);
  ASSERT_TRUE(res.ok()) << res.status().message();
  EXPECT_FALSE(res->layers[0][size_t(LoraTarget::kMoeGateUp)].has_value());
  expect_delta_near(delta_of(pair_at(*res, 0, LoraTarget::kMoeDown)), peft_param_delta(dn.a, dn.b, E, true, 2.0), kTol,
                    "down only");
}

// 2I == H: gate_up pairs look the same in both PEFT layouts.
struct SquareCase {
  std::string version;  // "" = field absent
  std::optional<int> lora_a_dim;
};

Result<Adapter> square_gate_up(const SquareCase& c, bool legacy_values, Delta* want) {
  const int E = 2, H = 6, I = 3;
  BaseModelShapes base = moe_shapes("qwen3_moe", 1, E, H, I);
  AdapterDir d("square");
  d.config()["target_parameters"] = {"mlp.experts.gate_up_proj"};
  if (c.version.empty()) d.config().erase("peft_version");
  else d.config()["peft_version"] = c.version;
  if (c.lora_a_dim) d.config()["loramux_fused_lora_a_dim"] = *c.lora_a_dim;
  FusedWrite gu = add_fused(d, 0, false, 2 * E, H, 2 * I, 700);
  *want = peft_param_delta(gu.a, gu.b, E, /*swapped=*/!legacy_values, 2.0);
  return load(d.write(), base);
}

TEST(AdapterLoad, SquareFusedDecidedByPeftVersion) {
  Delta want;
  for (SquareCase c : {SquareCase{"0.19.1", {}}, SquareCase{"0.21.2", {}}, SquareCase{"0.22.0.dev0@abc", {}}}) {
    auto res = square_gate_up(c, false, &want);
    ASSERT_TRUE(res.ok()) << c.version << ": " << res.status().message();
    expect_delta_near(delta_of(pair_at(*res, 0, LoraTarget::kMoeGateUp)), want, kTol, "current layout " + c.version);
  }
  for (SquareCase c : {SquareCase{"", {}}, SquareCase{"0.18.0", {}}, SquareCase{"0.18.1", {}}}) {
    auto res = square_gate_up(c, true, &want);
    ASSERT_TRUE(res.ok()) << c.version << ": " << res.status().message();
    expect_delta_near(delta_of(pair_at(*res, 0, LoraTarget::kMoeGateUp)), want, kTol, "old layout " + c.version);
  }
}

TEST(AdapterLoad, SquareFusedOnBoundaryVersionNeedsExplicitLayout) {
  Delta want;
  auto res = square_gate_up({"0.19.0", {}}, false, &want);
  ASSERT_FALSE(res.ok());
  const std::string& e = res.status().message();
  EXPECT_NE(e.find("is square (in = out = 6)"), std::string::npos) << e;
  EXPECT_NE(e.find("loramux_fused_lora_a_dim"), std::string::npos) << e;
  EXPECT_NE(e.find("layers.0.mlp.experts.lora_A.weight"), std::string::npos) << e;
  // The extension field decides: 1 = lora_A sized by dim 1 (old layout), 2 = by dim 2 (current).
  res = square_gate_up({"0.19.0", 1}, true, &want);
  ASSERT_TRUE(res.ok()) << res.status().message();
  expect_delta_near(delta_of(pair_at(*res, 0, LoraTarget::kMoeGateUp)), want, kTol, "lora_a_dim 1");
  res = square_gate_up({"0.19.0", 2}, false, &want);
  ASSERT_TRUE(res.ok()) << res.status().message();
  expect_delta_near(delta_of(pair_at(*res, 0, LoraTarget::kMoeGateUp)), want, kTol, "lora_a_dim 2");
}

TEST(AdapterLoad, SquareGptOssDownOnNewPeftIsAmbiguous) {
  // GPT-OSS-20B has I == H, so a down_proj-only adapter is square. PEFT >= 0.19.1 orients it by the
  // transformers version, which is not recorded.
  const int E = 2, H = 4, I = 4;
  BaseModelShapes base = moe_shapes("gpt_oss", 1, E, H, I);
  for (std::string version : {"0.21.2", "0.18.1"}) {
    AdapterDir d("square_gptoss");
    d.config()["target_parameters"] = {"mlp.experts.down_proj"};
    d.config()["peft_version"] = version;
    FusedWrite dn = add_fused(d, 0, false, 2 * E, I, H, 710);
    auto res = load(d.write(), base);
    if (version == "0.21.2") {
      ASSERT_FALSE(res.ok());
      EXPECT_NE(res.status().message().find("transformers version"), std::string::npos) << res.status().message();
    } else {
      ASSERT_TRUE(res.ok()) << res.status().message();
      expect_delta_near(delta_of(pair_at(*res, 0, LoraTarget::kMoeDown)),
                        transpose_experts(peft_param_delta(dn.a, dn.b, E, false, 2.0)), kTol, "gpt_oss square down");
    }
  }
}

TEST(AdapterLoad, SquareGateUpDecidedByNonSquareDown) {
  // 2I == H makes gate_up square, but down ({I, H}) is not: its shapes decide for both.
  const int E = 2, H = 6, I = 3, r = 2;
  BaseModelShapes base = moe_shapes("qwen3_moe", 1, E, H, I);
  AdapterDir d("square_mixed");
  d.config()["target_parameters"] = {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"};
  d.config()["peft_version"] = "0.19.0";  // undecided by version alone
  FusedWrite gu = add_fused(d, 0, true, r * E, 2 * I, H, 720);
  FusedWrite dn = add_fused(d, 0, false, r * E, H, I, 730);  // old layout: lora_A sized by d1 = H
  auto res = load(d.write(), base);
  ASSERT_TRUE(res.ok()) << res.status().message();
  expect_delta_near(delta_of(pair_at(*res, 0, LoraTarget::kMoeGateUp)), peft_param_delta(gu.a, gu.b, E, false, 2.0),
                    kTol, "gate_up");
  expect_delta_near(delta_of(pair_at(*res, 0, LoraTarget::kMoeDown)), peft_param_delta(dn.a, dn.b, E, false, 2.0), kTol,
                    "down");
}

TEST(AdapterLoad, FusedLayersDisagreeingOnLayoutIsAnError) {
  const int E = 3, H = 8, I = 3;
  BaseModelShapes base = moe_shapes("qwen3_moe", 2, E, H, I);
  AdapterDir d("fused_disagree");
  d.config()["target_parameters"] = {"mlp.experts.down_proj"};
  add_fused(d, 0, false, 2 * E, I, H, 740);  // current layout
  add_fused(d, 1, false, 2 * E, H, I, 750);  // old layout
  std::string e = load_error(d.write(), base);
  EXPECT_NE(e.find("disagree on layout"), std::string::npos) << e;
}

TEST(AdapterLoad, FusedShapeErrors) {
  const int E = 3, H = 8, I = 3;
  BaseModelShapes base = moe_shapes("qwen3_moe", 1, E, H, I);
  {
    AdapterDir d("fused_bad_dims");
    d.config()["target_parameters"] = {"mlp.experts.down_proj"};
    add_fused(d, 0, false, 2 * E, 5, H, 760);
    std::string e = load_error(d.write(), base);
    EXPECT_NE(e.find("wrong shape"), std::string::npos) << e;
    EXPECT_NE(e.find("{8, 6} (gate_up_proj) or {3, 8} (down_proj), found x = 5, y = 8"), std::string::npos) << e;
  }
  {
    AdapterDir d("fused_bad_rows");
    d.config()["target_parameters"] = {"mlp.experts.down_proj"};
    add_fused(d, 0, false, 7, I, H, 770);
    std::string e = load_error(d.write(), base);
    EXPECT_NE(e.find("not a multiple of E"), std::string::npos) << e;
  }
  {
    AdapterDir d("fused_rank_config");
    d.config()["target_parameters"] = {"mlp.experts.down_proj"};
    add_fused(d, 0, false, 4 * E, I, H, 780);  // rank 4, config r = 2
    std::string e = load_error(d.write(), base);
    EXPECT_NE(e.find("expected r=2"), std::string::npos) << e;
    EXPECT_NE(e.find("found 4"), std::string::npos) << e;
    EXPECT_NE(e.find("'model.layers.0.mlp.experts.down_proj'"), std::string::npos) << e;
  }
  {
    AdapterDir d("fused_on_dense");
    add_fused(d, 0, false, 2, 8, 8, 790);
    std::string e = load_error(d.write(), dense_shapes("llama", 1, 8, 12));
    EXPECT_NE(e.find("fused expert parameters, but the base model (llama) is dense"), std::string::npos) << e;
  }
}

// ---------------------------------------------------------------------------------------------------
// Validation errors: each names the file and tensor (or field) with expected vs found.

class AdapterErrors : public ::testing::Test {
 protected:
  BaseModelShapes qwen_ = moe_shapes("qwen3_moe", 2, 3, 8, 3);
};

TEST_F(AdapterErrors, UnknownTargetModules) {
  struct Case { BaseModelShapes base; std::string module; std::string needle; };
  std::vector<Case> cases = {
      {qwen_, "lm_head", "unsupported target module 'lm_head'"},
      {qwen_, "model.embed_tokens", "unsupported target module 'model.embed_tokens'"},
      {qwen_, "model.layers.0.mlp.gate", "LoRA on the MoE router is not supported"},
      {moe_shapes("gpt_oss", 2, 3, 8, 3), "model.layers.0.mlp.router", "LoRA on the MoE router is not supported"},
      {moe_shapes("mixtral", 2, 3, 8, 3), "model.layers.0.block_sparse_moe.gate", "router"},
      {qwen_, "model.layers.0.self_attn.qkv_proj", "unsupported target module 'model.layers.0.self_attn.qkv_proj'"},
  };
  for (const Case& c : cases) {
    AdapterDir d("unknown");
    d.add_pair(c.module, 2, 8, 8, 800);
    std::string e = load_error(d.write(), c.base);
    EXPECT_NE(e.find(c.needle), std::string::npos) << e;
    EXPECT_NE(e.find("adapter_model.safetensors: tensor 'base_model.model." + c.module), std::string::npos) << e;
  }
}

TEST_F(AdapterErrors, FamilyMismatch) {
  struct Case { BaseModelShapes base; std::string module; int in, out; std::string needle; };
  std::vector<Case> cases = {
      {moe_shapes("gpt_oss", 2, 3, 8, 3), "model.layers.0.block_sparse_moe.experts.0.w1", 8, 3,
       "uses mixtral's per-expert module names, but the base model is gpt_oss"},
      {moe_shapes("mixtral", 2, 3, 8, 3), "model.layers.0.mlp.experts.0.gate_proj", 8, 3,
       "uses qwen3_moe's per-expert module names, but the base model is mixtral"},
      {dense_shapes("llama", 2, 8, 12), "model.layers.0.mlp.experts.0.gate_proj", 8, 3,
       "is a mixture-of-experts expert, but the base model (llama) is dense"},
      {qwen_, "model.layers.0.mlp.gate_proj", 8, 12, "dense MLP projection, but the base model (qwen3_moe) has mixture-of-experts"},
  };
  for (const Case& c : cases) {
    AdapterDir d("family");
    d.add_pair(c.module, 2, c.in, c.out, 810);
    std::string e = load_error(d.write(), c.base);
    EXPECT_NE(e.find(c.needle), std::string::npos) << e;
    EXPECT_NE(e.find("adapter for another architecture"), std::string::npos) << e;
  }
}

TEST_F(AdapterErrors, WrongShapes) {
  {
    AdapterDir d("shape_a");
    d.add_pair(layer_module(0, "self_attn.k_proj"), 2, 9, 4, 820);
    std::string e = load_error(d.write(), qwen_);
    EXPECT_NE(e.find("k_proj.lora_A.weight': wrong shape: expected [2, 8] (in_features of k_proj = 8), found [2, 9]"),
              std::string::npos) << e;
  }
  {
    AdapterDir d("shape_b");
    d.add_pair(layer_module(0, "self_attn.k_proj"), 2, 8, 16, 821);
    std::string e = load_error(d.write(), qwen_);
    EXPECT_NE(e.find("k_proj.lora_B.weight': wrong shape: expected [4, 2] (out_features of k_proj = 4), found [16, 2]"),
              std::string::npos) << e;
  }
  {
    AdapterDir d("shape_expert");
    d.add_pair(layer_module(0, "mlp.experts.1.down_proj"), 2, 8, 3, 822);  // transposed dims
    std::string e = load_error(d.write(), qwen_);
    EXPECT_NE(e.find("expected [2, 3] (in_features of expert down projection), found [2, 8]"), std::string::npos) << e;
  }
  {
    AdapterDir d("shape_3d");
    d.add("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", {1, 2, 8}, 823);
    d.add("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", {16, 2}, 824);
    std::string e = load_error(d.write(), qwen_);
    EXPECT_NE(e.find("expected a 2-D tensor, found [1, 2, 8]"), std::string::npos) << e;
  }
}

TEST_F(AdapterErrors, Ranks) {
  {
    AdapterDir d("rank_limit");
    d.config()["r"] = 8;
    d.add_pair(layer_module(0, "self_attn.q_proj"), 8, 8, 16, 830);
    std::string e = load_error(d.write(), qwen_, /*max_rank=*/4);
    EXPECT_NE(e.find("rank 8 is above the limit (--max-lora-rank 4)"), std::string::npos) << e;
  }
  {
    AdapterDir d("rank_ab");
    d.add("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", {2, 8}, 831);
    d.add("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", {16, 3}, 832);
    std::string e = load_error(d.write(), qwen_);
    EXPECT_NE(e.find("rank mismatch between lora_A and lora_B: lora_A has 2 rows, lora_B has 3 columns"), std::string::npos)
        << e;
  }
  {
    AdapterDir d("rank_config");
    d.config()["rank_pattern"] = {{"q_proj", 4}};
    d.add_pair(layer_module(0, "self_attn.q_proj"), 2, 8, 16, 833);
    std::string e = load_error(d.write(), qwen_);
    EXPECT_NE(e.find("rank mismatch vs"), std::string::npos) << e;
    EXPECT_NE(e.find("adapter_config.json: expected r=4"), std::string::npos) << e;
    EXPECT_NE(e.find("found 2"), std::string::npos) << e;
  }
}

TEST_F(AdapterErrors, NanAndInf) {
  for (float bad : {std::nanf(""), INFINITY}) {
    AdapterDir d("nan");
    std::vector<float> b(16 * 2, 0.5f);
    b[5] = bad;
    d.add("base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight", {2, 8}, 840);
    d.add_values("base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight", {16, 2}, b, DType::BF16);
    std::string e = load_error(d.write(), qwen_);
    EXPECT_NE(e.find("layers.1.self_attn.q_proj.lora_B.weight': element [2, 1] is " +
                     std::string(std::isnan(bad) ? "NaN" : "Inf")),
              std::string::npos) << e;
  }
}

TEST_F(AdapterErrors, OutOfRangeIndices) {
  {
    AdapterDir d("layer_range");
    d.add_pair(layer_module(2, "self_attn.q_proj"), 2, 8, 16, 850);
    std::string e = load_error(d.write(), qwen_);
    EXPECT_NE(e.find("layer index 2 is out of range: the base model has 2 layers"), std::string::npos) << e;
  }
  {
    AdapterDir d("expert_range");
    d.add_pair(layer_module(0, "mlp.experts.3.gate_proj"), 2, 8, 3, 851);
    std::string e = load_error(d.write(), qwen_);
    EXPECT_NE(e.find("expert index 3 is out of range: the base model has 3 experts per layer"), std::string::npos) << e;
  }
}

TEST_F(AdapterErrors, MissingHalves) {
  {
    AdapterDir d("missing_b");
    d.add("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", {2, 8}, 860);
    std::string e = load_error(d.write(), qwen_);
    EXPECT_NE(e.find("q_proj.lora_A.weight': missing lora_B for this lora_A"), std::string::npos) << e;
  }
  {
    AdapterDir d("missing_a");
    d.add("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", {16, 2}, 861);
    std::string e = load_error(d.write(), qwen_);
    EXPECT_NE(e.find("missing lora_A for this lora_B"), std::string::npos) << e;
  }
}

TEST_F(AdapterErrors, UnsupportedTensorKinds) {
  {
    AdapterDir d("bias");
    d.add_pair(layer_module(0, "self_attn.q_proj"), 2, 8, 16, 870);
    d.add("base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias", {16}, 871);
    std::string e = load_error(d.write(), qwen_);
    EXPECT_NE(e.find("LoRA bias terms"), std::string::npos) << e;
  }
  {
    AdapterDir d("dora");
    d.add_pair(layer_module(0, "self_attn.q_proj"), 2, 8, 16, 872);
    d.add("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector", {16}, 873);
    std::string e = load_error(d.write(), qwen_);
    EXPECT_NE(e.find("DoRA"), std::string::npos) << e;
  }
  {
    AdapterDir d("int_dtype");
    d.add("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", {2, 8}, 874, DType::I32);
    d.add("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", {16, 2}, 875);
    std::string e = load_error(d.write(), qwen_);
    EXPECT_NE(e.find("dtype I32, expected F32, BF16 or F16"), std::string::npos) << e;
  }
  {
    AdapterDir d("empty");
    std::string e = load_error(d.write(), qwen_);
    EXPECT_NE(e.find("holds no LoRA tensors"), std::string::npos) << e;
  }
}

TEST_F(AdapterErrors, MissingAndCorruptFiles) {
  EXPECT_NE(load_error("/nonexistent/loramux/adapter", qwen_).find("not a directory"), std::string::npos);
  {
    AdapterDir d("no_config");
    d.add_pair(layer_module(0, "self_attn.q_proj"), 2, 8, 16, 880);
    d.write();
    std::filesystem::remove(d.dir() + "/adapter_config.json");
    std::string e = load_error(d.dir(), qwen_);
    EXPECT_NE(e.find("adapter_config.json: missing"), std::string::npos) << e;
  }
  {
    AdapterDir d("no_weights");
    d.write();
    std::filesystem::remove(d.dir() + "/adapter_model.safetensors");
    std::string e = load_error(d.dir(), qwen_);
    EXPECT_NE(e.find("adapter_model.safetensors: missing"), std::string::npos) << e;
    std::ofstream(d.dir() + "/adapter_model.bin") << "pickle";
    e = load_error(d.dir(), qwen_);
    EXPECT_NE(e.find("adapter_model.bin (pickle) is not read"), std::string::npos) << e;
  }
  {
    AdapterDir d("truncated");
    d.add_pair(layer_module(0, "self_attn.q_proj"), 2, 8, 16, 881);
    d.write();
    std::string path = d.dir() + "/adapter_model.safetensors";
    std::filesystem::resize_file(path, std::filesystem::file_size(path) - 20);
    std::string e = load_error(d.dir(), qwen_);
    EXPECT_NE(e.find("adapter 'test'"), std::string::npos) << e;
    EXPECT_NE(e.find("adapter_model.safetensors"), std::string::npos) << e;
  }
  {
    AdapterDir d("garbage");
    d.write();
    std::ofstream(d.dir() + "/adapter_model.safetensors", std::ios::binary) << "\x10\x00\x00\x00\x00\x00\x00\x00{not json}";
    std::string e = load_error(d.dir(), qwen_);
    EXPECT_NE(e.find("adapter_model.safetensors"), std::string::npos) << e;
  }
}

TEST_F(AdapterErrors, ConfigErrorsAreNamedByField) {
  struct Case { std::function<void(nlohmann::json&)> edit; std::string needle; };
  std::vector<Case> cases = {
      {[](auto& c) { c["peft_type"] = "IA3"; }, "field 'peft_type': expected \"LORA\", found 'IA3'"},
      {[](auto& c) { c["bias"] = "all"; }, "field 'bias': expected \"none\", found 'all'"},
      {[](auto& c) { c["use_dora"] = true; }, "field 'use_dora': DoRA adapters are not supported"},
      {[](auto& c) { c["modules_to_save"] = {"lm_head"}; }, "field 'modules_to_save' is [\"lm_head\"]"},
      {[](auto& c) { c["r"] = 0; }, "field 'r': expected an integer >= 1, found 0"},
      {[](auto& c) { c["lora_alpha"] = "16"; }, "field 'lora_alpha': expected a finite number, found \"16\""},
      {[](auto& c) { c["rank_pattern"] = {{"q_proj", "8"}}; }, "field 'rank_pattern' key 'q_proj': expected a positive integer"},
      {[](auto& c) { c["alpha_pattern"] = {{"(?P<x>q)", 8}}; }, "field 'alpha_pattern' key '(?P<x>q)'"},
      {[](auto& c) { c["target_modules"] = 5; }, "field 'target_modules': expected a list of names or a regex string"},
      {[](auto& c) { c["layers_to_transform"] = {0, -1}; }, "field 'layers_to_transform'[1]: expected a layer index >= 0"},
      {[](auto& c) { c["init_lora_weights"] = "pissa_niter_4"; }, "changes the base weights"},
      {[](auto& c) { c["loramux_fused_lora_a_dim"] = 3; }, "field 'loramux_fused_lora_a_dim': expected 1 or 2, found 3"},
  };
  for (const Case& c : cases) {
    AdapterDir d("config");
    c.edit(d.config());
    d.add_pair(layer_module(0, "self_attn.q_proj"), 2, 8, 16, 890);
    std::string e = load_error(d.write(), qwen_);
    EXPECT_NE(e.find(c.needle), std::string::npos) << e;
    EXPECT_NE(e.find("adapter_config.json"), std::string::npos) << e;
  }
  AdapterDir d("bad_json");
  d.write();
  std::ofstream(d.dir() + "/adapter_config.json") << "{\"r\": 8,";
  EXPECT_NE(load_error(d.dir(), qwen_).find("adapter_config.json: not valid JSON"), std::string::npos);
}

// ---------------------------------------------------------------------------------------------------
// Identity

TEST(AdapterIdentity, ContentHashFollowsBytesNotNames) {
  BaseModelShapes base = moe_shapes("qwen3_moe", 1, 3, 8, 3);
  AdapterDir d1("hash1"), d2("hash2");
  d1.add_pair(layer_module(0, "self_attn.q_proj"), 2, 8, 16, 900);
  d2.add_pair(layer_module(0, "self_attn.q_proj"), 2, 8, 16, 900);
  auto a1 = load_adapter(d1.write(), "first", base, {});
  auto a2 = load_adapter(d2.write(), "second", base, {});
  ASSERT_TRUE(a1.ok() && a2.ok());
  EXPECT_EQ(a1->content_hash.size(), 32u);
  EXPECT_EQ(a1->content_hash, a2->content_hash);  // same bytes, different name and directory
  EXPECT_EQ(a1->file_bytes, std::filesystem::file_size(d1.dir() + "/adapter_model.safetensors"));

  d2.config()["lora_alpha"] = 5;  // config bytes count too
  auto a3 = load_adapter(d2.write(), "second", base, {});
  ASSERT_TRUE(a3.ok());
  EXPECT_NE(a1->content_hash, a3->content_hash);

  AdapterDir d4("hash4");
  d4.add_pair(layer_module(0, "self_attn.q_proj"), 2, 8, 16, 901);  // one tensor's values differ
  auto a4 = load_adapter(d4.write(), "first", base, {});
  ASSERT_TRUE(a4.ok());
  EXPECT_NE(a1->content_hash, a4->content_hash);
}

}  // namespace
}  // namespace lmx::lora::testing

namespace lmx::lora::testing {
namespace {

// PEFT's transformers-v4 -> v5 conversion fuses per-expert gate/up into gate_up_proj with rank 2r
// (rank_pattern ".*\.gate_up_proj": 2r); such a gate_up may use the doubled slot capacity.
TEST(AdapterLoad, FusedGateUpMayUseTwiceTheRankLimit) {
  const int E = 2, H = 8, I = 3;
  BaseModelShapes base = moe_shapes("mixtral", 1, E, H, I);
  for (int rank : {4, 5}) {
    AdapterDir d("fused_2r");
    d.config()["target_parameters"] = {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"};
    d.config()["rank_pattern"] = {{".*\\.gate_up_proj", rank}};
    d.config()["alpha_pattern"] = {{".*\\.gate_up_proj", 8}};
    FusedWrite gu = add_fused(d, 0, true, rank * E, H, 2 * I, 800);
    add_fused(d, 0, false, 2 * E, I, H, 810);
    auto res = load(d.write(), base, /*max_rank=*/2);
    if (rank == 4) {
      ASSERT_TRUE(res.ok()) << res.status().message();
      EXPECT_EQ(res->max_rank, 4);
      expect_delta_near(delta_of(pair_at(*res, 0, LoraTarget::kMoeGateUp)), peft_param_delta(gu.a, gu.b, E, true, 2.0),
                        kTol, "gate_up rank 2r");
    } else {
      ASSERT_FALSE(res.ok());
      EXPECT_NE(res.status().message().find("rank 5 is above the limit (--max-lora-rank 2, doubled for gate_up_proj)"),
                std::string::npos)
          << res.status().message();
    }
  }
}

}  // namespace
}  // namespace lmx::lora::testing
