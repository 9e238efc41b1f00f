// Scheduler: each step picks what runs — every running sequence's pending tokens (decode: one token;
// a prefill in progress: its next chunk) and then waiting prompts, FIFO — within the token, sequence,
// KV-page and adapter-slot budgets. When a running sequence cannot get a KV page the most recently
// admitted sequence is preempted (pages freed, recomputed later). With prefix caching an admitted
// sequence starts after the longest run of its full pages already cached for the same adapter content,
// and pages it fills are published for later sequences. Plain host data structure.
#pragma once
#include <deque>
#include <list>
#include <memory>
#include <optional>

#include "engine/adapter_store.h"
#include "engine/request.h"
#include "kv/page_allocator.h"

namespace lmx::engine {

struct SchedulerLimits {
  int max_num_seqs = 16;              // B per step
  int max_num_batched_tokens = 2048;  // T per step
  int page_size = 16;                 // P
  int max_model_len = 4096;           // prompt + output tokens of one sequence
  // A waiting request passed over this many steps because every adapter slot is held stops later
  // adapter requests from being admitted until it gets a slot: its wait is bounded by the running
  // sequences' remaining tokens (no starvation by a stream of requests for resident adapters).
  int max_adapter_wait_steps = 32;
  // Automatic prefix caching (--enable-prefix-caching, on by default as in vLLM V1): full pages are
  // keyed by (prefix, page tokens, adapter content hash) and shared instead of recomputed.
  bool enable_prefix_caching = true;
  // How new prompts fill a step's token budget (--prefill-packing). kWhole (the default): a prompt that
  // does not fit what is left of the budget, but would fit a step beside every running sequence's decode
  // token, waits for the next step instead of starting there (and the prompts behind it wait too: FIFO).
  // Split across two steps it would finish no sooner, and the step it started in would take longer: every
  // request in that step waits for its chunk. Longer prompts are chunked as before. kFill: fill every
  // step's budget, the last prompt taking what is left (vLLM's chunked prefill).
  enum class PrefillPacking { kWhole, kFill };
  PrefillPacking prefill_packing = PrefillPacking::kWhole;
  // The engine's prefill lane (EngineConfig::prefill_lane): prompts are admitted only by schedule_lane(), one
  // at a time, and schedule() plans decode tokens only (running sequences with one pending token, not in
  // the lane). A sequence in the lane is never preempted.
  bool prefill_lane = false;
};

struct ScheduledSeq {
  Sequence* seq = nullptr;
  int num_tokens = 0;   // tokens fed this step: seq->tokens[num_computed, num_computed + num_tokens)
  bool sample = false;  // the last fed token completes the sequence's pending input: sample after it
};

class Scheduler {
 public:
  Scheduler(const SchedulerLimits& limits, int num_kv_pages, AdapterStore* adapters);

  void add(std::unique_ptr<Sequence> seq);
  bool has_work() const { return !waiting_.empty() || !running_.empty(); }
  // Plan one step; empty when nothing can run (e.g. waiting prompts that do not fit the KV cache at all).
  std::vector<ScheduledSeq> schedule();
  // With limits().prefill_lane: the lane's next run, or nothing. First a running sequence whose prefill is
  // not done (a prompt longer than the token budget: its next chunk), else the first waiting prompt that can
  // be admitted (FIFO, the adapter and page rules of schedule()), its first chunk. The sequence is marked
  // in_lane until the caller clears it after commit(). PRECOND: no sequence is in the lane.
  std::optional<ScheduledSeq> schedule_lane();
  // After the step ran: mark the fed tokens computed (call before appending sampled tokens).
  void commit(const std::vector<ScheduledSeq>& step);
  // Finish a running sequence: free its pages and adapter slot; returns ownership to the caller.
  std::unique_ptr<Sequence> finish(Sequence* seq, FinishReason reason);
  // Remove a waiting or running sequence (client gone): frees its pages and adapter slot; nullptr when
  // no such sequence is queued or running.
  std::unique_ptr<Sequence> abort(uint64_t id);
  // Waiting plus running sequences that use `adapter` (an adapter may be removed only at zero).
  int num_using(const std::string& adapter) const;
  // Sequences that failed while waiting (their adapter could not be read), finished with kAbort and an
  // error; the caller takes them after each schedule().
  std::vector<std::unique_ptr<Sequence>> take_failed();

  const SchedulerLimits& limits() const { return limits_; }
  const kv::PageAllocator& pages() const { return pages_; }
  // Pages taken here are invisible to scheduling (a benchmark holds some so that later sequences get pages
  // further into the pool, as a long-running server's do); give them back with pages().release().
  kv::PageAllocator& pages() { return pages_; }
  int num_running() const { return int(running_.size()); }
  int num_waiting() const { return int(waiting_.size()); }
  uint64_t num_preemptions() const { return preemptions_; }
  // Prefix cache, in tokens as vLLM counts them: tokens of admitted sequences looked up, and found cached.
  uint64_t prefix_cache_queries() const { return prefix_queries_; }
  uint64_t prefix_cache_hits() const { return prefix_hits_; }

 private:
  bool ensure_pages(Sequence* seq, int tokens_after);
  void preempt(std::list<std::unique_ptr<Sequence>>::iterator it);
  // Chain hashes of the sequence's first `num_pages` full pages (computed once, kept across preemption).
  void extend_page_hashes(Sequence* seq, int num_pages);
  // Admit a waiting sequence's first chunk: share its cached prefix pages and allocate the rest. False
  // (nothing changed) when the pages do not fit, or when its uncached tokens exceed `budget` but not
  // `whole_below` (it fits a later step whole: PrefillPacking::kWhole; 0 = never). *num_tokens: the chunk
  // fed this step.
  bool admit_pages(Sequence* seq, int budget, int whole_below, int* num_tokens);
  // One waiting sequence at `it` through schedule()'s admission: its adapter's readiness (a failed read ends
  // it; a read in flight or held slots pass it over, counting toward `starving`), then pages and slot.
  // kAdmitted: *out is its first chunk, it moved to running_ and `it` points past it; kSkipped: try the
  // next (`it` advanced); kStop: FIFO, nothing later is admitted this time.
  enum class Admission { kAdmitted, kSkipped, kStop };
  Admission try_admit(std::deque<std::unique_ptr<Sequence>>::iterator& it, int budget, int whole_below,
                      bool* starving, ScheduledSeq* out);
  void release_pages(Sequence* seq);

  SchedulerLimits limits_;
  kv::PageAllocator pages_;
  AdapterStore* adapters_;
  std::deque<std::unique_ptr<Sequence>> waiting_;
  std::list<std::unique_ptr<Sequence>> running_;  // admission order
  std::vector<std::unique_ptr<Sequence>> failed_;
  uint64_t preemptions_ = 0;
  uint64_t prefix_queries_ = 0, prefix_hits_ = 0;
};

}  // namespace lmx::engine
