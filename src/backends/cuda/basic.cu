// Kernels of the small dense ops (ops/basic.h) and their launchers. All are memory-bound: each kernel
// reads its inputs once and writes its output once, in 16-byte vectors where the row length and the
// pointers allow it, in bf16 scalars otherwise. Embedding and gather_rows are the same row copy.
#include "backends/cuda/basic.cuh"

#include <cuda_bf16.h>

#include <algorithm>
#include <string>

#include "backends/cuda/check.h"
#include "backends/cuda/launch.cuh"
#include "backends/cuda/device.cuh"
#include "core/rng.h"
#include "ops/mxfp4.h"
#include "ops/backend.h"

namespace lmx::cuda {
namespace {

using detail::kBf16PerVector;

// ---- kernels ------------------------------------------------------------------------------------------

struct CopyRowsParams {
  const void* src;         // [src_rows, C] bf16 (embedding table or activations)
  const int32_t* index;    // [N] i32: source row of each output row
  void* dst;               // [N, C] bf16
  int64_t units_per_row;   // C * 2 bytes / sizeof(Unit)
};

// dst[n] = src[index[n]]. Grid: x = N rows, y = chunks of blockDim.x * kCopyUnroll units along the row.
// PRECOND: every index in [0, src_rows); Unit is uint4 only if C*2 % 16 == 0 and both bases are 16-byte
// aligned; dst does not overlap src.
template <typename Unit>
__global__ static void copy_rows_kernel(const __grid_constant__ CopyRowsParams p) {
  detail::pdl_enter();  // first: launched by detail::launch (launch.cuh)
  const int64_t row = blockIdx.x;
  const int64_t src_row = p.index[row];
  const auto* src = static_cast<const Unit*>(p.src) + src_row * p.units_per_row;
  auto* dst = static_cast<Unit*>(p.dst) + row * p.units_per_row;
  detail::copy_units(dst, src, p.units_per_row, int64_t(blockIdx.y) * blockDim.x + threadIdx.x,
                     int64_t(gridDim.y) * blockDim.x);
}

struct SplitColumnsKernelParams {
  const void* x;            // [T, C] bf16
  const void* bias;         // [C] bf16 added (and rounded) before the copy, or null
  void* parts[3];           // [T, C_i] bf16
  int64_t units[3];         // C_i in Units (16-byte vectors or bf16 scalars); 0 for unused parts
  int64_t units_per_row;    // C in Units
};

// parts[i][t, :] = x[t, c_i : c_i + C_i]. Grid: x = T rows, y = chunks of blockDim.x units of the row; a
// thread copies one unit, finding its part by the running column offset (three compares).
// PRECOND: Unit is uint4 only if every C_i * 2 % 16 == 0 and every base is 16-byte aligned; parts do not
// overlap x.
template <typename Unit>
__global__ static void split_columns_kernel(const __grid_constant__ SplitColumnsKernelParams p) {
  detail::pdl_enter();  // first: launched by detail::launch (launch.cuh)
  const int64_t row = blockIdx.x;
  int64_t column = int64_t(blockIdx.y) * blockDim.x + threadIdx.x;
  if (column >= p.units_per_row) return;
  Unit value = static_cast<const Unit*>(p.x)[row * p.units_per_row + column];
  if (p.bias != nullptr) {  // the same fp32 add and rounding as linear's bias kernel
    const Unit bias = static_cast<const Unit*>(p.bias)[column];
    auto* v = reinterpret_cast<__nv_bfloat16*>(&value);
    const auto* b = reinterpret_cast<const __nv_bfloat16*>(&bias);
#pragma unroll
    for (int i = 0; i < int(sizeof(Unit) / sizeof(__nv_bfloat16)); ++i) {
      v[i] = __float2bfloat16_rn(__bfloat162float(v[i]) + __bfloat162float(b[i]));
    }
  }
#pragma unroll
  for (int i = 0; i < 3; ++i) {
    if (column < p.units[i]) {
      static_cast<Unit*>(p.parts[i])[row * p.units[i] + column] = value;
      return;
    }
    column -= p.units[i];
  }
}

struct RmsNormKernelParams {
  __nv_bfloat16* x;               // [N, C] bf16; written (x + residual) when residual is set
  const __nv_bfloat16* residual;  // [N, C] bf16, or null
  const __nv_bfloat16* weight;    // [C] bf16
  __nv_bfloat16* out;             // [N, C] bf16, may be x itself
  int cols;                       // C
  float eps;
};

// x + residual rounded to bf16 (elementwise_kernel's add: the same sum, the same rounding), written back
// to x; the norm then reads these rounded values, so add + rms_norm and the fused op agree bit for bit.
__device__ __forceinline__ void add_residual8(float (&f)[8], __nv_bfloat16* x, const __nv_bfloat16* residual) {
  float r[8];
  detail::load8(residual, r);
#pragma unroll
  for (int k = 0; k < 8; ++k) f[k] = __bfloat162float(__float2bfloat16_rn(f[k] + r[k]));
  detail::store8(x, f);
}

// One block per row, threads looping over it: sum of squares in fp32, then out = x * rsqrt(mean + eps) *
// weight, rounded once to bf16. The second pass re-reads x (L1/L2-resident: one row is a few KB). For rows
// too long for registers (C > 32768) or unaligned; rms_norm_resident_kernel below takes the rest.
// PRECOND: blockDim.x a multiple of 32 (<= 1024); kVector only if C % 8 == 0 and x, weight, out 16-byte
// aligned; out == x or disjoint (each element is read and written by the same thread).
template <bool kVector>
__global__ static void rms_norm_kernel(const __grid_constant__ RmsNormKernelParams p) {
  detail::pdl_enter();  // first: launched by detail::launch (launch.cuh)
  const int64_t row_offset = int64_t(blockIdx.x) * p.cols;
  __nv_bfloat16* x = p.x + row_offset;
  const __nv_bfloat16* residual = p.residual != nullptr ? p.residual + row_offset : nullptr;
  __nv_bfloat16* out = p.out + row_offset;
  float sum_squares = 0.0f;
  if constexpr (kVector) {
    const int vectors = p.cols / kBf16PerVector;
    for (int i = threadIdx.x; i < vectors; i += blockDim.x) {
      float f[8];
      detail::load8(x + i * kBf16PerVector, f);
      if (residual != nullptr) add_residual8(f, x + i * kBf16PerVector, residual + i * kBf16PerVector);
#pragma unroll
      for (int j = 0; j < 8; ++j) sum_squares += f[j] * f[j];
    }
  } else {
    for (int i = threadIdx.x; i < p.cols; i += blockDim.x) {
      float f = __bfloat162float(x[i]);
      if (residual != nullptr) {
        const __nv_bfloat16 sum = __float2bfloat16_rn(f + __bfloat162float(residual[i]));
        x[i] = sum;
        f = __bfloat162float(sum);
      }
      sum_squares += f * f;
    }
  }
  const float inv_rms = rsqrtf(detail::block_sum(sum_squares) / float(p.cols) + p.eps);
  if constexpr (kVector) {
    const int vectors = p.cols / kBf16PerVector;
    for (int i = threadIdx.x; i < vectors; i += blockDim.x) {
      float f[8], w[8];
      detail::load8(x + i * kBf16PerVector, f);
      detail::load8(p.weight + i * kBf16PerVector, w);
#pragma unroll
      for (int j = 0; j < 8; ++j) f[j] = f[j] * inv_rms * w[j];
      detail::store8(out + i * kBf16PerVector, f);
    }
  } else {
    for (int i = threadIdx.x; i < p.cols; i += blockDim.x) {
      out[i] = __float2bfloat16_rn(__bfloat162float(x[i]) * inv_rms * __bfloat162float(p.weight[i]));
    }
  }
}

// The same op with the row held in registers: each thread loads its kVectors vectors of x and of the
// weight before the reduction (all in flight together) and normalizes them from registers, so x is read
// once. H = 2880: 360 vectors, 96 threads of 4 (78 registers: 8 rows per SM, 8 loads in flight per thread).
// PRECOND: C % 8 == 0, C / 8 <= kVectors * blockDim.x; blockDim.x a multiple of 32 (<= 1024); x, weight, out
// 16-byte aligned; out == x or disjoint.
// kMaxThreads: the launch bounds (one CTA an SM at least). At 256 ptxas may keep every load of a thread in
// flight as 16-byte vectors; without bounds it held the kernel to 78 registers by splitting each vector
// load into four 4-byte loads and issuing the residual's in four later groups, each a round trip (perf-log,
// session of 2026-12-06). Rows longer than 256 · kVectors vectors take the 1024-thread instance.
template <int kVectors, int kMaxThreads>
__global__ static void __launch_bounds__(kMaxThreads, 1) rms_norm_resident_kernel(const __grid_constant__ RmsNormKernelParams p) {
  detail::pdl_enter();  // first: launched by detail::launch (launch.cuh)
  const int64_t row_offset = int64_t(blockIdx.x) * p.cols;
  __nv_bfloat16* x = p.x + row_offset;
  const __nv_bfloat16* residual = p.residual != nullptr ? p.residual + row_offset : nullptr;
  __nv_bfloat16* out = p.out + row_offset;
  const int vectors = p.cols / kBf16PerVector;
  float f[kVectors][8], w[kVectors][8];
  // Unconditional loads (past-the-end threads re-read the last vector and drop it below): loads inside a
  // divergent `if` are waited for where the branch rejoins, which serialized them (docs/perf-log.md).
#pragma unroll
  for (int j = 0; j < kVectors; ++j) {
    const int i = min(int(threadIdx.x + j * blockDim.x), vectors - 1);
    detail::load8(x + i * kBf16PerVector, f[j]);
    detail::load8(p.weight + i * kBf16PerVector, w[j]);
    if (residual != nullptr) {  // the sum as add_residual8 rounds it; stored below by the vector's owner only
      float r[8];
      detail::load8(residual + i * kBf16PerVector, r);
#pragma unroll
      for (int k = 0; k < 8; ++k) f[j][k] = __bfloat162float(__float2bfloat16_rn(f[j][k] + r[k]));
    }
  }
  if (residual != nullptr) {
#pragma unroll
    for (int j = 0; j < kVectors; ++j) {
      const int i = threadIdx.x + j * blockDim.x;
      if (i < vectors) detail::store8(x + i * kBf16PerVector, f[j]);
    }
  }
  float sum_squares = 0.0f;
#pragma unroll
  for (int j = 0; j < kVectors; ++j) {
    if (int(threadIdx.x + j * blockDim.x) < vectors) {
#pragma unroll
      for (int k = 0; k < 8; ++k) sum_squares += f[j][k] * f[j][k];
    }
  }
  const float inv_rms = rsqrtf(detail::block_sum(sum_squares) / float(p.cols) + p.eps);
#pragma unroll
  for (int j = 0; j < kVectors; ++j) {
    const int i = threadIdx.x + j * blockDim.x;
    if (i < vectors) {
#pragma unroll
      for (int k = 0; k < 8; ++k) f[j][k] = f[j][k] * inv_rms * w[j][k];
      detail::store8(out + i * kBf16PerVector, f[j]);
    }
  }
}

enum class Elementwise { kAdd, kSiluMul };

struct ElementwiseParams {
  const __nv_bfloat16* a;  // [numel] bf16: add: x; silu_mul: gate
  const __nv_bfloat16* b;  // [numel] bf16: add: y; silu_mul: up
  __nv_bfloat16* out;      // [numel] bf16: add: y; silu_mul: out (may be gate or up)
  int64_t numel;
};

template <Elementwise kOp>
__device__ __forceinline__ float apply(float a, float b) {
  if constexpr (kOp == Elementwise::kAdd) {
    return b + a;
  } else {
    return a / (1.0f + expf(-a)) * b;  // silu(gate) * up; expf(-a) = inf for a << 0 gives -0, as torch does
  }
}

// out[i] = op(a[i], b[i]), one unit (8 values or 1) per thread.
// PRECOND: kVector only if numel % 8 == 0 and a, b, out 16-byte aligned; out equals a or b exactly, or is
// disjoint from both (each element is read and written by the same thread).
template <Elementwise kOp, bool kVector>
__global__ static void elementwise_kernel(const __grid_constant__ ElementwiseParams p) {
  detail::pdl_enter();  // first: launched by detail::launch (launch.cuh)
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if constexpr (kVector) {
    if (i >= p.numel / kBf16PerVector) return;
    float a[8], b[8];
    detail::load8(p.a + i * kBf16PerVector, a);
    detail::load8(p.b + i * kBf16PerVector, b);
#pragma unroll
    for (int j = 0; j < 8; ++j) a[j] = apply<kOp>(a[j], b[j]);
    detail::store8(p.out + i * kBf16PerVector, a);
  } else {
    if (i >= p.numel) return;
    p.out[i] = __float2bfloat16_rn(apply<kOp>(__bfloat162float(p.a[i]), __bfloat162float(p.b[i])));
  }
}

struct GeneratedKernelParams {
  uint16_t* out;  // [n] bf16 bits
  int64_t n;
  uint64_t tensor_seed;
  float scale;    // generated_scale(stddev)
};

// Thread = 8 consecutive values (one 16-byte store when the tensor allows): value i is step i % chunk of
// the SplitMix64 stream seeded mix64(tensor_seed + i / chunk), whose j-th output is
// mix64(state0 + j * golden) — so any value is reachable without walking the stream.
// PRECOND: out 16-byte aligned when n % 8 == 0 (the vector store); chunk a multiple of 8.
__global__ static void generated_kernel(const __grid_constant__ GeneratedKernelParams p) {
  const int64_t first = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
  if (first >= p.n) return;
  const int64_t chunk = first / kGeneratedChunk;
  const uint64_t state0 = mix64(p.tensor_seed + uint64_t(chunk));
  uint16_t bits[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const uint64_t step = uint64_t(first + e - chunk * kGeneratedChunk);
    const uint64_t u = mix64(state0 + step * 0x9e3779b97f4a7c15ull);
    const int64_t sum = int64_t(u & 0xffff) + int64_t((u >> 16) & 0xffff) + int64_t((u >> 32) & 0xffff) +
                        int64_t(u >> 48) - 131070;
    bits[e] = __bfloat16_as_ushort(__float2bfloat16_rn(float(sum) * p.scale));
  }
  if (first + 8 <= p.n && p.n % 8 == 0) {
    *reinterpret_cast<uint4*>(p.out + first) = *reinterpret_cast<const uint4*>(bits);
  } else {
    for (int e = 0; e < 8 && first + e < p.n; ++e) p.out[first + e] = bits[e];
  }
}

struct GeneratedMxfp4KernelParams {
  uint64_t* blocks;  // [E, K/64, N, 32] bytes as four words a unit
  uint16_t* scales;  // [E, K/64, N, 2] bytes as one 16-bit pair a unit
  uint4* values;     // [E, N, K] bf16, eight values a vector
  int64_t units, rows, tiles;
  uint64_t seed;
  int scale_lo;
};

// Thread = one unit (expert, k-tile, row) of ops/mxfp4.h's generated_unit: its 32 code bytes and two
// exponents, then its 64 values as CpuBackend::fill_generated_mxfp4 computes them (the same helpers; the
// product is exact, so both roundings to bf16 agree) into the unit's 128 contiguous bytes of `values`.
// PRECOND: the tensors of ops::check(GeneratedMxfp4Params) on cuda; values 16-byte, blocks 8-byte and scales
// 2-byte aligned (the launcher checks both).
__global__ static void generated_mxfp4_kernel(const __grid_constant__ GeneratedMxfp4KernelParams p) {
  namespace mxfp4 = ops::mxfp4;
  const int64_t u = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (u >= p.units) return;
  const mxfp4::GeneratedUnit g = mxfp4::generated_unit(p.seed, u, p.scale_lo);
#pragma unroll
  for (int j = 0; j < 4; ++j) p.blocks[u * 4 + j] = g.words[j];
  p.scales[u] = uint16_t(g.scales[0] | (g.scales[1] << 8));
  const int64_t row = u % p.rows, kt = u / p.rows % p.tiles, expert = u / (p.rows * p.tiles);
  uint4* out = p.values + ((expert * p.rows + row) * p.tiles + kt) * (mxfp4::kTileK / 8);
#pragma unroll
  for (int v = 0; v < mxfp4::kTileK / 8; ++v) {
    uint32_t packed[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int k = v * 8 + 2 * i;
      const float lo = mxfp4::code_value(mxfp4::unit_code(g.words, k), g.scales[k / mxfp4::kGroup]);
      const float hi = mxfp4::code_value(mxfp4::unit_code(g.words, k + 1), g.scales[(k + 1) / mxfp4::kGroup]);
      packed[i] = uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(lo))) |
                  (uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(hi))) << 16);
    }
    out[v] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  }
}

