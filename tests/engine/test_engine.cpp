// Engine behaviour on the tiny preset with generated adapters: a mixed batch of all adapters + base
// equals each request run alone (bit-exact on the cpu backend), and so do chunked prefill, KV preemption
// and slot eviction; request validation errors name the problem.
#include <gtest/gtest.h>

#include "engine/setup.h"
#include "engine_test_util.h"
#include "lora/adapter.h"
#include "lora/slots.h"
#include "model/presets.h"

namespace lmx::engine {
namespace {

using testing::RunResult;
using testing::run_all;

struct Fixture {
  model::ModelWeights weights;
  cpu::CpuBackend backend;
  std::vector<lora::Adapter> adapters;
};

std::unique_ptr<Fixture> make_fixture(int num_adapters) {
  auto f = std::make_unique<Fixture>();
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

std::vector<Request> mixed_requests(int num_adapters, int count) {
  std::vector<Request> rs;
  for (int i = 0; i < count; ++i) {
    Request r;
    r.adapter = (i % (num_adapters + 1) == num_adapters) ? "" : "a" + std::to_string(i % (num_adapters + 1));
    for (int t = 0; t < 3 + (i * 5) % 17; ++t) r.prompt_ids.push_back((i * 31 + t * 7) % 200 + 1);
    r.sampling.max_tokens = 6 + i % 3;
    r.sampling.ignore_eos = true;
    r.return_logits = true;
    rs.push_back(r);
  }
  return rs;
}

void expect_same(const std::vector<RunResult>& a, const std::vector<RunResult>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].tokens, b[i].tokens) << "request " << i;
    ASSERT_EQ(a[i].logits.size(), b[i].logits.size());
    for (size_t k = 0; k < a[i].logits.size(); ++k) EXPECT_EQ(a[i].logits[k], b[i].logits[k]) << "request " << i << " token " << k;
  }
}

// Each request alone, in a fresh engine.
std::vector<RunResult> run_alone(Fixture& f, const std::vector<Request>& rs, EngineConfig config) {
  std::vector<RunResult> out;
  for (const Request& r : rs) {
    auto e = make_engine(f, config);
    out.push_back(run_all(*e, {r})[0]);
  }
  return out;
}

TEST(Engine, MixedBatchEqualsEachRequestAlone) {
  auto f = make_fixture(3);
  EngineConfig config;
  config.max_loras = 4;
  std::vector<Request> rs = mixed_requests(3, 8);
  auto e = make_engine(*f, config);
  std::vector<RunResult> mixed = run_all(*e, rs);
  expect_same(mixed, run_alone(*f, rs, config));
  // Adapters change the output: the same prompt under a0 and under the base model differs.
  Request base = rs[0];
  base.adapter = "";
  auto e2 = make_engine(*f, config);
  std::vector<RunResult> both = run_all(*e2, {rs[0], base});
  EXPECT_NE(both[0].logits[0], both[1].logits[0]);
}

// --mxfp4-experts on the cpu backend: the forward pass hands the experts' MXFP4 copies to the MoE op (its
// contract checks them), and a backend without an MXFP4 kernel reads the bf16 experts, which are their exact
// values: the same logits, bit for bit, as the same weights without the copies, adapters included.
struct MoeRecordingBackend : cpu::CpuBackend {  // counts MoE calls, and those that carried both MXFP4 copies
  int calls = 0, with_copies = 0;
  void moe(const ops::MoeParams& p) override {
    ++calls;
    with_copies += p.gate_up_mxfp4.defined() && p.down_mxfp4.defined() ? 1 : 0;
    cpu::CpuBackend::moe(p);
  }
};

