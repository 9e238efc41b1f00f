// Sampling kernel (ops/sampling.h; the arithmetic contract is in sampling.cuh) and its launcher. One
// thread-block cluster per row: its CTAs split the row, read it once from HBM into shared memory, and
// answer every question about it by radix descents over on-chip data, reduced across the cluster through
// distributed shared memory. Nothing sorts the vocabulary; nothing touches global memory but the row and
// the outputs.
//
// A descent finds, for a weight (a count, or the integer mass) and a target, the first token in CDF order
// whose running weight reaches the target: three levels of 11-bit digits of the token's 32-bit order key
// (each level: a shared-memory histogram of the tokens that match the digits found so far, summed over the
// cluster, scanned for the crossing bin), then the tie group of the full key, taken in id order. The row's
// questions, in order:
//   argmax and max logit (one pass)  →  logsumexp (one pass, with logprobs)  →  top-N of the raw logits
//   (count descent)  →  for temperature > 0: x → e in place, top-k (count descent), kept mass (one pass),
//   top-p prefix (mass descent), the draw (mass descent).
#include "backends/cuda/sampling.cuh"

#include <cooperative_groups.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "backends/cuda/check.h"
#include "backends/cuda/device.cuh"
#include "ops/backend.h"

namespace lmx::cuda {
namespace {

namespace cg = cooperative_groups;

// ---- kernel -------------------------------------------------------------------------------------------

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kDigitBits = 11;
constexpr int kBins = 1 << kDigitBits;  // histogram bins of one descent level
constexpr float kMassScale = 0x1p44f;   // fixed point of the integer masses: the top token weighs 2^44
constexpr int kTokensPerCta = 8192;     // the launcher's target when it picks the cluster size

struct SampleKernelParams {
  const float* logits;       // [B, V] f32
  const float* temperature;  // [B] f32
  const int32_t* top_k;      // [B] i32
  const float* top_p;        // [B] f32
  const float* uniform;      // [B] f32
  int32_t* out_tokens;       // [B] i32
  float* out_logprob;        // [B] f32, or null
  int32_t* out_top_ids;      // [B, N] i32, or null
  float* out_top_logprobs;   // [B, N] f32, or null
  int64_t vocab;             // V
  int chunk;                 // tokens per CTA: a multiple of 4, ctas · chunk >= V
  int top_n;                 // N (0 = none)
  bool vector_loads;         // V % 4 == 0 and logits 16-byte aligned
};

// Dynamic shared memory of one CTA, in bytes from its start: two histograms and two reduced slices (each
// ping-ponged between descent levels, see `Cta`), the CTA's share of the top-N list, its tokens.
struct SharedLayout {
  size_t hist = 0, slice = 0, list = 0, values = 0, bytes = 0;
};

__host__ __device__ constexpr SharedLayout shared_layout(int ctas, int chunk, int top_n) {
  SharedLayout l;
  l.hist = 0;
  l.slice = l.hist + 2 * kBins * sizeof(uint64_t);
  l.list = l.slice + 2 * size_t(kBins / ctas) * sizeof(uint64_t);
  l.values = l.list + size_t((top_n + 1) / 2 * 2) * sizeof(uint64_t);  // 16-byte aligned: uint4 loads
  l.bytes = l.values + size_t(chunk) * sizeof(uint32_t);
  return l;
}

// Static shared scratch. The two `exchange` slots alternate between cluster-wide scalar reductions: a CTA
// reads the others' slot r only before it arrives at the barrier of exchange r + 1, and nobody writes
// slot r again before passing that barrier, so one barrier per exchange is enough.
struct Scratch {
  uint64_t warp[kWarps];    // block reductions
  uint64_t exchange[2];     // cluster reductions of one u64 per CTA
  uint64_t slice_total[2];  // per descent level (ping-pong with the histograms)
  uint64_t level_need, level_above;
  uint32_t level_digit;
  int found;                // find_tied's answer
  uint32_t list_count;      // entries in this CTA's top-N list
};

// The order keys: ascending key = CDF order. Raw logits (top-N, argmax): descending value; -0 is folded
// into +0 (they are equal logits, so the id decides, as in the oracle's comparisons). Scaled (after
// x → e): the bits of e >= 0 as they are (+0 canonical), +inf for -inf logits.
__device__ __forceinline__ uint32_t logit_key(uint32_t bits) {
  if (bits == 0x80000000u) bits = 0;
  const uint32_t ascending = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  return ~ascending;
}
__device__ __forceinline__ float logit_of_key(uint32_t key) {
  const uint32_t ascending = ~key;
  return __uint_as_float((ascending & 0x80000000u) ? (ascending & 0x7fffffffu) : ~ascending);
}
__device__ __forceinline__ uint32_t scaled_key(float e) {
  const uint32_t bits = __float_as_uint(e);
  return bits == 0x80000000u ? 0u : bits;
}

// The integer mass of exp(d), d <= 0 (0 for d = -inf and for d below ~-31, where it rounds away).
__device__ __forceinline__ uint64_t quantized_exp(float d) { return __float2ull_rn(expf(d) * kMassScale); }
__device__ __forceinline__ uint64_t mass_of_key(uint32_t scaled) { return quantized_exp(-__uint_as_float(scaled)); }

enum class Space { kLogit, kScaled };  // what the CTA's values hold: raw logit bits, or scaled keys
enum class Weight { kCount, kMass };

template <Space kSpace>
__device__ __forceinline__ uint32_t key_of(uint32_t value) {
  return kSpace == Space::kLogit ? logit_key(value) : value;
}
template <Weight kWeight>
__device__ __forceinline__ uint64_t weight_of(uint32_t scaled_or_logit_key) {
  return kWeight == Weight::kCount ? 1 : mass_of_key(scaled_or_logit_key);
}

// Sum / minimum over the block; every thread gets it. PRECOND: every thread calls it.
__device__ uint64_t block_sum(uint64_t value, Scratch& s) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(~0u, value, offset);
  if (lane == 0) s.warp[warp] = value;
  __syncthreads();
  uint64_t total = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total += s.warp[w];
  __syncthreads();
  return total;
}
__device__ uint64_t block_min(uint64_t value, Scratch& s) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) value = min(value, __shfl_xor_sync(~0u, value, offset));
  if (lane == 0) s.warp[warp] = value;
  __syncthreads();
  uint64_t least = ~0ull;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) least = min(least, s.warp[w]);
  __syncthreads();
  return least;
}
// Exclusive prefix sum in thread order; *total gets the block's sum. PRECOND: every thread calls it.
__device__ uint64_t block_exclusive_scan(uint64_t value, Scratch& s, uint64_t* total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  uint64_t inclusive = value;
#pragma unroll
  for (int offset = 1; offset < 32; offset *= 2) {
    const uint64_t below = __shfl_up_sync(~0u, inclusive, offset);
    if (lane >= offset) inclusive += below;
  }
  if (lane == 31) s.warp[warp] = inclusive;
  __syncthreads();
  uint64_t before = 0, all = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    if (w < warp) before += s.warp[w];
    all += s.warp[w];
  }
  __syncthreads();
  *total = all;
  return before + inclusive - value;
}

