// bench_moe_gemm: GPU time of the base MoE of one layer (no LoRA) at GPT-OSS-20B (H 2880, I 2880, E 32,
// K 4) and Qwen3-30B-A3B (H 2048, I 768, E 128, K 8) shapes, T = 1, 16, 64, 256, 1600, 4096, random routing
// (K distinct experts per token). Rows: moe_block (align + gate_up with fused activation + down + combine),
// then each kernel alone (align, gate_up fused, gate_up to h + moe_activation, down, combine; gate_up and
// down also at both BLOCK_N, to check the default of the BLOCK_M in use, and for 64/128-row tiles in the
// grouped CTA order; the block again on the other kernels: warp-specialized wgmma, mma.sync; at prefill sizes
// a dense cuBLASLt GEMM of the same FLOPs, the card's practical ceiling under its power cap; from T 1024 the
// MoE-LoRA of a mixed step — a prompt's run of one adapter beside 15 tokens of 8 — by each path), each with
// µs, the bytes that must move (touched experts' weights once, plus activations in and out), the FLOPs,
// and the share of the H200 floor max(bytes / 4.2 TB/s, FLOPs / 750 TFLOP/s). Method as bench_moe_lora:
// many launches in one CUDA graph (bench/cuda_timing.h), cycling over 3 copies of the layer's weights
// (≥ 3.6 GB, far beyond the 50 MB L2) so weights come from DRAM; median of 5 replays. Random bf16 data.
// BENCH_WIDE_COPIES=N adds a block row over N more copies (a model's layers: 24 for GPT-OSS-20B, 38 GB).
// BENCH_BALANCED_ROUTING=1 routes pair i to expert i % E: every expert T·K / E pairs (padding by T alone).
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "backends/cuda/linear.cuh"
#include "backends/cuda/memory.h"
#include "backends/cuda/moe_align.cuh"
#include "backends/cuda/moe_gemm.cuh"
#include "backends/cuda/moe_lora_small.cuh"
#include "bench/cuda_timing.h"
#include "core/rng.h"
#include "model/mxfp4.h"
#include "ops/moe.h"

