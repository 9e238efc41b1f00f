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

void Backend::linear_lora(const LinearLoraParams& p) {
  require(check(p), "linear_lora");
  linear(p.linear);
  const bool split = p.parts[0].defined();
  if (split) split_columns({.x = p.linear.out, .parts = p.parts});
  if (p.token_slot.defined()) lora_outputs(p);
}

void Backend::route(const RouteParams& p) {
  require(check(p), "route");
  linear(p.linear());
  router_topk(p.topk());
}

void Backend::lora_outputs(const LinearLoraParams& p) {
  const bool split = p.parts[0].defined();
  LoraParams parts[3];
  size_t count = 0;
  for (size_t i = 0; i < p.lora.size(); ++i) {
    if (!p.lora[i].defined()) continue;
    parts[count++] = {.x = p.linear.x, .token_slot = p.token_slot, .w = p.lora[i], .y = split ? p.parts[i] : p.linear.out};
  }
  if (count == 1) lora(parts[0]);
  else if (count > 1) lora_group(std::span<const LoraParams>(parts, count));
}

void require(const Status& status, const char* op) {
  if (status.ok()) return;
  std::fprintf(stderr, "loramux: %s called against its contract: %s\n", op, status.message().c_str());
  std::abort();
}

}  // namespace lmx::ops
