// LinearRunner (linear.cuh): out = x·Wᵀ + b. Two paths:
//  - few rows (T <= 16; outputs up to LinearRunner::set_skinny_max_out, default 1024; any width when forced
//    with LinearPath::kSkinny): skinny_kernel, a weight-streaming GEMV on tensor cores. One mma.sync
//    m16n8k16 takes the (up to) 16 rows of x as A and 8 weight rows as B. Each lane loads 16 contiguous
//    bytes of a weight row and of two x rows per 32-wide k chunk; because a dot product does not care about
//    the order of k, the 8 values a lane holds are given to two mmas under one fixed permutation of k
//    (the same for A and B), so no shuffles and only 16-byte loads. 8 warps split `in`, reduce in shared
//    memory, add the bias, and store bf16 or f32. Rows >= T re-read row T-1 and are never stored. Narrow
//    products (the router) also split `in` over a cluster of 8 CTAs, reduced through distributed shared
//    memory; the CTA's weight rows are prefetched into L2 before the PDL wait.
//  - otherwise cuBLASLt. Row-major x [T, in] and W [out, in] are column-major xᵀ [in, T] and Wᵀ [in, out], so
//    outᵀ [out, T] (= row-major out) = op(W)·x with op = T: the "TN" GEMM, both operands K-contiguous. The
//    algorithm per (T, in, rows, ldc, out dtype, alignments) comes from the heuristic once and is cached; the bias
//    is a small kernel after it. (cuBLASLt's BIAS epilogue was tried and reverted: it passed the standalone
//    parity test but broke the GPT-OSS fixture's LoRA requests, docs/perf-log.md run 15.)
//    An output width that is not a multiple of 64 (set_split_row_align: or 128) runs as two products, the
//    first 64·⌊out/64⌋ rows of W and the rest: at an odd width (GPT-OSS's LM head served with its tokenizer, 200019 logits) cuBLASLt's
//    candidates read the weight at a quarter of the bandwidth (T 16: 1119 µs, against 270 at 199936 rows; the
//    same with output rows padded to 16 bytes). Split, it takes 391 µs (perf-log runs 81-85): the rest of the
//    gap was the ragged row stride of out (the 83-row tail takes 7 µs; run 86): where a row of out is not a
//    multiple of 16 bytes the two products write rows padded to 16 bytes into the runner's scratch, and the
//    bias kernel's pass copies them into out. Widths that are multiples of 128 are fast: 201088 = 128 · 1571
//    took 271.
#include "backends/cuda/linear.cuh"

#include <cublasLt.h>
#include <cuda_bf16.h>

#include <cooperative_groups.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "backends/cuda/check.h"
#include "backends/cuda/device.cuh"
#include "backends/cuda/launch.cuh"
#include "ops/backend.h"

#define LMX_CUBLAS_CHECK(call)                                                                      \
  do {                                                                                              \
    cublasStatus_t lmx_status_ = (call);                                                            \
    if (lmx_status_ != CUBLAS_STATUS_SUCCESS) {                                                     \
      std::fprintf(stderr, "loramux: cuBLASLt error at %s:%d: %s: %d\n", __FILE__, __LINE__, #call, \
                   int(lmx_status_));                                                               \
      std::abort();                                                                                 \
    }                                                                                               \
  } while (0)

namespace lmx::cuda {
namespace {

namespace cg = cooperative_groups;

// ---- kernels ------------------------------------------------------------------------------------------

struct FinishKernelParams {
  const void* src;            // [rows, src_ld] bf16 or f32: cuBLASLt's product (src_ld >= cols; may be out)
  void* out;                  // [rows, cols], the same dtype
  const __nv_bfloat16* bias;  // [cols] bf16 or null
  int64_t rows, cols, src_ld;
};

// out[t, o] = src[t, o] (+ bias[o], rounded once more): the bias after cuBLASLt (src == out), and the copy of
// a product written with padded rows (src_ld > cols). Rows stride over grid y, columns over grid x.
// PRECOND: src == out implies src_ld == cols; otherwise the two do not overlap.
template <typename Out>
__global__ static void finish_product_kernel(const __grid_constant__ FinishKernelParams p) {
  detail::pdl_enter();  // first: launched by detail::launch (launch.cuh)
  const auto* src = static_cast<const Out*>(p.src);
  auto* out = static_cast<Out*>(p.out);
  for (int64_t row = blockIdx.y; row < p.rows; row += gridDim.y) {
    const Out* src_row = src + row * p.src_ld;
    Out* out_row = out + row * p.cols;
    for (int64_t col = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; col < p.cols;
         col += int64_t(gridDim.x) * blockDim.x) {
      out_row[col] = p.bias ? Out(float(src_row[col]) + __bfloat162float(p.bias[col])) : src_row[col];
    }
  }
}

// The bf16 form of finish_product_kernel in 16-byte chunks (8 outputs a thread, the same rounding per element):
// the scalar kernel's 2-byte accesses took 12 µs a layer for GPT-OSS-20B's o_proj bias at T 1600 (2.7× the
// bytes' time). Chunks stride over the grid, row-major.
// PRECOND: cols % 8 == 0, src_ld % 8 == 0; src, out and bias 16-byte aligned; as finish_product_kernel.
__global__ static void finish_product_bf16x8_kernel(const __grid_constant__ FinishKernelParams p) {
  detail::pdl_enter();  // first: launched by detail::launch (launch.cuh)
  const int64_t row_chunks = p.cols / 8, chunks = p.rows * row_chunks;
  for (int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; c < chunks; c += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = c / row_chunks, col = (c % row_chunks) * 8;
    uint4 v = *reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(p.src) + row * p.src_ld + col);
    if (p.bias != nullptr) {
      const uint4 b = *reinterpret_cast<const uint4*>(p.bias + col);
      auto* vh = reinterpret_cast<__nv_bfloat162*>(&v);
      const auto* bh = reinterpret_cast<const __nv_bfloat162*>(&b);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 x = __bfloat1622float2(vh[i]), y = __bfloat1622float2(bh[i]);
        vh[i] = __floats2bfloat162_rn(x.x + y.x, x.y + y.y);
      }
    }
    *reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(p.out) + row * p.cols + col) = v;
  }
}

