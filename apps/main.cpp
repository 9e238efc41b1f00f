// loramux CLI entry point: registers the subcommands (apps/*.cpp) and runs the chosen one.
#include <cstdio>

#include "apps/commands.h"

int main(int argc, char** argv) {
  CLI::App app{"loramux: many LoRA adapters of one MoE model on one GPU"};
  app.require_subcommand(1);
  auto generate = lmx::apps::add_generate_command(app);
  auto inspect = lmx::apps::add_inspect_command(app);
  auto tokenize = lmx::apps::add_tokenize_command(app);
  auto serve = lmx::apps::add_serve_command(app);
  auto bench = lmx::apps::add_bench_command(app);
  auto tune = lmx::apps::add_tune_command(app);
  CLI11_PARSE(app, argc, argv);
  if (app.got_subcommand("generate")) return generate();
  if (app.got_subcommand("inspect")) return inspect();
  if (app.got_subcommand("tokenize")) return tokenize();
  if (app.got_subcommand("serve")) return serve();
  if (app.got_subcommand("bench")) return bench();
  if (app.got_subcommand("tune")) return tune();
  return 2;
}
