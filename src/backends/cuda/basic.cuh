// Entry points of the small dense ops on cuda (contracts in ops/basic.h): embedding, RMSNorm, residual add,
// SiLU-gated product and row gather. BF16 activations, fp32 math. Linear is not here (a GEMM, later).
// Each call checks its Params, enqueues one kernel on `stream` and returns; callers: tests, bench, (later)
// the CUDA backend.
#pragma once
#include <cuda_runtime_api.h>

#include "ops/basic.h"
#include "ops/moe.h"

namespace lmx::cuda {

void embedding(const ops::EmbeddingParams& p, cudaStream_t stream);
void rms_norm(const ops::RmsNormParams& p, cudaStream_t stream);
void add(const ops::AddParams& p, cudaStream_t stream);
void silu_mul(const ops::SiluMulParams& p, cudaStream_t stream);
void gather_rows(const ops::GatherRowsParams& p, cudaStream_t stream);
// With `bias` ([C] bf16): parts get x + bias rounded to bf16 per element, bit for bit a product's bias
// kernel followed by the plain split (CudaBackend::linear_lora: one launch instead of two).
void split_columns(const ops::SplitColumnsParams& p, cudaStream_t stream, const Tensor& bias = {});

// Generated (dummy) weights in place, bit for bit generate_weights_bf16 of core/rng.h: `t` BF16 on cuda.
void fill_generated(const Tensor& t, uint64_t tensor_seed, float stddev, cudaStream_t stream);
// Generated MXFP4 experts in place, the CPU backend's bytes bit for bit (ops::GeneratedMxfp4Params); every
// tensor on cuda, `values` 16-byte aligned.
void fill_generated_mxfp4(const ops::GeneratedMxfp4Params& p, cudaStream_t stream);

}  // namespace lmx::cuda
