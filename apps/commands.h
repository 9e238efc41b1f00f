// The CLI's subcommands: each file in apps/ registers one on the CLI11 app and runs it when chosen.
#pragma once
#include <CLI/CLI.hpp>
#include <functional>

namespace lmx::apps {
// Each returns the action to run when its subcommand was chosen (the process exit code).
std::function<int()> add_generate_command(CLI::App& app);
std::function<int()> add_inspect_command(CLI::App& app);
std::function<int()> add_tokenize_command(CLI::App& app);
std::function<int()> add_serve_command(CLI::App& app);
std::function<int()> add_bench_command(CLI::App& app);
std::function<int()> add_tune_command(CLI::App& app);
}  // namespace lmx::apps
