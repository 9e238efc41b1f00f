// Tests of config.json parsing: the published configs of each family (transformers v4 and v5 RoPE styles),
// family defaults, the model_config_to_json round trip, and every error naming its field and file.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "model/config.h"
#include "model/presets.h"

namespace lmx::model {
namespace {

// openai/gpt-oss-20b config.json as published (transformers v4 style).
const char* kGptOss20bV4 = R"({
  "architectures": ["GptOssForCausalLM"], "attention_bias": true, "attention_dropout": 0.0,
  "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
  "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
  "intermediate_size": 2880,
  "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention",
                  "sliding_attention", "full_attention", "sliding_attention", "full_attention",
                  "sliding_attention", "full_attention", "sliding_attention", "full_attention",
                  "sliding_attention", "full_attention", "sliding_attention", "full_attention",
                  "sliding_attention", "full_attention", "sliding_attention", "full_attention",
                  "sliding_attention", "full_attention", "sliding_attention", "full_attention"],
  "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
  "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32,
  "output_router_logits": false, "pad_token_id": 199999,
  "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                          "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
  "rms_norm_eps": 1e-05,
  "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                   "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": false},
  "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
  "tie_word_embeddings": false, "transformers_version": "4.55.0.dev0", "use_cache": true, "vocab_size": 201088
})";

Result<ModelConfig> parse(const std::string& text) { return parse_model_config(text, "/models/x/config.json"); }

// Replace `from` by `to` in `text` (once), asserting it was there.
std::string edit(std::string text, const std::string& from, const std::string& to) {
  size_t at = text.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  if (at != std::string::npos) text.replace(at, from.size(), to);
  return text;
}

void expect_error(const Result<ModelConfig>& r, std::initializer_list<std::string> parts) {
  ASSERT_FALSE(r.ok());
  for (const auto& part : parts) EXPECT_NE(r.status().message().find(part), std::string::npos) << r.status().message();
}

void expect_same(const ModelConfig& a, const ModelConfig& b) {
  EXPECT_EQ(a.family, b.family);
  EXPECT_EQ(a.architecture, b.architecture);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.hidden_size, b.hidden_size);
  EXPECT_EQ(a.num_layers, b.num_layers);
  EXPECT_EQ(a.num_heads, b.num_heads);
  EXPECT_EQ(a.num_kv_heads, b.num_kv_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.intermediate_size, b.intermediate_size);
  EXPECT_EQ(a.num_experts, b.num_experts);
  EXPECT_EQ(a.experts_per_token, b.experts_per_token);
  EXPECT_EQ(a.moe_intermediate_size, b.moe_intermediate_size);
  EXPECT_EQ(a.routing, b.routing);
  EXPECT_EQ(a.norm_topk_prob, b.norm_topk_prob);
  EXPECT_EQ(a.moe_activation, b.moe_activation);
  EXPECT_EQ(a.gate_up_layout, b.gate_up_layout);
  EXPECT_EQ(a.swiglu_alpha, b.swiglu_alpha);
  EXPECT_EQ(a.swiglu_limit, b.swiglu_limit);
  EXPECT_EQ(a.router_bias, b.router_bias);
  EXPECT_EQ(a.expert_bias, b.expert_bias);
  EXPECT_EQ(a.attention_bias, b.attention_bias);
  EXPECT_EQ(a.qk_norm, b.qk_norm);
  EXPECT_EQ(a.attention_sinks, b.attention_sinks);
  EXPECT_EQ(a.sliding_window, b.sliding_window);
  EXPECT_EQ(a.layer_sliding, b.layer_sliding);
  EXPECT_EQ(a.rope.type, b.rope.type);
  EXPECT_EQ(a.rope.theta, b.rope.theta);
  EXPECT_EQ(a.rope.factor, b.rope.factor);
  EXPECT_EQ(a.rope.original_max_position, b.rope.original_max_position);
  EXPECT_EQ(a.rope.beta_fast, b.rope.beta_fast);
  EXPECT_EQ(a.rope.beta_slow, b.rope.beta_slow);
  EXPECT_DOUBLE_EQ(a.rope.attention_factor, b.rope.attention_factor);
  EXPECT_EQ(a.rope.truncate, b.rope.truncate);
  EXPECT_EQ(a.rope.low_freq_factor, b.rope.low_freq_factor);
  EXPECT_EQ(a.rope.high_freq_factor, b.rope.high_freq_factor);
  EXPECT_EQ(a.rms_norm_eps, b.rms_norm_eps);
  EXPECT_EQ(a.max_position_embeddings, b.max_position_embeddings);
  EXPECT_EQ(a.tie_word_embeddings, b.tie_word_embeddings);
  EXPECT_EQ(a.eos_token_ids, b.eos_token_ids);
  EXPECT_EQ(a.bos_token_id, b.bos_token_id);
}

