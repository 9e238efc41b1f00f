// make_rope_table: the inverse-frequency table and cos/sin scaling for each RoPE scaling rule, written to
// match transformers' rope init functions (modeling_rope_utils.py: default, _compute_yarn_parameters,
// _compute_llama3_parameters). Computed in double, stored as float. Called once per model at load.
#include "ops/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace lmx::ops {
namespace {

// theta^(-2i/D) for i in [0, D/2): the unscaled frequencies every rule starts from.
std::vector<double> default_inv_freq(double theta, int head_dim) {
  std::vector<double> inv_freq(head_dim / 2);
  for (int i = 0; i < head_dim / 2; ++i) inv_freq[i] = 1.0 / std::pow(theta, double(2 * i) / head_dim);
  return inv_freq;
}

// YaRN: blend interpolated (divided by factor) and extrapolated (unchanged) frequencies with a linear ramp
// over the dims whose number of rotations within original_max_position lies between beta_fast and
// beta_slow; cos/sin are scaled by the attention factor.
RopeTable yarn_table(const RopeScaling& s, int head_dim) {
  const double dim = head_dim;
  const double base = s.theta;
  // transformers reads `beta_fast or 32` / `beta_slow or 1`: an explicit 0 means the default.
  const double beta_fast = s.beta_fast != 0.0 ? s.beta_fast : 32.0;
  const double beta_slow = s.beta_slow != 0.0 ? s.beta_slow : 1.0;
  // The dim whose wavelength completes `rotations` turns within the original context.
  auto correction_dim = [&](double rotations) {
    return dim * std::log(s.original_max_position / (rotations * 2.0 * std::numbers::pi)) / (2.0 * std::log(base));
  };
  double low = correction_dim(beta_fast);
  double high = correction_dim(beta_slow);
  if (s.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, dim - 1.0);
  if (low == high) high += 0.001;  // transformers' guard against a zero-width ramp

  const std::vector<double> pos_inv_freq = default_inv_freq(base, head_dim);
  RopeTable table;
  table.inv_freq.resize(head_dim / 2);
  for (int i = 0; i < head_dim / 2; ++i) {
    const double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);
    const double extrapolation_weight = 1.0 - ramp;
    const double extrapolated = pos_inv_freq[i];
    const double interpolated = pos_inv_freq[i] / s.factor;
    table.inv_freq[i] = float(interpolated * (1.0 - extrapolation_weight) + extrapolated * extrapolation_weight);
  }
  double attention_factor = s.attention_factor;
  if (attention_factor == 0.0) attention_factor = s.factor <= 1.0 ? 1.0 : 0.1 * std::log(s.factor) + 1.0;
  table.attention_scaling = float(attention_factor);
  return table;
}

// Llama-3: long wavelengths (> original/low_freq_factor) divided by factor, short ones (< original /
// high_freq_factor) kept, a smooth blend between.
RopeTable llama3_table(const RopeScaling& s, int head_dim) {
  const double old_context = s.original_max_position;
  const double low_freq_wavelen = old_context / s.low_freq_factor;
  const double high_freq_wavelen = old_context / s.high_freq_factor;
  const std::vector<double> base_inv_freq = default_inv_freq(s.theta, head_dim);
  RopeTable table;
  table.inv_freq.resize(head_dim / 2);
  for (int i = 0; i < head_dim / 2; ++i) {
    const double inv_freq = base_inv_freq[i];
    const double wavelen = 2.0 * std::numbers::pi / inv_freq;
    // Same case order as transformers, so that even odd configs (high < low factor) agree.
    const double long_scaled = wavelen > low_freq_wavelen ? inv_freq / s.factor : inv_freq;
    const bool medium = !(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen);
    double scaled = long_scaled;
    if (medium) {
      const double smooth = (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
      scaled = (1.0 - smooth) * long_scaled / s.factor + smooth * long_scaled;
    }
    table.inv_freq[i] = float(scaled);
  }
  table.attention_scaling = 1.0f;
  return table;
}

}  // namespace

RopeTable make_rope_table(const RopeScaling& scaling, int head_dim) {
  LMX_CHECK(head_dim > 0 && head_dim % 2 == 0);
  switch (scaling.type) {
    case RopeScaling::Type::kYarn:
      LMX_CHECK(scaling.original_max_position > 0 && scaling.factor > 0.0);
      return yarn_table(scaling, head_dim);
    case RopeScaling::Type::kLlama3:
      LMX_CHECK(scaling.original_max_position > 0 && scaling.factor > 0.0 &&
                scaling.high_freq_factor != scaling.low_freq_factor);
      return llama3_table(scaling, head_dim);
    case RopeScaling::Type::kDefault: break;
  }
  RopeTable table;
  for (double f : default_inv_freq(scaling.theta, head_dim)) table.inv_freq.push_back(float(f));
  return table;
}

RopeParams without_qk_norm(const RopeParams& p) {
  RopeParams r = p;
  r.q_norm = Tensor{};
  r.k_norm = Tensor{};
  return r;
}

}  // namespace lmx::ops
