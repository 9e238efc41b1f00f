// Parity of the CUDA base MoE (backends/cuda/moe_gemm.cuh): moe_block against CpuBackend::moe over T up to
// 1024, E up to 128, K up to 8, small H/I that are not multiples of the tiles, both activations and layouts,
// biases on/off, with and without MoE-LoRA (mixed ranks, rank-0 slot, NaN rank padding, tokens without a
// slot), plus GPT-OSS-20B and Qwen3-30B-A3B shapes at small T. Untouched experts' weights hold NaN (a tile
// that reads the wrong expert fails). The entry points are checked one by one against double loops at
// every tile configuration (BLOCK_M 16 / 64 × BLOCK_N 64 / 128, BLOCK_M 128); the fused activation must equal gate_up(h) + moe_activation bit for bit, and a batch
// without adapter tokens must give moe_block's base result bit for bit.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "backends/cuda/moe_align.cuh"
#include "backends/cuda/moe_gemm.cuh"
#include "cuda_test_util.h"
#include "model/mxfp4.h"
#include "ops/lora.h"
#include "ops/moe.h"

namespace lmx::test {
namespace {

class CudaMoeGemm : public CudaTest {};

// docs/NUMERICS.md, "base MoE": moe_block keeps h, a and d in bf16 between its kernels (three or four
// roundings, the activation's slope amplifying the one of h) where the oracle stays fp32.
constexpr double kTolMoeBlock = 1.0 / 32.0;

// moe_block (BF16, host) against the fp32 CPU oracle: every element within 2 · kTolMoeBlock, and at most one
// in 20000 (at least one) beyond kTolMoeBlock. The expand path rounds h to bf16 before adding the LoRA
// delta, and the activation's slope can carry one flipped ulp of h into a single output past 1/32 (seen:
// scaled error 0.0316 and 0.0341, one element of 76800–139264, on two of many random seeds; perf-log run
// 75). A wrong slot, rank or tile moves whole rows, far beyond either bound.
::testing::AssertionResult close_to_oracle(const Tensor& got, const Tensor& want) {
  const ::testing::AssertionResult bound = all_close(got, want, 2.0 * kTolMoeBlock);
  if (!bound) return bound;
  const ::testing::AssertionResult tight = all_close(got, want, kTolMoeBlock);
  if (tight) return tight;
  const float* w = want.ptr<float>();
  double sum_squares = 0.0;
  for (int64_t i = 0; i < want.numel(); ++i) sum_squares += double(w[i]) * w[i];
  const double rms = want.numel() ? std::sqrt(sum_squares / double(want.numel())) : 0.0;
  int64_t beyond = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double err = std::abs(double(bf16_to_f32(got.ptr<bf16>()[i])) - w[i]);
    beyond += err > kTolMoeBlock * (std::abs(double(w[i])) + rms) ? 1 : 0;
  }
  const int64_t allowed = std::max<int64_t>(1, got.numel() / 20000);
  if (beyond <= allowed) return ::testing::AssertionSuccess() << beyond << " outlier(s) within 2x tol";
  return ::testing::AssertionFailure() << beyond << " elements beyond tol (at most " << allowed << " allowed): "
                                       << tight.message();
}
// The fused activation rounds h to bf16 before act (as the unfused path stores it), then rounds a.
constexpr double kTolActivated = 1.0 / 64.0;

const bf16 kNan = f32_to_bf16(std::numeric_limits<float>::quiet_NaN());

// Uniform values of variance scale² (cheap enough for the GPT-OSS-sized weights), as bf16.
void fill_random(Rng& rng, bf16* dst, int64_t n, float scale) {
  const float half_width = scale * std::sqrt(3.0f);
  for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(rng.uniform(-half_width, half_width));
}

// Per-expert weights [E, rows, cols]: random for the experts in `touched`, NaN for the others.
OwnedTensor expert_weights(Rng& rng, int64_t experts, int64_t rows, int64_t cols, float scale,
                           const std::vector<bool>& touched) {
  OwnedTensor t = OwnedTensor::host(DType::BF16, {experts, rows, cols});
  for (int64_t e = 0; e < experts; ++e) {
    bf16* w = t.view.ptr<bf16>() + e * rows * cols;
    if (touched[e]) {
      fill_random(rng, w, rows * cols, scale);
    } else {
      std::fill(w, w + rows * cols, kNan);
    }
  }
  return t;
}

// Routing of T tokens: K distinct experts each, weights in [0.1, 1); `touched` marks the experts used.
struct Routing {
  OwnedTensor ids, weights;  // [T, K] i32, [T, K] f32
  std::vector<bool> touched;
};
Routing make_routing(Rng& rng, int64_t tokens, int64_t top_k, int64_t experts) {
  Routing r{OwnedTensor::host(DType::I32, {tokens, top_k}), OwnedTensor::host(DType::F32, {tokens, top_k}),
            std::vector<bool>(size_t(experts), false)};
  for (int64_t t = 0; t < tokens; ++t) {
    OwnedTensor ids = distinct_ids(rng, top_k, int32_t(experts));
    for (int64_t k = 0; k < top_k; ++k) {
      const int32_t e = ids.view.ptr<int32_t>()[k];
      r.ids.view.ptr<int32_t>()[t * top_k + k] = e;
      r.weights.view.ptr<float>()[t * top_k + k] = rng.uniform(0.1f, 1.0f);
      r.touched[e] = true;
    }
  }
  return r;
}

// A MoE LoRA stack a [S, E, R, in], b [S, E, out, R] with ranks: slot 0 rank 0, then R, R - 3, 8, random;
// padding ranks hold NaN (must never be read).
struct Stack {
  OwnedTensor a, b, rank;
  ops::LoraStack view() const { return {.a = a, .b = b, .rank = rank}; }
};
Stack make_stack(Rng& rng, int64_t slots, int64_t experts, int64_t capacity, int64_t in, int64_t out) {
  Stack s{OwnedTensor::host(DType::BF16, {slots, experts, capacity, in}),
          OwnedTensor::host(DType::BF16, {slots, experts, out, capacity}), OwnedTensor::host(DType::I32, {slots})};
  for (int64_t slot = 0; slot < slots; ++slot) {
    const int32_t choices[] = {int32_t(capacity), int32_t(capacity - 3), 8,
                               1 + int32_t(rng.next_u64() % uint64_t(capacity))};
    s.rank.view.ptr<int32_t>()[slot] = slot == 0 ? 0 : choices[slot % 4];
  }
  fill_random(rng, s.a.view.ptr<bf16>(), s.a.view.numel(), 1.0f / std::sqrt(float(in)));
  fill_random(rng, s.b.view.ptr<bf16>(), s.b.view.numel(), 0.5f / std::sqrt(float(capacity)));
  for (int64_t m = 0; m < slots * experts; ++m) {
    const int32_t r_true = s.rank.view.ptr<int32_t>()[m / experts];
    for (int64_t r = r_true; r < capacity; ++r) {
      for (int64_t i = 0; i < in; ++i) s.a.view.ptr<bf16>()[(m * capacity + r) * in + i] = kNan;
      for (int64_t o = 0; o < out; ++o) s.b.view.ptr<bf16>()[(m * out + o) * capacity + r] = kNan;
    }
  }
  return s;
}

struct BlockCase {
  int64_t tokens, experts, top_k, hidden, inter;
  ops::MoeActivation activation;
  ops::GateUpLayout layout;
  bool biases;
  int64_t slots = 0;  // 0: no MoE-LoRA
  int64_t rank_gate_up = 0, rank_down = 0;  // stack capacities R (0: that stack absent)
};

std::string describe(const BlockCase& c) {
  return "T " + std::to_string(c.tokens) + " E " + std::to_string(c.experts) + " K " + std::to_string(c.top_k) +
         " H " + std::to_string(c.hidden) + " I " + std::to_string(c.inter) +
         (c.activation == ops::MoeActivation::kSiluGated ? " silu" : " gpt-oss") +
         (c.layout == ops::GateUpLayout::kHalves ? " halves" : " interleaved") + (c.biases ? " biases" : "") +
         " S " + std::to_string(c.slots) + " R " + std::to_string(c.rank_gate_up) + "/" + std::to_string(c.rank_down);
}

// The host inputs of one moe_block case, their device copies, and the device output.
struct BlockData {
  Routing routing;
  OwnedTensor x, token_slot, gate_up, gate_up_bias, down, down_bias;
  Stack lora_gate_up, lora_down;
  // device
  OwnedTensor d_x, d_ids, d_weights, d_slot, d_gate_up, d_gate_up_bias, d_down, d_down_bias;
  OwnedTensor d_gu_a, d_gu_b, d_gu_rank, d_down_a, d_down_b, d_down_rank;
};

BlockData make_block_data(Rng& rng, const BlockCase& c) {
  BlockData b;
  b.routing = make_routing(rng, c.tokens, c.top_k, c.experts);
  b.x = random_bf16(rng, {c.tokens, c.hidden});
  // Scales keep h ~ N(0, 4): GPT-OSS's limit 7 clamps a few values, silu sees both tails.
  b.gate_up = expert_weights(rng, c.experts, 2 * c.inter, c.hidden, 2.0f / std::sqrt(float(c.hidden)),
                             b.routing.touched);
  b.down = expert_weights(rng, c.experts, c.hidden, c.inter, 1.0f / std::sqrt(float(c.inter)), b.routing.touched);
  b.d_x = cuda::upload(b.x);
  b.d_ids = cuda::upload(b.routing.ids);
  b.d_weights = cuda::upload(b.routing.weights);
  b.d_gate_up = cuda::upload(b.gate_up);
  b.d_down = cuda::upload(b.down);
  if (c.biases) {
    b.gate_up_bias = random_bf16(rng, {c.experts, 2 * c.inter}, 0.5f);
    b.down_bias = random_bf16(rng, {c.experts, c.hidden}, 0.5f);
    b.d_gate_up_bias = cuda::upload(b.gate_up_bias);
    b.d_down_bias = cuda::upload(b.down_bias);
  }
  if (c.slots > 0) {
    b.token_slot = random_ids(rng, c.tokens, -1, int32_t(c.slots));
    b.d_slot = cuda::upload(b.token_slot);
    if (c.rank_gate_up > 0) {
      b.lora_gate_up = make_stack(rng, c.slots, c.experts, c.rank_gate_up, c.hidden, 2 * c.inter);
      b.d_gu_a = cuda::upload(b.lora_gate_up.a);
      b.d_gu_b = cuda::upload(b.lora_gate_up.b);
      b.d_gu_rank = cuda::upload(b.lora_gate_up.rank);
    }
    if (c.rank_down > 0) {
      b.lora_down = make_stack(rng, c.slots, c.experts, c.rank_down, c.inter, c.hidden);
      b.d_down_a = cuda::upload(b.lora_down.a);
      b.d_down_b = cuda::upload(b.lora_down.b);
      b.d_down_rank = cuda::upload(b.lora_down.rank);
    }
  }
  return b;
}

cuda::MoeWorkspaceShape workspace_shape(const BlockCase& c) {
  return {.max_tokens = c.tokens, .top_k = c.top_k, .experts = c.experts, .slots = c.slots, .hidden = c.hidden,
          .inter = c.inter, .max_rank = std::max(c.rank_gate_up, c.rank_down)};
}

// moe_block on the device data into a fresh poisoned [T, H] output; with_lora = false drops the stacks.
// scattered: MoeParams::lora_scattered_tokens (-1: unknown, so the default mode keeps the expand kernels).
// mxfp4 (optional): MoeParams::gate_up_mxfp4 / down_mxfp4.
struct Mxfp4Copies {
  ops::Mxfp4Weight gate_up, down;
};
OwnedTensor run_block(const BlockCase& c, const BlockData& b, bool with_lora, cudaStream_t stream,
                      int64_t scattered = -1, const cuda::MoeBlockConfig& config = {},
                      const Mxfp4Copies* mxfp4 = nullptr) {
  OwnedTensor out = poisoned(DType::BF16, {c.tokens, c.hidden});
  const cuda::MoeWorkspaceShape shape = workspace_shape(c);
  OwnedTensor memory = cuda::empty(DType::U8, {int64_t(cuda::moe_workspace_bytes(shape))});
  cuda::fill_bytes(memory.view, 0xff);
  const cuda::MoeWorkspace workspace{.shape = shape, .memory = memory};
  cuda::moe_workspace_prepare(workspace, stream);
  ops::MoeParams p{.x = b.d_x, .topk_ids = b.d_ids, .topk_weights = b.d_weights, .token_slot = b.d_slot,
                   .gate_up = b.d_gate_up, .gate_up_bias = b.d_gate_up_bias, .down = b.d_down,
                   .down_bias = b.d_down_bias, .activation = c.activation, .layout = c.layout,
                   .swiglu_alpha = 1.702f, .swiglu_limit = 7.0f, .out = out, .lora_scattered_tokens = scattered};
  if (with_lora) {
    if (c.rank_gate_up > 0) p.lora_gate_up = {.a = b.d_gu_a, .b = b.d_gu_b, .rank = b.d_gu_rank};
    if (c.rank_down > 0) p.lora_down = {.a = b.d_down_a, .b = b.d_down_b, .rank = b.d_down_rank};
  }
  if (mxfp4 != nullptr) {
    p.gate_up_mxfp4 = mxfp4->gate_up;
    p.down_mxfp4 = mxfp4->down;
  }
  EXPECT_TRUE(ops::check(p).ok()) << ops::check(p).message();
  // A side stream and its events as CudaBackend passes them (the forked decode MoE-LoRA shrinks), unless given.
  cuda::MoeBlockConfig forked = config;
  if (forked.side_stream == nullptr) {
    static const auto side = [] {
      struct Side {
        cudaStream_t stream;
        cudaEvent_t fork, join;
      } s{};
      EXPECT_EQ(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking), cudaSuccess);
      EXPECT_EQ(cudaEventCreateWithFlags(&s.fork, cudaEventDisableTiming), cudaSuccess);
      EXPECT_EQ(cudaEventCreateWithFlags(&s.join, cudaEventDisableTiming), cudaSuccess);
      return s;
    }();
    forked.side_stream = side.stream;
    forked.fork = side.fork;
    forked.join = side.join;
  }
  cuda::moe_block(p, workspace, stream, forked);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  OwnedTensor first = cuda::download(out);
  // Again on the same workspace: the MoE-LoRA scratch cleaned itself, so the result is the same up to the
  // order of the split-K shrink's fp32 atomic adds. That order can flip the bf16 rounding of an h element,
  // and the down product carries the flip into the output (seen: 5 ulps at 1.3, scaled error 0.0098), so
  // the bound is 1/64; a z left over from the first run would double the LoRA term, far outside it.
  cuda::fill_bytes(out.view, 0xff);
  cuda::moe_block(p, workspace, stream, forked);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_TRUE(all_close(cuda::download(out), widen(first), 1.0 / 64.0))
      << "second moe_block on the same workspace differs";
  return first;
}