TEST(Engine, Mxfp4ExpertCopiesChangeNothingOnTheCpu) {
  model::ModelConfig c = model::preset_config("tiny-moe").value();
  c.moe_intermediate_size = 64;  // the decode layout's k-tiles
  Result<model::ModelWeights> with_copies = model::make_random_weights(c, 3, nullptr, true);
  ASSERT_TRUE(with_copies.ok()) << with_copies.status().message();
  ASSERT_TRUE(with_copies->layers[0].gate_up_mxfp4.defined());
  model::ModelWeights without = *with_copies;
  for (model::LayerWeights& l : without.layers) l.gate_up_mxfp4 = l.down_mxfp4 = {};
  const lora::BaseModelShapes shapes = lora_shapes(c);
  std::vector<std::vector<RunResult>> results;
  for (const model::ModelWeights* w : {&*with_copies, &without}) {
    MoeRecordingBackend backend;
    EngineConfig config;
    Result<std::unique_ptr<Engine>> e = Engine::create(*w, backend, config);
    ASSERT_TRUE(e.ok()) << e.status().message();
    for (int i = 0; i < 2; ++i) {
      ASSERT_TRUE((*e)->add_adapter(lora::make_dummy_adapter("a" + std::to_string(i), shapes, 8, 40 + uint64_t(i))).ok());
    }
    results.push_back(run_all(**e, mixed_requests(2, 6)));
    EXPECT_GT(backend.calls, 0);
    EXPECT_EQ(backend.with_copies, w == &without ? 0 : backend.calls);  // every layer's MoE op got them
  }
  expect_same(results[0], results[1]);
}

// The MXFP4 copies' default (engine::Mxfp4Experts::kAuto): on only for GPT-OSS with MXFP4 experts (a preset, or
// a checkpoint whose config.json says mxfp4) that fit the decode layout, on a GPU backend; the flags force
// either way; an unknown model is an error naming it.
TEST(Engine, Mxfp4ExpertsAreTheDefaultOnlyForGptOssOnAGpu) {
  struct GpuLike : cpu::CpuBackend {
    Device device() const override { return Device::kCuda; }
  };
  GpuLike gpu;
  cpu::CpuBackend cpu;
  auto resolved = [](Mxfp4Experts mode, const std::string& model, const ops::Backend* backend) {
    Result<bool> r = resolve_mxfp4_experts(mode, model, backend);
    EXPECT_TRUE(r.ok()) << model << ": " << r.status().message();
    return r.ok() && *r;
  };
  using M = Mxfp4Experts;
  EXPECT_TRUE(resolved(M::kAuto, "preset:gpt-oss-20b", &gpu));
  EXPECT_TRUE(resolved(M::kAuto, "preset:gpt-oss-120b", &gpu));
  EXPECT_FALSE(resolved(M::kAuto, "preset:gpt-oss-20b", &cpu));
  EXPECT_FALSE(resolved(M::kAuto, "preset:gpt-oss-20b", nullptr));
  EXPECT_FALSE(resolved(M::kAuto, "preset:qwen3-30b-a3b", &gpu));
  EXPECT_FALSE(resolved(M::kOff, "preset:gpt-oss-20b", &gpu));
  EXPECT_TRUE(resolved(M::kOn, "preset:qwen3-30b-a3b", &cpu));  // as asked; loading then refuses it
  // The GPT-OSS fixture has MXFP4 experts, but I 96 is not a multiple of the decode layout's 64-value k-tiles.
  EXPECT_FALSE(resolved(M::kAuto, std::string(LORAMUX_SOURCE_DIR) + "/tests/fixtures/gpt_oss/model", &gpu));
  Result<bool> unknown = resolve_mxfp4_experts(M::kAuto, "preset:nope", &gpu);
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("nope"), std::string::npos) << unknown.status().message();
}

TEST(Engine, DecodeGraphBucketsCoverEveryBatchSize) {
  EXPECT_EQ(decode_graph_buckets(1), (std::vector<int>{1}));
  EXPECT_EQ(decode_graph_buckets(12), (std::vector<int>{1, 2, 4, 8, 12}));
  EXPECT_EQ(decode_graph_buckets(40), (std::vector<int>{1, 2, 4, 8, 16, 24, 32, 40}));
  const std::vector<int> big = decode_graph_buckets(256);
  EXPECT_EQ(big.back(), 256);
  EXPECT_TRUE(std::is_sorted(big.begin(), big.end()));
  EXPECT_EQ(std::adjacent_find(big.begin(), big.end()), big.end());
}