// One CTA's view of its row. Every branch that decides whether a cluster barrier is reached depends only
// on values every CTA of the cluster computes identically (row parameters, cluster reductions), so all
// CTAs pass the same barriers in the same order.
struct Cta {
  cg::cluster_group cluster;
  unsigned rank, ctas;
  Scratch& s;
  uint64_t* hist;    // [2][kBins] u64: this level's local histogram (ping-pong)
  uint64_t* slice;   // [2][kBins / ctas] u64: this CTA's slice of the cluster-wide histogram (ping-pong)
  uint64_t* list;    // [N] u64: this CTA's top-N entries, (logit key << 32) | id
  uint32_t* values;  // [chunk]: logit bits, then scaled keys
  int count;         // tokens of this CTA (the last CTAs may hold fewer, or none)
  int64_t begin;     // id of values[0]
  int level_round = 0, exchange_round = 0;

  // The sum (or minimum) of one u64 per CTA over the cluster, identical on every CTA.
  __device__ uint64_t cluster_reduce(uint64_t mine, bool minimum) {
    uint64_t* slot = &s.exchange[exchange_round++ & 1];
    if (threadIdx.x == 0) *slot = mine;
    cluster.sync();
    uint64_t result = minimum ? ~0ull : 0;
    for (unsigned r = 0; r < ctas; ++r) {
      const uint64_t v = *cluster.map_shared_rank(slot, r);
      result = minimum ? min(result, v) : result + v;
    }
    return result;
  }
};