// Every `stride`-th row of a host tensor [T] or [T, n] (a MoE layer's tokens are independent of each other).
OwnedTensor every_nth_row(const Tensor& t, int64_t stride) {
  const int64_t rows = (t.dim(0) + stride - 1) / stride;
  const size_t row_bytes = t.nbytes() / size_t(t.dim(0));
  if (t.ndim > 2) throw std::invalid_argument("every_nth_row: " + t.shape_str() + ", expected [T] or [T, n]");
  OwnedTensor out = t.ndim == 1 ? OwnedTensor::host(t.dtype, {rows}) : OwnedTensor::host(t.dtype, {rows, t.dim(1)});
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(static_cast<char*>(out.view.data) + size_t(r) * row_bytes,
                static_cast<const char*>(t.data) + size_t(r * stride) * row_bytes, row_bytes);
  }
  return out;
}

// The fp32 CPU oracle of moe_block on every `stride`-th token (1: all of them; more checks layers too large
// for the full oracle, GPT-OSS-20B shapes at thousands of tokens, and still sees every kernel's tiles).
OwnedTensor cpu_block(cpu::CpuBackend& cpu, const BlockCase& c, const BlockData& b, int64_t stride = 1) {
  const OwnedTensor x = widen(every_nth_row(b.x, stride));
  const OwnedTensor ids = every_nth_row(b.routing.ids, stride), weights = every_nth_row(b.routing.weights, stride);
  OwnedTensor slot;
  if (c.slots > 0) slot = every_nth_row(b.token_slot, stride);
  OwnedTensor out = OwnedTensor::host(DType::F32, {x.view.dim(0), c.hidden});
  ops::MoeParams p{.x = x, .topk_ids = ids, .topk_weights = weights, .token_slot = slot,
                   .gate_up = b.gate_up, .gate_up_bias = b.gate_up_bias, .down = b.down,
                   .down_bias = b.down_bias, .activation = c.activation, .layout = c.layout,
                   .swiglu_alpha = 1.702f, .swiglu_limit = 7.0f, .out = out};
  if (c.slots > 0 && c.rank_gate_up > 0) p.lora_gate_up = b.lora_gate_up.view();
  if (c.slots > 0 && c.rank_down > 0) p.lora_down = b.lora_down.view();
  cpu.moe(p);
  return out;
}

using ops::GateUpLayout;
using ops::MoeActivation;
constexpr MoeActivation kSilu = MoeActivation::kSiluGated, kGptOss = MoeActivation::kGptOssClamped;
constexpr GateUpLayout kHalves = GateUpLayout::kHalves, kInterleaved = GateUpLayout::kInterleaved;

// The wgmma kernel (BLOCK_M 64/128, the default) against the mma.sync kernel on prefill-sized layers too
// large for the CPU oracle (GPT-OSS-20B at 1600 tokens): the same products in another accumulation order.
TEST_F(CudaMoeGemm, WgmmaMatchesMmaSync) {
  const std::vector<BlockCase> cases = {{640, 32, 4, 2880, 2880, kGptOss, kInterleaved, true},   // BLOCK_M 64
                                        {1600, 32, 4, 2880, 2880, kGptOss, kInterleaved, true},  // 128
                                        {4096, 16, 4, 2880, 1024, kSilu, kHalves, true, 8, 32, 32},  // 128
                                        {4096, 128, 8, 2048, 768, kSilu, kHalves, false}};  // Qwen3-30B-A3B, 128
  for (const BlockCase& c : cases) {
    SCOPED_TRACE(describe(c));
    const BlockData b = make_block_data(rng(), c);
    cuda::set_moe_gemm_kernel(cuda::MoeGemmKernel::kMmaSync);
    const OwnedTensor mma = run_block(c, b, true, stream_);
    for (cuda::MoeGemmKernel kernel : {cuda::MoeGemmKernel::kWgmma, cuda::MoeGemmKernel::kWgmmaWarpSpecialized,
                                       cuda::MoeGemmKernel::kAuto}) {
      SCOPED_TRACE(kernel == cuda::MoeGemmKernel::kWgmma                  ? "wgmma ring"
                   : kernel == cuda::MoeGemmKernel::kWgmmaWarpSpecialized ? "wgmma warp-specialized"
                                                                          : "auto (persistent where both by TMA)");
      cuda::set_moe_gemm_kernel(kernel);
      const OwnedTensor wgmma = run_block(c, b, true, stream_);
      EXPECT_TRUE(all_close(wgmma, widen(mma), 1.0 / 64.0));
    }
    cuda::set_moe_gemm_kernel(cuda::MoeGemmKernel::kAuto);
    // The default kernel with 128 × 256 tiles, and with the general epilogue for every work item (the
    // compact forms are bit-identical to it: same arithmetic per element).
    const OwnedTensor compact = run_block(c, b, true, stream_);
    // 128-row tiles at each BLOCK_N built (the default picks by width: 192 where n divides, else 128 for
    // gate_up and 256 for down; down without LoRA terms 240 where that divides too: the T 1600 case here),
    // gate_up and moe_block's down in turn (240: down only)
    for (int block_n : {128, 192, 240, 256}) {
      if (block_n != 240) {
        cuda::set_moe_gemm_large_block_n(block_n);
        EXPECT_TRUE(all_close(run_block(c, b, true, stream_), widen(mma), 1.0 / 64.0)) << "BLOCK_N " << block_n;
        cuda::set_moe_gemm_large_block_n(0);
      }
      cuda::set_moe_block_down_block_n(block_n);
      EXPECT_TRUE(all_close(run_block(c, b, true, stream_), widen(mma), 1.0 / 64.0)) << "down at BLOCK_N " << block_n;
      cuda::set_moe_block_down_block_n(0);
    }
    // The fused halves layout (no LoRA) by the 4-D tensor map on the persistent kernel (the default) and by the
    // ring's row-by-row loads
    if (c.layout == kHalves && c.slots == 0) {
      cuda::set_moe_gemm_halves_by_tma(false);
      EXPECT_TRUE(all_close(run_block(c, b, true, stream_), widen(compact), 1.0 / 64.0)) << "halves on the ring";
      cuda::set_moe_gemm_halves_by_tma(true);
    }
    cuda::set_moe_gemm_compact_epilogue(false);
    EXPECT_TRUE(bitwise_equal(run_block(c, b, true, stream_), compact)) << "general epilogue vs compact";
    cuda::set_moe_gemm_compact_epilogue(true);
    // gate_up's a written in tile order for down (the default) or by pair and gathered again: the same bits.
    cuda::set_moe_block_a_in_tile_order(false);
    EXPECT_TRUE(bitwise_equal(run_block(c, b, true, stream_), compact)) << "a by pair and gathered vs in tile order";
    cuda::set_moe_block_a_in_tile_order(true);
    // The MoE-LoRA in the persistent GEMMs' accumulators (MoeGemmLora) at both down widths. Its d rounds
    // to bf16 once (acc + LoRA + bias) where the reference rounds acc + bias and then the expand's sum:
    // the two differ by one ulp of d in a share of the elements, and |d| reaches 16 where the output is
    // small (seen: 134 of 11.8 M elements beyond 1/64, worst scaled error 0.028; and one element at 0.0317,
    // perf-log run 110), so the bound against the reference is the oracle's (close_to_oracle: 1/32, with
    // at most one element in 20000 up to 1/16), and every 64th token is checked against the CPU oracle too.
    // With the halves layout the gate_up term goes into the accumulators only with set_moe_gemm_lora_halves (the
    // default; down always): both forms.
    for (const bool lora_halves : {false, true}) {
      if (c.slots == 0 || (lora_halves && c.layout != kHalves)) continue;
      SCOPED_TRACE(lora_halves ? "gate_up's LoRA in the halves layout's accumulators too" : "");
      cuda::set_moe_gemm_lora_halves(lora_halves);
      const OwnedTensor want = cpu_block(cpu_, c, b, 64);
      EXPECT_TRUE(close_to_oracle(every_nth_row(mma.view, 64), want)) << "reference vs the CPU oracle";
      cuda::set_moe_lora_in_gemm(cuda::MoeLoraInGemm::kAlways);
      for (const auto& [gate_up_n, down_n] : {std::pair{128, 256}, std::pair{128, 128}, std::pair{192, 192}}) {
        SCOPED_TRACE("LoRA in the GEMM, gate_up at BLOCK_N " + std::to_string(gate_up_n) + ", down at " +
                     std::to_string(down_n));
        cuda::set_moe_gemm_large_block_n(gate_up_n);
        cuda::set_moe_block_down_block_n(down_n);
        const OwnedTensor got = run_block(c, b, true, stream_);
        EXPECT_TRUE(close_to_oracle(got, widen(mma))) << "vs the expand path";
        EXPECT_TRUE(close_to_oracle(every_nth_row(got.view, 64), want)) << "vs the CPU oracle";
        cuda::set_moe_block_a_in_tile_order(false);  // the down shrink reads a by pair instead of via pair_rows
        EXPECT_TRUE(bitwise_equal(run_block(c, b, true, stream_), got)) << "a by pair vs in tile order";
        cuda::set_moe_block_a_in_tile_order(true);
        cuda::set_moe_lora_l1_prefetch(false);  // hints only
        EXPECT_TRUE(bitwise_equal(run_block(c, b, true, stream_), got)) << "without vs with the L1 prefetch";
        cuda::set_moe_lora_l1_prefetch(true);
      }
      cuda::set_moe_block_down_block_n(0);
      cuda::set_moe_gemm_large_block_n(0);
      cuda::set_moe_lora_in_gemm(cuda::MoeLoraInGemm::kLongRuns);
      cuda::set_moe_gemm_lora_halves(true);  // the default
    }
  }
}

