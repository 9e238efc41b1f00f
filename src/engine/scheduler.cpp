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

// Recompute-style preemption: the sequence keeps its tokens but loses its cache and goes back to the
// front of the waiting queue.
void Scheduler::preempt(std::list<std::unique_ptr<Sequence>>::iterator it) {
  std::unique_ptr<Sequence> seq = std::move(*it);
  running_.erase(it);
  pages_.release(seq->pages);
  seq->pages.clear();
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

  // 1. Running sequences, oldest first: decode tokens and continuing prefill chunks.
  for (auto it = running_.begin(); it != running_.end() && budget > 0 && int(step.size()) < limits_.max_num_seqs;) {
    Sequence* seq = it->get();
    int n = std::min(seq->num_pending(), budget);
    bool got = ensure_pages(seq, seq->num_computed + n);
    while (!got) {  // free pages by preempting the newest sequence that is not already in this step
      auto victim = std::prev(running_.end());
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
    ++it;
  }

  // 2. Waiting prompts, FIFO, skipping those whose adapter cannot get a slot right now — unless one has
  // been skipped too long: then later adapter requests wait too, so held slots drain to it.
  bool starving = false;
  for (auto it = waiting_.begin();
       it != waiting_.end() && budget > 0 && int(running_.size()) < limits_.max_num_seqs &&
       int(step.size()) < limits_.max_num_seqs;) {
    Sequence* seq = it->get();
    const std::string& adapter = seq->request.adapter;
    if (!adapter.empty() && !adapters_->can_acquire(adapter)) {
      if (++seq->adapter_wait_steps >= limits_.max_adapter_wait_steps) starving = true;
      ++it;
      continue;
    }
    if (starving && !adapter.empty()) {  // base-model requests hold no slot and may still go
      ++it;
      continue;
    }
    int n = std::min(seq->num_pending(), budget);
    if (!ensure_pages(seq, n)) break;  // FIFO: later prompts wait for pages too
    if (!adapter.empty()) {
      Result<int> slot = adapters_->acquire(adapter);
      LMX_CHECK(slot.ok());  // can_acquire said yes and nothing changed since
      seq->slot = slot.value();
    }
    seq->state = SeqState::kRunning;
    step.push_back({seq, n, n == int(seq->tokens.size())});
    budget -= n;
    running_.push_back(std::move(*it));
    it = waiting_.erase(it);
  }
  return step;
}

void Scheduler::commit(const std::vector<ScheduledSeq>& step) {
  for (const ScheduledSeq& s : step) s.seq->num_computed += s.num_tokens;
}

std::unique_ptr<Sequence> Scheduler::finish(Sequence* seq, FinishReason reason) {
  auto it = std::find_if(running_.begin(), running_.end(), [&](const auto& p) { return p.get() == seq; });
  LMX_CHECK(it != running_.end());
  std::unique_ptr<Sequence> owned = std::move(*it);
  running_.erase(it);
  pages_.release(owned->pages);
  owned->pages.clear();
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
  // Waiting sequences hold no slot; pages only if a future admission policy reserves them early.
  pages_.release(owned->pages);
  owned->pages.clear();
  owned->state = SeqState::kFinished;
  owned->finish = FinishReason::kAbort;
  return owned;
}

int Scheduler::num_using(const std::string& adapter) const {
  int n = 0;
  for (const auto& seq : waiting_) n += seq->request.adapter == adapter;
  for (const auto& seq : running_) n += seq->request.adapter == adapter;
  return n;
}

}  // namespace lmx::engine
