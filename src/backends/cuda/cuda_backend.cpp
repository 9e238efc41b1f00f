// CudaBackend (cuda_backend.h): memory on the backend's stream and the dispatch of every op to its kernel
// family. The MoE workspace is sized from the largest batch seen so far (the model's first forward, made
// before any graph capture, fixes it for good in practice); a larger batch reallocates outside the kernels.
#include "backends/cuda/cuda_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <span>

#include "backends/cuda/attention.cuh"
#include "backends/cuda/basic.cuh"
#include "backends/cuda/check.h"
#include "backends/cuda/launch.cuh"
#include "backends/cuda/lora_dense.cuh"
#include "backends/cuda/make_backend.h"
#include "backends/cuda/memory.h"
#include "backends/cuda/moe_gemm.cuh"
#include "backends/cuda/rope.cuh"
#include "backends/cuda/routing.cuh"
#include "backends/cuda/sampling.cuh"
#include "backends/cuda/tune.h"

namespace lmx::cuda {

Result<std::unique_ptr<ops::Backend>> make_cuda_backend(const ops::KernelConfigs& kernel_configs) {
  // Tuned knobs out of the launchers' range fail here, with the entry named, not in a launcher mid-request.
  if (Status s = check_moe_lora_knobs(kernel_configs); !s.ok()) return s;
  int devices = 0;
  const cudaError_t status = cudaGetDeviceCount(&devices);
  if (status != cudaSuccess || devices == 0) {
    cudaGetLastError();  // clear the sticky "no device" error
    return unsupported(std::string("device 'cuda': no CUDA device is visible (") +
                       (status != cudaSuccess ? cudaGetErrorString(status) : "0 devices") + "); use --device cpu");
  }
  return std::unique_ptr<ops::Backend>(std::make_unique<CudaBackend>(kernel_configs));
}

struct MoeBlockState {
  MoeWorkspaceShape shape;
  OwnedTensor memory;  // [bytes] U8
};

CudaBackend::CudaBackend(ops::KernelConfigs kernel_configs) : kernel_configs_(std::move(kernel_configs)), host_(1) {
  LMX_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  LMX_CUDA_CHECK(cudaStreamCreateWithFlags(&side_stream_, cudaStreamNonBlocking));
  LMX_CUDA_CHECK(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
  LMX_CUDA_CHECK(cudaEventCreateWithFlags(&join_, cudaEventDisableTiming));
}

CudaBackend::~CudaBackend() {
  for (cudaGraphExec_t g : graphs_)
    if (g) cudaGraphExecDestroy(g);
  for (cudaEvent_t e : marks_)
    if (e) cudaEventDestroy(e);
  if (stream_) {
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
  if (side_stream_) {
    cudaStreamSynchronize(side_stream_);
    cudaStreamDestroy(side_stream_);
  }
  if (fork_) cudaEventDestroy(fork_);
  if (join_) cudaEventDestroy(join_);
}

void CudaBackend::set_stream_priority(int priority) {
  LMX_CUDA_CHECK(cudaStreamSynchronize(stream_));
  LMX_CUDA_CHECK(cudaStreamSynchronize(side_stream_));
  LMX_CUDA_CHECK(cudaStreamDestroy(stream_));
  LMX_CUDA_CHECK(cudaStreamDestroy(side_stream_));
  LMX_CUDA_CHECK(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, priority));
  LMX_CUDA_CHECK(cudaStreamCreateWithPriority(&side_stream_, cudaStreamNonBlocking, priority));
}

std::unique_ptr<ops::Backend> CudaBackend::make_lane(double sm_share, bool lane_first) {
  int least = 0, greatest = 0, device = 0, sms = 0;
  LMX_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  LMX_CUDA_CHECK(cudaGetDevice(&device));
  LMX_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  auto lane = std::make_unique<CudaBackend>(kernel_configs_);
  lane->set_stream_priority(lane_first ? greatest : least);
  lane->moe_max_sms_ = std::clamp(int(std::lround(sm_share * sms)), 1, sms);
  set_stream_priority(lane_first ? least : greatest);
  return lane;
}

Buffer CudaBackend::allocate(size_t bytes) { return cuda::allocate(bytes); }

void CudaBackend::time_mark(int which) {
  LMX_CHECK(which == 0 || which == 1, "CudaBackend::time_mark: which = %d, expected 0 or 1", which);
  if (!marks_[which]) LMX_CUDA_CHECK(cudaEventCreate(&marks_[which]));
  LMX_CUDA_CHECK(cudaEventRecord(marks_[which], stream_));
  marked_[which] = true;
}

double CudaBackend::marked_seconds() {
  if (!marked_[0] || !marked_[1]) return -1.0;
  marked_[0] = marked_[1] = false;
  float ms = 0.0f;
  // Both events are behind the host read that preceded this call; a mark still pending reads as no timer.
  if (cudaEventElapsedTime(&ms, marks_[0], marks_[1]) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1.0;
  }
  return double(ms) * 1e-3;
}

void CudaBackend::copy(const Tensor& dst, const Tensor& src) {
  if (dst.dtype != src.dtype || dst.numel() != src.numel()) {
    detail::contract_failure("copy", "dst", dst, ("the dtype and element count of src " + src.shape_str()).c_str());
  }
  if (dst.nbytes() == 0) return;
  if (dst.device == Device::kCpu && src.device == Device::kCpu) {
    std::memmove(dst.data, src.data, dst.nbytes());
    return;
  }
  // Ordered after the work already on the stream (a device-to-host copy reads finished results), and the
  // host side may be reused as soon as this returns: the engine's staging contract. From pageable host
  // memory to the device the runtime has already copied the source into its staging buffer when
  // cudaMemcpyAsync returns (CUDA runtime API, "API synchronization behavior"), so those uploads (the
  // engine's per-step batch and sampling parameters) no longer wait for the GPU; everything else (pinned
  // sources, reads back to the host) still synchronizes.
  LMX_CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, dst.nbytes(), cudaMemcpyDefault, stream_));
  if (dst.device == Device::kCuda && src.device == Device::kCpu) {
    cudaPointerAttributes attributes{};
    LMX_CUDA_CHECK(cudaPointerGetAttributes(&attributes, src.data));
    if (attributes.type == cudaMemoryTypeUnregistered) return;
  }
  LMX_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaBackend::fill_zero(const Tensor& dst) {
  if (dst.device != Device::kCuda) detail::contract_failure("fill_zero", "dst", dst, "a tensor on cuda");
  if (dst.nbytes() > 0) LMX_CUDA_CHECK(cudaMemsetAsync(dst.data, 0, dst.nbytes(), stream_));
}

void CudaBackend::synchronize() { LMX_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

// Thread-local capture: the adapter loader thread's own CUDA calls (if any) are not swept into it.
void CudaBackend::begin_capture() { LMX_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal)); }

