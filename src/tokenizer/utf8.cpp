// UTF-8 scanning and the ByteLevel alphabet (see utf8.h). The valid-range table follows Unicode's
// "well-formed UTF-8 byte sequences" (Table 3-7), which is what makes the maximal-subpart rule exact.
#include "tokenizer/utf8.h"

namespace lmx::tokenizer {

Utf8Step utf8_step(std::string_view text) {
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  const unsigned char b0 = p[0];
  if (b0 < 0x80) return {1, true, false};
  size_t need;            // continuation bytes after the lead byte
  unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the first continuation byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 1;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 2;
    if (b0 == 0xE0) lo = 0xA0;        // no overlong forms
    if (b0 == 0xED) hi = 0x9F;        // no surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 3;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;        // nothing above U+10FFFF
  } else {
    return {1, false, false};         // 0x80..0xC1, 0xF5..0xFF never start a sequence
  }
  for (size_t k = 1; k <= need; ++k) {
    if (k >= n) return {k, false, true};
    const unsigned char c = p[k];
    const unsigned char klo = k == 1 ? lo : 0x80, khi = k == 1 ? hi : 0xBF;
    if (c < klo || c > khi) return {k, false, false};
  }
  return {need + 1, true, false};
}

bool is_valid_utf8(std::string_view bytes) {
  size_t i = 0;
  while (i < bytes.size()) {
    if (static_cast<unsigned char>(bytes[i]) < 0x80) {
      ++i;
      continue;
    }
    Utf8Step s = utf8_step(bytes.substr(i));
    if (!s.valid) return false;
    i += s.length;
  }
  return true;
}

void append_utf8_lossy(std::string_view bytes, std::string& out) {
  size_t i = 0, run_start = 0;
  while (i < bytes.size()) {
    if (static_cast<unsigned char>(bytes[i]) < 0x80) {
      ++i;
      continue;
    }
    Utf8Step s = utf8_step(bytes.substr(i));
    if (s.valid) {
      i += s.length;
      continue;
    }
    out.append(bytes.substr(run_start, i - run_start));
    out.append(kReplacementChar);
    i += s.length;
    run_start = i;
  }
  out.append(bytes.substr(run_start));
}

char32_t decode_code_point(std::string_view text, size_t* length) {
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  if (p[0] < 0x80) {
    *length = 1;
    return p[0];
  }
  if (p[0] < 0xE0) {
    *length = 2;
    return (char32_t(p[0] & 0x1F) << 6) | (p[1] & 0x3F);
  }
  if (p[0] < 0xF0) {
    *length = 3;
    return (char32_t(p[0] & 0x0F) << 12) | (char32_t(p[1] & 0x3F) << 6) | (p[2] & 0x3F);
  }
  *length = 4;
  return (char32_t(p[0] & 0x07) << 18) | (char32_t(p[1] & 0x3F) << 12) | (char32_t(p[2] & 0x3F) << 6) |
         (p[3] & 0x3F);
}

void append_code_point(char32_t cp, std::string& out) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// GPT-2's bytes_to_unicode(): printable Latin-1 bytes map to themselves, the other 68 bytes to 256+n
// in byte order.
ByteLevelAlphabet::ByteLevelAlphabet() {
  reverse.fill(-1);
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    const char32_t cp = printable ? char32_t(b) : char32_t(next++);
    byte_to_char[b] = cp;
    reverse[cp] = static_cast<int16_t>(b);
  }
}

}  // namespace lmx::tokenizer
