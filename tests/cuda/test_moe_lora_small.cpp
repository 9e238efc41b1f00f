// Parity of the direct per-pair MoE-LoRA (backends/cuda/moe_lora_small.cuh) with the CPU oracle: every (token, k) pair
// is a row of CpuBackend::lora over the stack viewed as S·E dense adapters (matrix slot·E + expert, rank of the slot),
// exactly the LoRA term of moe.h. Covers T in {1, 2, 3, 8, 16, 24, 32}, E in {8, 32, 128}, K in {1, 2, 4, 8}, R from 8
// to 64 with ranks {8, 16, 32, 64, odd, 0} mixed across slots, R 72 and 128 (the cap-128 instantiations: a merged MoE
// gate_up at --max-lora-rank 64) with ranks {8, 72, 128, 97, 64, 0} at T 1, 16 and 257, NaN in the padding ranks of A
// and B (never read), tokens without adapter whose poisoned y rows must stay bit-identical, x per token and per pair,
// in/out off every tile size, PDL on and off, shrink + expand with the built-in launch shape and with every explicit
// one (shrink V = 1, 2, 4 vectors per lane; expand 4, 8 vectors per thread), x read before the PDL wait or after it,
// the fused kernel, a captured CUDA graph replayed twice and a graph of two calls back to back (y accumulated twice, z
// and z_readers zero again after each replay). One z / z_readers per case, zeroed once, serves every call in turn.
#include <cmath>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "backends/cuda/moe_lora_small.cuh"
#include "cuda_test_util.h"
#include "ops/lora.h"