TEST(Config, GptOss20bPublished) {
  auto r = parse(kGptOss20bV4);
  ASSERT_TRUE(r.ok()) << r.status().message();
  const ModelConfig& c = *r;
  EXPECT_EQ(c.family, Family::kGptOss);
  EXPECT_EQ(family_name(c.family), "gpt_oss");
  EXPECT_EQ(c.architecture, "GptOssForCausalLM");
  EXPECT_TRUE(c.mxfp4_checkpoint);  // quantization_config: mxfp4
  EXPECT_EQ(c.vocab_size, 201088);
  EXPECT_EQ(c.hidden_size, 2880);
  EXPECT_EQ(c.num_layers, 24);
  EXPECT_EQ(c.num_heads, 64);
  EXPECT_EQ(c.num_kv_heads, 8);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.q_dim(), 4096);
  EXPECT_EQ(c.kv_dim(), 512);
  EXPECT_EQ(c.num_experts, 32);
  EXPECT_EQ(c.experts_per_token, 4);
  EXPECT_EQ(c.moe_intermediate_size, 2880);
  EXPECT_EQ(c.routing, ops::RoutingRule::kTopKThenSoftmax);
  EXPECT_EQ(c.moe_activation, ops::MoeActivation::kGptOssClamped);
  EXPECT_EQ(c.gate_up_layout, ops::GateUpLayout::kInterleaved);
  EXPECT_FLOAT_EQ(c.swiglu_alpha, 1.702f);
  EXPECT_FLOAT_EQ(c.swiglu_limit, 7.0f);
  EXPECT_TRUE(c.router_bias && c.expert_bias && c.attention_bias && c.attention_sinks);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_EQ(c.sliding_window, 128);
  ASSERT_EQ(c.layer_sliding.size(), 24u);
  EXPECT_TRUE(c.layer_sliding[0]);
  EXPECT_FALSE(c.layer_sliding[1]);
  EXPECT_TRUE(c.layer_sliding[22]);
  EXPECT_FALSE(c.layer_sliding[23]);
  EXPECT_EQ(c.rope.type, ops::RopeScaling::Type::kYarn);
  EXPECT_EQ(c.rope.theta, 150000.0);
  EXPECT_EQ(c.rope.factor, 32.0);
  EXPECT_EQ(c.rope.original_max_position, 4096);
  EXPECT_EQ(c.rope.beta_fast, 32.0);
  EXPECT_EQ(c.rope.beta_slow, 1.0);
  EXPECT_FALSE(c.rope.truncate);
  EXPECT_DOUBLE_EQ(c.rope.attention_factor, 0.1 * std::log(32.0) + 1.0);
  EXPECT_FLOAT_EQ(c.rms_norm_eps, 1e-5f);
  EXPECT_EQ(c.max_position_embeddings, 131072);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.eos_token_ids, std::vector<int>{200002});
  EXPECT_EQ(c.bos_token_id, -1);
}

TEST(Config, GptOssV5RopeParametersMatchV4) {
  std::string v5 = edit(kGptOss20bV4, R"("rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                   "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": false},
  "rope_theta": 150000,)",
                        R"("rope_parameters": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "rope_theta": 150000.0,
                   "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": false},)");
  auto a = parse(kGptOss20bV4);
  auto b = parse(v5);
  ASSERT_TRUE(a.ok() && b.ok()) << b.status().message();
  expect_same(*a, *b);
}

