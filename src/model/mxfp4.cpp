// MXFP4 -> bf16: a 16 x 256 table of every (code, scale) result, then a parallel table lookup.
// The table is built with std::ldexp in fp32 and rounded to bf16, which is what transformers computes
// (LUT in bf16, torch.ldexp by scale - 127): every finite result is exact in bf16.
#include "model/mxfp4.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

#include "core/host_parallel.h"
#include "ops/mxfp4.h"

namespace lmx::model {
namespace {

std::array<uint16_t, 16 * 256> make_table() {
  std::array<uint16_t, 16 * 256> table{};
  for (int scale = 0; scale < 256; ++scale)
    for (int code = 0; code < 16; ++code)
      table[size_t(scale * 16 + code)] = f32_to_bf16(std::ldexp(kFp4Values[code], scale - 127)).bits;
  return table;
}

}  // namespace

bf16 mxfp4_value(uint8_t code, uint8_t scale) {
  return f32_to_bf16(std::ldexp(kFp4Values[code & 0xf], int(scale) - 127));
}

Result<OwnedTensor> dequantize_mxfp4(const Tensor& blocks, const Tensor& scales, const std::string& name) {
  if (blocks.dtype != DType::U8)
    return invalid_argument(name + ": MXFP4 blocks must be U8, found " + blocks.shape_str());
  if (scales.dtype != DType::U8 && scales.dtype != DType::F8_E8M0)
    return invalid_argument(name + ": MXFP4 scales must be U8 or F8_E8M0, found " + scales.shape_str());
  if (blocks.ndim < 2 || blocks.dim(-1) != 16)
    return invalid_argument(name + ": MXFP4 blocks must be [..., G, 16] (16 bytes = 32 FP4 values per group), found " +
                            blocks.shape_str());
  if (blocks.ndim >= kMaxDims)
    return invalid_argument(name + ": MXFP4 blocks have too many dims for the output: " + blocks.shape_str());
  bool scales_match = scales.ndim == blocks.ndim - 1;
  for (int i = 0; scales_match && i < scales.ndim; ++i) scales_match = scales.shape[i] == blocks.shape[i];
  if (!scales_match)
    return invalid_argument(name + ": MXFP4 scales must have the blocks' shape without the last dim: blocks " +
                            blocks.shape_str() + ", scales " + scales.shape_str());

  int64_t out_dims[kMaxDims];
  for (int i = 0; i < scales.ndim; ++i) out_dims[i] = scales.shape[i];
  out_dims[scales.ndim - 1] *= 32;
  OwnedTensor out;
  out.view = Tensor::with_shape(nullptr, DType::BF16, out_dims, scales.ndim);
  out.buffer = Buffer::host(out.view.nbytes());
  out.view.data = out.buffer.data();

  static const std::array<uint16_t, 16 * 256> kTable = make_table();  // immutable after first use
  const int64_t groups = scales.numel();
  const uint8_t* block_bytes = blocks.ptr<uint8_t>();   // [groups, 16]
  const uint8_t* scale_bytes = scales.ptr<uint8_t>();   // [groups]
  uint16_t* dst = out.view.ptr<uint16_t>();             // [groups, 32] bf16
  parallel_for(groups, 1 << 16, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const uint16_t* row = kTable.data() + size_t(scale_bytes[g]) * 16;
      const uint8_t* src = block_bytes + g * 16;
      uint16_t* o = dst + g * 32;
      for (int b = 0; b < 16; ++b) {
        o[2 * b] = row[src[b] & 0xf];
        o[2 * b + 1] = row[src[b] >> 4];
      }
    }
  });
  return out;
}

namespace {

namespace layout = ops::mxfp4;

// A decode-layout pair of the given sizes on the host (uninitialized).
Mxfp4Decode decode_tensors(int64_t experts, int64_t rows, int64_t k) {
  const int64_t tiles = k / layout::kTileK;
  return {OwnedTensor::host(DType::U8, {experts, tiles, rows, layout::kTileBytes}),
          OwnedTensor::host(DType::U8, {experts, tiles, rows, 2})};
}

}  // namespace