namespace lmx::test {
namespace {

// docs/NUMERICS.md: z is fp32 from bf16 inputs; only the summation order differs from the double loop.
constexpr double kTolShrinkF32 = 1e-5;

struct Case {
  int64_t tokens, top_k, experts, slots, capacity_rank, in, out;
  bool x_per_pair;
  // True ranks of slots 1, 2, ... cycled (each <= R; slot 0 is always rank 0). Empty: 8, 16, 32, 64, R,
  // R - 3, random.
  std::vector<int32_t> slot_ranks = {};
  // Slots of tokens 0, 1, ... (so that every rank is sure to be hit); the other tokens random in [-1, S).
  std::vector<int32_t> first_token_slots = {};
  std::string name() const {
    return "T " + std::to_string(tokens) + " K " + std::to_string(top_k) + " E " + std::to_string(experts) + " S " +
           std::to_string(slots) + " R " + std::to_string(capacity_rank) + " in " + std::to_string(in) + " out " +
           std::to_string(out) + (x_per_pair ? " x per pair" : " x per token");
  }
};

// One random problem on the host: weights with NaN padding ranks, routing, x, and y0 whose rows of skipped
// pairs are NaN (0xffff) so that any write to them shows.
struct Problem {
  Case c;
  OwnedTensor rank, a, b, topk_ids, token_slot, x, y0;
  std::vector<int32_t> pair_matrix;  // slot·E + expert, -1 for a skipped pair (slot -1 or rank 0)
};

Problem make_problem(Rng& rng, const Case& c, std::optional<int32_t> forced_slot) {
  Problem p{.c = c};
  const int64_t pairs = c.tokens * c.top_k, groups = c.slots * c.experts, R = c.capacity_rank;
  p.rank = OwnedTensor::host(DType::I32, {c.slots});
  p.rank.view.ptr<int32_t>()[0] = 0;
  for (int64_t s = 1; s < c.slots; ++s) {  // slot 0 disabled; then 8, 16, 32, 64, full, odd, random (<= R)
    const int32_t choices[] = {8, 16, 32, 64, int32_t(R), int32_t(std::max<int64_t>(1, R - 3)),
                               1 + int32_t(rng.next_u64() % uint64_t(R))};
    const int32_t chosen = c.slot_ranks.empty() ? choices[(s - 1) % 7]
                                                : c.slot_ranks[size_t(s - 1) % c.slot_ranks.size()];
    p.rank.view.ptr<int32_t>()[s] = std::min(int32_t(R), chosen);
  }
  p.a = random_bf16(rng, {c.slots, c.experts, R, c.in}, 0.05f);
  p.b = random_bf16(rng, {c.slots, c.experts, c.out, R}, 0.05f);
  const bf16 nan = f32_to_bf16(std::numeric_limits<float>::quiet_NaN());
  for (int64_t m = 0; m < groups; ++m) {  // padding ranks hold NaN: a kernel that uses them fails
    const int32_t r_true = p.rank.view.ptr<int32_t>()[m / c.experts];
    for (int64_t r = r_true; r < R; ++r) {
      for (int64_t i = 0; i < c.in; ++i) p.a.view.ptr<bf16>()[(m * R + r) * c.in + i] = nan;
      for (int64_t o = 0; o < c.out; ++o) p.b.view.ptr<bf16>()[(m * c.out + o) * R + r] = nan;
    }
  }
  p.topk_ids = OwnedTensor::host(DType::I32, {c.tokens, c.top_k});
  for (int64_t t = 0; t < c.tokens; ++t) {
    OwnedTensor ids = distinct_ids(rng, c.top_k, int32_t(c.experts));
    std::copy(ids.view.ptr<int32_t>(), ids.view.ptr<int32_t>() + c.top_k, p.topk_ids.view.ptr<int32_t>() + t * c.top_k);
  }
  p.token_slot = random_ids(rng, c.tokens, -1, int32_t(c.slots));
  for (size_t t = 0; t < c.first_token_slots.size() && int64_t(t) < c.tokens; ++t) {
    p.token_slot.view.ptr<int32_t>()[t] = c.first_token_slots[t];
  }
  if (forced_slot) {
    for (int64_t t = 0; t < c.tokens; ++t) p.token_slot.view.ptr<int32_t>()[t] = *forced_slot;
  }
  p.x = random_bf16(rng, {c.x_per_pair ? pairs : c.tokens, c.in});
  p.y0 = random_bf16(rng, {pairs, c.out});
  p.pair_matrix.resize(size_t(pairs));
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const int32_t slot = p.token_slot.view.ptr<int32_t>()[pair / c.top_k];
    const bool live = slot >= 0 && p.rank.view.ptr<int32_t>()[slot] > 0;
    p.pair_matrix[pair] = live ? int32_t(slot * c.experts + p.topk_ids.view.ptr<int32_t>()[pair]) : -1;
    if (!live) std::fill_n(p.y0.view.ptr<bf16>() + pair * c.out, c.out, bf16{0xffff});
  }
  return p;
}

// The oracle: y (F32 host, [T*K, out]) += the LoRA term of every live pair, through CpuBackend::lora.
void oracle_apply(cpu::CpuBackend& cpu, const Problem& p, const Tensor& y) {
  const Case& c = p.c;
  const int64_t pairs = c.tokens * c.top_k, groups = c.slots * c.experts, R = c.capacity_rank;
  OwnedTensor pair_x = OwnedTensor::host(DType::F32, {pairs, c.in});
  OwnedTensor matrix = OwnedTensor::host(DType::I32, {pairs});
  OwnedTensor matrix_rank = OwnedTensor::host(DType::I32, {groups});
  for (int64_t m = 0; m < groups; ++m) matrix_rank.view.ptr<int32_t>()[m] = p.rank.view.ptr<int32_t>()[m / c.experts];
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const int64_t row = c.x_per_pair ? pair : pair / c.top_k;
    for (int64_t i = 0; i < c.in; ++i) pair_x.view.ptr<float>()[pair * c.in + i] = bf16_to_f32(p.x.view.ptr<bf16>()[row * c.in + i]);
    matrix.view.ptr<int32_t>()[pair] = p.pair_matrix[pair];
  }
  const ops::LoraStack dense{.a = Tensor(p.a.view.data, DType::BF16, {groups, R, c.in}),
                             .b = Tensor(p.b.view.data, DType::BF16, {groups, c.out, R}),
                             .rank = matrix_rank};
  cpu.lora({.x = pair_x, .token_slot = matrix, .w = dense, .y = y});
}