// The answer of a descent: the first token in CDF order whose running weight reaches the target is the
// pick-th token (1-based, by id) of the tie group of `key`; `above` is the weight of every key before it.
struct TieGroup {
  uint32_t key;
  uint64_t above;
  uint64_t pick;
  uint64_t each;         // the weight of one token of the group (all share the key)
  uint64_t before_mine;  // group tokens in the CTAs of lower rank (lower ids)
  uint64_t mine;         // group tokens in this CTA
  uint64_t total;        // group tokens in the row
};

// PRECOND: 1 <= need <= the row's total weight; every thread of every CTA of the cluster calls it.
template <Space kSpace, Weight kWeight>
__device__ TieGroup descend(Cta& c, uint64_t need) {
  constexpr int kKeyBits = kSpace == Space::kLogit ? 32 : 31;  // a scaled key's sign bit is always 0
  const int tid = threadIdx.x;
  uint32_t prefix = 0;  // the digits found so far
  uint64_t above = 0;
  int resolved = 0, last_bits = 0;
  const uint64_t* last_hist = nullptr;
  while (resolved < kKeyBits) {
    const int bits = min(kDigitBits, kKeyBits - resolved);
    const int shift = kKeyBits - resolved - bits;
    const int bins = 1 << bits;
    const int buffer = c.level_round++ & 1;
    uint64_t* hist = c.hist + buffer * kBins;
    uint64_t* slice = c.slice + buffer * (kBins / int(c.ctas));
    uint64_t* slice_total = &c.s.slice_total[buffer];
    // The other CTAs last read this buffer two levels ago, before the barriers of the level in between.
    for (int i = tid; i < bins; i += kThreads) hist[i] = 0;
    __syncthreads();
    for (int i = tid; i < c.count; i += kThreads) {
      const uint32_t key = key_of<kSpace>(c.values[i]);
      if ((uint64_t(key) >> (shift + bits)) != prefix) continue;
      const uint64_t w = weight_of<kWeight>(key);
      if (w != 0) atomicAdd(reinterpret_cast<unsigned long long*>(&hist[(key >> shift) & uint32_t(bins - 1)]), (unsigned long long)w);
    }
    c.cluster.sync();

    // This CTA sums its slice of the bins over the cluster.
    const int width = bins / int(c.ctas);  // >= 512 / 8: the shortest level has 9 bits
    uint64_t part = 0;
    for (int j = tid; j < width; j += kThreads) {
      uint64_t sum = 0;
      for (unsigned r = 0; r < c.ctas; ++r) sum += c.cluster.map_shared_rank(hist, r)[int(c.rank) * width + j];
      slice[j] = sum;
      part += sum;
    }
    part = block_sum(part, c.s);
    if (tid == 0) *slice_total = part;
    c.cluster.sync();

    // Every CTA finds the crossing the same way: first the slice, then the bin inside it.
    uint64_t before = 0;
    unsigned owner = 0;
    for (; owner + 1 < c.ctas; ++owner) {
      const uint64_t t = *c.cluster.map_shared_rank(slice_total, owner);
      if (before + t >= need) break;
      before += t;
    }
    const uint64_t remaining = need - before;
    const uint64_t* owner_slice = c.cluster.map_shared_rank(slice, owner);
    const int per_thread = (width + kThreads - 1) / kThreads;
    const int first = min(tid * per_thread, width), last = min(first + per_thread, width);
    uint64_t mine = 0;
    for (int j = first; j < last; ++j) mine += owner_slice[j];
    if (tid == 0) {  // only if the precondition fails: keep the last bin rather than garbage
      c.s.level_digit = uint32_t(int(owner) * width + width - 1);
      c.s.level_need = 1;
      c.s.level_above = before;
    }
    uint64_t slice_sum;
    const uint64_t exclusive = block_exclusive_scan(mine, c.s, &slice_sum);
    if (mine > 0 && exclusive < remaining && remaining <= exclusive + mine) {
      uint64_t run = exclusive;
      for (int j = first; j < last; ++j) {
        const uint64_t b = owner_slice[j];
        if (run + b >= remaining) {
          c.s.level_digit = uint32_t(int(owner) * width + j);
          c.s.level_need = remaining - run;
          c.s.level_above = before + run;
          break;
        }
        run += b;
      }
    }
    __syncthreads();
    const uint32_t digit = c.s.level_digit;
    need = c.s.level_need;
    above += c.s.level_above;
    __syncthreads();  // level_* are rewritten by the next level
    prefix = (prefix << bits) | digit;
    resolved += bits;
    last_bits = bits;
    last_hist = hist;
  }

  // The last level's local histograms hold one full key per bin: the group's token count in each CTA.
  TieGroup g{.key = prefix, .above = above, .pick = 0, .each = 0, .before_mine = 0, .mine = 0, .total = 0};
  g.each = max(weight_of<kWeight>(prefix), uint64_t(1));  // > 0 for a group that holds a crossing
  g.pick = (need + g.each - 1) / g.each;
  const uint32_t last_digit = prefix & ((1u << last_bits) - 1);
  for (unsigned r = 0; r < c.ctas; ++r) {
    const uint64_t n = c.cluster.map_shared_rank(last_hist, r)[last_digit] / g.each;
    if (r < c.rank) g.before_mine += n;
    if (r == c.rank) g.mine = n;
    g.total += n;
  }
  return g;
}

