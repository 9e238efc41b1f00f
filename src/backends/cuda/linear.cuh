// Entry point of the dense projections on cuda (contract ops::LinearParams in ops/basic.h): out = x·Wᵀ + b,
// bf16 inputs, fp32 accumulation, bf16 or f32 out, through cuBLASLt (a few-row kernel of our own can be
// forced for comparison). The runner owns the cuBLASLt handle, its workspace and the chosen
// algorithm per shape, so a caller (the CUDA backend) holds one and passes its stream; nothing global.
#pragma once
#include <cuda_runtime_api.h>

#include <map>
#include <memory>
#include <tuple>

#include "core/tensor.h"
#include "ops/basic.h"
#include "ops/routing.h"

namespace lmx::cuda {

// Which kernel runs: kAuto = for T <= 16 rows and at most set_skinny_max_out() outputs (default 1024: the
// router, and k/v where they are separate) or at most as many outputs as inputs (o_proj;
// set_skinny_narrowing) our tensor-core skinny GEMV, cuBLASLt otherwise — faster on wide
// weights, in isolation (docs/perf-log.md run 9) and inside the decode step even against the skinny
// kernel's L2 prefetch before its PDL wait (run 24: 11.84 vs 12.01 ms); kSkinny forces the GEMV (T <= 16)
// and kCublasLt cuBLASLt, for tests and the benchmark's comparison rows.
enum class LinearPath { kAuto, kSkinny, kCublasLt };

class LinearRunner {
 public:
  LinearRunner();
  ~LinearRunner();
  LinearRunner(const LinearRunner&) = delete;
  LinearRunner& operator=(const LinearRunner&) = delete;

  // x [T, in] bf16, weight [out, in] bf16, bias [out] bf16 (optional), out [T, out] bf16 or f32, all on
  // cuda, rows contiguous. Enqueued on `stream`; no synchronization, except on the first call of a shape
  // of at most 16 rows, which times cuBLASLt's candidates (set_autotune). The first call of a shape asks
  // cuBLASLt's heuristic (host work): warm every shape up before capturing a CUDA graph.
  void run(const ops::LinearParams& p, cudaStream_t stream);
  // The router's product and top-k (ops::RouteParams) as one kernel where the product takes the skinny path
  // (T <= 16; K <= 32): the last CTA to store its logits ranks them (skinny_kernel). Logits, ids and weights
  // are bit for bit those of run() then router_topk (routing.cuh). A prompt (T > 16, up to 65536 tokens, at
  // most 256 experts) runs as row blocks of 16, each ranked by its own last CTA: the logits then come from the
  // skinny kernel's sums, not cuBLASLt's. Returns false, enqueuing nothing, where it does not apply (the
  // caller then runs the two). One route() at a time per runner: its counters are the runner's, so runners
  // whose streams run side by side (a prefill lane's backend) each need their own.
  bool route(const ops::RouteParams& p, cudaStream_t stream);
  void set_path(LinearPath path) { path_ = path; }
  // kAuto's skinny path takes T <= 16 products of at most this many outputs (a huge value puts q|k|v and
  // o_proj on it too: the bench's comparison row).
  void set_skinny_max_out(int64_t out) { skinny_max_out_ = out; }
  // kAuto's skinny path also takes T <= 16 products with out <= in (o_proj; a dense MLP's down_proj too,
  // not measured apart); false = only set_skinny_max_out's rule (the bench's before row).
  void set_skinny_narrowing(bool on) { skinny_narrowing_ = on; }
  // cuBLASLt products of at most 16 rows (decode) time the heuristic's first 8 candidates on their first
  // call (outside stream capture: host-synchronizing, once per shape) and keep the fastest (on, the
  // default); off keeps the heuristic's first choice (the bench's before row). Forgets the algorithms chosen
  // so far, so every shape chooses again on its next call.
  void set_autotune(bool on);
  // Whether run(p) takes the skinny kernel, which adds the bias inside its fp32 sum (one rounding). Otherwise
  // the bias is a separate kernel after cuBLASLt, out = bf16(bf16(x·Wᵀ) + b), which a caller may fuse into its
  // next kernel with the same two roundings (CudaBackend::linear_lora).
  bool takes_skinny(const ops::LinearParams& p) const;
  // cuBLASLt products of an output width that is not a multiple of 64 run as two, the aligned rows of W and
  // the rest, and where out's rows are not a multiple of 16 bytes both write padded rows into a scratch the
  // runner owns, copied into out after (on, the default); off: one product straight into out (the bench's
  // before row). The scratch grows on the first call of a larger shape, which must be outside a stream
  // capture (like the cuBLASLt heuristic's first call); it then moves, and memory_epoch() changes, so
  // recorded graphs must be made again.
  void set_split_ragged_rows(bool on) { split_ragged_ = on; }
  // The row multiple of that split: 64 (the default) or 128 (runs 85-95). At 64, GPT-OSS's o_proj (2880 =
  // 45 · 64) runs as one product instead of 2816 + 64 rows: decode 11.75 -> 11.35 ms (perf-log run 96), the
  // LM head's time the same. Throws std::invalid_argument otherwise.
  void set_split_row_align(int rows);
  // The bias after cuBLASLt (and a padded product's copy) on bf16 outputs in 16-byte chunks, 8 outputs a thread
  // (on, the default, where widths and addresses allow), or by the scalar kernel (the bench's before row, the
  // tests' second pass): the same bits.
  void set_finish_by_chunks(bool on) { finish_by_chunks_ = on; }
  // route() of a prompt (T > 16) over more than 32 experts: 64 outputs a CTA (on, the default) or 16 like every
  // skinny product (the bench's before row, the tests' second pass): the same bits.
  void set_wide_route(bool on) { wide_route_ = on; }
  // out += x·W[:, :k]ᵀ in one rounding (cuBLASLt with beta 1): x [T, k] bf16, weight [n, >= k] bf16 whose rows
  // are weight_ld elements apart, out [T, n] bf16, all on cuda. The dense LoRA's expand of a long run of one
  // adapter (CudaBackend::linear_lora): W is B[slot] [out, R] and k the slot's true rank. Not timed on its
  // first call (it would add into out); the heuristic's first choice.
  void accumulate(const Tensor& x, const Tensor& weight, int64_t weight_ld, const Tensor& out, cudaStream_t stream);
  uint64_t memory_epoch() const;

 private:
  LinearPath path_ = LinearPath::kAuto;
  bool autotune_ = true;
  bool split_ragged_ = true;
  int64_t row_align_ = 64;  // set_split_row_align
  int64_t skinny_max_out_ = 1024;
  bool skinny_narrowing_ = true;
  bool finish_by_chunks_ = true;
  bool wide_route_ = true;
  // One cuBLASLt product of `rows` rows of W into c with rows ldc apart (out_type: a cudaDataType_t);
  // lda: W's row stride (0: in); accumulate: c += instead of c =.
  void cublas_product(const void* w, const void* x, void* c, int64_t tokens, int64_t in, int64_t rows, int64_t ldc,
                      int out_type, cudaStream_t stream, int64_t lda = 0, bool accumulate = false);
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace lmx::cuda