int CudaBackend::end_capture() {
  cudaGraph_t graph = nullptr;
  LMX_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t status = cudaGraphInstantiateWithFlags(&exec, graph, 0);
  cudaGraphDestroy(graph);
  LMX_CUDA_CHECK(status);
  for (size_t i = 0; i < graphs_.size(); ++i) {
    if (!graphs_[i]) {
      graphs_[i] = exec;
      return int(i);
    }
  }
  graphs_.push_back(exec);
  return int(graphs_.size() - 1);
}

void CudaBackend::replay(int graph) {
  LMX_CHECK(graph >= 0 && size_t(graph) < graphs_.size() && graphs_[size_t(graph)], "replay: no graph %d", graph);
  LMX_CUDA_CHECK(cudaGraphLaunch(graphs_[size_t(graph)], stream_));
}

void CudaBackend::release_graph(int graph) {
  if (graph < 0 || size_t(graph) >= graphs_.size() || !graphs_[size_t(graph)]) return;
  LMX_CUDA_CHECK(cudaStreamSynchronize(stream_));  // it may still be running
  cudaGraphExecDestroy(graphs_[size_t(graph)]);
  graphs_[size_t(graph)] = nullptr;
}

uint64_t CudaBackend::total_bytes() const {
  size_t free_bytes = 0, total = 0;
  return cudaMemGetInfo(&free_bytes, &total) == cudaSuccess ? uint64_t(total) : 0;
}

