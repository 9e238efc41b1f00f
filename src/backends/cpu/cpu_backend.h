// CpuBackend: the reference implementation of every op in ops/*.h — plain loops, fp32 activations and
// accumulation, bf16 weights widened on read. It is the oracle the CUDA backend is tested against and runs
// the small-model tests, so it favours clarity and a fixed summation order over speed; loops over rows are
// split across the backend's own threads without changing any result. Who calls: model, engine, tests.
#pragma once
#include <memory>

#include "backends/cpu/thread_pool.h"
#include "ops/backend.h"

namespace lmx::cpu {

class CpuBackend : public ops::Backend {
 public:
  // num_threads <= 0: one per hardware thread. Results are identical for every thread count.
  explicit CpuBackend(int num_threads = 0);

  Device device() const override { return Device::kCpu; }
  DType activation_dtype() const override { return DType::F32; }
  DType lora_dtype() const override { return DType::F32; }
  int num_threads() const { return pool_.num_threads(); }

  Buffer allocate(size_t bytes) override;
  void copy(const Tensor& dst, const Tensor& src) override;
  void fill_zero(const Tensor& dst) override;
  void synchronize() override {}
  // The prefill lane's backend: another pool of as many threads (work of both runs at once).
  std::unique_ptr<ops::Backend> make_lane(double /*sm_share*/, bool /*lane_first*/) override { return std::make_unique<CpuBackend>(num_threads()); }
  uint64_t available_bytes() const override;
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
  void attention(const ops::AttentionParams& p) override;
  void router_topk(const ops::RouterTopKParams& p) override;
  void moe(const ops::MoeParams& p) override;
  void lora(const ops::LoraParams& p) override;
  void sample(const ops::SamplingParams& p) override;

 private:
  ThreadPool pool_;
};

}  // namespace lmx::cpu
