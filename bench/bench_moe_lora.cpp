// bench_moe_lora: GPU time of the MoE-LoRA of one GPT-OSS-20B layer (H 2880, I 2880, E 32, K 4), 8 adapter
// slots of rank 32, tokens spread evenly over the slots, for T = 1, 16, 64 (decode), 256, 2048 and 4096
// (prefill): align by (slot, expert), shrink + expand for gate_up (x [T, H] -> [T*K, 2I]) and for down
// ([T*K, I] -> [T*K, H]), per layer under each knob of MoeLoraConfig (PDL on/off, split, CTA order, BLOCK_N,
// expand chunks per CTA)
// and per kernel; then the dense multi-LoRA on q_proj (2880 -> 4096) and o_proj (4096 -> 2880) at T 16 and
// 2048. Each row prints µs, the bytes that must move (the touched A/B slices — R·in + out·R bf16 per
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

#include "backends/cuda/lora_dense.cuh"
#include "backends/cuda/moe_lora_small.cuh"
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

std::string knob_suffix(const cuda::MoeLoraConfig& c) {
  return std::string(" (split ") + (c.split_k == 0 ? "auto" : std::to_string(c.split_k)) +
         (c.order == cuda::MoeLoraCtaOrder::kTileFastest ? "" : ", piece-fastest") +
         (c.expand_block_n == 128 ? "" : ", N " + std::to_string(c.expand_block_n)) +
         (c.expand_chunks == 0 ? "" : ", chunks " + std::to_string(c.expand_chunks)) +
         (!c.expand_bulk ? ", cp.async" : c.expand_persistent ? "" : ", bulk per CTA") +
         (c.shrink_tiles_per_cta == 0 ? "" : ", shrink tiles " + std::to_string(c.shrink_tiles_per_cta)) +

         (c.pdl ? ", pdl" : ", no pdl") +
         ")";
}

