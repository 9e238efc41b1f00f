// AdapterLoader implementation: a job queue drained by one worker thread.
#include "engine/adapter_loader.h"

namespace lmx::engine {

AdapterLoader::~AdapterLoader() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    queue_.clear();
  }
  wake_.notify_all();
  if (worker_.joinable()) worker_.join();
}

void AdapterLoader::set_load_fn(LoadFn load) {
  std::lock_guard<std::mutex> lock(mu_);
  LMX_CHECK(queue_.empty() && running_ == 0);
  load_ = std::move(load);
}

void AdapterLoader::submit(uint64_t ticket, std::string name, AdapterSource source) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back({ticket, std::move(name), std::move(source)});
    if (!worker_.joinable()) worker_ = std::thread([this] { run(); });
  }
  wake_.notify_one();
}

std::vector<AdapterLoader::Done> AdapterLoader::collect() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Done> out;
  out.swap(done_);
  return out;
}

void AdapterLoader::run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (stopping_) return;
    Job job = std::move(queue_.front());
    queue_.pop_front();
    ++running_;
    LoadFn load = load_;
    lock.unlock();
    Result<lora::Adapter> adapter = load(job.name, job.source);
    Result<lora::SlotImage> image = invalid_argument("not prepared");
    if (adapter.ok()) {
      image = prepare_(*adapter);
      adapter->layers.clear();  // the f32 tensors: the image is what the host tier keeps
    }
    lock.lock();
    --running_;
    done_.push_back({job.ticket, std::move(job.name), std::move(adapter), std::move(image)});
  }
}

}  // namespace lmx::engine
