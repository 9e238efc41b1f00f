// Prefix caching in the engine (tiny preset, cpu backend, generated adapters): outputs with the cache are
// bitwise those without it (also under chunked prefill, preemption and slot eviction); a shared system
// prompt hits; identical prompts under different adapter content never share pages, while the same
// content under another name does; a re-registered adapter with changed weights misses; pages return to
// zero used (cached-but-free pages counted apart); eviction under memory pressure; abort keeps accounting.
#include <gtest/gtest.h>

#include <random>

#include "core/rng.h"
#include "engine_test_util.h"
#include "lora/adapter.h"
#include "model/presets.h"

namespace lmx::engine {
namespace {

using testing::RunResult;
using testing::run_all;

struct Fixture {
  model::ModelWeights weights;
  cpu::CpuBackend backend;
  std::vector<lora::Adapter> adapters;  // a0, a1, ...
  uint64_t seed = 0;
  std::optional<Rng> rng;
};

std::unique_ptr<Fixture> make_fixture(int num_adapters) {
  auto f = std::make_unique<Fixture>();
  f->seed = std::random_device{}();
  f->rng.emplace(f->seed);
  Result<model::ModelWeights> w = model::make_preset_model("tiny-moe", 7);
  EXPECT_TRUE(w.ok()) << w.status().message();
  f->weights = std::move(w).value();
  lora::BaseModelShapes shapes = lora_shapes(f->weights.config);
  for (int i = 0; i < num_adapters; ++i)
    f->adapters.push_back(lora::make_dummy_adapter("a" + std::to_string(i), shapes, 4 + 4 * (i % 2), 100 + uint64_t(i)));
  return f;
}

std::unique_ptr<Engine> make_engine(Fixture& f, EngineConfig config) {
  Result<std::unique_ptr<Engine>> e = Engine::create(f.weights, f.backend, config);
  EXPECT_TRUE(e.ok()) << e.status().message();
  for (const lora::Adapter& a : f.adapters) {
    Status s = (*e)->add_adapter(a);
    EXPECT_TRUE(s.ok()) << s.message();
  }
  return std::move(e).value();
}

std::vector<int32_t> random_ids(Fixture& f, int n) {
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int32_t& t : ids) t = int32_t(1 + f.rng->next_u64() % 250);
  return ids;
}

Request make_request(const std::string& adapter, std::vector<int32_t> prompt, int max_tokens = 5) {
  Request r;
  r.adapter = adapter;
  r.prompt_ids = std::move(prompt);
  r.sampling.max_tokens = max_tokens;
  r.sampling.ignore_eos = true;
  r.return_logits = true;
  return r;
}

std::vector<int32_t> concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

void expect_same(const std::vector<RunResult>& a, const std::vector<RunResult>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].tokens, b[i].tokens) << "request " << i;
    ASSERT_EQ(a[i].logits.size(), b[i].logits.size()) << "request " << i;
    for (size_t k = 0; k < a[i].logits.size(); ++k)
      EXPECT_EQ(a[i].logits[k], b[i].logits[k]) << "request " << i << " token " << k;
  }
}

EngineConfig small_pages(bool caching) {
  EngineConfig c;
  c.scheduler.page_size = 4;
  c.scheduler.max_model_len = 64;
  c.scheduler.enable_prefix_caching = caching;
  return c;
}

// Run one request to completion and return its result and the prompt tokens it found cached.
RunResult run_one(Engine& e, const Request& r, int* cached_tokens) {
  Result<uint64_t> id = e.add_request(r);
  EXPECT_TRUE(id.ok()) << id.status().message();
  int guard = 0;
  while (e.has_work() && ++guard < 10000) EXPECT_GT(e.step().num_tokens, 0);
  std::unique_ptr<Sequence> seq = e.take_finished(*id);
  RunResult out;
  if (!seq) {
    ADD_FAILURE() << "request did not finish";
    return out;
  }
  out.tokens.assign(seq->tokens.begin() + seq->prompt_len, seq->tokens.end());
  out.logits = seq->logits;
  out.finish = seq->finish;
  if (cached_tokens) *cached_tokens = seq->num_cached_tokens;
  return out;
}

