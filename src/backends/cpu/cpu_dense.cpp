// CPU reference of the dense ops in ops/basic.h: embedding, RMSNorm, linear, residual add, SiLU-gated
// product, row gather. fp32 throughout; bf16 weights widened on read.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/cpu_util.h"

namespace lmx::cpu {

void CpuBackend::embedding(const ops::EmbeddingParams& p) {
  ops::require(ops::check(p), "embedding");
  require_host_f32(p.out, "EmbeddingParams.out", "embedding");
  const int64_t tokens = p.token_ids.dim(0), vocab = p.table.dim(0), hidden = p.table.dim(1);
  const int32_t* token_ids = p.token_ids.ptr<int32_t>();  // [T] i32
  const bf16* table = p.table.ptr<bf16>();                // [V, H] bf16
  float* out = p.out.ptr<float>();                        // [T, H] f32
  for (int64_t t = 0; t < tokens; ++t) {
    const int32_t id = token_ids[t];
    if (id < 0 || id >= vocab) {
      contract_violation("embedding", "token_ids[" + std::to_string(t) + "] = " + std::to_string(id) + " outside [0, " +
                                          std::to_string(vocab) + ")");
    }
    for (int64_t h = 0; h < hidden; ++h) out[t * hidden + h] = bf16_to_f32(table[id * hidden + h]);
  }
}

// As transformers computes it in fp32: x * rsqrt(mean(x^2) + eps), then times the weight.
void CpuBackend::rms_norm(const ops::RmsNormParams& p) {
  ops::require(ops::check(p), "rms_norm");
  require_host_f32(p.x, "RmsNormParams.x", "rms_norm");
  const int64_t rows = p.x.dim(0), cols = p.x.dim(1);
  float* x = static_cast<float*>(p.x.data);                 // [N, C] f32 (the sum, with a residual)
  const float* residual = optional_ptr<float>(p.residual);  // [N, C] f32
  const bf16* weight = p.weight.ptr<bf16>();                // [C] bf16
  float* out = p.out.ptr<float>();                          // [N, C] f32, may be x
  pool_.parallel_for(rows, 3 * cols, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      if (residual) {  // x += residual, as CpuBackend::add
        for (int64_t c = 0; c < cols; ++c) x[n * cols + c] += residual[n * cols + c];
      }
      const float* x_row = x + n * cols;
      float* out_row = out + n * cols;
      const float mean_square = dot(x_row, x_row, cols) / float(cols);
      const float inv_rms = 1.0f / std::sqrt(mean_square + p.eps);
      for (int64_t c = 0; c < cols; ++c) out_row[c] = (x_row[c] * inv_rms) * bf16_to_f32(weight[c]);
    }
  });
}

// out[t][o] = dot(x[t], W[o]) + b[o]. Threads split the output features; tokens are walked in blocks so
// a block of x stays in cache while the chunk's weight rows stream past it.
void CpuBackend::linear(const ops::LinearParams& p) {
  ops::require(ops::check(p), "linear");
  require_host_f32(p.x, "LinearParams.x", "linear");
  constexpr int64_t kTokenBlock = 16;
  const int64_t tokens = p.x.dim(0), in = p.x.dim(1), out_features = p.weight.dim(0);
  const float* x = p.x.ptr<float>();              // [T, in] f32
  const bf16* weight = p.weight.ptr<bf16>();      // [out, in] bf16
  const bf16* bias = optional_ptr<bf16>(p.bias);  // [out] bf16
  float* out = p.out.ptr<float>();                // [T, out] f32
  pool_.parallel_for(out_features, 2 * tokens * in, [&](int64_t begin, int64_t end) {
    for (int64_t t0 = 0; t0 < tokens; t0 += kTokenBlock) {
      const int64_t t1 = std::min(tokens, t0 + kTokenBlock);
      for (int64_t o = begin; o < end; ++o) {
        const bf16* w_row = weight + o * in;
        const float b = bias ? bf16_to_f32(bias[o]) : 0.0f;
        for (int64_t t = t0; t < t1; ++t) out[t * out_features + o] = dot(x + t * in, w_row, in) + b;
      }
    }
  });
}

void CpuBackend::add(const ops::AddParams& p) {
  ops::require(ops::check(p), "add");
  require_host_f32(p.x, "AddParams.x", "add");
  const int64_t n = p.x.numel();
  const float* x = p.x.ptr<float>();  // [N, C] f32
  float* y = p.y.ptr<float>();        // [N, C] f32
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

void CpuBackend::silu_mul(const ops::SiluMulParams& p) {
  ops::require(ops::check(p), "silu_mul");
  require_host_f32(p.gate, "SiluMulParams.gate", "silu_mul");
  const int64_t n = p.gate.numel();
  const float* gate = p.gate.ptr<float>();  // [T, I] f32
  const float* up = p.up.ptr<float>();      // [T, I] f32
  float* out = p.out.ptr<float>();          // [T, I] f32, may be gate
  for (int64_t i = 0; i < n; ++i) out[i] = silu(gate[i]) * up[i];
}

void CpuBackend::gather_rows(const ops::GatherRowsParams& p) {
  ops::require(ops::check(p), "gather_rows");
  require_host_f32(p.x, "GatherRowsParams.x", "gather_rows");
  const int64_t rows = p.x.dim(0), cols = p.x.dim(1), picked = p.index.dim(0);
  const float* x = p.x.ptr<float>();              // [T, C] f32
  const int32_t* index = p.index.ptr<int32_t>();  // [B] i32
  float* out = p.out.ptr<float>();                // [B, C] f32
  for (int64_t b = 0; b < picked; ++b) {
    if (index[b] < 0 || index[b] >= rows) {
      contract_violation("gather_rows", "index[" + std::to_string(b) + "] = " + std::to_string(index[b]) +
                                            " outside [0, " + std::to_string(rows) + ")");
    }
    if (cols > 0) std::memcpy(out + b * cols, x + int64_t(index[b]) * cols, size_t(cols) * sizeof(float));
  }
}

void CpuBackend::split_columns(const ops::SplitColumnsParams& p) {
  ops::require(ops::check(p), "split_columns");
  require_host_f32(p.x, "SplitColumnsParams.x", "split_columns");
  const int64_t rows = p.x.dim(0), cols = p.x.dim(1);
  const float* x = p.x.ptr<float>();  // [T, C] f32
  int64_t first = 0;
  for (const Tensor& part : p.parts) {
    if (!part.defined()) break;
    const int64_t width = part.dim(1);
    float* out = part.ptr<float>();  // [T, C_i] f32
    for (int64_t t = 0; t < rows && width > 0; ++t) {
      std::memcpy(out + t * width, x + t * cols + first, size_t(width) * sizeof(float));
    }
    first += width;
  }
}

}  // namespace lmx::cpu
