// Parity of the CUDA paged attention (backends/cuda/attention.cuh) with the CPU oracle over flat batches
// that mix prefill chunks and decode rows: every kernel (simple, flash, split-KV, and the launcher's own
// choice with and without a workspace), GQA 1/2/8, page tables in shuffled physical order, page sizes 4/16,
// windows 0/4/128 (also with the pages behind the window freed), GPT-OSS sinks, head dims 16/64/128, long
// prefills, chunks against cached pages, decode at contexts 1..4096, sequences with no token this step.
// Cache rows no query may read hold NaN, so a kernel that reads past its keys fails; outputs and the
// split-KV workspace start poisoned. CudaAttentionWgmma: the prefill tiles by warpgroup MMAs.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "backends/cuda/attention.cuh"
#include "cuda_test_util.h"

namespace lmx::test {
namespace {

using cuda::AttentionKernel;

struct Seq {
  int context;  // keys 0 .. context-1 are in the cache after this step
  int queries;  // the last `queries` positions are this step's tokens (0: the sequence sits this step out)
};

struct Case {
  std::vector<Seq> seqs;
  int q_heads, kv_heads, head_dim, page_size, window;
  bool sinks;
  bool free_old_pages = false;  // window > 0: block-table entries wholly behind every query's window are -1
};

std::string describe(const Case& c) {
  std::string seqs;
  for (const Seq& s : c.seqs) seqs += " " + std::to_string(s.context) + "/" + std::to_string(s.queries);
  return "seqs (context/queries)" + seqs + ", Hq " + std::to_string(c.q_heads) + " Hkv " +
         std::to_string(c.kv_heads) + " D " + std::to_string(c.head_dim) + " P " + std::to_string(c.page_size) +
         " window " + std::to_string(c.window) + (c.sinks ? " sinks" : "") + (c.free_old_pages ? " freed" : "");
}

const char* kernel_name(AttentionKernel kernel) {
  switch (kernel) {
    case AttentionKernel::kAuto: return "auto";
    case AttentionKernel::kSimple: return "simple";
    case AttentionKernel::kFlash: return "flash";
    case AttentionKernel::kSplitKv: return "split-KV";
  }
  return "?";
}

// One batch on the host, its oracle result, and its device copies.
struct Batch {
  int tokens = 0;
  OwnedTensor q, k_cache, v_cache, block_table, seq_start, positions, sinks, want;
  OwnedTensor d_q, d_k, d_v, d_table, d_start, d_positions, d_sinks;
};

class CudaAttention : public CudaTest {
 protected:
  Batch make_batch(const Case& c) {
    const int B = int(c.seqs.size()), P = c.page_size, Hq = c.q_heads, Hkv = c.kv_heads, D = c.head_dim;
    Batch batch;
    int max_pages = 1, total_pages = 0;
    for (const Seq& s : c.seqs) {
      batch.tokens += s.queries;
      max_pages = std::max(max_pages, (s.context + P - 1) / P);
      total_pages += (s.context + P - 1) / P;
    }
    const int T = batch.tokens;
    const int pages = total_pages + 3;  // a few pages nobody owns
    // Physical pages in a shuffled order; block_table rows padded with -1.
    OwnedTensor order = distinct_ids(rng(), pages, pages);
    batch.block_table = OwnedTensor::host(DType::I32, {B, max_pages});
    batch.seq_start = OwnedTensor::host(DType::I32, {B + 1});
    batch.positions = OwnedTensor::host(DType::I32, {T});
    int32_t* table = batch.block_table.view.ptr<int32_t>();
    std::fill_n(table, B * max_pages, -1);
    // Cache: NaN everywhere, then random bf16 in the rows each sequence owns (keys 0 .. context-1).
    batch.k_cache = OwnedTensor::host(DType::BF16, {pages, P, Hkv, D});
    batch.v_cache = OwnedTensor::host(DType::BF16, {pages, P, Hkv, D});
    std::fill_n(batch.k_cache.view.ptr<bf16>(), batch.k_cache.view.numel(), bf16{0xffff});
    std::fill_n(batch.v_cache.view.ptr<bf16>(), batch.v_cache.view.numel(), bf16{0xffff});
    int next_page = 0, token = 0;
    for (int b = 0; b < B; ++b) {
      const Seq& s = c.seqs[size_t(b)];
      batch.seq_start.view.ptr<int32_t>()[b] = token;
      for (int page = 0; page < (s.context + P - 1) / P; ++page) {
        table[b * max_pages + page] = order.view.ptr<int32_t>()[next_page++];
      }
      for (int j = 0; j < s.context; ++j) {
        const int64_t row = int64_t(table[b * max_pages + j / P]) * P + j % P;
        for (int64_t e = 0; e < int64_t(Hkv) * D; ++e) {
          batch.k_cache.view.ptr<bf16>()[row * Hkv * D + e] = f32_to_bf16(rng().normal());
          batch.v_cache.view.ptr<bf16>()[row * Hkv * D + e] = f32_to_bf16(rng().normal());
        }
      }
      for (int i = 0; i < s.queries; ++i) batch.positions.view.ptr<int32_t>()[token++] = s.context - s.queries + i;
      if (c.free_old_pages && c.window > 0 && s.queries > 0) {
        // A page whose last key is below the first query's window start is never read: free it.
        const int first_lo = std::max(0, s.context - s.queries - c.window + 1);
        for (int page = 0; (page + 1) * P - 1 < first_lo; ++page) table[b * max_pages + page] = -1;
      }
    }
    batch.seq_start.view.ptr<int32_t>()[B] = T;
    batch.q = random_bf16(rng(), {T, Hq, D});
    batch.sinks = random_bf16(rng(), {Hq}, 2.0f);
    batch.want = OwnedTensor::host(DType::F32, {T, Hq, D});
    cpu_.attention({.q = widen(batch.q), .k_cache = widen(batch.k_cache), .v_cache = widen(batch.v_cache),
                    .block_table = batch.block_table, .seq_start = batch.seq_start, .positions = batch.positions,
                    .sinks = c.sinks ? batch.sinks.view : Tensor{}, .sliding_window = c.window,
                    .softmax_scale = 1.0f / std::sqrt(float(D)), .out = batch.want});
    batch.d_q = cuda::upload(batch.q);
    batch.d_k = cuda::upload(batch.k_cache);
    batch.d_v = cuda::upload(batch.v_cache);
    batch.d_table = cuda::upload(batch.block_table);
    batch.d_start = cuda::upload(batch.seq_start);
    batch.d_positions = cuda::upload(batch.positions);
    batch.d_sinks = cuda::upload(batch.sinks);
    return batch;
  }

