// bench_moe_lora: GPU time of the MoE-LoRA of one GPT-OSS-20B layer (H 2880, I 2880, E 32, K 4), 8 adapter
// slots of rank 32, tokens spread evenly over the slots, for T = 1, 16 (decode), 256 and 2048 (prefill):
// align by (slot, expert), shrink + expand for gate_up (x [T, H] -> [T*K, 2I]) and for down ([T*K, I] ->
// [T*K, H]). Each row prints µs, the bytes that must move (the touched A/B slices — R·in + out·R bf16 per
// distinct (slot, expert) and projection — plus x, z and y), the FLOPs, and the share of the H200 floor
// max(bytes / 4.2 TB/s, FLOPs / 750 TFLOP/s). Method as bench_cuda_ops: many launches in one CUDA graph,
// cycling over 3 copies of the layer's LoRA stacks (708 MB, ~12× the L2) so weights come from DRAM; median
// of 7 replays. Random bf16 data, never zeros. Run by scripts/device; numbers go to docs/perf-log.md.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "backends/cuda/memory.h"
#include "bench/cuda_timing.h"
#include "backends/cuda/moe_align.cuh"
#include "backends/cuda/moe_lora.cuh"
#include "core/rng.h"

namespace lmx {
namespace {


constexpr double kBytesPerSecond = 4.2e12;   // measured d2d copy (docs/perf-log.md)
constexpr double kFlopsPerSecond = 750e12;   // measured bf16 dense (issue 4)
constexpr int64_t kHidden = 2880, kInter = 2880, kExperts = 32, kTopK = 4, kSlots = 8, kRank = 32;
constexpr int kLayers = 3;      // copies of the LoRA stacks the launches cycle over
constexpr int kIterations = 60;  // per graph (a multiple of kLayers)
constexpr int kReplays = 7;

OwnedTensor random_device_bf16(Rng& rng, std::initializer_list<int64_t> dims) {
  OwnedTensor host = OwnedTensor::host(DType::BF16, dims);
  // One 1M-value random block tiled (fast for the 236 MB stacks), scale 0.05: y stays O(1) over the replays.
  static std::vector<bf16> block = [&] {
    std::vector<bf16> b(size_t(1) << 20);
    for (bf16& v : b) v = f32_to_bf16(0.05f * rng.normal());
    return b;
  }();
  for (int64_t i = 0; i < host.view.numel(); ++i) host.view.ptr<bf16>()[i] = block[size_t(i) % block.size()];
  return cuda::upload(host);
}

double time_graph(cudaStream_t stream, const std::function<void(int)>& launch) {
  return bench::seconds_per_launch(stream, kIterations, kReplays, launch);
}

void print_row(const char* what, int64_t tokens, double bytes, double flops, double seconds) {
  const double floor = std::max(bytes / kBytesPerSecond, flops / kFlopsPerSecond);
  std::printf("%-28s T %5lld  %9.2f us  %12.0f B  %12.0f FLOP  floor %7.2f us (%s)  %5.1f%% of floor\n", what,
              (long long)tokens, seconds * 1e6, bytes, flops, floor * 1e6,
              bytes / kBytesPerSecond >= flops / kFlopsPerSecond ? "bytes" : "flops", 100.0 * floor / seconds);
}

struct Layer {
  OwnedTensor gu_a, gu_b, down_a, down_b;  // [S, E, R, H], [S, E, 2I, R], [S, E, R, I], [S, E, H, R] bf16
};

void bench_tokens(int64_t tokens, const std::vector<Layer>& layers, const OwnedTensor& rank, cudaStream_t stream,
                  Rng& rng) {
  const int64_t pairs = tokens * kTopK, groups = kSlots * kExperts;
  // Routing: distinct experts per token; tokens spread evenly over the 8 adapters.
  std::vector<int32_t> ids(static_cast<size_t>(pairs)), slot(static_cast<size_t>(tokens));
  std::set<int64_t> touched;  // distinct (slot, expert)
  for (int64_t t = 0; t < tokens; ++t) {
    slot[t] = int32_t(t % kSlots);
    std::vector<int32_t> all(kExperts);
    for (int32_t e = 0; e < kExperts; ++e) all[e] = e;
    for (int64_t k = 0; k < kTopK; ++k) {
      std::swap(all[k], all[k + int64_t(rng.next_u64() % uint64_t(kExperts - k))]);
      ids[t * kTopK + k] = all[k];
      touched.insert(slot[t] * kExperts + all[k]);
    }
  }
  OwnedTensor h_ids = OwnedTensor::host(DType::I32, {tokens, kTopK}), h_slot = OwnedTensor::host(DType::I32, {tokens});
  std::copy(ids.begin(), ids.end(), h_ids.view.ptr<int32_t>());
  std::copy(slot.begin(), slot.end(), h_slot.view.ptr<int32_t>());
  OwnedTensor d_ids = cuda::upload(h_ids), d_slot = cuda::upload(h_slot);
  OwnedTensor x = random_device_bf16(rng, {tokens, kHidden});
  OwnedTensor act = random_device_bf16(rng, {pairs, kInter});
  OwnedTensor y_gu = random_device_bf16(rng, {pairs, 2 * kInter});
  OwnedTensor y_down = random_device_bf16(rng, {pairs, kHidden});
  OwnedTensor z_gu = cuda::empty(DType::F32, {pairs, kRank}), z_down = cuda::empty(DType::F32, {pairs, kRank});
  const int64_t capacity = cuda::moe_align_capacity(pairs, groups, cuda::kMoeLoraBlockM);
  OwnedTensor sorted = cuda::empty(DType::I32, {capacity});
  OwnedTensor tiles = cuda::empty(DType::I32, {capacity / cuda::kMoeLoraBlockM});
  OwnedTensor offsets = cuda::empty(DType::I32, {groups + 1});
  OwnedTensor num_tiles = cuda::empty(DType::I32, {1});
  OwnedTensor workspace = cuda::empty(DType::U8, {int64_t(cuda::moe_align_workspace_bytes(pairs, groups))});
  const cuda::MoeAlignParams align{.topk_ids = d_ids, .token_slot = d_slot, .experts = kExperts, .slots = kSlots,
                                   .block_m = cuda::kMoeLoraBlockM, .sorted_pairs = sorted, .tile_group = tiles,
                                   .group_offsets = offsets, .num_tiles = num_tiles, .workspace = workspace};
  auto gate_up = [&](int layer, int split) {
    return cuda::MoeLoraParams{.x = x, .w = {.a = layers[layer].gu_a, .b = layers[layer].gu_b, .rank = rank},
                               .top_k = kTopK, .sorted_pairs = sorted, .tile_group = tiles, .num_tiles = num_tiles,
                               .block_m = cuda::kMoeLoraBlockM, .z = z_gu, .y = y_gu, .split_k = split};
  };
  auto down = [&](int layer, int split) {
    return cuda::MoeLoraParams{.x = act, .w = {.a = layers[layer].down_a, .b = layers[layer].down_b, .rank = rank},
                               .top_k = kTopK, .sorted_pairs = sorted, .tile_group = tiles, .num_tiles = num_tiles,
                               .block_m = cuda::kMoeLoraBlockM, .z = z_down, .y = y_down, .split_k = split};
  };
  auto whole_layer = [&](int layer, int split) {
    cuda::moe_align(align, stream);
    cuda::moe_lora_shrink(gate_up(layer, split), stream);
    cuda::moe_lora_expand(gate_up(layer, split), stream);
    cuda::moe_lora_shrink(down(layer, split), stream);
    cuda::moe_lora_expand(down(layer, split), stream);
  };
  whole_layer(0, 0);
  BENCH_CUDA(cudaStreamSynchronize(stream));

  const double g = double(touched.size()), p = double(pairs), t = double(tokens), r = double(kRank);
  const double shrink_gu_bytes = g * r * kHidden * 2 + t * kHidden * 2 + p * r * 4;
  const double expand_gu_bytes = g * 2 * kInter * r * 2 + p * r * 4 + 2 * p * 2 * kInter * 2;
  const double shrink_down_bytes = g * r * kInter * 2 + p * kInter * 2 + p * r * 4;
  const double expand_down_bytes = g * kHidden * r * 2 + p * r * 4 + 2 * p * kHidden * 2;
  const double shrink_gu_flops = 2 * p * r * kHidden, expand_gu_flops = 2 * p * r * 2 * kInter;
  const double shrink_down_flops = 2 * p * r * kInter, expand_down_flops = 2 * p * r * kHidden;
  const double align_bytes = p * 4 * 3 + t * 4;
  const double total_bytes = shrink_gu_bytes + expand_gu_bytes + shrink_down_bytes + expand_down_bytes + align_bytes;
  const double total_flops = shrink_gu_flops + expand_gu_flops + shrink_down_flops + expand_down_flops;
  const int auto_split = cuda::moe_lora_auto_split(pairs, groups, kHidden);
  std::printf("-- T %lld: %lld pairs, %zu distinct (slot, expert), auto split_k %d, max tiles %lld\n",
              (long long)tokens, (long long)pairs, touched.size(), auto_split,
              (long long)(capacity / cuda::kMoeLoraBlockM));

  print_row("layer (auto split)", tokens, total_bytes, total_flops,
            time_graph(stream, [&](int i) { whole_layer(i % kLayers, 0); }));
  print_row("layer (no split)", tokens, total_bytes, total_flops,
            time_graph(stream, [&](int i) { whole_layer(i % kLayers, 1); }));
  print_row("  align", tokens, align_bytes, 0, time_graph(stream, [&](int) { cuda::moe_align(align, stream); }));
  for (int split : {0, 1}) {
    const std::string suffix = split == 0 ? " (auto split)" : " (no split)";
    print_row(("  shrink gate_up" + suffix).c_str(), tokens, shrink_gu_bytes, shrink_gu_flops,
              time_graph(stream, [&](int i) { cuda::moe_lora_shrink(gate_up(i % kLayers, split), stream); }));
    print_row(("  shrink down" + suffix).c_str(), tokens, shrink_down_bytes, shrink_down_flops,
              time_graph(stream, [&](int i) { cuda::moe_lora_shrink(down(i % kLayers, split), stream); }));
  }
  print_row("  expand gate_up", tokens, expand_gu_bytes, expand_gu_flops,
            time_graph(stream, [&](int i) { cuda::moe_lora_expand(gate_up(i % kLayers, 0), stream); }));
  print_row("  expand down", tokens, expand_down_bytes, expand_down_flops,
            time_graph(stream, [&](int i) { cuda::moe_lora_expand(down(i % kLayers, 0), stream); }));
}

}  // namespace
}  // namespace lmx

