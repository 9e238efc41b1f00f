// AdapterStore implementation: the registry, the host tier (LRU of slot images), reads (and slot layout)
// on the worker, and LRU slot assignment.
#include "engine/adapter_store.h"

#include "core/log.h"

namespace lmx::engine {

AdapterStore::AdapterStore(ops::Backend& backend, const lora::BaseModelShapes& base, int num_slots, int max_rank,
                           int max_host_adapters)
    : base_(base),
      max_rank_(max_rank),
      max_host_(max_host_adapters),
      slots_(backend, base, num_slots, max_rank),
      slot_state_(size_t(num_slots)),
      loader_([this](const std::string& name, const AdapterSource& source) { return read_source(name, source); },
              [this](const lora::Adapter& adapter) { return slots_.prepare(adapter); }) {
  LMX_CHECK(max_host_adapters == 0 || max_host_adapters >= num_slots);  // Engine::create validates it
}

// Runs on the loader's worker: reads only base_ and max_rank_, which never change.
Result<lora::Adapter> AdapterStore::read_source(const std::string& name, const AdapterSource& source) const {
  if (!source.dir.empty()) return lora::load_adapter(source.dir, name, base_, lora::AdapterLimits{.max_rank = max_rank_});
  if (source.dummy_rank > 0) return lora::make_dummy_adapter(name, base_, source.dummy_rank, source.dummy_seed);
  return invalid_argument("adapter '" + name + "' has no source to read it from (it was registered in memory only)");
}

int AdapterStore::num_pinned() const {
  int n = 0;
  for (const auto& [name, e] : entries_) n += e.pinned;
  return n;
}

Status AdapterStore::add(lora::Adapter adapter, AdapterOptions options) {
  const std::string name = adapter.name;
  if (name.empty()) return invalid_argument("adapter name must not be empty");
  if (entries_.count(name)) return invalid_argument("adapter '" + name + "' is already loaded");
  // The slot capacity (SlotTable): max_rank per target, twice that for a merged MoE gate_up. Checked here
  // so a slot load during scheduling cannot fail on rank.
  for (size_t l = 0; l < adapter.layers.size(); ++l) {
    for (int t = 0; t < ops::kNumLoraTargets; ++t) {
      const auto& pair = adapter.layers[l][size_t(t)];
      const int capacity = ops::LoraTarget(t) == ops::LoraTarget::kMoeGateUp ? 2 * max_rank_ : max_rank_;
      if (pair && pair->rank > capacity)
        return out_of_range("adapter '" + name + "' layer " + std::to_string(l) + " " +
                            std::string(ops::lora_target_name(ops::LoraTarget(t))) + ": rank " + std::to_string(pair->rank) +
                            " exceeds the slot capacity " + std::to_string(capacity) + " (--max-lora-rank " +
                            std::to_string(max_rank_) + ")");
    }
  }
  Entry entry;
  entry.source = options.source ? *options.source : AdapterSource{.dir = adapter.dir};
  entry.pinned = options.pinned;
  entry.identity = adapter.content_hash;
  if (max_host_ > 0) {
    // Entries that can never leave the host tier must fit in it. (When they fill it, the adapter just read
    // for a request stays beyond the limit until another read replaces it.)
    int fixed = 0;
    for (const auto& [n, e] : entries_) fixed += e.pinned || !e.source.reloadable();
    if ((entry.pinned || !entry.source.reloadable()) && fixed + 1 > max_host_)
      return invalid_argument("adapter '" + name + "': the host adapter tier (--max-cpu-loras " + std::to_string(max_host_) +
                              ") would be full of adapters that never leave it (pinned or not re-readable)");
  }
  if (entry.pinned && num_pinned() + 1 > int(slot_state_.size()))
    return invalid_argument("cannot pin adapter '" + name + "': all " + std::to_string(slot_state_.size()) +
                            " adapter slots (--max-loras) are pinned already");
  LMX_ASSIGN_OR_RETURN(lora::SlotImage image, slots_.prepare(adapter));
  entry.host = std::make_unique<lora::SlotImage>(std::move(image));
  entry.host_last_used = ++clock_;
  Entry& e = entries_.emplace(name, std::move(entry)).first->second;
  if (e.pinned) {
    Result<int> slot = acquire(name);
    if (!slot.ok()) {
      entries_.erase(name);
      return slot.status().with_context("pinning adapter '" + name + "'");
    }
    release(*slot);  // resident but idle: pick_victim skips pinned slots
  }
  evict_host_beyond_limit(name);
  return Status::Ok();
}

Status AdapterStore::remove(const std::string& name) {
  auto it = entries_.find(name);
  if (it == entries_.end()) return not_found("unknown adapter '" + name + "'");
  const int slot = it->second.slot;
  if (slot >= 0) {
    LMX_CHECK(slot_state_[size_t(slot)].users == 0);
    slots_.clear(slot);
    slot_state_[size_t(slot)] = SlotState{};
  }
  entries_.erase(it);  // a read still in flight finds no matching ticket and is dropped
  return Status::Ok();
}

Status AdapterStore::check_servable(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end())
    return not_found("unknown adapter '" + name + "' (loaded: " + std::to_string(entries_.size()) + ")");
  if (!it->second.pinned && num_pinned() >= int(slot_state_.size()))
    return invalid_argument("adapter '" + name + "' can never run: all " + std::to_string(slot_state_.size()) +
                            " adapter slots (--max-loras) are pinned to other adapters");
  return Status::Ok();
}

