// The RoPE kernel and its launcher. One block per token: the token's D/2 (cos, sin) pairs are computed once
// into shared memory, then every head of q and k is rotated from them, 8 pairs per thread with 16-byte
// accesses when D/2 % 8 == 0 (D = 64 and 128 both qualify), one pair per thread otherwise. Qwen3's QK-norm
// (RopeParams::q_norm / k_norm) is fused on the 16-byte path where a head's D/16 threads are a power of two
// (they sit in one warp and sum their squares by shuffles): the head is normalized as rms_norm would
// (x · rsqrt(mean(x²) + eps) · w, rounded to bf16) and then rotated; elsewhere rms_norm runs first.
#include "backends/cuda/rope.cuh"

#include <cuda_bf16.h>

#include <algorithm>

#include "backends/cuda/basic.cuh"
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
  // rope_kv_write only (else null): the rotated k rows and the v rows also go to cache row
  // kv_write_index[token] (skipped where -1), as kv_write does.
  const __nv_bfloat16* v;         // [T, Hkv, D] bf16
  const int32_t* kv_write_index;  // [T] i32
  __nv_bfloat16* k_cache;         // [rows, Hkv, D] bf16
  __nv_bfloat16* v_cache;         // [rows, Hkv, D] bf16
  // The QK-norm (16-byte path only), or null: [D] bf16 weights of q's and k's heads.
  const __nv_bfloat16* q_norm;
  const __nv_bfloat16* k_norm;
  float norm_eps;
  // rope_kv_write_from_qkv (else null): q, k and v read from the fused product's rows [T, (Hq + 2·Hkv)·D]
  // (heads in that order), with qkv_bias [(Hq + 2·Hkv)·D] (or null) added and rounded as split_columns adds
  // it; q and k written rotated, v written to v_out (and the cache): what split_columns then rope_kv_write
  // leave, bit for bit.
  const __nv_bfloat16* qkv;
  const __nv_bfloat16* qkv_bias;
  __nv_bfloat16* v_out;  // [T, Hkv, D] bf16
};

