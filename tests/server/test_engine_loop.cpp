// The engine loop's refill wait on the tiny preset (cpu backend): a request sent after another one finished
// joins the very next step when the loop holds for it, and not without the hold; a hold nobody answers ends
// after its limit; the holds never spend more than their budget. Steps are counted from the loop's
// published snapshot inside the sinks (they run on the engine thread, before the step's counters move).
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <thread>

#include "backends/cpu/cpu_backend.h"
#include "engine/engine.h"
#include "model/presets.h"
#include "server/engine_loop.h"

namespace lmx::server {
namespace {

struct Fixture {
  model::ModelWeights weights;
  cpu::CpuBackend backend;
  std::unique_ptr<engine::Engine> engine;
  Metrics metrics;
};

std::unique_ptr<Fixture> make_fixture() {
  auto f = std::make_unique<Fixture>();
  Result<model::ModelWeights> w = model::make_preset_model("tiny-moe", 7);
  EXPECT_TRUE(w.ok()) << w.status().message();
  f->weights = std::move(w).value();
  engine::EngineConfig config;
  config.scheduler.max_model_len = 2048;
  config.scheduler.max_num_seqs = 96;  // every request of a test runs at once: nothing is left waiting
  Result<std::unique_ptr<engine::Engine>> e = engine::Engine::create(f->weights, f->backend, config);
  EXPECT_TRUE(e.ok()) << e.status().message();
  f->engine = std::move(e).value();
  return f;
}

engine::Request request(int max_tokens, int32_t first_id) {
  engine::Request r;
  for (int t = 0; t < 12; ++t) r.prompt_ids.push_back((first_id + 7 * t) % 200 + 1);
  r.sampling.max_tokens = max_tokens;
  r.sampling.ignore_eos = true;
  return r;
}

uint64_t steps_of(const EngineLoop& loop) {
  EngineSnapshot s = loop.snapshot();
  return s.decode_steps.steps + s.mixed_steps.steps;
}

struct Refill {
  uint64_t finish_step = 0;       // the step in which A finished (0-based, from the snapshot)
  uint64_t first_token_step = 0;  // the step that gave B its first token
  EngineSnapshot::RefillWaits waits;
};

// A long request R keeps the loop stepping; A (3 tokens) finishes, and its "client" sends B `delay` after
// A's last token, from another thread. Returns the steps of both events and the loop's hold counters.
Refill run_refill(EngineLoopOptions options, std::chrono::milliseconds delay) {
  std::unique_ptr<Fixture> f = make_fixture();
  EngineLoop loop(*f->engine, f->metrics, "base", options);
  Refill out;
  std::promise<void> b_done;
  std::thread client;
  uint64_t r_ticket = loop.submit(request(1500, 1), [](TokenEvent) {});
  loop.submit(request(3, 50), [&](TokenEvent ev) {
    if (!ev.finished) return;
    out.finish_step = steps_of(loop);
    client = std::thread([&loop, &out, &b_done, delay] {
      std::this_thread::sleep_for(delay);
      auto first = std::make_shared<bool>(true);
      loop.submit(request(2, 90), [&loop, &out, &b_done, first](TokenEvent ev) {
        if (*first && !ev.tokens.empty()) {
          *first = false;
          out.first_token_step = steps_of(loop);
          out.waits = loop.snapshot().refill_waits;  // before B's own finish starts a hold of its own
        }
        if (ev.finished) b_done.set_value();
      });
    });
  });
  loop.start();  // R and A are admitted in the same first step
  EXPECT_EQ(b_done.get_future().wait_for(std::chrono::seconds(60)), std::future_status::ready);
  loop.cancel(r_ticket);
  if (client.joinable()) client.join();
  loop.stop();
  return out;
}

TEST(EngineLoopRefill, NextRequestJoinsTheStepAfterTheFinish) {
  // A generous hold: B arrives 30 ms after A's last token, and R's steps take well under that.
  Refill held = run_refill({.refill_wait_s = 2.0, .refill_wait_share = 1.0}, std::chrono::milliseconds(30));
  EXPECT_EQ(held.first_token_step, held.finish_step + 1);
  EXPECT_EQ(held.waits.arrived, 1u);
  EXPECT_EQ(held.waits.timed_out, 0u);
  EXPECT_GE(held.waits.seconds, 0.025);

  // No hold: R's decode steps go on while B's client sleeps, so B starts several steps later.
  Refill free = run_refill({.refill_wait_s = 0.0}, std::chrono::milliseconds(30));
  EXPECT_GE(free.first_token_step, free.finish_step + 2);
  EXPECT_EQ(free.waits.arrived + free.waits.timed_out, 0u);
}

// `count` short requests of distinct lengths beside a long one, nobody sending more: each finishes in a step
// of its own with R still decoding, so each finish starts a hold that nobody answers.
EngineSnapshot::RefillWaits run_unanswered(EngineLoopOptions options, int count) {
  std::unique_ptr<Fixture> f = make_fixture();
  EngineLoop loop(*f->engine, f->metrics, "base", options);
  std::vector<std::promise<void>> done(static_cast<size_t>(count));
  uint64_t r_ticket = loop.submit(request(1500, 1), [](TokenEvent) {});
  for (int i = 0; i < count; ++i) {
    loop.submit(request(2 + i, 20 + i), [&done, i](TokenEvent ev) {
      if (ev.finished) done[size_t(i)].set_value();
    });
  }
  loop.start();  // every request is admitted in the first step, so each short one ends in a step of its own
  for (auto& d : done) EXPECT_EQ(d.get_future().wait_for(std::chrono::seconds(60)), std::future_status::ready);
  // The last finish's hold starts after its sink ran; it ends well within this (limits are ≤ 20 ms here).
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  loop.cancel(r_ticket);
  EngineSnapshot::RefillWaits waits = loop.snapshot().refill_waits;
  loop.stop();
  return waits;
}

TEST(EngineLoopRefill, UnansweredHoldsEndAtTheirLimit) {
  const EngineLoopOptions options{.refill_wait_s = 0.02, .refill_wait_share = 1.0};
  EngineSnapshot::RefillWaits waits = run_unanswered(options, 8);
  EXPECT_EQ(waits.arrived, 0u);
  EXPECT_EQ(waits.timed_out, 8u);
  EXPECT_GE(waits.seconds, 8 * 0.0195);
  EXPECT_LE(waits.seconds, 8 * 0.02 + 0.5);  // each ends at its limit, give or take the thread's wake-up
}

TEST(EngineLoopRefill, HoldsNeverSpendMoreThanTheirBudget) {
  // No growth (share 0): 80 unanswered holds of up to 1 ms get the banked 64 ms between them, no more. Each
  // hold lasts at least its limit (a late wake-up only makes it longer and spends the bank sooner), so at
  // most 64 full holds and a last partial one run, the bank is spent, and only the last hold's wake-up
  // delay can exceed it.
  const EngineLoopOptions options{.refill_wait_s = 0.001, .refill_wait_share = 0.0};
  EngineSnapshot::RefillWaits waits = run_unanswered(options, 80);
  EXPECT_EQ(waits.arrived, 0u);
  EXPECT_GE(waits.timed_out, 1u);
  EXPECT_LE(waits.timed_out, uint64_t(EngineLoopOptions::kBankedHolds + 1));
  EXPECT_GE(waits.seconds, options.banked_s() * 0.999);
  EXPECT_LE(waits.seconds, options.banked_s() + 0.05);
}

}  // namespace
}  // namespace lmx::server