// ---- skinny (few-row) GEMM on tensor cores ----

struct SkinnyKernelParams {
  const __nv_bfloat16* x;     // [T, in] bf16
  const __nv_bfloat16* w;     // [out, in] bf16
  const __nv_bfloat16* bias;  // [out] bf16 or null
  void* y;                    // [T, out] bf16 or f32
  int tokens, in, out;
  // The router's top-k as the grid's tail (LinearRunner::route; y then holds the f32 logits): null unless.
  int* done;              // per row block (gridDim.z): CTAs that stored their outputs; 0 between launches
  int32_t* topk_ids;      // [T, K] i32
  float* topk_weights;    // [T, K] f32
  int top_k;
  bool softmax_first, renormalize;
};

constexpr int kSkinnyMaxRows = 16;
constexpr int kSkinnyWarps = 8;   // split `in`
constexpr int kSkinnyNTiles = 2;  // n8 tiles per warp: 16 outputs per CTA
constexpr int kSkinnyUnroll = 4;  // 32-wide k chunks in flight per warp
constexpr int kSkinnyOutPerCta = 8 * kSkinnyNTiles;
constexpr int kSkinnySplit = 8;   // CTAs of a cluster splitting `in` for narrow products
// A prompt's route over more than 32 experts (LinearRunner::route, set_wide_route): 64 outputs a CTA (8 n8
// tiles a warp, one 32-wide k chunk in flight a warp), so each 16-row block's x is read by E / 64 CTAs
// instead of E / 16 (Qwen3-30B-A3B's E 128: 200 CTAs at T 1600 instead of 800, 32.4 µs a layer, perf-log run 200).
constexpr int kRouteWideNTiles = 8, kRouteWideUnroll = 1;
// LinearRunner::route's counters (one per 16-row block): routes of up to 16 · 4096 tokens take one kernel.
constexpr int kRouteRowBlocks = 4096;

