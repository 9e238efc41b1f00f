// The benchmark report: the printed summary in `vllm bench serve`'s layout (plus OTPS and a per-adapter
// table) and the result JSON with vLLM's field names where the figure is the same. Called by apps/bench.cpp;
// tools/plot_bench.py and tests/server/test_bench_serve.py read the JSON.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "loadgen/stats.h"

namespace lmx::loadgen {

// The run's settings as they go into the JSON (and the report's header lines).
struct RunSettings {
  std::string base_url;
  std::string endpoint;
  std::string model;  // the base model's name
  std::string tokenizer;
  std::string dataset_name;
  std::string dataset_path;
  int num_prompts = 0;
  int num_warmups = 0;
  int input_len = 0;
  int output_len = 0;
  double request_rate = 0;  // infinity = all at once
  int max_concurrency = 0;  // 0 = unbounded
  uint64_t seed = 0;
  bool ignore_eos = false;
  std::vector<std::string> lora_modules;
  std::string lora_assignment;
  double base_fraction = 0;
  std::vector<double> percentiles;
};

struct BenchReport {
  RunSettings settings;
  std::string date;  // YYYYMMDD-HHMMSS, UTC
  Figures overall;
  // Per target (adapter name or the base model's name), with the number of requests planned for it.
  struct Target {
    std::string name;
    bool is_base = false;
    int planned = 0;
    Figures figures;
  };
  std::vector<Target> targets;
  std::vector<RequestOutcome> outcomes;  // for --save-detailed
};

// Builds the report from outcomes; `planned` = requests per target name as assigned (any order).
BenchReport make_report(RunSettings settings, std::vector<RequestOutcome> outcomes, double duration_s,
                        const std::vector<std::pair<std::string, int>>& planned);

// vLLM's key for a percentile: "p99", "p99.9".
std::string percentile_key(double p);

nlohmann::json report_json(const BenchReport& report, bool detailed);
std::string format_report(const BenchReport& report);

}  // namespace lmx::loadgen
