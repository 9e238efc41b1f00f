// safetensors: POSIX memory mapping, complete header validation, checkpoint directories (single file,
// index.json shards, or a bare set of files) and the writer. Errors name the file and the tensor.
// Callers: model/loader.cpp, lora/ (adapter loading), tests and the header fuzz target.
#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

namespace lmx::io {
namespace {

using json = nlohmann::json;

// The reference implementation refuses headers above 100 MB; so do we, which also bounds the JSON
// parser's memory on hostile input.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

std::string in_quotes(const std::string& s) { return "'" + s + "'"; }

std::string errno_text() { return std::strerror(errno); }

// A JSON value for an error message, bounded: hostile headers may hold huge or deeply nested values, and
// dump() recurses, so containers are only described.
std::string brief(const json& v) {
  if (v.is_array()) return "an array of " + std::to_string(v.size());
  if (v.is_object()) return "an object of " + std::to_string(v.size());
  std::string text = v.dump();
  if (text.size() > 64) text = text.substr(0, 60) + "...";
  return text;
}


// A JSON value as a non-negative integer that fits in int64 (safetensors shapes and offsets).
bool as_count(const json& v, uint64_t* out) {
  if (v.is_number_unsigned()) {
    *out = v.get<uint64_t>();
    return *out <= uint64_t(INT64_MAX);
  }
  if (v.is_number_integer()) {
    int64_t s = v.get<int64_t>();
    if (s < 0) return false;
    *out = uint64_t(s);
    return true;
  }
  return false;
}

Status parse_entry(const std::string& source, const std::string& name, const json& entry, size_t data_size,
                   TensorInfo* info) {
  const std::string where = source + ": tensor " + in_quotes(name);
  if (!entry.is_object()) return invalid_argument(where + ": header entry must be a JSON object, found " + entry.type_name());
  // Unknown fields are ignored, as the reference reader does.
  auto dtype_it = entry.find("dtype");
  if (dtype_it == entry.end()) return invalid_argument(where + ": missing field 'dtype'");
  if (!dtype_it->is_string()) return invalid_argument(where + ": field 'dtype' must be a string, found " + dtype_it->type_name());
  const std::string dtype = dtype_it->get<std::string>();
  if (!dtype_from_name(dtype, &info->dtype))
    return unsupported(where + ": dtype " + in_quotes(dtype) +
                       " is not one loramux reads (F32, BF16, F16, I32, I64, U8, I8, F8_E8M0)");

  auto shape_it = entry.find("shape");
  if (shape_it == entry.end()) return invalid_argument(where + ": missing field 'shape'");
  if (!shape_it->is_array()) return invalid_argument(where + ": field 'shape' must be an array, found " + shape_it->type_name());
  uint64_t numel = 1;
  bool numel_overflow = false;
  info->shape.clear();
  for (const json& d : *shape_it) {
    uint64_t n = 0;
    if (!as_count(d, &n)) return invalid_argument(where + ": 'shape' entries must be non-negative integers, found " + brief(d));
    info->shape.push_back(int64_t(n));
    if (!numel_overflow && __builtin_mul_overflow(numel, n, &numel)) numel_overflow = true;
  }
  uint64_t expected_bytes = 0;
  if (numel_overflow || __builtin_mul_overflow(numel, uint64_t(dtype_size(info->dtype)), &expected_bytes))
    return invalid_argument(where + ": shape " + dims_str(info->shape) + " overflows a 64-bit byte count");

  auto offsets_it = entry.find("data_offsets");
  if (offsets_it == entry.end()) return invalid_argument(where + ": missing field 'data_offsets'");
  if (!offsets_it->is_array() || offsets_it->size() != 2)
    return invalid_argument(where + ": field 'data_offsets' must be an array [begin, end], found " + brief(*offsets_it));
  uint64_t begin = 0, end = 0;
  if (!as_count((*offsets_it)[0], &begin) || !as_count((*offsets_it)[1], &end))
    return invalid_argument(where + ": 'data_offsets' must be non-negative integers, found [" +
                            brief((*offsets_it)[0]) + ", " + brief((*offsets_it)[1]) + "]");
  if (begin > end)
    return invalid_argument(where + ": data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                            "] has begin after end");
  if (end > data_size)
    return out_of_range(where + ": data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                        "] reach past the data section of " + std::to_string(data_size) + " bytes (truncated file?)");
  if (end - begin != expected_bytes)
    return invalid_argument(where + ": " + dtype + " " + dims_str(info->shape) + " needs " +
                            std::to_string(expected_bytes) + " bytes, data_offsets [" + std::to_string(begin) + ", " +
                            std::to_string(end) + "] hold " + std::to_string(end - begin));
  info->begin = size_t(begin);
  info->end = size_t(end);
  return Status::Ok();
}

Status parse_metadata(const std::string& source, const json& value, std::map<std::string, std::string>* metadata) {
  if (!value.is_object())
    return invalid_argument(source + ": '__metadata__' must be an object of strings, found " + value.type_name());
  for (const auto& [key, v] : value.items()) {
    if (!v.is_string())
      return invalid_argument(source + ": '__metadata__' entry " + in_quotes(key) + " must be a string, found " + v.type_name());
    (*metadata)[key] = v.get<std::string>();
  }
  return Status::Ok();
}

bool is_regular_file(const std::string& path) {
  std::error_code ec;
  return std::filesystem::is_regular_file(path, ec);
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
// MappedFile

Result<std::shared_ptr<MappedFile>> MappedFile::open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return io_error(path + ": cannot open: " + errno_text());
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    std::string e = errno_text();
    ::close(fd);
    return io_error(path + ": cannot stat: " + e);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return io_error(path + ": not a regular file");
  }
  std::shared_ptr<MappedFile> file(new MappedFile());
  file->path_ = path;
  file->size_ = size_t(st.st_size);
  if (file->size_ > 0) {
    void* p = ::mmap(nullptr, file->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      std::string e = errno_text();
      ::close(fd);
      return io_error(path + ": mmap of " + std::to_string(file->size_) + " bytes failed: " + e);
    }
    file->data_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);  // the mapping stays valid without the descriptor
  return file;
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
}

// ---------------------------------------------------------------------------------------------------
// Header

Status parse_safetensors_header(const uint8_t* bytes, size_t size, const std::string& source,
                                std::map<std::string, TensorInfo>* tensors,
                                std::map<std::string, std::string>* metadata, size_t* data_offset) {
  tensors->clear();
  metadata->clear();
  if (size < 8)
    return invalid_argument(source + ": file is " + std::to_string(size) +
                            " bytes, too short for the 8-byte header length (truncated or not safetensors)");
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | bytes[i];  // little-endian
  if (header_len > kMaxHeaderBytes)
    return invalid_argument(source + ": header length " + std::to_string(header_len) + " exceeds the " +
                            std::to_string(kMaxHeaderBytes) + "-byte limit (corrupt or not safetensors)");
  if (header_len > size - 8)
    return out_of_range(source + ": header length " + std::to_string(header_len) + " reaches past the end of the " +
                        std::to_string(size) + "-byte file (truncated?)");
  if (header_len < 2 || bytes[8] != '{')
    return invalid_argument(source + ": header does not start with a JSON object '{'");

  // Duplicate keys are legal JSON but ambiguous here; nlohmann keeps the last silently, so catch them
  // with the parser callback at depth 1 (tensor names and __metadata__).
  std::set<std::string> seen;
  std::string duplicate;
  auto on_event = [&](int depth, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::key && depth == 1 && parsed.is_string()) {
      const std::string& key = parsed.get_ref<const std::string&>();
      if (!seen.insert(key).second && duplicate.empty()) duplicate = key;
    }
    return true;
  };
  json header;
  try {
    header = json::parse(bytes + 8, bytes + 8 + header_len, on_event, /*allow_exceptions=*/true);
  } catch (const json::exception& e) {
    return invalid_argument(source + ": header is not valid JSON: " + e.what());
  }
  if (!duplicate.empty()) return invalid_argument(source + ": header lists " + in_quotes(duplicate) + " twice");
  if (!header.is_object()) return invalid_argument(source + ": header must be a JSON object, found " + header.type_name());