// Everything equal with and without the cache: a shared system prompt over two adapters and the base
// model, repeated prompts, prompts whose length is a multiple of the page size (the last page must still
// be computed), under chunked prefill, preemption and one adapter slot.
TEST(PrefixCaching, OutputsBitwiseEqualWithoutCaching) {
  auto f = make_fixture(2);
  SCOPED_TRACE("seed " + std::to_string(f->seed));
  const std::vector<int32_t> system = random_ids(*f, 13);
  std::vector<Request> rs;
  for (int i = 0; i < 9; ++i) {
    const std::string adapter = i % 3 == 2 ? "" : "a" + std::to_string(i % 3);
    rs.push_back(make_request(adapter, concat(system, random_ids(*f, 1 + i % 5)), 4 + i % 3));
  }
  rs.push_back(rs[0]);                                                     // the same prompt again
  rs.push_back(make_request("a1", std::vector<int32_t>(system.begin(), system.begin() + 12)));  // 3 full pages
  rs.push_back(make_request("a1", std::vector<int32_t>(system.begin(), system.begin() + 12)));

  for (bool tight : {false, true}) {
    SCOPED_TRACE(tight ? "tight limits" : "roomy limits");
    EngineConfig with = small_pages(true), without = small_pages(false);
    for (EngineConfig* c : {&with, &without}) {
      if (!tight) continue;
      c->max_loras = 1;
      c->scheduler.max_num_batched_tokens = 7;
      c->scheduler.max_num_seqs = 4;
      c->scheduler.max_model_len = 32;
      c->num_kv_pages = 12;
    }
    // Two waves: the second finds the first's pages (within a wave, later admissions find earlier ones).
    auto run_waves = [&](Engine& e) {
      std::vector<RunResult> out = run_all(e, std::vector<Request>(rs.begin(), rs.begin() + 3));
      std::vector<RunResult> rest = run_all(e, std::vector<Request>(rs.begin() + 3, rs.end()));
      out.insert(out.end(), rest.begin(), rest.end());
      return out;
    };
    auto cached = make_engine(*f, with);
    std::vector<RunResult> got = run_waves(*cached);
    auto plain = make_engine(*f, without);
    expect_same(got, run_waves(*plain));
    EXPECT_GT(cached->scheduler().prefix_cache_hits(), 0u);
    EXPECT_EQ(plain->scheduler().prefix_cache_hits(), 0u);
    EXPECT_EQ(plain->scheduler().prefix_cache_queries(), 0u);
    EXPECT_EQ(plain->scheduler().pages().num_cached(), 0);
    EXPECT_EQ(cached->scheduler().pages().num_used(), 0);
    EXPECT_EQ(plain->scheduler().pages().num_used(), 0);
    if (tight) {
      EXPECT_GT(cached->scheduler().num_preemptions(), 0u);
    }
  }
}

TEST(PrefixCaching, SharedSystemPromptHits) {
  auto f = make_fixture(1);
  SCOPED_TRACE("seed " + std::to_string(f->seed));
  const std::vector<int32_t> system = random_ids(*f, 14);  // 3 full pages + 2 tokens
  auto e = make_engine(*f, small_pages(true));
  int cached = -1;
  run_one(*e, make_request("a0", concat(system, random_ids(*f, 5))), &cached);
  EXPECT_EQ(cached, 0);
  EXPECT_EQ(e->scheduler().prefix_cache_hits(), 0u);
  const uint64_t queries = e->scheduler().prefix_cache_queries();
  EXPECT_EQ(queries, 19u);
  Request second = make_request("a0", concat(system, random_ids(*f, 7)));
  RunResult got = run_one(*e, second, &cached);
  EXPECT_EQ(cached, 12);  // the three full pages of the system prompt
  EXPECT_EQ(e->scheduler().prefix_cache_hits(), 12u);
  EXPECT_EQ(e->scheduler().prefix_cache_queries(), queries + 21u);
  auto fresh = make_engine(*f, small_pages(false));
  expect_same({got}, {run_one(*fresh, second, nullptr)});
  // Concurrent requests admitted in the same step after the prefix is cached all hit.
  std::vector<Request> many;
  for (int i = 0; i < 3; ++i) many.push_back(make_request("a0", concat(system, random_ids(*f, 2 + i))));
  const uint64_t before = e->scheduler().prefix_cache_hits();
  run_all(*e, many);
  EXPECT_EQ(e->scheduler().prefix_cache_hits() - before, 3u * 12u);
}

TEST(PrefixCaching, DifferentAdapterContentNeverHitsSameContentDoes) {
  auto f = make_fixture(2);
  SCOPED_TRACE("seed " + std::to_string(f->seed));
  const std::vector<int32_t> prompt = random_ids(*f, 17);
  auto e = make_engine(*f, small_pages(true));
  int cached = -1;
  run_one(*e, make_request("a0", prompt), &cached);
  EXPECT_EQ(cached, 0);
  run_one(*e, make_request("a1", prompt), &cached);
  EXPECT_EQ(cached, 0) << "a1 reused a0's KV";
  RunResult base = run_one(*e, make_request("", prompt), &cached);
  EXPECT_EQ(cached, 0) << "the base model reused an adapter's KV";
  run_one(*e, make_request("", prompt), &cached);
  EXPECT_EQ(cached, 16);
  // Identity is the content, not the name: a twin of a0 under another name shares a0's pages.
  lora::Adapter twin = f->adapters[0];
  twin.name = "a0_twin";
  ASSERT_TRUE(e->add_adapter(twin).ok());
  Request twin_request = make_request("a0_twin", prompt);
  RunResult got = run_one(*e, twin_request, &cached);
  EXPECT_EQ(cached, 16);
  auto fresh = make_engine(*f, small_pages(false));
  ASSERT_TRUE(fresh->add_adapter(twin).ok());
  expect_same({got}, {run_one(*fresh, twin_request, nullptr)});
  EXPECT_NE(got.logits[0], base.logits[0]);
}