TEST(Config, GptOssDefaultsWhenFieldsAbsent) {
  // No rope fields, no layer_types, no sliding_window, no head_dim: GptOssConfig's defaults.
  const char* minimal = R"({"architectures": ["GptOssForCausalLM"], "vocab_size": 100, "hidden_size": 128,
    "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_local_experts": 4})";
  auto r = parse(minimal);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->head_dim, 64);  // class default, not hidden/heads = 32
  EXPECT_FALSE(r->mxfp4_checkpoint);
  EXPECT_EQ(r->experts_per_token, 4);
  EXPECT_EQ(r->sliding_window, 128);
  EXPECT_EQ(r->layer_sliding, (std::vector<bool>{true, false, true}));
  EXPECT_EQ(r->rope.type, ops::RopeScaling::Type::kYarn);
  EXPECT_EQ(r->rope.theta, 150000.0);
  EXPECT_EQ(r->rope.factor, 32.0);
  EXPECT_EQ(r->rope.original_max_position, 4096);
  EXPECT_FALSE(r->rope.truncate);
  EXPECT_TRUE(r->attention_bias);
  EXPECT_EQ(r->max_position_embeddings, 131072);

  // An explicit null window turns sliding off everywhere.
  auto no_window = parse(edit(minimal, R"("num_local_experts": 4)", R"("num_local_experts": 4, "sliding_window": null)"));
  ASSERT_TRUE(no_window.ok());
  EXPECT_EQ(no_window->sliding_window, 0);
  EXPECT_EQ(no_window->layer_sliding, (std::vector<bool>{false, false, false}));
}

const char* kQwen3_30bA3b = R"({
  "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
  "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
  "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
  "moe_intermediate_size": 768, "norm_topk_prob": true, "num_attention_heads": 32, "num_experts": 128,
  "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": false,
  "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
  "sliding_window": null, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "transformers_version": "4.51.0", "use_cache": true, "use_sliding_window": false, "vocab_size": 151936
})";

TEST(Config, Qwen3MoePublished) {
  auto r = parse(kQwen3_30bA3b);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->family, Family::kQwen3Moe);
  EXPECT_EQ(r->head_dim, 128);
  EXPECT_EQ(r->q_dim(), 4096);  // != hidden_size: head_dim must come from the config
  EXPECT_EQ(r->num_experts, 128);
  EXPECT_EQ(r->experts_per_token, 8);
  EXPECT_EQ(r->moe_intermediate_size, 768);
  EXPECT_EQ(r->intermediate_size, 6144);
  EXPECT_TRUE(r->norm_topk_prob);
  EXPECT_TRUE(r->qk_norm);
  EXPECT_FALSE(r->attention_bias || r->attention_sinks || r->router_bias || r->expert_bias);
  EXPECT_EQ(r->routing, ops::RoutingRule::kSoftmaxThenTopK);
  EXPECT_EQ(r->moe_activation, ops::MoeActivation::kSiluGated);
  EXPECT_EQ(r->gate_up_layout, ops::GateUpLayout::kHalves);
  EXPECT_EQ(r->sliding_window, 0);
  EXPECT_EQ(r->layer_sliding, std::vector<bool>(48, false));
  EXPECT_EQ(r->rope.type, ops::RopeScaling::Type::kDefault);
  EXPECT_EQ(r->rope.theta, 1e6);
  EXPECT_EQ(r->bos_token_id, 151643);
  EXPECT_EQ(r->eos_token_ids, std::vector<int>{151645});
  EXPECT_EQ(r->max_position_embeddings, 40960);

  // norm_topk_prob defaults to false (Qwen3MoeConfig), unlike Mixtral.
  auto no_norm = parse(edit(kQwen3_30bA3b, R"("norm_topk_prob": true,)", ""));
  ASSERT_TRUE(no_norm.ok());
  EXPECT_FALSE(no_norm->norm_topk_prob);
}