  const size_t data_begin = size_t(8 + header_len);
  const size_t data_size = size - data_begin;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      LMX_RETURN_IF_ERROR(parse_metadata(source, entry, metadata));
      continue;
    }
    TensorInfo info;
    LMX_RETURN_IF_ERROR(parse_entry(source, name, entry, data_size, &info));
    tensors->emplace(name, std::move(info));
  }

  // No two tensors may share bytes. Gaps are tolerated (the reference writer never makes them, but they
  // are harmless). Empty tensors occupy no bytes and cannot overlap anything.
  std::vector<std::pair<const std::string*, const TensorInfo*>> by_offset;
  for (const auto& [name, info] : *tensors)
    if (info.end > info.begin) by_offset.emplace_back(&name, &info);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const auto& a, const auto& b) { return a.second->begin < b.second->begin; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const auto& prev = by_offset[i - 1];
    const auto& cur = by_offset[i];
    if (cur.second->begin < prev.second->end)
      return invalid_argument(source + ": tensors " + in_quotes(*prev.first) + " [" + std::to_string(prev.second->begin) +
                              ", " + std::to_string(prev.second->end) + ") and " + in_quotes(*cur.first) + " [" +
                              std::to_string(cur.second->begin) + ", " + std::to_string(cur.second->end) +
                              ") overlap in the data section");
  }
  *data_offset = data_begin;
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------------
// SafetensorsFile

