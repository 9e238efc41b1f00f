// The asynchronous benchmark client (see client.h). One io_context on the calling thread drives every
// request: an arrival timer releases requests into a ready queue, at most max_concurrency run at once,
// each on a kept-alive connection from an idle pool or a new one.
#include <utility>  // before asio (Boost 1.74 awaitable.hpp needs std::exchange)
#include "loadgen/client.h"

#include <array>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <deque>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>

#include "loadgen/sse.h"

namespace lmx::loadgen {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;
using Clock = std::chrono::steady_clock;

bool is_chat_endpoint(const std::string& endpoint) {
  const std::string suffix = "chat/completions";
  return endpoint.size() >= suffix.size() && endpoint.compare(endpoint.size() - suffix.size(), suffix.size(), suffix) == 0;
}

Result<std::string> request_body(const ClientOptions& o, const PlannedRequest& r) {
  const BenchPrompt& p = *r.prompt;
  nlohmann::json body = {{"model", r.model},
                         {"temperature", o.temperature},
                         {"stream", true},
                         {"stream_options", {{"include_usage", true}}}};
  if (is_chat_endpoint(o.endpoint)) {
    if (p.uses_ids)
      return invalid_argument(o.endpoint + " takes text messages, but this dataset's prompts are token ids "
                              "(--dataset-name random, or a JSONL id prompt); use /v1/completions");
    body["messages"] = nlohmann::json::array({{{"role", "user"}, {"content", p.prompt_text}}});
    body["max_completion_tokens"] = p.output_len;
  } else {
    body["prompt"] = p.uses_ids ? nlohmann::json(p.prompt_ids) : nlohmann::json(p.prompt_text);
    body["max_tokens"] = p.output_len;
  }
  if (o.ignore_eos) body["ignore_eos"] = true;
  return body.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

namespace {

std::chrono::steady_clock::duration seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

// The message of an OpenAI error body, else the body's start.
std::string error_message(const std::string& body) {
  const nlohmann::json j = nlohmann::json::parse(body, nullptr, false);
  if (!j.is_discarded() && j.is_object() && j.contains("error")) {
    const nlohmann::json& e = j["error"];
    if (e.is_object() && e.contains("message") && e["message"].is_string()) return e["message"].get<std::string>();
    if (e.is_string()) return e.get<std::string>();
  }
  return body.substr(0, 200);
}

struct Connection {
  explicit Connection(net::io_context& ioc) : stream(ioc) {}
  beast::tcp_stream stream;
  beast::flat_buffer buffer;
};

class Runner;

// One request from send to the end of its response.
class Exchange : public std::enable_shared_from_this<Exchange> {
 public:
  Exchange(Runner& runner, size_t index, std::string body);
  void start();

 private:
  void connect();
  void write();
  void read_header();
  void read_body();
  void on_body_bytes(std::string_view bytes);
  void on_event(const std::string& data);
  void on_message_end();
  // A reused keep-alive connection the server had already closed fails before any response byte; such a
  // request is sent again once, on a new connection.
  void retry_or_fail(const beast::error_code& ec, const char* what);
  void fail(std::string error);
  void succeed();

  Runner& runner_;
  size_t index_;
  std::unique_ptr<Connection> conn_;
  bool reused_ = false;
  bool retried_ = false;
  bool finished_ = false;
  http::request<http::string_body> request_;
  std::optional<http::response_parser<http::buffer_body>> parser_;
  std::array<char, 16384> body_buffer_;
  int status_ = 0;
  std::string error_body_;  // body of a non-200 response (its start)
  SseParser sse_;
  bool saw_done_ = false;
  std::optional<std::string> stream_error_;
  std::optional<int> usage_prompt_, usage_completion_;
  bool all_chunks_had_ids_ = true;
  int id_tokens_ = 0;
  std::string text_;
  RequestOutcome outcome_;
};

class Runner {
 public:
  Runner(const ClientOptions& options, const std::vector<PlannedRequest>& plan, const tokenizer::Tokenizer* tokenizer,
         const std::function<void(int, int)>& on_progress)
      : options(options), plan(plan), tokenizer(tokenizer), on_progress_(on_progress), arrival_timer_(ioc) {}

  Result<RunResult> run() {
    beast::error_code ec;
    tcp::resolver resolver(ioc);
    endpoints = resolver.resolve(options.host, std::to_string(options.port), ec);
    if (ec) return io_error("cannot resolve " + options.host + ":" + std::to_string(options.port) + ": " + ec.message());
    outcomes_.resize(plan.size());
    start_ = Clock::now();
    release_arrivals();
    ioc.run();
    RunResult result{.outcomes = std::move(outcomes_)};
    for (const RequestOutcome& o : result.outcomes) result.duration_s = std::max(result.duration_s, o.end_s);
    return result;
  }

  double now_s() const { return std::chrono::duration<double>(Clock::now() - start_).count(); }

  std::unique_ptr<Connection> take_idle() {
    if (idle_.empty()) return nullptr;
    std::unique_ptr<Connection> c = std::move(idle_.back());
    idle_.pop_back();
    return c;
  }

  void finished(size_t index, RequestOutcome outcome, std::unique_ptr<Connection> reusable) {
    outcomes_[index] = std::move(outcome);
    if (reusable) idle_.push_back(std::move(reusable));
    --in_flight_;
    ++done_;
    if (on_progress_) on_progress_(done_, int(plan.size()));
    dispatch();
  }

  net::io_context ioc{1};
  tcp::resolver::results_type endpoints;
  const ClientOptions& options;
  const std::vector<PlannedRequest>& plan;
  const tokenizer::Tokenizer* tokenizer;

 private:
  // Moves every request whose time has come to the ready queue and waits for the next arrival.
  void release_arrivals() {
    const double now = now_s();
    while (next_arrival_ < plan.size() && plan[next_arrival_].send_at_s <= now) ready_.push_back(next_arrival_++);
    dispatch();
    if (next_arrival_ == plan.size()) return;
    arrival_timer_.expires_at(start_ + seconds(plan[next_arrival_].send_at_s));
    arrival_timer_.async_wait([this](const beast::error_code& ec) {
      if (!ec) release_arrivals();
    });
  }

  void dispatch() {
    while (!ready_.empty() && (options.max_concurrency <= 0 || in_flight_ < options.max_concurrency)) {
      const size_t index = ready_.front();
      ready_.pop_front();
      Result<std::string> body = request_body(options, plan[index]);
      ++in_flight_;
      if (!body.ok()) {  // refused before sending: recorded as this request's failure
        RequestOutcome o{.target = plan[index].model, .is_base = plan[index].is_base, .error = body.status().message(),
                         .expected_output_len = plan[index].prompt->output_len};
        o.start_s = o.end_s = now_s();
        finished(index, std::move(o), nullptr);
        continue;
      }
      std::make_shared<Exchange>(*this, index, std::move(body).value())->start();
    }
  }

  std::function<void(int, int)> on_progress_;
  net::steady_timer arrival_timer_;
  Clock::time_point start_;
  std::vector<RequestOutcome> outcomes_;
  std::vector<std::unique_ptr<Connection>> idle_;
  std::deque<size_t> ready_;
  size_t next_arrival_ = 0;
  int in_flight_ = 0;
  int done_ = 0;
};

Exchange::Exchange(Runner& runner, size_t index, std::string body) : runner_(runner), index_(index) {
  const PlannedRequest& r = runner.plan[index];
  request_ = http::request<http::string_body>(http::verb::post, runner.options.endpoint, 11);
  request_.set(http::field::host, runner.options.host + ":" + std::to_string(runner.options.port));
  request_.set(http::field::content_type, "application/json");
  request_.set(http::field::accept, "text/event-stream");
  request_.set(http::field::user_agent, "loramux-bench");
  if (!runner.options.api_key.empty()) request_.set(http::field::authorization, "Bearer " + runner.options.api_key);
  request_.keep_alive(true);
  request_.body() = std::move(body);
  request_.prepare_payload();
  outcome_.target = r.model;
  outcome_.is_base = r.is_base;
  outcome_.expected_output_len = r.prompt->output_len;
}

void Exchange::start() {
  outcome_.start_s = runner_.now_s();
  conn_ = runner_.take_idle();
  reused_ = conn_ != nullptr;
  if (reused_) return write();
  connect();
}

void Exchange::connect() {
  conn_ = std::make_unique<Connection>(runner_.ioc);
  conn_->stream.expires_after(seconds(runner_.options.request_timeout_s));
  conn_->stream.async_connect(runner_.endpoints, [self = shared_from_this()](const beast::error_code& ec, const tcp::endpoint&) {
    if (ec) return self->fail("connect to " + self->runner_.options.host + ":" + std::to_string(self->runner_.options.port) +
                              ": " + ec.message());
    self->write();
  });
}

void Exchange::write() {
  parser_.emplace();
  // A long stream is fine (the timeout bounds a stuck one). Not boost::none: Boost 1.74 compares a
  // Content-Length against the empty optional and reports body_limit for every sized body.
  parser_->body_limit(std::numeric_limits<std::uint64_t>::max());
  conn_->stream.expires_after(seconds(runner_.options.request_timeout_s));
  http::async_write(conn_->stream, request_, [self = shared_from_this()](const beast::error_code& ec, size_t) {
    if (ec) return self->retry_or_fail(ec, "sending the request");
    self->read_header();
  });
}

void Exchange::read_header() {
  conn_->stream.expires_after(seconds(runner_.options.request_timeout_s));
  http::async_read_header(conn_->stream, conn_->buffer, *parser_, [self = shared_from_this()](const beast::error_code& ec, size_t) {
    if (ec) return self->retry_or_fail(ec, "reading the response header");
    self->status_ = self->parser_->get().result_int();
    const beast::string_view type = self->parser_->get()[http::field::content_type];
    if (self->status_ == 200 && type.find("text/event-stream") == beast::string_view::npos)
      return self->fail("expected a text/event-stream response to a streaming request, found Content-Type '" +
                        std::string(type) + "'");
    if (self->parser_->is_done()) return self->on_message_end();
    self->read_body();
  });
}

// async_read_some returns as soon as some bytes were parsed, so each chunk is timed when it arrives
// (async_read would wait to fill the buffer).
void Exchange::read_body() {
  http::buffer_body::value_type& body = parser_->get().body();
  body.data = body_buffer_.data();
  body.size = body_buffer_.size();
  conn_->stream.expires_after(seconds(runner_.options.request_timeout_s));
  http::async_read_some(conn_->stream, conn_->buffer, *parser_, [self = shared_from_this()](beast::error_code ec, size_t) {
    if (ec == http::error::need_buffer) ec = {};
    if (ec) return self->fail("reading the response: " + ec.message());
    const size_t got = self->body_buffer_.size() - self->parser_->get().body().size;
    self->on_body_bytes(std::string_view(self->body_buffer_.data(), got));
    if (self->finished_) return;
    if (self->parser_->is_done()) return self->on_message_end();
    self->read_body();
  });
}

void Exchange::on_body_bytes(std::string_view bytes) {
  if (bytes.empty()) return;
  if (status_ != 200) {
    if (error_body_.size() < 4096) error_body_.append(bytes.substr(0, 4096 - error_body_.size()));
    return;
  }
  for (const std::string& data : sse_.feed(bytes)) on_event(data);
}

void Exchange::on_event(const std::string& data) {
  if (saw_done_ || stream_error_) return;
  const StreamChunk chunk = parse_stream_chunk(data);
  if (chunk.done) {
    saw_done_ = true;
    return;
  }
  if (chunk.error) {
    stream_error_ = "error event in the stream: " + *chunk.error;
    return;
  }
  if (chunk.has_output) {
    const double now = runner_.now_s();
    outcome_.chunk_times_s.push_back(now);
    outcome_.chunk_tokens.push_back(chunk.tokens);
    outcome_.end_s = now;
    if (chunk.tokens_from_ids) id_tokens_ += chunk.tokens;
    else all_chunks_had_ids_ = false;
    text_ += chunk.text;
  }
  if (chunk.prompt_tokens) usage_prompt_ = chunk.prompt_tokens;
  if (chunk.completion_tokens) usage_completion_ = chunk.completion_tokens;
}

void Exchange::on_message_end() {
  if (status_ != 200) {
    return fail("HTTP " + std::to_string(status_) + ": " + error_message(error_body_));
  }
  if (stream_error_) return fail(*stream_error_);
  if (!saw_done_) return fail("the stream ended without data: [DONE]");
  succeed();
}

void Exchange::retry_or_fail(const beast::error_code& ec, const char* what) {
  if (reused_ && !retried_) {
    retried_ = true;
    reused_ = false;
    conn_.reset();
    return connect();
  }
  fail(std::string(what) + ": " + ec.message());
}

void Exchange::fail(std::string error) {
  if (finished_) return;
  finished_ = true;
  outcome_.success = false;
  outcome_.error = std::move(error);
  outcome_.end_s = runner_.now_s();
  conn_.reset();
  runner_.finished(index_, std::move(outcome_), nullptr);
}

void Exchange::succeed() {
  finished_ = true;
  outcome_.success = true;
  if (outcome_.chunk_times_s.empty()) outcome_.end_s = runner_.now_s();
  const BenchPrompt& prompt = *runner_.plan[index_].prompt;
  outcome_.prompt_len = usage_prompt_ ? *usage_prompt_ : prompt.input_len;
  // Output tokens, best source first: the server's usage, its token ids, our tokenizer, one per chunk.
  if (usage_completion_) outcome_.output_tokens = *usage_completion_;
  else if (all_chunks_had_ids_) outcome_.output_tokens = id_tokens_;
  else if (runner_.tokenizer) outcome_.output_tokens = int(runner_.tokenizer->encode(text_, false).size());
  else outcome_.output_tokens = int(outcome_.chunk_times_s.size());
  std::unique_ptr<Connection> reusable;
  if (parser_->keep_alive()) reusable = std::move(conn_);
  runner_.finished(index_, std::move(outcome_), std::move(reusable));
}

}  // namespace

Result<RunResult> run_requests(const ClientOptions& options, const std::vector<PlannedRequest>& plan,
                               const tokenizer::Tokenizer* tokenizer, const std::function<void(int, int)>& on_progress) {
  for (size_t i = 0; i < plan.size(); ++i) {
    LMX_CHECK(plan[i].prompt != nullptr);
    LMX_CHECK(i == 0 || plan[i].send_at_s >= plan[i - 1].send_at_s);
  }
  Runner runner(options, plan, tokenizer, on_progress);
  return runner.run();
}

Result<std::string> http_get(const ClientOptions& options, const std::string& path, double timeout_s) {
  const std::string url = "http://" + options.host + ":" + std::to_string(options.port) + path;
  net::io_context ioc{1};
  tcp::resolver resolver(ioc);
  beast::error_code ec;
  const tcp::resolver::results_type endpoints = resolver.resolve(options.host, std::to_string(options.port), ec);
  if (ec) return io_error("GET " + url + ": cannot resolve the host: " + ec.message());
  beast::tcp_stream stream(ioc);
  beast::flat_buffer buffer;
  http::request<http::empty_body> request(http::verb::get, path, 11);
  request.set(http::field::host, options.host + ":" + std::to_string(options.port));
  request.set(http::field::user_agent, "loramux-bench");
  if (!options.api_key.empty()) request.set(http::field::authorization, "Bearer " + options.api_key);
  http::response<http::string_body> response;
  std::string error;
  stream.expires_after(seconds(timeout_s));
  stream.async_connect(endpoints, [&](const beast::error_code& ec1, const tcp::endpoint&) {
    if (ec1) {
      error = "connect: " + ec1.message();
      return;
    }
    http::async_write(stream, request, [&](const beast::error_code& ec2, size_t) {
      if (ec2) {
        error = "send: " + ec2.message();
        return;
      }
      http::async_read(stream, buffer, response, [&](const beast::error_code& ec3, size_t) {
        if (ec3) error = "read: " + ec3.message();
      });
    });
  });
  ioc.run();
  if (!error.empty()) return io_error("GET " + url + ": " + error);
  if (response.result_int() != 200)
    return io_error("GET " + url + ": HTTP " + std::to_string(response.result_int()) + ": " + error_message(response.body()));
  return response.body();
}

}  // namespace lmx::loadgen