// What transformers 5's save_pretrained writes for a Qwen3-MoE model: v5 rope_parameters, and the expert
// count under `num_local_experts` (its attribute_map alias), not the published `num_experts`.
TEST(Config, Qwen3MoeAsSavedByTransformers5) {
  const char* saved = R"({
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "bos_token_id": null, "decoder_sparse_step": 1, "dtype": "bfloat16", "eos_token_id": null, "head_dim": 16,
    "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 128,
    "max_position_embeddings": 32768, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 32,
    "norm_topk_prob": false, "num_attention_heads": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2,
    "num_key_value_heads": 2, "num_local_experts": 4, "output_router_logits": false, "pad_token_id": null,
    "rms_norm_eps": 1e-06, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "router_aux_loss_coef": 0.001, "sliding_window": null, "tie_word_embeddings": false,
    "transformers_version": "5.24.0", "use_cache": true, "use_sliding_window": false, "vocab_size": 64})";
  auto r = parse(saved);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->num_experts, 4);
  EXPECT_EQ(r->experts_per_token, 2);
  EXPECT_EQ(r->rope.theta, 10000.0);
  EXPECT_TRUE(r->eos_token_ids.empty());
  EXPECT_EQ(r->bos_token_id, -1);
  // Both spellings present and disagreeing: an error naming both.
  expect_error(parse(edit(saved, R"("num_local_experts": 4)", R"("num_local_experts": 4, "num_experts": 8)")),
               {"'num_local_experts'", "disagrees with num_experts 8"});
}

TEST(Config, Qwen3MoeDenseLayersUnsupported) {
  expect_error(parse(edit(kQwen3_30bA3b, R"("mlp_only_layers": [])", R"("mlp_only_layers": [3])")),
               {"/models/x/config.json", "'mlp_only_layers'", "layer 3", "not supported"});
  expect_error(parse(edit(kQwen3_30bA3b, R"("decoder_sparse_step": 1)", R"("decoder_sparse_step": 2)")),
               {"'decoder_sparse_step'", "layer 0", "not supported"});
}

const char* kMixtral = R"({
  "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
  "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
  "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32,
  "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
  "output_router_logits": false, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
  "router_aux_loss_coef": 0.02, "sliding_window": null, "tie_word_embeddings": false,
  "torch_dtype": "bfloat16", "transformers_version": "4.36.0.dev0", "use_cache": true, "vocab_size": 32000
})";

TEST(Config, MixtralPublished) {
  auto r = parse(kMixtral);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->family, Family::kMixtral);
  EXPECT_EQ(r->head_dim, 128);  // hidden / heads
  EXPECT_EQ(r->num_experts, 8);
  EXPECT_EQ(r->experts_per_token, 2);
  EXPECT_EQ(r->moe_intermediate_size, 14336);
  EXPECT_TRUE(r->norm_topk_prob);
  EXPECT_FALSE(r->qk_norm);
  EXPECT_EQ(r->sliding_window, 0);
  EXPECT_EQ(r->rope.theta, 1e6);
  EXPECT_EQ(r->bos_token_id, 1);
  EXPECT_EQ(r->eos_token_ids, std::vector<int>{2});

  // Mistral-style window: every layer slides.
  auto windowed = parse(edit(kMixtral, R"("sliding_window": null)", R"("sliding_window": 4096)"));
  ASSERT_TRUE(windowed.ok());
  EXPECT_EQ(windowed->sliding_window, 4096);
  EXPECT_EQ(windowed->layer_sliding, std::vector<bool>(32, true));
  // norm_topk_prob in the file does not matter: Mixtral always renormalizes.
  auto forced = parse(edit(kMixtral, R"("num_local_experts": 8)", R"("num_local_experts": 8, "norm_topk_prob": false)"));
  ASSERT_TRUE(forced.ok());
  EXPECT_TRUE(forced->norm_topk_prob);
}

const char* kLlama31 = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "bos_token_id": 128000,
  "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 4096,
  "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
  "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0, "tie_word_embeddings": false, "vocab_size": 128256
})";

