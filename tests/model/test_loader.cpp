// Tests of load_model: tiny checkpoints written here in each family's Hugging Face naming and layout
// (fused or per-expert experts, GPT-OSS transposed experts, MXFP4, F32/F16, index shards) must load to
// the same canonical weights; each malformed checkpoint gives an error naming tensor and shapes.
#include <gtest/gtest.h>

#include "../common/temp_dir.h"
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <tuple>
#include <utility>
#include <vector>

#include "backends/cpu/cpu_backend.h"
#include "io/safetensors.h"
#include "model/config.h"
#include "model/mxfp4.h"
#include "model/presets.h"
#include "model/weights.h"

namespace lmx::model {
namespace {

namespace fs = std::filesystem;

using TempDir = lmx::testing::TempDir;

enum class ExpertFormat { kFused, kPerExpert };

struct WriteOptions {
  ExpertFormat experts = ExpertFormat::kFused;
  DType dtype = DType::BF16;
  int shards = 1;                    // > 1: model-0000k-of-0000n.safetensors + index.json
  bool mixtral_original_names = true;  // block_sparse_moe.* (else transformers-5 mlp.*)
  // Hook to drop or replace tensors before writing: return false to drop.
  std::function<bool(const std::string& name, Tensor* t)> edit = nullptr;
};

// Writes `w` as a Hugging Face checkpoint (config.json + safetensors), the inverse of load_model.
class CheckpointWriter {
 public:
  CheckpointWriter(const ModelWeights& w, WriteOptions options) : w_(w), opt_(std::move(options)) {}

  void write(const std::string& dir) {
    const ModelConfig& c = w_.config;
    add("model.embed_tokens.weight", w_.embed);
    add("model.norm.weight", w_.final_norm);
    if (!c.tie_word_embeddings) add("lm_head.weight", w_.lm_head);
    for (int i = 0; i < c.num_layers; ++i) add_layer(i, w_.layers[size_t(i)]);

    std::ofstream(fs::path(dir) / "config.json") << model_config_to_json(c);
    if (opt_.shards <= 1) {
      ASSERT_TRUE(io::write_safetensors((fs::path(dir) / "model.safetensors").string(), tensors_).ok());
      return;
    }
    std::vector<std::vector<std::pair<std::string, Tensor>>> parts(size_t(opt_.shards));
    std::string index = R"({"metadata": {}, "weight_map": {)";
    for (size_t i = 0; i < tensors_.size(); ++i) {
      const size_t shard = i % size_t(opt_.shards);
      parts[shard].push_back(tensors_[i]);
      index += (i ? ", " : "") + std::string("\"") + tensors_[i].first + "\": \"" + shard_name(shard) + "\"";
    }
    index += "}}";
    for (size_t s = 0; s < parts.size(); ++s)
      ASSERT_TRUE(io::write_safetensors((fs::path(dir) / shard_name(s)).string(), parts[s]).ok());
    std::ofstream(fs::path(dir) / "model.safetensors.index.json") << index;
  }

 private:
  std::string shard_name(size_t s) const {
    char buf[64];
    std::snprintf(buf, sizeof(buf), "model-%05zu-of-%05d.safetensors", s + 1, opt_.shards);
    return buf;
  }

  // Stores a converted copy of bf16 `t` in the requested dtype.
  void add(const std::string& name, const Tensor& t) {
    Tensor out = convert(t);
    if (opt_.edit && !opt_.edit(name, &out)) return;
    tensors_.emplace_back(name, out);
  }
  Tensor convert(const Tensor& t) {
    OwnedTensor o = OwnedTensor::host_like(t, opt_.dtype);
    const auto* src = t.ptr<uint16_t>();
    for (int64_t i = 0; i < t.numel(); ++i) {
      const float f = bf16_to_f32(bf16{src[i]});
      if (opt_.dtype == DType::F32) o.view.ptr<float>()[i] = f;
      if (opt_.dtype == DType::F16) o.view.ptr<uint16_t>()[i] = f32_to_f16(f);
      if (opt_.dtype == DType::BF16) o.view.ptr<uint16_t>()[i] = src[i];
    }
    store_.push_back(o);
    return o.view;
  }
  // A bf16 copy of rows [begin, end) of dim 1 of a 3D tensor's expert e.
  Tensor expert_rows(const Tensor& t, int64_t e, int64_t begin, int64_t end) {
    const int64_t cols = t.shape[2];
    OwnedTensor o = OwnedTensor::host(DType::BF16, {end - begin, cols});
    std::memcpy(o.view.data, t.ptr<uint16_t>() + (e * t.shape[1] + begin) * cols, size_t((end - begin) * cols) * 2);
    store_.push_back(o);
    return o.view;
  }
  // [E, R, C] -> [E, C, R] (GPT-OSS's HF orientation).
  Tensor transposed(const Tensor& t) {
    const int64_t E = t.shape[0], R = t.shape[1], C = t.shape[2];
    OwnedTensor o = OwnedTensor::host(DType::BF16, {E, C, R});
    for (int64_t e = 0; e < E; ++e)
      for (int64_t r = 0; r < R; ++r)
        for (int64_t c = 0; c < C; ++c) o.view.ptr<uint16_t>()[(e * C + c) * R + r] = t.ptr<uint16_t>()[(e * R + r) * C + c];
    store_.push_back(o);
    return o.view;
  }