// got (BF16 device y) against want (F32 host): live rows within kTolBf16Out, skipped rows bit-identical to y0.
void expect_y(const Problem& p, const Tensor& d_y, const Tensor& want, const std::string& what) {
  const int64_t out = p.c.out;
  OwnedTensor got = cuda::download(d_y);
  std::vector<int64_t> live;
  for (int64_t pair = 0; pair < int64_t(p.pair_matrix.size()); ++pair) {
    if (p.pair_matrix[pair] >= 0) {
      live.push_back(pair);
    } else {
      const Tensor got_row(got.view.ptr<bf16>() + pair * out, DType::BF16, {out});
      const Tensor y0_row(p.y0.view.ptr<bf16>() + pair * out, DType::BF16, {out});
      EXPECT_TRUE(bitwise_equal(got_row, y0_row)) << what << ": skipped pair " << pair << " was written";
    }
  }
  if (live.empty()) return;
  const int64_t n = int64_t(live.size());
  OwnedTensor got_live = OwnedTensor::host(DType::BF16, {n, out}), want_live = OwnedTensor::host(DType::F32, {n, out});
  for (int64_t i = 0; i < n; ++i) {
    std::copy_n(got.view.ptr<bf16>() + live[i] * out, out, got_live.view.ptr<bf16>() + i * out);
    std::copy_n(want.ptr<float>() + live[i] * out, out, want_live.view.ptr<float>() + i * out);
  }
  EXPECT_TRUE(all_close(got_live, want_live, kTolBf16Out)) << what << ": y of live pairs";
}

// Self-cleaning scratch: z and z_readers all zero bytes.
void expect_clean(const Tensor& z, const Tensor& z_readers, const std::string& what) {
  OwnedTensor zero_z = OwnedTensor::host(DType::F32, {z.dim(0), z.dim(1)});
  std::fill_n(zero_z.view.ptr<float>(), zero_z.view.numel(), 0.0f);
  OwnedTensor zero_readers = OwnedTensor::host(DType::I32, {z_readers.dim(0)});  // incl. the fused ticket
  std::fill_n(zero_readers.view.ptr<int32_t>(), zero_readers.view.numel(), 0);
  EXPECT_TRUE(bitwise_equal(cuda::download(z), zero_z)) << what << ": z not zero after the expand";
  EXPECT_TRUE(bitwise_equal(cuda::download(z_readers), zero_readers)) << what << ": z_readers not zero";
}

// z after the shrink alone: the double-loop product for live pairs over their true rank, exact 0 elsewhere.
void expect_z(const Problem& p, const Tensor& d_z, const std::string& what) {
  const Case& c = p.c;
  const int64_t R = c.capacity_rank;
  OwnedTensor got = cuda::download(d_z);
  std::vector<std::pair<double, double>> checked;  // (got, want)
  double sum_squares = 0.0;
  int64_t nonzero_padding = 0;
  for (int64_t pair = 0; pair < int64_t(p.pair_matrix.size()); ++pair) {
    const int32_t matrix = p.pair_matrix[pair];
    const int64_t rank = matrix < 0 ? 0 : p.rank.view.ptr<int32_t>()[matrix / c.experts];
    const int64_t row = c.x_per_pair ? pair : pair / c.top_k;
    for (int64_t r = 0; r < R; ++r) {
      const float g = got.view.ptr<float>()[pair * R + r];
      if (r >= rank) {
        nonzero_padding += g != 0.0f;
        continue;
      }
      double want = 0.0;
      for (int64_t i = 0; i < c.in; ++i) {
        want += double(bf16_to_f32(p.x.view.ptr<bf16>()[row * c.in + i])) *
                bf16_to_f32(p.a.view.ptr<bf16>()[(int64_t(matrix) * R + r) * c.in + i]);
      }
      checked.emplace_back(g, want);
      sum_squares += want * want;
    }
  }
  EXPECT_EQ(nonzero_padding, 0) << what << ": z written outside live pairs' true ranks";
  const double rms = checked.empty() ? 0.0 : std::sqrt(sum_squares / double(checked.size()));
  int64_t bad = 0;
  for (const auto& [g, want] : checked) {
    if (!(std::abs(g - want) <= kTolShrinkF32 * (std::abs(want) + rms)) && bad++ < 5) {
      ADD_FAILURE() << what << ": z got " << g << " want " << want;
    }
  }
  EXPECT_EQ(bad, 0) << what;
}

