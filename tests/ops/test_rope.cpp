// RoPE: make_rope_table against numbers produced by transformers' rope init functions, and the rope op
// against a rotation by complex multiplication computed in double.
#include <gtest/gtest.h>

#include <complex>
#include <cstdio>
#include <vector>

#include "backends/cpu/cpu_backend.h"
#include "op_test_util.h"
#include "ops/rope.h"

namespace lmx {
namespace {

using ops::RopeScaling;

struct HfRopeCase {
  const char* name;
  RopeScaling scaling;
  int head_dim;
  double attention_scaling;
  std::vector<float> inv_freq;
};

// Produced with transformers 5.24.0 (/opt/tv/bin/python), printing "%.9g" of every inv_freq entry:
//   from transformers import LlamaConfig
//   from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
//   from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding
//   c = LlamaConfig(hidden_size=4*D, num_attention_heads=4, head_dim=D, max_position_embeddings=131072,
//                   rope_parameters=ROPE)
//   inv, att = ROPE_INIT_FUNCTIONS[ROPE["rope_type"]](c)        # "default": GptOssRotaryEmbedding
//                                                               #   .compute_default_rope_parameters(c)
// with ROPE as in each case's comment.
std::vector<HfRopeCase> hf_cases() {
  std::vector<HfRopeCase> cases;
  // {"rope_type": "default", "rope_theta": 10000.0}, D = 64
  cases.push_back({"default_theta1e4_d64", {.type = RopeScaling::Type::kDefault, .theta = 10000.0}, 64, 1.0,
                   {1, 0.749894202, 0.562341332, 0.421696514, 0.316227764, 0.237137362, 0.177827939, 0.133352146,
                    0.100000001, 0.0749894157, 0.0562341288, 0.0421696492, 0.0316227786, 0.0237137359, 0.0177827943,
                    0.0133352149, 0.00999999978, 0.00749894232, 0.00562341325, 0.00421696482, 0.00316227786,
                    0.00237137382, 0.00177827943, 0.00133352145, 0.00100000005, 0.000749894185, 0.000562341302,
                    0.000421696488, 0.000316227786, 0.000237137385, 0.00017782794, 0.00013335215}});
  // {"rope_type": "default", "rope_theta": 1000000.0}, D = 80 (2i/D not a power of two)
  cases.push_back({"default_theta1e6_d80", {.type = RopeScaling::Type::kDefault, .theta = 1000000.0}, 80, 1.0,
                   {1, 0.707945764, 0.501187205, 0.354813397, 0.251188636, 0.177827939, 0.125892535, 0.0891250968,
                    0.0630957335, 0.0446683653, 0.0316227786, 0.0223872103, 0.0158489291, 0.0112201869,
                    0.00794328284, 0.00562341325, 0.00398107152, 0.00281838258, 0.00199526269, 0.00141253765,
                    0.00100000005, 0.000707946019, 0.000501187111, 0.000354813441, 0.000251188554, 0.00017782794,
                    0.000125892577, 8.91250747e-05, 6.30957438e-05, 4.46683443e-05, 3.16227743e-05,
                    2.23872194e-05, 1.58489293e-05, 1.12201869e-05, 7.94327934e-06, 5.62341347e-06,
                    3.98107295e-06, 2.81838265e-06, 1.99526266e-06, 1.41253713e-06}});
  // GPT-OSS: {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
  //           "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
  cases.push_back({"yarn_gpt_oss_d64",
                   {.type = RopeScaling::Type::kYarn, .theta = 150000.0, .factor = 32.0, .original_max_position = 4096,
                    .beta_fast = 32.0, .beta_slow = 1.0, .truncate = false},
                   64, 1.3465735902799727,
                   {1, 0.689044297, 0.47478205, 0.327145875, 0.225418001, 0.155322984, 0.107024424, 0.0737445652,
                    0.0508132726, 0.0317056961, 0.0193349998, 0.0115920492, 0.00679495931, 0.00386035908,
                    0.00209379266, 0.00105260219, 0.000456483918, 0.000129318694, 3.83088118e-05, 2.63964685e-05,
                    1.8188337e-05, 1.25325696e-05, 8.63549576e-06, 5.95023948e-06, 4.09997847e-06, 2.82506676e-06,
                    1.94659629e-06, 1.34129095e-06, 9.24208962e-07, 6.36820914e-07, 4.38797855e-07,
                    3.0235114e-07}});
  // {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 32768}
  // (truncate defaults to True; beta_fast/slow to 32/1)
  cases.push_back({"yarn_truncated_d128",
                   {.type = RopeScaling::Type::kYarn, .theta = 1000000.0, .factor = 4.0, .original_max_position = 32768},
                   128, 1.138629436111989,
                   {1, 0.805842221, 0.649381638, 0.523299158, 0.421696514, 0.339820832, 0.273841977, 0.220673397,
                    0.177827939, 0.143301263, 0.115478203, 0.0930572003, 0.0749894157, 0.0604296438, 0.0486967526,
                    0.0392418988, 0.0316227786, 0.0254829675, 0.0205352511, 0.0165481716, 0.0133352149,
                    0.0107460786, 0.00865964312, 0.00697830599, 0.00537532149, 0.0041317381, 0.00316842273,
                    0.00242342241, 0.00184827659, 0.00140511245, 0.00106436096, 0.000802959781, 0.000602941145,
                    0.000450323569, 0.000334240554, 0.000246258394, 0.000179841154, 0.00012993149, 9.26230132e-05,
                    6.4903943e-05, 4.44569851e-05, 3.58253164e-05, 2.88695483e-05, 2.32643015e-05, 1.87473561e-05,
                    1.51074091e-05, 1.21741887e-05, 9.81047469e-06, 7.90569356e-06, 6.37074163e-06, 5.13381246e-06,
                    4.13704265e-06, 3.33380353e-06, 2.68651957e-06, 2.16491094e-06, 1.74457659e-06, 1.40585337e-06,
                    1.13289593e-06, 9.1293532e-07, 7.35681795e-07, 5.92843435e-07, 4.7773824e-07, 3.84981632e-07,
                    3.10234441e-07}});
  // {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 2048,
  //  "attention_factor": 1.25, "beta_fast": 16.0, "beta_slow": 2.0}, D = 96
  cases.push_back({"yarn_explicit_attention_factor_d96",
                   {.type = RopeScaling::Type::kYarn, .theta = 10000.0, .factor = 8.0, .original_max_position = 2048,
                    .beta_fast = 16.0, .beta_slow = 2.0, .attention_factor = 1.25},
                   96, 1.25,
                   {1, 0.825404167, 0.681292057, 0.562341332, 0.464158893, 0.383118689, 0.316227764, 0.261015713,
                    0.215443447, 0.177827939, 0.146779925, 0.121152751, 0.100000001, 0.0825404152, 0.0681292117,
                    0.0562341288, 0.0430313908, 0.0327247269, 0.0247052945, 0.0184886102, 0.01368964, 0.0100028217,
                    0.00718610082, 0.00504803192, 0.00343749998, 0.00223547034, 0.00134839024, 0.000702926656,
                    0.000580198714, 0.000478898262, 0.000395284733, 0.000326269714, 0.000269304292, 0.000222284929,
                    0.000183474942, 0.000151440923, 0.000125000006, 0.000103175538, 8.51614896e-05, 7.02926627e-05,
                    5.80198684e-05, 4.78898255e-05, 3.95284733e-05, 3.26269728e-05, 2.69304273e-05, 2.22284925e-05,
                    1.83474949e-05, 1.51440936e-05}});
  // {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
  //  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, D = 128
  cases.push_back({"llama3_d128",
                   {.type = RopeScaling::Type::kLlama3, .theta = 500000.0, .factor = 8.0, .original_max_position = 8192,
                    .low_freq_factor = 1.0, .high_freq_factor = 4.0},
                   128, 1.0,
                   {1, 0.814617217, 0.663601279, 0.540580988, 0.440366626, 0.358730227, 0.292227834, 0.238053814,
                    0.193922758, 0.157972813, 0.128687382, 0.10483095, 0.0853971019, 0.0695659518, 0.0566696189,
                    0.0461640507, 0.0376060307, 0.0306345206, 0.0249554086, 0.0203291047, 0.0165604409,
                    0.0134904198, 0.0109895291, 0.00895225909, 0.00729266508, 0.00594073068, 0.00483942125,
                    0.00394227589, 0.00321144611, 0.00216657063, 0.00137189368, 0.00085675146, 0.000524846022,
                    0.00031269365, 0.000178507791, 9.55621217e-05, 7.78465546e-05, 6.34151438e-05, 5.16590699e-05,
                    4.20823671e-05, 3.42810235e-05, 2.79259093e-05, 2.2748929e-05, 1.85316694e-05, 1.50962178e-05,
                    1.22976389e-05, 1.00178686e-05, 8.1607277e-06, 6.64786967e-06, 5.41546933e-06, 4.41153452e-06,
                    3.59371188e-06, 2.92749974e-06, 2.38479174e-06, 1.94269251e-06, 1.58255079e-06, 1.28917316e-06,
                    1.05018262e-06, 8.55496921e-07, 6.96902532e-07, 5.6770881e-07, 4.6246538e-07, 3.7673226e-07,
                    3.06892588e-07}});
  return cases;
}

// transformers computes the table in fp32 (pow, division, the YaRN blend); we compute in double and
// round once, so entries agree to a few fp32 ulps (docs/NUMERICS.md, "RoPE inv_freq vs transformers").
constexpr double kTolRopeTable = 1e-6;

TEST(RopeTable, MatchesTransformers) {
  for (const HfRopeCase& c : hf_cases()) {
    SCOPED_TRACE(c.name);
    const ops::RopeTable table = ops::make_rope_table(c.scaling, c.head_dim);
    ASSERT_EQ(table.inv_freq.size(), c.inv_freq.size());
    EXPECT_FLOAT_EQ(table.attention_scaling, float(c.attention_scaling));
    double worst = 0.0;
    for (size_t i = 0; i < c.inv_freq.size(); ++i) {
      const double rel = std::abs(double(table.inv_freq[i]) - c.inv_freq[i]) / c.inv_freq[i];
      worst = std::max(worst, rel);
      EXPECT_LE(rel, kTolRopeTable) << "inv_freq[" << i << "] = " << table.inv_freq[i] << ", transformers "
                                    << c.inv_freq[i];
    }
    char worst_text[32];
    std::snprintf(worst_text, sizeof worst_text, "%.3g", worst);
    RecordProperty(c.name, worst_text);  // worst relative difference, for the record
  }
}

TEST(RopeTable, YarnFactorOneKeepsFrequenciesAndScaling) {
  const ops::RopeTable plain = ops::make_rope_table({.theta = 10000.0}, 32);
  const ops::RopeTable yarn = ops::make_rope_table(
      {.type = RopeScaling::Type::kYarn, .theta = 10000.0, .factor = 1.0, .original_max_position = 4096}, 32);
  EXPECT_EQ(yarn.attention_scaling, 1.0f);
  for (size_t i = 0; i < plain.inv_freq.size(); ++i) EXPECT_FLOAT_EQ(yarn.inv_freq[i], plain.inv_freq[i]);
}

// q, k rotated in place vs (x1 + i·x2)·e^{i·angle}·scaling in double, with the angle the fp32 product
// position·inv_freq the op's contract prescribes.
void check_rope(uint64_t seed, int64_t tokens, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                const RopeScaling& scaling, int32_t max_position) {
  SCOPED_TRACE("T=" + std::to_string(tokens) + " Hq=" + std::to_string(q_heads) + " Hkv=" + std::to_string(kv_heads) +
               " D=" + std::to_string(head_dim));
  Rng rng(seed);
  cpu::CpuBackend backend(2);
  const ops::RopeTable table = ops::make_rope_table(scaling, int(head_dim));
  OwnedTensor q = test::random_f32(rng, {tokens, q_heads, head_dim});
  OwnedTensor k = test::random_f32(rng, {tokens, kv_heads, head_dim});
  std::vector<int32_t> positions(tokens);
  for (auto& p : positions) p = int32_t(rng.next_u64() % uint64_t(max_position + 1));
  positions[0] = 0;  // position 0 must be the identity (times the scaling)
  OwnedTensor pos = test::i32_tensor(positions);
  OwnedTensor inv_freq = test::f32_tensor(table.inv_freq);

  auto reference = [&](const Tensor& x) {
    std::vector<double> want(x.numel());
    const int64_t heads = x.dim(1), half = head_dim / 2;
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        const float* head = x.ptr<float>() + (t * heads + h) * head_dim;
        double* out = want.data() + (t * heads + h) * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const double angle = double(float(positions[t]) * table.inv_freq[i]);
          const std::complex<double> z =
              std::complex<double>(head[i], head[i + half]) * std::polar(double(table.attention_scaling), angle);
          out[i] = z.real();
          out[i + half] = z.imag();
        }
      }
    }
    return want;
  };
  const std::vector<double> want_q = reference(q), want_k = reference(k);
  backend.rope({.q = q, .k = k, .positions = pos, .inv_freq = inv_freq,
                .attention_scaling = table.attention_scaling});
  EXPECT_TRUE(test::all_close(q, want_q, test::kTolElementwise));
  EXPECT_TRUE(test::all_close(k, want_k, test::kTolElementwise));
}

TEST(RopeOp, MatchesComplexRotation) {
  const RopeScaling plain{.theta = 10000.0};
  const RopeScaling gpt_oss{.type = RopeScaling::Type::kYarn, .theta = 150000.0, .factor = 32.0,
                            .original_max_position = 4096, .truncate = false};
  const RopeScaling llama3{.type = RopeScaling::Type::kLlama3, .theta = 500000.0, .factor = 8.0,
                           .original_max_position = 8192};
  check_rope(1, 1, 1, 1, 2, plain, 10);             // T = 1, the smallest head
  check_rope(2, 7, 4, 2, 16, plain, 100);
  check_rope(3, 33, 8, 1, 64, gpt_oss, 131071);     // YaRN scaling != 1, long positions
  check_rope(4, 5, 2, 2, 128, llama3, 100000);
  check_rope(5, 64, 6, 3, 10, plain, 4096);         // D/2 odd
}

}  // namespace
}  // namespace lmx