// ---- launchers ----------------------------------------------------------------------------------------

constexpr int kCopyThreads = 128;
constexpr int kElementwiseThreads = 256;
constexpr int kRmsNormVectors = 4;

template <typename T>
const T* device_ptr(const Tensor& t) { return static_cast<const T*>(t.data); }
template <typename T>
T* device_mut_ptr(const Tensor& t) { return static_cast<T*>(t.data); }

// out[n] = src[index[n]] for rows of `row_bytes`; the grid splits each row over blocks of kCopyThreads.
void launch_copy_rows(const void* src, const int32_t* index, void* dst, int64_t rows, int64_t row_bytes,
                      cudaStream_t stream) {
  if (rows == 0 || row_bytes == 0) return;
  const bool vector = row_bytes % 16 == 0 && detail::aligned16(src) && detail::aligned16(dst);
  const int64_t units = vector ? row_bytes / 16 : row_bytes / 2;
  LMX_CHECK(rows <= 0x7fffffff);
  // One block covers kCopyThreads * kCopyUnroll units of a row (H = 2880: 360 vectors, one block, 3 loads
  // in flight per thread).
  const dim3 grid(unsigned(rows), detail::blocks_for(units, kCopyThreads * detail::kCopyUnroll));
  const CopyRowsParams params{.src = src, .index = index, .dst = dst, .units_per_row = units};
  if (vector) {
    detail::launch(copy_rows_kernel<uint4>, dim3(grid), dim3(kCopyThreads), 0, stream, params);
  } else {
    detail::launch(copy_rows_kernel<uint16_t>, dim3(grid), dim3(kCopyThreads), 0, stream, params);
  }
  LMX_CUDA_CHECK_LAUNCH();
}