__device__ __forceinline__ void mma_bf16_16x8x16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                 uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Grid: ceil(out / 16) × kSplit CTAs of 8 warps. Lane (g = lane / 4, q = lane % 4) loads, per 32-wide chunk
// at k0, x rows g and g + 8 and weight rows n0 + g (+ 8 for the second tile) at k0 + 8q .. k0 + 8q + 7.
// Before the PDL wait (the only global accesses there; weights are never written by a kernel): the CTA's
// weight rows — one contiguous run of up to 16 · in bf16, a 1/kSplit share of it per CTA of a cluster — are
// prefetched into L2 with bulk prefetches, so a CTA that becomes resident in the previous kernel's tail (a
// norm, attention) pulls its weights from DRAM meanwhile, and its own loads after the wait hit L2.
// kSplit > 1 (narrow products: the router's 32 outputs were 2 CTAs, ~11 µs of latency): a thread-block
// cluster of kSplit CTAs along y splits `in`; each CTA reduces its warps in shared memory, then CTA 0 of
// the cluster adds the peers' partials through distributed shared memory in rank order (deterministic),
// adds the bias and stores.
// Row blocks (gridDim.z, LinearRunner::route of a prompt): block z takes rows 16z .. 16z + 15 as a product of
// its own (its weight prefetch only in block 0; the others read the weights from L2).
// With p.done (the router, LinearRunner::route): each CTA that stored outputs (rank 0 of each cluster) counts
// itself on its row block's counter p.done[z] after a device-scope fence; the last one ranks the block's
// tokens' logits with detail::router_topk_warp (a warp a token, logits read through L2), the same function as
// routing.cu's kernel, so ids and weights match the two kernels one after the other bit for bit; then it
// resets its counter.
// PRECOND: 1 <= T <= 16 · gridDim.z; in % 8 == 0; x, w 16-byte aligned with rows of `in` elements; launched
// with cluster dims (1, kSplit, 1) and gridDim.y == kSplit when kSplit > 1; with p.done: Out is float,
// p.done[0 .. gridDim.z) == 0 and no other grid uses them meanwhile (one set per stream), 1 <= K <= min(out,
// kRouterMaxTopK).
// The launch bounds name 2 CTAs an SM: without a minimum ptxas held the kernel to 42 registers and issued
// the loop's 16 loads in four groups of 4, each waiting for the MMAs of the one before (four round trips an
// iteration instead of one: o_proj at 1.37 TB/s on the H100, perf-log run 157); at 2 it keeps all 16 in
// flight (98 registers; 2 · 256 · 98 fit the 64K registers).
// kNTiles / kUnroll: n8 tiles a warp (outputs a CTA: 8 · kNTiles) and k chunks in flight; a warp's sum over
// its k chunks runs in the same order whatever they are, so every form gives the same bits.
template <typename Out, int kSplit, int kNTiles = kSkinnyNTiles, int kUnroll = kSkinnyUnroll>
__global__ static void __launch_bounds__(32 * kSkinnyWarps, 2) skinny_kernel(const __grid_constant__ SkinnyKernelParams p) {
  constexpr int kOutPerCta = 8 * kNTiles;
  const int n0 = blockIdx.x * kOutPerCta;
  const int r0 = int(blockIdx.z) * kSkinnyMaxRows, tokens = min(kSkinnyMaxRows, p.tokens - r0);  // this row block
  if (blockIdx.z == 0) {
    const int rows = min(kOutPerCta, p.out - n0);
    const char* first = reinterpret_cast<const char*>(p.w + int64_t(n0) * p.in);
    const int64_t bytes = int64_t(rows) * p.in * int64_t(sizeof(__nv_bfloat16));  // a multiple of 16
    const int64_t share = kSplit > 1 ? int64_t(blockIdx.y) : 0;
    const int64_t begin = (bytes / 16 * share / kSplit) * 16, end = (bytes / 16 * (share + 1) / kSplit) * 16;
    detail::prefetch_l2(first + begin, end - begin);  // 16 KB a thread: 32 KB..92 KB per CTA
  }
  detail::pdl_enter();  // then the PDL entry of launch.cuh: x is read and y written only after it
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const int chunks = (p.in + 31) / 32;
  const int split = kSplit > 1 ? int(blockIdx.y) : 0;
  const int split_begin = split * chunks / kSplit, split_chunks = (split + 1) * chunks / kSplit - split_begin;
  const int c_begin = split_begin + warp * split_chunks / kSkinnyWarps;
  const int c_end = split_begin + (warp + 1) * split_chunks / kSkinnyWarps;
  const __nv_bfloat16* x_lo = p.x + int64_t(r0 + min(g, tokens - 1)) * p.in;
  const __nv_bfloat16* x_hi = p.x + int64_t(r0 + min(g + 8, tokens - 1)) * p.in;
  const __nv_bfloat16* w_rows[kNTiles];
#pragma unroll
  for (int j = 0; j < kNTiles; ++j) w_rows[j] = p.w + int64_t(min(n0 + 8 * j + g, p.out - 1)) * p.in;

  float acc[kNTiles][4] = {};
  for (int c = c_begin; c < c_end; c += kUnroll) {
    uint4 xa[kUnroll], xb[kUnroll], wv[kUnroll][kNTiles];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {  // every load unconditional (clamped), then masked by value
      const int k = (c + u) * 32 + 8 * q;
      const int kk = min(k, p.in - 8);
      xa[u] = *reinterpret_cast<const uint4*>(x_lo + kk);
      xb[u] = *reinterpret_cast<const uint4*>(x_hi + kk);
#pragma unroll
      for (int j = 0; j < kNTiles; ++j) wv[u][j] = *reinterpret_cast<const uint4*>(w_rows[j] + kk);
      if (c + u >= c_end || k >= p.in) xa[u] = xb[u] = make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int j = 0; j < kNTiles; ++j) {
        mma_bf16_16x8x16(acc[j], xa[u].x, xb[u].x, xa[u].y, xb[u].y, wv[u][j].x, wv[u][j].y);
        mma_bf16_16x8x16(acc[j], xa[u].z, xb[u].z, xa[u].w, xb[u].w, wv[u][j].z, wv[u][j].w);
      }
    }
  }
  // C fragment: acc[j][0..1] = (row g, cols 8j + 2q, +1), acc[j][2..3] = (row g + 8, same cols).
  __shared__ float partial[kSkinnyWarps][kSkinnyMaxRows][kOutPerCta];
