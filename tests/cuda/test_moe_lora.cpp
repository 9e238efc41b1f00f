// Parity of the CUDA MoE-LoRA shrink and expand (backends/cuda/moe_lora.cuh, tensor cores), run on moe_align's tiles,
// with the CPU oracle: every (token, k) pair is a row of CpuBackend::lora over the stack viewed as S·E dense adapters
// (matrix slot·E + expert, rank of the slot), which is exactly the LoRA term of moe.h. Mixed true ranks per slot (0 =
// disabled, 8/16/32/64, odd), NaN in the padding ranks of A and B (must never reach a result), tokens without an
// adapter, T in {1, 3, 16, 64, 257, 1024, 4096}, E in {8, 32, 128}, K in {1, 2, 4, 8}, GPT-OSS and Qwen3 shapes, `in`
// both a multiple of the 64-input chunk (EVEN_K) and not, `out` a multiple of 8 (16-byte y vectors) and not, capacity
// ranks 8 / 16 / 32 / 64 / 128 (the expand's rank tiers; 72 and 128 use the kernels' rank cap 128, with true ranks 8 /
// 72 / 97 / 128 / 0 mixed across slots: a merged MoE gate_up at --max-lora-rank 64), every knob (split, CTA order,
// BLOCK_N, expand chunks per CTA: one, several, auto, all of `out`; shrink tiles per CTA: one, a run of up to 4 of one
// group, auto; PDL) and both z modes (self-cleaning with tile counters: z and the counters all zero after each expand,
// across calls; legacy: z poisoned, then holds the shrink). z is checked against a direct double loop.
#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "backends/cuda/moe_align.cuh"
#include "backends/cuda/moe_lora.cuh"
#include "cuda_test_util.h"
#include "ops/lora.h"