std::vector<std::string> AdapterStore::names() const {
  std::vector<std::string> out;
  for (const auto& [name, _] : entries_) out.push_back(name);
  return out;
}

std::vector<std::string> AdapterStore::resident() const {
  std::vector<std::string> out;
  for (const SlotState& st : slot_state_)
    if (!st.name.empty()) out.push_back(st.name);
  return out;
}

std::vector<std::string> AdapterStore::host_resident() const {
  std::vector<std::string> out;
  for (const auto& [name, e] : entries_)
    if (e.host) out.push_back(name);
  return out;
}

bool AdapterStore::pinned(const std::string& name) const {
  auto it = entries_.find(name);
  return it != entries_.end() && it->second.pinned;
}

const std::string& AdapterStore::identity(const std::string& name) const {
  static const std::string kBase;
  if (name.empty()) return kBase;
  auto it = entries_.find(name);
  LMX_CHECK(it != entries_.end());  // requests name registered adapters only (Engine::add_request)
  return it->second.identity;
}

// An empty slot first, else the idle unpinned slot used longest ago; -1 when none.
int AdapterStore::pick_victim() const {
  int best = -1;
  for (size_t s = 0; s < slot_state_.size(); ++s) {
    const SlotState& st = slot_state_[s];
    if (st.users > 0) continue;
    if (st.name.empty()) return int(s);
    if (entries_.at(st.name).pinned) continue;
    if (best < 0 || st.last_used < slot_state_[size_t(best)].last_used) best = int(s);
  }
  return best;
}

// Drop host copies, least recently used first, of adapters that can be read again and are not pinned,
// until the tier holds at most max_host_ (a slot keeps its own device copy).
void AdapterStore::evict_host_beyond_limit(const std::string& keep) {
  if (max_host_ <= 0) return;
  while (true) {
    int held = 0;
    Entry* victim = nullptr;
    for (auto& [name, e] : entries_) {
      if (!e.host) continue;
      ++held;
      if (name == keep || e.pinned || !e.source.reloadable()) continue;
      if (!victim || e.host_last_used < victim->host_last_used) victim = &e;
    }
    if (held <= max_host_ || !victim) return;
    victim->host.reset();
    ++host_evictions_;
  }
}

AdapterStore::Readiness AdapterStore::prepare(const std::string& name) {
  auto it = entries_.find(name);
  LMX_CHECK(it != entries_.end());  // waiting requests keep their adapter registered (Engine::remove_adapter)
  Entry& e = it->second;
  if (e.slot >= 0) return Readiness::kReady;
  if (!e.failure.ok()) {
    e.failure_reported = true;
    return Readiness::kFailed;
  }
  if (!e.host) {
    if (e.load_ticket == 0) {
      e.load_ticket = next_ticket_++;
      loader_.submit(e.load_ticket, name, e.source);
    }
    return Readiness::kLoading;
  }
  e.host_last_used = ++clock_;  // wanted by a waiting request: the last host copy to drop
  return pick_victim() >= 0 ? Readiness::kReady : Readiness::kSlotsHeld;
}