int main() {
  using namespace lmx;
  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreate(&stream));
  Rng rng(20261202);
  std::vector<Layer> layers;
  for (int l = 0; l < kLayers; ++l) {
    layers.push_back({random_device_bf16(rng, {kSlots, kExperts, kRank, kHidden}),
                      random_device_bf16(rng, {kSlots, kExperts, 2 * kInter, kRank}),
                      random_device_bf16(rng, {kSlots, kExperts, kRank, kInter}),
                      random_device_bf16(rng, {kSlots, kExperts, kHidden, kRank})});
  }
  OwnedTensor rank = OwnedTensor::host(DType::I32, {kSlots});
  for (int64_t s = 0; s < kSlots; ++s) rank.view.ptr<int32_t>()[s] = int32_t(kRank);
  OwnedTensor d_rank = cuda::upload(rank);
  std::printf("bench_moe_lora: GPT-OSS-20B MoE-LoRA (H %lld, I %lld, E %lld, K %lld, S %lld, R %lld), bf16, "
              "floor = max(bytes / 4.2 TB/s, FLOPs / 750 TFLOP/s)\n",
              (long long)kHidden, (long long)kInter, (long long)kExperts, (long long)kTopK, (long long)kSlots,
              (long long)kRank);
  for (int64_t tokens : {1, 16, 256, 2048}) bench_tokens(tokens, layers, d_rank, stream, rng);
  BENCH_CUDA(cudaStreamDestroy(stream));
  return 0;
}