TEST(Config, Llama31RopeAndEosList) {
  auto r = parse(kLlama31);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->family, Family::kLlama);
  EXPECT_FALSE(r->is_moe());
  EXPECT_EQ(r->intermediate_size, 14336);
  EXPECT_EQ(r->rope.type, ops::RopeScaling::Type::kLlama3);
  EXPECT_EQ(r->rope.theta, 500000.0);
  EXPECT_EQ(r->rope.factor, 8.0);
  EXPECT_EQ(r->rope.low_freq_factor, 1.0);
  EXPECT_EQ(r->rope.high_freq_factor, 4.0);
  EXPECT_EQ(r->rope.original_max_position, 8192);
  EXPECT_EQ(r->eos_token_ids, (std::vector<int>{128001, 128008, 128009}));
  EXPECT_EQ(r->bos_token_id, 128000);
  EXPECT_EQ(r->sliding_window, 0);
  EXPECT_EQ(r->layer_sliding, std::vector<bool>(32, false));

  // The legacy `type` key instead of `rope_type`.
  auto legacy = parse(edit(kLlama31, R"("rope_type": "llama3")", R"("type": "llama3")"));
  ASSERT_TRUE(legacy.ok()) << legacy.status().message();
  EXPECT_EQ(legacy->rope.type, ops::RopeScaling::Type::kLlama3);
  // Missing llama3 parameter: named with its dict.
  expect_error(parse(edit(kLlama31, R"("low_freq_factor": 1.0, )", "")), {"'rope_scaling.low_freq_factor'"});
  // mlp_bias is not implemented.
  expect_error(parse(edit(kLlama31, R"("mlp_bias": false)", R"("mlp_bias": true)")), {"'mlp_bias'"});
}

TEST(Config, Qwen3DenseDefaultsAndSlidingLayers) {
  const char* qwen3 = R"({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 1000, "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "rope_theta": 1000000.0, "use_sliding_window": true, "sliding_window": 64, "max_window_layers": 2})";
  auto r = parse(qwen3);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->family, Family::kQwen3);
  EXPECT_EQ(r->head_dim, 128);  // Qwen3Config class default
  EXPECT_TRUE(r->qk_norm);
  EXPECT_EQ(r->sliding_window, 64);
  EXPECT_EQ(r->layer_sliding, (std::vector<bool>{false, false, true, true}));
  EXPECT_FLOAT_EQ(r->rms_norm_eps, 1e-6f);
  // use_sliding_window false: the window is ignored.
  auto off = parse(edit(qwen3, R"("use_sliding_window": true)", R"("use_sliding_window": false)"));
  ASSERT_TRUE(off.ok());
  EXPECT_EQ(off->sliding_window, 0);
  EXPECT_EQ(off->layer_sliding, std::vector<bool>(4, false));
}

TEST(Config, YarnMscaleAndExplicitAttentionFactor) {
  const std::string base = R"({"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 64,
    "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 8192,
    "rope_parameters": ROPE})";
  auto with = [&](const std::string& rope) { return parse(edit(base, "ROPE", rope)); };
  auto mscale = with(R"({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.5,
                        "original_max_position_embeddings": 4096})");
  ASSERT_TRUE(mscale.ok()) << mscale.status().message();
  const double expect = (0.1 * 1.0 * std::log(40.0) + 1.0) / (0.1 * 0.5 * std::log(40.0) + 1.0);
  EXPECT_DOUBLE_EQ(mscale->rope.attention_factor, expect);
  EXPECT_TRUE(mscale->rope.truncate);
  auto explicit_factor = with(R"({"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.25})");
  ASSERT_TRUE(explicit_factor.ok()) << explicit_factor.status().message();
  EXPECT_EQ(explicit_factor->rope.attention_factor, 1.25);
  EXPECT_EQ(explicit_factor->rope.original_max_position, 8192);  // falls back to max_position_embeddings
  EXPECT_EQ(explicit_factor->rope.theta, 10000.0);                // Llama default theta
  expect_error(with(R"({"rope_type": "dynamic", "factor": 2.0})"), {"'dynamic'", "not supported"});
  expect_error(with(R"({"rope_type": "default", "partial_rotary_factor": 0.5})"), {"partial_rotary_factor"});
  expect_error(with(R"({"rope_type": 3})"), {"'rope_parameters.rope_type'"});
  expect_error(with(R"([1, 2])"), {"'rope_parameters'", "object"});
}