uint64_t CudaBackend::available_bytes() const {
  size_t free_bytes = 0, total_bytes = 0;
  return cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess ? uint64_t(free_bytes) : 0;
}

void CudaBackend::fill_generated(const Tensor& t, uint64_t tensor_seed, float stddev) {
  cuda::fill_generated(t, tensor_seed, stddev, stream_);
}
void CudaBackend::fill_generated_mxfp4(const ops::GeneratedMxfp4Params& p) { cuda::fill_generated_mxfp4(p, stream_); }

void CudaBackend::embedding(const ops::EmbeddingParams& p) { cuda::embedding(p, stream_); }
void CudaBackend::rms_norm(const ops::RmsNormParams& p) { cuda::rms_norm(p, stream_); }
void CudaBackend::linear(const ops::LinearParams& p) { linear_.run(p, stream_); }
void CudaBackend::add(const ops::AddParams& p) { cuda::add(p, stream_); }
void CudaBackend::silu_mul(const ops::SiluMulParams& p) { cuda::silu_mul(p, stream_); }
void CudaBackend::gather_rows(const ops::GatherRowsParams& p) { cuda::gather_rows(p, stream_); }
void CudaBackend::split_columns(const ops::SplitColumnsParams& p) { cuda::split_columns(p, stream_); }
void CudaBackend::rope(const ops::RopeParams& p) { cuda::rope(p, stream_); }
void CudaBackend::kv_write(const ops::KvWriteParams& p) { cuda::kv_write(p, stream_); }
void CudaBackend::rope_kv_write(const ops::RopeParams& r, const ops::KvWriteParams& w) {
  if (!fuse_rope_kv_write_) {  // the unfused chain: QK-norm by rms_norm, rope, kv_write
    qk_norm(r);
    ops::Backend::rope_kv_write(ops::without_qk_norm(r), w);
    return;
  }
  cuda::rope_kv_write(r, w, stream_);
}
// Where no adapter touches q|k|v (and the fused forms are on): the product as linear_lora runs it (its bias
// left for the split where the product would have added it in a kernel of its own), then the split, its bias,
// the rotation and the cache write as one kernel (rope_kv_write_from_qkv) — the same bits as linear_lora then
// rope_kv_write, one pass over q|k|v and one launch fewer. Otherwise, or where that kernel declines: the two.
void CudaBackend::qkv_rope_kv_write(const ops::LinearLoraParams& p, const ops::RopeParams& r,
                                    const ops::KvWriteParams& w) {
  bool adapter = false;
  if (p.token_slot.defined()) {
    for (const ops::LoraStack& stack : p.lora) adapter = adapter || stack.defined();
  }
  const bool parts_are_outputs = p.parts[0].data == r.q.data && p.parts[1].data == r.k.data &&
                                 p.parts[2].data == w.v.data && p.parts[0].defined() && p.parts[1].defined() &&
                                 p.parts[2].defined();
  if (!fuse_qkv_rope_ || !fuse_linear_lora_ || !fuse_rope_kv_write_ || adapter || !parts_are_outputs ||
      p.linear.out.dtype != DType::BF16) {
    ops::Backend::qkv_rope_kv_write(p, r, w);
    return;
  }
  ops::require(ops::check(p), "cuda::qkv_rope_kv_write");
  // linear_lora's rule: the bias leaves the product only where the product would add it in a kernel of its own
  const bool bias_later = p.linear.bias.defined() && !linear_.takes_skinny(p.linear);
  ops::LinearParams product = p.linear;
  if (bias_later) product.bias = Tensor{};
  linear_.run(product, stream_);
  if (!cuda::rope_kv_write_from_qkv(r, w, p.linear.out, bias_later ? p.linear.bias : Tensor{}, stream_)) {
    cuda::split_columns({.x = p.linear.out, .parts = p.parts}, stream_, bias_later ? p.linear.bias : Tensor{});
    cuda::rope_kv_write(r, w, stream_);
  }
}
// The split-KV workspace grows to the largest (tokens, heads, dim) seen; past 64 tokens its size stops
// growing (attention_workspace_bytes), so the first decode and prefill batches fix it in practice.
void CudaBackend::attention(const ops::AttentionParams& p) {
  if (!attention_split_kv_) {
    cuda::attention(p, stream_);
    return;
  }
  const size_t want = attention_workspace_bytes(p.q.dim(0), p.q.dim(1), p.q.dim(2));
  if (want > attention_workspace_.view.nbytes()) {
    ++memory_epoch_;
    LMX_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the old workspace may still be in use
    attention_workspace_ = cuda::empty(DType::U8, {int64_t(want)});
  }
  cuda::attention(p, stream_,
                  AttentionLaunch{.workspace = attention_workspace_.view.data, .workspace_bytes = attention_workspace_.view.nbytes()});
}
void CudaBackend::router_topk(const ops::RouterTopKParams& p) { cuda::router_topk(p, stream_); }

