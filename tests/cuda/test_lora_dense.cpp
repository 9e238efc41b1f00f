// Parity of the CUDA dense multi-LoRA (backends/cuda/lora_dense.cuh) with CpuBackend::lora, the op's CPU oracle: T in
// {1, 7, 64, 300, 1500 (align's sort path)}, mixed true ranks (0 = disabled, 8/16/32/64, odd), rank capacity 72 and 128
// (the kernels' rank cap 128) with ranks 8/72/128/97/64, tokens with slot -1, NaN in the padding ranks of A and B, `in`
// with and without the 64-input EVEN_K fast path, GPT-OSS q_proj and o_proj shapes, several knob settings, repeated
// calls on one scratch (its z must stay zero), a batch without adapters that must leave y bit-identical, and
// groups of q / k / v parts (lora_dense_group) against one CPU call per part; and the backend's fused
// linear + LoRA (CudaBackend::linear_lora: the shrink on a side stream, one expand that splits and adds
// the LoRA) against the CPU backend's composition, eager and in a graph.
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/lora_dense.cuh"
#include "backends/cuda/moe_lora_small.cuh"
#include "cuda_test_util.h"
#include "ops/lora.h"

namespace lmx::test {
namespace {

struct Case {
  int64_t tokens, slots, capacity_rank, in, out;
  // True ranks of slots 1, 2, ... cycled (each <= R; slot 0 is always rank 0). Empty: 8, 16, 32, 64, R - 3,
  // random.
  std::vector<int32_t> slot_ranks = {};
  // Slots of tokens 0, 1, ... (so that every rank is sure to be hit); the other tokens random in [-1, S).
  std::vector<int32_t> first_token_slots = {};
};

// run_case: one random problem against the CPU oracle under several knob settings (split 1 / 4 / auto,
// both CTA orders, BLOCK_N 64 / 128, PDL on and off, shrink run mode), on one scratch whose z stays zero.
class CudaLoraDense : public CudaTest {
 protected:
  void run_case(const Case& c);
  // The self-cleaning invariant: z and z_readers all zero after a call.
  static void expect_scratch_clean(const cuda::LoraDenseScratch& scratch) {
    OwnedTensor z = cuda::download(scratch.z);
    int64_t nonzero = 0;
    for (int64_t i = 0; i < z.view.numel(); ++i) nonzero += z.view.ptr<float>()[i] != 0.0f;
    EXPECT_EQ(nonzero, 0) << "scratch z must be all zero after the call";
    OwnedTensor readers = cuda::download(scratch.z_readers);
    int64_t nonzero_readers = 0;
    for (int64_t i = 0; i < readers.view.numel(); ++i) nonzero_readers += readers.view.ptr<int32_t>()[i] != 0;
    EXPECT_EQ(nonzero_readers, 0) << "scratch z_readers must be all zero after the call";
  }
};

TEST_F(CudaLoraDense, MatchesCpu) {
  const std::vector<Case> cases = {{1, 4, 32, 520, 1000},   {7, 3, 16, 8, 2},        {64, 8, 64, 2880, 4096},
                                   {64, 8, 32, 4096, 2880}, {300, 5, 64, 1032, 514}, {300, 8, 32, 2880, 4096},
                                   {1500, 6, 16, 264, 130},   // T > 1024: moe_align's sort path
                                   {1200, 5, 32, 264, 2056}};  // prefill-wide out: 4 expand chunks per CTA
  for (const Case& c : cases) {
    run_case(c);
    if (HasFatalFailure()) return;
  }
}

// Rank capacity 128 and 72 (the kernels' rank cap 128), true ranks 0 / 8 / 72 / 128 / 97 (odd) / 64 mixed
// across slots, tokens without adapter, `in` with and without EVEN_K, T 1 / 16 / 257.
TEST_F(CudaLoraDense, MatchesCpuRankCap128) {
  // Slot ranks 0 (slot 0), 8, 72, 128, 97, 64; the first tokens visit 128, 72, 97, 8, none, rank 0, 64.
  const std::vector<int32_t> ranks = {8, 72, 128, 97, 64}, first = {3, 2, 4, 1, -1, 0, 5};
  const std::vector<Case> cases = {{1, 6, 128, 2880, 4096, ranks, {3}},     // GPT-OSS q_proj shape, decode
                                   {1, 6, 128, 520, 1002, ranks, {2}},      // rank 72 at capacity 128
                                   {16, 6, 128, 2048, 1536, ranks, first},
                                   {16, 4, 72, 264, 776, {8, 72, 33}, {2, 1, 3, -1, 0}},  // R 72
                                   {257, 6, 128, 1032, 514, ranks, first},  // in off the 64-input chunk
                                   {257, 6, 128, 4096, 2880, ranks, first}};
  for (const Case& c : cases) {
    run_case(c);
    if (HasFatalFailure()) return;
  }
}

void CudaLoraDense::run_case(const Case& c) {
  const std::vector<cuda::MoeLoraConfig> configs = {
      {}, {.split_k = 1, .order = cuda::MoeLoraCtaOrder::kPieceFastest, .pdl = false, .expand_block_n = 64},
      {.split_k = 4, .order = cuda::MoeLoraCtaOrder::kTileFastest, .pdl = true, .expand_block_n = 64},
      {.split_k = 2, .order = cuda::MoeLoraCtaOrder::kTileFastest, .pdl = true, .expand_block_n = 128,
       .shrink_tiles_per_cta = 4},
      {.expand_block_n = 64, .expand_chunks = 4}, {.split_k = 1, .pdl = false, .expand_chunks = 1}};
  const std::string what = "T " + std::to_string(c.tokens) + " S " + std::to_string(c.slots) + " R " +
                           std::to_string(c.capacity_rank) + " in " + std::to_string(c.in) + " out " +
                           std::to_string(c.out);
  SCOPED_TRACE(what);
  const int64_t R = c.capacity_rank;
  OwnedTensor rank = OwnedTensor::host(DType::I32, {c.slots});
  rank.view.ptr<int32_t>()[0] = 0;
  for (int64_t s = 1; s < c.slots; ++s) {
    const int32_t choices[] = {8, 16, 32, 64, int32_t(R - 3), 1 + int32_t(rng().next_u64() % uint64_t(R))};
    const int32_t chosen = c.slot_ranks.empty() ? choices[(s - 1) % 6]
                                                : c.slot_ranks[size_t(s - 1) % c.slot_ranks.size()];
    rank.view.ptr<int32_t>()[s] = std::min<int32_t>(int32_t(R), chosen);
  }
  OwnedTensor a = random_bf16(rng(), {c.slots, R, c.in}, 0.05f);
  OwnedTensor b = random_bf16(rng(), {c.slots, c.out, R}, 0.05f);
  const bf16 nan = f32_to_bf16(std::numeric_limits<float>::quiet_NaN());
  for (int64_t s = 0; s < c.slots; ++s) {
    for (int64_t r = rank.view.ptr<int32_t>()[s]; r < R; ++r) {
      for (int64_t i = 0; i < c.in; ++i) a.view.ptr<bf16>()[(s * R + r) * c.in + i] = nan;
      for (int64_t o = 0; o < c.out; ++o) b.view.ptr<bf16>()[(s * c.out + o) * R + r] = nan;
    }
  }
  OwnedTensor token_slot = random_ids(rng(), c.tokens, -1, int32_t(c.slots));
  for (size_t t = 0; t < c.first_token_slots.size() && int64_t(t) < c.tokens; ++t) {
    token_slot.view.ptr<int32_t>()[t] = c.first_token_slots[t];
  }
  OwnedTensor x = random_bf16(rng(), {c.tokens, c.in});
  OwnedTensor y0 = random_bf16(rng(), {c.tokens, c.out});
  OwnedTensor want_y = widen(y0);
  cpu_.lora({.x = widen(x), .token_slot = token_slot,
             .w = {.a = a.view, .b = b.view, .rank = rank.view}, .y = want_y});

  OwnedTensor d_a = cuda::upload(a), d_b = cuda::upload(b), d_rank = cuda::upload(rank);
  OwnedTensor d_slot = cuda::upload(token_slot), d_x = cuda::upload(x);
  // One scratch sized above T: the call must use views of it, and keep its z zero across calls.
  const cuda::LoraDenseScratch scratch = cuda::lora_dense_scratch(c.tokens + 5, c.slots, R);
  // Every tiled config, then the direct path (with and without PDL), then the automatic choice.
  struct Run {
    cuda::MoeLoraConfig config;
    int path;
  };
  std::vector<Run> runs;
  for (const cuda::MoeLoraConfig& config : configs) runs.push_back({config, 1});
  if (c.tokens <= cuda::kMoeLoraSmallMaxPairs) {
    runs.push_back({{.pdl = true}, 0});
    runs.push_back({{.pdl = false}, 0});
  }
  runs.push_back({{}, -1});
  for (const auto& [config, path] : runs) {
    SCOPED_TRACE("path " + std::to_string(path) + " split " + std::to_string(config.split_k) + " order " +
                 std::to_string(int(config.order)) + " block_n " + std::to_string(config.expand_block_n) +
                 (config.pdl ? " pdl" : "") + " shrink tiles " + std::to_string(config.shrink_tiles_per_cta) +
                 " expand chunks " + std::to_string(config.expand_chunks));
    OwnedTensor d_y = cuda::upload(y0);
    cuda::lora_dense({.x = d_x, .token_slot = d_slot, .w = {.a = d_a, .b = d_b, .rank = d_rank}, .y = d_y},
                     scratch, config, stream_, path);
    sync();
    EXPECT_TRUE(all_close(cuda::download(d_y), want_y, kTolBf16Out)) << "y";
    expect_scratch_clean(scratch);
  }
}

// lora_dense_group: q, k, v of one layer (GPT-OSS shapes: in 2880, out 4096 / 512 / 512; and Qwen3-like
// 2048 → 4096 / 512 / 512 with R 64) against one CpuBackend::lora per part, on the direct path (one launch
// pair for the group) and the tiled one, with a part whose stack is undefined (k: no adapter targets it),
// slots of mixed true ranks (0 included) that differ per part, tokens without adapter, NaN in padding
// ranks, and the scratch's z / z_readers zero after every call.
TEST_F(CudaLoraDense, GroupMatchesCpu) {
  struct GroupCase {
    int64_t tokens, slots, capacity_rank, in;
    std::vector<int64_t> outs;
    bool skip_second;  // the second part has no stack
  };
  const std::vector<GroupCase> cases = {{1, 8, 32, 2880, {4096, 512, 512}, false},
                                        {16, 8, 32, 2880, {4096, 512, 512}, false},
                                        {16, 8, 32, 2880, {4096, 512, 512}, true},
                                        {64, 5, 64, 2048, {4096, 512, 512}, false},
                                        {7, 3, 16, 264, {130, 8, 2}, false},
                                        {300, 8, 32, 2880, {4096, 512, 512}, false}};  // tiled: one align
  for (const GroupCase& c : cases) {
    SCOPED_TRACE("T " + std::to_string(c.tokens) + " S " + std::to_string(c.slots) + " R " +
                 std::to_string(c.capacity_rank) + " in " + std::to_string(c.in) +
                 (c.skip_second ? " second part undefined" : ""));
    const int64_t R = c.capacity_rank, parts = int64_t(c.outs.size());
    OwnedTensor token_slot = random_ids(rng(), c.tokens, -1, int32_t(c.slots));
    OwnedTensor x = random_bf16(rng(), {c.tokens, c.in});
    OwnedTensor d_slot = cuda::upload(token_slot), d_x = cuda::upload(x);
    std::vector<OwnedTensor> a, b, rank, y0, want, d_a, d_b, d_rank;
    for (int64_t i = 0; i < parts; ++i) {
      const int64_t out = c.outs[size_t(i)];
      rank.push_back(OwnedTensor::host(DType::I32, {c.slots}));
      for (int64_t s = 0; s < c.slots; ++s) {  // per part: slot (s + i) % 4 == 0 has rank 0 here
        rank.back().view.ptr<int32_t>()[s] =
            (s + i) % 4 == 0 ? 0 : 1 + int32_t(rng().next_u64() % uint64_t(R));
      }
      a.push_back(random_bf16(rng(), {c.slots, R, c.in}, 0.05f));
      b.push_back(random_bf16(rng(), {c.slots, out, R}, 0.05f));
      const bf16 nan = f32_to_bf16(std::numeric_limits<float>::quiet_NaN());
      for (int64_t s = 0; s < c.slots; ++s) {
        for (int64_t r = rank.back().view.ptr<int32_t>()[s]; r < R; ++r) {
          for (int64_t k = 0; k < c.in; ++k) a.back().view.ptr<bf16>()[(s * R + r) * c.in + k] = nan;
          for (int64_t o = 0; o < out; ++o) b.back().view.ptr<bf16>()[(s * out + o) * R + r] = nan;
        }
      }
      y0.push_back(random_bf16(rng(), {c.tokens, out}));
      want.push_back(widen(y0.back()));
      if (!(c.skip_second && i == 1)) {
        cpu_.lora({.x = widen(x), .token_slot = token_slot,
                   .w = {.a = a.back().view, .b = b.back().view, .rank = rank.back().view}, .y = want.back()});
      }
      d_a.push_back(cuda::upload(a.back()));
      d_b.push_back(cuda::upload(b.back()));
      d_rank.push_back(cuda::upload(rank.back()));
    }
    const cuda::LoraDenseScratch scratch = cuda::lora_dense_scratch(c.tokens + 3, c.slots, R);
    for (int path : {0, -1, 1}) {
      if (path == 0 && c.tokens > cuda::kMoeLoraSmallMaxPairs) continue;
      for (int repeat = 0; repeat < 2; ++repeat) {
        SCOPED_TRACE("path " + std::to_string(path) + " repeat " + std::to_string(repeat));
        std::vector<OwnedTensor> d_y;
        std::vector<ops::LoraParams> group;
        for (int64_t i = 0; i < parts; ++i) {
          d_y.push_back(cuda::upload(y0[size_t(i)]));
          const bool skip = c.skip_second && i == 1;
          group.push_back({.x = d_x,
                           .token_slot = d_slot,
                           .w = skip ? ops::LoraStack{} : ops::LoraStack{.a = d_a[size_t(i)], .b = d_b[size_t(i)], .rank = d_rank[size_t(i)]},
                           .y = d_y.back()});
        }
        // repeat 1: no PDL, and the backend's 64-output expand chunks
        const cuda::MoeLoraConfig config =
            repeat == 0 ? cuda::MoeLoraConfig{} : cuda::MoeLoraConfig{.pdl = false, .expand_block_n = 64};
        cuda::lora_dense_group(group, scratch, config, stream_, path);
        sync();
        for (int64_t i = 0; i < parts; ++i) {
          EXPECT_TRUE(all_close(cuda::download(d_y[size_t(i)]), want[size_t(i)], kTolBf16Out)) << "y of part " << i;
        }
        expect_scratch_clean(scratch);
      }
    }
    if (HasFatalFailure()) return;
  }
}

// CudaBackend::linear_lora against CpuBackend::linear_lora (ops::Backend's composition: linear, split_columns,
// lora per output) for a q|k|v-like split with a bias, one output with and without a bias (o_proj, dense MLP),
// T 1 / 16 / 256 (fused) and 300 (the composition), a part without a stack (the composition), the fused form
// switched off, outputs poisoned with NaN before each call (the fused expand writes every row, adapter or
// not), tokens without adapter and a rank-0 slot (their rows bit for bit the composition's), repeated calls (a z
// left dirty would show in the second), a scalar (unaligned-width) split with a bias, and a CUDA graph (the
// side stream's fork and join captured) replayed twice.
// The oracle of a linear_lora case: the CPU backend's composition on f32 activations, one [T, N_i] f32 per
// output (outs: one entry = no split; stacks: one per output, undefined = no LoRA there).
std::vector<OwnedTensor> linear_lora_oracle(ops::Backend& cpu, const OwnedTensor& x, const OwnedTensor& weight,
                                            const Tensor& bias, const OwnedTensor& token_slot,
                                            const std::vector<int64_t>& outs, const std::vector<ops::LoraStack>& stacks) {
  const int64_t tokens = x.view.dim(0);
  int64_t width = 0;
  for (int64_t o : outs) width += o;
  OwnedTensor all = OwnedTensor::host(DType::F32, {tokens, width});
  std::vector<OwnedTensor> want;
  for (int64_t o : outs) want.push_back(OwnedTensor::host(DType::F32, {tokens, o}));
  OwnedTensor wide_x = widen(x);
  ops::LinearLoraParams host{.linear = {.x = wide_x, .weight = weight, .bias = bias,
                                        .out = outs.size() == 1 ? want[0].view : all.view},
                             .token_slot = token_slot};
  for (size_t i = 0; i < outs.size(); ++i) {
    if (outs.size() > 1) host.parts[i] = want[i];
    host.lora[i] = stacks[i];
  }
  cpu.linear_lora(host);
  return want;
}

// One linear_lora problem's shape: T, S, R, `in`, the output widths (one entry: no split), a bias, and which
// output has no LoRA stack (-1: none).
struct LinearCase {
  int64_t tokens, slots, capacity_rank, in;
  std::vector<int64_t> outs;
  bool bias;
  int undefined_part;
};

// A linear_lora case on the device: its inputs, poisoned outputs, and the LinearLoraParams (with_lora: the
// case's token_slot and stacks; otherwise the product alone).
struct DeviceLinear {
  OwnedTensor x, weight, bias, token_slot, all;
  std::vector<OwnedTensor> a, b, rank, out;

