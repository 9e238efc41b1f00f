// Prometheus metrics of the server: request counters and latency histograms labelled by model (the base
// model's served name or the adapter's name), HTTP responses by status, and gauges read from the engine
// loop's snapshot at scrape time. Thread-safe (one mutex; recording is a few adds per finished request).
// Who calls: the engine loop (finished requests), the HTTP server (responses, GET /metrics).
#pragma once
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace lmx::server {

// The engine's state as last published by its thread.
struct EngineSnapshot {
  int num_running = 0;
  int num_waiting = 0;
  int kv_pages_used = 0;
  int kv_pages_total = 0;
  std::vector<std::string> adapters;           // served (registered) adapters
  std::vector<std::string> resident_adapters;  // in a device slot now
  std::map<std::string, int> in_flight;        // per model label: accepted and not yet finished
  std::map<std::string, int> running_by_model;  // per model label: in flight and scheduled at least once
  std::map<std::string, int> waiting_by_model;  // per model label: in flight, never scheduled yet
  uint64_t num_preemptions = 0;
  uint64_t adapter_loads = 0;                  // copies of an adapter into a slot
  int kv_pages_cached = 0;                     // free pages still holding a cached prefix (not in kv_pages_used)
  uint64_t prefix_cache_queries = 0;           // prompt tokens looked up in the prefix cache
  uint64_t prefix_cache_hits = 0;              // of which found cached
  int host_adapters = 0;                       // adapters parsed in the host tier
  uint64_t adapter_disk_loads = 0;             // reads of an adapter from disk into the host tier
  // Engine-thread time by kind of step (decode: every sequence of the step consumed and produced one token;
  // mixed: prefill tokens too): `step` inside Engine::step (host preparation, the GPU work, sampling, the
  // token read-back), `loop` the whole iteration that ran it (also commands, token delivery, the snapshot),
  // `device` the device time of the step's ops (from its enqueued inputs to its sampled tokens; 0 where the
  // backend has no device timer).
  // The recent windows hold the last kRecentSteps steps' times (a ring: `recent_next` is the next slot to
  // overwrite once full) for the quantiles of /metrics: a mean over every step since start also carries the
  // few steps that recorded a decode graph (host time inside the device span), a median does not.
  static constexpr size_t kRecentSteps = 1024;
  struct StepTimes {
    uint64_t steps = 0;
    double step_s = 0, loop_s = 0, device_s = 0, launch_s = 0;
    std::vector<double> recent_step_s, recent_device_s, recent_launch_s;
    size_t recent_next = 0;
    void add_recent(double step_seconds, double device_seconds, double launch_seconds);
  };
  StepTimes decode_steps, mixed_steps;
  // The refill wait (EngineLoopOptions): holds after steps that finished requests, by outcome — the
  // replacements arrived, or the wait ran out (its limit or its time budget) — and the time spent holding.
  struct RefillWaits {
    uint64_t arrived = 0, timed_out = 0;
    double seconds = 0;
  };
  RefillWaits refill_waits;
};

struct RequestRecord {
  std::string model;           // label
  std::string finish_reason;   // "stop", "length", "abort"
  int prompt_tokens = 0;
  int generation_tokens = 0;
  double ttft_s = -1;          // < 0: no token was produced
  double queue_s = -1;         // arrival to first scheduled step; < 0: never scheduled
  double e2e_s = 0;
};

class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}
  void observe(double v);
  // Prometheus lines for `name` with the extra label text (e.g. model="x").
  void render(std::string* out, const std::string& name, const std::string& labels) const;

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // [bounds + 1], the last is +Inf
  double sum_ = 0;
  uint64_t count_ = 0;
};

class Metrics {
 public:
  void record_request(const RequestRecord& r);
  void record_response(int http_status);
  std::string render(const EngineSnapshot& engine) const;

 private:
  struct PerModel {
    std::map<std::string, uint64_t> finished;  // by finish reason
    uint64_t prompt_tokens = 0, generation_tokens = 0;
    Histogram ttft{{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30}};
    Histogram tpot{{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1}};
    Histogram e2e{{0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120}};
    Histogram queue{{0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30}};
    // OTPS = (generated - 1) / (e2e - ttft): the per-request decode speed of design.md §9.
    Histogram otps{{1, 2.5, 5, 10, 25, 50, 75, 100, 150, 200, 300, 500, 1000}};
  };
  mutable std::mutex mu_;
  std::map<std::string, PerModel> models_;
  std::map<int, uint64_t> responses_;  // by HTTP status
};

// Escape a label value for the Prometheus text format.
std::string prometheus_label(const std::string& value);

}  // namespace lmx::server
