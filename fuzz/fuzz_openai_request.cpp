// libFuzzer target: the OpenAI request parsers of the server (src/server/api.h) on arbitrary bodies.
// Every input must yield either a validated request or an ApiError, never a crash, hang or exception;
// error bodies must serialise (dump_json replaces invalid UTF-8 rather than throwing).
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "server/api.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  const lmx::server::ModelInfo model{.served_name = "base", .max_model_len = 64, .vocab_size = 256,
                                     .has_tokenizer = (size & 1) != 0, .has_chat_template = (size & 2) != 0};
  for (auto endpoint : {lmx::server::Endpoint::kCompletions, lmx::server::Endpoint::kChat}) {
    lmx::server::GenerateRequest request;
    if (auto error = lmx::server::parse_generate_request(body, endpoint, model, &request)) {
      (void)lmx::server::dump_json(lmx::server::error_json(*error));
    } else if (!request.prompt_ids.empty()) {
      if (auto error = lmx::server::finalize_prompt(model, &request)) (void)lmx::server::dump_json(lmx::server::error_json(*error));
    }
  }
  lmx::server::AdapterRequest adapter;
  if (auto error = lmx::server::parse_adapter_request(body, /*needs_path=*/true, model, &adapter))
    (void)lmx::server::dump_json(lmx::server::error_json(*error));
  return 0;
}