  void add_layer(int layer, const LayerWeights& l) {
    const ModelConfig& c = w_.config;
    const std::string p = "model.layers." + std::to_string(layer) + ".";
    add(p + "input_layernorm.weight", l.input_norm);
    add(p + "post_attention_layernorm.weight", l.post_attention_norm);
    add(p + "self_attn.q_proj.weight", l.q);
    add(p + "self_attn.k_proj.weight", l.k);
    add(p + "self_attn.v_proj.weight", l.v);
    add(p + "self_attn.o_proj.weight", l.o);
    if (c.attention_bias) {
      add(p + "self_attn.q_proj.bias", l.q_bias);
      add(p + "self_attn.k_proj.bias", l.k_bias);
      add(p + "self_attn.v_proj.bias", l.v_bias);
      add(p + "self_attn.o_proj.bias", l.o_bias);
    }
    if (c.qk_norm) {
      add(p + "self_attn.q_norm.weight", l.q_norm);
      add(p + "self_attn.k_norm.weight", l.k_norm);
    }
    if (c.attention_sinks) add(p + "self_attn.sinks", l.sinks);
    const int64_t E = c.num_experts, I = c.moe_intermediate_size;
    switch (c.family) {
      case Family::kGptOss:
        add(p + "mlp.router.weight", l.router);
        add(p + "mlp.router.bias", l.router_bias);
        add(p + "mlp.experts.gate_up_proj", transposed(l.gate_up));
        add(p + "mlp.experts.down_proj", transposed(l.down));
        add(p + "mlp.experts.gate_up_proj_bias", l.gate_up_bias);
        add(p + "mlp.experts.down_proj_bias", l.down_bias);
        break;
      case Family::kQwen3Moe:
      case Family::kMixtral: {
        const bool mixtral = c.family == Family::kMixtral;
        const std::string moe = mixtral && opt_.mixtral_original_names ? p + "block_sparse_moe." : p + "mlp.";
        add(moe + "gate.weight", l.router);
        if (opt_.experts == ExpertFormat::kFused) {
          add(moe + "experts.gate_up_proj", l.gate_up);
          add(moe + "experts.down_proj", l.down);
          break;
        }
        const bool w123 = mixtral && opt_.mixtral_original_names;
        for (int64_t e = 0; e < E; ++e) {
          const std::string ep = moe + "experts." + std::to_string(e) + ".";
          add(ep + (w123 ? "w1" : "gate_proj") + ".weight", expert_rows(l.gate_up, e, 0, I));
          add(ep + (w123 ? "w3" : "up_proj") + ".weight", expert_rows(l.gate_up, e, I, 2 * I));
          add(ep + (w123 ? "w2" : "down_proj") + ".weight", expert_rows(l.down, e, 0, c.hidden_size));
        }
        break;
      }
      case Family::kQwen3:
      case Family::kLlama:
        add(p + "mlp.gate_proj.weight", l.mlp_gate);
        add(p + "mlp.up_proj.weight", l.mlp_up);
        add(p + "mlp.down_proj.weight", l.mlp_down);
        break;
    }
  }