TEST(Config, Errors) {
  expect_error(parse("{not json"), {"/models/x/config.json", "not valid JSON"});
  expect_error(parse("[1]"), {"JSON object"});
  expect_error(parse(edit(kMixtral, "MixtralForCausalLM", "DeepseekV3ForCausalLM")),
               {"/models/x/config.json", "'DeepseekV3ForCausalLM'", "not supported", "GptOssForCausalLM"});
  expect_error(parse(edit(kMixtral, R"("hidden_size": 4096,)", "")),
               {"/models/x/config.json", "missing required field 'hidden_size'"});
  expect_error(parse(edit(kMixtral, R"("hidden_size": 4096)", R"("hidden_size": "big")")),
               {"'hidden_size'", "expected an integer", "\"big\""});
  expect_error(parse(edit(kMixtral, R"("hidden_size": 4096)", R"("hidden_size": -4)")), {"'hidden_size'", ">= 1"});
  expect_error(parse(edit(kMixtral, R"("num_key_value_heads": 8)", R"("num_key_value_heads": 5)")),
               {"'num_key_value_heads'", "multiple"});
  expect_error(parse(edit(kMixtral, R"("num_experts_per_tok": 2)", R"("num_experts_per_tok": 9)")),
               {"'num_experts_per_tok'", "exceeds"});
  expect_error(parse(edit(kMixtral, R"("hidden_act": "silu")", R"("hidden_act": "gelu")")), {"'hidden_act'", "gelu"});
  expect_error(parse(edit(kMixtral, R"("eos_token_id": 2)", R"("eos_token_id": "x")")), {"'eos_token_id'"});
  expect_error(parse(edit(kMixtral, R"("tie_word_embeddings": false)", R"("tie_word_embeddings": 0)")),
               {"'tie_word_embeddings'", "true or false"});
  expect_error(parse(edit(kQwen3_30bA3b, R"("rope_scaling": null)", R"("quantization_config": {"quant_method": "fp8"})")),
               {"'quantization_config'", "fp8", "not supported"});
  expect_error(parse(edit(kGptOss20bV4, R"("layer_types": ["sliding_attention", )", R"("layer_types": [)")),
               {"'layer_types'", "expected 24 entries", "found 23"});
  expect_error(parse(edit(kGptOss20bV4, R"("layer_types": ["sliding_attention", )", R"("layer_types": ["chunked", )")),
               {"'layer_types[0]'", "chunked"});
  expect_error(parse(R"({"vocab_size": 10})"), {"'architectures'"});
  expect_error(parse(R"({"model_type": "bert"})"), {"model_type", "bert", "not supported"});
  // model_type alone is enough to pick the family.
  auto by_type = parse(edit(kMixtral, R"("architectures": ["MixtralForCausalLM"],)", ""));
  ASSERT_TRUE(by_type.ok()) << by_type.status().message();
  EXPECT_EQ(by_type->family, Family::kMixtral);
}

TEST(Config, JsonRoundTripForEveryPresetAndPublishedConfig) {
  std::vector<ModelConfig> configs;
  for (const auto& name : preset_names()) {
    auto c = preset_config(name);
    ASSERT_TRUE(c.ok()) << name << ": " << c.status().message();
    configs.push_back(*c);
  }
  for (const char* text : {kGptOss20bV4, kQwen3_30bA3b, kMixtral, kLlama31}) configs.push_back(parse(text).value());
  for (const auto& c : configs) {
    SCOPED_TRACE(c.architecture);
    const std::string text = model_config_to_json(c);
    auto again = parse_model_config(text, "roundtrip");
    ASSERT_TRUE(again.ok()) << again.status().message() << "\n" << text;
    expect_same(c, *again);
    EXPECT_NE(text.find("\"rms_norm_eps\": 1e-0"), std::string::npos) << "eps not written as a short decimal";
  }
}

TEST(Config, LoadFromDirectory) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("lmx_config_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  {
    std::ofstream(dir / "config.json") << kMixtral;
  }
  auto r = load_model_config(dir.string());
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->family, Family::kMixtral);
  fs::remove(dir / "config.json");
  auto missing = load_model_config(dir.string());
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find((dir / "config.json").string()), std::string::npos);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace lmx::model
