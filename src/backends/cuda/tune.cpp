// tune_moe_lora (tune.h): for each token bucket, the MoE-LoRA of one layer (gate_up shrink + expand on
// x [T, H], down shrink + expand on the activation [T*K, I]; tokens spread over the slots, K distinct experts
// per token) is timed under every candidate launch configuration — the direct per-pair path and the tiled
// path's split_k × BLOCK_N × chunks × CTA order — and the fastest is kept. Weights cycle over 3 copies of
// the stacks so they come from DRAM, as in bench/bench_moe_lora.cpp.
#include "backends/cuda/tune.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <set>

#include "backends/cuda/basic.cuh"
#include "backends/cuda/check.h"
#include "backends/cuda/memory.h"
#include "backends/cuda/moe_align.cuh"
#include "backends/cuda/moe_gemm.cuh"
#include "backends/cuda/moe_lora.cuh"
#include "backends/cuda/moe_lora_small.cuh"
#include "core/rng.h"

namespace lmx::cuda {

std::string moe_lora_shape_key(int64_t hidden, int64_t inter, int64_t experts, int64_t top_k, int64_t slots,
                               int64_t rank) {
  return ops::shape_key({{"H", hidden}, {"I", inter}, {"E", experts}, {"K", top_k}, {"S", slots}, {"R", rank}});
}

void apply_moe_lora_knobs(const ops::KernelKnobs* knobs, MoeBlockConfig* config) {
  if (knobs == nullptr) return;
  auto get = [&](const char* name, int64_t fallback) {
    const auto it = knobs->find(name);
    return it == knobs->end() ? fallback : it->second;
  };
  config->lora_path = int(get("path", config->lora_path));
  config->small_pdl = get("pdl", config->small_pdl) != 0;
  config->lora.pdl = config->small_pdl;
  config->lora.split_k = int(get("split_k", config->lora.split_k));
  config->lora.order = get("order", int(config->lora.order)) != 0 ? MoeLoraCtaOrder::kPieceFastest
                                                                   : MoeLoraCtaOrder::kTileFastest;
  config->lora.expand_block_n = int(get("expand_block_n", config->lora.expand_block_n));
  config->lora.expand_chunks = int(get("expand_chunks", config->lora.expand_chunks));
  config->lora.expand_bulk = get("expand_bulk", config->lora.expand_bulk) != 0;
  config->lora.expand_persistent = get("expand_persistent", config->lora.expand_persistent) != 0;
}

Status check_moe_lora_knobs(const ops::KernelConfigs& configs) {
  struct Rule {
    const char* name;
    const char* expected;
    bool (*accepts)(int64_t);
  };
  static constexpr Rule kRules[] = {
      {"path", "0 (direct) or 1 (tiled)", [](int64_t v) { return v == 0 || v == 1; }},
      {"pdl", "0 or 1", [](int64_t v) { return v == 0 || v == 1; }},
      {"order", "0 (tile-fastest) or 1 (piece-fastest)", [](int64_t v) { return v == 0 || v == 1; }},
      {"split_k", "0 (by size) to 64", [](int64_t v) { return v >= 0 && v <= 64; }},
      {"expand_block_n", "64 or 128", [](int64_t v) { return v == 64 || v == 128; }},
      {"expand_chunks", "0 (by size) to 1024", [](int64_t v) { return v >= 0 && v <= 1024; }},
      {"expand_bulk", "0 (cp.async) or 1 (bulk copies)", [](int64_t v) { return v == 0 || v == 1; }},
      {"expand_persistent", "0 (a piece per CTA) or 1 (resident CTAs walk the pieces)",
       [](int64_t v) { return v == 0 || v == 1; }},
  };
  return configs.for_each(kMoeLoraOp, [](const std::string& shape, int64_t bucket, const ops::KernelKnobs& knobs) {
    const std::string where = std::string(kMoeLoraOp) + " " + shape + " max_tokens " + std::to_string(bucket);
    for (const auto& [name, value] : knobs) {
      const Rule* rule = nullptr;
      for (const Rule& r : kRules) {
        if (name == r.name) rule = &r;
      }
      if (rule == nullptr) {
        std::string known;
        for (const Rule& r : kRules) known += std::string(known.empty() ? "" : ", ") + r.name;
        return invalid_argument(where + ": unknown knob '" + name + "' (known: " + known + ")");
      }
      if (!rule->accepts(value)) {
        return invalid_argument(where + ": knob " + name + " = " + std::to_string(value) + ": expected " + rule->expected);
      }
    }
    return Status();
  });
}

namespace {

constexpr int kCopies = 3;     // copies of the stacks the launches cycle over (> L2)
constexpr int kLaunches = 12;  // per graph, a multiple of kCopies
constexpr int kReplays = 5;

struct Candidate {
  ops::KernelKnobs knobs;
  MoeBlockConfig config;
};

std::vector<Candidate> candidates(int64_t pairs) {
  std::vector<Candidate> out;
  if (pairs <= 4 * kMoeLoraSmallMaxPairs) {  // the direct path: worth timing up to a few times its default limit
    Candidate c;
    c.knobs = {{"path", 0}, {"pdl", 1}};
    apply_moe_lora_knobs(&c.knobs, &c.config);
    out.push_back(c);
  }
  for (int split : {0, 1, 2, 4, 8}) {
    for (int block_n : {64, 128}) {
      for (int chunks : {0, 1, 2, 4, 16, 32}) {
        for (int order : {0, 1}) {
          for (int form : {2, 1, 0}) {  // persistent, bulk copies a piece per CTA, cp.async
            Candidate c;
            c.knobs = {{"path", 1},
                       {"pdl", 1},
                       {"split_k", split},
                       {"expand_block_n", block_n},
                       {"expand_chunks", chunks},
                       {"order", order},
                       {"expand_bulk", form > 0 ? 1 : 0},
                       {"expand_persistent", form == 2 ? 1 : 0}};
            apply_moe_lora_knobs(&c.knobs, &c.config);
            out.push_back(c);
          }
        }
      }
    }
  }
  return out;
}

// Seconds per call of launch(i), from a graph of kLaunches calls, median of kReplays replays.
double time_graph(cudaStream_t stream, const std::function<void(int)>& launch) {
  for (int i = 0; i < kCopies; ++i) launch(i);  // warm-up outside capture (first-launch attributes)
  LMX_CUDA_CHECK(cudaStreamSynchronize(stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  LMX_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < kLaunches; ++i) launch(i);
  LMX_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  LMX_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t start, stop;
  LMX_CUDA_CHECK(cudaEventCreate(&start));
  LMX_CUDA_CHECK(cudaEventCreate(&stop));
  LMX_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  std::vector<float> ms(kReplays);
  for (float& m : ms) {
    LMX_CUDA_CHECK(cudaEventRecord(start, stream));
    LMX_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    LMX_CUDA_CHECK(cudaEventRecord(stop, stream));
    LMX_CUDA_CHECK(cudaEventSynchronize(stop));
    LMX_CUDA_CHECK(cudaEventElapsedTime(&m, start, stop));
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  std::sort(ms.begin(), ms.end());
  return double(ms[ms.size() / 2]) * 1e-3 / kLaunches;
}

OwnedTensor random_bf16(std::initializer_list<int64_t> dims, uint64_t seed, float stddev, cudaStream_t stream) {
  OwnedTensor t = cuda::empty(DType::BF16, dims);
  fill_generated(t.view, seed, stddev, stream);
  return t;
}

OwnedTensor zeros(DType dtype, std::initializer_list<int64_t> dims) {
  OwnedTensor t = cuda::empty(dtype, dims);
  fill_bytes(t.view, 0);
  return t;
}

}  // namespace

Result<ops::KernelConfigs> tune_moe_lora(const TuneMoeLoraOptions& o) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    cudaGetLastError();
    return unsupported("tune: no CUDA device is visible");
  }
  if (o.hidden % 8 || o.inter % 8 || o.experts < 1 || o.top_k < 1 || o.top_k > o.experts || o.slots < 1 ||
      o.rank < 8 || o.rank % 8 || o.rank > 64) {
    return invalid_argument("tune moe-lora: unsupported shape (H, I multiples of 8; 1 <= K <= E; S >= 1; R in 8..64 "
                            "step 8): " + moe_lora_shape_key(o.hidden, o.inter, o.experts, o.top_k, o.slots, o.rank));
  }
  const int64_t H = o.hidden, I = o.inter, E = o.experts, K = o.top_k, S = o.slots, R = o.rank;
  const int64_t stack_bytes = S * E * R * (H + 2 * I + I + H) * 2 * kCopies;
  size_t free_bytes = 0, total_bytes = 0;
  LMX_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  if (uint64_t(stack_bytes) * 2 > free_bytes) {
    return out_of_range("tune moe-lora: the stacks need " + std::to_string(stack_bytes >> 20) + " MiB of device memory, " +
                        std::to_string(free_bytes >> 20) + " MiB free");
  }
  cudaStream_t stream;
  LMX_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  struct Stacks { OwnedTensor gu_a, gu_b, down_a, down_b; };
  std::vector<Stacks> stacks;
  for (int c = 0; c < kCopies; ++c) {
    const uint64_t seed = 1000 + 10 * uint64_t(c);
    stacks.push_back({random_bf16({S, E, R, H}, seed, 0.05f, stream), random_bf16({S, E, 2 * I, R}, seed + 1, 0.05f, stream),
                      random_bf16({S, E, R, I}, seed + 2, 0.05f, stream), random_bf16({S, E, H, R}, seed + 3, 0.05f, stream)});
  }
  OwnedTensor rank_host = OwnedTensor::host(DType::I32, {S});
  std::fill_n(rank_host.view.ptr<int32_t>(), S, int32_t(R));
  OwnedTensor rank = upload(rank_host);