#pragma unroll
  for (int j = 0; j < kNTiles; ++j) {
    partial[warp][g][8 * j + 2 * q] = acc[j][0];
    partial[warp][g][8 * j + 2 * q + 1] = acc[j][1];
    partial[warp][g + 8][8 * j + 2 * q] = acc[j][2];
    partial[warp][g + 8][8 * j + 2 * q + 1] = acc[j][3];
  }
  __syncthreads();
  // Each thread then owns kPerThread outputs of the CTA: output o = threadIdx.x + 256 i, (row, col) = (o / kOutPerCta,
  // o % kOutPerCta); the warps' partials summed in warp order.
  constexpr int kOutputs = kSkinnyMaxRows * kOutPerCta, kPerThread = kOutputs / (32 * kSkinnyWarps);
  static_assert(kOutputs % (32 * kSkinnyWarps) == 0, "whole outputs a thread");
  static_assert(kSplit == 1 || kPerThread == 1, "the cluster split reduces one output a thread");
  float sums[kPerThread];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int o = int(threadIdx.x) + 32 * kSkinnyWarps * i;
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kSkinnyWarps; ++w) sum += partial[w][o / kOutPerCta][o % kOutPerCta];
    sums[i] = sum;
  }
  if constexpr (kSplit > 1) {
    __shared__ float cta_sum[kOutputs];  // this CTA's share, read by cluster rank 0
    cta_sum[threadIdx.x] = sums[0];
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();  // every CTA's share written (release / acquire at cluster scope)
    if (cluster.block_rank() == 0) {
      sums[0] = 0.0f;
      for (int r = 0; r < kSplit; ++r) sums[0] += cluster.map_shared_rank(cta_sum, r)[threadIdx.x];
    }
    cluster.sync();  // the peers' shared memory stays alive until rank 0 has read it
    if (cluster.block_rank() != 0) return;
  }
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int o = int(threadIdx.x) + 32 * kSkinnyWarps * i, row = o / kOutPerCta, n = n0 + o % kOutPerCta;
    if (row < tokens && n < p.out) {
      const float sum = p.bias != nullptr ? sums[i] + __bfloat162float(p.bias[n]) : sums[i];
      static_cast<Out*>(p.y)[int64_t(r0 + row) * p.out + n] = Out(sum);
    }
  }
  if constexpr (std::is_same_v<Out, float>) {
    if (p.done == nullptr) return;
    __shared__ bool last;
    __syncthreads();  // every store of this CTA issued
    if (threadIdx.x == 0) {
      __threadfence();  // cumulative: the CTA's stores, ordered before by the barrier, are visible first
      const int finished = atomicAdd(p.done + blockIdx.z, 1);
      __threadfence();  // acquire: the other CTAs' stores, fenced before their counts, are visible after
      last = finished == int(gridDim.x) - 1;
    }
    __syncthreads();
    if (!last) return;
    for (int token = r0 + warp; token < r0 + tokens; token += kSkinnyWarps) {
      detail::router_topk_warp(static_cast<const float*>(p.y) + int64_t(token) * p.out, p.out, p.top_k,
                               p.softmax_first, p.renormalize, p.topk_ids + int64_t(token) * p.top_k,
                               p.topk_weights + int64_t(token) * p.top_k);
    }
    if (threadIdx.x == 0) p.done[blockIdx.z] = 0;  // seen by the next launch: it waits for this grid (launch.cuh)
  }
}

// Launch of skinny_kernel<Out, kSplit>: PDL as launch.cuh, plus the cluster dims when kSplit > 1.
template <typename Out, int kSplit, int kNTiles = kSkinnyNTiles, int kUnroll = kSkinnyUnroll>
void launch_skinny(const SkinnyKernelParams& params, unsigned column_blocks, unsigned row_blocks, cudaStream_t stream) {
  cudaLaunchAttribute attributes[2] = {};
  attributes[0].id = cudaLaunchAttributeClusterDimension;
  attributes[0].val.clusterDim.x = 1;
  attributes[0].val.clusterDim.y = unsigned(kSplit);
  attributes[0].val.clusterDim.z = 1;
  attributes[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attributes[1].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(column_blocks, unsigned(kSplit), row_blocks);
  config.blockDim = dim3(32 * kSkinnyWarps);
  config.stream = stream;
  config.attrs = kSplit > 1 ? attributes : attributes + 1;
  config.numAttrs = (kSplit > 1 ? 1 : 0) + (programmatic_launches() ? 1 : 0);
  LMX_CUDA_CHECK(cudaLaunchKernelEx(&config, skinny_kernel<Out, kSplit, kNTiles, kUnroll>, params));
}

constexpr size_t kWorkspaceBytes = size_t(32) << 20;  // cuBLASLt's recommendation for Hopper is 32 MiB

int alignment_of(const void* p) {
  const auto bits = reinterpret_cast<uintptr_t>(p);
  for (int a : {256, 128, 64, 32, 16, 8, 4}) {
    if (bits % uintptr_t(a) == 0) return a;
  }
  return 2;
}

}  // namespace

// ---- launchers ----------------------------------------------------------------------------------------

constexpr int64_t kAutotuneMaxRows = 16;  // products of at most this many rows time their candidates
constexpr int kAutotuneCandidates = 8;
constexpr int kAutotuneReps = 5;