TEST_F(CudaMoeGemm, BlockMatchesCpu) {
  const std::vector<BlockCase> cases = {
      {1, 8, 1, 64, 64, kSilu, kHalves, false},
      {1, 8, 4, 200, 136, kGptOss, kInterleaved, true, 3, 16, 8},
      {3, 8, 2, 200, 136, kGptOss, kInterleaved, true, 3, 16, 8},
      {16, 32, 4, 320, 96, kSilu, kHalves, true, 4, 32, 32},
      {16, 32, 4, 320, 96, kGptOss, kHalves, false},
      {64, 128, 8, 128, 64, kSilu, kInterleaved, false},
      {64, 8, 8, 96, 64, kSilu, kHalves, false, 2, 8, 8},          // every expert, BLOCK_M 64
      {257, 8, 2, 200, 320, kGptOss, kHalves, true, 2, 16, 64},    // BLOCK_M 64, LoRA on both
      {257, 128, 4, 72, 104, kSilu, kInterleaved, true, 5, 0, 24},  // down LoRA only
      {1024, 32, 4, 256, 192, kSilu, kHalves, true},
      {1024, 8, 1, 64, 72, kGptOss, kInterleaved, false, 8, 64, 16},
      {1024, 8, 2, 136, 200, kSilu, kHalves, true, 3, 16, 16},  // 256 pairs per expert: BLOCK_M 128
      {2, 32, 4, 2880, 2880, kGptOss, kInterleaved, true, 2, 32, 32},  // GPT-OSS-20B
      {3, 128, 8, 2048, 768, kSilu, kHalves, false},                   // Qwen3-30B-A3B
      // wgmma tiles with K a multiple of 64 (BLOCK_M 64: 64 pairs per expert; BLOCK_M 128: 256, 300)
      {256, 8, 2, 2880, 2880, kGptOss, kInterleaved, true},
      {1024, 4, 1, 512, 256, kSilu, kHalves, false},
      {600, 8, 4, 128, 192, kSilu, kHalves, true, 2, 16, 16},
      {200, 4, 2, 192, 320, kGptOss, kHalves, true, 3, 8, 32},
      // BLOCK_M 128 (256 pairs per expert), interleaved, whole 128-column blocks: the persistent kernel's
      // fused epilogue forms, with the LoRA fold its kFusedDelta form
      {2048, 8, 1, 128, 256, kGptOss, kInterleaved, true, 3, 16, 16},
  };
  for (const BlockCase& c : cases) {
    SCOPED_TRACE(describe(c));
    const BlockData b = make_block_data(rng(), c);
    const OwnedTensor want = cpu_block(cpu_, c, b);
    // The MoE-LoRA by the expand kernels: the tiled gate_up LoRA added into h, and folded into the fused
    // activation; the direct path's (decode sizes) into h.
    cuda::set_moe_lora_in_gemm(cuda::MoeLoraInGemm::kOff);
    for (bool fold : {false, true}) {
      if (fold && (c.slots == 0 || c.rank_gate_up == 0)) continue;
      SCOPED_TRACE(fold ? "LoRA folded into the activation" : "LoRA added into h");
      cuda::set_moe_lora_in_epilogue(fold);
      const OwnedTensor got = run_block(c, b, true, stream_);
      EXPECT_TRUE(close_to_oracle(got, want));
    }
    cuda::set_moe_lora_in_epilogue(false);
    cuda::set_moe_lora_in_gemm(cuda::MoeLoraInGemm::kLongRuns);
    for (int block_n : {128, 192, 256}) {  // 128-row tiles at each width (the other BLOCK_M: unchanged)
      cuda::set_moe_gemm_large_block_n(block_n);
      EXPECT_TRUE(close_to_oracle(run_block(c, b, true, stream_), want)) << "BLOCK_N " << block_n << " at BLOCK_M 128";
    }
    cuda::set_moe_gemm_large_block_n(0);
    // down at 240 columns (forced on every width, partial last blocks included; with the LoRA by the expand
    // kernels, since 240 is built without LoRA terms in the accumulators)
    cuda::set_moe_lora_in_gemm(cuda::MoeLoraInGemm::kOff);
    cuda::set_moe_block_down_block_n(240);
    EXPECT_TRUE(close_to_oracle(run_block(c, b, true, stream_), want)) << "down at BLOCK_N 240";
    cuda::set_moe_block_down_block_n(0);
    // The LoRA in the GEMMs' accumulators where moe_block can add it there (the decode GEMM at 16-row tiles
    // of the direct path, the persistent kernel at 64/128; others: the expand kernels).
    cuda::set_moe_lora_in_gemm(cuda::MoeLoraInGemm::kAlways);
    EXPECT_TRUE(close_to_oracle(run_block(c, b, true, stream_), want)) << "LoRA in the GEMM accumulators";
    EXPECT_TRUE(close_to_oracle(run_block(c, b, true, stream_, -1, {.decode_lora_overlap = false}), want))
        << "LoRA in the GEMM accumulators, decode GEMMs waiting for their shrinks first";
    cuda::set_moe_gemm_early_trigger(true);  // the overlapped decode GEMMs let their dependents launch at their start
    EXPECT_TRUE(close_to_oracle(run_block(c, b, true, stream_), want))
        << "LoRA in the GEMM accumulators, decode GEMMs triggering their dependents early";
    cuda::set_moe_gemm_early_trigger(false);
    // gate_up's LoRA for the halves layout by the expand kernels instead of the accumulators (set_moe_gemm_lora_halves
    // off; on is the default, run above; 128-row tiles only, elsewhere the same paths as above)
    if (c.layout == kHalves && c.slots > 0) {
      cuda::set_moe_gemm_lora_halves(false);
      EXPECT_TRUE(close_to_oracle(run_block(c, b, true, stream_), want))
          << "LoRA in the accumulators, halves by expands";
      cuda::set_moe_lora_in_gemm(cuda::MoeLoraInGemm::kLongRuns);
      EXPECT_TRUE(close_to_oracle(run_block(c, b, true, stream_, 0), want)) << "halves by expands, one-adapter runs";
      cuda::set_moe_gemm_lora_halves(true);  // the default
    }
    // The default (kLongRuns) with the batch's hint on both sides of its threshold.
    cuda::set_moe_lora_in_gemm(cuda::MoeLoraInGemm::kLongRuns);
    for (int64_t scattered : {int64_t(0), c.tokens / 8, c.tokens}) {  // T / 8: warp-aligned slot groups at 128 rows
      EXPECT_TRUE(close_to_oracle(run_block(c, b, true, stream_, scattered), want)) << scattered << " scattered";
      if (scattered == 0) {  // run mode at the tuned config's split (default: its own, moe_lora_run_split)
        cuda::set_moe_lora_shrink_runs_split(false);
        EXPECT_TRUE(close_to_oracle(run_block(c, b, true, stream_, scattered), want)) << "runs at the config's split";
        cuda::set_moe_lora_shrink_runs_split(true);
      }
    }
  }
}

// Which path moe_block's MoE-LoRA takes by mode and the batch's hint (the shapes' own conditions aside).
// The decode GEMMs on MXFP4 copies (MoeParams::gate_up_mxfp4 / down_mxfp4; BLOCK_M 16, where the mean expert
// has fewer than 32 pairs). The experts are generated in the decode layout and dequantized into the bf16
// weights, so both paths multiply the same values in the same k order: the results must agree bit for bit
// without MoE-LoRA, and with it where one shrink CTA covers `in` (H and I <= 256). Wider shrinks split `in`
// over CTAs that add into z with fp32 atomics, in an order that changes from run to run (two runs of the bf16
// path differ too: run 118 on the H200, GPT-OSS-20B shape): there the two paths agree within 1/64 relative.
// Every built CTA shape (set_moe_gemm_mxfp4_shape) gives the same result. In the MXFP4 run the bf16 weights
// are NaN (it must read none of them), and the oracle checks the values themselves. Also the switch set_moe_gemm_mxfp4(false): back to the bf16 weights.
TEST_F(CudaMoeGemm, Mxfp4DecodeMatchesBf16Bitwise) {
  struct Mxfp4Case {
    BlockCase c;
    int scale_gate_up, scale_down;  // the generated exponents' low end (weights ~2/√H and ~1/√I)
  };
  const Mxfp4Case cases[] = {
      {{1, 8, 4, 256, 192, kGptOss, kInterleaved, true, 4, 16, 8}, 122, 121},
      {{3, 8, 4, 256, 192, kGptOss, kInterleaved, false}, 122, 121},
      {{16, 8, 4, 256, 192, kGptOss, kInterleaved, true, 5, 32, 32}, 122, 121},
      {{40, 8, 4, 320, 128, kSilu, kInterleaved, true, 3, 16, 16}, 122, 121},  // column blocks past n
      {{16, 32, 4, 2880, 2880, kGptOss, kInterleaved, true, 8, 32, 32}, 120, 119},  // GPT-OSS-20B
  };
  Rng& rng = this->rng();
  for (const Mxfp4Case& mc : cases) {
    const BlockCase& c = mc.c;
    SCOPED_TRACE(describe(c));
    ASSERT_LT(c.tokens * c.top_k / c.experts, 32) << "not a BLOCK_M 16 case";
    BlockData b = make_block_data(rng, c);
    model::Mxfp4Decode gu = model::generate_mxfp4_decode(c.experts, 2 * c.inter, c.hidden, rng.next_u64(), mc.scale_gate_up);
    model::Mxfp4Decode dn = model::generate_mxfp4_decode(c.experts, c.hidden, c.inter, rng.next_u64(), mc.scale_down);
    auto gu_bf16 = model::dequantize_mxfp4_decode(gu.blocks, gu.scales, "gate_up");
    auto dn_bf16 = model::dequantize_mxfp4_decode(dn.blocks, dn.scales, "down");
    ASSERT_TRUE(gu_bf16.ok() && dn_bf16.ok());
    b.gate_up = *gu_bf16;
    b.down = *dn_bf16;
    b.d_gate_up = cuda::upload(b.gate_up);
    b.d_down = cuda::upload(b.down);
    const OwnedTensor d_gu_blocks = cuda::upload(gu.blocks), d_gu_scales = cuda::upload(gu.scales);
    const OwnedTensor d_dn_blocks = cuda::upload(dn.blocks), d_dn_scales = cuda::upload(dn.scales);
    const Mxfp4Copies copies{.gate_up = {.blocks = d_gu_blocks, .scales = d_gu_scales},
                             .down = {.blocks = d_dn_blocks, .scales = d_dn_scales}};
    for (bool with_lora : {false, true}) {
      if (with_lora && c.slots == 0) continue;
      SCOPED_TRACE(with_lora ? "with LoRA" : "without LoRA");
      const OwnedTensor bf16_path = run_block(c, b, with_lora, stream_);
      BlockData nan_weights = b;  // the bf16 experts poisoned: the MXFP4 run must not read them
      nan_weights.d_gate_up = cuda::empty(DType::BF16, {c.experts, 2 * c.inter, c.hidden});
      nan_weights.d_down = cuda::empty(DType::BF16, {c.experts, c.hidden, c.inter});
      cuda::fill_bytes(nan_weights.d_gate_up.view, 0xff);
      cuda::fill_bytes(nan_weights.d_down.view, 0xff);
      const bool exact = !with_lora || std::max(c.hidden, c.inter) <= 256;
      auto same_as_bf16 = [&](const OwnedTensor& got) -> ::testing::AssertionResult {
        if (!exact) return all_close(got, widen(bf16_path), 1.0 / 64.0);
        if (std::memcmp(got.view.data, bf16_path.view.data, bf16_path.view.nbytes()) == 0) {
          return ::testing::AssertionSuccess();
        }
        return ::testing::AssertionFailure() << "not bit for bit the bf16 path's result";
      };
      cuda::set_moe_lora_in_mxfp4_gemm(true);  // the LoRA in the accumulators, as on the bf16 path
      const OwnedTensor mxfp4_path = run_block(c, nan_weights, with_lora, stream_, -1, {}, &copies);
      ASSERT_TRUE(same_as_bf16(mxfp4_path)) << "the MXFP4 decode GEMM differs from the bf16 one";
      cuda::set_moe_gemm_early_trigger(true);  // the same result when the overlapped GEMMs trigger early
      const OwnedTensor early = run_block(c, nan_weights, with_lora, stream_, -1, {}, &copies);
      cuda::set_moe_gemm_early_trigger(false);
      EXPECT_TRUE(same_as_bf16(early)) << "the MXFP4 decode GEMM with an early trigger";
      cuda::set_moe_lora_in_mxfp4_gemm(false);
      for (const auto& [block_n, stages, ctas] :
           {std::tuple{128, 4, 6}, std::tuple{128, 8, 4}, std::tuple{128, 6, 5}, std::tuple{128, 5, 6}, std::tuple{128, 4, 8},
            std::tuple{128, 3, 8}, std::tuple{64, 12, 4}, std::tuple{64, 6, 8}}) {
        cuda::set_moe_gemm_mxfp4_shape(block_n, stages, ctas);  // the bench's other CTA shapes: the same result
        cuda::set_moe_lora_in_mxfp4_gemm(true);
        const OwnedTensor shaped = run_block(c, nan_weights, with_lora, stream_, -1, {}, &copies);
        cuda::set_moe_lora_in_mxfp4_gemm(false);
        EXPECT_TRUE(same_as_bf16(shaped)) << block_n << " columns x " << stages << " stages @ " << ctas;
      }
      // The weight spans by bulk copies (set_moe_mxfp4_weight_by_bulk): the copies' bits, with the LoRA in the
      // GEMM (so the bf16 path's) and by the expands (the default on MXFP4).
      for (const auto& [block_n, stages, ctas] : {std::tuple{64, 8, 6}, std::tuple{128, 4, 6}, std::tuple{64, 12, 4}}) {
        cuda::set_moe_gemm_mxfp4_shape(block_n, stages, ctas);
        for (const bool in_gemm : {true, false}) {
          cuda::set_moe_lora_in_mxfp4_gemm(in_gemm);
          const OwnedTensor by_copies = run_block(c, nan_weights, with_lora, stream_, -1, {}, &copies);
          cuda::set_moe_mxfp4_weight_by_bulk(true);
          const OwnedTensor bulk = run_block(c, nan_weights, with_lora, stream_, -1, {}, &copies);
          cuda::set_moe_mxfp4_weight_by_bulk(false);
          const std::string what = std::to_string(block_n) + " columns x " + std::to_string(stages) +
                                   " stages, LoRA " + (in_gemm ? "in the GEMM" : "by the expands");
          // (not exact: the expand path's shrink adds 3+ pieces into z by atomics, in any order)
          EXPECT_TRUE(exact ? bitwise_equal(bulk, by_copies) : all_close(bulk, widen(by_copies), 1.0 / 64.0))
              << "bulk copies, " << what;
          if (in_gemm) {
            EXPECT_TRUE(same_as_bf16(bulk)) << "bulk copies, " << what;
          }
        }
      }
      cuda::set_moe_lora_in_mxfp4_gemm(false);
      cuda::set_moe_gemm_mxfp4_shape(64, 8);
      if (with_lora) {  // the default on MXFP4: the LoRA by the expand kernels, h unfused; so on both paths
        cuda::set_moe_lora_in_gemm(cuda::MoeLoraInGemm::kOff);
        const OwnedTensor bf16_expand = run_block(c, b, true, stream_);
        cuda::set_moe_lora_in_gemm(cuda::MoeLoraInGemm::kLongRuns);
        const OwnedTensor mxfp4_expand = run_block(c, nan_weights, true, stream_, -1, {}, &copies);
        if (exact) {
          EXPECT_EQ(std::memcmp(mxfp4_expand.view.data, bf16_expand.view.data, bf16_expand.view.nbytes()), 0)
              << "MXFP4 with the LoRA by the expand kernels";
        } else {
          EXPECT_TRUE(all_close(mxfp4_expand, widen(bf16_expand), 1.0 / 64.0)) << "MXFP4 with the LoRA by the expand kernels";
        }
        cuda::set_moe_lora_fork_shrinks(false);  // before (perf-log run 133): GEMM, shrink, expand in the chain
        const OwnedTensor chained = run_block(c, nan_weights, true, stream_, -1, {}, &copies);
        cuda::set_moe_lora_fork_shrinks(true);
        if (exact) {
          EXPECT_EQ(std::memcmp(chained.view.data, mxfp4_expand.view.data, mxfp4_expand.view.nbytes()), 0)
              << "the forked shrinks give other bits than the chained ones";
        } else {
          EXPECT_TRUE(all_close(chained, widen(mxfp4_expand), 1.0 / 64.0)) << "the forked shrinks against the chained ones";
        }
        // The default since perf-log run 149: the expands on the side stream beside their GEMMs, their terms
        // added by the activation and the combine (mxfp4_expand, bf16_expand). Off (set_moe_lora_side_expands:
        // each expand after the join, adding into the GEMM's output): the same bits, MXFP4 and bf16
        // (run_block runs each twice on one workspace, so a term left in the scratch would show as a doubled LoRA).
        cuda::set_moe_lora_side_expands(false);
        const OwnedTensor joined = run_block(c, nan_weights, true, stream_, -1, {}, &copies);
        cuda::set_moe_lora_in_gemm(cuda::MoeLoraInGemm::kOff);
        const OwnedTensor bf16_joined = run_block(c, b, true, stream_);
        cuda::set_moe_lora_in_gemm(cuda::MoeLoraInGemm::kLongRuns);
        cuda::set_moe_lora_side_expands(true);
        for (const auto& [got, what] : {std::pair{&joined, "MXFP4, expands after the join"},
                                        std::pair{&bf16_joined, "bf16, expands after the join"}}) {
          if (exact) {
            EXPECT_EQ(std::memcmp(got->view.data, mxfp4_expand.view.data, mxfp4_expand.view.nbytes()), 0) << what;
          } else {
            EXPECT_TRUE(all_close(*got, widen(mxfp4_expand), 1.0 / 64.0)) << what;
          }
        }
      }
      cpu::CpuBackend cpu;
      BlockCase oracle_case = c;
      if (!with_lora) oracle_case.slots = 0;
      const int64_t stride = c.hidden >= 2048 ? 4 : 1;
      const OwnedTensor want = cpu_block(cpu, oracle_case, b, stride);
      EXPECT_TRUE(close_to_oracle(every_nth_row(mxfp4_path, stride), want));
      const OwnedTensor mxfp4_default = run_block(c, nan_weights, with_lora, stream_, -1, {}, &copies);
      EXPECT_TRUE(close_to_oracle(every_nth_row(mxfp4_default, stride), want)) << "the default LoRA path on MXFP4";
      // Switched off, moe_block ignores the copies and reads the bf16 weights: the bf16 path's bits.
      cuda::set_moe_gemm_mxfp4(false);
      const OwnedTensor switched_off = run_block(c, b, with_lora, stream_, -1, {}, &copies);
      cuda::set_moe_gemm_mxfp4(true);
      EXPECT_TRUE(same_as_bf16(switched_off)) << "switched off";
    }
  }
}