void launch_elementwise(Elementwise op, const Tensor& a, const Tensor& b, const Tensor& out, cudaStream_t stream) {
  const int64_t numel = out.numel();
  if (numel == 0) return;
  const bool vector = numel % kBf16PerVector == 0 && detail::aligned16(a.data) && detail::aligned16(b.data) &&
                      detail::aligned16(out.data);
  const ElementwiseParams params{.a = device_ptr<__nv_bfloat16>(a),
                                 .b = device_ptr<__nv_bfloat16>(b),
                                 .out = device_mut_ptr<__nv_bfloat16>(out),
                                 .numel = numel};
  const unsigned blocks = detail::blocks_for(vector ? numel / kBf16PerVector : numel, kElementwiseThreads);
  // The one dispatch on (op, vector width); each pair is its own instantiation.
  if (op == Elementwise::kAdd) {
    if (vector) detail::launch(elementwise_kernel<Elementwise::kAdd, true>, dim3(blocks), dim3(kElementwiseThreads), 0, stream, params);
    else detail::launch(elementwise_kernel<Elementwise::kAdd, false>, dim3(blocks), dim3(kElementwiseThreads), 0, stream, params);
  } else {
    if (vector) detail::launch(elementwise_kernel<Elementwise::kSiluMul, true>, dim3(blocks), dim3(kElementwiseThreads), 0, stream, params);
    else detail::launch(elementwise_kernel<Elementwise::kSiluMul, false>, dim3(blocks), dim3(kElementwiseThreads), 0, stream, params);
  }
  LMX_CUDA_CHECK_LAUNCH();
}

}  // namespace

