// `loramux generate`: offline generation from prompt ids (no tokenizer yet). One request from
// --prompt-ids, or many from --requests FILE.jsonl run together as mixed-adapter batches; prints one JSON
// object per request in input order. A bad request is reported in its own line; the others still run.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <thread>

#include "apps/commands.h"
#include "core/log.h"
#include "engine/setup.h"
#include "io/safetensors.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"
#include "lora/adapter.h"

namespace lmx::apps {
namespace {

struct GenerateOptions {
  std::string model;  // "" = the built-in default model (models/default) and its adapters
  std::string device = "cpu";
  std::string kernel_configs;  // `loramux tune` output folder for the CUDA backend
  std::vector<std::string> loras;
  int dummy_loras = 0;
  int dummy_lora_rank = 16;
  std::vector<std::string> pinned_loras;
  std::string adapter;
  std::string prompt_ids = "1,2,3,4";
  std::string prompt_text;     // --prompt: encoded with the tokenizer
  std::string messages_file;   // --messages: rendered with the chat template, then encoded
  std::string tokenizer_dir;   // default: the model directory
  std::string chat_template;   // --chat-template FILE
  std::string requests_file;
  int max_tokens = 16;
  float temperature = 0.0f;
  int top_k = 0;
  float top_p = 1.0f;
  int64_t seed = -1;
  bool ignore_eos = false;
  engine::EngineConfig engine;
  uint64_t weight_seed = 0;
  bool mxfp4_experts = false, no_mxfp4_experts = false;  // neither: engine::Mxfp4Experts::kAuto
  std::string dump_dir;
};

// --dump-activations: every named stage of every layer (model/forward.h ActivationDump), copied to the
// host during a step and written as DIR/step<N>.safetensors ("layer3.attention", "embedding", ...), so
// a run on one backend can be compared tensor by tensor with a run on another.
class ActivationWriter {
 public:
  ActivationWriter(std::string dir, ops::Backend& backend) : dir_(std::move(dir)), backend_(backend) {}
  void record(const std::string& name, int layer, const Tensor& value) {
    OwnedTensor host = OwnedTensor::host_like(value, value.dtype);
    backend_.copy(host.view, value);
    tensors_.push_back({layer < 0 ? name : "layer" + std::to_string(layer) + "." + name, std::move(host)});
  }
  Status flush() {
    std::vector<std::pair<std::string, Tensor>> views;
    for (const auto& [name, t] : tensors_) views.push_back({name, t.view});
    Status written = io::write_safetensors(dir_ + "/step" + std::to_string(step_++) + ".safetensors", views);
    tensors_.clear();
    return written;
  }

