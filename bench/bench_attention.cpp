// bench_attention: GPU time of one layer's paged attention at GPT-OSS-20B shapes (Hq 64, Hkv 8, D 64, P 16,
// sinks on) and Qwen3-30B-A3B's prefill (Hq 32, Hkv 4, D 128, no sinks), each kernel of
// backends/cuda/attention.cuh: the first simple kernel (one warp per row), flash without a workspace at both
// row tiles (64 and 128 rows), and the launcher's choice with a workspace (split-KV when the row tiles are few).
//  - prefill of one 1,600-token prompt, full causal and window 128: FLOPs = 4·D·Hq·Σ_t keys(t) (QKᵀ and
//    P·V, 2 FLOPs per multiply-add each; keys(t) = t + 1, or min(t + 1, 128)), floor at 750 TFLOP/s;
//  - decode of 16 sequences at context 2,000, full and window 128: bytes = the K and V rows each sequence
//    reads (keys·Hkv·D·2 B, twice) + q and out, floor at 4.2 TB/s. The launches cycle over 4 copies of
//    the cache (4 × 65 MB, > 5× the L2) so K/V come from DRAM. Decode also runs split-KV pinned at 4, 6,
//    8, 16 splits, each with the 2- and 3-stage K/V ring: the data for the launcher's split and ring rules.
// Every row prints both counts and the floor is the larger of the two (FLOPs count the useful math only:
// flash's second P·V mma for P's low bf16 part is overhead against the floor).
// Method as the other CUDA benchmarks (bench/cuda_timing.h): launches in one CUDA graph, median replay.
// Random bf16 data, never zeros; pages in shuffled physical order. Numbers go to docs/perf-log.md.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "backends/cuda/attention.cuh"
#include "backends/cuda/memory.h"
#include "bench/cuda_timing.h"
#include "core/rng.h"

