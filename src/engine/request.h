// Requests and sequences: what a caller submits (prompt ids, adapter name, sampling options) and the
// per-sequence state the scheduler and runner advance. Host data only.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kv/page_allocator.h"

namespace lmx::engine {

struct SamplingOptions {
  float temperature = 0.0f;  // 0 = greedy
  int top_k = 0;             // 0 = off
  float top_p = 1.0f;        // 1 = off
  std::optional<uint64_t> seed;  // unset: derived from the request id (reproducible per engine run)
  int max_tokens = 16;
  bool ignore_eos = false;
  std::vector<int32_t> stop_token_ids;
  // -1 = off; N in [0, ops::kMaxTopLogprobs] = each generated token's raw logprob (log_softmax of the
  // logits, before temperature/top-k/top-p) and the N most likely alternatives (ops/sampling.h).
  int logprobs = -1;
};

// One generated token's raw logprobs (SamplingOptions::logprobs >= 0).
struct TokenLogprobs {
  float logprob = 0.0f;             // of the sampled token
  std::vector<int32_t> top_ids;     // [N] most likely first, ties: lower id first
  std::vector<float> top_logprobs;  // [N]
};

struct Request {
  std::string adapter;  // "" = base model
  std::vector<int32_t> prompt_ids;
  SamplingOptions sampling;
  bool return_logits = false;  // keep the fp32 logits each token was sampled from (tests, debugging)
};

enum class FinishReason { kNone, kLength, kStop, kAbort };
const char* finish_reason_name(FinishReason reason);  // "length", "stop", "abort", ""

enum class SeqState { kWaiting, kRunning, kFinished };

struct Sequence {
  uint64_t id = 0;
  Request request;
  std::vector<int32_t> tokens;  // prompt followed by generated tokens
  int prompt_len = 0;
  int num_computed = 0;          // tokens whose K/V are in the cache
  std::vector<int32_t> pages;    // block table
  SeqState state = SeqState::kWaiting;
  FinishReason finish = FinishReason::kNone;
  int slot = -1;                 // adapter slot while running, -1 = base
  int adapter_wait_steps = 0;    // steps passed over while waiting for an adapter slot
  bool in_lane = false;          // its prefill runs on the engine's prefill lane now (EngineConfig::prefill_lane)
  // Prefix cache (scheduler-owned): chain hashes of the full pages of `tokens` (grown as pages fill; the
  // tokens never change, so they survive preemption), how many leading pages are published, and how
  // many prompt tokens the last admission found cached.
  std::vector<kv::PageHash> page_hashes;
  int num_registered_pages = 0;
  int num_cached_tokens = 0;
  std::string error;             // why the request failed (finish kAbort) before running, e.g. its adapter
  std::vector<std::vector<float>> logits;  // per generated token, when request.return_logits
  std::vector<TokenLogprobs> token_logprobs;  // per generated token, when sampling.logprobs >= 0

  int num_generated() const { return int(tokens.size()) - prompt_len; }
  // Tokens still to be fed through the model before the next sample.
  int num_pending() const { return int(tokens.size()) - num_computed; }
};

// What one step produced for one sequence.
struct StepOutput {
  uint64_t id = 0;
  int32_t token = -1;
  bool finished = false;
  FinishReason finish = FinishReason::kNone;
  std::string error;  // set when the request failed before producing a token (token is then -1)
  std::optional<TokenLogprobs> logprobs;  // when the request asked for logprobs
};

}  // namespace lmx::engine
