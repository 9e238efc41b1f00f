// Element types and the scalar conversions (bf16, fp16 <-> fp32) every backend shares.
// Rounding is round-to-nearest-even, the same as torch's .to(torch.bfloat16).
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace lmx {

enum class DType : uint8_t { F32, BF16, F16, I32, I64, U8, I8, F8_E8M0 };

size_t dtype_size(DType dtype);
std::string_view dtype_name(DType dtype);  // "F32", "BF16", ... (safetensors spelling)
// Parse a safetensors dtype string; false when it is not one loramux reads.
bool dtype_from_name(std::string_view name, DType* out);

struct bf16 {
  uint16_t bits;
};

inline float bf16_to_f32(bf16 v) {
  uint32_t u = uint32_t(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline bf16 f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return bf16{uint16_t((u >> 16) | 0x40)};  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{uint16_t(u >> 16)};
}

// fp32 rounded through bf16 and back: what a value becomes when stored in a bf16 tensor.
inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

}  // namespace lmx
