// MXFP4 dequantization of GPT-OSS expert weights (`*_blocks` + `*_scales`) to bf16, bit-exact with
// transformers' integrations/mxfp4.py, and the decode layout (ops/mxfp4.h) the CUDA decode GEMM reads with
// --mxfp4-experts. Who calls: the weight loader (model/loader.cpp) and the preset generator. Every op but
// the CUDA decode GEMM reads bf16 experts; the MXFP4 copy dequantizes to exactly those values.
#pragma once
#include <string>

#include "core/status.h"
#include "core/tensor.h"

namespace lmx::model {

// The FP4 (E2M1) code points, indexed by the 4-bit code: sign bit 3, then 0, .5, 1, 1.5, 2, 3, 4, 6.
inline constexpr float kFp4Values[16] = {+0.0f, +0.5f, +1.0f, +1.5f, +2.0f, +3.0f, +4.0f, +6.0f,
                                         -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// One dequantized value: kFp4Values[code] * 2^(scale - 127) rounded to bf16 (exact except where the
// product overflows to inf, as torch.ldexp does).
bf16 mxfp4_value(uint8_t code, uint8_t scale);

// blocks [..., rows, G, 16] U8 (two FP4 codes per byte, low nibble first) and scales [..., rows, G]
// (U8 or F8_E8M0, the biased exponent of each 32-value group) -> [..., rows, G*32] bf16.
// The output keeps the checkpoint's row orientation: GPT-OSS stores `gate_up_proj_blocks` as
// [E, 2I, H/32, 16] and `down_proj_blocks` as [E, H, I/32, 16], which dequantize to loramux's canonical
// [E, 2I, H] and [E, H, I] directly. (transformers transposes the result to its [E, H, 2I] parameter
// layout; we do not.) `name` prefixes errors (e.g. the tensor name and file).
Result<OwnedTensor> dequantize_mxfp4(const Tensor& blocks, const Tensor& scales, const std::string& name);

// Experts in the MXFP4 decode layout of ops/mxfp4.h (the CUDA decode GEMM's): blocks [E, K/64, N, 32] and
// scales [E, K/64, N, 2], U8, for a weight [E, N, K].
struct Mxfp4Decode {
  OwnedTensor blocks, scales;
};

// The checkpoint's blocks [E, N, G, 16] and scales [E, N, G] (G = K/32) in the decode layout. Refused (the
// message names `name`, the expert, row and group): G odd (K not a multiple of 64), or an exponent byte above
// ops::mxfp4::kMaxDecodeScale (values of 2^2 and more: the decode GEMM's bf16 multiply would overflow).
Result<Mxfp4Decode> pack_mxfp4_decode(const Tensor& blocks, const Tensor& scales, const std::string& name);

// The bf16 weight [E, N, K] of a decode-layout pair: exactly dequantize_mxfp4 of the checkpoint form.
Result<OwnedTensor> dequantize_mxfp4_decode(const Tensor& blocks, const Tensor& scales, const std::string& name);

// Generated experts for presets (--mxfp4-experts): uniform random codes, exponents in [scale_lo, scale_lo + 2],
// in the decode layout for a weight [E, N, K] (K % 64 == 0). Deterministic in `seed`, whatever the threads.
Mxfp4Decode generate_mxfp4_decode(int64_t experts, int64_t rows, int64_t k, uint64_t seed, int scale_lo);

}  // namespace lmx::model
