// Engine: the serving loop of design.md §1. step() = schedule → run (build the flat batch, one forward
// pass) → sample → postprocess (append tokens, stop checks, free finished sequences). Owns the model on
// its backend, the KV cache, the adapter store and the scheduler. Single-threaded: the caller drives it
// (the adapter store reads adapters from disk on its own loader thread, which touches no engine state).
#pragma once
#include <future>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/adapter_store.h"
#include "engine/request.h"
#include "engine/scheduler.h"
#include "model/forward.h"

namespace lmx::engine {

struct EngineConfig {
  SchedulerLimits scheduler;
  int num_kv_pages = 0;  // 0 = from gpu_memory_utilization, else enough for max_num_seqs of max_model_len
  // Share of the device's memory this engine may fill (weights, slots, scratch, then the KV cache takes
  // what is left of it, less kKvHeadroomBytes for workspaces grown later); 0 = size the cache for
  // max_num_seqs sequences of max_model_len. Used only on devices with a fixed memory (total_bytes() > 0)
  // and when num_kv_pages is 0 (vLLM's --gpu-memory-utilization).
  double gpu_memory_utilization = 0.0;
  int max_loras = 4;     // adapter slots on the device (--max-loras)
  int max_lora_rank = 64;
  int max_cpu_loras = 0; // parsed adapters kept on the host (--max-cpu-loras); 0 = all, else >= max_loras
  uint64_t seed = 0;     // derives per-request sampling streams when a request has no seed
  // Decode-only steps replay a recorded graph per (batch-size bucket, LoRA layout) on backends that record
  // (CUDA); true runs every step op by op (vLLM's --enforce-eager).
  bool enforce_eager = false;
  // Pad decode-only steps to the graph buckets even without graphs (tests of the padding on the cpu).
  bool pad_decode_batches = false;
  // The prefill lane (--prefill-lane): each prompt's prefill runs on a second backend of the same device
  // (ops::Backend::make_lane: its own stream and scratch, the same weights and KV pages) on a worker thread,
  // beside the decode steps, instead of inside a mixed step that every decoding sequence waits for. One
  // prompt at a time; its first token joins the step outputs once the lane is done. docs/perf-log.md's plan
  // (item 5) gives the reason: with many clients TTFT is two mixed steps.
  bool prefill_lane = false;
  double prefill_lane_sm_share = 0.75;  // the SMs the lane's persistent kernels may hold (--prefill-lane-sm-share)
  // The lane's kernels go before the decode steps' where both wait for SMs (--prefill-lane-first): the prompt
  // finishes sooner, the steps beside it stretch. Off: the decode steps go first.
  bool prefill_lane_first = false;
};

// The batch sizes decode graphs are recorded for, up to max_seqs (which is always one): 1, 2, 4, 8, then
// every 8 to 64, then every 16, then every 32 — a step of B sequences runs in the smallest bucket >= B.
std::vector<int> decode_graph_buckets(int max_seqs);

// The base model's LoRA target shapes, for adapter validation.
lora::BaseModelShapes lora_shapes(const model::ModelConfig& config);

class Engine {
 public:
  ~Engine();
  // Validates the config against the model (e.g. max_model_len vs the KV cache) and allocates everything.
  static Result<std::unique_ptr<Engine>> create(const model::ModelWeights& weights, ops::Backend& backend,
                                                 const EngineConfig& config);

  Status add_adapter(lora::Adapter adapter, AdapterOptions options = {});
  // Forget an adapter; refused while a queued or running request uses it (callers drain first).
  Status remove_adapter(const std::string& name);
  const AdapterStore& adapters() const { return *adapters_; }
  AdapterStore& mutable_adapters() { return *adapters_; }
  // Queue a request; errors name the problem (unknown adapter, empty or too long prompt, bad token id,
  // bad sampling option). Returns the request id.
  Result<uint64_t> add_request(Request request);
  bool has_work() const { return scheduler_->has_work(); }
  // One step. A step that only prefills chunks yields no outputs but ran tokens; 0 tokens with
  // has_work() means the waiting requests cannot be scheduled (a caller's stall check) — unless
  // adapters().num_loading() > 0: requests wait for an adapter read from disk.
  struct StepReport {
    int num_tokens = 0;
    std::vector<StepOutput> outputs;
    std::vector<uint64_t> scheduled;  // ids of the sequences that ran this step (queue-time metrics)
    double device_seconds = -1;       // device time from the enqueued inputs to the sampled tokens (-1: none)
    // Host time from the enqueued inputs (the device timer's start) until the forward's last launch returned
    // (a graph replay's cudaGraphLaunch, or every eager launch). Until the first kernel is launched the GPU
    // idles inside device_seconds, so this bounds how much of that is host time.
    double launch_seconds = 0;
  };
  StepReport step();
  // A finished sequence (tokens, finish reason, logits if asked), removed from the engine.
  std::unique_ptr<Sequence> take_finished(uint64_t id);
  // Cancel a request wherever it is (waiting, running, or finished but not taken): its pages and adapter
  // slot are freed now. False when the id is unknown.
  bool abort(uint64_t id);

