// bench_cuda_ops: times the dense CUDA kernels (embedding, rms_norm, add, silu_mul, moe_activation, gather_rows, rope,
// kv_write, and the linear projections: skinny tensor-core kernel vs cuBLASLt) at GPT-OSS-20B sizes (H 2880, V 201088, Hq 64, Hkv 8, D 64) for T = 16 (decode), 256 and 2048
// (prefill). All are memory-bound, so each line prints the bytes the op must move, the floor those bytes
// take at the H200's measured ~4.2 TB/s, the measured time, GB/s and the share of 4.2 TB/s.
// Method: each kernel is launched many times inside one CUDA graph (launch gaps as in the decode graph),
// cycling over input/output sets that together exceed the 60 MB L2 several times (DRAM, not the cache, is
// measured); graph replays are timed with events, median of several, divided by the launches. Inputs are
// random bf16, never zeros. Run by scripts/device; numbers go to docs/perf-log.md and docs/benchmarks.md.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "backends/cuda/attention.cuh"
#include "bench/cuda_timing.h"
#include "backends/cuda/basic.cuh"
#include "backends/cuda/linear.cuh"
#include "backends/cuda/memory.h"
#include "backends/cuda/moe_gemm.cuh"
#include "backends/cuda/rope.cuh"
#include "core/rng.h"
#include "ops/rope.h"

