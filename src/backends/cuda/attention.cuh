// Entry points of the paged-KV attention family on cuda (contracts in ops/attention.h): kv_write scatters
// this step's k and v rows into cache pages; attention reads them back through the block table (causal,
// GQA, sliding window, sinks; prefill chunks and decode rows in one flat batch).
// Callers: tests, bench, the CUDA backend. Which kernel runs is decided in attention()'s launcher only.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "ops/attention.h"

namespace lmx::cuda {

void kv_write(const ops::KvWriteParams& p, cudaStream_t stream);

// The attention kernels. kAuto is the serving choice; tests and the bench pin one to compare them.
//  kSimple:  one warp per (token, q head), any D <= 256 (the fallback for D not in {64, 128}).
//  kFlash:   tensor-core tiles of 16 (key split), 64 or 128 (token, q head of the GQA group) rows, K/V
//            tiles of 64 keys.
//  kSplitKv: the same tiles with each row tile's keys split over several CTAs (flash-decoding) and a
//            combine kernel; needs the workspace.
enum class AttentionKernel { kAuto, kSimple, kFlash, kSplitKv };
constexpr int kAttentionMaxSplits = 16;  // a pinned kSplitKv uses as many as the workspace holds, up to this

struct AttentionLaunch {
  void* workspace = nullptr;   // device, 16-byte aligned; partial (max, sum, acc) of split-KV rows
  size_t workspace_bytes = 0;  // from attention_workspace_bytes(); fewer bytes = fewer splits (never an error)
  AttentionKernel kernel = AttentionKernel::kAuto;
  int flash_rows = 0;          // flash row tile: 0 = the launcher's choice, 16 (4 warps split each K/V tile's
                               // keys over the same rows: decode), 64 or 128 pins it (tests, bench)
  int splits = 0;              // pinned kSplitKv: 0 = as many as the workspace holds, n = min(n, that) (bench)
  int kv_stages = 0;           // K/V ring depth of 64-row flash tiles: 0 = the launcher's choice, 2 or 3
                               // (128-row tiles use 2; pinning 3 with flash_rows 128 is an error)
};

// Bytes of workspace that let any batch of up to max_tokens tokens use the most splits the launcher picks on
// its own (allocate once at start; batches above 64 tokens never split, so the figure stops growing there):
// kAttentionMaxSplits · min(max_tokens, 64) · Hq · (D + 2) f32.
size_t attention_workspace_bytes(int64_t max_tokens, int64_t q_heads, int64_t head_dim);

// BF16 q, caches and out; fp32 scores and softmax. Head dim D <= 256. No allocation, no host sync:
// capturable in a CUDA graph (after one eager call has set the kernels' shared-memory attribute).
void attention(const ops::AttentionParams& p, cudaStream_t stream, const AttentionLaunch& launch = {});

// The flash kernels' K/V loop at 64/128-row tiles: one CTA barrier per K/V tile, after its K and V landed and V
// went to fp16 (on, the default), or two (off: K first, V converted before P·V; the bench's before row). The
// key split (16-row tiles) always takes two. Process-wide.
void set_attention_one_barrier(bool on);

// The 128-row flash tiles (prefill; D 64 and 128) by warpgroup MMAs (flash_wgmma_kernel: both products on wgmma,
// P from registers; on, the default since perf-log run 116: GPT-OSS-20B T 1600 causal 164.8 → 125.7 µs, window
// 128 39.9 → 33.7, prefill 29.0 → 26.8 ms) or by mma.sync (off: the bench's before row). Two CTAs per SM at
// D 64, one at D 128. Other row tiles (decode, short chunks) are unchanged. Process-wide.
void set_attention_wgmma(bool on);

// flash_wgmma_kernel's K/V copies: each thread's block-table entries of the next tile loaded one tile ahead and
// the copies issued while Q·Kᵀ runs (on, the default), or the pages looked up and the copies issued between
// the tile's barrier and Q·Kᵀ (off: the bench's before row). The same result bit for bit. Process-wide.
void set_attention_wgmma_overlap_kv(bool on);

// The flash kernels' CTA order: row tile major with the kv heads inner (on, the default), so the longest-context
// tiles of every head start first and the short ones fill the last wave; or by head (off: head 0's shortest
// tiles start before the last head's longest). Causal prefill of one 1600-token prompt, simulated with a tile's
// time ∝ its key tiles: GPT-OSS-20B (8 kv heads, two CTAs an SM) 55 → 46 units, Qwen3-30B-A3B (4, one an SM)
// 49 → 46; measured (perf-log run 247, H100): GPT-OSS causal 103.0 → 85.8 µs, its decode window-128 layer 6.4 →
// 5.1, Qwen3 causal 100.5 → 99.5. The same result bit for bit. Process-wide.
void set_attention_heads_inner(bool on);

}  // namespace lmx::cuda
