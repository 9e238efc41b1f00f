// Tensor view helpers and host Buffers.
#include "core/tensor.h"

#include <cstdlib>
#include <sstream>

namespace lmx {

std::string_view device_name(Device device) { return device == Device::kCpu ? "cpu" : "cuda"; }

Tensor::Tensor(void* data_, DType dtype_, std::initializer_list<int64_t> dims, Device device_)
    : data(data_), dtype(dtype_), device(device_) {
  LMX_CHECK(dims.size() <= kMaxDims);
  for (int64_t d : dims) shape[ndim++] = d;
}

Tensor Tensor::with_shape(void* data, DType dtype, const int64_t* dims, int ndim, Device device) {
  LMX_CHECK(ndim <= kMaxDims);
  Tensor t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  t.ndim = ndim;
  for (int i = 0; i < ndim; ++i) t.shape[i] = dims[i];
  return t;
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return n;
}

int64_t Tensor::row_numel() const {
  int64_t n = 1;
  for (int i = 1; i < ndim; ++i) n *= shape[i];
  return n;
}

Tensor Tensor::row(int64_t i) const {
  LMX_CHECK(ndim >= 1 && i >= 0 && i < shape[0]);
  Tensor t = with_shape(static_cast<char*>(data) + size_t(i * row_numel()) * dtype_size(dtype), dtype,
                        shape + 1, ndim - 1, device);
  return t;
}

Tensor Tensor::rows(int64_t begin, int64_t end) const {
  LMX_CHECK(ndim >= 1 && begin >= 0 && begin <= end && end <= shape[0]);
  Tensor t = *this;
  t.data = static_cast<char*>(data) + size_t(begin * row_numel()) * dtype_size(dtype);
  t.shape[0] = end - begin;
  return t;
}

Tensor Tensor::reshape(std::initializer_list<int64_t> dims) const {
  Tensor t(data, dtype, dims, device);
  LMX_CHECK(t.numel() == numel());
  return t;
}

std::string dims_str(const int64_t* dims, int ndim) {
  std::ostringstream os;
  os << '[';
  for (int i = 0; i < ndim; ++i) os << (i ? ", " : "") << dims[i];
  os << ']';
  return os.str();
}

std::string Tensor::dims_str() const { return lmx::dims_str(shape, ndim); }

std::string Tensor::shape_str() const { return dims_str() + " " + std::string(dtype_name(dtype)); }

bool Tensor::same_shape(const Tensor& other) const {
  if (ndim != other.ndim) return false;
  for (int i = 0; i < ndim; ++i)
    if (shape[i] != other.shape[i]) return false;
  return true;
}

Status expect_tensor(const Tensor& t, const std::string& name, DType dtype, std::initializer_list<int64_t> dims) {
  std::ostringstream want;
  want << '[';
  int i = 0;
  for (int64_t d : dims) want << (i++ ? ", " : "") << (d < 0 ? std::string("*") : std::to_string(d));
  want << "] " << dtype_name(dtype);
  bool ok = t.dtype == dtype && t.ndim == int(dims.size());
  i = 0;
  for (int64_t d : dims) {
    if (ok && d >= 0 && t.shape[i] != d) ok = false;
    ++i;
  }
  if (ok) return Status::Ok();
  return invalid_argument(name + ": expected " + want.str() + ", found " + t.shape_str());
}

Buffer::Buffer(void* data, size_t bytes, Device device, std::function<void(void*)> release)
    : data_(data, std::move(release)), bytes_(bytes), device_(device) {}

Buffer Buffer::host(size_t bytes) {
  size_t rounded = (bytes + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, rounded ? rounded : 64);
  LMX_CHECK(p != nullptr);
  return Buffer(p, bytes, Device::kCpu, [](void* q) { std::free(q); });
}

OwnedTensor OwnedTensor::host(DType dtype, std::initializer_list<int64_t> dims) {
  OwnedTensor o;
  o.view = Tensor(nullptr, dtype, dims);
  o.buffer = Buffer::host(o.view.nbytes());
  o.view.data = o.buffer.data();
  return o;
}

OwnedTensor OwnedTensor::host_like(const Tensor& shape_of, DType dtype) {
  OwnedTensor o;
  o.view = Tensor::with_shape(nullptr, dtype, shape_of.shape, shape_of.ndim);
  o.buffer = Buffer::host(o.view.nbytes());
  o.view.data = o.buffer.data();
  return o;
}

}  // namespace lmx
