// MoE sort/align kernels (moe_align.cuh) and their launcher. Four paths with one result:
//  - tiny (up to kMoeAlignTinyPairs = 256 pairs, decode): one block of 256 threads, a pair each; its place
//    in its group by counting earlier pairs of its key in shared memory; the shared scan; one launch.
//  - one block (up to 4096 pairs by default, kMoeAlignSmallPairs = 16384 when forced): key every pair, a
//    stable block radix sort of (key, pair) in shared memory (cub::BlockRadixSort, 1024 threads × 1, 4 or
//    16 items), run heads/tails of equal keys give each group's start and count, the block scan pads the
//    groups, each pair goes to its group's padded offset + its place in the run; one launch.
//  - chunked (4097 to 16384 pairs: prefill chunks): chunks of 1024 pairs sorted by parallel CTAs, a scan
//    over (group, chunk), a scatter; three launches (the one-block sort at 16 items per thread took ~50 µs).
//  - sort (larger batches): key each pair, stable CUB radix sort of (key, pair) over the key's bits, scan
//    the counts in one block, scatter each sorted pair to its padded position.
// All count per group in global memory, so G = S·E is bounded by memory only (512 × 64 = 32768 groups is
// 128 KB of counters). The scan runs in one block of 1024 threads, each owning ceil(G / 1024) groups.
#include "backends/cuda/moe_align.cuh"

#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>

#include <algorithm>

#include "backends/cuda/check.h"
#include "backends/cuda/launch.cuh"