  const ModelWeights& w_;
  WriteOptions opt_;
  std::vector<std::pair<std::string, Tensor>> tensors_;
  std::vector<OwnedTensor> store_;
};

void write_checkpoint(const ModelWeights& w, const std::string& dir, WriteOptions options = {}) {
  CheckpointWriter writer(w, std::move(options));
  writer.write(dir);
}

// What a bf16 value becomes after a trip through `dtype` and back.
uint16_t through(uint16_t bits, DType dtype) {
  if (dtype == DType::F16) return f32_to_bf16(f16_to_f32(f32_to_f16(bf16_to_f32(bf16{bits})))).bits;
  return bits;
}

void expect_tensor_eq(const Tensor& want, const Tensor& got, const std::string& name, DType via = DType::BF16) {
  if (!want.defined()) {
    EXPECT_FALSE(got.defined()) << name << " should be absent";
    return;
  }
  ASSERT_TRUE(got.defined()) << name << " missing";
  ASSERT_EQ(got.dtype, DType::BF16) << name;
  ASSERT_TRUE(want.same_shape(got)) << name << ": want " << want.shape_str() << ", got " << got.shape_str();
  int64_t mismatches = 0, first = -1;
  for (int64_t i = 0; i < want.numel(); ++i) {
    if (through(want.ptr<uint16_t>()[i], via) != got.ptr<uint16_t>()[i]) {
      if (first < 0) first = i;
      ++mismatches;
    }
  }
  EXPECT_EQ(mismatches, 0) << name << ": first mismatch at element " << first;
}

void expect_weights_eq(const ModelWeights& want, const ModelWeights& got, DType via = DType::BF16) {
  expect_tensor_eq(want.embed, got.embed, "embed", via);
  expect_tensor_eq(want.final_norm, got.final_norm, "final_norm", via);
  expect_tensor_eq(want.lm_head, got.lm_head, "lm_head", via);
  ASSERT_EQ(want.layers.size(), got.layers.size());
  for (size_t i = 0; i < want.layers.size(); ++i) {
    const LayerWeights& a = want.layers[i];
    const LayerWeights& b = got.layers[i];
    const std::string p = "layer " + std::to_string(i) + " ";
    const std::pair<const Tensor*, const Tensor*> pairs[] = {
        {&a.input_norm, &b.input_norm}, {&a.q, &b.q}, {&a.k, &b.k}, {&a.v, &b.v}, {&a.o, &b.o},
        {&a.q_bias, &b.q_bias}, {&a.k_bias, &b.k_bias}, {&a.v_bias, &b.v_bias}, {&a.o_bias, &b.o_bias},
        {&a.q_norm, &b.q_norm}, {&a.k_norm, &b.k_norm}, {&a.sinks, &b.sinks},
        {&a.post_attention_norm, &b.post_attention_norm}, {&a.router, &b.router}, {&a.router_bias, &b.router_bias},
        {&a.gate_up, &b.gate_up}, {&a.gate_up_bias, &b.gate_up_bias}, {&a.down, &b.down},
        {&a.down_bias, &b.down_bias}, {&a.mlp_gate, &b.mlp_gate}, {&a.mlp_up, &b.mlp_up}, {&a.mlp_down, &b.mlp_down}};
    const char* names[] = {"input_norm", "q", "k", "v", "o", "q_bias", "k_bias", "v_bias", "o_bias", "q_norm",
                           "k_norm", "sinks", "post_attention_norm", "router", "router_bias", "gate_up",
                           "gate_up_bias", "down", "down_bias", "mlp_gate", "mlp_up", "mlp_down"};
    for (size_t k = 0; k < std::size(pairs); ++k) expect_tensor_eq(*pairs[k].first, *pairs[k].second, p + names[k], via);
  }
}

ModelWeights random_model(const std::string& preset, uint64_t seed = 7) {
  auto w = make_preset_model(preset, seed);
  EXPECT_TRUE(w.ok()) << w.status().message();
  return std::move(w).value();
}

ModelWeights load_ok(const std::string& dir) {
  auto r = load_model(dir);
  EXPECT_TRUE(r.ok()) << r.status().message();
  return std::move(r).value();
}

void expect_load_error(const std::string& dir, std::initializer_list<std::string> parts) {
  auto r = load_model(dir);
  ASSERT_FALSE(r.ok()) << "loaded " << dir;
  for (const auto& part : parts) EXPECT_NE(r.status().message().find(part), std::string::npos) << r.status().message();
}

// ---------------------------------------------------------------------------------------------------

TEST(Loader, GptOssFusedRoundTrip) {
  TempDir dir;
  ModelWeights w = random_model("tiny-moe");
  write_checkpoint(w, dir.str());
  ModelWeights got = load_ok(dir.str());
  EXPECT_EQ(got.config.family, Family::kGptOss);
  expect_weights_eq(w, got);
}

// Independent of the writer: GPT-OSS stores gate_up_proj as [E, H, 2I] (x @ W) and down_proj as [E, I, H];
// the loader must give gate_up[e][j][h] = file[e][h][j] and down[e][h][i] = file[e][i][h]. H != 2I and
// I != H here so a missing transpose cannot pass by shape.
TEST(Loader, GptOssTransposesFusedExperts) {
  TempDir dir;
  ModelConfig c = preset_config("tiny-moe").value();
  c.moe_intermediate_size = c.intermediate_size = 8;  // H 64, 2I 16
  ModelWeights w = make_random_weights(c, 3).value();
  const int64_t E = c.num_experts, H = c.hidden_size, I = 8;
  auto code = [](int64_t a, int64_t b, int64_t d) { return f32_to_bf16(float(a * 10000 + b * 100 + d)).bits; };
  OwnedTensor file_gu = OwnedTensor::host(DType::BF16, {E, H, 2 * I});
  OwnedTensor file_down = OwnedTensor::host(DType::BF16, {E, I, H});
  for (int64_t e = 0; e < E; ++e)
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t j = 0; j < 2 * I; ++j) file_gu.view.ptr<uint16_t>()[(e * H + h) * 2 * I + j] = code(e, h, j);
      for (int64_t i = 0; i < I; ++i) file_down.view.ptr<uint16_t>()[(e * I + i) * H + h] = code(e, i, h);
    }
  WriteOptions options;
  options.edit = [&](const std::string& name, Tensor* t) {
    if (name.find("experts.gate_up_proj") != std::string::npos && name.find("bias") == std::string::npos) *t = file_gu.view;
    if (name.find("experts.down_proj") != std::string::npos && name.find("bias") == std::string::npos) *t = file_down.view;
    return true;
  };
  write_checkpoint(w, dir.str(), options);
  ModelWeights got = load_ok(dir.str());
  const Tensor& gu = got.layers[1].gate_up;
  const Tensor& down = got.layers[1].down;
  ASSERT_EQ(gu.shape_str(), "[8, 16, 64] BF16");
  ASSERT_EQ(down.shape_str(), "[8, 64, 8] BF16");
  for (int64_t e : {0L, 5L})
    for (int64_t h : {0L, 1L, 63L}) {
      for (int64_t j : {0L, 1L, 15L}) EXPECT_EQ(gu.ptr<uint16_t>()[(e * 2 * I + j) * H + h], code(e, h, j));
      for (int64_t i : {0L, 7L}) EXPECT_EQ(down.ptr<uint16_t>()[(e * H + h) * I + i], code(e, i, h));
    }
}

