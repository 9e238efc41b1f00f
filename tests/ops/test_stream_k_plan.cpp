// The persistent MoE GEMM's stream-K partition (src/backends/cuda/stream_k.h) on the CPU: over many
// (units, grid, k-tiles), every k-tile of every unit runs exactly once, in at most two tail segments a CTA,
// and the rule by which a unit's finishing CTA finds each piece's partial names the slot its writer used.
// The kernel's memory protocol (partials, counters) is tested on the device (CudaMoeGemm.StreamKTailMatchesCpu).
#include "backends/cuda/stream_k.h"

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

namespace lmx::cuda::detail {
namespace {

struct Segment {
  int cta, kb, ke, piece;
};

TEST(StreamKPlan, EveryKTileOnceAndPiecesFoundWhereWritten) {
  for (int grid : {1, 3, 7, 132, 264}) {
    for (int k_tiles : {1, 2, 7, 8, 12, 45}) {
      for (int units = 0; units <= 3 * grid + 5; units += units < 2 * grid ? 1 : 3) {
        SCOPED_TRACE("grid " + std::to_string(grid) + ", k-tiles " + std::to_string(k_tiles) + ", units " +
                     std::to_string(units));
        const StreamKPlan plan = stream_k_plan(units, grid, k_tiles);
        const int tail = units - plan.dp_units;
        ASSERT_EQ(plan.dp_units % grid, 0);
        ASSERT_LT(tail, grid);
        ASSERT_GE(tail, 0);
        if (tail > 0) {
          ASSERT_GE(plan.ctas, tail);
          ASSERT_LE(plan.ctas, grid);
        } else {
          ASSERT_EQ(plan.ctas, 0);
        }
        std::map<int, std::vector<Segment>> by_unit;
        for (int cta = 0; cta < grid; ++cta) {
          int segments = 0;
          walk_units(true, plan, cta, grid, units, k_tiles, [&](int id, int kb, int ke, int piece) {
            ASSERT_GE(id, 0);
            ASSERT_LT(id, units);
            ASSERT_LT(kb, ke);
            ASSERT_LE(ke, k_tiles);
            if (id < plan.dp_units) {
              EXPECT_EQ(id % grid, cta) << "whole units round by round";
              EXPECT_EQ(piece, -1);
            } else {
              ++segments;
              EXPECT_EQ(piece, kb == 0 && ke == k_tiles ? -1 : segments - 1);
              EXPECT_LE(piece, 1) << "a tail range touches at most two units";
            }
            by_unit[id].push_back({cta, kb, ke, piece});
          });
          EXPECT_LE(segments, 2) << "CTA " << cta;
          if (cta < plan.ctas && plan.work >= int64_t(plan.ctas) * kStreamKMinTiles) {
            EXPECT_GE(plan.start(cta + 1) - plan.start(cta), kStreamKMinTiles) << "CTA " << cta;
          }
        }
        ASSERT_EQ(int(by_unit.size()), units) << "every unit has work";
        for (const auto& [id, segments] : by_unit) {
          // The k-tiles [0, k_tiles) once each, in CTA order.
          int next = 0;
          for (const Segment& s : segments) {
            EXPECT_EQ(s.kb, next) << "unit " << id;
            next = s.ke;
          }
          EXPECT_EQ(next, k_tiles) << "unit " << id;
          if (segments.size() == 1) {
            EXPECT_EQ(segments[0].piece, -1) << "unit " << id;
            continue;
          }
          // Split: the finishing CTA reads CTAs cta_of(begin) .. cta_of(end - 1), each at piece_of.
          const int64_t begin = int64_t(id - plan.dp_units) * k_tiles;
          const int c0 = plan.cta_of(begin), c1 = plan.cta_of(begin + k_tiles - 1);
          ASSERT_EQ(c1 - c0 + 1, int(segments.size())) << "unit " << id;
          for (int c = c0; c <= c1; ++c) {
            const Segment& s = segments[size_t(c - c0)];
            EXPECT_EQ(s.cta, c) << "unit " << id;
            EXPECT_EQ(plan.piece_of(c, begin), s.piece) << "unit " << id << ", CTA " << c;
          }
        }
      }
    }
  }
}

// Without stream-K the walk is the plain persistent loop: every stride-th unit, whole.
TEST(StreamKPlan, OffWalksEveryStrideThUnitWhole) {
  std::vector<int> seen;
  walk_units(false, StreamKPlan{}, 2, 5, 23, 9, [&](int id, int kb, int ke, int piece) {
    EXPECT_EQ(kb, 0);
    EXPECT_EQ(ke, 9);
    EXPECT_EQ(piece, -1);
    seen.push_back(id);
  });
  EXPECT_EQ(seen, (std::vector<int>{2, 7, 12, 17, 22}));
}

}  // namespace
}  // namespace lmx::cuda::detail
