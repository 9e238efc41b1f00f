// The asynchronous client against a scripted local HTTP server (plain blocking asio, one thread per
// connection): chunk timing and token counts, SSE split across any TCP writes, HTTP errors, error events,
// truncated streams, a non-SSE reply, refused connections, the concurrency limit and the retry of a
// kept-alive connection the server closed. Each request's `model` picks the server's script.
#include <utility>  // before asio (Boost 1.74 awaitable.hpp needs std::exchange)
#include <gtest/gtest.h>

#include <atomic>
#include <boost/asio.hpp>
#include <chrono>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "loadgen/client.h"

namespace lmx::loadgen {
namespace {

namespace net = boost::asio;
using tcp = net::ip::tcp;

std::string http_chunk(const std::string& bytes) {
  char size[32];
  std::snprintf(size, sizeof(size), "%zx\r\n", bytes.size());
  return size + bytes + "\r\n";
}
std::string sse(const std::string& json) { return "data: " + json + "\n\n"; }
std::string token_chunk(const std::string& ids) {
  return sse(R"({"choices":[{"index":0,"text":"","token_ids":)" + ids + R"(,"finish_reason":null}],"usage":null})");
}
const char* kSseHead = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\nConnection: keep-alive\r\n\r\n";

class ScriptedServer {
 public:
  ScriptedServer() : acceptor_(ioc_, tcp::endpoint(net::ip::make_address("127.0.0.1"), 0)) {
    port_ = acceptor_.local_endpoint().port();
    accept_thread_ = std::thread([this] { accept_loop(); });
  }
  ~ScriptedServer() {
    stopping_ = true;
    boost::system::error_code ec;
    acceptor_.close(ec);
    // Wake the blocked accept with a connection of our own.
    tcp::socket poke(ioc_);
    poke.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), port_), ec);
    accept_thread_.join();
    for (std::thread& t : connection_threads_) t.join();
  }
  int port() const { return port_; }
  int max_active() const { return max_active_; }
  int connections() const { return connections_; }

 private:
  void accept_loop() {
    while (!stopping_) {
      auto socket = std::make_shared<tcp::socket>(ioc_);
      boost::system::error_code ec;
      acceptor_.accept(*socket, ec);
      if (ec || stopping_) return;
      ++connections_;
      std::lock_guard<std::mutex> lock(mutex_);
      connection_threads_.emplace_back([this, socket] { serve(*socket); });
    }
  }

  // Reads requests (head + Content-Length body) and answers each by its model's script.
  void serve(tcp::socket& socket) {
    std::string buffer;
    for (;;) {
      size_t head_end;
      while ((head_end = buffer.find("\r\n\r\n")) == std::string::npos)
        if (!read_more(socket, &buffer)) return;
      const std::string head = buffer.substr(0, head_end);
      size_t length = 0;
      if (size_t at = head.find("Content-Length: "); at != std::string::npos) length = std::stoul(head.substr(at + 16));
      while (buffer.size() < head_end + 4 + length)
        if (!read_more(socket, &buffer)) return;
      const nlohmann::json body = nlohmann::json::parse(buffer.substr(head_end + 4, length));
      buffer.erase(0, head_end + 4 + length);
      const int now_active = ++active_;
      for (int seen = max_active_; now_active > seen && !max_active_.compare_exchange_weak(seen, now_active);) {
      }
      const bool keep = respond(socket, body["model"].get<std::string>());
      --active_;
      if (!keep) return;
    }
  }

  static bool read_more(tcp::socket& socket, std::string* buffer) {
    char data[4096];
    boost::system::error_code ec;
    const size_t n = socket.read_some(net::buffer(data), ec);
    if (ec) return false;
    buffer->append(data, n);
    return true;
  }
  static void send(tcp::socket& socket, const std::string& bytes) {
    boost::system::error_code ec;
    net::write(socket, net::buffer(bytes), ec);
  }
  static void pause_ms(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

  // Returns whether the connection stays open for the next request.
  bool respond(tcp::socket& socket, const std::string& script) {
    const std::string usage = sse(R"({"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}})");
    if (script == "ok" || script == "ok-then-close") {
      send(socket, kSseHead);
      for (const char* ids : {"[11]", "[12,13]", "[14]"}) {
        pause_ms(20);
        send(socket, http_chunk(token_chunk(ids)));
      }
      send(socket, http_chunk(usage + sse("[DONE]")) + "0\r\n\r\n");
      return script == "ok";  // ok-then-close: the server drops the kept-alive connection afterwards
    }
    if (script == "split") {  // the same events cut into 1-3 byte HTTP chunks, each its own write
      std::string events = token_chunk("[11]") + token_chunk("[12,13]") + token_chunk("[14]") + usage + sse("[DONE]");
      send(socket, kSseHead);
      for (size_t at = 0; at < events.size(); at += 1 + at % 3) send(socket, http_chunk(events.substr(at, 1 + at % 3)));
      send(socket, "0\r\n\r\n");
      return true;
    }
    if (script == "text-only") {  // no token ids, no usage: one token per chunk
      send(socket, kSseHead);
      for (const char* text : {"Shall", " I", " compare"})
        send(socket, http_chunk(sse(std::string(R"({"choices":[{"index":0,"text":")") + text + R"("}]})")));
      send(socket, http_chunk(sse("[DONE]")) + "0\r\n\r\n");
      return true;
    }
    if (script == "http-500") {
      const std::string body = R"({"error":{"message":"boom","type":"server_error","param":null,"code":500}})";
      send(socket, "HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\nContent-Length: " +
                       std::to_string(body.size()) + "\r\n\r\n" + body);
      return true;
    }
    if (script == "error-event") {
      send(socket, kSseHead);
      send(socket, http_chunk(token_chunk("[11]") + sse(R"({"error":{"message":"evicted","code":500}})") + sse("[DONE]")) +
                       "0\r\n\r\n");
      return true;
    }
    if (script == "no-done") {
      send(socket, kSseHead);
      send(socket, http_chunk(token_chunk("[11]")) + "0\r\n\r\n");
      return true;
    }
    if (script == "json") {
      send(socket, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}");
      return true;
    }
    return false;
  }

  net::io_context ioc_;
  tcp::acceptor acceptor_;
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::atomic<int> active_{0}, max_active_{0}, connections_{0};
  std::mutex mutex_;
  std::thread accept_thread_;
  std::vector<std::thread> connection_threads_;
};

