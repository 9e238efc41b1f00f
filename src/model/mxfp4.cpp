// MXFP4 -> bf16: a 16 x 256 table of every (code, scale) result, then a parallel table lookup.
// The table is built with std::ldexp in fp32 and rounded to bf16, which is what transformers computes
// (LUT in bf16, torch.ldexp by scale - 127): every finite result is exact in bf16.
#include "model/mxfp4.h"

#include <array>
#include <cmath>

#include "core/host_parallel.h"

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

}  // namespace lmx::model