// Decode steps padded to the graph buckets (what the CUDA backend replays) give the same tokens and logits
// as the unpadded steps: padding rows write no KV, take no adapter and are not sampled.
TEST(Engine, DecodePaddingToGraphBucketsChangesNothing) {
  auto f = make_fixture(3);
  EngineConfig plain;
  plain.max_loras = 4;
  plain.scheduler.max_num_seqs = 12;  // buckets 1, 2, 4, 8, 12: batches of 7..1 pad to 8, 8, 8, 8, 4, 4, 2, 1
  EngineConfig padded = plain;
  padded.pad_decode_batches = true;
  std::vector<Request> rs = mixed_requests(3, 7);
  for (size_t i = 0; i < rs.size(); ++i) rs[i].sampling.max_tokens = 3 + int(i);  // the batch shrinks step by step
  auto reference = make_engine(*f, plain);
  auto e = make_engine(*f, padded);
  expect_same(run_all(*e, rs), run_all(*reference, rs));
  EXPECT_GT(e->num_padding_rows(), 0u);  // the padded engine did pad
  EXPECT_EQ(reference->num_padding_rows(), 0u);
}

// A request of `prompt_tokens` ids for `adapter` ("" = base), two outputs with ignore_eos.
Request hint_request(const std::string& adapter, int prompt_tokens) {
  Request r;
  r.adapter = adapter;
  for (int t = 0; t < prompt_tokens; ++t) r.prompt_ids.push_back(t % 200 + 1);
  r.sampling.max_tokens = 2;
  r.sampling.ignore_eos = true;
  return r;
}

// A cpu backend that records, per MoE call, the batch size and the host hint the engine gave for the
// backend's MoE-LoRA path (ops::MoeParams::lora_scattered_tokens).
class MoeHintBackend : public cpu::CpuBackend {
 public:
  MoeHintBackend() : cpu::CpuBackend(1) {}
  void moe(const ops::MoeParams& p) override {
    calls.push_back({p.x.dim(0), p.lora_scattered_tokens, p.lora_gate_up.defined() || p.lora_down.defined()});
    cpu::CpuBackend::moe(p);
  }
  struct Call {
    int64_t tokens, scattered;
    bool lora;
  };
  std::vector<Call> calls;
};

// The hint counts adapter tokens of sequences with fewer than ops::kLoraRunTokens tokens in the step (their
// expert-sorted rows mix adapters); a long prompt's tokens and base tokens do not count.
TEST(Engine, MoeLoraHintCountsScatteredAdapterTokens) {
  auto f = make_fixture(2);
  MoeHintBackend backend;
  EngineConfig config;
  config.max_loras = 2;
  Result<std::unique_ptr<Engine>> created = Engine::create(f->weights, backend, config);
  ASSERT_TRUE(created.ok()) << created.status().message();
  Engine& e = **created;
  for (const lora::Adapter& a : f->adapters) ASSERT_TRUE(e.add_adapter(a).ok());
  const int long_prompt = ops::kLoraRunTokens + 4;
  run_all(e, {hint_request("a0", long_prompt), hint_request("a1", 5), hint_request("", 4)});
  ASSERT_FALSE(backend.calls.empty());
  const int64_t layers = f->weights.config.num_layers;
  // The first step prefills all three prompts: only a1's 5 tokens are scattered.
  EXPECT_EQ(backend.calls[0].tokens, long_prompt + 9);
  EXPECT_EQ(backend.calls[0].scattered, 5);
  EXPECT_TRUE(backend.calls[0].lora);
  // Then one decode step of three tokens: both adapter tokens are scattered (eager on the cpu backend).
  ASSERT_EQ(int64_t(backend.calls.size()), 2 * layers);
  EXPECT_EQ(backend.calls[size_t(layers)].tokens, 3);
  EXPECT_EQ(backend.calls[size_t(layers)].scattered, 2);
}

// A cpu backend that records the run hint of each dense projection call (ops::LinearLoraParams::runs and
// rest_rows) with LoRA in the batch.
class RunHintBackend : public cpu::CpuBackend {
 public:
  RunHintBackend() : cpu::CpuBackend(1) {}
  void linear_lora(const ops::LinearLoraParams& p) override {
    if (p.token_slot.defined()) calls.push_back({p.linear.x.dim(0), {p.runs.begin(), p.runs.end()}, p.rest_rows});
    cpu::CpuBackend::linear_lora(p);
  }
  struct Call {
    int64_t tokens;
    std::vector<ops::LoraRun> runs;
    int64_t rest_rows;
  };
  std::vector<Call> calls;
};