  ops::KernelConfigs configs;
  const std::string shape = moe_lora_shape_key(H, I, E, K, S, R);
  cudaDeviceProp prop;
  LMX_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  configs.set_note("device", prop.name);
  Rng rng(20261202);
  for (int64_t tokens : o.buckets) {
    const int64_t pairs = tokens * K, groups = S * E;
    // Routing: K distinct experts per token; tokens spread over the slots.
    OwnedTensor ids_host = OwnedTensor::host(DType::I32, {tokens, K}), slot_host = OwnedTensor::host(DType::I32, {tokens});
    std::vector<int32_t> all(static_cast<size_t>(E));
    for (int64_t t = 0; t < tokens; ++t) {
      slot_host.view.ptr<int32_t>()[t] = int32_t(t % S);
      for (int64_t e = 0; e < E; ++e) all[size_t(e)] = int32_t(e);
      for (int64_t k = 0; k < K; ++k) {
        std::swap(all[size_t(k)], all[size_t(k + int64_t(rng.next_u64() % uint64_t(E - k)))]);
        ids_host.view.ptr<int32_t>()[t * K + k] = all[size_t(k)];
      }
    }
    OwnedTensor ids = upload(ids_host), token_slot = upload(slot_host);
    OwnedTensor x = random_bf16({tokens, H}, 7, 1.0f, stream), act = random_bf16({pairs, I}, 8, 1.0f, stream);
    OwnedTensor y_gu = random_bf16({pairs, 2 * I}, 9, 1.0f, stream), y_down = random_bf16({pairs, H}, 10, 1.0f, stream);
    const int64_t capacity = moe_align_capacity(pairs, groups, kMoeLoraBlockM);
    OwnedTensor sorted = cuda::empty(DType::I32, {capacity}), tiles = cuda::empty(DType::I32, {capacity / kMoeLoraBlockM});
    OwnedTensor offsets = cuda::empty(DType::I32, {groups + 1}), num_tiles = cuda::empty(DType::I32, {1});
    OwnedTensor align_scratch = cuda::empty(DType::U8, {int64_t(moe_align_workspace_bytes(pairs, groups))});
    OwnedTensor z = zeros(DType::F32, {pairs, R}), counters = zeros(DType::I32, {capacity / kMoeLoraBlockM + kMoeLoraWorkCounters});
    OwnedTensor readers = zeros(DType::I32, {pairs + 1});

    auto layer = [&](const Candidate& c, int copy) {
      const Stacks& w = stacks[size_t(copy % kCopies)];
      const ops::LoraStack gu{.a = w.gu_a, .b = w.gu_b, .rank = rank}, down{.a = w.down_a, .b = w.down_b, .rank = rank};
      if (c.config.lora_path == 0) {
        for (const auto& [stack, in, out] : {std::tuple{&gu, &x, &y_gu}, std::tuple{&down, &act, &y_down}}) {
          const MoeLoraSmallParams p{.x = *in, .topk_ids = ids, .token_slot = token_slot, .w = *stack, .z = z,
                                     .z_readers = readers, .y = *out, .pdl = c.config.small_pdl};
          moe_lora_small_shrink(p, stream);
          moe_lora_small_expand(p, stream);
        }
        return;
      }
      moe_align({.topk_ids = ids, .token_slot = token_slot, .experts = E, .slots = S, .block_m = kMoeLoraBlockM,
                 .sorted_pairs = sorted, .tile_group = tiles, .group_offsets = offsets, .num_tiles = num_tiles,
                 .workspace = align_scratch},
                stream);
      for (const auto& [stack, in, out] : {std::tuple{&gu, &x, &y_gu}, std::tuple{&down, &act, &y_down}}) {
        const MoeLoraParams p{.x = *in, .w = *stack, .top_k = K, .sorted_pairs = sorted, .tile_group = tiles,
                              .num_tiles = num_tiles, .block_m = kMoeLoraBlockM, .z = z, .y = *out,
                              .config = c.config.lora, .tile_counters = counters};
        moe_lora_shrink(p, stream);
        moe_lora_expand(p, stream);
      }
    };
    double best_seconds = 1e30, default_seconds = 0;
    const Candidate* best = nullptr;
    const std::vector<Candidate> all_candidates = candidates(pairs);
    for (const Candidate& c : all_candidates) {
      const double seconds = time_graph(stream, [&](int i) { layer(c, i); });
      const bool is_default = (c.config.lora_path == 0) == moe_lora_small_fits(pairs) && c.knobs.at("pdl") == 1 &&
                              (c.config.lora_path == 0 || (c.knobs.at("split_k") == 0 && c.knobs.at("expand_block_n") == 128 &&
                                                           c.knobs.at("expand_chunks") == 0 && c.knobs.at("order") == 0 &&
                                                           c.knobs.at("expand_bulk") == 1 &&
                                                           c.knobs.at("expand_persistent") == 1));
      if (is_default) default_seconds = seconds;
      if (seconds < best_seconds) {
        best_seconds = seconds;
        best = &c;
      }
    }
    configs.set(kMoeLoraOp, shape, tokens, best->knobs);
    if (o.log) {
      std::string knobs;
      for (const auto& [name, value] : best->knobs) knobs += (knobs.empty() ? "" : " ") + name + "=" + std::to_string(value);
      char line[256];
      std::snprintf(line, sizeof line, "T %5lld: best %8.2f us (built-in default %8.2f us) of %zu candidates: %s",
                    (long long)tokens, best_seconds * 1e6, default_seconds * 1e6, all_candidates.size(), knobs.c_str());
      o.log(line);
    }
  }
  LMX_CUDA_CHECK(cudaStreamSynchronize(stream));
  cudaStreamDestroy(stream);
  return configs;
}

}  // namespace lmx::cuda
