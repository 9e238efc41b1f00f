// bench_sampling_cuda: GPU time of cuda::sample (backends/cuda/sampling.cuh) at GPT-OSS's vocabulary
// (V = 201,088; 200,019 as served with its tokenizer, an odd row length) and Qwen3's (151,936), B = 16 and 64 rows, for the serving mixes: greedy, greedy with 20
// top logprobs, top-k 50 + top-p 0.9 at T 0.8, and temperature alone (the whole vocabulary is the nucleus:
// the worst case for the mass descents). Floor: reading the logits once, B·V·4 bytes at 4.2 TB/s; the
// kernel reads nothing else from DRAM. The launches cycle over copies of the logits (> 4× the L2) so every
// row comes from DRAM. Random normal logits (σ 2), fresh uniform numbers per row; never zeros.
// Method as the other CUDA benchmarks (bench/cuda_timing.h): launches in one CUDA graph, median replay.
// The host path it replaces (copy B·V·4 bytes back, sample on the CPU) took ~3 ms at B = 16.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "backends/cuda/memory.h"
#include "backends/cuda/sampling.cuh"
#include "bench/cuda_timing.h"
#include "core/rng.h"

namespace lmx {
namespace {

constexpr double kBytesPerSecond = 4.2e12;  // measured d2d copy (docs/perf-log.md)
constexpr double kL2Bytes = 60e6;
constexpr int kIterations = 32;
constexpr int kReplays = 7;

struct Mix {
  const char* name;
  float temperature;
  int32_t top_k;
  float top_p;
  int64_t top_n;  // -1: no logprobs
};

OwnedTensor filled_f32(int64_t n, float value) {
  OwnedTensor t = OwnedTensor::host(DType::F32, {n});
  for (int64_t i = 0; i < n; ++i) t.view.ptr<float>()[i] = value;
  return cuda::upload(t);
}

void run(Rng& rng, int64_t rows, int64_t vocab, cudaStream_t stream) {
  const double bytes = double(rows) * double(vocab) * 4.0;
  const int copies = int(std::max(2.0, 4.0 * kL2Bytes / bytes + 1.0));
  std::vector<OwnedTensor> logits;
  OwnedTensor host = OwnedTensor::host(DType::F32, {rows, vocab});
  for (int c = 0; c < copies; ++c) {
    for (int64_t i = 0; i < rows * vocab; ++i) host.view.ptr<float>()[i] = 2.0f * rng.normal();
    logits.push_back(cuda::upload(host));
  }
  OwnedTensor uniform_host = OwnedTensor::host(DType::F32, {rows});
  for (int64_t b = 0; b < rows; ++b) uniform_host.view.ptr<float>()[b] = rng.uniform();
  OwnedTensor uniform = cuda::upload(uniform_host);
  OwnedTensor tokens = cuda::empty(DType::I32, {rows}), logprob = cuda::empty(DType::F32, {rows});
  OwnedTensor top_ids = cuda::empty(DType::I32, {rows, 20}), top_logprobs = cuda::empty(DType::F32, {rows, 20});

  const Mix mixes[] = {{"greedy", 0.0f, 0, 1.0f, -1},
                       {"greedy + 20 top logprobs", 0.0f, 0, 1.0f, 20},
                       {"top-k 50 + top-p 0.9, T 0.8", 0.8f, 50, 0.9f, -1},
                       {"top-p 0.9, T 0.8", 0.8f, 0, 0.9f, -1},
                       {"temperature 1 only (all V)", 1.0f, 0, 1.0f, -1}};
  const double floor_s = bytes / kBytesPerSecond;
  for (const Mix& mix : mixes) {
    OwnedTensor temperature = filled_f32(rows, mix.temperature), top_p = filled_f32(rows, mix.top_p);
    OwnedTensor top_k_host = OwnedTensor::host(DType::I32, {rows});
    for (int64_t b = 0; b < rows; ++b) top_k_host.view.ptr<int32_t>()[b] = mix.top_k;
    OwnedTensor top_k = cuda::upload(top_k_host);
    auto launch = [&](int i) {
      cuda::sample({.logits = logits[size_t(i % copies)],
                    .temperature = temperature,
                    .top_k = top_k,
                    .top_p = top_p,
                    .uniform = uniform,
                    .out_tokens = tokens,
                    .out_logprob = mix.top_n >= 0 ? logprob.view : Tensor{},
                    .out_top_ids = mix.top_n > 0 ? top_ids.view : Tensor{},
                    .out_top_logprobs = mix.top_n > 0 ? top_logprobs.view : Tensor{}},
                   stream);
    };
    launch(0);  // eager first call: sets the kernel's shared-memory attribute
    BENCH_CUDA(cudaStreamSynchronize(stream));
    const double seconds = bench::seconds_per_launch(stream, kIterations, kReplays, launch);
    std::printf("  B %3lld  V %6lld  %-28s %8.1f us   floor %6.1f us (%5.1f%% of floor)  %7.1f GB/s\n",
                (long long)rows, (long long)vocab, mix.name, seconds * 1e6, floor_s * 1e6, 100.0 * floor_s / seconds,
                bytes / seconds * 1e-9);
  }
}

}  // namespace
}  // namespace lmx

int main() {
  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  lmx::Rng rng(20240605);
  std::printf("cuda::sample (one thread-block cluster per row, row read once into shared memory)\n");
  std::printf("  CTAs per row: V 201088 -> %d, V 151936 -> %d\n", lmx::cuda::sampling_cluster_ctas(201088),
              lmx::cuda::sampling_cluster_ctas(151936));
  for (int64_t rows : {16, 64}) {
    for (int64_t vocab : {201088, 200019, 151936}) lmx::run(rng, rows, vocab, stream);  // 200019: GPT-OSS served with its tokenizer
  }
  BENCH_CUDA(cudaStreamDestroy(stream));
  return 0;
}
