// The RoPE kernel and its launcher. One block per token: the token's D/2 (cos, sin) pairs are computed once
// into shared memory, then every head of q and k is rotated from them, 8 pairs per thread with 16-byte
// accesses when D/2 % 8 == 0 (D = 64 and 128 both qualify), one pair per thread otherwise.
#include "backends/cuda/rope.cuh"

#include <cuda_bf16.h>

#include <algorithm>

#include "backends/cuda/check.h"
#include "backends/cuda/launch.cuh"
#include "backends/cuda/device.cuh"
#include "ops/backend.h"

namespace lmx::cuda {
namespace {

using detail::kBf16PerVector;

// ---- kernels ------------------------------------------------------------------------------------------

struct RopeKernelParams {
  __nv_bfloat16* q;          // [T, Hq, D] bf16, rotated in place
  __nv_bfloat16* k;          // [T, Hkv, D] bf16, rotated in place
  const int32_t* positions;  // [T] i32
  const float* inv_freq;     // [D/2] f32
  int q_heads;               // Hq
  int kv_heads;              // Hkv
  int half_dim;              // D/2
  float attention_scaling;   // YaRN's factor on cos and sin (1 otherwise)
};

// For each head and i < D/2, with a = position * inv_freq[i] (one fp32 product, as transformers computes it):
//   x[i]       = x[i] * cos(a) - x[i + D/2] * sin(a)
//   x[i + D/2] = x[i + D/2] * cos(a) + x[i] * sin(a)        (cos and sin scaled by attention_scaling)
// Dynamic shared memory: 2 * D/2 floats.
// PRECOND: kWidth is 8 only if D/2 % 8 == 0 and q, k 16-byte aligned, else 1; q and k disjoint.
template <int kWidth>
__global__ static void rope_kernel(const __grid_constant__ RopeKernelParams p) {
  detail::pdl_enter();  // first: launched by detail::launch (launch.cuh)
  extern __shared__ float cos_sin[];  // [2][D/2]: cos, then sin
  float* cos_table = cos_sin;
  float* sin_table = cos_sin + p.half_dim;
  const int64_t token = blockIdx.x;
  const float position = float(p.positions[token]);
  for (int i = threadIdx.x; i < p.half_dim; i += blockDim.x) {
    float s, c;
    // Accurate sincosf, not __sincosf: angles reach position * 1 rad ~ 1e5, far outside the fast
    // intrinsic's accurate range.
    sincosf(position * p.inv_freq[i], &s, &c);
    cos_table[i] = c * p.attention_scaling;
    sin_table[i] = s * p.attention_scaling;
  }
  __syncthreads();

  const int groups = p.half_dim / kWidth;  // kWidth-wide groups of pairs per head
  const int items = (p.q_heads + p.kv_heads) * groups;
  const int64_t dim = 2 * int64_t(p.half_dim);
  for (int item = threadIdx.x; item < items; item += blockDim.x) {
    const int head = item / groups;
    const int first = (item % groups) * kWidth;
    __nv_bfloat16* x = head < p.q_heads ? p.q + (token * p.q_heads + head) * dim
                                        : p.k + (token * p.kv_heads + (head - p.q_heads)) * dim;
    if constexpr (kWidth == kBf16PerVector) {
      float lo[8], hi[8], new_lo[8], new_hi[8];
      detail::load8(x + first, lo);
      detail::load8(x + p.half_dim + first, hi);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float c = cos_table[first + j], s = sin_table[first + j];
        new_lo[j] = lo[j] * c - hi[j] * s;
        new_hi[j] = hi[j] * c + lo[j] * s;
      }
      detail::store8(x + first, new_lo);
      detail::store8(x + p.half_dim + first, new_hi);
    } else {
      const float lo = __bfloat162float(x[first]), hi = __bfloat162float(x[first + p.half_dim]);
      const float c = cos_table[first], s = sin_table[first];
      x[first] = __float2bfloat16_rn(lo * c - hi * s);
      x[first + p.half_dim] = __float2bfloat16_rn(hi * c + lo * s);
    }
  }
}

// ---- launchers ----------------------------------------------------------------------------------------

constexpr int kMaxRopeThreads = 512;

}  // namespace

void rope(const ops::RopeParams& p, cudaStream_t stream) {
  ops::require(ops::check(p), "cuda::rope");
  detail::require_cuda("rope", {{"q", &p.q}, {"k", &p.k}, {"positions", &p.positions}, {"inv_freq", &p.inv_freq}});
  detail::require_bf16_activation("rope", "q", p.q);
  const int64_t tokens = p.q.dim(0), q_heads = p.q.dim(1), kv_heads = p.k.dim(1), half_dim = p.q.dim(2) / 2;
  if (tokens == 0 || half_dim == 0 || q_heads + kv_heads == 0) return;
  LMX_CHECK(tokens <= 0x7fffffff && q_heads + kv_heads <= 0x7fffffff / half_dim);
  const bool vector = half_dim % kBf16PerVector == 0 && detail::aligned16(p.q.data) && detail::aligned16(p.k.data);
  const int width = vector ? kBf16PerVector : 1;
  // GPT-OSS (Hq 64, Hkv 8, D 64): 72 heads * 4 groups = 288 threads, one group each.
  const int64_t items = (q_heads + kv_heads) * (half_dim / width);
  const int threads = int(std::clamp<int64_t>((items + 31) / 32 * 32, 32, kMaxRopeThreads));
  const size_t smem = 2 * size_t(half_dim) * sizeof(float);
  LMX_CHECK(smem <= 48 * 1024);  // D <= 12288: far above any model's head dim
  const RopeKernelParams params{.q = static_cast<__nv_bfloat16*>(p.q.data),
                                .k = static_cast<__nv_bfloat16*>(p.k.data),
                                .positions = static_cast<const int32_t*>(p.positions.data),
                                .inv_freq = static_cast<const float*>(p.inv_freq.data),
                                .q_heads = int(q_heads),
                                .kv_heads = int(kv_heads),
                                .half_dim = int(half_dim),
                                .attention_scaling = p.attention_scaling};
  if (vector) {
    detail::launch(rope_kernel<kBf16PerVector>, dim3(unsigned(tokens)), dim3(threads), smem, stream, params);
  } else {
    detail::launch(rope_kernel<1>, dim3(unsigned(tokens)), dim3(threads), smem, stream, params);
  }
  LMX_CUDA_CHECK_LAUNCH();
}

}  // namespace lmx::cuda
