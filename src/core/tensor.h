// Tensor: a non-owning, contiguous, row-major view (pointer + dtype + shape + device), trivially copyable
// so it can travel inside kernel Params. Owned memory is a Buffer (host or device) that outlives its views.
// Strides are deliberately absent: every loramux buffer is contiguous; slice along dim 0 with row().
#pragma once
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"

namespace lmx {

enum class Device : uint8_t { kCpu, kCuda };
std::string_view device_name(Device device);

constexpr int kMaxDims = 5;

struct Tensor {
  void* data = nullptr;
  DType dtype = DType::F32;
  Device device = Device::kCpu;
  int ndim = 0;
  int64_t shape[kMaxDims] = {};

  Tensor() = default;
  Tensor(void* data, DType dtype, std::initializer_list<int64_t> dims, Device device = Device::kCpu);
  static Tensor with_shape(void* data, DType dtype, const int64_t* dims, int ndim, Device device = Device::kCpu);

  bool defined() const { return data != nullptr; }
  int64_t dim(int i) const { return shape[i < 0 ? ndim + i : i]; }
  int64_t numel() const;
  size_t nbytes() const { return size_t(numel()) * dtype_size(dtype); }
  // Elements per index of dim 0 (the size of one row()).
  int64_t row_numel() const;
  // The i-th slice along dim 0, with one dim fewer.
  Tensor row(int64_t i) const;
  // Rows [begin, end) along dim 0, same ndim.
  Tensor rows(int64_t begin, int64_t end) const;
  // Same data, new shape; numel must match (checked).
  Tensor reshape(std::initializer_list<int64_t> dims) const;
  template <typename T> T* ptr() const { return static_cast<T*>(data); }
  std::string dims_str() const;   // "[4, 8]"
  std::string shape_str() const;  // "[4, 8] BF16"
  bool same_shape(const Tensor& other) const;
};

// "[4, 8]": how every error message spells a shape.
std::string dims_str(const int64_t* dims, int ndim);
inline std::string dims_str(const std::vector<int64_t>& dims) { return dims_str(dims.data(), int(dims.size())); }

// Check that `t` has the given dtype and shape (-1 = any size on that dim), naming it in the error.
Status expect_tensor(const Tensor& t, const std::string& name, DType dtype, std::initializer_list<int64_t> dims);

// Owned memory. Host buffers are 64-byte aligned; device buffers come from the backend that made them.
class Buffer {
 public:
  Buffer() = default;
  Buffer(void* data, size_t bytes, Device device, std::function<void(void*)> release);
  static Buffer host(size_t bytes);
  void* data() const { return data_.get(); }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }

 private:
  std::shared_ptr<void> data_;
  size_t bytes_ = 0;
  Device device_ = Device::kCpu;
};

// A Buffer and the Tensor view over all of it; copies share the buffer.
struct OwnedTensor {
  Buffer buffer;
  Tensor view;
  static OwnedTensor host(DType dtype, std::initializer_list<int64_t> dims);
  static OwnedTensor host_like(const Tensor& shape_of, DType dtype);
  operator const Tensor&() const { return view; }  // NOLINT: a view is what every op takes
};

}  // namespace lmx
