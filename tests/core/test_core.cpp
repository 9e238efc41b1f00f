// core: bf16/fp16 conversions (round-to-nearest-even, specials), Tensor views, Result/Status.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "core/dtype.h"
#include "core/rng.h"
#include "core/tensor.h"

namespace lmx {
namespace {

TEST(DType, Bf16RoundsToNearestEven) {
  EXPECT_EQ(f32_to_bf16(1.0f).bits, 0x3f80);
  // 1 + 2^-8 is exactly halfway between bf16 1.0 and 1 + 2^-7: ties to even (1.0).
  EXPECT_EQ(f32_to_bf16(1.0f + std::ldexp(1.0f, -8)).bits, 0x3f80);
  // 1 + 3*2^-8 is halfway between 1+2^-7 (odd mantissa) and 1+2^-6: rounds up to even.
  EXPECT_EQ(f32_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)).bits, 0x3f82);
  EXPECT_EQ(f32_to_bf16(-2.5f).bits, 0xc020);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isinf(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::infinity()))));
  Rng rng(1);
  for (int i = 0; i < 1000; ++i) {
    float x = rng.normal() * 100.0f;
    float r = round_bf16(x);
    EXPECT_LE(std::fabs(r - x), std::fabs(x) * std::ldexp(1.0f, -8));
    EXPECT_EQ(round_bf16(r), r);
  }
}

// rng_output reaches output n of Rng(seed) directly (the device generators rely on it).
TEST(Rng, OutputReachesAnyStepOfTheStream) {
  for (uint64_t seed : {uint64_t(0), uint64_t(7), ~uint64_t(0)}) {
    Rng rng(seed);
    for (uint64_t n = 0; n < 5000; ++n) ASSERT_EQ(rng_output(seed, n), rng.next_u64()) << seed << " " << n;
  }
}

TEST(DType, F16RoundTripAndSpecials) {
  EXPECT_EQ(f32_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(f32_to_f16(-2.0f), 0xc000);
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(70000.0f), 0x7c00);           // overflow to inf
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -24)), 0x0001);
  for (uint32_t h = 0; h < 0x7c00; ++h) {  // every finite positive half survives the round trip
    ASSERT_EQ(f32_to_f16(f16_to_f32(uint16_t(h))), h) << h;
    ASSERT_EQ(f32_to_f16(f16_to_f32(uint16_t(h | 0x8000))), h | 0x8000) << h;
  }
}

TEST(DType, Names) {
  DType d;
  ASSERT_TRUE(dtype_from_name("BF16", &d));
  EXPECT_EQ(d, DType::BF16);
  EXPECT_FALSE(dtype_from_name("bf16x", &d));
  EXPECT_EQ(dtype_name(DType::F8_E8M0), "F8_E8M0");
  EXPECT_EQ(dtype_size(DType::I64), 8u);
}

TEST(Tensor, RowsReshapeAndChecks) {
  OwnedTensor t = OwnedTensor::host(DType::F32, {4, 3});
  for (int i = 0; i < 12; ++i) t.view.ptr<float>()[i] = float(i);
  EXPECT_EQ(t.view.row(2).ptr<float>()[1], 7.0f);
  Tensor r = t.view.rows(1, 3);
  EXPECT_EQ(r.dim(0), 2);
  EXPECT_EQ(r.ptr<float>()[0], 3.0f);
  EXPECT_EQ(t.view.reshape({2, 6}).dim(1), 6);
  EXPECT_TRUE(expect_tensor(t.view, "x", DType::F32, {4, -1}).ok());
  Status s = expect_tensor(t.view, "x", DType::BF16, {4, 3});
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.message(), "x: expected [4, 3] BF16, found [4, 3] F32");
}

TEST(Result, CarriesValueOrStatus) {
  Result<int> ok = 3;
  EXPECT_TRUE(ok.ok());
  EXPECT_EQ(*ok, 3);
  Result<int> bad = invalid_argument("nope");
  EXPECT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().with_context("ctx").message(), "ctx: nope");
}

}  // namespace
}  // namespace lmx
