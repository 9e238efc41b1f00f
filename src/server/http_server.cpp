// HTTP sessions, routing and the OpenAI endpoints (see http_server.h). Each session runs on its strand:
// read a request → route → either answer at once, or submit to the engine loop and write what its sink
// posts back (SSE chunks, or one JSON body at the end) → read the next request (keep-alive).
// While a generation runs the session waits for the socket to become readable: a peer that closed
// (readable with nothing to read) has gone, and its request is cancelled so its pages and slot free now.
#include "server/http_server.h"

#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <ctime>
#include <deque>

#include "core/log.h"
#include "core/rng.h"
#include "server/adapter_paths.h"

namespace lmx::server {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;
using nlohmann::json;

struct HttpServer::Shared {
  ServerOptions options;
  Metrics& metrics;
  // Written once by set_ready before `ready` is released; sessions read them only after seeing it.
  ModelInfo model;
  EngineLoop* loop = nullptr;
  lora::BaseModelShapes adapter_shapes;
  lora::AdapterLimits adapter_limits;
  const TextCodec* text = nullptr;
  std::atomic<bool> ready{false};
  std::atomic<int> in_flight{0};     // admitted generation requests not yet answered
  std::atomic<bool> draining{false};
  std::atomic<uint64_t> next_id{0};
  uint64_t id_salt = 0;
  net::thread_pool blocking{1};      // adapter loads from disk: off the io thread and the engine thread

  bool admit() {
    int limit = options.max_pending_requests;
    if (in_flight.fetch_add(1) >= limit) {
      in_flight.fetch_sub(1);
      return false;
    }
    return true;
  }
  std::string new_id(const char* prefix) {
    char buf[17];
    std::snprintf(buf, sizeof buf, "%016llx", (unsigned long long)mix64(id_salt ^ next_id.fetch_add(1)));
    return std::string(prefix) + buf;
  }
};

namespace {

std::string status_line(int status) {
  return "HTTP/1.1 " + std::to_string(status) + " " + std::string(http::obsolete_reason(http::int_to_status(unsigned(status)))) + "\r\n";
}

std::string chunk(const std::string& data) {
  char size[20];
  std::snprintf(size, sizeof size, "%zx\r\n", data.size());
  return size + data + "\r\n";
}

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, std::shared_ptr<HttpServer> server)
      : stream_(std::move(socket)), server_(std::move(server)), s_(server_->shared()) {}
  ~Session() { release_admission(); }

  void start() {
    net::dispatch(stream_.get_executor(), [self = shared_from_this()] { self->read_request(); });
  }

 private:
  // ---- reading and writing -------------------------------------------------------------------------
  void read_request() {
    parser_.emplace();
    parser_->body_limit(s_.options.max_body_bytes);
    parser_->header_limit(64 * 1024);
    stream_.expires_after(std::chrono::seconds(s_.options.idle_timeout_s));
    http::async_read(stream_, buffer_, *parser_,
                     [self = shared_from_this()](beast::error_code ec, size_t) { self->on_read(ec); });
  }

  void on_read(beast::error_code ec) {
    if (ec == http::error::end_of_stream || ec == net::error::eof || ec == beast::error::timeout ||
        ec == net::error::operation_aborted || ec == net::error::connection_reset) {
      return close();
    }
    keep_alive_ = false;  // after a malformed request the stream position is unknown
    if (ec == http::error::body_limit)
      return respond_error({413, "request body larger than " + std::to_string(s_.options.max_body_bytes) + " bytes", ""});
    if (ec == http::error::header_limit) return respond_error({431, "request headers too large", ""});
    if (ec) return respond_error(bad_request("malformed HTTP request: " + ec.message()));
    http::request<http::string_body> req = parser_->release();
    keep_alive_ = req.keep_alive();
    route(req);
  }

  // Queue bytes for the socket; writes go out one at a time, in order.
  void enqueue(std::string bytes) {
    out_.push_back(std::move(bytes));
    if (!writing_) write_next();
  }

  void write_next() {
    if (closed_) return;
    if (out_.empty()) {
      writing_ = false;
      if (exchange_done_) after_exchange();
      return;
    }
    writing_ = true;
    stream_.expires_after(std::chrono::seconds(s_.options.write_timeout_s));
    net::async_write(stream_, net::buffer(out_.front()), [self = shared_from_this()](beast::error_code ec, size_t) {
      if (ec) return self->close();
      self->out_.pop_front();
      self->write_next();
    });
  }