namespace lmx {
namespace {

constexpr double kBytesPerSecond = 4.2e12;  // measured d2d copy (docs/perf-log.md)
constexpr double kFlopsPerSecond = 750e12;  // measured bf16 dense (issue 4)
constexpr int kCopies = 3;                  // copies of the layer's weights the launches cycle over
constexpr int kIterations = 30;             // per graph (a multiple of kCopies)
constexpr int kReplays = 5;

struct Model {
  const char* name;
  int64_t hidden, inter, experts, top_k;
  ops::MoeActivation activation;
  ops::GateUpLayout layout;
  bool biases;
};

// A device tensor of random bf16: one 16M-value random block uploaded once, tiled by device copies (fast
// for the GB-sized weight stacks). Scale 0.02 keeps h and d O(1).
OwnedTensor random_device_bf16(Rng& rng, std::initializer_list<int64_t> dims) {
  static const OwnedTensor block = [&] {
    OwnedTensor host = OwnedTensor::host(DType::BF16, {int64_t(1) << 24});
    for (int64_t i = 0; i < host.view.numel(); ++i) host.view.ptr<bf16>()[i] = f32_to_bf16(0.02f * rng.normal());
    return cuda::upload(host);
  }();
  OwnedTensor t = cuda::empty(DType::BF16, dims);
  const size_t bytes = t.view.nbytes(), block_bytes = block.view.nbytes();
  for (size_t at = 0; at < bytes; at += block_bytes) {
    BENCH_CUDA(cudaMemcpy(static_cast<char*>(t.view.data) + at, block.view.data, std::min(block_bytes, bytes - at),
                          cudaMemcpyDeviceToDevice));
  }
  return t;
}

void print_row(const char* what, int64_t tokens, double bytes, double flops, double seconds) {
  const double floor = std::max(bytes / kBytesPerSecond, flops / kFlopsPerSecond);
  std::printf("%-26s T %5lld  %9.2f us  %13.0f B  %15.0f FLOP  floor %8.2f us (%s)  %5.1f%% of floor\n", what,
              (long long)tokens, seconds * 1e6, bytes, flops, floor * 1e6,
              bytes / kBytesPerSecond >= flops / kFlopsPerSecond ? "bytes" : "flops", 100.0 * floor / seconds);
}

struct Layer {
  OwnedTensor gate_up, gate_up_bias, down, down_bias;  // [E, 2I, H], [E, 2I], [E, H, I], [E, H] bf16
  // GPT-OSS (interleaved): the experts' MXFP4 copies in the decode layout (ops/mxfp4.h), generated; their
  // values are not the bf16 weights' (timing only: the "MXFP4 experts" rows read nothing else)
  OwnedTensor gate_up_blocks, gate_up_scales, down_blocks, down_scales;
};

// cuBLAS's grouped GEMM (cublasGemmGroupedBatchedEx: one call, one group per expert) on moe_block's gathered
// rows (the persistent kernel's sorted_x / sorted_a: each expert's rows contiguous, padded to block_m):
// what a library grouped GEMM reaches once the row count of every expert is known on the host. Prefill runs
// eagerly, so moe_block could read the counts back once per layer. Unfused: gate_up writes the
// pre-activation h, in tile order. Timing rows only, by events over 30 calls (no graph: the call is not
// known to be capturable); a status other than success is printed and the rows are skipped.
void grouped_library_rows(const Model& m, int64_t tokens, int64_t pairs, int block_m, const Tensor& host_ids,
                          const std::vector<Layer>& layers, const Tensor& sorted_x, const Tensor& sorted_a,
                          cudaStream_t stream, double gate_up_bytes, double gate_up_flops, double down_bytes,
                          double down_flops) {
  const int64_t H = m.hidden, I = m.inter, E = m.experts;
  std::vector<int> count(size_t(E), 0);
  for (int64_t i = 0; i < pairs; ++i) ++count[size_t(host_ids.ptr<int32_t>()[i])];
  std::vector<int64_t> start(size_t(E), 0);
  int64_t rows = 0;
  for (int64_t e = 0; e < E; ++e) {
    start[size_t(e)] = rows;
    rows += (count[size_t(e)] + block_m - 1) / block_m * block_m;
  }
  if (rows > sorted_x.dim(0)) {
    std::printf("  cuBLAS grouped GEMM: %lld padded rows exceed the gathered rows' %lld (skipped)\n", (long long)rows,
                (long long)sorted_x.dim(0));
    return;
  }
  OwnedTensor grouped_h = cuda::empty(DType::BF16, {rows, 2 * I}), grouped_d = cuda::empty(DType::BF16, {rows, H});
  OwnedTensor workspace = cuda::empty(DType::U8, {int64_t(32) << 20});
  cublasHandle_t handle = nullptr;
  if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) {
    std::printf("  cuBLAS grouped GEMM: no cuBLAS handle (skipped)\n");
    return;
  }
  cublasSetStream(handle, stream);
  cublasSetWorkspace(handle, workspace.view.data, workspace.view.nbytes());
  // One group per expert with rows; within a group every problem shares m, n, k (one problem per group).
  std::vector<int> experts;
  for (int64_t e = 0; e < E; ++e)
    if (count[size_t(e)] > 0) experts.push_back(int(e));
  const int groups = int(experts.size());
  struct Product { int64_t out, in; };
  // Device arrays of per-expert pointers for each weight copy: A = the expert's weight, B = its rows, C = out.
  auto pointer_arrays = [&](const Product& shape, const Tensor& x, void* out, bool gate_up) {
    std::vector<OwnedTensor> arrays;  // per copy: [3 * groups] pointers
    for (size_t c = 0; c < layers.size(); ++c) {
      const auto* weight = static_cast<const char*>(gate_up ? layers[c].gate_up.view.data : layers[c].down.view.data);
      std::vector<const void*> host(size_t(3 * groups));
      for (int g = 0; g < groups; ++g) {
        const int64_t e = experts[size_t(g)];
        host[size_t(g)] = weight + e * shape.out * shape.in * 2;
        host[size_t(groups + g)] = static_cast<const char*>(x.data) + start[size_t(e)] * shape.in * 2;
        host[size_t(2 * groups + g)] = static_cast<char*>(out) + start[size_t(e)] * shape.out * 2;
      }
      OwnedTensor device = cuda::empty(DType::U8, {int64_t(host.size() * sizeof(void*))});
      BENCH_CUDA(cudaMemcpy(device.view.data, host.data(), host.size() * sizeof(void*), cudaMemcpyHostToDevice));
      arrays.push_back(std::move(device));
    }
    return arrays;
  };
  // Column-major, as LinearRunner: C [out, M] = op(A)·B with A the weight as [in, out] (op T), B the rows [in, M].
  auto run = [&](const Product& shape, const std::vector<OwnedTensor>& arrays, int copy) {
    std::vector<cublasOperation_t> transa(size_t(groups), CUBLAS_OP_T), transb(size_t(groups), CUBLAS_OP_N);
    std::vector<int> m_array(size_t(groups), int(shape.out)), k_array(size_t(groups), int(shape.in));
    std::vector<int> n_array(size_t(groups), 0);
    std::vector<int> lda(size_t(groups), int(shape.in)), ldb(size_t(groups), int(shape.in)), ldc(size_t(groups), int(shape.out));
    std::vector<int> group_size(size_t(groups), 1);
    std::vector<float> alpha(size_t(groups), 1.0f), beta(size_t(groups), 0.0f);
    for (int g = 0; g < groups; ++g) n_array[size_t(g)] = count[size_t(experts[size_t(g)])];
    const auto* pointers = static_cast<const void* const*>(arrays[size_t(copy)].view.data);
    return cublasGemmGroupedBatchedEx(handle, transa.data(), transb.data(), m_array.data(), n_array.data(),
                                      k_array.data(), alpha.data(), pointers, CUDA_R_16BF, lda.data(),
                                      pointers + groups, CUDA_R_16BF, ldb.data(), beta.data(),
                                      const_cast<void* const*>(pointers + 2 * groups), CUDA_R_16BF, ldc.data(),
                                      groups, group_size.data(), CUBLAS_COMPUTE_32F);
  };
  const Product gate_up{2 * I, H}, down{H, I};
  const std::vector<OwnedTensor> gate_up_arrays = pointer_arrays(gate_up, sorted_x, grouped_h.view.data, true);
  const std::vector<OwnedTensor> down_arrays = pointer_arrays(down, sorted_a, grouped_d.view.data, false);
  for (const auto& [shape, arrays, name, bytes, flops] :
       {std::tuple{gate_up, &gate_up_arrays, "  cuBLAS grouped GEMM, gate_up -> h", gate_up_bytes, gate_up_flops},
        std::tuple{down, &down_arrays, "  cuBLAS grouped GEMM, down", down_bytes, down_flops}}) {
    const cublasStatus_t status = run(shape, *arrays, 0);
    BENCH_CUDA(cudaStreamSynchronize(stream));
    if (status != CUBLAS_STATUS_SUCCESS) {
      std::printf("%s: cublasGemmGroupedBatchedEx status %d (skipped)\n", name, int(status));
      continue;
    }
    constexpr int kCalls = 30;
    cudaEvent_t begin, end;
    BENCH_CUDA(cudaEventCreate(&begin));
    BENCH_CUDA(cudaEventCreate(&end));
    for (int i = 0; i < 3; ++i) run(shape, *arrays, i % int(arrays->size()));  // warm-up
    BENCH_CUDA(cudaEventRecord(begin, stream));
    for (int i = 0; i < kCalls; ++i) run(shape, *arrays, i % int(arrays->size()));
    BENCH_CUDA(cudaEventRecord(end, stream));
    BENCH_CUDA(cudaEventSynchronize(end));
    float ms = 0.0f;
    BENCH_CUDA(cudaEventElapsedTime(&ms, begin, end));
    BENCH_CUDA(cudaEventDestroy(begin));
    BENCH_CUDA(cudaEventDestroy(end));
    print_row(name, tokens, bytes, flops, double(ms) * 1e-3 / kCalls);
  }
  cublasDestroy(handle);
}

void bench_tokens(const Model& m, int64_t tokens, const std::vector<Layer>& layers, const std::vector<Layer>& wide,
                  cudaStream_t stream, Rng& rng) {
  const int64_t H = m.hidden, I = m.inter, E = m.experts, K = m.top_k, pairs = tokens * K;
  OwnedTensor ids = OwnedTensor::host(DType::I32, {tokens, K}), weights = OwnedTensor::host(DType::F32, {tokens, K});
  std::vector<bool> touched(size_t(E), false);
  // BENCH_BALANCED_ROUTING=1: pair t·K + k goes to expert (t·K + k) % E (distinct per token for K <= E), so
  // every expert gets T·K / E pairs: T 1600 gives GPT-OSS-20B 200 an expert (64 tiles of 128, 22% padding),
  // T 2048 256 (64 tiles, none) — the same tiles with and without padding rows
  const char* balanced_env = std::getenv("BENCH_BALANCED_ROUTING");
  const bool balanced = balanced_env != nullptr && std::atoi(balanced_env) != 0;
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<int32_t> all(static_cast<size_t>(E));
    for (int32_t e = 0; e < E; ++e) all[e] = e;
    for (int64_t k = 0; k < K; ++k) {
      if (balanced) all[k] = int32_t((t * K + k) % E);
      else std::swap(all[k], all[k + int64_t(rng.next_u64() % uint64_t(E - k))]);
      ids.view.ptr<int32_t>()[t * K + k] = all[k];
      weights.view.ptr<float>()[t * K + k] = 1.0f / float(K);
      touched[all[k]] = true;
    }
  }
  const double experts_touched = double(std::count(touched.begin(), touched.end(), true));
  OwnedTensor d_ids = cuda::upload(ids), d_weights = cuda::upload(weights);
  OwnedTensor x = random_device_bf16(rng, {tokens, H});
  OwnedTensor h = cuda::empty(DType::BF16, {pairs, 2 * I}), a = cuda::empty(DType::BF16, {pairs, I});
  OwnedTensor d = random_device_bf16(rng, {pairs, H}), out = cuda::empty(DType::BF16, {tokens, H});

  // BENCH_BLOCK_M (16, 64 or 128) overrides the tile height of the component rows (gate_up, down: a
  // threshold check); the "block" rows keep moe_block's own choice.
  const char* forced_block_m = std::getenv("BENCH_BLOCK_M");
  const int block_m = forced_block_m != nullptr ? std::atoi(forced_block_m) : cuda::moe_gemm_block_m(pairs, E);
  const int64_t capacity = cuda::moe_align_capacity(pairs, E, block_m);
  OwnedTensor sorted = cuda::empty(DType::I32, {capacity}), tile_group = cuda::empty(DType::I32, {capacity / block_m});
  OwnedTensor offsets = cuda::empty(DType::I32, {E + 1}), num_tiles = cuda::empty(DType::I32, {1});
  OwnedTensor align_scratch = cuda::empty(DType::U8, {int64_t(cuda::moe_align_workspace_bytes(pairs, E))});
  const cuda::MoeAlignParams align{.topk_ids = d_ids, .experts = E, .slots = 0, .block_m = block_m,
                                   .sorted_pairs = sorted, .tile_group = tile_group, .group_offsets = offsets,
                                   .num_tiles = num_tiles, .workspace = align_scratch};
  const cuda::MoeExpertTiles tiles{.sorted_pairs = sorted, .tile_group = tile_group, .num_tiles = num_tiles,
                                   .block_m = block_m};
  const cuda::MoeWorkspaceShape shape{.max_tokens = tokens, .top_k = K, .experts = E, .hidden = H, .inter = I};
  OwnedTensor workspace = cuda::empty(DType::U8, {int64_t(cuda::moe_workspace_bytes(shape))});
  cuda::moe_workspace_prepare({.shape = shape, .memory = workspace}, stream);  // the stream-K counters' zeros
  // Scratch of the warp-specialized kernel's gathered A rows (MoeGateUpParams::sorted_rows).
  OwnedTensor sorted_x = cuda::empty(DType::BF16, {capacity, H}), sorted_a = cuda::empty(DType::BF16, {capacity, I});

