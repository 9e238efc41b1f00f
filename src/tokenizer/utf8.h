// UTF-8 scanning shared by encode and decode: the "maximal subpart" rule for invalid bytes (what Rust's
// String::from_utf8_lossy and Python's errors='replace' both do) and GPT-2's byte <-> printable-char map.
// Used by tokenizer.cpp and incremental_decoder.cpp; knows nothing about vocabularies.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace lmx::tokenizer {

// The UTF-8 sequence starting at text[0]: `length` bytes; `valid` when they form one scalar value;
// `truncated` when the bytes are a valid but unfinished prefix cut by the end of `text` (a streaming
// decoder waits for more; a full decode replaces them with one U+FFFD). An invalid sequence covers the
// maximal subpart that could have started a valid one, so one U+FFFD replaces exactly those bytes.
struct Utf8Step {
  size_t length;
  bool valid;
  bool truncated;
};
Utf8Step utf8_step(std::string_view text);

// Appends `bytes` to `out`, each invalid maximal subpart (including a truncated tail) as U+FFFD.
void append_utf8_lossy(std::string_view bytes, std::string& out);

// True when `bytes` is entirely valid UTF-8 (fast path: ASCII runs).
bool is_valid_utf8(std::string_view bytes);

// Decodes one code point of valid UTF-8 at text[0] (precondition: utf8_step(text).valid).
char32_t decode_code_point(std::string_view text, size_t* length);
void append_code_point(char32_t cp, std::string& out);

inline constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";

// GPT-2's ByteLevel alphabet: every byte maps to one printable code point, so vocabularies store byte
// strings as text ("Ġ" = 0x20). byte_to_char is total; char_to_byte answers -1 outside the alphabet.
struct ByteLevelAlphabet {
  ByteLevelAlphabet();
  std::array<char32_t, 256> byte_to_char;
  int char_to_byte(char32_t cp) const { return cp < reverse.size() ? reverse[cp] : -1; }
  std::array<int16_t, 324> reverse;  // code points of the alphabet are all below 324
};

}  // namespace lmx::tokenizer