// A sequence with at least ops::kLoraRunTokens tokens of one adapter in the step is a run; rest_rows says
// that every other adapter token lies before the first run (or -1 when one follows it).
TEST(Engine, DenseLoraHintNamesRunsAndTheRowsBeforeThem) {
  auto f = make_fixture(2);
  const int long_prompt = ops::kLoraRunTokens + 4;
  struct Order {
    std::vector<Request> requests;
    int64_t run_first, rest_rows;
  };
  const std::vector<Order> orders = {
      {{hint_request("a1", 5), hint_request("a0", long_prompt), hint_request("", 4)}, 5, 5},  // the short one first
      {{hint_request("a0", long_prompt), hint_request("a1", 5)}, 0, -1},  // an adapter token after the run
      {{hint_request("", 4), hint_request("a0", long_prompt)}, 4, 0}};    // the run holds every adapter token
  for (const Order& order : orders) {
    RunHintBackend backend;
    EngineConfig config;
    config.max_loras = 2;
    Result<std::unique_ptr<Engine>> created = Engine::create(f->weights, backend, config);
    ASSERT_TRUE(created.ok()) << created.status().message();
    Engine& e = **created;
    for (const lora::Adapter& a : f->adapters) ASSERT_TRUE(e.add_adapter(a).ok());
    run_all(e, order.requests);
    ASSERT_FALSE(backend.calls.empty());
    const RunHintBackend::Call& first = backend.calls[0];  // the step that prefills every prompt
    ASSERT_EQ(first.runs.size(), 1u);
    EXPECT_EQ(first.runs[0].first, order.run_first);
    EXPECT_EQ(first.runs[0].tokens, long_prompt);
    EXPECT_GE(first.runs[0].slot, 0);
    EXPECT_EQ(first.rest_rows, order.rest_rows);
    EXPECT_TRUE(backend.calls.back().runs.empty());  // a decode step has no runs
  }
}

// PrefillPacking::kWhole: beside another prompt's chunk, a prompt that fits a step of its own waits for
// the next step whole instead of being split; a longer one is still chunked. kFill fills every step's
// budget. The results do not depend on it.
TEST(Engine, PrefillPackingKeepsFittingPromptsWhole) {
  auto f = make_fixture(0);
  using Packing = SchedulerLimits::PrefillPacking;
  std::vector<Request> requests = {hint_request("", 30), hint_request("", 30), hint_request("", 60)};
  for (Request& r : requests) r.sampling.max_tokens = 4;
  std::vector<std::vector<RunResult>> results;
  for (Packing packing : {Packing::kWhole, Packing::kFill}) {
    SCOPED_TRACE(packing == Packing::kWhole ? "whole" : "fill");
    EngineConfig config;
    config.scheduler.max_num_batched_tokens = 40;
    config.scheduler.enable_prefix_caching = false;  // the prompts share their tokens
    config.scheduler.prefill_packing = packing;
    auto e = make_engine(*f, config);
    std::vector<int> steps;
    results.push_back(run_all(*e, requests, &steps));
    ASSERT_GE(steps.size(), 3u);
    if (packing == Packing::kWhole) {
      EXPECT_EQ(steps[0], 30);          // the first prompt alone: the second (30 > the 10 left) waits
      EXPECT_EQ(steps[1], 1 + 30 + 9);  // its decode, the second whole, the third (60 > 40 - 2) chunked
      EXPECT_EQ(steps[2], 1 + 1 + 38);
    } else {
      EXPECT_EQ(steps[0], 30 + 10);       // the second prompt split
      EXPECT_EQ(steps[1], 1 + 20 + 19);  // its rest, then the third's first chunk
    }
  }
  expect_same(results[0], results[1]);
}

// A cpu backend that reports a fixed device memory, as a GPU does (total_bytes() > 0).
class FixedMemoryBackend : public cpu::CpuBackend {
 public:
  FixedMemoryBackend(uint64_t total, uint64_t free_bytes) : cpu::CpuBackend(1), total_(total), free_(free_bytes) {}
  uint64_t total_bytes() const override { return total_; }
  uint64_t available_bytes() const override { return free_; }

 private:
  uint64_t total_, free_;
};