// moe_block's bf16 decode down GEMM at each of its stage counts (set_moe_block_down_decode_stages; 0, the
// default, = the kernel's 6): only the pipeline's depth changes, so the bits do not; and the oracle agrees.
TEST_F(CudaMoeGemm, DownDecodeStagesGiveTheSameBits) {
  for (const BlockCase& c : {BlockCase{16, 32, 4, 256, 192, kGptOss, kInterleaved, true},
                             BlockCase{5, 8, 2, 200, 136, kSilu, kHalves, false}}) {
    SCOPED_TRACE(describe(c));
    ASSERT_LT(c.tokens * c.top_k / c.experts, 32) << "not a BLOCK_M 16 case";
    const BlockData b = make_block_data(rng(), c);
    cuda::set_moe_block_down_decode_stages(0);
    const OwnedTensor six = run_block(c, b, false, stream_);  // the default
    EXPECT_TRUE(close_to_oracle(six, cpu_block(cpu_, c, b)));
    for (int stages : {4, 5, 6}) {
      cuda::set_moe_block_down_decode_stages(stages);
      EXPECT_TRUE(bitwise_equal(run_block(c, b, false, stream_), six)) << stages << " stages";
    }
  }
  cuda::set_moe_block_down_decode_stages(0);
}

// The decode GEMM variants' cases (BLOCK_M 16 tiles): `body(c, b, with_lora, base)` for each case with and
// without its MoE-LoRA, where base is moe_block's result with the default settings (checked against the CPU
// oracle here); `defaults` puts the variant's knobs back first.
// same_bits(c, with_lora, got, base): bit for bit, except where the MoE-LoRA's direct shrink splits a row's
// reduction into pieces (in > 256, 256 values a piece at the least) whose atomic adds into z land in any order
// (from 3 pieces on, that changes the last bits from run to run, perf-log run 216); there within 1/64 of base.
::testing::AssertionResult same_bits(const BlockCase& c, bool with_lora, const Tensor& got, const OwnedTensor& base) {
  if (!with_lora || std::max(c.hidden, c.inter) <= 256) return bitwise_equal(got, base);
  return all_close(got, widen(base), 1.0 / 64.0);
}
template <typename Defaults, typename Body>
void for_decode_cases(Rng& rng, cudaStream_t stream, cpu::CpuBackend& cpu, std::initializer_list<BlockCase> cases,
                      Defaults defaults, Body body) {
  for (const BlockCase& c : cases) {
    SCOPED_TRACE(describe(c));
    ASSERT_LT(c.tokens * c.top_k / c.experts, 32) << "not a BLOCK_M 16 case";
    const BlockData b = make_block_data(rng, c);
    for (const bool with_lora : {false, true}) {
      SCOPED_TRACE(with_lora ? "with the MoE-LoRA" : "without LoRA");
      defaults();
      const OwnedTensor base = run_block(c, b, with_lora, stream);
      BlockCase oracle_case = c;
      if (!with_lora) oracle_case.slots = 0;
      const int64_t stride = c.hidden >= 2048 ? 4 : 1;
      EXPECT_TRUE(close_to_oracle(every_nth_row(base, stride), cpu_block(cpu, oracle_case, b, stride)));
      body(c, b, with_lora, base);
    }
  }
  defaults();
}

// moe_block's bf16 decode GEMMs at BLOCK_N 128 (set_moe_block_decode_block_n): each output column's k-loop is
// the same at either width, so the bits match the default 64's, with and without the MoE-LoRA.
TEST_F(CudaMoeGemm, DecodeBlockNGivesTheSameBits) {
  for_decode_cases(
      rng(), stream_, cpu_,
      {BlockCase{16, 32, 4, 256, 192, kGptOss, kInterleaved, true, 4, 16, 16},
       BlockCase{5, 8, 2, 200, 136, kSilu, kHalves, false, 3, 8, 8},
       BlockCase{16, 32, 8, 512, 768, kSilu, kHalves, false, 2, 16, 16}},
      [] { cuda::set_moe_block_decode_block_n(0, 0); },
      [&](const BlockCase& c, const BlockData& b, bool with_lora, const OwnedTensor& base) {
        for (const auto& [gate_up, down] : {std::pair{128, 0}, std::pair{0, 128}, std::pair{128, 128}}) {
          cuda::set_moe_block_decode_block_n(gate_up, down);
          EXPECT_TRUE(same_bits(c, with_lora, run_block(c, b, with_lora, stream_), base))
              << "gate_up BLOCK_N " << gate_up << ", down " << down;
        }
      });
  EXPECT_THROW(cuda::set_moe_block_decode_block_n(256, 0), std::invalid_argument);
  EXPECT_THROW(cuda::set_moe_block_decode_block_n(0, 32), std::invalid_argument);
}

// moe_block's bf16 decode GEMMs with their weight tiles by TMA (set_moe_decode_weight_by_tma): the same stages
// land in the same swizzled places, so the bits match the cp.async copies' — both layouts (the halves through
// the 4-D map), k not a multiple of 64 (the box's zero fill), a partial last column block (rows of the next
// expert, never stored), every stage count, with and without the MoE-LoRA (the PDL wait modes).
TEST_F(CudaMoeGemm, DecodeWeightByTmaGivesTheSameBits) {
  // base: the weight by TMA (the default) at down's default stages
  for_decode_cases(
      rng(), stream_, cpu_,
      {BlockCase{16, 32, 4, 256, 192, kGptOss, kInterleaved, true, 4, 16, 16},
       BlockCase{5, 8, 2, 200, 136, kSilu, kHalves, false, 3, 8, 8},
       BlockCase{7, 8, 2, 200, 136, kGptOss, kInterleaved, true, 2, 8, 8},
       BlockCase{16, 32, 8, 512, 768, kSilu, kHalves, false, 2, 16, 16}},
      [] {
        cuda::set_moe_decode_weight_by_tma(true);
        cuda::set_moe_block_down_decode_stages(0);
      },
      [&](const BlockCase& c, const BlockData& b, bool with_lora, const OwnedTensor& base) {
        for (int stages : {4, 5}) {
          cuda::set_moe_block_down_decode_stages(stages);
          EXPECT_TRUE(same_bits(c, with_lora, run_block(c, b, with_lora, stream_), base))
              << "by TMA, down at stages " << stages;
        }
        cuda::set_moe_block_down_decode_stages(0);
        cuda::set_moe_decode_weight_by_tma(false);
        EXPECT_TRUE(same_bits(c, with_lora, run_block(c, b, with_lora, stream_), base)) << "by copies";
      });
}

TEST(CudaMoeLoraInGemm, ModeAndHintPickThePath) {
  using cuda::MoeLoraInGemm;
  constexpr int kLarge = cuda::kMoeGemmBlockMLarge, kPrefill = cuda::kMoeGemmBlockMPrefill;
  EXPECT_TRUE(cuda::moe_lora_in_gemm_for(MoeLoraInGemm::kLongRuns, 1600, 0, kLarge));
  EXPECT_TRUE(cuda::moe_lora_in_gemm_for(MoeLoraInGemm::kLongRuns, 1600, 6, kLarge));      // T / 256
  EXPECT_TRUE(cuda::moe_lora_in_gemm_for(MoeLoraInGemm::kLongRuns, 1600, 7, kLarge));
  EXPECT_TRUE(cuda::moe_lora_in_gemm_for(MoeLoraInGemm::kLongRuns, 1615, 15, kLarge));    // the yardstick's mixed step
  EXPECT_TRUE(cuda::moe_lora_in_gemm_for(MoeLoraInGemm::kLongRuns, 1600, 799, kLarge));
  EXPECT_TRUE(cuda::moe_lora_in_gemm_for(MoeLoraInGemm::kLongRuns, 1600, 800, kLarge));    // T / 2: interleaved
  EXPECT_TRUE(cuda::moe_lora_in_gemm_for(MoeLoraInGemm::kLongRuns, 4096, 4096, kLarge));
  EXPECT_FALSE(cuda::moe_lora_in_gemm_for(MoeLoraInGemm::kLongRuns, 256, 0, kPrefill));    // 64-row tiles
  EXPECT_FALSE(cuda::moe_lora_in_gemm_for(MoeLoraInGemm::kLongRuns, 256, 256, kPrefill));
  EXPECT_FALSE(cuda::moe_lora_in_gemm_for(MoeLoraInGemm::kLongRuns, 1600, -1, kLarge));    // unknown (a recording)
  EXPECT_TRUE(cuda::moe_lora_in_gemm_for(MoeLoraInGemm::kAlways, 16, -1, cuda::kMoeGemmBlockMDecode));
  // Decode: beside the GEMMs (the forked shrinks and side expands) since perf-log run 170, whatever the mix.
  EXPECT_FALSE(cuda::moe_lora_in_gemm_for(MoeLoraInGemm::kLongRuns, 16, -1, cuda::kMoeGemmBlockMDecode));
  EXPECT_FALSE(cuda::moe_lora_in_gemm_for(MoeLoraInGemm::kLongRuns, 64, 64, cuda::kMoeGemmBlockMDecode));
  EXPECT_FALSE(cuda::moe_lora_in_gemm_for(MoeLoraInGemm::kOff, 16, -1, cuda::kMoeGemmBlockMDecode));
  EXPECT_FALSE(cuda::moe_lora_in_gemm_for(MoeLoraInGemm::kOff, 1600, 0, kLarge));
  // Warp-aligned slot groups: only strictly between T / 256 and T / 2 scattered, at 128-row tiles, kLongRuns.
  EXPECT_FALSE(cuda::moe_lora_warp_groups_for(MoeLoraInGemm::kLongRuns, 1600, 6, kLarge));
  EXPECT_TRUE(cuda::moe_lora_warp_groups_for(MoeLoraInGemm::kLongRuns, 1600, 7, kLarge));
  EXPECT_TRUE(cuda::moe_lora_warp_groups_for(MoeLoraInGemm::kLongRuns, 1615, 15, kLarge));
  EXPECT_TRUE(cuda::moe_lora_warp_groups_for(MoeLoraInGemm::kLongRuns, 1600, 799, kLarge));
  EXPECT_FALSE(cuda::moe_lora_warp_groups_for(MoeLoraInGemm::kLongRuns, 1600, 800, kLarge));
  EXPECT_FALSE(cuda::moe_lora_warp_groups_for(MoeLoraInGemm::kLongRuns, 1600, -1, kLarge));
  EXPECT_FALSE(cuda::moe_lora_warp_groups_for(MoeLoraInGemm::kAlways, 1615, 15, kLarge));
  EXPECT_FALSE(cuda::moe_lora_warp_groups_for(MoeLoraInGemm::kLongRuns, 256, 10, kPrefill));
  // The tiled shrink in runs of a group's tiles: long runs dominate and hold >= 64 pairs a group (GPT-OSS-20B:
  // K 4, E 32, so >= 512 long-run tokens; Qwen3-30B-A3B: K 8, E 128, >= 1024).
  EXPECT_TRUE(cuda::moe_lora_shrink_runs_for(1600, 0, 4, 32));
  EXPECT_TRUE(cuda::moe_lora_shrink_runs_for(1615, 15, 4, 32));  // the yardstick's mixed step
  EXPECT_TRUE(cuda::moe_lora_shrink_runs_for(512, 0, 4, 32));
  EXPECT_FALSE(cuda::moe_lora_shrink_runs_for(511, 0, 4, 32));
  EXPECT_FALSE(cuda::moe_lora_shrink_runs_for(1600, 800, 4, 32));  // half the adapter tokens scattered
  EXPECT_FALSE(cuda::moe_lora_shrink_runs_for(1600, -1, 4, 32));   // unknown
  EXPECT_FALSE(cuda::moe_lora_shrink_runs_for(1023, 0, 8, 128));
  EXPECT_TRUE(cuda::moe_lora_shrink_runs_for(1024, 0, 8, 128));
  cuda::set_moe_lora_shrink_runs_hint(false);
  EXPECT_FALSE(cuda::moe_lora_shrink_runs_for(1600, 0, 4, 32));
  cuda::set_moe_lora_shrink_runs_hint(true);
}

