// The prompts of a serving benchmark: `sonnet` (an instruction plus randomly drawn lines of Shakespeare's
// sonnets up to --input-len tokens of the served model's tokenizer, design.md §9), `random` (token-id
// prompts of fixed length: no tokenizer needed) and `jsonl` (one {"prompt", "output_len"?} per line).
// Deterministic from the seed. Called by `bench serve`; the client sends what is built here.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"
#include "tokenizer/tokenizer.h"

namespace lmx::loadgen {

// One request's prompt. Exactly one of prompt_text / prompt_ids is the prompt.
struct BenchPrompt {
  std::string prompt_text;
  std::vector<int32_t> prompt_ids;
  bool uses_ids = false;
  int input_len = 0;   // prompt tokens as counted here (0 = unknown: a text prompt without --tokenizer)
  int output_len = 0;  // max_tokens to send
};

struct DatasetOptions {
  std::string name;  // sonnet | random | jsonl
  std::string path;  // sonnet file or JSONL file
  int num_prompts = 0;
  int input_len = 0;
  int output_len = 0;
  double range_ratio = 0;      // random: lengths uniform in [L (1 - r), L (1 + r)]
  int sonnet_prefix_len = 0;   // sonnet: tokens of leading sonnet lines shared by every prompt (vLLM's prefix)
  int random_vocab_size = 0;   // random: ids drawn from [0, V) (tokenizer's added tokens excluded)
  uint64_t seed = 0;
  const tokenizer::Tokenizer* tokenizer = nullptr;  // needed by sonnet; counts JSONL text prompts
};

// The instruction every sonnet prompt opens with (the usual recipe, as in vLLM's sonnet dataset).
inline constexpr const char* kSonnetInstruction = "Pick as many lines as you can from these poem lines:\n";

Result<std::vector<BenchPrompt>> build_dataset(const DatasetOptions& options);

// Sonnet prompt from the file's lines: the instruction, the shared prefix lines, then lines drawn at random
// while the prompt stays within `input_len` tokens, topped up word by word (the last word cut to fit) from
// one more drawn line; the result has at most input_len tokens, nearly always exactly input_len.
Result<std::vector<BenchPrompt>> build_sonnet(const std::vector<std::string>& lines, const DatasetOptions& options);

}  // namespace lmx::loadgen