  auto gate_up = [&](int layer, bool fused, int block_n = 0, int cta_group = 0, int decode_stages = 0) {
    cuda::MoeGateUpParams p{.x = x, .weight = layers[layer].gate_up, .bias = layers[layer].gate_up_bias,
                            .top_k = K, .tiles = tiles, .activation = m.activation, .layout = m.layout,
                            .cta_group = cta_group, .block_n = block_n, .decode_stages = decode_stages};
    (fused ? p.a : p.h) = fused ? a.view : h.view;
    return p;
  };
  auto down = [&](int layer, int block_n = 0, int cta_group = 0, int decode_stages = 0) {
    return cuda::MoeDownParams{.a = a, .weight = layers[layer].down, .bias = layers[layer].down_bias,
                               .tiles = tiles, .d = d, .block_n = block_n, .cta_group = cta_group,
                               .decode_stages = decode_stages};
  };
  auto block_on = [&](const Layer& l, bool gemm_pdl = true, bool mxfp4 = false) {
    ops::MoeParams p{.x = x, .topk_ids = d_ids, .topk_weights = d_weights, .gate_up = l.gate_up,
                     .gate_up_bias = l.gate_up_bias, .down = l.down, .down_bias = l.down_bias,
                     .activation = m.activation, .layout = m.layout, .out = out};
    if (mxfp4) {
      p.gate_up_mxfp4 = {.blocks = l.gate_up_blocks, .scales = l.gate_up_scales};
      p.down_mxfp4 = {.blocks = l.down_blocks, .scales = l.down_scales};
    }
    cuda::moe_block(p, {.shape = shape, .memory = workspace}, stream, {.gemm_pdl = gemm_pdl});
  };
  auto block = [&](int layer, bool gemm_pdl = true, bool mxfp4 = false) { block_on(layers[layer], gemm_pdl, mxfp4); };
  auto gate_up_gathered = [&](int layer, int block_n = 0, int cta_group = 0) {  // fused, A rows gathered for TMA
    cuda::MoeGateUpParams p = gate_up(layer, true, block_n, cta_group);
    p.sorted_rows = sorted_x;
    return p;
  };
  auto down_gathered = [&](int layer, int block_n = 0, int cta_group = 0) {
    cuda::MoeDownParams p = down(layer, block_n, cta_group);
    p.sorted_rows = sorted_a;
    return p;
  };
  // Untimed first calls: kernel attributes are set once, outside any graph capture.
  cuda::moe_align(align, stream);
  cuda::moe_gate_up(gate_up(0, true), stream);
  cuda::moe_gate_up(gate_up(0, false), stream);
  cuda::moe_activation({.h = h, .activation = m.activation, .layout = m.layout, .a = a}, stream);
  cuda::moe_down(down(0), stream);
  // Both BLOCK_N built at this BLOCK_M on the default kernels (BLOCK_M 64: 64 is the mma.sync kernel), to
  // check the default.
  const std::vector<int> block_ns =
      block_m == cuda::kMoeGemmBlockMLarge ? std::vector<int>{128, 256} : std::vector<int>{64, 128};
  for (int block_n : block_ns) {
    cuda::moe_gate_up(gate_up(0, true, block_n), stream);
    cuda::moe_down(down(0, block_n), stream);
  }
  if (block_m == cuda::kMoeGemmBlockMLarge) {  // BLOCK_N 192: the warp-specialized kernels only
    cuda::set_moe_gemm_kernel(cuda::MoeGemmKernel::kWgmmaWarpSpecialized);
    cuda::moe_gate_up(gate_up_gathered(0, 192), stream);
    cuda::moe_down(down_gathered(0, 192), stream);
    cuda::set_moe_gemm_kernel(cuda::MoeGemmKernel::kAuto);
  }
  const std::vector<int> decode_stages =
      block_m == cuda::kMoeGemmBlockMDecode ? std::vector<int>{4, 5} : std::vector<int>{};
  for (int stages : decode_stages) {
    cuda::moe_gate_up(gate_up(0, true, 64, 0, stages), stream);
    cuda::moe_down(down(0, 64, 0, stages), stream);
  }
  cuda::moe_combine({.d = d, .topk_weights = d_weights, .out = out}, stream);
  block(0);
  BENCH_CUDA(cudaStreamSynchronize(stream));

