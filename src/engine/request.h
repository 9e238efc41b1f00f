// Requests and sequences: what a caller submits (prompt ids, adapter name, sampling options) and the
// per-sequence state the scheduler and runner advance. Host data only.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace lmx::engine {

struct SamplingOptions {
  float temperature = 0.0f;  // 0 = greedy
  int top_k = 0;             // 0 = off
  float top_p = 1.0f;        // 1 = off
  std::optional<uint64_t> seed;  // unset: derived from the request id (reproducible per engine run)
  int max_tokens = 16;
  bool ignore_eos = false;
  std::vector<int32_t> stop_token_ids;
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
  std::vector<std::vector<float>> logits;  // per generated token, when request.return_logits

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
};

}  // namespace lmx::engine