Result<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  LMX_ASSIGN_OR_RETURN(auto mapping, MappedFile::open(path));
  SafetensorsFile file;
  LMX_RETURN_IF_ERROR(parse_safetensors_header(mapping->data(), mapping->size(), path, &file.tensors_,
                                               &file.metadata_, &file.data_offset_));
  file.file_ = std::move(mapping);
  return file;
}

Result<Tensor> SafetensorsFile::tensor(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) return not_found(path() + ": no tensor " + in_quotes(name));
  const TensorInfo& info = it->second;
  if (info.shape.size() > size_t(kMaxDims))
    return unsupported(path() + ": tensor " + in_quotes(name) + " has " + std::to_string(info.shape.size()) +
                       " dims, loramux tensors hold at most " + std::to_string(kMaxDims));
  // A parsed file is at least 8 bytes, so the mapping exists. The view is as aligned as the file makes it:
  // the reference writer pads the header to 8 bytes, so data_offset_ is 8-aligned in practice.
  const uint8_t* base = file_->data() + data_offset_ + info.begin;
  return Tensor::with_shape(const_cast<uint8_t*>(base), info.dtype, info.shape.data(), int(info.shape.size()));
}

// ---------------------------------------------------------------------------------------------------
// Checkpoint

Result<Checkpoint> Checkpoint::open(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return not_found(dir + ": not a directory");
  Checkpoint ckpt;
  ckpt.dir_ = dir;
  const std::string index_path = (fs::path(dir) / "model.safetensors.index.json").string();
  const std::string single_path = (fs::path(dir) / "model.safetensors").string();

  auto add_file = [&](const std::string& path) -> Result<size_t> {
    LMX_ASSIGN_OR_RETURN(auto file, SafetensorsFile::open(path));
    ckpt.files_.push_back(std::move(file));
    return ckpt.files_.size() - 1;
  };

  if (is_regular_file(index_path)) {
    LMX_ASSIGN_OR_RETURN(std::string text, read_text_file(index_path));
    json index;
    try {
      index = json::parse(text);
    } catch (const json::exception& e) {
      return invalid_argument(index_path + ": not valid JSON: " + e.what());
    }
    if (!index.is_object()) return invalid_argument(index_path + ": must be a JSON object, found " + index.type_name());
    auto map_it = index.find("weight_map");
    if (map_it == index.end()) return invalid_argument(index_path + ": missing field 'weight_map'");
    if (!map_it->is_object())
      return invalid_argument(index_path + ": field 'weight_map' must be an object, found " + map_it->type_name());
    std::map<std::string, size_t> shard_index;  // shard file name -> files_ index
    for (const auto& [name, shard_value] : map_it->items()) {
      if (!shard_value.is_string())
        return invalid_argument(index_path + ": weight_map entry " + in_quotes(name) + " must be a file name string");
      const std::string shard = shard_value.get<std::string>();
      fs::path shard_rel(shard);
      bool escapes = shard_rel.is_absolute();
      for (const auto& part : shard_rel)
        if (part == "..") escapes = true;
      if (shard.empty() || escapes)
        return invalid_argument(index_path + ": weight_map entry " + in_quotes(name) + " names shard " + in_quotes(shard) +
                                " outside the model directory");
      auto sit = shard_index.find(shard);
      if (sit == shard_index.end()) {
        const std::string shard_path = (fs::path(dir) / shard_rel).string();
        auto added = add_file(shard_path);
        if (!added.ok()) return added.status().with_context(index_path + " lists shard " + in_quotes(shard));
        sit = shard_index.emplace(shard, added.value()).first;
      }
      if (!ckpt.files_[sit->second].contains(name))
        return not_found(index_path + ": tensor " + in_quotes(name) + " is listed in shard " + in_quotes(shard) +
                         " but missing from " + ckpt.files_[sit->second].path());
      ckpt.where_[name] = sit->second;
    }
    // Tensors present in a shard but absent from the index are still served (harmless extras).
    for (size_t i = 0; i < ckpt.files_.size(); ++i)
      for (const auto& [name, info] : ckpt.files_[i].tensors()) ckpt.where_.emplace(name, i);
    return ckpt;
  }

  std::vector<std::string> paths;
  if (is_regular_file(single_path)) {
    paths.push_back(single_path);
  } else {
    for (const auto& entry : fs::directory_iterator(dir, ec)) {
      if (entry.path().extension() == ".safetensors" && entry.is_regular_file()) paths.push_back(entry.path().string());
    }
    if (ec) return io_error(dir + ": cannot list directory: " + ec.message());
    std::sort(paths.begin(), paths.end());
  }
  if (paths.empty())
    return not_found(dir + ": no model.safetensors, model.safetensors.index.json or *.safetensors file");
  for (const auto& path : paths) {
    LMX_ASSIGN_OR_RETURN(size_t i, add_file(path));
    for (const auto& [name, info] : ckpt.files_[i].tensors()) {
      auto [it, inserted] = ckpt.where_.emplace(name, i);
      if (!inserted)
        return invalid_argument(dir + ": tensor " + in_quotes(name) + " appears in both " + ckpt.files_[it->second].path() +
                                " and " + path);
    }
  }
  return ckpt;
}