TEST(Engine, KvCacheIsSizedFromGpuMemoryUtilization) {
  auto f = make_fixture(0);
  const model::ModelConfig& c = f->weights.config;
  const uint64_t gib = uint64_t(1) << 30;
  EngineConfig config;
  config.gpu_memory_utilization = 0.5;
  config.scheduler.max_model_len = 64;
  // 8 GiB device, 1 GiB in use: 0.5 * 8 - 1 - 2 (workspace headroom) = 1 GiB for pages of
  // layers * 2 (k, v) * P * Hkv * D * 4 bytes (the cpu backend's f32).
  FixedMemoryBackend roomy(8 * gib, 7 * gib);
  Result<std::unique_ptr<Engine>> e = Engine::create(f->weights, roomy, config);
  ASSERT_TRUE(e.ok()) << e.status().message();
  const uint64_t page_bytes = uint64_t(c.num_layers) * 2 * uint64_t(config.scheduler.page_size) *
                              uint64_t(c.num_kv_heads) * uint64_t(c.head_dim) * 4;
  EXPECT_EQ(uint64_t((*e)->config().num_kv_pages), gib / page_bytes);
  // What the start-up log reports: the KV cache and the adapter slots as allocated.
  EXPECT_EQ((*e)->kv_cache_bytes(), uint64_t((*e)->config().num_kv_pages) * page_bytes);
  EXPECT_EQ((*e)->adapter_slot_bytes(),
            lora::SlotTable::device_bytes(lora_shapes(c), config.max_loras, config.max_lora_rank, DType::F32));
  // An explicit page count wins; no fixed memory (the plain cpu backend) keeps the max_num_seqs sizing.
  config.num_kv_pages = 40;
  Result<std::unique_ptr<Engine>> explicit_pages = Engine::create(f->weights, roomy, config);
  ASSERT_TRUE(explicit_pages.ok());
  EXPECT_EQ((*explicit_pages)->config().num_kv_pages, 40);
  config.num_kv_pages = 0;
  Result<std::unique_ptr<Engine>> plain = Engine::create(f->weights, f->backend, config);
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ((*plain)->config().num_kv_pages, 4 * config.scheduler.max_num_seqs);  // 64 tokens = 4 pages of 16
  // Too little memory: an error naming the flag and what one sequence needs.
  FixedMemoryBackend full(8 * gib, 2 * gib);
  Result<std::unique_ptr<Engine>> refused = Engine::create(f->weights, full, config);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("gpu_memory_utilization 0.50"), std::string::npos) << refused.status().message();
  EXPECT_NE(refused.status().message().find("max_model_len 64"), std::string::npos) << refused.status().message();
  config.gpu_memory_utilization = 1.5;
  EXPECT_FALSE(Engine::create(f->weights, roomy, config).ok());
}

// Adapter slots that cannot fit the free memory are refused before anything is allocated, naming the flags.
TEST(Engine, AdapterSlotsBeyondFreeMemoryAreRefused) {
  auto f = make_fixture(0);
  const uint64_t gib = uint64_t(1) << 30;
  EngineConfig config;
  config.max_loras = 1 << 24;  // the tiny model's slots: well over the 3 GiB free
  config.max_lora_rank = 16;
  FixedMemoryBackend small(8 * gib, 3 * gib);
  Result<std::unique_ptr<Engine>> refused = Engine::create(f->weights, small, config);
  ASSERT_FALSE(refused.ok());
  const std::string& m = refused.status().message();
  EXPECT_NE(m.find("--max-loras 16777216"), std::string::npos) << m;
  EXPECT_NE(m.find("--max-lora-rank 16"), std::string::npos) << m;
  EXPECT_NE(m.find("only 3.0 GiB is free"), std::string::npos) << m;
  config.max_loras = 4;
  EXPECT_TRUE(Engine::create(f->weights, small, config).ok());
}

TEST(Engine, ChunkedPrefillPreemptionAndSlotEvictionKeepResults) {
  auto f = make_fixture(3);
  EngineConfig roomy;
  roomy.max_loras = 4;
  std::vector<Request> rs = mixed_requests(3, 10);
  std::vector<RunResult> reference = run_alone(*f, rs, roomy);

  EngineConfig tight;
  tight.max_loras = 1;                              // adapters take turns in one slot
  tight.scheduler.max_num_batched_tokens = 7;       // prompts are prefilled in chunks
  tight.scheduler.max_num_seqs = 4;
  tight.scheduler.page_size = 4;
  tight.scheduler.max_model_len = 32;
  tight.num_kv_pages = 12;                          // forces preemption
  auto e = make_engine(*f, tight);
  std::vector<RunResult> squeezed = run_all(*e, rs);
  expect_same(squeezed, reference);
  // The scheduler groups work by adapter: while one adapter holds the only slot, requests for others wait
  // and later requests of the resident adapter go first, so each adapter is loaded exactly once here.
  EXPECT_EQ(e->adapters().loads(), 3u);
  EXPECT_GT(e->scheduler().num_preemptions(), 0u);
}

