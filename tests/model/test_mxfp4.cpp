// Tests of MXFP4 dequantization against hand-computed values (FP4 code x 2^(scale-127)) and against bit
// patterns observed from transformers' convert_moe_packed_tensors (transformers 5, torch 2.x), including
// the overflow/underflow corners of the e8m0 scale.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "model/mxfp4.h"

namespace lmx::model {
namespace {

OwnedTensor u8(std::initializer_list<int64_t> dims, const std::vector<uint8_t>& values) {
  OwnedTensor o = OwnedTensor::host(DType::U8, dims);
  for (int64_t i = 0; i < o.view.numel(); ++i) o.view.ptr<uint8_t>()[i] = values[size_t(i) % values.size()];
  return o;
}

float at(const Tensor& t, int64_t i) { return bf16_to_f32(bf16{t.ptr<uint16_t>()[i]}); }
uint16_t bits_at(const Tensor& t, int64_t i) { return t.ptr<uint16_t>()[i]; }

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

}  // namespace
}  // namespace lmx::model
