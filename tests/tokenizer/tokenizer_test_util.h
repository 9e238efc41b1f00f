// Shared by the tokenizer tests: where the real tokenizers live (../shared/data/tokenizers), loading
// each once per test binary, and the committed HF reference (fixtures/tokenizer_reference.json).
// A missing shared-data directory fails the tests unless LORAMUX_NO_SHARED_DATA is set (then: skip).
#pragma once
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "tokenizer/tokenizer.h"

namespace lmx::tokenizer::testing {

// The build's shared-data directory (tests/CMakeLists.txt searches ../shared/data); "" when none was found.
inline std::string shared_data_dir() { return LORAMUX_SHARED_DATA; }
// Whether a missing tokenizer skips (no shared data known to this build, or LORAMUX_NO_SHARED_DATA set)
// rather than fails (the build found the data and it has gone missing).
inline bool shared_data_optional() {
  return shared_data_dir().empty() || std::getenv("LORAMUX_NO_SHARED_DATA") != nullptr;
}
inline std::string tokenizer_dir(const std::string& name) { return shared_data_dir() + "/tokenizers/" + name; }

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The three tokenizers, loaded once for the whole binary (loading o200k takes a second or two).
// Test-only cache; returns nullptr after recording a failure or skip reason in `why`.
inline const Tokenizer* shared_tokenizer(const std::string& name, std::string& why) {
  static std::map<std::string, std::unique_ptr<Tokenizer>> loaded;  // test binary only
  auto it = loaded.find(name);
  if (it != loaded.end()) return it->second.get();
  if (!std::filesystem::exists(tokenizer_dir(name))) {
    why = shared_data_dir().empty()
              ? "this build found no shared data (../shared/data with the published tokenizers)"
              : "missing " + tokenizer_dir(name) + " (the real tokenizers live in ../shared/data; set "
                "LORAMUX_NO_SHARED_DATA=1 to skip these tests on a machine without it)";
    return nullptr;
  }
  Result<Tokenizer> tok = Tokenizer::load(tokenizer_dir(name));
  if (!tok.ok()) {
    why = tok.status().message();
    return nullptr;
  }
  return (loaded[name] = std::make_unique<Tokenizer>(std::move(tok).value())).get();
}

inline const nlohmann::json& reference() {
  static const nlohmann::json ref = nlohmann::json::parse(
      read_file(std::string(LORAMUX_SOURCE_DIR) + "/tests/tokenizer/fixtures/tokenizer_reference.json"));
  return ref;
}

}  // namespace lmx::tokenizer::testing

// Gets the named real tokenizer or ends the test: FAIL when the shared data is missing, SKIP when the
// build found none or LORAMUX_NO_SHARED_DATA is set.
#define LMX_GET_TOKENIZER(var, name)                                                   \
  std::string lmx_why_;                                                                \
  const ::lmx::tokenizer::Tokenizer* var = ::lmx::tokenizer::testing::shared_tokenizer(name, lmx_why_); \
  if (var == nullptr) {                                                                \
    if (::lmx::tokenizer::testing::shared_data_optional()) GTEST_SKIP() << lmx_why_;   \
    FAIL() << lmx_why_;                                                                \
  }