// EngineConfig::prefill_lane: every prompt's prefill on a second backend (here another CpuBackend on a
// worker thread) beside the decode steps gives each request the tokens and logits it gets alone: mixed
// adapters and base requests, seeded sampling, logprobs, a prompt longer than the token budget (the lane
// runs it in chunks), and the tight limits of the test above (one slot, preemption of decoding sequences:
// never of the lane's). Every prompt went through the lane.
TEST(Engine, PrefillLaneKeepsResults) {
  auto f = make_fixture(3);
  EngineConfig roomy;
  roomy.max_loras = 4;
  std::vector<Request> rs = mixed_requests(3, 10);
  for (size_t i = 0; i < rs.size(); i += 3) {
    rs[i].sampling.temperature = 0.8f;
    rs[i].sampling.seed = 99 + i;
    rs[i].sampling.logprobs = 2;
  }
  std::vector<RunResult> reference = run_alone(*f, rs, roomy);

  EngineConfig lane = roomy;
  lane.prefill_lane = true;
  auto e = make_engine(*f, lane);
  expect_same(run_all(*e, rs), reference);
  EXPECT_EQ(e->num_lane_runs(), rs.size());

  EngineConfig chunked = lane;
  chunked.scheduler.max_num_batched_tokens = 7;  // prompts of up to 19 tokens: up to three lane runs each
  auto c = make_engine(*f, chunked);
  expect_same(run_all(*c, rs), reference);
  EXPECT_GT(c->num_lane_runs(), rs.size());

  // The lane's work first (stream priorities on a GPU; on the CPU the same tokens by construction), and
  // that order without a lane is a configuration error.
  EngineConfig first = lane;
  first.prefill_lane_first = true;
  auto l = make_engine(*f, first);
  expect_same(run_all(*l, rs), reference);
  EngineConfig no_lane = roomy;
  no_lane.prefill_lane_first = true;
  Result<std::unique_ptr<Engine>> refused = Engine::create(f->weights, f->backend, no_lane);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("it needs prefill_lane (--prefill-lane)"), std::string::npos)
      << refused.status().message();

  EngineConfig tight = chunked;
  tight.max_loras = 1;
  tight.scheduler.max_num_seqs = 4;
  tight.scheduler.page_size = 4;
  tight.scheduler.max_model_len = 32;
  tight.num_kv_pages = 12;
  auto t = make_engine(*f, tight);
  expect_same(run_all(*t, rs), reference);
}

// A request aborted while its prefill runs on the lane: the engine waits for the run, then frees it; the
// others finish as they would alone.
TEST(Engine, PrefillLaneAbortWaitsForTheRun) {
  auto f = make_fixture(2);
  EngineConfig config;
  config.max_loras = 3;
  config.prefill_lane = true;
  std::vector<Request> rs = mixed_requests(2, 4);
  auto e = make_engine(*f, config);
  std::vector<uint64_t> ids;
  for (const Request& r : rs) {
    Result<uint64_t> id = e->add_request(r);
    ASSERT_TRUE(id.ok()) << id.status().message();
    ids.push_back(id.value());
  }
  e->step();  // the lane has taken the first prompt
  EXPECT_TRUE(e->abort(ids[0]));
  int guard = 0;
  while (e->has_work() && ++guard < 1000) e->step();
  EXPECT_EQ(e->take_finished(ids[0]), nullptr);
  std::vector<RunResult> alone = run_alone(*f, {rs[1], rs[2], rs[3]}, config);
  for (size_t i = 1; i < ids.size(); ++i) {
    std::unique_ptr<Sequence> seq = e->take_finished(ids[i]);
    ASSERT_NE(seq, nullptr);
    EXPECT_EQ(std::vector<int32_t>(seq->tokens.begin() + seq->prompt_len, seq->tokens.end()), alone[i - 1].tokens);
  }
  EXPECT_EQ(e->scheduler().pages().num_free(), e->config().num_kv_pages);
}