namespace lmx::cuda {
namespace {

constexpr int kScanThreads = 1024;
constexpr int kKeyThreads = 256;
constexpr int kTinyThreads = 256;  // the tiny path's block: one pair per thread
static_assert(kTinyThreads == kMoeAlignTinyPairs);

struct AlignKernelParams {
  const int32_t* topk_ids;    // [T, K] i32, or null: every pair is expert 0 (single_expert)
  const int32_t* token_slot;  // [T] i32, or null: group by expert
  int pairs;                  // T * K (also the sentinel)
  int top_k;                  // K
  int experts;                // E
  int groups;                 // G
  int run_groups;             // consecutive groups padded as one run of tiles: 1, or S + 1 (order_by_slot)
  int group_rows;             // each group of a run starts at a multiple of this (order_by_slot), else 1
  int block_m;                // BLOCK_M
  int max_tiles;              // capacity / BLOCK_M
  int key_bits;               // bits of the keys [0, G]: ceil(log2(G + 1))
  int32_t* counts;            // [G] i32 workspace
  int32_t* unpadded_offsets;  // [G] i32 workspace (sort path)
  int32_t* keys;              // [pairs] i32 workspace (sort path: unsorted keys; sentinel key G = dropped)
  int32_t* values;            // [pairs] i32 workspace (sort path: pair index)
  const int32_t* sorted_keys;    // [pairs] i32 workspace (sort path)
  const int32_t* sorted_values;  // [pairs] i32 workspace (sort path)
  int32_t* sorted_pairs;      // [capacity] i32
  int32_t* tile_group;        // [max_tiles] i32
  int32_t* group_offsets;     // [G + 1] i32
  int32_t* num_tiles;         // [1] i32
  int32_t* chunk_counts;      // [chunks, G] i32 workspace (chunked path): pairs of group g in chunk c, then
                              // (after the scan) the padded position of the chunk's first pair of g
  int32_t* chunk_starts;      // [chunks, G] i32 workspace (chunked path): g's first position in the sorted chunk
  int chunks;                 // chunked path: ceil(pairs / kChunkPairs)
};

// The group of pair p, or G when its token has no slot (LoRA grouping only). order_by_slot (run_groups =
// S + 1): expert · (S + 1) + slot + 1, every pair kept.
__device__ __forceinline__ int group_of(const AlignKernelParams& p, int pair) {
  const int expert = p.topk_ids != nullptr ? p.topk_ids[pair] : 0;
  if (p.token_slot == nullptr) return expert;
  const int slot = p.token_slot[pair / p.top_k];
  if (p.run_groups > 1) return expert * p.run_groups + max(slot, -1) + 1;
  return slot < 0 ? p.groups : slot * p.experts + expert;
}

// Block-wide, 1024 threads: from counts[G] write group_offsets, tile_group (with -1 past the last tile up
// to max_tiles), num_tiles, the sentinel on every padding position, and (if asked) the unpadded offsets.
// Groups are padded to whole tiles in runs of run_groups (a run's groups back to back, its tiles' group the
// run's index); with group_rows > 1 each group of a run starts at a multiple of group_rows wherever that
// fits in the run's tiles (the tile padding's rows move between its groups; the run never grows).
// `counts` is p.counts, or a copy in shared memory (the tiny path's, the chunked scan's); `offsets_out`, when set, also gets each
// group's offset (it may be `counts` itself: a group's count is read, by the one thread that owns its run,
// before its offset is written).
// PRECOND: blockDim.x == kThreads; counts complete and visible to the block.
template <int kThreads = kScanThreads>
__device__ void scan_groups(const AlignKernelParams& p, bool write_unpadded, const int32_t* counts,
                            int32_t* offsets_out = nullptr) {
  using ScanInt = cub::BlockScan<int, kThreads>;
  __shared__ typename ScanInt::TempStorage scan_storage;
  __shared__ int total_tiles;
  const int runs = p.groups / p.run_groups;
  const int per_thread = (runs + kThreads - 1) / kThreads;
  const int first = threadIdx.x * per_thread, last = min(first + per_thread, runs);
  auto round_to = [](int n, int m) { return (n + m - 1) / m * m; };
  auto run_count = [&](int run) {
    int c = 0;
    for (int g = run * p.run_groups; g < (run + 1) * p.run_groups; ++g) c += counts[g];
    return c;
  };
  auto run_aligned = [&](int run) {  // the run's groups start at multiples of group_rows
    if (p.group_rows == 1) return false;
    int rows = 0;
    for (int g = run * p.run_groups; g < (run + 1) * p.run_groups; ++g) rows += round_to(counts[g], p.group_rows);
    return round_to(rows, p.block_m) == round_to(run_count(run), p.block_m);
  };
  int padded = 0, unpadded = 0;
  for (int run = first; run < last; ++run) {
    const int c = run_count(run);
    padded += round_to(c, p.block_m);
    unpadded += c;
  }
  int padded_start = 0, padded_total = 0;
  ScanInt(scan_storage).ExclusiveSum(padded, padded_start, padded_total);
  __syncthreads();
  int unpadded_start = 0;
  if (write_unpadded) ScanInt(scan_storage).ExclusiveSum(unpadded, unpadded_start);
  for (int run = first; run < last; ++run) {
    const int size = round_to(run_count(run), p.block_m);
    const int group_rows = run_aligned(run) ? p.group_rows : 1;
    int at = padded_start;
    for (int g = run * p.run_groups; g < (run + 1) * p.run_groups; ++g) {
      const int count = counts[g];  // before offsets_out[g] (it may alias counts)
      p.group_offsets[g] = at;
      if (offsets_out != nullptr) offsets_out[g] = at;
      if (write_unpadded) p.unpadded_offsets[g] = unpadded_start;
      const int rows = round_to(count, group_rows);
      for (int i = at + count; i < at + rows; ++i) p.sorted_pairs[i] = p.pairs;
      at += rows;
      unpadded_start += count;
    }
    for (int i = at; i < padded_start + size; ++i) p.sorted_pairs[i] = p.pairs;
    for (int tile = padded_start / p.block_m; tile < (padded_start + size) / p.block_m; ++tile) p.tile_group[tile] = run;
    padded_start += size;
  }
  if (threadIdx.x == 0) {
    total_tiles = padded_total / p.block_m;
    p.group_offsets[p.groups] = padded_total;
    *p.num_tiles = total_tiles;
  }
  __syncthreads();
  for (int tile = total_tiles + threadIdx.x; tile < p.max_tiles; tile += kThreads) p.tile_group[tile] = -1;
}

// The one-block path's stable sort of (key, pair) and its shared memory: CUB's storage, then (after the
// sort) the sorted keys in its place.
template <int kItems>
using BlockSortPairs = cub::BlockRadixSort<unsigned, kScanThreads, kItems, int>;

template <int kItems>
constexpr size_t block_sort_shared_bytes() {
  return std::max(sizeof(typename BlockSortPairs<kItems>::TempStorage), size_t(kScanThreads) * kItems * sizeof(unsigned));
}

// The whole align in one block. Thread i holds pairs [i·kItems, (i+1)·kItems) (CUB's blocked arrangement,
// whose order the sort keeps among equal keys: the stable t*K + k order inside a group); padding items get
// the dropped key G and sort last. PRECOND: blockDim.x == kScanThreads; pairs <= kScanThreads · kItems;
// dynamic shared memory = block_sort_shared_bytes<kItems>(); keys [0, G] fit in key_bits.
template <int kItems>
__global__ static void __launch_bounds__(kScanThreads) align_block_kernel(const __grid_constant__ AlignKernelParams p) {
  detail::pdl_enter();  // first: launched by detail::launch (launch.cuh)
  extern __shared__ __align__(16) unsigned char sort_shared[];
  auto& sort_storage = *reinterpret_cast<typename BlockSortPairs<kItems>::TempStorage*>(sort_shared);
  unsigned* const sorted_keys = reinterpret_cast<unsigned*>(sort_shared);  // [kScanThreads · kItems]
  for (int g = threadIdx.x; g < p.groups; g += kScanThreads) p.counts[g] = 0;  // ordered by the barriers below
  unsigned keys[kItems];
  int values[kItems];
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int pair = int(threadIdx.x) * kItems + i;
    keys[i] = pair < p.pairs ? unsigned(group_of(p, pair)) : unsigned(p.groups);
    values[i] = pair;
  }
  BlockSortPairs<kItems>(sort_storage).Sort(keys, values, 0, p.key_bits);
  __syncthreads();  // the sort's storage is dead: the sorted keys overlay it
#pragma unroll
  for (int i = 0; i < kItems; ++i) sorted_keys[threadIdx.x * kItems + i] = keys[i];
  __syncthreads();
  // Runs of equal keys: the head records the run's start, then the tail its length (the group's count).
  constexpr int kTotal = kScanThreads * kItems;
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int position = int(threadIdx.x) * kItems + i;
    if (keys[i] < unsigned(p.groups) && (position == 0 || sorted_keys[position - 1] != keys[i])) {
      p.unpadded_offsets[keys[i]] = position;
    }
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int position = int(threadIdx.x) * kItems + i;
    if (keys[i] < unsigned(p.groups) && (position == kTotal - 1 || sorted_keys[position + 1] != keys[i])) {
      p.counts[keys[i]] = position + 1 - p.unpadded_offsets[keys[i]];
    }
  }
  __syncthreads();
  scan_groups(p, false, p.counts);
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int position = int(threadIdx.x) * kItems + i;
    if (keys[i] < unsigned(p.groups)) {
      p.sorted_pairs[p.group_offsets[keys[i]] + position - p.unpadded_offsets[keys[i]]] = values[i];
    }
  }
}

