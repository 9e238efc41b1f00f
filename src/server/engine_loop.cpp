// The engine thread (see engine_loop.h): drain commands, step, hand tokens to sinks, publish a snapshot.
#include "server/engine_loop.h"

#include <algorithm>

#include "core/log.h"

namespace lmx::server {

EngineLoop::EngineLoop(engine::Engine& engine, Metrics& metrics, std::string base_label, EngineLoopOptions options)
    : engine_(engine), metrics_(metrics), base_label_(std::move(base_label)), options_(options),
      refill_budget_s_(std::max(options.banked_s(), 0.0)) {
  for (const std::string& name : engine_.adapters().names()) served_.insert(name);
  publish();
}

EngineLoop::~EngineLoop() { stop(); }

void EngineLoop::start() { thread_ = std::thread([this] { run(); }); }

void EngineLoop::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void EngineLoop::post(std::function<void()> command) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    commands_.push_back(std::move(command));
  }
  wake_.notify_one();
}

uint64_t EngineLoop::submit(engine::Request request, TokenSink sink) {
  Clock::time_point arrival = Clock::now();
  std::unique_lock<std::mutex> lock(mu_);
  const uint64_t ticket = next_ticket_++;
  // Queued under the same lock that counts it, so a refill wait that sees the count finds the command.
  ++submitted_;
  commands_.push_back([this, ticket, arrival, request = std::move(request), sink = std::move(sink)]() mutable {
    std::string adapter = request.adapter;
    int prompt_tokens = int(request.prompt_ids.size());
    // An adapter being unloaded is still in the engine but takes no new requests.
    Result<uint64_t> id = retiring_.count(adapter) ? Result<uint64_t>(not_found("unknown adapter '" + adapter + "'"))
                                                   : engine_.add_request(std::move(request));
    if (!id.ok()) {
      const Status& s = id.status();
      TokenEvent ev{.finished = true, .prompt_tokens = prompt_tokens};
      ev.error = ApiError{s.code() == StatusCode::kNotFound ? 404 : 400, s.message(),
                          s.code() == StatusCode::kNotFound ? "model" : ""};
      sink(std::move(ev));
      return;
    }
    Active a{.engine_id = *id, .sink = std::move(sink), .label = adapter.empty() ? base_label_ : adapter,
             .adapter = adapter, .arrival = arrival, .prompt_tokens = prompt_tokens};
    ticket_of_[*id] = ticket;
    active_.emplace(ticket, std::move(a));
  });
  lock.unlock();
  wake_.notify_one();
  return ticket;
}

void EngineLoop::cancel(uint64_t ticket, engine::FinishReason reason) {
  post([this, ticket, reason] {
    auto it = active_.find(ticket);
    if (it == active_.end()) return;  // already finished
    engine_.abort(it->second.engine_id);
    Active a = std::move(it->second);
    active_.erase(it);
    ticket_of_.erase(a.engine_id);
    a.sink = nullptr;
    finish(a, reason);
    retire_unused_adapters();
  });
}

void EngineLoop::add_adapter(lora::Adapter adapter, AdminDone done) {
  post([this, adapter = std::move(adapter), done = std::move(done)]() mutable {
    std::string name = adapter.name;
    if (retiring_.count(name)) {
      done(ApiError{409, "adapter '" + name + "' is still finishing requests after its unload; retry shortly", "lora_name"});
      return;
    }
    if (engine_.adapters().contains(name)) {
      done(ApiError{400, "adapter '" + name + "' is already loaded", "lora_name"});
      return;
    }
    Status added = engine_.add_adapter(std::move(adapter));
    if (!added.ok()) {
      done(ApiError{400, added.message(), "lora_name"});
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      served_.insert(name);
    }
    log_info("loaded adapter '" + name + "'");
    done(std::nullopt);
  });
}

void EngineLoop::remove_adapter(const std::string& name, AdminDone done) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!served_.erase(name)) {
      done(ApiError{404, "adapter '" + name + "' is not loaded", "lora_name"});
      return;
    }
  }
  post([this, name, done = std::move(done)] {
    retiring_.insert(name);
    retire_unused_adapters();
    done(std::nullopt);
  });
}

bool EngineLoop::has_adapter(const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  return served_.count(name) != 0;
}

std::vector<std::string> EngineLoop::adapter_names() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {served_.begin(), served_.end()};
}

EngineSnapshot EngineLoop::snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  return snapshot_;
}