TEST(PrefixCaching, ReloadedAdapterWithChangedWeightsMisses) {
  auto f = make_fixture(1);
  SCOPED_TRACE("seed " + std::to_string(f->seed));
  const std::vector<int32_t> prompt = random_ids(*f, 21);
  auto e = make_engine(*f, small_pages(true));
  int cached = -1;
  RunResult old_weights = run_one(*e, make_request("a0", prompt), &cached);
  ASSERT_TRUE(e->remove_adapter("a0").ok());
  // Same name, other weights (as a directory rewritten between unload and load would give).
  lora::Adapter changed = lora::make_dummy_adapter("a0", lora_shapes(f->weights.config), 4, 999);
  ASSERT_NE(changed.content_hash, f->adapters[0].content_hash);
  ASSERT_TRUE(e->add_adapter(changed).ok());
  Request r = make_request("a0", prompt);
  RunResult got = run_one(*e, r, &cached);
  EXPECT_EQ(cached, 0) << "the reloaded adapter hit pages computed with its old weights";
  std::swap(f->adapters[0], changed);
  auto fresh = make_engine(*f, small_pages(false));
  std::swap(f->adapters[0], changed);
  expect_same({got}, {run_one(*fresh, r, nullptr)});
  EXPECT_NE(got.logits[0], old_weights.logits[0]);
  // Reloading the original content hits again (its pages are still cached).
  ASSERT_TRUE(e->remove_adapter("a0").ok());
  ASSERT_TRUE(e->add_adapter(f->adapters[0]).ok());
  expect_same({run_one(*e, r, &cached)}, {old_weights});
  EXPECT_EQ(cached, 20);
}

// Small cache: a second long prompt must evict the first one's cached pages, tail first; the first
// prompt run again finds only its surviving head.
TEST(PrefixCaching, EvictionUnderMemoryPressure) {
  auto f = make_fixture(1);
  SCOPED_TRACE("seed " + std::to_string(f->seed));
  EngineConfig config = small_pages(true);
  config.scheduler.max_model_len = 32;
  config.scheduler.max_num_seqs = 1;
  config.num_kv_pages = 10;  // one sequence of 32 tokens needs 8
  auto e = make_engine(*f, config);
  const kv::PageAllocator& pages = e->scheduler().pages();
  Request a = make_request("a0", random_ids(*f, 26), 4), b = make_request("a0", random_ids(*f, 26), 4);
  int cached = -1;
  RunResult a_first = run_one(*e, a, &cached);
  EXPECT_EQ(pages.num_used(), 0);
  EXPECT_EQ(pages.num_cached(), 7);  // 29 computed tokens fill 7 pages
  EXPECT_EQ(pages.num_free(), 10);
  run_one(*e, b, &cached);
  EXPECT_EQ(cached, 0);
  EXPECT_EQ(pages.num_evictions(), 5u);  // b needs 8 pages: the 3 never used, then 5 of a's, tail first
  EXPECT_EQ(pages.num_cached(), 9);      // a's 2 head pages + b's 7
  RunResult a_again = run_one(*e, a, &cached);
  EXPECT_EQ(cached, 8);  // a's two surviving head pages
  expect_same({a_again}, {a_first});
  EXPECT_EQ(pages.num_used(), 0);
  EXPECT_EQ(pages.num_free(), 10);
}

// Aborting sequences that share cached pages (running and waiting) frees exactly their references.
TEST(PrefixCaching, AbortAndFinishKeepPageAccountingExact) {
  auto f = make_fixture(1);
  SCOPED_TRACE("seed " + std::to_string(f->seed));
  EngineConfig config = small_pages(true);
  config.scheduler.max_num_seqs = 2;
  auto e = make_engine(*f, config);
  const kv::PageAllocator& pages = e->scheduler().pages();
  const std::vector<int32_t> system = random_ids(*f, 16);
  int cached = -1;
  run_one(*e, make_request("a0", concat(system, random_ids(*f, 3))), &cached);
  const int cached_pages = pages.num_cached();
  std::vector<uint64_t> ids;
  for (int i = 0; i < 4; ++i) ids.push_back(e->add_request(make_request("a0", concat(system, random_ids(*f, 2 + i)), 8)).value());
  e->step();  // two admitted (sharing the system prompt's 4 pages), two waiting
  EXPECT_EQ(e->scheduler().num_running(), 2);
  EXPECT_EQ(pages.ref_count(e->scheduler().pages().lookup(kv::page_hash(
                kv::prefix_root(e->adapters().identity("a0")), system.data(), 4))),
            2);
  EXPECT_TRUE(e->abort(ids[0]));
  EXPECT_TRUE(e->abort(ids[3]));
  while (e->has_work()) ASSERT_GT(e->step().num_tokens, 0);
  EXPECT_NE(e->take_finished(ids[1]), nullptr);
  EXPECT_NE(e->take_finished(ids[2]), nullptr);
  EXPECT_EQ(pages.num_used(), 0);
  EXPECT_EQ(pages.num_free(), pages.num_pages());
  EXPECT_GE(pages.num_cached(), cached_pages);
}

}  // namespace
}  // namespace lmx::engine