// The persistent GEMMs' stream-K tail (set_moe_gemm_stream_k; off by default until the H200 measures it) at
// 128-row tiles: layers whose last round of work units is partial on an H200's grid and whose units split
// along k into pieces (32 and 45 k-tiles), or stay whole (8), at each tile width, with the LoRA in the
// accumulators and without it.
// Without LoRA two runs agree bit for bit: the pieces are summed in a fixed order whichever CTA finishes a
// unit (run_block's second moe_block on the same workspace also checks that the counters were left zero).
TEST_F(CudaMoeGemm, StreamKTailMatchesCpu) {
  struct Case {
    BlockCase c;
    int64_t stride;  // the oracle on every stride-th token (a MoE layer's tokens are independent)
  };
  const std::vector<Case> cases = {
      {{400, 8, 4, 2048, 2048, kGptOss, kInterleaved, true, 3, 16, 32}, 4},     // 200 pairs an expert, K 2048
      {{2048, 8, 1, 512, 512, kSilu, kInterleaved, false}, 8},                 // 256 pairs an expert: whole units
      {{1600, 32, 4, 2880, 2880, kGptOss, kInterleaved, true, 8, 32, 32}, 64},  // GPT-OSS-20B at T 1600
  };
  cuda::set_moe_gemm_stream_k(true);
  for (const Case& k : cases) {
    const BlockCase& c = k.c;
    SCOPED_TRACE(describe(c));
    const BlockData b = make_block_data(rng(), c);
    BlockCase base_case = c;
    base_case.slots = 0;
    const OwnedTensor want = cpu_block(cpu_, c, b, k.stride), want_base = cpu_block(cpu_, base_case, b, k.stride);
    for (int block_n : {0, 128, 192, 256}) {
      SCOPED_TRACE("BLOCK_N " + std::to_string(block_n) + " at BLOCK_M 128 (0: the default)");
      cuda::set_moe_gemm_large_block_n(block_n);
      EXPECT_TRUE(close_to_oracle(every_nth_row(run_block(c, b, true, stream_, 0), k.stride), want))
          << "LoRA in the accumulators";
      const OwnedTensor base = run_block(c, b, false, stream_);
      EXPECT_TRUE(close_to_oracle(every_nth_row(base, k.stride), want_base)) << "no LoRA";
      EXPECT_TRUE(bitwise_equal(run_block(c, b, false, stream_), base)) << "two runs without LoRA";
    }
    cuda::set_moe_gemm_large_block_n(0);
  }
  cuda::set_moe_gemm_stream_k(false);
}

// The fused gate_up epilogue by the producer warpgroup's idle warps (set_moe_gemm_epilogue_warps; the default since
// perf-log run 246): the same arithmetic per element as the consumers' kFused form, so moe_block's output is
// bit-identical with and without it, at both gate_up widths that take it, with gate_up's a in tile order (the
// default) and by pair, with and without the MoE-LoRA in the accumulators; items that do not take the stage (a
// partial last column block) stay with the consumers; down's store form through them too
// (set_moe_gemm_epilogue_down). GPT-OSS-20B and Qwen3-30B-A3B shapes, partial blocks, and one case against the
// CPU oracle. (Output rows that are not a multiple of 16 bytes cannot reach moe_block: moe_down needs I % 8 == 0.)
TEST_F(CudaMoeGemm, EpilogueWarpsMatchConsumerEpilogueBitwise) {
  const std::vector<BlockCase> cases = {
      {1600, 32, 4, 2880, 2880, kGptOss, kInterleaved, true},   // GPT-OSS-20B
      {4096, 128, 8, 2048, 768, kSilu, kHalves, false},         // Qwen3-30B-A3B
      {1024, 8, 2, 512, 1000, kSilu, kInterleaved, true},       // n 2000: a partial last column block
      {600, 8, 2, 256, 992, kGptOss, kInterleaved, true},       // n 1984: partial at 128 and 192
  };
  for (const BlockCase& c : cases) {
    SCOPED_TRACE(describe(c));
    const BlockData b = make_block_data(rng(), c);
    for (int block_n : {0, 128, 192}) {
      cuda::set_moe_gemm_large_block_n(block_n);
      for (bool tile_order : {true, false}) {
        SCOPED_TRACE("gate_up BLOCK_N " + std::to_string(block_n) + (tile_order ? ", a in tile order" : ", a by pair"));
        cuda::set_moe_block_a_in_tile_order(tile_order);
        cuda::set_moe_gemm_epilogue_warps(false);
        const OwnedTensor consumers = run_block(c, b, false, stream_);
        cuda::set_moe_gemm_epilogue_warps(true);
        const OwnedTensor staged = run_block(c, b, false, stream_);
        EXPECT_TRUE(bitwise_equal(staged, consumers));
      }
    }
    cuda::set_moe_block_a_in_tile_order(true);
    cuda::set_moe_gemm_large_block_n(0);
    // down through the epilogue warps too (set_moe_gemm_epilogue_down), against the consumers at the same width
    for (int down_n : {128, 192}) {
      cuda::set_moe_block_down_block_n(down_n);
      cuda::set_moe_gemm_epilogue_warps(false);
      const OwnedTensor consumers = run_block(c, b, false, stream_);
      cuda::set_moe_gemm_epilogue_warps(true);
      cuda::set_moe_gemm_epilogue_down(true);
      const OwnedTensor staged = run_block(c, b, false, stream_);
      cuda::set_moe_gemm_epilogue_down(false);
      EXPECT_TRUE(bitwise_equal(staged, consumers)) << "down at BLOCK_N " << down_n << " by the epilogue warps";
    }
    cuda::set_moe_block_down_block_n(0);
  }
  // With the MoE-LoRA in the accumulators (the path of a prompt with an adapter): bit-identical too, at both widths.
  // The shrink's split-K adds z's pieces by atomics, so z (and the output) differs run to run in its last bits
  // (perf-log run 249): these runs take the shrink unsplit (split_k 1, not the run mode's split), z stored once.
  // With the LoRA terms by the epilogue warps as well (set_moe_gemm_epilogue_lora), h is rounded twice where a
  // token has an adapter: against the CPU oracle, and tokens without one bit-identical to the consumers' result.
  cuda::set_moe_lora_in_gemm(cuda::MoeLoraInGemm::kAlways);
  cuda::set_moe_lora_shrink_runs_split(false);
  cuda::MoeBlockConfig one_piece;
  one_piece.lora.split_k = 1;
  struct LoraCase {
    BlockCase c;
    int64_t stride;  // the oracle on every stride-th token
  };
  for (const LoraCase& k : {LoraCase{{1600, 32, 4, 2880, 2880, kGptOss, kInterleaved, true, 8, 32, 32}, 64},
                            LoraCase{{400, 8, 4, 2048, 2048, kSilu, kInterleaved, false, 6, 32, 16}, 4}}) {
    const BlockCase& c = k.c;
    SCOPED_TRACE(describe(c) + ", LoRA in the accumulators");
    const BlockData b = make_block_data(rng(), c);
    const OwnedTensor want = cpu_block(cpu_, c, b, k.stride);
    for (int block_n : {0, 128, 192}) {
      SCOPED_TRACE("gate_up BLOCK_N " + std::to_string(block_n));
      cuda::set_moe_gemm_large_block_n(block_n);
      cuda::set_moe_gemm_lora_ktile(false);  // the LoRA form by the epilogue warps is not beside the k-tile
      cuda::set_moe_gemm_epilogue_warps(false);
      const OwnedTensor consumers = run_block(c, b, true, stream_, 0, one_piece);
      cuda::set_moe_gemm_epilogue_warps(true);
      const OwnedTensor staged = run_block(c, b, true, stream_, 0, one_piece);
      cuda::set_moe_gemm_epilogue_lora(true);
      const OwnedTensor by_warps = run_block(c, b, true, stream_, 0, one_piece);
      cuda::set_moe_gemm_epilogue_lora(false);
      cuda::set_moe_gemm_lora_ktile(true);  // the default
      EXPECT_TRUE(bitwise_equal(staged, consumers));
      EXPECT_TRUE(close_to_oracle(every_nth_row(by_warps.view, k.stride), want)) << "LoRA by the epilogue warps";
      int64_t base_rows = 0;
      for (int64_t t = 0; t < c.tokens; ++t) {
        if (b.token_slot.view.ptr<int32_t>()[t] >= 0) continue;
        ++base_rows;
        const size_t row_bytes = size_t(c.hidden) * 2;
        EXPECT_EQ(std::memcmp(static_cast<const char*>(by_warps.view.data) + size_t(t) * row_bytes,
                              static_cast<const char*>(consumers.view.data) + size_t(t) * row_bytes, row_bytes),
                  0)
            << "token " << t << " (no adapter), LoRA by the epilogue warps";
      }
      EXPECT_GT(base_rows, 0);  // the data mixes tokens without an adapter in
    }
    cuda::set_moe_gemm_large_block_n(0);
  }
  cuda::set_moe_lora_shrink_runs_split(true);  // the default
  cuda::set_moe_lora_in_gemm(cuda::MoeLoraInGemm::kLongRuns);
  const BlockCase c{1024, 8, 2, 512, 1000, kGptOss, kInterleaved, true};
  const BlockData b = make_block_data(rng(), c);
  const OwnedTensor want = cpu_block(cpu_, c, b, 16);
  EXPECT_TRUE(close_to_oracle(every_nth_row(run_block(c, b, false, stream_), 16), want)) << "against the CPU oracle";
}

// The main-slot MoE-LoRA tests' cases and token patterns (make_stack gives slot 4 the capacity R): every token
// on slot 4, the first half on it and the rest the data's random slots, the data's random slots; f(case, data,
// the CPU oracle on every stride-th token) for each.
struct MainSlotCase {
  BlockCase c;
  int64_t stride;  // the oracle on every stride-th token
};
template <typename F>
void for_each_main_slot_pattern(Rng& rng, cpu::CpuBackend& cpu, const std::vector<MainSlotCase>& cases, F&& f) {
  for (const MainSlotCase& k : cases) {
    BlockData b = make_block_data(rng, k.c);
    const std::vector<int32_t> random_slots(b.token_slot.view.ptr<int32_t>(),
                                            b.token_slot.view.ptr<int32_t>() + k.c.tokens);
    for (int pattern = 0; pattern < 3; ++pattern) {
      SCOPED_TRACE(describe(k.c) + (pattern == 0 ? " slot 4 everywhere" : pattern == 1 ? " half on slot 4" : " random slots"));
      for (int64_t t = 0; t < k.c.tokens; ++t) {
        const bool on_4 = pattern == 0 || (pattern == 1 && t < k.c.tokens / 2);
        b.token_slot.view.ptr<int32_t>()[t] = on_4 ? 4 : random_slots[size_t(t)];
      }
      b.d_slot = cuda::upload(b.token_slot);
      f(k, b, cpu_block(cpu, k.c, b, k.stride));
    }
  }
}
// moe_block with the MoE-LoRA against the oracle at each 128-row BLOCK_N and with the stream-K tail, the batch
// hinted as one long run (lora_scattered_tokens 0).
void expect_oracle_at_each_width(const MainSlotCase& k, const BlockData& b, const OwnedTensor& want,
                                 cudaStream_t stream) {
  for (int block_n : {128, 192, 256}) {
    cuda::set_moe_gemm_large_block_n(block_n);
    EXPECT_TRUE(close_to_oracle(every_nth_row(run_block(k.c, b, true, stream, 0), k.stride), want))
        << "BLOCK_N " << block_n;
  }
  cuda::set_moe_gemm_large_block_n(0);
  cuda::set_moe_gemm_stream_k(true);
  EXPECT_TRUE(close_to_oracle(every_nth_row(run_block(k.c, b, true, stream, 0), k.stride), want))
      << "with the stream-K tail";
  cuda::set_moe_gemm_stream_k(false);
}