  // Runs `kernel` on the batch (with a poisoned workspace when `workspace`: attention_workspace_bytes for the
  // launcher's choice, room for every split of every row when split-KV is pinned) and compares with the oracle.
  OwnedTensor expect_matches(const Case& c, const Batch& batch, AttentionKernel kernel, bool workspace,
                             int flash_rows = 0, int kv_stages = 0) {
    SCOPED_TRACE(std::string("kernel ") + kernel_name(kernel) + (workspace ? " with workspace" : "") +
                 (flash_rows ? ", row tile " + std::to_string(flash_rows) : "") +
                 (kv_stages ? ", K/V stages " + std::to_string(kv_stages) : ""));
    const int T = batch.tokens;
    OwnedTensor d_workspace;
    cuda::AttentionLaunch launch{.kernel = kernel, .flash_rows = flash_rows, .kv_stages = kv_stages};
    if (workspace) {
      const size_t bytes = kernel == AttentionKernel::kSplitKv
                               ? size_t(cuda::kAttentionMaxSplits) * T * c.q_heads * (c.head_dim + 2) * sizeof(float)
                               : cuda::attention_workspace_bytes(T, c.q_heads, c.head_dim);
      d_workspace = poisoned(DType::F32, {int64_t(bytes / sizeof(float))});
      launch.workspace = d_workspace.view.data;
      launch.workspace_bytes = bytes;
    }
    OwnedTensor d_out = poisoned(DType::BF16, {T, c.q_heads, c.head_dim});
    cuda::attention({.q = batch.d_q, .k_cache = batch.d_k, .v_cache = batch.d_v, .block_table = batch.d_table,
                     .seq_start = batch.d_start, .positions = batch.d_positions,
                     .sinks = c.sinks ? batch.d_sinks.view : Tensor{}, .sliding_window = c.window,
                     .softmax_scale = 1.0f / std::sqrt(float(c.head_dim)), .out = d_out},
                    stream_, launch);
    sync();
    OwnedTensor out = cuda::download(d_out);
    EXPECT_TRUE(all_close(out, batch.want, kTolBf16Out));
    return out;
  }

