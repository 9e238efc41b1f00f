// EngineLoop: the one thread that owns the Engine and runs its step loop (schedule → run → sample →
// postprocess). Other threads reach it only through submit/cancel/adapter calls, which enqueue commands;
// each request's tokens come back through its sink, called on the engine thread (the HTTP server posts
// them onto the connection's strand). Does not parse HTTP or know about sockets. Who calls: http_server.cpp.
#pragma once
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>

#include "engine/engine.h"
#include "server/api.h"
#include "server/metrics.h"

namespace lmx::server {

// What a request's sink receives: new tokens (one per step today), and once, finished = true.
struct TokenEvent {
  std::vector<int32_t> tokens;
  std::vector<engine::TokenLogprobs> logprobs;  // one per token when the request asked for logprobs
  bool finished = false;
  engine::FinishReason finish = engine::FinishReason::kNone;
  int prompt_tokens = 0;
  int completion_tokens = 0;      // generated so far
  std::optional<ApiError> error;  // the engine refused the request (finished is true)
};
using TokenSink = std::function<void(TokenEvent)>;
using AdminDone = std::function<void(std::optional<ApiError>)>;

// The refill wait. A client that sends its next request as soon as one finishes (a closed-loop benchmark, an
// agent chaining calls) reaches the engine while the step after the finish already runs, so its prompt
// waits one whole step more than it had to; when that step is another new prompt's prefill, a mixed step of
// ~37 ms on GPT-OSS-20B, every such arrival waits for the one before it (TTFT ≈ two mixed steps). After a
// step that finished requests, with nothing waiting to be scheduled and sequences still decoding, the loop
// holds the next step until as many new requests as finished have arrived, or `refill_wait_s` has passed.
// The holds are paid from a budget that grows by `refill_wait_share` of every step's time, so decoding
// sequences never lose more than that share of their speed, whatever the traffic. Up to kBankedHolds
// holds' worth is banked: in a closed loop the finishes come in runs of consecutive steps (each client's
// replacement prompt makes the next step a mixed one, in which the next client finishes), so the holds
// cluster too. refill_wait_s 0 turns it off.
struct EngineLoopOptions {
  static constexpr int kBankedHolds = 64;
  double refill_wait_s = 0.003;
  double refill_wait_share = 0.02;
  double banked_s() const { return kBankedHolds * refill_wait_s; }
};

class EngineLoop {
 public:
  // `base_label` labels base-model requests in metrics (the served model name).
  EngineLoop(engine::Engine& engine, Metrics& metrics, std::string base_label, EngineLoopOptions options = {});
  ~EngineLoop();
  EngineLoop(const EngineLoop&) = delete;
  EngineLoop& operator=(const EngineLoop&) = delete;

  void start();
  // Abort whatever is still queued (sinks get an error) and join the thread.
  void stop();

  // Queue a request; returns a ticket for cancel(). The sink is called on the engine thread.
  uint64_t submit(engine::Request request, TokenSink sink);
  // The client is gone (kAbort) or a stop string matched (kStop): end the request and free its pages and
  // slot. No further events reach its sink; `reason` is what metrics record.
  void cancel(uint64_t ticket, engine::FinishReason reason = engine::FinishReason::kAbort);

  // Adapters. Unloading refuses new requests at once and removes the adapter from the engine when its
  // last queued or running request has finished (they finish with its weights, never another's).
  void add_adapter(lora::Adapter adapter, AdminDone done);
  void remove_adapter(const std::string& name, AdminDone done);
  bool has_adapter(const std::string& name) const;
  std::vector<std::string> adapter_names() const;

  EngineSnapshot snapshot() const;

 private:
  using Clock = std::chrono::steady_clock;
  struct Active {
    uint64_t engine_id = 0;
    TokenSink sink;
    std::string label;  // metrics label: adapter name or the base label
    std::string adapter;
    Clock::time_point arrival, first_scheduled, first_token;
    bool scheduled = false;  // ran in a step at least once (counted as running from then on)
    int prompt_tokens = 0;
    int generated = 0;
  };

  void post(std::function<void()> command);
  void run();
  void deliver(const engine::StepOutput& out);
  void finish(Active& a, engine::FinishReason reason);  // metrics of a request that ended
  void retire_unused_adapters();
  void publish();
  // After a step that finished `finished` requests: hold until that many requests were submitted after
  // `mark` (a value of submitted_), the budget is spent or refill_wait_s has passed (EngineLoopOptions).
  void wait_for_refill(int finished, uint64_t mark);

  engine::Engine& engine_;
  Metrics& metrics_;
  std::string base_label_;
  EngineLoopOptions options_;
  std::thread thread_;

  mutable std::mutex mu_;  // guards the fields below up to the engine-thread-only section
  std::condition_variable wake_;
  std::deque<std::function<void()>> commands_;
  bool stopping_ = false;
  uint64_t next_ticket_ = 1;
  uint64_t submitted_ = 0;  // requests submitted since start (their commands are queued once counted)
  std::set<std::string> served_;   // adapters new requests may use
  EngineSnapshot snapshot_;

  // Engine thread only.
  std::unordered_map<uint64_t, Active> active_;  // by ticket
  std::unordered_map<uint64_t, uint64_t> ticket_of_;  // engine id -> ticket
  std::set<std::string> retiring_;  // unloaded, still used by queued or running requests
  EngineSnapshot::StepTimes decode_times_, mixed_times_;  // engine-thread time per kind of step (metrics)
  EngineSnapshot::RefillWaits refill_waits_;
  double refill_budget_s_ = 0;  // what the refill wait may still hold (EngineLoopOptions)
};

}  // namespace lmx::server