  const double p = double(pairs), t = double(tokens), bias_gu = m.biases ? 2.0 * I * 2 : 0, bias_d = m.biases ? H * 2.0 : 0;
  const double gate_up_bytes = experts_touched * (2.0 * I * H * 2 + bias_gu) + t * H * 2 + p * I * 2;
  const double gate_up_h_bytes = experts_touched * (2.0 * I * H * 2 + bias_gu) + t * H * 2 + p * 2 * I * 2;
  const double activation_bytes = p * 2 * I * 2 + p * I * 2;
  const double down_bytes = experts_touched * (double(H) * I * 2 + bias_d) + p * I * 2 + p * H * 2;
  const double combine_bytes = p * H * 2 + p * 4 + t * H * 2;
  const double align_bytes = p * 4 * 3;
  const double gate_up_flops = 2.0 * p * 2 * I * H, down_flops = 2.0 * p * H * I;
  std::printf("-- %s T %lld: %lld pairs, %.0f experts touched, BLOCK_M %d%s\n", m.name, (long long)tokens,
              (long long)pairs, experts_touched, block_m, forced_block_m != nullptr ? " (BENCH_BLOCK_M)" : "");
  auto time = [&](const std::function<void(int)>& launch) {
    return bench::seconds_per_launch(stream, kIterations, kReplays, launch);
  };
  print_row("block (no LoRA)", tokens, align_bytes + gate_up_bytes + down_bytes + combine_bytes,
            gate_up_flops + down_flops, time([&](int i) { block(i % kCopies); }));
  if (!wide.empty()) {  // BENCH_WIDE_COPIES: the same launches over as many weight copies as a model's layers
    const std::string what = "block (no LoRA), " + std::to_string(wide.size()) + " weight copies";
    print_row(what.c_str(), tokens, align_bytes + gate_up_bytes + down_bytes + combine_bytes, gate_up_flops + down_flops,
              time([&](int i) { block_on(wide[size_t(i) % wide.size()]); }));
  }
  if (const char* rounds = std::getenv("BENCH_EPILOGUE_AB"); rounds != nullptr && block_m == cuda::kMoeGemmBlockMLarge) {
    // Only moe_block with gate_up's fused epilogue by the consumers and by the producer warpgroup's idle warps
    // (set_moe_gemm_epilogue_warps) in turn, `rounds` times, then the next T.
    // Third row: down's store form through them too (set_moe_gemm_epilogue_down; down at BLOCK_N 192, not 240).
    for (int r = 0; r < std::atoi(rounds); ++r) {
      for (int form = 0; form < 3; ++form) {
        cuda::set_moe_gemm_epilogue_warps(form > 0);
        cuda::set_moe_gemm_epilogue_down(form == 2);
        block(0);  // kernel attributes, outside the graph
        BENCH_CUDA(cudaStreamSynchronize(stream));
        print_row(form == 0   ? "block (no LoRA), epilogue by the consumers"
                  : form == 1 ? "block (no LoRA), epilogue warps"
                              : "block (no LoRA), epilogue warps, down too",
                  tokens, align_bytes + gate_up_bytes + down_bytes + combine_bytes, gate_up_flops + down_flops,
                  time([&](int i) { block(i % kCopies); }));
      }
    }
    cuda::set_moe_gemm_epilogue_down(false);
    cuda::set_moe_gemm_epilogue_warps(true);  // the default
    return;
  }
  if (const char* rounds = std::getenv("BENCH_DOWN_AB"); rounds != nullptr && block_m == cuda::kMoeGemmBlockMLarge) {
    // Only moe_block's down at BLOCK_N 192 and 240 in turn, `rounds` times (rows of one section spread by
    // 20–40 µs on an H100: an A/B needs them side by side), then the next T.
    for (int r = 0; r < std::atoi(rounds); ++r) {
      for (int down_n : {192, 240}) {
        cuda::set_moe_block_down_block_n(down_n);
        const std::string what = "block (no LoRA), down at BLOCK_N " + std::to_string(down_n);
        print_row(what.c_str(), tokens, align_bytes + gate_up_bytes + down_bytes + combine_bytes,
                  gate_up_flops + down_flops, time([&](int i) { block(i % kCopies); }));
      }
    }
    cuda::set_moe_block_down_block_n(0);
    return;
  }
  if (block_m == cuda::kMoeGemmBlockMDecode && layers[0].gate_up_blocks.view.defined()) {
    // --mxfp4-experts: the decode GEMMs stream the MXFP4 copies (17 bytes per 32 values instead of 64)
    block(0, true, true);  // first call outside the graph (kernel attributes)
    const double fp4 = 17.0 / 64.0;
    const double weight_bytes = experts_touched * (3.0 * I * H * 2) * (1.0 - fp4);
    print_row("block (no LoRA), MXFP4 experts", tokens,
              align_bytes + gate_up_bytes + down_bytes + combine_bytes - weight_bytes, gate_up_flops + down_flops,
              time([&](int i) { block(i % kCopies, true, true); }));
    // The CTA shapes beside the default (64 columns, 8 stages, 6 CTAs an SM, since run 133; 128 × 4 before):
    // more stages and fewer resident warps (run 121), or 8 CTAs an SM at 64 registers
    struct Shape {
      int block_n, stages, ctas;
    };
    for (const Shape& s : {Shape{128, 4, 6}, Shape{128, 8, 4}, Shape{128, 6, 5}, Shape{128, 5, 6}, Shape{128, 4, 8},
                           Shape{128, 3, 8}, Shape{64, 12, 4}, Shape{64, 6, 8}}) {
      cuda::set_moe_gemm_mxfp4_shape(s.block_n, s.stages, s.ctas);
      block(0, true, true);  // kernel attributes outside the graph
      const std::string what = "block (no LoRA), MXFP4 experts, " + std::to_string(s.block_n) + " columns x " +
                               std::to_string(s.stages) + " stages, " + std::to_string(s.ctas) + " CTAs an SM";
      print_row(what.c_str(), tokens, align_bytes + gate_up_bytes + down_bytes + combine_bytes - weight_bytes,
                gate_up_flops + down_flops, time([&](int i) { block(i % kCopies, true, true); }));
    }
    cuda::set_moe_gemm_mxfp4_shape(64, 8);
  }
  if (block_m != cuda::kMoeGemmBlockMDecode) {  // before: gate_up writes a by pair, down gathers it again
    cuda::set_moe_block_a_in_tile_order(false);
    print_row("block (no LoRA), a by pair and gathered for down", tokens,
              align_bytes + gate_up_bytes + down_bytes + combine_bytes, gate_up_flops + down_flops,
              time([&](int i) { block(i % kCopies); }));
    cuda::set_moe_block_a_in_tile_order(true);
    cuda::set_moe_gemm_stream_k(true);  // after: the persistent GEMMs' partial last round cut along k
    print_row("block (no LoRA), stream-K tail", tokens, align_bytes + gate_up_bytes + down_bytes + combine_bytes,
              gate_up_flops + down_flops, time([&](int i) { block(i % kCopies); }));
    cuda::set_moe_gemm_stream_k(false);
  }
  if (block_m == cuda::kMoeGemmBlockMLarge) {  // moe_block at other 128-row BLOCK_N (default: by width; down 240
                                               // where its last round is fuller, down_block_n_for)
    for (const auto& [gate_up_n, down_n] :
         {std::pair{128, 256}, std::pair{128, 128}, std::pair{192, 192}, std::pair{192, 240}}) {
      cuda::set_moe_gemm_large_block_n(gate_up_n);
      cuda::set_moe_block_down_block_n(down_n);
      const std::string what = "block (no LoRA), gate_up at BLOCK_N " + std::to_string(gate_up_n) + ", down at " +
                               std::to_string(down_n);
      print_row(what.c_str(), tokens, align_bytes + gate_up_bytes + down_bytes + combine_bytes,
                gate_up_flops + down_flops, time([&](int i) { block(i % kCopies); }));
    }
    cuda::set_moe_gemm_large_block_n(0);
    cuda::set_moe_block_down_block_n(0);
  }
  // The MoE-LoRA of 8 rank-32 adapters on gate_up and down (every token with one, or spread over 8).
  constexpr int64_t kSlots = 8, kRank = 32;
  OwnedTensor lora_a_gate_up = random_device_bf16(rng, {kSlots, E, kRank, H});
  OwnedTensor lora_a_down = random_device_bf16(rng, {kSlots, E, kRank, I});
  OwnedTensor lora_b_gate_up = random_device_bf16(rng, {kSlots, E, 2 * I, kRank});
  OwnedTensor lora_b_down = random_device_bf16(rng, {kSlots, E, H, kRank});
  OwnedTensor rank_host = OwnedTensor::host(DType::I32, {kSlots});
  for (int64_t s = 0; s < kSlots; ++s) rank_host.view.ptr<int32_t>()[s] = int32_t(kRank);
  OwnedTensor slot_one = OwnedTensor::host(DType::I32, {tokens}), slot_spread = OwnedTensor::host(DType::I32, {tokens});
  for (int64_t t = 0; t < tokens; ++t) {
    slot_one.view.ptr<int32_t>()[t] = 1;
    slot_spread.view.ptr<int32_t>()[t] = int32_t(t % kSlots);
  }
  // A mixed step's slots (the yardstick's: 15 decoding tokens of 8 adapters, then a prompt of one adapter),
  // and the same with the decoding tokens on the base model.
  constexpr int64_t kDecoding = 15;
  OwnedTensor slot_mixed = OwnedTensor::host(DType::I32, {tokens}), slot_prompt = OwnedTensor::host(DType::I32, {tokens});
  for (int64_t t = 0; t < tokens; ++t) {
    slot_mixed.view.ptr<int32_t>()[t] = t < kDecoding ? int32_t(t % kSlots) : 1;
    slot_prompt.view.ptr<int32_t>()[t] = t < kDecoding ? -1 : 1;
  }
  const OwnedTensor lora_rank = cuda::upload(rank_host);
  const OwnedTensor d_slot_one = cuda::upload(slot_one), d_slot_spread = cuda::upload(slot_spread);
  const OwnedTensor d_slot_mixed = cuda::upload(slot_mixed), d_slot_prompt = cuda::upload(slot_prompt);
  // moe_block with that MoE-LoRA (shrink included): by the expand kernels, and in the GEMMs' accumulators
  // (`in_gemm`: how moe_block gets it there at this size). Minus the block without LoRA, this is the
  // layer's MoE-LoRA cost (issue 4's table).
  // A side stream and its events, as CudaBackend passes its own: the decode MoE-LoRA by the expand kernels
  // forks its shrinks beside the GEMMs here as in the engine (set_moe_lora_fork_shrinks, perf-log run 135).
  static const cuda::MoeBlockConfig forked = [] {
    cuda::MoeBlockConfig config;
    BENCH_CUDA(cudaStreamCreateWithFlags(&config.side_stream, cudaStreamNonBlocking));
    BENCH_CUDA(cudaEventCreateWithFlags(&config.fork, cudaEventDisableTiming));
    BENCH_CUDA(cudaEventCreateWithFlags(&config.join, cudaEventDisableTiming));
    return config;
  }();
  auto lora_block_rows = [&](const char* in_gemm, bool decode = false) {
    const cuda::MoeWorkspaceShape lora_shape{.max_tokens = tokens, .top_k = K, .experts = E, .slots = kSlots,
                                             .hidden = H, .inter = I, .max_rank = kRank};
    OwnedTensor lora_workspace = cuda::empty(DType::U8, {int64_t(cuda::moe_workspace_bytes(lora_shape))});
    cuda::moe_workspace_prepare({.shape = lora_shape, .memory = lora_workspace}, stream);
    for (const auto& [slots, name] : {std::pair{&d_slot_one, "one adapter"}, std::pair{&d_slot_spread, "8 adapters spread"}}) {
      auto lora_block = [&](int layer, bool overlap = true) {
        ops::MoeParams p{.x = x, .topk_ids = d_ids, .topk_weights = d_weights, .token_slot = *slots,
                         .gate_up = layers[layer].gate_up, .gate_up_bias = layers[layer].gate_up_bias,
                         .down = layers[layer].down, .down_bias = layers[layer].down_bias, .activation = m.activation,
                         .layout = m.layout, .out = out};
        p.lora_gate_up = {.a = lora_a_gate_up, .b = lora_b_gate_up, .rank = lora_rank};
        p.lora_down = {.a = lora_a_down, .b = lora_b_down, .rank = lora_rank};
        cuda::MoeBlockConfig config = forked;
        config.decode_lora_overlap = overlap;
        cuda::moe_block(p, {.shape = lora_shape, .memory = lora_workspace}, stream, config);
      };
      for (const auto& [mode, how] : {std::pair{cuda::MoeLoraInGemm::kOff, "by the expand kernels"},
                                      std::pair{cuda::MoeLoraInGemm::kAlways, in_gemm}}) {
        cuda::set_moe_lora_in_gemm(mode);
        lora_block(0);  // kernel attributes, outside the graph
        BENCH_CUDA(cudaStreamSynchronize(stream));
        print_row((std::string("block + MoE-LoRA, ") + name + ", " + how).c_str(), tokens,
                  align_bytes + gate_up_bytes + down_bytes + combine_bytes, gate_up_flops + down_flops,
                  time([&](int i) { lora_block(i % kCopies); }));
      }
      if (decode) {  // before/after of the decode GEMMs' k-loops alongside their shrinks
        print_row((std::string("block + MoE-LoRA, ") + name + ", " + in_gemm + ", GEMMs waiting for the shrinks").c_str(),
                  tokens, align_bytes + gate_up_bytes + down_bytes + combine_bytes, gate_up_flops + down_flops,
                  time([&](int i) { lora_block(i % kCopies, false); }));
        // after (off by default until measured): the overlapped GEMMs let their dependents launch at their start
        cuda::set_moe_lora_in_gemm(cuda::MoeLoraInGemm::kAlways);
        cuda::set_moe_gemm_early_trigger(true);
        print_row((std::string("block + MoE-LoRA, ") + name + ", " + in_gemm + ", GEMMs triggering early").c_str(),
                  tokens, align_bytes + gate_up_bytes + down_bytes + combine_bytes, gate_up_flops + down_flops,
                  time([&](int i) { lora_block(i % kCopies); }));
        cuda::set_moe_gemm_early_trigger(false);
      }
      cuda::set_moe_lora_in_gemm(cuda::MoeLoraInGemm::kLongRuns);
    }
    if (tokens < 1024 || decode) return;
    // A mixed step's MoE-LoRA by moe_block's rule (kLongRuns with the engine's hint: 15 tokens in short runs,
    // or none when the decoding tokens have no adapter), and the mixed slots by the other two paths.
    struct Mixed { const OwnedTensor* slots; int64_t scattered; cuda::MoeLoraInGemm mode; const char* name; };
    for (const Mixed& c : {Mixed{&d_slot_prompt, 0, cuda::MoeLoraInGemm::kLongRuns,
                                 "a prompt's run + 15 base tokens, by the rule"},
                           Mixed{&d_slot_mixed, kDecoding, cuda::MoeLoraInGemm::kLongRuns,
                                 "a prompt's run + 15 of 8 adapters, by the rule (warp groups)"},
                           Mixed{&d_slot_mixed, kDecoding, cuda::MoeLoraInGemm::kAlways,
                                 "a prompt's run + 15 of 8 adapters, accumulators, slots sharing warps"},
                           Mixed{&d_slot_mixed, kDecoding, cuda::MoeLoraInGemm::kOff,
                                 "a prompt's run + 15 of 8 adapters, by the expand kernels"}}) {
      cuda::set_moe_lora_in_gemm(c.mode);
      auto mixed_block = [&](int layer) {
        ops::MoeParams p{.x = x, .topk_ids = d_ids, .topk_weights = d_weights, .token_slot = *c.slots,
                         .gate_up = layers[layer].gate_up, .gate_up_bias = layers[layer].gate_up_bias,
                         .down = layers[layer].down, .down_bias = layers[layer].down_bias, .activation = m.activation,
                         .layout = m.layout, .out = out, .lora_scattered_tokens = c.scattered};
        p.lora_gate_up = {.a = lora_a_gate_up, .b = lora_b_gate_up, .rank = lora_rank};
        p.lora_down = {.a = lora_a_down, .b = lora_b_down, .rank = lora_rank};
        cuda::moe_block(p, {.shape = lora_shape, .memory = lora_workspace}, stream);
      };
      mixed_block(0);  // kernel attributes, outside the graph
      BENCH_CUDA(cudaStreamSynchronize(stream));
      print_row((std::string("block + MoE-LoRA, ") + c.name).c_str(), tokens,
                align_bytes + gate_up_bytes + down_bytes + combine_bytes, gate_up_flops + down_flops,
                time([&](int i) { mixed_block(i % kCopies); }));
      if (c.mode == cuda::MoeLoraInGemm::kLongRuns && c.scattered > 0) {
        cuda::set_moe_gemm_stream_k(true);  // after: the persistent GEMMs' partial last round cut along k
        print_row((std::string("block + MoE-LoRA, ") + c.name + ", stream-K tail").c_str(), tokens,
                  align_bytes + gate_up_bytes + down_bytes + combine_bytes, gate_up_flops + down_flops,
                  time([&](int i) { mixed_block(i % kCopies); }));
        cuda::set_moe_gemm_stream_k(false);
        cuda::set_moe_lora_gemm_wgmma(true);  // after: each tile's main slot by warpgroup MMAs (TMA'd B slice)
        print_row((std::string("block + MoE-LoRA, ") + c.name + ", main slot by warpgroup MMAs").c_str(), tokens,
                  align_bytes + gate_up_bytes + down_bytes + combine_bytes, gate_up_flops + down_flops,
                  time([&](int i) { mixed_block(i % kCopies); }));
        cuda::set_moe_gemm_stream_k(true);
        print_row((std::string("block + MoE-LoRA, ") + c.name + ", main slot by warpgroup MMAs, stream-K tail").c_str(),
                  tokens, align_bytes + gate_up_bytes + down_bytes + combine_bytes, gate_up_flops + down_flops,
                  time([&](int i) { mixed_block(i % kCopies); }));
        cuda::set_moe_gemm_stream_k(false);
        cuda::set_moe_lora_gemm_wgmma(false);
        // before/after of the shrink in runs of a group's tiles, and of their own split
        cuda::set_moe_lora_shrink_runs_split(false);
        print_row((std::string("block + MoE-LoRA, ") + c.name + ", run-mode shrink at the config's split").c_str(),
                  tokens, align_bytes + gate_up_bytes + down_bytes + combine_bytes, gate_up_flops + down_flops,
                  time([&](int i) { mixed_block(i % kCopies); }));
        cuda::set_moe_lora_shrink_runs_split(true);
        cuda::set_moe_lora_shrink_runs_hint(false);
        print_row((std::string("block + MoE-LoRA, ") + c.name + ", shrink by its own size rule").c_str(), tokens,
                  align_bytes + gate_up_bytes + down_bytes + combine_bytes, gate_up_flops + down_flops,
                  time([&](int i) { mixed_block(i % kCopies); }));
        cuda::set_moe_lora_shrink_runs_hint(true);
        cuda::set_moe_lora_l1_prefetch(false);
        print_row((std::string("block + MoE-LoRA, ") + c.name + ", inputs not prefetched into L1").c_str(), tokens,
                  align_bytes + gate_up_bytes + down_bytes + combine_bytes, gate_up_flops + down_flops,
                  time([&](int i) { mixed_block(i % kCopies); }));
        cuda::set_moe_lora_l1_prefetch(true);
      }
    }
    cuda::set_moe_lora_in_gemm(cuda::MoeLoraInGemm::kLongRuns);
  };
  if (block_m == cuda::kMoeGemmBlockMDecode) {  // before/after of gate_up and down as programmatic dependents
    print_row("block (no LoRA), GEMMs without PDL", tokens, align_bytes + gate_up_bytes + down_bytes + combine_bytes,
              gate_up_flops + down_flops, time([&](int i) { block(i % kCopies, false); }));
    if (pairs <= cuda::kMoeLoraSmallMaxPairs) lora_block_rows("in the decode GEMMs' accumulators", true);
  }
  if (block_m != cuda::kMoeGemmBlockMDecode) {  // before/after for the BLOCK_M 64/128 tiles: the other kernels
    // (the default, kAuto, is the persistent warp-specialized kernel where both operands come by TMA)
    for (const auto& [kernel, name] :
         {std::pair{cuda::MoeGemmKernel::kWgmma, "block (no LoRA), wgmma ring"},
          std::pair{cuda::MoeGemmKernel::kWgmmaWarpSpecialized, "block (no LoRA), wgmma warp-spec. everywhere"},
          std::pair{cuda::MoeGemmKernel::kMmaSync, "block (no LoRA), mma.sync"}}) {
      cuda::set_moe_gemm_kernel(kernel);
      block(0);  // kernel attributes, outside the timed graph
      BENCH_CUDA(cudaStreamSynchronize(stream));
      print_row(name, tokens, align_bytes + gate_up_bytes + down_bytes + combine_bytes, gate_up_flops + down_flops,
                time([&](int i) { block(i % kCopies); }));
    }
    cuda::set_moe_gemm_kernel(cuda::MoeGemmKernel::kAuto);
    cuda::set_moe_gemm_multicast(true);  // the persistent kernel in CTA pairs sharing each A tile (off by default)
    block(0);
    BENCH_CUDA(cudaStreamSynchronize(stream));
    std::printf("  (multicast kernel: %d clusters of 2 resident, %d SMs)\n", cuda::moe_gemm_multicast_clusters(),
                [] { int n = 0; cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, 0); return n; }());
    print_row("block (no LoRA), persistent, multicast A", tokens, align_bytes + gate_up_bytes + down_bytes + combine_bytes,
              gate_up_flops + down_flops, time([&](int i) { block(i % kCopies); }));
    print_row("  gate_up fused, persistent, multicast A", tokens, gate_up_bytes, gate_up_flops,
              time([&](int i) { cuda::moe_gate_up(gate_up_gathered(i % kCopies, 0, 8), stream); }));
    print_row("  down, persistent, multicast A", tokens, down_bytes, down_flops,
              time([&](int i) { cuda::moe_down(down_gathered(i % kCopies, 0, 8), stream); }));
    cuda::set_moe_gemm_multicast(false);
    // The MoE-LoRA in the persistent GEMMs' accumulators (MoeGemmLora, what set_moe_lora_in_gemm runs): the
    // same GEMMs with z·Bᵀ of rank 32 added before the epilogue, every token with one adapter or the tokens
    // spread over 8 (one pass per distinct slot of a warp's 16 rows). z is random, not a shrink's output.
    OwnedTensor z_host = OwnedTensor::host(DType::F32, {pairs, kRank});
    for (int64_t i = 0; i < z_host.view.numel(); ++i) z_host.view.ptr<float>()[i] = rng.normal();
    const OwnedTensor lora_z = cuda::upload(z_host);
    const OwnedTensor lora_z_rows = cuda::empty(DType::BF16, {capacity, 64});  // set_moe_gemm_lora_ktile's scratch
    const OwnedTensor lora_tile_slots = cuda::empty(DType::I32, {capacity / block_m});
    // (not for the halves layout: its gate_up never carries LoRA terms in the GEMM, moe_gate_up refuses them)
    // Each row's forms explicit (the defaults, epilogue warps and the k-tile, are restored after the rows): the first
    // row with the consumers' epilogue and add_lora_terms for every row.
    cuda::set_moe_gemm_epilogue_warps(false);
    cuda::set_moe_gemm_lora_ktile(false);
    for (const auto& [slots, name] : {std::pair{&d_slot_one, "one adapter"}, std::pair{&d_slot_spread, "8 adapters"}}) {
      if (m.layout == ops::GateUpLayout::kHalves) break;
      auto gate_up_lora = [&](int layer) {
        cuda::MoeGateUpParams p = gate_up_gathered(layer, 0, 8);
        p.lora = {.z = lora_z, .b = lora_b_gate_up, .rank = lora_rank, .token_slot = *slots, .z_rows = lora_z_rows,
                  .tile_slots = lora_tile_slots};
        return p;
      };
      auto down_lora = [&](int layer) {
        cuda::MoeDownParams p = down_gathered(layer, 256, 8);
        p.top_k = K;
        p.lora = {.z = lora_z, .b = lora_b_down, .rank = lora_rank, .token_slot = *slots, .z_rows = lora_z_rows,
                  .tile_slots = lora_tile_slots};
        return p;
      };
      cuda::moe_gate_up(gate_up_lora(0), stream);  // kernel attributes, outside the graph
      cuda::moe_down(down_lora(0), stream);
      BENCH_CUDA(cudaStreamSynchronize(stream));
      print_row((std::string("  gate_up fused, persistent + MoE-LoRA, ") + name).c_str(), tokens, gate_up_bytes,
                gate_up_flops, time([&](int i) { cuda::moe_gate_up(gate_up_lora(i % kCopies), stream); }));
      cuda::set_moe_gemm_epilogue_warps(true);  // after: the activation by the producer warpgroup's idle warps
      cuda::moe_gate_up(gate_up_lora(0), stream);  // kernel attributes, outside the graph
      BENCH_CUDA(cudaStreamSynchronize(stream));
      print_row((std::string("  gate_up fused, persistent + MoE-LoRA, ") + name + ", epilogue warps").c_str(), tokens,
                gate_up_bytes, gate_up_flops, time([&](int i) { cuda::moe_gate_up(gate_up_lora(i % kCopies), stream); }));
      cuda::set_moe_gemm_epilogue_lora(true);  // after: the LoRA terms by those warps too
      print_row((std::string("  gate_up fused, persistent + MoE-LoRA, ") + name + ", LoRA by the epilogue warps").c_str(),
                tokens, gate_up_bytes, gate_up_flops,
                time([&](int i) { cuda::moe_gate_up(gate_up_lora(i % kCopies), stream); }));
      cuda::set_moe_gemm_epilogue_lora(false);
      cuda::set_moe_gemm_epilogue_warps(false);
      cuda::set_moe_gemm_lora_ktile(true);  // after: the main slot's term as one more k-tile of the ring
      print_row((std::string("  gate_up fused, persistent + MoE-LoRA, ") + name + ", main slot as a k-tile").c_str(),
                tokens, gate_up_bytes, gate_up_flops,
                time([&](int i) { cuda::moe_gate_up(gate_up_lora(i % kCopies), stream); }));
      cuda::set_moe_gemm_lora_ktile(false);
      print_row((std::string("  down N 256, persistent + MoE-LoRA, ") + name).c_str(), tokens, down_bytes, down_flops,
                time([&](int i) { cuda::moe_down(down_lora(i % kCopies), stream); }));
      cuda::set_moe_gemm_lora_ktile(true);
      print_row((std::string("  down N 256, persistent + MoE-LoRA, ") + name + ", main slot as a k-tile").c_str(),
                tokens, down_bytes, down_flops, time([&](int i) { cuda::moe_down(down_lora(i % kCopies), stream); }));
      cuda::set_moe_gemm_lora_ktile(false);
    }
    cuda::set_moe_gemm_lora_ktile(true);  // the defaults again
    cuda::set_moe_gemm_epilogue_warps(true);
    lora_block_rows("in the accumulators, rows by slot");
    cuda::set_moe_gemm_epilogue_warps(false);  // before: the consumers' epilogue
    cuda::moe_gate_up(gate_up_gathered(0, 0, 8), stream);  // kernel attributes, outside the graph
    BENCH_CUDA(cudaStreamSynchronize(stream));
    print_row("  gate_up fused, persistent (no LoRA)", tokens, gate_up_bytes, gate_up_flops,
              time([&](int i) { cuda::moe_gate_up(gate_up_gathered(i % kCopies, 0, 8), stream); }));
    cuda::set_moe_gemm_epilogue_warps(true);  // after: the activation by the producer warpgroup's idle warps
    cuda::moe_gate_up(gate_up_gathered(0, 0, 8), stream);  // kernel attributes, outside the graph
    BENCH_CUDA(cudaStreamSynchronize(stream));
    print_row("  gate_up fused, persistent (no LoRA), epilogue warps", tokens, gate_up_bytes, gate_up_flops,
              time([&](int i) { cuda::moe_gate_up(gate_up_gathered(i % kCopies, 0, 8), stream); }));
    print_row("  down N 256, persistent (no LoRA)", tokens, down_bytes, down_flops,
              time([&](int i) { cuda::moe_down(down_gathered(i % kCopies, 256, 8), stream); }));
  }
  print_row("  align", tokens, align_bytes, 0, time([&](int) { cuda::moe_align(align, stream); }));
  if (pairs <= cuda::kMoeAlignTinyPairs) {  // before/after of the tiny path (decode batches)
    cuda::MoeAlignParams one_block = align;
    one_block.force_path = 0;
    print_row("  align, one-block path", tokens, align_bytes, 0, time([&](int) { cuda::moe_align(one_block, stream); }));
  }
  print_row("  gate_up + act (fused)", tokens, gate_up_bytes, gate_up_flops,
            time([&](int i) { cuda::moe_gate_up(gate_up(i % kCopies, true), stream); }));
  print_row("  gate_up -> h", tokens, gate_up_h_bytes, gate_up_flops,
            time([&](int i) { cuda::moe_gate_up(gate_up(i % kCopies, false), stream); }));
  print_row("  activation", tokens, activation_bytes, 0, time([&](int) {
              cuda::moe_activation({.h = h, .activation = m.activation, .layout = m.layout, .a = a}, stream);
            }));
  print_row("  down", tokens, down_bytes, down_flops, time([&](int i) { cuda::moe_down(down(i % kCopies), stream); }));
  for (int block_n : block_ns) {  // both BLOCK_N at this BLOCK_M (if built), to check the default
    const std::string suffix = " BLOCK_N " + std::to_string(block_n);
    print_row(("  gate_up fused" + suffix).c_str(), tokens, gate_up_bytes, gate_up_flops,
              time([&](int i) { cuda::moe_gate_up(gate_up(i % kCopies, true, block_n), stream); }));
    print_row(("  down" + suffix).c_str(), tokens, down_bytes, down_flops,
              time([&](int i) { cuda::moe_down(down(i % kCopies, block_n), stream); }));
  }
  for (int stages : decode_stages) {  // BLOCK_M 16: fewer stages, more CTAs per SM (the default has 6)
    const std::string suffix = " BLOCK_N 64, " + std::to_string(stages) + " stages";
    print_row(("  gate_up fused" + suffix).c_str(), tokens, gate_up_bytes, gate_up_flops,
              time([&](int i) { cuda::moe_gate_up(gate_up(i % kCopies, true, 64, 0, stages), stream); }));
    print_row(("  down" + suffix).c_str(), tokens, down_bytes, down_flops,
              time([&](int i) { cuda::moe_down(down(i % kCopies, 64, 0, stages), stream); }));
  }
  if (block_m != cuda::kMoeGemmBlockMDecode) {  // the grouped CTA order (L2 reuse of x) against the plain one
    print_row("  gate_up fused, CTA groups 8", tokens, gate_up_bytes, gate_up_flops,
              time([&](int i) { cuda::moe_gate_up(gate_up(i % kCopies, true, 0, 8), stream); }));
    print_row("  down, CTA groups 8", tokens, down_bytes, down_flops,
              time([&](int i) { cuda::moe_down(down(i % kCopies, 0, 8), stream); }));
    // The warp-specialized kernel with both operands by TMA: the A rows gathered into tile order first (the
    // gather kernel is inside the timed launch; its extra bytes are not in the floor).
    cuda::set_moe_gemm_kernel(cuda::MoeGemmKernel::kWgmmaWarpSpecialized);
    for (int block_n : {128, 256}) {
      cuda::moe_gate_up(gate_up_gathered(0, block_n), stream);  // kernel attributes, outside the graph
      cuda::moe_down(down_gathered(0, block_n), stream);
      BENCH_CUDA(cudaStreamSynchronize(stream));
      const std::string suffix = ", warp-spec., A gathered, BLOCK_N " + std::to_string(block_n);
      print_row(("  gate_up fused" + suffix).c_str(), tokens, gate_up_bytes, gate_up_flops,
                time([&](int i) { cuda::moe_gate_up(gate_up_gathered(i % kCopies, block_n), stream); }));
      print_row(("  down" + suffix).c_str(), tokens, down_bytes, down_flops,
                time([&](int i) { cuda::moe_down(down_gathered(i % kCopies, block_n), stream); }));
      const std::string plain = ", warp-spec., A by cp.async, BLOCK_N " + std::to_string(block_n);
      print_row(("  gate_up fused" + plain).c_str(), tokens, gate_up_bytes, gate_up_flops,
                time([&](int i) { cuda::moe_gate_up(gate_up(i % kCopies, true, block_n), stream); }));
      print_row(("  down" + plain).c_str(), tokens, down_bytes, down_flops,
                time([&](int i) { cuda::moe_down(down(i % kCopies, block_n), stream); }));
    }
    // moe_block's configuration: gathered rows, CTA groups of 8 (kAuto: gate_up of the halves layout stays
    // on the ring, as here with cp.async for the weight)
    // 128 is moe_block's choice; 256: twice the FLOPs per byte from L2; 192 (BLOCK_M 128 only): 1.2×, and
    // GPT-OSS-20B's widths are whole multiples of it
    const std::vector<int> configured_ns =
        block_m == cuda::kMoeGemmBlockMLarge ? std::vector<int>{128, 256, 192} : std::vector<int>{128, 256};
    for (int block_n : configured_ns) {
      const std::string suffix =
          ", warp-spec., A gathered, CTA groups 8" + (block_n == 128 ? std::string() : ", N " + std::to_string(block_n));
      print_row(("  gate_up fused" + suffix).c_str(), tokens, gate_up_bytes, gate_up_flops,
                time([&](int i) { cuda::moe_gate_up(gate_up_gathered(i % kCopies, block_n, 8), stream); }));
      print_row(("  down" + suffix).c_str(), tokens, down_bytes, down_flops,
                time([&](int i) { cuda::moe_down(down_gathered(i % kCopies, block_n, 8), stream); }));
      // before: the per-column general epilogue for every work item
      cuda::set_moe_gemm_compact_epilogue(false);
      print_row(("  gate_up fused" + suffix + ", general epilogue").c_str(), tokens, gate_up_bytes, gate_up_flops,
                time([&](int i) { cuda::moe_gate_up(gate_up_gathered(i % kCopies, block_n, 8), stream); }));
      print_row(("  down" + suffix + ", general epilogue").c_str(), tokens, down_bytes, down_flops,
                time([&](int i) { cuda::moe_down(down_gathered(i % kCopies, block_n, 8), stream); }));
      cuda::set_moe_gemm_compact_epilogue(true);
    }
    cuda::set_moe_gemm_kernel(cuda::MoeGemmKernel::kAuto);
  }
  if (block_m != cuda::kMoeGemmBlockMDecode) {
    // The ceiling this card reaches on the same FLOPs: one dense cuBLASLt GEMM of all `pairs` rows against one
    // expert's weight (no gather, no grouping, no fused activation): what a grouped GEMM could hope for at
    // the clocks the power cap allows (the GEMM benches run at the 700 W cap).
    static cuda::LinearRunner dense;
    dense.set_path(cuda::LinearPath::kCublasLt);
    const Tensor x_rows = sorted_x.view.rows(0, pairs);
    auto expert0 = [&](const OwnedTensor& w, int64_t rows, int64_t cols) {
      return Tensor(w.view.data, DType::BF16, {rows, cols}, Device::kCuda);
    };
    const Tensor a_rows = sorted_a.view.rows(0, pairs);
    auto dense_gate_up = [&](int i) {
      dense.run({.x = x_rows, .weight = expert0(layers[size_t(i % kCopies)].gate_up, 2 * I, H), .out = h.view}, stream);
    };
    auto dense_down = [&](int i) {
      dense.run({.x = a_rows, .weight = expert0(layers[size_t(i % kCopies)].down, H, I), .out = d.view}, stream);
    };
    dense_gate_up(0);  // the heuristic's first call, outside the graph
    dense_down(0);
    BENCH_CUDA(cudaStreamSynchronize(stream));
    print_row("  cuBLASLt dense, gate_up FLOPs", tokens, p * H * 2 + 2.0 * I * H * 2 + p * 2 * I * 2, gate_up_flops,
              time(dense_gate_up));
    print_row("  cuBLASLt dense, down FLOPs", tokens, p * I * 2 + double(H) * I * 2 + p * H * 2, down_flops,
              time(dense_down));
    grouped_library_rows(m, tokens, pairs, block_m, ids.view, layers, sorted_x.view, sorted_a.view, stream,
                         p * H * 2 + double(experts_touched) * 2.0 * I * H * 2 + p * 2 * I * 2, gate_up_flops,
                         p * I * 2 + double(experts_touched) * H * I * 2 + p * H * 2, down_flops);
  }
  print_row("  combine", tokens, combine_bytes, 0, time([&](int) {
              cuda::moe_combine({.d = d, .topk_weights = d_weights, .out = out}, stream);
            }));
}

}  // namespace
}  // namespace lmx

