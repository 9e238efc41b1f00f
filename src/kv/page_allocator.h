// PageAllocator: the KV-cache pages (host bookkeeping only; the cache tensors live with the engine) with
// reference counts and vLLM-style automatic prefix caching: a full, computed page is registered under the
// chain hash of its prefix; a later sequence with the same prefix (same tokens, same adapter content)
// shares it instead of recomputing it. Who calls: the engine's scheduler.
#pragma once
#include <compare>
#include <cstdint>
#include <set>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace lmx::kv {

// Number of pages needed to hold `tokens` tokens at `page_size` tokens per page.
inline int pages_for_tokens(int64_t tokens, int page_size) { return int((tokens + page_size - 1) / page_size); }

// 128-bit identity of one full page: every token before it, its own tokens and the adapter (through the
// chain root). Non-cryptographic (two independent 64-bit lanes); a false hit needs a 128-bit collision.
struct PageHash {
  uint64_t hi = 0, lo = 0;
  friend bool operator==(const PageHash&, const PageHash&) = default;
  friend auto operator<=>(const PageHash&, const PageHash&) = default;
};

// The parent of a sequence's first page: the adapter's identity (its content hash; "" = base model), so
// no sequence ever shares pages computed under other weights.
PageHash prefix_root(std::string_view adapter_identity);
// The hash of the page holding tokens[0, page_size) whose prefix hashes to `parent`.
PageHash page_hash(const PageHash& parent, const int32_t* tokens, int page_size);

class PageAllocator {
 public:
  explicit PageAllocator(int num_pages);
  int num_pages() const { return num_pages_; }
  // Pages a caller can allocate now: never-registered free pages plus cached pages nobody references.
  int num_free() const { return int(plain_free_.size() + evictable_.size()); }
  // Pages referenced by at least one sequence (num_pages = num_used + num_free).
  int num_used() const { return num_pages_ - num_free(); }
  // Free pages that still hold a registered prefix (part of num_free; evicted least-recently-freed first).
  int num_cached() const { return int(evictable_.size()); }
  uint64_t num_evictions() const { return evictions_; }

  // Append `count` pages (one reference each) to `pages`; false (and nothing taken) when fewer than `count`
  // are free. Never-registered pages go first (lowest id first, so runs are reproducible), then cached
  // pages are evicted, least recently freed first.
  bool allocate(int count, std::vector<int32_t>* pages);
  // Drop one reference from each page; aborts on a page out of range or not referenced (double free). A
  // page whose last reference goes stays cached if registered. Pages are freed last to first, so a
  // sequence's tail is evicted before its head (its head is the prefix others most likely share).
  void release(const std::vector<int32_t>& pages);

  // Prefix cache. The cached page registered under `hash`, or -1.
  int32_t lookup(const PageHash& hash) const;
  // Take one more reference to a registered page (referenced or cached-free).
  void share(int32_t page);
  // Publish a referenced, full, computed page under `hash`. When another page already holds `hash` (two
  // sequences computed the same prefix at once) this page stays unregistered and is freed normally.
  void register_page(int32_t page, const PageHash& hash);
  int ref_count(int32_t page) const;
  bool is_registered(int32_t page) const;

 private:
  struct HashOf {
    size_t operator()(const PageHash& h) const { return size_t(h.hi ^ (h.lo * 0x9e3779b97f4a7c15ull)); }
  };
  void check_page(int32_t page) const;

  int num_pages_;
  std::vector<int32_t> ref_;                // [num_pages] references held by sequences
  std::vector<PageHash> hash_;              // [num_pages] valid where registered_
  std::vector<bool> registered_;            // [num_pages]
  std::vector<uint64_t> freed_at_;          // [num_pages] stamp of the release that made a cached page free
  std::set<int32_t> plain_free_;            // free, not registered: lowest id first
  std::set<std::pair<uint64_t, int32_t>> evictable_;  // free, registered: (freed_at, page), oldest first
  std::unordered_map<PageHash, int32_t, HashOf> cached_;  // registered hash -> page
  uint64_t clock_ = 0;
  uint64_t evictions_ = 0;
};

}  // namespace lmx::kv