// Index of the fastest of cuBLASLt's candidates for one product: each runs kAutotuneReps times from a cold L2
// (a write of twice the L2 before each run, as a decode step streams its weights from HBM), timed by events,
// median kept. Host-synchronizing, so only outside stream capture (inside one, or when anything fails,
// candidate 0: the heuristic's own choice). run(algo) enqueues the product on `stream` and returns cuBLASLt's
// status; a candidate that fails is skipped.
int fastest_candidate(std::span<const cublasLtMatmulHeuristicResult_t> candidates,
                      const std::function<cublasStatus_t(const cublasLtMatmulAlgo_t&)>& run, cudaStream_t stream) {
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capturing) != cudaSuccess || capturing != cudaStreamCaptureStatusNone) return 0;
  int device = 0, l2_bytes = 0;
  LMX_CUDA_CHECK(cudaGetDevice(&device));
  LMX_CUDA_CHECK(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device));
  const size_t flush_bytes = size_t(std::max(l2_bytes, 1 << 20)) * 2;
  void* flush = nullptr;
  if (cudaMalloc(&flush, flush_bytes) != cudaSuccess) {
    cudaGetLastError();  // clear the failed allocation: untimed, the heuristic's choice
    return 0;
  }
  cudaEvent_t start = nullptr, stop = nullptr;
  LMX_CUDA_CHECK(cudaEventCreate(&start));
  LMX_CUDA_CHECK(cudaEventCreate(&stop));
  int best = 0;
  float best_ms = 0.0f;
  bool timed = false;
  for (size_t c = 0; c < candidates.size(); ++c) {
    if (candidates[c].state != CUBLAS_STATUS_SUCCESS) continue;
    std::vector<float> ms;
    for (int rep = 0; rep < kAutotuneReps; ++rep) {
      LMX_CUDA_CHECK(cudaMemsetAsync(flush, rep, flush_bytes, stream));
      LMX_CUDA_CHECK(cudaEventRecord(start, stream));
      const cublasStatus_t status = run(candidates[c].algo);
      LMX_CUDA_CHECK(cudaEventRecord(stop, stream));
      LMX_CUDA_CHECK(cudaEventSynchronize(stop));
      if (status != CUBLAS_STATUS_SUCCESS) break;
      float elapsed = 0.0f;
      LMX_CUDA_CHECK(cudaEventElapsedTime(&elapsed, start, stop));
      ms.push_back(elapsed);
    }
    if (ms.size() != size_t(kAutotuneReps)) continue;
    std::nth_element(ms.begin(), ms.begin() + kAutotuneReps / 2, ms.end());
    const float median = ms[kAutotuneReps / 2];
    if (!timed || median < best_ms) best = int(c), best_ms = median, timed = true;
  }
  LMX_CUDA_CHECK(cudaEventDestroy(start));
  LMX_CUDA_CHECK(cudaEventDestroy(stop));
  LMX_CUDA_CHECK(cudaStreamSynchronize(stream));
  LMX_CUDA_CHECK(cudaFree(flush));
  return best;
}

struct LinearRunner::State {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  // (T, in, rows, ldc, out dtype (+1000: accumulating), alignment of x, W, out, lda) -> algorithm
  std::map<std::tuple<int64_t, int64_t, int64_t, int64_t, int, int, int, int, int64_t>, cublasLtMatmulAlgo_t> algos;
  void* padded = nullptr;  // a ragged product's rows padded to 16 bytes (see the top), grown outside captures
  size_t padded_bytes = 0;
  uint64_t epoch = 0;      // bumped when `padded` moves
  int* route_done = nullptr;  // route()'s counters of finished CTAs, one per row block (skinny_kernel), 0 between
};

LinearRunner::LinearRunner() : state_(std::make_unique<State>()) {
  LMX_CUBLAS_CHECK(cublasLtCreate(&state_->handle));
  LMX_CUDA_CHECK(cudaMalloc(&state_->workspace, kWorkspaceBytes));
  LMX_CUDA_CHECK(cudaMalloc(&state_->route_done, kRouteRowBlocks * sizeof(int)));
  LMX_CUDA_CHECK(cudaMemset(state_->route_done, 0, kRouteRowBlocks * sizeof(int)));
}

void LinearRunner::set_autotune(bool on) {
  autotune_ = on;
  state_->algos.clear();
}

LinearRunner::~LinearRunner() {
  if (state_->workspace) cudaFree(state_->workspace);
  if (state_->padded) cudaFree(state_->padded);
  if (state_->route_done) cudaFree(state_->route_done);
  if (state_->handle) cublasLtDestroy(state_->handle);
}

// kAuto: cuBLASLt reads wide weights faster than the skinny kernel (docs/perf-log.md runs 9 and 24), but
// narrow products (the router's 32 columns) cost it ~12 µs each (run 14's profile), far above their bytes:
// those take the skinny kernel. So do narrowing products (out <= in: o_proj), where cuBLASLt sat at ~53% of
// the bytes floor (run 96): decode step −0.035 to −0.11 ms in five runs (perf-log runs 130–138, H100 on
// MXFP4 experts and H200 on bf16; the bench's row "same, o_proj on the skinny kernel").
uint64_t LinearRunner::memory_epoch() const { return state_->epoch; }

bool LinearRunner::takes_skinny(const ops::LinearParams& p) const {
  const int64_t tokens = p.x.dim(0), in = p.x.dim(1), out = p.weight.dim(0);
  const bool skinny_fits = tokens <= kSkinnyMaxRows && in % 8 == 0;
  const bool narrow = out <= skinny_max_out_ || (skinny_narrowing_ && out <= in);
  const bool skinny = path_ == LinearPath::kSkinny || (path_ == LinearPath::kAuto && narrow);
  return skinny && skinny_fits && detail::aligned16(p.x.data) && detail::aligned16(p.weight.data);
}

