// ThreadPool implementation: workers sleep on a condition variable between jobs; chunk c of a job covers
// rows [c*n/chunks, (c+1)*n/chunks) and the calling thread takes chunk 0.
#include "backends/cpu/thread_pool.h"

#include <algorithm>

namespace lmx::cpu {

namespace {
// Below this much work (~flops) per chunk, waking a thread costs more than it saves.
constexpr int64_t kMinWorkPerChunk = int64_t(1) << 16;
}  // namespace

ThreadPool::ThreadPool(int num_threads) {
  for (int i = 1; i < std::max(num_threads, 1); ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  start_cv_.notify_all();
  for (std::thread& worker : workers_) worker.join();
}

void ThreadPool::run_chunk(int chunk) {
  const int64_t begin = rows_ * chunk / chunks_;
  const int64_t end = rows_ * (chunk + 1) / chunks_;
  if (begin < end) (*body_)(begin, end);
}

void ThreadPool::parallel_for(int64_t n, int64_t work_per_row, const std::function<void(int64_t, int64_t)>& body) {
  if (n <= 0) return;
  const int64_t total_work = n * std::max<int64_t>(work_per_row, 1);
  const int64_t worthwhile = std::max<int64_t>(total_work / kMinWorkPerChunk, 1);
  const int chunks = int(std::min<int64_t>({int64_t(num_threads()), n, worthwhile}));
  if (chunks == 1) {
    body(0, n);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    body_ = &body;
    rows_ = n;
    chunks_ = chunks;
    pending_ = chunks - 1;
    ++generation_;
  }
  start_cv_.notify_all();
  run_chunk(0);
  std::unique_lock<std::mutex> lock(mutex_);
  done_cv_.wait(lock, [this] { return pending_ == 0; });
  body_ = nullptr;
}

void ThreadPool::worker_loop(int worker_index) {
  uint64_t seen = 0;
  while (true) {
    std::unique_lock<std::mutex> lock(mutex_);
    start_cv_.wait(lock, [&] { return stopping_ || generation_ != seen; });
    if (stopping_) return;
    seen = generation_;
    if (worker_index >= chunks_) continue;  // this job needs fewer threads
    lock.unlock();
    run_chunk(worker_index);
    lock.lock();
    if (--pending_ == 0) done_cv_.notify_one();
  }
}

}  // namespace lmx::cpu