  DeviceLinear(const LinearCase& c, const OwnedTensor& host_x, const OwnedTensor& host_weight,
               const OwnedTensor& host_bias, const OwnedTensor& host_slot, const std::vector<OwnedTensor>& host_a,
               const std::vector<OwnedTensor>& host_b, const std::vector<OwnedTensor>& host_rank, int64_t width)
      : x(cuda::upload(host_x)), weight(cuda::upload(host_weight)), bias(cuda::upload(host_bias)),
        token_slot(cuda::upload(host_slot)), all(poisoned(DType::BF16, {c.tokens, width})) {
    for (size_t i = 0; i < c.outs.size(); ++i) {
      a.push_back(cuda::upload(host_a[i]));
      b.push_back(cuda::upload(host_b[i]));
      rank.push_back(cuda::upload(host_rank[i]));
      out.push_back(poisoned(DType::BF16, {c.tokens, c.outs[i]}));
    }
  }
  ops::LinearLoraParams params(const LinearCase& c, bool with_lora) const {
    const size_t parts = c.outs.size();
    ops::LinearLoraParams p{.linear = {.x = x, .weight = weight, .bias = c.bias ? bias.view : Tensor{},
                                       .out = parts == 1 ? out[0].view : all.view}};
    if (with_lora) p.token_slot = token_slot;
    for (size_t i = 0; i < parts; ++i) {
      if (parts > 1) p.parts[i] = out[i];
      if (with_lora && int(i) != c.undefined_part) p.lora[i] = {.a = a[i], .b = b[i], .rank = rank[i]};
    }
    return p;
  }
};

// 2⁻⁶ (docs/NUMERICS.md): two roundings of y at the product's magnitude (product + bias, then + the LoRA
// term) where the term cancels most of the product, over millions of elements; z in bf16 on the run path.
// One ulp was too tight for the bias cases: 1 of 65,536 elements at 1.04 ulp (H200, run 115).
constexpr double kTolLinearLora = 2 * kTolBf16Out;

TEST_F(CudaLoraDense, LinearLoraMatchesCpu) {
  const std::vector<LinearCase> cases = {{16, 8, 32, 2880, {4096, 512, 512}, true, -1},  // GPT-OSS q|k|v
                                         {1, 8, 32, 2880, {4096, 512, 512}, true, -1},
                                         {16, 8, 32, 4096, {2880}, true, -1},             // GPT-OSS o_proj
                                         {256, 4, 16, 264, {136, 64, 64}, true, -1},
                                         {7, 3, 16, 264, {520}, false, -1},               // dense MLP
                                         {16, 4, 32, 264, {256, 64, 64}, true, 1},        // k without LoRA
                                         {16, 4, 32, 264, {256, 64, 64}, true, -1},       // skinny keeps the bias
                                         {300, 4, 16, 264, {256, 64, 64}, true, -1},      // tiled: split + bias
                                         {300, 4, 16, 264, {130, 66, 68}, true, -1}};     // scalar split + bias
  cuda::CudaBackend backend;
  for (const LinearCase& c : cases) {
    const int64_t R = c.capacity_rank, parts = int64_t(c.outs.size());
    int64_t width = 0;
    for (int64_t o : c.outs) width += o;
    SCOPED_TRACE("T " + std::to_string(c.tokens) + " in " + std::to_string(c.in) + " parts " + std::to_string(parts) +
                 " width " + std::to_string(width) + (c.bias ? " bias" : "") +
                 (c.undefined_part >= 0 ? " part " + std::to_string(c.undefined_part) + " without LoRA" : ""));
    OwnedTensor token_slot = random_ids(rng(), c.tokens, -1, int32_t(c.slots));
    OwnedTensor x = random_bf16(rng(), {c.tokens, c.in});
    OwnedTensor weight = random_bf16(rng(), {width, c.in}, 0.05f);
    OwnedTensor bias = random_bf16(rng(), {width});
    std::vector<OwnedTensor> a, b, rank;
    for (int64_t i = 0; i < parts; ++i) {
      const int64_t out = c.outs[size_t(i)];
      rank.push_back(OwnedTensor::host(DType::I32, {c.slots}));
      for (int64_t s = 0; s < c.slots; ++s) rank.back().view.ptr<int32_t>()[s] = s == 1 ? 0 : 1 + int32_t(rng().next_u64() % uint64_t(R));
      a.push_back(random_bf16(rng(), {c.slots, R, c.in}, 0.05f));
      b.push_back(random_bf16(rng(), {c.slots, out, R}, 0.05f));
    }
    std::vector<ops::LoraStack> stacks;
    for (int64_t i = 0; i < parts; ++i) {
      stacks.push_back(i == c.undefined_part ? ops::LoraStack{}
                                             : ops::LoraStack{.a = a[size_t(i)], .b = b[size_t(i)], .rank = rank[size_t(i)]});
    }
    const std::vector<OwnedTensor> want =
        linear_lora_oracle(cpu_, x, weight, c.bias ? bias.view : Tensor{}, token_slot, c.outs, stacks);

    DeviceLinear d(c, x, weight, bias, token_slot, a, b, rank, width);
    std::vector<OwnedTensor>& d_out = d.out;
    const ops::LinearLoraParams device = d.params(c, true);
    auto poison_outputs = [&] {
      backend.synchronize();
      for (int64_t i = 0; i < parts; ++i) cuda::fill_bytes(d_out[size_t(i)].view, 0xff);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    };
    auto expect_outputs = [&](const std::string& how) {
      backend.synchronize();
      ASSERT_EQ(cudaGetLastError(), cudaSuccess) << how;
      for (int64_t i = 0; i < parts; ++i) {
        EXPECT_TRUE(all_close(cuda::download(d_out[size_t(i)]), want[size_t(i)], kTolLinearLora)) << how << ": output " << i;
      }
    };
    std::vector<OwnedTensor> composed;  // the composition's outputs (fuse off), for the bitwise check below
    for (bool fuse : {false, true}) {
      backend.set_fuse_linear_lora(fuse);
      for (int repeat = 0; repeat < 2; ++repeat) {
        poison_outputs();
        backend.linear_lora(device);
        expect_outputs(std::string(fuse ? "fused" : "composed") + " call " + std::to_string(repeat));
        if (!fuse && repeat == 0) {
          for (int64_t i = 0; i < parts; ++i) composed.push_back(cuda::download(d_out[size_t(i)]));
        }
      }
    }
    // Rows without a LoRA term (slot -1, or slot 1 whose rank is 0) hold product + bias alone: the fused
    // forms must give them bit for bit what the composition does (same bias rounding). Rows with an adapter
    // may differ in the last bit (fp32 atomics into z in another order).
    for (int64_t i = 0; i < parts; ++i) {
      OwnedTensor got = cuda::download(d_out[size_t(i)]);
      const int64_t width_i = c.outs[size_t(i)];
      int64_t differing = 0;
      for (int64_t t = 0; t < c.tokens; ++t) {
        const int32_t slot = token_slot.view.ptr<int32_t>()[t];
        if (slot >= 0 && slot != 1 && i != c.undefined_part) continue;
        differing += std::memcmp(got.view.ptr<bf16>() + t * width_i, composed[size_t(i)].view.ptr<bf16>() + t * width_i,
                                 size_t(width_i) * sizeof(bf16)) != 0;
      }
      EXPECT_EQ(differing, 0) << "output " << i << ": rows without a LoRA term differ from the composition's";
    }
    backend.set_fuse_linear_lora(true);
    for (bool product_first : {false, true}) {  // the fork's enqueue order (set_fork_product_first)
      backend.set_fork_product_first(product_first);
      const std::string order = product_first ? "product first, " : "";
      poison_outputs();
      backend.linear_lora(device);
      expect_outputs(order + "eager");
      backend.begin_capture();
      backend.linear_lora(device);
      const int graph = backend.end_capture();
      for (int replay = 0; replay < 2; ++replay) {
        poison_outputs();
        backend.replay(graph);
        expect_outputs(order + "graph replay " + std::to_string(replay));
      }
      backend.release_graph(graph);
    }
    backend.set_fork_product_first(true);  // the default
    if (HasFatalFailure()) return;
  }
}

TEST_F(CudaLoraDense, NoAdapterLeavesOutputBitIdentical) {
  const int64_t tokens = 64, slots = 4, R = 16, in = 256, out = 512;
  OwnedTensor rank = OwnedTensor::host(DType::I32, {slots});
  for (int64_t s = 0; s < slots; ++s) rank.view.ptr<int32_t>()[s] = s == 2 ? 0 : int32_t(R);
  for (int32_t only_slot : {-1, 2}) {
    OwnedTensor token_slot = OwnedTensor::host(DType::I32, {tokens});
    for (int64_t t = 0; t < tokens; ++t) token_slot.view.ptr<int32_t>()[t] = only_slot;
    OwnedTensor d_slot = cuda::upload(token_slot), d_rank = cuda::upload(rank);
    OwnedTensor d_a = cuda::upload(random_bf16(rng(), {slots, R, in}));
    OwnedTensor d_b = cuda::upload(random_bf16(rng(), {slots, out, R}));
    OwnedTensor d_x = cuda::upload(random_bf16(rng(), {tokens, in}));
    OwnedTensor y0 = random_bf16(rng(), {tokens, out});
    OwnedTensor d_y = cuda::upload(y0);
    const cuda::LoraDenseScratch scratch = cuda::lora_dense_scratch(tokens, slots, R);
    cuda::lora_dense({.x = d_x, .token_slot = d_slot, .w = {.a = d_a, .b = d_b, .rank = d_rank}, .y = d_y}, scratch,
                     {}, stream_);
    sync();
    EXPECT_TRUE(bitwise_equal(cuda::download(d_y), y0)) << "slot " << only_slot;
  }
}

// linear_lora with the engine's run hint (ops::LoraRun: a prompt chunk's tokens all on one adapter): the
// runs go through two cuBLASLt products per output (z rounded to bf16 in between) where every other adapter
// token lies before the first run, and those through the grouped kernels on that slice alone; otherwise the
// grouped kernels take everything. Against the CPU composition, which ignores the hint; a run of a rank-0
// slot, and the hint switched off.

TEST_F(CudaLoraDense, LinearLoraRunsMatchCpu) {
  struct RunCase {
    int64_t slots, capacity_rank, in;
    std::vector<int64_t> outs;  // one entry: no split
    bool bias;
    int layout;  // adapter tokens outside the runs: 0 before the first run, 1 also between runs, 2 none
  };
  const std::vector<RunCase> cases = {{8, 32, 2880, {4096, 512, 512}, true, 0},  // GPT-OSS q|k|v
                                      {8, 32, 2880, {4096, 512, 512}, true, 1},
                                      {8, 32, 4096, {2880}, true, 2},              // GPT-OSS o_proj
                                      {8, 32, 4096, {2880}, true, 0},
                                      {4, 16, 264, {256, 64, 64}, false, 1},
                                      {4, 16, 264, {520}, false, 2}};
  cuda::CudaBackend backend;
  for (const RunCase& c : cases) {
    const int64_t R = c.capacity_rank, parts = int64_t(c.outs.size());
    int64_t width = 0;
    for (int64_t o : c.outs) width += o;
    SCOPED_TRACE("in " + std::to_string(c.in) + " parts " + std::to_string(parts) + " width " + std::to_string(width) +
                 " layout " + std::to_string(c.layout));
    // 20 scattered tokens, a run of 300 on slot 2, 7 scattered, a run of 260 on slot 1 (rank 0 everywhere:
    // nothing to add), 5 scattered, a run of 280 on slot 0. Scattered tokens have random slots (layout 0: the
    // first 20 only), or none (layout 2).
    const std::vector<std::pair<int64_t, int32_t>> pieces = {{20, -2}, {300, 2}, {7, -2}, {260, 1}, {5, -2}, {280, 0}};
    int64_t tokens = 0;
    for (const auto& piece : pieces) tokens += piece.first;
    OwnedTensor token_slot = OwnedTensor::host(DType::I32, {tokens});
    std::vector<ops::LoraRun> runs;
    int64_t t = 0, rest_rows = 0;
    for (const auto& [count, slot] : pieces) {
      if (slot >= 0) runs.push_back({.first = t, .tokens = count, .slot = slot});
      const bool scattered = slot < 0 && (c.layout == 1 || (c.layout == 0 && runs.empty()));
      for (int64_t i = 0; i < count; ++i, ++t) {
        token_slot.view.ptr<int32_t>()[t] =
            slot >= 0 ? slot : scattered ? int32_t(rng().next_u64() % uint64_t(c.slots)) : -1;
      }
      if (scattered) rest_rows = runs.empty() ? t : -1;  // as the engine's build_batch
    }
    OwnedTensor x = random_bf16(rng(), {tokens, c.in});
    OwnedTensor weight = random_bf16(rng(), {width, c.in}, 0.05f);
    OwnedTensor bias = random_bf16(rng(), {width});
    std::vector<OwnedTensor> a, b, rank;
    for (int64_t i = 0; i < parts; ++i) {
      rank.push_back(OwnedTensor::host(DType::I32, {c.slots}));
      for (int64_t s = 0; s < c.slots; ++s) rank.back().view.ptr<int32_t>()[s] = s == 1 ? 0 : 1 + int32_t(rng().next_u64() % uint64_t(R));
      a.push_back(random_bf16(rng(), {c.slots, R, c.in}, 0.05f));
      b.push_back(random_bf16(rng(), {c.slots, c.outs[size_t(i)], R}, 0.05f));
    }
    std::vector<ops::LoraStack> stacks;
    for (int64_t i = 0; i < parts; ++i) stacks.push_back({.a = a[size_t(i)], .b = b[size_t(i)], .rank = rank[size_t(i)]});
    const std::vector<OwnedTensor> want =
        linear_lora_oracle(cpu_, x, weight, c.bias ? bias.view : Tensor{}, token_slot, c.outs, stacks);

    OwnedTensor d_x = cuda::upload(x), d_weight = cuda::upload(weight), d_bias = cuda::upload(bias);
    OwnedTensor d_slot = cuda::upload(token_slot), d_all = poisoned(DType::BF16, {tokens, width});
    std::vector<OwnedTensor> d_a, d_b, d_rank, d_out;
    for (int64_t i = 0; i < parts; ++i) {
      d_a.push_back(cuda::upload(a[size_t(i)]));
      d_b.push_back(cuda::upload(b[size_t(i)]));
      d_rank.push_back(cuda::upload(rank[size_t(i)]));
      d_out.push_back(poisoned(DType::BF16, {tokens, c.outs[size_t(i)]}));
    }
    ops::LinearLoraParams device{.linear = {.x = d_x, .weight = d_weight, .bias = c.bias ? d_bias.view : Tensor{},
                                            .out = parts == 1 ? d_out[0].view : d_all.view},
                                 .token_slot = d_slot,
                                 .runs = runs,
                                 .rest_rows = rest_rows};
    for (int64_t i = 0; i < parts; ++i) {
      if (parts > 1) device.parts[size_t(i)] = d_out[size_t(i)];
      device.lora[size_t(i)] = {.a = d_a[size_t(i)], .b = d_b[size_t(i)], .rank = d_rank[size_t(i)],
                                .host_rank = std::span<const int32_t>(rank[size_t(i)].view.ptr<int32_t>(), size_t(c.slots))};
    }
    ASSERT_TRUE(ops::check(device).ok()) << ops::check(device).message();
    for (bool dense : {true, false}) {
      backend.set_dense_lora_runs(dense);
      backend.synchronize();
      for (int64_t i = 0; i < parts; ++i) cuda::fill_bytes(d_out[size_t(i)].view, 0xff);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      backend.linear_lora(device);
      backend.synchronize();
      ASSERT_EQ(cudaGetLastError(), cudaSuccess);
      for (int64_t i = 0; i < parts; ++i) {
        EXPECT_TRUE(all_close(cuda::download(d_out[size_t(i)]), want[size_t(i)], kTolLinearLora))
            << (dense ? "runs as dense products" : "hint off") << ": output " << i;
      }
    }
    backend.set_dense_lora_runs(true);
  }
}

}  // namespace
}  // namespace lmx::test
