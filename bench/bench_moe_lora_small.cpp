// bench_moe_lora_small: GPU time of the direct per-pair MoE-LoRA (backends/cuda/moe_lora_small.cuh) on one
// GPT-OSS-20B layer (H 2880, I 2880, E 32, K 4), 8 adapter slots of rank 32, tokens spread evenly over the
// slots, T = 1 … 64: shrink + expand for gate_up (x [T, H] -> [T*K, 2I]) and for down ([T*K, I] -> [T*K, H]),
// no align. Rows: the layer as 4 kernels (shrink + expand) and as 2 fused kernels, and each kernel, PDL on
// and off; then the launch-shape sweep (MoeLoraSmallParams.shrink_vectors_per_lane / expand_vectors_per_
// thread) that fixes the built-in choice. Each row prints µs, the bytes that must move (touched A/B slices —
// R·in + out·R bf16 per distinct (slot, expert) and projection — plus x, z and y), FLOPs and the share of
// the floor max(bytes / 4.2 TB/s, FLOPs / 750 TFLOP/s). Method of bench_moe_lora (bench/cuda_timing.h):
// 60 launches in one CUDA graph, median of 7 replays. Launch i uses copy i % 3 of the LoRA stacks and
// routing i % 20 (20 random routings per T), so the 60 launches of a graph touch 60 different sets of A/B
// slices (≥ 170 MB even at T = 1, ~3× the L2): decode reads adapters from DRAM, as between real layers.
// Run 2 (docs/perf-log.md) used one routing, so at T = 1 its slices stayed in L2; the row "1 routing"
// repeats that figure for comparison. Random bf16 data. Run on the H200; numbers go to docs/perf-log.md.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "backends/cuda/memory.h"
#include "backends/cuda/moe_lora_small.cuh"
#include "bench/cuda_timing.h"
#include "core/rng.h"

