// The connection layer under `spillway serve`'s HTTP endpoint (private to part server):
// cpp-httplib's Server with an exclusive bind and one read buffer per connection.
//
// Note [Connections]: cpp-httplib 0.11 reads each request of a keep-alive connection through
// a stream of its own with its own read-ahead buffer, so the bytes of a pipelined request
// that arrived with the one before are thrown away with that buffer (three POSTs sent at
// once got one answer). Server reads every request of a connection through one
// ConnectionStream whose buffer lives as long as the connection. A handler learns its
// connection through current_connection() (same thread) so that it can see a client that
// went away (Note [Client gone]) and close a connection whose body it did not read.
#pragma once

#include <httplib.h>

#include <array>
#include <cstdint>
#include <string>

namespace spillway::http {

class ConnectionStream final : public httplib::Stream {
 public:
  ConnectionStream(socket_t sock, int read_timeout_ms, int write_timeout_ms)
      : sock_(sock), read_timeout_ms_(read_timeout_ms), write_timeout_ms_(write_timeout_ms) {}

  bool is_readable() const override;
  bool is_writable() const override;
  ssize_t read(char* ptr, size_t size) override;
  ssize_t write(const char* ptr, size_t size) override;
  void get_remote_ip_and_port(std::string& ip, int& port) const override;
  void get_local_ip_and_port(std::string& ip, int& port) const override;
  socket_t socket() const override { return sock_; }

  // Bytes of the next request already read: it is there without waiting for the socket.
  bool buffered() const { return off_ < end_; }
  // Note [Client gone]: the peer closed its side and sent nothing more (a pipelined request
  // still buffered or in the socket means it is there).
  bool peer_closed() const;
  // Reads and drops the next `bytes` bytes (a body not wanted), if there are at most `most`;
  // false when it cannot (unknown or too long, or the client stopped sending).
  bool discard(int64_t bytes, int64_t most);
  // The handler answered without reading the whole body: the connection ends after it.
  bool close_after = false;

 private:
  bool poll_for(short events, int timeout_ms) const;

  socket_t sock_;
  int read_timeout_ms_, write_timeout_ms_;
  std::array<char, 16384> buf_{};
  size_t off_ = 0, end_ = 0;
};

// The connection whose request this thread is handling, or nullptr.
ConnectionStream* current_connection();

// Why host:port cannot be bound (the library says only that it failed): a bind of our own,
// the OS error in words ("Address already in use": another server listens there).
std::string bind_error(const std::string& host, int port);

// The listening socket binds exclusively (cpp-httplib's default, SO_REUSEPORT, let a second
// server listen on the same port and take half the requests); every connection is read
// through one ConnectionStream (Note [Connections]).
class Server final : public httplib::Server {
 public:
  Server();
  // Debian's compiled cpp-httplib listens with a backlog of 5: a burst of connections beyond
  // it waits for the client's connect retry (~1 s). listen() again with the system's maximum.
  void deepen_backlog();

 private:
  bool process_and_close_socket(socket_t sock) override;
  // Waits for the next request of a keep-alive connection: buffered already, or readable on
  // the socket within the keep-alive timeout, while the server runs.
  bool next_request(const ConnectionStream& strm) const;
};

}  // namespace spillway::http
