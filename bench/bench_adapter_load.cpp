// bench_adapter_load: the host side of putting an adapter into a LoRA slot for a preset's shapes. Two
// parts: SlotTable::prepare (validation, padding, f32 -> bf16 with experts in parallel), which the adapter
// loader's worker runs when an adapter enters the host tier, and SlotTable::load of the prepared image —
// what a request for a not-yet-resident adapter waits for on the engine thread. The slots live in host
// memory here (a CPU backend whose LoRA dtype is BF16, as on the GPU), so the load is a host memcpy; on
// the GPU it is a host-to-device transfer instead.
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
  for (int i = 0; i < loads; ++i) {
    t0 = now_ms();
    Result<lora::SlotImage> image = slots.prepare(adapter);  // the loader's worker, off the engine thread
    const double prepare_ms = now_ms() - t0;
    if (!image.ok()) {
      std::fprintf(stderr, "bench_adapter_load: %s\n", image.status().message().c_str());
      return 1;
    }
    t0 = now_ms();
    const Status status = slots.load(0, *image);  // the engine thread: copies only
    const double load_ms = now_ms() - t0;
    if (!status.ok()) {
      std::fprintf(stderr, "bench_adapter_load: %s\n", status.message().c_str());
      return 1;
    }
    const double gb = double(image->bytes()) / 1e9;
    std::printf("round %d: prepare %8.1f ms (loader thread), slot load %8.1f ms (engine thread: %.2f GB, %.2f GB/s)\n",
                i, prepare_ms, load_ms, gb, gb * 1e3 / load_ms);
  }
  return 0;
}