// The MoE-LoRA's main slot by warpgroup MMAs from a TMA'd B slice (set_moe_lora_gemm_wgmma; off by default until
// the H200 measures it) at 128-row tiles, each BLOCK_N, the accumulator path forced. make_stack gives slot 4 the
// full capacity (16, 32 or 64: eligible) and NaN in every padding rank; three token patterns: every token on
// slot 4 (a prompt's run: every tile takes the pass), the first half on slot 4 and the rest random (tiles
// mixing the pass with add_lora_terms for other slots' rows), and the data's random slots (most tiles' main
// slot ineligible or absent). Once more with the stream-K tail (its pieces take add_lora_terms only).
TEST_F(CudaMoeGemm, LoraWgmmaMatchesCpu) {
  const std::vector<MainSlotCase> cases = {
      {{1600, 32, 4, 2880, 2880, kGptOss, kInterleaved, true, 8, 32, 32}, 64},  // GPT-OSS-20B at T 1600
      {{2048, 8, 1, 128, 256, kGptOss, kInterleaved, true, 6, 16, 64}, 1},      // R 16 and 64 (the whole box)
      {{400, 8, 4, 2048, 2048, kSilu, kInterleaved, false, 6, 32, 16}, 4},
  };
  cuda::set_moe_lora_in_gemm(cuda::MoeLoraInGemm::kAlways);
  cuda::set_moe_lora_gemm_wgmma(true);
  for_each_main_slot_pattern(rng(), cpu_, cases, [&](const MainSlotCase& k, const BlockData& b,
                                                      const OwnedTensor& want) {
    expect_oracle_at_each_width(k, b, want, stream_);
  });
  cuda::set_moe_lora_gemm_wgmma(false);
  cuda::set_moe_lora_in_gemm(cuda::MoeLoraInGemm::kLongRuns);
}

// set_moe_gemm_lora_ktile: each tile's main slot of full rank (slot 4 here: make_stack gives it the capacity R;
// slots 1 and 5 rank R - 3, slot 2 rank 8, slot 3 random) as one more k-tile of the persistent ring, the other
// slots' rows by add_lora_terms, against the oracle (on every stride-th token): one slot everywhere (every tile
// by the k-tile), half the tokens on it (tiles of mixed slots: the other rows by add_lora_terms), random slots
// (main slots of every rank: tiles without the k-tile); at each BLOCK_N, with the stream-K tail on (the form
// stands aside: whole units only), beside the epilogue warps' LoRA form (which stands aside too), with the
// consumers' epilogue, without the k-tile (its off form), and where R is 16 / 64 (the whole box) or not a
// multiple of 16 (no main slot: add_lora_terms alone).
TEST_F(CudaMoeGemm, LoraKtileMatchesCpu) {
  const std::vector<MainSlotCase> cases = {
      {{1600, 32, 4, 2880, 2880, kGptOss, kInterleaved, true, 8, 32, 32}, 64},  // GPT-OSS-20B at T 1600
      {{2048, 8, 1, 128, 256, kGptOss, kInterleaved, true, 6, 16, 64}, 1},      // R 16 and 64 (the whole box)
      {{400, 8, 4, 2048, 2048, kSilu, kInterleaved, false, 6, 32, 24}, 4},      // down's R 24: no main slot
  };
  cuda::set_moe_lora_in_gemm(cuda::MoeLoraInGemm::kAlways);
  for_each_main_slot_pattern(rng(), cpu_, cases, [&](const MainSlotCase& k, const BlockData& b,
                                                      const OwnedTensor& want) {
    cuda::set_moe_gemm_lora_ktile(true);
    expect_oracle_at_each_width(k, b, want, stream_);
    cuda::set_moe_gemm_epilogue_lora(true);  // beside the epilogue warps (the default) and their LoRA form
    EXPECT_TRUE(close_to_oracle(every_nth_row(run_block(k.c, b, true, stream_, 0), k.stride), want))
        << "beside the epilogue warps' LoRA form";
    cuda::set_moe_gemm_epilogue_lora(false);
    cuda::set_moe_gemm_epilogue_warps(false);
    EXPECT_TRUE(close_to_oracle(every_nth_row(run_block(k.c, b, true, stream_, 0), k.stride), want))
        << "with the consumers' epilogue";
    cuda::set_moe_gemm_epilogue_warps(true);  // the default
    cuda::set_moe_gemm_lora_ktile(false);  // and add_lora_terms for every row (the k-tile's off form)
    EXPECT_TRUE(close_to_oracle(every_nth_row(run_block(k.c, b, true, stream_, 0), k.stride), want))
        << "without the k-tile";
    cuda::set_moe_gemm_lora_ktile(true);  // the default
  });
  cuda::set_moe_lora_in_gemm(cuda::MoeLoraInGemm::kLongRuns);
}

// LoRA stacks present but no token with an adapter (all slots -1, or only the rank-0 slot 0): the output
// is bit-identical to moe_block without the stacks (fused path), so a base request does not depend on
// the other requests of its batch.
TEST_F(CudaMoeGemm, NoAdapterTokensGiveBaseResultBitwise) {
  for (int32_t only_slot : {-1, 0}) {
    for (const BlockCase& c : {BlockCase{16, 32, 4, 320, 96, kGptOss, kInterleaved, true, 4, 32, 16},
                               BlockCase{300, 8, 2, 200, 136, kSilu, kHalves, false, 3, 16, 16},
                               BlockCase{2048, 8, 1, 128, 256, kGptOss, kInterleaved, true, 3, 16, 16}}) {
      SCOPED_TRACE(describe(c) + " slot " + std::to_string(only_slot));
      BlockData b = make_block_data(rng(), c);
      for (int64_t t = 0; t < c.tokens; ++t) b.token_slot.view.ptr<int32_t>()[t] = only_slot;
      b.d_slot = cuda::upload(b.token_slot);
      const OwnedTensor base = run_block(c, b, false, stream_);
      cuda::set_moe_lora_in_gemm(cuda::MoeLoraInGemm::kOff);  // the expand kernels
      for (bool fold : {false, true}) {  // the LoRA added into h, or folded into the fused activation
        SCOPED_TRACE(fold ? "LoRA folded into the activation" : "LoRA added into h");
        cuda::set_moe_lora_in_epilogue(fold);
        EXPECT_TRUE(bitwise_equal(run_block(c, b, true, stream_), base));
      }
      cuda::set_moe_lora_in_epilogue(false);
      cuda::set_moe_lora_in_gemm(cuda::MoeLoraInGemm::kLongRuns);  // decode sizes: beside the GEMMs (run 170)
      EXPECT_TRUE(bitwise_equal(run_block(c, b, true, stream_), base)) << "the default rule";
      cuda::set_moe_lora_in_gemm(cuda::MoeLoraInGemm::kAlways);  // in the GEMMs' accumulators: no warp has a slot, nothing is added
      EXPECT_TRUE(bitwise_equal(run_block(c, b, true, stream_), base)) << "LoRA in the GEMM accumulators";
      cuda::set_moe_lora_in_gemm(cuda::MoeLoraInGemm::kLongRuns);
      EXPECT_TRUE(close_to_oracle(base, cpu_block(cpu_, c, b)));
    }
  }
}

// ---- entry points ------------------------------------------------------------------------------------

double act_ref(double gate, double up, MoeActivation activation) {
  if (activation == kSilu) return gate / (1.0 + std::exp(-gate)) * up;
  gate = std::min(gate, 7.0);
  up = std::clamp(up, -7.0, 7.0);
  return (up + 1.0) * gate / (1.0 + std::exp(-1.702 * gate));
}

// The expert tiles of a routing at one BLOCK_M (moe_align, slots = 0), kept alive with the view.
struct Tiles {
  OwnedTensor sorted, tile_group, offsets, count, scratch;
  cuda::MoeExpertTiles view;
};
Tiles align_by_expert(const Tensor& d_ids, int64_t pairs, int64_t experts, int block_m, cudaStream_t stream) {
  const int64_t capacity = cuda::moe_align_capacity(pairs, experts, block_m);
  Tiles t{poisoned(DType::I32, {capacity}), poisoned(DType::I32, {capacity / block_m}),
          poisoned(DType::I32, {experts + 1}), poisoned(DType::I32, {1}),
          cuda::empty(DType::U8, {int64_t(cuda::moe_align_workspace_bytes(pairs, experts))}), {}};
  cuda::moe_align({.topk_ids = d_ids, .experts = experts, .slots = 0, .block_m = block_m, .sorted_pairs = t.sorted,
                   .tile_group = t.tile_group, .group_offsets = t.offsets, .num_tiles = t.count,
                   .workspace = t.scratch},
                  stream);
  t.view = {.sorted_pairs = t.sorted, .tile_group = t.tile_group, .num_tiles = t.count, .block_m = block_m};
  return t;
}

struct GemmCase {
  int64_t tokens, experts, top_k, hidden, inter;
};

