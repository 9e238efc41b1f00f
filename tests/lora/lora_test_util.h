// Helpers for the lora tests: temporary adapter directories written with io::write_safetensors, base
// model shapes for each family, and PEFT's delta-weight definitions re-stated independently of the loader
// (peft/tuners/lora/layer.py: Linear.get_delta_weight, ParamWrapper.get_delta_weight).
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "../common/temp_dir.h"
#include "core/rng.h"
#include "io/safetensors.h"
#include "lora/adapter.h"

namespace lmx::lora::testing {

using ops::LoraTarget;


// A host matrix/tensor as written to the file, values already rounded to the stored dtype.
struct Stored {
  std::vector<int64_t> shape;
  std::vector<float> values;
  float at2(int64_t r, int64_t c) const { return values[size_t(r * shape[1] + c)]; }
};

inline float round_to(DType dtype, float v) {
  if (dtype == DType::BF16) return round_bf16(v);
  if (dtype == DType::F16) return f16_to_f32(f32_to_f16(v));
  return v;
}

// Builds an adapter directory: adapter_config.json from `config`, adapter_model.safetensors from tensors.
class AdapterDir {
 public:
  explicit AdapterDir(const std::string& tag) : temp_(tag), dir_(temp_.str()) {
    config_ = {{"peft_type", "LORA"}, {"r", 2}, {"lora_alpha", 4}, {"bias", "none"}, {"use_dora", false},
               {"target_modules", nlohmann::json::array({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                         "up_proj", "down_proj", "w1", "w2", "w3"})},
               {"peft_version", "0.21.2"}};
  }
  nlohmann::json& config() { return config_; }
  const std::string& dir() const { return dir_; }

  // Random values in [-1, 1) rounded to `dtype`; returned for the test's own reference computation.
  Stored add(const std::string& name, std::vector<int64_t> shape, uint64_t seed, DType dtype = DType::F32) {
    Rng rng(seed);
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = round_to(dtype, rng.uniform(-1.0f, 1.0f));
    return add_values(name, std::move(shape), std::move(v), dtype);
  }
  Stored add_values(const std::string& name, std::vector<int64_t> shape, std::vector<float> values,
                    DType dtype = DType::F32) {
    Entry e{name, dtype, shape, values, {}};
    entries_.push_back(std::move(e));
    return Stored{std::move(shape), std::move(values)};
  }
  // A standard PEFT module pair "base_model.model.<module>.lora_{A,B}.weight".
  std::pair<Stored, Stored> add_pair(const std::string& module, int64_t r, int64_t in, int64_t out, uint64_t seed,
                                     DType dtype = DType::F32) {
    Stored a = add("base_model.model." + module + ".lora_A.weight", {r, in}, seed, dtype);
    Stored b = add("base_model.model." + module + ".lora_B.weight", {out, r}, seed + 7777, dtype);
    return {a, b};
  }

  std::string write(const std::map<std::string, std::string>& metadata = {{"format", "pt"}}) {
    std::ofstream(dir_ + "/adapter_config.json") << config_.dump(2);
    std::vector<std::pair<std::string, Tensor>> views;
    for (Entry& e : entries_) {
      size_t n = e.values.size();
      e.bytes.assign(n * dtype_size(e.dtype), 0);
      for (size_t i = 0; i < n; ++i) {
        if (e.dtype == DType::F32) {
          std::memcpy(&e.bytes[4 * i], &e.values[i], 4);
        } else if (e.dtype == DType::BF16) {
          bf16 h = f32_to_bf16(e.values[i]);
          std::memcpy(&e.bytes[2 * i], &h.bits, 2);
        } else if (e.dtype == DType::F16) {
          uint16_t h = f32_to_f16(e.values[i]);
          std::memcpy(&e.bytes[2 * i], &h, 2);
        } else if (e.dtype == DType::I32) {
          int32_t v = int32_t(e.values[i]);
          std::memcpy(&e.bytes[4 * i], &v, 4);
        }
      }
      views.emplace_back(e.name, Tensor::with_shape(e.bytes.data(), e.dtype, e.shape.data(), int(e.shape.size())));
    }
    Status s = io::write_safetensors(dir_ + "/adapter_model.safetensors", views, metadata);
    EXPECT_TRUE(s.ok()) << s.message();
    return dir_;
  }

