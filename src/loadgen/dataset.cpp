// Benchmark datasets (see dataset.h).
#include "loadgen/dataset.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/rng.h"
#include "loadgen/schedule.h"

namespace lmx::loadgen {
namespace {

int count_tokens(const tokenizer::Tokenizer& tok, const std::string& text) {
  return int(tok.encode(text, /*add_special_tokens=*/false).size());
}

// A uniform integer in [lo, hi].
int uniform_int(Rng& rng, int lo, int hi) {
  return lo + int(unit_interval(rng.next_u64()) * double(hi - lo + 1));
}

// A length drawn from [L (1 - r), L (1 + r)], at least 1.
int draw_len(Rng& rng, int len, double ratio) {
  if (ratio <= 0) return len;
  const int lo = std::max(1, int(std::floor(double(len) * (1.0 - ratio))));
  const int hi = std::max(lo, int(std::ceil(double(len) * (1.0 + ratio))));
  return uniform_int(rng, lo, hi);
}

Result<std::vector<std::string>> read_lines(const std::string& path, const char* what) {
  std::ifstream in(path);
  if (!in) return not_found(std::string(what) + " file '" + path + "' cannot be opened");
  std::vector<std::string> lines;
  std::string line;
  while (std::getline(in, line)) lines.push_back(line);
  return lines;
}

Result<std::vector<BenchPrompt>> build_random(const DatasetOptions& o) {
  if (o.random_vocab_size < 2)
    return invalid_argument("--random-vocab-size must be at least 2, found " + std::to_string(o.random_vocab_size));
  // Ids the tokenizer treats as added (special) tokens would make prompts the server may refuse or read as
  // control tokens; they are skipped when a tokenizer is known.
  std::vector<int32_t> allowed;
  for (int32_t id = 0; id < o.random_vocab_size; ++id)
    if (!o.tokenizer || !o.tokenizer->is_added(id)) allowed.push_back(id);
  if (allowed.empty()) return invalid_argument("--random-vocab-size leaves no ordinary token ids to draw from");
  Rng rng(mix64(o.seed ^ 0x72616e646f6dull));  // "random"
  std::vector<BenchPrompt> prompts;
  for (int i = 0; i < o.num_prompts; ++i) {
    BenchPrompt p{.uses_ids = true};
    const int input_len = draw_len(rng, o.input_len, o.range_ratio);
    p.output_len = draw_len(rng, o.output_len, o.range_ratio);
    p.prompt_ids.resize(size_t(input_len));
    for (int32_t& id : p.prompt_ids) id = allowed[size_t(uniform_int(rng, 0, int(allowed.size()) - 1))];
    p.input_len = input_len;
    prompts.push_back(std::move(p));
  }
  return prompts;
}

Result<std::vector<BenchPrompt>> build_jsonl(const DatasetOptions& o) {
  LMX_ASSIGN_OR_RETURN(std::vector<std::string> lines, read_lines(o.path, "--dataset-path (jsonl)"));
  std::vector<BenchPrompt> all;
  for (size_t n = 0; n < lines.size(); ++n) {
    const std::string where = o.path + ":" + std::to_string(n + 1) + ": ";
    if (lines[n].find_first_not_of(" \t\r") == std::string::npos) continue;
    const nlohmann::json j = nlohmann::json::parse(lines[n], nullptr, false);
    if (j.is_discarded() || !j.is_object()) return invalid_argument(where + "expected a JSON object per line");
    auto prompt = j.find("prompt");
    if (prompt == j.end()) return invalid_argument(where + "missing \"prompt\" (a string or an array of token ids)");
    BenchPrompt p{.output_len = o.output_len};
    if (prompt->is_string()) {
      p.prompt_text = prompt->get<std::string>();
      if (p.prompt_text.empty()) return invalid_argument(where + "\"prompt\" is empty");
      if (o.tokenizer) p.input_len = count_tokens(*o.tokenizer, p.prompt_text);
    } else if (prompt->is_array() && !prompt->empty()) {
      for (const nlohmann::json& id : *prompt) {
        if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX)
          return invalid_argument(where + "\"prompt\" ids must be non-negative int32 integers, found " + id.dump());
        p.prompt_ids.push_back(id.get<int32_t>());
      }
      p.uses_ids = true;
      p.input_len = int(p.prompt_ids.size());
    } else {
      return invalid_argument(where + "\"prompt\" must be a non-empty string or array of token ids, found " +
                              std::string(prompt->type_name()));
    }
    if (auto out = j.find("output_len"); out != j.end() && !out->is_null()) {
      if (!out->is_number_integer() || out->get<int64_t>() < 1 || out->get<int64_t>() > INT32_MAX)
        return invalid_argument(where + "\"output_len\" must be a positive integer, found " + out->dump());
      p.output_len = out->get<int>();
    }
    all.push_back(std::move(p));
  }
  if (all.empty()) return invalid_argument("--dataset-path (jsonl) '" + o.path + "' holds no prompts");
  // In file order, cycling when more prompts are asked for than the file holds.
  std::vector<BenchPrompt> prompts;
  for (int i = 0; i < o.num_prompts; ++i) prompts.push_back(all[size_t(i) % all.size()]);
  return prompts;
}

std::vector<std::string> split_words(const std::string& line) {
  std::vector<std::string> words;
  std::istringstream in(line);
  std::string w;
  while (in >> w) words.push_back(w);
  return words;
}

}  // namespace

