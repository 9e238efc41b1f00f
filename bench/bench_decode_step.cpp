// bench_decode_step: the whole model on the CUDA backend through the engine, as issue 5 measures it —
// one decode step of B sequences at a given context with tokens spread over the adapters, the same step
// with LoRA enabled but no adapter in the batch, the same with LoRA disabled, and the prefill of one
// prompt. Each row prints wall time per step (engine.step(): forward + sampling + host bookkeeping, i.e.
// what a user waits for), the bytes a decode step must read (experts actually touched, attention, router,
// LM head, touched adapter slices, KV) or the FLOPs a prefill must do, and the share of that floor.
// Weights are generated on the GPU (presets); adapters are random (make_dummy_adapter). Run by
// scripts/device with a preset and shapes on the command line; numbers go to docs/benchmarks.md.
//   bench_decode_step [--model preset:gpt-oss-20b] [--adapters 8] [--rank 32] [--batch 16] [--context 2000]
//                     [--steps 12] [--prefill 1600] [--profile 1] [--gpu-memory-utilization 0.9]
//                     [--max-num-batched-tokens 2048] [--kernel-configs DIR|none] [--decode-warmup 3]
//                     [--steady-steps 240] [--steady-output 600] [--vocab N] [--weight-seed 1] [--target-rows 1]
//                     [--step-reps 5] [--only decode|decode-base|prefill|prefill-adapter|mixed|steady]
//                     [--prefill-lane 1] [--prefill-lane-sm-share 0.75] [--prefill-lane-first 1] [--moe-stream-k 1]
//                     [--moe-epilogue-warps 0] [--moe-epilogue-lora 1] [--moe-epilogue-down 1] [--moe-lora-ktile 0]
//                     [--moe-lora-wgmma 1] [--fuse-route 1] [--mxfp4-shape 128x6 | 128x4x8] [--floor-only 1]
//                     [--skinny-max-out N] [--moe-lora-in-gemm off|long-runs|always] [--down-decode-stages 6]
//                     [--gate-up-decode-block-n 64|128] [--down-decode-block-n 64|128] [--pdl 0]
// --gpu-memory-utilization / --max-num-batched-tokens size the KV pool (default: for the batch only) and the
// token budget as loramux serve does. --decode-warmup N: full-batch decode steps before the timed ones (the
// serve run's steps are hundreds of tokens into each generation); each decode row prints how many distinct
// tokens the batch sampled. --steady-steps N (0: off): the steady-state row, the serve run's request
// lifecycle without HTTP (requests of --prefill + --steady-output tokens replaced as they finish), timed
// over N full-batch decode steps; it also prints the replacement requests' admission-to-first-token times
// (TTFT without HTTP) and, with --prefill-lane 1 (EngineConfig::prefill_lane), the decode steps that ran
// beside a prompt on the lane. --vocab N sizes a preset's vocabulary as loramux serve does from its
// tokenizer (GPT-OSS: 200019); --weight-seed as serve's (0 there).
// --profile 1 repeats the adapter decode step and the prefill with per-op GPU and host times (op_profiler.h).
// --only ROW: one row, then exit — decode (adapters spread), decode-base (no adapter in the batch), prefill,
// prefill-adapter, mixed, steady. For Nsight Compute: every timed step of every row runs inside the NVTX range
// "timed steps", which scripts/device-run's NCU_TIMES selects (a decode row times --steps steps, the others
// --step-reps).
// --target-rows 1 adds decode rows with the adapters on attention only and on the MLP only (as many more
// dummy adapters of each kind, spread the same way): where the adapters' decode cost goes, graphs included.
// --knockout MASK (with --only): the row without the small LoRA launches MASK names (set_small_lora_knockout;
// wrong results, for NCU_TIMES comparisons). --new-rows-only 1: of the adapter rows only the first, the newest (the dense enqueue order, the side
// expands, the knock-outs) and the no-adapter row (a short device call).
// --attention-overlap-kv 0: the prefill attention's wgmma tiles issue their K/V copies in order (the before run).
// --attention-heads-inner 0: the flash kernels' CTAs by kv head (set_attention_heads_inner; the before run).
// --cta-group N: moe_block's 128-row GEMMs in CTA groups of N tiles × every column block (0: plain order; default 8).
// --down-block-n N: moe_block's 128-row down GEMM at BLOCK_N N (128, 192, 240, 256; default: its rule).
// --fuse-prompt-route 0: a prompt's router as cuBLASLt's product, bias and top-k kernels (the before run).
// --moe-lora-halves 0: gate_up's MoE-LoRA of the halves layout (Qwen3, Mixtral) by the expand kernels into h
// instead of the persistent GEMM's accumulators (set_moe_gemm_lora_halves; the before run). --moe-epilogue-warps 0
// (gate_up's epilogue by the consumers) and --moe-lora-ktile 0 (the main slot by add_lora_terms) likewise.
// --fuse-qkv-rope 0: q|k|v's split (and its bias) as its own kernel before the rotation (the before run).
// --moe-block-m N: the MoE GEMMs' BLOCK_M at 64 or 128 wherever experts average 32 pairs or more (default:
// the rule, moe_gemm_block_m).
// --halves-by-tma 0: the fused gate_up of the halves layout (Qwen3) on the ring kernel (the before run).
// --decode-weight-tma 0: the bf16 decode GEMMs' weight tiles by cp.async copies (set_moe_decode_weight_by_tma;
// every row; the before run). --mxfp4-weight-bulk 1: the MXFP4 decode GEMMs' weight spans by bulk copies
// (set_moe_mxfp4_weight_by_bulk; every row).
// --timeline 1: the last timed step of each row (prefill: its last rep) through CUPTI's kernel records
// (KernelTimeline): span, busy and idle GPU time, where the idle stretches fall, in-situ kernel times. The
// records stay on for the whole run, so every row's figures carry CUPTI's (small) cost alike.
// --wide-route 0: a prompt's route over more than 32 experts at 16 outputs a CTA (the before run).
// --finish-by-chunks 0: the bias after cuBLASLt (o_proj) by the scalar kernel (the before run).
// --step-reps N (odd, default 5; 3 until perf-log run 105): the prefill and mixed-step rows are the median of
// N timed steps (those rows moved ±0.5–1 ms between runs at 3).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <nvtx3/nvToolsExt.h>

#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/attention.cuh"
#include "backends/cuda/moe_lora_small.cuh"
#include "backends/cuda/moe_gemm.cuh"
#include "core/rng.h"
#include "engine/engine.h"
#include "engine/setup.h"
#include "lora/adapter.h"
#include "model/presets.h"
#include "ops/kernel_configs.h"
#include "kernel_timeline.h"
#include "op_profiler.h"

