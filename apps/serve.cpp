// `loramux serve`: the OpenAI-compatible server. Binds the port first (503 "model is loading" on its own io
// thread), then builds the backend, base model, engine and adapters as `generate` does, attaches the
// tokenizer and chat template (--tokenizer DIR, else the model directory's tokenizer.json; --chat-template
// FILE), prints the effective configuration, starts the engine loop and marks the server ready.
// SIGTERM/SIGINT drain: stop accepting, finish in-flight requests, exit 0 (a second signal exits at once).
#include <utility>  // before asio (Boost 1.74 awaitable.hpp needs std::exchange)
#include <boost/asio.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <thread>

#include "apps/commands.h"
#include "core/log.h"
#include "engine/setup.h"
#include "lora/adapter.h"
#include "server/http_server.h"
#include "server/tokenizer_text.h"

namespace lmx::apps {
namespace {

struct ServeOptions {
  std::string model;               // "" = the built-in default model (models/default) and its adapters
  std::string served_model_name;  // "" = the --model value ("default" for the built-in model)
  std::string tokenizer;      // "" = the model directory's tokenizer.json, if any
  std::string chat_template;  // "" = the tokenizer directory's template, if any
  std::string device = "cpu";
  std::string kernel_configs;  // `loramux tune` output folder for the CUDA backend
  std::vector<std::string> loras;
  std::vector<std::string> pinned_loras;
  int dummy_loras = 0;
  int dummy_lora_rank = 16;
  uint64_t weight_seed = 0;
  bool mxfp4_experts = false, no_mxfp4_experts = false;  // neither: engine::Mxfp4Experts::kAuto
  engine::EngineConfig engine;
  server::ServerOptions server;
  double refill_wait_ms = 3.0;  // server::EngineLoopOptions, in the flag's unit
  double refill_wait_share = 0.02;
};

// The HTTP server's io thread, running from before the model loads; stopped and joined on every return.
struct IoThread {
  explicit IoThread(boost::asio::io_context& ioc) : ioc(ioc), thread([&ioc] { ioc.run(); }) {}
  ~IoThread() {
    ioc.stop();
    if (thread.joinable()) thread.join();
  }
  boost::asio::io_context& ioc;
  std::thread thread;
};

int run_serve(ServeOptions o) {
  auto fail = [](const Status& s) {
    std::cerr << "loramux serve: " << s.message() << "\n";
    return 1;
  };
  Result<bool> built_in = engine::use_default_model_if_unset(&o.model, &o.loras);
  if (!built_in.ok()) return fail(built_in.status());
  if (o.served_model_name.empty()) o.served_model_name = *built_in ? "default" : o.model;

  // Readiness: the port is bound first and answers 503 "model is loading" (/health and /v1/*) until the
  // model, tokenizer and start-up adapters below are loaded. Declared before what they serve: the engine
  // loop outlives the io context and the server's sessions.
  server::Metrics metrics;
  std::unique_ptr<server::EngineLoop> loop;
  boost::asio::io_context ioc(1);
  auto http = std::make_shared<server::HttpServer>(ioc, o.server, metrics);
  Status listening = http->listen();
  if (!listening.ok()) return fail(listening);
  // The bound port on its own line (tests start the server with --port 0 and read it, then poll /health).
  std::cerr << "loramux serve: listening on http://" << o.server.host << ":" << http->port() << " (loading the model)\n"
            << std::flush;
  boost::asio::signal_set signals(ioc, SIGINT, SIGTERM);
  bool draining = false;
  std::function<void(const boost::system::error_code&, int)> on_signal = [&](const boost::system::error_code& ec, int sig) {
    if (ec) return;
    if (!http->ready()) {  // nothing is in flight while loading: leave now rather than after the load
      std::cerr << "loramux serve: signal " << sig << " during start-up, exiting\n" << std::flush;
      std::_Exit(0);
    }
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
  IoThread io(ioc);
  // Test hook (never set in production): hold start-up this long so tests can watch the 503 phase.
  if (const char* delay = std::getenv("LORAMUX_TEST_STARTUP_DELAY_MS")) {
    char* end = nullptr;
    const long ms = std::strtol(delay, &end, 10);
    if (end == delay || *end != '\0' || ms < 0)
      return fail(invalid_argument("LORAMUX_TEST_STARTUP_DELAY_MS must be a number of milliseconds, got '" +
                                   std::string(delay) + "'"));
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  }

  Result<std::unique_ptr<ops::Backend>> backend = engine::make_backend(o.device, o.kernel_configs);
  if (!backend.ok()) return fail(backend.status());

  // The tokenizer first: a preset takes its vocabulary size from it.
  const bool is_preset = o.model.rfind("preset:", 0) == 0;
  std::string tokenizer_dir = o.tokenizer;
  std::error_code fs_error;
  if (tokenizer_dir.empty() && !is_preset &&
      std::filesystem::exists(std::filesystem::path(o.model) / "tokenizer.json", fs_error))
    tokenizer_dir = o.model;
  if (tokenizer_dir.empty() && !o.chat_template.empty())
    return fail(invalid_argument("--chat-template needs a tokenizer: pass --tokenizer DIR (" +
                                 std::string(is_preset ? "presets have none" : "no tokenizer.json in " + o.model) + ")"));
  std::unique_ptr<server::TokenizerText> text;
  if (!tokenizer_dir.empty()) {
    Result<std::unique_ptr<server::TokenizerText>> loaded = server::TokenizerText::load(tokenizer_dir, o.chat_template);
    if (!loaded.ok()) return fail(loaded.status().with_context("tokenizer"));
    text = std::move(loaded).value();
  }
  const int tokenizer_vocab = text ? int(text->tokenizer().vocab_size()) : 0;
  const uint64_t free_before_weights = (*backend)->available_bytes();
  Result<model::ModelWeights> weights = engine::load_base_model(o.model, o.weight_seed, is_preset ? tokenizer_vocab : 0,
                                                                         backend->get(), engine::mxfp4_mode(o.mxfp4_experts, o.no_mxfp4_experts));
  if (!weights.ok()) return fail(weights.status());
  const uint64_t free_after_weights = (*backend)->available_bytes();
  if (text) {
    // Checkpoints often pad V beyond the tokenizer (fine); a tokenizer with ids past V would index past the
    // embedding and LM head.
    if (tokenizer_vocab > weights->config.vocab_size)
      return fail(invalid_argument("the tokenizer in " + tokenizer_dir + " has " + std::to_string(tokenizer_vocab) +
                                   " ids but the model's vocab_size is " + std::to_string(weights->config.vocab_size) +
                                   "; use the model's own tokenizer"));
    // The tokenizer's EOS ends generation (unless ignore_eos), beside config.json's eos ids.
    std::vector<int>& eos = weights->config.eos_token_ids;
    const int32_t tokenizer_eos = text->tokenizer().eos_id();
    if (tokenizer_eos >= 0 && std::find(eos.begin(), eos.end(), tokenizer_eos) == eos.end()) eos.push_back(tokenizer_eos);
  }
  if (o.engine.max_cpu_loras == 0)
    o.engine.max_cpu_loras = engine::default_max_cpu_loras(o.engine.max_loras, int(o.loras.size()) + o.dummy_loras);
  Result<std::unique_ptr<engine::Engine>> created = engine::Engine::create(*weights, **backend, o.engine);
  if (!created.ok()) return fail(created.status());
  engine::Engine& eng = **created;
  const lora::BaseModelShapes shapes = engine::lora_shapes(weights->config);
  const lora::AdapterLimits limits{.max_rank = o.engine.max_lora_rank};
  Status added = engine::add_cli_adapters(eng, o.loras, o.dummy_loras, o.dummy_lora_rank, o.weight_seed, o.pinned_loras);
  if (!added.ok()) return fail(added);

  server::ModelInfo info{.served_name = o.served_model_name,
                         .max_model_len = eng.config().scheduler.max_model_len,
                         .vocab_size = weights->config.vocab_size,
                         .has_tokenizer = text != nullptr,
                         .has_chat_template = text != nullptr && text->has_chat_template()};
  std::string tokenizer_line = "none (token-id prompts only)", template_line = "none (no tokenizer)";
  if (text) {
    tokenizer_line = tokenizer_dir + " (vocab " + std::to_string(tokenizer_vocab) + ", eos " +
                     std::to_string(text->tokenizer().eos_id()) + ")";
    template_line = text->has_chat_template() ? text->chat_template_origin()
                                              : "none (" + text->chat_template_problem() + ")";
  }
  std::string eos_line;
  for (int id : weights->config.eos_token_ids) eos_line += (eos_line.empty() ? "" : ",") + std::to_string(id);

  const engine::EngineConfig& ec = eng.config();
  // The device's memory plan as allocated at start (a GPU reports its total; the cpu backend does not). The
  // weights are the free memory the load took (what the loader and generator placed on the device).
  std::string memory_line = "host memory (cpu backend)";
  if ((*backend)->total_bytes() > 0) {
    auto gib = [](uint64_t bytes) {
      char text[32];
      std::snprintf(text, sizeof text, "%.1f GiB", double(bytes) / double(uint64_t(1) << 30));
      return std::string(text);
    };
    const uint64_t weights_bytes = free_before_weights > free_after_weights ? free_before_weights - free_after_weights : 0;
    memory_line = "weights " + gib(weights_bytes) + ", adapter slots " + gib(eng.adapter_slot_bytes()) +
                  ", KV cache " + gib(eng.kv_cache_bytes()) + "; " + gib((*backend)->available_bytes()) + " of " +
                  gib((*backend)->total_bytes()) + " free";
  }
  std::string adapters;
  for (const std::string& name : eng.adapters().names())
    adapters += (adapters.empty() ? "" : ",") + name + (eng.adapters().pinned(name) ? " (pinned)" : "");
  std::cerr << "loramux serve configuration:\n"
            << "  model                   " << o.model << " (served as '" << o.served_model_name << "', "
            << model::family_name(weights->config.family) << ", vocab " << weights->config.vocab_size << ")\n"
            << "  device                  " << o.device << "\n"
            << "  tokenizer               " << tokenizer_line << "\n"
            << "  chat template           " << template_line << "\n"
            << "  eos ids                 " << (eos_line.empty() ? "(none)" : eos_line) << "\n"
            << "  adapters                " << (adapters.empty() ? "(none)" : adapters) << "\n"
            << "  max-loras               " << ec.max_loras << "\n"
            << "  max-lora-rank           " << ec.max_lora_rank << "\n"
            << "  max-cpu-loras           " << ec.max_cpu_loras << "\n"
            << "  mxfp4 experts           " << (engine::has_mxfp4_experts(*weights) ? "on (decode GEMMs)" : "off")
            << (o.mxfp4_experts || o.no_mxfp4_experts ? "" : " (default for this model and device)") << "\n"
            << "  prefix caching          " << (ec.scheduler.enable_prefix_caching ? "on" : "off") << "\n"
            << "  decode graphs           " << (ec.enforce_eager ? "off (--enforce-eager)" : "on where the device records them") << "\n"
            << "  prefill lane            "
            << (ec.prefill_lane ? "on (--prefill-lane), SM share " + std::to_string(ec.prefill_lane_sm_share).substr(0, 4)
                                : std::string("off"))
            << "\n"
            << "  refill wait             "
            << (o.refill_wait_ms > 0 ? std::to_string(o.refill_wait_ms).substr(0, 5) + " ms, at most " +
                                           std::to_string(o.refill_wait_share * 100).substr(0, 4) + "% of step time"
                                     : std::string("off"))
            << "\n"
            << "  max-num-seqs            " << ec.scheduler.max_num_seqs << "\n"
            << "  max-num-batched-tokens  " << ec.scheduler.max_num_batched_tokens << "\n"
            << "  prefill-packing         "
            << (ec.scheduler.prefill_packing == engine::SchedulerLimits::PrefillPacking::kWhole ? "whole" : "fill") << "\n"
            << "  max-model-len           " << ec.scheduler.max_model_len << "\n"
            << "  gpu-memory-utilization  " << ec.gpu_memory_utilization << "\n"
            << "  page-size / kv pages    " << ec.scheduler.page_size << " / " << ec.num_kv_pages << "\n"
            << "  device memory           " << memory_line << "\n"
            << "  max-pending-requests    " << o.server.max_pending_requests << "\n"
            << "  max-body-bytes          " << o.server.max_body_bytes << "\n"
            << "  lora-dir                " << (o.server.lora_dir.empty() ? "(runtime loading disabled)" : o.server.lora_dir) << "\n"
            << "  api-key                 " << (o.server.api_key.empty() ? "(none)" : "(set)") << "\n"
            << "  listen                  " << o.server.host << ":" << o.server.port << " (backlog " << o.server.backlog << ")\n";

  loop = std::make_unique<server::EngineLoop>(
      eng, metrics, o.served_model_name,
      server::EngineLoopOptions{.refill_wait_s = o.refill_wait_ms / 1e3, .refill_wait_share = o.refill_wait_share});
  loop->start();
  http->set_ready({.model = info, .loop = loop.get(), .adapter_shapes = shapes, .adapter_limits = limits, .text = text.get()});
  std::cerr << "loramux serve: ready on http://" << o.server.host << ":" << http->port() << "\n" << std::flush;
  io.thread.join();  // until drained (SIGTERM) or stopped (a second signal)
  loop->stop();
  return 0;
}

}  // namespace

std::function<int()> add_serve_command(CLI::App& app) {
  auto o = std::make_shared<ServeOptions>();
  CLI::App* cmd = app.add_subcommand("serve", "OpenAI-compatible HTTP server (completions, models, adapters, metrics)");
  cmd->add_option("--model", o->model,
                  "Hugging Face model directory or preset:NAME (default: the built-in models/default, served as "
                  "'default', with its adapters)");
  cmd->add_option("--served-model-name", o->served_model_name, "Name that selects the base model (default: --model)");
  cmd->add_option("--tokenizer", o->tokenizer,
                  "Directory with tokenizer.json (+ tokenizer_config.json) for text prompts and chat; a preset's "
                  "vocabulary is sized to it (default: the model directory's tokenizer.json, if any)");
  cmd->add_option("--chat-template", o->chat_template, "Jinja chat template file overriding the tokenizer's");
  cmd->add_option("--device", o->device, "cpu or cuda")->capture_default_str();
  cmd->add_option("--kernel-configs", o->kernel_configs,
                  "Tuned CUDA launch configs from `loramux tune` (default: the committed configs/kernels)");
  cmd->add_option("--lora", o->loras, "Adapter as NAME=DIR (PEFT directory); repeatable");
  cmd->add_option("--dummy-loras", o->dummy_loras, "Generate N random adapters lora0.. (as generate does)")->capture_default_str();
  cmd->add_option("--dummy-lora-rank", o->dummy_lora_rank, "Rank of generated adapters")->capture_default_str();
  cmd->add_option("--weight-seed", o->weight_seed, "Seed of preset weights and dummy adapters")->capture_default_str();
  CLI::Option* mxfp4_on = cmd->add_flag("--mxfp4-experts", o->mxfp4_experts,
                "GPT-OSS: keep the experts' MXFP4 copy (the checkpoint's own blocks; a preset generates MXFP4 experts) "
                "and run decode-sized MoE GEMMs on it, 3.8x fewer weight bytes (cuda; prefill stays bf16, the same "
                "values). Default: on for GPT-OSS with MXFP4 experts on cuda, off otherwise");
  cmd->add_flag("--no-mxfp4-experts", o->no_mxfp4_experts, "GPT-OSS: decode on the bf16 experts only")
      ->excludes(mxfp4_on);
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
  cmd->add_option("--max-cpu-loras", o->engine.max_cpu_loras,
                  "Adapters kept on the host, laid out for a slot (LRU; evicted ones are read from disk again); 0 = max(--max-loras, "
                  "number of start-up adapters)")->capture_default_str();
  cmd->add_option("--pin-lora", o->pinned_loras,
                  "Keep this start-up adapter (a --lora or --dummy-loras name) in its slot and on the host; repeatable");
  cmd->add_flag("--enable-prefix-caching,!--no-enable-prefix-caching", o->engine.scheduler.enable_prefix_caching,
                "Share KV pages of identical prefixes under the same adapter content (default on)");
  cmd->add_flag("--enforce-eager", o->engine.enforce_eager,
                "Run every step op by op (no CUDA graphs for decode steps)");
  cmd->add_flag("--prefill-lane", o->engine.prefill_lane,
                "Run each prompt's prefill on a second stream beside the decode steps, instead of in a mixed step "
                "every decoding sequence waits for (H200, perf-log run 117: TTFT 74 -> 137 ms with the decode steps first; see --prefill-lane-first)");
  cmd->add_option("--prefill-lane-sm-share", o->engine.prefill_lane_sm_share,
                  "With --prefill-lane: the share of the GPU's SMs its persistent MoE GEMMs may hold")
      ->check(CLI::Range(0.05, 1.0))
      ->capture_default_str();
  cmd->add_flag("--prefill-lane-first", o->engine.prefill_lane_first,
                "With --prefill-lane: its kernels go before the decode steps' (stream priority), so a prompt's "
                "first token comes sooner and the steps beside it stretch");
  cmd->add_option("--refill-wait-ms", o->refill_wait_ms,
                  "After a step that finished requests, with nothing waiting and sequences still decoding, hold the "
                  "next step up to this long for as many new requests, so a client that sends its next request on "
                  "completion joins the next step instead of the one after it (0 = off)")
      ->check(CLI::Range(0.0, 1000.0))
      ->capture_default_str();
  cmd->add_option("--refill-wait-share", o->refill_wait_share,
                  "The refill wait's budget: at most this share of the time spent in steps")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  cmd->add_option("--max-num-seqs", o->engine.scheduler.max_num_seqs, "Sequences per step")->capture_default_str();
  add_prefill_packing_option(cmd, &o->engine.scheduler);
  cmd->add_option("--max-num-batched-tokens", o->engine.scheduler.max_num_batched_tokens, "Tokens per step")->capture_default_str();
  cmd->add_option("--max-model-len", o->engine.scheduler.max_model_len, "Prompt + output tokens per sequence")->capture_default_str();
  cmd->add_option("--page-size", o->engine.scheduler.page_size, "KV-cache page size (tokens)")->capture_default_str();
  o->engine.gpu_memory_utilization = 0.9;
  cmd->add_option("--gpu-memory-utilization", o->engine.gpu_memory_utilization,
                  "Share of the GPU's memory to fill; the KV cache gets what weights, adapter slots and scratch leave "
                  "(cuda; ignored with --num-kv-pages)")
      ->check(CLI::Range(0.01, 1.0))
      ->capture_default_str();
  cmd->add_option("--num-kv-pages", o->engine.num_kv_pages, "KV-cache pages (0 = from --gpu-memory-utilization on cuda, enough for max-num-seqs on cpu)")->capture_default_str();
  return [o, cmd]() { return cmd->parsed() ? run_serve(*o) : 0; };
}

}  // namespace lmx::apps
