// Scheduler implementation (see scheduler.h for the policy).
#include "engine/scheduler.h"

#include <algorithm>

namespace lmx::engine {

Scheduler::Scheduler(const SchedulerLimits& limits, int num_kv_pages, AdapterStore* adapters)
    : limits_(limits), pages_(num_kv_pages), adapters_(adapters) {}

void Scheduler::add(std::unique_ptr<Sequence> seq) {
  seq->state = SeqState::kWaiting;
  waiting_.push_back(std::move(seq));
}

bool Scheduler::ensure_pages(Sequence* seq, int tokens_after) {
  int need = kv::pages_for_tokens(tokens_after, limits_.page_size) - int(seq->pages.size());
  return need <= 0 || pages_.allocate(need, &seq->pages);
}

void Scheduler::release_pages(Sequence* seq) {
  pages_.release(seq->pages);
  seq->pages.clear();
  seq->num_registered_pages = 0;
}

void Scheduler::extend_page_hashes(Sequence* seq, int num_pages) {
  const int P = limits_.page_size;
  LMX_CHECK(int64_t(num_pages) * P <= int64_t(seq->tokens.size()));
  while (int(seq->page_hashes.size()) < num_pages) {
    const size_t i = seq->page_hashes.size();
    const kv::PageHash parent = i == 0 ? kv::prefix_root(adapters_->identity(seq->request.adapter)) : seq->page_hashes.back();
    seq->page_hashes.push_back(kv::page_hash(parent, seq->tokens.data() + i * size_t(P), P));
  }
}

// The cached prefix is the longest run of leading full pages found in the cache, never including the
// page of the last token: the step must compute at least one token to produce the logits it samples.
bool Scheduler::admit_pages(Sequence* seq, int budget, int whole_below, int* num_tokens) {
  LMX_CHECK(seq->num_computed == 0 && seq->pages.empty());
  const int P = limits_.page_size, len = int(seq->tokens.size());
  std::vector<int32_t> hits;
  int reclaimed = 0;  // hits that are free now (cached, unreferenced): taking them shrinks num_free
  if (limits_.enable_prefix_caching) {
    const int usable = (len - 1) / P;
    extend_page_hashes(seq, usable);
    for (int i = 0; i < usable; ++i) {
      const int32_t page = pages_.lookup(seq->page_hashes[size_t(i)]);
      if (page < 0) break;
      hits.push_back(page);
      reclaimed += pages_.ref_count(page) == 0;
    }
  }
  const int cached_tokens = int(hits.size()) * P;
  const int rest = len - cached_tokens;
  if (rest > budget && rest <= whole_below) return false;
  const int n = std::min(rest, budget);
  const int need = kv::pages_for_tokens(cached_tokens + n, P) - int(hits.size());
  if (need > pages_.num_free() - reclaimed) return false;
  for (int32_t page : hits) pages_.share(page);
  seq->pages = hits;
  LMX_CHECK(pages_.allocate(need, &seq->pages));  // fits: checked above
  seq->num_computed = cached_tokens;
  seq->num_registered_pages = int(hits.size());
  seq->num_cached_tokens = cached_tokens;
  if (limits_.enable_prefix_caching) {
    prefix_queries_ += uint64_t(len);
    prefix_hits_ += uint64_t(cached_tokens);
  }
  *num_tokens = n;
  return true;
}

// Recompute-style preemption: the sequence keeps its tokens but loses its cache and goes back to the
// front of the waiting queue. Its published pages stay cached, so readmission usually finds them.
void Scheduler::preempt(std::list<std::unique_ptr<Sequence>>::iterator it) {
  std::unique_ptr<Sequence> seq = std::move(*it);
  running_.erase(it);
  release_pages(seq.get());
  seq->num_computed = 0;
  if (seq->slot >= 0) adapters_->release(seq->slot);
  seq->slot = -1;
  seq->state = SeqState::kWaiting;
  ++preemptions_;
  waiting_.push_front(std::move(seq));
}

std::vector<ScheduledSeq> Scheduler::schedule() {
  std::vector<ScheduledSeq> step;
  int budget = limits_.max_num_batched_tokens;
  adapters_->collect_loads();

  // 1. Running sequences, oldest first: decode tokens and continuing prefill chunks.
  bool prompt_in_step = false;  // a prefill chunk is in the step (PrefillPacking::kWhole)
  for (auto it = running_.begin(); it != running_.end() && budget > 0 && int(step.size()) < limits_.max_num_seqs;) {
    Sequence* seq = it->get();
    // The prefill lane's sequence runs there; with the lane, prefills (more than one pending token) go there too.
    if (seq->in_lane || (limits_.prefill_lane && seq->num_pending() > 1)) {
      ++it;
      continue;
    }
    int n = std::min(seq->num_pending(), budget);
    bool got = ensure_pages(seq, seq->num_computed + n);
    while (!got) {  // free pages by preempting the newest sequence that is not already in this step
      auto victim = std::prev(running_.end());
      while (victim != it && (*victim)->in_lane) --victim;  // the lane writes its pages right now
      if (victim == it) break;
      preempt(victim);
      got = ensure_pages(seq, seq->num_computed + n);
    }
    if (!got) {  // even alone it cannot grow: preempt it too and stop
      auto next = std::next(it);
      preempt(it);
      it = next;
      break;
    }
    step.push_back({seq, n, seq->num_computed + n == int(seq->tokens.size())});
    budget -= n;
    prompt_in_step = prompt_in_step || seq->num_computed < seq->prompt_len;
    ++it;
  }

  // 2. Waiting prompts, FIFO, skipping those whose adapter cannot get a slot right now (or is still being
  // read from disk) — unless one has been skipped too long for a slot: then later adapter requests wait
  // too, so held slots drain to it. With the prefill lane, prompts start only there (schedule_lane).
  bool starving = false;
  for (auto it = waiting_.begin();
       !limits_.prefill_lane && it != waiting_.end() && budget > 0 &&
       int(running_.size()) < limits_.max_num_seqs && int(step.size()) < limits_.max_num_seqs;) {
    // kWhole: beside another prompt's chunk, a prompt that a later step can hold whole (next to the
    // running sequences' decode tokens) is not split; it starts there.
    const int whole_below = limits_.prefill_packing == SchedulerLimits::PrefillPacking::kWhole && prompt_in_step
                                ? limits_.max_num_batched_tokens - int(running_.size())
                                : 0;
    ScheduledSeq admitted;
    const Admission admission = try_admit(it, budget, whole_below, &starving, &admitted);
    if (admission == Admission::kStop) break;  // FIFO: later prompts wait for pages (or a step) too
    if (admission == Admission::kSkipped) continue;
    step.push_back(admitted);
    budget -= admitted.num_tokens;
    prompt_in_step = true;
  }

  // 3. Requests queued behind a full batch: start reading their adapters now (host room permitting), so
  // the read overlaps the steps before their turn. Bounded to one batch's worth of the queue.
  int looked = 0;
  for (auto it = waiting_.begin(); it != waiting_.end() && looked < limits_.max_num_seqs; ++it, ++looked)
    if (!(*it)->request.adapter.empty()) adapters_->prefetch((*it)->request.adapter);
  return step;
}

Scheduler::Admission Scheduler::try_admit(std::deque<std::unique_ptr<Sequence>>::iterator& it, int budget,
                                          int whole_below, bool* starving, ScheduledSeq* out) {
  Sequence* seq = it->get();
  const std::string& adapter = seq->request.adapter;
  if (!adapter.empty()) {
    AdapterStore::Readiness ready = adapters_->prepare(adapter);
    if (ready == AdapterStore::Readiness::kFailed) {  // its adapter could not be read: the request ends
      std::unique_ptr<Sequence> owned = std::move(*it);
      it = waiting_.erase(it);
      release_pages(owned.get());
      owned->state = SeqState::kFinished;
      owned->finish = FinishReason::kAbort;
      owned->error = adapters_->load_error(adapter).message();
      failed_.push_back(std::move(owned));
      return Admission::kSkipped;
    }
    if (ready == AdapterStore::Readiness::kLoading) {  // a read is in flight: wait, holding nothing
      ++it;
      return Admission::kSkipped;
    }
    if (ready == AdapterStore::Readiness::kSlotsHeld) {
      if (++seq->adapter_wait_steps >= limits_.max_adapter_wait_steps) *starving = true;
      ++it;
      return Admission::kSkipped;
    }
  }
  if (*starving && !adapter.empty()) {  // base-model requests hold no slot and may still go
    ++it;
    return Admission::kSkipped;
  }
  int n = 0;
  if (!admit_pages(seq, budget, whole_below, &n)) return Admission::kStop;
  if (!adapter.empty()) {
    Result<int> slot = adapters_->acquire(adapter);  // prepare() said ready; only a refused copy fails
    if (!slot.ok()) {
      release_pages(seq);
      seq->num_computed = 0;
      seq->state = SeqState::kFinished;
      seq->finish = FinishReason::kAbort;
      seq->error = slot.status().message();
      failed_.push_back(std::move(*it));
      it = waiting_.erase(it);
      return Admission::kSkipped;
    }
    seq->slot = slot.value();
  }
  seq->state = SeqState::kRunning;
  *out = {seq, n, seq->num_computed + n == int(seq->tokens.size())};
  running_.push_back(std::move(*it));
  it = waiting_.erase(it);
  return Admission::kAdmitted;
}

std::optional<ScheduledSeq> Scheduler::schedule_lane() {
  LMX_CHECK(limits_.prefill_lane);
  adapters_->collect_loads();
  const int budget = limits_.max_num_batched_tokens;
  // A prefill the lane has started (a prompt longer than one run's budget) continues first.
  for (const std::unique_ptr<Sequence>& owned : running_) {
    Sequence* seq = owned.get();
    LMX_CHECK(!seq->in_lane);
    if (seq->num_pending() <= 1) continue;
    const int n = std::min(seq->num_pending(), budget);
    if (!ensure_pages(seq, seq->num_computed + n)) return std::nullopt;  // pages free up as others finish
    seq->in_lane = true;
    return ScheduledSeq{seq, n, seq->num_computed + n == int(seq->tokens.size())};
  }
  if (int(running_.size()) >= limits_.max_num_seqs) return std::nullopt;
  bool starving = false;
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    ScheduledSeq admitted;
    const Admission admission = try_admit(it, budget, 0, &starving, &admitted);
    if (admission == Admission::kStop) return std::nullopt;
    if (admission == Admission::kSkipped) continue;
    admitted.seq->in_lane = true;
    return admitted;
  }
  return std::nullopt;
}