// One cuBLASLt product: rows `rows` of W (from w) times x into c, whose rows (output rows of `out`) are ldc
// elements apart. The algorithm per (T, in, rows, ldc, dtype, alignments) is cached.
void LinearRunner::cublas_product(const void* w, const void* x, void* c, int64_t tokens, int64_t in, int64_t rows,
                                  int64_t ldc, int out_type_value, cudaStream_t stream, int64_t lda, bool accumulate) {
  if (lda == 0) lda = in;
  const auto out_type = cudaDataType_t(out_type_value);
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a_layout = nullptr, b_layout = nullptr, c_layout = nullptr;
  LMX_CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t transpose = CUBLAS_OP_T, none = CUBLAS_OP_N;
  LMX_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof(transpose)));
  LMX_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &none, sizeof(none)));
  // Column-major: A = W as [in, out] (op T -> [out, in]), B = x as [in, T], C = out as [out, T].
  LMX_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&a_layout, CUDA_R_16BF, uint64_t(in), uint64_t(rows), lda));
  LMX_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&b_layout, CUDA_R_16BF, uint64_t(in), uint64_t(tokens), in));
  LMX_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&c_layout, out_type, uint64_t(rows), uint64_t(tokens), ldc));

  const int align_x = alignment_of(x), align_w = alignment_of(w), align_o = alignment_of(c);
  const auto key = std::make_tuple(tokens, in, rows, ldc, int(out_type) + (accumulate ? 1000 : 0), align_x, align_w,
                                   align_o, lda);
  auto found = state_->algos.find(key);
  if (found == state_->algos.end()) {
    cublasLtMatmulPreference_t preference = nullptr;
    LMX_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&preference));
    const uint64_t workspace = kWorkspaceBytes;
    const uint32_t aw = uint32_t(align_w), ax = uint32_t(align_x), ao = uint32_t(align_o);
    LMX_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                          &workspace, sizeof(workspace)));
    LMX_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aw, sizeof(aw)));
    LMX_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ax, sizeof(ax)));
    LMX_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ao, sizeof(ao)));
    LMX_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ao, sizeof(ao)));
    // Deterministic reductions only (split-K through the workspace, never accumulated in place in `out`):
    // the same batch gives the same bits on every call, in a graph or not.
    const uint32_t schemes = CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE |
                             CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE;
    LMX_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                                          &schemes, sizeof(schemes)));
    // Few rows (decode): the heuristic's first choice leaves bandwidth on the table for some shapes (o_proj
    // [16, 4096]·[2880, 4096]ᵀ at 51% of its bytes floor, perf-log run 9), so its candidates are timed once.
    // (never while accumulating: the timed runs would add into c)
    const bool tune = autotune_ && tokens <= kAutotuneMaxRows && !accumulate;
    cublasLtMatmulHeuristicResult_t results[kAutotuneCandidates]{};
    int count = 0;
    LMX_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(state_->handle, desc, a_layout, b_layout, c_layout, c_layout,
                                                    preference, tune ? kAutotuneCandidates : 1, results, &count));
    cublasLtMatmulPreferenceDestroy(preference);
    if (count == 0) {
      std::fprintf(stderr, "loramux: cuBLASLt has no algorithm for linear T %lld in %lld out %lld (ldc %lld)\n",
                   (long long)tokens, (long long)in, (long long)rows, (long long)ldc);
      std::abort();
    }
    int best = 0;
    if (tune && count > 1) {
      best = fastest_candidate(std::span(results, size_t(count)), [&](const cublasLtMatmulAlgo_t& algo) {
        const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
        return cublasLtMatmul(state_->handle, desc, &alpha, w, a_layout, x, b_layout, &beta, c, c_layout, c, c_layout,
                              &algo, state_->workspace, kWorkspaceBytes, stream);
      }, stream);
    }
    found = state_->algos.emplace(key, results[best].algo).first;
  }
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  LMX_CUBLAS_CHECK(cublasLtMatmul(state_->handle, desc, &alpha, w, a_layout, x, b_layout, &beta, c, c_layout, c,
                                  c_layout, &found->second, state_->workspace, kWorkspaceBytes, stream));
  cublasLtMatrixLayoutDestroy(a_layout);
  cublasLtMatrixLayoutDestroy(b_layout);
  cublasLtMatrixLayoutDestroy(c_layout);
  cublasLtMatmulDescDestroy(desc);
}

void LinearRunner::set_split_row_align(int rows) {
  if (rows != 64 && rows != 128) {
    throw std::invalid_argument("LinearRunner::set_split_row_align: rows = " + std::to_string(rows) +
                                ", expected 64 or 128");
  }
  row_align_ = rows;
}

void LinearRunner::accumulate(const Tensor& x, const Tensor& weight, int64_t weight_ld, const Tensor& out,
                              cudaStream_t stream) {
  detail::require_cuda("linear accumulate", {{"x", &x}, {"weight", &weight}, {"out", &out}});
  const int64_t tokens = x.dim(0), k = x.dim(1), n = weight.dim(0);
  if (x.dtype != DType::BF16 || weight.dtype != DType::BF16 || out.dtype != DType::BF16 || x.ndim != 2 ||
      weight.ndim != 2 || out.ndim != 2 || weight.dim(1) < k || weight_ld < weight.dim(1) || out.dim(0) != tokens ||
      out.dim(1) != n) {
    detail::contract_failure("linear accumulate", "out", out,
                             ("[T, n] bf16 with x [T, k] and weight [n, >= k] bf16, rows weight_ld apart (x " +
                              x.shape_str() + ", weight " + weight.shape_str() + ")").c_str());
  }
  if (tokens == 0 || n == 0) return;
  const int64_t main_rows = split_ragged_ && n > row_align_ ? n / row_align_ * row_align_ : n;
  cublas_product(weight.data, x.data, out.data, tokens, k, main_rows, n, CUDA_R_16BF, stream, weight_ld, true);
  if (main_rows < n) {
    cublas_product(static_cast<const char*>(weight.data) + main_rows * weight_ld * 2, x.data,
                   static_cast<char*>(out.data) + main_rows * 2, tokens, k, n - main_rows, n, CUDA_R_16BF, stream,
                   weight_ld, true);
  }
}

