// OpProfiler: an ops::Backend that forwards every call to a CudaBackend and records, per op, the GPU time
// between CUDA events placed around it on the backend's stream, the host time the call took (enqueue, or
// the whole call where the op synchronizes, like host sampling and copies) and the call count. The events
// serialize nothing the stream did not already serialize, but their records cost a little host time, so
// figures are for finding where a step's time goes, not for the headline table. Who uses it:
// bench_decode_step --profile.
#pragma once
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "backends/cuda/cuda_backend.h"

namespace lmx::bench {

class OpProfiler final : public ops::Backend {
 public:
  explicit OpProfiler(cuda::CudaBackend& inner) : inner_(inner) {}
  // Off: calls go straight through (one virtual call more than the plain backend, nothing recorded).
  void enable(bool on) { enabled_ = on; }
  ~OpProfiler() override {
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
  }

  Device device() const override { return inner_.device(); }
  DType activation_dtype() const override { return inner_.activation_dtype(); }
  DType lora_dtype() const override { return inner_.lora_dtype(); }
  Buffer allocate(size_t bytes) override { return inner_.allocate(bytes); }
  uint64_t available_bytes() const override { return inner_.available_bytes(); }
  uint64_t total_bytes() const override { return inner_.total_bytes(); }
  void synchronize() override { timed("synchronize", [&] { inner_.synchronize(); }); }
  void copy(const Tensor& dst, const Tensor& src) override { timed("copy", [&] { inner_.copy(dst, src); }); }
  void fill_zero(const Tensor& dst) override { timed("fill_zero", [&] { inner_.fill_zero(dst); }); }
  void fill_generated(const Tensor& t, uint64_t seed, float stddev) override { inner_.fill_generated(t, seed, stddev); }
  void fill_generated_mxfp4(const ops::GeneratedMxfp4Params& p) override { inner_.fill_generated_mxfp4(p); }

  void embedding(const ops::EmbeddingParams& p) override { timed("embedding", [&] { inner_.embedding(p); }); }
  void rms_norm(const ops::RmsNormParams& p) override { timed("rms_norm", [&] { inner_.rms_norm(p); }); }
  void linear(const ops::LinearParams& p) override {
    // Split by output width, so the projections and the LM head read apart.
    timed("linear out=" + std::to_string(p.weight.dim(0)), [&] { inner_.linear(p); });
  }
  void linear_lora(const ops::LinearLoraParams& p) override {
    // The projection with its split and LoRA (the backend may fuse them): "linear+lora" when the batch has
    // an adapter on it, "linear" (+ split) otherwise.
    const char* kind = p.token_slot.defined() ? "linear+lora out=" : "linear out=";
    timed(kind + std::to_string(p.linear.weight.dim(0)), [&] { inner_.linear_lora(p); });
  }
  void add(const ops::AddParams& p) override { timed("add", [&] { inner_.add(p); }); }
  void silu_mul(const ops::SiluMulParams& p) override { timed("silu_mul", [&] { inner_.silu_mul(p); }); }
  void gather_rows(const ops::GatherRowsParams& p) override { timed("gather_rows", [&] { inner_.gather_rows(p); }); }
  void split_columns(const ops::SplitColumnsParams& p) override {
    timed("split_columns", [&] { inner_.split_columns(p); });
  }
  void rope(const ops::RopeParams& p) override { timed("rope", [&] { inner_.rope(p); }); }
  void kv_write(const ops::KvWriteParams& p) override { timed("kv_write", [&] { inner_.kv_write(p); }); }
  void rope_kv_write(const ops::RopeParams& r, const ops::KvWriteParams& w) override {
    timed("rope_kv_write", [&] { inner_.rope_kv_write(r, w); });
  }
  void qkv_rope_kv_write(const ops::LinearLoraParams& p, const ops::RopeParams& r, const ops::KvWriteParams& w) override {
    // the fused q|k|v projection with its split, rotation and cache write (one op: the backend may fuse them)
    const char* kind = p.token_slot.defined() ? "q|k|v+lora, rope_kv_write" : "q|k|v, rope_kv_write";
    timed(kind, [&] { inner_.qkv_rope_kv_write(p, r, w); });
  }
  void attention(const ops::AttentionParams& p) override { timed("attention", [&] { inner_.attention(p); }); }
  void router_topk(const ops::RouterTopKParams& p) override { timed("router_topk", [&] { inner_.router_topk(p); }); }
  void route(const ops::RouteParams& p) override { timed("route", [&] { inner_.route(p); }); }
  void moe(const ops::MoeParams& p) override {
    timed(p.lora_gate_up.defined() || p.lora_down.defined() ? "moe (+lora)" : "moe", [&] { inner_.moe(p); });
  }
  void lora(const ops::LoraParams& p) override { timed("lora", [&] { inner_.lora(p); }); }
  void lora_group(std::span<const ops::LoraParams> parts) override {
    timed("lora_group", [&] { inner_.lora_group(parts); });
  }
  void sample(const ops::SamplingParams& p) override { timed("sample", [&] { inner_.sample(p); }); }

