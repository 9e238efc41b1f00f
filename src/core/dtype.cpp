// DType names/sizes and the fp16 conversions (bf16 ones are inline in dtype.h).
#include "core/dtype.h"

#include <cmath>

namespace lmx {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::F32: case DType::I32: return 4;
    case DType::BF16: case DType::F16: return 2;
    case DType::I64: return 8;
    case DType::U8: case DType::I8: case DType::F8_E8M0: return 1;
  }
  return 0;
}

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F32: return "F32";
    case DType::BF16: return "BF16";
    case DType::F16: return "F16";
    case DType::I32: return "I32";
    case DType::I64: return "I64";
    case DType::U8: return "U8";
    case DType::I8: return "I8";
    case DType::F8_E8M0: return "F8_E8M0";
  }
  return "?";
}

bool dtype_from_name(std::string_view name, DType* out) {
  static constexpr struct { std::string_view name; DType dtype; } kNames[] = {
      {"F32", DType::F32}, {"BF16", DType::BF16}, {"F16", DType::F16}, {"I32", DType::I32},
      {"I64", DType::I64}, {"U8", DType::U8},     {"I8", DType::I8},   {"F8_E8M0", DType::F8_E8M0}};
  for (const auto& n : kNames) {
    if (n.name == name) {
      *out = n.dtype;
      return true;
    }
  }
  return false;
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h >> 15) << 31;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t u;
  if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {  // subnormal: value = mant * 2^-24
      float f = std::ldexp(float(mant), -24);
      std::memcpy(&u, &f, 4);
      u |= sign;
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (mant << 13);
  } else {
    u = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t f32_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint16_t sign = uint16_t((u >> 16) & 0x8000);
  uint32_t abs = u & 0x7fffffffu;
  if (abs >= 0x7f800000u) return uint16_t(sign | 0x7c00 | (abs > 0x7f800000u ? 0x200 : 0));
  if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00);  // rounds to inf
  if (abs < 0x38800000u) {                                 // subnormal or zero in fp16
    float af;
    std::memcpy(&af, &abs, 4);
    return uint16_t(sign | uint16_t(std::nearbyint(af * 16777216.0f)));  // 2^24; default rounding = RNE
  }
  uint32_t mant_round = abs + 0xfffu + ((abs >> 13) & 1u);
  return uint16_t(sign | ((mant_round - 0x38000000u) >> 13));
}

}  // namespace lmx