Result<Tensor> Checkpoint::tensor(const std::string& name) const {
  auto it = where_.find(name);
  if (it == where_.end()) return not_found(dir_ + ": checkpoint has no tensor " + in_quotes(name));
  return files_[it->second].tensor(name);
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  out.reserve(where_.size());
  for (const auto& [name, index] : where_) out.push_back(name);
  return out;
}

std::vector<std::shared_ptr<void>> Checkpoint::mappings() const {
  std::vector<std::shared_ptr<void>> out;
  for (const auto& f : files_) out.push_back(std::static_pointer_cast<void>(std::const_pointer_cast<MappedFile>(f.mapping())));
  return out;
}

// ---------------------------------------------------------------------------------------------------
// Writing

Status write_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                         const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) {
    json meta = json::object();
    for (const auto& [k, v] : metadata) meta[k] = v;
    header["__metadata__"] = std::move(meta);
  }
  // Data order: larger elements first (stable otherwise), as the reference writer does, so that every
  // tensor starts aligned to its element size once the header is padded to 8 bytes.
  std::vector<const std::pair<std::string, Tensor>*> order;
  for (const auto& entry : tensors) order.push_back(&entry);
  std::stable_sort(order.begin(), order.end(), [](const auto* a, const auto* b) {
    return dtype_size(a->second.dtype) > dtype_size(b->second.dtype);
  });
  size_t offset = 0;
  for (const auto* entry : order) {
    const auto& [name, t] = *entry;
    if (name == "__metadata__") return invalid_argument(path + ": '__metadata__' cannot name a tensor");
    if (header.contains(name)) return invalid_argument(path + ": tensor " + in_quotes(name) + " given twice");
    if (t.device != Device::kCpu)
      return invalid_argument(path + ": tensor " + in_quotes(name) + " is on " + std::string(device_name(t.device)) +
                              ", write_safetensors takes host tensors");
    if (t.numel() > 0 && t.data == nullptr) return invalid_argument(path + ": tensor " + in_quotes(name) + " has no data");
    json shape = json::array();
    for (int i = 0; i < t.ndim; ++i) shape.push_back(t.shape[i]);
    header[name] = {{"dtype", std::string(dtype_name(t.dtype))},
                    {"shape", std::move(shape)},
                    {"data_offsets", {offset, offset + t.nbytes()}}};
    offset += t.nbytes();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // pad so the data section starts 8-byte aligned
  uint8_t len_bytes[8];
  uint64_t len = text.size();
  for (int i = 0; i < 8; ++i) len_bytes[i] = uint8_t(len >> (8 * i));

  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return io_error(path + ": cannot create: " + errno_text());
  bool ok = std::fwrite(len_bytes, 1, 8, f) == 8 && std::fwrite(text.data(), 1, text.size(), f) == text.size();
  for (const auto* entry : order) {
    const Tensor& t = entry->second;
    if (!ok) break;
    size_t n = t.nbytes();
    if (n > 0) ok = std::fwrite(t.data, 1, n, f) == n;
  }
  std::string write_error = ok ? "" : errno_text();
  if (std::fclose(f) != 0 && ok) {
    ok = false;
    write_error = errno_text();
  }
  if (!ok) return io_error(path + ": write failed: " + write_error);
  return Status::Ok();
}

Result<std::string> read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return io_error(path + ": cannot open: " + errno_text());
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return io_error(path + ": read failed");
  return ss.str();
}

}  // namespace lmx::io