namespace lmx {
namespace {

constexpr double kBytesPerSecond = 4.2e12;  // measured d2d copy on the H200 (docs/perf-log.md)
constexpr const char* kTimedRange = "timed steps";  // the NVTX range of every timed step (NCU_TIMES selects it)
constexpr double kFlopsPerSecond = 750e12;  // dense bf16 (issue 4/5)

struct Options {
  std::string model = "preset:gpt-oss-20b";
  int adapters = 8, rank = 32, batch = 16, context = 2000, steps = 12, prefill = 1600, profile = 0;
  bool new_rows_only = false;  // --new-rows-only 1: the first row, the newest rows, the no-adapter row
  int max_batched_tokens = 0;         // 0: max(prefill, 4096)
  int vocab = 0;                      // 0: the preset's; else as loramux serve sizes a preset from its tokenizer
  uint64_t weight_seed = 1;           // loramux serve's --weight-seed is 0
  int steady_steps = 240;             // full-batch decode steps the steady-state row times (0: no such row)
  int steady_output = 600;            // output tokens of each request in the steady-state row
  int target_rows = 0;                // 1: decode rows with adapters on attention only / the MLP only
  int decode_warmup = 3;              // full-batch decode steps before the timed ones (the serve run's steps
                                      // sit hundreds of tokens into each generation)
  int step_reps = 5;                  // prefill and mixed rows: median of this many timed steps (odd, >= 3)
  std::string only;                   // one row only (Nsight Compute runs): decode, decode-base, prefill, ...
  int knockout = 0;                   // --knockout MASK with --only: set_small_lora_knockout (wrong results)
  int moe_stream_k = 0;               // 1: every row with the MoE GEMMs' stream-K tail (set_moe_gemm_stream_k)
  int moe_lora_wgmma = 0;             // 1: every row with the MoE-LoRA's main slot by wgmma (set_moe_lora_gemm_wgmma)
  int moe_epilogue_warps = -1;        // 0 / 1: every row with gate_up's epilogue by the consumers / by idle warps
                                      // (set_moe_gemm_epilogue_warps; -1: the default, idle warps)
  int moe_epilogue_lora = 0;          // 1: with it, the MoE-LoRA terms by those warps too (set_moe_gemm_epilogue_lora)
  int moe_epilogue_down = 0;          // 1: with it, down's stores by those warps too (set_moe_gemm_epilogue_down)
  int moe_lora_ktile = -1;            // 0 / 1: the MoE-LoRA's main slot by add_lora_terms / as one more k-tile
                                      // (set_moe_gemm_lora_ktile; -1: the default, the k-tile)
  int fuse_route = 0;                 // 1: every row with the router's product and top-k as one kernel (set_fuse_route)
  int64_t skinny_max_out = 1024;      // every row: few-row products up to this width on the skinny kernel (5120: q|k|v)
  std::string moe_lora_in_gemm;       // --moe-lora-in-gemm MODE: set_moe_lora_in_gemm for every row (empty: the default)
  int down_decode_stages = -1;        // --down-decode-stages N: set_moe_block_down_decode_stages for every row
  int pdl = 1;                        // 0: plain launches for every kernel (set_programmatic_launches; with --only)
  int gate_up_decode_block_n = 0;     // --gate-up-decode-block-n / --down-decode-block-n 64|128:
  int down_decode_block_n = 0;        //   set_moe_block_decode_block_n for every row (0: the default, 64)
  int mxfp4_block_n = 0, mxfp4_stages = 0, mxfp4_ctas = 0;  // --mxfp4-shape NxS[xC]: set_moe_gemm_mxfp4_shape
  int mxfp4_experts = 0;              // 1: GPT-OSS experts generated as MXFP4, the decode GEMMs on them (--mxfp4-experts)
  int attention_wgmma = 1;            // 0: every row with the prefill attention's 128-row tiles by mma.sync
                                      // (set_attention_wgmma(false): the before run)
  int attention_overlap_kv = 1;       // 0: the wgmma tiles' K/V copies in order (set_attention_wgmma_overlap_kv)
  int attention_heads_inner = 1;      // 0: the flash CTAs by kv head (set_attention_heads_inner(false))
  int cta_group = -1;                 // moe_block's CTA groups at 128-row tiles (set_moe_block_cta_group; -1: its 8)
  int down_block_n = 0;               // moe_block's 128-row down BLOCK_N (set_moe_block_down_block_n; 0: its rule)
  int fuse_prompt_route = 1;          // 0: a prompt's router as product + reduce + bias + top-k (set_fuse_prompt_route)
  int moe_lora_halves = -1;           // 0 / 1: set_moe_gemm_lora_halves (the halves layout's gate_up LoRA in the GEMM;
                                      // -1: the default, on)
  int fuse_qkv_rope = 1;              // 0: q|k|v's split as its own kernel before the rotation (set_fuse_qkv_rope)
  int moe_block_m = 0;                // 64 or 128: set_moe_gemm_block_m_override (0: the rule)
  int halves_by_tma = 1;              // 0: halves-layout gate_up on the ring kernel (set_moe_gemm_halves_by_tma)
  int timeline = 0;                   // 1: the last timed step of each row through KernelTimeline (CUPTI)
  int decode_weight_tma = 1;          // 0: the decode GEMMs' weight by copies (set_moe_decode_weight_by_tma)
  int mxfp4_weight_bulk = 0;          // 1: the MXFP4 decode GEMMs' weight by bulk copies
  int wide_route = 1;                 // 0: set_wide_route(false)
  int finish_by_chunks = 1;           // 0: the bias after cuBLASLt by the scalar kernel (set_finish_by_chunks)
  int prefill_lane = 0;               // 1: the engine's prefill lane (EngineConfig::prefill_lane)
  double prefill_lane_sm_share = 0.75;
  int prefill_lane_first = 0;         // 1: the lane's kernels before the decode steps' (EngineConfig::prefill_lane_first)
  double gpu_memory_utilization = 0;  // 0: a KV cache for the batch only; 0.9 sizes it as loramux serve does
  // Tuned launch knobs, as loramux serve loads them: "" = the committed configs/kernels, "none" = the
  // backend's built-in defaults (what this bench measured before perf-log run 44).
  std::string kernel_configs;
  int floor_only = 0;  // 1: print the floors of this shape and exit (no GPU needed)
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string key = argv[i], value = argv[i + 1];
    if (key == "--model") o.model = value;
    else if (key == "--adapters") o.adapters = std::atoi(value.c_str());
    else if (key == "--rank") o.rank = std::atoi(value.c_str());
    else if (key == "--batch") o.batch = std::atoi(value.c_str());
    else if (key == "--context") o.context = std::atoi(value.c_str());
    else if (key == "--steps") o.steps = std::atoi(value.c_str());
    else if (key == "--prefill") o.prefill = std::atoi(value.c_str());
    else if (key == "--profile") o.profile = std::atoi(value.c_str());
    else if (key == "--max-num-batched-tokens") o.max_batched_tokens = std::atoi(value.c_str());
    else if (key == "--gpu-memory-utilization") o.gpu_memory_utilization = std::atof(value.c_str());
    else if (key == "--kernel-configs") o.kernel_configs = value;
    else if (key == "--floor-only") o.floor_only = std::atoi(value.c_str());
    else if (key == "--vocab") o.vocab = std::max(0, std::atoi(value.c_str()));
    else if (key == "--weight-seed") o.weight_seed = std::strtoull(value.c_str(), nullptr, 10);
    else if (key == "--steady-steps") o.steady_steps = std::max(0, std::atoi(value.c_str()));
    else if (key == "--steady-output") o.steady_output = std::max(2, std::atoi(value.c_str()));
    else if (key == "--decode-warmup") o.decode_warmup = std::max(1, std::atoi(value.c_str()));
    else if (key == "--target-rows") o.target_rows = std::atoi(value.c_str());
    else if (key == "--step-reps") o.step_reps = std::max(3, std::atoi(value.c_str()) | 1);
    else if (key == "--only") o.only = value;
    else if (key == "--knockout") o.knockout = std::atoi(value.c_str());
    else if (key == "--new-rows-only") o.new_rows_only = std::atoi(value.c_str()) != 0;
    else if (key == "--attention-wgmma") o.attention_wgmma = std::atoi(value.c_str());
    else if (key == "--attention-overlap-kv") o.attention_overlap_kv = std::atoi(value.c_str());
    else if (key == "--attention-heads-inner") o.attention_heads_inner = std::atoi(value.c_str());
    else if (key == "--cta-group") o.cta_group = std::atoi(value.c_str());
    else if (key == "--down-block-n") o.down_block_n = std::atoi(value.c_str());
    else if (key == "--fuse-prompt-route") o.fuse_prompt_route = std::atoi(value.c_str());
    else if (key == "--moe-lora-halves") o.moe_lora_halves = std::atoi(value.c_str());
    else if (key == "--fuse-qkv-rope") o.fuse_qkv_rope = std::atoi(value.c_str());
    else if (key == "--moe-block-m") o.moe_block_m = std::atoi(value.c_str());
    else if (key == "--halves-by-tma") o.halves_by_tma = std::atoi(value.c_str());
    else if (key == "--timeline") o.timeline = std::atoi(value.c_str());
    else if (key == "--decode-weight-tma") o.decode_weight_tma = std::atoi(value.c_str());
    else if (key == "--mxfp4-weight-bulk") o.mxfp4_weight_bulk = std::atoi(value.c_str());
    else if (key == "--wide-route") o.wide_route = std::atoi(value.c_str());
    else if (key == "--finish-by-chunks") o.finish_by_chunks = std::atoi(value.c_str());
    else if (key == "--moe-stream-k") o.moe_stream_k = std::atoi(value.c_str());
    else if (key == "--moe-epilogue-warps") o.moe_epilogue_warps = std::atoi(value.c_str());
    else if (key == "--moe-epilogue-lora") o.moe_epilogue_lora = std::atoi(value.c_str());
    else if (key == "--moe-lora-ktile") o.moe_lora_ktile = std::atoi(value.c_str());
    else if (key == "--moe-epilogue-down") o.moe_epilogue_down = std::atoi(value.c_str());
    else if (key == "--moe-lora-wgmma") o.moe_lora_wgmma = std::atoi(value.c_str());
    else if (key == "--fuse-route") o.fuse_route = std::atoi(value.c_str());
    else if (key == "--skinny-max-out") o.skinny_max_out = std::atoll(value.c_str());
    else if (key == "--moe-lora-in-gemm") o.moe_lora_in_gemm = value;
    else if (key == "--down-decode-stages") o.down_decode_stages = std::atoi(value.c_str());
    else if (key == "--pdl") o.pdl = std::atoi(value.c_str());
    else if (key == "--gate-up-decode-block-n") o.gate_up_decode_block_n = std::atoi(value.c_str());
    else if (key == "--down-decode-block-n") o.down_decode_block_n = std::atoi(value.c_str());
    else if (key == "--mxfp4-shape") {
      if (std::sscanf(value.c_str(), "%dx%dx%d", &o.mxfp4_block_n, &o.mxfp4_stages, &o.mxfp4_ctas) < 2) {
        std::fprintf(stderr, "bench_decode_step: --mxfp4-shape: expected COLUMNSxSTAGES[xCTAS] (e.g. 128x6, 128x4x8), got '%s'\n",
                     value.c_str());
        std::exit(2);
      }
    }
    else if (key == "--mxfp4-experts") o.mxfp4_experts = std::atoi(value.c_str());
    else if (key == "--prefill-lane") o.prefill_lane = std::atoi(value.c_str());
    else if (key == "--prefill-lane-sm-share") o.prefill_lane_sm_share = std::atof(value.c_str());
    else if (key == "--prefill-lane-first") o.prefill_lane_first = std::atoi(value.c_str());
    else {
      std::fprintf(stderr, "bench_decode_step: unknown option %s\n", key.c_str());
      std::exit(2);
    }
  }
  return o;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Bytes one decode step of `batch` sequences at `context` must read, by part.
struct DecodeFloor {
  double attention = 0, experts = 0, router = 0, lm_head = 0, kv = 0, adapters = 0;
  double total() const { return attention + experts + router + lm_head + kv + adapters; }
};

// mxfp4: the experts are read as MXFP4 (17 bytes per 32 values: codes and one exponent a group).
DecodeFloor decode_floor(const model::ModelConfig& c, int batch, int context, int adapters, int rank,
                         bool mxfp4 = false) {
  DecodeFloor f;
  const double H = c.hidden_size, D = c.head_dim, Hq = c.num_heads, Hkv = c.num_kv_heads, E = c.num_experts;
  const double K = c.experts_per_token, I = c.is_moe() ? c.moe_intermediate_size : c.intermediate_size;
  const double attention_params = (Hq * D * H) * 2 + (Hkv * D * H) * 2;
  // Expected distinct experts touched by B tokens of K distinct experts each (uniform routing).
  const double touched = c.is_moe() ? E * (1.0 - std::pow(1.0 - K / E, batch)) : 1.0;
  const double expert_params = 3.0 * I * H;
  // Adapter slices: per slot, the distinct experts of its own tokens, A and B of gate_up and down, plus
  // attention q, k, v, o.
  const int slots_used = std::min(adapters, batch);
  const double tokens_per_slot = slots_used ? double(batch) / slots_used : 0.0;
  const double touched_per_slot = c.is_moe() ? E * (1.0 - std::pow(1.0 - K / E, tokens_per_slot)) : 1.0;
  const double lora_expert = rank * (H + 2 * I + I + H);
  const double lora_attention = rank * ((H + Hq * D) * 2 + (H + Hkv * D) * 2);
  for (int layer = 0; layer < c.num_layers; ++layer) {
    f.attention += attention_params * 2;
    f.experts += touched * expert_params * (mxfp4 ? 17.0 / 32.0 : 2.0);
    if (c.is_moe()) f.router += E * H * 2;
    const bool sliding = c.sliding_window > 0 && c.layer_sliding[size_t(layer)];
    const double keys = sliding ? std::min<double>(context, c.sliding_window) : context;
    f.kv += batch * keys * Hkv * D * 2 * 2;
    f.adapters += slots_used * (touched_per_slot * lora_expert + lora_attention) * 2;
  }
  f.lm_head = double(c.vocab_size) * H * 2;
  return f;
}

// FLOPs of one prefill of `tokens` (matmuls over the active parameters + causal attention).
double prefill_flops(const model::ModelConfig& c, int tokens) {
  const double H = c.hidden_size, D = c.head_dim, Hq = c.num_heads, Hkv = c.num_kv_heads;
  const double K = c.is_moe() ? c.experts_per_token : 1, I = c.is_moe() ? c.moe_intermediate_size : c.intermediate_size;
  double flops = 0;
  for (int layer = 0; layer < c.num_layers; ++layer) {
    flops += 2.0 * tokens * ((Hq * D * H) * 2 + (Hkv * D * H) * 2 + K * 3 * I * H);
    const bool sliding = c.sliding_window > 0 && c.layer_sliding[size_t(layer)];
    const double keys = sliding ? std::min<double>(tokens, c.sliding_window) : tokens / 2.0;  // mean keys per query
    flops += 2.0 * 2.0 * tokens * keys * Hq * D;
  }
  return flops + 2.0 * H * c.vocab_size;  // one sampled row through the LM head
}

// Bytes one prefill of `tokens` must read at least: the weights it touches (attention, the experts its
// tokens route to under uniform routing, the router, the LM head), as decode_floor counts them for a batch of
// `tokens`. The prefill rows keep the FLOP floor (issue 5); this says where the weights' bytes come close to
// it (Qwen3-30B-A3B at 1600 tokens: 128 experts of 9.4 MB in each of 48 layers).
double prefill_weight_bytes(const model::ModelConfig& c, int tokens) {
  const DecodeFloor f = decode_floor(c, tokens, 0, 0, 0);
  return f.attention + f.experts + f.router + f.lm_head;
}

struct Run {
  std::unique_ptr<engine::Engine> engine;
};

// --floor-only 1: the decode floors (bf16 experts, and MXFP4 for GPT-OSS) and the prefill floor of this
// shape, as OTPS too, without a GPU: the yardstick's "% of floor" at other batch sizes and models.
int print_floors(const Options& o) {
  const std::string prefix = "preset:";
  if (o.model.rfind(prefix, 0) != 0) {
    std::fprintf(stderr, "bench_decode_step: --floor-only needs a preset model (preset:NAME), got '%s'\n", o.model.c_str());
    return 2;
  }
  Result<model::ModelConfig> config = model::preset_config(o.model.substr(prefix.size()));
  if (!config.ok()) {
    std::fprintf(stderr, "bench_decode_step: %s\n", config.status().message().c_str());
    return 2;
  }
  model::ModelConfig c = std::move(config).value();
  if (o.vocab > 0) c.vocab_size = o.vocab;
  std::printf("%s (vocab %d): B %d at context %d, %d adapters of rank %d; bytes over %.1f TB/s, FLOPs over %.0f TFLOP/s\n",
              o.model.c_str(), c.vocab_size, o.batch, o.context, o.adapters, o.rank, kBytesPerSecond * 1e-12,
              kFlopsPerSecond * 1e-12);
  for (const bool mxfp4 : {false, true}) {
    if (mxfp4 && c.family != model::Family::kGptOss) continue;
    const double with_lora = decode_floor(c, o.batch, o.context, o.adapters, o.rank, mxfp4).total() / kBytesPerSecond;
    const double base = decode_floor(c, o.batch, o.context, 0, o.rank, mxfp4).total() / kBytesPerSecond;
    std::printf("decode floor, %s experts: %.3f ms = %.0f OTPS with the adapters, %.3f ms = %.0f OTPS without\n",
                mxfp4 ? "MXFP4" : "bf16", with_lora * 1e3, 1.0 / with_lora, base * 1e3, 1.0 / base);
  }
  std::printf("prefill floor, %d tokens: %.3f ms of FLOPs; the weights' bytes alone %.3f ms\n", o.prefill,
              prefill_flops(c, o.prefill) / kFlopsPerSecond * 1e3, prefill_weight_bytes(c, o.prefill) / kBytesPerSecond * 1e3);
  return 0;
}

std::vector<int32_t> random_prompt(Rng& rng, int length, int vocab) {
  std::vector<int32_t> ids(static_cast<size_t>(length));
  for (int32_t& id : ids) id = int32_t(rng.next_u64() % uint64_t(vocab));
  return ids;
}

// Admits a request of `prompt_tokens` random tokens and `max_tokens` outputs (ignore_eos) for `adapter`;
// exits on a refusal.
uint64_t admit(engine::Engine& engine, Rng& rng, int vocab, const std::string& adapter, int prompt_tokens,
               int max_tokens) {
  engine::Request r;
  r.adapter = adapter;
  r.prompt_ids = random_prompt(rng, std::max(1, prompt_tokens), vocab);
  r.sampling.max_tokens = max_tokens;
  r.sampling.ignore_eos = true;
  Result<uint64_t> id = engine.add_request(r);
  if (!id.ok()) {
    std::fprintf(stderr, "bench_decode_step: %s\n", id.status().message().c_str());
    std::exit(1);
  }
  return *id;
}

// Median wall seconds of `steps` decode steps once all `batch` sequences (prompt `context` - 1 tokens)
// are decoding. adapter_of(i) names sequence i's adapter ("" = base). staggered: as the yardstick's steady
// state — contexts spread over context ± 300 and the requests admitted one at a time while the earlier ones
// decode, so their KV pages interleave in the pool.
// --timeline 1: a KernelTimeline over one timed step when `on` (the device idle before it starts: every row's
// steps end by reading their sampled tokens); print() stops it and prints its summary.
class Timeline {
 public:
  explicit Timeline(bool on) : on_(on) {
    if (on_) timeline_.start();
  }
  void print(const char* what) {
    if (!on_) return;
    cudaDeviceSynchronize();
    timeline_.stop();
    timeline_.print(what);
    on_ = false;
  }

