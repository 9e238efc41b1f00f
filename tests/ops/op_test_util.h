// Helpers shared by the op tests (tests/ops/*.cpp): random host tensors from core/rng.h, NaN poisoning of
// outputs, and the comparisons against double-precision references with the tolerances of
// docs/NUMERICS.md. Test-only; nothing here is linked into loramux.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "core/rng.h"
#include "core/tensor.h"

namespace lmx::test {

// Tolerances (docs/NUMERICS.md, "CPU reference ops vs double-precision formulas"). An element passes when
// |got - want| <= tol * (|want| + rms(want)): relative for large values, and relative to the tensor's
// scale where cancellation makes a value small.
constexpr double kTolElementwise = 1e-6;  // a few fp32 roundings per element (exp, division, rotation)
constexpr double kTolReduction = 1e-5;    // fp32 sums of up to ~1000 products, chained (linear, LoRA, MoE, ...)

inline OwnedTensor random_f32(Rng& rng, std::initializer_list<int64_t> dims, float scale = 1.0f) {
  OwnedTensor t = OwnedTensor::host(DType::F32, dims);
  for (int64_t i = 0; i < t.view.numel(); ++i) t.view.ptr<float>()[i] = scale * rng.normal();
  return t;
}

inline OwnedTensor random_bf16(Rng& rng, std::initializer_list<int64_t> dims, float scale = 1.0f) {
  OwnedTensor t = OwnedTensor::host(DType::BF16, dims);
  for (int64_t i = 0; i < t.view.numel(); ++i) t.view.ptr<bf16>()[i] = f32_to_bf16(scale * rng.normal());
  return t;
}

inline OwnedTensor i32_tensor(const std::vector<int32_t>& values, std::initializer_list<int64_t> dims) {
  OwnedTensor t = OwnedTensor::host(DType::I32, dims);
  EXPECT_EQ(int64_t(values.size()), t.view.numel());
  if (!values.empty()) std::memcpy(t.view.data, values.data(), values.size() * sizeof(int32_t));
  return t;
}
inline OwnedTensor i32_tensor(const std::vector<int32_t>& values) {
  return i32_tensor(values, {int64_t(values.size())});
}

inline OwnedTensor f32_tensor(const std::vector<float>& values, std::initializer_list<int64_t> dims) {
  OwnedTensor t = OwnedTensor::host(DType::F32, dims);
  EXPECT_EQ(int64_t(values.size()), t.view.numel());
  if (!values.empty()) std::memcpy(t.view.data, values.data(), values.size() * sizeof(float));
  return t;
}
inline OwnedTensor f32_tensor(const std::vector<float>& values) { return f32_tensor(values, {int64_t(values.size())}); }

// Fill an output with values no correct op leaves behind: NaN for floats, INT32_MIN for ids.
inline void poison(const Tensor& t) {
  for (int64_t i = 0; i < t.numel(); ++i) {
    switch (t.dtype) {
      case DType::F32: t.ptr<float>()[i] = std::numeric_limits<float>::quiet_NaN(); break;
      case DType::BF16: t.ptr<bf16>()[i] = bf16{0x7fc0}; break;
      case DType::I32: t.ptr<int32_t>()[i] = std::numeric_limits<int32_t>::min(); break;
      default: FAIL() << "poison: unsupported dtype";
    }
  }
}

// Element i of an F32 or BF16 tensor, widened.
inline double value_at(const Tensor& t, int64_t i) {
  return t.dtype == DType::BF16 ? double(bf16_to_f32(t.ptr<bf16>()[i])) : double(t.ptr<float>()[i]);
}

inline std::vector<double> to_doubles(const Tensor& t) {
  std::vector<double> v(size_t(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) v[i] = value_at(t, i);
  return v;
}

// got (F32) against a double reference: |got - want| <= tol * (|want| + rms(want)) everywhere.
inline ::testing::AssertionResult all_close(const Tensor& got, const std::vector<double>& want, double tol) {
  if (got.numel() != int64_t(want.size())) {
    return ::testing::AssertionFailure() << "size " << got.numel() << " vs reference " << want.size();
  }
  double sum_squares = 0.0;
  for (double w : want) sum_squares += w * w;
  const double rms = want.empty() ? 0.0 : std::sqrt(sum_squares / double(want.size()));
  int64_t failures = 0;
  double worst = 0.0;
  std::ostringstream first;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double g = value_at(got, i);
    const double err = std::abs(g - want[i]);
    const double bound = tol * (std::abs(want[i]) + rms);
    worst = std::max(worst, err / (std::abs(want[i]) + rms + 1e-300));
    if (!(err <= bound)) {  // also catches NaN
      if (failures++ < 5) first << "\n  [" << i << "] got " << g << ", want " << want[i] << " (err " << err << ")";
    }
  }
  // LMX_REPORT_ERRORS=1 prints the worst scaled error of every comparison (to review the tolerances).
  if (std::getenv("LMX_REPORT_ERRORS")) std::printf("  worst scaled error %.3g (tol %.1g)\n", worst, tol);
  if (failures == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << failures << " of " << got.numel() << " elements beyond tol " << tol
                                       << " (worst scaled error " << worst << "):" << first.str();
}

inline ::testing::AssertionResult bitwise_equal(const Tensor& a, const Tensor& b) {
  if (a.nbytes() != b.nbytes()) return ::testing::AssertionFailure() << "sizes differ";
  if (std::memcmp(a.data, b.data, a.nbytes()) == 0) return ::testing::AssertionSuccess();
  for (size_t i = 0; i < a.nbytes(); ++i) {
    if (static_cast<const char*>(a.data)[i] != static_cast<const char*>(b.data)[i]) {
      return ::testing::AssertionFailure() << "first differing byte " << i << " of " << a.nbytes();
    }
  }
  return ::testing::AssertionFailure();
}

// A random permutation of 0..n-1 (Fisher-Yates on our own Rng, so it is the same on every platform).
inline std::vector<int32_t> permutation(Rng& rng, int32_t n) {
  std::vector<int32_t> p(n);
  for (int32_t i = 0; i < n; ++i) p[i] = i;
  for (int32_t i = n - 1; i > 0; --i) std::swap(p[i], p[int32_t(rng.next_u64() % uint64_t(i + 1))]);
  return p;
}

inline double silu_d(double x) { return x / (1.0 + std::exp(-x)); }
inline double sigmoid_d(double x) { return 1.0 / (1.0 + std::exp(-x)); }

}  // namespace lmx::test
