// Streaming detokenization (see incremental_decoder.h). Invariant: emitted + held_ + lossy(pending_bytes_)
// equals decode(ids so far) once pending bytes are flushed; held_ is the shortest suffix of the text that
// might still grow into a stop string, so no stop string can start inside text already emitted.
#include "tokenizer/incremental_decoder.h"

#include <algorithm>

#include "tokenizer/utf8.h"

namespace lmx::tokenizer {

IncrementalDecoder::IncrementalDecoder(const Tokenizer& tokenizer, std::vector<std::string> stop_strings,
                                       bool skip_special_tokens)
    : tokenizer_(&tokenizer), skip_special_tokens_(skip_special_tokens) {
  for (std::string& s : stop_strings)
    if (!s.empty()) stop_strings_.push_back(std::move(s));
}

void IncrementalDecoder::drain_bytes(bool flush) {
  // Complete characters and invalid subparts are final; a valid-but-truncated tail waits for more bytes
  // unless the run ends here (an added token or the end of the sequence), where decode() too makes it
  // one U+FFFD.
  size_t i = 0, final_end = 0;
  while (i < pending_bytes_.size()) {
    Utf8Step step = utf8_step(std::string_view(pending_bytes_).substr(i));
    if (step.truncated && !flush) break;
    i += step.length;
    final_end = i;
  }
  append_utf8_lossy(std::string_view(pending_bytes_).substr(0, final_end), held_);
  pending_bytes_.erase(0, final_end);
}

IncrementalDecoder::Piece IncrementalDecoder::release(bool at_end) {
  Piece piece;
  // The earliest complete stop string wins (ties: any, they end the text at the same place).
  size_t stop_at = std::string::npos;
  for (const std::string& s : stop_strings_) stop_at = std::min(stop_at, held_.find(s));
  if (stop_at != std::string::npos) {
    piece.text = held_.substr(0, stop_at);
    piece.stopped = stopped_ = true;
    held_.clear();
    pending_bytes_.clear();
    return piece;
  }
  // Hold back from the earliest position whose suffix is a proper prefix of some stop string. Stop
  // strings are valid UTF-8, so that position starts a character and the emitted text ends on one.
  size_t keep_from = held_.size();
  if (!at_end) {
    for (size_t p = 0; p < held_.size() && keep_from == held_.size(); ++p) {
      const std::string_view suffix = std::string_view(held_).substr(p);
      for (const std::string& s : stop_strings_) {
        if (s.size() > suffix.size() && std::string_view(s).substr(0, suffix.size()) == suffix) {
          keep_from = p;
          break;
        }
      }
    }
  }
  piece.text = held_.substr(0, keep_from);
  held_.erase(0, keep_from);
  return piece;
}

IncrementalDecoder::Piece IncrementalDecoder::push(int32_t id) {
  if (stopped_) return {"", true};
  if (id < 0 || id >= tokenizer_->vocab_size()) return release(false);  // decode() skips unknown ids too
  if (tokenizer_->is_added(id)) {
    if (tokenizer_->is_special(id) && skip_special_tokens_) return release(false);
    drain_bytes(/*flush=*/true);  // an added token ends the byte run (see Tokenizer::decode)
    held_ += tokenizer_->token_bytes(id);
  } else {
    pending_bytes_ += tokenizer_->token_bytes(id);
    drain_bytes(/*flush=*/false);
  }
  return release(false);
}

IncrementalDecoder::Piece IncrementalDecoder::finish() {
  if (stopped_) return {"", true};
  drain_bytes(/*flush=*/true);
  return release(/*at_end=*/true);
}

}  // namespace lmx::tokenizer