Result<std::vector<BenchPrompt>> build_sonnet(const std::vector<std::string>& file_lines, const DatasetOptions& o) {
  if (!o.tokenizer)
    return invalid_argument("--dataset-name sonnet measures prompts with the served model's tokenizer: pass --tokenizer DIR");
  const tokenizer::Tokenizer& tok = *o.tokenizer;
  std::vector<std::string> lines;  // each with its newline
  std::vector<int> line_tokens;
  for (const std::string& l : file_lines) {
    if (l.find_first_not_of(" \t\r") == std::string::npos) continue;
    lines.push_back((l.back() == '\r' ? l.substr(0, l.size() - 1) : l) + "\n");
    line_tokens.push_back(count_tokens(tok, lines.back()));
  }
  if (lines.empty()) return invalid_argument("the sonnet file holds no lines");
  const std::string instruction = kSonnetInstruction;
  const int instruction_tokens = count_tokens(tok, instruction);
  if (o.input_len <= instruction_tokens)
    return invalid_argument("--input-len " + std::to_string(o.input_len) + " leaves no room after the sonnet instruction (" +
                            std::to_string(instruction_tokens) + " tokens)");
  if (o.sonnet_prefix_len > o.input_len)
    return invalid_argument("--sonnet-prefix-len " + std::to_string(o.sonnet_prefix_len) + " exceeds --input-len " +
                            std::to_string(o.input_len));

  // The shared prefix: the file's first lines up to sonnet_prefix_len tokens (instruction included).
  std::string prefix = instruction;
  int prefix_estimate = instruction_tokens;
  for (size_t k = 0; k < lines.size() && prefix_estimate + line_tokens[k] <= o.sonnet_prefix_len; ++k) {
    prefix += lines[k];
    prefix_estimate += line_tokens[k];
  }

  Rng rng(mix64(o.seed ^ 0x736f6e6e6574ull));  // "sonnet"
  std::vector<BenchPrompt> prompts;
  for (int i = 0; i < o.num_prompts; ++i) {
    // Whole lines while the per-line estimate fits. Lines end in "\n" and start with a letter, which every
    // supported pre-tokenizer splits, so the estimate is nearly always exact; the real count decides below.
    std::vector<size_t> drawn;
    int estimate = prefix_estimate;
    for (;;) {
      const size_t k = size_t(uniform_int(rng, 0, int(lines.size()) - 1));
      if (estimate + line_tokens[k] > o.input_len) {
        drawn.push_back(k);  // the line to top up from
        break;
      }
      drawn.push_back(k);
      estimate += line_tokens[k];
    }
    const size_t topup = drawn.back();
    drawn.pop_back();
    std::string text = prefix;
    for (size_t k : drawn) text += lines[k];
    int tokens = count_tokens(tok, text);
    while (tokens > o.input_len && !drawn.empty()) {  // the estimate was short: drop whole lines
      drawn.pop_back();
      text = prefix;
      for (size_t k : drawn) text += lines[k];
      tokens = count_tokens(tok, text);
    }
    // Top up word by word from the extra line while the real count stays within input_len; the word that
    // would overshoot contributes its longest prefix that still fits (so most prompts land exactly).
    std::string partial;
    for (const std::string& word : split_words(lines[topup])) {
      if (tokens >= o.input_len) break;
      const std::string separator = partial.empty() ? "" : " ";
      const int candidate_tokens = count_tokens(tok, text + partial + separator + word);
      if (candidate_tokens <= o.input_len) {
        partial += separator + word;
        tokens = candidate_tokens;
        continue;
      }
      std::string best;
      for (size_t chars = 1; chars < word.size(); ++chars) {
        const std::string piece = separator + word.substr(0, chars);
        const int piece_tokens = count_tokens(tok, text + partial + piece);
        if (piece_tokens > o.input_len) break;
        best = piece;
        tokens = piece_tokens;
      }
      partial += best;
      break;
    }
    text += partial;
    prompts.push_back(BenchPrompt{.prompt_text = std::move(text), .input_len = tokens, .output_len = o.output_len});
  }
  return prompts;
}

Result<std::vector<BenchPrompt>> build_dataset(const DatasetOptions& o) {
  if (o.num_prompts < 1) return invalid_argument("--num-prompts must be at least 1, found " + std::to_string(o.num_prompts));
  if (o.output_len < 1) return invalid_argument("--output-len must be at least 1, found " + std::to_string(o.output_len));
  if (o.name == "random") {
    if (o.input_len < 1) return invalid_argument("--input-len must be at least 1, found " + std::to_string(o.input_len));
    if (o.range_ratio < 0 || o.range_ratio >= 1)
      return invalid_argument("--random-range-ratio must be in [0, 1), found " + std::to_string(o.range_ratio));
    return build_random(o);
  }
  if (o.name == "jsonl") {
    if (o.path.empty()) return invalid_argument("--dataset-name jsonl needs --dataset-path FILE");
    return build_jsonl(o);
  }
  if (o.name == "sonnet") {
    if (o.path.empty()) return invalid_argument("--dataset-name sonnet needs the sonnet file: --dataset-path FILE");
    LMX_ASSIGN_OR_RETURN(std::vector<std::string> lines, read_lines(o.path, "sonnet"));
    return build_sonnet(lines, o);
  }
  return invalid_argument("--dataset-name must be sonnet, random or jsonl, found '" + o.name + "'");
}

}  // namespace lmx::loadgen
