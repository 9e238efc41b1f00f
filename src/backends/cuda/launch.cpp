// The PDL knob of launch.cuh (a process-wide bench setting, like set_moe_gemm_kernel).
#include "backends/cuda/launch.cuh"

#include <atomic>

namespace lmx::cuda {
namespace {
std::atomic<bool> programmatic{true};
}  // namespace

void set_programmatic_launches(bool on) { programmatic.store(on); }
bool programmatic_launches() { return programmatic.load(std::memory_order_relaxed); }

}  // namespace lmx::cuda
