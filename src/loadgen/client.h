// The benchmark's HTTP client: sends planned streaming requests to an OpenAI-compatible server on one io
// thread (Boost.Beast/asio, no thread per request), at their arrival times and within a concurrency limit,
// and records when each output chunk arrived. Knows nothing of statistics (stats.h) or the CLI (apps/bench.cpp).
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "core/status.h"
#include "loadgen/dataset.h"
#include "loadgen/stats.h"
#include "tokenizer/tokenizer.h"

namespace lmx::loadgen {

struct ClientOptions {
  std::string host = "127.0.0.1";
  int port = 8000;
  std::string endpoint = "/v1/completions";  // or /v1/chat/completions (chosen by the path's ending)
  std::string api_key;                       // sent as Authorization: Bearer when set
  int max_concurrency = 0;                   // requests in flight at most; 0 = unbounded
  double request_timeout_s = 600;            // a request fails after this long without a byte
  bool ignore_eos = false;                   // vLLM's extra parameter: generate exactly max_tokens
  double temperature = 0;                    // greedy, as vLLM's benchmark sends
};

// Chat when the endpoint path ends in chat/completions (the OpenAI layout), else completions.
bool is_chat_endpoint(const std::string& endpoint);

struct PlannedRequest {
  const BenchPrompt* prompt = nullptr;
  std::string model;     // adapter name or the base model's name
  bool is_base = false;
  double send_at_s = 0;  // from the run's start; non-decreasing over a plan
};

// The JSON body of one request: streaming with stream_options.include_usage, max_tokens (chat:
// max_completion_tokens) = the prompt's output_len, temperature, ignore_eos when set. Token-id prompts
// are refused for chat (the error says so).
Result<std::string> request_body(const ClientOptions& options, const PlannedRequest& request);

struct RunResult {
  std::vector<RequestOutcome> outcomes;  // in plan order
  double duration_s = 0;                 // start to the last request's end
};

// Sends every planned request and waits for all. Request failures (refused connection, HTTP errors,
// error events, truncated streams, timeouts) are recorded in the outcomes, not returned; the Status is
// for what stops the whole run (the host does not resolve). `tokenizer` (may be null) counts output
// tokens when the server reports neither usage nor token ids. `on_progress(done, total)` after each.
Result<RunResult> run_requests(const ClientOptions& options, const std::vector<PlannedRequest>& plan,
                               const tokenizer::Tokenizer* tokenizer, const std::function<void(int, int)>& on_progress);

// GET `path` (e.g. /v1/models) and return the body of a 200 response; anything else is an error naming
// the URL and the status.
Result<std::string> http_get(const ClientOptions& options, const std::string& path, double timeout_s);

}  // namespace lmx::loadgen