  // Graphs only while not profiling (the engine then runs op by op, so every op is seen).
  bool supports_graphs() const override { return !enabled_ && inner_.supports_graphs(); }
  void begin_capture() override { inner_.begin_capture(); }
  int end_capture() override { return inner_.end_capture(); }
  void replay(int graph) override { inner_.replay(graph); }
  void release_graph(int graph) override { inner_.release_graph(graph); }
  uint64_t memory_epoch() const override { return inner_.memory_epoch(); }
  std::unique_ptr<ops::Backend> make_lane(double sm_share, bool lane_first) override {
    return inner_.make_lane(sm_share, lane_first);
  }
  void time_mark(int which) override { inner_.time_mark(which); }
  double marked_seconds() override { return inner_.marked_seconds(); }

  // Forget what was recorded (call between warm-up and the measured steps).
  void reset() {
    cudaStreamSynchronize(inner_.stream());
    marks_.clear();
    totals_.clear();
    next_ = 0;
  }

  // Prints one line per op, largest GPU time first, as per-step figures over `steps` steps.
  void print(int steps, double wall_seconds_per_step) {
    fold();
    std::vector<std::pair<std::string, Total>> rows(totals_.begin(), totals_.end());
    std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.gpu_ms > b.second.gpu_ms; });
    double gpu = 0.0, host = 0.0;
    std::printf("  %-22s %10s %10s %8s   (per step, over %d steps)\n", "op", "GPU ms", "host ms", "calls", steps);
    for (const auto& [name, t] : rows) {
      std::printf("  %-22s %10.3f %10.3f %8.1f\n", name.c_str(), t.gpu_ms / steps, t.host_ms / steps, double(t.calls) / steps);
      gpu += t.gpu_ms / steps;
      host += t.host_ms / steps;
    }
    std::printf("  %-22s %10.3f %10.3f          wall %.3f ms per step\n", "total", gpu, host, wall_seconds_per_step * 1e3);
    totals_.clear();
  }

 private:
  struct Mark {
    std::string name;
    size_t begin, end;
  };
  struct Total {
    double gpu_ms = 0.0, host_ms = 0.0;
    long calls = 0;
  };

  size_t record() {
    if (next_ == events_.size()) {
      cudaEvent_t e;
      cudaEventCreate(&e);
      events_.push_back(e);
    }
    cudaEventRecord(events_[next_], inner_.stream());
    return next_++;
  }

  template <class F>
  void timed(const std::string& name, F&& call) {
    if (!enabled_) {
      call();
      return;
    }
    if (marks_.size() > 50000) fold();
    const size_t begin = record();
    const auto t0 = std::chrono::steady_clock::now();
    call();
    Total& t = totals_[name];
    t.host_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    ++t.calls;
    marks_.push_back({name, begin, record()});
  }

  // Folds the recorded marks into the totals and recycles the events (bounded memory on long runs).
  void fold() {
    cudaStreamSynchronize(inner_.stream());
    for (const Mark& m : marks_) {
      float ms = 0.0f;
      cudaEventElapsedTime(&ms, events_[m.begin], events_[m.end]);
      totals_[m.name].gpu_ms += ms;
    }
    marks_.clear();
    next_ = 0;
  }

  cuda::CudaBackend& inner_;
  bool enabled_ = false;
  std::vector<cudaEvent_t> events_;
  size_t next_ = 0;
  std::vector<Mark> marks_;
  std::map<std::string, Total> totals_;
};

}  // namespace lmx::bench