void CudaBackend::route(const ops::RouteParams& p) {
  const bool prompt = p.x.dim(0) > 16;  // LinearRunner::route's row blocks
  if ((prompt ? fuse_prompt_route_ : fuse_route_) && linear_.route(p, stream_)) return;
  Backend::route(p);
}

void CudaBackend::moe(const ops::MoeParams& p) {
  MoeWorkspaceShape want{.max_tokens = p.x.dim(0),
                         .top_k = p.topk_ids.dim(1),
                         .experts = p.gate_up.dim(0),
                         .slots = 0,
                         .hidden = p.gate_up.dim(2),
                         .inter = p.down.dim(2),
                         .max_rank = 0};
  for (const ops::LoraStack* stack : {&p.lora_gate_up, &p.lora_down}) {
    if (!stack->defined()) continue;
    want.slots = std::max(want.slots, stack->a.dim(0));
    want.max_rank = std::max(want.max_rank, stack->a.dim(2));
  }
  const bool fits = moe_ && moe_->shape.top_k == want.top_k && moe_->shape.experts == want.experts &&
                    moe_->shape.hidden == want.hidden && moe_->shape.inter == want.inter &&
                    moe_->shape.max_tokens >= want.max_tokens && moe_->shape.slots >= want.slots &&
                    moe_->shape.max_rank >= want.max_rank;
  if (!fits) {
    if (moe_) {  // grow: keep the larger of each, so alternating batches do not reallocate back and forth
      want.max_tokens = std::max(want.max_tokens, moe_->shape.max_tokens);
      want.slots = std::max(want.slots, moe_->shape.slots);
      want.max_rank = std::max(want.max_rank, moe_->shape.max_rank);
    }
    ++memory_epoch_;
    LMX_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the old workspace may still be in use
    moe_ = std::make_unique<MoeBlockState>();
    moe_->shape = want;
    moe_->memory = cuda::empty(DType::U8, {int64_t(moe_workspace_bytes(want))});
    moe_workspace_prepare(MoeWorkspace{.shape = moe_->shape, .memory = moe_->memory.view}, stream_);
  }
  MoeBlockConfig config;
  const int64_t lora_rank = p.lora_gate_up.defined() ? p.lora_gate_up.b.dim(-1)
                            : p.lora_down.defined()  ? p.lora_down.b.dim(-1)
                                                     : 0;
  if (lora_rank > 0) {
    const std::string shape = moe_lora_shape_key(want.hidden, want.inter, want.experts, want.top_k,
                                                 p.lora_gate_up.defined() ? p.lora_gate_up.a.dim(0) : p.lora_down.a.dim(0),
                                                 lora_rank);
    apply_moe_lora_knobs(kernel_configs_.find(kMoeLoraOp, shape, p.x.dim(0)), &config);
  }
  config.max_sms = moe_max_sms_;
  config.side_stream = side_stream_;  // the decode MoE-LoRA's shrinks beside their GEMMs (linear_lora's fork and join)
  config.fork = fork_;
  config.join = join_;
  moe_block(p, MoeWorkspace{.shape = moe_->shape, .memory = moe_->memory.view}, stream_, config);
}

