// The MXFP4 decode layout of MoE expert weights: GPT-OSS's own 4-bit experts (E2M1 codes in groups of 32
// sharing an E8M0 exponent), rearranged so that the CUDA decode GEMM (moe_gemm.cu, grouped_gemm_mxfp4_kernel)
// turns them into mma.sync's bf16 B fragments with a few integer operations and one bf16x2 multiply.
// Plain integer arithmetic, callable on the host as well: model/mxfp4.cpp packs and unpacks this layout
// with it, and tests/ops/test_mxfp4_layout.cpp checks the device's arithmetic on the CPU.
//
// A weight [E, N, K] (rows N = output columns, K = the reduction, K % 64 == 0) becomes
//   blocks [E, K/64, N, 32] U8: per k-tile of 64 values and row, 32 bytes;
//   scales [E, K/64, N, 2]  U8: the biased exponents (E8M0) of the k-tile's groups of values 0–31 and 32–63.
// The 32 bytes of a (k-tile, row) are four 8-byte parts, one per lane t = 0..3 of an mma quad (mma.sync
// m16n8k16 gives lane 4g + t the B values of column g at k = 2t, 2t + 1 and 2t + 8, 2t + 9 of each 16-k
// step). Part t is two 32-bit words (little-endian); word w holds the lane's B registers m = 4w + r,
// r = 0..3, where register m is the k step kk = m / 2 (b0 for even m, b1 for odd) and holds the values
// k = 16·kk + 2t + 8·(m % 2) (low half) and k + 1 (high half). A register's bf16x2 bits are (sign, 0,
// magnitude << 6) per half: each code's sign at bit 15 / 31 and its 3-bit magnitude at bits 6–8 / 22–24,
// which is the E2M1 value times 2^-126 exactly (magnitude 1, the value 0.5, is the subnormal 2^-127).
// The codes' bits are spread over the word so that few operations bring them there (perf-log run 133):
// register r's low-half magnitude sits at bits magnitude_bit(r) .. + 2 and its sign at bit sign_bit(r),
// the high half's 16 bits above, and decode_register moves them with the shifts of its table — r 0 is in
// place (one AND), r 1 one shift (the sign travels with the magnitude), r 2 and 3 a shift each for the
// magnitudes and for the signs. Word 0 is the k-tile's first group, word 1 its second, so one bf16x2
// multiply by 2^(scale - 1) per register gives value · 2^(scale - 127), exact for scale ≤ 128
// (2^(scale - 1) must be a finite bf16): pack refuses larger exponents.
#pragma once
#include <cstdint>
#include <cstring>

#include "core/rng.h"

#if defined(__CUDACC__)
#define LMX_MXFP4_FN __host__ __device__ __forceinline__
#else
#define LMX_MXFP4_FN inline
#endif