// Usage: bench_moe_gemm [MODEL [T ...]] — MODEL a prefix of a shape's name ("GPT", "Qwen"), T token counts:
// only those rows (a profiler run, e.g. ncu on the T 4096 prefill GEMM, wants few launches). Environment:
// BENCH_BLOCK_M=16|64|128 pins the component rows' tile height (the block rows keep moe_block's choice);
// BENCH_HALVES_BY_TMA=0: the halves layout's fused gate_up on the ring kernel (set_moe_gemm_halves_by_tma).
// BENCH_DECODE_WEIGHT_TMA=0: the bf16 decode GEMMs' weight tiles by cp.async copies (set_moe_decode_weight_by_tma).
// BENCH_MXFP4_WEIGHT_BULK=1: the MXFP4 decode GEMMs' weight spans by bulk copies (set_moe_mxfp4_weight_by_bulk).
// BENCH_DOWN_AB=N prints, after each T's first block row, only the block with down at BLOCK_N 192 and 240 in
// turn, N rounds (128-row tiles).
int main(int argc, char** argv) {
  using namespace lmx;
  const std::string only_model = argc > 1 ? argv[1] : "";
  std::vector<int64_t> token_counts;
  for (int i = 2; i < argc; ++i) token_counts.push_back(std::atoll(argv[i]));
  if (token_counts.empty()) token_counts = {1, 16, 64, 256, 1600, 4096};
  if (const char* v = std::getenv("BENCH_HALVES_BY_TMA"); v != nullptr && std::atoi(v) == 0) {
    cuda::set_moe_gemm_halves_by_tma(false);
    std::printf("every row: the halves-layout gate_up on the ring kernel (BENCH_HALVES_BY_TMA=0)\n");
  }
  if (const char* v = std::getenv("BENCH_DECODE_WEIGHT_TMA"); v != nullptr && std::atoi(v) == 0) {
    cuda::set_moe_decode_weight_by_tma(false);
    std::printf("every row: the bf16 decode GEMMs' weight tiles by cp.async copies (BENCH_DECODE_WEIGHT_TMA=0)\n");
  }
  if (const char* v = std::getenv("BENCH_MXFP4_WEIGHT_BULK"); v != nullptr && std::atoi(v) != 0) {
    cuda::set_moe_mxfp4_weight_by_bulk(true);
    std::printf("every row: the MXFP4 decode GEMMs' weight spans by bulk copies (BENCH_MXFP4_WEIGHT_BULK=1)\n");
  }
  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreate(&stream));
  Rng rng(20261203);
  const Model models[] = {
      {"GPT-OSS-20B", 2880, 2880, 32, 4, ops::MoeActivation::kGptOssClamped, ops::GateUpLayout::kInterleaved, true},
      {"Qwen3-30B-A3B", 2048, 768, 128, 8, ops::MoeActivation::kSiluGated, ops::GateUpLayout::kHalves, false}};
  std::printf("bench_moe_gemm: base MoE layer, bf16, floor = max(bytes / 4.2 TB/s, FLOPs / 750 TFLOP/s)\n");
  for (const Model& m : models) {
    if (std::string(m.name).rfind(only_model, 0) != 0) continue;
    std::vector<Layer> layers;
    for (int l = 0; l < kCopies; ++l) {
      Layer layer{random_device_bf16(rng, {m.experts, 2 * m.inter, m.hidden}), {},
                  random_device_bf16(rng, {m.experts, m.hidden, m.inter}), {}};
      if (m.biases) {
        layer.gate_up_bias = random_device_bf16(rng, {m.experts, 2 * m.inter});
        layer.down_bias = random_device_bf16(rng, {m.experts, m.hidden});
      }
      if (m.layout == ops::GateUpLayout::kInterleaved && m.hidden % 64 == 0 && m.inter % 64 == 0) {
        const model::Mxfp4Decode gu = model::generate_mxfp4_decode(m.experts, 2 * m.inter, m.hidden, rng.next_u64(), 119);
        const model::Mxfp4Decode dn = model::generate_mxfp4_decode(m.experts, m.hidden, m.inter, rng.next_u64(), 119);
        layer.gate_up_blocks = cuda::upload(gu.blocks);
        layer.gate_up_scales = cuda::upload(gu.scales);
        layer.down_blocks = cuda::upload(dn.blocks);
        layer.down_scales = cuda::upload(dn.scales);
      }
      layers.push_back(std::move(layer));
    }
    std::printf("%s: H %lld, I %lld, E %lld, K %lld, %d weight copies of %.2f GB\n", m.name, (long long)m.hidden,
                (long long)m.inter, (long long)m.experts, (long long)m.top_k, kCopies,
                double(layers[0].gate_up.view.nbytes() + layers[0].down.view.nbytes()) / 1e9);
    // BENCH_WIDE_COPIES=N: N more bf16 copies of the layer (GPT-OSS-20B's 24 layers: 38 GB) for one row that
    // cycles over them, as a model's prefill walks its layers: whether the weights' spread (TLB reach, DRAM
    // pages) slows the GEMMs against the 3 copies the other rows cycle over (perf-log run 223)
    std::vector<Layer> wide;
    if (const char* v = std::getenv("BENCH_WIDE_COPIES"); v != nullptr && std::atoi(v) > 0) {
      for (int l = 0; l < std::atoi(v); ++l) {
        Layer layer{random_device_bf16(rng, {m.experts, 2 * m.inter, m.hidden}), {},
                    random_device_bf16(rng, {m.experts, m.hidden, m.inter}), {}};
        if (m.biases) {
          layer.gate_up_bias = random_device_bf16(rng, {m.experts, 2 * m.inter});
          layer.down_bias = random_device_bf16(rng, {m.experts, m.hidden});
        }
        wide.push_back(std::move(layer));
      }
    }
    for (int64_t tokens : token_counts) bench_tokens(m, tokens, layers, wide, stream, rng);
  }
  BENCH_CUDA(cudaStreamDestroy(stream));
  return 0;
}
