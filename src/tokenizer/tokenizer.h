// Tokenizer: a Hugging Face tokenizer.json (+ tokenizer_config.json) loaded for byte-level BPE models
// (GPT-OSS o200k, Qwen3, DeepSeek-V3, Llama-3 style). encode/decode equal HF `tokenizers` token for
// token; streaming decode is IncrementalDecoder's job and chat rendering chat_template's.
// Used by the engine/server for prompts and by `loramux tokenize`.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace lmx::tokenizer {

class Tokenizer {
 public:
  // `path` is a model directory (reads tokenizer.json and, if present, tokenizer_config.json) or a
  // tokenizer.json file (its sibling tokenizer_config.json is read if present). Unsupported components
  // fail here, naming the component, its JSON path and the file.
  static Result<Tokenizer> load(const std::string& path);

  // Text -> ids exactly as `tokenizers`' Tokenizer.encode(text, add_special_tokens).ids. Bytes that are
  // not valid UTF-8 are first replaced by U+FFFD per maximal subpart — what Python's
  // bytes.decode('utf-8', errors='replace') hands to HF. add_special_tokens applies tokenizer.json's
  // post-processor (TemplateProcessing); tokenizer_config's add_bos_token is deliberately not applied,
  // as transformers 5 ignores it for tokenizer.json models too (chat templates write BOS themselves).
  // Thread-safe: copies share one bounded cache of pre-token -> ids behind a reader/writer lock.
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens) const;

  // Ids -> text exactly as `tokenizers`' decode: runs of model tokens are joined as bytes and made valid
  // UTF-8 (U+FFFD per invalid maximal subpart); each added token cuts the run and contributes its own
  // content, unless it is special and skip_special_tokens is set. Unknown ids are skipped.
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens) const;

  // Raw bytes of one token (an added token's content, or a model token's bytes); "" for unknown ids.
  const std::string& token_bytes(int32_t id) const;
  bool is_added(int32_t id) const;
  bool is_special(int32_t id) const;
  // Id of an added token's content, or of a model token given as raw bytes.
  std::optional<int32_t> token_to_id(std::string_view text) const;

  // From tokenizer_config.json (bos_token / eos_token); -1 when not configured.
  int32_t bos_id() const;
  int32_t eos_id() const;
  // One past the largest id of the model vocabulary and the added tokens.
  int32_t vocab_size() const;

  struct Impl;  // defined in tokenizer.cpp

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace lmx::tokenizer