// Sort path, step 1: key and count every pair. PRECOND: counts zeroed.
__global__ static void align_keys_kernel(const __grid_constant__ AlignKernelParams p) {
  detail::pdl_enter();  // first: launched by detail::launch (launch.cuh)
  const int pair = blockIdx.x * blockDim.x + threadIdx.x;
  if (pair >= p.pairs) return;
  const int key = group_of(p, pair);
  p.keys[pair] = key;
  p.values[pair] = pair;
  if (key < p.groups) atomicAdd(&p.counts[key], 1);
}

// Sort path, step 3 (after the radix sort): offsets and tiles. PRECOND: one block of kScanThreads.
__global__ static void align_scan_kernel(const __grid_constant__ AlignKernelParams p) {
  detail::pdl_enter();  // first: launched by detail::launch (launch.cuh)
  scan_groups(p, true, p.counts);
}

// Sort path, step 4: sorted position i of group g goes to group_offsets[g] + (i - unpadded_offsets[g]).
__global__ static void align_scatter_kernel(const __grid_constant__ AlignKernelParams p) {
  detail::pdl_enter();  // first: launched by detail::launch (launch.cuh)
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= p.pairs) return;
  const int key = p.sorted_keys[i];
  if (key >= p.groups) return;
  p.sorted_pairs[p.group_offsets[key] + i - p.unpadded_offsets[key]] = p.sorted_values[i];
}