void embedding(const ops::EmbeddingParams& p, cudaStream_t stream) {
  ops::require(ops::check(p), "cuda::embedding");
  detail::require_cuda("embedding", {{"table", &p.table}, {"token_ids", &p.token_ids}, {"out", &p.out}});
  detail::require_bf16_activation("embedding", "out", p.out);
  launch_copy_rows(p.table.data, device_ptr<int32_t>(p.token_ids), p.out.data, p.out.dim(0),
                   p.out.dim(1) * int64_t(sizeof(__nv_bfloat16)), stream);
}

void gather_rows(const ops::GatherRowsParams& p, cudaStream_t stream) {
  ops::require(ops::check(p), "cuda::gather_rows");
  detail::require_cuda("gather_rows", {{"x", &p.x}, {"index", &p.index}, {"out", &p.out}});
  detail::require_bf16_activation("gather_rows", "x", p.x);
  launch_copy_rows(p.x.data, device_ptr<int32_t>(p.index), p.out.data, p.out.dim(0),
                   p.out.dim(1) * int64_t(sizeof(__nv_bfloat16)), stream);
}

void split_columns(const ops::SplitColumnsParams& p, cudaStream_t stream, const Tensor& bias) {
  ops::require(ops::check(p), "cuda::split_columns");
  detail::require_cuda("split_columns", {{"x", &p.x}, {"parts[0]", &p.parts[0]}});
  detail::require_bf16_activation("split_columns", "x", p.x);
  const int64_t rows = p.x.dim(0), cols = p.x.dim(1);
  if (bias.defined() && (bias.device != Device::kCuda || bias.dtype != DType::BF16 || bias.ndim != 1 || bias.dim(0) != cols)) {
    detail::contract_failure("split_columns", "bias", bias, ("[C] BF16 on cuda, C = x.dim(1) = " + std::to_string(cols)).c_str());
  }
  if (rows == 0 || cols == 0) return;
  LMX_CHECK(rows <= 0x7fffffff);
  bool vector = detail::aligned16(p.x.data) && cols % kBf16PerVector == 0 && (!bias.defined() || detail::aligned16(bias.data));
  for (const Tensor& part : p.parts) {
    if (part.defined()) vector = vector && detail::aligned16(part.data) && part.dim(1) % kBf16PerVector == 0;
  }
  const int64_t per_unit = vector ? kBf16PerVector : 1;
  SplitColumnsKernelParams params{.x = p.x.data, .bias = bias.defined() ? bias.data : nullptr, .parts = {}, .units = {},
                                  .units_per_row = cols / per_unit};
  for (size_t i = 0; i < p.parts.size(); ++i) {
    if (!p.parts[i].defined()) continue;
    params.parts[i] = p.parts[i].data;
    params.units[i] = p.parts[i].dim(1) / per_unit;
  }
  const dim3 grid(unsigned(rows), detail::blocks_for(params.units_per_row, kCopyThreads));
  if (vector) detail::launch(split_columns_kernel<uint4>, dim3(grid), dim3(kCopyThreads), 0, stream, params);
  else detail::launch(split_columns_kernel<uint16_t>, dim3(grid), dim3(kCopyThreads), 0, stream, params);
  LMX_CUDA_CHECK_LAUNCH();
}

