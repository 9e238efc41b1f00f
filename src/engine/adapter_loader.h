// AdapterLoader: one worker thread that reads adapters (parse + validate a PEFT directory, or regenerate a
// dummy) off the engine's step loop, so a request for an adapter that is not on the host waits without
// stalling the other requests. The engine thread submits jobs and collects finished ones; the load
// function runs on the worker and touches nothing else. Who calls: AdapterStore.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "lora/adapter.h"
#include "lora/slots.h"

namespace lmx::engine {

// Where an adapter that left the host tier is read again from.
struct AdapterSource {
  std::string dir;         // a PEFT directory (lora::load_adapter)
  int dummy_rank = 0;      // > 0: lora::make_dummy_adapter(name, base, dummy_rank, dummy_seed) (--dummy-loras)
  uint64_t dummy_seed = 0;
  // Neither: the adapter exists only in memory and never leaves the host tier.
  bool reloadable() const { return !dir.empty() || dummy_rank > 0; }
};

class AdapterLoader {
 public:
  // Runs on the worker thread; must not touch engine state.
  using LoadFn = std::function<Result<lora::Adapter>(const std::string& name, const AdapterSource& source)>;
  // Also on the worker, after a successful read: lays the adapter out for a slot (SlotTable::prepare).
  using PrepareFn = std::function<Result<lora::SlotImage>(const lora::Adapter& adapter)>;
  struct Done {
    uint64_t ticket = 0;
    std::string name;
    Result<lora::Adapter> adapter;  // its tensors are released once `image` is made
    Result<lora::SlotImage> image = invalid_argument("not prepared");  // meaningful when `adapter` is ok
  };

  AdapterLoader(LoadFn load, PrepareFn prepare) : load_(std::move(load)), prepare_(std::move(prepare)) {}
  ~AdapterLoader();  // waits for the job in progress, drops queued ones
  AdapterLoader(const AdapterLoader&) = delete;
  AdapterLoader& operator=(const AdapterLoader&) = delete;

  // Replace the load function (tests wrap it to delay a read); only while nothing is queued.
  void set_load_fn(LoadFn load);
  // Queue a read; the worker starts on the first submit, so engines that never read from disk own no thread.
  void submit(uint64_t ticket, std::string name, AdapterSource source);
  // Finished jobs in completion order; never waits for a read in progress.
  std::vector<Done> collect();

 private:
  struct Job {
    uint64_t ticket;
    std::string name;
    AdapterSource source;
  };
  void run();

  LoadFn load_;
  PrepareFn prepare_;
  mutable std::mutex mu_;
  std::condition_variable wake_;
  std::deque<Job> queue_;
  std::vector<Done> done_;
  int running_ = 0;
  bool stopping_ = false;
  std::thread worker_;
};

}  // namespace lmx::engine
