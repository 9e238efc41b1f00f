// PCRE2 behind Regex (see regex.h). Patterns come from tokenizer.json and were written for Oniguruma
// (what HF `tokenizers` uses); PCRE2 with UTF|UCP agrees on the constructs they use (\p{..}, \s, (?i:),
// lookahead). Known doubt: PCRE2 10.42 knows Unicode 14, so letters added later are not \p{L} here.
#define PCRE2_CODE_UNIT_WIDTH 8
#include "tokenizer/regex.h"

#include <pcre2.h>

namespace lmx::tokenizer {

struct Regex::Code {
  pcre2_code* code = nullptr;
  ~Code() { pcre2_code_free(code); }
};

Result<Regex> Regex::compile(const std::string& pattern, const std::string& where) {
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   PCRE2_UTF | PCRE2_UCP, &error, &offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof(message));
    return invalid_argument(where + ": regex does not compile at offset " + std::to_string(offset) + ": " +
                            reinterpret_cast<const char*>(message) + " (pattern: " + pattern + ")");
  }
  Regex regex;
  auto owned = std::make_shared<Code>();
  owned->code = code;
  // JIT is several times faster; if the platform lacks it the interpreter gives the same matches.
  regex.jit_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
  regex.code_ = std::move(owned);
  regex.where_ = where;
  return regex;
}

Status Regex::find_all(std::string_view subject, RegexScratch& scratch,
                       std::vector<std::pair<size_t, size_t>>& matches) const {
  auto* md = static_cast<pcre2_match_data*>(scratch.match_data_);
  auto* mc = static_cast<pcre2_match_context*>(scratch.match_context_);
  const auto* s = reinterpret_cast<PCRE2_SPTR>(subject.data());
  size_t start = 0;
  while (start <= subject.size()) {
    const int rc = jit_ ? pcre2_jit_match(code_->code, s, subject.size(), start, 0, md, mc)
                        : pcre2_match(code_->code, s, subject.size(), start, PCRE2_NO_UTF_CHECK, md, mc);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(rc, message, sizeof(message));
      return Status(StatusCode::kInternal, where_ + ": regex match failed: " + reinterpret_cast<const char*>(message));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    matches.emplace_back(ov[0], ov[1]);
    if (ov[1] > ov[0]) {
      start = ov[1];
    } else {  // empty match: step over one whole character so the next scan starts on a boundary
      if (ov[1] >= subject.size()) break;
      start = ov[1] + 1;
      while (start < subject.size() && (static_cast<unsigned char>(subject[start]) & 0xC0) == 0x80) ++start;
    }
  }
  return Status::Ok();
}

RegexScratch::RegexScratch() {
  match_data_ = pcre2_match_data_create(1, nullptr);
  // 32 KiB (PCRE2's default machine-stack budget) is too little for `\s+(?!\S)` over long whitespace
  // runs; the JIT stack grows on demand up to 8 MiB.
  jit_stack_ = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
  match_context_ = pcre2_match_context_create(nullptr);
  if (jit_stack_ != nullptr)
    pcre2_jit_stack_assign(static_cast<pcre2_match_context*>(match_context_), nullptr, jit_stack_);
}

RegexScratch::~RegexScratch() {
  pcre2_match_context_free(static_cast<pcre2_match_context*>(match_context_));
  pcre2_jit_stack_free(static_cast<pcre2_jit_stack*>(jit_stack_));
  pcre2_match_data_free(static_cast<pcre2_match_data*>(match_data_));
}

}  // namespace lmx::tokenizer
