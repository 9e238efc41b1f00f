// The adapter tiers (GPU slots ← host LRU ← disk) on the tiny preset with PEFT directories written to a
// temporary folder: more adapters than host entries than slots all produce what they produce alone; a
// slow disk read (held back by the test) never stalls other requests' steps; pinned adapters stay in
// their slot and on the host; an adapter whose files changed or vanished fails its requests by name.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <future>
#include <random>
#include <thread>

#include "../lora/lora_test_util.h"
#include "engine_test_util.h"
#include "model/presets.h"

namespace lmx::engine {
namespace {

using testing::RunResult;

struct Fixture {
  model::ModelWeights weights;
  cpu::CpuBackend backend;
  uint64_t seed = 0;
  std::optional<Rng> rng;
  std::vector<std::unique_ptr<lora::testing::AdapterDir>> dirs;
  std::vector<std::string> names;
};

// A PEFT adapter on q_proj and v_proj of both layers with random A and small random B.
void write_adapter(Fixture& f, lora::testing::AdapterDir& d) {
  d.config()["target_modules"] = nlohmann::json::array({"q_proj", "v_proj"});
  const model::ModelConfig& c = f.weights.config;
  for (int layer = 0; layer < c.num_layers; ++layer) {
    for (auto [leaf, out] : {std::pair<const char*, int>{"q_proj", c.q_dim()}, {"v_proj", c.kv_dim()}}) {
      const std::string module = "base_model.model.model.layers." + std::to_string(layer) + ".self_attn." + leaf;
      std::vector<float> a(size_t(2 * c.hidden_size)), b(size_t(out * 2));
      for (float& x : a) x = f.rng->uniform(-1.0f, 1.0f);
      for (float& x : b) x = f.rng->uniform(-0.1f, 0.1f);
      d.add_values(module + ".lora_A.weight", {2, c.hidden_size}, a);
      d.add_values(module + ".lora_B.weight", {out, 2}, b);
    }
  }
  d.write();
}

std::unique_ptr<Fixture> make_fixture(int num_adapters) {
  auto f = std::make_unique<Fixture>();
  f->seed = std::random_device{}();
  f->rng.emplace(f->seed);
  Result<model::ModelWeights> w = model::make_preset_model("tiny-moe", 7);
  EXPECT_TRUE(w.ok()) << w.status().message();
  f->weights = std::move(w).value();
  for (int i = 0; i < num_adapters; ++i) {
    f->dirs.push_back(std::make_unique<lora::testing::AdapterDir>("tier" + std::to_string(i)));
    write_adapter(*f, *f->dirs.back());
    f->names.push_back("d" + std::to_string(i));
  }
  return f;
}

Result<lora::Adapter> read(const Fixture& f, int i, int max_rank = 64) {
  return lora::load_adapter(f.dirs[size_t(i)]->dir(), f.names[size_t(i)], lora_shapes(f.weights.config),
                            lora::AdapterLimits{.max_rank = max_rank});
}

// An engine with every fixture adapter registered from disk (pinned ones first, as add_cli_adapters does).
std::unique_ptr<Engine> make_engine(Fixture& f, EngineConfig config, const std::vector<std::string>& pinned = {}) {
  Result<std::unique_ptr<Engine>> e = Engine::create(f.weights, f.backend, config);
  EXPECT_TRUE(e.ok()) << e.status().message();
  for (int pass = 0; pass < 2; ++pass) {
    for (size_t i = 0; i < f.names.size(); ++i) {
      const bool pin = std::find(pinned.begin(), pinned.end(), f.names[i]) != pinned.end();
      if (pin != (pass == 0)) continue;
      Result<lora::Adapter> a = read(f, int(i));
      EXPECT_TRUE(a.ok()) << a.status().message();
      Status s = (*e)->add_adapter(std::move(a).value(), {.pinned = pin});
      EXPECT_TRUE(s.ok()) << s.message();
    }
  }
  return std::move(e).value();
}

Request make_request(const std::string& adapter, std::vector<int32_t> prompt, int max_tokens) {
  Request r;
  r.adapter = adapter;
  r.prompt_ids = std::move(prompt);
  r.sampling.max_tokens = max_tokens;
  r.sampling.ignore_eos = true;
  r.return_logits = true;
  return r;
}

std::vector<int32_t> random_ids(Fixture& f, int n) {
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int32_t& t : ids) t = int32_t(1 + f.rng->next_u64() % 250);
  return ids;
}

RunResult result_of(std::unique_ptr<Sequence> seq) {
  RunResult r;
  if (!seq) {
    ADD_FAILURE() << "request did not finish";
    return r;
  }
  r.tokens.assign(seq->tokens.begin() + seq->prompt_len, seq->tokens.end());
  r.logits = seq->logits;
  r.finish = seq->finish;
  return r;
}

// Step until done, tolerating steps that run nothing while an adapter read is in flight; `each_step`
// checks invariants after every step.
std::vector<RunResult> run_all_reading(Engine& e, const std::vector<Request>& rs, const std::function<void()>& each_step = {}) {
  std::vector<uint64_t> ids;
  for (const Request& r : rs) {
    Result<uint64_t> id = e.add_request(r);
    EXPECT_TRUE(id.ok()) << id.status().message();
    ids.push_back(id.ok() ? *id : 0);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (e.has_work() && std::chrono::steady_clock::now() < deadline) {
    const int ran = e.step().num_tokens;
    if (each_step) each_step();
    if (ran == 0) {
      EXPECT_GT(e.adapters().num_loading(), 0) << "a step ran nothing with no adapter read in flight";
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  EXPECT_FALSE(e.has_work()) << "timed out";
  std::vector<RunResult> out;
  for (uint64_t id : ids) out.push_back(result_of(e.take_finished(id)));
  return out;
}

// Holds reads back until opened; opens when destroyed (declare it after the engine) so a failing test never
// leaves the loader's worker waiting.
struct ReadGate {
  std::promise<void> promise;
  std::shared_future<void> opened = promise.get_future().share();
  bool is_open = false;
  void open() {
    if (!is_open) promise.set_value();
    is_open = true;
  }
  ~ReadGate() { open(); }
};

void expect_same(const std::vector<RunResult>& a, const std::vector<RunResult>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].tokens, b[i].tokens) << "request " << i;
    ASSERT_EQ(a[i].logits.size(), b[i].logits.size()) << "request " << i;
    for (size_t k = 0; k < a[i].logits.size(); ++k)
      EXPECT_EQ(a[i].logits[k], b[i].logits[k]) << "request " << i << " token " << k;
  }
}

std::vector<RunResult> run_each_alone(Fixture& f, const std::vector<Request>& rs) {
  std::vector<RunResult> out;
  for (const Request& r : rs) {
    auto e = make_engine(f, EngineConfig{});
    out.push_back(run_all_reading(*e, {r})[0]);
  }
  return out;
}

TEST(AdapterTiers, MoreAdaptersThanHostEntriesThanSlots) {
  auto f = make_fixture(5);
  SCOPED_TRACE("seed " + std::to_string(f->seed));
  std::vector<Request> rs;
  for (int i = 0; i < 14; ++i)
    rs.push_back(make_request(i % 6 == 5 ? "" : f->names[size_t(i % 6)], random_ids(*f, 3 + i % 7), 3 + i % 4));
  const std::vector<RunResult> alone = run_each_alone(*f, rs);
  // Adapters change outputs (so equality below means each request used its own weights).
  EXPECT_NE(alone[0].logits[0], alone[1].logits[0]);

  EngineConfig config;
  config.max_loras = 2;
  config.max_cpu_loras = 3;
  config.scheduler.max_num_seqs = 4;
  auto e = make_engine(*f, config);
  EXPECT_EQ(e->adapters().host_resident().size(), 3u);  // registration already evicted two host copies
  size_t most_on_host = 0;
  std::vector<RunResult> got = run_all_reading(*e, rs, [&] {
    most_on_host = std::max(most_on_host, e->adapters().host_resident().size());
    EXPECT_LE(e->adapters().resident().size(), 2u);
  });
  expect_same(got, alone);
  EXPECT_LE(most_on_host, 3u);
  EXPECT_GT(e->adapters().disk_loads(), 0u);
  EXPECT_GT(e->adapters().host_evictions(), 2u);
  EXPECT_EQ(e->scheduler().pages().num_used(), 0);
}

// The read of "d0" is held until the test releases it; meanwhile requests for resident adapters and the
// base model run every step and finish, and the d0 request waits holding nothing.
TEST(AdapterTiers, SlowDiskReadDoesNotStallOtherRequests) {
  auto f = make_fixture(3);
  SCOPED_TRACE("seed " + std::to_string(f->seed));
  EngineConfig config;
  config.max_loras = 2;
  config.max_cpu_loras = 2;  // registering d0, d1, d2 in order drops d0's host copy
  auto e = make_engine(*f, config);
  ASSERT_EQ(e->adapters().host_resident(), (std::vector<std::string>{"d1", "d2"}));
  ReadGate gate;
  std::atomic<int> slow_reads{0};
  AdapterStore& store = e->mutable_adapters();
  store.set_load_fn([&store, opened = gate.opened, &slow_reads](const std::string& name, const AdapterSource& source) {
    if (name == "d0") {
      ++slow_reads;
      opened.wait_for(std::chrono::seconds(30));
    }
    return store.read_source(name, source);
  });

  Request slow = make_request("d0", random_ids(*f, 6), 4);
  std::vector<Request> others = {make_request("d1", random_ids(*f, 5), 6), make_request("", random_ids(*f, 4), 5),
                                 make_request("d2", random_ids(*f, 7), 6)};
  std::vector<Request> all = {slow};
  all.insert(all.end(), others.begin(), others.end());
  const std::vector<RunResult> alone = run_each_alone(*f, all);
  uint64_t slow_id = e->add_request(slow).value();
  std::vector<uint64_t> other_ids;
  for (const Request& r : others) other_ids.push_back(e->add_request(r).value());
  std::vector<RunResult> other_results(others.size());
  std::vector<bool> done(others.size(), false);
  int steps = 0;
  while (std::find(done.begin(), done.end(), false) != done.end()) {
    ASSERT_LT(++steps, 100);
    const auto start = std::chrono::steady_clock::now();
    ASSERT_GT(e->step().num_tokens, 0) << "a step ran nothing while d0 is being read";
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
    for (size_t i = 0; i < others.size(); ++i) {
      if (done[i]) continue;
      std::unique_ptr<Sequence> seq = e->take_finished(other_ids[i]);
      if (!seq) continue;
      other_results[i] = result_of(std::move(seq));
      done[i] = true;
    }
  }
  expect_same(other_results, std::vector<RunResult>(alone.begin() + 1, alone.end()));
  EXPECT_EQ(e->scheduler().num_running(), 0);
  EXPECT_EQ(e->scheduler().num_waiting(), 1);  // d0's request, holding no pages or slot
  EXPECT_EQ(e->adapters().num_loading(), 1);
  for (int i = 0; i < 5000 && slow_reads.load() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(slow_reads.load(), 1);  // the worker is inside the held read
  EXPECT_EQ(e->scheduler().pages().num_used(), 0);
  gate.open();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (e->has_work() && std::chrono::steady_clock::now() < deadline) {
    if (e->step().num_tokens == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_FALSE(e->has_work());
  expect_same({result_of(e->take_finished(slow_id))}, {alone[0]});
  EXPECT_EQ(slow_reads.load(), 1);
  EXPECT_EQ(e->adapters().disk_loads(), 1u);
}

// An adapter removed (and registered again under its name with other content) while its read is in
// flight: the stale read is dropped when it lands, never installed under the new registration.
TEST(AdapterTiers, ReadLandingAfterRemoveIsDropped) {
  auto f = make_fixture(3);
  SCOPED_TRACE("seed " + std::to_string(f->seed));
  EngineConfig config;
  config.max_loras = 2;
  config.max_cpu_loras = 2;
  auto e = make_engine(*f, config);  // d0 is not on the host
  ReadGate gate;
  auto reads = std::make_shared<std::atomic<int>>(0), landed = std::make_shared<std::atomic<int>>(0);
  AdapterStore& store = e->mutable_adapters();
  store.set_load_fn([&store, opened = gate.opened, reads, landed](const std::string& name, const AdapterSource& source) {
    ++*reads;
    opened.wait_for(std::chrono::seconds(30));
    Result<lora::Adapter> adapter = store.read_source(name, source);
    ++*landed;
    return adapter;
  });
  const uint64_t id = e->add_request(make_request("d0", {7, 8, 9}, 2)).value();
  EXPECT_EQ(e->step().num_tokens, 0);  // the read starts; nothing else to run
  EXPECT_EQ(e->adapters().num_loading(), 1);
  for (int i = 0; i < 5000 && reads->load() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_EQ(reads->load(), 1);
  EXPECT_TRUE(e->abort(id));
  ASSERT_TRUE(e->remove_adapter("d0").ok());
  Result<lora::Adapter> other = read(*f, 1);  // d1's content, registered as "d0"
  ASSERT_TRUE(other.ok());
  lora::Adapter renamed = std::move(other).value();
  renamed.name = "d0";
  ASSERT_TRUE(e->add_adapter(std::move(renamed)).ok());
  EXPECT_EQ(e->adapters().num_loading(), 0);
  gate.open();
  for (int i = 0; i < 5000 && landed->load() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the worker hands the result over
  Request r = make_request("d0", random_ids(*f, 6), 4);
  Request as_d1 = r;
  as_d1.adapter = "d1";
  std::vector<RunResult> got = run_all_reading(*e, {r});
  EXPECT_EQ(e->adapters().disk_loads(), 0u);  // the stale read of the old d0 was dropped
  expect_same(got, run_each_alone(*f, {as_d1}));
}

// A request queued behind a full batch has its adapter read while the batch runs, not when its turn comes.
TEST(AdapterTiers, QueuedRequestsAdapterIsReadBeforeItsTurn) {
  auto f = make_fixture(3);
  SCOPED_TRACE("seed " + std::to_string(f->seed));
  EngineConfig config;
  config.max_loras = 1;
  config.max_cpu_loras = 2;
  config.scheduler.max_num_seqs = 1;
  auto e = make_engine(*f, config);  // on the host: d1, d2
  ASSERT_EQ(e->adapters().host_resident(), (std::vector<std::string>{"d1", "d2"}));
  ASSERT_TRUE(e->remove_adapter("d2").ok());  // leaves room on the host for one read
  const uint64_t first = e->add_request(make_request("d1", random_ids(*f, 4), 200)).value();
  Request queued = make_request("d0", random_ids(*f, 5), 3);
  const uint64_t second = e->add_request(queued).value();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (e->adapters().disk_loads() == 0 && std::chrono::steady_clock::now() < deadline) {
    ASSERT_GT(e->step().num_tokens, 0);
    ASSERT_EQ(e->take_finished(first), nullptr) << "the first request ended before d0 was read";
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(e->adapters().disk_loads(), 1u);
  EXPECT_EQ(e->scheduler().num_waiting(), 1);  // still behind the first request
  std::vector<std::string> host = e->adapters().host_resident();
  EXPECT_NE(std::find(host.begin(), host.end(), "d0"), host.end());
  while (e->has_work()) ASSERT_GT(e->step().num_tokens, 0);  // no step waits for a read any more
  EXPECT_NE(e->take_finished(first), nullptr);
  expect_same({result_of(e->take_finished(second))}, run_each_alone(*f, {queued}));
}

TEST(AdapterTiers, PinnedAdapterIsNeverEvicted) {
  auto f = make_fixture(5);
  SCOPED_TRACE("seed " + std::to_string(f->seed));
  EngineConfig config;
  config.max_loras = 2;
  config.max_cpu_loras = 2;
  auto e = make_engine(*f, config, {"d4"});
  EXPECT_TRUE(e->adapters().pinned("d4"));
  auto pinned_everywhere = [&] {
    std::vector<std::string> slots = e->adapters().resident(), host = e->adapters().host_resident();
    EXPECT_NE(std::find(slots.begin(), slots.end(), "d4"), slots.end()) << "d4 left its slot";
    EXPECT_NE(std::find(host.begin(), host.end(), "d4"), host.end()) << "d4 left the host tier";
  };
  pinned_everywhere();
  EXPECT_EQ(e->adapters().loads(), 1u);
  std::vector<Request> rs;
  for (int i = 0; i < 12; ++i) rs.push_back(make_request(f->names[size_t(i % 5)], random_ids(*f, 4 + i % 5), 3));
  std::vector<RunResult> got = run_all_reading(*e, rs, pinned_everywhere);
  expect_same(got, run_each_alone(*f, rs));
  // d4 was copied into its slot once; the others took turns in the single unpinned slot.
  EXPECT_GT(e->adapters().loads(), 4u);
  EXPECT_GT(e->adapters().host_evictions(), 0u);
  pinned_everywhere();

  // Limits: pinning every slot leaves no slot for unpinned adapters; requests for them are refused.
  EngineConfig one_slot;
  one_slot.max_loras = 1;
  auto all_pinned = make_engine(*f, one_slot, {"d0"});
  Result<uint64_t> refused = all_pinned->add_request(make_request("d1", {1, 2, 3}, 2));
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("pinned"), std::string::npos) << refused.status().message();
  EXPECT_TRUE(all_pinned->add_request(make_request("d0", {1, 2, 3}, 2)).ok());
  Result<lora::Adapter> second = read(*f, 1);
  ASSERT_TRUE(second.ok());
  lora::Adapter renamed = std::move(second).value();
  renamed.name = "d1_pinned";
  Status too_many = all_pinned->add_adapter(std::move(renamed), {.pinned = true});
  EXPECT_FALSE(too_many.ok());
  EXPECT_NE(too_many.message().find("all 1 adapter slots (--max-loras) are pinned"), std::string::npos) << too_many.message();
}

// Host copies are re-read from disk; files that changed (other content hash) or vanished fail the
// waiting requests with a message naming the adapter, and the other requests are unaffected.
TEST(AdapterTiers, ChangedOrMissingFilesFailOnlyTheirRequests) {
  auto f = make_fixture(3);
  SCOPED_TRACE("seed " + std::to_string(f->seed));
  EngineConfig config;
  config.max_loras = 1;
  config.max_cpu_loras = 1;
  Request base = make_request("", random_ids(*f, 5), 4);
  const std::vector<RunResult> alone = run_each_alone(*f, {base});
  auto e = make_engine(*f, config);  // d0 and d1 have left the host tier
  ASSERT_EQ(e->adapters().host_resident(), std::vector<std::string>{"d2"});
  {  // new random weights in d0's directory
    lora::testing::AdapterDir rewritten("rewritten");
    write_adapter(*f, rewritten);
    std::filesystem::copy_file(rewritten.dir() + "/adapter_model.safetensors", f->dirs[0]->dir() + "/adapter_model.safetensors",
                               std::filesystem::copy_options::overwrite_existing);
  }
  std::filesystem::remove(f->dirs[1]->dir() + "/adapter_model.safetensors");
  std::vector<uint64_t> ids;
  for (const std::string& adapter : {"d0", "d1"}) ids.push_back(e->add_request(make_request(adapter, {4, 5, 6}, 3)).value());
  const uint64_t base_id = e->add_request(base).value();
  std::vector<StepOutput> failures;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (e->has_work() && std::chrono::steady_clock::now() < deadline) {
    Engine::StepReport report = e->step();
    for (const StepOutput& out : report.outputs)
      if (!out.error.empty()) failures.push_back(out);
    if (report.num_tokens == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_EQ(failures.size(), 2u);
  for (const StepOutput& out : failures) {
    EXPECT_TRUE(out.finished);
    EXPECT_EQ(out.finish, FinishReason::kAbort);
    EXPECT_EQ(out.token, -1);
    std::unique_ptr<Sequence> seq = e->take_finished(out.id);
    ASSERT_NE(seq, nullptr);
    EXPECT_EQ(seq->error, out.error);
  }
  const std::string& changed = failures[0].id == ids[0] ? failures[0].error : failures[1].error;
  const std::string& missing = failures[0].id == ids[1] ? failures[0].error : failures[1].error;
  EXPECT_NE(changed.find("adapter 'd0' changed in"), std::string::npos) << changed;
  EXPECT_NE(missing.find("adapter 'd1'"), std::string::npos) << missing;
  EXPECT_NE(missing.find("adapter_model.safetensors"), std::string::npos) << missing;
  expect_same({result_of(e->take_finished(base_id))}, alone);
  EXPECT_EQ(e->scheduler().pages().num_used(), 0);
  // A later request for d1 tries the read again (and fails again, the file is still gone).
  const uint64_t retry = e->add_request(make_request("d1", {4, 5, 6}, 3)).value();
  while (e->has_work()) {
    if (e->step().num_tokens == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::unique_ptr<Sequence> again = e->take_finished(retry);
  ASSERT_NE(again, nullptr);
  EXPECT_NE(again->error.find("adapter 'd1'"), std::string::npos) << again->error;
}

TEST(AdapterTiers, LimitsAreCheckedAtRegistration) {
  auto f = make_fixture(0);
  EngineConfig config;
  config.max_loras = 4;
  config.max_cpu_loras = 2;
  Result<std::unique_ptr<Engine>> e = Engine::create(f->weights, f->backend, config);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("max_cpu_loras 2 must be 0 (no limit) or >= max_loras 4"), std::string::npos)
      << e.status().message();

  // A rank beyond the slot capacity is refused when registered, not when a slot load is attempted.
  config.max_cpu_loras = 4;
  config.max_lora_rank = 8;
  Result<std::unique_ptr<Engine>> small = Engine::create(f->weights, f->backend, config);
  ASSERT_TRUE(small.ok()) << small.status().message();
  Status refused = (*small)->add_adapter(lora::make_dummy_adapter("big", lora_shapes(f->weights.config), 9, 1));
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.message().find("adapter 'big' layer 0 q_proj: rank 9 exceeds the slot capacity 8 (--max-lora-rank 8)"),
            std::string::npos)
      << refused.message();
  EXPECT_FALSE((*small)->adapters().contains("big"));
  // Adapters that can never leave the host tier (in memory only) must fit in it.
  lora::BaseModelShapes shapes = lora_shapes(f->weights.config);
  for (int i = 0; i < 4; ++i)
    ASSERT_TRUE((*small)->add_adapter(lora::make_dummy_adapter("m" + std::to_string(i), shapes, 2, 5 + i)).ok());
  Status full = (*small)->add_adapter(lora::make_dummy_adapter("m4", shapes, 2, 9));
  ASSERT_FALSE(full.ok());
  EXPECT_NE(full.message().find("--max-cpu-loras 4"), std::string::npos) << full.message();
  // A dummy recipe can be regenerated, so it may leave the host tier.
  const AdapterSource recipe{.dummy_rank = 2, .dummy_seed = 9};
  EXPECT_TRUE((*small)->add_adapter(lora::make_dummy_adapter("m5", shapes, 2, 9), {.source = recipe}).ok());
}

}  // namespace
}  // namespace lmx::engine