namespace {

// run()'s and route()'s checks beyond ops::check: where the tensors live and their dtypes on cuda.
void require_cuda_linear(const ops::LinearParams& p) {
  detail::require_cuda("linear", {{"x", &p.x}, {"weight", &p.weight}, {"out", &p.out}});
  detail::require_bf16_activation("linear", "x", p.x);
  if (p.weight.dtype != DType::BF16) detail::contract_failure("linear", "weight", p.weight, "[out, in] BF16");
  if (p.out.dtype != DType::BF16 && p.out.dtype != DType::F32) {
    detail::contract_failure("linear", "out", p.out, "[T, out] BF16 or F32");
  }
  if (p.bias.defined() && (p.bias.device != Device::kCuda || p.bias.dtype != DType::BF16)) {
    detail::contract_failure("linear", "bias", p.bias, "[out] BF16 on cuda");
  }
}

// The skinny kernel for p (LinearRunner::takes_skinny(p) holds, or route()'s rows form: T > 16 in row blocks
// of 16), with the router's top-k tail when `topk` has its `done` counters set (its other fields are the
// tail's; f32 out).
void run_skinny(const ops::LinearParams& p, const SkinnyKernelParams& topk, cudaStream_t stream, bool wide = false) {
  const int64_t tokens = p.x.dim(0), in = p.x.dim(1), out = p.weight.dim(0);
  LMX_CHECK(in < 0x7fffffff && out < 0x7fffffff);
  SkinnyKernelParams params = topk;
  params.x = static_cast<const __nv_bfloat16*>(p.x.data);
  params.w = static_cast<const __nv_bfloat16*>(p.weight.data);
  params.bias = p.bias.defined() ? static_cast<const __nv_bfloat16*>(p.bias.data) : nullptr;
  params.y = p.out.data;
  params.tokens = int(tokens);
  params.in = int(in);
  params.out = int(out);
  const unsigned row_blocks = detail::blocks_for(tokens, kSkinnyMaxRows);
  if (wide) {  // a prompt's route over many experts (LinearRunner::route): 64 outputs a CTA, no cluster split
    LMX_CHECK(p.out.dtype == DType::F32 && row_blocks > 1);
    launch_skinny<float, 1, kRouteWideNTiles, kRouteWideUnroll>(params, detail::blocks_for(out, 8 * kRouteWideNTiles),
                                                               row_blocks, stream);
    LMX_CUDA_CHECK_LAUNCH();
    return;
  }
  const unsigned blocks = detail::blocks_for(out, kSkinnyOutPerCta);
  // Fewer CTAs than a quarter of the SMs (the router at decode: 2): split `in` over a cluster of 8 CTAs.
  const bool split = int64_t(blocks) * row_blocks * 4 < 132 && in >= 32 * 8 * kSkinnySplit;
  if (p.out.dtype == DType::F32) {
    if (split) launch_skinny<float, kSkinnySplit>(params, blocks, row_blocks, stream);
    else launch_skinny<float, 1>(params, blocks, row_blocks, stream);
  } else {
    LMX_CHECK(params.done == nullptr);
    if (split) launch_skinny<__nv_bfloat16, kSkinnySplit>(params, blocks, row_blocks, stream);
    else launch_skinny<__nv_bfloat16, 1>(params, blocks, row_blocks, stream);
  }
  LMX_CUDA_CHECK_LAUNCH();
}

}  // namespace

