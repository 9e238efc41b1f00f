// Parity of the CUDA dense multi-LoRA (backends/cuda/lora_dense.cuh) with CpuBackend::lora, the op's CPU
// oracle: T in {1, 7, 64, 300, 1500 (align's sort path)}, mixed true ranks (0 = disabled, 8/16/32/64,
// odd), tokens with slot -1, NaN in the padding ranks of A and B, `in` with and without the 64-input
// EVEN_K fast path, GPT-OSS q_proj and o_proj shapes, several knob settings, repeated calls on one
// scratch (its z must stay zero), and a batch without adapters that must leave y bit-identical.
#include <limits>
#include <string>
#include <vector>

#include "backends/cuda/lora_dense.cuh"
#include "cuda_test_util.h"
#include "ops/lora.h"

namespace lmx::test {
namespace {

class CudaLoraDense : public CudaTest {};

struct Case {
  int64_t tokens, slots, capacity_rank, in, out;
};

TEST_F(CudaLoraDense, MatchesCpu) {
  const std::vector<Case> cases = {{1, 4, 32, 520, 1000},   {7, 3, 16, 8, 2},        {64, 8, 64, 2880, 4096},
                                   {64, 8, 32, 4096, 2880}, {300, 5, 64, 1032, 514}, {300, 8, 32, 2880, 4096},
                                   {1500, 6, 16, 264, 130}};  // T > 1024: moe_align's sort path
  const std::vector<cuda::MoeLoraConfig> configs = {
      {}, {.split_k = 1, .order = cuda::MoeLoraCtaOrder::kPieceFastest, .pdl = false, .expand_block_n = 64},
      {.split_k = 4, .order = cuda::MoeLoraCtaOrder::kTileFastest, .pdl = true, .expand_block_n = 64}};
  for (const Case& c : cases) {
    const std::string what = "T " + std::to_string(c.tokens) + " S " + std::to_string(c.slots) + " R " +
                             std::to_string(c.capacity_rank) + " in " + std::to_string(c.in) + " out " +
                             std::to_string(c.out);
    SCOPED_TRACE(what);
    const int64_t R = c.capacity_rank;
    OwnedTensor rank = OwnedTensor::host(DType::I32, {c.slots});
    for (int64_t s = 0; s < c.slots; ++s) {
      const int32_t choices[] = {8, 16, 32, 64, int32_t(R - 3), 1 + int32_t(rng().next_u64() % uint64_t(R))};
      rank.view.ptr<int32_t>()[s] = s == 0 ? 0 : std::min<int32_t>(int32_t(R), choices[(s - 1) % 6]);
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
    OwnedTensor x = random_bf16(rng(), {c.tokens, c.in});
    OwnedTensor y0 = random_bf16(rng(), {c.tokens, c.out});
    OwnedTensor want_y = widen(y0);
    cpu_.lora({.x = widen(x), .token_slot = token_slot,
               .w = {.a = a.view, .b = b.view, .rank = rank.view}, .y = want_y});

    OwnedTensor d_a = cuda::upload(a), d_b = cuda::upload(b), d_rank = cuda::upload(rank);
    OwnedTensor d_slot = cuda::upload(token_slot), d_x = cuda::upload(x);
    // One scratch sized above T: the call must use views of it, and keep its z zero across calls.
    const cuda::LoraDenseScratch scratch = cuda::lora_dense_scratch(c.tokens + 5, c.slots, R);
    for (const cuda::MoeLoraConfig& config : configs) {
      SCOPED_TRACE("split " + std::to_string(config.split_k) + " order " + std::to_string(int(config.order)) +
                   " block_n " + std::to_string(config.expand_block_n) + (config.pdl ? " pdl" : ""));
      OwnedTensor d_y = cuda::upload(y0);
      cuda::lora_dense({.x = d_x, .token_slot = d_slot, .w = {.a = d_a, .b = d_b, .rank = d_rank}, .y = d_y},
                       scratch, config, stream_);
      sync();
      EXPECT_TRUE(all_close(cuda::download(d_y), want_y, kTolBf16Out)) << "y";
      OwnedTensor z = cuda::download(scratch.z);
      int64_t nonzero = 0;
      for (int64_t i = 0; i < z.view.numel(); ++i) nonzero += z.view.ptr<float>()[i] != 0.0f;
      EXPECT_EQ(nonzero, 0) << "scratch z must be all zero after the call";
    }
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

}  // namespace
}  // namespace lmx::test
