// Shared by the CUDA benchmarks: the error check and the one timing method every figure in
// docs/perf-log.md uses — launches captured into a CUDA graph, the graph replayed, the median replay
// (CUDA events) divided by the launches it holds.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#define BENCH_CUDA(call)                                                                             \
  do {                                                                                               \
    cudaError_t err_ = (call);                                                                       \
    if (err_ != cudaSuccess) {                                                                       \
      std::fprintf(stderr, "benchmark: %s failed: %s\n", #call, cudaGetErrorString(err_));          \
      std::exit(1);                                                                                  \
    }                                                                                                \
  } while (0)

namespace lmx::bench {

// Median of `replays` timed runs of enqueue() on `stream` (one untimed warm-up first), in seconds.
inline double median_seconds(cudaStream_t stream, int replays, const std::function<void()>& enqueue) {
  cudaEvent_t start, stop;
  BENCH_CUDA(cudaEventCreate(&start));
  BENCH_CUDA(cudaEventCreate(&stop));
  enqueue();  // warm-up: module load, first touch
  std::vector<float> ms(static_cast<size_t>(replays));
  for (float& m : ms) {
    BENCH_CUDA(cudaEventRecord(start, stream));
    enqueue();
    BENCH_CUDA(cudaEventRecord(stop, stream));
    BENCH_CUDA(cudaEventSynchronize(stop));
    BENCH_CUDA(cudaEventElapsedTime(&m, start, stop));
  }
  BENCH_CUDA(cudaGetLastError());
  BENCH_CUDA(cudaEventDestroy(start));
  BENCH_CUDA(cudaEventDestroy(stop));
  std::sort(ms.begin(), ms.end());
  return double(ms[ms.size() / 2]) * 1e-3;
}

// Seconds per launch: `launches` calls of launch(i) captured into one graph, timed by median_seconds.
inline double seconds_per_launch(cudaStream_t stream, int launches, int replays, const std::function<void(int)>& launch) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  BENCH_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < launches; ++i) launch(i);
  BENCH_CUDA(cudaStreamEndCapture(stream, &graph));
  BENCH_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  double seconds = median_seconds(stream, replays, [&] { BENCH_CUDA(cudaGraphLaunch(exec, stream)); });
  BENCH_CUDA(cudaGraphExecDestroy(exec));
  BENCH_CUDA(cudaGraphDestroy(graph));
  return seconds / launches;
}

}  // namespace lmx::bench
