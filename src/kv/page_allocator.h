// PageAllocator: the free list of KV-cache pages (host bookkeeping only; the cache tensors themselves
// live with the engine). Pages are handed out lowest-id first so runs are reproducible.
// Who calls: the engine's scheduler when it grows or frees a sequence's block table.
#pragma once
#include <cstdint>
#include <vector>

namespace lmx::kv {

// Number of pages needed to hold `tokens` tokens at `page_size` tokens per page.
inline int pages_for_tokens(int64_t tokens, int page_size) { return int((tokens + page_size - 1) / page_size); }

class PageAllocator {
 public:
  explicit PageAllocator(int num_pages);
  int num_pages() const { return num_pages_; }
  int num_free() const { return int(free_.size()); }
  // Append `count` pages to `pages`; false (and nothing taken) when fewer than `count` are free.
  bool allocate(int count, std::vector<int32_t>* pages);
  // Return pages to the free list; aborts on a page that is out of range or already free (double free).
  void release(const std::vector<int32_t>& pages);

 private:
  int num_pages_;
  std::vector<int32_t> free_;      // kept sorted descending so back() is the lowest id
  std::vector<bool> is_free_;      // [num_pages]
};

}  // namespace lmx::kv
