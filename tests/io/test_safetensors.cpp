// Tests of io/safetensors: write/read round trips, checkpoint directories (single, index shards, bare
// set), and every header validation error, each asserting that the message names file and tensor.
// Malformed headers are built byte by byte here, as a hostile writer would.
#include "io/safetensors.h"

#include <gtest/gtest.h>

#include "../common/temp_dir.h"
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace lmx::io {
namespace {

namespace fs = std::filesystem;

// A fresh directory per test, removed afterwards.
using TempDir = lmx::testing::TempDir;

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), std::streamsize(bytes.size()));
}

// 8-byte little-endian length + header + data bytes.
std::string raw_file(const std::string& header, size_t data_bytes, uint64_t claimed_len = UINT64_MAX) {
  uint64_t len = claimed_len == UINT64_MAX ? header.size() : claimed_len;
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = char((len >> (8 * i)) & 0xff);
  out += header;
  out.append(data_bytes, '\x11');
  return out;
}

Status parse(const std::string& file_bytes) {
  std::map<std::string, TensorInfo> tensors;
  std::map<std::string, std::string> metadata;
  size_t data_offset = 0;
  return parse_safetensors_header(reinterpret_cast<const uint8_t*>(file_bytes.data()), file_bytes.size(), "mem.safetensors",
                                  &tensors, &metadata, &data_offset);
}

std::vector<float> iota_f32(size_t n, float start) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = start + float(i) * 0.5f;
  return v;
}

TEST(Safetensors, RoundTripKeepsDtypeShapeBytesAndMetadata) {
  TempDir dir;
  std::vector<float> a = iota_f32(6, 1.0f);                  // [2, 3] f32
  std::vector<uint16_t> b = {0x3f80, 0x4000, 0xbf80};       // [3] bf16
  std::vector<uint8_t> c = {1, 2, 3, 4, 5};                 // [5] u8 (odd size: written after the wider ones)
  std::vector<int32_t> d = {7, -8};                         // [1, 2] i32
  std::vector<std::pair<std::string, Tensor>> tensors = {
      {"a", Tensor(a.data(), DType::F32, {2, 3})},
      {"b", Tensor(b.data(), DType::BF16, {3})},
      {"c", Tensor(c.data(), DType::U8, {5})},
      {"d", Tensor(d.data(), DType::I32, {1, 2})},
      {"scalar_empty", Tensor(nullptr, DType::F32, {0, 4})},
  };
  const std::string path = dir.file("x.safetensors");
  ASSERT_TRUE(write_safetensors(path, tensors, {{"format", "pt"}}).ok());

  // Header length is a multiple of 8 (padded with spaces like the reference writer).
  std::ifstream in(path, std::ios::binary);
  uint64_t len = 0;
  in.read(reinterpret_cast<char*>(&len), 8);
  EXPECT_EQ(len % 8, 0u);

  auto file = SafetensorsFile::open(path);
  ASSERT_TRUE(file.ok()) << file.status().message();
  EXPECT_EQ(file->metadata().at("format"), "pt");
  EXPECT_EQ(file->tensors().size(), 5u);
  auto ta = file->tensor("a");
  ASSERT_TRUE(ta.ok());
  EXPECT_EQ(ta->shape_str(), "[2, 3] F32");
  EXPECT_EQ(std::memcmp(ta->data, a.data(), 24), 0);
  auto tb = file->tensor("b");
  EXPECT_EQ(tb->shape_str(), "[3] BF16");
  EXPECT_EQ(std::memcmp(tb->data, b.data(), 6), 0);
  auto tc = file->tensor("c");
  EXPECT_EQ(std::memcmp(tc->data, c.data(), 5), 0);
  auto td = file->tensor("d");
  EXPECT_EQ(td->shape_str(), "[1, 2] I32");
  EXPECT_EQ(std::memcmp(td->data, d.data(), 8), 0);
  EXPECT_EQ(file->tensor("scalar_empty")->numel(), 0);
  // Every tensor is aligned to its element size despite the odd-sized u8 tensor in the middle.
  for (const auto& [name, info] : file->tensors()) {
    auto t = file->tensor(name);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t->data) % dtype_size(t->dtype), 0u) << name;
  }

  auto missing = file->tensor("nope");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("'nope'"), std::string::npos);
  EXPECT_NE(missing.status().message().find(path), std::string::npos);
}