// A problem's inputs on the device, its scratch z / z_readers zeroed once, y = y0; params() over them.
struct DeviceProblem {
  OwnedTensor a, b, rank, ids, slot, x, z, z_readers, y;
  explicit DeviceProblem(const Problem& p)
      : a(cuda::upload(p.a)), b(cuda::upload(p.b)), rank(cuda::upload(p.rank)), ids(cuda::upload(p.topk_ids)),
        slot(cuda::upload(p.token_slot)), x(cuda::upload(p.x)),
        z(cuda::empty(DType::F32, {p.c.tokens * p.c.top_k, p.c.capacity_rank})),
        z_readers(cuda::empty(DType::I32, {p.c.tokens * p.c.top_k + 1})), y(cuda::upload(p.y0)) {
    cuda::fill_bytes(z.view, 0);
    cuda::fill_bytes(z_readers.view, 0);
  }
  cuda::MoeLoraSmallParams params() const {
    return {.x = x, .topk_ids = ids, .token_slot = slot, .w = {.a = a, .b = b, .rank = rank}, .z = z,
            .z_readers = z_readers, .y = y};
  }
};

// run_case: for shrink + expand (shrink checked alone first; built-in shape with PDL on and off, then each
// explicit launch shape with PDL) and for the fused kernel (PDL on and off): direct launches, then a
// captured graph replayed twice. z / z_readers are zeroed once per case and must stay clean
// across every call that follows.
class CudaMoeLoraSmall : public CudaTest {
 protected:
  void run_case(const Case& c, std::optional<int32_t> forced_slot = std::nullopt);
};

