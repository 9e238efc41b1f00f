// parallel_for over host memory for load-time bulk work (dtype conversion, transposes, MXFP4
// dequantization, preset weight generation). Spawns threads per call: meant for seconds-long work, never
// the hot path. Who calls: model/loader.cpp, model/mxfp4.cpp, model/presets.cpp, lora/slots.cpp.
#pragma once
#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace lmx {

// Calls fn(begin, end) over disjoint chunks covering [0, n), each at least `min_chunk` long (except the
// last), on up to hardware_concurrency threads. fn must only touch its own chunk's outputs.
template <typename Fn>
void parallel_for(int64_t n, int64_t min_chunk, Fn&& fn) {
  if (n <= 0) return;
  const int64_t hw = std::max<int64_t>(1, int64_t(std::thread::hardware_concurrency()));
  const int64_t chunks = std::clamp<int64_t>(n / std::max<int64_t>(1, min_chunk), 1, hw);
  if (chunks == 1) {
    fn(int64_t(0), n);
    return;
  }
  const int64_t step = (n + chunks - 1) / chunks;
  std::vector<std::thread> threads;
  threads.reserve(size_t(chunks));
  for (int64_t begin = 0; begin < n; begin += step) {
    const int64_t end = std::min(n, begin + step);
    threads.emplace_back([&fn, begin, end] { fn(begin, end); });
  }
  for (auto& t : threads) t.join();
}

}  // namespace lmx
