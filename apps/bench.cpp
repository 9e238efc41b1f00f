// `loramux bench serve`: the serving benchmark against any OpenAI-compatible server (vLLM's `bench serve`
// flags where they mean the same): builds the dataset, assigns adapters and arrival times, runs warm-ups
// then the timed requests (src/loadgen), prints the report, writes --result-json and draws --plot.
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "apps/commands.h"
#include "loadgen/client.h"
#include "loadgen/dataset.h"
#include "loadgen/report.h"
#include "loadgen/schedule.h"
#include "tokenizer/tokenizer.h"

namespace lmx::apps {
namespace {

struct BenchServeOptions {
  std::string base_url;  // http://host:port[/prefix]; overrides --host/--port
  std::string host = "127.0.0.1";
  int port = 8000;
  std::string endpoint = "/v1/completions";
  std::string model;  // "" = the first base model /v1/models lists
  std::string tokenizer;
  std::string api_key;
  std::string dataset_name = "sonnet";
  std::string dataset_path;
  int input_len = 1600;
  int output_len = 600;
  int sonnet_prefix_len = 0;
  double random_range_ratio = 0;
  int random_vocab_size = 0;
  int num_prompts = 1000;
  int num_warmups = 0;
  std::string request_rate = "inf";
  int max_concurrency = 0;
  uint64_t seed = 0;
  bool ignore_eos = false;
  double temperature = 0;
  std::vector<std::string> lora_modules;
  std::string lora_assignment = "round-robin";
  double base_fraction = 0;
  std::string metric_percentiles = "90,99";
  std::string result_json;
  bool save_detailed = false;
  std::string plot;
  double request_timeout_s = 600;
  bool disable_progress = false;
};

int fail(const Status& s) {
  std::cerr << "loramux bench serve: " << s.message() << "\n";
  return 1;
}

// http://host[:port][/prefix] -> host, port, and a path prefix put before --endpoint.
Status parse_base_url(const std::string& url, std::string* host, int* port, std::string* prefix) {
  const std::string scheme = "http://";
  if (url.rfind("https://", 0) == 0) return unsupported("--base-url: https is not supported, found '" + url + "'");
  if (url.rfind(scheme, 0) != 0) return invalid_argument("--base-url must look like http://host:port, found '" + url + "'");
  std::string rest = url.substr(scheme.size());
  const size_t slash = rest.find('/');
  *prefix = slash == std::string::npos ? "" : rest.substr(slash);
  while (!prefix->empty() && prefix->back() == '/') prefix->pop_back();
  rest = rest.substr(0, slash);
  const size_t colon = rest.rfind(':');
  *port = 80;
  if (colon != std::string::npos && rest.find(']') == std::string::npos) {
    const std::string port_text = rest.substr(colon + 1);
    if (port_text.empty() || port_text.find_first_not_of("0123456789") != std::string::npos || port_text.size() > 5 ||
        std::stoi(port_text) > 65535)
      return invalid_argument("--base-url: port '" + port_text + "' is not a number in [0, 65535]");
    *port = std::stoi(port_text);
    rest = rest.substr(0, colon);
  }
  if (rest.empty()) return invalid_argument("--base-url has no host: '" + url + "'");
  *host = rest;
  return Status::Ok();
}

Result<double> parse_rate(const std::string& text) {
  if (text == "inf" || text == "infinity") return loadgen::kInfiniteRate;
  size_t used = 0;
  double rate = 0;
  try {
    rate = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size() || !(rate > 0) || !std::isfinite(rate))
    return invalid_argument("--request-rate must be a positive number of requests/s or inf, found '" + text + "'");
  return rate;
}

Result<std::vector<double>> parse_percentiles(const std::string& text) {
  std::vector<double> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    size_t used = 0;
    double p = -1;
    try {
      p = std::stod(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size() || !(p > 0 && p < 100))
      return invalid_argument("--metric-percentiles wants numbers in (0, 100) separated by commas, found '" + item + "'");
    out.push_back(p);
  }
  if (out.empty()) return invalid_argument("--metric-percentiles is empty");
  return out;
}

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

std::filesystem::path executable_dir() {
  std::error_code ec;
  std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::filesystem::path(".") : exe.parent_path();
}

// tools/plot_bench.py with the build's venv Python when there is one (scripts/setup installs matplotlib
// there), else python3; LORAMUX_PYTHON overrides.
Status draw_plot(const std::string& json_path, const std::string& png_path) {
  std::filesystem::path script = std::filesystem::path(LORAMUX_SOURCE_DIR) / "tools" / "plot_bench.py";
  std::error_code ec;
  if (!std::filesystem::exists(script, ec)) script = executable_dir() / ".." / "tools" / "plot_bench.py";
  if (!std::filesystem::exists(script, ec)) return not_found("--plot: tools/plot_bench.py not found (looked beside the source tree and the binary)");
  std::string python = "python3";
  if (const char* env = std::getenv("LORAMUX_PYTHON"); env && *env) python = env;
  else if (std::filesystem::exists(executable_dir() / "venv" / "bin" / "python", ec)) python = (executable_dir() / "venv" / "bin" / "python").string();
  const std::string command = shell_quote(python) + " " + shell_quote(script.string()) + " " + shell_quote(json_path) + " " +
                              shell_quote(png_path);
  const int rc = std::system(command.c_str());
  if (rc != 0) return io_error("--plot: `" + command + "` failed (exit status " + std::to_string(rc) + "; is matplotlib installed?)");
  return Status::Ok();
}

// Many concurrent requests need many sockets: lift the soft open-file limit to the hard one.
void raise_open_file_limit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur < limit.rlim_max) {
    limit.rlim_cur = limit.rlim_max;
    setrlimit(RLIMIT_NOFILE, &limit);
  }
}

