// Engine implementation: request validation, the step loop, flat-batch construction and sampling inputs.
#include "engine/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <future>
#include <limits>

#include "core/rng.h"
#include "kv/page_allocator.h"

namespace lmx::engine {

const char* finish_reason_name(FinishReason reason) {
  switch (reason) {
    case FinishReason::kLength: return "length";
    case FinishReason::kStop: return "stop";
    case FinishReason::kAbort: return "abort";
    case FinishReason::kNone: return "";
  }
  return "";
}

lora::BaseModelShapes lora_shapes(const model::ModelConfig& c) {
  using ops::LoraTarget;
  lora::BaseModelShapes s;
  s.family = std::string(model::family_name(c.family));
  s.num_layers = c.num_layers;
  s.num_experts = c.num_experts;
  s.hidden_size = c.hidden_size;
  s.moe_intermediate_size = c.moe_intermediate_size;
  s.gate_up_interleaved = c.gate_up_layout == ops::GateUpLayout::kInterleaved;
  auto set = [&](LoraTarget t, int in, int out) {
    s.in_features[size_t(t)] = in;
    s.out_features[size_t(t)] = out;
  };
  set(LoraTarget::kQ, c.hidden_size, c.q_dim());
  set(LoraTarget::kK, c.hidden_size, c.kv_dim());
  set(LoraTarget::kV, c.hidden_size, c.kv_dim());
  set(LoraTarget::kO, c.q_dim(), c.hidden_size);
  if (c.is_moe()) {
    set(LoraTarget::kMoeGateUp, c.hidden_size, 2 * c.moe_intermediate_size);
    set(LoraTarget::kMoeDown, c.moe_intermediate_size, c.hidden_size);
  } else {
    set(LoraTarget::kGate, c.hidden_size, c.intermediate_size);
    set(LoraTarget::kUp, c.hidden_size, c.intermediate_size);
    set(LoraTarget::kDown, c.intermediate_size, c.hidden_size);
  }
  return s;
}

std::vector<int> decode_graph_buckets(int max_seqs) {
  std::vector<int> buckets;
  for (int b = 1; b < max_seqs;) {
    buckets.push_back(b);
    b = b < 8 ? 2 * b : b < 64 ? b + 8 : b < 256 ? b + 16 : b + 32;
  }
  buckets.push_back(max_seqs);
  return buckets;
}

namespace {

// Workspaces the backend grows on first use after start (MoE, attention split-KV, LoRA scratch, cuBLASLt):
// kept out of the KV budget (twice with the prefill lane: its backend grows its own).
constexpr uint64_t kKvHeadroomBytes = uint64_t(2) << 30;

std::string gib(double bytes) {  // "1.5 GiB", or "12.3 MiB" below one GiB
  char text[32];
  const bool small = bytes < double(uint64_t(1) << 30);
  std::snprintf(text, sizeof text, small ? "%.1f MiB" : "%.1f GiB", bytes / double(uint64_t(1) << (small ? 20 : 30)));
  return text;
}

// The adapter slots are allocated whole at start: a plan that cannot fit is refused here, naming the flags,
// before an allocation fails (which aborts). Slots that fit but leave too little for the KV cache get
// kv_pages_from_memory's error instead.
Status check_slots_fit(const model::ModelWeights& weights, const ops::Backend& backend, const EngineConfig& config) {
  const uint64_t free_bytes = backend.available_bytes();
  if (free_bytes == 0) return Status();  // unknown
  const uint64_t need = lora::SlotTable::device_bytes(lora_shapes(weights.config), config.max_loras,
                                                      config.max_lora_rank, backend.lora_dtype());
  if (need <= free_bytes) return Status();
  return out_of_range("--max-loras " + std::to_string(config.max_loras) + " adapter slots of --max-lora-rank " +
                      std::to_string(config.max_lora_rank) + " need " + gib(double(need)) + " of " +
                      std::string(device_name(backend.device())) + " memory for this model (" +
                      gib(double(need) / config.max_loras) + " a slot), but only " + gib(double(free_bytes)) +
                      " is free after the weights; lower --max-loras or --max-lora-rank");
}

}  // namespace

Result<std::unique_ptr<Engine>> Engine::create(const model::ModelWeights& weights, ops::Backend& backend,
                                               const EngineConfig& config) {
  const SchedulerLimits& lim = config.scheduler;
  if (lim.max_num_seqs < 1) return invalid_argument("max_num_seqs must be >= 1, got " + std::to_string(lim.max_num_seqs));
  if (lim.max_num_batched_tokens < 1)
    return invalid_argument("max_num_batched_tokens must be >= 1, got " + std::to_string(lim.max_num_batched_tokens));
  if (lim.page_size < 1) return invalid_argument("page_size must be >= 1, got " + std::to_string(lim.page_size));
  if (lim.max_model_len < 2) return invalid_argument("max_model_len must be >= 2, got " + std::to_string(lim.max_model_len));
  if (config.max_loras < 1) return invalid_argument("max_loras must be >= 1, got " + std::to_string(config.max_loras));
  if (config.max_lora_rank < 1)
    return invalid_argument("max_lora_rank must be >= 1, got " + std::to_string(config.max_lora_rank));
  if (config.max_cpu_loras != 0 && config.max_cpu_loras < config.max_loras)
    return invalid_argument("max_cpu_loras " + std::to_string(config.max_cpu_loras) + " must be 0 (no limit) or >= max_loras " +
                            std::to_string(config.max_loras) + ": every adapter in a slot is read from the host tier");
  int per_seq = kv::pages_for_tokens(lim.max_model_len, lim.page_size);
  if (config.num_kv_pages != 0 && config.num_kv_pages < per_seq)
    return invalid_argument("num_kv_pages " + std::to_string(config.num_kv_pages) + " cannot hold one sequence of max_model_len " +
                            std::to_string(lim.max_model_len) + " (needs " + std::to_string(per_seq) + " pages)");
  if (config.prefill_lane && !(config.prefill_lane_sm_share > 0.0 && config.prefill_lane_sm_share <= 1.0))
    return invalid_argument("prefill_lane_sm_share must be in (0, 1], got " + std::to_string(config.prefill_lane_sm_share));
  if (config.prefill_lane_first && !config.prefill_lane)
    return invalid_argument("prefill_lane_first orders the prefill lane's work before the decode steps': it needs "
                            "prefill_lane (--prefill-lane)");
  if (config.gpu_memory_utilization < 0.0 || config.gpu_memory_utilization > 1.0)
    return invalid_argument("gpu_memory_utilization must be in (0, 1] (0 = off), got " +
                            std::to_string(config.gpu_memory_utilization));
  LMX_RETURN_IF_ERROR(check_slots_fit(weights, backend, config));
  std::unique_ptr<Engine> engine(new Engine(weights, backend, config));
  if (!engine->init_status_.ok()) return engine->init_status_;
  return engine;
}

Result<int> Engine::kv_pages_from_memory(const model::ModelConfig& mc) const {
  const uint64_t total = backend_.total_bytes(), free_now = backend_.available_bytes();
  const uint64_t used = total > free_now ? total - free_now : 0;  // weights, slots, scratch (and anything else)
  const double allowed = config_.gpu_memory_utilization * double(total);
  const uint64_t page_bytes = uint64_t(mc.num_layers) * 2 * uint64_t(config_.scheduler.page_size) *
                              uint64_t(mc.num_kv_heads) * uint64_t(mc.head_dim) * dtype_size(backend_.activation_dtype());
  // The prefill lane's backend grows its own workspaces beside the engine's.
  const double headroom = double(kKvHeadroomBytes) * (lane_ ? 2.0 : 1.0);
  const double budget = allowed - double(used) - headroom;
  const double pages = budget > 0 ? std::floor(budget / double(page_bytes)) : 0.0;
  if (pages < max_pages_per_seq_) {
    return invalid_argument("gpu_memory_utilization " + std::to_string(config_.gpu_memory_utilization).substr(0, 4) +
                              " of " + gib(double(total)) + " leaves " + gib(std::max(budget, 0.0)) +
                              " for the KV cache after " + gib(double(used)) + " in use and " +
                              gib(headroom) + " of workspace headroom: one sequence of max_model_len " +
                              std::to_string(config_.scheduler.max_model_len) + " needs " +
                              gib(double(max_pages_per_seq_) * double(page_bytes)) +
                              " (raise --gpu-memory-utilization or lower --max-model-len)");
  }
  return int(std::min(pages, double(std::numeric_limits<int>::max() / 2)));
}

Engine::Engine(const model::ModelWeights& weights, ops::Backend& backend, const EngineConfig& config)
    : config_(config), backend_(backend) {
  config_.scheduler.prefill_lane = config_.prefill_lane;  // prompts start only on the lane
  const SchedulerLimits& lim = config_.scheduler;
  const int T = lim.max_num_batched_tokens, B = lim.max_num_seqs;
  max_pages_per_seq_ = kv::pages_for_tokens(lim.max_model_len, lim.page_size);
  model_ = std::make_unique<model::Model>(weights, backend, model::ModelLimits{.max_tokens = T, .max_seqs = B});
  if (config_.prefill_lane) {  // before the KV cache takes what memory is left
    lane_ = std::make_unique<Lane>();
    lane_->backend = backend.make_lane(config_.prefill_lane_sm_share, config_.prefill_lane_first);
    if (!lane_->backend) {
      init_status_ = invalid_argument("prefill_lane: the " + std::string(device_name(backend.device())) +
                                      " backend cannot run a second lane");
      lane_.reset();
    } else {
      // The same device weights (tensors already on the device are used in place); the lane's own scratch.
      lane_->model = std::make_unique<model::Model>(model_->device_weights(), *lane_->backend,
                                                    model::ModelLimits{.max_tokens = T, .max_seqs = 1});
      lane_->staging = make_staging(*lane_->backend, T, 1);
    }
  }
  adapters_ = std::make_unique<AdapterStore>(backend, lora_shapes(weights.config), config_.max_loras, config_.max_lora_rank,
                                             config_.max_cpu_loras);
  if (config_.num_kv_pages == 0) {
    config_.num_kv_pages = max_pages_per_seq_ * B;
    if (config_.gpu_memory_utilization > 0.0 && backend.total_bytes() > 0) {
      Result<int> pages = kv_pages_from_memory(weights.config);
      if (!pages.ok()) {
        init_status_ = pages.status();
        config_.num_kv_pages = max_pages_per_seq_;  // enough to finish constructing; create() fails
      } else {
        config_.num_kv_pages = *pages;
      }
    }
  }
  cache_ = model::KvCache::allocate(backend, weights.config, config_.num_kv_pages, lim.page_size);
  scheduler_ = std::make_unique<Scheduler>(lim, config_.num_kv_pages, adapters_.get());

  main_ = make_staging(backend, T, B);
  buckets_ = decode_graph_buckets(std::min(B, T));
}

uint64_t Engine::adapter_slot_bytes() const {
  return lora::SlotTable::device_bytes(adapters_->base(), config_.max_loras, config_.max_lora_rank,
                                       backend_.lora_dtype());
}

Engine::Staging Engine::make_staging(ops::Backend& backend, int max_tokens, int max_seqs) const {
  const int T = max_tokens, B = max_seqs;
  auto stage = [&](DType dtype, std::initializer_list<int64_t> dims) {
    return Staged{OwnedTensor::host(dtype, dims), backend.empty(dtype, dims)};
  };
  Staging st;
  st.token_ids = stage(DType::I32, {T});
  st.positions = stage(DType::I32, {T});
  st.token_slot = stage(DType::I32, {T});
  st.seq_start = stage(DType::I32, {B + 1});
  st.block_table = stage(DType::I32, {B, max_pages_per_seq_});
  st.kv_write_index = stage(DType::I32, {T});
  st.sample_index = stage(DType::I32, {B});
  st.temperature = stage(DType::F32, {B});
  st.top_k = stage(DType::I32, {B});
  st.top_p = stage(DType::F32, {B});
  st.uniform = stage(DType::F32, {B});
  st.sampled_tokens = stage(DType::I32, {B});
  st.sampled_logprob = stage(DType::F32, {B});
  st.top_ids = stage(DType::I32, {int64_t(B) * ops::kMaxTopLogprobs});
  st.top_logprobs = stage(DType::F32, {int64_t(B) * ops::kMaxTopLogprobs});
  return st;
}

Engine::~Engine() {
  if (lane_ && lane_->result.valid()) lane_->result.wait();  // the worker reads this engine's state
  release_graphs();
}

void Engine::release_graphs() {
  for (auto& [key, graph] : graphs_) backend_.release_graph(graph.id);
  graphs_.clear();
}

int Engine::decode_bucket(const std::vector<ScheduledSeq>& step) const {
  const bool graphs = backend_.supports_graphs() && !config_.enforce_eager;
  if (!graphs && !config_.pad_decode_batches) return 0;
  for (const ScheduledSeq& s : step)
    if (s.num_tokens != 1 || !s.sample) return 0;  // prefill chunks run eagerly
  const auto it = std::lower_bound(buckets_.begin(), buckets_.end(), int(step.size()));
  return it == buckets_.end() ? 0 : *it;
}

Tensor Engine::run_forward(int bucket) {
  const lora::SlotTable& slots = adapters_->slots();
  const model::LoraLookup lookup = [&](int layer, ops::LoraTarget target) { return slots.stack(layer, target); };
  // A dump reads activations back on the host mid-forward: never inside a recording.
  if (bucket == 0 || !backend_.supports_graphs() || config_.enforce_eager || model_->has_activation_dump())
    return model_->forward(main_.batch, cache_, lookup);
  main_.batch.lora_scattered_tokens = -1;  // a recording serves any adapter mix: no path chosen from this one
  main_.batch.lora_runs = {};
  main_.batch.lora_rest_rows = -1;
  if (backend_.memory_epoch() != graphs_epoch_) {  // a workspace moved: every recording points at old memory
    release_graphs();
    graphs_epoch_ = backend_.memory_epoch();
  }
  // The LoRA layout: which stacks the forward would launch kernels for (none when no token has an adapter,
  // so base-only batches take a LoRA-free recording). Slot contents and ranks live in device memory the
  // recording reads, so one recording serves any mix of resident adapters.
  std::string layout;
  if (main_.batch.any_lora) {
    const int layers = model_->config().num_layers;
    layout.reserve(size_t(layers) * ops::kNumLoraTargets);
    for (int layer = 0; layer < layers; ++layer)
      for (int t = 0; t < ops::kNumLoraTargets; ++t)
        layout.push_back(slots.stack(layer, ops::LoraTarget(t)).defined() ? '1' : '0');
  }
  auto [it, first_sight] = graphs_.try_emplace({bucket, std::move(layout)});
  DecodeGraph& graph = it->second;
  if (first_sight) return model_->forward(main_.batch, cache_, lookup);  // sizes workspaces, sets kernel attributes
  if (graph.id < 0) {
    backend_.begin_capture();
    graph.logits = model_->forward(main_.batch, cache_, lookup);
    graph.id = backend_.end_capture();
    ++graph_captures_;
  }
  backend_.replay(graph.id);
  ++graph_replays_;
  return graph.logits;
}

Status Engine::add_adapter(lora::Adapter adapter, AdapterOptions options) {
  return adapters_->add(std::move(adapter), std::move(options));
}

Status Engine::remove_adapter(const std::string& name) {
  if (!adapters_->contains(name)) return not_found("unknown adapter '" + name + "'");
  int users = scheduler_->num_using(name);
  if (users > 0)
    return invalid_argument("adapter '" + name + "' is used by " + std::to_string(users) + " queued or running requests");
  return adapters_->remove(name);
}

bool Engine::abort(uint64_t id) {
  if (finished_.erase(id)) return true;
  if (lane_ && lane_->result.valid() && lane_->job.seq->id == id) {  // the lane writes its pages: let it finish
    std::vector<StepOutput> ignored;
    finish_lane(ignored, true);
    if (finished_.erase(id)) return true;
  }
  return scheduler_->abort(id) != nullptr;
}

Result<uint64_t> Engine::add_request(Request request) {
  const model::ModelConfig& mc = model_->config();
  const SchedulerLimits& lim = config_.scheduler;
  if (!request.adapter.empty()) LMX_RETURN_IF_ERROR(adapters_->check_servable(request.adapter));
  if (request.prompt_ids.empty()) return invalid_argument("prompt is empty");
  for (size_t i = 0; i < request.prompt_ids.size(); ++i) {
    int32_t id = request.prompt_ids[i];
    if (id < 0 || id >= mc.vocab_size)
      return invalid_argument("prompt token " + std::to_string(i) + " is " + std::to_string(id) + ", outside the vocabulary [0, " +
                              std::to_string(mc.vocab_size) + ")");
  }
  const SamplingOptions& so = request.sampling;
  if (so.max_tokens < 1) return invalid_argument("max_tokens must be >= 1, got " + std::to_string(so.max_tokens));
  if (!(so.temperature >= 0.0f)) return invalid_argument("temperature must be >= 0, got " + std::to_string(so.temperature));
  if (so.top_k < 0) return invalid_argument("top_k must be >= 0, got " + std::to_string(so.top_k));
  if (!(so.top_p > 0.0f && so.top_p <= 1.0f)) return invalid_argument("top_p must be in (0, 1], got " + std::to_string(so.top_p));
  if (so.logprobs < -1 || so.logprobs > ops::kMaxTopLogprobs)
    return invalid_argument("logprobs must be -1 (off) or in [0, " + std::to_string(ops::kMaxTopLogprobs) + "], got " +
                            std::to_string(so.logprobs));
  int64_t total = int64_t(request.prompt_ids.size()) + so.max_tokens;
  if (total > lim.max_model_len)
    return invalid_argument("prompt (" + std::to_string(request.prompt_ids.size()) + " tokens) + max_tokens (" +
                            std::to_string(so.max_tokens) + ") exceeds max_model_len " + std::to_string(lim.max_model_len));
  auto seq = std::make_unique<Sequence>();
  seq->id = next_id_++;
  seq->tokens = request.prompt_ids;
  seq->prompt_len = int(request.prompt_ids.size());
  seq->request = std::move(request);
  uint64_t id = seq->id;
  scheduler_->add(std::move(seq));
  return id;
}

void Engine::build_batch(Staging& st, ops::Backend& backend, const std::vector<ScheduledSeq>& step, int pad_to) {
  const int P = config_.scheduler.page_size;
  int32_t* token_ids = st.token_ids.host.view.ptr<int32_t>();
  int32_t* positions = st.positions.host.view.ptr<int32_t>();
  int32_t* token_slot = st.token_slot.host.view.ptr<int32_t>();
  int32_t* seq_start = st.seq_start.host.view.ptr<int32_t>();
  int32_t* block_table = st.block_table.host.view.ptr<int32_t>();
  int32_t* kv_write = st.kv_write_index.host.view.ptr<int32_t>();
  int32_t* sample_index = st.sample_index.host.view.ptr<int32_t>();
  int t = 0, num_samples = 0;
  bool any_lora = false;
  int64_t scattered = 0;
  st.lora_runs.clear();
  // Rows [0, rest_end) hold every adapter token outside the runs, unless one follows a run (the scheduler
  // puts running sequences, decode tokens first, before new prompts, so usually none does).
  int64_t rest_end = 0;
  bool rest_after_run = false;
  for (size_t b = 0; b < step.size(); ++b) {
    const Sequence& seq = *step[b].seq;
    seq_start[b] = t;
    if (seq.slot >= 0 && step[b].num_tokens >= ops::kLoraRunTokens) {  // a prompt chunk: one adapter's run
      st.lora_runs.push_back({.first = t, .tokens = step[b].num_tokens, .slot = seq.slot});
    } else if (seq.slot >= 0) {
      rest_end = t + step[b].num_tokens;
      rest_after_run |= !st.lora_runs.empty();
    }
    int32_t* row = block_table + b * size_t(max_pages_per_seq_);
    std::fill(row, row + max_pages_per_seq_, 0);
    std::copy(seq.pages.begin(), seq.pages.end(), row);
    for (int i = 0; i < step[b].num_tokens; ++i, ++t) {
      int pos = seq.num_computed + i;
      token_ids[t] = seq.tokens[size_t(pos)];
      positions[t] = pos;
      token_slot[t] = seq.slot;
      kv_write[t] = seq.pages[size_t(pos / P)] * P + pos % P;
    }
    any_lora |= seq.slot >= 0;
    if (seq.slot >= 0 && step[b].num_tokens < ops::kLoraRunTokens) scattered += step[b].num_tokens;
    if (step[b].sample) sample_index[num_samples++] = t - 1;
  }
  // Padding rows (a decode bucket): one token each in a sequence of its own at position 0 of page 0,
  // base slot, no KV write; its keys are whatever page 0 holds and its logits are never read.
  int B = int(step.size());
  for (; B < pad_to; ++B, ++t, ++padding_rows_) {
    seq_start[B] = t;
    int32_t* row = block_table + B * size_t(max_pages_per_seq_);
    std::fill(row, row + max_pages_per_seq_, 0);
    token_ids[t] = 0;
    positions[t] = 0;
    token_slot[t] = -1;
    kv_write[t] = -1;
    sample_index[num_samples++] = t;
  }
  seq_start[B] = t;

  auto upload = [&](Staged& s, int64_t rows) {
    Tensor dst = s.device.view.rows(0, rows), src = s.host.view.rows(0, rows);
    backend.copy(dst, src);
    return dst;
  };
  st.batch = model::BatchView{};
  st.batch.num_tokens = t;
  st.batch.num_seqs = B;
  st.batch.num_samples = num_samples;
  st.batch.token_ids = upload(st.token_ids, t);
  st.batch.positions = upload(st.positions, t);
  st.batch.token_slot = upload(st.token_slot, t);
  st.batch.seq_start = upload(st.seq_start, B + 1);
  st.batch.block_table = upload(st.block_table, B);
  st.batch.kv_write_index = upload(st.kv_write_index, t);
  st.batch.sample_index = upload(st.sample_index, num_samples);
  st.batch.any_lora = any_lora;
  st.batch.lora_scattered_tokens = scattered;
  st.batch.lora_runs = st.lora_runs;
  st.batch.lora_rest_rows = rest_after_run ? -1 : rest_end;
}

// One uniform number per sampled row from the request's stream and the index of the token being drawn,
// so a seeded request samples the same tokens however it is batched.
std::vector<int32_t> Engine::sample(Staging& st, ops::Backend& backend, const std::vector<ScheduledSeq>& step,
                                    const Tensor& logits, std::vector<std::optional<TokenLogprobs>>* logprobs) {
  std::vector<int32_t> tokens;
  int S = int(logits.dim(0));
  logprobs->assign(size_t(S), std::nullopt);
  if (S == 0) return tokens;
  int top_n = -1;  // the widest top-logprobs list a row of this step asked for; -1 = no row wants logprobs
  float* temperature = st.temperature.host.view.ptr<float>();
  int32_t* top_k = st.top_k.host.view.ptr<int32_t>();
  float* top_p = st.top_p.host.view.ptr<float>();
  float* uniform = st.uniform.host.view.ptr<float>();
  int i = 0;
  for (const ScheduledSeq& s : step) {
    if (!s.sample) continue;
    const SamplingOptions& so = s.seq->request.sampling;
    temperature[i] = so.temperature;
    top_k[i] = so.top_k;
    top_p[i] = so.top_p;
    top_n = std::max(top_n, so.logprobs);
    uint64_t stream = so.seed ? mix64(*so.seed) : mix64(config_.seed ^ mix64(s.seq->id));
    uint64_t draw = mix64(stream ^ mix64(uint64_t(s.seq->num_generated())));
    uniform[i] = float(draw >> 40) * (1.0f / 16777216.0f);
    ++i;
  }
  auto upload = [&](Staged& staged) {
    Tensor dst = staged.device.view.rows(0, S);
    backend.copy(dst, staged.host.view.rows(0, S));
    return dst;
  };
  Tensor out = st.sampled_tokens.device.view.rows(0, S);
  ops::SamplingParams params{.logits = logits,
                             .temperature = upload(st.temperature),
                             .top_k = upload(st.top_k),
                             .top_p = upload(st.top_p),
                             .uniform = upload(st.uniform),
                             .out_tokens = out};
  // Logprobs only when a row asked; every row then gets the widest list and keeps its own prefix of it
  // (never wider than the vocabulary: a tiny model lists all of its tokens).
  top_n = int(std::min<int64_t>(top_n, logits.dim(1)));
  auto top_view = [&](Staged& staged, bool device) {
    return (device ? staged.device : staged.host).view.rows(0, int64_t(S) * top_n).reshape({S, top_n});
  };
  if (top_n >= 0) {
    params.out_logprob = st.sampled_logprob.device.view.rows(0, S);
    if (top_n > 0) {
      params.out_top_ids = top_view(st.top_ids, true);
      params.out_top_logprobs = top_view(st.top_logprobs, true);
    }
  }
  backend.sample(params);
  backend.time_mark(1);  // the step's last device op before the tokens are read back
  backend.copy(st.sampled_tokens.host.view.rows(0, S), out);
  const int32_t* host = st.sampled_tokens.host.view.ptr<int32_t>();
  tokens.assign(host, host + S);
  if (top_n < 0) return tokens;
  backend.copy(st.sampled_logprob.host.view.rows(0, S), params.out_logprob);
  if (top_n > 0) {
    backend.copy(top_view(st.top_ids, false), params.out_top_ids);
    backend.copy(top_view(st.top_logprobs, false), params.out_top_logprobs);
  }
  const float* logprob = st.sampled_logprob.host.view.ptr<float>();         // [S] f32
  const int32_t* top_ids = st.top_ids.host.view.ptr<int32_t>();             // [S, top_n] i32
  const float* top_logprobs = st.top_logprobs.host.view.ptr<float>();       // [S, top_n] f32
  i = 0;
  for (const ScheduledSeq& s : step) {
    if (!s.sample) continue;
    const int n = std::min(s.seq->request.sampling.logprobs, top_n);
    if (n >= 0) {
      const size_t row = size_t(i) * size_t(top_n);
      (*logprobs)[size_t(i)] = TokenLogprobs{.logprob = logprob[i],
                                             .top_ids = {top_ids + row, top_ids + row + n},
                                             .top_logprobs = {top_logprobs + row, top_logprobs + row + n}};
    }
    ++i;
  }
  return tokens;
}

Engine::StepReport Engine::step() {
  StepReport report;
  std::vector<StepOutput>& outputs = report.outputs;
  // 0. The prefill lane: a finished run's first tokens join this step's outputs; an idle lane takes the
  // next prompt (it runs beside the step below).
  if (lane_) {
    report.num_tokens += finish_lane(outputs, false);
    start_lane(report.scheduled);
  }
  // 1. schedule
  std::vector<ScheduledSeq> step = scheduler_->schedule();
  for (std::unique_ptr<Sequence>& failed : scheduler_->take_failed()) {  // e.g. its adapter could not be read
    outputs.push_back({.id = failed->id, .finished = true, .finish = FinishReason::kAbort, .error = failed->error});
    finished_[failed->id] = std::move(failed);
  }
  if (step.empty()) {
    // Nothing decodes: wait for the lane, then give it the next prompt.
    if (lane_) {
      const int fed = finish_lane(outputs, true);
      report.num_tokens += fed;
      if (fed > 0) start_lane(report.scheduled);
    }
    return report;
  }
  // 2. run
  const int bucket = decode_bucket(step);
  build_batch(main_, backend_, step, bucket);
  backend_.time_mark(0);  // the step's inputs are enqueued: device time from here to the sampled tokens
  const auto launch_start = std::chrono::steady_clock::now();
  for (const ScheduledSeq& s : step) {
    report.num_tokens += s.num_tokens;
    report.scheduled.push_back(s.seq->id);
  }
  Tensor logits = run_forward(bucket);
  report.launch_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - launch_start).count();
  int real_samples = 0;
  for (const ScheduledSeq& s : step) real_samples += s.sample ? 1 : 0;
  logits = logits.rows(0, real_samples);  // padding rows' logits are not sampled
  // 3. sample
  std::vector<std::optional<TokenLogprobs>> token_logprobs;  // per sampled row
  std::vector<int32_t> tokens = sample(main_, backend_, step, logits, &token_logprobs);
  report.device_seconds = backend_.marked_seconds();  // sample() has read the tokens back: both marks are done
  scheduler_->commit(step);
  // 4. postprocess
  postprocess(step, tokens, token_logprobs, logits, backend_, outputs);
  // A lane run that finished meanwhile: its token goes out now, and the lane takes the next prompt.
  if (lane_) {
    const int fed = finish_lane(outputs, false);
    report.num_tokens += fed;
    if (fed > 0) start_lane(report.scheduled);
  }
  return report;
}

