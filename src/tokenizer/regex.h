// A compiled PCRE2 pattern (UTF + Unicode properties, JIT when available) that lists the byte ranges
// of its non-overlapping matches, as the Split pre-tokenizer needs. Match scratch (match data, JIT
// stack) lives in RegexScratch, owned by the caller, so one compiled Regex serves many threads.
#pragma once
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/status.h"

namespace lmx::tokenizer {

class RegexScratch;

class Regex {
 public:
  // `where` names the pattern's origin for error messages ("tokenizer.json pre_tokenizer.pretokenizers[0]").
  static Result<Regex> compile(const std::string& pattern, const std::string& where);
  // Appends [begin, end) of each match of the pattern in `subject` (valid UTF-8; not re-checked), scanning
  // left to right like Oniguruma's find_iter: an empty match is kept and the scan moves one character on.
  // Fails only when PCRE2 gives up (e.g. a backtracking limit), with the pattern's origin in the message.
  Status find_all(std::string_view subject, RegexScratch& scratch,
                  std::vector<std::pair<size_t, size_t>>& matches) const;

 private:
  struct Code;
  std::shared_ptr<const Code> code_;  // shared: Tokenizer copies keep one compiled pattern
  bool jit_ = false;
  std::string where_;
};

// Per-thread (or per-call) match state for any Regex: reusable across patterns.
class RegexScratch {
 public:
  RegexScratch();
  ~RegexScratch();
  RegexScratch(const RegexScratch&) = delete;
  RegexScratch& operator=(const RegexScratch&) = delete;

 private:
  friend class Regex;
  void* match_data_ = nullptr;     // pcre2_match_data_8*, sized for any of our patterns (1 pair)
  void* match_context_ = nullptr;  // pcre2_match_context_8*, carries the JIT stack
  void* jit_stack_ = nullptr;      // pcre2_jit_stack_8*
};

}  // namespace lmx::tokenizer
