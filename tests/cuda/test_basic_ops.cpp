// Parity of the CUDA small dense ops (backends/cuda/basic.cuh) with the CPU oracle: embedding, rms_norm,
// add, silu_mul, gather_rows. Shapes cover GPT-OSS sizes, odd sizes (scalar fallbacks), rows longer than
// one block, misaligned views and the aliasing each contract allows. Outputs are poisoned before each run.
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "backends/cpu/cpu_backend.h"
#include "backends/cuda/basic.cuh"
#include "backends/cuda/cuda_backend.h"
#include "core/rng.h"
#include "cuda_test_util.h"
#include "model/presets.h"

namespace lmx::test {
namespace {

class CudaBasicOps : public CudaTest {};

TEST_F(CudaBasicOps, Embedding) {
  struct Case { int64_t vocab, hidden, tokens; };
  // 2880: GPT-OSS H (16-byte rows); 2881 and 7: scalar path; 20000: a row over several blocks.
  for (Case c : {Case{1000, 2880, 16}, Case{37, 2881, 5}, Case{300, 64, 1}, Case{5, 7, 9}, Case{64, 20000, 3},
                 Case{10, 8, 0}}) {
    SCOPED_TRACE("V " + std::to_string(c.vocab) + " H " + std::to_string(c.hidden) + " T " + std::to_string(c.tokens));
    OwnedTensor table = random_bf16(rng(), {c.vocab, c.hidden});
    OwnedTensor ids = random_ids(rng(), c.tokens, 0, int32_t(c.vocab));
    OwnedTensor want = OwnedTensor::host(DType::F32, {c.tokens, c.hidden});
    cpu_.embedding({.table = table, .token_ids = ids, .out = want});

    OwnedTensor d_table = cuda::upload(table), d_ids = cuda::upload(ids);
    OwnedTensor d_out = poisoned(DType::BF16, {c.tokens, c.hidden});
    cuda::embedding({.table = d_table, .token_ids = d_ids, .out = d_out}, stream_);
    sync();
    EXPECT_TRUE(bitwise_equal(cuda::download(d_out), narrow(want)));
  }
}

TEST_F(CudaBasicOps, GatherRows) {
  struct Case { int64_t rows, cols, picked; int64_t offset; };
  for (Case c : {Case{2048, 2880, 16, 0}, Case{16, 2880, 16, 0}, Case{9, 2881, 4, 0}, Case{40, 2880, 7, 1},
                 Case{3, 20000, 5, 0}, Case{4, 1, 3, 0}}) {
    SCOPED_TRACE("T " + std::to_string(c.rows) + " C " + std::to_string(c.cols) + " B " + std::to_string(c.picked) +
                 " offset " + std::to_string(c.offset));
    OwnedTensor x = random_bf16(rng(), {c.rows, c.cols});
    OwnedTensor index = random_ids(rng(), c.picked, 0, int32_t(c.rows));
    OwnedTensor x32 = widen(x);
    OwnedTensor want = OwnedTensor::host(DType::F32, {c.picked, c.cols});
    cpu_.gather_rows({.x = x32, .index = index, .out = want});

    OwnedTensor d_x = upload_at_offset(x, c.offset), d_index = cuda::upload(index);
    OwnedTensor d_out = poisoned(DType::BF16, {c.picked, c.cols});
    cuda::gather_rows({.x = d_x, .index = d_index, .out = d_out}, stream_);
    sync();
    EXPECT_TRUE(bitwise_equal(cuda::download(d_out), narrow(want)));
  }
}

// The fused q|k|v product's split: GPT-OSS (4096 | 512 | 512), Qwen3 widths, odd widths (scalar path), two
// parts, an offset base (scalar path); bit-exact copies of the CPU oracle.
TEST_F(CudaBasicOps, SplitColumns) {
  struct Case { int64_t rows; std::vector<int64_t> widths; int64_t offset; };
  for (const Case& c : {Case{16, {4096, 512, 512}, 0}, Case{1600, {4096, 512, 512}, 0}, Case{3, {4096, 512, 512}, 1},
                        Case{7, {2048, 512, 512}, 0}, Case{5, {9, 3, 3}, 0}, Case{2, {64, 24}, 0}}) {
    int64_t total = 0;
    for (int64_t w : c.widths) total += w;
    SCOPED_TRACE("T " + std::to_string(c.rows) + " C " + std::to_string(total) + " parts " +
                 std::to_string(c.widths.size()) + " offset " + std::to_string(c.offset));
    OwnedTensor x = random_bf16(rng(), {c.rows, total});
    std::vector<OwnedTensor> want, got;
    ops::SplitColumnsParams cpu_p{.x = widen(x)}, cuda_p{};
    OwnedTensor d_x = upload_at_offset(x, c.offset);
    cuda_p.x = d_x.view;
    for (size_t i = 0; i < c.widths.size(); ++i) {
      want.push_back(OwnedTensor::host(DType::F32, {c.rows, c.widths[i]}));
      got.push_back(poisoned(DType::BF16, {c.rows, c.widths[i]}));
      cpu_p.parts[i] = want.back().view;
      cuda_p.parts[i] = got.back().view;
    }
    OwnedTensor x32 = widen(x);
    cpu_p.x = x32.view;
    cpu_.split_columns(cpu_p);
    cuda::split_columns(cuda_p, stream_);
    sync();
    for (size_t i = 0; i < c.widths.size(); ++i) EXPECT_TRUE(bitwise_equal(cuda::download(got[i]), narrow(want[i])));
  }
}

TEST_F(CudaBasicOps, RmsNorm) {
  enum class Out { kSeparate, kInPlace };
  struct Case { int64_t rows, cols; float eps, scale; Out out; int64_t offset; };
  // Register-resident path: 2880 (GPT-OSS hidden, 96 threads of 4 vectors), 64/128 (per-head q/k norm rows,
  // one warp), 20000 (640 threads); 40000: too long for registers, the vector loop; 2881, 7 and offset 1
  // (misaligned): the scalar loop.
  const std::vector<Case> cases = {
      {16, 2880, 1e-5f, 1.0f, Out::kSeparate, 0}, {256, 2880, 1e-6f, 30.0f, Out::kInPlace, 0},
      {200, 64, 1e-6f, 1.0f, Out::kSeparate, 0},  {33, 128, 1e-6f, 0.01f, Out::kInPlace, 0},
      {3, 2881, 1e-5f, 1.0f, Out::kSeparate, 0},  {5, 7, 1e-6f, 1.0f, Out::kSeparate, 0},
      {2, 20000, 1e-5f, 2.0f, Out::kSeparate, 0}, {3, 40000, 1e-5f, 1.0f, Out::kInPlace, 0},
      {6, 2880, 1e-5f, 1.0f, Out::kSeparate, 1},
      {0, 2880, 1e-5f, 1.0f, Out::kSeparate, 0}};
  for (const Case& c : cases) {
    SCOPED_TRACE("N " + std::to_string(c.rows) + " C " + std::to_string(c.cols) + " scale " +
                 std::to_string(c.scale) + (c.out == Out::kInPlace ? " in place" : "") + " offset " +
                 std::to_string(c.offset));
    OwnedTensor x = random_bf16(rng(), {c.rows, c.cols}, c.scale);
    OwnedTensor weight = random_bf16(rng(), {c.cols});  // signed weights, not near 1: every element matters
    OwnedTensor x32 = widen(x);
    OwnedTensor want = OwnedTensor::host(DType::F32, {c.rows, c.cols});
    cpu_.rms_norm({.x = x32, .weight = weight, .eps = c.eps, .out = want});

    OwnedTensor d_x = upload_at_offset(x, c.offset), d_weight = cuda::upload(weight);
    OwnedTensor d_out = c.out == Out::kInPlace ? d_x : poisoned(DType::BF16, {c.rows, c.cols});
    cuda::rms_norm({.x = d_x, .weight = d_weight, .eps = c.eps, .out = d_out}, stream_);
    sync();
    EXPECT_TRUE(all_close(cuda::download(d_out), want, kTolBf16Out));
  }
}

// RmsNormParams.residual: hidden += residual, then the norm of the sum, on every kernel path (resident,
// vector loop, scalar loop, misaligned); the sum and the output bit for bit as cuda::add then rms_norm,
// and the output against the CPU oracle.
TEST_F(CudaBasicOps, RmsNormWithResidual) {
  struct Case { int64_t rows, cols; int64_t offset; };
  for (const Case& c : {Case{16, 2880, 0}, Case{130, 2880, 0}, Case{4, 64, 0}, Case{3, 40000, 0}, Case{5, 7, 0},
                        Case{6, 2880, 1}, Case{0, 2880, 0}}) {
    SCOPED_TRACE("N " + std::to_string(c.rows) + " C " + std::to_string(c.cols) + " offset " +
                 std::to_string(c.offset));
    OwnedTensor x = random_bf16(rng(), {c.rows, c.cols}, 3.0f), residual = random_bf16(rng(), {c.rows, c.cols});
    OwnedTensor weight = random_bf16(rng(), {c.cols});
    OwnedTensor want_sum = widen(x), want = OwnedTensor::host(DType::F32, {c.rows, c.cols});
    cpu_.rms_norm({.x = want_sum, .weight = weight, .eps = 1e-5f, .out = want, .residual = widen(residual)});

    OwnedTensor d_weight = cuda::upload(weight);
    OwnedTensor d_x = upload_at_offset(x, c.offset), d_residual = upload_at_offset(residual, c.offset);
    OwnedTensor d_out = poisoned(DType::BF16, {c.rows, c.cols});
    cuda::rms_norm({.x = d_x, .weight = d_weight, .eps = 1e-5f, .out = d_out, .residual = d_residual}, stream_);
    OwnedTensor d_x2 = upload_at_offset(x, c.offset), d_out2 = poisoned(DType::BF16, {c.rows, c.cols});
    cuda::add({.x = d_residual, .y = d_x2}, stream_);
    cuda::rms_norm({.x = d_x2, .weight = d_weight, .eps = 1e-5f, .out = d_out2}, stream_);
    sync();
    const OwnedTensor got_sum = cuda::download(d_x), got = cuda::download(d_out);
    EXPECT_TRUE(bitwise_equal(got_sum, cuda::download(d_x2))) << "x + residual";
    EXPECT_TRUE(bitwise_equal(got, cuda::download(d_out2))) << "norm of the sum";
    EXPECT_TRUE(all_close(got_sum, want_sum, kTolBf16Out));
    EXPECT_TRUE(all_close(got, want, kTolBf16Out));
  }
}

TEST_F(CudaBasicOps, Add) {
  struct Case { int64_t rows, cols; bool y_is_x; int64_t offset; };
  for (Case c : {Case{16, 2880, false, 0}, Case{2048, 2880, false, 0}, Case{7, 13, false, 0},
                 Case{16, 2880, true, 0}, Case{5, 2880, false, 1}, Case{0, 8, false, 0}}) {
    SCOPED_TRACE("N " + std::to_string(c.rows) + " C " + std::to_string(c.cols) + (c.y_is_x ? " y is x" : "") +
                 " offset " + std::to_string(c.offset));
    OwnedTensor x = random_bf16(rng(), {c.rows, c.cols});
    OwnedTensor y = c.y_is_x ? x : random_bf16(rng(), {c.rows, c.cols}, 3.0f);
    OwnedTensor want = widen(y);
    if (c.y_is_x) {
      cpu_.add({.x = want, .y = want});  // y += y
    } else {
      cpu_.add({.x = widen(x), .y = want});
    }

    // y is the output: it holds its inputs, so it cannot be poisoned; a missed element keeps the old y,
    // which differs from old y + x by far more than the tolerance (x ~ N(0, 1)).
    OwnedTensor d_y = upload_at_offset(y, c.offset);
    OwnedTensor d_x = c.y_is_x ? d_y : upload_at_offset(x, c.offset);
    cuda::add({.x = d_x, .y = d_y}, stream_);
    sync();
    EXPECT_TRUE(all_close(cuda::download(d_y), want, kTolBf16Out));
  }
}

TEST_F(CudaBasicOps, SiluMul) {
  enum class Out { kSeparate, kGate, kUp };
  struct Case { int64_t tokens, inter; Out out; int64_t offset; };
  for (Case c : {Case{16, 2880, Out::kSeparate, 0}, Case{256, 2880, Out::kGate, 0}, Case{9, 2880, Out::kUp, 0},
                 Case{3, 1001, Out::kSeparate, 0}, Case{4, 2880, Out::kSeparate, 1}, Case{0, 16, Out::kSeparate, 0}}) {
    SCOPED_TRACE("T " + std::to_string(c.tokens) + " I " + std::to_string(c.inter) + " out " +
                 std::to_string(int(c.out)) + " offset " + std::to_string(c.offset));
    // Gates up to |20|: both silu tails (x and ~0) are exercised.
    OwnedTensor gate = random_bf16(rng(), {c.tokens, c.inter}, 6.0f);
    OwnedTensor up = random_bf16(rng(), {c.tokens, c.inter});
    OwnedTensor gate32 = widen(gate), up32 = widen(up);
    OwnedTensor want = OwnedTensor::host(DType::F32, {c.tokens, c.inter});
    cpu_.silu_mul({.gate = gate32, .up = up32, .out = want});

    OwnedTensor d_gate = upload_at_offset(gate, c.offset), d_up = upload_at_offset(up, c.offset);
    OwnedTensor d_out = c.out == Out::kGate ? d_gate
                        : c.out == Out::kUp ? d_up
                                            : poisoned(DType::BF16, {c.tokens, c.inter});
    cuda::silu_mul({.gate = d_gate, .up = d_up, .out = d_out}, stream_);
    sync();
    EXPECT_TRUE(all_close(cuda::download(d_out), want, kTolBf16Out));
  }
}

// Generated weights: the device generator equals the host's generate_weights_bf16 bit for bit, across
// chunk boundaries, odd sizes (scalar tail) and misaligned starts.
TEST_F(CudaBasicOps, GeneratedWeightsEqualTheHostGenerator) {
  for (int64_t n : {int64_t(1), int64_t(7), int64_t(8), int64_t(65536 + 3), int64_t(3 * 65536), int64_t(1) << 20}) {
    for (float stddev : {1.0f, 0.0186f}) {
      const uint64_t seed = rng().next_u64();
      SCOPED_TRACE("n " + std::to_string(n) + " stddev " + std::to_string(stddev));
      OwnedTensor want = OwnedTensor::host(DType::BF16, {n});
      generate_weights_bf16(want.view.ptr<uint16_t>(), 0, n, seed, stddev);
      OwnedTensor got = poisoned(DType::BF16, {n});
      cuda::fill_generated(got, seed, stddev, stream_);
      sync();
      EXPECT_TRUE(bitwise_equal(cuda::download(got), want));
    }
  }
}

// MXFP4 experts generated on the GPU equal the CPU backend's (the host path's bytes, tests/model), codes,
// exponents and bf16 values, over several streams and exponent ranges.
TEST_F(CudaBasicOps, GeneratedMxfp4ExpertsEqualTheCpuBackend) {
  cpu::CpuBackend host(2);
  for (const auto& [experts, rows, k] : {std::tuple{int64_t(3), int64_t(40), int64_t(128)},
                                          std::tuple{int64_t(4), int64_t(2880), int64_t(192)}}) {
    for (int scale_lo : {0, 117, 126}) {
      SCOPED_TRACE(std::to_string(experts) + " x " + std::to_string(rows) + " x " + std::to_string(k) + " scale_lo " +
                   std::to_string(scale_lo));
      const uint64_t seed = rng().next_u64();
      const OwnedTensor want_blocks = host.empty(DType::U8, {experts, k / 64, rows, 32});
      const OwnedTensor want_scales = host.empty(DType::U8, {experts, k / 64, rows, 2});
      const OwnedTensor want_values = host.empty(DType::BF16, {experts, rows, k});
      const ops::GeneratedMxfp4Params want{.weight = {.blocks = want_blocks.view, .scales = want_scales.view},
                                           .values = want_values.view,
                                           .seed = seed,
                                           .scale_lo = scale_lo};
      host.fill_generated_mxfp4(want);
      const OwnedTensor blocks = poisoned(DType::U8, {experts, k / 64, rows, 32});
      const OwnedTensor scales = poisoned(DType::U8, {experts, k / 64, rows, 2});
      const OwnedTensor values = poisoned(DType::BF16, {experts, rows, k});
      cuda::fill_generated_mxfp4({.weight = {.blocks = blocks.view, .scales = scales.view},
                                  .values = values.view,
                                  .seed = seed,
                                  .scale_lo = scale_lo},
                                 stream_);
      sync();
      EXPECT_TRUE(bitwise_equal(cuda::download(blocks), want.weight.blocks));
      EXPECT_TRUE(bitwise_equal(cuda::download(scales), want.weight.scales));
      EXPECT_TRUE(bitwise_equal(cuda::download(values), want.values));
    }
  }
  // Through the preset generator: a GPT-OSS config's MXFP4 experts generated on the GPU equal the host's.
  cuda::CudaBackend backend;
  model::ModelConfig c = model::preset_config("tiny-moe").value();
  c.moe_intermediate_size = 64;
  const model::ModelWeights on_host = model::make_random_weights(c, 5, nullptr, true).value();
  const model::ModelWeights on_device = model::make_random_weights(c, 5, &backend, true).value();
  backend.synchronize();
  for (size_t l = 0; l < on_host.layers.size(); ++l) {
    const model::LayerWeights &a = on_host.layers[l], &b = on_device.layers[l];
    for (const auto& [h, d] : {std::pair{a.gate_up, b.gate_up}, std::pair{a.down, b.down},
                               std::pair{a.gate_up_mxfp4.blocks, b.gate_up_mxfp4.blocks},
                               std::pair{a.gate_up_mxfp4.scales, b.gate_up_mxfp4.scales},
                               std::pair{a.down_mxfp4.blocks, b.down_mxfp4.blocks},
                               std::pair{a.down_mxfp4.scales, b.down_mxfp4.scales}}) {
      ASSERT_EQ(d.device, Device::kCuda);
      EXPECT_TRUE(bitwise_equal(cuda::download(d), h)) << "layer " << l << " " << h.shape_str();
    }
  }
}

// A whole preset generated on the GPU equals the host-generated preset, tensor by tensor.
TEST_F(CudaBasicOps, PresetGeneratedOnDeviceEqualsHostPreset) {
  cuda::CudaBackend backend;
  for (const char* preset : {"tiny-moe", "tiny-llama", "tiny-qwen3-moe"}) {
    SCOPED_TRACE(preset);
    Result<model::ModelWeights> host = model::make_preset_model(preset, 11);
    Result<model::ModelWeights> device = model::make_preset_model(preset, 11, 0, &backend);
    ASSERT_TRUE(host.ok() && device.ok());
    backend.synchronize();
    auto same = [&](const Tensor& h, const Tensor& d, const std::string& what) {
      ASSERT_EQ(h.defined(), d.defined()) << what;
      if (!h.defined()) return;
      ASSERT_EQ(d.device, Device::kCuda) << what;
      EXPECT_TRUE(bitwise_equal(cuda::download(d), h)) << what;
    };
    same(host->embed, device->embed, "embed");
    same(host->final_norm, device->final_norm, "final_norm");
    for (size_t l = 0; l < host->layers.size(); ++l) {
      const model::LayerWeights &a = host->layers[l], &b = device->layers[l];
      same(a.q, b.q, "q");
      same(a.o, b.o, "o");
      same(a.input_norm, b.input_norm, "input_norm");
      same(a.gate_up, b.gate_up, "gate_up");
      same(a.down, b.down, "down");
      same(a.router, b.router, "router");
      same(a.mlp_gate, b.mlp_gate, "mlp_gate");
      same(a.sinks, b.sinks, "sinks");
    }
  }
}

}  // namespace
}  // namespace lmx::test