// The split's bias add: x + b in fp32, rounded to bf16 (split_columns_kernel's arithmetic).
__device__ __forceinline__ float add_bias_bf16(float x, float b) { return __bfloat162float(__float2bfloat16_rn(x + b)); }

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
  const int64_t dim = 2 * int64_t(p.half_dim);
  // With the cache write, Hkv more "heads" after q and k: v's rows, copied to the cache unrotated.
  const int64_t cache_row = p.kv_write_index != nullptr ? p.kv_write_index[token] : -1;
  const int heads = p.q_heads + p.kv_heads + (p.kv_write_index != nullptr || p.qkv != nullptr ? p.kv_heads : 0);
  const int items = heads * groups;
  // qkv: the fused product's row of this token (head h's D values at h·D, q's heads, then k's, then v's)
  const __nv_bfloat16* qkv_row = p.qkv != nullptr ? p.qkv + token * (p.q_heads + 2 * p.kv_heads) * dim : nullptr;
  for (int item = threadIdx.x; item < items; item += blockDim.x) {
    const int head = item / groups;
    const int first = (item % groups) * kWidth;
    if (head >= p.q_heads + p.kv_heads) {  // v → cache (and with qkv, v's own rows too)
      if (cache_row < 0 && qkv_row == nullptr) continue;
      const int kv_head = head - p.q_heads - p.kv_heads;
      __nv_bfloat16* dst = cache_row >= 0 ? p.v_cache + (cache_row * p.kv_heads + kv_head) * dim : nullptr;
      if (qkv_row != nullptr) {  // the split's v rows, biased, into v_out and the cache
        __nv_bfloat16* v_row = p.v_out + (token * p.kv_heads + kv_head) * dim;
        if constexpr (kWidth == kBf16PerVector) {
          float lo[8], hi[8];
          detail::load8(qkv_row + head * dim + first, lo);
          detail::load8(qkv_row + head * dim + p.half_dim + first, hi);
          if (p.qkv_bias != nullptr) {
            float b_lo[8], b_hi[8];
            detail::load8(p.qkv_bias + head * dim + first, b_lo);
            detail::load8(p.qkv_bias + head * dim + p.half_dim + first, b_hi);
#pragma unroll
            for (int j = 0; j < 8; ++j) lo[j] = add_bias_bf16(lo[j], b_lo[j]), hi[j] = add_bias_bf16(hi[j], b_hi[j]);
          }
          detail::store8(v_row + first, lo);
          detail::store8(v_row + p.half_dim + first, hi);
          if (dst != nullptr) {
            detail::store8(dst + first, lo);
            detail::store8(dst + p.half_dim + first, hi);
          }
        } else {
          for (const int at : {first, p.half_dim + first}) {
            float value = __bfloat162float(qkv_row[head * dim + at]);
            if (p.qkv_bias != nullptr) value = add_bias_bf16(value, __bfloat162float(p.qkv_bias[head * dim + at]));
            v_row[at] = __float2bfloat16_rn(value);
            if (dst != nullptr) dst[at] = __float2bfloat16_rn(value);
          }
        }
        continue;
      }
      const __nv_bfloat16* src = p.v + (token * p.kv_heads + kv_head) * dim;
      if constexpr (kWidth == kBf16PerVector) {  // 16-byte copies (the launcher checked the alignment)
        *reinterpret_cast<uint4*>(dst + first) = *reinterpret_cast<const uint4*>(src + first);
        *reinterpret_cast<uint4*>(dst + p.half_dim + first) = *reinterpret_cast<const uint4*>(src + p.half_dim + first);
      } else {
        dst[first] = src[first];
        dst[p.half_dim + first] = src[p.half_dim + first];
      }
      continue;
    }
    const bool is_k = head >= p.q_heads;
    __nv_bfloat16* x = !is_k ? p.q + (token * p.q_heads + head) * dim
                             : p.k + (token * p.kv_heads + (head - p.q_heads)) * dim;
    // where the head's values come from: x itself (in place), or the fused product's row (qkv)
    const __nv_bfloat16* in = qkv_row != nullptr ? qkv_row + head * dim : x;
    const __nv_bfloat16* in_bias = qkv_row != nullptr && p.qkv_bias != nullptr ? p.qkv_bias + head * dim : nullptr;
    // the rotated k row's cache copy, or null
    __nv_bfloat16* cached = is_k && cache_row >= 0 ? p.k_cache + (cache_row * p.kv_heads + (head - p.q_heads)) * dim
                                                   : nullptr;
    if constexpr (kWidth == kBf16PerVector) {
      float lo[8], hi[8], new_lo[8], new_hi[8];
      detail::load8(in + first, lo);
      detail::load8(in + p.half_dim + first, hi);
      if (in_bias != nullptr) {
        float b_lo[8], b_hi[8];
        detail::load8(in_bias + first, b_lo);
        detail::load8(in_bias + p.half_dim + first, b_hi);
#pragma unroll
        for (int j = 0; j < 8; ++j) lo[j] = add_bias_bf16(lo[j], b_lo[j]), hi[j] = add_bias_bf16(hi[j], b_hi[j]);
      }
      if (p.q_norm != nullptr) {
        // The head's `groups` threads are consecutive lanes of one warp (groups a power of two <= 32, the
        // block a multiple of 32 threads, every head's items consecutive), and all of them take this branch.
        float sum_squares = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) sum_squares += lo[j] * lo[j] + hi[j] * hi[j];
        const int lane = int(threadIdx.x % 32);
        const unsigned group_mask = groups == 32 ? 0xffffffffu : ((1u << groups) - 1u) << (lane & ~(groups - 1));
        for (int offset = groups / 2; offset > 0; offset /= 2) sum_squares += __shfl_xor_sync(group_mask, sum_squares, offset);
        const float inv_rms = rsqrtf(sum_squares / float(dim) + p.norm_eps);
        const __nv_bfloat16* weight = is_k ? p.k_norm : p.q_norm;
        float w_lo[8], w_hi[8];
        detail::load8(weight + first, w_lo);
        detail::load8(weight + p.half_dim + first, w_hi);
#pragma unroll
        for (int j = 0; j < 8; ++j) {  // as rms_norm: x · inv_rms · w, rounded once to bf16
          lo[j] = __bfloat162float(__float2bfloat16_rn(lo[j] * inv_rms * w_lo[j]));
          hi[j] = __bfloat162float(__float2bfloat16_rn(hi[j] * inv_rms * w_hi[j]));
        }
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float c = cos_table[first + j], s = sin_table[first + j];
        new_lo[j] = lo[j] * c - hi[j] * s;
        new_hi[j] = hi[j] * c + lo[j] * s;
      }
      detail::store8(x + first, new_lo);
      detail::store8(x + p.half_dim + first, new_hi);
      if (cached != nullptr) {
        detail::store8(cached + first, new_lo);
        detail::store8(cached + p.half_dim + first, new_hi);
      }
    } else {
      float lo = __bfloat162float(in[first]), hi = __bfloat162float(in[first + p.half_dim]);
      if (in_bias != nullptr) {
        lo = add_bias_bf16(lo, __bfloat162float(in_bias[first]));
        hi = add_bias_bf16(hi, __bfloat162float(in_bias[first + p.half_dim]));
      }
      const float c = cos_table[first], s = sin_table[first];
      const __nv_bfloat16 new_lo = __float2bfloat16_rn(lo * c - hi * s), new_hi = __float2bfloat16_rn(hi * c + lo * s);
      x[first] = new_lo;
      x[first + p.half_dim] = new_hi;
      if (cached != nullptr) {
        cached[first] = new_lo;
        cached[first + p.half_dim] = new_hi;
      }
    }
  }
}

