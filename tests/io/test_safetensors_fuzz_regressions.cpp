// Regression inputs for the safetensors header parser: the kind of malformed headers the libFuzzer
// target (fuzz/fuzz_safetensors_header.cpp) produces. Each must give an error Status, never a crash;
// new crashers found by fuzzing belong in this list.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "io/safetensors.h"

namespace lmx::io {
namespace {

std::string with_len(uint64_t len, const std::string& rest) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = char((len >> (8 * i)) & 0xff);
  return out + rest;
}
std::string framed(const std::string& header, const std::string& data = "") {
  return with_len(header.size(), header) + data;
}

TEST(SafetensorsFuzzRegressions, MalformedHeadersFailCleanly) {
  const std::vector<std::string> inputs = {
      "",
      std::string(7, '\0'),
      with_len(0, ""),
      with_len(1, "{"),
      with_len(UINT64_MAX, "{}"),
      with_len(UINT64_MAX - 7, "{}"),            // 8 + len wraps around
      framed("{\"a\":"),
      framed("{\"a\":1}"),
      framed("{\"a\":{}}"),
      framed("{\"a\":{\"dtype\":\"U8\",\"shape\":{},\"data_offsets\":[0,0]}}"),
      framed("{\"a\":{\"dtype\":\"U8\",\"shape\":[1.5],\"data_offsets\":[0,0]}}"),
      framed("{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,18446744073709551615]}}", "x"),
      framed("{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[18446744073709551615,0]}}", "x"),
      framed("{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[\"0\",\"1\"]}}", "x"),
      framed("{\"a\":{\"dtype\":\"F32\",\"shape\":[9223372036854775807,2],\"data_offsets\":[0,0]}}"),
      framed("{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}} trailing", "x"),
      framed("{\"\xff\xfe\":1}"),               // invalid UTF-8 in a key
      framed("{\"__metadata__\":null}"),
      framed("{\"__metadata__\":{\"k\":{\"nested\":\"v\"}}}"),
      framed("{\"a\":{\"dtype\":null,\"shape\":[],\"data_offsets\":[0,1]}}", "x"),
      framed(std::string(200, '[') + std::string(200, ']')),
      // Deep nesting where a value is reported in the error: the message must not recurse through it.
      framed("{\"a\":{\"dtype\":\"U8\",\"shape\":[" + std::string(100000, '[') + std::string(100000, ']') +
             "],\"data_offsets\":[0,0]}}"),
      framed("{\"a\":{\"dtype\":\"U8\",\"shape\":[],\"data_offsets\":" + std::string(100000, '[') +
             std::string(100000, ']') + "}}"),
      framed("{\"__metadata__\":{\"k\":" + std::string(100000, '[') + std::string(100000, ']') + "}}"),
  };
  for (size_t i = 0; i < inputs.size(); ++i) {
    std::map<std::string, TensorInfo> tensors;
    std::map<std::string, std::string> metadata;
    size_t data_offset = 0;
    Status s = parse_safetensors_header(reinterpret_cast<const uint8_t*>(inputs[i].data()), inputs[i].size(),
                                        "fuzz-input", &tensors, &metadata, &data_offset);
    EXPECT_FALSE(s.ok()) << "input " << i << " was accepted";
    EXPECT_NE(s.message().find("fuzz-input"), std::string::npos) << "input " << i << ": " << s.message();
  }
}

TEST(SafetensorsFuzzRegressions, ZeroSizedTensorsAndEmptyHeaderAreValid) {
  for (const std::string& input : {framed("{}"), framed("{}      "),
                                   framed("{\"a\":{\"dtype\":\"F32\",\"shape\":[0,3],\"data_offsets\":[0,0]}}"),
                                   framed("{\"s\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[0,8]}}", "12345678")}) {
    std::map<std::string, TensorInfo> tensors;
    std::map<std::string, std::string> metadata;
    size_t data_offset = 0;
    Status s = parse_safetensors_header(reinterpret_cast<const uint8_t*>(input.data()), input.size(), "ok-input",
                                        &tensors, &metadata, &data_offset);
    EXPECT_TRUE(s.ok()) << s.message();
  }
}

}  // namespace
}  // namespace lmx::io