void rms_norm(const ops::RmsNormParams& p, cudaStream_t stream) {
  ops::require(ops::check(p), "cuda::rms_norm");
  detail::require_cuda("rms_norm", {{"x", &p.x}, {"weight", &p.weight}, {"out", &p.out}});
  if (p.residual.defined()) detail::require_cuda("rms_norm", {{"residual", &p.residual}});
  detail::require_bf16_activation("rms_norm", "x", p.x);
  const int64_t rows = p.x.dim(0), cols = p.x.dim(1);
  if (rows == 0 || cols == 0) return;
  LMX_CHECK(rows <= 0x7fffffff && cols <= 0x7fffffff);
  const bool vector = cols % kBf16PerVector == 0 && detail::aligned16(p.x.data) &&
                      detail::aligned16(p.weight.data) && detail::aligned16(p.out.data) &&
                      (!p.residual.defined() || detail::aligned16(p.residual.data));
  const int64_t units = vector ? cols / kBf16PerVector : cols;
  const RmsNormKernelParams params{.x = device_mut_ptr<__nv_bfloat16>(p.x),
                                   .residual = p.residual.defined() ? device_ptr<__nv_bfloat16>(p.residual) : nullptr,
                                   .weight = device_ptr<__nv_bfloat16>(p.weight),
                                   .out = device_mut_ptr<__nv_bfloat16>(p.out),
                                   .cols = int(cols),
                                   .eps = p.eps};
  // Rows of up to 4 * 1024 vectors (C <= 32768) stay in registers, kRmsNormVectors per thread (H = 2880: 96
  // threads). Longer or unaligned rows: the looping kernel, one thread per unit up to 1024 threads.
  if (vector && units <= kRmsNormVectors * 1024) {
    const int64_t holders = (units + kRmsNormVectors - 1) / kRmsNormVectors;  // threads that hold a vector
    const int threads = int((holders + 31) / 32 * 32);
    if (threads <= 256) {
      detail::launch(rms_norm_resident_kernel<kRmsNormVectors, 256>, dim3(unsigned(rows)), dim3(threads), 0, stream, params);
    } else {
      detail::launch(rms_norm_resident_kernel<kRmsNormVectors, 1024>, dim3(unsigned(rows)), dim3(threads), 0, stream, params);
    }
  } else {
    const int threads = int(std::clamp<int64_t>((units + 31) / 32 * 32, 32, 1024));
    if (vector) {
      detail::launch(rms_norm_kernel<true>, dim3(unsigned(rows)), dim3(threads), 0, stream, params);
    } else {
      detail::launch(rms_norm_kernel<false>, dim3(unsigned(rows)), dim3(threads), 0, stream, params);
    }
  }
  LMX_CUDA_CHECK_LAUNCH();
}

