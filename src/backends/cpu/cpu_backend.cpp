// CpuBackend: construction, memory (host buffers, memcpy) and the helpers the op files share. The ops
// live in one file per family: cpu_dense.cpp, cpu_attention.cpp, cpu_moe.cpp, cpu_sampling.cpp.
#include "backends/cpu/cpu_backend.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>

#include "backends/cpu/cpu_util.h"
#include "core/rng.h"
#include "ops/mxfp4.h"

namespace lmx::cpu {

void contract_violation(const char* op, const std::string& message) {
  ops::require(invalid_argument(message), op);
  std::abort();  // require() has aborted already; this tells the compiler so
}

void require_host_f32(const Tensor& t, const char* field, const char* op) {
  if (t.device != Device::kCpu) {
    contract_violation(op, std::string(field) + ": the cpu backend needs host memory, found a " +
                               std::string(device_name(t.device)) + " tensor");
  }
  if (t.dtype != DType::F32) {
    contract_violation(op, std::string(field) + ": the cpu backend computes in F32, found " + t.shape_str());
  }
}

void require_no_nan(const float* row, int64_t n, const char* field, int64_t row_index, const char* op) {
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(row[i])) {
      contract_violation(op, std::string(field) + "[" + std::to_string(row_index) + "][" + std::to_string(i) +
                                 "] is NaN (a NaN upstream: the ordering it feeds would be arbitrary)");
    }
  }
}

namespace {
int default_threads(int requested) {
  if (requested > 0) return requested;
  const unsigned hardware = std::thread::hardware_concurrency();
  return hardware ? int(hardware) : 1;
}
}  // namespace

CpuBackend::CpuBackend(int num_threads) : pool_(default_threads(num_threads)) {}

Buffer CpuBackend::allocate(size_t bytes) { return Buffer::host(bytes); }

void CpuBackend::copy(const Tensor& dst, const Tensor& src) {
  if (dst.dtype != src.dtype || dst.numel() != src.numel()) {
    contract_violation("copy",
                       "dst " + dst.shape_str() + " and src " + src.shape_str() + " differ in dtype or element count");
  }
  if (dst.device != Device::kCpu || src.device != Device::kCpu) {
    contract_violation("copy", "the cpu backend copies host memory only (dst on " +
                                   std::string(device_name(dst.device)) + ", src on " +
                                   std::string(device_name(src.device)) + ")");
  }
  if (dst.nbytes() > 0) std::memmove(dst.data, src.data, dst.nbytes());
}

uint64_t CpuBackend::available_bytes() const {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  uint64_t kib = 0;
  std::string unit;
  while (meminfo >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024;
  }
  return 0;
}

void CpuBackend::fill_generated(const Tensor& t, uint64_t tensor_seed, float stddev) {
  if (t.device != Device::kCpu || t.dtype != DType::BF16) {
    contract_violation("fill_generated", "t must be a BF16 host tensor, found " + t.shape_str());
  }
  uint16_t* out = t.ptr<uint16_t>();
  const int64_t chunks = (t.numel() + kGeneratedChunk - 1) / kGeneratedChunk;
  pool_.parallel_for(chunks, kGeneratedChunk, [&](int64_t begin, int64_t end) {
    generate_weights_bf16(out, begin * kGeneratedChunk, std::min(t.numel(), end * kGeneratedChunk), tensor_seed, stddev);
  });
}

void CpuBackend::fill_generated_mxfp4(const ops::GeneratedMxfp4Params& p) {
  ops::require(ops::check(p), "fill_generated_mxfp4");
  if (p.values.device != Device::kCpu) {
    contract_violation("fill_generated_mxfp4", "the cpu backend fills host memory, found " + p.values.shape_str() +
                                                   " on " + std::string(device_name(p.values.device)));
  }
  namespace mxfp4 = ops::mxfp4;
  const int64_t rows = p.values.dim(1), k = p.values.dim(2), tiles = k / mxfp4::kTileK;
  const int64_t units = p.values.dim(0) * tiles * rows;  // (expert, k-tile, row)
  uint8_t* blocks = p.weight.blocks.ptr<uint8_t>();
  uint8_t* scales = p.weight.scales.ptr<uint8_t>();
  uint16_t* values = p.values.ptr<uint16_t>();
  pool_.parallel_for(units, 16 * mxfp4::kTileK, [&](int64_t begin, int64_t end) {  // ~16 operations a value
    for (int64_t u = begin; u < end; ++u) {
      const mxfp4::GeneratedUnit g = mxfp4::generated_unit(p.seed, u, p.scale_lo);
      std::memcpy(blocks + u * mxfp4::kTileBytes, g.words, mxfp4::kTileBytes);
      std::memcpy(scales + u * 2, g.scales, 2);
      const int64_t row = u % rows, kt = u / rows % tiles, expert = u / (rows * tiles);
      uint16_t* out = values + (expert * rows + row) * k + kt * mxfp4::kTileK;
      for (int i = 0; i < mxfp4::kTileK; ++i) {
        out[i] = f32_to_bf16(mxfp4::code_value(mxfp4::unit_code(g.words, i), g.scales[i / mxfp4::kGroup])).bits;
      }
    }
  });
}

void CpuBackend::fill_zero(const Tensor& dst) {
  if (dst.device != Device::kCpu) contract_violation("fill_zero", "dst is not host memory: " + dst.shape_str());
  if (dst.nbytes() > 0) std::memset(dst.data, 0, dst.nbytes());
}

}  // namespace lmx::cpu