// Mark the fed tokens computed and publish the pages they filled.
void Scheduler::commit(const std::vector<ScheduledSeq>& step) {
  for (const ScheduledSeq& s : step) {
    Sequence* seq = s.seq;
    seq->num_computed += s.num_tokens;
    if (!limits_.enable_prefix_caching) continue;
    const int full = seq->num_computed / limits_.page_size;
    if (full <= seq->num_registered_pages) continue;
    extend_page_hashes(seq, full);
    for (int i = seq->num_registered_pages; i < full; ++i)
      pages_.register_page(seq->pages[size_t(i)], seq->page_hashes[size_t(i)]);
    seq->num_registered_pages = full;
  }
}

std::unique_ptr<Sequence> Scheduler::finish(Sequence* seq, FinishReason reason) {
  auto it = std::find_if(running_.begin(), running_.end(), [&](const auto& p) { return p.get() == seq; });
  LMX_CHECK(it != running_.end());
  std::unique_ptr<Sequence> owned = std::move(*it);
  running_.erase(it);
  release_pages(owned.get());
  if (owned->slot >= 0) adapters_->release(owned->slot);
  owned->slot = -1;
  owned->state = SeqState::kFinished;
  owned->finish = reason;
  return owned;
}

std::unique_ptr<Sequence> Scheduler::abort(uint64_t id) {
  auto has_id = [&](const auto& p) { return p->id == id; };
  if (auto it = std::find_if(running_.begin(), running_.end(), has_id); it != running_.end())
    return finish(it->get(), FinishReason::kAbort);
  auto it = std::find_if(waiting_.begin(), waiting_.end(), has_id);
  if (it == waiting_.end()) return nullptr;
  std::unique_ptr<Sequence> owned = std::move(*it);
  waiting_.erase(it);
  // Waiting sequences hold no slot and no pages (preemption and failed admissions release them all).
  release_pages(owned.get());
  owned->state = SeqState::kFinished;
  owned->finish = FinishReason::kAbort;
  return owned;
}

std::vector<std::unique_ptr<Sequence>> Scheduler::take_failed() {
  std::vector<std::unique_ptr<Sequence>> out;
  out.swap(failed_);
  return out;
}

int Scheduler::num_using(const std::string& adapter) const {
  int n = 0;
  for (const auto& seq : waiting_) n += seq->request.adapter == adapter;
  for (const auto& seq : running_) n += seq->request.adapter == adapter;
  return n;
}

}  // namespace lmx::engine