void CudaMoeLoraSmall::run_case(const Case& c, std::optional<int32_t> forced_slot) {
  const Problem p = make_problem(rng(), c, forced_slot);
  OwnedTensor want1 = widen(p.y0);
  oracle_apply(cpu_, p, want1);
  OwnedTensor want2 = widen(narrow(want1));  // the GPU rounds y to bf16 after each call
  oracle_apply(cpu_, p, want2);

  const DeviceProblem dev(p);
  const OwnedTensor& z = dev.z;
  const OwnedTensor& z_readers = dev.z_readers;
  struct Variant {
    bool fused, pdl, x_before_wait;
    int shrink_vectors_per_lane, expand_vectors_per_thread;  // 0 = built-in
  };
  const Variant variants[] = {{false, true, false, 0, 0}, {false, false, false, 0, 0}, {false, true, true, 0, 0},
                              {false, true, false, 1, 4}, {false, true, true, 2, 8},   {false, true, false, 4, 4},
                              {false, true, false, 1, 8}, {true, true, false, 0, 0},   {true, false, false, 0, 0}};
  for (const Variant& v : variants) {
    // The shrink refuses V = 4 above R 64 (16 A rows × 4 vectors per lane would not fit in registers).
    if (v.shrink_vectors_per_lane == 4 && c.capacity_rank > 64) continue;
    const bool fused = v.fused, pdl = v.pdl;
    const std::string what = c.name() + (fused ? " fused" : " shrink+expand") + (pdl ? " pdl" : " no pdl") +
                             (v.x_before_wait ? " x before wait" : "") + " shape " +
                             std::to_string(v.shrink_vectors_per_lane) + "/" +
                             std::to_string(v.expand_vectors_per_thread);
    SCOPED_TRACE(what);
    const OwnedTensor& d_y = dev.y;
    cuda::copy(d_y.view, p.y0.view);
    cuda::MoeLoraSmallParams params = dev.params();
    params.pdl = pdl;
    params.x_before_wait = v.x_before_wait;
    params.shrink_vectors_per_lane = v.shrink_vectors_per_lane;
    params.expand_vectors_per_thread = v.expand_vectors_per_thread;
    if (fused) {
      cuda::moe_lora_small_fused(params, stream_);
    } else {
      cuda::moe_lora_small_shrink(params, stream_);
      sync();
      expect_z(p, z, what + " direct");
      cuda::moe_lora_small_expand(params, stream_);
    }
    sync();
    expect_y(p, d_y, want1, what + " direct");
    expect_clean(z, z_readers, what + " direct");

    // Graphs, fresh y and the same (clean) scratch each: one call replayed twice, then two calls back to
    // back in one graph replayed once (the PDL chain of a layer: the second shrink loads A, routing and,
    // with x_before_wait, x while the first expand runs; its atomics into z follow that expand's zeroing).
    // y accumulates twice either way.
    for (const int calls : {1, 2}) {
      cuda::copy(d_y.view, p.y0.view);
      cudaGraph_t graph = nullptr;
      cudaGraphExec_t exec = nullptr;
      ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), cudaSuccess);
      for (int call = 0; call < calls; ++call) {
        if (fused) {
          cuda::moe_lora_small_fused(params, stream_);
        } else {
          cuda::moe_lora_small_shrink(params, stream_);
          cuda::moe_lora_small_expand(params, stream_);
        }
      }
      ASSERT_EQ(cudaStreamEndCapture(stream_, &graph), cudaSuccess);
      ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
      for (int replay = 1; replay * calls <= 2; ++replay) {
        ASSERT_EQ(cudaGraphLaunch(exec, stream_), cudaSuccess);
        sync();
        const std::string step =
            what + " graph of " + std::to_string(calls) + " call(s), replay " + std::to_string(replay);
        expect_y(p, d_y, replay * calls == 1 ? want1 : want2, step);
        expect_clean(z, z_readers, step);
      }
      EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
      EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
    }
  }
}

TEST_F(CudaMoeLoraSmall, MatchesCpu) {
  const std::vector<Case> cases = {
      {1, 4, 32, 8, 32, 2880, 5760, false},  // GPT-OSS-20B gate_up, decode
      {1, 4, 32, 8, 32, 2880, 2880, true},   // GPT-OSS-20B down
      {2, 4, 32, 3, 32, 1024, 5760, false},  // 8 pairs: the expand picks 128-thread CTAs
      {2, 8, 128, 4, 64, 520, 1000, false},  // Qwen3-MoE-like K and E
      {3, 1, 8, 3, 16, 8, 8, true},          // smallest in/out of the contract, K = 1
      {3, 2, 8, 7, 40, 72, 7, true},         // R / 8 = 5 (lanes per B row 8), ranks 8 … 40 and 37, odd out
      {8, 2, 8, 5, 64, 264, 136, true},
      {8, 4, 32, 4, 24, 264, 1000, false},   // R / 8 = 3 (lanes per B row 4)
      {16, 4, 32, 8, 32, 1032, 2056, false},
      {16, 4, 128, 2, 8, 2888, 520, false},  // R = 8: one lane per B row
      {32, 8, 128, 6, 64, 136, 264, true},   // 256 pairs: past the intended bucket, still correct
      {24, 4, 32, 8, 32, 2880, 5760, false}, // GPT-OSS gate_up, 96 pairs: the built-in shrink takes V = 2
      // The yardstick's merged gate_up: capacity 64 (2 x --max-lora-rank 32), rank-32 adapters, so the shrink
      // folds (half the pieces) and the expand reads two B rows per 8-lane group (half the chunks); ranks 64
      // and 40 beside them take the unfolded forms in the same launch.
      {16, 4, 32, 8, 64, 2880, 5760, false, {32, 32, 64, 32, 40, 16, 32}},
      {1, 4, 32, 8, 64, 2880, 5760, false, {32}, {1}},
  };
  for (const Case& c : cases) {
    run_case(c);
    if (HasFatalFailure()) return;
  }
}

