// ThreadPool: a fixed set of worker threads owned by one CpuBackend, splitting a loop over rows into
// contiguous chunks. Each row is computed by exactly one thread with the same instructions, so results do
// not depend on the thread count. One caller at a time; parallel_for must not be nested.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace lmx::cpu {

class ThreadPool {
 public:
  // num_threads counts the calling thread: 1 = everything runs on the caller, no workers are started.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return int(workers_.size()) + 1; }

  // Runs body(begin, end) over [0, n) in contiguous chunks and returns when all are done. `work_per_row`
  // (rough flops) decides how many threads are worth waking: small loops stay on the calling thread.
  void parallel_for(int64_t n, int64_t work_per_row, const std::function<void(int64_t, int64_t)>& body);

 private:
  void worker_loop(int worker_index);
  void run_chunk(int chunk);

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable start_cv_;
  std::condition_variable done_cv_;
  // The job in flight, guarded by mutex_; generation_ tells workers a new job has arrived.
  const std::function<void(int64_t, int64_t)>* body_ = nullptr;
  int64_t rows_ = 0;
  int chunks_ = 0;
  int pending_ = 0;
  uint64_t generation_ = 0;
  bool stopping_ = false;
};

}  // namespace lmx::cpu
