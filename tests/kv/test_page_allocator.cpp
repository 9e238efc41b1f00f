// PageAllocator: allocation order, exhaustion, release and reuse.
#include <gtest/gtest.h>

#include "kv/page_allocator.h"

namespace lmx::kv {

TEST(PageAllocator, PagesForTokens) {
  EXPECT_EQ(pages_for_tokens(0, 16), 0);
  EXPECT_EQ(pages_for_tokens(1, 16), 1);
  EXPECT_EQ(pages_for_tokens(16, 16), 1);
  EXPECT_EQ(pages_for_tokens(17, 16), 2);
}

TEST(PageAllocator, AllocatesLowestFirstAndRefusesWhenShort) {
  PageAllocator alloc(4);
  std::vector<int32_t> a;
  ASSERT_TRUE(alloc.allocate(3, &a));
  EXPECT_EQ(a, (std::vector<int32_t>{0, 1, 2}));
  std::vector<int32_t> b;
  EXPECT_FALSE(alloc.allocate(2, &b));
  EXPECT_TRUE(b.empty());
  EXPECT_EQ(alloc.num_free(), 1);
  alloc.release({1});
  ASSERT_TRUE(alloc.allocate(2, &b));
  EXPECT_EQ(b, (std::vector<int32_t>{1, 3}));
  EXPECT_EQ(alloc.num_free(), 0);
}

TEST(PageAllocatorDeathTest, DoubleFreeAborts) {
  PageAllocator alloc(2);
  std::vector<int32_t> a;
  ASSERT_TRUE(alloc.allocate(1, &a));
  alloc.release(a);
  EXPECT_DEATH(alloc.release(a), "check failed");
}

}  // namespace lmx::kv
