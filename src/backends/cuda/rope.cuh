// Entry point of rotary position embedding on cuda (contract in ops/rope.h): rotates q and k in place,
// rotate-half (NeoX) layout, BF16 activations, fp32 angles and math. The inv_freq table comes from
// ops::make_rope_table on the host. Callers: tests, bench, (later) the CUDA backend.
#pragma once
#include <cuda_runtime_api.h>

#include "ops/attention.h"
#include "ops/rope.h"

namespace lmx::cuda {

void rope(const ops::RopeParams& p, cudaStream_t stream);
// rope(r) then kv_write(w) (w.k is r.k, after the rotation) in one kernel: q and k rotated in place, the
// rotated k rows and the v rows copied to cache row kv_write_index[t] (skipped where -1). Contracts of both.
void rope_kv_write(const ops::RopeParams& r, const ops::KvWriteParams& w, cudaStream_t stream);
// rope_kv_write with the split folded in: q (r.q), k (r.k) and v (w.v) come from the fused product `qkv`
// [T, (Hq + 2·Hkv)·D] (q's heads, then k's, then v's) plus `bias` [(Hq + 2·Hkv)·D] bf16 (optional), exactly as
// split_columns({qkv → q, k, v}, bias) then rope_kv_write(r, w) would leave q, k, v and both caches, bit for
// bit, in one kernel. Returns false, enqueuing nothing, where it does not apply (a QK-norm the rotation cannot
// fuse: its rms_norm must run on split heads); the caller then runs the two.
bool rope_kv_write_from_qkv(const ops::RopeParams& r, const ops::KvWriteParams& w, const Tensor& qkv, const Tensor& bias,
                            cudaStream_t stream);

}  // namespace lmx::cuda