// The index in this CTA's values of its m-th token (1-based, by id) whose key is `key`, or -1.
// PRECOND: every thread of the CTA calls it (no cluster barrier inside).
template <Space kSpace>
__device__ int find_tied(Cta& c, uint32_t key, uint64_t m) {
  const int tid = threadIdx.x;
  const int per_thread = (c.count + kThreads - 1) / kThreads;
  const int first = min(tid * per_thread, c.count), last = min(first + per_thread, c.count);
  uint64_t mine = 0;
  for (int i = first; i < last; ++i) mine += key_of<kSpace>(c.values[i]) == key;
  if (tid == 0) c.s.found = -1;
  uint64_t total;
  const uint64_t exclusive = block_exclusive_scan(mine, c.s, &total);
  if (exclusive < m && m <= exclusive + mine) {
    uint64_t run = exclusive;
    for (int i = first; i < last; ++i) {
      if (key_of<kSpace>(c.values[i]) == key && ++run == m) {
        c.s.found = i;
        break;
      }
    }
  }
  __syncthreads();
  const int found = c.s.found;
  __syncthreads();
  return found;
}

// The sum of the integer masses of this row's tokens whose scaled key is below `limit`, over the cluster.
__device__ uint64_t mass_below(Cta& c, uint32_t limit) {
  uint64_t sum = 0;
  for (int i = threadIdx.x; i < c.count; i += kThreads) {
    if (c.values[i] < limit) sum += mass_of_key(c.values[i]);
  }
  return c.cluster_reduce(block_sum(sum, c.s), false);
}