// Tiny path (decode batches: up to kMoeAlignTinyPairs pairs), one block of kTinyThreads, one pair per
// thread: the keys go to shared memory, each pair's place in its group is the number of earlier pairs with
// its key (at most 255 compares), the counts are shared-memory atomics that the scan reads in place and
// overwrites with the groups' offsets, then each pair is written at its group's offset + its place (no
// global round trip between the steps: p.counts is not used). The one-block sort's 1024-thread radix sort of a
// mostly padding block and its ~30 barriers took ~7.3 µs at 64 pairs (perf-log run 114).
// PRECOND: blockDim.x == kTinyThreads; pairs <= kTinyThreads; dynamic shared memory = groups ints.
__global__ static void __launch_bounds__(kTinyThreads) align_tiny_kernel(const __grid_constant__ AlignKernelParams p) {
  detail::pdl_enter();  // first: launched by detail::launch (launch.cuh)
  extern __shared__ int tiny_counts[];  // [groups]
  __shared__ int keys[kTinyThreads];
  for (int g = threadIdx.x; g < p.groups; g += kTinyThreads) tiny_counts[g] = 0;
  const int pair = threadIdx.x;
  const int key = pair < p.pairs ? group_of(p, pair) : p.groups;
  keys[pair] = key;
  __syncthreads();
  int place = 0;
  if (key < p.groups) {
    for (int q = 0; q < pair; ++q) place += keys[q] == key ? 1 : 0;
    atomicAdd(&tiny_counts[key], 1);
  }
  __syncthreads();  // the counts complete in shared memory
  scan_groups<kTinyThreads>(p, false, tiny_counts, tiny_counts);  // tiny_counts[g] becomes g's offset
  __syncthreads();
  if (key < p.groups) p.sorted_pairs[tiny_counts[key] + place] = pair;
}

// Warp path (past the tiny path's pairs up to kMoeAlignWarpPairs: the MoE-LoRA of a 256-token prefill chunk,
// 1024 pairs), one block of kScanThreads, one pair per thread: __match_any_sync gives each pair the lanes of
// its warp with the same key, the lowest of them writes the count into its warp's row of a [32, G] table in
// shared memory (one writer per cell: no atomics); the column pass turns each group's column into the
// exclusive prefix over warps and its total, the shared scan gives the groups' offsets, and each pair goes
// to offset + earlier warps' pairs of its key + its lanes below it. Stable and one launch, without the
// one-block radix sort's passes over 1024 keys (9.5 µs at 1024 pairs over 256 groups, perf-log run 225).
// PRECOND: blockDim.x == kScanThreads; pairs <= kScanThreads; dynamic shared memory = 33 · groups ints.
__global__ static void __launch_bounds__(kScanThreads) align_warp_kernel(const __grid_constant__ AlignKernelParams p) {
  detail::pdl_enter();  // first: launched by detail::launch (launch.cuh)
  constexpr int kWarpsPerBlock = kScanThreads / 32;
  extern __shared__ int warp_shared[];
  int* const warp_counts = warp_shared;                         // [kWarpsPerBlock, G]
  int* const counts = warp_shared + kWarpsPerBlock * p.groups;  // [G]: totals, then offsets
  for (int i = threadIdx.x; i < kWarpsPerBlock * p.groups; i += kScanThreads) warp_counts[i] = 0;
  const int pair = threadIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int key = pair < p.pairs ? group_of(p, pair) : p.groups;
  const unsigned peers = __match_any_sync(0xffffffffu, key);
  const int below = __popc(peers & ((1u << lane) - 1u));  // this pair's place among its warp's pairs of its key
  __syncthreads();  // the table is zero
  if (key < p.groups && below == 0) warp_counts[warp * p.groups + key] = __popc(peers);
  __syncthreads();
  for (int g = threadIdx.x; g < p.groups; g += kScanThreads) {
    int sum = 0;
#pragma unroll 8
    for (int w = 0; w < kWarpsPerBlock; ++w) {
      const int c = warp_counts[w * p.groups + g];
      warp_counts[w * p.groups + g] = sum;
      sum += c;
    }
    counts[g] = sum;
  }
  __syncthreads();  // the totals complete in shared memory
  scan_groups(p, false, counts, counts);  // counts[g] becomes g's offset
  __syncthreads();
  if (key < p.groups) p.sorted_pairs[counts[key] + warp_counts[warp * p.groups + key] + below] = pair;
}

// Chunked path (a few thousand to kMoeAlignSmallPairs pairs): the one-block sort's cost grows with its items
// per thread (16384 pairs: ~50 µs on one SM), so chunks of kChunkPairs pairs sort in parallel CTAs, one item
// per thread, and a scan over (group, chunk) places them. Three launches; stable (chunks in pair order, each
// chunk's sort stable).
constexpr int kChunkPairs = kScanThreads;
constexpr int64_t kMaxOneBlockPairs = 4 * kScanThreads;  // auto: the one-block path up to 4 items per thread
using ChunkSortPairs = cub::BlockRadixSort<unsigned, kScanThreads, 1, int>;