 private:
  bool on_;
  bench::KernelTimeline timeline_;
};

double time_decode(engine::Engine& engine, const Options& o, int vocab, Rng& rng,
                   const std::function<std::string(int)>& adapter_of, bench::OpProfiler* profiler = nullptr,
                   bool staggered = false) {
  std::vector<uint64_t> ids;
  for (int i = 0; i < o.batch; ++i) {
    const int spread = staggered && o.batch > 1 ? 600 * i / (o.batch - 1) - 300 : 0;
    // decodes through the admissions
    ids.push_back(admit(engine, rng, vocab, adapter_of(i), o.context - 1 + spread,
                        o.decode_warmup + o.steps + 64 + (staggered ? 8 * o.batch : 0)));
    if (staggered) {  // this one's prefill, then a few decode steps of everything admitted so far
      while (engine.scheduler().num_waiting() > 0) engine.step();
      for (int s = 0; s < 8; ++s) engine.step();
    }
  }
  // Prefill everything (chunked), then a few warm-up decode steps.
  int guard = 0;
  while (engine.scheduler().num_waiting() > 0 || guard < o.decode_warmup) {
    if (engine.step().num_tokens == o.batch) ++guard;
  }
  std::vector<double> seconds, device, launch;
  if (profiler) profiler->reset();
  // The sampled tokens: with generated weights greedy decoding may repeat one token across the batch, which
  // routes every sequence to the same experts at layer 0 (fewer expert bytes than the floor assumes).
  std::set<int32_t> last_tokens, all_tokens;
  nvtxRangePushA(kTimedRange);
  for (int s = 0; s < o.steps; ++s) {
    Timeline timeline(o.timeline && s == o.steps - 1);
    const auto t0 = std::chrono::steady_clock::now();
    const engine::Engine::StepReport report = engine.step();
    seconds.push_back(seconds_since(t0));
    timeline.print("decode step, last timed step");
    device.push_back(report.device_seconds);
    launch.push_back(report.launch_seconds);
    if (report.num_tokens != o.batch) {
      std::fprintf(stderr, "bench_decode_step: a step ran %d tokens, not %d\n", report.num_tokens, o.batch);
    }
    last_tokens.clear();
    for (const engine::StepOutput& out : report.outputs) {
      last_tokens.insert(out.token);
      all_tokens.insert(out.token);
    }
  }
  nvtxRangePop();
  // The serve run's step metrics, for the same step here: device time (enqueued inputs to sampled tokens)
  // and the host time until the forward was launched, medians.
  std::sort(device.begin(), device.end());
  std::sort(launch.begin(), launch.end());
  std::printf("  (%zu distinct tokens among the batch's last step, %zu over the %d timed steps, after %d decode "
              "steps of warm-up; device median %.3f ms, host launch median %.3f ms)\n",
              last_tokens.size(), all_tokens.size(), o.steps, o.decode_warmup, device[device.size() / 2] * 1e3,
              launch[launch.size() / 2] * 1e3);
  for (uint64_t id : ids) engine.abort(id);
  std::sort(seconds.begin(), seconds.end());
  if (profiler) profiler->print(o.steps, seconds[seconds.size() / 2]);
  return seconds[seconds.size() / 2];
}

// The serve run without its HTTP side: `batch` requests in flight, each a fresh `prefill`-token prompt with
// `steady_output` tokens (ignore_eos), adapters round-robin; a finished request is replaced at once, so its
// successor's prompt is prefilled in a mixed step beside the others' decodes. The first requests' output
// lengths are staggered so that they finish one by one, as in the yardstick's steady state. Runs until
// `steady_steps` decode steps of the full batch have been seen and prints their device and wall medians
// (the figures the serve run's /metrics reports) and the mixed steps'; returns the decode steps' wall median.
double time_steady(engine::Engine& engine, const Options& o, int vocab, Rng& rng,
                   const std::function<std::string(int)>& adapter_of) {
  std::set<uint64_t> in_flight;
  std::map<uint64_t, std::chrono::steady_clock::time_point> admitted_at;  // until the request's first token
  std::vector<double> first_token;  // admission → first token, wall (TTFT without HTTP), after the first batch
  int admitted = 0;
  auto admit_one = [&](int max_tokens) {
    const uint64_t id = admit(engine, rng, vocab, adapter_of(admitted++), o.prefill, max_tokens);
    in_flight.insert(id);
    if (admitted > o.batch) admitted_at[id] = std::chrono::steady_clock::now();
  };
  for (int i = 0; i < o.batch; ++i) admit_one(std::max(2, o.steady_output * (i + 1) / o.batch));
  std::vector<double> decode_wall, decode_device, mixed_device;
  std::vector<double> beside_lane_device;  // decode steps of the others while one prompt is on the prefill lane
  int steps = 0;
  while (int(decode_device.size()) < o.steady_steps) {
    const auto t0 = std::chrono::steady_clock::now();
    const engine::Engine::StepReport report = engine.step();
    const double wall = seconds_since(t0);
    if (++steps > 100 * (o.steady_steps + o.batch)) {
      std::fprintf(stderr, "bench_decode_step: the steady-state row saw only %zu full decode steps in %d steps\n",
                   decode_device.size(), steps);
      std::exit(1);
    }
    const bool decode_only = report.num_tokens == int(report.outputs.size());
    if (decode_only && report.num_tokens == o.batch) {
      decode_wall.push_back(wall);
      decode_device.push_back(report.device_seconds);
    } else if (decode_only && report.num_tokens == o.batch - 1 && engine.config().prefill_lane) {
      beside_lane_device.push_back(report.device_seconds);
    } else if (!decode_only && engine.scheduler().num_waiting() == 0 && admitted > o.batch) {
      mixed_device.push_back(report.device_seconds);  // a successor's prompt beside the others' decodes
    }
    for (const engine::StepOutput& out : report.outputs) {
      if (auto it = admitted_at.find(out.id); it != admitted_at.end()) {
        first_token.push_back(seconds_since(it->second));
        admitted_at.erase(it);
      }
      if (!out.finished) continue;
      in_flight.erase(out.id);
      admit_one(o.steady_output);
    }
  }
  for (uint64_t id : in_flight) engine.abort(id);
  while (engine.has_work()) engine.step();
  auto median = [](std::vector<double> v) {
    if (v.empty()) return 0.0;
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::printf("  (%zu full decode steps: device median %.3f ms; %zu mixed steps (a new prompt beside %d decoding): "
              "device median %.3f ms; %d requests admitted)\n",
              decode_device.size(), median(decode_device) * 1e3, mixed_device.size(), o.batch - 1,
              median(mixed_device) * 1e3, admitted);
  std::sort(first_token.begin(), first_token.end());
  std::printf("  (admission to first token, %zu replacement requests: median %.1f ms, p90 %.1f ms; prefill lane: %s, "
              "%zu decode steps beside it, device median %.3f ms)\n",
              first_token.size(), median(first_token) * 1e3,
              first_token.empty() ? 0.0 : first_token[first_token.size() * 9 / 10] * 1e3,
              engine.config().prefill_lane ? "on" : "off", beside_lane_device.size(), median(beside_lane_device) * 1e3);
  return median(decode_wall);
}

// Median wall seconds of the prefill of one `o.prefill`-token prompt (nothing else running) for `adapter`
// ("": the base model).
double time_prefill(engine::Engine& engine, const Options& o, int vocab, Rng& rng, bench::OpProfiler* profiler = nullptr,
                    const std::string& adapter = "") {
  engine::Request r;
  r.adapter = adapter;
  r.prompt_ids = random_prompt(rng, o.prefill, vocab);
  r.sampling.max_tokens = 1;
  r.sampling.ignore_eos = true;
  std::vector<double> seconds, device, launch;  // device / launch: summed over the prompt's steps
  const int reps = o.step_reps;
  for (int rep = 0; rep < reps; ++rep) {
    r.prompt_ids[0] = int32_t(rep);  // a new prompt each time: no prefix-cache hit
    if (!engine.add_request(r).ok()) std::exit(1);
    if (profiler && rep == reps - 1) profiler->reset();
    const bool traced = o.timeline && rep == reps - 1;
    Timeline timeline(traced);
    double device_sum = 0, launch_sum = 0;
    const auto t0 = std::chrono::steady_clock::now();
    nvtxRangePushA(kTimedRange);
    while (engine.has_work()) {
      const engine::Engine::StepReport report = engine.step();
      device_sum += std::max(report.device_seconds, 0.0);
      launch_sum += report.launch_seconds;
    }
    nvtxRangePop();
    timeline.print(adapter.empty() ? "prefill of one prompt, last rep" : "prefill with an adapter, last rep");
    seconds.push_back(seconds_since(t0));
    device.push_back(device_sum);
    launch.push_back(launch_sum);
  }
  if (profiler) profiler->print(1, seconds.back());
  std::sort(seconds.begin(), seconds.end());
  std::sort(device.begin(), device.end());
  std::sort(launch.begin(), launch.end());
  // Wall time against device time (enqueued inputs to sampled tokens) says what the host adds around the
  // forward; the host launch time says whether the GPU could have waited for the launches inside it.
  std::printf("  (prefill of %d tokens: wall median %.3f ms, device median %.3f ms, host launch median %.3f ms)\n",
              o.prefill, seconds[size_t(reps / 2)] * 1e3, device[size_t(reps / 2)] * 1e3, launch[size_t(reps / 2)] * 1e3);
  return seconds[size_t(reps / 2)];
}

// Median wall seconds of the yardstick's mixed step: one new `o.prefill`-token prompt (adapter
// adapter_of(o.batch - 1)) prefilled in the same step as `o.batch - 1` sequences at context `o.context`
// decode (adapters adapter_of(i)). The serve run's mixed steps take 50 ms of device time (perf-log run 62)
// where the prompt alone takes ~40: this row measures that step in isolation.
double time_mixed(engine::Engine& engine, const Options& o, int vocab, Rng& rng,
                  const std::function<std::string(int)>& adapter_of, bench::OpProfiler* profiler = nullptr) {
  std::vector<uint64_t> ids;
  const int decoding = std::max(0, o.batch - 1);
  for (int i = 0; i < decoding; ++i) ids.push_back(admit(engine, rng, vocab, adapter_of(i), o.context - 1, o.decode_warmup + 64));
  int guard = 0;
  while (engine.scheduler().num_waiting() > 0 || guard < o.decode_warmup) {
    if (engine.step().num_tokens == decoding) ++guard;
  }
  std::vector<double> seconds;
  int step_tokens = 0;
  const int reps = o.step_reps;
  for (int rep = 0; rep < reps; ++rep) {
    admit(engine, rng, vocab, adapter_of(o.batch - 1), o.prefill, 1);  // fresh tokens: no prefix-cache hit
    if (profiler && rep == reps - 1) profiler->reset();
    Timeline timeline(o.timeline && rep == reps - 1);
    const auto t0 = std::chrono::steady_clock::now();
    nvtxRangePushA(kTimedRange);
    step_tokens = engine.step().num_tokens;
    nvtxRangePop();
    seconds.push_back(seconds_since(t0));
    timeline.print("mixed step, last rep");
    while (engine.scheduler().num_waiting() > 0) engine.step();  // a prompt the step budget split
  }
  std::printf("  (the timed step ran %d tokens: %d decoding, the rest of the new prompt)\n", step_tokens, decoding);
  for (uint64_t id : ids) engine.abort(id);
  if (profiler) profiler->print(1, seconds.back());
  std::sort(seconds.begin(), seconds.end());
  return seconds[size_t(reps / 2)];
}

}  // namespace
}  // namespace lmx

int main(int argc, char** argv) {
  using namespace lmx;
  const Options o = parse(argc, argv);
  if (o.floor_only) return print_floors(o);
  if (o.moe_stream_k) {
    cuda::set_moe_gemm_stream_k(true);
    std::printf("every row: the MoE GEMMs with a stream-K tail (--moe-stream-k 1)\n");
  }
  if (o.moe_epilogue_warps >= 0) {
    cuda::set_moe_gemm_epilogue_warps(o.moe_epilogue_warps == 1);
    std::printf("every row: gate_up's fused epilogue by %s (--moe-epilogue-warps %d)\n",
                o.moe_epilogue_warps == 1 ? "the producer warpgroup's idle warps" : "the consumers", o.moe_epilogue_warps);
  }
  if (o.moe_epilogue_lora) {
    cuda::set_moe_gemm_epilogue_lora(true);
    std::printf("every row: the MoE-LoRA terms by those warps too (--moe-epilogue-lora 1)\n");
  }
  if (o.moe_lora_ktile >= 0) {
    cuda::set_moe_gemm_lora_ktile(o.moe_lora_ktile == 1);
    std::printf("every row: the MoE-LoRA's main slot %s (--moe-lora-ktile %d)\n",
                o.moe_lora_ktile == 1 ? "as one more k-tile of the GEMMs' ring" : "by add_lora_terms", o.moe_lora_ktile);
  }
  if (o.moe_epilogue_down) {
    cuda::set_moe_gemm_epilogue_down(true);
    std::printf("every row: down's stores by those warps too, down at BLOCK_N 192 (--moe-epilogue-down 1)\n");
  }
  if (o.moe_lora_wgmma) {
    cuda::set_moe_lora_gemm_wgmma(true);
    std::printf("every row: the MoE-LoRA's main slot by warpgroup MMAs (--moe-lora-wgmma 1)\n");
  }
  if (!o.attention_wgmma) {
    cuda::set_attention_wgmma(false);
    std::printf("every row: prefill attention tiles by mma.sync (--attention-wgmma 0)\n");
  }
  if (o.down_block_n != 0) {
    cuda::set_moe_block_down_block_n(o.down_block_n);
    std::printf("every row: moe_block's 128-row down GEMM at BLOCK_N %d (--down-block-n)\n", o.down_block_n);
  }
  if (!o.attention_overlap_kv) {
    cuda::set_attention_wgmma_overlap_kv(false);
    std::printf("every row: the wgmma attention tiles' K/V copies in order (--attention-overlap-kv 0)\n");
  }
  if (!o.attention_heads_inner) {
    cuda::set_attention_heads_inner(false);
    std::printf("every row: the flash attention CTAs by kv head (--attention-heads-inner 0)\n");
  }
  if (o.cta_group >= 0) {
    cuda::set_moe_block_cta_group(o.cta_group);
    std::printf("every row: moe_block's 128-row GEMMs in CTA groups of %d tiles (--cta-group)\n", o.cta_group);
  }
  ops::KernelConfigs kernel_configs;
  std::string configs_dir = o.kernel_configs;
  if (configs_dir.empty() && std::filesystem::is_directory(std::string(LORAMUX_SOURCE_DIR) + "/configs/kernels")) {
    configs_dir = std::string(LORAMUX_SOURCE_DIR) + "/configs/kernels";
  }
  if (!configs_dir.empty() && configs_dir != "none") {
    Result<ops::KernelConfigs> loaded = ops::KernelConfigs::load_dir(configs_dir);
    if (!loaded.ok()) {
      std::fprintf(stderr, "bench_decode_step: --kernel-configs: %s\n", loaded.status().message().c_str());
      return 1;
    }
    kernel_configs = std::move(loaded).value();
  }
  std::printf("bench_decode_step: kernel configs %s\n", configs_dir.empty() || configs_dir == "none"
                                                           ? "none (built-in defaults)" : configs_dir.c_str());
  cuda::CudaBackend cuda_backend(kernel_configs);
  bench::OpProfiler backend(cuda_backend);  // passes calls straight through until enabled (--profile)
  if (o.timeline) bench::KernelTimeline::enable();  // every timed step under CUPTI alike (KernelTimeline::enable)
  if (o.mxfp4_block_n != 0) {
    try {
      cuda::set_moe_gemm_mxfp4_shape(o.mxfp4_block_n, o.mxfp4_stages, o.mxfp4_ctas);
    } catch (const std::invalid_argument& e) {
      std::fprintf(stderr, "bench_decode_step: --mxfp4-shape: %s\n", e.what());
      return 2;
    }
    std::printf("every row: the MXFP4 decode GEMM at %d columns x %d stages%s\n", o.mxfp4_block_n, o.mxfp4_stages,
                o.mxfp4_ctas ? (", " + std::to_string(o.mxfp4_ctas) + " CTAs an SM").c_str() : "");
  }
  if (o.moe_block_m != 0) {
    try {
      cuda::set_moe_gemm_block_m_override(o.moe_block_m);
    } catch (const std::invalid_argument& e) {
      std::fprintf(stderr, "bench_decode_step: --moe-block-m: %s\n", e.what());
      return 2;
    }
    std::printf("every row: the MoE GEMMs at BLOCK_M %d (--moe-block-m)\n", o.moe_block_m);
  }
  if (!o.halves_by_tma) {
    cuda::set_moe_gemm_halves_by_tma(false);
    std::printf("every row: the halves-layout gate_up on the ring kernel (--halves-by-tma 0)\n");
  }
  if (!o.decode_weight_tma) {
    cuda::set_moe_decode_weight_by_tma(false);
    std::printf("every row: the bf16 decode GEMMs' weight tiles by cp.async copies (--decode-weight-tma 0)\n");
  }
  if (o.mxfp4_weight_bulk) {
    cuda::set_moe_mxfp4_weight_by_bulk(true);
    std::printf("every row: the MXFP4 decode GEMMs' weight spans by bulk copies (--mxfp4-weight-bulk 1)\n");
  }
  if (!o.pdl) {  // the full run's "same, plain launches" row and its knob rows set it back on: use with --only
    cuda_backend.set_programmatic_launches(false);
    std::printf("every row: plain launches, no PDL chain (--pdl 0)\n");
  }
  if (!o.wide_route) {
    cuda_backend.set_wide_route(false);
    std::printf("every row: a prompt's route at 16 outputs a CTA (--wide-route 0)\n");
  }
  if (!o.finish_by_chunks) {
    cuda_backend.set_finish_by_chunks(false);
    std::printf("every row: the bias after cuBLASLt by the scalar kernel (--finish-by-chunks 0)\n");
  }
  if (!o.fuse_qkv_rope) {
    cuda_backend.set_fuse_qkv_rope(false);
    std::printf("every row: q|k|v's split as its own kernel before the rotation (--fuse-qkv-rope 0)\n");
  }
  if (o.moe_lora_halves >= 0) {
    cuda::set_moe_gemm_lora_halves(o.moe_lora_halves == 1);
    std::printf("every row: gate_up's MoE-LoRA for the halves layout %s (--moe-lora-halves %d)\n",
                o.moe_lora_halves == 1 ? "in the GEMM's accumulators" : "by the expand kernels", o.moe_lora_halves);
  }
  if (!o.fuse_prompt_route) {
    cuda_backend.set_fuse_prompt_route(false);
    std::printf("every row: a prompt's router as cuBLASLt's product, the bias and the top-k kernels (--fuse-prompt-route 0)\n");
  }
  if (o.fuse_route) {
    cuda_backend.set_fuse_route(true);
    std::printf("every row: the router's product and top-k as one kernel (--fuse-route 1)\n");
  }
  if (o.down_decode_stages >= 0) {
    cuda::set_moe_block_down_decode_stages(o.down_decode_stages);  // throws with the accepted values
    std::printf("every row: the bf16 decode down GEMM at %d stages (--down-decode-stages)\n", o.down_decode_stages);
  }
  if (o.gate_up_decode_block_n != 0 || o.down_decode_block_n != 0) {
    cuda::set_moe_block_decode_block_n(o.gate_up_decode_block_n, o.down_decode_block_n);  // throws if not built
    std::printf("every row: the bf16 decode GEMMs at BLOCK_N %d (gate_up) and %d (down) (0: 64)\n",
                o.gate_up_decode_block_n, o.down_decode_block_n);
  }
  if (!o.moe_lora_in_gemm.empty()) {
    const std::string& m = o.moe_lora_in_gemm;
    if (m != "off" && m != "long-runs" && m != "always") {
      std::fprintf(stderr, "bench_decode_step: --moe-lora-in-gemm: expected off, long-runs or always, got '%s'\n", m.c_str());
      return 2;
    }
    cuda::set_moe_lora_in_gemm(m == "off" ? cuda::MoeLoraInGemm::kOff
                               : m == "always" ? cuda::MoeLoraInGemm::kAlways
                                               : cuda::MoeLoraInGemm::kLongRuns);
    std::printf("every row: set_moe_lora_in_gemm(%s) (--moe-lora-in-gemm)\n", m.c_str());
  }
  if (o.skinny_max_out != 1024) {
    cuda_backend.set_skinny_max_out(o.skinny_max_out);
    std::printf("every row: products of <= 16 rows and up to %lld outputs on the skinny kernel (--skinny-max-out)\n",
                (long long)o.skinny_max_out);
  }
  const auto t_load = std::chrono::steady_clock::now();
  Result<model::ModelWeights> weights =
      engine::load_base_model(o.model, o.weight_seed, o.vocab, &backend,
                              o.mxfp4_experts != 0 ? engine::Mxfp4Experts::kOn : engine::Mxfp4Experts::kOff);
  if (!weights.ok()) {
    std::fprintf(stderr, "bench_decode_step: %s\n", weights.status().message().c_str());
    return 1;
  }
  backend.synchronize();
  const model::ModelConfig& c = weights->config;
  std::printf("bench_decode_step: %s (vocab %d, weight seed %llu), weights generated on the GPU in %.1f s; B %d, "
              "context %d, %d adapters of rank %d\n",
              o.model.c_str(), c.vocab_size, (unsigned long long)o.weight_seed, seconds_since(t_load), o.batch,
              o.context, o.adapters, o.rank);

  engine::EngineConfig config;
  config.scheduler.max_num_seqs = o.batch;
  config.scheduler.max_num_batched_tokens = o.max_batched_tokens > 0 ? o.max_batched_tokens : std::max(o.prefill, 4096);
  config.gpu_memory_utilization = o.gpu_memory_utilization;  // the serve run's KV pool (the 0.7 ms question)
  // room for the staggered row: contexts up to --context + 300, 8 decode steps per later admission
  config.scheduler.max_model_len = std::max({o.context + 300 + o.decode_warmup + o.steps + 8 * o.batch + 128,
                                             o.prefill + 16, o.steady_steps > 0 ? o.prefill + o.steady_output + 16 : 0});
  config.max_loras = std::max(1, o.adapters);
  config.max_lora_rank = o.rank;
  config.scheduler.enable_prefix_caching = false;  // every step must do its full work
  config.prefill_lane = o.prefill_lane != 0;
  config.prefill_lane_sm_share = o.prefill_lane_sm_share;
  config.prefill_lane_first = o.prefill_lane_first != 0;
  Result<std::unique_ptr<engine::Engine>> engine = engine::Engine::create(*weights, backend, config);
  if (!engine.ok()) {
    std::fprintf(stderr, "bench_decode_step: %s\n", engine.status().message().c_str());
    return 1;
  }
  const lora::BaseModelShapes shapes = engine::lora_shapes(c);
  const auto t_adapters = std::chrono::steady_clock::now();
  for (int a = 0; a < o.adapters; ++a) {
    Status added = (*engine)->add_adapter(lora::make_dummy_adapter("a" + std::to_string(a), shapes, o.rank, 100 + a));
    if (!added.ok()) {
      std::fprintf(stderr, "bench_decode_step: %s\n", added.message().c_str());
      return 1;
    }
  }
  if (o.target_rows != 0) {  // the same seeds on attention only ("attn<a>") and on the MLP only ("mlp<a>")
    for (int a = 0; a < o.adapters; ++a) {
      for (const auto& [prefix, which] : {std::pair{"attn", lora::DummyTargets::kAttention},
                                          std::pair{"mlp", lora::DummyTargets::kMlp}}) {
        Status added = (*engine)->add_adapter(
            lora::make_dummy_adapter(prefix + std::to_string(a), shapes, o.rank, 100 + a, which));
        if (!added.ok()) {
          std::fprintf(stderr, "bench_decode_step: %s\n", added.message().c_str());
          return 1;
        }
      }
    }
  }
  std::printf("  %d dummy adapters made in %.1f s\n", o.adapters * (o.target_rows != 0 ? 3 : 1),
              seconds_since(t_adapters));

  Rng rng(20261202);
  const bool mxfp4 = o.mxfp4_experts != 0;
  const DecodeFloor with_lora = decode_floor(c, o.batch, o.context, o.adapters, o.rank, mxfp4);
  const DecodeFloor base = decode_floor(c, o.batch, o.context, 0, o.rank, mxfp4);
  if (mxfp4) {
    std::printf("every row: MXFP4 experts (--mxfp4-experts 1): the decode GEMMs read them, the floors count them\n");
  }
  std::printf("  decode floor bytes (GB): attention %.2f, experts %.2f, router %.3f, LM head %.2f, KV %.2f, adapters %.2f\n",
              with_lora.attention * 1e-9, with_lora.experts * 1e-9, with_lora.router * 1e-9, with_lora.lm_head * 1e-9,
              with_lora.kv * 1e-9, with_lora.adapters * 1e-9);
  if (o.prefill > 0) {
    std::printf("  prefill of %d tokens: the rows' floor is its FLOPs, %.3f ms; its weights' bytes alone take %.3f ms\n",
                o.prefill, prefill_flops(c, o.prefill) / kFlopsPerSecond * 1e3,
                prefill_weight_bytes(c, o.prefill) / kBytesPerSecond * 1e3);
  }
  auto row = [&](const char* what, double seconds, double floor_seconds) {
    std::printf("%-52s %10.3f ms  floor %8.3f ms  %5.1f%% of floor  (%.2fx)\n", what, seconds * 1e3, floor_seconds * 1e3,
                100.0 * floor_seconds / seconds, seconds / floor_seconds);
    std::fflush(stdout);
  };
  const int vocab = c.vocab_size;
  auto spread = [&](int i) { return "a" + std::to_string(i % std::max(1, o.adapters)); };
  auto no_adapter = [](int) { return std::string(); };
  if (!o.only.empty()) {  // one row (Nsight Compute runs)
    cuda::set_small_lora_knockout(o.knockout);  // a diagnostic: the named small LoRA launches skipped
    const double prefill_floor = prefill_flops(c, o.prefill) / kFlopsPerSecond;
    if (o.only == "decode") {
      row("decode step, adapters spread over the batch", time_decode(**engine, o, vocab, rng, spread),
          with_lora.total() / kBytesPerSecond);
    } else if (o.only == "decode-base") {
      row("decode step, LoRA on, no adapter in batch", time_decode(**engine, o, vocab, rng, no_adapter),
          base.total() / kBytesPerSecond);
    } else if (o.only == "prefill") {
      row("prefill of one prompt", time_prefill(**engine, o, vocab, rng), prefill_floor);
    } else if (o.only == "prefill-adapter" && o.adapters > 0) {
      row("prefill of one prompt with an adapter", time_prefill(**engine, o, vocab, rng, nullptr, "a0"), prefill_floor);
    } else if (o.only == "mixed" && o.adapters > 0) {
      row("mixed step: a prompt with an adapter + the decoding batch", time_mixed(**engine, o, vocab, rng, spread),
          prefill_floor);
    } else if (o.only == "steady" && o.steady_steps > 0 && o.prefill > 0) {
      row("decode step, steady state", time_steady(**engine, o, vocab, rng, spread), with_lora.total() / kBytesPerSecond);
    } else {
      std::fprintf(stderr, "bench_decode_step: --only %s: not a row (decode, decode-base, prefill, steady with "
                           "--steady-steps > 0, and with --adapters > 0 prefill-adapter, mixed)\n", o.only.c_str());
      return 1;
    }
    return 0;
  }
  if (o.adapters > 0) {
    row("decode step, adapters spread over the batch", time_decode(**engine, o, vocab, rng, spread),
        with_lora.total() / kBytesPerSecond);
    if (!o.new_rows_only) {  // --new-rows-only 1 skips from here to the enqueue-order row
    if (mxfp4) {  // before/after: the same weights' bf16 copies (the floor printed stays the MXFP4 one)
      cuda::set_moe_gemm_mxfp4(false);
      cuda_backend.set_programmatic_launches(true);  // unchanged; makes the engine record its graphs again
      row("same, decode GEMMs on the bf16 experts", time_decode(**engine, o, vocab, rng, spread),
          with_lora.total() / kBytesPerSecond);
      cuda::set_moe_gemm_mxfp4(true);
      cuda_backend.set_programmatic_launches(true);
      cuda::set_moe_lora_in_mxfp4_gemm(true);  // before (run 118's default): the LoRA in the MXFP4 GEMMs
      cuda_backend.set_programmatic_launches(true);
      row("same, MoE-LoRA in the MXFP4 GEMMs' accumulators", time_decode(**engine, o, vocab, rng, spread),
          with_lora.total() / kBytesPerSecond);
      cuda::set_moe_lora_in_mxfp4_gemm(false);
      cuda::set_moe_lora_fork_shrinks(false);  // before (run 133): GEMM → shrink → expand, the shrinks in the chain
      cuda_backend.set_programmatic_launches(true);
      row("same, MoE-LoRA shrinks after their GEMMs", time_decode(**engine, o, vocab, rng, spread),
          with_lora.total() / kBytesPerSecond);
      cuda::set_moe_lora_fork_shrinks(true);
      cuda_backend.set_programmatic_launches(true);
    }
    if (o.target_rows != 0) {  // the floor printed is the full adapters' (an upper bound for these rows)
      for (const char* prefix : {"attn", "mlp"}) {
        auto by_target = [&](int i) { return prefix + std::to_string(i % o.adapters); };
        row(std::string(prefix) == "attn" ? "same, adapters on attention only (q, k, v, o)"
                                          : "same, adapters on the MLP only (experts)",
            time_decode(**engine, o, vocab, rng, by_target), with_lora.total() / kBytesPerSecond);
      }
    }
    cuda_backend.set_programmatic_launches(false);  // before/after of PDL (graphs are recorded again)
    row("same, plain launches (no PDL chain)", time_decode(**engine, o, vocab, rng, spread),
        with_lora.total() / kBytesPerSecond);
    cuda_backend.set_programmatic_launches(true);
    cuda_backend.set_skinny_max_out(int64_t(1) << 40);  // q|k|v and o_proj on the skinny kernel (L2 prefetch)
    row("same, every product of <= 16 rows on the skinny kernel", time_decode(**engine, o, vocab, rng, spread),
        with_lora.total() / kBytesPerSecond);
    cuda_backend.set_skinny_max_out(o.skinny_max_out);
    // Before/after of o_proj on the skinny kernel (the default since its five wins, perf-log runs 130-138):
    // its cuBLASLt product sat at ~53% of its bytes floor (perf-log run 71)
    cuda_backend.set_skinny_narrowing(false);
    row("same, o_proj on cuBLASLt", time_decode(**engine, o, vocab, rng, spread), with_lora.total() / kBytesPerSecond);
    cuda_backend.set_skinny_narrowing(true);
    cuda_backend.set_fuse_rope_kv_write(false);  // before/after of the fused rope + KV-cache write
    row("same, rope, kv_write (and a QK-norm) unfused", time_decode(**engine, o, vocab, rng, spread),
        with_lora.total() / kBytesPerSecond);
    cuda_backend.set_fuse_rope_kv_write(true);
    // Before/after of the decode MoE-LoRA in the GEMM accumulators (perf-log run 68): the expand kernels.
    cuda::set_moe_lora_in_gemm(cuda::MoeLoraInGemm::kOff);
    cuda_backend.set_programmatic_launches(true);  // unchanged; makes the engine record its graphs again
    row("same, MoE-LoRA by the expand kernels", time_decode(**engine, o, vocab, rng, spread),
        with_lora.total() / kBytesPerSecond);
    cuda::set_moe_lora_in_gemm(cuda::MoeLoraInGemm::kLongRuns);
    cuda_backend.set_programmatic_launches(true);
    // After (off by default until measured): the overlapped decode GEMMs trigger their dependents at their start.
    cuda::set_moe_gemm_early_trigger(true);
    cuda_backend.set_programmatic_launches(true);
    row("same, decode MoE GEMMs trigger their dependents at their start", time_decode(**engine, o, vocab, rng, spread),
        with_lora.total() / kBytesPerSecond);
    cuda::set_moe_gemm_early_trigger(false);
    cuda_backend.set_programmatic_launches(true);
    }
    // Before (perf-log run 148): each fused linear + LoRA enqueues its forked shrink before its product.
    cuda_backend.set_fork_product_first(false);
    row("same, forked LoRA shrinks enqueued before their dense products", time_decode(**engine, o, vocab, rng, spread),
        with_lora.total() / kBytesPerSecond);
    cuda_backend.set_fork_product_first(true);
    // Before (perf-log run 149): each MoE-LoRA expand after the join, adding into its GEMM's output (the default:
    // on the side stream right after its shrink, beside the GEMM; the activation and the combine add the terms).
    cuda::set_moe_lora_side_expands(false);
    cuda_backend.set_programmatic_launches(true);
    row("same, MoE-LoRA expands after their GEMMs (in place)", time_decode(**engine, o, vocab, rng, spread),
        with_lora.total() / kBytesPerSecond);
    cuda::set_moe_lora_side_expands(true);
    cuda_backend.set_programmatic_launches(true);
    // Where the adapters' small kernels cost step time: the step without some of them (wrong results; timing
    // only). Without the dense shrinks z stays zero, so the values stay sane; the dense expands are never
    // knocked out (they write the fused projections' outputs).
    for (const auto& [mask, what] : {std::pair{1, "diagnostic (wrong results): no dense LoRA shrinks"},
                                     std::pair{4, "diagnostic (wrong results): no MoE-LoRA shrinks"},
                                     std::pair{8, "diagnostic (wrong results): no MoE-LoRA expands"},
                                     std::pair{12, "diagnostic (wrong results): no MoE-LoRA small kernels"},
                                     std::pair{13, "diagnostic (wrong results): only the dense expands"}}) {
      cuda::set_small_lora_knockout(mask);
      cuda_backend.set_programmatic_launches(true);
      row(what, time_decode(**engine, o, vocab, rng, spread), with_lora.total() / kBytesPerSecond);
    }
    cuda::set_small_lora_knockout(0);
    cuda_backend.set_programmatic_launches(true);
    if (!o.new_rows_only) {  // and from here to the no-adapter row
    if (!o.fuse_route) {  // after (off by default until measured): the router's product and top-k as one kernel
      cuda_backend.set_fuse_route(true);
      row("same, router product and top-k as one kernel", time_decode(**engine, o, vocab, rng, spread),
          with_lora.total() / kBytesPerSecond);
      cuda_backend.set_fuse_route(false);
    }
    cuda_backend.set_linear_autotune(false);  // before/after of timing cuBLASLt's candidates for few-row products
    row("same, cuBLASLt's heuristic choice for every projection", time_decode(**engine, o, vocab, rng, spread),
        with_lora.total() / kBytesPerSecond);
    cuda_backend.set_linear_autotune(true);
    if (c.vocab_size % 128 != 0) {  // an LM head of a ragged width (loramux serve's GPT-OSS: 200019 logits)
      cuda_backend.set_split_ragged_rows(false);  // before/after of the LM head as two products (perf-log run 81)
      row("same, LM head as one cuBLASLt product (ragged width)", time_decode(**engine, o, vocab, rng, spread),
          with_lora.total() / kBytesPerSecond);
      cuda_backend.set_split_ragged_rows(true);
    }
    // Before/after of the split at multiples of 64 rows (the default): at 128, the LM head's tail is 83 rows
    // instead of 19, and GPT-OSS's o_proj (2880 = 45 · 64) two products, 2816 + 64 rows (perf-log run 96).
    cuda_backend.set_split_row_align(128);
    row("same, products split at multiples of 128 rows", time_decode(**engine, o, vocab, rng, spread),
        with_lora.total() / kBytesPerSecond);
    cuda_backend.set_split_row_align(64);
    cuda_backend.set_fuse_linear_lora(false);  // before/after of the fused linear + LoRA (shrink beside the product)
    row("same, projections as product, bias, split, LoRA launches", time_decode(**engine, o, vocab, rng, spread),
        with_lora.total() / kBytesPerSecond);
    cuda_backend.set_fuse_linear_lora(true);
    }
    row("decode step, LoRA on, no adapter in batch", time_decode(**engine, o, vocab, rng, no_adapter),
        base.total() / kBytesPerSecond);
    // The yardstick's steady state: contexts spread ± 300 around --context, pages interleaved by admission
    // one at a time (the serve run's decode steps sit ~0.7 ms above the first row; perf-log run 35).
    row("decode step, adapters spread, contexts staggered",
        time_decode(**engine, o, vocab, rng, spread, nullptr, true), with_lora.total() / kBytesPerSecond);
    // The serve run's lifecycle (requests finishing and replaced, their prompts in mixed steps) without its
    // HTTP side: whether the ~0.6 ms its decode steps spend above the first row comes from the lifecycle.
    if (o.steady_steps > 0 && o.prefill > 0) {
      char steady_what[96];
      std::snprintf(steady_what, sizeof steady_what, "decode step, steady state (%d+%d-token requests)", o.prefill,
                    o.steady_output);
      row(steady_what, time_steady(**engine, o, vocab, rng, spread), with_lora.total() / kBytesPerSecond);
    }
    // The serve run with prefix caching keeps every finished prompt's pages cached, so new sequences take
    // pages ever further into the pool (ids up to ~6700 after the yardstick's 48 requests); here 6000 low
    // pages are held first: the same batch, its KV ~100 MB further into each layer's cache.
    std::vector<int32_t> held;
    const int free_pages = (*engine)->scheduler().pages().num_free();
    if (free_pages >= 6000 + o.batch * ((o.context + o.steps + 64) / 16 + 2) &&
        (*engine)->scheduler().pages().allocate(6000, &held)) {
      row("decode step, adapters spread, pages past 6000 held ones",
          time_decode(**engine, o, vocab, rng, spread), with_lora.total() / kBytesPerSecond);
      (*engine)->scheduler().pages().release(held);
    } else {
      std::printf("(row with 6000 held KV pages skipped: %d free pages; --gpu-memory-utilization 0.9 sizes the pool "
                  "as loramux serve does)\n", free_pages);
    }
  }
  const double prefill_floor = prefill_flops(c, o.prefill) / kFlopsPerSecond;
  char prefill_what[64];
  std::snprintf(prefill_what, sizeof prefill_what, "prefill of one %d-token prompt", o.prefill);
  if (o.prefill > 0) {
    row(prefill_what, time_prefill(**engine, o, vocab, rng), prefill_floor);
    cuda::set_attention_one_barrier(false);  // before/after of the flash K/V loop's one barrier a tile
    row("same, attention with two barriers a K/V tile", time_prefill(**engine, o, vocab, rng), prefill_floor);
    cuda::set_attention_one_barrier(true);
    if (!o.moe_stream_k) {
      cuda::set_moe_gemm_stream_k(true);  // after: the MoE GEMMs' partial last round cut along k (off by default)
      row("same, MoE GEMMs with a stream-K tail", time_prefill(**engine, o, vocab, rng), prefill_floor);
      cuda::set_moe_gemm_stream_k(false);
    }
    if (o.attention_wgmma) {
      cuda::set_attention_wgmma(false);  // before/after of the 128-row tiles by warpgroup MMAs
      row("same, attention tiles by mma.sync", time_prefill(**engine, o, vocab, rng), prefill_floor);
      cuda::set_attention_wgmma(true);
    }
    cuda_backend.set_fuse_rope_kv_write(false);  // before/after of the fused rope + KV-cache write (+ QK-norm)
    row("same, rope, kv_write (and a QK-norm) unfused", time_prefill(**engine, o, vocab, rng), prefill_floor);
    cuda_backend.set_fuse_rope_kv_write(true);
    cuda_backend.set_split_row_align(128);  // o_proj 2880 as two products (see the decode row)
    row("same, products split at multiples of 128 rows", time_prefill(**engine, o, vocab, rng), prefill_floor);
    cuda_backend.set_split_row_align(64);
    // Before/after of the default (kAuto: the persistent warp-specialized kernel where both operands come by
    // TMA): the MoE GEMMs of 64/128-row tiles all on the ring kernel.
    cuda::set_moe_gemm_kernel(cuda::MoeGemmKernel::kWgmma);
    row("same, MoE GEMMs on the ring kernel", time_prefill(**engine, o, vocab, rng), prefill_floor);
    cuda::set_moe_gemm_kernel(cuda::MoeGemmKernel::kAuto);
    cuda::set_moe_gemm_multicast(true);  // the persistent kernel in CTA pairs sharing each A tile (off by default)
    row("same, persistent MoE GEMM with multicast A", time_prefill(**engine, o, vocab, rng), prefill_floor);
    cuda::set_moe_gemm_multicast(false);
    // The 128-row MoE GEMMs' BLOCK_N (default by width: 192 where it divides n, as GPT-OSS-20B's 5760 and
    // 2880; else gate_up 128, down 256). Before: gate_up 128, down 256; and other widths.
    cuda::set_moe_gemm_large_block_n(128);
    cuda::set_moe_block_down_block_n(256);
    row("same, gate_up GEMM at BLOCK_N 128, down 256 (before run 91)", time_prefill(**engine, o, vocab, rng),
        prefill_floor);
    cuda::set_moe_gemm_large_block_n(256);
    row("same, gate_up and down GEMMs at BLOCK_N 256", time_prefill(**engine, o, vocab, rng), prefill_floor);
    cuda::set_moe_block_down_block_n(128);
    cuda::set_moe_gemm_large_block_n(128);
    row("same, gate_up and down GEMMs at BLOCK_N 128", time_prefill(**engine, o, vocab, rng), prefill_floor);
    cuda::set_moe_gemm_large_block_n(0);
    cuda::set_moe_block_down_block_n(0);
    cuda::set_moe_gemm_compact_epilogue(false);  // before: the per-column general epilogue everywhere
    row("same, general GEMM epilogue", time_prefill(**engine, o, vocab, rng), prefill_floor);
    cuda::set_moe_gemm_compact_epilogue(true);
    cuda::set_moe_block_a_in_tile_order(false);  // before: gate_up writes a by pair, down gathers it again
    row("same, MoE a by pair and gathered for down", time_prefill(**engine, o, vocab, rng), prefill_floor);
    cuda::set_moe_block_a_in_tile_order(true);
    if (o.adapters > 0) {  // what a served prompt with an adapter costs (LoRA on every target)
      row("same prompt with an adapter", time_prefill(**engine, o, vocab, rng, nullptr, "a0"), prefill_floor);
      cuda_backend.set_dense_lora_runs(false);  // before/after of the prompt's dense LoRA as cuBLASLt products
      row("same, dense LoRA by the grouped kernels", time_prefill(**engine, o, vocab, rng, nullptr, "a0"),
          prefill_floor);
      cuda_backend.set_dense_lora_runs(true);
      if (!o.moe_lora_wgmma) {
        cuda::set_moe_lora_gemm_wgmma(true);  // after: each tile's main slot by warpgroup MMAs
        row("same, MoE-LoRA main slot by warpgroup MMAs", time_prefill(**engine, o, vocab, rng, nullptr, "a0"),
            prefill_floor);
        cuda::set_moe_lora_gemm_wgmma(false);
      }
      cuda::set_moe_lora_shrink_runs_split(false);  // before: the runs at the tuned config's split
      row("same, run-mode MoE-LoRA shrink at the config's split", time_prefill(**engine, o, vocab, rng, nullptr, "a0"),
          prefill_floor);
      cuda::set_moe_lora_shrink_runs_split(true);
      cuda::set_moe_lora_shrink_runs_hint(false);  // before: the shrink's own size rule (a tile per CTA here)
      row("same, MoE-LoRA shrink by its own size rule", time_prefill(**engine, o, vocab, rng, nullptr, "a0"),
          prefill_floor);
      cuda::set_moe_lora_shrink_runs_hint(true);
      cuda::set_moe_lora_l1_prefetch(false);  // before: add_lora_terms' inputs from L2 after each item's k-loop
      row("same, MoE-LoRA inputs not prefetched into L1", time_prefill(**engine, o, vocab, rng, nullptr, "a0"),
          prefill_floor);
      cuda::set_moe_lora_l1_prefetch(true);
      // Before/after of the gate_up MoE-LoRA folded into the fused activation (off by default: slower).
      cuda::set_moe_lora_in_epilogue(true);
      row("same, MoE-LoRA folded into the activation", time_prefill(**engine, o, vocab, rng, nullptr, "a0"),
          prefill_floor);
      cuda::set_moe_lora_in_epilogue(false);
      // Before/after of the MoE-LoRA in the persistent GEMMs' accumulators (the default for a prompt's long
      // run of one adapter): the expand kernels instead.
      cuda::set_moe_lora_in_gemm(cuda::MoeLoraInGemm::kOff);
      row("same, MoE-LoRA by the expand kernels", time_prefill(**engine, o, vocab, rng, nullptr, "a0"),
          prefill_floor);
      cuda::set_moe_lora_in_gemm(cuda::MoeLoraInGemm::kLongRuns);
      char mixed_what[96];
      std::snprintf(mixed_what, sizeof mixed_what, "mixed step: the prompt with an adapter + %d decoding", o.batch - 1);
      row(mixed_what, time_mixed(**engine, o, vocab, rng, spread), prefill_floor);
      cuda_backend.set_dense_lora_runs(false);  // the prompt's dense LoRA by the grouped kernels with the rest
      row("same, dense LoRA by the grouped kernels", time_mixed(**engine, o, vocab, rng, spread), prefill_floor);
      cuda_backend.set_dense_lora_runs(true);
      cuda::set_moe_block_a_in_tile_order(false);
      row("same, MoE a by pair and gathered for down", time_mixed(**engine, o, vocab, rng, spread), prefill_floor);
      cuda::set_moe_block_a_in_tile_order(true);
      cuda::set_moe_lora_shrink_runs_hint(false);  // before: the shrink's own size rule (a tile per CTA here)
      row("same, MoE-LoRA shrink by its own size rule", time_mixed(**engine, o, vocab, rng, spread), prefill_floor);
      cuda::set_moe_lora_shrink_runs_hint(true);
      cuda::set_moe_lora_shrink_runs_split(false);
      row("same, run-mode MoE-LoRA shrink at the config's split", time_mixed(**engine, o, vocab, rng, spread),
          prefill_floor);
      cuda::set_moe_lora_shrink_runs_split(true);
      if (!o.moe_stream_k) {
        cuda::set_moe_gemm_stream_k(true);
        row("same, MoE GEMMs with a stream-K tail", time_mixed(**engine, o, vocab, rng, spread), prefill_floor);
        cuda::set_moe_gemm_stream_k(false);
      }
      if (!o.moe_lora_wgmma) {
        cuda::set_moe_lora_gemm_wgmma(true);  // after: each tile's main slot by warpgroup MMAs
        row("same, MoE-LoRA main slot by warpgroup MMAs", time_mixed(**engine, o, vocab, rng, spread), prefill_floor);
        cuda::set_moe_lora_gemm_wgmma(false);
      }
      cuda::set_moe_lora_l1_prefetch(false);  // before: add_lora_terms' inputs from L2 after each item's k-loop
      row("same, MoE-LoRA inputs not prefetched into L1", time_mixed(**engine, o, vocab, rng, spread), prefill_floor);
      cuda::set_moe_lora_l1_prefetch(true);
      // Where a mixed step's extra time goes: the MoE-LoRA in the GEMMs' accumulators with each slot's rows
      // at a warp boundary (the default since run 106), without that (kAlways: the decode tokens' adapters
      // share warps with the prompt's), by the expand kernels (the default of runs 65–105), or the decoding
      // sequences themselves.
      cuda::set_moe_lora_in_gemm(cuda::MoeLoraInGemm::kAlways);
      row("same, MoE-LoRA in the GEMM accumulators, slots sharing warps", time_mixed(**engine, o, vocab, rng, spread),
          prefill_floor);
      cuda::set_moe_lora_in_gemm(cuda::MoeLoraInGemm::kOff);
      row("same, MoE-LoRA by the expand kernels", time_mixed(**engine, o, vocab, rng, spread), prefill_floor);
      cuda::set_moe_lora_in_gemm(cuda::MoeLoraInGemm::kLongRuns);
      const int prompt_index = o.batch - 1;
      const auto prompt_only = [&](int i) { return i == prompt_index ? spread(i) : std::string(); };
      row("same, the decoding sequences without adapters", time_mixed(**engine, o, vocab, rng, prompt_only),
          prefill_floor);
      row("same, no adapter anywhere", time_mixed(**engine, o, vocab, rng, [](int) { return std::string(); }),
          prefill_floor);
    }
  }
  if (o.profile && o.adapters > 0) {
    std::printf("profile: decode step, adapters spread over the batch\n");
    backend.enable(true);
    time_decode(**engine, o, vocab, rng, spread, &backend);
    std::printf("profile: decode step, LoRA on, no adapter in the batch\n");  // where the adapters' cost goes
    time_decode(**engine, o, vocab, rng, no_adapter, &backend);
    if (o.prefill > 0) {
      std::printf("profile: %s\n", prefill_what);
      time_prefill(**engine, o, vocab, rng, &backend);
      std::printf("profile: %s with an adapter\n", prefill_what);
      time_prefill(**engine, o, vocab, rng, &backend, "a0");
      std::printf("profile: mixed step (the prompt with an adapter + %d decoding)\n", o.batch - 1);
      time_mixed(**engine, o, vocab, rng, spread, &backend);
    }
    backend.enable(false);
  }
  // LoRA disabled: with no adapter resident the slot stacks are undefined and the forward launches no
  // LoRA kernel at all (the slot memory stays allocated; it is not read).
  for (int a = 0; a < o.adapters; ++a) (void)(*engine)->remove_adapter("a" + std::to_string(a));
  row("decode step, LoRA disabled (no adapter resident)", time_decode(**engine, o, vocab, rng, no_adapter),
      base.total() / kBytesPerSecond);
  return 0;
}
