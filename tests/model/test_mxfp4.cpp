// Tests of MXFP4 dequantization against hand-computed values (FP4 code x 2^(scale-127)) and against bit
// patterns observed from transformers' convert_moe_packed_tensors (transformers 5, torch 2.x), including
// the overflow/underflow corners of the e8m0 scale; and of the decode layout (ops/mxfp4.h): packing keeps
// every value, and the CUDA decode GEMM's register arithmetic, done here on the CPU, gives exactly the
// dequantized values in mma's fragment order.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "model/mxfp4.h"
#include "ops/mxfp4.h"

namespace lmx::model {
namespace {

OwnedTensor u8(std::initializer_list<int64_t> dims, const std::vector<uint8_t>& values) {
  OwnedTensor o = OwnedTensor::host(DType::U8, dims);
  for (int64_t i = 0; i < o.view.numel(); ++i) o.view.ptr<uint8_t>()[i] = values[size_t(i) % values.size()];
  return o;
}

float at(const Tensor& t, int64_t i) { return bf16_to_f32(bf16{t.ptr<uint16_t>()[i]}); }
uint16_t bits_at(const Tensor& t, int64_t i) { return t.ptr<uint16_t>()[i]; }
float at_value(const Tensor& t, int64_t i) { return at(t, i); }

TEST(Mxfp4, ValueTable) {
  // scale 127 is 2^0: the code points themselves.
  const float expect[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
  for (int code = 0; code < 16; ++code) {
    EXPECT_EQ(bf16_to_f32(mxfp4_value(uint8_t(code), 127)), expect[code]) << code;
    EXPECT_EQ(bf16_to_f32(mxfp4_value(uint8_t(code), 130)), expect[code] * 8.0f) << code;
    EXPECT_EQ(bf16_to_f32(mxfp4_value(uint8_t(code), 125)), expect[code] * 0.25f) << code;
  }
  EXPECT_TRUE(std::signbit(bf16_to_f32(mxfp4_value(8, 127))));  // code 8 is -0
}

TEST(Mxfp4, HandComputedBlock) {
  // One expert, two rows, one group each. Row 0 scale 129 (x4), row 1 scale 124 (x1/8).
  // Bytes: 0x21 -> codes 1 (0.5) then 2 (1.0); 0xF8 -> 8 (-0) then 15 (-6); 0x7A -> 10 (-1) then 7 (6).
  std::vector<uint8_t> row(16, 0x00);
  row[0] = 0x21;
  row[1] = 0xF8;
  row[15] = 0x7A;
  std::vector<uint8_t> bytes = row;
  bytes.insert(bytes.end(), row.begin(), row.end());
  OwnedTensor blocks = u8({1, 2, 1, 16}, bytes);
  OwnedTensor scales = u8({1, 2, 1}, {129, 124});
  auto r = dequantize_mxfp4(blocks, scales, "t");
  ASSERT_TRUE(r.ok()) << r.status().message();
  const Tensor& out = r->view;
  ASSERT_EQ(out.shape_str(), "[1, 2, 32] BF16");
  EXPECT_EQ(at(out, 0), 2.0f);     // 0.5 * 4
  EXPECT_EQ(at(out, 1), 4.0f);     // 1.0 * 4
  EXPECT_EQ(at(out, 2), 0.0f);     // -0
  EXPECT_TRUE(std::signbit(at(out, 2)));
  EXPECT_EQ(at(out, 3), -24.0f);   // -6 * 4
  EXPECT_EQ(at(out, 4), 0.0f);     // zero byte
  EXPECT_EQ(at(out, 30), -4.0f);   // -1 * 4
  EXPECT_EQ(at(out, 31), 24.0f);   // 6 * 4
  EXPECT_EQ(at(out, 32 + 0), 0.0625f);  // 0.5 / 8
  EXPECT_EQ(at(out, 32 + 1), 0.125f);
  EXPECT_EQ(at(out, 32 + 3), -0.75f);
  EXPECT_EQ(at(out, 32 + 31), 0.75f);
}

TEST(Mxfp4, GroupsLandInColumnOrder) {
  // Two groups in one row: group g covers output columns [32g, 32g + 32).
  std::vector<uint8_t> bytes(32, 0x00);
  bytes[0] = 0x02;   // group 0, col 0: code 2 = 1.0
  bytes[16] = 0x30;  // group 1, col 33: code 3 = 1.5
  OwnedTensor blocks = u8({1, 1, 2, 16}, bytes);
  OwnedTensor scales = u8({1, 1, 2}, {127, 128});
  auto r = dequantize_mxfp4(blocks, scales, "t");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->view.shape_str(), "[1, 1, 64] BF16");
  EXPECT_EQ(at(r->view, 0), 1.0f);
  EXPECT_EQ(at(r->view, 32), 0.0f);
  EXPECT_EQ(at(r->view, 33), 3.0f);  // 1.5 * 2
}

// Bit patterns transformers produced for blocks [0x21, 0xF8, 0...] under scales 128, 255 and 0.
TEST(Mxfp4, MatchesTransformersBitPatterns) {
  struct Case {
    uint8_t scale;
    uint16_t bits[4];
  };
  const Case cases[] = {
      {128, {0x3F80, 0x4000, 0x8000, 0xC140}},  // 1, 2, -0, -12
      {255, {0x7F00, 0x7F80, 0x8000, 0xFF80}},  // 2^127, inf, -0, -inf (ldexp overflow)
      {0, {0x0020, 0x0040, 0x8000, 0x8140}},    // 2^-128, 2^-127, -0, -6 * 2^-127 (subnormal, exact)
  };
  for (const Case& c : cases) {
    std::vector<uint8_t> bytes(16, 0);
    bytes[0] = 0x21;
    bytes[1] = 0xF8;
    OwnedTensor blocks = u8({1, 1, 1, 16}, bytes);
    OwnedTensor scales = u8({1, 1, 1}, {c.scale});
    auto r = dequantize_mxfp4(blocks, scales, "t");
    ASSERT_TRUE(r.ok());
    for (int i = 0; i < 4; ++i) EXPECT_EQ(bits_at(r->view, i), c.bits[i]) << "scale " << int(c.scale) << " value " << i;
  }
}

TEST(Mxfp4, LargeTensorMatchesScalarPath) {
  // Enough groups for the parallel path; every (code, scale) pair appears.
  const int64_t E = 4, rows = 256, G = 90;
  std::vector<uint8_t> bytes(size_t(E * rows * G * 16));
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = uint8_t((i * 2654435761u) >> 13);
  std::vector<uint8_t> scale_bytes(size_t(E * rows * G));
  for (size_t i = 0; i < scale_bytes.size(); ++i) scale_bytes[i] = uint8_t(i * 37 + 11);
  OwnedTensor blocks = u8({E, rows, G, 16}, bytes);
  OwnedTensor scales = u8({E, rows, G}, scale_bytes);
  auto r = dequantize_mxfp4(blocks, scales, "t");
  ASSERT_TRUE(r.ok());
  ASSERT_EQ(r->view.numel(), E * rows * G * 32);
  int64_t mismatches = 0;
  for (int64_t g = 0; g < E * rows * G; ++g)
    for (int64_t j = 0; j < 32; ++j) {
      const uint8_t byte = bytes[size_t(g * 16 + j / 2)];
      const uint8_t code = j % 2 == 0 ? byte & 0xf : byte >> 4;
      if (bits_at(r->view, g * 32 + j) != mxfp4_value(code, scale_bytes[size_t(g)]).bits) ++mismatches;
    }
  EXPECT_EQ(mismatches, 0);
}

TEST(Mxfp4, Errors) {
  OwnedTensor blocks = u8({2, 3, 4, 16}, {0});
  OwnedTensor scales = u8({2, 3, 4}, {127});
  OwnedTensor wrong_scales = u8({2, 3, 5}, {127});
  auto mismatch = dequantize_mxfp4(blocks, wrong_scales, "layer.gate_up_proj_blocks");
  ASSERT_FALSE(mismatch.ok());
  EXPECT_NE(mismatch.status().message().find("layer.gate_up_proj_blocks"), std::string::npos);
  EXPECT_NE(mismatch.status().message().find("[2, 3, 4, 16] U8"), std::string::npos) << mismatch.status().message();
  EXPECT_NE(mismatch.status().message().find("[2, 3, 5] U8"), std::string::npos) << mismatch.status().message();

  OwnedTensor not_16 = u8({2, 3, 4, 8}, {0});
  auto bad_last = dequantize_mxfp4(not_16, scales, "b");
  ASSERT_FALSE(bad_last.ok());
  EXPECT_NE(bad_last.status().message().find("[..., G, 16]"), std::string::npos) << bad_last.status().message();

  OwnedTensor f32_blocks = OwnedTensor::host(DType::F32, {2, 3, 4, 16});
  auto bad_dtype = dequantize_mxfp4(f32_blocks, scales, "b");
  ASSERT_FALSE(bad_dtype.ok());
  EXPECT_NE(bad_dtype.status().message().find("must be U8"), std::string::npos) << bad_dtype.status().message();

  // F8_E8M0 scales are accepted like U8.
  OwnedTensor e8 = u8({2, 3, 4}, {127});
  e8.view.dtype = DType::F8_E8M0;
  EXPECT_TRUE(dequantize_mxfp4(blocks, e8, "b").ok());
}

// A checkpoint-form weight [E, N, G, 16] / [E, N, G] with every code and exponents in [lo, hi].
struct Checkpoint {
  OwnedTensor blocks, scales;
};
Checkpoint checkpoint(int64_t E, int64_t N, int64_t G, int lo, int hi) {
  std::vector<uint8_t> bytes(size_t(E * N * G * 16)), scale_bytes(size_t(E * N * G));
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = uint8_t((i * 2654435761u) >> 11);
  for (size_t i = 0; i < scale_bytes.size(); ++i) scale_bytes[i] = uint8_t(lo + int((i * 40503u) >> 3) % (hi - lo + 1));
  return {u8({E, N, G, 16}, bytes), u8({E, N, G}, scale_bytes)};
}

TEST(Mxfp4Decode, PackKeepsEveryValue) {
  Checkpoint c = checkpoint(3, 40, 6, 0, ops::mxfp4::kMaxDecodeScale);
  auto plain = dequantize_mxfp4(c.blocks, c.scales, "w");
  auto packed = pack_mxfp4_decode(c.blocks, c.scales, "w");
  ASSERT_TRUE(plain.ok() && packed.ok()) << packed.status().message();
  EXPECT_EQ(packed->blocks.view.shape_str(), "[3, 3, 40, 32] U8");
  EXPECT_EQ(packed->scales.view.shape_str(), "[3, 3, 40, 2] U8");
  auto back = dequantize_mxfp4_decode(packed->blocks, packed->scales, "w");
  ASSERT_TRUE(back.ok()) << back.status().message();
  ASSERT_EQ(back->view.shape_str(), plain->view.shape_str());
  for (int64_t i = 0; i < plain->view.numel(); ++i) ASSERT_EQ(bits_at(back->view, i), bits_at(plain->view, i)) << i;
}

TEST(Mxfp4Decode, CodePlacesAreAPermutation) {
  // Every bit of the 32 bytes holds one bit of one code: 64 codes × (3 magnitude bits + 1 sign bit) = 256.
  std::vector<int> seen(256, 0);
  for (int k = 0; k < ops::mxfp4::kTileK; ++k) {
    const ops::mxfp4::CodePlace p = ops::mxfp4::code_place(k);
    ASSERT_TRUE(p.word >= 0 && p.word < 8 && p.magnitude >= 0 && p.magnitude + 2 < 32 && p.sign >= 0 && p.sign < 32) << k;
    for (int b = 0; b < 3; ++b) ++seen[size_t(32 * p.word + p.magnitude + b)];
    ++seen[size_t(32 * p.word + p.sign)];
  }
  for (int n : seen) EXPECT_EQ(n, 1);
  // put_code and read_code agree, code by code, and a code's bits stay its own.
  for (int k = 0; k < ops::mxfp4::kTileK; ++k)
    for (int code = 0; code < 16; ++code) {
      uint8_t unit[ops::mxfp4::kTileBytes] = {};
      ops::mxfp4::put_code(unit, k, code);
      for (int other = 0; other < ops::mxfp4::kTileK; ++other)
        ASSERT_EQ(ops::mxfp4::read_code(unit, other), other == k ? code : 0) << "k " << k << " code " << code;
    }
}

// The device's arithmetic: lane t of a quad reads its 8 bytes, register m = 4w + r is decode_register(word w, r)
// times scale_multiplier(the group's exponent) in bf16 — here in fp32, which is exact for these products —
// and must hold the dequantized values k = register_k(t, m) (low half) and k + 1 (high half).
TEST(Mxfp4Decode, RegisterArithmeticGivesTheFragmentValues) {
  Checkpoint c = checkpoint(2, 24, 8, 1, ops::mxfp4::kMaxDecodeScale);
  auto plain = dequantize_mxfp4(c.blocks, c.scales, "w");
  auto packed = pack_mxfp4_decode(c.blocks, c.scales, "w");
  ASSERT_TRUE(plain.ok() && packed.ok());
  const int64_t E = 2, N = 24, K = 8 * 32, tiles = K / 64;
  const uint8_t* blocks = packed->blocks.view.ptr<uint8_t>();
  const uint8_t* scales = packed->scales.view.ptr<uint8_t>();
  auto half_value = [](uint32_t bits, int half) {
    const uint16_t b = uint16_t(half == 0 ? bits & 0xffffu : bits >> 16);
    return bf16_to_f32(bf16{b});
  };
  int64_t checked = 0;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t kt = 0; kt < tiles; ++kt)
      for (int64_t n = 0; n < N; ++n) {
        const int64_t at = (e * tiles + kt) * N + n;
        for (int t = 0; t < 4; ++t)
          for (int m = 0; m < 8; ++m) {
            uint32_t word;
            std::memcpy(&word, blocks + at * 32 + 8 * t + 4 * (m / 4), 4);
            const uint32_t bits = ops::mxfp4::decode_register(word, m % 4);
            const uint32_t mult = ops::mxfp4::scale_multiplier(scales[at * 2 + m / 4]);
            ASSERT_EQ(mult & 0xffffu, mult >> 16);
            for (int half = 0; half < 2; ++half) {
              const int k = ops::mxfp4::register_k(t, m) + half;
              const float got = half_value(bits, half) * half_value(mult, 0);
              const float want = at_value(plain->view, (e * N + n) * K + kt * 64 + k);
              ASSERT_EQ(got, want) << "e " << e << " kt " << kt << " n " << n << " lane " << t << " reg " << m;
              ASSERT_EQ(std::signbit(got), std::signbit(want));
              ++checked;
            }
          }
      }
  EXPECT_EQ(checked, E * tiles * N * 64);
}

TEST(Mxfp4Decode, Refusals) {
  Checkpoint odd = checkpoint(1, 4, 3, 120, 121);  // K = 96: not a multiple of 64
  auto r = pack_mxfp4_decode(odd.blocks, odd.scales, "layer.gate_up_proj_blocks");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("layer.gate_up_proj_blocks"), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("K = 96"), std::string::npos) << r.status().message();