TEST_F(CudaMoeGemm, EntryPointsMatchReference) {
  // H, I, 2I not multiples of 64 / 128 (masked paths), and one case where everything divides (even-K path).
  const std::vector<GemmCase> cases = {{5, 8, 2, 72, 104}, {40, 4, 2, 128, 64}, {300, 16, 4, 200, 136},
                                       {1, 32, 4, 2880, 2880}};
  for (const GemmCase& c : cases) {
    const int64_t pairs = c.tokens * c.top_k, H = c.hidden, I = c.inter;
    Routing routing = make_routing(rng(), c.tokens, c.top_k, c.experts);
    OwnedTensor x = random_bf16(rng(), {c.tokens, H});
    OwnedTensor gate_up = expert_weights(rng(), c.experts, 2 * I, H, 2.0f / std::sqrt(float(H)), routing.touched);
    OwnedTensor down = expert_weights(rng(), c.experts, H, I, 1.0f / std::sqrt(float(I)), routing.touched);
    OwnedTensor gate_up_bias = random_bf16(rng(), {c.experts, 2 * I}, 0.5f);
    OwnedTensor down_bias = random_bf16(rng(), {c.experts, H}, 0.5f);
    OwnedTensor a_in = random_bf16(rng(), {pairs, I});
    OwnedTensor d_x = cuda::upload(x), d_ids = cuda::upload(routing.ids), d_gate_up = cuda::upload(gate_up);
    OwnedTensor d_down = cuda::upload(down), d_gu_bias = cuda::upload(gate_up_bias), d_d_bias = cuda::upload(down_bias);
    OwnedTensor d_a_in = cuda::upload(a_in);
    const int32_t* ids = routing.ids.view.ptr<int32_t>();

    for (bool biases : {false, true}) {
      // References in double: h[pair] (weight's row order) and d[pair] from a_in.
      std::vector<double> h_ref(size_t(pairs * 2 * I)), d_ref(size_t(pairs * H));
      for (int64_t pair = 0; pair < pairs; ++pair) {
        const int64_t e = ids[pair], t = pair / c.top_k;
        for (int64_t r = 0; r < 2 * I; ++r) {
          double sum = biases ? bf16_to_f32(gate_up_bias.view.ptr<bf16>()[e * 2 * I + r]) : 0.0;
          const bf16* w = gate_up.view.ptr<bf16>() + (e * 2 * I + r) * H;
          for (int64_t i = 0; i < H; ++i) sum += double(bf16_to_f32(w[i])) * bf16_to_f32(x.view.ptr<bf16>()[t * H + i]);
          h_ref[pair * 2 * I + r] = sum;
        }
        for (int64_t o = 0; o < H; ++o) {
          double sum = biases ? bf16_to_f32(down_bias.view.ptr<bf16>()[e * H + o]) : 0.0;
          const bf16* w = down.view.ptr<bf16>() + (e * H + o) * I;
          for (int64_t i = 0; i < I; ++i) sum += double(bf16_to_f32(w[i])) * bf16_to_f32(a_in.view.ptr<bf16>()[pair * I + i]);
          d_ref[pair * H + o] = sum;
        }
      }
      auto as_f32 = [](const std::vector<double>& v, int64_t rows, int64_t cols) {
        OwnedTensor t = OwnedTensor::host(DType::F32, {rows, cols});
        for (size_t i = 0; i < v.size(); ++i) t.view.ptr<float>()[i] = float(v[i]);
        return t;
      };
      const OwnedTensor want_h = as_f32(h_ref, pairs, 2 * I), want_d = as_f32(d_ref, pairs, H);

      // (BLOCK_M, BLOCK_N, kernel, CTA group): every kernel instantiation family — mma.sync at 16 and at
      // 64/128 (as chosen, or the ring's BLOCK_N 64); the wgmma ring at 64/128 (BLOCK_N 128, and
      // 256 at 128); the warp-specialized wgmma at 64/128 with BLOCK_N 128 and 256; the grouped CTA order
      // (groups of 3 tiles: a partial last group) on both wgmma kernels; BLOCK_M 16 with 4 and 5 stages; the
      // PDL code path of grouped_gemm_kernel (down with its tiles and first weights before the wait; here the
      // stream is idle at each launch, so this checks the math, the model tests check the chain).
      using cuda::MoeGemmKernel;
      constexpr MoeGemmKernel kMma = MoeGemmKernel::kMmaSync, kRing = MoeGemmKernel::kWgmma,
                              kWs = MoeGemmKernel::kWgmmaWarpSpecialized, kAuto = MoeGemmKernel::kAuto;
      // The last field: the persistent kernel at BLOCK_M 128 × BLOCK_N 128 in CTA pairs sharing the A tile by
      // multicast, or one CTA per work item (the default).
      for (const auto& [block_m, block_n, kernel, cta_group, stages, pdl, sorted, multicast] :
           std::vector<std::tuple<int, int, MoeGemmKernel, int, int, bool, bool, bool>>{
               {cuda::kMoeGemmBlockMDecode, 0, kRing, 0, 0, false, false, true},
               {cuda::kMoeGemmBlockMDecode, 128, kRing, 0, 0, false, false, true},
               {cuda::kMoeGemmBlockMDecode, 64, kRing, 0, 4, false, false, true},
               {cuda::kMoeGemmBlockMDecode, 64, kRing, 0, 5, false, false, true},
               {cuda::kMoeGemmBlockMDecode, 0, kRing, 0, 0, true, false, true},
               {cuda::kMoeGemmBlockMPrefill, 0, kMma, 0, 0, true, false, true},
               {cuda::kMoeGemmBlockMPrefill, 0, kWs, 0, 0, false, false, true},
               {cuda::kMoeGemmBlockMPrefill, 0, kWs, 0, 0, false, true, true},
               {cuda::kMoeGemmBlockMPrefill, 256, kWs, 3, 0, false, false, true},
               {cuda::kMoeGemmBlockMPrefill, 256, kWs, 3, 0, false, true, true},
               {cuda::kMoeGemmBlockMPrefill, 0, kRing, 0, 0, false, false, true},
               {cuda::kMoeGemmBlockMPrefill, 0, kRing, 3, 0, false, false, true},
               {cuda::kMoeGemmBlockMPrefill, 0, kMma, 0, 0, false, false, true},
               {cuda::kMoeGemmBlockMPrefill, 64, kRing, 0, 0, false, false, true},
               {cuda::kMoeGemmBlockMLarge, 0, kWs, 3, 0, false, false, true},
               {cuda::kMoeGemmBlockMLarge, 0, kWs, 3, 0, false, true, true},
               {cuda::kMoeGemmBlockMLarge, 256, kWs, 0, 0, false, false, true},
               {cuda::kMoeGemmBlockMLarge, 256, kWs, 0, 0, false, true, true},
               {cuda::kMoeGemmBlockMLarge, 192, kWs, 0, 0, false, false, true},
               {cuda::kMoeGemmBlockMLarge, 192, kWs, 3, 0, false, true, true},
               {cuda::kMoeGemmBlockMLarge, 0, kRing, 0, 0, false, false, true},
               {cuda::kMoeGemmBlockMLarge, 256, kRing, 3, 0, false, false, true},
               {cuda::kMoeGemmBlockMLarge, 0, kMma, 0, 0, false, false, true},
               // kAuto: persistent warp-specialized with the rows gathered (and the fused halves gate_up on
               // the ring), the ring without them
               {cuda::kMoeGemmBlockMPrefill, 0, kAuto, 3, 0, false, true, true},
               {cuda::kMoeGemmBlockMLarge, 0, kAuto, 3, 0, false, true, true},
               {cuda::kMoeGemmBlockMLarge, 0, kAuto, 0, 0, false, false, true},
               {cuda::kMoeGemmBlockMLarge, 0, kWs, 3, 0, false, true, false},
               {cuda::kMoeGemmBlockMLarge, 0, kAuto, 0, 0, false, true, false}}) {
        cuda::set_moe_gemm_kernel(kernel);
        cuda::set_moe_gemm_multicast(multicast);
        SCOPED_TRACE("T " + std::to_string(c.tokens) + " E " + std::to_string(c.experts) + " K " +
                     std::to_string(c.top_k) + " H " + std::to_string(H) + " I " + std::to_string(I) + " BLOCK_M " +
                     std::to_string(block_m) + " BLOCK_N " + std::to_string(block_n) + (biases ? " biases" : "") +
                     (kernel == kMma    ? " mma.sync"
                      : kernel == kRing ? " wgmma ring"
                      : kernel == kWs   ? " wgmma warp-specialized"
                                        : " auto") +
                     " CTA group " + std::to_string(cta_group) + " decode stages " + std::to_string(stages) +
                     (pdl ? " pdl" : "") + (sorted ? " A rows gathered for TMA" : "") +
                     (multicast ? " multicast A" : ""));
        const Tiles tiles = align_by_expert(d_ids, pairs, c.experts, block_m, stream_);
        // Scratch of the gathered A rows (warp-specialized kernel), poisoned: every row the GEMM reads must
        // have been written by the gather.
        const int64_t capacity = tiles.view.sorted_pairs.dim(0);
        // The persistent kernel runs here (a in tile order: MoeGateUpParams::pair_rows, a_in_tile_order).
        const bool persistent = sorted && block_m != cuda::kMoeGemmBlockMDecode && (kernel == kAuto || kernel == kWs);
        sync();
        const OwnedTensor sorted_host = cuda::download(tiles.sorted), count_host = cuda::download(tiles.count);
        const int64_t tile_rows = int64_t(count_host.view.ptr<int32_t>()[0]) * block_m;
        const int32_t* sorted_pairs = sorted_host.view.ptr<int32_t>();
        OwnedTensor sorted_x = poisoned(DType::BF16, {sorted ? capacity : 1, H});
        OwnedTensor sorted_a = poisoned(DType::BF16, {sorted ? capacity : 1, I});
        const Tensor sorted_x_view = sorted ? sorted_x.view : Tensor(), sorted_a_view = sorted ? sorted_a.view : Tensor();
        const Tensor gu_bias = biases ? d_gu_bias.view : Tensor(), dn_bias = biases ? d_d_bias.view : Tensor();
        // gate_up, pre-activation h
        OwnedTensor h = poisoned(DType::BF16, {pairs, 2 * I});
        cuda::moe_gate_up({.x = d_x, .weight = d_gate_up, .bias = gu_bias, .top_k = c.top_k, .tiles = tiles.view,
                           .h = h, .cta_group = cta_group, .block_n = block_n, .decode_stages = stages, .pdl = pdl,
                           .sorted_rows = sorted_x_view},
                          stream_);
        sync();
        const OwnedTensor got_h = cuda::download(h);
        EXPECT_TRUE(all_close(got_h, want_h, kTolBf16Out)) << "h";
        // moe_activation and the fused activation, every activation × layout
        for (MoeActivation activation : {kSilu, kGptOss}) {
          for (GateUpLayout layout : {kHalves, kInterleaved}) {
            SCOPED_TRACE(std::string(activation == kSilu ? "silu" : "gpt-oss") +
                         (layout == kHalves ? " halves" : " interleaved"));
            OwnedTensor a_unfused = poisoned(DType::BF16, {pairs, I});
            cuda::moe_activation({.h = h, .activation = activation, .layout = layout, .swiglu_alpha = 1.702f,
                                  .swiglu_limit = 7.0f, .a = a_unfused},
                                 stream_);
            OwnedTensor a_fused = poisoned(DType::BF16, {pairs, I});
            cuda::moe_gate_up({.x = d_x, .weight = d_gate_up, .bias = gu_bias, .top_k = c.top_k,
                               .tiles = tiles.view, .activation = activation, .layout = layout,
                               .swiglu_alpha = 1.702f, .swiglu_limit = 7.0f, .a = a_fused, .cta_group = cta_group,
                               .block_n = block_n, .decode_stages = stages, .pdl = pdl,
                               .sorted_rows = sorted_x_view},
                              stream_);
            sync();
            OwnedTensor want_from_h = OwnedTensor::host(DType::F32, {pairs, I});  // act of the GPU's bf16 h
            OwnedTensor want_a = OwnedTensor::host(DType::F32, {pairs, I});       // act of the double h
            for (int64_t pair = 0; pair < pairs; ++pair) {
              for (int64_t i = 0; i < I; ++i) {
                const int64_t g = layout == kHalves ? i : 2 * i, u = layout == kHalves ? I + i : 2 * i + 1;
                want_from_h.view.ptr<float>()[pair * I + i] =
                    float(act_ref(bf16_to_f32(got_h.view.ptr<bf16>()[pair * 2 * I + g]),
                                  bf16_to_f32(got_h.view.ptr<bf16>()[pair * 2 * I + u]), activation));
                want_a.view.ptr<float>()[pair * I + i] =
                    float(act_ref(h_ref[pair * 2 * I + g], h_ref[pair * 2 * I + u], activation));
              }
            }
            const OwnedTensor got_unfused = cuda::download(a_unfused), got_fused = cuda::download(a_fused);
            EXPECT_TRUE(all_close(got_unfused, want_from_h, kTolBf16Out)) << "moe_activation";
            EXPECT_TRUE(all_close(got_fused, want_a, kTolActivated)) << "fused a";
            EXPECT_TRUE(bitwise_equal(got_fused, got_unfused)) << "fused a vs h + moe_activation";
            if (persistent && layout == kInterleaved) {
              // a in tile order: each pair's bits at the tile row the gather records in pair_rows
              OwnedTensor a_rows = poisoned(DType::BF16, {capacity, I}), pair_rows = poisoned(DType::I32, {pairs});
              cuda::moe_gate_up({.x = d_x, .weight = d_gate_up, .bias = gu_bias, .top_k = c.top_k,
                                 .tiles = tiles.view, .activation = activation, .layout = layout,
                                 .swiglu_alpha = 1.702f, .swiglu_limit = 7.0f, .a = a_rows, .cta_group = cta_group,
                                 .block_n = block_n, .sorted_rows = sorted_x_view, .pair_rows = pair_rows},
                                stream_);
              sync();
              const OwnedTensor got_rows = cuda::download(a_rows), got_pair_rows = cuda::download(pair_rows);
              int64_t wrong_rows = 0, wrong_values = 0;
              for (int64_t row = 0; row < tile_rows; ++row) {
                const int32_t pair = sorted_pairs[row];
                if (pair >= pairs) continue;
                wrong_rows += got_pair_rows.view.ptr<int32_t>()[pair] != row ? 1 : 0;
                wrong_values += std::memcmp(got_rows.view.ptr<bf16>() + row * I, got_fused.view.ptr<bf16>() + pair * I,
                                            size_t(I) * sizeof(bf16)) != 0
                                    ? 1
                                    : 0;
              }
              EXPECT_EQ(wrong_rows, 0) << "pair_rows vs the tiles' sorted pairs";
              EXPECT_EQ(wrong_values, 0) << "a in tile order vs a by pair (rows differing)";
            }
          }
        }
        // down
        OwnedTensor d = poisoned(DType::BF16, {pairs, H});
        cuda::moe_down({.a = d_a_in, .weight = d_down, .bias = dn_bias, .tiles = tiles.view, .d = d,
                        .block_n = block_n, .cta_group = cta_group, .decode_stages = stages, .pdl = pdl,
                        .routing_before_wait = pdl, .sorted_rows = sorted_a_view},
                       stream_);
        sync();
        const OwnedTensor got_d = cuda::download(d);
        EXPECT_TRUE(all_close(got_d, want_d, kTolBf16Out)) << "d";
        if (persistent) {  // down from a in tile order (padding rows NaN: never read into a real row)
          OwnedTensor a_tiles = OwnedTensor::host(DType::BF16, {capacity, I});
          std::fill(a_tiles.view.ptr<bf16>(), a_tiles.view.ptr<bf16>() + capacity * I, kNan);
          for (int64_t row = 0; row < tile_rows; ++row) {
            const int32_t pair = sorted_pairs[row];
            if (pair < pairs) std::memcpy(a_tiles.view.ptr<bf16>() + row * I, a_in.view.ptr<bf16>() + pair * I, size_t(I) * 2);
          }
          OwnedTensor d_a_tiles = cuda::upload(a_tiles), d_rows = poisoned(DType::BF16, {pairs, H});
          cuda::moe_down({.a = d_a_tiles, .weight = d_down, .bias = dn_bias, .tiles = tiles.view, .d = d_rows,
                          .block_n = block_n, .cta_group = cta_group, .a_in_tile_order = true},
                         stream_);
          sync();
          EXPECT_TRUE(bitwise_equal(cuda::download(d_rows), got_d)) << "d from a in tile order vs a gathered";
        }
      }
      cuda::set_moe_gemm_kernel(kAuto);  // the defaults, for the tests after this one
      cuda::set_moe_gemm_multicast(false);
    }
  }
}

