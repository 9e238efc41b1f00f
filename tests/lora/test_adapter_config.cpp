// parse_adapter_config and PEFT's matching rules: rank/alpha patterns (first match in file order, module
// suffix semantics), target_modules as list or regex, exclude_modules, layers_to_transform, versions.
#include <gtest/gtest.h>

#include "lora/adapter_config.h"

namespace lmx::lora {
namespace {

AdapterConfig parse_ok(const std::string& json) {
  AdapterConfig c;
  Status s = parse_adapter_config(json, "cfg.json", &c);
  EXPECT_TRUE(s.ok()) << s.message();
  return c;
}

std::string parse_error(const std::string& json) {
  AdapterConfig c;
  Status s = parse_adapter_config(json, "cfg.json", &c);
  EXPECT_FALSE(s.ok()) << json;
  return s.message();
}

TEST(AdapterConfig, ReadsThePeftFields) {
  AdapterConfig c = parse_ok(R"({
    "peft_type": "LORA", "r": 16, "lora_alpha": 32.5, "use_rslora": true,
    "target_modules": ["q_proj", "v_proj"], "target_parameters": ["mlp.experts.gate_up_proj"],
    "rank_pattern": {"z_proj": 4, "a_proj": 8}, "alpha_pattern": {}, "layers_to_transform": [1, 3],
    "layers_pattern": "layers", "base_model_name_or_path": "openai/gpt-oss-20b", "peft_version": "0.21.2",
    "bias": "none", "use_dora": false, "modules_to_save": null, "fan_in_fan_out": false, "lora_bias": false,
    "init_lora_weights": true, "task_type": "CAUSAL_LM", "lora_dropout": 0.05})");
  EXPECT_EQ(c.r, 16);
  EXPECT_DOUBLE_EQ(c.lora_alpha, 32.5);
  EXPECT_TRUE(c.use_rslora);
  EXPECT_EQ(c.target_modules, (std::vector<std::string>{"q_proj", "v_proj"}));
  EXPECT_FALSE(c.target_modules_regex.has_value());
  EXPECT_EQ(c.target_parameters, (std::vector<std::string>{"mlp.experts.gate_up_proj"}));
  ASSERT_EQ(c.rank_pattern.size(), 2u);
  EXPECT_EQ(c.rank_pattern[0].first, "z_proj");  // file order kept, not sorted
  EXPECT_EQ(c.layers_to_transform, (std::vector<int>{1, 3}));
  EXPECT_EQ(c.layers_pattern, (std::vector<std::string>{"layers"}));
  EXPECT_EQ(c.base_model_name_or_path, "openai/gpt-oss-20b");
  EXPECT_EQ(c.peft_version, "0.21.2");
}

TEST(AdapterConfig, RankPatternFirstMatchWinsWithSuffixSemantics) {
  AdapterConfig c = parse_ok(R"({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"],
    "rank_pattern": {"layers\\.1\\..*proj": 2, "q_proj": 4, "model.layers.0.self_attn.k_proj": 6},
    "alpha_pattern": {"proj": 99}})");
  auto rank = [&](const std::string& key) { return rank_for(c, key).value(); };
  EXPECT_EQ(rank("model.layers.1.self_attn.q_proj"), 2);  // first key matches (regex suffix)
  EXPECT_EQ(rank("model.layers.0.self_attn.q_proj"), 4);  // "(.*\.)?(q_proj)$"
  EXPECT_EQ(rank("model.layers.0.self_attn.k_proj"), 6);  // a full name
  EXPECT_EQ(rank("model.layers.0.self_attn.v_proj"), 8);  // default r
  EXPECT_EQ(rank("model.layers.0.self_attn.xq_proj"), 8);  // suffix must start at a '.'
  // "proj" matches only a whole last segment named "proj", as in PEFT.
  EXPECT_DOUBLE_EQ(alpha_for(c, "model.layers.0.self_attn.q_proj").value(), 16.0);
  EXPECT_DOUBLE_EQ(alpha_for(c, "model.layers.0.proj").value(), 99.0);
}