  // The response is fully written: next request, or close.
  void after_exchange() {
    exchange_done_ = false;
    release_admission();
    if (!keep_alive_ || s_.draining) return close();
    beast::error_code ignored;
    stream_.socket().cancel(ignored);  // the disconnect watch, if any (no write is pending here)
    read_request();
  }

  void close() {
    if (closed_) return;
    closed_ = true;
    cancel_generation();
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.socket().close(ignored);
  }

  // ---- plain responses ---------------------------------------------------------------------------
  void respond(int status, const std::string& content_type, const std::string& body) {
    s_.metrics.record_response(status);
    std::string head = status_line(status);
    head += "Server: loramux\r\nContent-Type: " + content_type + "\r\nContent-Length: " + std::to_string(body.size()) + "\r\n";
    head += keep_alive_ ? "Connection: keep-alive\r\n" : "Connection: close\r\n";
    if (status == 401) head += "WWW-Authenticate: Bearer\r\n";
    exchange_done_ = true;
    enqueue(head + "\r\n" + body);
  }
  void respond_json(int status, const json& body) { respond(status, "application/json", dump_json(body)); }
  void respond_error(const ApiError& e) {
    if (e.status == 413 || e.status == 431) keep_alive_ = false;  // the rest of the body was not read
    respond_json(e.status, error_json(e));
  }

  // ---- routing -----------------------------------------------------------------------------------
  void route(const http::request<http::string_body>& req) {
    std::string target(req.target());
    if (size_t q = target.find('?'); q != std::string::npos) target.resize(q);
    const bool get = req.method() == http::verb::get, post = req.method() == http::verb::post;
    if (s_.draining) {
      keep_alive_ = false;
      return respond_error({503, "the server is shutting down", ""});
    }
    if (target.rfind("/v1/", 0) == 0 && !s_.options.api_key.empty()) {
      auto auth = req.find(http::field::authorization);
      if (auth == req.end() || auth->value() != "Bearer " + s_.options.api_key)
        return respond_error({401, "invalid or missing API key (Authorization: Bearer KEY)", ""});
    }
    auto method_not_allowed = [&] { respond_error({405, "method " + std::string(req.method_string()) + " not allowed on " + target, ""}); };
    const bool ready = s_.ready.load(std::memory_order_acquire);
    if (target == "/metrics")
      return get ? respond(200, "text/plain; version=0.0.4", s_.metrics.render(ready ? s_.loop->snapshot() : EngineSnapshot{}))
                 : method_not_allowed();
    if (!ready && (target == "/health" || target.rfind("/v1/", 0) == 0))
      return respond_error({503, "model is loading; retry shortly", ""});
    if (target == "/health") return get ? respond(200, "text/plain", "") : method_not_allowed();
    if (target == "/v1/models") return get ? list_models() : method_not_allowed();
    if (target == "/v1/completions") return post ? generate(req.body(), Endpoint::kCompletions) : method_not_allowed();
    if (target == "/v1/chat/completions") return post ? generate(req.body(), Endpoint::kChat) : method_not_allowed();
    if (target == "/v1/load_lora_adapter") return post ? load_adapter(req.body()) : method_not_allowed();
    if (target == "/v1/unload_lora_adapter") return post ? unload_adapter(req.body()) : method_not_allowed();
    respond_error({404, "no route for " + target, ""});
  }

  void list_models() {
    int64_t now = int64_t(std::time(nullptr));
    const std::string& base = s_.model.served_name;
    json data = json::array();
    data.push_back({{"id", base}, {"object", "model"}, {"created", now}, {"owned_by", "loramux"}, {"root", base},
                    {"parent", nullptr}, {"max_model_len", s_.model.max_model_len}});
    for (const std::string& name : s_.loop->adapter_names())
      data.push_back({{"id", name}, {"object", "model"}, {"created", now}, {"owned_by", "loramux"}, {"root", name},
                      {"parent", base}});
    respond_json(200, {{"object", "list"}, {"data", data}});
  }

