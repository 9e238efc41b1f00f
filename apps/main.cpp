// loramux CLI entry point: parses the subcommand and hands off to apps/*.cpp.
#include <CLI/CLI.hpp>

int main(int argc, char** argv) {
  CLI::App app{"loramux: many LoRA adapters of one MoE model on one GPU"};
  app.require_subcommand(1);
  CLI11_PARSE(app, argc, argv);
  return 0;
}