namespace lmx {
namespace {

constexpr double kBytesPerSecond = 4.2e12;  // measured d2d copy (docs/perf-log.md)
constexpr double kFlopsPerSecond = 750e12;  // measured bf16 dense (issue 4)
constexpr int64_t kPageSize = 16;

// A model's attention shape.
struct Shape {
  const char* model;
  int64_t q_heads, kv_heads, head_dim;
  bool sinks;
};
constexpr Shape kGptOss{"GPT-OSS-20B", 64, 8, 64, true};
constexpr Shape kQwen3{"Qwen3-30B-A3B", 32, 4, 128, false};
constexpr int kCopies = 4;       // caches the launches cycle over
constexpr int kIterations = 40;  // per graph (a multiple of kCopies)
constexpr int kReplays = 7;

OwnedTensor random_device_bf16(Rng& rng, std::initializer_list<int64_t> dims) {
  OwnedTensor host = OwnedTensor::host(DType::BF16, dims);
  for (int64_t i = 0; i < host.view.numel(); ++i) host.view.ptr<bf16>()[i] = f32_to_bf16(rng.normal());
  return cuda::upload(host);
}

// One attention batch on the device: B sequences with `context` keys each, the last `queries` of them this
// step's tokens; kCopies caches with the same block table.
struct Batch {
  Shape shape;
  int64_t tokens = 0, seqs = 0, context = 0;
  OwnedTensor q, block_table, seq_start, positions, sinks, out;  // [T, Hq, D], [B, pages], [B+1], [T], [Hq], [T, Hq, D]
  std::vector<OwnedTensor> k_cache, v_cache;                     // kCopies × [pages, P, Hkv, D] bf16
};

Batch make_batch(Rng& rng, const Shape& shape, int64_t seqs, int64_t context, int64_t queries) {
  const int64_t kQHeads = shape.q_heads, kKvHeads = shape.kv_heads, kHeadDim = shape.head_dim;
  Batch batch;
  batch.shape = shape;
  batch.seqs = seqs;
  batch.context = context;
  batch.tokens = seqs * queries;
  const int64_t pages_per_seq = (context + kPageSize - 1) / kPageSize, pages = seqs * pages_per_seq;
  std::vector<int32_t> order(static_cast<size_t>(pages));
  for (int64_t i = 0; i < pages; ++i) order[size_t(i)] = int32_t(i);
  for (int64_t i = pages - 1; i > 0; --i) std::swap(order[size_t(i)], order[size_t(rng.next_u64() % uint64_t(i + 1))]);
  OwnedTensor table = OwnedTensor::host(DType::I32, {seqs, pages_per_seq});
  OwnedTensor start = OwnedTensor::host(DType::I32, {seqs + 1});
  OwnedTensor positions = OwnedTensor::host(DType::I32, {batch.tokens});
  for (int64_t i = 0; i < pages; ++i) table.view.ptr<int32_t>()[i] = order[size_t(i)];
  for (int64_t b = 0; b <= seqs; ++b) start.view.ptr<int32_t>()[b] = int32_t(b * queries);
  for (int64_t b = 0; b < seqs; ++b) {
    for (int64_t i = 0; i < queries; ++i) {
      positions.view.ptr<int32_t>()[b * queries + i] = int32_t(context - queries + i);
    }
  }
  batch.block_table = cuda::upload(table);
  batch.seq_start = cuda::upload(start);
  batch.positions = cuda::upload(positions);
  batch.q = random_device_bf16(rng, {batch.tokens, kQHeads, kHeadDim});
  batch.sinks = random_device_bf16(rng, {kQHeads});
  batch.out = cuda::empty(DType::BF16, {batch.tokens, kQHeads, kHeadDim});
  for (int c = 0; c < kCopies; ++c) {
    batch.k_cache.push_back(random_device_bf16(rng, {pages, kPageSize, kKvHeads, kHeadDim}));
    batch.v_cache.push_back(random_device_bf16(rng, {pages, kPageSize, kKvHeads, kHeadDim}));
  }
  return batch;
}

// Keys the batch's queries see in total: Σ over tokens of min(position + 1, window).
double keys_seen(const Batch& batch, int window) {
  const int64_t queries = batch.tokens / batch.seqs;
  double keys = 0;
  for (int64_t i = 0; i < queries; ++i) {
    const int64_t position = batch.context - queries + i;
    keys += double(window > 0 ? std::min<int64_t>(position + 1, window) : position + 1);
  }
  return keys * double(batch.seqs);
}

// Times each variant on the batch; `pinned_splits` adds split-KV rows at those split counts (decode tuning).
void run(const char* what, const Batch& batch, int window, void* workspace, size_t workspace_bytes,
         const std::vector<int>& pinned_splits, cudaStream_t stream) {
  const double keys = keys_seen(batch, window);
  const int64_t kQHeads = batch.shape.q_heads, kKvHeads = batch.shape.kv_heads, kHeadDim = batch.shape.head_dim;
  const double flops = 4.0 * double(kHeadDim) * double(kQHeads) * keys;
  const double row_bytes = double(kQHeads) * kHeadDim * 2.0;  // q or out of one token
  // Each sequence's K and V rows from its first query's window start on, read once.
  const int64_t queries = batch.tokens / batch.seqs;
  const int64_t first_key = window > 0 ? std::max<int64_t>(0, batch.context - queries - window + 1) : 0;
  const double kv_rows = double(batch.seqs) * double(batch.context - first_key);
  const double bytes = 2.0 * kv_rows * double(kKvHeads) * kHeadDim * 2.0 + 2.0 * double(batch.tokens) * row_bytes;
  const double floor = std::max(bytes / kBytesPerSecond, flops / kFlopsPerSecond);
  struct Variant {
    std::string name;
    cuda::AttentionLaunch launch;
    bool two_barriers = false;  // the K/V loop's two CTA barriers per tile (before set_attention_one_barrier)
    bool mma_sync = false;      // 128-row tiles by mma.sync (set_attention_wgmma(false): the before rows)
    bool copies_in_order = false;  // wgmma tiles' K/V copies between barrier and Q·Kᵀ (overlap_kv off: before)
    bool by_head = false;          // CTAs by kv head (set_attention_heads_inner(false): the before row)
  };
  std::vector<Variant> variants = {
      {"simple (old)", {.kernel = cuda::AttentionKernel::kSimple}},
      {"flash, 16-row tiles (key split)", {.kernel = cuda::AttentionKernel::kFlash, .flash_rows = 16}},
      {"flash, 64-row tiles", {.kernel = cuda::AttentionKernel::kFlash, .flash_rows = 64}},
      {"flash, 128-row tiles", {.kernel = cuda::AttentionKernel::kFlash, .flash_rows = 128}},
      {"auto + workspace", {.workspace = workspace, .workspace_bytes = workspace_bytes}},
  };
  variants.push_back({"auto + workspace, 64-row tiles",
                      {.workspace = workspace, .workspace_bytes = workspace_bytes, .flash_rows = 64}});
  variants.push_back({"auto + workspace, 3 stages",
                      {.workspace = workspace, .workspace_bytes = workspace_bytes, .kv_stages = 3}});
  variants.push_back({"auto + workspace, two barriers a tile", {.workspace = workspace, .workspace_bytes = workspace_bytes},
                      true});
  variants.push_back({"flash, 128-row tiles, two barriers", {.kernel = cuda::AttentionKernel::kFlash, .flash_rows = 128},
                      true});
  for (int splits : pinned_splits) {
    for (int stages : {2, 3}) {
      variants.push_back({"split-KV x" + std::to_string(splits) + (stages == 3 ? ", 3 stages" : ""),
                          {.workspace = workspace, .workspace_bytes = workspace_bytes,
                           .kernel = cuda::AttentionKernel::kSplitKv, .flash_rows = 64, .splits = splits,
                           .kv_stages = stages}});
    }
    variants.push_back({"split-KV x" + std::to_string(splits) + ", key split",
                        {.workspace = workspace, .workspace_bytes = workspace_bytes,
                         .kernel = cuda::AttentionKernel::kSplitKv, .flash_rows = 16, .splits = splits}});
  }
  {  // before rows of the 128-row tiles by warpgroup MMAs (the default since perf-log run 116)
    variants.push_back({"flash, 128-row tiles, mma.sync", {.kernel = cuda::AttentionKernel::kFlash, .flash_rows = 128},
                        false, true});
    variants.push_back({"auto + workspace, mma.sync", {.workspace = workspace, .workspace_bytes = workspace_bytes},
                        false, true});
    variants.push_back({"flash, 128-row tiles, copies in order",
                        {.kernel = cuda::AttentionKernel::kFlash, .flash_rows = 128}, false, false, true});
  }
  // the CTA order by kv head (set_attention_heads_inner off; the default has the heads inner), against "flash,
  // 128-row tiles" / "auto + workspace"
  variants.push_back({"flash, 128-row tiles, by head", {.kernel = cuda::AttentionKernel::kFlash, .flash_rows = 128},
                      false, false, false, true});
  variants.push_back({"auto + workspace, by head", {.workspace = workspace, .workspace_bytes = workspace_bytes},
                      false, false, false, true});
  for (const Variant& variant : variants) {
    auto enqueue = [&](int i) {
      const int copy = i % kCopies;
      cuda::attention({.q = batch.q, .k_cache = batch.k_cache[size_t(copy)], .v_cache = batch.v_cache[size_t(copy)],
                       .block_table = batch.block_table, .seq_start = batch.seq_start, .positions = batch.positions,
                       .sinks = batch.shape.sinks ? batch.sinks.view : Tensor{}, .sliding_window = window,
                       .softmax_scale = 1.0f / std::sqrt(float(kHeadDim)), .out = batch.out},
                      stream, variant.launch);
    };
    cuda::set_attention_one_barrier(!variant.two_barriers);
    cuda::set_attention_wgmma(!variant.mma_sync);
    cuda::set_attention_wgmma_overlap_kv(!variant.copies_in_order);
    cuda::set_attention_heads_inner(!variant.by_head);
    enqueue(0);  // eager first: shared-memory attributes are set outside the capture
    BENCH_CUDA(cudaStreamSynchronize(stream));
    const double seconds = bench::seconds_per_launch(stream, kIterations, kReplays, enqueue);
    cuda::set_attention_one_barrier(true);
    cuda::set_attention_wgmma(true);
    cuda::set_attention_wgmma_overlap_kv(true);
    cuda::set_attention_heads_inner(true);
    const char* bound = bytes / kBytesPerSecond >= flops / kFlopsPerSecond ? "bytes" : "flops";
    std::printf("%-34s %-20s %9.2f us  %13.0f FLOP  %12.0f B  floor %7.2f us (%s)  %5.1f%% of floor\n", what,
                variant.name.c_str(), seconds * 1e6, flops, bytes, floor * 1e6, bound, 100.0 * floor / seconds);
  }
}

int main_impl() {
  Rng rng(20261202);
  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreate(&stream));
  for (const Shape& shape : {kGptOss, kQwen3}) {
    std::printf("%s attention, one layer: Hq %lld, Hkv %lld, D %lld, P %lld%s; H200 floors %.0f TB/s, %.0f TFLOP/s\n",
                shape.model, (long long)shape.q_heads, (long long)shape.kv_heads, (long long)shape.head_dim,
                (long long)kPageSize, shape.sinks ? ", sinks" : "", kBytesPerSecond / 1e12, kFlopsPerSecond / 1e12);
    {
      const Batch prefill = make_batch(rng, shape, 1, 1600, 1600);
      const size_t bytes = cuda::attention_workspace_bytes(prefill.tokens, shape.q_heads, shape.head_dim);
      OwnedTensor workspace = cuda::empty(DType::F32, {int64_t(bytes / sizeof(float))});
      run("prefill T 1600, causal", prefill, 0, workspace.view.data, bytes, {}, stream);
      // Qwen3 has no sliding layers; its decode rows would repeat GPT-OSS's kernels at D 128 (not tuned here)
      if (shape.sinks) run("prefill T 1600, window 128", prefill, 128, workspace.view.data, bytes, {}, stream);
    }
    if (!shape.sinks) continue;
    const Batch decode = make_batch(rng, shape, 16, 2000, 1);
    const size_t bytes = cuda::attention_workspace_bytes(decode.tokens, shape.q_heads, shape.head_dim);
    OwnedTensor workspace = cuda::empty(DType::F32, {int64_t(bytes / sizeof(float))});
    run("decode B 16, context 2000", decode, 0, workspace.view.data, bytes, {2, 4, 6, 8, 16}, stream);
    run("decode B 16, context 2000, win 128", decode, 128, workspace.view.data, bytes, {2}, stream);
  }
  BENCH_CUDA(cudaStreamDestroy(stream));
  return 0;
}

}  // namespace
}  // namespace lmx

int main(int argc, char**) {
  if (argc > 1) {
    std::fprintf(stderr, "usage: bench_attention (no arguments)\n");
    return 2;
  }
  return lmx::main_impl();
}