namespace lmx {
namespace {


constexpr double kCeilingBytesPerSecond = 4.2e12;  // device-to-device copy on an H200 (docs/perf-log.md)
constexpr size_t kRotationBytes = size_t(512) << 20;  // per op: ~8x the L2, so every launch reads DRAM
constexpr int kMaxSets = 2048;
constexpr int kMinLaunches = 200;
constexpr int kReplays = 7;

// GPT-OSS-20B
constexpr int64_t kHidden = 2880, kVocab = 201088, kQHeads = 64, kKvHeads = 8, kHeadDim = 64, kPageSize = 16;

// `sets` equal-sized slots of one role (x, out, ids, ...), each 256-byte aligned.
struct Rotation {
  Buffer buffer;
  size_t slot_bytes = 0;
  int sets = 0;
  void* slot(int i) const { return static_cast<char*>(buffer.data()) + size_t(i % sets) * slot_bytes; }
};

Rotation make_rotation(size_t bytes_per_set, int sets) {
  Rotation r;
  r.slot_bytes = (bytes_per_set + 255) / 256 * 256;
  r.sets = sets;
  r.buffer = cuda::allocate(r.slot_bytes * size_t(sets));
  return r;
}

// Fill device memory with random bf16 N(0, 1) values, tiling one 8 MB random block (fast, never zeros).
void fill_random_bf16(const Buffer& buffer, Rng& rng) {
  static std::vector<bf16> block = [&] {
    std::vector<bf16> b(size_t(4) << 20);
    for (bf16& v : b) v = f32_to_bf16(rng.normal());
    return b;
  }();
  const size_t block_bytes = block.size() * sizeof(bf16);
  for (size_t off = 0; off < buffer.bytes(); off += block_bytes) {
    BENCH_CUDA(cudaMemcpy(static_cast<char*>(buffer.data()) + off, block.data(),
                          std::min(block_bytes, buffer.bytes() - off), cudaMemcpyHostToDevice));
  }
}

// Every set's slot gets its own ids: uniform in [0, range), or distinct when `distinct` (kv_write rows).
void fill_ids(const Rotation& r, int64_t count, int32_t range, bool distinct, Rng& rng) {
  std::vector<int32_t> ids(static_cast<size_t>(count));
  std::vector<int32_t> all;
  if (distinct) {
    all.resize(size_t(range));
    for (int32_t i = 0; i < range; ++i) all[i] = i;
  }
  for (int s = 0; s < r.sets; ++s) {
    for (int64_t i = 0; i < count; ++i) {
      if (distinct) {
        std::swap(all[i], all[i + int64_t(rng.next_u64() % uint64_t(range - i))]);
        ids[i] = all[i];
      } else {
        ids[i] = int32_t(rng.next_u64() % uint64_t(range));
      }
    }
    BENCH_CUDA(cudaMemcpy(r.slot(s), ids.data(), ids.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  }
}

int sets_for(double bytes_per_launch) {
  return int(std::clamp<double>(double(kRotationBytes) / bytes_per_launch, 1.0, double(kMaxSets)));
}

// Seconds per launch: `launches` calls of launch(i) captured into one graph, replays timed with events,
// median replay / launches.
double time_per_launch(cudaStream_t stream, int launches, const std::function<void(int)>& launch) {
  return bench::seconds_per_launch(stream, launches, kReplays, launch);
}

int launches_for(int sets) { return (std::max(kMinLaunches, sets) + sets - 1) / sets * sets; }

struct Row {
  std::string op, shape;
  int64_t tokens;
  double bytes, seconds;
};

void print_row(const Row& r) {
  const double floor_us = r.bytes / kCeilingBytesPerSecond * 1e6;
  const double gbps = r.bytes / r.seconds * 1e-9;
  std::printf("%-12s %5lld  %-30s %12.0f  %9.2f  %9.2f  %8.1f  %6.1f%%\n", r.op.c_str(), (long long)r.tokens,
              r.shape.c_str(), r.bytes, floor_us, r.seconds * 1e6, gbps, 100.0 * gbps * 1e9 / kCeilingBytesPerSecond);
  std::fflush(stdout);
}

std::string dims(std::initializer_list<int64_t> d) {
  std::string s = "[";
  for (int64_t v : d) s += (s.size() > 1 ? ", " : "") + std::to_string(v);
  return s + "]";
}

Tensor bf16_view(const Rotation& r, int i, std::initializer_list<int64_t> d) {
  return Tensor(r.slot(i), DType::BF16, d, Device::kCuda);
}
Tensor i32_view(const Rotation& r, int i, int64_t n) { return Tensor(r.slot(i), DType::I32, {n}, Device::kCuda); }

// The device-to-device copy rate, the reference for the 4.2 TB/s ceiling. Timed on the stream, not in a
// graph: a memcpy node in a graph ran at ~2.8 TB/s on the H200 (2026-12-02), a stream copy is what
// KINDS.md's 4.3 TB/s was read from.
void bench_copy(cudaStream_t stream) {
  const size_t bytes = size_t(1) << 30;
  Buffer src = cuda::allocate(bytes), dst = cuda::allocate(bytes);
  BENCH_CUDA(cudaMemset(src.data(), 0x3c, bytes));
  const double seconds = bench::median_seconds(stream, kReplays, [&] {
    BENCH_CUDA(cudaMemcpyAsync(dst.data(), src.data(), bytes, cudaMemcpyDeviceToDevice, stream));
  });
  print_row({.op = "d2d_copy", .shape = "1 GiB (stream)", .tokens = 0, .bytes = 2.0 * double(bytes),
             .seconds = seconds});
}

void bench_tokens(int64_t T, cudaStream_t stream, Rng& rng, const Buffer& table) {
  const int64_t H = kHidden;
  const size_t row = size_t(T * H) * 2;  // one [T, H] bf16 activation
  {  // embedding: T random rows of the [V, H] table
    const double bytes = 2.0 * double(row) + 4.0 * T;
    const int sets = sets_for(bytes);
    Rotation ids = make_rotation(4 * T, sets), out = make_rotation(row, sets);
    fill_ids(ids, T, int32_t(kVocab), false, rng);
    const Tensor table_view(table.data(), DType::BF16, {kVocab, H}, Device::kCuda);
    const double s = time_per_launch(stream, launches_for(sets), [&](int i) {
      cuda::embedding({.table = table_view, .token_ids = i32_view(ids, i, T), .out = bf16_view(out, i, {T, H})},
                      stream);
    });
    print_row({.op = "embedding", .shape = dims({kVocab, H}) + " -> " + dims({T, H}), .tokens = T, .bytes = bytes, .seconds = s});
  }
  {  // rms_norm over [T, H]
    const double bytes = 2.0 * double(row) + 2.0 * H;
    const int sets = sets_for(bytes);
    Rotation x = make_rotation(row, sets), w = make_rotation(2 * H, sets), out = make_rotation(row, sets);
    fill_random_bf16(x.buffer, rng);
    fill_random_bf16(w.buffer, rng);
    const double s = time_per_launch(stream, launches_for(sets), [&](int i) {
      cuda::rms_norm({.x = bf16_view(x, i, {T, H}), .weight = bf16_view(w, i, {H}), .eps = 1e-5f,
                      .out = bf16_view(out, i, {T, H})},
                     stream);
    });
    print_row({.op = "rms_norm", .shape = dims({T, H}), .tokens = T, .bytes = bytes, .seconds = s});
  }
  {  // add: y += x over [T, H] (the residual)
    const double bytes = 3.0 * double(row);
    const int sets = sets_for(bytes);
    Rotation x = make_rotation(row, sets), y = make_rotation(row, sets);
    fill_random_bf16(x.buffer, rng);
    fill_random_bf16(y.buffer, rng);
    const double s = time_per_launch(stream, launches_for(sets), [&](int i) {
      cuda::add({.x = bf16_view(x, i, {T, H}), .y = bf16_view(y, i, {T, H})}, stream);
    });
    print_row({.op = "add", .shape = dims({T, H}), .tokens = T, .bytes = bytes, .seconds = s});
  }
  {  // silu_mul over [T, I], I = 2880 (GPT-OSS's expert width; dense models use this op)
    const double bytes = 3.0 * double(row);
    const int sets = sets_for(bytes);
    Rotation gate = make_rotation(row, sets), up = make_rotation(row, sets), out = make_rotation(row, sets);
    fill_random_bf16(gate.buffer, rng);
    fill_random_bf16(up.buffer, rng);
    const double s = time_per_launch(stream, launches_for(sets), [&](int i) {
      cuda::silu_mul({.gate = bf16_view(gate, i, {T, H}), .up = bf16_view(up, i, {T, H}),
                      .out = bf16_view(out, i, {T, H})},
                     stream);
    });
    print_row({.op = "silu_mul", .shape = dims({T, H}), .tokens = T, .bytes = bytes, .seconds = s});
  }
  {  // moe_activation over the T*4 pairs of GPT-OSS-20B (K 4, I 2880, interleaved gate/up, clamped SwiGLU):
     // the separate activation of the MoE-LoRA side expands (moe_block), without and with their f32 terms
     // (read, added, zeroed). The terms are zero after a set's first launch: the kernel's work does not
     // depend on their values (a select per element).
    const int64_t P = 4 * T, I = kHidden;
    for (const bool terms : {false, true}) {
      const double bytes = double(P * 2 * I * 2 + P * I * 2) + (terms ? 2.0 * double(P * 2 * I * 4) : 0.0);
      const int sets = sets_for(bytes);
      Rotation h = make_rotation(size_t(P * 2 * I * 2), sets), a = make_rotation(size_t(P * I * 2), sets);
      Rotation delta = make_rotation(terms ? size_t(P * 2 * I * 4) : 16, sets);
      fill_random_bf16(h.buffer, rng);
      fill_random_bf16(delta.buffer, rng);  // any finite f32 bits: two bf16 N(0, 1) halves
      const double s = time_per_launch(stream, launches_for(sets), [&](int i) {
        cuda::moe_activation({.h = bf16_view(h, i, {P, 2 * I}),
                              .activation = ops::MoeActivation::kGptOssClamped,
                              .layout = ops::GateUpLayout::kInterleaved,
                              .a = bf16_view(a, i, {P, I}),
                              .delta = terms ? Tensor(delta.slot(i), DType::F32, {P, 2 * I}, Device::kCuda) : Tensor{}},
                             stream);
      });
      print_row({.op = terms ? "moe_act+lora" : "moe_act", .shape = dims({P, 2 * I}) + " -> " + dims({P, I}),
                 .tokens = T, .bytes = bytes, .seconds = s});
    }
  }
  {  // gather_rows: the sampled rows before the LM head; decode samples every token, prefill one per sequence
    const int64_t B = std::min<int64_t>(T, 16);
    const double bytes = 2.0 * double(B * H * 2) + 4.0 * B;
    const int sets = sets_for(double(row));  // rotate whole [T, H] inputs: the rows read are random
    Rotation x = make_rotation(row, sets), index = make_rotation(4 * B, sets), out = make_rotation(B * H * 2, sets);
    fill_random_bf16(x.buffer, rng);
    fill_ids(index, B, int32_t(T), false, rng);
    const double s = time_per_launch(stream, launches_for(sets), [&](int i) {
      cuda::gather_rows({.x = bf16_view(x, i, {T, H}), .index = i32_view(index, i, B), .out = bf16_view(out, i, {B, H})},
                        stream);
    });
    print_row({.op = "gather_rows", .shape = dims({T, H}) + " -> " + dims({B, H}), .tokens = T, .bytes = bytes, .seconds = s});
  }
  {  // rope: q [T, 64, 64] and k [T, 8, 64] in place, GPT-OSS YaRN table
    const size_t q_bytes = size_t(T * kQHeads * kHeadDim) * 2, k_bytes = size_t(T * kKvHeads * kHeadDim) * 2;
    const double bytes = 2.0 * double(q_bytes + k_bytes) + 4.0 * T + 4.0 * (kHeadDim / 2);
    const int sets = sets_for(bytes);
    Rotation q = make_rotation(q_bytes, sets), k = make_rotation(k_bytes, sets), pos = make_rotation(4 * T, sets);
    fill_random_bf16(q.buffer, rng);
    fill_random_bf16(k.buffer, rng);
    fill_ids(pos, T, 131072, false, rng);
    ops::RopeScaling scaling{.type = ops::RopeScaling::Type::kYarn, .theta = 150000.0, .factor = 32.0,
                             .original_max_position = 4096, .truncate = false};
    const ops::RopeTable table = ops::make_rope_table(scaling, int(kHeadDim));
    OwnedTensor inv_freq = cuda::upload(Tensor(const_cast<float*>(table.inv_freq.data()), DType::F32, {kHeadDim / 2}));
    const double s = time_per_launch(stream, launches_for(sets), [&](int i) {
      cuda::rope({.q = bf16_view(q, i, {T, kQHeads, kHeadDim}), .k = bf16_view(k, i, {T, kKvHeads, kHeadDim}),
                  .positions = i32_view(pos, i, T), .inv_freq = inv_freq, .attention_scaling = table.attention_scaling},
                 stream);
    });
    print_row({.op = "rope", .shape = dims({T, kQHeads, kHeadDim}) + "+" + dims({T, kKvHeads, kHeadDim}), .tokens = T,
               .bytes = bytes, .seconds = s});
  }
  {  // kv_write: k, v [T, 8, 64] into 8192 pages of 16 (a 134 MB cache each), distinct random rows
    const int64_t pages = 8192;
    const size_t kv_bytes = size_t(T * kKvHeads * kHeadDim) * 2;
    const double bytes = 4.0 * double(kv_bytes) + 4.0 * T;
    const int sets = sets_for(bytes);
    Rotation k = make_rotation(kv_bytes, sets), v = make_rotation(kv_bytes, sets), index = make_rotation(4 * T, sets);
    fill_random_bf16(k.buffer, rng);
    fill_random_bf16(v.buffer, rng);
    fill_ids(index, T, int32_t(pages * kPageSize), true, rng);
    OwnedTensor k_cache = cuda::empty(DType::BF16, {pages, kPageSize, kKvHeads, kHeadDim});
    OwnedTensor v_cache = cuda::empty(DType::BF16, {pages, kPageSize, kKvHeads, kHeadDim});
    const double s = time_per_launch(stream, launches_for(sets), [&](int i) {
      cuda::kv_write({.k = bf16_view(k, i, {T, kKvHeads, kHeadDim}), .v = bf16_view(v, i, {T, kKvHeads, kHeadDim}),
                      .kv_write_index = i32_view(index, i, T), .k_cache = k_cache, .v_cache = v_cache},
                     stream);
    });
    print_row({.op = "kv_write", .shape = dims({T, kKvHeads, kHeadDim}) + " x2", .tokens = T, .bytes = bytes, .seconds = s});
  }
}

// Dense projections of GPT-OSS-20B at decode and prefill row counts: cuBLASLt (the default) against the
// forced skinny tensor-core kernel. Bytes = weights + x + out; weights cycle over copies > L2.
void bench_linear(cudaStream_t stream, Rng& rng) {
  struct Shape { const char* name; int64_t in, out; DType out_dtype; };
  const Shape shapes[] = {{"qkv", kHidden, (kQHeads + 2 * kKvHeads) * kHeadDim, DType::BF16},
                          {"o_proj", kQHeads * kHeadDim, kHidden, DType::BF16},
                          {"router", kHidden, 32, DType::F32},
                          {"lm_head", kHidden, kVocab, DType::F32},
                          // GPT-OSS served with its tokenizer: 200019 logits a row, and the nearest
                          // multiple of 128 below it
                          {"lm_head", kHidden, 200019, DType::F32},
                          {"lm_head", kHidden, 199936, DType::F32},
                          {"lm_head_tail", kHidden, 200019 - 199936, DType::F32}};  // the split's second product
  cuda::LinearRunner runner, untuned;  // untuned: cuBLASLt's heuristic choice (LinearRunner::set_autotune)
  untuned.set_autotune(false);
  untuned.set_path(cuda::LinearPath::kCublasLt);
  for (const Shape& shape : shapes) {
    const double weight_bytes = double(shape.in) * double(shape.out) * 2;
    const int sets = sets_for(weight_bytes);
    Rotation weights = make_rotation(size_t(weight_bytes), sets);
    fill_random_bf16(weights.buffer, rng);
    for (int64_t T : {1, 16, 64, 2048}) {
      if (std::string(shape.name).rfind("lm_head", 0) == 0 && T > 64) continue;  // the LM head sees sampled rows only
      const size_t out_elem = shape.out_dtype == DType::F32 ? 4 : 2;
      Buffer x = cuda::allocate(size_t(T * shape.in) * 2), out = cuda::allocate(size_t(T * shape.out) * out_elem);
      fill_random_bf16(x, rng);
      const double bytes = weight_bytes + double(T * shape.in) * 2 + double(T * shape.out) * double(out_elem);
      const bool ragged = shape.out % 128 != 0;
      // skinny, cuBLASLt (autotuned at T <= 16; a ragged width as two products), its heuristic's choice, and
      // for a ragged width one cuBLASLt product (the before of perf-log run 81)
      for (int variant = 0; variant < 4; ++variant) {
        const cuda::LinearPath path = variant == 0 ? cuda::LinearPath::kSkinny : cuda::LinearPath::kCublasLt;
        if (path == cuda::LinearPath::kSkinny && T > 16) continue;  // the skinny kernel's limit
        if (variant == 2 && T > 16) continue;                         // the same as variant 1 there
        if (variant == 3 && !ragged) continue;
        cuda::LinearRunner& use = variant == 2 ? untuned : runner;
        use.set_path(path);
        use.set_split_ragged_rows(variant != 3);
        auto launch = [&](int i) {
          use.run({.x = Tensor(x.data(), DType::BF16, {T, shape.in}, Device::kCuda),
                   .weight = Tensor(weights.slot(i), DType::BF16, {shape.out, shape.in}, Device::kCuda),
                   .out = Tensor(out.data(), shape.out_dtype, {T, shape.out}, Device::kCuda)},
                  stream);
        };
        launch(0);  // the heuristic query and the autotune (host) before capture
        BENCH_CUDA(cudaStreamSynchronize(stream));
        const double s = time_per_launch(stream, launches_for(sets), launch);
        print_row({.op = std::string(variant == 0   ? "skinny "
                                     : variant == 1 ? "cublasLt "
                                     : variant == 2 ? "cublasLt heuristic "
                                                    : "cublasLt one product ") + shape.name,
                   .shape = dims({T, shape.in}) + " x " + dims({shape.out, shape.in}), .tokens = T, .bytes = bytes,
                   .seconds = s});
      }
    }
  }
}

}  // namespace
}  // namespace lmx

// Usage: bench_cuda_ops [linear] — "linear": only the projection rows.
int main(int argc, char** argv) {
  using namespace lmx;
  const bool linear_only = argc > 1 && std::string(argv[1]) == "linear";
  cudaDeviceProp prop;
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("bench_cuda_ops: %s, %d SMs, L2 %d MB, %.0f GB; ceiling for %% = %.1f TB/s\n", prop.name,
              prop.multiProcessorCount, prop.l2CacheSize >> 20, double(prop.totalGlobalMem) * 1e-9,
              kCeilingBytesPerSecond * 1e-12);
  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Rng rng(20251202);
  Buffer table = cuda::allocate(size_t(kVocab * kHidden) * 2);
  fill_random_bf16(table, rng);

  std::printf("%-12s %5s  %-30s %12s  %9s  %9s  %8s  %7s\n", "op", "T", "shape", "bytes", "floor_us", "time_us",
              "GB/s", "%4.2TB/s");
  if (!linear_only) {
    bench_copy(stream);
    for (int64_t T : {16, 256, 2048}) bench_tokens(T, stream, rng, table);
  }
  bench_linear(stream, rng);
  BENCH_CUDA(cudaStreamDestroy(stream));
  return 0;
}