// The N largest raw logits, descending, ties by id, with their logprobs: a count descent finds the N-th,
// each CTA lists its members, rank 0 merges the lists (ranking each entry by comparisons) and writes.
__device__ void top_logprobs(Cta& c, const SampleKernelParams& p, int64_t row, double log_normaliser) {
  const TieGroup g = descend<Space::kLogit, Weight::kCount>(c, uint64_t(p.top_n));
  const uint64_t take = g.pick > g.before_mine ? min(g.pick - g.before_mine, g.mine) : 0;  // my tied members
  const int last_tied = take > 0 ? find_tied<Space::kLogit>(c, g.key, take) : -1;
  if (threadIdx.x == 0) c.s.list_count = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < c.count; i += kThreads) {
    const uint32_t key = logit_key(c.values[i]);
    if (key < g.key || (key == g.key && i <= last_tied)) {
      const uint32_t slot = atomicAdd(&c.s.list_count, 1u);
      if (slot < uint32_t(p.top_n)) c.list[slot] = (uint64_t(key) << 32) | uint64_t(c.begin + i);
    }
  }
  c.cluster.sync();
  if (c.rank == 0) {
    // Rank 0's histograms are free now (every CTA read them before the barrier above; the next descent
    // clears them before its next barrier): they hold the merged list, N <= kSamplingMaxTopN <= 2 · kBins.
    uint64_t* merged = c.hist;
    int filled = 0;
    for (unsigned r = 0; r < c.ctas; ++r) {  // the bounds only matter if the descent were wrong
      const int n = min(int(*c.cluster.map_shared_rank(&c.s.list_count, r)), p.top_n - filled);
      const uint64_t* list = c.cluster.map_shared_rank(c.list, r);
      for (int i = threadIdx.x; i < n; i += kThreads) merged[filled + i] = list[i];
      filled += n;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < filled; i += kThreads) {
      const uint64_t entry = merged[i];
      int position = 0;
      for (int j = 0; j < filled; ++j) position += merged[j] < entry;
      const float logit = logit_of_key(uint32_t(entry >> 32));
      if (position >= p.top_n) continue;
      p.out_top_ids[row * p.top_n + position] = int32_t(uint32_t(entry));
      p.out_top_logprobs[row * p.top_n + position] = float(double(logit) - log_normaliser);
    }
    __syncthreads();
  }
}