  // ---- adapters ----------------------------------------------------------------------------------
  void load_adapter(const std::string& body) {
    AdapterRequest a;
    if (auto e = parse_adapter_request(body, true, s_.model, &a)) return respond_error(*e);
    if (s_.options.lora_dir.empty())
      return respond_error({403, "runtime adapter loading is disabled; start the server with --lora-dir ROOT", ""});
    Result<std::string> dir = resolve_adapter_dir(s_.options.lora_dir, a.path);
    if (!dir.ok()) return respond_error({dir.status().code() == StatusCode::kNotFound ? 404 : 400, dir.status().message(), "lora_path"});
    if (s_.loop->has_adapter(a.name)) return respond_error({400, "adapter '" + a.name + "' is already loaded", "lora_name"});
    auto self = shared_from_this();
    auto reply = [self, name = a.name](std::optional<ApiError> e) {
      net::post(self->stream_.get_executor(), [self, name, e] {
        if (e) return self->respond_error(*e);
        self->respond(200, "text/plain", "Success: LoRA adapter '" + name + "' added successfully.");
      });
    };
    net::post(s_.blocking, [self, name = a.name, dir = dir.value(), reply]() mutable {
      Result<lora::Adapter> adapter = lora::load_adapter(dir, name, self->s_.adapter_shapes, self->s_.adapter_limits);
      if (!adapter.ok()) reply(ApiError{400, adapter.status().message(), "lora_path"});
      else self->s_.loop->add_adapter(std::move(adapter).value(), reply);
      // Drop these references on the session's strand, never here: the last one may destroy the server,
      // whose destructor joins this pool.
      auto executor = self->stream_.get_executor();
      net::post(executor, [self = std::move(self), reply = std::move(reply)] {});
    });
  }

  void unload_adapter(const std::string& body) {
    AdapterRequest a;
    if (auto e = parse_adapter_request(body, false, s_.model, &a)) return respond_error(*e);
    auto self = shared_from_this();
    s_.loop->remove_adapter(a.name, [self, name = a.name](std::optional<ApiError> e) {
      net::post(self->stream_.get_executor(), [self, name, e] {
        if (e) return self->respond_error(*e);
        self->respond(200, "text/plain", "Success: LoRA adapter '" + name + "' removed successfully.");
      });
    });
  }

  // ---- generation --------------------------------------------------------------------------------
  void generate(const std::string& body, Endpoint endpoint) {
    GenerateRequest g;
    if (auto e = parse_generate_request(body, endpoint, s_.model, &g)) return respond_error(*e);
    std::string adapter;
    if (!g.model.empty() && g.model != s_.model.served_name) {
      if (!s_.loop->has_adapter(g.model))
        return respond_error({404, "The model `" + g.model + "` does not exist.", "model"});
      adapter = g.model;
    }
    if (g.prompt_ids.empty()) {  // text or chat: the codec exists (parse refused otherwise)
      Result<std::vector<int32_t>> ids =
          endpoint == Endpoint::kChat ? s_.text->render_chat(g.messages) : s_.text->encode(*g.prompt_text);
      if (!ids.ok()) return respond_error(bad_request(ids.status().message(), endpoint == Endpoint::kChat ? "messages" : "prompt"));
      g.prompt_ids = std::move(ids).value();
      if (auto e = finalize_prompt(s_.model, &g)) return respond_error(*e);
    }
    if (!s_.admit())
      return respond_error({429, "the server is at capacity (" + std::to_string(s_.options.max_pending_requests) +
                                     " requests in flight); retry later", ""});
    admitted_ = true;
    gen_ = Generation{};
    gen_.stream = g.stream;
    gen_.include_usage = g.include_usage;
    gen_.logprobs = g.sampling.logprobs;
    gen_.header = {.endpoint = endpoint,
                   .id = s_.new_id(endpoint == Endpoint::kChat ? "chatcmpl-" : "cmpl-"),
                   .created = int64_t(std::time(nullptr)),
                   .model = g.model.empty() ? s_.model.served_name : g.model};
    gen_.usage.prompt_tokens = int(g.prompt_ids.size());
    if (s_.text) gen_.text_stream = s_.text->start(g.stop);
    engine::Request request{.adapter = adapter, .prompt_ids = std::move(g.prompt_ids), .sampling = g.sampling};
    auto self = shared_from_this();
    generating_ = true;
    // Events are tagged with this request's number: after a stop string the engine may still deliver a few
    // tokens before its cancel lands, and they must not reach the next request on this connection.
    const uint64_t request_number = ++request_number_;
    ticket_ = s_.loop->submit(std::move(request), [self, request_number](TokenEvent ev) {
      net::post(self->stream_.get_executor(), [self, request_number, ev = std::move(ev)]() mutable {
        if (request_number == self->request_number_) self->on_tokens(std::move(ev));
      });
    });
    watch_disconnect();
  }