void LinearRunner::run(const ops::LinearParams& p, cudaStream_t stream) {
  ops::require(ops::check(p), "cuda::linear");
  require_cuda_linear(p);
  const int64_t tokens = p.x.dim(0), in = p.x.dim(1), out = p.weight.dim(0);
  if (tokens == 0 || out == 0) return;
  if (path_ == LinearPath::kSkinny && !(tokens <= kSkinnyMaxRows && in % 8 == 0)) {
    detail::contract_failure("linear", "x", p.x, "T <= 16 and in % 8 == 0 for the forced skinny path");
  }
  if (takes_skinny(p)) {
    run_skinny(p, SkinnyKernelParams{}, stream);
    return;
  }
  const cudaDataType_t out_type = p.out.dtype == DType::F32 ? CUDA_R_32F : CUDA_R_16BF;
  // An output width that is not a multiple of row_align_ (GPT-OSS's LM head served with its tokenizer: 200019
  // logits) runs as two products: the aligned rows of W, then the few left, both into out (ldc = out).
  // Rows of out that are not a multiple of 16 bytes cost the first product ~110 µs more at 16 rows (perf-log
  // run 86): then both write into the runner's scratch with rows padded to 16 bytes, copied into out after.
  const int64_t element = p.out.dtype == DType::F32 ? 4 : 2;
  const int64_t main_rows = split_ragged_ && out > row_align_ ? out / row_align_ * row_align_ : out;
  const int64_t ldc = split_ragged_ && out * element % 16 != 0 ? (out * element + 15) / 16 * 16 / element : out;
  void* product = p.out.data;
  if (ldc != out) {
    const size_t bytes = size_t(tokens) * size_t(ldc) * size_t(element);
    if (bytes > state_->padded_bytes) {
      cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
      LMX_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
      if (capture != cudaStreamCaptureStatusNone) {
        std::fprintf(stderr, "loramux: cuda::linear: the padded product of T %lld out %lld needs a larger scratch "
                     "inside a stream capture; run the shape eagerly once first\n", (long long)tokens, (long long)out);
        std::abort();
      }
      LMX_CUDA_CHECK(cudaStreamSynchronize(stream));  // the old scratch may still be in use
      if (state_->padded) LMX_CUDA_CHECK(cudaFree(state_->padded));
      state_->padded = nullptr;
      LMX_CUDA_CHECK(cudaMalloc(&state_->padded, bytes));
      state_->padded_bytes = bytes;
      ++state_->epoch;
    }
    product = state_->padded;
  }
  cublas_product(p.weight.data, p.x.data, product, tokens, in, main_rows, ldc, out_type, stream);
  if (main_rows < out) {
    cublas_product(static_cast<const char*>(p.weight.data) + main_rows * in * 2, p.x.data,
                   static_cast<char*>(product) + main_rows * element, tokens, in, out - main_rows, ldc, out_type,
                   stream);
  }

  if (p.bias.defined() || product != p.out.data) {
    const FinishKernelParams params{.src = product,
                                    .out = p.out.data,
                                    .bias = p.bias.defined() ? static_cast<const __nv_bfloat16*>(p.bias.data) : nullptr,
                                    .rows = tokens,
                                    .cols = out,
                                    .src_ld = ldc};
    // ~4096 CTAs of 256 threads in all: columns first, then rows (at most 65535 along y).
    const int64_t column_blocks = std::min<int64_t>(detail::blocks_for(out, 256), 4096);
    const int64_t row_blocks = std::clamp<int64_t>(4096 / column_blocks, 1, std::min<int64_t>(tokens, 65535));
    const dim3 grid{unsigned(column_blocks), unsigned(row_blocks)};
    const bool by_chunks = finish_by_chunks_ && p.out.dtype == DType::BF16 && out % 8 == 0 && ldc % 8 == 0 &&
                           detail::aligned16(product) && detail::aligned16(p.out.data) &&
                           (!p.bias.defined() || detail::aligned16(p.bias.data));
    if (by_chunks) {
      // at most 2048 CTAs of 256 threads (~2 waves on 132 SMs); each thread loops over its chunks
      const int64_t chunks = tokens * (out / 8);
      const int64_t blocks = std::min<int64_t>(detail::blocks_for(chunks, 256), 2048);
      detail::launch(finish_product_bf16x8_kernel, dim3(unsigned(blocks)), dim3(256), 0, stream, params);
    } else if (p.out.dtype == DType::F32) {
      detail::launch(finish_product_kernel<float>, grid, dim3(256), 0, stream, params);
    } else {
      detail::launch(finish_product_kernel<__nv_bfloat16>, grid, dim3(256), 0, stream, params);
    }
    LMX_CUDA_CHECK_LAUNCH();
  }
}

bool LinearRunner::route(const ops::RouteParams& p, cudaStream_t stream) {
  ops::require(ops::check(p), "cuda::route");
  const ops::LinearParams product = p.linear();
  require_cuda_linear(product);
  detail::require_cuda("route", {{"topk_ids", &p.topk_ids}, {"topk_weights", &p.topk_weights}});
  const int64_t tokens = p.x.dim(0), in = p.x.dim(1), experts = p.weight.dim(0);
  // T > 16 (a prompt): row blocks of 16 (skinny_kernel), for router widths (at most 256 experts)
  const bool rows = tokens > kSkinnyMaxRows;
  const bool rows_fit = tokens <= int64_t(kSkinnyMaxRows) * kRouteRowBlocks && in % 8 == 0 && experts <= 256 &&
                        detail::aligned16(p.x.data) && detail::aligned16(p.weight.data);
  if (tokens == 0 || !(rows ? rows_fit : takes_skinny(product)) || p.top_k > detail::kRouterMaxTopK) return false;
  SkinnyKernelParams topk{};
  topk.done = state_->route_done;
  topk.topk_ids = static_cast<int32_t*>(p.topk_ids.data);
  topk.topk_weights = static_cast<float*>(p.topk_weights.data);
  topk.top_k = p.top_k;
  topk.softmax_first = p.rule == ops::RoutingRule::kSoftmaxThenTopK;
  topk.renormalize = p.renormalize;
  run_skinny(product, topk, stream, rows && wide_route_ && experts > 32);
  return true;
}

}  // namespace lmx::cuda
