// cudaMalloc-backed Buffers and synchronous host<->device copies (see memory.h).
#include "backends/cuda/memory.h"

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "backends/cuda/check.h"

namespace lmx::cuda {

Buffer allocate(size_t bytes) {
  void* data = nullptr;
  if (bytes > 0) LMX_CUDA_CHECK(cudaMalloc(&data, bytes));
  // cudaFree's status is ignored on purpose: a Buffer outliving the CUDA runtime (static teardown at exit)
  // gets cudaErrorCudartUnloading, and there is nothing left to free then.
  return Buffer(data, bytes, Device::kCuda, [](void* p) {
    if (p) (void)cudaFree(p);
  });
}

OwnedTensor empty(DType dtype, std::initializer_list<int64_t> dims) {
  OwnedTensor o;
  o.view = Tensor(nullptr, dtype, dims, Device::kCuda);
  o.buffer = allocate(o.view.nbytes());
  o.view.data = o.buffer.data();
  return o;
}

OwnedTensor empty_like(const Tensor& shape_of, DType dtype) {
  OwnedTensor o;
  o.view = Tensor::with_shape(nullptr, dtype, shape_of.shape, shape_of.ndim, Device::kCuda);
  o.buffer = allocate(o.view.nbytes());
  o.view.data = o.buffer.data();
  return o;
}

void copy(const Tensor& dst, const Tensor& src) {
  if (dst.dtype != src.dtype || dst.numel() != src.numel()) {
    std::fprintf(stderr, "loramux: cuda::copy: dst %s and src %s differ in dtype or size\n", dst.shape_str().c_str(),
                 src.shape_str().c_str());
    std::abort();
  }
  if (src.nbytes() == 0) return;
  // cudaMemcpyDefault infers the direction from the pointers (unified addressing, every 64-bit platform).
  LMX_CUDA_CHECK(cudaMemcpy(dst.data, src.data, src.nbytes(), cudaMemcpyDefault));
}

OwnedTensor upload(const Tensor& host) {
  OwnedTensor o = empty_like(host, host.dtype);
  copy(o.view, host);
  return o;
}

OwnedTensor download(const Tensor& device) {
  OwnedTensor o = OwnedTensor::host_like(device, device.dtype);
  copy(o.view, device);
  return o;
}

void fill_bytes(const Tensor& dst, uint8_t byte) {
  if (dst.nbytes() == 0) return;
  LMX_CUDA_CHECK(cudaMemset(dst.data, byte, dst.nbytes()));
}

}  // namespace lmx::cuda
