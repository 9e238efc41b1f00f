// Benchmark report text and JSON (see report.h).
#include "loadgen/report.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <sstream>

namespace lmx::loadgen {

using nlohmann::json;

std::string percentile_key(double p) {
  char text[32];
  if (p == std::floor(p)) std::snprintf(text, sizeof(text), "p%d", int(p));
  else std::snprintf(text, sizeof(text), "p%g", p);
  return text;
}

BenchReport make_report(RunSettings settings, std::vector<RequestOutcome> outcomes, double duration_s,
                        const std::vector<std::pair<std::string, int>>& planned) {
  BenchReport r;
  r.settings = std::move(settings);
  const std::time_t now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm utc{};
  gmtime_r(&now, &utc);
  char date[32];
  std::strftime(date, sizeof(date), "%Y%m%d-%H%M%S", &utc);
  r.date = date;
  r.overall = compute_figures(outcomes, duration_s, r.settings.percentiles);
  // Every planned target gets a row (also one whose requests all failed or that got none), in plan order.
  std::vector<std::pair<std::string, Figures>> per_target = figures_per_target(outcomes, duration_s, r.settings.percentiles);
  for (const auto& [name, count] : planned) {
    BenchReport::Target t{.name = name, .is_base = name == r.settings.model, .planned = count};
    for (const auto& [target, figures] : per_target)
      if (target == name) t.figures = figures;
    r.targets.push_back(std::move(t));
  }
  r.outcomes = std::move(outcomes);
  return r;
}

namespace {

// The figures under vLLM's names: completed, total_*_tokens, *_throughput, {mean,median,std,pN}_{metric}_ms.
json figures_json(const Figures& f) {
  json j = {{"completed", f.completed},
            {"failed", f.failed},
            {"total_input_tokens", f.total_input_tokens},
            {"total_output_tokens", f.total_output_tokens},
            {"request_throughput", f.request_throughput},
            {"output_throughput", f.output_throughput},
            {"total_token_throughput", f.total_token_throughput},
            {"max_output_tokens_per_s", f.max_output_tokens_per_s},
            {"max_concurrent_requests", f.max_concurrent_requests},
            {"output_len_mismatches", f.output_len_mismatches}};
  auto add = [&](const char* metric, const char* unit, const Distribution& d) {
    const std::string suffix = std::string(metric) + unit;
    j["mean_" + suffix] = d.mean;
    j["median_" + suffix] = d.median;
    j["std_" + suffix] = d.std;
    for (const auto& [p, value] : d.percentiles) j[percentile_key(p) + "_" + suffix] = value;
  };
  add("ttft", "_ms", f.ttft_ms);
  add("tpot", "_ms", f.tpot_ms);
  add("itl", "_ms", f.itl_ms);
  add("e2el", "_ms", f.e2el_ms);
  add("otps", "", f.otps);  // tokens/s per request: (output tokens - 1) / (latency - TTFT)
  json errors = json::object();
  for (const auto& [message, count] : f.errors) errors[message] = count;
  j["error_counts"] = errors;
  return j;
}

}  // namespace

json report_json(const BenchReport& r, bool detailed) {
  const RunSettings& s = r.settings;
  json j = {{"date", r.date},
            {"backend", "openai"},
            {"base_url", s.base_url},
            {"endpoint", s.endpoint},
            {"model_id", s.model},
            {"tokenizer_id", s.tokenizer.empty() ? json(nullptr) : json(s.tokenizer)},
            {"dataset_name", s.dataset_name},
            {"dataset_path", s.dataset_path.empty() ? json(nullptr) : json(s.dataset_path)},
            {"num_prompts", s.num_prompts},
            {"num_warmups", s.num_warmups},
            {"input_len", s.input_len},
            {"output_len", s.output_len},
            {"request_rate", std::isfinite(s.request_rate) ? json(s.request_rate) : json("inf")},
            {"burstiness", 1.0},
            {"max_concurrency", s.max_concurrency > 0 ? json(s.max_concurrency) : json(nullptr)},
            {"seed", s.seed},
            {"ignore_eos", s.ignore_eos},
            {"lora_modules", s.lora_modules},
            {"lora_assignment", s.lora_assignment},
            {"base_fraction", s.base_fraction},
            {"percentiles", s.percentiles},
            {"duration", r.overall.duration_s}};
  j.update(figures_json(r.overall));
  json per_adapter = json::object();
  for (const BenchReport::Target& t : r.targets) {
    json row = figures_json(t.figures);
    row["is_base"] = t.is_base;
    row["num_requests"] = t.planned;
    per_adapter[t.name] = row;
  }
  j["per_adapter"] = per_adapter;
  if (detailed) {  // vLLM's --save-detailed arrays, one entry per request in send order
    json input_lens = json::array(), output_lens = json::array(), ttfts = json::array(), itls = json::array(),
         errors = json::array(), models = json::array(), start_times = json::array();
    for (const RequestOutcome& o : r.outcomes) {
      input_lens.push_back(o.prompt_len);
      output_lens.push_back(o.output_tokens);
      ttfts.push_back(o.ttft_s());
      json gaps = json::array();
      for (size_t i = 1; i < o.chunk_times_s.size(); ++i) gaps.push_back(o.chunk_times_s[i] - o.chunk_times_s[i - 1]);
      itls.push_back(gaps);
      errors.push_back(o.error);
      models.push_back(o.target);
      start_times.push_back(o.start_s);
    }
    j["input_lens"] = input_lens;
    j["output_lens"] = output_lens;
    j["ttfts"] = ttfts;
    j["itls"] = itls;
    j["errors"] = errors;
    j["models"] = models;
    j["start_times"] = start_times;
  }
  return j;
}

namespace {

void line(std::ostringstream& out, const std::string& label, const std::string& value) {
  char text[160];
  std::snprintf(text, sizeof(text), "%-40s %-10s\n", label.c_str(), value.c_str());
  out << text;
}
std::string fixed2(double v) {
  char text[48];
  std::snprintf(text, sizeof(text), "%.2f", v);
  return text;
}
// "====== title ======" centred in 50 columns, as vLLM prints section headers.
std::string header(const std::string& title, char fill) {
  const size_t width = 50;
  if (title.size() >= width) return title + "\n";
  const size_t left = (width - title.size()) / 2;
  return std::string(left, fill) + title + std::string(width - title.size() - left, fill) + "\n";
}
std::string percentile_label(double p) {
  std::string key = percentile_key(p);
  key[0] = 'P';
  return key;
}

void distribution(std::ostringstream& out, const std::string& title, const std::string& name, const std::string& unit,
                  const Distribution& d) {
  out << header(title, '-');
  line(out, "Mean " + name + " (" + unit + "):", fixed2(d.mean));
  line(out, "Median " + name + " (" + unit + "):", fixed2(d.median));
  for (const auto& [p, value] : d.percentiles) line(out, percentile_label(p) + " " + name + " (" + unit + "):", fixed2(value));
}

}  // namespace

std::string format_report(const BenchReport& r) {
  const Figures& f = r.overall;
  std::ostringstream out;
  out << header(" Serving Benchmark Result ", '=');
  line(out, "Successful requests:", std::to_string(f.completed));
  line(out, "Failed requests:", std::to_string(f.failed));
  if (r.settings.max_concurrency > 0) line(out, "Maximum request concurrency:", std::to_string(r.settings.max_concurrency));
  line(out, "Request rate configured (RPS):", std::isfinite(r.settings.request_rate) ? fixed2(r.settings.request_rate) : "inf");
  line(out, "Benchmark duration (s):", fixed2(f.duration_s));
  line(out, "Total input tokens:", std::to_string(f.total_input_tokens));
  line(out, "Total generated tokens:", std::to_string(f.total_output_tokens));
  line(out, "Request throughput (req/s):", fixed2(f.request_throughput));
  line(out, "Output token throughput (tok/s):", fixed2(f.output_throughput));
  line(out, "Peak output token throughput (tok/s):", fixed2(f.max_output_tokens_per_s));
  line(out, "Peak concurrent requests:", fixed2(f.max_concurrent_requests));
  line(out, "Total Token throughput (tok/s):", fixed2(f.total_token_throughput));
  distribution(out, "Time to First Token", "TTFT", "ms", f.ttft_ms);
  distribution(out, "Time per Output Token (excl. 1st token)", "TPOT", "ms", f.tpot_ms);
  distribution(out, "Inter-token Latency", "ITL", "ms", f.itl_ms);
  distribution(out, "End-to-end Latency", "E2EL", "ms", f.e2el_ms);
  distribution(out, "Output Tokens per Second per Request", "OTPS", "tok/s", f.otps);
  out << header("", '=');
  if (f.output_len_mismatches > 0)
    out << "note: " << f.output_len_mismatches << " completed request(s) generated a different number of tokens than "
        << "max_tokens (stopped at EOS? pass --ignore-eos)\n";
  if (!f.errors.empty()) {
    out << "Errors:\n";
    for (const auto& [message, count] : f.errors) out << "  " << count << " x " << message << "\n";
  }
  if (r.targets.size() > 1 || (r.targets.size() == 1 && !r.targets[0].is_base)) {
    out << header(" Per Adapter ", '-');
    // The tail column shows the highest reported percentile (p99 by default).
    const double tail = r.settings.percentiles.empty() ? 50 : *std::max_element(r.settings.percentiles.begin(),
                                                                                 r.settings.percentiles.end());
    const std::string tail_label = "TTFT " + percentile_key(tail);
    char row[256];
    std::snprintf(row, sizeof(row), "%-20s %5s %5s %9s %9s %9s %9s %9s %10s\n", "model", "ok", "fail", "OTPS med",
                  "TTFT med", tail_label.c_str(), "TPOT med", "E2EL med", "out tok/s");
    out << row;
    for (const BenchReport::Target& t : r.targets) {
      const Figures& g = t.figures;
      const std::string name = t.is_base ? t.name + " (base)" : t.name;
      double ttft_tail = g.ttft_ms.median;
      for (const auto& [p, value] : g.ttft_ms.percentiles)
        if (p == tail) ttft_tail = value;
      std::snprintf(row, sizeof(row), "%-20s %5d %5d %9.2f %9.2f %9.2f %9.2f %9.2f %10.2f\n", name.c_str(), g.completed,
                    g.failed, g.otps.median, g.ttft_ms.median, ttft_tail, g.tpot_ms.median, g.e2el_ms.median,
                    g.output_throughput);
      out << row;
    }
    out << header("", '=');
  }
  return out.str();
}

}  // namespace lmx::loadgen