TEST(AdapterConfig, TargetModulesListRegexExcludeAndLayers) {
  AdapterConfig list = parse_ok(R"({"peft_type": "LORA", "target_modules": ["q_proj", "mlp.down_proj"],
                                    "exclude_modules": ["model.layers.1.self_attn.q_proj"]})");
  EXPECT_TRUE(targets_module(list, "model.layers.0.self_attn.q_proj").value());
  EXPECT_FALSE(targets_module(list, "model.layers.1.self_attn.q_proj").value());  // excluded
  EXPECT_TRUE(targets_module(list, "model.layers.0.mlp.down_proj").value());
  EXPECT_FALSE(targets_module(list, "model.layers.0.mlp.experts.0.down_proj").value());  // "experts.0.down_proj"
  EXPECT_FALSE(targets_module(list, "model.layers.0.self_attn.k_proj").value());

  AdapterConfig regex = parse_ok(R"({"peft_type": "LORA", "target_modules": ".*\\.(q|v)_proj"})");
  ASSERT_TRUE(regex.target_modules_regex.has_value());
  EXPECT_TRUE(targets_module(regex, "model.layers.3.self_attn.v_proj").value());
  EXPECT_FALSE(targets_module(regex, "model.layers.3.self_attn.k_proj").value());

  AdapterConfig layers = parse_ok(R"({"peft_type": "LORA", "target_modules": ["q_proj", "gate_proj"],
                                      "layers_to_transform": [2]})");
  EXPECT_TRUE(targets_module(layers, "model.layers.2.self_attn.q_proj").value());
  EXPECT_FALSE(targets_module(layers, "model.layers.1.self_attn.q_proj").value());
  // The layer index is the first numbered segment, never the expert index.
  EXPECT_TRUE(targets_module(layers, "model.layers.2.mlp.experts.1.gate_proj").value());
  EXPECT_FALSE(targets_module(layers, "model.layers.1.mlp.experts.2.gate_proj").value());

  AdapterConfig pattern = parse_ok(R"({"peft_type": "LORA", "target_modules": ["q_proj"], "layers_to_transform": 0,
                                       "layers_pattern": ["blocks"]})");
  EXPECT_FALSE(targets_module(pattern, "model.layers.0.self_attn.q_proj").value());  // no "blocks" segment
  EXPECT_TRUE(targets_module(pattern, "model.blocks.0.self_attn.q_proj").value());

  AdapterConfig params = parse_ok(R"({"peft_type": "LORA", "target_parameters": ["experts.down_proj"]})");
  EXPECT_TRUE(targets_parameter(params, "model.layers.0.mlp.experts.down_proj"));
  EXPECT_FALSE(targets_parameter(params, "model.layers.0.mlp.experts.gate_up_proj"));
}

TEST(AdapterConfig, RejectsWhatCannotBeServedExactly) {
  EXPECT_NE(parse_error(R"({"r": 8})").find("field 'peft_type': expected \"LORA\", found nothing"), std::string::npos);
  EXPECT_NE(parse_error(R"({"peft_type": "LORA", "target_modules": ["q"], "bias": "lora_only"})").find("field 'bias'"),
            std::string::npos);
  EXPECT_NE(parse_error(R"({"peft_type": "LORA", "target_modules": ["q"], "lora_bias": true})").find("field 'lora_bias'"),
            std::string::npos);
  EXPECT_NE(parse_error(R"({"peft_type": "LORA", "target_modules": ["q"], "fan_in_fan_out": true})")
                .find("field 'fan_in_fan_out'"),
            std::string::npos);
  EXPECT_NE(parse_error(R"({"peft_type": "LORA", "target_modules": ["q"], "trainable_token_indices": [1, 2]})")
                .find("field 'trainable_token_indices'"),
            std::string::npos);
  EXPECT_NE(parse_error(R"({"peft_type": "LORA", "target_modules": ["q"], "layer_replication": [[0, 2]]})")
                .find("field 'layer_replication'"),
            std::string::npos);
  EXPECT_NE(parse_error(R"({"peft_type": "LORA", "target_modules": ".*q", "layers_to_transform": [0]})")
                .find("cannot be used when 'target_modules' is a regex"),
            std::string::npos);
  EXPECT_NE(parse_error(R"({"peft_type": "LORA"})").find("neither 'target_modules' nor 'target_parameters'"),
            std::string::npos);
  EXPECT_NE(parse_error(R"([1, 2])").find("expected a JSON object, found array"), std::string::npos);
  EXPECT_NE(parse_error(R"({"peft_type": "LORA", "target_modules": ["q"], "r": 2.5})").find("field 'r': expected an integer"),
            std::string::npos);
}

TEST(AdapterConfig, RefusesOversizedPatterns) {
  std::string long_pattern(600, 'a');
  EXPECT_NE(parse_error(R"({"peft_type": "LORA", "target_modules": ")" + long_pattern + R"("})").find("at most 512"),
            std::string::npos);
  EXPECT_NE(parse_error(R"({"peft_type": "LORA", "target_modules": "(a{100}){100}"})").find("multiply beyond"),
            std::string::npos);
  EXPECT_NE(parse_error(R"({"peft_type": "LORA", "target_modules": ["q"], "rank_pattern": {"(": 4}})")
                .find("field 'rank_pattern' key '('"),
            std::string::npos);
}

TEST(AdapterConfig, PeftVersions) {
  int v[3];
  ASSERT_TRUE(parse_peft_version("0.19.1", v));
  EXPECT_EQ(v[0], 0);
  EXPECT_EQ(v[1], 19);
  EXPECT_EQ(v[2], 1);
  ASSERT_TRUE(parse_peft_version("0.22.0.dev0@abc123", v));
  EXPECT_EQ(v[1], 22);
  ASSERT_TRUE(parse_peft_version("1.0", v));
  EXPECT_EQ(v[0], 1);
  EXPECT_EQ(v[2], 0);
  EXPECT_FALSE(parse_peft_version("dev", v));
  EXPECT_FALSE(parse_peft_version("", v));
}

}  // namespace
}  // namespace lmx::lora
