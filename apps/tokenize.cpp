// `loramux tokenize --model DIR`: text <-> token ids from the command line, one JSON value per line
// (stdin -> stdout): a JSON string in, a JSON array of ids out; with --decode the reverse. Lets scripts
// and tests check loramux's tokenizer against Hugging Face's without writing C++.
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

#include "apps/commands.h"
#include "tokenizer/tokenizer.h"

namespace lmx::apps {
namespace {

struct TokenizeOptions {
  std::string model;
  bool decode = false;
  bool no_special = false;
};

// A bad line answers `null` (so output lines stay aligned with input lines), is reported on stderr with
// its line number, and makes the exit code 1; the other lines are still processed.
int run_tokenize(const TokenizeOptions& opts) {
  Result<tokenizer::Tokenizer> tok = tokenizer::Tokenizer::load(opts.model);
  if (!tok.ok()) {
    std::cerr << "loramux tokenize: " << tok.status().message() << "\n";
    return 1;
  }
  int exit_code = 0;
  std::string line;
  for (size_t line_number = 1; std::getline(std::cin, line); ++line_number) {
    try {
      const nlohmann::json input = nlohmann::json::parse(line);
      if (!opts.decode) {
        if (!input.is_string()) throw std::invalid_argument("expected a JSON string, found " + std::string(input.type_name()));
        std::cout << nlohmann::json(tok->encode(input.get<std::string>(), !opts.no_special)).dump() << "\n";
      } else {
        if (!input.is_array()) throw std::invalid_argument("expected a JSON array of ids, found " + std::string(input.type_name()));
        std::vector<int32_t> ids;
        for (const nlohmann::json& id : input) {
          if (!id.is_number_integer()) throw std::invalid_argument("expected integer ids, found " + id.dump());
          ids.push_back(id.get<int32_t>());
        }
        // --no-special while decoding drops special tokens from the text (skip_special_tokens).
        std::cout << nlohmann::json(tok->decode(ids, opts.no_special)).dump() << "\n";
      }
    } catch (const std::exception& e) {
      std::cerr << "loramux tokenize: stdin line " << line_number << ": " << e.what() << "\n";
      std::cout << "null\n";
      exit_code = 1;
    }
  }
  return exit_code;
}

}  // namespace

std::function<int()> add_tokenize_command(CLI::App& app) {
  auto opts = std::make_shared<TokenizeOptions>();
  CLI::App* cmd = app.add_subcommand("tokenize", "Encode JSON strings (one per stdin line) to JSON id arrays, or --decode");
  cmd->add_option("--model", opts->model, "Model directory with tokenizer.json, or the tokenizer.json file")->required();
  cmd->add_flag("--decode", opts->decode, "Read JSON arrays of ids, print JSON strings");
  cmd->add_flag("--no-special", opts->no_special,
                "Encode without the post-processor's special tokens; decode without special tokens");
  return [opts] { return run_tokenize(*opts); };
}

}  // namespace lmx::apps
