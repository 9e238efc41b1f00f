// safetensors reading (memory-mapped) and writing. Shared by the model loader and the adapter loader.
// Reading validates the header completely (JSON shape, dtypes, offsets inside the file, no overlap) so a
// truncated or hostile file is an error naming the file and tensor, never a crash.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"

namespace lmx::io {

// A read-only memory mapping of a whole file.
class MappedFile {
 public:
  static Result<std::shared_ptr<MappedFile>> open(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  MappedFile() = default;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  std::string path_;
};

struct TensorInfo {
  DType dtype;
  std::vector<int64_t> shape;
  size_t begin = 0, end = 0;  // byte offsets into the data section
};

// Parse a safetensors header from raw bytes (the 8-byte length + JSON); the fuzz target's entry point.
// `file_size` bounds the data offsets; `source` names the file in errors.
Status parse_safetensors_header(const uint8_t* bytes, size_t size, const std::string& source,
                                std::map<std::string, TensorInfo>* tensors,
                                std::map<std::string, std::string>* metadata, size_t* data_offset);

// One .safetensors file, mapped.
class SafetensorsFile {
 public:
  static Result<SafetensorsFile> open(const std::string& path);
  const std::map<std::string, TensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }
  // A host view into the mapping (valid while this object or mapping() lives).
  Result<Tensor> tensor(const std::string& name) const;
  const std::shared_ptr<MappedFile>& mapping() const { return file_; }
  const std::string& path() const { return file_->path(); }

 private:
  std::shared_ptr<MappedFile> file_;
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
  size_t data_offset_ = 0;
};

// All tensors of a model directory: `model.safetensors`, or the shards listed in
// `model.safetensors.index.json`, or (no index) every *.safetensors file in the directory.
class Checkpoint {
 public:
  static Result<Checkpoint> open(const std::string& dir);
  bool contains(const std::string& name) const { return where_.count(name) != 0; }
  Result<Tensor> tensor(const std::string& name) const;  // error names the tensor and directory
  std::vector<std::string> names() const;
  std::vector<std::shared_ptr<void>> mappings() const;   // keep-alive handles for the views

 private:
  std::string dir_;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, size_t> where_;  // tensor name -> index into files_
};

// Write tensors (host views) with optional metadata to `path`.
Status write_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                         const std::map<std::string, std::string>& metadata = {});

// Read a whole text file.
Result<std::string> read_text_file(const std::string& path);

}  // namespace lmx::io