// PRECOND: blockDim.x == kThreads; clusters of `ctas` CTAs along x, one cluster per row; dynamic shared
// memory laid out by shared_layout(ctas, chunk, top_n); 1 <= N <= kSamplingMaxTopN when top_n > 0; the
// row parameters within ops/sampling.h's ranges (out-of-range values give some token, never a fault).
__global__ static void __launch_bounds__(kThreads, 1) sample_kernel(const __grid_constant__ SampleKernelParams p) {
  extern __shared__ __align__(16) unsigned char shared[];
  __shared__ Scratch scratch;
  cg::cluster_group cluster = cg::this_cluster();
  const unsigned ctas = cluster.num_blocks(), rank = cluster.block_rank();
  const SharedLayout layout = shared_layout(int(ctas), p.chunk, p.top_n);
  const int64_t row = blockIdx.x / ctas;
  const int64_t begin = int64_t(rank) * p.chunk;
  Cta c{.cluster = cluster,
        .rank = rank,
        .ctas = ctas,
        .s = scratch,
        .hist = reinterpret_cast<uint64_t*>(shared + layout.hist),
        .slice = reinterpret_cast<uint64_t*>(shared + layout.slice),
        .list = reinterpret_cast<uint64_t*>(shared + layout.list),
        .values = reinterpret_cast<uint32_t*>(shared + layout.values),
        .count = int(max(int64_t(0), min(int64_t(p.chunk), p.vocab - begin))),
        .begin = begin};
  const float* row_logits = p.logits + row * p.vocab;

  // 1. The CTA's share of the row into shared memory, once.
  if (p.vector_loads) {
    detail::copy_units(reinterpret_cast<uint4*>(c.values), reinterpret_cast<const uint4*>(row_logits + begin),
                       c.count / 4, threadIdx.x, kThreads);
  } else {
    detail::copy_units(c.values, reinterpret_cast<const uint32_t*>(row_logits + begin), c.count, threadIdx.x,
                       kThreads);
  }
  __syncthreads();

  // 2. Argmax (lowest id on ties): the least (logit key, id) over the row.
  uint64_t best = ~0ull;
  for (int i = threadIdx.x; i < c.count; i += kThreads) {
    best = min(best, (uint64_t(logit_key(c.values[i])) << 32) | uint64_t(begin + i));
  }
  best = c.cluster_reduce(block_min(best, scratch), true);
  const int32_t argmax = int32_t(uint32_t(best));
  const float max_logit = logit_of_key(uint32_t(best >> 32));

  // 3. Raw logsumexp: the exact sum of the integer masses of exp(x − max).
  double log_normaliser = 0.0;
  if (p.out_logprob) {
    uint64_t sum = 0;
    for (int i = threadIdx.x; i < c.count; i += kThreads) {
      sum += quantized_exp(__fsub_rn(__uint_as_float(c.values[i]), max_logit));
    }
    sum = c.cluster_reduce(block_sum(sum, scratch), false);
    log_normaliser = double(max_logit) + log(double(sum) * 0x1p-44);
  }
  if (p.top_n > 0) top_logprobs(c, p, row, log_normaliser);

  // 4. Sampling. Greedy rows, and rows whose scaled maximum is not finite, keep the argmax.
  const float temperature = p.temperature[row];
  const float scaled_max = temperature > 0.0f ? __fdiv_rn(max_logit, temperature) : 0.0f;
  int32_t token = argmax;
  bool token_is_mine = rank == 0;
  if (temperature > 0.0f && isfinite(scaled_max)) {
    // x → e = m − x / T, in place; e >= 0 since fl(x / T) <= fl(max / T) = m.
    for (int i = threadIdx.x; i < c.count; i += kThreads) {
      const float scaled = __fdiv_rn(__uint_as_float(c.values[i]), temperature);
      c.values[i] = scaled_key(__fsub_rn(scaled_max, scaled));
    }
    __syncthreads();

    // Top-k: the kept mass is the mass of every key before the k-th token's plus its tie group's share.
    const int32_t top_k = p.top_k[row];
    uint64_t kept_mass;
    if (top_k > 0 && top_k < p.vocab) {
      const TieGroup k = descend<Space::kScaled, Weight::kCount>(c, uint64_t(top_k));
      kept_mass = mass_below(c, k.key) + min(k.pick, k.total) * mass_of_key(k.key);
    } else {
      kept_mass = mass_below(c, ~0u);
    }
    // Top-p: the running mass at the end of the shortest prefix reaching ceil(top_p · kept mass).
    uint64_t prefix_mass = kept_mass;
    const float top_p = p.top_p[row];
    if (top_p < 1.0f) {
      const double want = ceil(double(kept_mass) * double(top_p));
      const uint64_t need = want >= double(kept_mass) ? kept_mass : max(uint64_t(want), uint64_t(1));
      const TieGroup cut = descend<Space::kScaled, Weight::kMass>(c, need);
      prefix_mass = cut.above + cut.pick * cut.each;
    }
    // The draw: the first token whose running mass exceeds floor(uniform · prefix mass).
    const double target = floor(double(p.uniform[row]) * double(prefix_mass));
    const uint64_t need = target >= double(prefix_mass) ? prefix_mass : uint64_t(max(target, 0.0)) + 1;
    const TieGroup draw = descend<Space::kScaled, Weight::kMass>(c, need);
    if (draw.pick <= draw.total) {  // always, unless a precondition failed: then rank 0 keeps the argmax
      token_is_mine = draw.before_mine < draw.pick && draw.pick <= draw.before_mine + draw.mine;
      if (token_is_mine) token = int32_t(begin + find_tied<Space::kScaled>(c, draw.key, draw.pick - draw.before_mine));
    }
  }
  if (token_is_mine && threadIdx.x == 0) {
    p.out_tokens[row] = token;
    if (p.out_logprob) p.out_logprob[row] = float(double(row_logits[token]) - log_normaliser);
  }
  cluster.sync();  // no CTA leaves while another may still read its shared memory
}

// ---- launchers ----------------------------------------------------------------------------------------

int chunk_for(int64_t vocab, int ctas) { return int(((vocab + ctas - 1) / ctas + 3) / 4 * 4); }

int max_shared_bytes() {
  static const int bytes = [] {
    int device = 0, optin = 0;
    LMX_CUDA_CHECK(cudaGetDevice(&device));
    LMX_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    return optin - int(sizeof(Scratch));
  }();
  return bytes;
}

// Once per process, on the first (eager) call: the kernel may use all the opt-in shared memory.
void prepare_kernel() {
  static const bool prepared = [] {
    LMX_CUDA_CHECK(cudaFuncSetAttribute(sample_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, max_shared_bytes()));
    return true;
  }();
  (void)prepared;
}

}  // namespace

int sampling_cluster_ctas(int64_t vocab) {
  int ctas = 1;
  while (ctas < kSamplingMaxClusterCtas && int64_t(ctas) * kTokensPerCta < vocab) ctas *= 2;
  return ctas;
}