TEST(Safetensors, WriterRejectsDuplicateNames) {
  TempDir dir;
  float v = 1.0f;
  Status s = write_safetensors(dir.file("d.safetensors"),
                               {{"w", Tensor(&v, DType::F32, {1})}, {"w", Tensor(&v, DType::F32, {1})}});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("'w' given twice"), std::string::npos) << s.message();
}

TEST(Safetensors, OpenMissingFileNamesPath) {
  auto r = SafetensorsFile::open("/nonexistent/dir/model.safetensors");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kIo);
  EXPECT_NE(r.status().message().find("/nonexistent/dir/model.safetensors"), std::string::npos);
}

TEST(Safetensors, TruncatedDataIsOutOfRange) {
  TempDir dir;
  std::vector<float> a = iota_f32(64, 0.0f);
  const std::string path = dir.file("t.safetensors");
  ASSERT_TRUE(write_safetensors(path, {{"layer.w", Tensor(a.data(), DType::F32, {8, 8})}}).ok());
  fs::resize_file(path, fs::file_size(path) - 10);
  auto r = SafetensorsFile::open(path);
  ASSERT_FALSE(r.ok());
  const std::string& m = r.status().message();
  EXPECT_NE(m.find(path), std::string::npos) << m;
  EXPECT_NE(m.find("'layer.w'"), std::string::npos) << m;
  EXPECT_NE(m.find("past the data section"), std::string::npos) << m;
}

TEST(Safetensors, ShorterThanLengthPrefix) {
  Status s = parse(std::string("\x05\x00\x00", 3));
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("mem.safetensors"), std::string::npos);
  EXPECT_NE(s.message().find("too short"), std::string::npos) << s.message();
}

TEST(Safetensors, HeaderLengthBeyondFile) {
  Status s = parse(raw_file("{}", 0, 1000));
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("header length 1000"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("past the end"), std::string::npos) << s.message();
  Status huge = parse(raw_file("{}", 0, uint64_t(1) << 62));
  ASSERT_FALSE(huge.ok());
  EXPECT_NE(huge.message().find("header length"), std::string::npos) << huge.message();
}

TEST(Safetensors, BadJson) {
  Status s = parse(raw_file("{\"a\": {\"dtype\": ", 0));
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("not valid JSON"), std::string::npos) << s.message();
  Status not_object = parse(raw_file("[1, 2]  ", 0));
  ASSERT_FALSE(not_object.ok());
  EXPECT_NE(not_object.message().find("JSON object"), std::string::npos) << not_object.message();
}

TEST(Safetensors, WrongDtypeStringNamesTensorAndDtype) {
  Status s = parse(raw_file(R"({"w": {"dtype": "F33", "shape": [2], "data_offsets": [0, 8]}})", 8));
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kUnsupported);
  EXPECT_NE(s.message().find("'w'"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("'F33'"), std::string::npos) << s.message();
  Status not_string = parse(raw_file(R"({"w": {"dtype": 4, "shape": [2], "data_offsets": [0, 8]}})", 8));
  ASSERT_FALSE(not_string.ok());
  EXPECT_NE(not_string.message().find("'dtype' must be a string"), std::string::npos) << not_string.message();
}

TEST(Safetensors, ByteCountMustMatchShape) {
  Status s = parse(raw_file(R"({"w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 10]}})", 16));
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("'w'"), std::string::npos);
  EXPECT_NE(s.message().find("needs 12 bytes"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("hold 10"), std::string::npos) << s.message();
}

TEST(Safetensors, OffsetsErrors) {
  // begin > end
  Status reversed = parse(raw_file(R"({"w": {"dtype": "U8", "shape": [2], "data_offsets": [4, 2]}})", 8));
  ASSERT_FALSE(reversed.ok());
  EXPECT_NE(reversed.message().find("begin after end"), std::string::npos) << reversed.message();
  // out of range
  Status outside = parse(raw_file(R"({"w": {"dtype": "U8", "shape": [4], "data_offsets": [6, 10]}})", 8));
  ASSERT_FALSE(outside.ok());
  EXPECT_EQ(outside.code(), StatusCode::kOutOfRange);
  EXPECT_NE(outside.message().find("8 bytes"), std::string::npos) << outside.message();
  // overlap: both tensors named
  Status overlap = parse(raw_file(R"({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                                      "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}})",
                                  8));
  ASSERT_FALSE(overlap.ok());
  EXPECT_NE(overlap.message().find("'a'"), std::string::npos) << overlap.message();
  EXPECT_NE(overlap.message().find("'b'"), std::string::npos) << overlap.message();
  EXPECT_NE(overlap.message().find("overlap"), std::string::npos) << overlap.message();
  // negative / non-integer offsets
  Status negative = parse(raw_file(R"({"w": {"dtype": "U8", "shape": [2], "data_offsets": [-2, 0]}})", 8));
  ASSERT_FALSE(negative.ok());
  EXPECT_NE(negative.message().find("non-negative"), std::string::npos) << negative.message();
  Status three = parse(raw_file(R"({"w": {"dtype": "U8", "shape": [2], "data_offsets": [0, 1, 2]}})", 8));
  ASSERT_FALSE(three.ok());
  EXPECT_NE(three.message().find("[begin, end]"), std::string::npos) << three.message();
  // adjacent tensors and gaps are fine
  EXPECT_TRUE(parse(raw_file(R"({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
                                 "b": {"dtype": "U8", "shape": [2], "data_offsets": [4, 6]}})",
                             8))
                  .ok());
}

