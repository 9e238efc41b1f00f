// PageAllocator implementation.
#include "kv/page_allocator.h"

#include <algorithm>
#include <functional>

#include "core/status.h"

namespace lmx::kv {

PageAllocator::PageAllocator(int num_pages) : num_pages_(num_pages), is_free_(size_t(num_pages), true) {
  LMX_CHECK(num_pages >= 0);
  free_.reserve(size_t(num_pages));
  for (int p = num_pages - 1; p >= 0; --p) free_.push_back(p);
}

bool PageAllocator::allocate(int count, std::vector<int32_t>* pages) {
  if (count < 0 || count > num_free()) return false;
  for (int i = 0; i < count; ++i) {
    int32_t page = free_.back();
    free_.pop_back();
    is_free_[size_t(page)] = false;
    pages->push_back(page);
  }
  return true;
}

void PageAllocator::release(const std::vector<int32_t>& pages) {
  for (int32_t page : pages) {
    LMX_CHECK(page >= 0 && page < num_pages_);
    LMX_CHECK(!is_free_[size_t(page)]);
    is_free_[size_t(page)] = true;
    free_.push_back(page);
  }
  std::sort(free_.begin(), free_.end(), std::greater<int32_t>());
}

}  // namespace lmx::kv
