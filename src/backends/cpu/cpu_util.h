// Helpers shared by the CPU op files (internal to backends/cpu): element widening, the one dot product
// every projection uses, activation functions, and the abort for values that break an op's contract.
#pragma once
#include <cmath>
#include <cstdint>
#include <string>

#include "core/tensor.h"

namespace lmx::cpu {

inline float to_f32(float v) { return v; }
inline float to_f32(bf16 v) { return bf16_to_f32(v); }

// Σ x[i]·w[i] in fp32. The order is fixed: lane l (0..7) sums the products with i % 8 == l in increasing
// i, then the lanes are added pairwise ((0+4)+(2+6)) + ((1+5)+(3+7)). Same result on every thread count,
// vectorisable, and no less accurate than a sequential sum.
template <typename W>
inline float dot(const float* x, const W* w, int64_t n) {
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int l = 0; l < 8; ++l) lane[l] += x[i + l] * to_f32(w[i + l]);
  }
  for (int l = 0; i < n; ++i, ++l) lane[l] += x[i] * to_f32(w[i]);
  return ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
}

// The data of an optional tensor, or nullptr when it is undefined.
template <typename T>
inline const T* optional_ptr(const Tensor& t) {
  return t.defined() ? t.ptr<T>() : nullptr;
}

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

// Abort like ops::require() when a value inside a tensor (an id, an index, a rank) breaks the contract.
[[noreturn]] void contract_violation(const char* op, const std::string& message);

// A NaN among a row's logits would make every ordering (top-k, argmax) arbitrary: report it instead.
void require_no_nan(const float* row, int64_t n, const char* field, int64_t row_index, const char* op);

// The CPU backend computes activations in F32 only and reads only host memory.
void require_host_f32(const Tensor& t, const char* field, const char* op);

}  // namespace lmx::cpu