TEST(Engine, SeededSamplingDoesNotDependOnBatching) {
  auto f = make_fixture(2);
  EngineConfig config;
  std::vector<Request> rs = mixed_requests(2, 5);
  for (size_t i = 0; i < rs.size(); ++i) {
    rs[i].sampling.temperature = 0.9f;
    rs[i].sampling.top_p = 0.9f;
    rs[i].sampling.top_k = 20;
    rs[i].sampling.seed = 1234 + i;
  }
  auto e = make_engine(*f, config);
  expect_same(run_all(*e, rs), run_alone(*f, rs, config));
}

TEST(Engine, StopsAtStopTokenAndMaxTokens) {
  auto f = make_fixture(0);
  auto e = make_engine(*f, EngineConfig{});
  Request r;
  r.prompt_ids = {1, 2, 3};
  r.sampling.max_tokens = 5;
  r.sampling.ignore_eos = true;
  RunResult free_run = run_all(*e, {r})[0];
  ASSERT_EQ(free_run.tokens.size(), 5u);
  EXPECT_EQ(free_run.finish, FinishReason::kLength);
  r.sampling.stop_token_ids = {free_run.tokens[2]};
  RunResult stopped = run_all(*e, {r})[0];
  EXPECT_EQ(stopped.finish, FinishReason::kStop);
  EXPECT_LE(stopped.tokens.size(), 3u);
  EXPECT_EQ(stopped.tokens.back(), free_run.tokens[2]);
}

TEST(Engine, RejectsBadRequestsWithClearErrors) {
  auto f = make_fixture(1);
  EngineConfig config;
  config.scheduler.max_model_len = 16;
  auto e = make_engine(*f, config);
  auto error_of = [&](Request r) {
    Result<uint64_t> id = e->add_request(std::move(r));
    return id.ok() ? std::string("ok") : id.status().message();
  };
  Request good;
  good.prompt_ids = {1, 2};
  good.sampling.max_tokens = 4;
  good.sampling.ignore_eos = true;
  Request unknown = good;
  unknown.adapter = "nope";
  EXPECT_NE(error_of(unknown).find("unknown adapter 'nope'"), std::string::npos);
  Request empty;
  EXPECT_NE(error_of(empty).find("prompt is empty"), std::string::npos);
  Request oov = good;
  oov.prompt_ids = {1, 99999};
  EXPECT_NE(error_of(oov).find("prompt token 1 is 99999"), std::string::npos);
  Request too_long = good;
  too_long.sampling.max_tokens = 15;
  EXPECT_NE(error_of(too_long).find("exceeds max_model_len 16"), std::string::npos);
  Request bad_p = good;
  bad_p.sampling.top_p = 0.0f;
  EXPECT_NE(error_of(bad_p).find("top_p"), std::string::npos);
  // The engine still serves good requests after rejecting bad ones.
  EXPECT_EQ(run_all(*e, {good})[0].tokens.size(), size_t(good.sampling.max_tokens));
}

TEST(Engine, RejectsInconsistentLimits) {
  auto f = make_fixture(0);
  EngineConfig config;
  config.scheduler.max_model_len = 64;
  config.scheduler.page_size = 16;
  config.num_kv_pages = 2;
  Result<std::unique_ptr<Engine>> e = Engine::create(f->weights, f->backend, config);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("num_kv_pages 2 cannot hold"), std::string::npos);
}