// One scratch serves every dense call site: calls are ordered on the stream, z cleans itself, and all
// stacks share the slot count S and rank capacity R (--max-loras, --max-lora-rank).
void CudaBackend::set_programmatic_launches(bool on) {
  cuda::set_programmatic_launches(on);
  ++memory_epoch_;  // recordings hold the launch attributes: the engine must record its graphs again
}

void CudaBackend::lora(const ops::LoraParams& p) {
  if (!p.w.defined()) return;
  lora_dense(p, lora_scratch(p), kLoraDenseConfig, stream_);
}

void CudaBackend::lora_group(std::span<const ops::LoraParams> parts) {
  for (const ops::LoraParams& p : parts) {
    if (p.w.defined()) {
      lora_dense_group(parts, lora_scratch(p), kLoraDenseConfig, stream_);
      return;
    }
  }
}

// The projection, its split and its LoRA with fewer launches than the composition (ops/lora.h):
//  - fused (decode sizes, every output with a stack, an adapter in the batch; lora_dense.cuh):
//      main stream:  [fork] -- product -- [wait join] -- expand: bias + split + LoRA
//      side stream:  [wait fork] -- shrink -- [join]
//    the shrink's latency hides behind the product, and the bias and split kernels disappear: q|k|v takes 3
//    launches on the critical path instead of 5, o_proj 3 instead of 4;
//  - otherwise a split takes the bias with it (one kernel instead of two), then the LoRA launches.
// A bias leaves the product only where the product would have added it in a kernel of its own (cuBLASLt);
// the skinny kernel adds it inside its fp32 sum, so it keeps it. Either way the later kernel rounds it in
// exactly like that bias kernel, so every output is bit for bit the composition's (perf-log run 77: a
// single rounding instead flipped GPT-OSS fixture tokens at router near ties).
void CudaBackend::linear_lora(const ops::LinearLoraParams& p) {
  ops::require(ops::check(p), "cuda::linear_lora");
  if (!fuse_linear_lora_ || p.linear.out.dtype != DType::BF16) {
    Backend::linear_lora(p);
    return;
  }
  const bool split = p.parts[0].defined();
  ops::LoraParams parts[3];
  size_t count = 0;
  bool every_output = p.token_slot.defined();
  for (size_t i = 0; i < (split ? p.parts.size() : 1) && every_output; ++i) {
    if (split && !p.parts[i].defined()) break;
    every_output = p.lora[i].defined();
    parts[count++] = {.x = p.linear.x, .token_slot = p.token_slot, .w = p.lora[i], .y = split ? p.parts[i] : p.linear.out};
  }
  const int64_t tokens = p.linear.x.dim(0);
  const bool fused = every_output && count > 0 && tokens > 0 && lora_dense_fused_fits(tokens);
  const bool bias_later = p.linear.bias.defined() && (fused || split) && !linear_.takes_skinny(p.linear);
  ops::LinearParams product = p.linear;
  if (bias_later) product.bias = Tensor{};
  if (fused) {
    const std::span<const ops::LoraParams> group(parts, count);
    const LoraDenseScratch& scratch = lora_scratch(parts[0]);  // may grow (a sync) before anything is enqueued
    LMX_CUDA_CHECK(cudaEventRecord(fork_, stream_));
    if (fork_product_first_) linear_.run(product, stream_);  // the shrink still depends only on the fork
    LMX_CUDA_CHECK(cudaStreamWaitEvent(side_stream_, fork_, 0));
    lora_dense_fused_shrink(group, scratch, side_stream_);
    LMX_CUDA_CHECK(cudaEventRecord(join_, side_stream_));
    if (!fork_product_first_) linear_.run(product, stream_);
    LMX_CUDA_CHECK(cudaStreamWaitEvent(stream_, join_, 0));
    lora_dense_fused_expand(group, p.linear.out, bias_later ? p.linear.bias : Tensor{}, scratch, kLoraDenseConfig, stream_);
    return;
  }
  linear_.run(product, stream_);
  if (split) cuda::split_columns({.x = p.linear.out, .parts = p.parts}, stream_, bias_later ? p.linear.bias : Tensor{});
  if (!p.token_slot.defined()) return;
  if (!dense_runs(p)) {
    lora_outputs(p);
    return;
  }
  if (p.rest_rows <= 0) return;
  // The adapter tokens outside the runs (decode tokens beside a prompt) all lie in rows [0, rest_rows): the
  // grouped kernels on that slice alone (a few rows: the direct per-pair path).
  ops::LinearLoraParams rest = p;
  rest.linear.x = p.linear.x.rows(0, p.rest_rows);
  rest.linear.out = p.linear.out.rows(0, p.rest_rows);
  rest.token_slot = p.token_slot.rows(0, p.rest_rows);
  for (Tensor& part : rest.parts) {
    if (part.defined()) part = part.rows(0, p.rest_rows);
  }
  rest.runs = {};
  rest.rest_rows = -1;
  lora_outputs(rest);
}