void EngineLoop::retire_unused_adapters() {
  for (auto it = retiring_.begin(); it != retiring_.end();) {
    if (engine_.remove_adapter(*it).ok()) {  // refused while queued or running requests use it
      log_info("unloaded adapter '" + *it + "'");
      it = retiring_.erase(it);
    } else {
      ++it;
    }
  }
}

void EngineLoop::finish(Active& a, engine::FinishReason reason) {
  Clock::time_point now = Clock::now();
  auto seconds = [](Clock::duration d) { return std::chrono::duration<double>(d).count(); };
  metrics_.record_request({.model = a.label,
                           .finish_reason = engine::finish_reason_name(reason),
                           .prompt_tokens = a.prompt_tokens,
                           .generation_tokens = a.generated,
                           .ttft_s = a.generated > 0 ? seconds(a.first_token - a.arrival) : -1.0,
                           .queue_s = a.scheduled ? seconds(a.first_scheduled - a.arrival) : -1.0,
                           .e2e_s = seconds(now - a.arrival)});
}

void EngineLoop::deliver(const engine::StepOutput& out) {
  auto t = ticket_of_.find(out.id);
  LMX_CHECK(t != ticket_of_.end());
  uint64_t ticket = t->second;
  Active& a = active_.at(ticket);
  if (a.generated++ == 0) a.first_token = Clock::now();
  TokenEvent ev{.tokens = {out.token}, .finished = out.finished, .finish = out.finish,
                .prompt_tokens = a.prompt_tokens, .completion_tokens = a.generated};
  if (out.logprobs) ev.logprobs.push_back(*out.logprobs);
  if (!out.error.empty()) {  // failed before any token (its adapter could not be read again)
    --a.generated;
    ev.tokens.clear();
    ev.completion_tokens = 0;
    ev.error = ApiError{500, out.error, "model"};
  }
  if (!out.finished) {
    a.sink(std::move(ev));
    return;
  }
  // Metrics and the published snapshot are updated before the client gets its last token, so a scrape
  // made after the response never finds the request still in flight.
  TokenSink sink = std::move(a.sink);
  engine_.take_finished(out.id);  // the sink gets every token; drop the sequence
  finish(a, out.finish);
  ticket_of_.erase(t);
  active_.erase(ticket);
  publish();
  sink(std::move(ev));
}

void EngineLoop::wait_for_refill(int finished, uint64_t mark) {
  const double limit_s = std::min(options_.refill_wait_s, refill_budget_s_);
  if (limit_s <= 0) return;
  const Clock::time_point start = Clock::now();
  bool arrived;
  {
    std::unique_lock<std::mutex> lock(mu_);
    arrived = wake_.wait_for(lock, std::chrono::duration<double>(limit_s),
                             [&] { return stopping_ || submitted_ - mark >= uint64_t(finished); });
    arrived = arrived && !stopping_;
  }
  const double held_s = std::chrono::duration<double>(Clock::now() - start).count();
  refill_budget_s_ = std::max(0.0, refill_budget_s_ - held_s);
  ++(arrived ? refill_waits_.arrived : refill_waits_.timed_out);
  refill_waits_.seconds += held_s;
  std::lock_guard<std::mutex> lock(mu_);
  snapshot_.refill_waits = refill_waits_;
}

void EngineLoop::publish() {
  EngineSnapshot s;
  const engine::Scheduler& sched = engine_.scheduler();
  s.num_running = sched.num_running();
  s.num_waiting = sched.num_waiting();
  s.kv_pages_total = sched.pages().num_pages();
  s.kv_pages_used = s.kv_pages_total - sched.pages().num_free();
  s.resident_adapters = engine_.adapters().resident();
  s.num_preemptions = sched.num_preemptions();
  s.adapter_loads = engine_.adapters().loads();
  s.kv_pages_cached = sched.pages().num_cached();
  s.prefix_cache_queries = sched.prefix_cache_queries();
  s.prefix_cache_hits = sched.prefix_cache_hits();
  s.host_adapters = int(engine_.adapters().host_resident().size());
  s.adapter_disk_loads = engine_.adapters().disk_loads();
  s.decode_steps = decode_times_;
  s.mixed_steps = mixed_times_;
  s.refill_waits = refill_waits_;
  for (const auto& [ticket, a] : active_) ++s.in_flight[a.label];
  // Per model label (every served adapter and the base, zeros included): requests that have run in a step
  // (running; a preempted one stays counted here) and those not yet scheduled (waiting).
  s.running_by_model[base_label_] = s.waiting_by_model[base_label_] = 0;
  for (const std::string& name : engine_.adapters().names()) s.running_by_model[name] = s.waiting_by_model[name] = 0;
  for (const auto& [ticket, a] : active_) ++(a.scheduled ? s.running_by_model : s.waiting_by_model)[a.label];
  std::lock_guard<std::mutex> lock(mu_);
  s.adapters.assign(served_.begin(), served_.end());
  snapshot_ = std::move(s);
}

