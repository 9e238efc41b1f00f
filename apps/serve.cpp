// `loramux serve`: the OpenAI-compatible server. Builds the backend, base model, engine and adapters as
// `generate` does, prints the effective configuration, then runs the HTTP server on this thread and the
// engine loop on its own. SIGTERM/SIGINT drain: stop accepting, finish in-flight requests, exit 0 (a
// second signal exits at once).
#include <utility>  // before asio (Boost 1.74 awaitable.hpp needs std::exchange)
#include <boost/asio.hpp>
#include <iostream>

#include "apps/commands.h"
#include "core/log.h"
#include "engine/setup.h"
#include "lora/adapter.h"
#include "server/http_server.h"

namespace lmx::apps {
namespace {

struct ServeOptions {
  std::string model = "preset:tiny-moe";
  std::string served_model_name;  // "" = the --model value
  std::string device = "cpu";
  std::vector<std::string> loras;
  int dummy_loras = 0;
  int dummy_lora_rank = 16;
  uint64_t weight_seed = 0;
  engine::EngineConfig engine;
  server::ServerOptions server;
};

int run_serve(ServeOptions o) {
  auto fail = [](const Status& s) {
    std::cerr << "loramux serve: " << s.message() << "\n";
    return 1;
  };
  if (o.served_model_name.empty()) o.served_model_name = o.model;
  Result<std::unique_ptr<ops::Backend>> backend = engine::make_backend(o.device);
  if (!backend.ok()) return fail(backend.status());
  Result<model::ModelWeights> weights = engine::load_base_model(o.model, o.weight_seed);
  if (!weights.ok()) return fail(weights.status());
  Result<std::unique_ptr<engine::Engine>> created = engine::Engine::create(*weights, **backend, o.engine);
  if (!created.ok()) return fail(created.status());
  engine::Engine& eng = **created;
  const lora::BaseModelShapes shapes = engine::lora_shapes(weights->config);
  const lora::AdapterLimits limits{.max_rank = o.engine.max_lora_rank};
  Status added = engine::add_cli_adapters(eng, o.loras, o.dummy_loras, o.dummy_lora_rank, o.weight_seed);
  if (!added.ok()) return fail(added);

  // Tokenizer: the seam (server/text.h) is wired when src/tokenizer lands; until then token ids only.
  const server::TextCodec* text = nullptr;
  server::ModelInfo info{.served_name = o.served_model_name,
                         .max_model_len = eng.config().scheduler.max_model_len,
                         .vocab_size = weights->config.vocab_size,
                         .has_tokenizer = text != nullptr,
                         .has_chat_template = text != nullptr && text->has_chat_template()};

  const engine::EngineConfig& ec = eng.config();
  std::string adapters;
  for (const std::string& name : eng.adapters().names()) adapters += (adapters.empty() ? "" : ",") + name;
  std::cerr << "loramux serve configuration:\n"
            << "  model                   " << o.model << " (served as '" << o.served_model_name << "', "
            << model::family_name(weights->config.family) << ", vocab " << weights->config.vocab_size << ")\n"
            << "  device                  " << o.device << "\n"
            << "  tokenizer               " << (text ? "yes" : "none (token-id prompts only)") << "\n"
            << "  adapters                " << (adapters.empty() ? "(none)" : adapters) << "\n"
            << "  max-loras               " << ec.max_loras << "\n"
            << "  max-lora-rank           " << ec.max_lora_rank << "\n"
            << "  max-num-seqs            " << ec.scheduler.max_num_seqs << "\n"
            << "  max-num-batched-tokens  " << ec.scheduler.max_num_batched_tokens << "\n"
            << "  max-model-len           " << ec.scheduler.max_model_len << "\n"
            << "  page-size / kv pages    " << ec.scheduler.page_size << " / " << ec.num_kv_pages << "\n"
            << "  max-pending-requests    " << o.server.max_pending_requests << "\n"
            << "  max-body-bytes          " << o.server.max_body_bytes << "\n"
            << "  lora-dir                " << (o.server.lora_dir.empty() ? "(runtime loading disabled)" : o.server.lora_dir) << "\n"
            << "  api-key                 " << (o.server.api_key.empty() ? "(none)" : "(set)") << "\n"
            << "  listen                  " << o.server.host << ":" << o.server.port << " (backlog " << o.server.backlog << ")\n";

  server::Metrics metrics;
  server::EngineLoop loop(eng, metrics, o.served_model_name);
  boost::asio::io_context ioc(1);
  auto http = std::make_shared<server::HttpServer>(ioc, o.server, info, loop, metrics, shapes, limits, text);
  Status listening = http->listen();
  if (!listening.ok()) return fail(listening);
  loop.start();
  // The bound port on its own line (tests start the server with --port 0 and read it).
  std::cerr << "loramux serve: listening on http://" << o.server.host << ":" << http->port() << "\n" << std::flush;

  boost::asio::signal_set signals(ioc, SIGINT, SIGTERM);
  bool draining = false;
  std::function<void(const boost::system::error_code&, int)> on_signal = [&](const boost::system::error_code& ec, int sig) {
    if (ec) return;
    if (draining) {  // second signal: stop now
      std::cerr << "loramux serve: signal " << sig << " again, stopping now\n";
      ioc.stop();
      return;
    }
    draining = true;
    std::cerr << "loramux serve: signal " << sig << ", draining (finishing in-flight requests)\n";
    http->drain([&] {
      std::cerr << "loramux serve: drained\n";
      ioc.stop();
    });
    signals.async_wait(on_signal);
  };
  signals.async_wait(on_signal);
  ioc.run();
  loop.stop();
  return 0;
}

}  // namespace

std::function<int()> add_serve_command(CLI::App& app) {
  auto o = std::make_shared<ServeOptions>();
  CLI::App* cmd = app.add_subcommand("serve", "OpenAI-compatible HTTP server (completions, models, adapters, metrics)");
  cmd->add_option("--model", o->model, "Hugging Face model directory or preset:NAME")->capture_default_str();
  cmd->add_option("--served-model-name", o->served_model_name, "Name that selects the base model (default: --model)");
  cmd->add_option("--device", o->device, "cpu or cuda")->capture_default_str();
  cmd->add_option("--lora", o->loras, "Adapter as NAME=DIR (PEFT directory); repeatable");
  cmd->add_option("--dummy-loras", o->dummy_loras, "Generate N random adapters lora0.. (as generate does)")->capture_default_str();
  cmd->add_option("--dummy-lora-rank", o->dummy_lora_rank, "Rank of generated adapters")->capture_default_str();
  cmd->add_option("--weight-seed", o->weight_seed, "Seed of preset weights and dummy adapters")->capture_default_str();
  cmd->add_option("--host", o->server.host, "Address to listen on")->capture_default_str();
  cmd->add_option("--port", o->server.port, "Port (0 = any free port)")->capture_default_str();
  cmd->add_option("--backlog", o->server.backlog, "listen(2) backlog")->capture_default_str();
  cmd->add_option("--api-key", o->server.api_key, "Require Authorization: Bearer KEY on /v1/*");
  cmd->add_option("--lora-dir", o->server.lora_dir, "Root that runtime adapter loads must resolve inside (unset: disabled)");
  cmd->add_option("--max-pending-requests", o->server.max_pending_requests,
                  "Generation requests in flight (running + waiting) before 429")->capture_default_str();
  cmd->add_option("--max-body-bytes", o->server.max_body_bytes, "Larger request bodies get 413")->capture_default_str();
  cmd->add_option("--max-loras", o->engine.max_loras, "Adapter slots on the device")->capture_default_str();
  cmd->add_option("--max-lora-rank", o->engine.max_lora_rank, "Largest adapter rank accepted")->capture_default_str();
  cmd->add_option("--max-num-seqs", o->engine.scheduler.max_num_seqs, "Sequences per step")->capture_default_str();
  cmd->add_option("--max-num-batched-tokens", o->engine.scheduler.max_num_batched_tokens, "Tokens per step")->capture_default_str();
  cmd->add_option("--max-model-len", o->engine.scheduler.max_model_len, "Prompt + output tokens per sequence")->capture_default_str();
  cmd->add_option("--page-size", o->engine.scheduler.page_size, "KV-cache page size (tokens)")->capture_default_str();
  cmd->add_option("--num-kv-pages", o->engine.num_kv_pages, "KV-cache pages (0 = enough for max-num-seqs)")->capture_default_str();
  return [o, cmd]() { return cmd->parsed() ? run_serve(*o) : 0; };
}

}  // namespace lmx::apps
