// Prometheus text rendering of the server's metrics (see metrics.h).
#include "server/metrics.h"

#include <algorithm>
#include <cstdio>
#include <string>

namespace lmx::server {

namespace {
std::string number(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}
void line(std::string* out, const std::string& name, const std::string& labels, double value) {
  *out += name;
  if (!labels.empty()) *out += "{" + labels + "}";
  *out += " " + number(value) + "\n";
}
void help(std::string* out, const std::string& name, const char* type, const char* text) {
  *out += "# HELP " + name + " " + text + "\n# TYPE " + name + " " + type + "\n";
}
}  // namespace

std::string prometheus_label(const std::string& value) {
  std::string out;
  for (char c : value) {
    if (c == '\\') out += "\\\\";
    else if (c == '"') out += "\\\"";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

void EngineSnapshot::StepTimes::add_recent(double step_seconds, double device_seconds, double launch_seconds) {
  if (recent_step_s.size() < kRecentSteps) {
    recent_step_s.push_back(step_seconds);
    recent_device_s.push_back(device_seconds);
    recent_launch_s.push_back(launch_seconds);
    return;
  }
  recent_step_s[recent_next] = step_seconds;
  recent_device_s[recent_next] = device_seconds;
  recent_launch_s[recent_next] = launch_seconds;
  recent_next = (recent_next + 1) % kRecentSteps;
}

namespace {
// Prometheus summary lines (quantiles 0.5 / 0.9 / 0.99, _sum, _count) of `values`; nothing when empty.
void summary(std::string* out, const std::string& name, const std::string& labels, std::vector<double> values) {
  if (values.empty()) return;
  std::sort(values.begin(), values.end());
  double sum = 0;
  for (double v : values) sum += v;
  for (const char* q : {"0.5", "0.9", "0.99"}) {
    const size_t at = std::min(values.size() - 1, size_t(std::stod(q) * double(values.size())));
    line(out, name, labels + ",quantile=\"" + q + "\"", values[at]);
  }
  line(out, name + "_sum", labels, sum);
  line(out, name + "_count", labels, double(values.size()));
}
}  // namespace

void Histogram::observe(double v) {
  size_t i = 0;
  while (i < bounds_.size() && v > bounds_[i]) ++i;
  ++counts_[i];
  sum_ += v;
  ++count_;
}

void Histogram::render(std::string* out, const std::string& name, const std::string& labels) const {
  uint64_t cumulative = 0;
  std::string sep = labels.empty() ? "" : ",";
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    cumulative += counts_[i];
    std::string le = i < bounds_.size() ? number(bounds_[i]) : "+Inf";
    line(out, name + "_bucket", labels + sep + "le=\"" + le + "\"", double(cumulative));
  }
  line(out, name + "_sum", labels, sum_);
  line(out, name + "_count", labels, double(count_));
}

void Metrics::record_request(const RequestRecord& r) {
  std::lock_guard<std::mutex> lock(mu_);
  PerModel& m = models_[r.model];
  ++m.finished[r.finish_reason];
  m.prompt_tokens += uint64_t(r.prompt_tokens);
  m.generation_tokens += uint64_t(r.generation_tokens);
  if (r.ttft_s >= 0) m.ttft.observe(r.ttft_s);
  if (r.generation_tokens > 1) m.tpot.observe((r.e2e_s - r.ttft_s) / (r.generation_tokens - 1));
  m.e2e.observe(r.e2e_s);
  if (r.queue_s >= 0) m.queue.observe(r.queue_s);
  if (r.generation_tokens > 1 && r.e2e_s > r.ttft_s) m.otps.observe((r.generation_tokens - 1) / (r.e2e_s - r.ttft_s));
}

void Metrics::record_response(int http_status) {
  std::lock_guard<std::mutex> lock(mu_);
  ++responses_[http_status];
}

std::string Metrics::render(const EngineSnapshot& e) const {
  std::string out;
  auto gauge = [&](const char* name, const char* text, double v) {
    help(&out, name, "gauge", text);
    line(&out, name, "", v);
  };
  gauge("loramux_num_requests_running", "Sequences in the engine's running set.", e.num_running);
  gauge("loramux_num_requests_waiting", "Sequences waiting for admission.", e.num_waiting);
  gauge("loramux_kv_pages_used", "KV-cache pages held by sequences.", e.kv_pages_used);
  gauge("loramux_kv_pages_total", "KV-cache pages in the cache.", e.kv_pages_total);
  gauge("loramux_kv_cache_usage_perc", "Fraction of KV-cache pages in use.",
        e.kv_pages_total ? double(e.kv_pages_used) / e.kv_pages_total : 0.0);
  gauge("loramux_adapters_loaded", "Adapters registered (servable by name).", double(e.adapters.size()));
  gauge("loramux_adapters_resident", "Adapters in a device slot.", double(e.resident_adapters.size()));
  help(&out, "loramux_num_preemptions_total", "counter", "Sequences preempted (recomputed later) for KV pages.");
  line(&out, "loramux_num_preemptions_total", "", double(e.num_preemptions));
  help(&out, "loramux_adapter_slot_loads_total", "counter", "Adapter copies into a device slot.");
  line(&out, "loramux_adapter_slot_loads_total", "", double(e.adapter_loads));
  gauge("loramux_kv_pages_cached", "Free KV-cache pages still holding a cached prefix (evictable).", e.kv_pages_cached);
  help(&out, "loramux_gpu_prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.");
  line(&out, "loramux_gpu_prefix_cache_queries_total", "", double(e.prefix_cache_queries));
  help(&out, "loramux_gpu_prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.");
  line(&out, "loramux_gpu_prefix_cache_hits_total", "", double(e.prefix_cache_hits));
  gauge("loramux_gpu_prefix_cache_hit_rate", "Prefix cache hits / queries (tokens) since start.",
        e.prefix_cache_queries ? double(e.prefix_cache_hits) / double(e.prefix_cache_queries) : 0.0);
  gauge("loramux_adapters_host", "Adapters parsed in the host tier (--max-cpu-loras).", e.host_adapters);
  help(&out, "loramux_adapter_disk_loads_total", "counter", "Adapter reads from disk into the host tier after start.");
  line(&out, "loramux_adapter_disk_loads_total", "", double(e.adapter_disk_loads));
  help(&out, "loramux_engine_steps_total", "counter",
       "Engine steps by kind: decode (one token in and out per sequence) or mixed (prefill tokens too).");
  help(&out, "loramux_engine_step_seconds_total", "counter",
       "Wall time inside the engine's step (inputs, GPU work, sampling, token read-back), by kind.");
  help(&out, "loramux_engine_loop_seconds_total", "counter",
       "Wall time of the engine-thread iterations that ran a step (plus commands, token delivery, snapshot), by kind.");
  help(&out, "loramux_engine_device_seconds_total", "counter",
       "Device time of the steps' ops, enqueued inputs to sampled tokens (CUDA events; 0 without a device timer), by kind.");
  for (const auto& [kind, t] : {std::pair{"decode", e.decode_steps}, std::pair{"mixed", e.mixed_steps}}) {
    const std::string label = std::string("kind=\"") + kind + "\"";
    line(&out, "loramux_engine_steps_total", label, double(t.steps));
    line(&out, "loramux_engine_step_seconds_total", label, t.step_s);
    line(&out, "loramux_engine_loop_seconds_total", label, t.loop_s);
    line(&out, "loramux_engine_device_seconds_total", label, t.device_s);
  }
  help(&out, "loramux_engine_refill_waits_total", "counter",
       "Holds of the next step after a step that finished requests, waiting for their clients' next requests "
       "(--refill-wait-ms), by outcome: arrived (as many new requests as finished) or timeout.");
  line(&out, "loramux_engine_refill_waits_total", "outcome=\"arrived\"", double(e.refill_waits.arrived));
  line(&out, "loramux_engine_refill_waits_total", "outcome=\"timeout\"", double(e.refill_waits.timed_out));
  help(&out, "loramux_engine_refill_wait_seconds_total", "counter", "Wall time the engine thread held steps for refills.");
  line(&out, "loramux_engine_refill_wait_seconds_total", "", e.refill_waits.seconds);
  help(&out, "loramux_engine_step_seconds", "summary",
       "Wall time inside the engine's step over the last 1024 steps of the kind: quantiles, sum, count.");
  help(&out, "loramux_engine_step_device_seconds", "summary",
       "Device time of the step's ops over the last 1024 steps of the kind (0 without a device timer).");
  help(&out, "loramux_engine_step_launch_seconds", "summary",
       "Host time from the step's enqueued inputs until its forward was launched (graph replay or eager launches), "
       "over the last 1024 steps of the kind: the device span includes it until the first kernel starts.");
  for (const auto& [kind, t] : {std::pair{"decode", e.decode_steps}, std::pair{"mixed", e.mixed_steps}}) {
    const std::string label = std::string("kind=\"") + kind + "\"";
    summary(&out, "loramux_engine_step_seconds", label, t.recent_step_s);
    summary(&out, "loramux_engine_step_device_seconds", label, t.recent_device_s);
    summary(&out, "loramux_engine_step_launch_seconds", label, t.recent_launch_s);
  }
  help(&out, "loramux_adapter_resident", "gauge", "1 for each adapter in a device slot.");
  for (const std::string& a : e.resident_adapters) line(&out, "loramux_adapter_resident", "adapter=\"" + prometheus_label(a) + "\"", 1);
  help(&out, "loramux_requests_in_flight", "gauge", "Accepted requests not yet finished, by model.");
  for (const auto& [model, n] : e.in_flight) line(&out, "loramux_requests_in_flight", "model=\"" + prometheus_label(model) + "\"", n);
  help(&out, "loramux_model_requests_running", "gauge", "In-flight requests that have been scheduled, by model (adapter).");
  for (const auto& [model, n] : e.running_by_model)
    line(&out, "loramux_model_requests_running", "model=\"" + prometheus_label(model) + "\"", n);
  help(&out, "loramux_model_requests_waiting", "gauge", "In-flight requests not yet scheduled, by model (adapter).");
  for (const auto& [model, n] : e.waiting_by_model)
    line(&out, "loramux_model_requests_waiting", "model=\"" + prometheus_label(model) + "\"", n);

  std::lock_guard<std::mutex> lock(mu_);
  help(&out, "loramux_http_responses_total", "counter", "HTTP responses by status code.");
  for (const auto& [status, n] : responses_) line(&out, "loramux_http_responses_total", "status=\"" + std::to_string(status) + "\"", double(n));
  help(&out, "loramux_requests_total", "counter", "Finished generation requests by model and finish reason.");
  for (const auto& [model, m] : models_)
    for (const auto& [reason, n] : m.finished)
      line(&out, "loramux_requests_total", "model=\"" + prometheus_label(model) + "\",finish_reason=\"" + reason + "\"", double(n));
  help(&out, "loramux_prompt_tokens_total", "counter", "Prompt tokens of finished requests.");
  for (const auto& [model, m] : models_) line(&out, "loramux_prompt_tokens_total", "model=\"" + prometheus_label(model) + "\"", double(m.prompt_tokens));
  help(&out, "loramux_generation_tokens_total", "counter", "Generated tokens of finished requests.");
  for (const auto& [model, m] : models_)
    line(&out, "loramux_generation_tokens_total", "model=\"" + prometheus_label(model) + "\"", double(m.generation_tokens));
  help(&out, "loramux_time_to_first_token_seconds", "histogram", "Arrival to first generated token.");
  for (const auto& [model, m] : models_) m.ttft.render(&out, "loramux_time_to_first_token_seconds", "model=\"" + prometheus_label(model) + "\"");
  help(&out, "loramux_time_per_output_token_seconds", "histogram", "Mean time between output tokens after the first.");
  for (const auto& [model, m] : models_) m.tpot.render(&out, "loramux_time_per_output_token_seconds", "model=\"" + prometheus_label(model) + "\"");
  help(&out, "loramux_e2e_request_latency_seconds", "histogram", "Arrival to last token.");
  for (const auto& [model, m] : models_) m.e2e.render(&out, "loramux_e2e_request_latency_seconds", "model=\"" + prometheus_label(model) + "\"");
  help(&out, "loramux_request_queue_time_seconds", "histogram", "Arrival to the first step that ran the request.");
  for (const auto& [model, m] : models_)
    m.queue.render(&out, "loramux_request_queue_time_seconds", "model=\"" + prometheus_label(model) + "\"");
  help(&out, "loramux_request_output_tokens_per_second", "histogram",
       "Per-request decode speed (OTPS): (generated tokens - 1) / (e2e - TTFT).");
  for (const auto& [model, m] : models_)
    m.otps.render(&out, "loramux_request_output_tokens_per_second", "model=\"" + prometheus_label(model) + "\"");
  return out;
}

}  // namespace lmx::server