bool sampling_fits(int64_t vocab, int cluster_ctas, int64_t top_n) {
  if (vocab > (int64_t(1) << 19)) return false;  // the row's mass, V · 2^44, must fit in a u64 (with margin)
  return shared_layout(cluster_ctas, chunk_for(vocab, cluster_ctas), int(top_n)).bytes <= size_t(max_shared_bytes());
}

void sample(const ops::SamplingParams& p, cudaStream_t stream, const SamplingLaunch& launch) {
  ops::require(ops::check(p), "cuda::sample");
  detail::require_cuda("sample", {{"SamplingParams.logits", &p.logits},
                                  {"SamplingParams.temperature", &p.temperature},
                                  {"SamplingParams.top_k", &p.top_k},
                                  {"SamplingParams.top_p", &p.top_p},
                                  {"SamplingParams.uniform", &p.uniform},
                                  {"SamplingParams.out_tokens", &p.out_tokens}});
  if (p.out_logprob.defined()) detail::require_cuda("sample", {{"SamplingParams.out_logprob", &p.out_logprob}});
  const int64_t rows = p.logits.dim(0), vocab = p.logits.dim(1);
  const int64_t top_n = p.out_top_ids.defined() ? p.out_top_ids.dim(1) : 0;
  if (top_n > 0) {
    detail::require_cuda("sample", {{"SamplingParams.out_top_ids", &p.out_top_ids},
                                    {"SamplingParams.out_top_logprobs", &p.out_top_logprobs}});
  }
  if (top_n > kSamplingMaxTopN) {
    detail::contract_failure("sample", "SamplingParams.out_top_ids", p.out_top_ids,
                             ("at most " + std::to_string(kSamplingMaxTopN) + " columns (the merge buffer)").c_str());
  }
  if (rows == 0) return;
  const int ctas = launch.cluster_ctas > 0 ? launch.cluster_ctas : sampling_cluster_ctas(vocab);
  if (ctas != 1 && ctas != 2 && ctas != 4 && ctas != 8) {
    std::fprintf(stderr, "loramux: cuda::sample called against its contract: SamplingLaunch.cluster_ctas: expected "
                         "0, 1, 2, 4 or 8, found %d\n", launch.cluster_ctas);
    std::abort();
  }
  if (!sampling_fits(vocab, ctas, top_n)) {
    const size_t fixed = shared_layout(ctas, 0, int(top_n)).bytes;
    const std::string want = "a row that " + std::to_string(ctas) + " CTAs hold in shared memory (V <= " +
                             std::to_string(std::min<int64_t>(int64_t(1) << 19,
                                                              int64_t(ctas) * int64_t(max_shared_bytes() - fixed) / 4 / 4 * 4)) +
                             ")";
    detail::contract_failure("sample", "SamplingParams.logits", p.logits, want.c_str());
  }
  LMX_CHECK(rows * ctas <= 0x7fffffff);
  prepare_kernel();
  const int chunk = chunk_for(vocab, ctas);
  const SampleKernelParams params{
      .logits = static_cast<const float*>(p.logits.data),
      .temperature = static_cast<const float*>(p.temperature.data),
      .top_k = static_cast<const int32_t*>(p.top_k.data),
      .top_p = static_cast<const float*>(p.top_p.data),
      .uniform = static_cast<const float*>(p.uniform.data),
      .out_tokens = static_cast<int32_t*>(p.out_tokens.data),
      .out_logprob = p.out_logprob.defined() ? static_cast<float*>(p.out_logprob.data) : nullptr,
      .out_top_ids = top_n > 0 ? static_cast<int32_t*>(p.out_top_ids.data) : nullptr,
      .out_top_logprobs = top_n > 0 ? static_cast<float*>(p.out_top_logprobs.data) : nullptr,
      .vocab = vocab,
      .chunk = chunk,
      .top_n = int(top_n),
      .vector_loads = vocab % 4 == 0 && detail::aligned16(p.logits.data)};

  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = unsigned(ctas);
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(unsigned(rows * ctas));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = shared_layout(ctas, chunk, int(top_n)).bytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  LMX_CUDA_CHECK(cudaLaunchKernelEx(&config, sample_kernel, params));
}

}  // namespace lmx::cuda
