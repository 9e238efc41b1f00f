// Benchmark statistics (see stats.h). numpy/vLLM conventions: linear-interpolation percentiles,
// population std, 0 for a figure without samples.
#include "loadgen/stats.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace lmx::loadgen {

double percentile(std::vector<double> values, double p) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  // numpy "linear": the p-th percentile sits at rank p/100 * (n - 1) of the sorted values.
  const double rank = std::clamp(p, 0.0, 100.0) / 100.0 * double(values.size() - 1);
  const size_t below = size_t(std::floor(rank));
  const size_t above = std::min(below + 1, values.size() - 1);
  const double fraction = rank - double(below);
  return values[below] + (values[above] - values[below]) * fraction;
}

Distribution summarize(std::span<const double> values, std::span<const double> percentiles) {
  Distribution d;
  d.count = values.size();
  std::vector<double> copy(values.begin(), values.end());
  if (!copy.empty()) {
    d.mean = std::accumulate(copy.begin(), copy.end(), 0.0) / double(copy.size());
    double squares = 0;
    for (double v : copy) squares += (v - d.mean) * (v - d.mean);
    d.std = std::sqrt(squares / double(copy.size()));
    d.median = percentile(copy, 50);
  }
  for (double p : percentiles) d.percentiles.emplace_back(p, percentile(copy, p));
  return d;
}

bool request_otps(const RequestOutcome& r, double* otps) {
  const double decode_s = r.latency_s() - r.ttft_s();
  if (!r.success || r.output_tokens < 2 || r.chunk_times_s.empty() || !(decode_s > 0)) return false;
  *otps = double(r.output_tokens - 1) / decode_s;
  return true;
}

bool request_tpot_ms(const RequestOutcome& r, double* tpot_ms) {
  double otps = 0;
  if (!request_otps(r, &otps)) return false;
  *tpot_ms = 1000.0 / otps;
  return true;
}

namespace {

// Most requests in flight at once: a sweep over [start, end) intervals (an end before a start at the
// same instant, so back-to-back requests on one slot count once).
int max_in_flight(std::span<const RequestOutcome> outcomes) {
  std::vector<std::pair<double, int>> events;
  for (const RequestOutcome& r : outcomes) {
    events.emplace_back(r.start_s, +1);
    events.emplace_back(std::max(r.end_s, r.start_s), -1);
  }
  std::sort(events.begin(), events.end());
  int now = 0, most = 0;
  for (const auto& [time, delta] : events) {
    now += delta;
    most = std::max(most, now);
  }
  return most;
}

// Output tokens of the busiest whole second after the start (vLLM buckets token arrivals by second).
double peak_output_per_second(std::span<const RequestOutcome> outcomes) {
  std::map<int64_t, int64_t> per_second;
  for (const RequestOutcome& r : outcomes) {
    if (!r.success) continue;
    for (size_t i = 0; i < r.chunk_times_s.size(); ++i)
      per_second[int64_t(std::floor(r.chunk_times_s[i]))] += i < r.chunk_tokens.size() ? r.chunk_tokens[i] : 1;
  }
  int64_t most = 0;
  for (const auto& [second, tokens] : per_second) most = std::max(most, tokens);
  return double(most);
}

}  // namespace

Figures compute_figures(std::span<const RequestOutcome> outcomes, double duration_s, std::span<const double> percentiles) {
  Figures f;
  f.duration_s = duration_s;
  std::vector<double> ttft, tpot, itl, e2el, otps;
  for (const RequestOutcome& r : outcomes) {
    if (!r.success) {
      ++f.failed;
      ++f.errors[r.error.empty() ? "unknown error" : r.error];
      continue;
    }
    ++f.completed;
    f.total_input_tokens += r.prompt_len;
    f.total_output_tokens += r.output_tokens;
    if (r.output_tokens != r.expected_output_len) ++f.output_len_mismatches;
    if (!r.chunk_times_s.empty()) ttft.push_back(r.ttft_s() * 1000.0);
    for (size_t i = 1; i < r.chunk_times_s.size(); ++i) itl.push_back((r.chunk_times_s[i] - r.chunk_times_s[i - 1]) * 1000.0);
    e2el.push_back(r.latency_s() * 1000.0);
    double value = 0;
    if (request_otps(r, &value)) otps.push_back(value);
    if (request_tpot_ms(r, &value)) tpot.push_back(value);
  }
  if (duration_s > 0) {
    f.request_throughput = double(f.completed) / duration_s;
    f.output_throughput = double(f.total_output_tokens) / duration_s;
    f.total_token_throughput = double(f.total_input_tokens + f.total_output_tokens) / duration_s;
  }
  f.max_output_tokens_per_s = peak_output_per_second(outcomes);
  f.max_concurrent_requests = max_in_flight(outcomes);
  f.ttft_ms = summarize(ttft, percentiles);
  f.tpot_ms = summarize(tpot, percentiles);
  f.itl_ms = summarize(itl, percentiles);
  f.e2el_ms = summarize(e2el, percentiles);
  f.otps = summarize(otps, percentiles);
  return f;
}

std::vector<std::pair<std::string, Figures>> figures_per_target(std::span<const RequestOutcome> outcomes, double duration_s,
                                                                std::span<const double> percentiles) {
  std::vector<std::string> order;
  std::map<std::string, std::vector<RequestOutcome>> groups;
  for (const RequestOutcome& r : outcomes) {
    auto [it, inserted] = groups.try_emplace(r.target);
    if (inserted) order.push_back(r.target);
    it->second.push_back(r);
  }
  std::vector<std::pair<std::string, Figures>> out;
  for (const std::string& target : order) out.emplace_back(target, compute_figures(groups[target], duration_s, percentiles));
  return out;
}

}  // namespace lmx::loadgen
