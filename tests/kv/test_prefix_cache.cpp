// PageAllocator's prefix cache: chain hashes (tokens, parent, adapter identity), reference counts,
// cached-but-free accounting, eviction order (plain pages first, then cached pages least recently freed,
// a sequence's tail before its head), duplicate registration.
#include <gtest/gtest.h>

#include <random>

#include "core/rng.h"
#include "kv/page_allocator.h"

namespace lmx::kv {
namespace {

std::vector<int32_t> random_tokens(Rng& rng, int n) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int32_t& x : t) x = int32_t(rng.next_u64() % 150000);
  return t;
}

TEST(PrefixHash, ChainDependsOnTokensParentAndAdapter) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Rng rng(seed);
  const int P = 16;
  std::vector<int32_t> tokens = random_tokens(rng, 2 * P);
  const PageHash base = prefix_root(""), a = prefix_root("0123456789abcdef0123456789abcdef");
  const PageHash b = prefix_root("0123456789abcdef0123456789abcdee");
  EXPECT_NE(base, a);
  EXPECT_NE(a, b);
  const PageHash a0 = page_hash(a, tokens.data(), P), a1 = page_hash(a0, tokens.data() + P, P);
  EXPECT_EQ(a0, page_hash(prefix_root("0123456789abcdef0123456789abcdef"), tokens.data(), P));  // deterministic
  EXPECT_NE(a0, page_hash(b, tokens.data(), P));     // other adapter content
  EXPECT_NE(a0, page_hash(base, tokens.data(), P));  // base model
  EXPECT_NE(a1, page_hash(a, tokens.data() + P, P));  // same page tokens, other prefix
  std::vector<int32_t> changed = tokens;
  changed[size_t(rng.next_u64() % P)] ^= 1;  // one token differs anywhere in the page
  EXPECT_NE(a0, page_hash(a, changed.data(), P));
  std::vector<int32_t> swapped = tokens;
  std::swap(swapped[0], swapped[1]);  // order matters
  if (swapped[0] != swapped[1]) EXPECT_NE(a0, page_hash(a, swapped.data(), P));
}

TEST(PrefixCache, CachedPagesAreFreeButFoundUntilEvicted) {
  PageAllocator alloc(6);
  const PageHash root = prefix_root("");
  std::vector<int32_t> tokens = {1, 2, 3, 4, 5, 6, 7, 8};
  const PageHash h0 = page_hash(root, tokens.data(), 4), h1 = page_hash(h0, tokens.data() + 4, 4);
  std::vector<int32_t> seq;
  ASSERT_TRUE(alloc.allocate(3, &seq));
  EXPECT_EQ(seq, (std::vector<int32_t>{0, 1, 2}));
  alloc.register_page(seq[0], h0);
  alloc.register_page(seq[1], h1);
  EXPECT_EQ(alloc.lookup(h0), 0);
  EXPECT_EQ(alloc.lookup(h1), 1);
  EXPECT_EQ(alloc.num_used(), 3);
  EXPECT_EQ(alloc.num_cached(), 0);

  // Another sequence shares the first page while the owner runs.
  std::vector<int32_t> other = {alloc.lookup(h0)};
  alloc.share(other[0]);
  EXPECT_EQ(alloc.ref_count(0), 2);
  alloc.release(seq);  // page 2 (unregistered) becomes plain free, page 1 cached, page 0 still used
  EXPECT_EQ(alloc.num_used(), 1);
  EXPECT_EQ(alloc.num_cached(), 1);
  EXPECT_EQ(alloc.num_free(), 5);
  alloc.release(other);
  EXPECT_EQ(alloc.num_used(), 0);
  EXPECT_EQ(alloc.num_cached(), 2);
  EXPECT_EQ(alloc.num_free(), 6);

  // A cached free page can be taken back by a new sequence.
  std::vector<int32_t> again = {alloc.lookup(h0)};
  alloc.share(again[0]);
  EXPECT_EQ(alloc.num_cached(), 1);
  EXPECT_EQ(alloc.num_free(), 5);

  // Allocation takes the never-registered pages (2..5, lowest first) before evicting anything.
  std::vector<int32_t> fresh;
  ASSERT_TRUE(alloc.allocate(4, &fresh));
  EXPECT_EQ(fresh, (std::vector<int32_t>{2, 3, 4, 5}));
  EXPECT_EQ(alloc.num_evictions(), 0u);
  EXPECT_EQ(alloc.lookup(h1), 1);
  // Now only the cached page 1 is free: taking it evicts h1.
  std::vector<int32_t> more;
  ASSERT_TRUE(alloc.allocate(1, &more));
  EXPECT_EQ(more, std::vector<int32_t>{1});
  EXPECT_EQ(alloc.num_evictions(), 1u);
  EXPECT_EQ(alloc.lookup(h1), -1);
  EXPECT_FALSE(alloc.is_registered(1));
  EXPECT_EQ(alloc.lookup(h0), 0);  // referenced pages are never evicted
  std::vector<int32_t> none;
  EXPECT_FALSE(alloc.allocate(1, &none));
  EXPECT_TRUE(none.empty());
  alloc.release(more);
  alloc.release(fresh);
  alloc.release(again);
  EXPECT_EQ(alloc.num_used(), 0);
  EXPECT_EQ(alloc.num_free(), 6);
  EXPECT_EQ(alloc.num_cached(), 1);  // h0 only
}