// The LoRA of linear_lora's long single-adapter runs (ops::LoraRun: a prompt's chunk) as dense products,
// where every other token with an adapter lies before the first run (rest_rows >= 0): per run and output,
// z = x[rows]·A[slot][:r]ᵀ (bf16, rank r of the slot) and y[rows] += z·B[slot][:, :r]ᵀ, both cuBLASLt
// (LinearRunner). The grouped kernels re-read B per 16-row tile and run at 14–23% of their bytes floor at
// T 1600 (perf-log run 80); a 1600-token prompt with an adapter takes ~2 ms less (run 89). The caller runs
// the grouped kernels on rows [0, rest_rows) after it; over the whole batch with the runs masked out they
// cost more than the dense products saved (run 89). Eager steps only (the engine gives no runs to
// recordings); false where it does not apply: switched off, inside a capture, a stack without host ranks,
// rest_rows -1.
bool CudaBackend::dense_runs(const ops::LinearLoraParams& p) {
  if (!dense_lora_runs_ || p.runs.empty() || p.rest_rows < 0 || p.linear.out.dtype != DType::BF16) return false;
  for (const ops::LoraStack& w : p.lora) {
    if (w.defined() && (int64_t(w.host_rank.size()) != w.a.dim(0) || w.a.dtype != DType::BF16)) return false;
  }
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  LMX_CUDA_CHECK(cudaStreamIsCapturing(stream_, &capture));
  if (capture != cudaStreamCaptureStatusNone) return false;
  int64_t longest = 0, max_rank = 0;
  for (const ops::LoraRun& run : p.runs) longest = std::max(longest, run.tokens);
  for (const ops::LoraStack& w : p.lora) {
    if (w.defined()) max_rank = std::max(max_rank, w.a.dim(1));
  }
  if (run_z_.view.numel() < longest * max_rank) {
    ++memory_epoch_;
    LMX_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the old buffer may still be in use
    run_z_ = cuda::empty(DType::BF16, {longest * max_rank});
  }
  const bool split = p.parts[0].defined();
  for (size_t i = 0; i < p.lora.size(); ++i) {
    const ops::LoraStack& w = p.lora[i];
    if (!w.defined()) continue;
    const Tensor& y = split ? p.parts[i] : p.linear.out;
    const int64_t capacity = w.a.dim(1), in = w.a.dim(2), out = w.b.dim(1);
    for (const ops::LoraRun& run : p.runs) {
      const int64_t rank = w.host_rank[size_t(run.slot)];
      if (rank <= 0) continue;
      const auto* a = static_cast<const bf16*>(w.a.data) + run.slot * capacity * in;
      const auto* b = static_cast<const bf16*>(w.b.data) + run.slot * out * capacity;
      const Tensor z(run_z_.view.data, DType::BF16, {run.tokens, rank}, Device::kCuda);
      linear_.run({.x = p.linear.x.rows(run.first, run.first + run.tokens),
                   .weight = Tensor(const_cast<bf16*>(a), DType::BF16, {rank, in}, Device::kCuda),
                   .out = z},
                  stream_);
      linear_.accumulate(z, Tensor(const_cast<bf16*>(b), DType::BF16, {out, capacity}, Device::kCuda), capacity,
                         y.rows(run.first, run.first + run.tokens), stream_);
    }
  }
  return true;
}

