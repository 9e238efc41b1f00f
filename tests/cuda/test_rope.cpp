// Parity of the CUDA RoPE kernel (backends/cuda/rope.cuh) with the CPU oracle: GPT-OSS and Qwen3 head
// shapes (16-byte path), odd half-dims and a misaligned view (scalar path), positions up to 128k (angles
// far outside the fast sincos range), YaRN's attention scaling and a real YaRN table from make_rope_table;
// rope_kv_write, and rope_kv_write_from_qkv (the q|k|v split folded in), against the ops they fuse.
#include <array>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "backends/cuda/attention.cuh"
#include "backends/cuda/basic.cuh"
#include "backends/cuda/rope.cuh"
#include "cuda_test_util.h"
#include "ops/rope.h"

namespace lmx::test {
namespace {

class CudaRope : public CudaTest {};

TEST_F(CudaRope, MatchesCpu) {
  struct Case { int64_t tokens, q_heads, kv_heads, head_dim; bool yarn; int64_t offset; };
  // (64, 8, 64): GPT-OSS; (32, 4, 128): Qwen3-30B-A3B; D 6 and 18: D/2 = 3, 9 (scalar); D 2: one pair.
  const std::vector<Case> cases = {{16, 64, 8, 64, true, 0},   {300, 64, 8, 64, true, 0}, {7, 32, 4, 128, false, 0},
                                   {5, 4, 2, 6, false, 0},     {3, 3, 1, 18, true, 0},    {2, 1, 1, 2, false, 0},
                                   {9, 64, 8, 64, false, 1},   {0, 8, 2, 64, false, 0}};
  for (const Case& c : cases) {
    SCOPED_TRACE("T " + std::to_string(c.tokens) + " Hq " + std::to_string(c.q_heads) + " Hkv " +
                 std::to_string(c.kv_heads) + " D " + std::to_string(c.head_dim) + (c.yarn ? " yarn" : "") +
                 " offset " + std::to_string(c.offset));
    ops::RopeScaling scaling;
    scaling.theta = 150000.0;
    if (c.yarn) {  // GPT-OSS's rope_scaling
      scaling.type = ops::RopeScaling::Type::kYarn;
      scaling.factor = 32.0;
      scaling.original_max_position = 4096;
      scaling.truncate = false;
    }
    const ops::RopeTable table = ops::make_rope_table(scaling, int(c.head_dim));
    OwnedTensor inv_freq = OwnedTensor::host(DType::F32, {c.head_dim / 2});
    std::copy(table.inv_freq.begin(), table.inv_freq.end(), inv_freq.view.ptr<float>());
    OwnedTensor positions = random_ids(rng(), c.tokens, 0, 131072);
    if (c.tokens > 0) positions.view.ptr<int32_t>()[0] = 0;  // position 0 (no rotation), always
    OwnedTensor q = random_bf16(rng(), {c.tokens, c.q_heads, c.head_dim});
    OwnedTensor k = random_bf16(rng(), {c.tokens, c.kv_heads, c.head_dim}, 4.0f);

    OwnedTensor want_q = widen(q), want_k = widen(k);
    cpu_.rope({.q = want_q, .k = want_k, .positions = positions, .inv_freq = inv_freq,
               .attention_scaling = table.attention_scaling});

    // In place: q and k are their own outputs, so they cannot be poisoned; an element the kernel skips keeps
    // its input, which the rotation (random positions) moves far beyond the tolerance.
    OwnedTensor d_q = upload_at_offset(q, c.offset), d_k = upload_at_offset(k, c.offset);
    OwnedTensor d_positions = cuda::upload(positions), d_inv_freq = cuda::upload(inv_freq);
    cuda::rope({.q = d_q, .k = d_k, .positions = d_positions, .inv_freq = d_inv_freq,
                .attention_scaling = table.attention_scaling},
               stream_);
    sync();
    EXPECT_TRUE(all_close(cuda::download(d_q), want_q, kTolBf16Out)) << "q";
    EXPECT_TRUE(all_close(cuda::download(d_k), want_k, kTolBf16Out)) << "k";
  }
}

// rope_kv_write against rope then kv_write on the device, bitwise (the same math): q and k in place, the
// rotated k and the v rows in the caches, rows of index -1 not written (the caches are poisoned), on the
// 16-byte path (GPT-OSS, Qwen3 heads) and the scalar one (odd half-dim).
TEST_F(CudaRope, RopeKvWriteMatchesTheTwoOps) {
  struct Case { int64_t tokens, q_heads, kv_heads, head_dim; };
  for (const Case& c : {Case{16, 64, 8, 64}, Case{37, 32, 4, 128}, Case{5, 4, 2, 6}}) {
    SCOPED_TRACE("T " + std::to_string(c.tokens) + " Hq " + std::to_string(c.q_heads) + " Hkv " +
                 std::to_string(c.kv_heads) + " D " + std::to_string(c.head_dim));
    const int64_t rows = 4 * c.tokens;  // cache rows; each token writes a distinct one, or none
    OwnedTensor inv_freq = OwnedTensor::host(DType::F32, {c.head_dim / 2});
    for (int64_t i = 0; i < c.head_dim / 2; ++i) inv_freq.view.ptr<float>()[i] = std::pow(10000.0f, -2.0f * i / c.head_dim);
    OwnedTensor positions = random_ids(rng(), c.tokens, 0, 4096);
    OwnedTensor index = OwnedTensor::host(DType::I32, {c.tokens});
    for (int64_t t = 0; t < c.tokens; ++t) index.view.ptr<int32_t>()[t] = t % 5 == 3 ? -1 : int32_t(4 * t + t % 4);
    const OwnedTensor q = random_bf16(rng(), {c.tokens, c.q_heads, c.head_dim});
    const OwnedTensor k = random_bf16(rng(), {c.tokens, c.kv_heads, c.head_dim});
    const OwnedTensor v = random_bf16(rng(), {c.tokens, c.kv_heads, c.head_dim});
    OwnedTensor d_positions = cuda::upload(positions), d_inv_freq = cuda::upload(inv_freq), d_index = cuda::upload(index);
    OwnedTensor d_v = cuda::upload(v);
    auto run = [&](bool fused) {
      std::vector<OwnedTensor> out;
      out.push_back(cuda::upload(q));
      out.push_back(cuda::upload(k));
      out.push_back(poisoned(DType::BF16, {rows, 1, c.kv_heads, c.head_dim}));
      out.push_back(poisoned(DType::BF16, {rows, 1, c.kv_heads, c.head_dim}));
      const ops::RopeParams r{.q = out[0], .k = out[1], .positions = d_positions, .inv_freq = d_inv_freq};
      const ops::KvWriteParams w{.k = out[1], .v = d_v, .kv_write_index = d_index, .k_cache = out[2], .v_cache = out[3]};
      if (fused) {
        cuda::rope_kv_write(r, w, stream_);
      } else {
        cuda::rope(r, stream_);
        cuda::kv_write(w, stream_);
      }
      sync();
      return out;
    };
    const std::vector<OwnedTensor> fused = run(true), separate = run(false);
    const char* names[] = {"q", "k", "k_cache", "v_cache"};
    for (int i = 0; i < 4; ++i) {
      EXPECT_TRUE(bitwise_equal(cuda::download(fused[size_t(i)]), cuda::download(separate[size_t(i)]))) << names[i];
    }
  }
}

// rope_kv_write_from_qkv (q|k|v's split and its bias folded into the rotation) against split_columns with the
// bias then rope_kv_write, bitwise: q, k, v and both caches (rows of index -1 not written; everything starts
// poisoned). GPT-OSS's heads with a bias, Qwen3's with the QK-norm and without a bias, the scalar path (odd
// half-dim) with a bias; a QK-norm the rotation cannot fuse (D 96) is declined, enqueuing nothing.
TEST_F(CudaRope, RopeKvWriteFromQkvMatchesSplitThenRopeKvWrite) {
  struct Case { int64_t tokens, q_heads, kv_heads, head_dim; bool bias, qk_norm, fused; };
  for (const Case& c : {Case{16, 64, 8, 64, true, false, true}, Case{37, 32, 4, 128, false, true, true},
                        Case{300, 64, 8, 64, true, false, true}, Case{5, 4, 2, 6, true, false, true},
                        Case{3, 4, 2, 96, true, true, false}}) {
    SCOPED_TRACE("T " + std::to_string(c.tokens) + " Hq " + std::to_string(c.q_heads) + " Hkv " +
                 std::to_string(c.kv_heads) + " D " + std::to_string(c.head_dim) + (c.bias ? " bias" : "") +
                 (c.qk_norm ? " qk-norm" : ""));
    const int64_t rows = 4 * c.tokens, width = (c.q_heads + 2 * c.kv_heads) * c.head_dim;
    OwnedTensor inv_freq = OwnedTensor::host(DType::F32, {c.head_dim / 2});
    for (int64_t i = 0; i < c.head_dim / 2; ++i) inv_freq.view.ptr<float>()[i] = std::pow(10000.0f, -2.0f * i / c.head_dim);
    OwnedTensor index = OwnedTensor::host(DType::I32, {c.tokens});
    for (int64_t t = 0; t < c.tokens; ++t) index.view.ptr<int32_t>()[t] = t % 5 == 3 ? -1 : int32_t(4 * t + t % 4);
    const OwnedTensor d_positions = cuda::upload(random_ids(rng(), c.tokens, 0, 4096));
    const OwnedTensor d_inv_freq = cuda::upload(inv_freq), d_index = cuda::upload(index);
    const OwnedTensor d_qkv = cuda::upload(random_bf16(rng(), {c.tokens, width}, 2.0f));
    const OwnedTensor d_bias = cuda::upload(random_bf16(rng(), {width}, 0.5f));
    const OwnedTensor d_q_norm = cuda::upload(random_bf16(rng(), {c.head_dim}));
    const OwnedTensor d_k_norm = cuda::upload(random_bf16(rng(), {c.head_dim}));
    const Tensor bias = c.bias ? d_bias.view : Tensor();
    auto run = [&](bool from_qkv) {
      std::vector<OwnedTensor> out;
      out.push_back(poisoned(DType::BF16, {c.tokens, c.q_heads, c.head_dim}));
      out.push_back(poisoned(DType::BF16, {c.tokens, c.kv_heads, c.head_dim}));
      out.push_back(poisoned(DType::BF16, {c.tokens, c.kv_heads, c.head_dim}));
      out.push_back(poisoned(DType::BF16, {rows, 1, c.kv_heads, c.head_dim}));
      out.push_back(poisoned(DType::BF16, {rows, 1, c.kv_heads, c.head_dim}));
      ops::RopeParams r{.q = out[0], .k = out[1], .positions = d_positions, .inv_freq = d_inv_freq};
      if (c.qk_norm) {
        r.q_norm = d_q_norm;
        r.k_norm = d_k_norm;
      }
      const ops::KvWriteParams w{.k = out[1], .v = out[2], .kv_write_index = d_index, .k_cache = out[3], .v_cache = out[4]};
      bool fused = false;
      if (from_qkv) {
        fused = cuda::rope_kv_write_from_qkv(r, w, d_qkv, bias, stream_);
      } else {
        const std::array<Tensor, 3> parts = {out[0].view.reshape({c.tokens, c.q_heads * c.head_dim}),
                                             out[1].view.reshape({c.tokens, c.kv_heads * c.head_dim}),
                                             out[2].view.reshape({c.tokens, c.kv_heads * c.head_dim})};
        cuda::split_columns({.x = d_qkv, .parts = parts}, stream_, bias);
        cuda::rope_kv_write(r, w, stream_);
      }
      sync();
      return std::pair{fused, std::move(out)};
    };
    const auto [fused, from_qkv] = run(true);
    EXPECT_EQ(fused, c.fused);
    if (!fused) {  // declined: nothing written
      EXPECT_TRUE(bitwise_equal(cuda::download(from_qkv[0]),
                                cuda::download(poisoned(DType::BF16, {c.tokens, c.q_heads, c.head_dim}))))
          << "q after a declined call";
      EXPECT_TRUE(bitwise_equal(cuda::download(from_qkv[2]),
                                cuda::download(poisoned(DType::BF16, {c.tokens, c.kv_heads, c.head_dim}))))
          << "v after a declined call";
      continue;
    }
    const auto [unused, split] = run(false);
    const char* names[] = {"q", "k", "v", "k_cache", "v_cache"};
    for (int i = 0; i < 5; ++i) {
      EXPECT_TRUE(bitwise_equal(cuda::download(from_qkv[size_t(i)]), cuda::download(split[size_t(i)]))) << names[i];
    }
  }
}

// The QK-norm inside the rotation (RopeParams::q_norm / k_norm, Qwen3) against the CPU oracle's rms_norm
// on every head followed by its rope: the fused 16-byte path (D 128: 8 threads a head, D 64: 4, D 256: 16)
// and the rms_norm-first fallbacks (D 96: 6 threads a head, not a power of two; D 6: scalar path); and
// rope_kv_write with it against rope then kv_write, whose k rows must reach the cache normalized too.
TEST_F(CudaRope, QkNormMatchesCpu) {
  struct Case { int64_t tokens, q_heads, kv_heads, head_dim; };
  for (const Case& c : {Case{16, 32, 4, 128}, Case{5, 8, 2, 64}, Case{3, 4, 2, 256}, Case{4, 4, 2, 96},
                        Case{3, 2, 1, 6}, Case{1, 32, 4, 128}}) {
    SCOPED_TRACE("T " + std::to_string(c.tokens) + " Hq " + std::to_string(c.q_heads) + " Hkv " +
                 std::to_string(c.kv_heads) + " D " + std::to_string(c.head_dim));
    const ops::RopeTable table = ops::make_rope_table({.theta = 1000000.0}, int(c.head_dim));
    OwnedTensor inv_freq = OwnedTensor::host(DType::F32, {c.head_dim / 2});
    std::copy(table.inv_freq.begin(), table.inv_freq.end(), inv_freq.view.ptr<float>());
    const OwnedTensor positions = random_ids(rng(), c.tokens, 0, 40960);
    const OwnedTensor q = random_bf16(rng(), {c.tokens, c.q_heads, c.head_dim}, 3.0f);
    const OwnedTensor k = random_bf16(rng(), {c.tokens, c.kv_heads, c.head_dim}, 8.0f);
    const OwnedTensor q_norm = random_bf16(rng(), {c.head_dim}), k_norm = random_bf16(rng(), {c.head_dim});
    constexpr float kEps = 1e-6f;

    OwnedTensor want_q = widen(q), want_k = widen(k);
    cpu_.rope({.q = want_q, .k = want_k, .positions = positions, .inv_freq = inv_freq, .q_norm = q_norm,
               .k_norm = k_norm, .norm_eps = kEps});
    // The oracle's own composition, spelled out: rms_norm on the [T·H, D] views, then the rotation alone.
    OwnedTensor two_q = widen(q), two_k = widen(k);
    Tensor qh = two_q.view.reshape({c.tokens * c.q_heads, c.head_dim}), kh = two_k.view.reshape({c.tokens * c.kv_heads, c.head_dim});
    cpu_.rms_norm({.x = qh, .weight = q_norm, .eps = kEps, .out = qh});
    cpu_.rms_norm({.x = kh, .weight = k_norm, .eps = kEps, .out = kh});
    cpu_.rope({.q = two_q, .k = two_k, .positions = positions, .inv_freq = inv_freq});
    EXPECT_TRUE(bitwise_equal(want_q, two_q)) << "cpu q";
    EXPECT_TRUE(bitwise_equal(want_k, two_k)) << "cpu k";
    // The device's reference: its activations are bf16, so the normalized heads are rounded to bf16 before
    // the rotation (as the unfused rms_norm kernel stores them); the CPU oracle keeps them in f32.
    want_q = widen(q), want_k = widen(k);
    qh = want_q.view.reshape({c.tokens * c.q_heads, c.head_dim}), kh = want_k.view.reshape({c.tokens * c.kv_heads, c.head_dim});
    cpu_.rms_norm({.x = qh, .weight = q_norm, .eps = kEps, .out = qh});
    cpu_.rms_norm({.x = kh, .weight = k_norm, .eps = kEps, .out = kh});
    for (OwnedTensor* t : {&want_q, &want_k}) {
      for (int64_t i = 0; i < t->view.numel(); ++i) t->view.ptr<float>()[i] = round_bf16(t->view.ptr<float>()[i]);
    }
    cpu_.rope({.q = want_q, .k = want_k, .positions = positions, .inv_freq = inv_freq});

    OwnedTensor d_positions = cuda::upload(positions), d_inv_freq = cuda::upload(inv_freq);
    OwnedTensor d_q_norm = cuda::upload(q_norm), d_k_norm = cuda::upload(k_norm);
    OwnedTensor d_q = cuda::upload(q), d_k = cuda::upload(k);
    const ops::RopeParams r{.q = d_q, .k = d_k, .positions = d_positions, .inv_freq = d_inv_freq, .q_norm = d_q_norm,
                            .k_norm = d_k_norm, .norm_eps = kEps};
    cuda::rope(r, stream_);
    sync();
    const OwnedTensor got_q = cuda::download(d_q), got_k = cuda::download(d_k);
    EXPECT_TRUE(all_close(got_q, want_q, kTolBf16Out)) << "q";
    EXPECT_TRUE(all_close(got_k, want_k, kTolBf16Out)) << "k";

    // rope_kv_write: q and k as cuda::rope left them (the same kernel path), k's rows also in the cache.
    const int64_t rows = c.tokens;
    OwnedTensor index = OwnedTensor::host(DType::I32, {c.tokens});
    for (int64_t t = 0; t < c.tokens; ++t) index.view.ptr<int32_t>()[t] = int32_t(t);
    OwnedTensor d_index = cuda::upload(index), d_v = cuda::upload(random_bf16(rng(), {c.tokens, c.kv_heads, c.head_dim}));
    OwnedTensor f_q = cuda::upload(q), f_k = cuda::upload(k);
    OwnedTensor k_cache = poisoned(DType::BF16, {rows, 1, c.kv_heads, c.head_dim});
    OwnedTensor v_cache = poisoned(DType::BF16, {rows, 1, c.kv_heads, c.head_dim});
    ops::RopeParams fused = r;
    fused.q = f_q;
    fused.k = f_k;
    cuda::rope_kv_write(fused, {.k = f_k, .v = d_v, .kv_write_index = d_index, .k_cache = k_cache, .v_cache = v_cache},
                        stream_);
    sync();
    EXPECT_TRUE(bitwise_equal(cuda::download(f_q), got_q)) << "rope_kv_write q";
    EXPECT_TRUE(bitwise_equal(cuda::download(f_k), got_k)) << "rope_kv_write k";
    EXPECT_TRUE(bitwise_equal(cuda::download(k_cache).view.reshape({c.tokens, c.kv_heads, c.head_dim}), got_k.view))
        << "k_cache";
  }
}

}  // namespace
}  // namespace lmx::test