TEST(Loader, Qwen3MoePerExpertAndFusedAgree) {
  TempDir dir;
  ModelWeights w = random_model("tiny-qwen3-moe");
  const std::string fused = dir.sub("fused"), per_expert = dir.sub("per_expert");
  write_checkpoint(w, fused, {.experts = ExpertFormat::kFused});
  write_checkpoint(w, per_expert, {.experts = ExpertFormat::kPerExpert});
  ModelWeights a = load_ok(fused);
  ModelWeights b = load_ok(per_expert);
  expect_weights_eq(w, a);
  expect_weights_eq(w, b);
  expect_weights_eq(a, b);
}

TEST(Loader, MixtralOriginalAndTransformers5NamesAgree) {
  TempDir dir;
  ModelConfig c = preset_config("tiny-qwen3-moe").value();
  // A Mixtral-shaped toy from the Qwen3-MoE one: no q/k norms, always renormalized.
  c.family = Family::kMixtral;
  c.architecture = "MixtralForCausalLM";
  c.qk_norm = false;
  c.intermediate_size = c.moe_intermediate_size;
  c.sliding_window = 8;
  c.layer_sliding.assign(size_t(c.num_layers), true);
  ModelWeights w = make_random_weights(c, 11).value();
  const std::string original = dir.sub("w123"), fused = dir.sub("fused"), renamed = dir.sub("renamed");
  write_checkpoint(w, original, {.experts = ExpertFormat::kPerExpert, .mixtral_original_names = true});
  write_checkpoint(w, fused, {.experts = ExpertFormat::kFused, .mixtral_original_names = false});
  write_checkpoint(w, renamed, {.experts = ExpertFormat::kPerExpert, .mixtral_original_names = false});
  for (const auto& d : {original, fused, renamed}) {
    SCOPED_TRACE(d);
    ModelWeights got = load_ok(d);
    EXPECT_EQ(got.config.family, Family::kMixtral);
    EXPECT_EQ(got.config.sliding_window, 8);
    expect_weights_eq(w, got);
  }
}