namespace lmx::test {
namespace {

// docs/NUMERICS.md: z is fp32 from bf16 inputs on tensor cores (exact products, fp32 accumulation in an
// order of 16-input mma steps, warp sums and split-K atomics); the mma adder's fp32 rounding is not
// round-to-nearest on every part, so 1e-4 of the scale, still 40× below a bf16 ulp.
constexpr double kTolShrinkTc = 1e-4;

struct Case {
  int64_t tokens, top_k, experts, slots, capacity_rank, in, out;
  bool x_per_pair;
  // True ranks of slots 1, 2, ... cycled (each <= R; slot 0 is always rank 0, disabled). Empty: 8, 16, 32,
  // 64, R - 3, random.
  std::vector<int32_t> slot_ranks = {};
  // Slots of tokens 0, 1, ... (so that every rank is sure to be hit); the other tokens random in [-1, S).
  std::vector<int32_t> first_token_slots = {};
};

struct Knobs {
  int split;
  cuda::MoeLoraCtaOrder order;
  int block_n;
  bool pdl;
  int expand_chunks = 0;  // 0: auto
  int shrink_tiles = 0;   // shrink tiles per CTA: 1 (warps split `in`), 4 (a run, a tile per warp), 0: auto
  bool expand_bulk = false;  // the expand's copies: bulk (cp.async.bulk + mbarrier) or 16-byte cp.async
  bool persistent = false;   // the persistent bulk expand (a producer warp, items across the grid)
};

// run_case: one random problem (NaN padding ranks, tokens without adapter) against the CPU oracle under
// every knob setting given, in both z modes, and shrink + expand back to back.
class CudaMoeLora : public CudaTest {
 protected:
  void run_case(const Case& c, const std::vector<Knobs>& knobs);
};

std::string describe(const Case& c) {
  return "T " + std::to_string(c.tokens) + " K " + std::to_string(c.top_k) + " E " + std::to_string(c.experts) +
         " S " + std::to_string(c.slots) + " R " + std::to_string(c.capacity_rank) + " in " + std::to_string(c.in) +
         " out " + std::to_string(c.out) + (c.x_per_pair ? " x per pair" : "");
}

std::string describe(const Knobs& k) {
  return "split " + std::to_string(k.split) +
         (k.order == cuda::MoeLoraCtaOrder::kTileFastest ? " tile-fastest" : " piece-fastest") + " block_n " +
         std::to_string(k.block_n) + (k.pdl ? " pdl" : " no pdl") + " expand_chunks " + std::to_string(k.expand_chunks) +
         " shrink_tiles " + std::to_string(k.shrink_tiles) + (k.expand_bulk ? " bulk" : "") + (k.persistent ? " persistent" : "");
}

// z of every pair with a slot, over the slot's true rank, against `want` (the double loop).
::testing::AssertionResult z_matches(const Tensor& got_z, const std::vector<std::pair<int64_t, double>>& want) {
  double sum_squares = 0.0;
  for (const auto& [index, value] : want) sum_squares += value * value;
  const double rms = want.empty() ? 0.0 : std::sqrt(sum_squares / double(want.size()));
  int64_t bad = 0;
  std::string first;
  for (const auto& [index, value] : want) {
    const double got = got_z.ptr<float>()[index];
    if (!(std::abs(got - value) <= kTolShrinkTc * (std::abs(value) + rms)) && bad++ < 5) {
      first += "\n  z[" + std::to_string(index) + "] got " + std::to_string(got) + " want " + std::to_string(value);
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << want.size() << " z values beyond tol" << first;
}

::testing::AssertionResult all_zero(const Tensor& host, const char* what) {
  const auto* bytes = static_cast<const unsigned char*>(host.data);
  for (size_t i = 0; i < host.nbytes(); ++i) {
    if (bytes[i] != 0) return ::testing::AssertionFailure() << what << " not all zero: byte " << i;
  }
  return ::testing::AssertionSuccess();
}

// Every knob setting: split (1, several, auto), CTA order, BLOCK_N, PDL, expand chunks per CTA and shrink
// tiles per CTA (per-tile, run mode, auto).
std::vector<Knobs> all_knobs() {
  return {{1, cuda::MoeLoraCtaOrder::kTileFastest, 128, true},   {0, cuda::MoeLoraCtaOrder::kTileFastest, 128, true},
          {3, cuda::MoeLoraCtaOrder::kPieceFastest, 64, false},  {0, cuda::MoeLoraCtaOrder::kPieceFastest, 128, true},
          {5, cuda::MoeLoraCtaOrder::kTileFastest, 64, true},    {0, cuda::MoeLoraCtaOrder::kTileFastest, 64, false},
          {0, cuda::MoeLoraCtaOrder::kTileFastest, 128, true, 1, 4}, {2, cuda::MoeLoraCtaOrder::kPieceFastest, 64, true, 3, 4},
          {1, cuda::MoeLoraCtaOrder::kTileFastest, 128, false, 1000, 1},  // 1000: clamped, one piece spans all of out
          {3, cuda::MoeLoraCtaOrder::kTileFastest, 64, true, 0, 4},  {1, cuda::MoeLoraCtaOrder::kPieceFastest, 128, true, 2, 4},
          // the expand by bulk copies: auto chunks, a piece shorter than the ring, one piece spanning all of out
          {0, cuda::MoeLoraCtaOrder::kTileFastest, 64, true, 0, 0, true}, {3, cuda::MoeLoraCtaOrder::kPieceFastest, 128, false, 1, 0, true},
          {0, cuda::MoeLoraCtaOrder::kTileFastest, 128, true, 1000, 4, true},
          // the persistent bulk expand: both orders, a piece shorter than the ring, one piece spanning all of out
          {0, cuda::MoeLoraCtaOrder::kTileFastest, 64, true, 0, 0, true, true},
          {3, cuda::MoeLoraCtaOrder::kPieceFastest, 64, true, 1, 0, true, true},
          {1, cuda::MoeLoraCtaOrder::kTileFastest, 128, false, 1000, 4, true, true}};
}

TEST_F(CudaMoeLora, MatchesCpu) {
  const std::vector<Case> cases = {
      {1, 4, 32, 8, 32, 520, 1000, false},      {3, 1, 8, 3, 16, 8, 2, true},
      {16, 4, 32, 8, 32, 2880, 5760, false},    {16, 4, 32, 8, 32, 2880, 2880, true},  // GPT-OSS gate_up, down
      {16, 8, 8, 2, 64, 136, 2050, false},      {64, 8, 128, 5, 64, 2048, 1536, false},  // Qwen3 gate_up
      {64, 8, 128, 5, 64, 768, 2048, true},     // Qwen3 down
      {257, 2, 8, 4, 64, 1032, 512, true},      {257, 4, 32, 8, 32, 2880, 5760, false},
      {1024, 8, 128, 8, 16, 2048, 1536, false}, {4096, 1, 8, 3, 64, 136, 200, false},
      {4096, 2, 32, 8, 32, 512, 520, true},     {64, 2, 8, 3, 8, 264, 776, false},  // R 8: the rank tier 16
      {300, 4, 32, 8, 16, 2880, 5760, false},   {33, 3, 8, 4, 64, 200, 1154, true}};
  for (const Case& c : cases) {
    run_case(c, all_knobs());
    if (HasFatalFailure()) return;
  }
}

// Rank capacity 128 (the kernels' rank cap 128: a merged MoE gate_up at the default --max-lora-rank 64) and
// 72 (the same cap with R < 128): true ranks 0 / 8 / 72 / 128 / 97 (odd) / 64 mixed across slots, tokens
// without adapter, `in` with and without EVEN_K, `out` with and without 16-byte y vectors, T 1 / 16 / 257,
// every knob (split-K, run mode, BLOCK_N 64 and 128, ...).
TEST_F(CudaMoeLora, MatchesCpuRankCap128) {
  // Slot ranks 0 (slot 0), 8, 72, 128, 97, 64; the first tokens visit 128, 72, 97, 8, none, rank 0, 64.
  const std::vector<int32_t> ranks = {8, 72, 128, 97, 64}, first = {3, 2, 4, 1, -1, 0, 5};
  const std::vector<Case> cases = {
      {1, 8, 128, 6, 128, 2048, 1536, false, ranks, {3}},  // Qwen3-30B-A3B gate_up (H 2048, 2I 1536), decode
      {1, 4, 32, 6, 128, 520, 1002, true, ranks, {2}},     // rank 72 at capacity 128
      {16, 8, 128, 6, 128, 2048, 1536, false, ranks, first},
      {16, 4, 32, 6, 128, 520, 1002, false, ranks, first},  // in off the 64-input chunk, out off 16-byte vectors
      {16, 2, 8, 4, 72, 264, 776, true, {8, 72, 33}, {2, 1, 3, -1, 0}},  // R 72: cap 128, z / B rows of 72
      {257, 2, 8, 6, 128, 1032, 514, true, ranks, first},
      {257, 8, 128, 6, 128, 2048, 1536, false, ranks, first}};
  for (const Case& c : cases) {
    run_case(c, all_knobs());
    if (HasFatalFailure()) return;
  }
}

void CudaMoeLora::run_case(const Case& c, const std::vector<Knobs>& knobs) {
  SCOPED_TRACE(describe(c));
  const int64_t pairs = c.tokens * c.top_k, groups = c.slots * c.experts, R = c.capacity_rank;
  // Ranks: slot 0 rank 0 (disabled), then cycling through c.slot_ranks, or 8, 16, 32, 64, R - 3, random
  // (each <= R).
  OwnedTensor rank = OwnedTensor::host(DType::I32, {c.slots});
  rank.view.ptr<int32_t>()[0] = 0;
  for (int64_t s = 1; s < c.slots; ++s) {
    const int32_t choices[] = {8, 16, 32, 64, int32_t(R - 3), 1 + int32_t(rng().next_u64() % uint64_t(R))};
    const int32_t chosen = c.slot_ranks.empty() ? choices[(s - 1) % 6]
                                                : c.slot_ranks[size_t(s - 1) % c.slot_ranks.size()];
    rank.view.ptr<int32_t>()[s] = std::min<int32_t>(int32_t(R), chosen);
  }
  OwnedTensor a = random_bf16(rng(), {c.slots, c.experts, R, c.in}, 0.05f);
  OwnedTensor b = random_bf16(rng(), {c.slots, c.experts, c.out, R}, 0.05f);
  const bf16 nan = f32_to_bf16(std::numeric_limits<float>::quiet_NaN());
  for (int64_t m = 0; m < groups; ++m) {  // padding ranks hold NaN: a kernel that uses them fails
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
  for (size_t t = 0; t < c.first_token_slots.size() && int64_t(t) < c.tokens; ++t) {
    token_slot.view.ptr<int32_t>()[t] = c.first_token_slots[t];
  }
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
  std::vector<std::pair<int64_t, double>> want_z;  // (index into z, value)
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const int32_t matrix = pair_matrix.view.ptr<int32_t>()[pair];
    if (matrix < 0) continue;
    for (int64_t r = 0; r < matrix_rank.view.ptr<int32_t>()[matrix]; ++r) {
      double sum = 0.0;
      const float* xr = pair_x.view.ptr<float>() + pair * c.in;
      const bf16* ar = a.view.ptr<bf16>() + (matrix * R + r) * c.in;
      for (int64_t i = 0; i < c.in; ++i) sum += double(xr[i]) * bf16_to_f32(ar[i]);
      want_z.emplace_back(pair * R + r, sum);
    }
  }

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
  // Self-cleaning mode: z and the counters are zeroed once here and must stay zero across every call. The
  // counters have the persistent expand's item counters after the tiles' (its dynamic scheduling);
  // `tile_counters_only` has none (it then stripes the items over its CTAs).
  OwnedTensor z = cuda::empty(DType::F32, {pairs, R});
  OwnedTensor counters = cuda::empty(DType::I32, {capacity / cuda::kMoeLoraBlockM + cuda::kMoeLoraWorkCounters});
  OwnedTensor tile_counters_only = cuda::empty(DType::I32, {capacity / cuda::kMoeLoraBlockM});
  cuda::fill_bytes(z.view, 0);
  cuda::fill_bytes(counters.view, 0);
  cuda::fill_bytes(tile_counters_only.view, 0);
  auto params_for = [&](const Knobs& k, const Tensor& z_buffer, const Tensor& y, bool self_cleaning) {
    return cuda::MoeLoraParams{.x = d_x, .w = {.a = d_a, .b = d_b, .rank = d_rank}, .top_k = c.top_k,
                               .sorted_pairs = sorted, .tile_group = tiles, .num_tiles = num_tiles,
                               .block_m = cuda::kMoeLoraBlockM, .z = z_buffer, .y = y,
                               .config = {.split_k = k.split, .order = k.order, .pdl = k.pdl,
                                          .expand_block_n = k.block_n, .expand_chunks = k.expand_chunks,
                                          .expand_bulk = k.expand_bulk, .expand_persistent = k.persistent, .shrink_tiles_per_cta = k.shrink_tiles},
                               .tile_counters = self_cleaning ? counters.view : Tensor()};
  };
  for (const Knobs& k : knobs) {
    SCOPED_TRACE(describe(k));
    OwnedTensor d_y = cuda::upload(y0);
    const cuda::MoeLoraParams params = params_for(k, z, d_y, true);
    cuda::moe_lora_shrink(params, stream_);
    sync();
    EXPECT_TRUE(z_matches(cuda::download(z), want_z)) << "z after the shrink";
    cuda::moe_lora_expand(params, stream_);
    sync();
    EXPECT_TRUE(all_close(cuda::download(d_y), want_y, kTolBf16Out)) << "y";
    EXPECT_TRUE(all_zero(cuda::download(z), "z after the expand"));
    EXPECT_TRUE(all_zero(cuda::download(counters), "tile_counters after the expand"));
  }
  {  // shrink and expand back to back (the expand's prologue overlaps the shrink under PDL), twice
    SCOPED_TRACE("back to back, pdl");
    OwnedTensor d_y = cuda::upload(y0), d_y2 = cuda::upload(y0);
    cuda::moe_lora_shrink(params_for(knobs[1], z, d_y, true), stream_);
    cuda::moe_lora_expand(params_for(knobs[1], z, d_y, true), stream_);
    cuda::moe_lora_shrink(params_for(knobs[4], z, d_y2, true), stream_);
    cuda::moe_lora_expand(params_for(knobs[4], z, d_y2, true), stream_);
    sync();
    EXPECT_TRUE(all_close(cuda::download(d_y), want_y, kTolBf16Out)) << "y";
    EXPECT_TRUE(all_close(cuda::download(d_y2), want_y, kTolBf16Out)) << "y, second call";
    EXPECT_TRUE(all_zero(cuda::download(z), "z after the expand"));
  }
  {  // the expand by bulk copies gives expand_kernel's bits, adding into y and overwriting it (moe_block's
     // folded gate_up), at both BLOCK_N (out % 8 != 0: both take the cp.async kernel); split 1, so z has the
     // same bits in both runs (split-K's atomics would reorder its sums)
    for (bool overwrite : {false, true}) {
      for (int block_n : {64, 128}) {
        SCOPED_TRACE(std::string("bulk vs cp.async, ") + (overwrite ? "overwrite" : "add") + ", BLOCK_N " +
                     std::to_string(block_n));
        OwnedTensor y_async = cuda::upload(y0), y_bulk = cuda::upload(y0), y_stream = cuda::upload(y0),
                    y_striped = cuda::upload(y0);
        // cp.async, bulk, persistent bulk (items from the counter), persistent bulk (items striped)
        for (int form : {0, 1, 2, 3}) {
          Knobs k{1, cuda::MoeLoraCtaOrder::kTileFastest, block_n, true};
          k.expand_bulk = form > 0;
          k.persistent = form >= 2;
          const OwnedTensor& y = form == 0 ? y_async : form == 1 ? y_bulk : form == 2 ? y_stream : y_striped;
          cuda::MoeLoraParams params = params_for(k, z, y.view, true);
          params.overwrite = overwrite;
          if (form == 3) params.tile_counters = tile_counters_only.view;
          cuda::moe_lora_shrink(params, stream_);
          cuda::moe_lora_expand(params, stream_);
        }
        sync();
        EXPECT_TRUE(bitwise_equal(cuda::download(y_bulk), cuda::download(y_async)));
        EXPECT_TRUE(bitwise_equal(cuda::download(y_stream), cuda::download(y_async))) << "persistent";
        EXPECT_TRUE(bitwise_equal(cuda::download(y_striped), cuda::download(y_async))) << "persistent, striped";
        EXPECT_TRUE(all_zero(cuda::download(z), "z after the expand"));
        EXPECT_TRUE(all_zero(cuda::download(counters), "counters after the expands"));
        EXPECT_TRUE(all_zero(cuda::download(tile_counters_only), "tile counters after the striped expand"));
      }
    }
  }
  {  // x's rows looked up through x_rows (moe_block's a in tile order): the same z bit for bit, per-tile and run
     // mode, without split (atomics would reorder the sums). x_rows points into a larger x whose other rows
     // hold NaN, so a wrong lookup shows.
    SCOPED_TRACE("x through x_rows");
    const int64_t spread_rows = pairs + 3;
    std::vector<int32_t> order(static_cast<size_t>(spread_rows));
    for (int64_t i = 0; i < spread_rows; ++i) order[size_t(i)] = int32_t(i);
    for (int64_t i = spread_rows - 1; i > 0; --i) {
      std::swap(order[size_t(i)], order[size_t(rng().next_u64() % uint64_t(i + 1))]);
    }
    OwnedTensor spread = OwnedTensor::host(DType::BF16, {spread_rows, c.in});
    std::fill(spread.view.ptr<bf16>(), spread.view.ptr<bf16>() + spread_rows * c.in, nan);
    OwnedTensor rows = OwnedTensor::host(DType::I32, {pairs});
    for (int64_t pair = 0; pair < pairs; ++pair) {
      const int32_t row = order[size_t(pair)];
      rows.view.ptr<int32_t>()[pair] = row;
      const int64_t source = c.x_per_pair ? pair : pair / c.top_k;
      std::copy(x.view.ptr<bf16>() + source * c.in, x.view.ptr<bf16>() + (source + 1) * c.in,
                spread.view.ptr<bf16>() + row * c.in);
    }
    OwnedTensor d_spread = cuda::upload(spread), d_rows = cuda::upload(rows);
    for (int tiles_per_cta : {1, 4}) {
      const Knobs k{1, cuda::MoeLoraCtaOrder::kTileFastest, 128, false, 0, tiles_per_cta};
      OwnedTensor z_plain = poisoned(DType::F32, {pairs, R}), z_rows = poisoned(DType::F32, {pairs, R});
      OwnedTensor d_y = cuda::upload(y0);
      cuda::moe_lora_shrink(params_for(k, z_plain, d_y, false), stream_);
      cuda::MoeLoraParams by_rows = params_for(k, z_rows, d_y, false);
      by_rows.x = d_spread;
      by_rows.x_rows = d_rows;
      cuda::moe_lora_shrink(by_rows, stream_);
      sync();
      const OwnedTensor got = cuda::download(z_rows);
      EXPECT_TRUE(z_matches(got, want_z)) << "z, tiles per CTA " << tiles_per_cta;
      EXPECT_TRUE(bitwise_equal(got, cuda::download(z_plain))) << "z via x_rows vs by pair, tiles per CTA " << tiles_per_cta;
    }
  }
  for (int split : {1, 0}) {  // legacy mode (no tile counters): z poisoned, written by the shrink, kept
    SCOPED_TRACE("no tile counters, split " + std::to_string(split));
    OwnedTensor z_legacy = poisoned(DType::F32, {pairs, R});
    OwnedTensor d_y = cuda::upload(y0);
    const cuda::MoeLoraParams params = params_for({split, cuda::MoeLoraCtaOrder::kTileFastest, 128, true},
                                                  z_legacy, d_y, false);
    cuda::moe_lora_shrink(params, stream_);
    cuda::moe_lora_expand(params, stream_);
    sync();
    EXPECT_TRUE(z_matches(cuda::download(z_legacy), want_z)) << "z";
    EXPECT_TRUE(all_close(cuda::download(d_y), want_y, kTolBf16Out)) << "y";
  }
}

// A batch whose tokens have no adapter (or only rank-0 slots) leaves y bit-identical, and z zero; at rank
// capacity 32 and 128 (the rank caps 64 and 128).
TEST_F(CudaMoeLora, NoLoraLeavesOutputBitIdentical) {
  const int64_t tokens = 16, top_k = 4, experts = 32, slots = 8, in = 520, out = 1000;
  const int64_t pairs = tokens * top_k, groups = slots * experts;
  for (const int64_t R : {32, 128}) {
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
      OwnedTensor z = cuda::empty(DType::F32, {pairs, R});
      OwnedTensor counters = cuda::empty(DType::I32, {capacity / cuda::kMoeLoraBlockM});
      cuda::fill_bytes(z.view, 0);
      cuda::fill_bytes(counters.view, 0);
      cuda::moe_align({.topk_ids = d_ids, .token_slot = d_slot, .experts = experts, .slots = slots,
                       .block_m = cuda::kMoeLoraBlockM, .sorted_pairs = sorted, .tile_group = tiles,
                       .group_offsets = offsets, .num_tiles = num_tiles, .workspace = workspace},
                      stream_);
      const cuda::MoeLoraParams params{.x = d_x, .w = {.a = d_a, .b = d_b, .rank = d_rank}, .top_k = top_k,
                                       .sorted_pairs = sorted, .tile_group = tiles, .num_tiles = num_tiles,
                                       .block_m = cuda::kMoeLoraBlockM, .z = z, .y = d_y, .tile_counters = counters};
      cuda::moe_lora_shrink(params, stream_);
      cuda::moe_lora_expand(params, stream_);
      sync();
      EXPECT_TRUE(bitwise_equal(cuda::download(d_y), y0)) << "R " << R << " slot " << only_slot;
      EXPECT_TRUE(all_zero(cuda::download(z), "z")) << "R " << R << " slot " << only_slot;
    }
  }
}

}  // namespace
}  // namespace lmx::test
