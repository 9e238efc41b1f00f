// Helpers shared by the CUDA parity tests (tests/cuda/*.cpp): a fixture with a stream, a fresh seed per run
// and the CPU oracle; random bf16 host tensors, poisoned device outputs, and the comparisons with the
// tolerances of docs/NUMERICS.md. Test-only. Every suite is named Cuda* so scripts/test can skip them
// on machines without a GPU (they run on the H200 through scripts/device).
#pragma once
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "backends/cpu/cpu_backend.h"
#include "backends/cuda/memory.h"
#include "core/rng.h"
#include "core/tensor.h"

namespace lmx::test {

// docs/NUMERICS.md, "CUDA kernels (bf16 out) vs the CPU oracle": a bf16 output of fp32 math against the
// fp32 CPU result from the same bf16 inputs. The final rounding to bf16 costs up to half an ulp (2^-8
// relative); fp32 order and intrinsics (rsqrtf, expf, sincosf) stay far below that. One ulp, 2^-7.
constexpr double kTolBf16Out = 1.0 / 128.0;

// Every CUDA test gets its own stream (the launchers must honour it), a seed that is fresh on every run
// unless LORAMUX_TEST_SEED pins it (the seed is printed with any failure), and the CPU backend as oracle.
class CudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int devices = 0;
    ASSERT_EQ(cudaGetDeviceCount(&devices), cudaSuccess) << "no CUDA device: Cuda* tests need a GPU";
    ASSERT_GT(devices, 0);
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
    const char* pinned = std::getenv("LORAMUX_TEST_SEED");
    seed_ = pinned ? std::strtoull(pinned, nullptr, 10) : std::random_device{}();
    rng_.emplace(seed_);
    trace_.emplace(__FILE__, __LINE__, "seed " + std::to_string(seed_) + " (rerun with LORAMUX_TEST_SEED)");
  }
  void TearDown() override {
    if (stream_) {
      EXPECT_EQ(cudaStreamDestroy(stream_), cudaSuccess);
    }
  }

  // Wait for the stream and surface any fault of the kernels on it.
  void sync() {
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  }

  Rng& rng() { return *rng_; }
  cudaStream_t stream_ = nullptr;
  cpu::CpuBackend cpu_;

 private:
  uint64_t seed_ = 0;
  std::optional<Rng> rng_;
  std::optional<::testing::ScopedTrace> trace_;
};

inline OwnedTensor random_bf16(Rng& rng, std::initializer_list<int64_t> dims, float scale = 1.0f) {
  OwnedTensor t = OwnedTensor::host(DType::BF16, dims);
  for (int64_t i = 0; i < t.view.numel(); ++i) t.view.ptr<bf16>()[i] = f32_to_bf16(scale * rng.normal());
  return t;
}

// Uniform ints in [lo, hi), as an I32 host tensor [n].
inline OwnedTensor random_ids(Rng& rng, int64_t n, int32_t lo, int32_t hi) {
  OwnedTensor t = OwnedTensor::host(DType::I32, {n});
  for (int64_t i = 0; i < n; ++i) t.view.ptr<int32_t>()[i] = lo + int32_t(rng.next_u64() % uint64_t(hi - lo));
  return t;
}

// n distinct values of [0, range) in random order (Fisher-Yates prefix), as an I32 host tensor [n].
inline OwnedTensor distinct_ids(Rng& rng, int64_t n, int32_t range) {
  std::vector<int32_t> all(static_cast<size_t>(range));
  for (int32_t i = 0; i < range; ++i) all[i] = i;
  for (int64_t i = 0; i < n; ++i) std::swap(all[i], all[i + int64_t(rng.next_u64() % uint64_t(range - i))]);
  OwnedTensor t = OwnedTensor::host(DType::I32, {n});
  std::copy(all.begin(), all.begin() + n, t.view.ptr<int32_t>());
  return t;
}

// The F32 copy of a BF16 host tensor: what the CPU oracle computes from.
inline OwnedTensor widen(const Tensor& host_bf16) {
  OwnedTensor t = OwnedTensor::host_like(host_bf16, DType::F32);
  for (int64_t i = 0; i < t.view.numel(); ++i) t.view.ptr<float>()[i] = bf16_to_f32(host_bf16.ptr<bf16>()[i]);
  return t;
}