// The dense-LoRA scratch, grown (outside any capture: the engine's first step of a shape is eager) when a
// call needs more tokens or another S / R.
const LoraDenseScratch& CudaBackend::lora_scratch(const ops::LoraParams& p) {
  const int64_t tokens = p.x.dim(0), slots = p.w.a.dim(0), capacity_rank = p.w.a.dim(1);
  if (!lora_ || lora_->max_tokens < tokens || lora_->slots != slots || lora_->capacity_rank != capacity_rank) {
    const int64_t max_tokens = std::max(tokens, lora_ ? lora_->max_tokens : int64_t(0));
    ++memory_epoch_;
    LMX_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the old scratch may still be in use
    lora_ = std::make_unique<LoraDenseScratch>(lora_dense_scratch(max_tokens, slots, capacity_rank));
  }
  return *lora_;
}

// GPU sampling (sampling.cuh): one thread-block cluster per row reads the row once into shared memory; no
// workspace, no host sync. Its first call sets the kernel's shared-memory attribute (eager: the engine's
// first step of a shape never runs inside a capture). Vocabularies or top-N lists beyond the kernel's limits
// (V above ~350k, N above 1024) fall back to the host path below: the logits come back and the CPU oracle
// samples.
void CudaBackend::sample(const ops::SamplingParams& p) {
  const int64_t vocab = p.logits.dim(1), top_n = p.out_top_ids.defined() ? p.out_top_ids.dim(1) : 0;
  if (sampling_fits(vocab, sampling_cluster_ctas(vocab), top_n)) {
    cuda::sample(p, stream_);
    return;
  }
  auto to_host = [&](const Tensor& t) {
    OwnedTensor host = OwnedTensor::host_like(t, t.dtype);
    copy(host.view, t);
    return host;
  };
  auto host_output = [](const Tensor& t) { return t.defined() ? OwnedTensor::host_like(t, t.dtype) : OwnedTensor{}; };
  OwnedTensor logits = to_host(p.logits), temperature = to_host(p.temperature), top_k = to_host(p.top_k);
  OwnedTensor top_p = to_host(p.top_p), uniform = to_host(p.uniform);
  OwnedTensor tokens = host_output(p.out_tokens), logprob = host_output(p.out_logprob);
  OwnedTensor top_ids = host_output(p.out_top_ids), top_logprobs = host_output(p.out_top_logprobs);
  host_.sample({.logits = logits, .temperature = temperature, .top_k = top_k, .top_p = top_p, .uniform = uniform,
                .out_tokens = tokens, .out_logprob = logprob, .out_top_ids = top_ids,
                .out_top_logprobs = top_logprobs});
  copy(p.out_tokens, tokens.view);
  if (p.out_logprob.defined()) copy(p.out_logprob, logprob.view);
  if (p.out_top_ids.defined()) copy(p.out_top_ids, top_ids.view);
  if (p.out_top_logprobs.defined()) copy(p.out_top_logprobs, top_logprobs.view);
}

}  // namespace lmx::cuda
