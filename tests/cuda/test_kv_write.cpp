// Parity of the CUDA kv_write kernel (backends/cuda/attention.cuh) with the CPU oracle: k and v rows
// scattered into cache pages at distinct random rows. The caches start poisoned, so the whole cache is
// compared bit for bit: written rows must hold k/v exactly, every other row must still be poison.
#include <cstdint>
#include <vector>

#include "backends/cuda/attention.cuh"
#include "cuda_test_util.h"

namespace lmx::test {
namespace {

class CudaKvWrite : public CudaTest {};

// The host image of a device cache poisoned with 0xff bytes, as F32 for the CPU oracle: every bf16 0xffff
// widens to the F32 NaN 0xffff0000 and narrows back to 0xffff, so narrow(oracle) is the exact expectation.
OwnedTensor poisoned_host_f32(std::initializer_list<int64_t> dims) {
  OwnedTensor t = OwnedTensor::host(DType::F32, dims);
  for (int64_t i = 0; i < t.view.numel(); ++i) t.view.ptr<float>()[i] = bf16_to_f32(bf16{0xffff});
  return t;
}

TEST_F(CudaKvWrite, MatchesCpu) {
  struct Case { int64_t tokens, kv_heads, head_dim, pages, page_size; int64_t offset; };
  // (8, 64): GPT-OSS rows of 1 KB; (4, 128): Qwen3; (3, 5): 30-byte rows (scalar); (1, 8): 16-byte rows;
  // offset 1: misaligned k/v (scalar).
  const std::vector<Case> cases = {{16, 8, 64, 64, 16, 0}, {2048, 8, 64, 256, 16, 0}, {7, 4, 128, 4, 16, 0},
                                   {5, 3, 5, 4, 4, 0},     {300, 1, 8, 40, 16, 0},    {6, 8, 64, 2, 16, 1},
                                   {0, 8, 64, 2, 16, 0}};
  for (const Case& c : cases) {
    SCOPED_TRACE("T " + std::to_string(c.tokens) + " Hkv " + std::to_string(c.kv_heads) + " D " +
                 std::to_string(c.head_dim) + " pages " + std::to_string(c.pages) + " P " +
                 std::to_string(c.page_size) + " offset " + std::to_string(c.offset));
    OwnedTensor k = random_bf16(rng(), {c.tokens, c.kv_heads, c.head_dim});
    OwnedTensor v = random_bf16(rng(), {c.tokens, c.kv_heads, c.head_dim});
    OwnedTensor index = distinct_ids(rng(), c.tokens, int32_t(c.pages * c.page_size));
    // Every third row a padding row (-1): written nowhere, so its cache rows keep the poison.
    for (int64_t t = 1; t < c.tokens; t += 3) index.view.ptr<int32_t>()[t] = -1;

    OwnedTensor want_k = poisoned_host_f32({c.pages, c.page_size, c.kv_heads, c.head_dim});
    OwnedTensor want_v = poisoned_host_f32({c.pages, c.page_size, c.kv_heads, c.head_dim});
    cpu_.kv_write({.k = widen(k), .v = widen(v), .kv_write_index = index, .k_cache = want_k, .v_cache = want_v});

    OwnedTensor d_k = upload_at_offset(k, c.offset), d_v = upload_at_offset(v, c.offset);
    OwnedTensor d_index = cuda::upload(index);
    OwnedTensor d_k_cache = poisoned(DType::BF16, {c.pages, c.page_size, c.kv_heads, c.head_dim});
    OwnedTensor d_v_cache = poisoned(DType::BF16, {c.pages, c.page_size, c.kv_heads, c.head_dim});
    cuda::kv_write({.k = d_k, .v = d_v, .kv_write_index = d_index, .k_cache = d_k_cache, .v_cache = d_v_cache},
                   stream_);
    sync();
    EXPECT_TRUE(bitwise_equal(cuda::download(d_k_cache), narrow(want_k))) << "k_cache";
    EXPECT_TRUE(bitwise_equal(cuda::download(d_v_cache), narrow(want_v))) << "v_cache";
  }
}

}  // namespace
}  // namespace lmx::test
