// AdapterStore: the adapters known to the engine (host copies, by name) and which one sits in which
// device slot. Slots are reused least-recently-used first, never while a running sequence holds them.
// Who calls: the engine (registration) and the scheduler (acquire/release per sequence).
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "lora/slots.h"

namespace lmx::engine {

class AdapterStore {
 public:
  AdapterStore(ops::Backend& backend, const lora::BaseModelShapes& base, int num_slots, int max_rank);

  // Register a loaded adapter under its name; an existing name is an error.
  Status add(lora::Adapter adapter);
  // Forget `name` and empty its slot. The caller guarantees no sequence uses it (Engine::remove_adapter).
  Status remove(const std::string& name);
  bool contains(const std::string& name) const { return adapters_.count(name) != 0; }
  std::vector<std::string> names() const;
  std::vector<std::string> resident() const;  // adapters currently in a device slot
  const lora::BaseModelShapes& base() const { return base_; }
  int max_rank() const { return max_rank_; }

  // The slot holding `name`, loading it into a free or least-recently-used idle slot when needed.
  // -1 with a Status when every slot is held by running sequences (the caller retries later).
  Result<int> acquire(const std::string& name);
  // One running sequence stops using `slot`.
  void release(int slot);
  // True when `name` is resident or could be made resident now.
  bool can_acquire(const std::string& name) const;

  const lora::SlotTable& slots() const { return slots_; }
  uint64_t loads() const { return loads_; }  // how many times an adapter was copied into a slot

 private:
  struct SlotState {
    std::string name;  // "" = empty
    int users = 0;
    uint64_t last_used = 0;
  };
  int find_slot(const std::string& name) const;
  int pick_victim() const;

  lora::BaseModelShapes base_;
  int max_rank_;
  lora::SlotTable slots_;
  std::map<std::string, std::unique_ptr<lora::Adapter>> adapters_;
  std::vector<SlotState> slot_state_;
  uint64_t clock_ = 0;
  uint64_t loads_ = 0;
};

}  // namespace lmx::engine