// Rank capacity 128 and 72 (R in (64, 128]: the cap-128 shrink with 16 A rows per warp, 16 lanes per B row
// in the expand and the fused kernel), true ranks 0 / 8 / 72 / 128 / 97 (odd) / 64 mixed across slots,
// tokens without adapter, every launch shape but shrink V = 4, graphs.
TEST_F(CudaMoeLoraSmall, MatchesCpuRankCap128) {
  // Slot ranks 0 (slot 0), 8, 72, 128, 97, 64; the first tokens visit 128, 72, 97, 8, none, rank 0, 64.
  const std::vector<int32_t> ranks = {8, 72, 128, 97, 64}, first = {3, 2, 4, 1, -1, 0, 5};
  const std::vector<Case> cases = {
      {1, 8, 128, 6, 128, 2048, 1536, false, ranks, {3}},    // Qwen3-30B-A3B gate_up (H 2048, 2I 1536), decode
      {1, 4, 32, 6, 128, 520, 1002, true, ranks, {2}},       // rank 72 at capacity 128
      {16, 8, 128, 6, 128, 2048, 1536, false, ranks, first},  // 128 pairs
      {16, 4, 32, 6, 128, 1032, 1002, false, ranks, first},
      {3, 2, 8, 4, 72, 72, 7, true, {8, 72, 33}, {2, 1, 3}},  // R 72 (9 vectors per B row: 16 lanes), odd out
      {257, 1, 8, 6, 128, 264, 520, true, ranks, first},      // 257 pairs: past the intended bucket, still correct
  };
  for (const Case& c : cases) {
    run_case(c);
    if (HasFatalFailure()) return;
  }
}

// Batches with no live pair (every token without adapter, or every token on a rank-0 slot): y bit-identical
// (its rows are poisoned, so the bitwise check is the whole check), z and z_readers stay zero; R 32 and 128.
TEST_F(CudaMoeLoraSmall, NoLoraLeavesOutputBitIdentical) {
  for (const int64_t R : {32, 128}) {
    const Case c{16, 4, 32, 8, R, 520, 1000, false};
    for (int32_t only_slot : {-1, 0}) {  // slot 0 has rank 0 (make_problem)
      SCOPED_TRACE("R " + std::to_string(R) + ", every token on slot " + std::to_string(only_slot));
      run_case(c, only_slot);
    }
  }
}