std::vector<PlannedRequest> plan_of(const std::vector<std::string>& scripts, const BenchPrompt& prompt) {
  std::vector<PlannedRequest> plan;
  for (const std::string& s : scripts) plan.push_back({.prompt = &prompt, .model = s});
  return plan;
}

TEST(LoadgenClient, TimesChunksCountsTokensAndRecordsEveryKindOfFailure) {
  ScriptedServer server;
  const BenchPrompt prompt{.prompt_ids = {1, 2, 3}, .uses_ids = true, .input_len = 3, .output_len = 4};
  const ClientOptions options{.port = server.port(), .request_timeout_s = 10};
  const std::vector<std::string> scripts = {"ok", "split", "text-only", "http-500", "error-event", "no-done", "json"};
  int progress_calls = 0;
  Result<RunResult> run = run_requests(options, plan_of(scripts, prompt), nullptr, [&](int done, int total) {
    EXPECT_EQ(total, int(scripts.size()));
    EXPECT_EQ(done, ++progress_calls);
  });
  ASSERT_TRUE(run.ok()) << run.status().message();
  ASSERT_EQ(run->outcomes.size(), scripts.size());
  const std::vector<RequestOutcome>& o = run->outcomes;

  ASSERT_TRUE(o[0].success) << o[0].error;
  EXPECT_EQ(o[0].target, "ok");
  EXPECT_EQ(o[0].output_tokens, 4);  // usage
  EXPECT_EQ(o[0].prompt_len, 3);
  EXPECT_EQ(o[0].chunk_tokens, (std::vector<int>{1, 2, 1}));
  ASSERT_EQ(o[0].chunk_times_s.size(), 3u);
  // The server sleeps 20 ms before each chunk: bounds that hold however late the client reads (a single
  // gap may shrink when a descheduled client reads two chunks at once, so gaps are not checked one by one).
  EXPECT_GE(o[0].ttft_s(), 0.019);
  EXPECT_GE(o[0].latency_s(), 0.059);
  EXPECT_LT(o[0].chunk_times_s[0], o[0].chunk_times_s[2]);
  EXPECT_DOUBLE_EQ(o[0].end_s, o[0].chunk_times_s.back());

  ASSERT_TRUE(o[1].success) << o[1].error;
  EXPECT_EQ(o[1].chunk_tokens, (std::vector<int>{1, 2, 1}));
  EXPECT_EQ(o[1].output_tokens, 4);

  ASSERT_TRUE(o[2].success) << o[2].error;
  EXPECT_EQ(o[2].chunk_tokens, (std::vector<int>{1, 1, 1}));
  EXPECT_EQ(o[2].output_tokens, 3);  // no usage, no ids, no tokenizer: one per chunk
  EXPECT_EQ(o[2].prompt_len, 3);     // no usage: the dataset's count

  auto failed_with = [](const RequestOutcome& r, const std::string& text) {
    EXPECT_FALSE(r.success);
    EXPECT_NE(r.error.find(text), std::string::npos) << r.error;
  };
  failed_with(o[3], "HTTP 500: boom");
  failed_with(o[4], "error event in the stream: evicted");
  failed_with(o[5], "without data: [DONE]");
  failed_with(o[6], "text/event-stream");
  EXPECT_GE(run->duration_s, o[0].end_s);
}