// "\r[#####.....]  12/100" on a terminal.
void draw_progress(int done, int total, const char* phase) {
  const int width = 40;
  const int filled = total > 0 ? done * width / total : width;
  std::cout << "\r" << phase << " [" << std::string(size_t(filled), '#') << std::string(size_t(width - filled), '.') << "] "
            << done << "/" << total << (done == total ? "\n" : "") << std::flush;
}

int run_bench_serve(BenchServeOptions o) {
  raise_open_file_limit();
  loadgen::ClientOptions client{.host = o.host, .port = o.port, .endpoint = o.endpoint, .api_key = o.api_key,
                                .max_concurrency = o.max_concurrency, .request_timeout_s = o.request_timeout_s,
                                .ignore_eos = o.ignore_eos, .temperature = o.temperature};
  std::string base_url = "http://" + o.host + ":" + std::to_string(o.port);
  std::string prefix;  // a path in --base-url goes before the endpoint and /v1/models
  if (!o.base_url.empty()) {
    Status parsed = parse_base_url(o.base_url, &client.host, &client.port, &prefix);
    if (!parsed.ok()) return fail(parsed);
    client.endpoint = prefix + o.endpoint;
    base_url = o.base_url;
  }
  if (o.endpoint.empty() || o.endpoint.front() != '/') return fail(invalid_argument("--endpoint must start with '/', found '" + o.endpoint + "'"));
  if (o.max_concurrency < 0) return fail(invalid_argument("--max-concurrency must be >= 0 (0 = unbounded), found " + std::to_string(o.max_concurrency)));
  if (o.num_warmups < 0) return fail(invalid_argument("--num-warmups must be >= 0, found " + std::to_string(o.num_warmups)));
  if (!(o.request_timeout_s > 0)) return fail(invalid_argument("--request-timeout must be > 0 seconds"));
  Result<double> rate = parse_rate(o.request_rate);
  if (!rate.ok()) return fail(rate.status());
  Result<std::vector<double>> percentiles = parse_percentiles(o.metric_percentiles);
  if (!percentiles.ok()) return fail(percentiles.status());
  Result<loadgen::Assignment> assignment = loadgen::parse_assignment(o.lora_assignment, o.base_fraction);
  if (!assignment.ok()) return fail(assignment.status());
  for (size_t i = 0; i < o.lora_modules.size(); ++i)
    for (size_t k = 0; k < i; ++k)
      if (o.lora_modules[i] == o.lora_modules[k]) return fail(invalid_argument("--lora-modules names '" + o.lora_modules[i] + "' twice"));

  // The server's models: the base model's name when --model is not given, and a check that every adapter
  // asked for is served (before any timed request fails with 404).
  Result<std::string> models_body = loadgen::http_get(client, prefix + "/v1/models", 30);
  if (models_body.ok()) {
    const nlohmann::json models = nlohmann::json::parse(*models_body, nullptr, false);
    std::vector<std::string> served;
    std::string first_base;
    if (!models.is_discarded() && models.is_object() && models.contains("data") && models["data"].is_array())
      for (const nlohmann::json& m : models["data"])
        if (m.is_object() && m.contains("id") && m["id"].is_string()) {
          served.push_back(m["id"].get<std::string>());
          if (first_base.empty() && (!m.contains("parent") || m["parent"].is_null())) first_base = served.back();
        }
    if (o.model.empty()) o.model = first_base;
    std::string served_list;
    for (const std::string& s : served) served_list += (served_list.empty() ? "" : ", ") + s;
    for (const std::string& name : o.lora_modules)
      if (!served.empty() && std::find(served.begin(), served.end(), name) == served.end())
        return fail(not_found("--lora-modules: '" + name + "' is not served by " + base_url + " (its /v1/models lists: " + served_list + ")"));
  } else if (o.model.empty()) {
    return fail(models_body.status().with_context("--model not given and the server's model list is unavailable"));
  } else {
    std::cerr << "loramux bench serve: warning: " << models_body.status().message() << " (continuing with --model " << o.model << ")\n";
  }
  if (o.model.empty()) return fail(invalid_argument("--model not given and " + base_url + "/v1/models lists no base model"));

  std::optional<tokenizer::Tokenizer> tok;
  if (!o.tokenizer.empty()) {
    Result<tokenizer::Tokenizer> loaded = tokenizer::Tokenizer::load(o.tokenizer);
    if (!loaded.ok()) return fail(loaded.status().with_context("--tokenizer"));
    tok = std::move(loaded).value();
  }
  if (o.dataset_name == "sonnet" && o.dataset_path.empty()) {
    const std::filesystem::path shared = std::filesystem::path(LORAMUX_SOURCE_DIR) / ".." / "shared" / "data" / "sonnet.txt";
    std::error_code ec;
    if (!std::filesystem::exists(shared, ec))
      return fail(invalid_argument("--dataset-name sonnet: pass the sonnet file with --dataset-path (" + shared.string() + " is absent)"));
    o.dataset_path = std::filesystem::weakly_canonical(shared, ec).string();
  }
  if (o.random_vocab_size == 0) o.random_vocab_size = tok ? int(tok->vocab_size()) : 256;

  loadgen::DatasetOptions dataset{.name = o.dataset_name, .path = o.dataset_path, .num_prompts = o.num_prompts + o.num_warmups,
                                  .input_len = o.input_len, .output_len = o.output_len, .range_ratio = o.random_range_ratio,
                                  .sonnet_prefix_len = o.sonnet_prefix_len, .random_vocab_size = o.random_vocab_size,
                                  .seed = o.seed, .tokenizer = tok ? &*tok : nullptr};
  if (o.num_prompts < 1) return fail(invalid_argument("--num-prompts must be at least 1, found " + std::to_string(o.num_prompts)));
  Result<std::vector<loadgen::BenchPrompt>> prompts = loadgen::build_dataset(dataset);
  if (!prompts.ok()) return fail(prompts.status());
  if (loadgen::is_chat_endpoint(client.endpoint) && (*prompts)[0].uses_ids)
    return fail(invalid_argument(client.endpoint + " takes text messages, but --dataset-name " + o.dataset_name +
                                 " gives token-id prompts; use /v1/completions or a text dataset"));

  // The plan: warm-ups (first num_warmups prompts, all at once within the concurrency limit), then the
  // timed requests with their adapters and arrival times.
  auto target_name = [&](int target) { return target < 0 ? o.model : o.lora_modules[size_t(target)]; };
  const std::vector<int> warmup_targets = loadgen::assign_targets(o.num_warmups, int(o.lora_modules.size()), *assignment, o.seed + 1);
  std::vector<loadgen::PlannedRequest> warmups, plan;
  for (int i = 0; i < o.num_warmups; ++i)
    warmups.push_back({.prompt = &(*prompts)[size_t(i)], .model = target_name(warmup_targets[size_t(i)]),
                       .is_base = warmup_targets[size_t(i)] < 0});
  const std::vector<int> targets = loadgen::assign_targets(o.num_prompts, int(o.lora_modules.size()), *assignment, o.seed);
  const std::vector<double> arrivals = loadgen::poisson_arrivals(o.num_prompts, *rate, o.seed);
  std::vector<std::pair<std::string, int>> planned;
  for (int i = 0; i < o.num_prompts; ++i) {
    const std::string name = target_name(targets[size_t(i)]);
    plan.push_back({.prompt = &(*prompts)[size_t(o.num_warmups + i)], .model = name, .is_base = targets[size_t(i)] < 0,
                    .send_at_s = arrivals[size_t(i)]});
    auto it = std::find_if(planned.begin(), planned.end(), [&](const auto& p) { return p.first == name; });
    if (it == planned.end()) planned.emplace_back(name, 1);
    else ++it->second;
  }
  int64_t planned_input = 0;
  for (const loadgen::PlannedRequest& r : plan) planned_input += r.prompt->input_len;

  std::cout << "loramux bench serve: " << base_url << o.endpoint
            << ", model " << o.model << ", dataset " << o.dataset_name
            << (o.dataset_path.empty() ? "" : " (" + o.dataset_path + ")") << "\n"
            << "  prompts " << o.num_prompts << " (+" << o.num_warmups << " warm-up), input " << o.input_len
            << " tokens (dataset total " << planned_input << "), output " << o.output_len << (o.ignore_eos ? " (ignore_eos)" : "")
            << ", seed " << o.seed << "\n"
            << "  request rate " << o.request_rate << (std::isfinite(*rate) ? " req/s (Poisson)" : " (all at once)")
            << ", max concurrency " << (o.max_concurrency > 0 ? std::to_string(o.max_concurrency) : "unbounded") << "\n"
            << "  targets:";
  for (const auto& [name, count] : planned) std::cout << " " << name << (name == o.model ? " (base)" : "") << "=" << count;
  std::cout << " (" << o.lora_assignment << ", base fraction " << o.base_fraction << ")\n";
  if (o.dataset_name == "random")
    std::cout << "  random token ids in [0, " << o.random_vocab_size << ")" << (tok ? "" : " (no --tokenizer: pass --random-vocab-size for the model's vocabulary)") << "\n";
  std::cout << std::flush;

  const bool progress = !o.disable_progress && isatty(STDOUT_FILENO);
  const tokenizer::Tokenizer* counter = tok ? &*tok : nullptr;
  if (!warmups.empty()) {
    Result<loadgen::RunResult> warm = loadgen::run_requests(client, warmups, counter, [&](int done, int total) {
      if (progress) draw_progress(done, total, "warm-up");
    });
    if (!warm.ok()) return fail(warm.status());
    int warm_failed = 0;
    std::string first_error;
    for (const loadgen::RequestOutcome& r : warm->outcomes)
      if (!r.success && warm_failed++ == 0) first_error = r.error;
    std::cout << "warm-up: " << warmups.size() - size_t(warm_failed) << "/" << warmups.size() << " succeeded"
              << (warm_failed ? " (first error: " + first_error + ")" : "") << "\n";
  }
  Result<loadgen::RunResult> run = loadgen::run_requests(client, plan, counter, [&](int done, int total) {
    if (progress) draw_progress(done, total, "benchmark");
  });
  if (!run.ok()) return fail(run.status());

  loadgen::RunSettings settings{.base_url = base_url, .endpoint = o.endpoint, .model = o.model, .tokenizer = o.tokenizer,
                                .dataset_name = o.dataset_name, .dataset_path = o.dataset_path, .num_prompts = o.num_prompts,
                                .num_warmups = o.num_warmups, .input_len = o.input_len, .output_len = o.output_len,
                                .request_rate = *rate, .max_concurrency = o.max_concurrency, .seed = o.seed,
                                .ignore_eos = o.ignore_eos, .lora_modules = o.lora_modules,
                                .lora_assignment = o.lora_assignment, .base_fraction = o.base_fraction,
                                .percentiles = *percentiles};
  const double duration_s = run->duration_s;
  loadgen::BenchReport report = loadgen::make_report(std::move(settings), std::move(run->outcomes), duration_s, planned);
  std::cout << loadgen::format_report(report) << std::flush;

  std::string json_path = o.result_json;
  if (json_path.empty() && !o.plot.empty())
    json_path = (std::filesystem::temp_directory_path() / ("loramux_bench_" + std::to_string(getpid()) + ".json")).string();
  if (!json_path.empty()) {
    std::ofstream out(json_path);
    out << loadgen::report_json(report, o.save_detailed).dump(2) << "\n";
    if (!out) return fail(io_error("--result-json: cannot write '" + json_path + "'"));
    out.close();
    if (!o.result_json.empty()) std::cout << "result JSON: " << json_path << "\n";
  }
  if (!o.plot.empty()) {
    Status plotted = draw_plot(json_path, o.plot);
    if (o.result_json.empty()) std::filesystem::remove(json_path);
    if (!plotted.ok()) return fail(plotted);
    std::cout << "plot: " << o.plot << "\n";
  }
  // Failed requests are in the report; the exit status says whether every request succeeded.
  return report.overall.failed == 0 ? 0 : 3;
}

}  // namespace