 private:
  struct Entry {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    std::vector<float> values;
    std::vector<uint8_t> bytes;
  };
  lmx::testing::TempDir temp_;  // declared before dir_: dir_ is initialised from it
  std::string dir_;
  nlohmann::json config_;
  std::vector<Entry> entries_;
};

// ---- base model shapes (tiny, every dim distinct where possible so transposes show) ----

inline void set_target(BaseModelShapes& s, LoraTarget t, int in, int out) {
  s.in_features[size_t(t)] = in;
  s.out_features[size_t(t)] = out;
}

inline BaseModelShapes moe_shapes(const std::string& family, int layers, int E, int H, int I) {
  BaseModelShapes s;
  s.family = family;
  s.num_layers = layers;
  s.num_experts = E;
  s.hidden_size = H;
  s.moe_intermediate_size = I;
  s.gate_up_interleaved = family == "gpt_oss";
  set_target(s, LoraTarget::kQ, H, 2 * H);  // q_dim = 2H, kv_dim = H/2 (GQA-like, all distinct)
  set_target(s, LoraTarget::kK, H, H / 2);
  set_target(s, LoraTarget::kV, H, H / 2);
  set_target(s, LoraTarget::kO, 2 * H, H);
  set_target(s, LoraTarget::kMoeGateUp, H, 2 * I);
  set_target(s, LoraTarget::kMoeDown, I, H);
  return s;
}

inline BaseModelShapes dense_shapes(const std::string& family, int layers, int H, int I) {
  BaseModelShapes s;
  s.family = family;
  s.num_layers = layers;
  s.hidden_size = H;
  set_target(s, LoraTarget::kQ, H, 2 * H);
  set_target(s, LoraTarget::kK, H, H / 2);
  set_target(s, LoraTarget::kV, H, H / 2);
  set_target(s, LoraTarget::kO, 2 * H, H);
  set_target(s, LoraTarget::kGate, H, I);
  set_target(s, LoraTarget::kUp, H, I);
  set_target(s, LoraTarget::kDown, I, H);
  return s;
}

// ---- deltas ----

// A dense delta [out, in] or expert deltas [E][out, in], flattened.
struct Delta {
  int64_t experts = 1, out = 0, in = 0;
  std::vector<double> values;
  double& at(int64_t e, int64_t o, int64_t i) { return values[size_t((e * out + o) * in + i)]; }
  double at(int64_t e, int64_t o, int64_t i) const { return values[size_t((e * out + o) * in + i)]; }
};

inline Delta zero_delta(int64_t E, int64_t out, int64_t in) {
  Delta d{E, out, in, {}};
  d.values.assign(size_t(E * out * in), 0.0);
  return d;
}

// b·a of a loaded canonical pair.
inline Delta delta_of(const LoraPair& p) {
  const Tensor& a = p.a.view;
  const Tensor& b = p.b.view;
  const bool expert = a.ndim == 3;
  const int64_t E = expert ? a.shape[0] : 1;
  const int64_t R = a.shape[expert ? 1 : 0], in = a.shape[expert ? 2 : 1], out = b.shape[expert ? 1 : 0];
  EXPECT_EQ(b.shape[expert ? 2 : 1], R);
  Delta d = zero_delta(E, out, in);
  const float* av = a.ptr<float>();
  const float* bv = b.ptr<float>();
  for (int64_t e = 0; e < E; ++e)
    for (int64_t o = 0; o < out; ++o)
      for (int64_t i = 0; i < in; ++i) {
        double s = 0;
        for (int64_t k = 0; k < R; ++k) s += double(bv[(e * out + o) * R + k]) * av[(e * R + k) * in + i];
        d.at(e, o, i) = s;
      }
  return d;
}

// PEFT Linear: delta = scaling · B·A, [out, in].
inline Delta linear_delta(const Stored& a, const Stored& b, double scaling) {
  const int64_t r = a.shape[0], in = a.shape[1], out = b.shape[0];
  Delta d = zero_delta(1, out, in);
  for (int64_t o = 0; o < out; ++o)
    for (int64_t i = 0; i < in; ++i) {
      double s = 0;
      for (int64_t k = 0; k < r; ++k) s += double(b.at2(o, k)) * a.at2(k, i);
      d.at(0, o, i) = s * scaling;
    }
  return d;
}

// PEFT ParamWrapper.get_delta_weight for a 3D parameter [E, d1, d2], in the parameter's own layout:
//   lora_A.reshape(E, r, x), lora_B.reshape(y, r, E);
//   not swapped: einsum("o r e, e r i -> e i o") (x = d1, y = d2)
//   swapped:     einsum("o r e, e r i -> e o i") (x = d2, y = d1)
// Returned as Delta{E, out=d1, in=d2} (i.e. [E, d1, d2]).
inline Delta peft_param_delta(const Stored& A, const Stored& B, int64_t E, bool swapped, double scaling) {
  const int64_t rE = A.shape[0], r = rE / E, x = A.shape[1], y = B.shape[0];
  const int64_t d1 = swapped ? y : x, d2 = swapped ? x : y;
  Delta d = zero_delta(E, d1, d2);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t p = 0; p < y; ++p)      // "o" of the einsum: rows of lora_B
      for (int64_t q = 0; q < x; ++q) {  // "i" of the einsum: columns of lora_A
        double s = 0;
        for (int64_t k = 0; k < r; ++k) s += double(B.at2(p, k * E + e)) * A.at2(e * r + k, q);
        if (swapped) d.at(e, p, q) = s * scaling;  // e o i
        else d.at(e, q, p) = s * scaling;          // e i o
      }
  return d;
}

