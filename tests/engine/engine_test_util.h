// Helpers shared by the engine tests: build an engine on the cpu backend and run requests to completion.
#pragma once
#include <memory>
#include <vector>

#include "backends/cpu/cpu_backend.h"
#include "engine/engine.h"

namespace lmx::engine::testing {

struct RunResult {
  std::vector<int32_t> tokens;                // generated
  std::vector<std::vector<float>> logits;     // per generated token
  FinishReason finish = FinishReason::kNone;
};

// Submit all requests, step until done, return results in input order (aborts the test on errors).
// step_tokens (optional): each step's token count, in order.
inline std::vector<RunResult> run_all(Engine& engine, const std::vector<Request>& requests,
                                      std::vector<int>* step_tokens = nullptr) {
  std::vector<uint64_t> ids;
  for (const Request& r : requests) {
    Result<uint64_t> id = engine.add_request(r);
    EXPECT_TRUE(id.ok()) << id.status().message();
    ids.push_back(id.ok() ? *id : 0);
  }
  int guard = 0;
  while (engine.has_work()) {
    const int tokens = engine.step().num_tokens;
    if (step_tokens != nullptr) step_tokens->push_back(tokens);
    if (tokens == 0) {
      ADD_FAILURE() << "no progress";
      break;
    }
    if (++guard > 100000) break;
  }
  std::vector<RunResult> out;
  for (uint64_t id : ids) {
    std::unique_ptr<Sequence> seq = engine.take_finished(id);
    RunResult r;
    if (seq) {
      r.tokens.assign(seq->tokens.begin() + seq->prompt_len, seq->tokens.end());
      r.logits = seq->logits;
      r.finish = seq->finish;
    }
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace lmx::engine::testing