  // Readable with nothing to read = the peer closed. Pipelined bytes stop the watch (they wait in the
  // kernel until the next read).
  void watch_disconnect() {
    uint64_t gen = ++watch_generation_;
    stream_.socket().async_wait(tcp::socket::wait_read, [self = shared_from_this(), gen](beast::error_code ec) {
      if (gen != self->watch_generation_ || !self->generating_ || ec == net::error::operation_aborted) return;
      beast::error_code avail_ec;
      size_t available = self->stream_.socket().available(avail_ec);
      if (ec || avail_ec || available == 0) self->close();
    });
  }

  void cancel_generation() {
    if (generating_) s_.loop->cancel(ticket_);
    generating_ = false;
    release_admission();
  }

  void release_admission() {
    if (admitted_) {
      admitted_ = false;
      s_.in_flight.fetch_sub(1);
    }
  }

  void on_tokens(TokenEvent ev) {
    if (!generating_ || closed_) return;
    if (ev.error) {
      generating_ = false;
      if (!gen_.sse_started) return respond_error(*ev.error);
      exchange_done_ = true;
      enqueue(chunk(sse_event(error_json(*ev.error))) + chunk("data: [DONE]\n\n") + "0\r\n\r\n");
      return;
    }
    std::string text;
    engine::FinishReason finish = ev.finish;
    std::vector<TokenLogprobView> logprobs;  // of this event's tokens
    for (size_t k = 0; k < ev.tokens.size(); ++k) {
      const int32_t t = ev.tokens[k];
      gen_.token_ids.push_back(t);
      if (gen_.logprobs >= 0 && k < ev.logprobs.size())
        logprobs.push_back(logprob_view(t, ev.logprobs[k], gen_.text_chars + utf8_chars(text)));
      if (gen_.text_stream) text += gen_.text_stream->add(t);
    }
    gen_.usage.completion_tokens = ev.completion_tokens;
    if (gen_.text_stream && gen_.text_stream->stopped()) {
      // A stop string matched (possibly on the last token, which would otherwise say "length"): the text
      // ends before it, and the engine need not generate further.
      if (!ev.finished) s_.loop->cancel(ticket_, engine::FinishReason::kStop);
      ev.finished = true;
      finish = engine::FinishReason::kStop;
    } else if (gen_.text_stream && ev.finished) {
      text += gen_.text_stream->flush();
    }
    gen_.text += text;
    gen_.text_chars += utf8_chars(text);
    if (ev.finished) generating_ = false;  // the admission is released once the response is written
    if (!gen_.stream) {
      gen_.logprobs_so_far.insert(gen_.logprobs_so_far.end(), logprobs.begin(), logprobs.end());
      if (ev.finished)
        respond_json(200, full_response(gen_.header, gen_.text, gen_.token_ids, finish, gen_.usage,
                                        gen_.logprobs >= 0 ? logprobs_json(gen_.header.endpoint, gen_.logprobs_so_far) : json()));
      return;
    }
    std::string bytes;
    if (!gen_.sse_started) {
      gen_.sse_started = true;
      s_.metrics.record_response(200);
      bytes = status_line(200) +
              "Server: loramux\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
              "Transfer-Encoding: chunked\r\n" +
              (keep_alive_ ? "Connection: keep-alive\r\n" : "Connection: close\r\n") + "\r\n";
    }
    bytes += chunk(sse_event(stream_chunk(gen_.header, text, ev.tokens, ev.finished ? finish : engine::FinishReason::kNone,
                                          gen_.include_usage, gen_.first_chunk,
                                          gen_.logprobs >= 0 ? logprobs_json(gen_.header.endpoint, logprobs) : json())));
    gen_.first_chunk = false;
    if (ev.finished) {
      if (gen_.include_usage) bytes += chunk(sse_event(usage_chunk(gen_.header, gen_.usage)));
      bytes += chunk("data: [DONE]\n\n") + "0\r\n\r\n";
      exchange_done_ = true;
    }
    enqueue(std::move(bytes));
  }

  // One generated token's logprobs with the token texts resolved (the tokenizer's bytes, or "token_id:ID").
  TokenLogprobView logprob_view(int32_t token, const engine::TokenLogprobs& lp, int text_offset) const {
    auto text_of = [&](int32_t id) { return s_.text ? s_.text->token_text(id) : "token_id:" + std::to_string(id); };
    TokenLogprobView view{.sampled = {text_of(token), lp.logprob}, .text_offset = text_offset};
    for (size_t i = 0; i < lp.top_ids.size() && i < lp.top_logprobs.size(); ++i)
      view.top.push_back({text_of(lp.top_ids[i]), lp.top_logprobs[i]});
    return view;
  }

