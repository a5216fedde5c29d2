// The connection layer under the HTTP endpoint (server/http_connection.hpp, Note
// [Connections], Note [Client gone]).
#include "http/http_connection.hpp"

#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>

namespace spillway::http {
namespace {

thread_local ConnectionStream* current = nullptr;

template <class F>
void address(int sock, F f, std::string& ip, int& port) {
  sockaddr_storage a{};
  socklen_t len = sizeof(a);
  ip.clear();
  port = 0;
  if (f(sock, reinterpret_cast<sockaddr*>(&a), &len) != 0) return;
  std::array<char, NI_MAXHOST> host{};
  std::array<char, NI_MAXSERV> serv{};
  if (::getnameinfo(reinterpret_cast<sockaddr*>(&a), len, host.data(), host.size(), serv.data(),
                    serv.size(), NI_NUMERICHOST | NI_NUMERICSERV) == 0) {
    ip = host.data();
    port = std::atoi(serv.data());
  }
}

}  // namespace

ConnectionStream* current_connection() {
  return current;
}

bool ConnectionStream::poll_for(short events, int timeout_ms) const {
  pollfd p{sock_, events, 0};
  int r = 0;
  do {
    r = ::poll(&p, 1, timeout_ms);
  } while (r < 0 && errno == EINTR);
  return r > 0 && (p.revents & (events | POLLHUP | POLLERR)) != 0;
}

bool ConnectionStream::is_readable() const {
  return buffered() || poll_for(POLLIN, read_timeout_ms_);
}

bool ConnectionStream::is_writable() const {
  return poll_for(POLLOUT, write_timeout_ms_);
}

ssize_t ConnectionStream::read(char* ptr, size_t size) {
  if (off_ == end_) {
    if (!poll_for(POLLIN, read_timeout_ms_)) return -1;
    ssize_t n = 0;
    do {
      n = ::recv(sock_, buf_.data(), buf_.size(), 0);
    } while (n < 0 && errno == EINTR);
    if (n <= 0) return n;
    off_ = 0;
    end_ = static_cast<size_t>(n);
  }
  const size_t n = std::min(size, end_ - off_);
  std::memcpy(ptr, buf_.data() + off_, n);
  off_ += n;
  return static_cast<ssize_t>(n);
}

ssize_t ConnectionStream::write(const char* ptr, size_t size) {
  if (!poll_for(POLLOUT, write_timeout_ms_)) return -1;
  ssize_t n = 0;
  do {
    n = ::send(sock_, ptr, size, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  return n;
}

void ConnectionStream::get_remote_ip_and_port(std::string& ip, int& port) const {
  address(sock_, ::getpeername, ip, port);
}

void ConnectionStream::get_local_ip_and_port(std::string& ip, int& port) const {
  address(sock_, ::getsockname, ip, port);
}

bool ConnectionStream::peer_closed() const {
  if (buffered()) return false;
  pollfd p{sock_, POLLIN, 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  if ((p.revents & (POLLERR | POLLHUP | POLLNVAL)) != 0) return true;
  char c = 0;
  return ::recv(sock_, &c, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

bool ConnectionStream::discard(int64_t bytes, int64_t most) {
  if (bytes < 0 || bytes > most) return false;
  char sink[4096];
  while (bytes > 0) {
    const ssize_t n = read(sink, static_cast<size_t>(std::min<int64_t>(bytes, sizeof(sink))));
    if (n <= 0) return false;
    bytes -= n;
  }
  return true;
}

std::string bind_error(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* info = nullptr;
  const std::string service = std::to_string(port);
  if (const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &info); rc != 0)
    return fmt::format("'{}' is not an address: {}", host, ::gai_strerror(rc));
  std::string why = "no address to bind";
  for (addrinfo* a = info; a != nullptr; a = a->ai_next) {
    const int sock = ::socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (sock < 0) {
      why = std::strerror(errno);
      continue;
    }
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    const bool bound = ::bind(sock, a->ai_addr, a->ai_addrlen) == 0;
    why = bound ? "the port was taken while binding" : std::strerror(errno);
    if (!bound && errno == EADDRINUSE) why += " (another server listens there)";
    ::close(sock);
    if (!bound) break;
  }
  ::freeaddrinfo(info);
  return why;
}

Server::Server() {
  set_socket_options([](socket_t sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
}

void Server::deepen_backlog() {
  const socket_t s = svr_sock_;
  if (s != INVALID_SOCKET) ::listen(s, SOMAXCONN);
}

bool Server::process_and_close_socket(socket_t sock) {
  ConnectionStream strm(sock,
                        static_cast<int>(read_timeout_sec_ * 1000 + read_timeout_usec_ / 1000),
                        static_cast<int>(write_timeout_sec_ * 1000 + write_timeout_usec_ / 1000));
  bool ret = false;
  for (size_t count = keep_alive_max_count_; count > 0 && next_request(strm); --count) {
    bool connection_closed = false;
    current = &strm;
    ret = process_request(strm, count == 1, connection_closed, nullptr);
    current = nullptr;
    if (!ret || connection_closed || strm.close_after) break;
  }
  ::shutdown(sock, SHUT_RDWR);
  ::close(sock);
  return ret;
}

bool Server::next_request(const ConnectionStream& strm) const {
  if (strm.buffered()) return true;
  const auto until =
      std::chrono::steady_clock::now() + std::chrono::seconds(keep_alive_timeout_sec_);
  while (svr_sock_ != INVALID_SOCKET) {
    pollfd p{strm.socket(), POLLIN, 0};
    const int r = ::poll(&p, 1, 50);
    if (r > 0) return true;
    if (r < 0 && errno != EINTR) return false;
    if (std::chrono::steady_clock::now() > until) return false;
  }
  return false;
}

}  // namespace spillway::http