void bench_tokens(int64_t tokens, const std::vector<Layer>& layers, const OwnedTensor& rank, cudaStream_t stream,
                  Rng& rng, int64_t used_slots) {
  const int64_t pairs = tokens * kTopK, groups = kSlots * kExperts;
  // Routing: distinct experts per token; tokens spread evenly over `used_slots` of the 8 adapters (1: one
  // prompt's prefill).
  std::vector<int32_t> ids(static_cast<size_t>(pairs)), slot(static_cast<size_t>(tokens));
  std::set<int64_t> touched;  // distinct (slot, expert)
  for (int64_t t = 0; t < tokens; ++t) {
    slot[t] = int32_t(t % used_slots);
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
  const int64_t capacity = cuda::moe_align_capacity(pairs, groups, cuda::kMoeLoraBlockM);
  // Self-cleaning z and tile counters (moe_lora.cuh): zeroed once here, never memset in the timed path.
  OwnedTensor z_gu = cuda::empty(DType::F32, {pairs, kRank}), z_down = cuda::empty(DType::F32, {pairs, kRank});
  OwnedTensor counters_gu = cuda::empty(DType::I32, {capacity / cuda::kMoeLoraBlockM + cuda::kMoeLoraWorkCounters});
  OwnedTensor counters_down = cuda::empty(DType::I32, {capacity / cuda::kMoeLoraBlockM + cuda::kMoeLoraWorkCounters});
  for (const OwnedTensor* t : {&z_gu, &z_down, &counters_gu, &counters_down}) cuda::fill_bytes(t->view, 0);
  OwnedTensor sorted = cuda::empty(DType::I32, {capacity});
  OwnedTensor tiles = cuda::empty(DType::I32, {capacity / cuda::kMoeLoraBlockM});
  OwnedTensor offsets = cuda::empty(DType::I32, {groups + 1});
  OwnedTensor num_tiles = cuda::empty(DType::I32, {1});
  OwnedTensor workspace = cuda::empty(DType::U8, {int64_t(cuda::moe_align_workspace_bytes(pairs, groups))});
  const cuda::MoeAlignParams align{.topk_ids = d_ids, .token_slot = d_slot, .experts = kExperts, .slots = kSlots,
                                   .block_m = cuda::kMoeLoraBlockM, .sorted_pairs = sorted, .tile_group = tiles,
                                   .group_offsets = offsets, .num_tiles = num_tiles, .workspace = workspace};
  auto gate_up = [&](int layer, const cuda::MoeLoraConfig& config) {
    return cuda::MoeLoraParams{.x = x, .w = {.a = layers[layer].gu_a, .b = layers[layer].gu_b, .rank = rank},
                               .top_k = kTopK, .sorted_pairs = sorted, .tile_group = tiles, .num_tiles = num_tiles,
                               .block_m = cuda::kMoeLoraBlockM, .z = z_gu, .y = y_gu, .config = config,
                               .tile_counters = counters_gu};
  };
  auto down = [&](int layer, const cuda::MoeLoraConfig& config) {
    return cuda::MoeLoraParams{.x = act, .w = {.a = layers[layer].down_a, .b = layers[layer].down_b, .rank = rank},
                               .top_k = kTopK, .sorted_pairs = sorted, .tile_group = tiles, .num_tiles = num_tiles,
                               .block_m = cuda::kMoeLoraBlockM, .z = z_down, .y = y_down, .config = config,
                               .tile_counters = counters_down};
  };
  auto whole_layer = [&](int layer, const cuda::MoeLoraConfig& config) {
    cuda::moe_align(align, stream);
    cuda::moe_lora_shrink(gate_up(layer, config), stream);
    cuda::moe_lora_expand(gate_up(layer, config), stream);
    cuda::moe_lora_shrink(down(layer, config), stream);
    cuda::moe_lora_expand(down(layer, config), stream);
  };
  const cuda::MoeLoraConfig defaults{};
  whole_layer(0, defaults);
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
  const int64_t max_tiles = capacity / cuda::kMoeLoraBlockM;
  std::printf("-- T %lld (%lld of %lld slots used): %lld pairs, %zu distinct (slot, expert), auto split_k %d, max tiles %lld, auto expand "
              "chunks (N 128) gate_up %d down %d (persistent: %d, %d)\n",
              (long long)tokens, (long long)used_slots, (long long)kSlots, (long long)pairs, touched.size(), auto_split, (long long)max_tiles,
              cuda::moe_lora_auto_expand_chunks(max_tiles, (2 * kInter + 127) / 128, false),
              cuda::moe_lora_auto_expand_chunks(max_tiles, (kHidden + 127) / 128, false),
              cuda::moe_lora_auto_expand_chunks(max_tiles, (2 * kInter + 127) / 128, true),
              cuda::moe_lora_auto_expand_chunks(max_tiles, (kHidden + 127) / 128, true));

  // Layer rows: the default knobs, then one knob changed at a time (PDL off is the before/after of PDL).
  const std::vector<cuda::MoeLoraConfig> layer_configs = {
      defaults,
      {.pdl = false},
      {.split_k = 1},
      {.order = cuda::MoeLoraCtaOrder::kPieceFastest},
      {.expand_block_n = 64},
      {.expand_chunks = 1},
      {.shrink_tiles_per_cta = 1},
      {.expand_block_n = 64, .expand_bulk = false},
      {.expand_block_n = 64, .expand_chunks = 32},
      {.expand_block_n = 64, .expand_persistent = false},
      {.expand_bulk = false}};
  for (const cuda::MoeLoraConfig& config : layer_configs) {
    print_row(("layer" + knob_suffix(config)).c_str(), tokens, total_bytes, total_flops,
              time_graph(stream, [&](int i) { whole_layer(i % kLayers, config); }));
  }
  print_row("  align", tokens, align_bytes, 0, time_graph(stream, [&](int) { cuda::moe_align(align, stream); }));
  // shrink tiles 1: a tile per CTA (the kernel before run mode); 4: runs of one (slot, expert)'s tiles.
  for (const cuda::MoeLoraConfig& config :
       {defaults, cuda::MoeLoraConfig{.split_k = 1}, cuda::MoeLoraConfig{.shrink_tiles_per_cta = 1},
        cuda::MoeLoraConfig{.shrink_tiles_per_cta = 4}, cuda::MoeLoraConfig{.split_k = 4},
        cuda::MoeLoraConfig{.split_k = 8}}) {
    const std::string suffix = knob_suffix(config);
    print_row(("  shrink gate_up" + suffix).c_str(), tokens, shrink_gu_bytes, shrink_gu_flops,
              time_graph(stream, [&](int i) { cuda::moe_lora_shrink(gate_up(i % kLayers, config), stream); }));
    print_row(("  shrink down" + suffix).c_str(), tokens, shrink_down_bytes, shrink_down_flops,
              time_graph(stream, [&](int i) { cuda::moe_lora_shrink(down(i % kLayers, config), stream); }));
    // The shrink-only loops left sums in z: one expand each restores the all-zero invariant.
    cuda::moe_lora_expand(gate_up(0, config), stream);
    cuda::moe_lora_expand(down(0, config), stream);
  }
  // chunks 1: one BLOCK_N chunk per CTA (no ring reuse, as the expand was before the chunk loop); 4, 16.
  for (const cuda::MoeLoraConfig& config :
       {defaults, cuda::MoeLoraConfig{.expand_block_n = 64}, cuda::MoeLoraConfig{.expand_chunks = 1},
        cuda::MoeLoraConfig{.expand_chunks = 4}, cuda::MoeLoraConfig{.expand_chunks = 16},
        cuda::MoeLoraConfig{.expand_block_n = 64, .expand_chunks = 8},
        cuda::MoeLoraConfig{.expand_block_n = 64, .expand_chunks = 32},
        cuda::MoeLoraConfig{.expand_block_n = 64, .expand_persistent = false},
        cuda::MoeLoraConfig{.expand_block_n = 64, .expand_chunks = 16, .expand_persistent = false},
        cuda::MoeLoraConfig{.expand_block_n = 64, .expand_bulk = false},
        cuda::MoeLoraConfig{.expand_block_n = 64, .expand_chunks = 16, .expand_bulk = false},
        cuda::MoeLoraConfig{.expand_bulk = false}, cuda::MoeLoraConfig{.expand_chunks = 16, .expand_bulk = false}}) {
    const std::string suffix = knob_suffix(config);
    print_row(("  expand gate_up" + suffix).c_str(), tokens, expand_gu_bytes, expand_gu_flops,
              time_graph(stream, [&](int i) { cuda::moe_lora_expand(gate_up(i % kLayers, config), stream); }));
    print_row(("  expand down" + suffix).c_str(), tokens, expand_down_bytes, expand_down_flops,
              time_graph(stream, [&](int i) { cuda::moe_lora_expand(down(i % kLayers, config), stream); }));
  }
  // moe_block's gate_up expand since the LoRA folds into the fused activation: y written, not read (the
  // bytes column still counts the read); persistent (the default), by bulk copies a piece per CTA, by cp.async.
  for (int form : {2, 1, 0}) {
    const cuda::MoeLoraConfig config{.expand_block_n = 64, .expand_bulk = form > 0, .expand_persistent = form == 2};
    auto overwrite_expand = [&](int i) {
      cuda::MoeLoraParams lp = gate_up(i % kLayers, config);
      lp.overwrite = true;
      cuda::moe_lora_expand(lp, stream);
    };
    print_row(("  expand gate_up overwrite" + knob_suffix(config)).c_str(), tokens, expand_gu_bytes, expand_gu_flops,
              time_graph(stream, overwrite_expand));
  }
  BENCH_CUDA(cudaStreamSynchronize(stream));
}

// Dense multi-LoRA (lora_dense.cuh) on a GPT-OSS-20B attention projection, S 8, R 32, tokens spread over
// the slots. The stacks are small (8·32·(in + out)·2 B ≈ 3.6 MB), so the launches cycle over kDenseCopies
// copies (~72 MB, above the 50 MB L2) to read weights from DRAM. Bytes: touched A/B + x + y read/write.
constexpr int kDenseCopies = 20;  // divides kIterations

void bench_dense(const char* name, int64_t in, int64_t out, int64_t tokens, cudaStream_t stream, Rng& rng) {
  std::vector<OwnedTensor> a, b;
  for (int c = 0; c < kDenseCopies; ++c) {
    a.push_back(random_device_bf16(rng, {kSlots, kRank, in}));
    b.push_back(random_device_bf16(rng, {kSlots, out, kRank}));
  }
  OwnedTensor rank = OwnedTensor::host(DType::I32, {kSlots}), h_slot = OwnedTensor::host(DType::I32, {tokens});
  for (int64_t s = 0; s < kSlots; ++s) rank.view.ptr<int32_t>()[s] = int32_t(kRank);
  for (int64_t t = 0; t < tokens; ++t) h_slot.view.ptr<int32_t>()[t] = int32_t(t % kSlots);
  OwnedTensor d_rank = cuda::upload(rank), d_slot = cuda::upload(h_slot);
  OwnedTensor x = random_device_bf16(rng, {tokens, in}), y = random_device_bf16(rng, {tokens, out});
  const cuda::LoraDenseScratch scratch = cuda::lora_dense_scratch(tokens, kSlots, kRank);
  const double touched = double(std::min<int64_t>(tokens, kSlots));
  const double bytes = touched * kRank * (in + out) * 2 + double(tokens) * in * 2 + 2.0 * double(tokens) * out * 2;
  const double flops = 2.0 * double(tokens) * kRank * (in + out);
  // path 1: the tiled shrink/expand (align + 2 launches); path 0: the direct per-pair kernels (small
  // batches); the launcher picks by size (lora_dense.cuh).
  for (int path : {1, 0}) {
    if (path == 0 && tokens > cuda::kMoeLoraSmallMaxPairs) continue;
    for (const cuda::MoeLoraConfig& config :
         {cuda::MoeLoraConfig{}, cuda::MoeLoraConfig{.pdl = false}, cuda::kLoraDenseConfig,
          cuda::MoeLoraConfig{.expand_block_n = 64, .expand_chunks = 4},
          cuda::MoeLoraConfig{.expand_block_n = 64, .expand_chunks = 8},
          cuda::MoeLoraConfig{.expand_block_n = 64, .expand_chunks = 16}}) {
      if (path == 0 && config.expand_chunks != 0) continue;  // the direct path has no expand chunks
      print_row((std::string("dense ") + name + (path == 0 ? " direct" : " tiled") + knob_suffix(config)).c_str(),
                tokens, bytes, flops, time_graph(stream, [&](int i) {
                  const int c = i % kDenseCopies;
                  cuda::lora_dense({.x = x, .token_slot = d_slot, .w = {.a = a[c], .b = b[c], .rank = d_rank}, .y = y},
                                   scratch, config, stream, path);
                }));
    }
  }
}

// The q|k|v group of a GPT-OSS-20B layer (2880 -> 4096, 512, 512 sharing x and token_slot) as the model
// calls it (lora_dense_group: one align on the tiled path), under the backend's config and the default one;
// tokens spread over `used_slots` slots (1: one prompt's prefill, all tokens on one adapter).
void bench_dense_group(int64_t tokens, int64_t used_slots, cudaStream_t stream, Rng& rng) {
  constexpr int64_t kIn = kHidden;
  const int64_t outs[3] = {4096, 512, 512};
  std::vector<OwnedTensor> a[3], b[3], y;
  for (int part = 0; part < 3; ++part) {
    for (int c = 0; c < kDenseCopies; ++c) {
      a[part].push_back(random_device_bf16(rng, {kSlots, kRank, kIn}));
      b[part].push_back(random_device_bf16(rng, {kSlots, outs[part], kRank}));
    }
    y.push_back(random_device_bf16(rng, {tokens, outs[part]}));
  }
  OwnedTensor rank = OwnedTensor::host(DType::I32, {kSlots}), h_slot = OwnedTensor::host(DType::I32, {tokens});
  for (int64_t s = 0; s < kSlots; ++s) rank.view.ptr<int32_t>()[s] = int32_t(kRank);
  for (int64_t t = 0; t < tokens; ++t) h_slot.view.ptr<int32_t>()[t] = int32_t(t % used_slots);
  OwnedTensor d_rank = cuda::upload(rank), d_slot = cuda::upload(h_slot);
  OwnedTensor x = random_device_bf16(rng, {tokens, kIn});
  const cuda::LoraDenseScratch scratch = cuda::lora_dense_scratch(tokens, kSlots, kRank);
  const double touched = double(std::min<int64_t>(tokens, used_slots));
  double bytes = double(tokens) * kIn * 2, flops = 0;
  for (int64_t out : outs) {
    bytes += touched * kRank * (kIn + out) * 2 + 2.0 * double(tokens) * out * 2;
    flops += 2.0 * double(tokens) * kRank * (kIn + out);
  }
  for (const cuda::MoeLoraConfig& config :
       {cuda::kLoraDenseConfig, cuda::MoeLoraConfig{}, cuda::MoeLoraConfig{.expand_block_n = 64, .expand_chunks = 8},
        cuda::MoeLoraConfig{.expand_block_n = 64, .expand_chunks = 16}}) {
    const std::string spread = used_slots == 1 ? ", one adapter" : "";
    print_row(("dense q|k|v group" + spread + knob_suffix(config)).c_str(), tokens, bytes, flops, time_graph(stream, [&](int i) {
                const int c = i % kDenseCopies;
                ops::LoraParams parts[3];
                for (int part = 0; part < 3; ++part) {
                  parts[part] = {.x = x, .token_slot = d_slot, .w = {.a = a[part][c], .b = b[part][c], .rank = d_rank},
                                 .y = y[size_t(part)]};
                }
                cuda::lora_dense_group(parts, scratch, config, stream);
              }));
  }
}

}  // namespace
}  // namespace lmx

