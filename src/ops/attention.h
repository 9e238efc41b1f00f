// Paged-KV attention contracts: writing this step's k/v into cache pages, and causal attention of every
// batch token over its sequence's pages (GQA, optional sliding window, optional GPT-OSS sinks).
// Page layout: cache[page][offset][Hkv][D]; token j of sequence b lives at block_table[b][j / P] * P + j % P.
#pragma once
#include "core/status.h"
#include "core/tensor.h"

namespace lmx::ops {

struct KvWriteParams {
  Tensor k;               // [T, Hkv, D]
  Tensor v;               // [T, Hkv, D]
  Tensor kv_write_index;  // [T] i32: flat cache row (page * P + offset); -1 = not written (a padding row)
  Tensor k_cache;         // [pages, P, Hkv, D]
  Tensor v_cache;         // [pages, P, Hkv, D]
};
Status check(const KvWriteParams& p);

struct AttentionParams {
  Tensor q;            // [T, Hq, D]
  Tensor k_cache;      // [pages, P, Hkv, D]
  Tensor v_cache;      // [pages, P, Hkv, D]
  Tensor block_table;  // [B, max_pages] i32
  Tensor seq_start;    // [B+1] i32: tokens of sequence b are rows [seq_start[b], seq_start[b+1]) of q
  Tensor positions;    // [T] i32: absolute position of each token; keys 0..position are in the cache
  Tensor sinks;        // [Hq] bf16, optional: an extra logit per head in the softmax denominator
  int sliding_window = 0;  // 0 = full causal; W > 0: a query at p sees keys in (p - W, p]
  float softmax_scale = 1.0f;
  Tensor out;          // [T, Hq, D]
};
Status check(const AttentionParams& p);

}  // namespace lmx::ops