// A device tensor filled with 0xff bytes: bf16 0xffff is a NaN, i32 -1 is out of every range. A kernel
// that leaves an element unwritten fails the comparison.
inline OwnedTensor poisoned(DType dtype, std::initializer_list<int64_t> dims) {
  OwnedTensor t = cuda::empty(dtype, dims);
  cuda::fill_bytes(t.view, 0xff);
  return t;
}

// A device copy of `host` that starts `offset_elems` elements into its buffer: offset 1 breaks 16-byte
// alignment and exercises the launchers' scalar fallbacks. The Buffer keeps the whole allocation alive.
inline OwnedTensor upload_at_offset(const Tensor& host, int64_t offset_elems) {
  const size_t elem = dtype_size(host.dtype);
  OwnedTensor t;
  t.buffer = cuda::allocate(host.nbytes() + size_t(offset_elems) * elem);
  t.view = Tensor::with_shape(static_cast<char*>(t.buffer.data()) + offset_elems * elem, host.dtype, host.shape,
                              host.ndim, Device::kCuda);
  cuda::copy(t.view, host);
  return t;
}

// got (BF16, host) against the F32 oracle: |got - want| <= tol * (|want| + rms(want)) everywhere (relative
// for large values, relative to the tensor's scale where cancellation makes a value small). NaN fails.
inline ::testing::AssertionResult all_close(const Tensor& got, const Tensor& want, double tol) {
  if (got.dtype != DType::BF16 || want.dtype != DType::F32 || got.numel() != want.numel()) {
    return ::testing::AssertionFailure() << "got " << got.shape_str() << " vs want " << want.shape_str();
  }
  const float* w = want.ptr<float>();
  double sum_squares = 0.0;
  for (int64_t i = 0; i < want.numel(); ++i) sum_squares += double(w[i]) * w[i];
  const double rms = want.numel() ? std::sqrt(sum_squares / double(want.numel())) : 0.0;
  int64_t failures = 0;
  double worst = 0.0;
  std::ostringstream first;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double g = bf16_to_f32(got.ptr<bf16>()[i]);
    const double err = std::abs(g - w[i]);
    const double scale = std::abs(double(w[i])) + rms;
    worst = std::max(worst, err / (scale + 1e-300));
    if (!(err <= tol * scale)) {  // also catches NaN (poison left behind)
      if (failures++ < 5) first << "\n  [" << i << "] got " << g << ", want " << w[i] << " (err " << err << ")";
    }
  }
  if (failures == 0) return ::testing::AssertionSuccess() << "worst scaled error " << worst;
  return ::testing::AssertionFailure() << failures << " of " << got.numel() << " elements beyond tol " << tol
                                       << " (worst scaled error " << worst << "):" << first.str();
}

// Exact comparison of two host tensors of equal size (pure data movement must match bit for bit).
inline ::testing::AssertionResult bitwise_equal(const Tensor& got, const Tensor& want) {
  if (got.nbytes() != want.nbytes()) {
    return ::testing::AssertionFailure() << "got " << got.shape_str() << " vs want " << want.shape_str();
  }
  const auto* g = static_cast<const unsigned char*>(got.data);
  const auto* w = static_cast<const unsigned char*>(want.data);
  for (size_t i = 0; i < got.nbytes(); ++i) {
    if (g[i] != w[i]) return ::testing::AssertionFailure() << "first differing byte " << i << " of " << got.nbytes();
  }
  return ::testing::AssertionSuccess();
}

// The BF16 host tensor holding `f32` rounded to bf16: the exact expectation for copies of bf16 data.
inline OwnedTensor narrow(const Tensor& host_f32) {
  OwnedTensor t = OwnedTensor::host_like(host_f32, DType::BF16);
  for (int64_t i = 0; i < t.view.numel(); ++i) t.view.ptr<bf16>()[i] = f32_to_bf16(host_f32.ptr<float>()[i]);
  return t;
}

}  // namespace lmx::test