  // Every kernel that can run the case's shape (flash and split-KV with every row tile), and the launcher's
  // own choice with and without workspace.
  void expect_all_kernels_match(const Case& c) {
    SCOPED_TRACE(describe(c));
    const Batch batch = make_batch(c);
    expect_matches(c, batch, AttentionKernel::kAuto, true);
    expect_matches(c, batch, AttentionKernel::kAuto, false);
    expect_matches(c, batch, AttentionKernel::kSimple, false);
    if (c.head_dim == 64 || c.head_dim == 128) {
      for (int flash_rows : {16, 64, 128}) {  // 16: the key split (any batch shape, not only decode)
        expect_matches(c, batch, AttentionKernel::kFlash, false, flash_rows);
        expect_matches(c, batch, AttentionKernel::kSplitKv, true, flash_rows);
      }
      for (int kv_stages : {2, 3}) {  // both ring depths of the 64-row tiles
        expect_matches(c, batch, AttentionKernel::kFlash, false, 64, kv_stages);
        expect_matches(c, batch, AttentionKernel::kSplitKv, true, 64, kv_stages);
      }
      // The K/V loop with two barriers per tile (the form before set_attention_one_barrier), every row tile
      // and both ring depths.
      cuda::set_attention_one_barrier(false);
      SCOPED_TRACE("two barriers a K/V tile");
      for (int flash_rows : {16, 64, 128}) {
        expect_matches(c, batch, AttentionKernel::kFlash, false, flash_rows);
        expect_matches(c, batch, AttentionKernel::kSplitKv, true, flash_rows);
      }
      expect_matches(c, batch, AttentionKernel::kFlash, false, 64, 3);
      cuda::set_attention_one_barrier(true);
    }
  }
};

// The first cases: one of each batch shape the engine builds.
TEST_F(CudaAttention, MatchesCpu) {
  const std::vector<Case> cases = {
      {{{37, 37}, {101, 1}, {70, 20}}, 8, 2, 64, 16, 0, true},       // prefill + decode + chunk, GPT-OSS-like
      {{{37, 37}, {101, 1}, {70, 20}}, 8, 2, 64, 16, 8, true},       // the same through a window of 8
      {{{1, 1}, {2, 2}, {129, 3}}, 4, 4, 128, 16, 0, false},         // Qwen3 head dim, MHA
      {{{9, 9}, {33, 1}}, 4, 2, 16, 4, 4, true},                     // tiny presets: D 16, P 4
      {{{2000, 1}, {1500, 1}, {64, 1}, {777, 1}}, 64, 8, 64, 16, 0, true},  // decode at long context
      {{{2000, 1}, {1500, 1}}, 64, 8, 64, 16, 128, true},            // GPT-OSS sliding layers
      {{{300, 300}}, 16, 2, 64, 16, 0, false},                       // one long prefill
  };
  for (const Case& c : cases) expect_all_kernels_match(c);
}

// Head dims 16/64/128 × GQA 1/2/8 × pages 4/16 × windows 0/4/128 × sinks off/on, on one mixed batch
// (a prefill, a decode row, a chunk against cached pages, a sequence with no token this step).
TEST_F(CudaAttention, ShapeSweep) {
  for (int head_dim : {16, 64, 128}) {
    for (int group : {1, 2, 8}) {
      for (int page_size : {4, 16}) {
        for (int window : {0, 4, 128}) {
          for (bool sinks : {false, true}) {
            expect_all_kernels_match({{{37, 37}, {150, 1}, {50, 0}, {90, 21}}, 2 * group, 2, head_dim, page_size,
                                      window, sinks});
          }
        }
      }
    }
  }
}

// Long prefills (several 64-row tiles per sequence, causal diagonal on every one) and chunks of a prompt
// against the pages cached by earlier chunks, with and without a window.
TEST_F(CudaAttention, LongPrefillAndChunks) {
  const std::vector<Case> cases = {
      {{{1000, 1000}}, 8, 1, 64, 16, 0, true},
      {{{1000, 1000}}, 8, 1, 128, 16, 128, false},
      {{{1000, 1000}}, 16, 2, 64, 16, 128, true, true},
      {{{1000, 100}}, 8, 1, 64, 16, 0, true},                        // the last chunk of a prompt
      {{{530, 64}, {200, 7}, {4096, 33}}, 32, 4, 128, 16, 0, false},  // Qwen3 shapes, three chunks
      {{{530, 64}, {200, 7}, {4096, 33}}, 64, 8, 64, 16, 128, true, true},  // GPT-OSS sliding, old pages freed
      {{{700, 300}, {70, 1}}, 8, 4, 64, 4, 4, true},
  };
  for (const Case& c : cases) expect_all_kernels_match(c);
}

// Decode rows at contexts 1 .. 4096 in one batch, around the 64-key tile and page boundaries.
TEST_F(CudaAttention, DecodeContexts) {
  std::vector<Seq> seqs;
  for (int context : {1, 2, 15, 16, 17, 63, 64, 65, 127, 128, 129, 1000, 2047, 4096}) seqs.push_back({context, 1});
  const std::vector<Case> cases = {
      {seqs, 64, 8, 64, 16, 0, true},          // GPT-OSS full layers
      {seqs, 64, 8, 64, 16, 128, true, true},  // GPT-OSS sliding layers, pages behind the window freed
      {seqs, 32, 4, 128, 16, 0, false},        // Qwen3
      {seqs, 8, 8, 64, 4, 4, false},           // MHA, small pages, tiny window
      {{{4096, 1}}, 16, 2, 128, 16, 0, true},  // one sequence: all parallelism from the split
  };
  for (const Case& c : cases) expect_all_kernels_match(c);
}

// q one element past 16-byte alignment: the launcher's own choice falls back to the simple kernel.
TEST_F(CudaAttention, MisalignedQFallsBackToSimple) {
  const Case c{{{37, 37}, {101, 1}, {70, 20}}, 8, 2, 64, 16, 0, true};
  SCOPED_TRACE(describe(c));
  const Batch batch = make_batch(c);
  OwnedTensor d_q = upload_at_offset(batch.q, 1);
  OwnedTensor d_out = poisoned(DType::BF16, {batch.tokens, c.q_heads, c.head_dim});
  cuda::attention({.q = d_q, .k_cache = batch.d_k, .v_cache = batch.d_v, .block_table = batch.d_table,
                   .seq_start = batch.d_start, .positions = batch.d_positions, .sinks = batch.d_sinks,
                   .sliding_window = c.window, .softmax_scale = 1.0f / std::sqrt(float(c.head_dim)), .out = d_out},
                  stream_);
  sync();
  EXPECT_TRUE(all_close(cuda::download(d_out), batch.want, kTolBf16Out));
}

// Pinning a kernel on a shape it cannot run, or a bad knob, aborts with a message naming the problem.
TEST_F(CudaAttention, BadLaunchNamesTheProblem) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const Case tiny{{{9, 9}, {33, 1}}, 4, 2, 16, 4, 0, false};
  const Batch batch = make_batch(tiny);
  OwnedTensor d_out = poisoned(DType::BF16, {batch.tokens, tiny.q_heads, tiny.head_dim});
  const ops::AttentionParams params{.q = batch.d_q, .k_cache = batch.d_k, .v_cache = batch.d_v,
                                    .block_table = batch.d_table, .seq_start = batch.d_start,
                                    .positions = batch.d_positions, .softmax_scale = 0.25f, .out = d_out};
  EXPECT_DEATH(cuda::attention(params, stream_, {.kernel = AttentionKernel::kFlash}),
               "flash kernel needs D 64 or 128.*found D 16");
  const Case gpt_oss{{{40, 1}}, 8, 1, 64, 16, 0, false};
  const Batch decode = make_batch(gpt_oss);
  OwnedTensor d_decode_out = poisoned(DType::BF16, {decode.tokens, gpt_oss.q_heads, gpt_oss.head_dim});
  const ops::AttentionParams decode_params{.q = decode.d_q, .k_cache = decode.d_k, .v_cache = decode.d_v,
                                           .block_table = decode.d_table, .seq_start = decode.d_start,
                                           .positions = decode.d_positions, .softmax_scale = 0.125f,
                                           .out = d_decode_out};
  EXPECT_DEATH(cuda::attention(decode_params, stream_, {.kernel = AttentionKernel::kSplitKv}),
               "split-KV kernel needs a workspace of at least 4224 bytes.*found 0");
  EXPECT_DEATH(cuda::attention(decode_params, stream_, {.flash_rows = 96}),
               "AttentionLaunch.flash_rows: expected 0, 16, 64 or 128, found 96");
  EXPECT_DEATH(cuda::attention(decode_params, stream_, {.flash_rows = 128, .kv_stages = 3}),
               "AttentionLaunch.kv_stages 3 is built for 64-row tiles only, found flash_rows 128");
  EXPECT_DEATH(cuda::attention(decode_params, stream_, {.kv_stages = 4}),
               "AttentionLaunch.kv_stages: expected 0, 2 or 3, found 4");
}

// The split-KV path replayed from a CUDA graph (no allocation or host sync inside the launcher).
TEST_F(CudaAttention, SplitKvCapturesInGraph) {
  const Case c{{{2000, 1}, {1500, 1}, {64, 1}, {777, 1}}, 64, 8, 64, 16, 0, true};
  SCOPED_TRACE(describe(c));
  const Batch batch = make_batch(c);
  const size_t bytes = cuda::attention_workspace_bytes(batch.tokens, c.q_heads, c.head_dim);
  OwnedTensor d_workspace = poisoned(DType::F32, {int64_t(bytes / sizeof(float))});
  OwnedTensor d_out = poisoned(DType::BF16, {batch.tokens, c.q_heads, c.head_dim});
  const ops::AttentionParams params{.q = batch.d_q, .k_cache = batch.d_k, .v_cache = batch.d_v,
                                    .block_table = batch.d_table, .seq_start = batch.d_start,
                                    .positions = batch.d_positions, .sinks = batch.d_sinks,
                                    .sliding_window = c.window, .softmax_scale = 1.0f / std::sqrt(float(c.head_dim)),
                                    .out = d_out};
  const cuda::AttentionLaunch launch{.workspace = d_workspace.view.data, .workspace_bytes = bytes,
                                     .kernel = AttentionKernel::kSplitKv};
  cuda::attention(params, stream_, launch);  // eager first: sets the kernels' shared-memory attribute
  sync();
  cuda::fill_bytes(d_out, 0xff);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  cuda::attention(params, stream_, launch);
  ASSERT_EQ(cudaStreamEndCapture(stream_, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, stream_), cudaSuccess);
  sync();
  EXPECT_TRUE(all_close(cuda::download(d_out), batch.want, kTolBf16Out));
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
}

// flash_wgmma_kernel (set_attention_wgmma): the 128-row tiles by warpgroup MMAs, against the oracle on every
// D 64 shape above and Qwen3's D 128 — prefill, chunks against cached pages, decode rows (a tile of 8 real rows: its
// second warpgroup all padding), windows with freed pages, sinks, GQA 1/2/8, pages 4/16 — pinned (one split)
// and with the key split over CTAs (its partial triples), and through the launcher's own choice. Its own
// suite, so a device run can take it apart from the others (scripts/device-run TESTS_LATE).
class CudaAttentionWgmma : public CudaAttention {
 protected:
  void TearDown() override {
    cuda::set_attention_wgmma(true);
    cuda::set_attention_wgmma_overlap_kv(true);
    cuda::set_attention_heads_inner(true);  // the default
    CudaAttention::TearDown();
  }
  // Both forms of the 128-row tiles: warpgroup MMAs (the default) and mma.sync (the knob off).
  void expect_wgmma_matches(const Case& c) {
    const Batch batch = make_batch(c);
    for (bool wgmma : {true, false}) {
      SCOPED_TRACE(describe(c) + (wgmma ? ", 128-row tiles by wgmma" : ", 128-row tiles by mma.sync"));
      cuda::set_attention_wgmma(wgmma);
      expect_matches(c, batch, AttentionKernel::kFlash, false, 128);
      expect_matches(c, batch, AttentionKernel::kSplitKv, true, 128);
      expect_matches(c, batch, AttentionKernel::kAuto, true);
    }
    cuda::set_attention_wgmma(true);
  }
};

TEST_F(CudaAttentionWgmma, MatchesCpu) {
  const std::vector<Case> cases = {
      {{{37, 37}, {101, 1}, {70, 20}}, 8, 2, 64, 16, 0, true},
      {{{37, 37}, {101, 1}, {70, 20}}, 8, 2, 64, 16, 8, true},
      {{{300, 300}}, 16, 2, 64, 16, 0, false},
      {{{1000, 1000}}, 8, 1, 64, 16, 0, true},
      {{{1000, 1000}}, 16, 2, 64, 16, 128, true, true},
      {{{1000, 100}}, 8, 1, 64, 16, 0, true},
      {{{530, 64}, {200, 7}, {4096, 33}}, 64, 8, 64, 16, 128, true, true},
      {{{700, 300}, {70, 1}}, 8, 4, 64, 4, 4, true},
      {{{1600, 1600}}, 64, 8, 64, 16, 0, true},    // the yardstick's prompt, full layer
      {{{1600, 1600}}, 64, 8, 64, 16, 128, true},  // and sliding layer
      {{{2000, 1}, {1500, 1}, {64, 1}, {777, 1}}, 64, 8, 64, 16, 0, true},
      {{{1600, 1600}}, 32, 4, 128, 16, 0, false},                       // Qwen3-30B-A3B's prompt (D 128)
      {{{530, 64}, {200, 7}, {4096, 33}}, 32, 4, 128, 16, 0, false},    // Qwen3 chunks against cached pages
      {{{1000, 1000}}, 8, 1, 128, 16, 128, true},                       // D 128 with a window and sinks
      {{{1, 1}, {2, 2}, {129, 3}}, 4, 4, 128, 16, 0, false},            // MHA, tiny sequences
  };
  for (const Case& c : cases) expect_wgmma_matches(c);
}

TEST_F(CudaAttentionWgmma, ShapeSweep) {
  for (int head_dim : {64, 128}) {
    for (int group : {1, 2, 8}) {
      for (int page_size : {4, 16}) {
        for (int window : {0, 4, 128}) {
          for (bool sinks : {false, true}) {
            expect_wgmma_matches(
                {{{37, 37}, {150, 1}, {50, 0}, {90, 21}}, 2 * group, 2, head_dim, page_size, window, sinks});
          }
        }
      }
    }
  }
}

// set_attention_wgmma_overlap_kv moves when the K/V copies are issued (block-table entries a tile ahead, the
// copies behind Q·Kᵀ) and nothing else: the same bits as the in-order loop, pinned and split over CTAs, D 64
// and 128, page sizes 4 and 16 (a thread's rows in 16 pages a tile), windows behind freed pages, every
// tile count from 1 up; both meet the oracle.
TEST_F(CudaAttentionWgmma, OverlappedCopiesGiveTheSameBits) {
  const std::vector<Case> cases = {
      {{{37, 37}, {101, 1}, {70, 20}}, 8, 2, 64, 16, 8, true},
      {{{1000, 1000}}, 16, 2, 64, 16, 128, true, true},
      {{{700, 300}, {70, 1}}, 8, 4, 64, 4, 4, true},
      {{{1600, 1600}}, 64, 8, 64, 16, 0, true},
      {{{530, 64}, {200, 7}, {4096, 33}}, 32, 4, 128, 16, 0, false},
      {{{1000, 1000}}, 8, 1, 128, 16, 128, true},
      {{{1, 1}, {2, 2}, {129, 3}}, 4, 4, 128, 4, 0, false},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(describe(c));
    const Batch batch = make_batch(c);
    for (const bool split : {false, true}) {
      const AttentionKernel kernel = split ? AttentionKernel::kSplitKv : AttentionKernel::kFlash;
      cuda::set_attention_wgmma_overlap_kv(true);
      const OwnedTensor overlapped = expect_matches(c, batch, kernel, split, 128);
      cuda::set_attention_wgmma_overlap_kv(false);
      const OwnedTensor in_order = expect_matches(c, batch, kernel, split, 128);
      EXPECT_TRUE(bitwise_equal(overlapped, in_order)) << (split ? "split over CTAs" : "one split");
    }
  }
  cuda::set_attention_wgmma_overlap_kv(true);
}

// set_attention_heads_inner changes which CTA takes which (row tile, kv head) and nothing else: the same bits
// with the heads inner as by head, for every flash kernel (16-, 64- and 128-row tiles, by wgmma and by
// mma.sync, one split and split over CTAs), several sequences of uneven lengths (each one's longest tile
// first), GQA 1 / 4 / 8 and the yardstick's shapes; both meet the oracle.
TEST_F(CudaAttentionWgmma, HeadsInnerGivesTheSameBits) {
  const std::vector<Case> cases = {
      {{{37, 37}, {101, 1}, {70, 20}}, 8, 2, 64, 16, 8, true},
      {{{1600, 1600}}, 64, 8, 64, 16, 0, true},
      {{{530, 64}, {200, 7}, {900, 33}}, 32, 4, 128, 16, 0, false},
      {{{300, 300}, {80, 1}}, 4, 4, 128, 4, 0, false},
      {{{1, 1}, {2, 2}, {129, 3}}, 4, 4, 64, 4, 0, false},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(describe(c));
    const Batch batch = make_batch(c);
    for (const int rows : {16, 64, 128}) {
      for (const bool wgmma : {true, false}) {
        if (rows != 128 && !wgmma) continue;  // the knob only moves the 128-row tiles
        cuda::set_attention_wgmma(wgmma);
        for (const bool split : {false, true}) {
          SCOPED_TRACE("row tile " + std::to_string(rows) + (wgmma ? ", wgmma" : ", mma.sync") +
                       (split ? ", split over CTAs" : ", one split"));
          const AttentionKernel kernel = split ? AttentionKernel::kSplitKv : AttentionKernel::kFlash;
          cuda::set_attention_heads_inner(false);
          const OwnedTensor by_head = expect_matches(c, batch, kernel, split, rows);
          cuda::set_attention_heads_inner(true);
          const OwnedTensor heads_inner = expect_matches(c, batch, kernel, split, rows);
          EXPECT_TRUE(bitwise_equal(by_head, heads_inner));
        }
      }
    }
    cuda::set_attention_heads_inner(true);
    expect_matches(c, batch, AttentionKernel::kAuto, true);
  }
  cuda::set_attention_wgmma(true);
}

// The knob switches kernels and nothing else: off, the mma.sync kernel gives the same batch bit for bit before
// and after a run by wgmma; both meet the oracle.
TEST_F(CudaAttentionWgmma, KnobSwitchesKernels) {
  const Case c{{{300, 300}, {70, 20}}, 16, 2, 64, 16, 0, true};
  SCOPED_TRACE(describe(c));
  const Batch batch = make_batch(c);
  auto run = [&] {
    OwnedTensor d_out = poisoned(DType::BF16, {batch.tokens, c.q_heads, c.head_dim});
    cuda::attention({.q = batch.d_q, .k_cache = batch.d_k, .v_cache = batch.d_v, .block_table = batch.d_table,
                     .seq_start = batch.d_start, .positions = batch.d_positions, .sinks = batch.d_sinks,
                     .sliding_window = c.window, .softmax_scale = 0.125f, .out = d_out},
                    stream_, {.kernel = AttentionKernel::kFlash, .flash_rows = 128});
    sync();
    return cuda::download(d_out);
  };
  cuda::set_attention_wgmma(false);
  const OwnedTensor before = run();
  cuda::set_attention_wgmma(true);
  const OwnedTensor wgmma = run();
  cuda::set_attention_wgmma(false);
  const OwnedTensor after = run();
  EXPECT_TRUE(bitwise_equal(before, after));
  EXPECT_TRUE(all_close(before, batch.want, kTolBf16Out));
  EXPECT_TRUE(all_close(wgmma, batch.want, kTolBf16Out));
}

}  // namespace
}  // namespace lmx::test