void AdapterStore::prefetch(const std::string& name) {
  auto it = entries_.find(name);
  LMX_CHECK(it != entries_.end());
  Entry& e = it->second;
  if (e.slot >= 0 || e.host || e.load_ticket != 0 || !e.failure.ok()) return;
  if (max_host_ > 0) {
    int held = 0;  // host copies plus reads that will become host copies
    for (const auto& [n, other] : entries_) held += other.host != nullptr || other.load_ticket != 0;
    if (held >= max_host_) return;
  }
  e.load_ticket = next_ticket_++;
  loader_.submit(e.load_ticket, name, e.source);
}

Status AdapterStore::load_error(const std::string& name) const {
  auto it = entries_.find(name);
  return it == entries_.end() ? not_found("unknown adapter '" + name + "'") : it->second.failure;
}

void AdapterStore::collect_loads() {
  for (auto& [name, e] : entries_) {
    if (e.failure_reported) {
      e.failure = Status::Ok();
      e.failure_reported = false;
    }
  }
  for (AdapterLoader::Done& done : loader_.collect()) {
    auto it = entries_.find(done.name);
    if (it == entries_.end() || it->second.load_ticket != done.ticket) continue;  // removed (or re-added) meanwhile
    Entry& e = it->second;
    e.load_ticket = 0;
    if (!done.adapter.ok()) {
      e.failure = done.adapter.status().with_context("reading adapter '" + done.name + "' again");
      log_warn(e.failure.message());
      continue;
    }
    if (done.adapter->content_hash != e.identity) {
      // Its identity (and so its prefix-cache keys) is fixed at registration; changed files are a new adapter.
      e.failure = invalid_argument("adapter '" + done.name + "' changed in " + e.source.dir +
                                   " since it was loaded (content hash " + e.identity + ", now " +
                                   done.adapter->content_hash + "); unload and load it again");
      log_warn(e.failure.message());
      continue;
    }
    if (!done.image.ok()) {
      e.failure = done.image.status().with_context("preparing adapter '" + done.name + "' for a slot");
      log_warn(e.failure.message());
      continue;
    }
    e.host = std::make_unique<lora::SlotImage>(std::move(done.image).value());
    e.host_last_used = ++clock_;
    ++disk_loads_;
    evict_host_beyond_limit(done.name);
  }
}

int AdapterStore::num_loading() const {
  int n = 0;
  for (const auto& [name, e] : entries_) n += e.load_ticket != 0;
  return n;
}

Result<int> AdapterStore::acquire(const std::string& name) {
  auto it = entries_.find(name);
  if (it == entries_.end()) return not_found("unknown adapter '" + name + "'");
  Entry& e = it->second;
  int slot = e.slot;
  if (slot < 0) {
    if (!e.host) return invalid_argument("adapter '" + name + "' is not on the host yet (prepare() reads it first)");
    slot = pick_victim();
    if (slot < 0) return out_of_range("all " + std::to_string(slot_state_.size()) + " adapter slots are in use or pinned");
    SlotState& st = slot_state_[size_t(slot)];
    if (!st.name.empty()) entries_.at(st.name).slot = -1;
    // Only copies here (the image was laid out when it entered the host tier). The seam for overlapping
    // them: SlotTable::load issues the host-to-device copies through the backend (a plain copy on the
    // cpu); a CUDA backend can put them on a copy stream that the next forward waits on, since nothing
    // reads the slot before that step's forward.
    Status loaded = slots_.load(slot, *e.host);
    if (!loaded.ok()) {  // the victim's old contents may be half overwritten: leave the slot empty
      slots_.clear(slot);
      st = SlotState{};
      return loaded.with_context("adapter '" + name + "'");
    }
    st.name = name;
    e.slot = slot;
    ++loads_;
  }
  SlotState& st = slot_state_[size_t(slot)];
  ++st.users;
  st.last_used = ++clock_;
  if (e.host) e.host_last_used = ++clock_;
  return slot;
}

void AdapterStore::release(int slot) {
  LMX_CHECK(slot >= 0 && slot < int(slot_state_.size()) && slot_state_[size_t(slot)].users > 0);
  --slot_state_[size_t(slot)].users;
}

}  // namespace lmx::engine
