// Backend helpers shared by every backend: allocation of typed tensors, uploads, contract enforcement.
#include "ops/backend.h"

#include <cstdio>
#include <cstdlib>

namespace lmx::ops {

OwnedTensor Backend::empty(DType dtype, std::initializer_list<int64_t> dims) {
  OwnedTensor o;
  o.view = Tensor(nullptr, dtype, dims, device());
  o.buffer = allocate(o.view.nbytes());
  o.view.data = o.buffer.data();
  return o;
}

OwnedTensor Backend::upload(const Tensor& host) {
  OwnedTensor o;
  o.view = Tensor::with_shape(nullptr, host.dtype, host.shape, host.ndim, device());
  o.buffer = allocate(o.view.nbytes());
  o.view.data = o.buffer.data();
  copy(o.view, host);
  return o;
}

void require(const Status& status, const char* op) {
  if (status.ok()) return;
  std::fprintf(stderr, "loramux: %s called against its contract: %s\n", op, status.message().c_str());
  std::abort();
}

}  // namespace lmx::ops