void add(const ops::AddParams& p, cudaStream_t stream) {
  ops::require(ops::check(p), "cuda::add");
  detail::require_cuda("add", {{"x", &p.x}, {"y", &p.y}});
  detail::require_bf16_activation("add", "x", p.x);
  launch_elementwise(Elementwise::kAdd, p.x, p.y, p.y, stream);
}

void silu_mul(const ops::SiluMulParams& p, cudaStream_t stream) {
  ops::require(ops::check(p), "cuda::silu_mul");
  detail::require_cuda("silu_mul", {{"gate", &p.gate}, {"up", &p.up}, {"out", &p.out}});
  detail::require_bf16_activation("silu_mul", "gate", p.gate);
  launch_elementwise(Elementwise::kSiluMul, p.gate, p.up, p.out, stream);
}

void fill_generated(const Tensor& t, uint64_t tensor_seed, float stddev, cudaStream_t stream) {
  detail::require_cuda("fill_generated", {{"t", &t}});
  if (t.dtype != DType::BF16) detail::contract_failure("fill_generated", "t", t, "a BF16 tensor");
  const int64_t n = t.numel();
  if (n == 0) return;
  if (n % 8 == 0 && !detail::aligned16(t.data)) detail::contract_failure("fill_generated", "t", t, "16-byte aligned");
  const GeneratedKernelParams params{.out = static_cast<uint16_t*>(t.data), .n = n, .tensor_seed = tensor_seed,
                                     .scale = generated_scale(stddev)};
  constexpr int kThreads = 256;
  generated_kernel<<<detail::blocks_for((n + 7) / 8, kThreads), kThreads, 0, stream>>>(params);
  LMX_CUDA_CHECK_LAUNCH();
}