// A client that goes away: abort frees the pages and the adapter slot of a running request at once, drops
// a waiting one, and the remaining requests produce exactly what they would have alone.
TEST(Engine, AbortFreesPagesAndSlotAndLeavesOthersIntact) {
  auto f = make_fixture(2);
  EngineConfig config;
  config.max_loras = 1;
  config.scheduler.max_num_seqs = 2;
  std::vector<Request> rs = mixed_requests(2, 3);  // a0, a1, base
  for (Request& r : rs) r.sampling.max_tokens = 12;
  std::vector<RunResult> reference = run_alone(*f, {rs[2]}, config);
  auto e = make_engine(*f, config);
  std::vector<uint64_t> ids;
  for (const Request& r : rs) ids.push_back(e->add_request(r).value());
  e->step();  // a0 runs (holding the only slot), a1 waits for the slot, base runs
  EXPECT_EQ(e->scheduler().num_running(), 2);
  EXPECT_EQ(e->scheduler().num_waiting(), 1);
  int total = e->scheduler().pages().num_pages();
  EXPECT_LT(e->scheduler().pages().num_free(), total);
  EXPECT_TRUE(e->abort(ids[0]));   // running
  EXPECT_TRUE(e->abort(ids[1]));   // waiting
  EXPECT_FALSE(e->abort(ids[1]));  // already gone
  EXPECT_FALSE(e->abort(12345));
  EXPECT_EQ(e->scheduler().num_running(), 1);
  EXPECT_EQ(e->scheduler().num_waiting(), 0);
  EXPECT_EQ(e->take_finished(ids[0]), nullptr);
  // The slot a0 held is idle again: the adapter can be removed, which the engine refuses while it is used.
  EXPECT_TRUE(e->remove_adapter("a0").ok());
  while (e->has_work()) e->step();
  std::unique_ptr<Sequence> base = e->take_finished(ids[2]);
  ASSERT_NE(base, nullptr);
  EXPECT_EQ(std::vector<int32_t>(base->tokens.begin() + base->prompt_len, base->tokens.end()), reference[0].tokens);
  EXPECT_EQ(e->scheduler().pages().num_free(), total);
  // Finished but not taken: abort drops it too.
  uint64_t late = e->add_request(rs[2]).value();
  while (e->has_work()) e->step();
  EXPECT_TRUE(e->abort(late));
  EXPECT_EQ(e->take_finished(late), nullptr);
}

TEST(Engine, RemoveAdapterRefusedWhileUsedThenForgotten) {
  auto f = make_fixture(2);
  auto e = make_engine(*f, EngineConfig{});
  Request r = mixed_requests(2, 1)[0];  // a0
  uint64_t id = e->add_request(r).value();
  Status busy = e->remove_adapter("a0");
  EXPECT_FALSE(busy.ok());
  EXPECT_NE(busy.message().find("used by 1 queued or running"), std::string::npos) << busy.message();
  EXPECT_EQ(e->remove_adapter("nope").code(), StatusCode::kNotFound);
  while (e->has_work()) e->step();
  ASSERT_NE(e->take_finished(id), nullptr);
  EXPECT_EQ(e->adapters().resident(), std::vector<std::string>{"a0"});
  EXPECT_TRUE(e->remove_adapter("a0").ok());
  EXPECT_TRUE(e->adapters().resident().empty());
  EXPECT_NE(e->add_request(r).status().message().find("unknown adapter 'a0'"), std::string::npos);
  // The same name can be registered again (its slot was emptied, so no stale weights are reused).
  EXPECT_TRUE(e->add_adapter(f->adapters[0]).ok());
  EXPECT_TRUE(e->add_request(r).ok());
}

}  // namespace
}  // namespace lmx::engine

namespace lmx::engine {
namespace {

// One slot, a steady stream of requests for the resident adapter a0, and one request for a1 behind
// them. Without the wait bound a1 never gets the slot (each new a0 request keeps it held); with it, a1
// finishes within the bound plus the running a0 sequences' remaining tokens.
TEST(Engine, AdapterWaitIsBounded) {
  auto f = make_fixture(2);
  EngineConfig config;
  config.max_loras = 1;
  config.scheduler.max_adapter_wait_steps = 4;
  auto e = make_engine(*f, config);
  auto request = [](const std::string& adapter, int max_tokens) {
    Request r;
    r.adapter = adapter;
    r.prompt_ids = {5, 6, 7};
    r.sampling.max_tokens = max_tokens;
    r.sampling.ignore_eos = true;
    return r;
  };
  ASSERT_TRUE(e->add_request(request("a0", 10)).ok());
  Result<uint64_t> starved = e->add_request(request("a1", 3));
  ASSERT_TRUE(starved.ok());
  int steps = 0;
  for (; steps < 200; ++steps) {
    ASSERT_TRUE(e->add_request(request("a0", 10)).ok());  // a new a0 request every step
    ASSERT_GT(e->step().num_tokens, 0);
    if (e->take_finished(*starved)) break;
  }
  // wait bound (4) + the longest a0 sequence admitted before it (10 tokens + prefill) + its own 3 tokens.
  EXPECT_LE(steps, 4 + 11 + 4) << "the a1 request waited " << steps << " steps";
}

}  // namespace
}  // namespace lmx::engine
