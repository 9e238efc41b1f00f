// The BPE model of tokenizer.json over raw bytes: vocabulary, merge ranks and the merge loop of HF
// `tokenizers` (lowest rank first, leftmost on ties). Vocabulary strings in GPT-2's ByteLevel alphabet
// are turned back into bytes at load, so words are merged as bytes. Called by Tokenizer, per pre-token.
#pragma once
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/status.h"

namespace lmx::tokenizer {

// Transparent hashing so lookups by string_view allocate nothing.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using BytesToId = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

class BpeModel {
 public:
  // `model` is tokenizer.json's "model" object; `file` names tokenizer.json in errors.
  static Result<BpeModel> from_json(const nlohmann::json& model, const std::string& file);

  // Appends the ids of one pre-token given as raw bytes.
  void encode_word(std::string_view word, std::vector<int32_t>& ids) const;

  // Bytes of every model token, indexed by id ("" for ids the vocabulary skips). Tokens outside the
  // ByteLevel alphabet decode to their own UTF-8, as HF's ByteLevel decoder does.
  const std::vector<std::string>& id_to_bytes() const { return id_to_bytes_; }
  std::optional<int32_t> find(std::string_view bytes) const;

 private:
  struct Merge {
    uint32_t rank;
    int32_t merged;
  };
  const Merge* find_merge(int32_t left, int32_t right) const;

  BytesToId bytes_to_id_;
  std::vector<std::string> id_to_bytes_;
  int32_t byte_id_[256];               // id of each single byte, -1 when absent
  std::vector<uint64_t> merge_keys_;   // open addressing, power-of-two size, key ~0 = empty
  std::vector<Merge> merge_values_;
  bool ignore_merges_ = false;
  bool byte_fallback_ = false;
  bool fuse_unk_ = false;
  int32_t unk_id_ = -1;
};

}  // namespace lmx::tokenizer
