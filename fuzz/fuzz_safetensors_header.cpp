// libFuzzer target: arbitrary bytes as a whole safetensors file through parse_safetensors_header.
// Any crash, sanitizer report or hang is a bug; an error Status is the expected outcome for junk.
// Built only with -DLORAMUX_FUZZ=ON and clang (see fuzz/README.md).
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::map<std::string, lmx::io::TensorInfo> tensors;
  std::map<std::string, std::string> metadata;
  size_t data_offset = 0;
  lmx::Status status = lmx::io::parse_safetensors_header(data, size, "fuzz-input", &tensors, &metadata, &data_offset);
  if (status.ok()) {
    // Invariants a successful parse promises to every reader.
    for (const auto& [name, info] : tensors) {
      if (info.begin > info.end || data_offset + info.end > size) __builtin_trap();
    }
  }
  return 0;
}