Result<Mxfp4Decode> pack_mxfp4_decode(const Tensor& blocks, const Tensor& scales, const std::string& name) {
  if (blocks.dtype != DType::U8 || blocks.ndim != 4 || blocks.dim(3) != 16)
    return invalid_argument(name + ": MXFP4 blocks must be U8 [E, N, G, 16], found " + blocks.shape_str());
  if ((scales.dtype != DType::U8 && scales.dtype != DType::F8_E8M0) || scales.ndim != 3 ||
      scales.dim(0) != blocks.dim(0) || scales.dim(1) != blocks.dim(1) || scales.dim(2) != blocks.dim(2))
    return invalid_argument(name + ": MXFP4 scales must be U8 [E, N, G] matching blocks " + blocks.shape_str() +
                            ", found " + scales.shape_str());
  const int64_t experts = blocks.dim(0), rows = blocks.dim(1), groups = blocks.dim(2);
  if (groups % 2 != 0)
    return invalid_argument(name + ": the MXFP4 decode layout needs K a multiple of 64, found K = " +
                            std::to_string(groups * layout::kGroup));
  const uint8_t* scale_bytes = scales.ptr<uint8_t>();
  for (int64_t i = 0; i < scales.numel(); ++i) {
    if (scale_bytes[i] > layout::kMaxDecodeScale) {
      const int64_t e = i / (rows * groups), r = i / groups % rows, g = i % groups;
      return invalid_argument(name + ": expert " + std::to_string(e) + ", row " + std::to_string(r) + ", group " +
                              std::to_string(g) + ": exponent byte " + std::to_string(scale_bytes[i]) +
                              " is above the decode layout's " + std::to_string(layout::kMaxDecodeScale) +
                              " (values of 2^2 and more)");
    }
  }
  const int64_t tiles = groups / 2;
  Mxfp4Decode out = decode_tensors(experts, rows, tiles * layout::kTileK);
  const uint8_t* src = blocks.ptr<uint8_t>();
  uint8_t* dst = out.blocks.view.ptr<uint8_t>();
  uint8_t* dst_scales = out.scales.view.ptr<uint8_t>();
  parallel_for(experts * rows, 256, [&](int64_t begin, int64_t end) {
    for (int64_t er = begin; er < end; ++er) {
      const int64_t e = er / rows, r = er % rows;
      for (int64_t kt = 0; kt < tiles; ++kt) {
        const uint8_t* in = src + (er * groups + 2 * kt) * 16;  // the tile's 64 codes: 32 bytes, low nibble first
        uint8_t* o = dst + ((e * tiles + kt) * rows + r) * layout::kTileBytes;
        std::fill(o, o + layout::kTileBytes, uint8_t{0});
        for (int k = 0; k < layout::kTileK; ++k) {
          layout::put_code(o, k, (in[k / 2] >> (4 * (k % 2))) & 0xf);
        }
        uint8_t* os = dst_scales + ((e * tiles + kt) * rows + r) * 2;
        os[0] = scale_bytes[er * groups + 2 * kt];
        os[1] = scale_bytes[er * groups + 2 * kt + 1];
      }
    }
  });
  return out;
}

Result<OwnedTensor> dequantize_mxfp4_decode(const Tensor& blocks, const Tensor& scales, const std::string& name) {
  if (blocks.dtype != DType::U8 || blocks.ndim != 4 || blocks.dim(3) != layout::kTileBytes)
    return invalid_argument(name + ": decode-layout blocks must be U8 [E, K/64, N, 32], found " + blocks.shape_str());
  if (scales.dtype != DType::U8 || scales.ndim != 4 || scales.dim(3) != 2 || scales.dim(0) != blocks.dim(0) ||
      scales.dim(1) != blocks.dim(1) || scales.dim(2) != blocks.dim(2))
    return invalid_argument(name + ": decode-layout scales must be U8 [E, K/64, N, 2] matching blocks " +
                            blocks.shape_str() + ", found " + scales.shape_str());
  const int64_t experts = blocks.dim(0), tiles = blocks.dim(1), rows = blocks.dim(2), k = tiles * layout::kTileK;
  OwnedTensor out = OwnedTensor::host(DType::BF16, {experts, rows, k});
  static const std::array<uint16_t, 16 * 256> kTable = make_table();
  const uint8_t* src = blocks.ptr<uint8_t>();
  const uint8_t* src_scales = scales.ptr<uint8_t>();
  uint16_t* dst = out.view.ptr<uint16_t>();
  parallel_for(experts * rows, 256, [&](int64_t begin, int64_t end) {
    for (int64_t er = begin; er < end; ++er) {
      const int64_t e = er / rows, r = er % rows;
      for (int64_t kt = 0; kt < tiles; ++kt) {
        const int64_t at = (e * tiles + kt) * rows + r;
        const uint8_t* in = src + at * layout::kTileBytes;
        uint16_t* o = dst + er * k + kt * layout::kTileK;
        for (int kk = 0; kk < layout::kTileK; ++kk) {
          o[kk] = kTable[size_t(src_scales[at * 2 + kk / layout::kGroup]) * 16 + size_t(layout::read_code(in, kk))];
        }
      }
    }
  });
  return out;
}

Mxfp4Decode generate_mxfp4_decode(int64_t experts, int64_t rows, int64_t k, uint64_t seed, int scale_lo) {
  LMX_CHECK(k % layout::kTileK == 0 && scale_lo >= 0 && scale_lo + 2 <= layout::kMaxDecodeScale);
  Mxfp4Decode out = decode_tensors(experts, rows, k);
  const int64_t tiles = k / layout::kTileK, units = experts * tiles * rows;  // (expert, k-tile, row) units
  uint8_t* blocks = out.blocks.view.ptr<uint8_t>();
  uint8_t* scales = out.scales.view.ptr<uint8_t>();
  parallel_for(units, layout::kGeneratedUnits, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const layout::GeneratedUnit g = layout::generated_unit(seed, u, scale_lo);
      std::memcpy(blocks + u * layout::kTileBytes, g.words, layout::kTileBytes);
      std::memcpy(scales + u * 2, g.scales, 2);
    }
  });
  return out;
}

}  // namespace lmx::model