// Step 1, one CTA per chunk: sort the chunk's (key, pair) into keys / values at the chunk's positions; write
// the chunk's row of chunk_counts (zeros included) and chunk_starts for the groups present.
// PRECOND: blockDim.x == kScanThreads; gridDim.x == chunks.
__global__ static void __launch_bounds__(kScanThreads) align_chunk_sort_kernel(const __grid_constant__ AlignKernelParams p) {
  detail::pdl_enter();  // first: launched by detail::launch (launch.cuh)
  __shared__ typename ChunkSortPairs::TempStorage sort_storage;
  __shared__ unsigned sorted_keys[kChunkPairs];
  const int chunk = blockIdx.x, first = chunk * kChunkPairs;
  int32_t* counts = p.chunk_counts + int64_t(chunk) * p.groups;
  int32_t* starts = p.chunk_starts + int64_t(chunk) * p.groups;
  for (int g = threadIdx.x; g < p.groups; g += kScanThreads) counts[g] = 0;  // ordered by the barriers below
  const int pair = first + int(threadIdx.x);
  unsigned key[1] = {pair < p.pairs ? unsigned(group_of(p, pair)) : unsigned(p.groups)};
  int value[1] = {pair};
  ChunkSortPairs(sort_storage).Sort(key, value, 0, p.key_bits);
  sorted_keys[threadIdx.x] = key[0];
  __syncthreads();
  const int position = int(threadIdx.x);
  if (first + position < p.pairs) {
    p.keys[first + position] = int(key[0]);
    p.values[first + position] = value[0];
  }
  if (key[0] < unsigned(p.groups) && (position == 0 || sorted_keys[position - 1] != key[0])) {
    starts[key[0]] = position;  // run head
  }
  __syncthreads();
  if (key[0] < unsigned(p.groups) && (position == kChunkPairs - 1 || sorted_keys[position + 1] != key[0])) {
    counts[key[0]] = position + 1 - starts[key[0]];  // run tail: the group's count in this chunk
  }
}

// Step 2, one block: the groups' totals, the shared scan (offsets, tiles, sentinels), then each (chunk,
// group)'s first padded position: group offset + the group's pairs in earlier chunks. A group's column of
// chunk counts is loaded whole (kMaxChunks loads in flight) before it is summed, and again before the
// positions are written: a loop of one load and its use per chunk waited one L2 round trip a chunk, twice
// (Qwen3-30B-A3B T 1600: 13 chunks, 11.2 µs of own time a layer, perf-log run 236).
// PRECOND: blockDim.x == kScanThreads; step 1 complete; p.chunks <= kMaxChunks.
constexpr int kMaxChunks = int(kMoeAlignSmallPairs / kChunkPairs);
static_assert(kMoeAlignSmallPairs % kChunkPairs == 0);
constexpr int kSharedCountGroups = 4096;  // 16 KB: every preset's G (S·E or E·(S + 1) up to 8 × 128 + 128)
__device__ __forceinline__ void load_chunk_column(const AlignKernelParams& p, int g, int (&column)[kMaxChunks]) {
#pragma unroll
  for (int c = 0; c < kMaxChunks; ++c) column[c] = c < p.chunks ? p.chunk_counts[int64_t(c) * p.groups + g] : 0;
}
__global__ static void __launch_bounds__(kScanThreads) align_chunk_scan_kernel(const __grid_constant__ AlignKernelParams p) {
  detail::pdl_enter();  // first: launched by detail::launch (launch.cuh)
  // The totals in shared memory where they fit (scan_groups reads a run's counts one by one, in turn)
  __shared__ int32_t shared_counts[kSharedCountGroups];
  int32_t* counts = p.groups <= kSharedCountGroups ? shared_counts : p.counts;
  for (int g = threadIdx.x; g < p.groups; g += kScanThreads) {
    int column[kMaxChunks];
    load_chunk_column(p, g, column);
    int total = 0;
#pragma unroll
    for (int c = 0; c < kMaxChunks; ++c) total += column[c];
    counts[g] = total;
  }
  __syncthreads();  // counts visible to the block
  scan_groups(p, false, counts);
  __syncthreads();
  for (int g = threadIdx.x; g < p.groups; g += kScanThreads) {
    int column[kMaxChunks];
    load_chunk_column(p, g, column);
    int position = p.group_offsets[g];
#pragma unroll
    for (int c = 0; c < kMaxChunks; ++c) {
      if (c < p.chunks) p.chunk_counts[int64_t(c) * p.groups + g] = position;
      position += column[c];
    }
  }
}