// moe_activation alone on both kernels: I % 8 == 0 (8 outputs per thread, 16-byte vectors) and I = 12 or
// a misaligned h (one output per thread), every activation × layout, against the formula on h; with the
// side expands' f32 terms (about a third of them zero) each h element with a nonzero term is bf16(h + term)
// first, and the kernel leaves every term zero.
TEST_F(CudaMoeGemm, ActivationMatchesReference) {
  struct Case { int64_t rows, inter, offset; };
  for (const Case& c : {Case{37, 2880, 0}, Case{5, 64, 0}, Case{9, 12, 0}, Case{6, 64, 1}, Case{0, 64, 0}}) {
    for (MoeActivation activation : {kSilu, kGptOss}) {
      for (GateUpLayout layout : {kHalves, kInterleaved}) {
        for (const bool terms : {false, true}) {
          SCOPED_TRACE("P " + std::to_string(c.rows) + " I " + std::to_string(c.inter) + " offset " +
                       std::to_string(c.offset) + (activation == kSilu ? " silu" : " gpt-oss") +
                       (layout == kHalves ? " halves" : " interleaved") + (terms ? " terms" : ""));
          const int64_t I = c.inter;
          OwnedTensor h = random_bf16(rng(), {c.rows, 2 * I}, 4.0f);  // beyond the ±7 clamp now and then
          OwnedTensor delta = OwnedTensor::host(DType::F32, {c.rows, 2 * I});
          for (int64_t i = 0; i < c.rows * 2 * I; ++i) {
            delta.view.ptr<float>()[i] = rng().uniform(0.0f, 3.0f) < 1.0f ? 0.0f : rng().normal() * 0.5f;
          }
          OwnedTensor want = OwnedTensor::host(DType::F32, {c.rows, I});
          const auto input = [&](int64_t at) {  // h's element at `at`, with its term rounded in (the expand's bits)
            const float v = bf16_to_f32(h.view.ptr<bf16>()[at]), t = delta.view.ptr<float>()[at];
            return terms && t != 0.0f ? bf16_to_f32(f32_to_bf16(v + t)) : v;
          };
          for (int64_t r = 0; r < c.rows; ++r) {
            for (int64_t i = 0; i < I; ++i) {
              const int64_t g = layout == kHalves ? i : 2 * i, u = layout == kHalves ? I + i : 2 * i + 1;
              want.view.ptr<float>()[r * I + i] = float(act_ref(input(r * 2 * I + g), input(r * 2 * I + u), activation));
            }
          }
          OwnedTensor d_h = upload_at_offset(h, c.offset), a = poisoned(DType::BF16, {c.rows, I});
          OwnedTensor d_delta = cuda::upload(delta);
          cuda::moe_activation({.h = d_h, .activation = activation, .layout = layout, .swiglu_alpha = 1.702f,
                                .swiglu_limit = 7.0f, .a = a, .delta = terms ? d_delta.view : Tensor{}},
                               stream_);
          sync();
          EXPECT_TRUE(all_close(cuda::download(a), want, kTolBf16Out));
          if (terms) {
            const OwnedTensor left = cuda::download(d_delta);
            int64_t nonzero = 0;
            for (int64_t i = 0; i < c.rows * 2 * I; ++i) nonzero += left.view.ptr<float>()[i] != 0.0f ? 1 : 0;
            EXPECT_EQ(nonzero, 0) << "terms left nonzero";
          }
        }
      }
    }
  }
}

// The sigmoid by the MUFU (ex2, rcp) at the extremes: gates far past the clamp on both sides, zeros, tiny and
// huge values, each against every up. Each output is within one bf16 step of the formula in double, or below
// 1e-30 in magnitude (a gate near -88: 1 / (1 + e^88) is subnormal and the reciprocal flushes it to 0).
TEST_F(CudaMoeGemm, ActivationAtExtremesMatchesReference) {
  const std::vector<float> gates = {-1e30f, -1e4f, -100.0f, -88.5f, -87.0f, -50.0f, -20.0f, -7.5f,
                                    -1.0f,  -1e-30f, -0.0f, 0.0f,   1e-30f, 0.5f,   1.0f,   3.0f,
                                    6.99f,  7.0f,   7.5f,   20.0f,  50.0f,  88.5f,  1e4f,   1e30f};
  const std::vector<float> ups = {-8.0f, -1.0f, -0.0f, 0.25f, 1.0f, 7.5f, 100.0f};
  const int64_t I = int64_t(gates.size()), rows = int64_t(ups.size());  // I % 8 == 0: the vector path
  OwnedTensor h = OwnedTensor::host(DType::BF16, {rows, 2 * I});
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < I; ++i) {  // halves: gate i, up I + i
      h.view.ptr<bf16>()[r * 2 * I + i] = f32_to_bf16(gates[size_t(i)]);
      h.view.ptr<bf16>()[r * 2 * I + I + i] = f32_to_bf16(ups[size_t(r)]);
    }
  }
  for (MoeActivation activation : {kSilu, kGptOss}) {
    SCOPED_TRACE(activation == kSilu ? "silu" : "gpt-oss");
    OwnedTensor d_h = cuda::upload(h), a = poisoned(DType::BF16, {rows, I});
    cuda::moe_activation({.h = d_h, .activation = activation, .layout = kHalves, .swiglu_alpha = 1.702f,
                          .swiglu_limit = 7.0f, .a = a},
                         stream_);
    sync();
    const OwnedTensor got = cuda::download(a);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = 0; i < I; ++i) {
        const double gate = bf16_to_f32(h.view.ptr<bf16>()[r * 2 * I + i]);
        const double up = bf16_to_f32(h.view.ptr<bf16>()[r * 2 * I + I + i]);
        const double want = act_ref(gate, up, activation);
        const double value = bf16_to_f32(got.view.ptr<bf16>()[r * I + i]);
        EXPECT_LE(std::abs(value - want), std::abs(want) / 128.0 + 1e-30)
            << "gate " << gate << ", up " << up << ": got " << value << ", want " << want;
      }
    }
  }
}

TEST_F(CudaMoeGemm, CombineMatchesReference) {
  // H % 8 == 0 (16-byte path) and odd H (scalar path); K = 1 .. 8.
  for (const auto& [tokens, top_k, hidden] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
           {1, 4, 2880}, {7, 1, 64}, {33, 8, 37}, {300, 2, 200}}) {
    SCOPED_TRACE("T " + std::to_string(tokens) + " K " + std::to_string(top_k) + " H " + std::to_string(hidden));
    OwnedTensor d = random_bf16(rng(), {tokens * top_k, hidden});
    OwnedTensor weights = OwnedTensor::host(DType::F32, {tokens, top_k});
    for (int64_t i = 0; i < tokens * top_k; ++i) weights.view.ptr<float>()[i] = rng().uniform(0.0f, 1.0f);
    OwnedTensor want = OwnedTensor::host(DType::F32, {tokens, hidden});
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t o = 0; o < hidden; ++o) {
        double sum = 0.0;
        for (int64_t k = 0; k < top_k; ++k) {
          sum += double(weights.view.ptr<float>()[t * top_k + k]) *
                 bf16_to_f32(d.view.ptr<bf16>()[(t * top_k + k) * hidden + o]);
        }
        want.view.ptr<float>()[t * hidden + o] = float(sum);
      }
    }
    OwnedTensor d_d = cuda::upload(d), d_w = cuda::upload(weights);
    OwnedTensor out = poisoned(DType::BF16, {tokens, hidden});
    cuda::moe_combine({.d = d_d, .topk_weights = d_w, .out = out}, stream_);
    sync();
    const OwnedTensor got = cuda::download(out);
    EXPECT_TRUE(all_close(got, want, kTolBf16Out));
    // Deterministic: a second run gives the same bits.
    OwnedTensor again = poisoned(DType::BF16, {tokens, hidden});
    cuda::moe_combine({.d = d_d, .topk_weights = d_w, .out = again}, stream_);
    sync();
    EXPECT_TRUE(bitwise_equal(cuda::download(again), got));
    // With `clear`: the same output, and the F32 range zeroed, also where it is larger than the output.
    for (int64_t clear_numel : {int64_t(8), (tokens * hidden * 2 + 7) / 4 * 4}) {
      OwnedTensor clear = poisoned(DType::F32, {clear_numel}), cleared = poisoned(DType::BF16, {tokens, hidden});
      cuda::moe_combine({.d = d_d, .topk_weights = d_w, .out = cleared, .clear = clear}, stream_);
      sync();
      EXPECT_TRUE(bitwise_equal(cuda::download(cleared), got)) << "with clear of " << clear_numel;
      const OwnedTensor zeros = cuda::download(clear);
      int64_t nonzero = 0;
      for (int64_t i = 0; i < clear_numel; ++i) nonzero += zeros.view.ptr<float>()[i] != 0.0f ? 1 : 0;
      EXPECT_EQ(nonzero, 0) << "clear of " << clear_numel << " floats";
    }
  }
}

// Contract violations abort with a message naming the field, the expectation and what was found.
TEST_F(CudaMoeGemm, BadInputNamesTheField) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_THROW(cuda::set_moe_gemm_large_block_n(64), std::invalid_argument);
  EXPECT_THROW(cuda::set_moe_block_down_block_n(64), std::invalid_argument);
  EXPECT_THROW(cuda::set_moe_block_down_decode_stages(3), std::invalid_argument);
  EXPECT_THROW(cuda::set_moe_block_down_decode_stages(7), std::invalid_argument);
  const int64_t tokens = 4, top_k = 2, experts = 8, H = 64, I = 64, pairs = tokens * top_k;
  Routing routing = make_routing(rng(), tokens, top_k, experts);
  OwnedTensor d_ids = cuda::upload(routing.ids), d_weights = cuda::upload(routing.weights);
  OwnedTensor d_x = cuda::upload(random_bf16(rng(), {tokens, H}));
  OwnedTensor d_gate_up = cuda::upload(random_bf16(rng(), {experts, 2 * I, H}));
  OwnedTensor d_down = cuda::upload(random_bf16(rng(), {experts, H, I}));
  const Tiles tiles = align_by_expert(d_ids, pairs, experts, cuda::kMoeGemmBlockMDecode, stream_);
  sync();
  OwnedTensor h = cuda::empty(DType::BF16, {pairs, 2 * I}), a = cuda::empty(DType::BF16, {pairs, I});
  OwnedTensor short_a = cuda::empty(DType::BF16, {pairs, I - 8});
  EXPECT_DEATH(cuda::moe_gate_up({.x = d_x, .weight = d_gate_up, .top_k = top_k, .tiles = tiles.view, .h = h, .a = a},
                                 stream_),
               "moe_gate_up.*exactly one of h");
  EXPECT_DEATH(cuda::moe_gate_up({.x = d_x, .weight = d_gate_up, .top_k = top_k, .tiles = tiles.view, .a = short_a},
                                 stream_),
               "moe_gate_up.*a: expected \\[8, 64\\] BF16");
  // The LoRA delta goes into the fused activation only, and needs every token's slot.
  EXPECT_DEATH(cuda::moe_gate_up({.x = d_x, .weight = d_gate_up, .top_k = top_k, .tiles = tiles.view, .h = h,
                                  .lora_h = h, .token_slot = cuda::empty(DType::I32, {tokens})},
                                 stream_),
               "moe_gate_up.*lora_h is added before the fused activation");
  EXPECT_DEATH(cuda::moe_gate_up({.x = d_x, .weight = d_gate_up, .top_k = top_k, .tiles = tiles.view, .a = a,
                                  .lora_h = h, .token_slot = cuda::empty(DType::I32, {tokens + 1})},
                                 stream_),
               "moe_gate_up.*token_slot: expected \\[4\\] I32");
  // The LoRA in the accumulators runs on the decode kernel (16-row tiles) and the persistent kernel only:
  // 64-row tiles without gathered rows (the ring or mma.sync kernels) are refused by name.
  const cuda::MoeGemmLora lora{.z = cuda::empty(DType::F32, {pairs, 16}),
                               .b = cuda::empty(DType::BF16, {2, experts, 2 * I, 16}),
                               .rank = cuda::empty(DType::I32, {2}),
                               .token_slot = cuda::empty(DType::I32, {tokens})};
  const Tiles tiles64 = align_by_expert(d_ids, pairs, experts, cuda::kMoeGemmBlockMPrefill, stream_);
  sync();
  EXPECT_DEATH(cuda::moe_gate_up({.x = d_x, .weight = d_gate_up, .top_k = top_k, .tiles = tiles64.view, .a = a,
                                  .lora = lora},
                                 stream_),
               "moe_gate_up.*lora.z is added by the BLOCK_M 16 decode kernel or the persistent TMA kernel only.*"
               "\\(got 64\\) with sorted_rows given \\(no\\)");
  EXPECT_DEATH(cuda::moe_combine({.d = cuda::empty(DType::BF16, {pairs, H}), .topk_weights = d_weights, .out = d_x,
                                  .clear = cuda::empty(DType::F32, {6})},
                                 stream_),
               "moe_combine.*clear: expected F32, numel a multiple of 4");
  // BLOCK_N 240 is built for down at 128-row tiles only.
  EXPECT_DEATH(cuda::moe_gate_up({.x = d_x, .weight = d_gate_up, .top_k = top_k, .tiles = tiles.view, .a = a,
                                  .block_n = 240},
                                 stream_),
               "moe_gate_up.*block_n = 240: built only for tiles.block_m 128");
  EXPECT_DEATH(cuda::moe_down({.a = a, .weight = d_down, .tiles = tiles.view, .d = cuda::empty(DType::BF16, {pairs, H}),
                               .block_n = 240},
                              stream_),
               "moe_down.*block_n = 240: built only for tiles.block_m 128");
  EXPECT_THROW(cuda::set_moe_gemm_large_block_n(240), std::invalid_argument);
  cuda::MoeExpertTiles wrong_block = tiles.view;
  wrong_block.block_m = 32;
  EXPECT_DEATH(cuda::moe_down({.a = a, .weight = d_down, .tiles = wrong_block, .d = h}, stream_),
               "moe_down.*d: expected \\[8, 64\\]");
  EXPECT_DEATH(cuda::moe_down({.a = a, .weight = d_down, .tiles = wrong_block,
                               .d = cuda::empty(DType::BF16, {pairs, H})},
                              stream_),
               "block_m = 32");
  // A batch larger than the workspace was sized for.
  const cuda::MoeWorkspaceShape shape{.max_tokens = tokens - 1, .top_k = top_k, .experts = experts, .hidden = H,
                                      .inter = I};
  OwnedTensor memory = cuda::empty(DType::U8, {int64_t(cuda::moe_workspace_bytes(shape))});
  OwnedTensor out = cuda::empty(DType::BF16, {tokens, H});
  EXPECT_DEATH(cuda::moe_block({.x = d_x, .topk_ids = d_ids, .topk_weights = d_weights, .gate_up = d_gate_up,
                                .down = d_down, .out = out},
                               {.shape = shape, .memory = memory}, stream_),
               "moe_block.*does not fit the workspace shape \\(max T 3");
}

}  // namespace
}  // namespace lmx::test
