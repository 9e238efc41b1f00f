// CudaBackend: the ops::Backend on one NVIDIA GPU (sm_90a) — every op of ops/*.h enqueued on the backend's
// own stream with BF16 activations, KV cache and LoRA stacks. Owns the stream, the cuBLASLt runner and the
// MoE workspace; the kernels live in the op-family files beside it. Who calls: engine/setup (`--device
// cuda`), the CUDA model tests. Sampling runs on the GPU (sampling.cuh); the engine reads back only the
// sampled tokens (and logprobs when asked).
#pragma once
#include <cuda_runtime_api.h>

#include <memory>
#include <vector>

#include "backends/cpu/cpu_backend.h"
#include "backends/cuda/linear.cuh"
#include "ops/backend.h"
#include "ops/kernel_configs.h"

namespace lmx::cuda {

struct MoeBlockState;     // the MoE workspace, grown to the largest batch seen (moe_gemm.cuh)
struct LoraDenseScratch;  // the dense multi-LoRA scratch, likewise (lora_dense.cuh)

class CudaBackend final : public ops::Backend {
 public:
  explicit CudaBackend(ops::KernelConfigs kernel_configs = {});
  ~CudaBackend() override;

  Device device() const override { return Device::kCuda; }
  DType activation_dtype() const override { return DType::BF16; }
  DType lora_dtype() const override { return DType::BF16; }
  cudaStream_t stream() const { return stream_; }

  Buffer allocate(size_t bytes) override;
  void copy(const Tensor& dst, const Tensor& src) override;
  void fill_zero(const Tensor& dst) override;
  void synchronize() override;
  uint64_t available_bytes() const override;
  uint64_t total_bytes() const override;
  void fill_generated(const Tensor& t, uint64_t tensor_seed, float stddev) override;
  void fill_generated_mxfp4(const ops::GeneratedMxfp4Params& p) override;

  void embedding(const ops::EmbeddingParams& p) override;
  void rms_norm(const ops::RmsNormParams& p) override;
  void linear(const ops::LinearParams& p) override;
  void add(const ops::AddParams& p) override;
  void silu_mul(const ops::SiluMulParams& p) override;
  void gather_rows(const ops::GatherRowsParams& p) override;
  void split_columns(const ops::SplitColumnsParams& p) override;
  void rope(const ops::RopeParams& p) override;
  void kv_write(const ops::KvWriteParams& p) override;
  void rope_kv_write(const ops::RopeParams& r, const ops::KvWriteParams& w) override;
  void qkv_rope_kv_write(const ops::LinearLoraParams& p, const ops::RopeParams& r, const ops::KvWriteParams& w) override;
  void attention(const ops::AttentionParams& p) override;
  void router_topk(const ops::RouterTopKParams& p) override;
  void route(const ops::RouteParams& p) override;
  void moe(const ops::MoeParams& p) override;
  void lora(const ops::LoraParams& p) override;
  void lora_group(std::span<const ops::LoraParams> parts) override;
  void linear_lora(const ops::LinearLoraParams& p) override;
  void sample(const ops::SamplingParams& p) override;