TEST(Safetensors, ShapeErrors) {
  Status neg = parse(raw_file(R"({"w": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 0]}})", 0));
  ASSERT_FALSE(neg.ok());
  EXPECT_NE(neg.message().find("'shape'"), std::string::npos) << neg.message();
  Status overflow = parse(
      raw_file(R"({"w": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 0]}})", 0));
  ASSERT_FALSE(overflow.ok());
  EXPECT_NE(overflow.message().find("overflows"), std::string::npos) << overflow.message();
  Status missing = parse(raw_file(R"({"w": {"dtype": "U8", "data_offsets": [0, 0]}})", 0));
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.message().find("missing field 'shape'"), std::string::npos) << missing.message();
}

TEST(Safetensors, MetadataMustBeStringMap) {
  Status s = parse(raw_file(R"({"__metadata__": {"format": 3}})", 0));
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("'format'"), std::string::npos) << s.message();
  Status arr = parse(raw_file(R"({"__metadata__": ["x"]})", 0));
  ASSERT_FALSE(arr.ok());
  EXPECT_NE(arr.message().find("__metadata__"), std::string::npos) << arr.message();
  EXPECT_TRUE(parse(raw_file(R"({"__metadata__": {"format": "pt"}})", 0)).ok());
}

TEST(Safetensors, DuplicateKeysRejected) {
  Status s = parse(raw_file(R"({"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
                                "w": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}})",
                            2));
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("'w' twice"), std::string::npos) << s.message();
}

TEST(Safetensors, TooManyDimsIsAnErrorAtTensorTime) {
  TempDir dir;
  const std::string path = dir.file("six.safetensors");
  write_bytes(path, raw_file(R"({"w": {"dtype": "U8", "shape": [1,1,1,1,1,2], "data_offsets": [0, 2]}})", 2));
  auto f = SafetensorsFile::open(path);
  ASSERT_TRUE(f.ok()) << f.status().message();
  auto t = f->tensor("w");
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("6 dims"), std::string::npos) << t.status().message();
}

// -------------------------------------------------------------------------------------------------
// Checkpoint directories

void write_f32(const std::string& path, const std::vector<std::pair<std::string, std::vector<float>>>& named) {
  std::vector<std::pair<std::string, Tensor>> views;
  for (const auto& [name, values] : named)
    views.emplace_back(name, Tensor(const_cast<float*>(values.data()), DType::F32, {int64_t(values.size())}));
  ASSERT_TRUE(write_safetensors(path, views).ok());
}

float first_value(const Checkpoint& ckpt, const std::string& name) {
  auto t = ckpt.tensor(name);
  EXPECT_TRUE(t.ok()) << t.status().message();
  return t.ok() ? t->ptr<float>()[0] : -1.0f;
}

