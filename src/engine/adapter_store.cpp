// AdapterStore implementation: name registry plus LRU slot assignment.
#include "engine/adapter_store.h"

namespace lmx::engine {

AdapterStore::AdapterStore(ops::Backend& backend, const lora::BaseModelShapes& base, int num_slots, int max_rank)
    : base_(base), max_rank_(max_rank), slots_(backend, base, num_slots, max_rank), slot_state_(size_t(num_slots)) {}

Status AdapterStore::add(lora::Adapter adapter) {
  if (adapter.name.empty()) return invalid_argument("adapter name must not be empty");
  if (adapters_.count(adapter.name)) return invalid_argument("adapter '" + adapter.name + "' is already loaded");
  std::string name = adapter.name;
  adapters_[name] = std::make_unique<lora::Adapter>(std::move(adapter));
  return Status::Ok();
}

Status AdapterStore::remove(const std::string& name) {
  auto it = adapters_.find(name);
  if (it == adapters_.end()) return not_found("unknown adapter '" + name + "'");
  int slot = find_slot(name);
  if (slot >= 0) {
    LMX_CHECK(slot_state_[size_t(slot)].users == 0);
    slots_.clear(slot);
    slot_state_[size_t(slot)] = SlotState{};
  }
  adapters_.erase(it);
  return Status::Ok();
}

std::vector<std::string> AdapterStore::resident() const {
  std::vector<std::string> out;
  for (const SlotState& st : slot_state_)
    if (!st.name.empty()) out.push_back(st.name);
  return out;
}

std::vector<std::string> AdapterStore::names() const {
  std::vector<std::string> out;
  for (const auto& [name, _] : adapters_) out.push_back(name);
  return out;
}

int AdapterStore::find_slot(const std::string& name) const {
  for (size_t s = 0; s < slot_state_.size(); ++s)
    if (slot_state_[s].name == name) return int(s);
  return -1;
}

// An empty slot first, else the idle slot used longest ago; -1 when all are held.
int AdapterStore::pick_victim() const {
  int best = -1;
  for (size_t s = 0; s < slot_state_.size(); ++s) {
    const SlotState& st = slot_state_[s];
    if (st.users > 0) continue;
    if (st.name.empty()) return int(s);
    if (best < 0 || st.last_used < slot_state_[size_t(best)].last_used) best = int(s);
  }
  return best;
}

bool AdapterStore::can_acquire(const std::string& name) const {
  return find_slot(name) >= 0 || pick_victim() >= 0;
}

Result<int> AdapterStore::acquire(const std::string& name) {
  auto it = adapters_.find(name);
  if (it == adapters_.end()) return not_found("unknown adapter '" + name + "'");
  int slot = find_slot(name);
  if (slot < 0) {
    slot = pick_victim();
    if (slot < 0) return out_of_range("all " + std::to_string(slot_state_.size()) + " adapter slots are in use");
    Status loaded = slots_.load(slot, *it->second);
    if (!loaded.ok()) {  // the victim's old contents may be half overwritten: leave the slot empty
      slots_.clear(slot);
      slot_state_[size_t(slot)].name.clear();
      return loaded.with_context("adapter '" + name + "'");
    }
    slot_state_[size_t(slot)].name = name;
    ++loads_;
  }
  SlotState& st = slot_state_[size_t(slot)];
  ++st.users;
  st.last_used = ++clock_;
  return slot;
}

void AdapterStore::release(int slot) {
  LMX_CHECK(slot >= 0 && slot < int(slot_state_.size()) && slot_state_[size_t(slot)].users > 0);
  --slot_state_[size_t(slot)].users;
}

}  // namespace lmx::engine