void fill_generated_mxfp4(const ops::GeneratedMxfp4Params& p, cudaStream_t stream) {
  ops::require(ops::check(p), "cuda::fill_generated_mxfp4");
  detail::require_cuda("fill_generated_mxfp4",
                       {{"values", &p.values}, {"weight.blocks", &p.weight.blocks}, {"weight.scales", &p.weight.scales}});
  if (!detail::aligned16(p.values.data) || reinterpret_cast<uintptr_t>(p.weight.blocks.data) % 8 != 0 ||
      reinterpret_cast<uintptr_t>(p.weight.scales.data) % 2 != 0) {
    detail::contract_failure("fill_generated_mxfp4", "values", p.values,
                             "values 16-byte, blocks 8-byte and scales 2-byte aligned");
  }
  const int64_t rows = p.values.dim(1), tiles = p.values.dim(2) / ops::mxfp4::kTileK;
  const int64_t units = p.values.dim(0) * tiles * rows;
  if (units == 0) return;
  const GeneratedMxfp4KernelParams params{.blocks = static_cast<uint64_t*>(p.weight.blocks.data),
                                          .scales = static_cast<uint16_t*>(p.weight.scales.data),
                                          .values = static_cast<uint4*>(p.values.data),
                                          .units = units,
                                          .rows = rows,
                                          .tiles = tiles,
                                          .seed = p.seed,
                                          .scale_lo = p.scale_lo};
  constexpr int kThreads = 128;
  generated_mxfp4_kernel<<<detail::blocks_for(units, kThreads), kThreads, 0, stream>>>(params);
  LMX_CUDA_CHECK_LAUNCH();
}

}  // namespace lmx::cuda