TEST(Loader, ConvertsF32AndF16ToBf16) {
  TempDir dir;
  ModelWeights w = random_model("tiny-qwen3-moe");
  const std::string f32 = dir.sub("f32"), f16 = dir.sub("f16");
  write_checkpoint(w, f32, {.experts = ExpertFormat::kPerExpert, .dtype = DType::F32});
  write_checkpoint(w, f16, {.experts = ExpertFormat::kFused, .dtype = DType::F16});
  expect_weights_eq(w, load_ok(f32));  // bf16 -> f32 -> bf16 is exact
  expect_weights_eq(w, load_ok(f16), DType::F16);
  // GPT-OSS's transposed path converts too.
  ModelWeights g = random_model("tiny-moe");
  const std::string g32 = dir.sub("gpt_oss_f32");
  write_checkpoint(g, g32, {.dtype = DType::F32});
  expect_weights_eq(g, load_ok(g32));
}

TEST(Loader, ShardedIndex) {
  TempDir dir;
  ModelWeights w = random_model("tiny-moe");
  write_checkpoint(w, dir.str(), {.shards = 3});
  ASSERT_TRUE(fs::exists(fs::path(dir.str()) / "model.safetensors.index.json"));
  expect_weights_eq(w, load_ok(dir.str()));
}

TEST(Loader, TiedEmbeddingsAndDenseMlp) {
  TempDir dir;
  ModelWeights w = random_model("tiny-llama");
  ASSERT_TRUE(w.config.tie_word_embeddings);
  write_checkpoint(w, dir.str());
  ModelWeights got = load_ok(dir.str());
  EXPECT_EQ(got.lm_head.data, got.embed.data);
  expect_weights_eq(w, got);
}

// A GPT-OSS checkpoint in `dir` whose experts are MXFP4 blocks/scales with known codes (every layer the same):
// byte i of gate_up's blocks holds codes (i % 16) low and ((i / 16) % 16) high, its scales cycle 124..128
// (128: the decode layout's largest exponent).
struct Mxfp4Checkpoint {
  ModelWeights base;  // the other weights, as written
  std::vector<OwnedTensor> store;
  Tensor gu_blocks, gu_scales, d_blocks, d_scales;
};
Mxfp4Checkpoint write_mxfp4_checkpoint(const std::string& dir, const ModelConfig& c) {
  Mxfp4Checkpoint m{.base = make_random_weights(c, 5).value()};
  const int64_t E = c.num_experts, H = c.hidden_size, I = c.moe_intermediate_size;
  auto u8 = [&](std::initializer_list<int64_t> dims, auto value) {
    OwnedTensor o = OwnedTensor::host(DType::U8, dims);
    for (int64_t i = 0; i < o.view.numel(); ++i) o.view.ptr<uint8_t>()[i] = uint8_t(value(i));
    m.store.push_back(o);
    return o.view;
  };
  m.gu_blocks = u8({E, 2 * I, H / 32, 16}, [](int64_t i) { return (i % 16) | (((i / 16) % 16) << 4); });
  m.gu_scales = u8({E, 2 * I, H / 32}, [](int64_t i) { return 124 + i % 5; });
  m.d_blocks = u8({E, H, I / 32, 16}, [](int64_t i) { return (i * 7) % 256; });
  m.d_scales = u8({E, H, I / 32}, [](int64_t i) { return 120 + i % 9; });
  WriteOptions options;
  options.edit = [](const std::string& name, Tensor*) {
    return !(name.ends_with("experts.gate_up_proj") || name.ends_with("experts.down_proj"));
  };
  CheckpointWriter writer(m.base, options);
  writer.write(dir);
  // Add the MXFP4 tensors as a second file (no index: every *.safetensors is read... except that
  // model.safetensors exists, so rename it first).
  fs::rename(fs::path(dir) / "model.safetensors", fs::path(dir) / "part-1.safetensors");
  std::vector<std::pair<std::string, Tensor>> mx;
  for (int layer = 0; layer < c.num_layers; ++layer) {
    const std::string p = "model.layers." + std::to_string(layer) + ".mlp.experts.";
    mx.emplace_back(p + "gate_up_proj_blocks", m.gu_blocks);
    mx.emplace_back(p + "gate_up_proj_scales", m.gu_scales);
    mx.emplace_back(p + "down_proj_blocks", m.d_blocks);
    mx.emplace_back(p + "down_proj_scales", m.d_scales);
  }
  EXPECT_TRUE(io::write_safetensors((fs::path(dir) / "part-2.safetensors").string(), mx).ok());
  return m;
}