namespace lmx::ops::mxfp4 {

constexpr int kGroup = 32;           // values sharing one exponent
constexpr int kTileK = 64;           // values of one k-tile: two groups
constexpr int kTileBytes = 32;       // bytes of one (k-tile, row)
constexpr int kMaxDecodeScale = 128; // largest exponent byte the decode layout takes (2^(s-1) finite in bf16)

// The value index in the k-tile (0..63) of the low half of register m (0..7) of lane t (0..3).
LMX_MXFP4_FN int register_k(int t, int m) { return 16 * (m / 2) + 2 * t + 8 * (m % 2); }

// Where register r (0..3) of a word keeps its low half's code: the magnitude's lowest bit and the sign bit
// (the high half's are 16 above). Together the four registers use each of the word's 32 bits once.
LMX_MXFP4_FN int magnitude_bit(int r) { return r == 0 ? 6 : r == 1 ? 0 : r == 2 ? 3 : 11; }
LMX_MXFP4_FN int sign_bit(int r) { return r == 0 ? 15 : r == 1 ? 9 : r == 2 ? 10 : 14; }

// The code of value k of the k-tile (0..63) in the (k-tile, row)'s 32 bytes: which of its eight 32-bit words
// (part t's word w is word 2t + w), and the bits of its magnitude (three, from `magnitude` up) and sign.
struct CodePlace {
  int word;
  int magnitude;
  int sign;
};
LMX_MXFP4_FN CodePlace code_place(int k) {
  const int kk = k / 16, within = k % 16, high = within % 2;  // high: the register's high half
  const int t = (within % 8) / 2, m = 2 * kk + within / 8;
  const int w = m / 4, r = m % 4;
  return {2 * t + w, magnitude_bit(r) + 16 * high, sign_bit(r) + 16 * high};
}

// Word `w` (0..7) of a (k-tile, row)'s 32 bytes, little-endian.
LMX_MXFP4_FN uint32_t unit_word(const uint8_t* unit, int w) {
  return uint32_t(unit[4 * w]) | uint32_t(unit[4 * w + 1]) << 8 | uint32_t(unit[4 * w + 2]) << 16 |
         uint32_t(unit[4 * w + 3]) << 24;
}

// The 4-bit E2M1 code at `place` of a word.
LMX_MXFP4_FN int word_code(uint32_t word, CodePlace place) {
  return int((word >> place.magnitude) & 7u) | int((word >> place.sign) & 1u) << 3;
}

// Puts `code` (0..15) at value k of a (k-tile, row)'s 32 bytes, whose bits there must be zero.
inline void put_code(uint8_t* unit, int k, int code) {
  const CodePlace place = code_place(k);
  const uint32_t bits = uint32_t(code & 7) << place.magnitude | uint32_t(code >> 3 & 1) << place.sign;
  for (int b = 0; b < 4; ++b) unit[4 * place.word + b] = uint8_t(unit[4 * place.word + b] | bits >> (8 * b));
}

// The code of value k of a (k-tile, row)'s 32 bytes.
LMX_MXFP4_FN int read_code(const uint8_t* unit, int k) {
  const CodePlace place = code_place(k);
  return word_code(unit_word(unit, place.word), place);
}

// bf16x2 bits of register r (0..3) of a lane's word: both codes times 2^-126 (see the header comment).
// Called with a constant r in the decode GEMM, so each case is its own few instructions.
LMX_MXFP4_FN uint32_t decode_register(uint32_t word, int r) {
  constexpr uint32_t kMagnitudes = 0x01C001C0u, kSigns = 0x80008000u;
  switch (r) {
    case 0: return word & (kMagnitudes | kSigns);
    case 1: return (word << 6) & (kMagnitudes | kSigns);
    case 2: return ((word << 3) & kMagnitudes) | ((word << 5) & kSigns);
    default: return ((word >> 5) & kMagnitudes) | ((word << 1) & kSigns);
  }
}

// bf16x2 bits of 2^(scale - 1) in both halves; PRECOND scale <= kMaxDecodeScale.
LMX_MXFP4_FN uint32_t scale_multiplier(uint32_t scale) { return ((scale + 126u) << 7) * 0x00010001u; }

// ---- generated (dummy) experts: presets' --mxfp4-experts, the same bytes on the host and the device ----
// Unit u = (expert, k-tile, row) of the decode layout, u = (e · K/64 + kt) · N + row, takes outputs
// 5p .. 5p + 4 of the stream Rng(seed + u / kGeneratedUnits), p = u % kGeneratedUnits: its four 8-byte code
// words (the unit's 32 bytes, little-endian), then the pick of its two exponents, each scale_lo + 0, 1 or 2.
constexpr int64_t kGeneratedUnits = 4096;

struct GeneratedUnit {
  uint64_t words[4];
  uint8_t scales[2];
};

LMX_MXFP4_FN GeneratedUnit generated_unit(uint64_t seed, int64_t u, int scale_lo) {
  GeneratedUnit g;
  const uint64_t stream = seed + uint64_t(u / kGeneratedUnits), first = uint64_t(u % kGeneratedUnits) * 5;
  for (int j = 0; j < 4; ++j) g.words[j] = rng_output(stream, first + uint64_t(j));
  const uint64_t pick = rng_output(stream, first + 4);
  g.scales[0] = uint8_t(scale_lo + int(pick % 3));
  g.scales[1] = uint8_t(scale_lo + int((pick >> 8) % 3));
  return g;
}

// The 4-bit code of value k (0..63) of a unit's k-tile, from its words (little-endian: word w of the 32
// bytes is half w % 2 of words[w / 2]).
LMX_MXFP4_FN int unit_code(const uint64_t (&words)[4], int k) {
  const CodePlace place = code_place(k);
  return word_code(uint32_t(words[place.word / 2] >> (32 * (place.word % 2))), place);
}

// E2M1 `code` times 2^(scale - 127) in fp32, exact for scale <= kMaxDecodeScale: the code's bits placed as
// fp32 bits give code · 2^-126 (as decode_register's bf16 halves do), then one multiply by 2^(scale - 1).
// Rounded to bf16 it is model::dequantize_mxfp4_decode's value (exact in bf16 unless it is below 2^-126).
LMX_MXFP4_FN float code_value(int code, int scale) {
  const uint32_t value_bits = (uint32_t(code & 8) << 28) | (uint32_t(code & 7) << 22);
  const uint32_t multiplier_bits = uint32_t(scale + 126) << 23;
  float value, multiplier;
  memcpy(&value, &value_bits, 4);
  memcpy(&multiplier, &multiplier_bits, 4);
  return value * multiplier;
}

}  // namespace lmx::ops::mxfp4
