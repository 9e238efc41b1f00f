// HttpServer: HTTP/1.1 over Boost.Beast/asio. One acceptor with an explicit backlog; each connection is a
// session on its own strand (no thread per connection or stream); generation requests go to the engine
// loop and their tokens come back onto the session's strand, streamed as SSE or gathered into one JSON
// response. Routes: /v1/completions, /v1/chat/completions, /v1/models, /v1/load_lora_adapter,
// /v1/unload_lora_adapter, /health, /metrics. The port is bound before the model loads: until set_ready,
// /health and every /v1 route answer 503 "model is loading" (/metrics answers). Who calls: apps/serve.cpp.
#pragma once
#include <utility>  // before asio: Boost 1.74's awaitable.hpp uses std::exchange without including it
#include <atomic>
#include <boost/asio.hpp>
#include <functional>
#include <memory>
#include <string>

#include "lora/adapter.h"
#include "server/api.h"
#include "server/engine_loop.h"
#include "server/metrics.h"
#include "server/text.h"

namespace lmx::server {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                      // 0 = any free port (see HttpServer::port)
  int backlog = 1024;                   // listen(2) backlog
  std::string api_key;                  // "" = no key required on /v1/*
  std::string lora_dir;                 // root of runtime adapter loads; "" = runtime loading disabled
  size_t max_body_bytes = 1 << 20;      // larger bodies get 413
  int max_pending_requests = 256;       // generation requests in flight (running + waiting) before 429
  int idle_timeout_s = 60;              // keep-alive idle and header read timeout
  int write_timeout_s = 60;             // a client that reads nothing this long is dropped (its request aborted)
};

// What the server serves once start-up has loaded it; every pointer outlives the server's io thread.
struct Serving {
  ModelInfo model;
  EngineLoop* loop = nullptr;
  lora::BaseModelShapes adapter_shapes;
  lora::AdapterLimits adapter_limits;
  const TextCodec* text = nullptr;  // nullptr: token-id prompts only
};

class HttpServer : public std::enable_shared_from_this<HttpServer> {
 public:
  // Sessions hold the server alive, so it is always created with std::make_shared.
  HttpServer(boost::asio::io_context& ioc, ServerOptions options, Metrics& metrics);
  ~HttpServer();

  Status listen();  // bind, listen(backlog), start accepting (answering 503 until set_ready)
  // The model, tokenizer and start-up adapters are loaded: serve. Call once, from any thread.
  void set_ready(Serving serving);
  bool ready() const;
  int port() const { return bound_port_; }
  // Stop accepting; requests arriving on open connections get 503; `drained` runs (on the io thread) once
  // no generation request is in flight.
  void drain(std::function<void()> drained);

  // Used by sessions (http_server.cpp).
  struct Shared;
  Shared& shared() { return *shared_; }

 private:
  void accept();
  void poll_drained(std::function<void()> drained);

  boost::asio::io_context& ioc_;
  boost::asio::ip::tcp::acceptor acceptor_;
  boost::asio::steady_timer drain_timer_;
  std::unique_ptr<Shared> shared_;
  int bound_port_ = 0;
};

}  // namespace lmx::server
