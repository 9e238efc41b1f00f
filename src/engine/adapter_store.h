// AdapterStore: the adapter tiers of design.md §5 — device slots (--max-loras) ← host tier of adapters laid
// out as slot images in the LoRA dtype (--max-cpu-loras, LRU) ← disk. Every registered adapter has a name, an identity (content
// hash, fixed at registration), a source to re-read it from, and maybe a pin. Reads from disk run on an
// AdapterLoader worker; slots are reused least-recently-used first, never while a running sequence holds
// them, never when pinned. Who calls: the engine (registration) and the scheduler (prepare/acquire/release
// per sequence). Engine thread only.
#pragma once
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/adapter_loader.h"
#include "lora/slots.h"

namespace lmx::engine {

struct AdapterOptions {
  bool pinned = false;                  // never evicted from its slot or the host tier
  std::optional<AdapterSource> source;  // unset: the adapter's own dir (none: in memory only)
};

class AdapterStore {
 public:
  // max_host_adapters: parsed adapters kept on the host (0 = no limit); when set it must be >= num_slots.
  AdapterStore(ops::Backend& backend, const lora::BaseModelShapes& base, int num_slots, int max_rank,
               int max_host_adapters = 0);

  // Register a parsed adapter under its name (an existing name is an error). It enters the host tier
  // (evicting the least recently used re-readable adapter beyond the limit); a pinned one also takes a
  // slot now. Refused when pinning it would leave no slot (or host entry) for unpinned adapters' turns.
  Status add(lora::Adapter adapter, AdapterOptions options = {});
  // Forget `name` and empty its slot. The caller guarantees no sequence uses it (Engine::remove_adapter).
  // A read in flight for it is discarded when it finishes.
  Status remove(const std::string& name);
  bool contains(const std::string& name) const { return entries_.count(name) != 0; }
  // A request may use `name`: it is registered, and a slot can ever be free for it.
  Status check_servable(const std::string& name) const;
  std::vector<std::string> names() const;
  std::vector<std::string> resident() const;       // adapters in a device slot now
  std::vector<std::string> host_resident() const;  // adapters parsed on the host now
  bool pinned(const std::string& name) const;
  // The adapter's identity (content hash) for prefix-cache keys; "" for the base model (name "").
  const std::string& identity(const std::string& name) const;
  const lora::BaseModelShapes& base() const { return base_; }
  int max_rank() const { return max_rank_; }
  int max_host_adapters() const { return max_host_; }

  enum class Readiness {
    kReady,      // acquire() will succeed now
    kLoading,    // not on the host: a read is queued or running (started by this call if needed)
    kSlotsHeld,  // on the host, but every slot is held by running sequences or pinned
    kFailed,     // the last read failed: load_error() says why; the next prepare() tries again
  };
  // Where a waiting request for `name` stands; starts a read from the source when the host lacks it.
  Readiness prepare(const std::string& name);
  Status load_error(const std::string& name) const;
  // Start reading `name` for a request still queued behind others, so the read overlaps their steps — only
  // when the host tier has room without dropping anything (a prefetch never causes a re-read elsewhere).
  void prefetch(const std::string& name);
  // Install finished reads into the host tier (engine thread; the scheduler calls it each step) and
  // forget failures already reported. Never waits for a read.
  void collect_loads();
  int num_loading() const;  // reads queued or running

  // The slot holding `name`, copying its host copy into a free or least-recently-used idle slot when
  // needed. An error when it is not on the host or every slot is held (prepare() says kReady first).
  Result<int> acquire(const std::string& name);
  // One running sequence stops using `slot`.
  void release(int slot);

  // Replace how adapters are read from their source (tests wrap it to delay or fail a read). Call only
  // while no read is queued.
  void set_load_fn(AdapterLoader::LoadFn load) { loader_.set_load_fn(std::move(load)); }
  // The default read: lora::load_adapter for a dir, lora::make_dummy_adapter for a dummy recipe.
  Result<lora::Adapter> read_source(const std::string& name, const AdapterSource& source) const;

  const lora::SlotTable& slots() const { return slots_; }
  uint64_t loads() const { return loads_; }              // copies of an adapter into a slot
  uint64_t disk_loads() const { return disk_loads_; }    // reads from a source that reached the host tier
  uint64_t host_evictions() const { return host_evictions_; }

 private:
  struct Entry {
    AdapterSource source;
    bool pinned = false;
    std::string identity;                 // content hash at registration; a re-read must match it
    std::unique_ptr<lora::SlotImage> host;  // slot-layout copy while in the host tier (prepared off-loop
                                            // for reads; a slot load only copies it)
    uint64_t host_last_used = 0;
    uint64_t load_ticket = 0;             // != 0 while a read is queued or running
    Status failure;                       // the last read's error, until collect_loads() forgets it
    bool failure_reported = false;
    int slot = -1;
  };
  struct SlotState {
    std::string name;  // "" = empty
    int users = 0;
    uint64_t last_used = 0;
  };
  int pick_victim() const;
  void evict_host_beyond_limit(const std::string& keep);
  int num_pinned() const;

  lora::BaseModelShapes base_;
  int max_rank_;
  int max_host_;
  lora::SlotTable slots_;
  std::map<std::string, Entry> entries_;
  std::vector<SlotState> slot_state_;
  AdapterLoader loader_;
  uint64_t clock_ = 0;
  uint64_t next_ticket_ = 1;
  uint64_t loads_ = 0;
  uint64_t disk_loads_ = 0;
  uint64_t host_evictions_ = 0;
};

}  // namespace lmx::engine
