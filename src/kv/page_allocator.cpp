// PageAllocator implementation: reference counts, the two free sets and the prefix-hash index.
#include "kv/page_allocator.h"

#include "core/rng.h"
#include "core/status.h"

namespace lmx::kv {

namespace {
constexpr uint64_t kLaneA = 0x6b762d7072656678ull;  // "kv-prefx"
constexpr uint64_t kLaneB = 0xd6e8feb86659fd93ull;
}  // namespace

PageHash prefix_root(std::string_view adapter_identity) {
  uint64_t a = mix64(kLaneA ^ adapter_identity.size()), b = mix64(kLaneB + adapter_identity.size());
  for (unsigned char c : adapter_identity) {
    a = mix64(a ^ c);
    b = mix64(b + (uint64_t(c) << 17) + 0x632be59bd9b4e019ull);
  }
  return {a, b};
}

PageHash page_hash(const PageHash& parent, const int32_t* tokens, int page_size) {
  uint64_t a = mix64(parent.hi ^ kLaneA), b = mix64(parent.lo + kLaneB);
  for (int i = 0; i < page_size; ++i) {
    const uint64_t token = uint32_t(tokens[i]);
    a = mix64(a ^ token);
    b = mix64(b + token * 0xff51afd7ed558ccdull + uint64_t(i));
  }
  return {mix64(a ^ uint64_t(page_size)), mix64(b ^ a)};
}

PageAllocator::PageAllocator(int num_pages)
    : num_pages_(num_pages),
      ref_(size_t(num_pages), 0),
      hash_(size_t(num_pages)),
      registered_(size_t(num_pages), false),
      freed_at_(size_t(num_pages), 0) {
  LMX_CHECK(num_pages >= 0);
  for (int32_t p = 0; p < num_pages; ++p) plain_free_.insert(plain_free_.end(), p);
}

void PageAllocator::check_page(int32_t page) const { LMX_CHECK(page >= 0 && page < num_pages_); }

bool PageAllocator::allocate(int count, std::vector<int32_t>* pages) {
  if (count < 0 || count > num_free()) return false;
  for (int i = 0; i < count; ++i) {
    int32_t page;
    if (!plain_free_.empty()) {
      page = *plain_free_.begin();
      plain_free_.erase(plain_free_.begin());
    } else {  // evict the cached page freed longest ago
      page = evictable_.begin()->second;
      evictable_.erase(evictable_.begin());
      auto it = cached_.find(hash_[size_t(page)]);
      LMX_CHECK(it != cached_.end() && it->second == page);
      cached_.erase(it);
      registered_[size_t(page)] = false;
      ++evictions_;
    }
    ref_[size_t(page)] = 1;
    pages->push_back(page);
  }
  return true;
}

void PageAllocator::release(const std::vector<int32_t>& pages) {
  for (auto it = pages.rbegin(); it != pages.rend(); ++it) {
    const int32_t page = *it;
    check_page(page);
    LMX_CHECK(ref_[size_t(page)] > 0);
    if (--ref_[size_t(page)] > 0) continue;
    if (registered_[size_t(page)]) {
      freed_at_[size_t(page)] = ++clock_;
      evictable_.insert({freed_at_[size_t(page)], page});
    } else {
      plain_free_.insert(page);
    }
  }
}

int32_t PageAllocator::lookup(const PageHash& hash) const {
  auto it = cached_.find(hash);
  return it == cached_.end() ? -1 : it->second;
}

void PageAllocator::share(int32_t page) {
  check_page(page);
  LMX_CHECK(registered_[size_t(page)]);  // only published pages are shared
  if (ref_[size_t(page)]++ == 0) {
    size_t erased = evictable_.erase({freed_at_[size_t(page)], page});
    LMX_CHECK(erased == 1);
  }
}

void PageAllocator::register_page(int32_t page, const PageHash& hash) {
  check_page(page);
  LMX_CHECK(ref_[size_t(page)] > 0 && !registered_[size_t(page)]);
  if (cached_.count(hash)) return;
  cached_.emplace(hash, page);
  hash_[size_t(page)] = hash;
  registered_[size_t(page)] = true;
}

int PageAllocator::ref_count(int32_t page) const {
  check_page(page);
  return ref_[size_t(page)];
}

bool PageAllocator::is_registered(int32_t page) const {
  check_page(page);
  return registered_[size_t(page)];
}

}  // namespace lmx::kv