  const Scheduler& scheduler() const { return *scheduler_; }
  Scheduler& scheduler() { return *scheduler_; }  // benchmarks: e.g. hold KV pages to move a batch's pages
  // Padding rows run so far (decode steps padded up to their graph bucket).
  uint64_t num_padding_rows() const { return padding_rows_; }
  // Decode steps that replayed a recorded graph, and recordings made.
  uint64_t num_graph_replays() const { return graph_replays_; }
  uint64_t num_graph_captures() const { return graph_captures_; }
  // Prefill runs on the lane so far (EngineConfig::prefill_lane).
  uint64_t num_lane_runs() const { return lane_runs_; }
  const model::Model& model() const { return *model_; }
  const EngineConfig& config() const { return config_; }
  // What the engine allocated at start, for the start-up log: the adapter slots and the KV cache.
  uint64_t adapter_slot_bytes() const;
  uint64_t kv_cache_bytes() const { return cache_.bytes(); }
  model::Model& mutable_model() { return *model_; }

 private:
  Engine(const model::ModelWeights& weights, ops::Backend& backend, const EngineConfig& config);
  // KV pages the memory budget allows (gpu_memory_utilization), or an error naming the shortfall.
  Result<int> kv_pages_from_memory(const model::ModelConfig& mc) const;
  // Host staging of one flat batch and its device twins (sized from the limits once), and the batch built
  // from them. The engine has one for its steps and, with the prefill lane, one on the lane's backend.
  struct Staged {
    OwnedTensor host, device;
  };
  struct Staging {
    Staged token_ids, positions, token_slot, seq_start, block_table, kv_write_index, sample_index;
    Staged temperature, top_k, top_p, uniform, sampled_tokens;
    Staged sampled_logprob;         // [B] f32
    Staged top_ids, top_logprobs;   // [B * kMaxTopLogprobs] i32 / f32, viewed as [S, N] per step
    model::BatchView batch;
    std::vector<ops::LoraRun> lora_runs;  // batch.lora_runs' storage
  };
  Staging make_staging(ops::Backend& backend, int max_tokens, int max_seqs) const;
  // `pad_to` > step.size(): rows past the real sequences are padding (base slot, no KV write, not read).
  void build_batch(Staging& st, ops::Backend& backend, const std::vector<ScheduledSeq>& step, int pad_to = 0);
  // The bucket a decode-only step is padded to, or 0 when the step runs eagerly as it is.
  int decode_bucket(const std::vector<ScheduledSeq>& step) const;
  // The forward pass of the batch just built, through a recorded graph when `bucket` > 0 and the backend
  // records; the first step of a (bucket, LoRA layout) runs eagerly (it sizes workspaces), the second
  // records, later ones replay.
  Tensor run_forward(int bucket);
  // The sampled token of each sampled row; `logprobs` gets one entry per row (set for rows that asked).
  std::vector<int32_t> sample(Staging& st, ops::Backend& backend, const std::vector<ScheduledSeq>& step,
                              const Tensor& logits, std::vector<std::optional<TokenLogprobs>>* logprobs);
  // Append each sampled row's token to its sequence, check stops, finish sequences; one output per row.
  // `logits` (the sampled rows', on `backend`) is read back only for requests that keep logits.
  void postprocess(const std::vector<ScheduledSeq>& step, const std::vector<int32_t>& tokens,
                   std::vector<std::optional<TokenLogprobs>>& token_logprobs, const Tensor& logits,
                   ops::Backend& backend, std::vector<StepOutput>& outputs);
  // The prefill lane (EngineConfig::prefill_lane): start its next run if idle (its sequence's id goes to
  // `scheduled`), or take a finished run's outputs (wait: block until the run in flight is done); returns the
  // tokens the finished run fed (0: none finished).
  void start_lane(std::vector<uint64_t>& scheduled);
  int finish_lane(std::vector<StepOutput>& outputs, bool wait);

  EngineConfig config_;
  ops::Backend& backend_;
  Status init_status_;  // a construction failure create() returns (e.g. no memory left for the KV cache)
  std::unique_ptr<model::Model> model_;
  model::KvCache cache_;
  std::unique_ptr<AdapterStore> adapters_;
  std::unique_ptr<Scheduler> scheduler_;
  int max_pages_per_seq_ = 0;
  uint64_t next_id_ = 1;
  std::map<uint64_t, std::unique_ptr<Sequence>> finished_;

  Staging main_;  // the engine's own steps

  // The prefill lane: a second backend and model (the same device weights), its staging, and the run in
  // flight on a worker thread, which returns the sampled rows' tokens and logprobs.
  struct LaneResult {
    std::vector<int32_t> tokens;
    std::vector<std::optional<TokenLogprobs>> logprobs;
    Tensor logits;  // the sampled rows' logits on the lane's backend (valid until the next run)
  };
  struct Lane {
    std::unique_ptr<ops::Backend> backend;
    std::unique_ptr<model::Model> model;
    Staging staging;
    std::vector<ops::LoraStack> stacks;  // [layer · kNumLoraTargets + target]: the slot table when the run began
    ScheduledSeq job;
    std::future<LaneResult> result;
  };
  std::unique_ptr<Lane> lane_;
  uint64_t lane_runs_ = 0;

  struct DecodeGraph {
    int id = -1;    // backend recording; -1: seen once (ran eagerly), not yet recorded
    Tensor logits;  // where the recording leaves the logits [bucket, V]
  };
  std::map<std::pair<int, std::string>, DecodeGraph> graphs_;  // (bucket, LoRA layout) -> recording
  uint64_t graphs_epoch_ = 0;                                  // backend memory epoch of graphs_
  std::vector<int> buckets_;
  uint64_t padding_rows_ = 0, graph_replays_ = 0, graph_captures_ = 0;
  void release_graphs();
};

}  // namespace lmx::engine