// ---- launchers ----------------------------------------------------------------------------------------

constexpr int kMaxRopeThreads = 512;

// rope_kv_write_from_qkv's source: the fused product and its bias (undefined: none).
struct QkvSource {
  Tensor qkv;
  Tensor bias;
};

// rope, and with `w` (rope_kv_write) the cache write in the same kernel; the QK-norm fused where it can be.
// With `src` (and w) q, k and v come from the fused product (RopeKernelParams::qkv); returns false, enqueuing
// nothing, where a QK-norm cannot be fused then (its rms_norm-first fallback needs q and k split already).
bool launch_rope(const ops::RopeParams& p, const ops::KvWriteParams* w, const QkvSource* src, cudaStream_t stream) {
  const int64_t tokens = p.q.dim(0), q_heads = p.q.dim(1), kv_heads = p.k.dim(1), half_dim = p.q.dim(2) / 2;
  if (tokens == 0 || half_dim == 0 || q_heads + kv_heads == 0) return true;
  LMX_CHECK(tokens <= 0x7fffffff && q_heads + 2 * kv_heads <= 0x7fffffff / half_dim);
  bool vector = half_dim % kBf16PerVector == 0 && detail::aligned16(p.q.data) && detail::aligned16(p.k.data);
  if (w != nullptr) {
    vector = vector && detail::aligned16(w->v.data) && detail::aligned16(w->k_cache.data) &&
             detail::aligned16(w->v_cache.data);
  }
  if (src != nullptr) {
    vector = vector && detail::aligned16(src->qkv.data) && (!src->bias.defined() || detail::aligned16(src->bias.data));
  }
  if (p.has_qk_norm()) {
    const int64_t groups = half_dim / kBf16PerVector;
    const bool fuse = vector && groups <= 32 && (groups & (groups - 1)) == 0 && detail::aligned16(p.q_norm.data) &&
                      detail::aligned16(p.k_norm.data);
    if (!fuse) {  // rms_norm on the [T·H, D] views first, then the rotation alone
      if (src != nullptr) return false;
      for (const auto& [x, weight] : {std::pair{p.q, p.q_norm}, std::pair{p.k, p.k_norm}}) {
        const Tensor rows = x.reshape({x.dim(0) * x.dim(1), x.dim(2)});
        rms_norm({.x = rows, .weight = weight, .eps = p.norm_eps, .out = rows}, stream);
      }
      return launch_rope(ops::without_qk_norm(p), w, nullptr, stream);
    }
  }
  const int width = vector ? kBf16PerVector : 1;
  // GPT-OSS (Hq 64, Hkv 8, D 64): 72 heads * 4 groups = 288 threads, one group each (80 with the cache write).
  const int64_t items = (q_heads + kv_heads + (w != nullptr || src != nullptr ? kv_heads : 0)) * (half_dim / width);
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
                                .attention_scaling = p.attention_scaling,
                                .v = w != nullptr ? static_cast<const __nv_bfloat16*>(w->v.data) : nullptr,
                                .kv_write_index = w != nullptr ? static_cast<const int32_t*>(w->kv_write_index.data)
                                                               : nullptr,
                                .k_cache = w != nullptr ? static_cast<__nv_bfloat16*>(w->k_cache.data) : nullptr,
                                .v_cache = w != nullptr ? static_cast<__nv_bfloat16*>(w->v_cache.data) : nullptr,
                                .q_norm = p.has_qk_norm() ? static_cast<const __nv_bfloat16*>(p.q_norm.data) : nullptr,
                                .k_norm = p.has_qk_norm() ? static_cast<const __nv_bfloat16*>(p.k_norm.data) : nullptr,
                                .norm_eps = p.norm_eps,
                                .qkv = src != nullptr ? static_cast<const __nv_bfloat16*>(src->qkv.data) : nullptr,
                                .qkv_bias = src != nullptr && src->bias.defined()
                                                ? static_cast<const __nv_bfloat16*>(src->bias.data)
                                                : nullptr,
                                .v_out = src != nullptr ? static_cast<__nv_bfloat16*>(w->v.data) : nullptr};
  if (vector) {
    detail::launch(rope_kernel<kBf16PerVector>, dim3(unsigned(tokens)), dim3(threads), smem, stream, params);
  } else {
    detail::launch(rope_kernel<1>, dim3(unsigned(tokens)), dim3(threads), smem, stream, params);
  }
  LMX_CUDA_CHECK_LAUNCH();
  return true;
}

}  // namespace

