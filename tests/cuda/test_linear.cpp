// Parity of the CUDA dense projection (backends/cuda/linear.cuh, cuBLASLt) with the CPU oracle: bf16 and
// f32 outputs (the router and LM head write f32 logits), with and without bias, decode and prefill row
// counts, the GPT-OSS q/o/fused-qkv/router shapes and the tiny presets' small dims; each through the default
// (skinny for few rows and narrow outputs, cuBLASLt otherwise), forced cuBLASLt and, up to 16 rows, the
// forced skinny tensor-core kernel (`in` not a multiple of 32, `out`
// not of 16, T not of 8); widths that are not a multiple of 128 as two cuBLASLt products (default) and as one.
// Outputs start poisoned.
#include <cstdint>
#include <vector>

#include "backends/cuda/linear.cuh"
#include "cuda_test_util.h"

namespace lmx::test {
namespace {

class CudaLinear : public CudaTest {};

// got (F32, host) against the F32 oracle, the same scaled rule as all_close.
::testing::AssertionResult all_close_f32(const Tensor& got, const Tensor& want, double tol) {
  double sum_squares = 0.0;
  for (int64_t i = 0; i < want.numel(); ++i) sum_squares += double(want.ptr<float>()[i]) * want.ptr<float>()[i];
  const double rms = want.numel() ? std::sqrt(sum_squares / double(want.numel())) : 0.0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double g = got.ptr<float>()[i], w = want.ptr<float>()[i];
    if (!(std::abs(g - w) <= tol * (std::abs(w) + rms))) {
      return ::testing::AssertionFailure() << "[" << i << "] got " << g << ", want " << w;
    }
  }
  return ::testing::AssertionSuccess();
}

TEST_F(CudaLinear, MatchesCpu) {
  struct Case { int64_t tokens, in, out; bool bias; DType out_dtype; };
  const std::vector<Case> cases = {
      {1, 64, 32, false, DType::BF16},     {3, 64, 256, true, DType::F32},      {16, 2880, 4096, true, DType::BF16},
      {16, 4096, 2880, true, DType::BF16}, {300, 2880, 32, true, DType::F32},   {257, 64, 1000, false, DType::F32},
      {5, 16, 8, true, DType::BF16},       {1024, 512, 384, false, DType::BF16}, {16, 2880, 5760, false, DType::BF16},
      {8, 72, 40, true, DType::F32},       {2, 2880, 201088 / 64, false, DType::F32}, {11, 4104, 24, true, DType::BF16},
      {16, 2880, 5120, true, DType::BF16}, {1600, 2880, 5120, true, DType::BF16}, {16, 2880, 512, true, DType::BF16},
      {16, 2880, 32, true, DType::F32},    {13, 2048, 128, false, DType::F32},  {16, 4096, 2880, false, DType::BF16},
      // one shape without and then with a bias (a tiny model's q_proj and o_proj): the cached algorithm of
      // the first must not serve the second's bias epilogue
      {4, 64, 64, false, DType::BF16},     {4, 64, 64, true, DType::BF16},      {40, 64, 64, false, DType::BF16},
      {40, 64, 64, true, DType::BF16},
      // widths that are not a multiple of 128 (an odd vocabulary: GPT-OSS's tokenizer has 200019 ids): on
      // cuBLASLt two products, the aligned rows of W and the rest, both into out
      {16, 2880, 2001, false, DType::F32}, {64, 2880, 2001, true, DType::F32}, {17, 64, 1001, true, DType::BF16},
      {3, 64, 77, false, DType::BF16},     {300, 128, 2003, false, DType::F32}};
  cuda::LinearRunner runner;
  for (cuda::LinearPath path : {cuda::LinearPath::kSkinny, cuda::LinearPath::kAuto, cuda::LinearPath::kCublasLt})
  for (const Case& c : cases) {
    if (path == cuda::LinearPath::kSkinny && c.tokens > 16) continue;  // the skinny kernel's limit
    runner.set_path(path);
    SCOPED_TRACE("T " + std::to_string(c.tokens) + " in " + std::to_string(c.in) + " out " + std::to_string(c.out) +
                 (c.bias ? " bias" : "") + (c.out_dtype == DType::F32 ? " f32" : " bf16") +
                 (path == cuda::LinearPath::kSkinny ? " skinny (forced)"
                  : path == cuda::LinearPath::kAuto ? " auto" : " cuBLASLt (forced)"));
    OwnedTensor x = random_bf16(rng(), {c.tokens, c.in});
    OwnedTensor w = random_bf16(rng(), {c.out, c.in}, 0.05f);
    OwnedTensor b = random_bf16(rng(), {c.out});
    OwnedTensor want = OwnedTensor::host(DType::F32, {c.tokens, c.out});
    cpu_.linear({.x = widen(x), .weight = w, .bias = c.bias ? b.view : Tensor{}, .out = want});

    OwnedTensor d_x = cuda::upload(x), d_w = cuda::upload(w), d_b = cuda::upload(b);
    const bool ragged = c.out % 64 != 0 && c.out > 64;
    // A ragged width on cuBLASLt: two products by default, at multiples of 64 rows or 128; also one (the
    // before of perf-log run 81).
    for (int variant = 0; variant < 3; ++variant) {
      const bool split = variant < 2;
      if (variant > 0 && !ragged) continue;
      runner.set_split_ragged_rows(split);
      runner.set_split_row_align(variant == 1 ? 128 : 64);
      SCOPED_TRACE(variant == 0 ? "" : variant == 1 ? "split at 128 rows" : "one product");
      OwnedTensor d_out = poisoned(c.out_dtype, {c.tokens, c.out});
      runner.run({.x = d_x, .weight = d_w, .bias = c.bias ? d_b.view : Tensor{}, .out = d_out}, stream_);
      sync();
      OwnedTensor got = cuda::download(d_out);
      // fp32 accumulation in another order: far below the bf16 rounding of the output; for f32 out, 1e-4.
      if (c.out_dtype == DType::F32) EXPECT_TRUE(all_close_f32(got, want, 1e-4));
      else EXPECT_TRUE(all_close(got, want, kTolBf16Out));
      // bf16 with a bias or a padded copy after cuBLASLt: 16-byte chunks (the default where widths allow) and
      // the scalar kernel store the same bits
      if (c.out_dtype == DType::BF16 && (c.bias || ragged)) {
        runner.set_finish_by_chunks(false);
        OwnedTensor d_scalar = poisoned(c.out_dtype, {c.tokens, c.out});
        runner.run({.x = d_x, .weight = d_w, .bias = c.bias ? d_b.view : Tensor{}, .out = d_scalar}, stream_);
        sync();
        EXPECT_TRUE(bitwise_equal(cuda::download(d_scalar), got)) << "finish by chunks vs scalar";
        runner.set_finish_by_chunks(true);
      }
    }
    runner.set_split_ragged_rows(true);
    runner.set_split_row_align(64);
  }
}

// The padded scratch of a ragged product moves only when a larger one needs more room; memory_epoch() says
// so (the backend adds it to its own, so recorded graphs are made again).
TEST_F(CudaLinear, PaddedScratchGrowsAndReportsIt) {
  cuda::LinearRunner runner;
  runner.set_path(cuda::LinearPath::kCublasLt);
  auto run = [&](int64_t tokens, int64_t out) {
    OwnedTensor x = cuda::upload(random_bf16(rng(), {tokens, 64}));
    OwnedTensor w = cuda::upload(random_bf16(rng(), {out, 64}, 0.05f));
    OwnedTensor y = poisoned(DType::F32, {tokens, out});
    runner.run({.x = x, .weight = w, .out = y}, stream_);
    sync();
  };
  const uint64_t start = runner.memory_epoch();
  run(4, 512);  // rows of 16-byte multiples: no scratch
  EXPECT_EQ(runner.memory_epoch(), start);
  run(4, 1001);
  const uint64_t grown = runner.memory_epoch();
  EXPECT_GT(grown, start);
  run(2, 1001);  // fits
  run(4, 999);
  EXPECT_EQ(runner.memory_epoch(), grown);
  run(64, 1001);
  EXPECT_GT(runner.memory_epoch(), grown);
}

}  // namespace
}  // namespace lmx::test