void Engine::postprocess(const std::vector<ScheduledSeq>& step, const std::vector<int32_t>& tokens,
                         std::vector<std::optional<TokenLogprobs>>& token_logprobs, const Tensor& logits,
                         ops::Backend& backend, std::vector<StepOutput>& outputs) {
  const model::ModelConfig& mc = model_->config();
  OwnedTensor host_logits;
  int i = 0;
  for (const ScheduledSeq& s : step) {
    if (!s.sample) continue;
    Sequence* seq = s.seq;
    int32_t token = tokens[size_t(i)];
    if (seq->request.return_logits) {
      if (!host_logits.view.defined()) {
        host_logits = OwnedTensor::host(DType::F32, {logits.dim(0), logits.dim(1)});
        backend.copy(host_logits.view, logits);
      }
      const float* row = host_logits.view.row(i).ptr<float>();
      seq->logits.emplace_back(row, row + mc.vocab_size);
    }
    std::optional<TokenLogprobs> token_logprob = std::move(token_logprobs[size_t(i)]);
    if (token_logprob) seq->token_logprobs.push_back(*token_logprob);
    ++i;
    seq->tokens.push_back(token);
    const SamplingOptions& so = seq->request.sampling;
    FinishReason reason = FinishReason::kNone;
    bool is_eos = std::find(mc.eos_token_ids.begin(), mc.eos_token_ids.end(), token) != mc.eos_token_ids.end();
    bool is_stop = std::find(so.stop_token_ids.begin(), so.stop_token_ids.end(), token) != so.stop_token_ids.end();
    if ((is_eos && !so.ignore_eos) || is_stop) reason = FinishReason::kStop;
    else if (seq->num_generated() >= so.max_tokens) reason = FinishReason::kLength;
    outputs.push_back({.id = seq->id, .token = token, .finished = reason != FinishReason::kNone, .finish = reason,
                       .logprobs = std::move(token_logprob)});
    if (reason != FinishReason::kNone) {
      std::unique_ptr<Sequence> done = scheduler_->finish(seq, reason);
      finished_[done->id] = std::move(done);
    }
  }
}

