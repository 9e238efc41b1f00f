// Added-token matching (see added_tokens.h). Word and whitespace tests use Unicode categories via
// utf8proc, approximating Rust's char::is_alphanumeric / is_whitespace (none of the shipped tokenizers
// sets single_word, lstrip or rstrip; the rules are here so a model that does gets HF's behaviour).
#include "tokenizer/added_tokens.h"

#include <utf8proc.h>

#include <algorithm>

#include "tokenizer/utf8.h"

namespace lmx::tokenizer {
namespace {

bool is_word_char(char32_t cp) {
  switch (utf8proc_category(utf8proc_int32_t(cp))) {
    case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM: case UTF8PROC_CATEGORY_LO: case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL: case UTF8PROC_CATEGORY_NO:
      return true;
    default:
      return false;
  }
}

bool is_space_char(char32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}

char32_t last_char(std::string_view s) {
  size_t i = s.size() - 1;
  while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
  size_t length = 0;
  return decode_code_point(s.substr(i), &length);
}

char32_t first_char(std::string_view s) {
  size_t length = 0;
  return decode_code_point(s, &length);
}

}  // namespace

AddedTokenMatcher::AddedTokenMatcher(std::vector<AddedToken> tokens, std::vector<std::string> patterns)
    : tokens_(std::move(tokens)) {
  trie_.emplace_back();
  for (size_t t = 0; t < tokens_.size(); ++t) {
    const std::string& pattern = patterns[t];
    if (pattern.empty()) continue;
    first_bytes_.set(static_cast<unsigned char>(pattern[0]));
    int32_t node = 0;
    for (unsigned char b : pattern) {
      int32_t next = child(node, b);
      if (next < 0) {
        next = int32_t(trie_.size());
        trie_.emplace_back();
        auto& children = trie_[size_t(node)].children;
        children.insert(std::lower_bound(children.begin(), children.end(), std::make_pair(b, int32_t(0))),
                        {b, next});
      }
      node = next;
    }
    // Two tokens with the same content: the first one loaded wins (ids ascending), as in HF's trie.
    if (trie_[size_t(node)].token < 0) trie_[size_t(node)].token = int32_t(t);
  }
}

int32_t AddedTokenMatcher::child(int32_t node, unsigned char byte) const {
  const auto& children = trie_[size_t(node)].children;
  auto it = std::lower_bound(children.begin(), children.end(), std::make_pair(byte, int32_t(0)));
  return it != children.end() && it->first == byte ? it->second : -1;
}

void AddedTokenMatcher::split(std::string_view text, std::vector<TextSegment>& out) const {
  size_t start_offset = 0;  // end of the previous match
  size_t i = 0;
  while (i < text.size()) {
    if (!first_bytes_.test(static_cast<unsigned char>(text[i]))) {
      ++i;
      continue;
    }
    // Longest token starting at i (leftmost-longest: the first start with any match wins).
    int32_t best = -1;
    size_t best_end = 0;
    int32_t node = 0;
    for (size_t j = i; j < text.size(); ++j) {
      node = child(node, static_cast<unsigned char>(text[j]));
      if (node < 0) break;
      if (trie_[size_t(node)].token >= 0) {
        best = trie_[size_t(node)].token;
        best_end = j + 1;
      }
    }
    if (best < 0) {
      ++i;
      continue;
    }
    const AddedToken& token = tokens_[size_t(best)];
    size_t start = i, stop = best_end;
    i = best_end;  // non-overlapping matches, as aho-corasick's find_iter
    if (token.single_word) {
      const bool space_before = start == 0 || !is_word_char(last_char(text.substr(0, start)));
      const bool space_after = stop == text.size() || !is_word_char(first_char(text.substr(stop)));
      if (!space_before || !space_after) continue;
    }
    if (token.lstrip) {
      size_t s = start;
      while (s > 0) {
        size_t p = s - 1;
        while (p > 0 && (static_cast<unsigned char>(text[p]) & 0xC0) == 0x80) --p;
        size_t length = 0;
        if (!is_space_char(decode_code_point(text.substr(p), &length))) break;
        s = p;
      }
      start = std::max(s, start_offset);  // spaces a previous match already took stay with it
    }
    if (token.rstrip) {
      while (stop < text.size()) {
        size_t length = 0;
        if (!is_space_char(decode_code_point(text.substr(stop), &length))) break;
        stop += length;
      }
    }
    if (start_offset < start) out.push_back(TextSegment{start_offset, start, -1});
    out.push_back(TextSegment{start, stop, token.id});
    start_offset = stop;
    i = std::max(i, stop);
  }
  if (start_offset < text.size()) out.push_back(TextSegment{start_offset, text.size(), -1});
}

}  // namespace lmx::tokenizer