// Usage: bench_moe_lora [T ...] — only the MoE-LoRA rows of those token counts, no dense rows (a profiler
// run, e.g. ncu on the T 4096 expand, wants few launches); bench_moe_lora one [T ...] — the same with every
// token on one adapter (a prompt's prefill); bench_moe_lora dense [T ...] — only the dense rows, at those
// token counts (default 16 and 2048).
int main(int argc, char** argv) {
  using namespace lmx;
  const bool dense_only = argc > 1 && std::string(argv[1]) == "dense";
  const bool one_adapter = argc > 1 && std::string(argv[1]) == "one";
  std::vector<int64_t> token_counts;
  for (int i = dense_only || one_adapter ? 2 : 1; i < argc; ++i) token_counts.push_back(std::atoll(argv[i]));
  const bool dense_rows = token_counts.empty() || dense_only;
  std::vector<int64_t> dense_counts = dense_only && !token_counts.empty() ? token_counts : std::vector<int64_t>{16, 2048};
  if (dense_only) token_counts.clear();
  else if (token_counts.empty()) token_counts = {1, 16, 64, 256, 2048, 4096};
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
  for (int64_t tokens : token_counts) bench_tokens(tokens, layers, d_rank, stream, rng, one_adapter ? 1 : kSlots);
  for (int64_t tokens : dense_rows ? dense_counts : std::vector<int64_t>{}) {
    bench_dense("q_proj", kHidden, 4096, tokens, stream, rng);
    bench_dense("o_proj", 4096, kHidden, tokens, stream, rng);
    bench_dense_group(tokens, kSlots, stream, rng);
    bench_dense_group(tokens, 1, stream, rng);
  }
  BENCH_CUDA(cudaStreamDestroy(stream));
  return 0;
}