  Checkpoint big = checkpoint(1, 4, 2, 120, 121);
  big.scales.view.ptr<uint8_t>()[5] = 130;  // expert 0, row 2, group 1
  auto s = pack_mxfp4_decode(big.blocks, big.scales, "w");
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("expert 0, row 2, group 1: exponent byte 130"), std::string::npos)
      << s.status().message();

  auto bad = dequantize_mxfp4_decode(big.blocks, big.scales, "w");  // the checkpoint form is not the layout
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("[E, K/64, N, 32]"), std::string::npos) << bad.status().message();
}

TEST(Mxfp4Decode, GeneratedWeightsAreDeterministicAndInRange) {
  Mxfp4Decode a = generate_mxfp4_decode(2, 48, 128, 7, 119), b = generate_mxfp4_decode(2, 48, 128, 7, 119);
  Mxfp4Decode other = generate_mxfp4_decode(2, 48, 128, 8, 119);
  ASSERT_EQ(a.blocks.view.nbytes(), size_t(2 * 2 * 48 * 32));
  EXPECT_EQ(std::memcmp(a.blocks.view.data, b.blocks.view.data, a.blocks.view.nbytes()), 0);
  EXPECT_EQ(std::memcmp(a.scales.view.data, b.scales.view.data, a.scales.view.nbytes()), 0);
  EXPECT_NE(std::memcmp(a.blocks.view.data, other.blocks.view.data, a.blocks.view.nbytes()), 0);
  for (int64_t i = 0; i < a.scales.view.numel(); ++i) {
    const int s = a.scales.view.ptr<uint8_t>()[i];
    EXPECT_TRUE(s >= 119 && s <= 121) << s;
  }
}

}  // namespace
}  // namespace lmx::model