TEST(Checkpoint, SingleFile) {
  TempDir dir;
  write_f32(dir.file("model.safetensors"), {{"a", {1, 2}}, {"b", {3}}});
  write_f32(dir.file("ignored.safetensors"), {{"c", {9}}});  // model.safetensors wins over the glob
  auto ckpt = Checkpoint::open(dir.str());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().message();
  EXPECT_EQ(ckpt->names(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(first_value(*ckpt, "b"), 3.0f);
  EXPECT_FALSE(ckpt->contains("c"));
  EXPECT_EQ(ckpt->mappings().size(), 1u);
  auto missing = ckpt->tensor("zzz");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("'zzz'"), std::string::npos);
  EXPECT_NE(missing.status().message().find(dir.str()), std::string::npos);
}

TEST(Checkpoint, IndexShards) {
  TempDir dir;
  write_f32(dir.file("model-00001-of-00002.safetensors"), {{"a", {1}}, {"b", {2}}});
  write_f32(dir.file("model-00002-of-00002.safetensors"), {{"c", {3}}});
  write_bytes(dir.file("model.safetensors.index.json"),
              R"({"metadata": {"total_size": 12}, "weight_map": {
                   "a": "model-00001-of-00002.safetensors",
                   "b": "model-00001-of-00002.safetensors",
                   "c": "model-00002-of-00002.safetensors"}})");
  auto ckpt = Checkpoint::open(dir.str());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().message();
  EXPECT_EQ(ckpt->names().size(), 3u);
  EXPECT_EQ(first_value(*ckpt, "a"), 1.0f);
  EXPECT_EQ(first_value(*ckpt, "c"), 3.0f);
  EXPECT_EQ(ckpt->mappings().size(), 2u);
}

TEST(Checkpoint, IndexTensorMissingFromShard) {
  TempDir dir;
  write_f32(dir.file("s1.safetensors"), {{"a", {1}}});
  write_bytes(dir.file("model.safetensors.index.json"), R"({"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}})");
  auto ckpt = Checkpoint::open(dir.str());
  ASSERT_FALSE(ckpt.ok());
  const std::string& m = ckpt.status().message();
  EXPECT_NE(m.find("'b'"), std::string::npos) << m;
  EXPECT_NE(m.find("s1.safetensors"), std::string::npos) << m;
  EXPECT_NE(m.find("missing"), std::string::npos) << m;
}

TEST(Checkpoint, IndexErrors) {
  TempDir dir;
  write_bytes(dir.file("model.safetensors.index.json"), R"({"weight_map": {"a": "absent.safetensors"}})");
  auto absent = Checkpoint::open(dir.str());
  ASSERT_FALSE(absent.ok());
  EXPECT_NE(absent.status().message().find("absent.safetensors"), std::string::npos) << absent.status().message();

  write_bytes(dir.file("model.safetensors.index.json"), R"({"weight_map": {"a": "../escape.safetensors"}})");
  auto escape = Checkpoint::open(dir.str());
  ASSERT_FALSE(escape.ok());
  EXPECT_NE(escape.status().message().find("outside"), std::string::npos) << escape.status().message();

  write_bytes(dir.file("model.safetensors.index.json"), R"({"metadata": {}})");
  auto no_map = Checkpoint::open(dir.str());
  ASSERT_FALSE(no_map.ok());
  EXPECT_NE(no_map.status().message().find("'weight_map'"), std::string::npos) << no_map.status().message();

  write_bytes(dir.file("model.safetensors.index.json"), "{not json");
  auto bad = Checkpoint::open(dir.str());
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("model.safetensors.index.json"), std::string::npos);
}

TEST(Checkpoint, GlobWithoutIndex) {
  TempDir dir;
  write_f32(dir.file("part-b.safetensors"), {{"y", {5}}});
  write_f32(dir.file("part-a.safetensors"), {{"x", {4}}});
  write_bytes(dir.file("notes.txt"), "not a tensor file");
  auto ckpt = Checkpoint::open(dir.str());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().message();
  EXPECT_EQ(first_value(*ckpt, "x"), 4.0f);
  EXPECT_EQ(first_value(*ckpt, "y"), 5.0f);

  write_f32(dir.file("part-c.safetensors"), {{"x", {6}}});
  auto dup = Checkpoint::open(dir.str());
  ASSERT_FALSE(dup.ok());
  EXPECT_NE(dup.status().message().find("'x' appears in both"), std::string::npos) << dup.status().message();
}

TEST(Checkpoint, EmptyOrMissingDirectory) {
  TempDir dir;
  auto empty = Checkpoint::open(dir.str());
  ASSERT_FALSE(empty.ok());
  EXPECT_EQ(empty.status().code(), StatusCode::kNotFound);
  EXPECT_NE(empty.status().message().find("no model.safetensors"), std::string::npos);
  auto missing = Checkpoint::open(dir.file("nope"));
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("not a directory"), std::string::npos);
}

TEST(ReadTextFile, MissingFile) {
  auto r = read_text_file("/nonexistent/config.json");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("/nonexistent/config.json"), std::string::npos);
}

}  // namespace
}  // namespace lmx::io
