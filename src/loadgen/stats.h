// The figures of a serving benchmark, computed from per-request outcomes: TTFT, TPOT, ITL, end-to-end
// latency and OTPS distributions (mean/median/std/percentiles), throughputs, peaks, error counts; whole
// run or one adapter. Pure functions, unit-tested in tests/loadgen. Called by the bench report.
#pragma once
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace lmx::loadgen {

// What one request did. Times are seconds since the benchmark's start (steady clock).
struct RequestOutcome {
  std::string target;  // the `model` sent: an adapter name, or the base model's name
  bool is_base = false;
  bool success = false;
  std::string error;             // why it failed ("" on success)
  int prompt_len = 0;            // usage.prompt_tokens when the server reports it, else the dataset's count
  int output_tokens = 0;         // usage.completion_tokens, else counted from the stream
  int expected_output_len = 0;   // max_tokens sent
  double start_s = 0;            // request sent
  std::vector<double> chunk_times_s;  // arrival of each stream chunk that carried output (first = TTFT)
  std::vector<int> chunk_tokens;      // tokens in each of those chunks (1 where the server sends no ids)
  double end_s = 0;              // last output chunk (vLLM's latency end), or the failure
  double ttft_s() const { return chunk_times_s.empty() ? 0 : chunk_times_s.front() - start_s; }
  double latency_s() const { return end_s - start_s; }
};

// numpy.percentile's default (linear interpolation between closest ranks) of `values`, p in [0, 100].
// Empty input gives 0 (vLLM reports 0 for a figure with no samples).
double percentile(std::vector<double> values, double p);

struct Distribution {
  size_t count = 0;
  double mean = 0, median = 0, std = 0;  // std: population (numpy's default ddof=0)
  std::vector<std::pair<double, double>> percentiles;  // (p, value)
};
Distribution summarize(std::span<const double> values, std::span<const double> percentiles);

// Per-request OTPS = (output tokens - 1) / (latency - TTFT), tokens/s; false (no figure) for requests with
// one output token or no time after the first. TPOT = 1000 / OTPS ms, as vLLM defines it.
bool request_otps(const RequestOutcome& r, double* otps);
bool request_tpot_ms(const RequestOutcome& r, double* tpot_ms);

struct Figures {
  int completed = 0;
  int failed = 0;
  int64_t total_input_tokens = 0;
  int64_t total_output_tokens = 0;
  int output_len_mismatches = 0;  // completed requests whose output tokens != max_tokens sent
  double duration_s = 0;
  double request_throughput = 0;      // completed / duration
  double output_throughput = 0;       // output tokens / duration
  double total_token_throughput = 0;  // (input + output tokens) / duration
  double max_output_tokens_per_s = 0; // busiest whole second since the start (vLLM's peak)
  int max_concurrent_requests = 0;    // most requests in flight at once
  Distribution ttft_ms, tpot_ms, itl_ms, e2el_ms, otps;
  std::map<std::string, int> errors;  // message -> count
};

// Figures over `outcomes` (completed and failed) for a run that lasted `duration_s`. Only completed
// requests enter the token counts and distributions. ITL: every gap between consecutive output chunks.
Figures compute_figures(std::span<const RequestOutcome> outcomes, double duration_s, std::span<const double> percentiles);

// Per target, in first-seen order of `outcomes`.
std::vector<std::pair<std::string, Figures>> figures_per_target(std::span<const RequestOutcome> outcomes, double duration_s,
                                                                std::span<const double> percentiles);

}  // namespace lmx::loadgen
