// bench_adapter_load: the host side of putting an adapter into a LoRA slot (lora::SlotTable::load) for a
// preset's shapes — what a request for a not-yet-resident adapter waits for on the engine thread. The
// slots live in host memory here (a CPU backend whose LoRA dtype is BF16, as on the GPU), so the row is
// the staging (padding + f32 -> bf16, experts in parallel) plus a host memcpy; on the GPU the copy is a
// host-to-device transfer instead. Prints ms per load and GB/s of slot bytes written.
// Usage: bench_adapter_load [--model preset:gpt-oss-20b] [--rank 32] [--loads 3]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "backends/cpu/cpu_backend.h"
#include "engine/engine.h"
#include "lora/adapter.h"
#include "lora/slots.h"
#include "model/presets.h"

namespace {

// The CPU backend with BF16 LoRA stacks (the CUDA backend's dtype), so load() converts like it does there.
class Bf16LoraCpuBackend final : public lmx::cpu::CpuBackend {
 public:
  using CpuBackend::CpuBackend;
  lmx::DType lora_dtype() const override { return lmx::DType::BF16; }
};

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

int main(int argc, char** argv) {
  using namespace lmx;
  std::string model = "preset:gpt-oss-20b";
  int rank = 32, loads = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string key = argv[i], value = argv[i + 1];
    if (key == "--model") model = value;
    else if (key == "--rank") rank = std::atoi(value.c_str());
    else if (key == "--loads") loads = std::atoi(value.c_str());
    else {
      std::fprintf(stderr, "bench_adapter_load: unknown flag %s\n", key.c_str());
      return 2;
    }
  }
  Result<model::ModelConfig> config = model::preset_config(model);
  if (!config.ok()) {
    std::fprintf(stderr, "bench_adapter_load: %s\n", config.status().message().c_str());
    return 2;
  }
  const lora::BaseModelShapes shapes = engine::lora_shapes(*config);
  double t0 = now_ms();
  const lora::Adapter adapter = lora::make_dummy_adapter("bench", shapes, rank, 1);
  std::printf("bench_adapter_load: %s, rank %d: dummy adapter made in %.0f ms (max rank %d)\n", model.c_str(), rank,
              now_ms() - t0, adapter.max_rank);
  Bf16LoraCpuBackend backend(1);
  lora::SlotTable slots(backend, shapes, 1, rank);
  uint64_t slot_bytes = 0;
  for (int i = 0; i < loads; ++i) {
    t0 = now_ms();
    const Status status = slots.load(0, adapter);
    const double ms = now_ms() - t0;
    if (!status.ok()) {
      std::fprintf(stderr, "bench_adapter_load: %s\n", status.message().c_str());
      return 1;
    }
    if (slot_bytes == 0) {
      for (int layer = 0; layer < shapes.num_layers; ++layer) {
        for (int t = 0; t < ops::kNumLoraTargets; ++t) {
          const ops::LoraStack s = slots.stack(layer, ops::LoraTarget(t));
          if (s.defined()) slot_bytes += s.a.nbytes() + s.b.nbytes();
        }
      }
    }
    std::printf("load %d: %8.1f ms  (%.2f GB of bf16 slot, %.2f GB/s)\n", i, ms, double(slot_bytes) / 1e9,
                double(slot_bytes) / 1e6 / ms);
  }
  return 0;
}
