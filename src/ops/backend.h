// The Backend interface: memory and every op, implemented by backends/cpu (the reference) and
// backends/cuda. Model code is written once against it. Ops check their Params (ops/*.h check()) and
// abort on a violated contract: shapes come from loramux code, never directly from users.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>

#include "core/tensor.h"
#include "ops/attention.h"
#include "ops/basic.h"
#include "ops/lora.h"
#include "ops/moe.h"
#include "ops/rope.h"
#include "ops/routing.h"
#include "ops/sampling.h"

namespace lmx::ops {

class Backend {
 public:
  virtual ~Backend() = default;
  virtual Device device() const = 0;
  // Dtype of activations, KV cache and LoRA stacks on this backend (F32 on cpu: the oracle; BF16 on cuda).
  virtual DType activation_dtype() const = 0;
  virtual DType lora_dtype() const = 0;

  virtual Buffer allocate(size_t bytes) = 0;
  // Same dtype and numel; either side may be host or device memory.
  virtual void copy(const Tensor& dst, const Tensor& src) = 0;
  virtual void fill_zero(const Tensor& dst) = 0;
  virtual void synchronize() = 0;
  // Bytes a new allocation may take now (host MemAvailable, device free memory); 0 when unknown.
  virtual uint64_t available_bytes() const = 0;
  // The device's whole memory (for --gpu-memory-utilization); 0 when it has no fixed size (the host).
  virtual uint64_t total_bytes() const { return 0; }
  // Generated (dummy) weights in place: `t` (BF16, this backend's memory) gets generate_weights_bf16's
  // values (core/rng.h) for (tensor_seed, stddev), bit for bit the same on every backend.
  virtual void fill_generated(const Tensor& t, uint64_t tensor_seed, float stddev) = 0;
  // Generated MXFP4 experts in place (GeneratedMxfp4Params): the same bytes on every backend.
  virtual void fill_generated_mxfp4(const GeneratedMxfp4Params& p) = 0;

  virtual void embedding(const EmbeddingParams& p) = 0;
  virtual void rms_norm(const RmsNormParams& p) = 0;
  virtual void linear(const LinearParams& p) = 0;
  virtual void add(const AddParams& p) = 0;
  virtual void silu_mul(const SiluMulParams& p) = 0;
  virtual void gather_rows(const GatherRowsParams& p) = 0;
  virtual void split_columns(const SplitColumnsParams& p) = 0;
  virtual void rope(const RopeParams& p) = 0;
  virtual void kv_write(const KvWriteParams& p) = 0;
  // rope(r) then kv_write(w) where w.k is r.k (the model's attention block): one pass on backends that fuse
  // them (cuda: one kernel instead of two per layer).
  virtual void rope_kv_write(const RopeParams& r, const KvWriteParams& w) {
    rope(r);
    kv_write(w);
  }
  // RopeParams' QK-norm alone, as rms_norm on the [T·H, D] views of q and k (in place): what a backend's rope
  // runs first where it does not fuse the norm into the rotation. No-op without QK-norm weights.
  void qk_norm(const RopeParams& p) {
    if (!p.has_qk_norm()) return;
    Tensor q = p.q.reshape({p.q.dim(0) * p.q.dim(1), p.q.dim(2)}), k = p.k.reshape({p.k.dim(0) * p.k.dim(1), p.k.dim(2)});
    rms_norm({.x = q, .weight = p.q_norm, .eps = p.norm_eps, .out = q});
    rms_norm({.x = k, .weight = p.k_norm, .eps = p.norm_eps, .out = k});
  }
  virtual void attention(const AttentionParams& p) = 0;
  virtual void router_topk(const RouterTopKParams& p) = 0;
  // The router's product then its top-k (RouteParams): linear then router_topk, or one kernel on backends
  // that fuse them (cuda at decode sizes).
  virtual void route(const RouteParams& p);
  virtual void moe(const MoeParams& p) = 0;
  virtual void lora(const LoraParams& p) = 0;
  // Several LoRA targets of the same x and token_slot (a layer's q, k and v) in one call, so a backend may
  // run them together (cuda: one launch pair instead of one per target). PRECOND: every part's x and
  // token_slot are the same tensors; at most 3 parts. Default: lora() per part.
  virtual void lora_group(std::span<const LoraParams> parts) {
    for (const LoraParams& p : parts) lora(p);
  }
  // LinearLoraParams: the projection, its split and its LoRA. Default: linear, split_columns, then lora /
  // lora_group over the outputs with a stack (when token_slot is defined).
  virtual void linear_lora(const LinearLoraParams& p);
  // The attention block's fused q|k|v: linear_lora(p) (one product split into p.parts = q, k, v, and their LoRA),
  // then rope_kv_write(r, w). Backends may skip the split where no adapter touches the projection, reading q,
  // k and v (with the bias) straight from the product in the rotation (cuda: one pass and one launch fewer).
  // PRECOND: check(p), p.parts[0..2] are r.q, r.k and w.v as [T, H·D] views of the same memory, w.k is r.k.
  virtual void qkv_rope_kv_write(const LinearLoraParams& p, const RopeParams& r, const KvWriteParams& w) {
    linear_lora(p);
    rope_kv_write(r, w);
  }
  // linear_lora's last step: lora (one output with a stack) or lora_group (several) on linear.x.
  // PRECOND: check(p) holds and p.token_slot is defined.
  void lora_outputs(const LinearLoraParams& p);
  virtual void sample(const SamplingParams& p) = 0;

  // Recorded op sequences (CUDA graphs): between begin_capture() and end_capture() the ops are recorded,
  // not run, so nothing in between may read results on the host, synchronize or allocate; replay(id)
  // runs the recording again on the same buffers. A backend without them says so and is never asked.
  virtual bool supports_graphs() const { return false; }
  virtual void begin_capture() {}
  virtual int end_capture() { return -1; }  // the recording's id
  virtual void replay(int /*graph*/) {}
  virtual void release_graph(int /*graph*/) {}
  // Changes whenever the backend replaces memory a recording may point at (a workspace grown for a larger
  // batch): recordings made under another epoch must be released and made again.
  virtual uint64_t memory_epoch() const { return 0; }
  // A second backend of the same device whose work runs beside this one's (the engine's prefill lane): its
  // own stream and scratch, the same memory, so tensors of either are valid in both; sm_share (0, 1]: the
  // share of the device's SMs its long-running kernels may hold (a GPU's persistent grids); lane_first: the
  // lane's work goes before this backend's where both wait for the device (stream priorities), else after.
  // nullptr: not supported.
  virtual std::unique_ptr<Backend> make_lane(double /*sm_share*/, bool /*lane_first*/) { return nullptr; }
  // Device time between two points of the op stream (the engine's step metrics): time_mark(0) after a
  // step's inputs are enqueued, time_mark(1) after its last op; once a host read that follows has returned,
  // marked_seconds() is the device time in between. -1: this backend has no device timer (the CPU backend,
  // whose ops run inside the calls). Never called while recording.
  virtual void time_mark(int /*which*/) {}
  virtual double marked_seconds() { return -1.0; }

  // A tensor in this backend's memory (contents undefined).
  OwnedTensor empty(DType dtype, std::initializer_list<int64_t> dims);
  // A copy of a host tensor in this backend's memory (on cpu: a copy too, so the caller may free src).
  OwnedTensor upload(const Tensor& host);
};

// Abort with the check's message when a Params contract is violated (a programmer error).
void require(const Status& status, const char* op);

}  // namespace lmx::ops
