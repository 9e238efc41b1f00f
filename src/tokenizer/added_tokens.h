// Added tokens (specials such as <|im_end|> and extras such as <think>) and how they are found in text
// before any pre-tokenization: leftmost-longest over all contents, then the single_word / lstrip /
// rstrip rules of HF `tokenizers`' AddedVocabulary::find_matches. Called by Tokenizer::encode.
#pragma once
#include <bitset>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace lmx::tokenizer {

struct AddedToken {
  int32_t id;
  std::string content;
  bool special = false;
  bool lstrip = false;       // the match swallows whitespace before it
  bool rstrip = false;       // ... and after it
  bool normalized = false;   // matched in normalized text (else in the raw input)
  bool single_word = false;  // only matches when not inside a word
};

// A piece of the input: either an added token's match (token_id >= 0) or text between matches.
struct TextSegment {
  size_t begin, end;
  int32_t token_id;  // -1 for plain text
};

class AddedTokenMatcher {
 public:
  AddedTokenMatcher() = default;
  // `patterns[i]` is the string searched for tokens[i] (its content, normalized if the token is).
  AddedTokenMatcher(std::vector<AddedToken> tokens, std::vector<std::string> patterns);
  bool empty() const { return tokens_.empty(); }
  // Splits text[begin, end) into segments, appending to `out`; plain segments are never empty.
  void split(std::string_view text, std::vector<TextSegment>& out) const;

 private:
  struct Node {
    std::vector<std::pair<unsigned char, int32_t>> children;  // sorted by byte
    int32_t token = -1;                                       // index into tokens_ ending here
  };
  int32_t child(int32_t node, unsigned char byte) const;

  std::vector<AddedToken> tokens_;
  std::vector<Node> trie_;
  std::bitset<256> first_bytes_;  // quick rejection: most text positions cannot start a token
};

}  // namespace lmx::tokenizer