void rope(const ops::RopeParams& p, cudaStream_t stream) {
  ops::require(ops::check(p), "cuda::rope");
  detail::require_cuda("rope", {{"q", &p.q}, {"k", &p.k}, {"positions", &p.positions}, {"inv_freq", &p.inv_freq}});
  if (p.has_qk_norm()) detail::require_cuda("rope", {{"q_norm", &p.q_norm}, {"k_norm", &p.k_norm}});
  detail::require_bf16_activation("rope", "q", p.q);
  launch_rope(p, nullptr, nullptr, stream);
}

void rope_kv_write(const ops::RopeParams& r, const ops::KvWriteParams& w, cudaStream_t stream) {
  ops::require(ops::check(r), "cuda::rope_kv_write");
  ops::require(ops::check(w), "cuda::rope_kv_write");
  detail::require_cuda("rope_kv_write", {{"q", &r.q}, {"k", &r.k}, {"positions", &r.positions},
                                         {"inv_freq", &r.inv_freq}, {"v", &w.v}, {"kv_write_index", &w.kv_write_index},
                                         {"k_cache", &w.k_cache}, {"v_cache", &w.v_cache}});
  if (r.has_qk_norm()) detail::require_cuda("rope_kv_write", {{"q_norm", &r.q_norm}, {"k_norm", &r.k_norm}});
  detail::require_bf16_activation("rope_kv_write", "q", r.q);
  detail::require_bf16_activation("rope_kv_write", "k_cache", w.k_cache);
  if (w.k.data != r.k.data || w.k.shape_str() != r.k.shape_str()) {
    detail::contract_failure("rope_kv_write", "w.k", w.k, ("the rope's k, " + r.k.shape_str()).c_str());
  }
  launch_rope(r, &w, nullptr, stream);
}

bool rope_kv_write_from_qkv(const ops::RopeParams& r, const ops::KvWriteParams& w, const Tensor& qkv, const Tensor& bias,
                            cudaStream_t stream) {
  const char* op = "rope_kv_write_from_qkv";
  ops::require(ops::check(r), op);
  ops::require(ops::check(w), op);
  detail::require_cuda(op, {{"q", &r.q}, {"k", &r.k}, {"positions", &r.positions}, {"inv_freq", &r.inv_freq},
                            {"v", &w.v}, {"kv_write_index", &w.kv_write_index}, {"k_cache", &w.k_cache},
                            {"v_cache", &w.v_cache}, {"qkv", &qkv}});
  if (r.has_qk_norm()) detail::require_cuda(op, {{"q_norm", &r.q_norm}, {"k_norm", &r.k_norm}});
  detail::require_bf16_activation(op, "q", r.q);
  detail::require_bf16_activation(op, "k_cache", w.k_cache);
  if (w.k.data != r.k.data || w.k.shape_str() != r.k.shape_str()) {
    detail::contract_failure(op, "w.k", w.k, ("the rope's k, " + r.k.shape_str()).c_str());
  }
  const int64_t tokens = r.q.dim(0), width = (r.q.dim(1) + 2 * r.k.dim(1)) * r.q.dim(2);
  if (qkv.dtype != DType::BF16 || qkv.ndim != 2 || qkv.dim(0) != tokens || qkv.dim(1) != width) {
    detail::contract_failure(op, "qkv", qkv,
                             ("[" + std::to_string(tokens) + ", " + std::to_string(width) + "] BF16 (q|k|v rows)").c_str());
  }
  if (bias.defined() && (bias.dtype != DType::BF16 || bias.ndim != 1 || bias.dim(0) != width ||
                         bias.device != Device::kCuda)) {
    detail::contract_failure(op, "bias", bias, ("[" + std::to_string(width) + "] BF16 on cuda, or undefined").c_str());
  }
  const QkvSource src{.qkv = qkv, .bias = bias};
  return launch_rope(r, &w, &src, stream);
}

}  // namespace lmx::cuda