// Pages released together are evicted tail first; pages released earlier go before later ones.
TEST(PrefixCache, EvictsLeastRecentlyFreedAndTailFirst) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Rng rng(seed);
  const int P = 4;
  PageAllocator alloc(6);
  auto fill = [&](int pages, std::vector<PageHash>* hashes) {
    std::vector<int32_t> seq;
    EXPECT_TRUE(alloc.allocate(pages, &seq));
    std::vector<int32_t> tokens = random_tokens(rng, pages * P);
    PageHash parent = prefix_root("x");
    for (int i = 0; i < pages; ++i) {
      parent = page_hash(parent, tokens.data() + i * P, P);
      alloc.register_page(seq[size_t(i)], parent);
      hashes->push_back(parent);
    }
    return seq;
  };
  std::vector<PageHash> first, second;
  std::vector<int32_t> a = fill(3, &first), b = fill(3, &second);
  alloc.release(a);  // freed first: evicted first, tail (a[2]) before head (a[0])
  alloc.release(b);
  EXPECT_EQ(alloc.num_cached(), 6);
  std::vector<int32_t> got;
  for (int32_t expect : {a[2], a[1], a[0], b[2], b[1], b[0]}) {
    got.clear();
    ASSERT_TRUE(alloc.allocate(1, &got));
    EXPECT_EQ(got[0], expect);
  }
  for (const PageHash& h : first) EXPECT_EQ(alloc.lookup(h), -1);
  EXPECT_EQ(alloc.num_evictions(), 6u);
}

TEST(PrefixCache, DuplicateRegistrationKeepsTheFirstPage) {
  PageAllocator alloc(2);
  std::vector<int32_t> tokens = {9, 8, 7, 6};
  const PageHash h = page_hash(prefix_root(""), tokens.data(), 4);
  std::vector<int32_t> x, y;
  ASSERT_TRUE(alloc.allocate(1, &x));
  ASSERT_TRUE(alloc.allocate(1, &y));
  alloc.register_page(x[0], h);
  alloc.register_page(y[0], h);  // computed the same prefix concurrently: stays unregistered
  EXPECT_EQ(alloc.lookup(h), x[0]);
  EXPECT_FALSE(alloc.is_registered(y[0]));
  alloc.release(y);
  alloc.release(x);
  EXPECT_EQ(alloc.num_cached(), 1);
  EXPECT_EQ(alloc.num_free(), 2);
}

TEST(PrefixCacheDeathTest, SharingAnUnregisteredPageAborts) {
  PageAllocator alloc(2);
  std::vector<int32_t> a;
  ASSERT_TRUE(alloc.allocate(1, &a));
  EXPECT_DEATH(alloc.share(a[0]), "check failed");
}

}  // namespace
}  // namespace lmx::kv