 private:
  std::string dir_;
  ops::Backend& backend_;
  int step_ = 0;
  std::vector<std::pair<std::string, OwnedTensor>> tensors_;
};

Result<std::vector<int32_t>> parse_ids(const std::string& text) {
  std::vector<int32_t> ids;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    try {
      size_t used = 0;
      long v = std::stol(item, &used);
      if (used != item.size()) throw std::invalid_argument(item);
      ids.push_back(int32_t(v));
    } catch (const std::exception&) {
      return invalid_argument("--prompt-ids: '" + item + "' is not an integer token id");
    }
  }
  return ids;
}

// One JSONL line -> Request, with errors naming the line and field.
Result<engine::Request> parse_request_line(const std::string& line, size_t line_no, const GenerateOptions& o) {
  std::string where = "requests line " + std::to_string(line_no);
  nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return invalid_argument(where + ": not a JSON object");
  engine::Request r;
  r.sampling.max_tokens = o.max_tokens;
  r.sampling.temperature = o.temperature;
  r.sampling.top_k = o.top_k;
  r.sampling.top_p = o.top_p;
  r.sampling.ignore_eos = o.ignore_eos;
  if (o.seed >= 0) r.sampling.seed = uint64_t(o.seed);
  try {
    if (j.contains("adapter") && !j["adapter"].is_null()) r.adapter = j["adapter"].get<std::string>();
    if (!j.contains("prompt_ids")) return invalid_argument(where + ": missing field 'prompt_ids'");
    r.prompt_ids = j["prompt_ids"].get<std::vector<int32_t>>();
    if (j.contains("max_tokens")) r.sampling.max_tokens = j["max_tokens"].get<int>();
    if (j.contains("temperature")) r.sampling.temperature = j["temperature"].get<float>();
    if (j.contains("top_k")) r.sampling.top_k = j["top_k"].get<int>();
    if (j.contains("top_p")) r.sampling.top_p = j["top_p"].get<float>();
    if (j.contains("seed")) r.sampling.seed = j["seed"].get<uint64_t>();
    if (j.contains("ignore_eos")) r.sampling.ignore_eos = j["ignore_eos"].get<bool>();
  } catch (const nlohmann::json::exception& e) {
    return invalid_argument(where + ": " + e.what());
  }
  return r;
}

// Text in (--prompt / --messages) needs a tokenizer: --tokenizer DIR, else the model directory's own.
// Loaded before the model, because a preset is generated with the tokenizer's vocabulary size.
struct TextSupport {
  std::optional<tokenizer::Tokenizer> tok;
  std::string dir;
};

Result<TextSupport> load_text_support(const GenerateOptions& o) {
  TextSupport text;
  if (o.prompt_text.empty() && o.messages_file.empty() && o.tokenizer_dir.empty()) return text;
  text.dir = !o.tokenizer_dir.empty() ? o.tokenizer_dir : o.model;
  if (text.dir.rfind("preset:", 0) == 0)
    return invalid_argument("--prompt/--messages with a preset model need --tokenizer DIR");
  LMX_ASSIGN_OR_RETURN(tokenizer::Tokenizer tok, tokenizer::Tokenizer::load(text.dir));
  text.tok = std::move(tok);
  return text;
}

// The tokenizer must fit the model's vocabulary; its EOS ends generation (unless ignore_eos) beside
// config.json's EOS ids — the same rule as `serve`, so both give the same tokens.
Status attach_tokenizer(const TextSupport& text, model::ModelConfig& config) {
  if (!text.tok) return Status::Ok();
  if (text.tok->vocab_size() > config.vocab_size)
    return invalid_argument("tokenizer in " + text.dir + " has " + std::to_string(text.tok->vocab_size()) +
                            " ids but the model's vocabulary has " + std::to_string(config.vocab_size));
  const int32_t eos = text.tok->eos_id();
  std::vector<int>& ids = config.eos_token_ids;
  if (eos >= 0 && std::find(ids.begin(), ids.end(), eos) == ids.end()) ids.push_back(eos);
  return Status::Ok();
}

// The prompt ids of the single request: --prompt text, --messages rendered by the chat template, or
// --prompt-ids.
Result<std::vector<int32_t>> single_prompt(const GenerateOptions& o, const TextSupport& text) {
  if (!o.prompt_text.empty()) return text.tok->encode(o.prompt_text, /*add_special_tokens=*/true);
  if (!o.messages_file.empty()) {
    LMX_ASSIGN_OR_RETURN(std::string json_text, io::read_text_file(o.messages_file));
    nlohmann::ordered_json j = nlohmann::ordered_json::parse(json_text, nullptr, false);
    if (j.is_object() && j.contains("messages")) j = j["messages"];
    if (!j.is_array()) return invalid_argument(o.messages_file + ": expected a JSON array of messages (or {\"messages\": [...]})");
    LMX_ASSIGN_OR_RETURN(tokenizer::ChatTemplate chat, tokenizer::load_chat_template(text.dir, o.chat_template));
    LMX_ASSIGN_OR_RETURN(std::string rendered, chat.render(j, {{"add_generation_prompt", true}}));
    // The template writes BOS and other special tokens itself, as transformers' apply_chat_template does.
    return text.tok->encode(rendered, /*add_special_tokens=*/false);
  }
  return parse_ids(o.prompt_ids);
}

int run_generate(GenerateOptions o) {
  auto fail = [](const Status& s) {
    std::cerr << "loramux generate: " << s.message() << "\n";
    return 1;
  };
  Result<bool> built_in = engine::use_default_model_if_unset(&o.model, &o.loras);
  if (!built_in.ok()) return fail(built_in.status());
  Result<std::unique_ptr<ops::Backend>> backend = engine::make_backend(o.device, o.kernel_configs);
  if (!backend.ok()) return fail(backend.status());
  Result<TextSupport> text = load_text_support(o);
  if (!text.ok()) return fail(text.status());
  const bool is_preset = o.model.rfind("preset:", 0) == 0;
  Result<model::ModelWeights> weights =
      engine::load_base_model(o.model, o.weight_seed, is_preset && text->tok ? text->tok->vocab_size() : 0,
                              backend->get(), engine::mxfp4_mode(o.mxfp4_experts, o.no_mxfp4_experts));
  if (!weights.ok()) return fail(weights.status());
  Status attached = attach_tokenizer(*text, weights->config);
  if (!attached.ok()) return fail(attached);
  engine::EngineConfig config = o.engine;
  if (config.max_cpu_loras == 0)
    config.max_cpu_loras = engine::default_max_cpu_loras(config.max_loras, int(o.loras.size()) + o.dummy_loras);
  Result<std::unique_ptr<engine::Engine>> created = engine::Engine::create(*weights, **backend, config);
  if (!created.ok()) return fail(created.status());
  engine::Engine& eng = **created;

  Status added = engine::add_cli_adapters(eng, o.loras, o.dummy_loras, o.dummy_lora_rank, o.weight_seed, o.pinned_loras);
  if (!added.ok()) return fail(added);

  // Requests, in input order; a malformed one becomes an error line, not an abort.
  std::vector<Result<engine::Request>> requests;
  if (!o.requests_file.empty()) {
    std::ifstream in(o.requests_file);
    if (!in) return fail(io_error("cannot open requests file '" + o.requests_file + "'"));
    std::string line;
    size_t line_no = 0;
    while (std::getline(in, line)) {
      ++line_no;
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      requests.push_back(parse_request_line(line, line_no, o));
    }
  } else {
    Result<std::vector<int32_t>> ids = single_prompt(o, *text);
    if (!ids.ok()) return fail(ids.status());
    engine::Request r;
    r.adapter = o.adapter;
    r.prompt_ids = *ids;
    r.sampling = {.temperature = o.temperature, .top_k = o.top_k, .top_p = o.top_p, .max_tokens = o.max_tokens,
                  .ignore_eos = o.ignore_eos};
    if (o.seed >= 0) r.sampling.seed = uint64_t(o.seed);
    requests.push_back(r);
  }

  std::vector<nlohmann::json> results(requests.size());
  std::vector<std::pair<uint64_t, size_t>> ids;  // request id -> input index
  bool any_error = false;
  for (size_t i = 0; i < requests.size(); ++i) {
    results[i] = {{"index", i}};
    Result<uint64_t> id = requests[i].ok() ? eng.add_request(requests[i].value()) : Result<uint64_t>(requests[i].status());
    if (!id.ok()) {
      results[i]["error"] = id.status().message();
      any_error = true;
      continue;
    }
    results[i]["adapter"] = requests[i]->adapter.empty() ? nlohmann::json(nullptr) : nlohmann::json(requests[i]->adapter);
    ids.push_back({*id, i});
  }
  std::unique_ptr<ActivationWriter> dump;
  if (!o.dump_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(o.dump_dir, ec);
    if (ec) return fail(io_error("--dump-activations: cannot create '" + o.dump_dir + "': " + ec.message()));
    dump = std::make_unique<ActivationWriter>(o.dump_dir, **backend);
    eng.mutable_model().set_activation_dump(
        [&](const std::string& name, int layer, const Tensor& value) { dump->record(name, layer, value); });
  }
  while (eng.has_work()) {
    int ran = eng.step().num_tokens;
    if (dump) {
      Status written = dump->flush();
      if (!written.ok()) return fail(written);
    }
    if (ran == 0 && eng.adapters().num_loading() > 0) {  // waiting for an adapter read from disk
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      continue;
    }
    if (ran == 0) {
      std::cerr << "loramux generate: the scheduler cannot make progress (KV cache or adapter slots too small)\n";
      return 1;
    }
  }
  for (auto [id, index] : ids) {
    std::unique_ptr<engine::Sequence> seq = eng.take_finished(id);
    LMX_CHECK(seq != nullptr);
    std::vector<int32_t> generated(seq->tokens.begin() + seq->prompt_len, seq->tokens.end());
    if (text->tok) results[index]["text"] = text->tok->decode(generated, /*skip_special_tokens=*/true);
    results[index]["token_ids"] = generated;
    results[index]["finish_reason"] = engine::finish_reason_name(seq->finish);
    if (!seq->error.empty()) {  // e.g. its adapter could no longer be read
      results[index]["error"] = seq->error;
      any_error = true;
    }
  }
  for (const nlohmann::json& r : results) std::cout << r.dump() << "\n";
  return any_error ? 1 : 0;
}

}  // namespace

