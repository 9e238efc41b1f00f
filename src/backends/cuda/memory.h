// Device memory for the CUDA kernels, their tests and benchmarks: cudaMalloc'd Buffers (released with
// cudaFree) and synchronous copies between host and device tensors. No caching allocator: buffers are
// allocated once at start-up (design.md §3), so plain cudaMalloc is enough. No CUDA types in this header.
#pragma once
#include <cstdint>
#include <initializer_list>

#include "core/tensor.h"

namespace lmx::cuda {

// `bytes` of device memory on the current device, freed when the last copy of the Buffer goes.
Buffer allocate(size_t bytes);

// A device tensor (contents undefined) and the Buffer that owns it.
OwnedTensor empty(DType dtype, std::initializer_list<int64_t> dims);
OwnedTensor empty_like(const Tensor& shape_of, DType dtype);

// Same dtype and numel; either side may be host or device memory. Synchronous.
void copy(const Tensor& dst, const Tensor& src);

// A device copy of a host tensor, and a host copy of a device tensor. Synchronous.
OwnedTensor upload(const Tensor& host);
OwnedTensor download(const Tensor& device);

// Set every byte of a device tensor (tests poison outputs with 0xff: bf16 0xffff is a NaN). Synchronous.
void fill_bytes(const Tensor& dst, uint8_t byte);

}  // namespace lmx::cuda