namespace lmx {
namespace {

constexpr double kBytesPerSecond = 4.2e12;  // measured d2d copy (docs/perf-log.md)
constexpr double kFlopsPerSecond = 750e12;  // measured bf16 dense (issue 4)
constexpr int64_t kHidden = 2880, kInter = 2880, kExperts = 32, kTopK = 4, kSlots = 8, kRank = 32;
constexpr int kLayers = 3;       // copies of the LoRA stacks the launches cycle over
constexpr int kIterations = 60;  // per graph (a multiple of kLayers and kRoutings)
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

// A zeroed device tensor: the self-cleaning scratch (z, z_readers) starts at zero once.
OwnedTensor zeroed(DType dtype, std::initializer_list<int64_t> dims) {
  OwnedTensor t = cuda::empty(dtype, dims);
  cuda::fill_bytes(t.view, 0);
  return t;
}

double time_graph(cudaStream_t stream, const std::function<void(int)>& launch) {
  return bench::seconds_per_launch(stream, kIterations, kReplays, launch);
}

void print_row(const std::string& what, int64_t tokens, double bytes, double flops, double seconds) {
  const double floor = std::max(bytes / kBytesPerSecond, flops / kFlopsPerSecond);
  std::printf("%-30s T %3lld  %8.2f us  %11.0f B  %10.0f FLOP  floor %6.2f us (%s)  %5.1f%% of floor\n",
              what.c_str(), (long long)tokens, seconds * 1e6, bytes, flops, floor * 1e6,
              bytes / kBytesPerSecond >= flops / kFlopsPerSecond ? "bytes" : "flops", 100.0 * floor / seconds);
}

struct Layer {
  OwnedTensor gu_a, gu_b, down_a, down_b;  // [S, E, R, H], [S, E, 2I, R], [S, E, R, I], [S, E, H, R] bf16
};

constexpr int kRoutings = 20;  // routings per T the launches cycle over (kIterations a multiple of 3 and 20)
static_assert(kIterations % kLayers == 0 && kIterations % kRoutings == 0);

// One random routing: distinct experts per token, token t on slot t % S; the distinct (slot, expert) count.
struct Routing {
  OwnedTensor topk_ids, token_slot;  // [T, K] i32, [T] i32 (device)
  size_t touched = 0;
};

Routing random_routing(int64_t tokens, Rng& rng) {
  OwnedTensor ids = OwnedTensor::host(DType::I32, {tokens, kTopK}), slot = OwnedTensor::host(DType::I32, {tokens});
  std::set<int64_t> touched;
  for (int64_t t = 0; t < tokens; ++t) {
    slot.view.ptr<int32_t>()[t] = int32_t(t % kSlots);
    std::vector<int32_t> all(kExperts);
    for (int32_t e = 0; e < kExperts; ++e) all[e] = e;
    for (int64_t k = 0; k < kTopK; ++k) {
      std::swap(all[k], all[k + int64_t(rng.next_u64() % uint64_t(kExperts - k))]);
      ids.view.ptr<int32_t>()[t * kTopK + k] = all[k];
      touched.insert((t % kSlots) * kExperts + all[k]);
    }
  }
  return {cuda::upload(ids), cuda::upload(slot), touched.size()};
}

void bench_tokens(int64_t tokens, const std::vector<Layer>& layers, const OwnedTensor& rank, cudaStream_t stream,
                  Rng& rng) {
  const int64_t pairs = tokens * kTopK;
  std::vector<Routing> routings;
  double mean_touched = 0.0;
  for (int r = 0; r < kRoutings; ++r) {
    routings.push_back(random_routing(tokens, rng));
    mean_touched += double(routings.back().touched) / kRoutings;
  }
  OwnedTensor x = random_device_bf16(rng, {tokens, kHidden});       // [T, H]
  OwnedTensor act = random_device_bf16(rng, {pairs, kInter});       // [T*K, I]
  OwnedTensor y_gu = random_device_bf16(rng, {pairs, 2 * kInter});  // [T*K, 2I]
  OwnedTensor y_down = random_device_bf16(rng, {pairs, kHidden});   // [T*K, H]
  OwnedTensor z_gu = zeroed(DType::F32, {pairs, kRank}), z_down = zeroed(DType::F32, {pairs, kRank});
  OwnedTensor readers_gu = zeroed(DType::I32, {pairs + 1}), readers_down = zeroed(DType::I32, {pairs + 1});
  struct Shape {
    bool pdl = true;
    bool x_before_wait = false;  // valid here: x and the activation are never written by these launches
    int shrink_vectors_per_lane = 0, expand_vectors_per_thread = 0;  // 0 = built-in
    int routings = kRoutings;                                        // 1 = run 2's L2-warm setup
  };
  // Launch i: stack copy i % 3, routing i % shape.routings.
  auto gate_up = [&](int i, const Shape& shape) {
    const Routing& r = routings[size_t(i % shape.routings)];
    return cuda::MoeLoraSmallParams{.x = x, .topk_ids = r.topk_ids, .token_slot = r.token_slot,
                                    .w = {.a = layers[i % kLayers].gu_a, .b = layers[i % kLayers].gu_b, .rank = rank},
                                    .z = z_gu, .z_readers = readers_gu, .y = y_gu, .pdl = shape.pdl,
                                    .x_before_wait = shape.x_before_wait,
                                    .shrink_vectors_per_lane = shape.shrink_vectors_per_lane,
                                    .expand_vectors_per_thread = shape.expand_vectors_per_thread};
  };
  auto down = [&](int i, const Shape& shape) {
    const Routing& r = routings[size_t(i % shape.routings)];
    return cuda::MoeLoraSmallParams{.x = act, .topk_ids = r.topk_ids, .token_slot = r.token_slot,
                                    .w = {.a = layers[i % kLayers].down_a, .b = layers[i % kLayers].down_b, .rank = rank},
                                    .z = z_down, .z_readers = readers_down, .y = y_down, .pdl = shape.pdl,
                                    .x_before_wait = shape.x_before_wait,
                                    .shrink_vectors_per_lane = shape.shrink_vectors_per_lane,
                                    .expand_vectors_per_thread = shape.expand_vectors_per_thread};
  };
  auto whole_layer = [&](int i, const Shape& shape) {
    cuda::moe_lora_small_shrink(gate_up(i, shape), stream);
    cuda::moe_lora_small_expand(gate_up(i, shape), stream);
    cuda::moe_lora_small_shrink(down(i, shape), stream);
    cuda::moe_lora_small_expand(down(i, shape), stream);
  };
  auto fused_layer = [&](int i, const Shape& shape) {
    cuda::moe_lora_small_fused(gate_up(i, shape), stream);
    cuda::moe_lora_small_fused(down(i, shape), stream);
  };
  whole_layer(0, {});
  fused_layer(0, {});
  BENCH_CUDA(cudaStreamSynchronize(stream));

  const double g = mean_touched, p = double(pairs), t = double(tokens), r = double(kRank);
  const double shrink_gu_bytes = g * r * kHidden * 2 + t * kHidden * 2 + p * r * 4;
  const double expand_gu_bytes = g * 2 * kInter * r * 2 + p * r * 4 + 2 * p * 2 * kInter * 2;
  const double shrink_down_bytes = g * r * kInter * 2 + p * kInter * 2 + p * r * 4;
  const double expand_down_bytes = g * kHidden * r * 2 + p * r * 4 + 2 * p * kHidden * 2;
  const double shrink_gu_flops = 2 * p * r * kHidden, expand_gu_flops = 2 * p * r * 2 * kInter;
  const double shrink_down_flops = 2 * p * r * kInter, expand_down_flops = 2 * p * r * kHidden;
  const double total_bytes = shrink_gu_bytes + expand_gu_bytes + shrink_down_bytes + expand_down_bytes;
  const double total_flops = shrink_gu_flops + expand_gu_flops + shrink_down_flops + expand_down_flops;
  std::printf("-- T %lld: %lld pairs, %.1f distinct (slot, expert) on average over %d routings, fits the small "
              "path: %s\n", (long long)tokens, (long long)pairs, g, kRoutings,
              cuda::moe_lora_small_fits(pairs) ? "yes" : "no");

  auto layer_row = [&](const std::string& what, const Shape& shape) {
    print_row(what, tokens, total_bytes, total_flops, time_graph(stream, [&](int i) { whole_layer(i, shape); }));
  };
  // The shrinks alone accumulate into z (the expands alone keep it clean: they read zeros and re-zero), so z
  // is re-zeroed after each group of shrink-only rows.
  auto kernel_rows = [&](const std::string& suffix, const Shape& shape, bool with_fused) {
    if (with_fused) {
      print_row("  fused gate_up" + suffix, tokens, shrink_gu_bytes + expand_gu_bytes, shrink_gu_flops + expand_gu_flops,
                time_graph(stream, [&](int i) { cuda::moe_lora_small_fused(gate_up(i, shape), stream); }));
      print_row("  fused down" + suffix, tokens, shrink_down_bytes + expand_down_bytes, shrink_down_flops + expand_down_flops,
                time_graph(stream, [&](int i) { cuda::moe_lora_small_fused(down(i, shape), stream); }));
    }
    print_row("  expand gate_up" + suffix, tokens, expand_gu_bytes, expand_gu_flops,
              time_graph(stream, [&](int i) { cuda::moe_lora_small_expand(gate_up(i, shape), stream); }));
    print_row("  expand down" + suffix, tokens, expand_down_bytes, expand_down_flops,
              time_graph(stream, [&](int i) { cuda::moe_lora_small_expand(down(i, shape), stream); }));
    print_row("  shrink gate_up" + suffix, tokens, shrink_gu_bytes, shrink_gu_flops,
              time_graph(stream, [&](int i) { cuda::moe_lora_small_shrink(gate_up(i, shape), stream); }));
    print_row("  shrink down" + suffix, tokens, shrink_down_bytes, shrink_down_flops,
              time_graph(stream, [&](int i) { cuda::moe_lora_small_shrink(down(i, shape), stream); }));
    BENCH_CUDA(cudaStreamSynchronize(stream));
    cuda::fill_bytes(z_gu.view, 0);
    cuda::fill_bytes(z_down.view, 0);
  };

  for (bool pdl : {true, false}) {
    const std::string suffix = pdl ? " (pdl)" : " (no pdl)";
    layer_row("layer, 4 kernels" + suffix, {.pdl = pdl});
    print_row("layer, 2 fused kernels" + suffix, tokens, total_bytes, total_flops,
              time_graph(stream, [&](int i) { fused_layer(i, {.pdl = pdl}); }));
  }
  layer_row("layer, 4 kernels (pdl, 1 routing)", {.routings = 1});
  layer_row("layer, 4 kernels (pdl, x before wait)", {.x_before_wait = true});
  for (bool pdl : {true, false}) kernel_rows(pdl ? " (pdl)" : " (no pdl)", {.pdl = pdl}, true);

  // Launch-shape sweep, PDL on, x before the wait: shrink V vectors per lane x expand vectors per thread.
  for (int shrink_v : {1, 2, 4}) {
    for (int expand_v : {4, 8}) {
      layer_row("layer, 4 kernels, shape " + std::to_string(shrink_v) + "/" + std::to_string(expand_v),
                {.x_before_wait = true, .shrink_vectors_per_lane = shrink_v, .expand_vectors_per_thread = expand_v});
    }
  }
  for (int v : {1, 2, 4}) {
    const Shape shape{.x_before_wait = true, .shrink_vectors_per_lane = v, .expand_vectors_per_thread = v == 1 ? 4 : 8};
    kernel_rows(" (shape " + std::to_string(v) + "/" + std::to_string(shape.expand_vectors_per_thread) + ")", shape,
                false);
  }
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
  std::printf("bench_moe_lora_small: GPT-OSS-20B MoE-LoRA, direct per-pair path (H %lld, I %lld, E %lld, K %lld, "
              "S %lld, R %lld), bf16, floor = max(bytes / 4.2 TB/s, FLOPs / 750 TFLOP/s)\n",
              (long long)kHidden, (long long)kInter, (long long)kExperts, (long long)kTopK, (long long)kSlots,
              (long long)kRank);
  for (int64_t tokens : {1, 2, 4, 8, 16, 32, 64}) bench_tokens(tokens, layers, d_rank, stream, rng);
  BENCH_CUDA(cudaStreamDestroy(stream));
  return 0;
}