std::function<int()> add_bench_command(CLI::App& app) {
  auto o = std::make_shared<BenchServeOptions>();
  if (const char* key = std::getenv("OPENAI_API_KEY")) o->api_key = key;
  CLI::App* bench = app.add_subcommand("bench", "Benchmarks against a running server");
  bench->require_subcommand(1);
  CLI::App* cmd = bench->add_subcommand("serve", "Serving benchmark against any OpenAI-compatible server (vLLM bench serve's flags and report)");
  cmd->add_option("--base-url", o->base_url, "Server URL, http://host:port (overrides --host/--port)");
  cmd->add_option("--host", o->host, "Server host")->capture_default_str();
  cmd->add_option("--port", o->port, "Server port")->capture_default_str();
  cmd->add_option("--endpoint", o->endpoint, "/v1/completions or /v1/chat/completions")->capture_default_str();
  cmd->add_option("--model", o->model, "Base model name sent in `model` (default: the first base model of /v1/models)");
  cmd->add_option("--tokenizer", o->tokenizer, "Directory with the served model's tokenizer.json (needed by sonnet)");
  cmd->add_option("--api-key", o->api_key, "Bearer token (default: $OPENAI_API_KEY)");
  cmd->add_option("--dataset-name", o->dataset_name, "sonnet, random or jsonl")->capture_default_str();
  cmd->add_option("--dataset-path", o->dataset_path, "sonnet: the sonnet text (default ../shared/data/sonnet.txt); jsonl: the file");
  cmd->add_option("--input-len", o->input_len, "Prompt tokens (sonnet: at most, filled to it; random: exactly)")->capture_default_str();
  cmd->add_option("--output-len", o->output_len, "max_tokens of each request (jsonl: unless the line sets output_len)")->capture_default_str();
  cmd->add_option("--sonnet-prefix-len", o->sonnet_prefix_len, "Tokens of leading sonnet lines shared by all prompts (vLLM's default is 200)")->capture_default_str();
  cmd->add_option("--random-range-ratio", o->random_range_ratio, "random: lengths uniform in [L(1-r), L(1+r)]")->capture_default_str();
  cmd->add_option("--random-vocab-size", o->random_vocab_size, "random: ids drawn from [0, V) (default: the tokenizer's, else 256)");
  cmd->add_option("--num-prompts", o->num_prompts, "Timed requests")->capture_default_str();
  cmd->add_option("--num-warmups", o->num_warmups, "Warm-up requests sent first, excluded from the figures")->capture_default_str();
  cmd->add_option("--request-rate", o->request_rate, "Requests/s (Poisson arrivals) or inf (all at once)")->capture_default_str();
  cmd->add_option("--max-concurrency", o->max_concurrency, "Requests in flight at most (0 = unbounded)")->capture_default_str();
  cmd->add_option("--seed", o->seed, "Seed of the dataset, adapter assignment and arrivals")->capture_default_str();
  cmd->add_flag("--ignore-eos", o->ignore_eos, "Send ignore_eos so every request generates exactly its max_tokens");
  cmd->add_option("--temperature", o->temperature, "Sampling temperature sent (0 = greedy)")->capture_default_str();
  cmd->add_option("--lora-modules", o->lora_modules, "Adapter names to send as `model`");
  cmd->add_option("--lora-assignment", o->lora_assignment, "round-robin, random or zipf:S")->capture_default_str();
  cmd->add_option("--base-fraction", o->base_fraction, "Share of requests sent to the base model, in [0, 1]")->capture_default_str();
  cmd->add_option("--metric-percentiles", o->metric_percentiles, "Percentiles reported, comma-separated")->capture_default_str();
  cmd->add_option("--result-json", o->result_json, "Write the result JSON here");
  cmd->add_flag("--save-detailed", o->save_detailed, "Add per-request arrays (input_lens, output_lens, ttfts, itls, errors) to the JSON");
  cmd->add_option("--plot", o->plot, "Draw latency percentiles and throughput per adapter into this PNG (tools/plot_bench.py)");
  cmd->add_option("--request-timeout", o->request_timeout_s, "Seconds without a byte before a request fails")->capture_default_str();
  cmd->add_flag("--disable-tqdm,--no-progress", o->disable_progress, "No progress bar");
  return [o, cmd]() { return cmd->parsed() ? run_bench_serve(*o) : 0; };
}

}  // namespace lmx::apps