  // Code points in UTF-8 text (text_offset counts characters, as Python's len() does for vLLM).
  static int utf8_chars(const std::string& text) {
    int n = 0;
    for (unsigned char c : text) n += (c & 0xC0) != 0x80;
    return n;
  }

  struct Generation {
    bool stream = false, include_usage = false, sse_started = false, first_chunk = true;
    int logprobs = -1;                                // top-N width; -1 = no logprobs in the response
    std::vector<TokenLogprobView> logprobs_so_far;    // non-streamed responses gather them here
    int text_chars = 0;                               // code points in `text`
    ResponseHeader header;
    Usage usage;
    std::vector<int32_t> token_ids;
    std::string text;
    std::unique_ptr<TextCodec::Stream> text_stream;
  };

  beast::tcp_stream stream_;
  std::shared_ptr<HttpServer> server_;
  HttpServer::Shared& s_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  std::deque<std::string> out_;
  bool writing_ = false;
  bool exchange_done_ = false;  // the last bytes of the response are queued
  bool keep_alive_ = true;
  bool closed_ = false;
  bool generating_ = false;     // a request of this session is in the engine loop
  bool admitted_ = false;       // holds one of max_pending_requests
  uint64_t ticket_ = 0;
  uint64_t watch_generation_ = 0;
  uint64_t request_number_ = 0;  // generation requests started on this connection
  Generation gen_;
};

}  // namespace

HttpServer::HttpServer(net::io_context& ioc, ServerOptions options, Metrics& metrics)
    : ioc_(ioc), acceptor_(net::make_strand(ioc)), drain_timer_(ioc),
      shared_(new Shared{.options = std::move(options), .metrics = metrics}) {
  shared_->id_salt = uint64_t(std::chrono::steady_clock::now().time_since_epoch().count());
}

void HttpServer::set_ready(Serving serving) {
  LMX_CHECK(!shared_->ready.load() && serving.loop != nullptr);
  shared_->model = std::move(serving.model);
  shared_->loop = serving.loop;
  shared_->adapter_shapes = std::move(serving.adapter_shapes);
  shared_->adapter_limits = serving.adapter_limits;
  shared_->text = serving.text;
  shared_->ready.store(true, std::memory_order_release);
}

bool HttpServer::ready() const { return shared_->ready.load(std::memory_order_acquire); }

HttpServer::~HttpServer() { shared_->blocking.join(); }

Status HttpServer::listen() {
  const ServerOptions& o = shared_->options;
  beast::error_code ec;
  net::ip::address address = net::ip::make_address(o.host, ec);
  if (ec) return invalid_argument("--host '" + o.host + "' is not an IP address: " + ec.message());
  if (o.port < 0 || o.port > 65535) return invalid_argument("--port " + std::to_string(o.port) + " is out of range");
  tcp::endpoint endpoint(address, uint16_t(o.port));
  acceptor_.open(endpoint.protocol(), ec);
  if (!ec) acceptor_.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) acceptor_.bind(endpoint, ec);
  if (!ec) acceptor_.listen(o.backlog, ec);
  if (ec) return io_error("cannot listen on " + o.host + ":" + std::to_string(o.port) + ": " + ec.message());
  bound_port_ = acceptor_.local_endpoint().port();
  accept();
  return Status::Ok();
}

void HttpServer::accept() {
  acceptor_.async_accept(net::make_strand(ioc_), [self = shared_from_this()](beast::error_code ec, tcp::socket socket) {
    if (!self->acceptor_.is_open()) return;  // draining
    if (!ec) {
      socket.set_option(tcp::no_delay(true), ec);
      std::make_shared<Session>(std::move(socket), self)->start();
    }
    self->accept();
  });
}

void HttpServer::drain(std::function<void()> drained) {
  shared_->draining = true;
  net::post(acceptor_.get_executor(), [self = shared_from_this(), drained = std::move(drained)] {
    beast::error_code ignored;
    self->acceptor_.close(ignored);
    self->poll_drained(drained);
  });
}

void HttpServer::poll_drained(std::function<void()> drained) {
  if (shared_->in_flight == 0) return drained();
  drain_timer_.expires_after(std::chrono::milliseconds(20));
  drain_timer_.async_wait([self = shared_from_this(), drained](beast::error_code) { self->poll_drained(drained); });
}

}  // namespace lmx::server
