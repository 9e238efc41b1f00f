// The persistent MoE GEMM's stream-K tail partition (moe_gemm.cu, set_moe_gemm_stream_k): which CTA runs which
// k-range of which work unit, and where a unit's pieces are. Plain integer arithmetic, callable on the host
// as well, so tests/ops/test_stream_k_plan.cpp checks the partition on the CPU. Not the kernel's memory
// protocol (partials, counters): that is stream_k_merge in moe_gemm.cu.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define LMX_STREAM_K_FN __host__ __device__ __forceinline__
#else
#define LMX_STREAM_K_FN inline
#endif

namespace lmx::cuda::detail {

constexpr int kStreamKMinTiles = 8;  // the fewest k-tiles a tail CTA takes, where the tail has that many

// With `units` work units on a grid of G CTAs: units / G full rounds run whole (data-parallel); the tail's
// units · k_tiles k-tiles are split evenly over `ctas` CTAs, at least as many as tail units (so a CTA's range
// is at most one unit long and touches at most two units) and at most G.
struct StreamKPlan {
  int dp_units = 0;  // units run whole, round by round
  int ctas = 0;      // CTAs that share the tail's k-tiles (0: no tail)
  int64_t work = 0;  // the tail's k-tiles
  // The first tail k-tile of CTA c (c <= ctas).
  LMX_STREAM_K_FN int64_t start(int c) const { return int64_t(c) * work / ctas; }
  // The CTA whose range holds tail k-tile i (0 <= i < work).
  LMX_STREAM_K_FN int cta_of(int64_t i) const {
    int c = int(i * ctas / work);
    while (c + 1 < ctas && start(c + 1) <= i) ++c;
    while (c > 0 && start(c) > i) --c;
    return c;
  }
  // Which of CTA c's (at most two) tail segments lies in the unit whose first tail k-tile is unit_begin: the
  // first if c's range starts inside that unit, else the second. PRECOND: c's range touches the unit.
  LMX_STREAM_K_FN int piece_of(int c, int64_t unit_begin) const { return start(c) >= unit_begin ? 0 : 1; }
};

LMX_STREAM_K_FN StreamKPlan stream_k_plan(int units, int grid, int k_tiles) {
  StreamKPlan plan;
  plan.dp_units = units / grid * grid;
  const int tail = units - plan.dp_units;
  plan.work = int64_t(tail) * k_tiles;
  const int64_t by_size = plan.work / kStreamKMinTiles;  // CTAs of at least kStreamKMinTiles k-tiles each
  plan.ctas = tail == 0 ? 0 : by_size >= grid ? grid : by_size <= tail ? tail : int(by_size);
  return plan;
}

// Calls f(id, kb, ke, piece) for CTA `first`'s work in order: unit `id`'s k-tiles [kb, ke); piece -1 for a
// whole unit, else the segment's index among the CTA's tail segments (0 or 1: its slot in the partials).
// Without stream-K: every `stride`-th of `units`, whole. Producer and consumers walk the same sequence.
template <class F>
LMX_STREAM_K_FN void walk_units(bool stream_k, const StreamKPlan& plan, int first, int stride, int units, int k_tiles,
                                F&& f) {
  const int whole = stream_k ? plan.dp_units : units;
  for (int id = first; id < whole; id += stride) f(id, 0, k_tiles, -1);
  if (!stream_k || first >= plan.ctas) return;
  const int64_t end = plan.start(first + 1);
  int piece = 0;
  for (int64_t i = plan.start(first); i < end; ++piece) {
    const int unit = int(i / k_tiles), kb = int(i % k_tiles);
    const int ke = end - i >= k_tiles - kb ? k_tiles : kb + int(end - i);
    f(plan.dp_units + unit, kb, ke, kb == 0 && ke == k_tiles ? -1 : piece);
    i += ke - kb;
  }
}

}  // namespace lmx::cuda::detail