// MoeLoraSmallParams::delta: the expand writes the term alone (f32) and leaves y as it was; adding it as the
// consumers do (bf16(y + delta) where delta != 0) gives the in-place expand's bits from the same z. Rows of
// pairs without an adapter stay zero; z and z_readers are clean after it. R 32 and 64 (rank-aware lanes).
TEST_F(CudaMoeLoraSmall, DeltaModeMatchesInPlaceBits) {
  for (const int64_t R : {32, 64}) {
    const Case c{16, 4, 32, 8, R, 520, 1000, false};
    SCOPED_TRACE(c.name());
    const Problem p = make_problem(rng(), c, std::nullopt);
    const int64_t pairs = c.tokens * c.top_k;
    const DeviceProblem dev(p);
    const OwnedTensor &z = dev.z, &z_readers = dev.z_readers, &d_y = dev.y;
    OwnedTensor delta = cuda::empty(DType::F32, {pairs, c.out});
    cuda::fill_bytes(delta.view, 0);
    cuda::MoeLoraSmallParams params = dev.params();
    cuda::moe_lora_small_shrink(params, stream_);
    sync();
    const OwnedTensor z_saved = cuda::download(z);
    params.delta = delta;
    cuda::moe_lora_small_expand(params, stream_);
    sync();
    EXPECT_TRUE(bitwise_equal(cuda::download(d_y), p.y0)) << "the delta-mode expand wrote y";
    expect_clean(z, z_readers, "delta mode");
    const OwnedTensor terms = cuda::download(delta);
    cuda::copy(z.view, z_saved.view);  // the same z for the in-place expand
    params.delta = Tensor();
    cuda::moe_lora_small_expand(params, stream_);
    sync();
    const OwnedTensor in_place = cuda::download(d_y);
    OwnedTensor added = OwnedTensor::host(DType::BF16, {pairs, c.out});
    int64_t stray = 0;
    for (int64_t pair = 0; pair < pairs; ++pair) {
      for (int64_t o = 0; o < c.out; ++o) {
        const int64_t i = pair * c.out + o;
        const float term = terms.view.ptr<float>()[i];
        const bf16 y0 = p.y0.view.ptr<bf16>()[i];
        added.view.ptr<bf16>()[i] = term != 0.0f ? f32_to_bf16(bf16_to_f32(y0) + term) : y0;
        stray += p.pair_matrix[pair] < 0 && term != 0.0f;
      }
    }
    EXPECT_EQ(stray, 0) << "terms written for pairs without an adapter";
    EXPECT_TRUE(bitwise_equal(added, in_place)) << "y + delta differs from the in-place expand";
  }
}

// set_small_lora_knockout (a bench diagnostic): the MoE shrink's bit leaves z untouched (zero), the MoE
// expand's leaves y bit for bit as it was, the dense bits leave MoE launches alone, and a mask past 4 bits
// throws. Off again, the same call gives the oracle's y.
TEST_F(CudaMoeLoraSmall, KnockoutSkipsOnlyTheNamedLaunches) {
  EXPECT_THROW(cuda::set_small_lora_knockout(16), std::invalid_argument);
  EXPECT_THROW(cuda::set_small_lora_knockout(-1), std::invalid_argument);
  const Case c{16, 4, 32, 8, 32, 520, 1000, false};
  const Problem p = make_problem(rng(), c, std::nullopt);
  OwnedTensor want = widen(p.y0);
  oracle_apply(cpu_, p, want);
  const DeviceProblem dev(p);
  const OwnedTensor &z = dev.z, &z_readers = dev.z_readers, &d_y = dev.y;
  const cuda::MoeLoraSmallParams params = dev.params();
  cuda::set_small_lora_knockout(3);  // the dense launches only: the MoE shrink runs
  cuda::moe_lora_small_shrink(params, stream_);
  sync();
  expect_z(p, z, "dense knock-outs");
  cuda::set_small_lora_knockout(8);  // the MoE expand: y untouched, z left as the shrink wrote it
  cuda::moe_lora_small_expand(params, stream_);
  sync();
  EXPECT_TRUE(bitwise_equal(cuda::download(d_y), p.y0)) << "a knocked-out expand wrote y";
  expect_z(p, z, "after a knocked-out expand");
  cuda::set_small_lora_knockout(0);
  cuda::moe_lora_small_expand(params, stream_);
  sync();
  expect_y(p, d_y, want, "knock-out off");
  expect_clean(z, z_readers, "knock-out off");
  cuda::set_small_lora_knockout(4);  // the MoE shrink: z stays zero, so the expand adds nothing
  cuda::copy(d_y.view, p.y0.view);
  cuda::moe_lora_small_shrink(params, stream_);
  sync();
  expect_clean(z, z_readers, "a knocked-out shrink");
  cuda::set_small_lora_knockout(0);
}

}  // namespace
}  // namespace lmx::test
