// The text stages of tokenizer.json between added-token matching and BPE: the normalizer (NFC and
// friends, Prepend, Replace) and the pre-tokenizer (Split regexes, ByteLevel, Sequence). Each is parsed
// once into a flat list of steps; unsupported types fail at load naming their JSON path.
// Called by Tokenizer; the pieces it produces are raw bytes (ByteLevel's char mapping is implicit).
#pragma once
#include <deque>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/status.h"
#include "tokenizer/regex.h"

namespace lmx::tokenizer {

class Normalizer {
 public:
  // `spec` is tokenizer.json's "normalizer" (null allowed); `where` its path for errors.
  static Result<Normalizer> from_json(const nlohmann::json& spec, const std::string& where);
  bool identity() const { return steps_.empty(); }
  // Appends normalize(text) to out.
  void apply(std::string_view text, std::string& out) const;

 private:
  enum class Kind { kNfc, kNfd, kNfkc, kNfkd, kPrepend, kReplace };
  struct Step {
    Kind kind;
    std::string pattern, content;  // Prepend: content; Replace: literal pattern -> content
  };
  static Status parse(const nlohmann::json& spec, const std::string& where, std::vector<Step>& steps);
  std::vector<Step> steps_;
};

// Pieces are views into the normalized text or into `owned` (pieces a step had to rewrite, such as
// ByteLevel's add_prefix_space). Both must outlive the pieces.
struct PreTokenScratch {
  std::vector<std::string_view> pieces, next;
  std::vector<std::pair<size_t, size_t>> matches;
  std::deque<std::string> owned;
  RegexScratch regex;
};

class PreTokenizer {
 public:
  static Result<PreTokenizer> from_json(const nlohmann::json& spec, const std::string& where);
  // True when the last step is ByteLevel, which the byte-level BPE model requires.
  bool ends_with_byte_level() const { return !steps_.empty() && steps_.back().kind == Kind::kByteLevel; }
  // Splits `text` into scratch.pieces (raw bytes, never empty).
  Status apply(std::string_view text, PreTokenScratch& scratch) const;

 private:
  enum class Kind { kSplit, kByteLevel };
  enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };
  struct Step {
    Kind kind;
    Regex regex;  // Split's pattern, or GPT-2's pattern for ByteLevel with use_regex
    bool has_regex = false;
    Behavior behavior = Behavior::kIsolated;
    bool invert = false;
    bool add_prefix_space = false;
  };
  static Status parse(const nlohmann::json& spec, const std::string& where, std::vector<Step>& steps);
  std::vector<Step> steps_;
};

}  // namespace lmx::tokenizer