TEST(LoadgenClient, KeepsWithinMaxConcurrencyAndRetriesAClosedKeptAliveConnection) {
  ScriptedServer server;
  const BenchPrompt prompt{.prompt_ids = {1}, .uses_ids = true, .input_len = 1, .output_len = 4};
  const ClientOptions limited{.port = server.port(), .max_concurrency = 2, .request_timeout_s = 10};
  Result<RunResult> run = run_requests(limited, plan_of(std::vector<std::string>(6, "ok"), prompt), nullptr, nullptr);
  ASSERT_TRUE(run.ok());
  for (const RequestOutcome& r : run->outcomes) EXPECT_TRUE(r.success) << r.error;
  EXPECT_EQ(server.max_active(), 2);
  EXPECT_EQ(server.connections(), 2);  // kept alive and reused
  const std::vector<double> no_percentiles;
  EXPECT_LE(compute_figures(run->outcomes, run->duration_s, no_percentiles).max_concurrent_requests, 2);

  // One connection at a time; the server closes it after each response, so every later request first
  // fails on the stale connection and is sent again on a new one.
  ScriptedServer closing;
  const ClientOptions one{.port = closing.port(), .max_concurrency = 1, .request_timeout_s = 10};
  Result<RunResult> again = run_requests(one, plan_of(std::vector<std::string>(3, "ok-then-close"), prompt), nullptr, nullptr);
  ASSERT_TRUE(again.ok());
  for (const RequestOutcome& r : again->outcomes) EXPECT_TRUE(r.success) << r.error;
  EXPECT_EQ(closing.connections(), 3);
}

TEST(LoadgenClient, ArrivalTimesAreHonoured) {
  ScriptedServer server;
  const BenchPrompt prompt{.prompt_ids = {1}, .uses_ids = true, .input_len = 1, .output_len = 4};
  std::vector<PlannedRequest> plan = plan_of({"ok", "ok", "ok"}, prompt);
  plan[1].send_at_s = 0.05;
  plan[2].send_at_s = 0.12;
  Result<RunResult> run = run_requests({.port = server.port()}, plan, nullptr, nullptr);
  ASSERT_TRUE(run.ok());
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_TRUE(run->outcomes[i].success);
    EXPECT_GE(run->outcomes[i].start_s, plan[i].send_at_s);
    EXPECT_LT(run->outcomes[i].start_s, plan[i].send_at_s + 0.25);  // generous for a loaded CI machine
  }
}

TEST(LoadgenClient, RefusedConnectionsFailEachRequestAndBadHostsFailTheRun) {
  int free_port;
  {
    net::io_context ioc;
    tcp::acceptor a(ioc, tcp::endpoint(net::ip::make_address("127.0.0.1"), 0));
    free_port = a.local_endpoint().port();
  }  // closed: nothing listens there now
  const BenchPrompt prompt{.prompt_ids = {1}, .uses_ids = true, .input_len = 1, .output_len = 4};
  Result<RunResult> run = run_requests({.port = free_port}, plan_of({"ok", "ok"}, prompt), nullptr, nullptr);
  ASSERT_TRUE(run.ok());
  for (const RequestOutcome& r : run->outcomes) {
    EXPECT_FALSE(r.success);
    EXPECT_NE(r.error.find("connect to 127.0.0.1:" + std::to_string(free_port)), std::string::npos) << r.error;
  }
  Result<RunResult> bad = run_requests({.host = "no-such-host.invalid", .port = 80}, plan_of({"ok"}, prompt), nullptr, nullptr);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("no-such-host.invalid"), std::string::npos);
  Result<std::string> get = http_get({.port = free_port}, "/v1/models", 5);
  ASSERT_FALSE(get.ok());
  EXPECT_NE(get.status().message().find("/v1/models"), std::string::npos);
}

}  // namespace
}  // namespace lmx::loadgen