// MXFP4 experts: blocks/scales with known codes load as their dequantized values, in canonical rows.
TEST(Loader, GptOssMxfp4Experts) {
  TempDir dir;
  ModelConfig c = preset_config("tiny-moe").value();  // H 64, I 32: both divisible by 32
  Mxfp4Checkpoint m = write_mxfp4_checkpoint(dir.str(), c);
  const ModelWeights& w = m.base;
  const Tensor &gu_blocks = m.gu_blocks, &gu_scales = m.gu_scales, &d_blocks = m.d_blocks, &d_scales = m.d_scales;
  ModelWeights got = load_ok(dir.str());
  const Tensor& gu = got.layers[0].gate_up;
  ASSERT_EQ(gu.shape_str(), "[8, 64, 64] BF16");
  // Element (e, row, col): group g = col / 32, byte = (col % 32) / 2, nibble = col % 2.
  auto expect_at = [&](const Tensor& t, const Tensor& blocks, const Tensor& scales, int64_t e, int64_t row, int64_t col) {
    const int64_t rows = t.shape[1], G = t.shape[2] / 32;
    const int64_t group = (e * rows + row) * G + col / 32;
    const uint8_t byte = blocks.ptr<uint8_t>()[group * 16 + (col % 32) / 2];
    const uint8_t code = col % 2 == 0 ? byte & 0xf : byte >> 4;
    const float want = kFp4Values[code] * std::ldexp(1.0f, int(scales.ptr<uint8_t>()[group]) - 127);
    EXPECT_EQ(bf16_to_f32(bf16{t.ptr<uint16_t>()[(e * rows + row) * t.shape[2] + col]}), want)
        << "e " << e << " row " << row << " col " << col;
  };
  for (int64_t e : {0L, 3L, 7L})
    for (int64_t row : {0L, 1L, 63L})
      for (int64_t col : {0L, 1L, 2L, 31L, 32L, 33L, 63L}) expect_at(gu, gu_blocks, gu_scales, e, row, col);
  const Tensor& down = got.layers[1].down;
  ASSERT_EQ(down.shape_str(), "[8, 64, 32] BF16");
  for (int64_t e : {0L, 7L})
    for (int64_t row : {0L, 17L, 63L})
      for (int64_t col : {0L, 1L, 30L, 31L}) expect_at(down, d_blocks, d_scales, e, row, col);
  // The non-expert weights are untouched.
  expect_tensor_eq(w.layers[0].q, got.layers[0].q, "q");
  expect_tensor_eq(w.layers[0].gate_up_bias, got.layers[0].gate_up_bias, "gate_up_bias");
  EXPECT_FALSE(got.layers[0].gate_up_mxfp4.defined());  // only with mxfp4_experts
}

// --mxfp4-experts: the checkpoint's blocks are also kept in the decode layout, which dequantizes to exactly
// the bf16 experts; checkpoints that cannot give it are refused with the reason.
TEST(Loader, GptOssMxfp4ExpertsKeptForDecode) {
  TempDir dir;
  ModelConfig c = preset_config("tiny-moe").value();
  c.moe_intermediate_size = 64;  // H 64, I 64: the layout's k-tiles
  write_mxfp4_checkpoint(dir.str(), c);
  auto got = load_model(dir.str(), true);
  ASSERT_TRUE(got.ok()) << got.status().message();
  for (const LayerWeights& l : got->layers) {
    ASSERT_EQ(l.gate_up_mxfp4.blocks.shape_str(), "[8, 1, 128, 32] U8");
    ASSERT_EQ(l.down_mxfp4.scales.shape_str(), "[8, 1, 64, 2] U8");
    for (const auto& [copy, bf16] : {std::pair{l.gate_up_mxfp4, l.gate_up}, std::pair{l.down_mxfp4, l.down}}) {
      auto values = dequantize_mxfp4_decode(copy.blocks, copy.scales, "copy");
      ASSERT_TRUE(values.ok()) << values.status().message();
      expect_tensor_eq(bf16, values->view, "the decode layout's values");
    }
  }
  // I 32: down's K is not a multiple of 64
  TempDir narrow;
  write_mxfp4_checkpoint(narrow.str(), preset_config("tiny-moe").value());
  auto refused = load_model(narrow.str(), true);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("--mxfp4-experts: tensor 'model.layers.0.mlp.experts.down_proj_blocks'"),
            std::string::npos) << refused.status().message();
  EXPECT_NE(refused.status().message().find("K = 32"), std::string::npos) << refused.status().message();
  // bf16 experts: nothing to keep
  TempDir plain;
  CheckpointWriter(make_random_weights(c, 5).value(), WriteOptions{}).write(plain.str());
  auto not_mxfp4 = load_model(plain.str(), true);
  ASSERT_FALSE(not_mxfp4.ok());
  EXPECT_NE(not_mxfp4.status().message().find("the checkpoint's experts are not MXFP4"), std::string::npos)
      << not_mxfp4.status().message();
}

