// IncrementalDecoder: turns one sequence's generated ids into text pieces as they arrive. A piece never
// ends inside a UTF-8 character, the pieces concatenate to Tokenizer::decode of all ids, and text that
// could begin a stop string is held back until it is known not to. Used per sequence by the engine's
// streaming path; one instance per sequence, not thread-safe.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace lmx::tokenizer {

class IncrementalDecoder {
 public:
  struct Piece {
    std::string text;      // newly final text (may be empty)
    bool stopped = false;  // a stop string matched: `text` ends just before it; later pushes add nothing
  };

  // `tokenizer` must outlive the decoder. Empty stop strings are ignored.
  IncrementalDecoder(const Tokenizer& tokenizer, std::vector<std::string> stop_strings, bool skip_special_tokens);

  Piece push(int32_t id);
  // End of the sequence: releases held text; an unfinished UTF-8 tail becomes U+FFFD, as decode does.
  Piece finish();
  bool stopped() const { return stopped_; }

 private:
  // Moves complete characters from pending_bytes_ into held_ (flush: also the unfinished tail).
  void drain_bytes(bool flush);
  // Emits what of held_ can no longer be part of a stop string; detects a complete one.
  Piece release(bool at_end);

  const Tokenizer* tokenizer_;
  std::vector<std::string> stop_strings_;
  bool skip_special_tokens_;
  std::string pending_bytes_;  // model-token bytes not yet forming complete characters
  std::string held_;           // valid text not yet emitted (a possible stop-string prefix)
  bool stopped_ = false;
};

}  // namespace lmx::tokenizer