std::function<int()> add_generate_command(CLI::App& app) {
  auto opts = std::make_shared<GenerateOptions>();
  CLI::App* cmd = app.add_subcommand("generate", "Generate tokens from prompt ids (greedy by default)");
  cmd->add_option("--model", opts->model,
                  "Hugging Face model directory or preset:NAME (default: the built-in models/default with its adapters)");
  cmd->add_option("--device", opts->device, "cpu or cuda")->capture_default_str();
  cmd->add_option("--kernel-configs", opts->kernel_configs,
                  "Tuned CUDA launch configs from `loramux tune` (default: the committed configs/kernels)");
  cmd->add_option("--lora", opts->loras, "Adapter as NAME=DIR (PEFT directory); repeatable");
  cmd->add_option("--dummy-loras", opts->dummy_loras, "Generate N random adapters lora0..")->capture_default_str();
  cmd->add_option("--dummy-lora-rank", opts->dummy_lora_rank, "Rank of generated adapters")->capture_default_str();
  cmd->add_option("--adapter", opts->adapter, "Adapter for --prompt-ids (default: base model)");
  cmd->add_option("--prompt-ids", opts->prompt_ids, "Comma-separated prompt token ids")->capture_default_str();
  cmd->add_option("--prompt", opts->prompt_text, "Prompt text (needs a tokenizer)");
  cmd->add_option("--messages", opts->messages_file, "JSON file of chat messages, rendered with the chat template");
  cmd->add_option("--tokenizer", opts->tokenizer_dir, "Directory with tokenizer.json (default: the model directory)");
  cmd->add_option("--chat-template", opts->chat_template, "Jinja chat template file overriding the model's");
  cmd->add_option("--requests", opts->requests_file,
                  "JSONL file: {\"adapter\": .., \"prompt_ids\": [..], \"max_tokens\": n} per line, run together");
  cmd->add_option("--max-tokens", opts->max_tokens, "Tokens to generate per request")->capture_default_str();
  cmd->add_option("--temperature", opts->temperature, "0 = greedy")->capture_default_str();
  cmd->add_option("--top-k", opts->top_k, "0 = off")->capture_default_str();
  cmd->add_option("--top-p", opts->top_p, "1 = off")->capture_default_str();
  cmd->add_option("--seed", opts->seed, "Sampling seed (-1: per-request streams)")->capture_default_str();
  cmd->add_flag("--ignore-eos", opts->ignore_eos, "Do not stop at EOS");
  cmd->add_option("--max-loras", opts->engine.max_loras, "Adapter slots on the device")->capture_default_str();
  cmd->add_option("--max-lora-rank", opts->engine.max_lora_rank, "Largest adapter rank accepted")->capture_default_str();
  cmd->add_option("--max-cpu-loras", opts->engine.max_cpu_loras,
                  "Adapters kept on the host, laid out for a slot; 0 = max(--max-loras, number of adapters)")->capture_default_str();
  cmd->add_option("--pin-lora", opts->pinned_loras, "Keep this adapter in its slot and on the host; repeatable");
  cmd->add_flag("--enable-prefix-caching,!--no-enable-prefix-caching", opts->engine.scheduler.enable_prefix_caching,
                "Share KV pages of identical prefixes under the same adapter content (default on)");
  cmd->add_flag("--enforce-eager", opts->engine.enforce_eager,
                "Run every step op by op (no CUDA graphs for decode steps)");
  cmd->add_flag("--prefill-lane", opts->engine.prefill_lane,
                "Run each prompt's prefill on a second stream beside the decode steps, instead of in a mixed step "
                "every decoding sequence waits for (H200, perf-log run 117: TTFT 74 -> 137 ms with the decode steps first; see --prefill-lane-first)");
  cmd->add_option("--prefill-lane-sm-share", opts->engine.prefill_lane_sm_share,
                  "With --prefill-lane: the share of the GPU's SMs its persistent MoE GEMMs may hold")
      ->check(CLI::Range(0.05, 1.0))
      ->capture_default_str();
  cmd->add_flag("--prefill-lane-first", opts->engine.prefill_lane_first,
                "With --prefill-lane: its kernels go before the decode steps' (stream priority), so a prompt's "
                "first token comes sooner and the steps beside it stretch");
  cmd->add_option("--max-num-seqs", opts->engine.scheduler.max_num_seqs, "Sequences per step")->capture_default_str();
  add_prefill_packing_option(cmd, &opts->engine.scheduler);
  cmd->add_option("--max-num-batched-tokens", opts->engine.scheduler.max_num_batched_tokens, "Tokens per step")
      ->capture_default_str();
  cmd->add_option("--max-model-len", opts->engine.scheduler.max_model_len, "Prompt + output tokens per sequence")
      ->capture_default_str();
  cmd->add_option("--page-size", opts->engine.scheduler.page_size, "KV-cache page size (tokens)")->capture_default_str();
  opts->engine.gpu_memory_utilization = 0.9;
  cmd->add_option("--gpu-memory-utilization", opts->engine.gpu_memory_utilization,
                  "Share of the GPU's memory to fill; the KV cache gets what weights, adapter slots and scratch leave "
                  "(cuda; ignored with --num-kv-pages)")
      ->check(CLI::Range(0.01, 1.0))
      ->capture_default_str();
  cmd->add_option("--num-kv-pages", opts->engine.num_kv_pages, "KV-cache pages (0 = from --gpu-memory-utilization on cuda, enough for max-num-seqs on cpu)")
      ->capture_default_str();
  cmd->add_option("--dump-activations", opts->dump_dir,
                  "Write every layer's named activations of each step to DIR/step<N>.safetensors");
  cmd->add_option("--weight-seed", opts->weight_seed, "Seed of preset weights and dummy adapters")->capture_default_str();
  CLI::Option* mxfp4_on = cmd->add_flag("--mxfp4-experts", opts->mxfp4_experts,
                "GPT-OSS: keep the experts' MXFP4 copy (the checkpoint's own blocks; a preset generates MXFP4 experts) "
                "and run decode-sized MoE GEMMs on it (cuda). Default: on for GPT-OSS with MXFP4 experts on cuda");
  cmd->add_flag("--no-mxfp4-experts", opts->no_mxfp4_experts, "GPT-OSS: decode on the bf16 experts only")
      ->excludes(mxfp4_on);
  return [opts, cmd]() { return cmd->parsed() ? run_generate(*opts) : 0; };
}

}  // namespace lmx::apps