// A device backend for load_model without a GPU: host memory under the cuda label, counting uploads.
class LabelledDevice final : public cpu::CpuBackend {
 public:
  LabelledDevice() : cpu::CpuBackend(1) {}
  Device device() const override { return Device::kCuda; }
  Buffer allocate(size_t bytes) override {
    ++uploads;
    return Buffer::host(bytes);
  }
  void copy(const Tensor& dst, const Tensor& src) override { std::memcpy(dst.data, src.data, dst.nbytes()); }
  int uploads = 0;
};

// Given a device backend, the loader uploads each converted expert tensor as it builds it (MXFP4
// dequantized and decode-layout copies, GPT-OSS's transposed experts, stacked per-expert experts) with the
// host load's bytes; everything else stays on the host for the Model to upload.
TEST(Loader, ConvertedExpertsGoToTheDeviceBackend) {
  ModelConfig c = preset_config("tiny-moe").value();
  c.moe_intermediate_size = 64;
  TempDir mxfp4, plain, per_expert;
  write_mxfp4_checkpoint(mxfp4.str(), c);
  CheckpointWriter(make_random_weights(c, 5).value(), WriteOptions{}).write(plain.str());
  write_checkpoint(random_model("tiny-qwen3-moe"), per_expert.str(), {.experts = ExpertFormat::kPerExpert});
  for (const auto& [dir, keep_mxfp4, per_layer] : {std::tuple{mxfp4.str(), true, 6}, std::tuple{plain.str(), false, 2},
                                                    std::tuple{per_expert.str(), false, 2}}) {
    SCOPED_TRACE(dir);
    const ModelWeights host = load_model(dir, keep_mxfp4).value();
    LabelledDevice device;
    const ModelWeights got = load_model(dir, keep_mxfp4, &device).value();
    ASSERT_EQ(got.layers.size(), host.layers.size());
    EXPECT_EQ(device.uploads, per_layer * int(host.layers.size()));
    for (size_t l = 0; l < host.layers.size(); ++l) {
      const LayerWeights &a = host.layers[l], &b = got.layers[l];
      std::vector<std::pair<Tensor, Tensor>> moved = {{a.gate_up, b.gate_up}, {a.down, b.down}};
      if (keep_mxfp4) {
        moved.insert(moved.end(), {{a.gate_up_mxfp4.blocks, b.gate_up_mxfp4.blocks},
                                   {a.gate_up_mxfp4.scales, b.gate_up_mxfp4.scales},
                                   {a.down_mxfp4.blocks, b.down_mxfp4.blocks},
                                   {a.down_mxfp4.scales, b.down_mxfp4.scales}});
      }
      for (const auto& [want, have] : moved) {
        EXPECT_EQ(have.device, Device::kCuda) << "layer " << l << " " << want.shape_str();
        ASSERT_EQ(have.nbytes(), want.nbytes());
        EXPECT_EQ(std::memcmp(have.data, want.data, want.nbytes()), 0) << "layer " << l << " " << want.shape_str();
      }
      EXPECT_EQ(b.q.device, Device::kCpu);
      EXPECT_EQ(b.router.device, Device::kCpu);
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Errors

TEST(LoaderErrors, MissingTensorNamesItAndTheShape) {
  TempDir dir;
  ModelWeights w = random_model("tiny-moe");
  write_checkpoint(w, dir.str(), {.edit = [](const std::string& name, Tensor*) {
                                    return name != "model.layers.1.self_attn.k_proj.weight";
                                  }});
  expect_load_error(dir.str(), {dir.str(), "'model.layers.1.self_attn.k_proj.weight'", "[32, 64]"});
}

TEST(LoaderErrors, WrongShapeNamesExpectedAndFound) {
  TempDir dir;
  ModelWeights w = random_model("tiny-moe");
  OwnedTensor wrong = OwnedTensor::host(DType::BF16, {4, 3});
  std::memset(wrong.view.data, 0, wrong.view.nbytes());
  write_checkpoint(w, dir.str(), {.edit = [&](const std::string& name, Tensor* t) {
                                    if (name == "model.layers.0.self_attn.sinks") *t = wrong.view;
                                    return true;
                                  }});
  expect_load_error(dir.str(), {"'model.layers.0.self_attn.sinks'", "expected shape [4]", "found [4, 3] BF16"});
}

TEST(LoaderErrors, GptOssUntransposedExpertsRejected) {
  // A canonical-orientation [E, 2I, H] tensor where GPT-OSS expects [E, H, 2I] (H != 2I here).
  TempDir dir;
  ModelConfig c = preset_config("tiny-moe").value();
  c.moe_intermediate_size = c.intermediate_size = 8;
  ModelWeights w = make_random_weights(c, 3).value();
  write_checkpoint(w, dir.str(), {.edit = [&](const std::string& name, Tensor* t) {
                                    if (name == "model.layers.0.mlp.experts.gate_up_proj") *t = w.layers[0].gate_up;
                                    return true;
                                  }});
  expect_load_error(dir.str(), {"'model.layers.0.mlp.experts.gate_up_proj'", "expected shape [8, 64, 16]",
                                "found [8, 16, 64] BF16"});
}

TEST(LoaderErrors, WrongDtype) {
  TempDir dir;
  ModelWeights w = random_model("tiny-llama");
  OwnedTensor ints = OwnedTensor::host(DType::I32, {64});
  std::memset(ints.view.data, 0, ints.view.nbytes());
  write_checkpoint(w, dir.str(), {.edit = [&](const std::string& name, Tensor* t) {
                                    if (name == "model.norm.weight") *t = ints.view;
                                    return true;
                                  }});
  expect_load_error(dir.str(), {"'model.norm.weight'", "F32, F16 or BF16", "I32"});
}

TEST(LoaderErrors, MissingExpertWeights) {
  TempDir dir;
  ModelWeights w = random_model("tiny-qwen3-moe");
  const std::string none = dir.sub("none"), one = dir.sub("one");
  write_checkpoint(w, none, {.experts = ExpertFormat::kPerExpert, .edit = [](const std::string& name, Tensor*) {
                               return name.find("model.layers.1.mlp.experts.") == std::string::npos;
                             }});
  expect_load_error(none, {"no expert weights under 'model.layers.1.mlp.experts.'", "gate_up_proj",
                           "model.layers.1.mlp.experts.0.gate_proj.weight"});
  write_checkpoint(w, one, {.experts = ExpertFormat::kPerExpert, .edit = [](const std::string& name, Tensor*) {
                              return name != "model.layers.0.mlp.experts.5.up_proj.weight";
                            }});
  expect_load_error(one, {"'model.layers.0.mlp.experts.5.up_proj.weight'", "[32, 64]"});
}

TEST(LoaderErrors, IndexListsTensorMissingFromShard) {
  TempDir dir;
  ModelWeights w = random_model("tiny-llama");
  write_checkpoint(w, dir.str(), {.shards = 2});
  std::string index;
  {
    std::ifstream in(fs::path(dir.str()) / "model.safetensors.index.json");
    index.assign(std::istreambuf_iterator<char>(in), {});
  }
  index.insert(index.rfind("}}"), R"(, "model.layers.0.extra.weight": "model-00002-of-00002.safetensors")");
  std::ofstream(fs::path(dir.str()) / "model.safetensors.index.json") << index;
  expect_load_error(dir.str(), {"'model.layers.0.extra.weight'", "model-00002-of-00002.safetensors", "missing"});
}

TEST(LoaderErrors, TruncatedShardAndUnsupportedArchitecture) {
  TempDir dir;
  ModelWeights w = random_model("tiny-llama");
  const std::string truncated = dir.sub("truncated"), arch = dir.sub("arch"), no_config = dir.sub("no_config");
  write_checkpoint(w, truncated);
  const fs::path file = fs::path(truncated) / "model.safetensors";
  fs::resize_file(file, fs::file_size(file) - 100);
  expect_load_error(truncated, {file.string(), "past the data section"});

  write_checkpoint(w, arch);
  std::string config = model_config_to_json(w.config);
  config.replace(config.find("LlamaForCausalLM"), 16, "GPT2LMHeadModel");
  std::ofstream(fs::path(arch) / "config.json") << config;
  expect_load_error(arch, {"config.json", "'GPT2LMHeadModel'", "not supported"});

  expect_load_error(no_config, {"config.json", "cannot open"});
}

}  // namespace
}  // namespace lmx::model