void EngineLoop::run() {
  while (true) {
    std::deque<std::function<void()>> commands;
    {
      std::unique_lock<std::mutex> lock(mu_);
      // Idle: sleep until a command arrives. A step that could not schedule anything (should not happen:
      // a lone request always fits) waits briefly instead of spinning.
      auto ready = [&] { return stopping_ || !commands_.empty(); };
      if (!engine_.has_work()) wake_.wait(lock, ready);
      if (stopping_) break;
      commands.swap(commands_);
    }
    const Clock::time_point iteration_start = Clock::now();
    for (auto& command : commands) command();
    EngineSnapshot::StepTimes* times = nullptr;  // the kind of step this iteration ran, if any
    double step_seconds = 0, device_seconds = 0, launch_seconds = 0;
    int finished = 0;        // requests that ended in this step
    uint64_t mark = 0;       // submissions counted before their tokens went out
    if (engine_.has_work()) {
      const Clock::time_point step_start = Clock::now();
      engine::Engine::StepReport report = engine_.step();
      const Clock::time_point ran = Clock::now();
      {
        std::lock_guard<std::mutex> lock(mu_);
        mark = submitted_;
      }
      step_seconds = std::chrono::duration<double>(ran - step_start).count();
      device_seconds = std::max(report.device_seconds, 0.0);
      launch_seconds = report.launch_seconds;
      if (report.num_tokens > 0) {
        times = report.num_tokens == int(report.outputs.size()) ? &decode_times_ : &mixed_times_;
      }
      for (uint64_t id : report.scheduled) {
        auto t = ticket_of_.find(id);
        if (t == ticket_of_.end()) continue;
        Active& a = active_.at(t->second);
        if (!a.scheduled) {
          a.scheduled = true;
          a.first_scheduled = ran;
        }
      }
      for (const engine::StepOutput& out : report.outputs) deliver(out);
      for (const engine::StepOutput& out : report.outputs) finished += out.finished ? 1 : 0;
      if (finished > 0 && !retiring_.empty()) retire_unused_adapters();
      if (report.num_tokens == 0) {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait_for(lock, std::chrono::milliseconds(5), [&] { return stopping_ || !commands_.empty(); });
      }
    }
    publish();
    if (times != nullptr) {  // after the snapshot, so its cost is counted too; then patched into it
      ++times->steps;
      times->step_s += step_seconds;
      times->device_s += device_seconds;
      times->launch_s += launch_seconds;
      times->loop_s += std::chrono::duration<double>(Clock::now() - iteration_start).count();
      times->add_recent(step_seconds, device_seconds, launch_seconds);
      std::lock_guard<std::mutex> lock(mu_);
      snapshot_.decode_steps = decode_times_;
      snapshot_.mixed_steps = mixed_times_;
    }
    if (options_.refill_wait_s > 0) {
      refill_budget_s_ = std::min(options_.banked_s(), refill_budget_s_ + options_.refill_wait_share * step_seconds);
      // Only where the next step would decode alone: a waiting prompt is scheduled anyway, and with nothing
      // running the loop sleeps until the next command.
      if (finished > 0 && engine_.has_work() && engine_.scheduler().num_waiting() == 0) wait_for_refill(finished, mark);
    }
  }
  // Shutdown: whatever is still queued is aborted; the server drains before stopping, so normally nothing.
  std::deque<std::function<void()>> late;
  {
    std::lock_guard<std::mutex> lock(mu_);
    late.swap(commands_);
  }
  for (auto& command : late) command();
  for (auto& [ticket, a] : active_) {
    engine_.abort(a.engine_id);
    TokenEvent ev{.finished = true, .finish = engine::FinishReason::kAbort};
    ev.error = ApiError{503, "the server is shutting down", ""};
    a.sink(std::move(ev));
  }
  active_.clear();
  ticket_of_.clear();
  publish();
}

}  // namespace lmx::server