inline Delta transpose_experts(const Delta& d) {
  Delta t = zero_delta(d.experts, d.in, d.out);
  for (int64_t e = 0; e < d.experts; ++e)
    for (int64_t o = 0; o < d.out; ++o)
      for (int64_t i = 0; i < d.in; ++i) t.at(e, i, o) = d.at(e, o, i);
  return t;
}

inline void expect_delta_near(const Delta& got, const Delta& want, double tol, const std::string& what) {
  ASSERT_EQ(got.experts, want.experts) << what;
  ASSERT_EQ(got.out, want.out) << what;
  ASSERT_EQ(got.in, want.in) << what;
  double worst = 0;
  size_t worst_i = 0;
  double scale = 0;
  for (double v : want.values) scale = std::max(scale, std::fabs(v));
  for (size_t i = 0; i < got.values.size(); ++i) {
    double err = std::fabs(got.values[i] - want.values[i]);
    if (err > worst) worst = err, worst_i = i;
  }
  EXPECT_GT(scale, 0.0) << what << ": reference delta is all zero (test would prove nothing)";
  EXPECT_LE(worst, tol * std::max(1.0, scale)) << what << ": worst error at flat index " << worst_i << " got "
                                              << got.values[worst_i] << " want " << want.values[worst_i];
}

inline Result<Adapter> load(const std::string& dir, const BaseModelShapes& base, int max_rank = 64) {
  return load_adapter(dir, "test", base, AdapterLimits{.max_rank = max_rank});
}

// Loads and expects failure; returns the message.
inline std::string load_error(const std::string& dir, const BaseModelShapes& base, int max_rank = 64) {
  Result<Adapter> r = load(dir, base, max_rank);
  EXPECT_FALSE(r.ok()) << "expected the load of " << dir << " to fail";
  return r.ok() ? std::string() : r.status().message();
}

}  // namespace lmx::lora::testing
