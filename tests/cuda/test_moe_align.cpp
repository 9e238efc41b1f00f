// Parity of the CUDA MoE sort/align (backends/cuda/moe_align.cuh) with a CPU reference written here from
// the contract: groups by expert or by (slot, expert), pairs in increasing t*K + k inside a group, groups
// padded to BLOCK_M with the sentinel T*K, tile -> group, offsets, tile count. Every path (tiny up to 256
// pairs, one block, chunked, radix sort) on every case up to kMoeAlignSmallPairs = 16384 pairs (each of the one-block path's 1 / 4 / 16
// items-per-thread buckets and their edges), the sort path above; up to E = 512 × S = 64 (32768 groups).
// Also order_by_slot: tiles by expert, an expert's pairs by slot (-1 first) then t*K + k, each slot group
// starting at a multiple of slot_group_rows where set and the expert's tiles have room. Exact.
#include <vector>

#include "backends/cuda/moe_align.cuh"
#include "cuda_test_util.h"

namespace lmx::test {
namespace {

class CudaMoeAlign : public CudaTest {};

struct Aligned {
  std::vector<int32_t> sorted_pairs, tile_group, group_offsets;
  int32_t num_tiles = 0;
};

Aligned align_reference(const Tensor& topk_ids, const Tensor* token_slot, int64_t experts, int64_t slots,
                        int block_m, bool order_by_slot = false, int group_rows = 1) {
  const int64_t tokens = topk_ids.dim(0), top_k = topk_ids.dim(1), pairs = tokens * top_k;
  // order_by_slot: groups (expert, slot + 1), padded in runs of S + 1 (one run per expert)
  const int64_t run = order_by_slot ? slots + 1 : 1;
  const int64_t groups = order_by_slot ? experts * run : token_slot ? slots * experts : experts;
  std::vector<std::vector<int32_t>> members(static_cast<size_t>(groups));
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const int32_t expert = topk_ids.ptr<int32_t>()[pair];
    if (!token_slot) {
      members[expert].push_back(int32_t(pair));
      continue;
    }
    const int32_t slot = token_slot->ptr<int32_t>()[pair / top_k];
    if (order_by_slot) members[expert * run + slot + 1].push_back(int32_t(pair));
    else if (slot >= 0) members[slot * experts + expert].push_back(int32_t(pair));
  }
  auto round_to = [](size_t n, size_t m) { return (n + m - 1) / m * m; };
  Aligned r;
  for (int64_t first = 0; first < groups; first += run) {
    // group_rows: each group of the run starts at a multiple of it, if the run's tiles have room for that
    size_t count = 0, aligned = 0;
    for (int64_t g = first; g < first + run; ++g) {
      count += members[g].size();
      aligned += round_to(members[g].size(), size_t(group_rows));
    }
    const size_t rows = round_to(aligned, block_m) == round_to(count, block_m) ? size_t(group_rows) : 1;
    for (int64_t g = first; g < first + run; ++g) {
      r.group_offsets.push_back(int32_t(r.sorted_pairs.size()));
      for (int32_t pair : members[g]) r.sorted_pairs.push_back(pair);
      while (r.sorted_pairs.size() % rows != 0) r.sorted_pairs.push_back(int32_t(pairs));
    }
    while (r.sorted_pairs.size() % block_m != 0) r.sorted_pairs.push_back(int32_t(pairs));
    while (int64_t(r.tile_group.size()) * block_m < int64_t(r.sorted_pairs.size())) {
      r.tile_group.push_back(int32_t(first / run));
    }
  }
  r.group_offsets.push_back(int32_t(r.sorted_pairs.size()));
  r.num_tiles = int32_t(r.tile_group.size());
  return r;
}

std::vector<int32_t> to_vector(const Tensor& host, int64_t n) {
  return std::vector<int32_t>(host.ptr<int32_t>(), host.ptr<int32_t>() + n);
}

TEST_F(CudaMoeAlign, MatchesReference) {
  struct Case {
    int64_t tokens, top_k, experts, slots;
    int block_m;
    bool by_slot;
    bool order_by_slot = false;
    int group_rows = 1;
  };
  const std::vector<Case> cases = {
      {1, 4, 32, 8, 16, true},     {3, 2, 8, 4, 16, true},       {16, 4, 32, 8, 16, true},   {16, 4, 32, 8, 16, false},
      {64, 8, 128, 8, 16, true},   {256, 4, 32, 8, 16, true},    {256, 4, 32, 8, 64, false}, {257, 4, 32, 1, 1, true},
      {64, 8, 512, 64, 16, true},  {1024, 8, 512, 64, 16, true}, {2048, 4, 32, 8, 16, true}, {4096, 8, 128, 16, 16, false},
      {4096, 8, 128, 16, 16, true}, {0, 4, 32, 8, 16, true},
      // The one-block path's buckets: 1025 pairs (4 items), 4000, 4100 (16 items), 16384 (its limit, the
      // GPT-OSS T 4096 prefill), 16384 pairs over 32768 groups, 16388 (sort path only), BLOCK_M 1 and 128.
      {1025, 1, 32, 8, 16, true},  {1000, 4, 32, 8, 16, true},   {1025, 4, 32, 8, 16, true}, {4096, 4, 32, 8, 16, true},
      {2048, 8, 512, 64, 16, true}, {4097, 4, 32, 8, 16, true},  {3000, 2, 8, 4, 1, true},   {2000, 8, 128, 1, 128, false},
      // order_by_slot (moe_block's expert tiles where the MoE-LoRA runs in the GEMM accumulators): each path,
      // GPT-OSS-20B's T 256 / 1600 / 4096 with 8 slots at BLOCK_M 64 / 128, a T above the small paths, 512 × 64.
      {256, 4, 32, 8, 64, true, true},  {1600, 4, 32, 8, 128, true, true}, {4096, 4, 32, 8, 128, true, true},
      {3, 2, 8, 4, 16, true, true},     {4097, 4, 32, 8, 128, true, true}, {1024, 8, 512, 64, 64, true, true},
      {0, 4, 32, 8, 128, true, true},
      // slot_group_rows 16 (moe_block's mixed batches: no warp holds two adapters): each path, the mixed step
      // of the yardstick (T 1615: experts with and without room), group rows equal to BLOCK_M, many groups
      // per expert.
      {1615, 4, 32, 8, 128, true, true, 16}, {3, 2, 8, 4, 16, true, true, 16}, {4097, 4, 32, 8, 128, true, true, 16},
      {1024, 8, 512, 64, 64, true, true, 16}, {256, 4, 32, 8, 64, true, true, 64}, {0, 4, 32, 8, 128, true, true, 16},
      // the tiny path's edges: 256 pairs, GPT-OSS-20B's decode batch ordered by slot (and 256 pairs of it), 256
      // pairs over more groups than its shared memory holds (auto takes the one-block path), group rows
      {64, 4, 32, 8, 16, true}, {16, 4, 32, 8, 16, true, true}, {64, 4, 32, 8, 16, true, true},
      {32, 8, 512, 64, 16, true}, {64, 4, 32, 8, 16, true, true, 16},
      // the warp path's edges: 1024 pairs (GPT-OSS-20B's T 256 by (slot, expert) and by expert at BLOCK_M 64),
      // 257 pairs, 1024 pairs over 1536 groups (its limit: 512 experts by slot, S 2 ordered: 512 · 3) and over
      // 2048 (auto leaves it), Qwen3's 128 experts × 8 slots
      {256, 4, 32, 8, 16, true, false}, {256, 4, 32, 8, 64, false}, {257, 1, 32, 8, 16, true},
      {128, 8, 512, 2, 128, true, true}, {1024, 1, 256, 8, 16, true}, {128, 8, 128, 8, 16, true},
      {128, 8, 128, 8, 128, true, true, 16}};
  for (const Case& c : cases) {
    const int64_t pairs = c.tokens * c.top_k;
    const int64_t groups = c.order_by_slot ? c.experts * (c.slots + 1) : c.by_slot ? c.slots * c.experts : c.experts;
    OwnedTensor topk_ids = OwnedTensor::host(DType::I32, {c.tokens, c.top_k});
    for (int64_t t = 0; t < c.tokens; ++t) {  // distinct experts per token, as the router makes them
      OwnedTensor ids = distinct_ids(rng(), c.top_k, int32_t(c.experts));
      std::copy(ids.view.ptr<int32_t>(), ids.view.ptr<int32_t>() + c.top_k, topk_ids.view.ptr<int32_t>() + t * c.top_k);
    }
    OwnedTensor token_slot = random_ids(rng(), c.tokens, -1, int32_t(c.slots));  // -1: base tokens
    const Aligned want =
        align_reference(topk_ids, c.by_slot ? &token_slot.view : nullptr, c.experts, c.slots, c.block_m, c.order_by_slot,
                        c.group_rows);
    const int64_t capacity = cuda::moe_align_capacity(pairs, c.order_by_slot ? c.experts : groups, c.block_m);
    for (int path : {-1, 0, 1, 2, 3, 4}) {
      if ((path == 0 || path == 2) && pairs > cuda::kMoeAlignSmallPairs) continue;
      if (path == 3 && (pairs > cuda::kMoeAlignTinyPairs || groups > cuda::kMoeAlignTinyGroups)) continue;
      if (path == 4 && (pairs > cuda::kMoeAlignWarpPairs || groups > cuda::kMoeAlignWarpGroups)) continue;
      SCOPED_TRACE("T " + std::to_string(c.tokens) + " K " + std::to_string(c.top_k) + " E " +
                   std::to_string(c.experts) + " S " + std::to_string(c.slots) + " BLOCK_M " +
                   std::to_string(c.block_m) + (c.order_by_slot ? " ordered by slot" : c.by_slot ? " by slot" : " by expert") +
                   " group rows " + std::to_string(c.group_rows) +
                   " path " + std::to_string(path));
      OwnedTensor d_ids = cuda::upload(topk_ids), d_slot = cuda::upload(token_slot);
      OwnedTensor sorted = poisoned(DType::I32, {capacity});
      OwnedTensor tiles = poisoned(DType::I32, {capacity / c.block_m});
      OwnedTensor offsets = poisoned(DType::I32, {groups + 1});
      OwnedTensor num_tiles = poisoned(DType::I32, {1});
      OwnedTensor workspace = poisoned(DType::U8, {int64_t(cuda::moe_align_workspace_bytes(pairs, groups))});
      cuda::moe_align({.topk_ids = d_ids, .token_slot = d_slot, .experts = c.experts,
                       .slots = c.by_slot ? c.slots : 0, .block_m = c.block_m, .sorted_pairs = sorted, .tile_group = tiles,
                       .group_offsets = offsets, .num_tiles = num_tiles, .workspace = workspace, .force_path = path,
                       .order_by_slot = c.order_by_slot, .slot_group_rows = c.group_rows},
                      stream_);
      sync();
      OwnedTensor got_num = cuda::download(num_tiles);
      ASSERT_EQ(got_num.view.ptr<int32_t>()[0], want.num_tiles);
      EXPECT_EQ(to_vector(cuda::download(sorted), int64_t(want.sorted_pairs.size())), want.sorted_pairs);
      std::vector<int32_t> want_tiles = want.tile_group;
      want_tiles.resize(size_t(capacity / c.block_m), -1);
      EXPECT_EQ(to_vector(cuda::download(tiles), capacity / c.block_m), want_tiles);
      EXPECT_EQ(to_vector(cuda::download(offsets), groups + 1), want.group_offsets);
    }
  }
}

}  // namespace
}  // namespace lmx::test
