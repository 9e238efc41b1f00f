// Paged KV ops of ops/attention.h on the cpu backend: kv_write against a direct row copy, and attention
// against a dense masked softmax(q·Kᵀ·scale)·V computed in double from unpaged K/V, with the pages scattered
// by a shuffled page table and every cache row the op must not read set to NaN.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "backends/cpu/cpu_backend.h"
#include "op_test_util.h"

namespace lmx {
namespace {

TEST(KvWrite, CopiesRowsToTheirCacheRowsAndSkipsPadding) {
  cpu::CpuBackend backend(1);
  for (auto [tokens, pages, page_size, kv_heads, head_dim] :
       {std::tuple{1, 1, 1, 1, 1}, {5, 3, 4, 2, 8}, {16, 8, 16, 1, 64}}) {
    Rng rng(tokens * 31 + pages);
    OwnedTensor k = test::random_f32(rng, {tokens, kv_heads, head_dim});
    OwnedTensor v = test::random_f32(rng, {tokens, kv_heads, head_dim});
    OwnedTensor k_cache = test::random_f32(rng, {pages, page_size, kv_heads, head_dim});
    OwnedTensor v_cache = test::random_f32(rng, {pages, page_size, kv_heads, head_dim});
    std::vector<int32_t> rows = test::permutation(rng, int32_t(pages * page_size));
    rows.resize(tokens);
    for (int t = 1; t < tokens; t += 3) rows[size_t(t)] = -1;  // padding rows: written nowhere
    OwnedTensor index = test::i32_tensor(rows);
    const int64_t row_elems = kv_heads * head_dim;
    std::vector<float> want_k(k_cache.view.ptr<float>(), k_cache.view.ptr<float>() + k_cache.view.numel());
    std::vector<float> want_v(v_cache.view.ptr<float>(), v_cache.view.ptr<float>() + v_cache.view.numel());
    for (int t = 0; t < tokens; ++t) {
      if (rows[size_t(t)] < 0) continue;
      std::copy_n(k.view.ptr<float>() + t * row_elems, row_elems, want_k.begin() + rows[t] * row_elems);
      std::copy_n(v.view.ptr<float>() + t * row_elems, row_elems, want_v.begin() + rows[t] * row_elems);
    }
    backend.kv_write({.k = k, .v = v, .kv_write_index = index, .k_cache = k_cache, .v_cache = v_cache});
    EXPECT_TRUE(std::equal(want_k.begin(), want_k.end(), k_cache.view.ptr<float>()));
    EXPECT_TRUE(std::equal(want_v.begin(), want_v.end(), v_cache.view.ptr<float>()));
  }
}

struct Sequence {
  int length;      // keys 0..length-1 are in the cache
  int new_tokens;  // the batch holds positions [length - new_tokens, length)
};

struct AttentionCase {
  std::vector<Sequence> seqs;
  int q_heads, kv_heads, head_dim, page_size;
  int window = 0;
  bool sinks = false;
  float q_scale = 1.0f;  // larger = peakier softmax
};

void check_attention(uint64_t seed, const AttentionCase& c) {
  SCOPED_TRACE("seed " + std::to_string(seed) + " Hq=" + std::to_string(c.q_heads) +
               " Hkv=" + std::to_string(c.kv_heads) + " D=" + std::to_string(c.head_dim) +
               " P=" + std::to_string(c.page_size) + " W=" + std::to_string(c.window) + (c.sinks ? " sinks" : ""));
  Rng rng(seed);
  const int seqs = int(c.seqs.size()), P = c.page_size, D = c.head_dim, Hq = c.q_heads, Hkv = c.kv_heads;
  const int64_t row_elems = int64_t(Hkv) * D;

  // Dense per-sequence K/V, the token layout of the batch, and the first position any batch token reads.
  std::vector<std::vector<float>> keys(seqs), values(seqs);
  std::vector<int32_t> seq_start{0}, positions;
  std::vector<int> first_read(seqs);
  int max_pages = 1, total_pages = 0;
  for (int b = 0; b < seqs; ++b) {
    const Sequence& s = c.seqs[b];
    keys[b].resize(s.length * row_elems);
    values[b].resize(s.length * row_elems);
    for (auto& x : keys[b]) x = rng.normal();
    for (auto& x : values[b]) x = rng.normal();
    for (int p = s.length - s.new_tokens; p < s.length; ++p) positions.push_back(p);
    seq_start.push_back(int32_t(positions.size()));
    const int first_position = s.length - s.new_tokens;
    first_read[b] = c.window > 0 ? std::max(0, first_position - c.window + 1) : 0;
    const int pages = (s.length + P - 1) / P;
    max_pages = std::max(max_pages, pages + 1);  // one spare entry per row, left at -1
    total_pages += pages;
  }
  total_pages += 2;  // pages nobody owns, left NaN
  const int tokens = int(positions.size());

  // Scatter the pages over a shuffled cache. Pages wholly before the first window are released (-1), as a
  // scheduler may do for sliding-window layers; every cache row not holding a readable key stays NaN.
  const std::vector<int32_t> physical = test::permutation(rng, total_pages);
  std::vector<int32_t> block_table(seqs * max_pages, -1);
  OwnedTensor k_cache = OwnedTensor::host(DType::F32, {total_pages, P, Hkv, D});
  OwnedTensor v_cache = OwnedTensor::host(DType::F32, {total_pages, P, Hkv, D});
  test::poison(k_cache);
  test::poison(v_cache);
  int next_page = 0;
  for (int b = 0; b < seqs; ++b) {
    const int pages = (c.seqs[b].length + P - 1) / P;
    for (int page = 0; page < pages; ++page) {
      const int32_t owner = physical[next_page++];
      if ((page + 1) * P <= first_read[b]) continue;  // released
      block_table[b * max_pages + page] = owner;
      for (int j = page * P; j < std::min((page + 1) * P, c.seqs[b].length); ++j) {
        const int64_t row = int64_t(owner) * P + j % P;
        std::copy_n(keys[b].data() + j * row_elems, row_elems, k_cache.view.ptr<float>() + row * row_elems);
        std::copy_n(values[b].data() + j * row_elems, row_elems, v_cache.view.ptr<float>() + row * row_elems);
      }
    }
  }

  OwnedTensor q = test::random_f32(rng, {tokens, Hq, D}, c.q_scale);
  OwnedTensor sinks = test::random_bf16(rng, {Hq}, 2.0f);
  const float scale = 1.0f / std::sqrt(float(D));

  // Reference: for each token and head, a dense softmax over keys [lo, p] (plus the sink) in double.
  std::vector<double> want(int64_t(tokens) * Hq * D, 0.0);
  for (int b = 0; b < seqs; ++b) {
    for (int t = seq_start[b]; t < seq_start[b + 1]; ++t) {
      const int p = positions[t];
      const int lo = c.window > 0 ? std::max(0, p - c.window + 1) : 0;
      for (int h = 0; h < Hq; ++h) {
        const int kv_head = h / (Hq / Hkv);
        std::vector<double> logits;
        for (int j = lo; j <= p; ++j) {
          double s = 0.0;
          for (int d = 0; d < D; ++d) {
            s += test::value_at(q, (int64_t(t) * Hq + h) * D + d) * keys[b][j * row_elems + kv_head * D + d];
          }
          logits.push_back(s * scale);
        }
        double m = *std::max_element(logits.begin(), logits.end());
        const double sink = test::value_at(sinks, h);
        if (c.sinks) m = std::max(m, sink);
        double denominator = c.sinks ? std::exp(sink - m) : 0.0;
        for (double l : logits) denominator += std::exp(l - m);
        for (int j = lo; j <= p; ++j) {
          const double w = std::exp(logits[j - lo] - m) / denominator;
          for (int d = 0; d < D; ++d) {
            want[(int64_t(t) * Hq + h) * D + d] += w * values[b][j * row_elems + kv_head * D + d];
          }
        }
      }
    }
  }

  OwnedTensor block_table_t = test::i32_tensor(block_table, {seqs, max_pages});
  OwnedTensor seq_start_t = test::i32_tensor(seq_start);
  OwnedTensor positions_t = test::i32_tensor(positions);
  OwnedTensor out = OwnedTensor::host(DType::F32, {tokens, Hq, D});
  test::poison(out);
  cpu::CpuBackend backend(3);
  backend.attention({.q = q,
                     .k_cache = k_cache,
                     .v_cache = v_cache,
                     .block_table = block_table_t,
                     .seq_start = seq_start_t,
                     .positions = positions_t,
                     .sinks = c.sinks ? sinks.view : Tensor(),
                     .sliding_window = c.window,
                     .softmax_scale = scale,
                     .out = out});
  EXPECT_TRUE(test::all_close(out, want, test::kTolReduction));
}

TEST(Attention, FirstTokenOfASequence) {
  check_attention(1, {.seqs = {{1, 1}}, .q_heads = 1, .kv_heads = 1, .head_dim = 8, .page_size = 4});
  check_attention(2, {.seqs = {{1, 1}}, .q_heads = 2, .kv_heads = 1, .head_dim = 8, .page_size = 4, .sinks = true});
}

TEST(Attention, MixedPrefillChunkedPrefillAndDecode) {
  const std::vector<Sequence> seqs{{37, 37}, {20, 1}, {5, 3}, {64, 1}};
  for (bool sinks : {false, true}) {
    check_attention(10 + sinks,
                    {.seqs = seqs, .q_heads = 4, .kv_heads = 2, .head_dim = 16, .page_size = 4, .sinks = sinks});
    check_attention(
        12 + sinks,
        {.seqs = seqs, .q_heads = 4, .kv_heads = 4, .head_dim = 16, .page_size = 16, .sinks = sinks, .q_scale = 4.0f});
  }
}

TEST(Attention, SlidingWindowSmallerAndBiggerThanTheSequence) {
  const std::vector<Sequence> seqs{{37, 37}, {20, 1}, {9, 4}, {130, 2}};
  for (int window : {1, 2, 8, 19, 20, 200}) {
    check_attention(100 + window, {.seqs = seqs,
                                   .q_heads = 6,
                                   .kv_heads = 2,
                                   .head_dim = 8,
                                   .page_size = 4,
                                   .window = window,
                                   .sinks = window % 2 == 0});
  }
}

TEST(Attention, GroupedQueriesAndPageSizes) {
  check_attention(20, {.seqs = {{70, 70}}, .q_heads = 8, .kv_heads = 1, .head_dim = 64, .page_size = 16});
  check_attention(
      21, {.seqs = {{13, 5}, {3, 3}}, .q_heads = 4, .kv_heads = 2, .head_dim = 32, .page_size = 1, .sinks = true});
  // A GPT-OSS-like decode step: T = 1, window 128 over a longer sequence, sinks.
  check_attention(
      22,
      {.seqs = {{300, 1}}, .q_heads = 8, .kv_heads = 2, .head_dim = 64, .page_size = 16, .window = 128, .sinks = true});
}

TEST(AttentionDeathTest, BadMetadataAborts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  OwnedTensor q = OwnedTensor::host(DType::F32, {2, 2, 4});
  OwnedTensor cache_k = OwnedTensor::host(DType::F32, {2, 4, 1, 4});
  OwnedTensor cache_v = OwnedTensor::host(DType::F32, {2, 4, 1, 4});
  OwnedTensor out = OwnedTensor::host(DType::F32, {2, 2, 4});
  OwnedTensor positions = test::i32_tensor({0, 5});
  OwnedTensor good_table = test::i32_tensor({1, 0}, {1, 2});
  OwnedTensor bad_table = test::i32_tensor({1, 7}, {1, 2});
  OwnedTensor seq_start = test::i32_tensor({0, 2});
  OwnedTensor short_seq_start = test::i32_tensor({0, 1});
  ops::AttentionParams p{.q = q,
                         .k_cache = cache_k,
                         .v_cache = cache_v,
                         .block_table = bad_table,
                         .seq_start = seq_start,
                         .positions = positions,
                         .softmax_scale = 0.5f,
                         .out = out};
  EXPECT_DEATH(cpu::CpuBackend(1).attention(p), "attention .*block_table\\[0\\]\\[1\\] = 7 outside \\[0, 2\\)");
  p.block_table = good_table;
  p.seq_start = short_seq_start;
  EXPECT_DEATH(cpu::CpuBackend(1).attention(p), "attention .*seq_start must run from 0 to T = 2");

  OwnedTensor k = OwnedTensor::host(DType::F32, {2, 1, 4});
  OwnedTensor twice = test::i32_tensor({3, 3});
  EXPECT_DEATH(
      cpu::CpuBackend(1).kv_write({.k = k, .v = k, .kv_write_index = twice, .k_cache = cache_k, .v_cache = cache_v}),
      "kv_write .*cache row 3 written twice");
  OwnedTensor outside = test::i32_tensor({3, 8});
  EXPECT_DEATH(
      cpu::CpuBackend(1).kv_write({.k = k, .v = k, .kv_write_index = outside, .k_cache = cache_k, .v_cache = cache_v}),
      "kv_write .*kv_write_index\\[1\\] = 8 outside");
}

}  // namespace
}  // namespace lmx