// The lane's run: the batch is built here on the engine's thread (host staging, uploads on the lane's
// stream); forward and sampling run on a worker thread, on the lane's backend and model. The worker reads
// only the lane's own state, the KV cache tensors (its sequence's pages, which nothing else touches while
// it is in the lane) and a copy of the slot table's stacks taken now (its slot is held by its sequence).
void Engine::start_lane(std::vector<uint64_t>& scheduled) {
  if (!lane_ || lane_->result.valid()) return;
  std::optional<ScheduledSeq> job = scheduler_->schedule_lane();
  if (!job) return;
  Lane& lane = *lane_;
  lane.job = *job;
  scheduled.push_back(job->seq->id);
  const lora::SlotTable& slots = adapters_->slots();
  const int layers = model_->config().num_layers;
  lane.stacks.assign(size_t(layers) * ops::kNumLoraTargets, ops::LoraStack{});
  for (int layer = 0; layer < layers; ++layer)
    for (int t = 0; t < ops::kNumLoraTargets; ++t)
      lane.stacks[size_t(layer) * ops::kNumLoraTargets + size_t(t)] = slots.stack(layer, ops::LoraTarget(t));
  build_batch(lane.staging, *lane.backend, {lane.job});
  ++lane_runs_;
  lane.result = std::async(std::launch::async, [this, &lane] {
    const model::LoraLookup lookup = [&lane](int layer, ops::LoraTarget target) {
      return lane.stacks[size_t(layer) * ops::kNumLoraTargets + size_t(target)];
    };
    LaneResult result;
    Tensor logits = lane.model->forward(lane.staging.batch, cache_, lookup);
    result.logits = logits.rows(0, lane.job.sample ? 1 : 0);
    result.tokens = sample(lane.staging, *lane.backend, {lane.job}, result.logits, &result.logprobs);
    lane.backend->synchronize();
    return result;
  });
}

int Engine::finish_lane(std::vector<StepOutput>& outputs, bool wait) {
  if (!lane_ || !lane_->result.valid()) return 0;
  Lane& lane = *lane_;
  if (!wait && lane.result.wait_for(std::chrono::seconds(0)) != std::future_status::ready) return 0;
  LaneResult result = lane.result.get();
  const std::vector<ScheduledSeq> job = {lane.job};
  scheduler_->commit(job);
  lane.job.seq->in_lane = false;
  postprocess(job, result.tokens, result.logprobs, result.logits, *lane.backend, outputs);
  return job[0].num_tokens;
}

std::unique_ptr<Sequence> Engine::take_finished(uint64_t id) {
  auto it = finished_.find(id);
  if (it == finished_.end()) return nullptr;
  std::unique_ptr<Sequence> seq = std::move(it->second);
  finished_.erase(it);
  return seq;
}

}  // namespace lmx::engine
