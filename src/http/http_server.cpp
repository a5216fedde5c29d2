// The OpenAI-compatible HTTP endpoint (spillway/http/http_server.hpp, Note [HTTP endpoints]): the
// server bound, run, drained and stopped. Its protocol is http_protocol.cpp's, its routes and
// handlers http_routes.cpp's, its streamed answers http_streaming.cpp's.
#include "spillway/http/http_server.hpp"

#include <fmt/format.h>
#include <httplib.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <mutex>

#include "http/http_server_impl.hpp"
#include "spillway/core/error.hpp"

namespace spillway::http {

using namespace detail;  // the pieces of http_server_impl.hpp

HttpServer::HttpServer(inference::ServingEngine& engine, const HttpOptions& options)
    : impl_(std::make_unique<Impl>(engine, options)) {
  Impl& m = *impl_;
  // A client gone mid-response must be a failed write (the request is cancelled), not a
  // SIGPIPE that ends the process: the library's sends do not ask for MSG_NOSIGNAL.
  ::signal(SIGPIPE, SIG_IGN);
  if (options.port < 0 || options.port > 65535)
    SPILLWAY_FIELD_ERROR("port", options.port, "must be in [0, 65535]");
  int threads = options.threads;
  if (threads <= 0)
    threads = engine.slices() * engine.options().max_running + engine.options().max_waiting + 8;
  m.svr.new_task_queue = [threads] {
    return new httplib::ThreadPool(static_cast<size_t>(threads));
  };
  m.svr.set_payload_max_length(kMaxBody);
  m.svr.set_keep_alive_timeout(2);
  m.routes();
  if (options.port == 0) {
    m.port = m.svr.bind_to_any_port(options.host);
    if (m.port < 0) SPILLWAY_INPUT_ERROR("cannot bind {} to any port", options.host);
  } else {
    if (!m.svr.bind_to_port(options.host, options.port))
      SPILLWAY_INPUT_ERROR("cannot listen on {}:{}: {}", options.host, options.port,
                           bind_error(options.host, options.port));
    m.port = options.port;
  }
  m.svr.deepen_backlog();
}

HttpServer::~HttpServer() {
  stop();
}

int HttpServer::port() const {
  return impl_->port;
}

void HttpServer::run() {
  Impl& m = *impl_;
  {
    std::lock_guard lk(m.run_mu);
    if (m.stop_requested) return;  // stopped before it ran
    m.run_done = false;
  }
  m.svr.listen_after_bind();
  {
    std::lock_guard lk(m.run_mu);
    m.run_done = true;
  }
  m.run_cv.notify_all();
}

int64_t HttpServer::shutdown() {
  Impl& m = *impl_;
  const int64_t drained = m.engine.in_flight();
  m.engine.drain();
  {
    std::unique_lock lk(m.mu);
    m.cv.wait_for(lk, std::chrono::seconds(30), [&] { return m.writing == 0; });
  }
  stop();
  return drained;
}

HttpServer::DrainReport HttpServer::shutdown(std::chrono::milliseconds deadline) {
  Impl& m = *impl_;
  DrainReport r;
  const auto until = std::chrono::steady_clock::now() + deadline;
  r.in_flight = m.engine.in_flight();
  if (!m.engine.drain_for(deadline)) {
    r.cut = m.engine.cancel_all(fmt::format(
        "cancelled: the server shut down and its drain deadline ({} ms) passed", deadline.count()));
    m.engine.drain_for(std::chrono::seconds(5));
  }
  {
    std::unique_lock lk(m.mu);
    m.cv.wait_until(lk, std::max(until, std::chrono::steady_clock::now() + std::chrono::seconds(1)),
                    [&] { return m.writing == 0; });
  }
  stop();
  return r;
}

void HttpServer::stop() {
  Impl& m = *impl_;
  std::unique_lock lk(m.run_mu);
  m.stop_requested = true;
  // httplib's stop() does nothing until its loop runs: repeat it until run() has returned.
  while (!m.run_done) {
    m.svr.stop();
    m.run_cv.wait_for(lk, std::chrono::milliseconds(10));
  }
}

}  // namespace spillway::http