  bool supports_graphs() const override { return true; }
  void begin_capture() override;
  int end_capture() override;
  void replay(int graph) override;
  void release_graph(int graph) override;
  uint64_t memory_epoch() const override { return memory_epoch_ + linear_.memory_epoch(); }
  // The prefill lane's backend: the same kernel configs, its own streams at the lowest priority, while this
  // backend's streams move to the highest (decode kernels get SMs first when both have work).
  // sm_share: the share of the SMs the lane's persistent MoE GEMMs may fill (MoeBlockConfig::max_sms).
  std::unique_ptr<ops::Backend> make_lane(double sm_share, bool lane_first) override;
  void time_mark(int which) override;  // CUDA events on the stream
  double marked_seconds() override;
  // false: attention never splits a row's keys over CTAs (no workspace; the plain flash kernel). For
  // comparisons in tests and benches; the default splits decode rows when that fills the GPU.
  void set_attention_split_kv(bool on) { attention_split_kv_ = on; }
  // false: the kernels that can start in the previous kernel's tail (launch.cuh, the MoE GEMMs) go out as
  // plain launches (bench before/after). Process-wide; bumps memory_epoch() so recorded graphs are made again.
  void set_programmatic_launches(bool on);
  // true (default): qkv_rope_kv_write folds the q|k|v split (and its bias) into the rotation where no adapter
  // touches the projection; false: linear_lora then rope_kv_write (the bench's before row). Bumps memory_epoch().
  void set_fuse_qkv_rope(bool on) {
    fuse_qkv_rope_ = on;
    ++memory_epoch_;
  }
  // false: rope_kv_write runs rms_norm for a QK-norm, rope, then kv_write (bench before/after); bumps memory_epoch().
  void set_fuse_rope_kv_write(bool on) {
    fuse_rope_kv_write_ = on;
    ++memory_epoch_;
  }
  // false: linear_lora always runs as linear, split, then the LoRA pair (bench before/after); true (default)
  // fuses them at decode sizes (lora_dense.cuh). Bumps memory_epoch() so graphs are recorded again.
  void set_fuse_linear_lora(bool on) {
    fuse_linear_lora_ = on;
    ++memory_epoch_;
  }
  // true (default since perf-log run 148: -0.09 ms a GPT-OSS-20B MXFP4 decode step on the H100): the fused
  // linear + LoRA enqueues its product before its forked shrink (the graph's nodes are made in that order), so
  // the product's CTAs take their SMs first and the shrink fills the ones it leaves idle (q|k|v on cuBLASLt:
  // 80 CTAs); false (the bench's before row): the shrink first. Same bits. Bumps memory_epoch().
  void set_fork_product_first(bool on) {
    fork_product_first_ = on;
    ++memory_epoch_;
  }
  // true: route runs the router's product and its top-k as one kernel at decode sizes (LinearRunner::route);
  // false (default until measured on the H200): the product, then the top-k kernel. Bumps memory_epoch().
  void set_fuse_route(bool on) {
    fuse_route_ = on;
    ++memory_epoch_;
  }
  // true (default): route runs a prompt's (T > 16) router product and top-k as one kernel in row blocks of 16
  // (LinearRunner::route) instead of cuBLASLt's split-K product, its reduce, the bias kernel and the top-k
  // kernel; false: those four (the bench's before row).
  void set_fuse_prompt_route(bool on) { fuse_prompt_route_ = on; }
  // LinearRunner::set_skinny_max_out (bench before/after); bumps memory_epoch() so graphs are recorded again.
  void set_skinny_max_out(int64_t out) {
    linear_.set_skinny_max_out(out);
    ++memory_epoch_;
  }
  // LinearRunner::set_skinny_narrowing (bench before/after); bumps memory_epoch().
  void set_skinny_narrowing(bool on) {
    linear_.set_skinny_narrowing(on);
    ++memory_epoch_;
  }
  // LinearRunner::set_autotune (bench before/after); graphs are recorded again, and every shape chooses its
  // cuBLASLt algorithm again on its next (eager) call.
  void set_linear_autotune(bool on) {
    linear_.set_autotune(on);
    ++memory_epoch_;
  }
  // false: linear_lora's long single-adapter runs (ops::LinearLoraParams::runs, when they hold every adapter
  // token) go through the grouped LoRA kernels, instead of two cuBLASLt products per run and output (bench
  // before/after).
  void set_dense_lora_runs(bool on) { dense_lora_runs_ = on; }
  // LinearRunner::set_split_ragged_rows (bench before/after); graphs are recorded again.
  void set_split_ragged_rows(bool on) {
    linear_.set_split_ragged_rows(on);
    ++memory_epoch_;
  }
  // LinearRunner::set_split_row_align (64, the default, or 128; bench before/after); graphs are recorded again.
  void set_split_row_align(int rows) {
    linear_.set_split_row_align(rows);
    ++memory_epoch_;
  }
  // LinearRunner::set_finish_by_chunks (bench before/after); graphs are recorded again.
  void set_finish_by_chunks(bool on) {
    linear_.set_finish_by_chunks(on);
    ++memory_epoch_;
  }
  // LinearRunner::set_wide_route (bench before/after); graphs are recorded again.
  void set_wide_route(bool on) {
    linear_.set_wide_route(on);
    ++memory_epoch_;
  }

 private:
  cudaStream_t stream_ = nullptr;
  // linear_lora's fork: the LoRA shrink runs on side_stream_ beside the product (fork_ orders it after the
  // stream's work, join_ the expand after it); captured into a graph as a parallel branch.
  cudaStream_t side_stream_ = nullptr;
  cudaEvent_t fork_ = nullptr, join_ = nullptr;
  bool fuse_linear_lora_ = true;
  bool fork_product_first_ = true;
  bool fuse_route_ = false;
  bool fuse_prompt_route_ = true;
  ops::KernelConfigs kernel_configs_;
  LinearRunner linear_;
  std::unique_ptr<MoeBlockState> moe_;
  std::unique_ptr<LoraDenseScratch> lora_;
  const LoraDenseScratch& lora_scratch(const ops::LoraParams& p);
  bool dense_lora_runs_ = true;
  int moe_max_sms_ = 0;  // MoeBlockConfig::max_sms of this backend's MoE layers (a prefill lane's: make_lane)
  // Replaces stream_ and side_stream_ by streams of `priority` (cudaDeviceGetStreamPriorityRange; lower is
  // higher). Only before any recording: graphs and events hold the old streams.
  void set_stream_priority(int priority);
  OwnedTensor run_z_;      // [longest run · R] bf16: dense_runs' z
  bool dense_runs(const ops::LinearLoraParams& p);
  OwnedTensor attention_workspace_;  // [bytes] U8: split-KV partials (attention.cuh)
  bool attention_split_kv_ = true;
  bool fuse_rope_kv_write_ = true;
  bool fuse_qkv_rope_ = true;
  uint64_t memory_epoch_ = 0;        // bumped when a workspace above is replaced
  std::vector<cudaGraphExec_t> graphs_;  // by id; released ones are null
  cudaEvent_t marks_[2] = {nullptr, nullptr};  // time_mark's events, made on first use
  bool marked_[2] = {false, false};
  cpu::CpuBackend host_;  // samples on the host when the GPU sampler's limits are exceeded (one thread)
};

}  // namespace lmx::cuda
