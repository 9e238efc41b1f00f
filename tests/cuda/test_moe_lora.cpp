// Parity of the CUDA MoE-LoRA shrink and expand (backends/cuda/moe_lora.cuh), run on moe_align's tiles,
// with the CPU oracle: every (token, k) pair is a row of CpuBackend::lora over the stack viewed as S·E
// dense adapters (matrix slot·E + expert, rank of the slot), which is exactly the LoRA term of moe.h.
// Mixed true ranks per slot (0, not multiples of 8, full), NaN in the padding ranks of A and B (must never
// be read), tokens without an adapter, T in {1, 16, 256}, R in {16, 32, 64}, E up to 32, x per token
// (gate_up) and per pair (down), split-K off / auto / 3. z is checked against a direct double loop.
#include <cmath>
#include <limits>
#include <vector>

#include "backends/cuda/moe_align.cuh"
#include "backends/cuda/moe_lora.cuh"
#include "cuda_test_util.h"
#include "ops/lora.h"

namespace lmx::test {
namespace {

class CudaMoeLora : public CudaTest {};

// docs/NUMERICS.md: z is fp32 from bf16 inputs; only the summation order differs from the double loop.
constexpr double kTolShrinkF32 = 1e-5;

struct Case {
  int64_t tokens, top_k, experts, slots, capacity_rank, in, out;
  bool x_per_pair;
};

TEST_F(CudaMoeLora, MatchesCpu) {
  const std::vector<Case> cases = {
      {1, 4, 32, 8, 32, 520, 1000, false},   {16, 4, 32, 8, 32, 520, 1000, false}, {16, 4, 32, 8, 16, 264, 302, true},
      {256, 4, 32, 8, 32, 520, 1000, false}, {256, 2, 8, 4, 64, 1032, 512, true},  {16, 8, 8, 2, 64, 136, 2050, false},
      {3, 1, 8, 3, 16, 8, 2, true},          {16, 4, 32, 8, 32, 2880, 5760, false}};
  for (const Case& c : cases) {
    const int64_t pairs = c.tokens * c.top_k, groups = c.slots * c.experts, R = c.capacity_rank;
    // Ranks: slot 0 rank 0 (disabled), then cycling through full, odd, a multiple of 8, random.
    OwnedTensor rank = OwnedTensor::host(DType::I32, {c.slots});
    for (int64_t s = 0; s < c.slots; ++s) {
      const int32_t choices[] = {int32_t(R), int32_t(R - 3), 8, 1 + int32_t(rng().next_u64() % uint64_t(R))};
      rank.view.ptr<int32_t>()[s] = s == 0 ? 0 : choices[s % 4];
    }
    OwnedTensor a = random_bf16(rng(), {c.slots, c.experts, R, c.in}, 0.05f);
    OwnedTensor b = random_bf16(rng(), {c.slots, c.experts, c.out, R}, 0.05f);
    const bf16 nan = f32_to_bf16(std::numeric_limits<float>::quiet_NaN());
    for (int64_t m = 0; m < groups; ++m) {  // padding ranks hold NaN: a kernel that reads them fails
      const int32_t r_true = rank.view.ptr<int32_t>()[m / c.experts];
      for (int64_t r = r_true; r < R; ++r) {
        for (int64_t i = 0; i < c.in; ++i) a.view.ptr<bf16>()[(m * R + r) * c.in + i] = nan;
        for (int64_t o = 0; o < c.out; ++o) b.view.ptr<bf16>()[(m * c.out + o) * R + r] = nan;
      }
    }
    OwnedTensor topk_ids = OwnedTensor::host(DType::I32, {c.tokens, c.top_k});
    for (int64_t t = 0; t < c.tokens; ++t) {
      OwnedTensor ids = distinct_ids(rng(), c.top_k, int32_t(c.experts));
      std::copy(ids.view.ptr<int32_t>(), ids.view.ptr<int32_t>() + c.top_k, topk_ids.view.ptr<int32_t>() + t * c.top_k);
    }
    OwnedTensor token_slot = random_ids(rng(), c.tokens, -1, int32_t(c.slots));
    const int64_t x_rows = c.x_per_pair ? pairs : c.tokens;
    OwnedTensor x = random_bf16(rng(), {x_rows, c.in});
    OwnedTensor y0 = random_bf16(rng(), {pairs, c.out});

    // Oracle: pair rows through CpuBackend::lora, matrix slot·E + expert, rank of the slot.
    OwnedTensor pair_x = OwnedTensor::host(DType::F32, {pairs, c.in});
    OwnedTensor pair_matrix = OwnedTensor::host(DType::I32, {pairs});
    OwnedTensor matrix_rank = OwnedTensor::host(DType::I32, {groups});
    for (int64_t m = 0; m < groups; ++m) matrix_rank.view.ptr<int32_t>()[m] = rank.view.ptr<int32_t>()[m / c.experts];
    for (int64_t pair = 0; pair < pairs; ++pair) {
      const int64_t row = c.x_per_pair ? pair : pair / c.top_k;
      for (int64_t i = 0; i < c.in; ++i) pair_x.view.ptr<float>()[pair * c.in + i] = bf16_to_f32(x.view.ptr<bf16>()[row * c.in + i]);
      const int32_t slot = token_slot.view.ptr<int32_t>()[pair / c.top_k];
      pair_matrix.view.ptr<int32_t>()[pair] = slot < 0 ? -1 : int32_t(slot * c.experts + topk_ids.view.ptr<int32_t>()[pair]);
    }
    OwnedTensor want_y = widen(y0);
    ops::LoraStack dense{.a = Tensor(a.view.data, DType::BF16, {groups, R, c.in}),
                         .b = Tensor(b.view.data, DType::BF16, {groups, c.out, R}),
                         .rank = matrix_rank};
    cpu_.lora({.x = pair_x, .token_slot = pair_matrix, .w = dense, .y = want_y});

    OwnedTensor d_a = cuda::upload(a), d_b = cuda::upload(b), d_rank = cuda::upload(rank);
    OwnedTensor d_ids = cuda::upload(topk_ids), d_slot = cuda::upload(token_slot), d_x = cuda::upload(x);
    const int64_t capacity = cuda::moe_align_capacity(pairs, groups, cuda::kMoeLoraBlockM);
    OwnedTensor sorted = poisoned(DType::I32, {capacity});
    OwnedTensor tiles = poisoned(DType::I32, {capacity / cuda::kMoeLoraBlockM});
    OwnedTensor offsets = poisoned(DType::I32, {groups + 1});
    OwnedTensor num_tiles = poisoned(DType::I32, {1});
    OwnedTensor workspace = cuda::empty(DType::U8, {int64_t(cuda::moe_align_workspace_bytes(pairs, groups))});
    cuda::moe_align({.topk_ids = d_ids, .token_slot = d_slot, .experts = c.experts, .slots = c.slots,
                     .block_m = cuda::kMoeLoraBlockM, .sorted_pairs = sorted, .tile_group = tiles,
                     .group_offsets = offsets, .num_tiles = num_tiles, .workspace = workspace},
                    stream_);
    for (int split : {1, 0, 3}) {
      SCOPED_TRACE("T " + std::to_string(c.tokens) + " K " + std::to_string(c.top_k) + " E " +
                   std::to_string(c.experts) + " S " + std::to_string(c.slots) + " R " + std::to_string(R) + " in " +
                   std::to_string(c.in) + " out " + std::to_string(c.out) + (c.x_per_pair ? " x per pair" : "") +
                   " split " + std::to_string(split));
      OwnedTensor z = poisoned(DType::F32, {pairs, R});
      OwnedTensor d_y = cuda::upload(y0);
      const cuda::MoeLoraParams params{.x = d_x, .w = {.a = d_a, .b = d_b, .rank = d_rank}, .top_k = c.top_k,
                                       .sorted_pairs = sorted, .tile_group = tiles, .num_tiles = num_tiles,
                                       .block_m = cuda::kMoeLoraBlockM, .z = z, .y = d_y, .split_k = split};
      cuda::moe_lora_shrink(params, stream_);
      cuda::moe_lora_expand(params, stream_);
      sync();
      // z of every pair with a slot, over the slot's true rank, against a double loop.
      OwnedTensor got_z = cuda::download(z);
      double sum_squares = 0.0;
      std::vector<std::pair<double, double>> checked;  // (got, want)
      for (int64_t pair = 0; pair < pairs; ++pair) {
        const int32_t matrix = pair_matrix.view.ptr<int32_t>()[pair];
        if (matrix < 0) continue;
        for (int64_t r = 0; r < matrix_rank.view.ptr<int32_t>()[matrix]; ++r) {
          double want = 0.0;
          for (int64_t i = 0; i < c.in; ++i) {
            want += double(pair_x.view.ptr<float>()[pair * c.in + i]) *
                    bf16_to_f32(a.view.ptr<bf16>()[(matrix * R + r) * c.in + i]);
          }
          checked.emplace_back(got_z.view.ptr<float>()[pair * R + r], want);
          sum_squares += want * want;
        }
      }
      const double rms = checked.empty() ? 0.0 : std::sqrt(sum_squares / double(checked.size()));
      int64_t bad = 0;
      for (const auto& [got, want] : checked) {
        if (!(std::abs(got - want) <= kTolShrinkF32 * (std::abs(want) + rms)) && bad++ < 5) {
          ADD_FAILURE() << "z got " << got << " want " << want;
        }
      }
      EXPECT_EQ(bad, 0);
      EXPECT_TRUE(all_close(cuda::download(d_y), want_y, kTolBf16Out)) << "y";
    }
  }
}

// A batch whose tokens have no adapter (or only rank-0 slots) leaves y bit-identical.
TEST_F(CudaMoeLora, NoLoraLeavesOutputBitIdentical) {
  const int64_t tokens = 16, top_k = 4, experts = 32, slots = 8, R = 32, in = 520, out = 1000;
  const int64_t pairs = tokens * top_k, groups = slots * experts;
  OwnedTensor rank = OwnedTensor::host(DType::I32, {slots});
  for (int64_t s = 0; s < slots; ++s) rank.view.ptr<int32_t>()[s] = s == 3 ? 0 : int32_t(R);
  for (int32_t only_slot : {-1, 3}) {
    OwnedTensor token_slot = OwnedTensor::host(DType::I32, {tokens});
    for (int64_t t = 0; t < tokens; ++t) token_slot.view.ptr<int32_t>()[t] = only_slot;
    OwnedTensor d_ids = cuda::upload(random_ids(rng(), pairs, 0, int32_t(experts)).view.reshape({tokens, top_k}));
    OwnedTensor d_slot = cuda::upload(token_slot), d_rank = cuda::upload(rank);
    OwnedTensor d_a = cuda::upload(random_bf16(rng(), {slots, experts, R, in}));
    OwnedTensor d_b = cuda::upload(random_bf16(rng(), {slots, experts, out, R}));
    OwnedTensor d_x = cuda::upload(random_bf16(rng(), {tokens, in}));
    OwnedTensor y0 = random_bf16(rng(), {pairs, out});
    OwnedTensor d_y = cuda::upload(y0);
    const int64_t capacity = cuda::moe_align_capacity(pairs, groups, cuda::kMoeLoraBlockM);
    OwnedTensor sorted = cuda::empty(DType::I32, {capacity});
    OwnedTensor tiles = cuda::empty(DType::I32, {capacity / cuda::kMoeLoraBlockM});
    OwnedTensor offsets = cuda::empty(DType::I32, {groups + 1});
    OwnedTensor num_tiles = cuda::empty(DType::I32, {1});
    OwnedTensor workspace = cuda::empty(DType::U8, {int64_t(cuda::moe_align_workspace_bytes(pairs, groups))});
    OwnedTensor z = poisoned(DType::F32, {pairs, R});
    cuda::moe_align({.topk_ids = d_ids, .token_slot = d_slot, .experts = experts, .slots = slots,
                     .block_m = cuda::kMoeLoraBlockM, .sorted_pairs = sorted, .tile_group = tiles,
                     .group_offsets = offsets, .num_tiles = num_tiles, .workspace = workspace},
                    stream_);
    const cuda::MoeLoraParams params{.x = d_x, .w = {.a = d_a, .b = d_b, .rank = d_rank}, .top_k = top_k,
                                     .sorted_pairs = sorted, .tile_group = tiles, .num_tiles = num_tiles,
                                     .block_m = cuda::kMoeLoraBlockM, .z = z, .y = d_y};
    cuda::moe_lora_shrink(params, stream_);
    cuda::moe_lora_expand(params, stream_);
    sync();
    EXPECT_TRUE(bitwise_equal(cuda::download(d_y), y0)) << "slot " << only_slot;
  }
}

}  // namespace
}  // namespace lmx::test
