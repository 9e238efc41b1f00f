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

void CpuBackend::fill_zero(const Tensor& dst) {
  if (dst.device != Device::kCpu) contract_violation("fill_zero", "dst is not host memory: " + dst.shape_str());
  if (dst.nbytes() > 0) std::memset(dst.data, 0, dst.nbytes());
}

}  // namespace lmx::cpu
