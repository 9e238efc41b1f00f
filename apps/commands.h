// The CLI's subcommands: each file in apps/ registers one on the CLI11 app and runs it when chosen.
#pragma once
#include <CLI/CLI.hpp>
#include <functional>
#include <map>
#include <string>

#include "engine/scheduler.h"

namespace lmx::apps {
// --prefill-packing whole|fill (generate and serve): SchedulerLimits::prefill_packing.
inline void add_prefill_packing_option(CLI::App* cmd, engine::SchedulerLimits* limits) {
  using Packing = engine::SchedulerLimits::PrefillPacking;
  const std::map<std::string, Packing> names{{"whole", Packing::kWhole}, {"fill", Packing::kFill}};
  cmd->add_option("--prefill-packing", limits->prefill_packing,
                  "whole: a new prompt that fits a step of its own is not split across two steps (it starts in the "
                  "next one); fill: fill every step's token budget, splitting the last prompt (vLLM's chunked prefill)")
      ->transform(CLI::CheckedTransformer(names, CLI::ignore_case))
      ->option_text("whole|fill (default: whole)");
}

// Each returns the action to run when its subcommand was chosen (the process exit code).
std::function<int()> add_generate_command(CLI::App& app);
std::function<int()> add_inspect_command(CLI::App& app);
std::function<int()> add_tokenize_command(CLI::App& app);
std::function<int()> add_serve_command(CLI::App& app);
std::function<int()> add_bench_command(CLI::App& app);
std::function<int()> add_tune_command(CLI::App& app);
}  // namespace lmx::apps
