// The dense ops of ops/basic.h on the cpu backend against formulas written out here in double:
// embedding, RMSNorm, linear, add, SiLU-gated product, row gather. Several shapes each, T = 1 included.
#include <gtest/gtest.h>

#include <vector>

#include "backends/cpu/cpu_backend.h"
#include "op_test_util.h"

namespace lmx {
namespace {

using test::all_close;
using test::poison;
using test::to_doubles;

TEST(DenseOps, EmbeddingCopiesRowsExactly) {
  cpu::CpuBackend backend(2);
  for (auto [vocab, hidden, tokens] : {std::tuple{1, 1, 1}, {50, 8, 1}, {97, 33, 12}}) {
    Rng rng(100 + tokens);
    OwnedTensor table = test::random_bf16(rng, {vocab, hidden});
    std::vector<int32_t> ids(tokens);
    for (auto& id : ids) id = int32_t(rng.next_u64() % uint64_t(vocab));
    ids.back() = vocab - 1;
    OwnedTensor token_ids = test::i32_tensor(ids);
    OwnedTensor out = OwnedTensor::host(DType::F32, {tokens, hidden});
    poison(out);
    backend.embedding({.table = table, .token_ids = token_ids, .out = out});
    for (int t = 0; t < tokens; ++t) {
      for (int h = 0; h < hidden; ++h) {
        ASSERT_EQ(out.view.ptr<float>()[t * hidden + h], bf16_to_f32(table.view.ptr<bf16>()[ids[t] * hidden + h]));
      }
    }
  }
}

TEST(DenseOps, RmsNormMatchesFormula) {
  cpu::CpuBackend backend(2);
  for (auto [rows, cols, eps] : {std::tuple{1, 1, 1e-6f}, {1, 64, 1e-5f}, {7, 13, 1e-6f}, {33, 1000, 1e-6f}}) {
    for (bool in_place : {false, true}) {
      SCOPED_TRACE("N=" + std::to_string(rows) + " C=" + std::to_string(cols) + (in_place ? " in place" : ""));
      Rng rng(rows * 1000 + cols + in_place);
      OwnedTensor x = test::random_f32(rng, {rows, cols}, 3.0f);
      OwnedTensor weight = test::random_bf16(rng, {cols});
      std::vector<double> want(rows * cols);
      for (int n = 0; n < rows; ++n) {
        double mean_square = 0.0;
        for (int c = 0; c < cols; ++c) mean_square += test::value_at(x, n * cols + c) * test::value_at(x, n * cols + c);
        mean_square /= cols;
        for (int c = 0; c < cols; ++c) {
          want[n * cols + c] =
              test::value_at(x, n * cols + c) / std::sqrt(mean_square + eps) * test::value_at(weight, c);
        }
      }
      OwnedTensor out = in_place ? x : OwnedTensor::host(DType::F32, {rows, cols});
      if (!in_place) poison(out);
      backend.rms_norm({.x = x, .weight = weight, .eps = eps, .out = out});
      EXPECT_TRUE(all_close(out, want, test::kTolReduction));
    }
  }
}

// RmsNormParams.residual: x becomes x + residual (the exact fp32 sum) and out the norm of that sum.
TEST(DenseOps, RmsNormWithResidualAddsThenNorms) {
  cpu::CpuBackend backend(2);
  for (auto [rows, cols, in_place] : {std::tuple{1, 64, false}, {7, 13, true}, {33, 1000, false}}) {
    SCOPED_TRACE("N=" + std::to_string(rows) + " C=" + std::to_string(cols) + (in_place ? " in place" : ""));
    Rng rng(rows * 7 + cols);
    OwnedTensor x = test::random_f32(rng, {rows, cols}, 3.0f), residual = test::random_f32(rng, {rows, cols});
    OwnedTensor weight = test::random_bf16(rng, {cols});
    std::vector<double> want_sum(rows * cols), want(rows * cols);
    for (int n = 0; n < rows; ++n) {
      double mean_square = 0.0;
      for (int c = 0; c < cols; ++c) {
        const int i = n * cols + c;
        want_sum[i] = double(float(test::value_at(x, i)) + float(test::value_at(residual, i)));
        mean_square += want_sum[i] * want_sum[i];
      }
      mean_square /= cols;
      for (int c = 0; c < cols; ++c) {
        want[n * cols + c] = want_sum[n * cols + c] / std::sqrt(mean_square + 1e-5) * test::value_at(weight, c);
      }
    }
    OwnedTensor out = in_place ? x : OwnedTensor::host(DType::F32, {rows, cols});
    if (!in_place) poison(out);
    backend.rms_norm({.x = x, .weight = weight, .eps = 1e-5f, .out = out, .residual = residual});
    EXPECT_TRUE(all_close(out, want, test::kTolReduction));
    if (!in_place) {
      for (int i = 0; i < rows * cols; ++i) ASSERT_EQ(test::value_at(x, i), want_sum[i]) << i;
    }
  }
}

TEST(DenseOps, LinearMatchesFormula) {
  cpu::CpuBackend backend(3);
  // (T, in, out): T = 1 decode, in not a multiple of 8 (the dot's lane tail), more rows than a token block.
  for (auto [tokens, in, out_features] :
       {std::tuple{1, 1, 1}, {1, 64, 48}, {3, 7, 5}, {17, 130, 9}, {40, 256, 200}, {2, 1000, 3}}) {
    for (bool with_bias : {false, true}) {
      SCOPED_TRACE("T=" + std::to_string(tokens) + " in=" + std::to_string(in) +
                   " out=" + std::to_string(out_features) + (with_bias ? " bias" : ""));
      Rng rng(tokens * 7919 + in * 31 + out_features + with_bias);
      OwnedTensor x = test::random_f32(rng, {tokens, in});
      OwnedTensor weight = test::random_bf16(rng, {out_features, in}, 0.1f);
      OwnedTensor bias = test::random_bf16(rng, {out_features});
      std::vector<double> want(tokens * out_features);
      for (int t = 0; t < tokens; ++t) {
        for (int o = 0; o < out_features; ++o) {
          double sum = with_bias ? test::value_at(bias, o) : 0.0;
          for (int i = 0; i < in; ++i) sum += test::value_at(x, t * in + i) * test::value_at(weight, o * in + i);
          want[t * out_features + o] = sum;
        }
      }
      OwnedTensor out = OwnedTensor::host(DType::F32, {tokens, out_features});
      poison(out);
      backend.linear({.x = x, .weight = weight, .bias = with_bias ? bias.view : Tensor(), .out = out});
      EXPECT_TRUE(all_close(out, want, test::kTolReduction));
    }
  }
}

TEST(DenseOps, AddIsExactFp32Sum) {
  cpu::CpuBackend backend(1);
  for (auto [rows, cols] : {std::pair{1, 1}, {5, 17}}) {
    Rng rng(rows + cols);
    OwnedTensor x = test::random_f32(rng, {rows, cols});
    OwnedTensor y = test::random_f32(rng, {rows, cols});
    std::vector<float> want(rows * cols);
    for (int i = 0; i < rows * cols; ++i) want[i] = y.view.ptr<float>()[i] + x.view.ptr<float>()[i];
    backend.add({.x = x, .y = y});
    for (int i = 0; i < rows * cols; ++i) ASSERT_EQ(y.view.ptr<float>()[i], want[i]);
    backend.add({.x = y, .y = y});  // exact aliasing doubles y
    for (int i = 0; i < rows * cols; ++i) ASSERT_EQ(y.view.ptr<float>()[i], 2.0f * want[i]);
  }
}

TEST(DenseOps, SiluMulMatchesFormula) {
  cpu::CpuBackend backend(1);
  for (auto [tokens, inter] : {std::pair{1, 1}, {1, 96}, {9, 31}}) {
    for (bool in_place : {false, true}) {
      Rng rng(tokens * 100 + inter + in_place);
      OwnedTensor gate = test::random_f32(rng, {tokens, inter}, 4.0f);
      OwnedTensor up = test::random_f32(rng, {tokens, inter});
      std::vector<double> want(tokens * inter);
      for (int i = 0; i < tokens * inter; ++i) want[i] = test::silu_d(test::value_at(gate, i)) * test::value_at(up, i);
      OwnedTensor out = in_place ? gate : OwnedTensor::host(DType::F32, {tokens, inter});
      if (!in_place) poison(out);
      backend.silu_mul({.gate = gate, .up = up, .out = out});
      EXPECT_TRUE(all_close(out, want, test::kTolElementwise));
    }
  }
}

TEST(DenseOps, GatherRowsCopiesExactly) {
  cpu::CpuBackend backend(1);
  Rng rng(5);
  OwnedTensor x = test::random_f32(rng, {9, 6});
  for (const std::vector<int32_t>& rows : {std::vector<int32_t>{8}, {0, 8, 3, 3}, {4, 2, 1, 0, 5}}) {
    OwnedTensor index = test::i32_tensor(rows);
    OwnedTensor out = OwnedTensor::host(DType::F32, {int64_t(rows.size()), 6});
    poison(out);
    backend.gather_rows({.x = x, .index = index, .out = out});
    for (size_t b = 0; b < rows.size(); ++b) {
      for (int c = 0; c < 6; ++c) ASSERT_EQ(out.view.ptr<float>()[b * 6 + c], x.view.ptr<float>()[rows[b] * 6 + c]);
    }
  }
}

TEST(DenseOps, SplitColumnsCopiesEachBlock) {
  cpu::CpuBackend backend(1);
  Rng rng(7);
  for (const std::vector<int64_t>& widths : {std::vector<int64_t>{5, 2, 2}, {3, 4}, {9}}) {
    int64_t total = 0;
    for (int64_t w : widths) total += w;
    OwnedTensor x = test::random_f32(rng, {4, total});
    std::vector<OwnedTensor> parts;
    ops::SplitColumnsParams p{.x = x};
    for (size_t i = 0; i < widths.size(); ++i) {
      parts.push_back(OwnedTensor::host(DType::F32, {4, widths[i]}));
      poison(parts.back());
      p.parts[i] = parts.back().view;
    }
    backend.split_columns(p);
    int64_t first = 0;
    for (size_t i = 0; i < widths.size(); ++i) {
      for (int64_t t = 0; t < 4; ++t) {
        for (int64_t c = 0; c < widths[i]; ++c) {
          ASSERT_EQ(parts[i].view.ptr<float>()[t * widths[i] + c], x.view.ptr<float>()[t * total + first + c]);
        }
      }
      first += widths[i];
    }
  }
}

// Values inside tensors that break a contract abort with the op and the offending element.
TEST(DenseOpsDeathTest, OutOfRangeIdsAbort) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  Rng rng(6);
  OwnedTensor table = test::random_bf16(rng, {10, 4});
  OwnedTensor ids = test::i32_tensor({3, 10});
  OwnedTensor out = OwnedTensor::host(DType::F32, {2, 4});
  EXPECT_DEATH(cpu::CpuBackend(1).embedding({.table = table, .token_ids = ids, .out = out}),
               "embedding .*token_ids\\[1\\] = 10 outside \\[0, 10\\)");
  OwnedTensor x = test::random_f32(rng, {3, 4});
  OwnedTensor index = test::i32_tensor({-1, 0});
  EXPECT_DEATH(cpu::CpuBackend(1).gather_rows({.x = x, .index = index, .out = out}), "gather_rows .*index\\[0\\] = -1");
}

}  // namespace
}  // namespace lmx