// Step 3, one CTA per chunk: sorted position i of the chunk, group g, goes to g's chunk base + (i - start).
// PRECOND: blockDim.x == kScanThreads; gridDim.x == chunks; step 2 complete.
__global__ static void __launch_bounds__(kScanThreads) align_chunk_scatter_kernel(const __grid_constant__ AlignKernelParams p) {
  detail::pdl_enter();  // first: launched by detail::launch (launch.cuh)
  const int chunk = blockIdx.x, i = chunk * kChunkPairs + int(threadIdx.x);
  if (i >= p.pairs) return;
  const int key = p.keys[i];
  if (key >= p.groups) return;
  const int64_t cell = int64_t(chunk) * p.groups + key;
  p.sorted_pairs[p.chunk_counts[cell] + int(threadIdx.x) - p.chunk_starts[cell]] = p.values[i];
}

// ---- launchers ----------------------------------------------------------------------------------------

constexpr size_t kAlign = 256;
size_t round_up(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

int key_bits(int64_t groups) {  // keys run over [0, G]: G is the "no slot" key, sorted last
  int bits = 1;
  while ((int64_t(1) << bits) <= groups) ++bits;
  return bits;
}

size_t cub_temp_bytes(int64_t pairs, int64_t groups) {
  size_t bytes = 0;
  LMX_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const int32_t*>(nullptr),
                                                 static_cast<int32_t*>(nullptr), static_cast<const int32_t*>(nullptr),
                                                 static_cast<int32_t*>(nullptr), int(std::max<int64_t>(pairs, 1)), 0,
                                                 key_bits(groups)));
  return bytes;
}

}  // namespace

int64_t moe_align_capacity(int64_t pairs, int64_t groups, int block_m) {
  return std::max<int64_t>(pairs + std::min(pairs, groups) * (block_m - 1), block_m);
}

// Chunks of the chunked path for `pairs` (it runs up to kMoeAlignSmallPairs pairs).
int64_t align_chunks(int64_t pairs) {
  return (std::min(pairs, kMoeAlignSmallPairs) + kChunkPairs - 1) / kChunkPairs;
}

size_t moe_align_workspace_bytes(int64_t pairs, int64_t groups) {
  // counts, unpadded offsets, keys, values, sorted keys, sorted values, CUB's scratch, the chunked path's
  // [chunks, G] counts and starts
  return 2 * round_up(size_t(groups) * 4) + 4 * round_up(size_t(pairs) * 4) + round_up(cub_temp_bytes(pairs, groups)) +
         2 * round_up(size_t(align_chunks(pairs)) * size_t(groups) * 4);
}

void moe_align(const MoeAlignParams& p, cudaStream_t stream) {
  const char* op = "moe_align";
  if (p.single_expert && (p.experts != 1 || p.slots <= 0 || p.token_slot.dtype != DType::I32 ||
                          p.token_slot.ndim != 1)) {
    detail::contract_failure(op, "token_slot", p.token_slot, "[T] I32 with single_expert: experts == 1, slots > 0");
  }
  if (!p.single_expert && (p.topk_ids.dtype != DType::I32 || p.topk_ids.ndim != 2)) {
    detail::contract_failure(op, "topk_ids", p.topk_ids, "[T, K] I32");
  }
  const int64_t tokens = p.single_expert ? p.token_slot.dim(0) : p.topk_ids.dim(0);
  const int64_t top_k = p.single_expert ? 1 : p.topk_ids.dim(1), pairs = tokens * top_k;
  const bool by_slot = p.slots > 0;
  if (by_slot && (p.token_slot.dtype != DType::I32 || p.token_slot.ndim != 1 || p.token_slot.dim(0) != tokens)) {
    detail::contract_failure(op, "token_slot", p.token_slot, "[T] I32 with T = topk_ids.dim(0)");
  }
  if (p.order_by_slot && (!by_slot || p.single_expert)) {
    detail::contract_failure(op, "token_slot", p.token_slot, "slots > 0 and not single_expert with order_by_slot");
  }
  const int64_t run_groups = p.order_by_slot ? p.slots + 1 : 1;  // groups padded together as one run
  const int64_t groups = p.order_by_slot ? p.experts * run_groups : by_slot ? p.slots * p.experts : p.experts;
  LMX_CHECK(p.experts > 0 && p.slots >= 0, "moe_align: E = %lld, S = %lld", (long long)p.experts,
            (long long)p.slots);
  LMX_CHECK(p.block_m >= 1 && p.block_m <= 1024 && (p.block_m & (p.block_m - 1)) == 0,
            "moe_align: block_m = %d is not a power of two in [1, 1024]", p.block_m);
  LMX_CHECK(p.slot_group_rows == 1 || (p.order_by_slot && p.slot_group_rows <= p.block_m &&
                                        (p.slot_group_rows & (p.slot_group_rows - 1)) == 0),
            "moe_align: slot_group_rows = %d needs order_by_slot and a power of two <= block_m (%d)",
            p.slot_group_rows, p.block_m);
  const int64_t capacity = moe_align_capacity(pairs, groups / run_groups, p.block_m), max_tiles = capacity / p.block_m;
  LMX_CHECK(capacity < 0x7fffffff && groups < 0x7fffffff);
  auto require_i32 = [&](const char* name, const Tensor& t, int64_t numel) {
    if (t.dtype != DType::I32 || t.numel() != numel) {
      detail::contract_failure(op, name, t, ("I32 with " + std::to_string(numel) + " elements").c_str());
    }
  };
  require_i32("sorted_pairs", p.sorted_pairs, capacity);
  require_i32("tile_group", p.tile_group, max_tiles);
  require_i32("group_offsets", p.group_offsets, groups + 1);
  require_i32("num_tiles", p.num_tiles, 1);
  if (p.workspace.nbytes() < moe_align_workspace_bytes(pairs, groups)) {
    detail::contract_failure(op, "workspace", p.workspace,
                             ("moe_align_workspace_bytes = " + std::to_string(moe_align_workspace_bytes(pairs, groups)) +
                              " bytes").c_str());
  }
  std::initializer_list<std::pair<const char*, const Tensor*>> tensors = {
      {"sorted_pairs", &p.sorted_pairs}, {"tile_group", &p.tile_group},   {"group_offsets", &p.group_offsets},
      {"num_tiles", &p.num_tiles},       {"workspace", &p.workspace}};
  detail::require_cuda(op, tensors);
  if (!p.single_expert) detail::require_cuda(op, {{"topk_ids", &p.topk_ids}});
  if (by_slot) detail::require_cuda(op, {{"token_slot", &p.token_slot}});

  char* work = static_cast<char*>(p.workspace.data);
  auto carve = [&](size_t bytes) {
    char* at = work;
    work += round_up(bytes);
    return reinterpret_cast<int32_t*>(at);
  };
  int32_t* counts = carve(size_t(groups) * 4);
  int32_t* unpadded = carve(size_t(groups) * 4);
  int32_t* keys = carve(size_t(pairs) * 4);
  int32_t* values = carve(size_t(pairs) * 4);
  int32_t* sorted_keys = carve(size_t(pairs) * 4);
  int32_t* sorted_values = carve(size_t(pairs) * 4);
  int32_t* cub_temp = carve(cub_temp_bytes(pairs, groups));
  const int64_t chunks = align_chunks(pairs);
  int32_t* chunk_counts = carve(size_t(chunks) * size_t(groups) * 4);
  int32_t* chunk_starts = carve(size_t(chunks) * size_t(groups) * 4);

  const AlignKernelParams params{.topk_ids = p.single_expert ? nullptr : static_cast<const int32_t*>(p.topk_ids.data),
                                 .token_slot = by_slot ? static_cast<const int32_t*>(p.token_slot.data) : nullptr,
                                 .pairs = int(pairs),
                                 .top_k = int(top_k),
                                 .experts = int(p.experts),
                                 .groups = int(groups),
                                 .run_groups = int(run_groups),
                                 .group_rows = p.slot_group_rows,
                                 .block_m = p.block_m,
                                 .max_tiles = int(max_tiles),
                                 .key_bits = key_bits(groups),
                                 .counts = counts,
                                 .unpadded_offsets = unpadded,
                                 .keys = keys,
                                 .values = values,
                                 .sorted_keys = sorted_keys,
                                 .sorted_values = sorted_values,
                                 .sorted_pairs = static_cast<int32_t*>(p.sorted_pairs.data),
                                 .tile_group = static_cast<int32_t*>(p.tile_group.data),
                                 .group_offsets = static_cast<int32_t*>(p.group_offsets.data),
                                 .num_tiles = static_cast<int32_t*>(p.num_tiles.data),
                                 .chunk_counts = chunk_counts,
                                 .chunk_starts = chunk_starts,
                                 .chunks = int(chunks)};
  // The one dispatch on batch size: the tiny path up to kMoeAlignTinyPairs (its group counters fit its
  // shared memory), one block up to 4 items per thread, chunks up to kMoeAlignSmallPairs, the device radix
  // sort above.
  const bool tiny_fits = pairs <= kMoeAlignTinyPairs && groups <= kMoeAlignTinyGroups;
  if (p.force_path == 3 || (p.force_path < 0 && tiny_fits)) {
    LMX_CHECK(tiny_fits, "moe_align: tiny path forced with %lld pairs, %lld groups (at most %lld, %lld)",
              (long long)pairs, (long long)groups, (long long)kMoeAlignTinyPairs, (long long)kMoeAlignTinyGroups);
    detail::launch(align_tiny_kernel, dim3(1), dim3(kTinyThreads), size_t(groups) * 4, stream, params);
    LMX_CUDA_CHECK_LAUNCH();
    return;
  }
  const bool warp_fits = pairs <= kMoeAlignWarpPairs && groups <= kMoeAlignWarpGroups;
  if (p.force_path == 4 || (p.force_path < 0 && warp_fits)) {
    LMX_CHECK(warp_fits, "moe_align: warp path forced with %lld pairs, %lld groups (at most %lld, %lld)",
              (long long)pairs, (long long)groups, (long long)kMoeAlignWarpPairs, (long long)kMoeAlignWarpGroups);
    const size_t shared_bytes = size_t(kScanThreads / 32 + 1) * size_t(groups) * 4;
    LMX_CUDA_CHECK(cudaFuncSetAttribute(align_warp_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared_bytes)));
    detail::launch(align_warp_kernel, dim3(1), dim3(kScanThreads), shared_bytes, stream, params);
    LMX_CUDA_CHECK_LAUNCH();
    return;
  }
  const bool chunked =
      p.force_path == 2 || (p.force_path < 0 && pairs > kMaxOneBlockPairs && pairs <= kMoeAlignSmallPairs);
  if (chunked) {
    LMX_CHECK(pairs <= kMoeAlignSmallPairs, "moe_align: chunked path forced with %lld pairs (at most %lld)",
              (long long)pairs, (long long)kMoeAlignSmallPairs);
    if (pairs > 0) {
      detail::launch(align_chunk_sort_kernel, dim3(unsigned(chunks)), dim3(kScanThreads), 0, stream, params);
      LMX_CUDA_CHECK_LAUNCH();
    }
    detail::launch(align_chunk_scan_kernel, dim3(1), dim3(kScanThreads), 0, stream, params);
    LMX_CUDA_CHECK_LAUNCH();
    if (pairs > 0) {
      detail::launch(align_chunk_scatter_kernel, dim3(unsigned(chunks)), dim3(kScanThreads), 0, stream, params);
      LMX_CUDA_CHECK_LAUNCH();
    }
    return;
  }
  const bool small = p.force_path == 0 || (p.force_path < 0 && pairs <= kMoeAlignSmallPairs);
  if (small) {
    LMX_CHECK(pairs <= kMoeAlignSmallPairs, "moe_align: one-block path forced with %lld pairs (at most %lld)",
              (long long)pairs, (long long)kMoeAlignSmallPairs);
    auto run = [&](auto kernel, size_t shared_bytes) {
      LMX_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared_bytes)));
      detail::launch(kernel, dim3(1), dim3(kScanThreads), shared_bytes, stream, params);
    };
    // Items per thread by batch size (the one dispatch): the sort's work scales with kItems, not pairs.
    if (pairs <= kScanThreads) run(align_block_kernel<1>, block_sort_shared_bytes<1>());
    else if (pairs <= 4 * kScanThreads) run(align_block_kernel<4>, block_sort_shared_bytes<4>());
    else run(align_block_kernel<16>, block_sort_shared_bytes<16>());
    LMX_CUDA_CHECK_LAUNCH();
    return;
  }
  LMX_CUDA_CHECK(cudaMemsetAsync(counts, 0, size_t(groups) * 4, stream));
  if (pairs > 0) {
    detail::launch(align_keys_kernel, dim3(detail::blocks_for(pairs, kKeyThreads)), dim3(kKeyThreads), 0, stream, params);
    LMX_CUDA_CHECK_LAUNCH();
    size_t temp_bytes = cub_temp_bytes(pairs, groups);
    LMX_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(cub_temp, temp_bytes, keys, sorted_keys, values, sorted_values,
                                                   int(pairs), 0, key_bits(groups), stream));
  }
  detail::launch(align_scan_kernel, dim3(1), dim3(kScanThreads), 0, stream, params);
  LMX_CUDA_CHECK_LAUNCH();
  if (pairs > 0) {
    detail::launch(align_scatter_kernel, dim3(detail::blocks_for(pairs, kKeyThreads)), dim3(kKeyThreads), 0, stream, params);
    LMX_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace lmx::cuda
