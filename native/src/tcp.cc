// TCP links and the token-checked rendezvous (see tcp.h). Every message starts with a fixed
// hello (magic, token, rank, listening port, address); a wrong token is refused and logged in
// the error rank 0 raises if the job never completes.
#include "tcp.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

namespace autopar {

namespace {

constexpr uint64_t kHello = 0x6170746370686931ull;

struct Hello {
  uint64_t magic;
  char token[64];
  int32_t rank;
  int32_t port;
  char host[64];
};

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string err(const char* what) { return std::string(what) + ": " + std::strerror(errno); }

class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept { reset(o.release()); return *this; }
  ~Fd() { reset(); }
  int get() const { return fd_; }
  int release() { int f = fd_; fd_ = -1; return f; }
  void reset(int f = -1) { if (fd_ >= 0) close(fd_); fd_ = f; }

 private:
  int fd_;
};

class TcpLink : public Link {
 public:
  TcpLink(Fd fd, int peer) : fd_(std::move(fd)), peer_(peer), buf_(1 << 18) {
    int one = 1;
    setsockopt(fd_.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    fcntl(fd_.get(), F_SETFL, fcntl(fd_.get(), F_GETFL) | O_NONBLOCK);
  }

  size_t send_some(const char* p, size_t n) override {
    ssize_t k = ::send(fd_.get(), p, n, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (k >= 0) return size_t(k);
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return 0;
    throw std::runtime_error("connection to rank " + std::to_string(peer_) + " lost (" +
                             std::strerror(errno) + ")");
  }

  size_t recv_some(size_t n, size_t align, char* /*direct*/,
                   const std::function<void(const char*, size_t)>& consume) override {
    if (end_ - begin_ < std::min(n, align) || end_ == begin_) fill();
    size_t have = end_ - begin_, k = std::min(n, have);
    if (k < n) k -= k % align;
    if (k == 0) return 0;
    consume(buf_.data() + begin_, k);
    begin_ += k;
    if (begin_ == end_) begin_ = end_ = 0;
    return k;
  }

  std::string kind() const override { return "tcp"; }

 private:
  void fill() {
    if (end_ == buf_.size()) {
      std::memmove(buf_.data(), buf_.data() + begin_, end_ - begin_);
      end_ -= begin_, begin_ = 0;
    }
    ssize_t k = ::recv(fd_.get(), buf_.data() + end_, buf_.size() - end_, MSG_DONTWAIT);
    if (k > 0) {
      end_ += size_t(k);
    } else if (k == 0) {
      throw std::runtime_error("rank " + std::to_string(peer_) + " closed the connection");
    } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      throw std::runtime_error("connection to rank " + std::to_string(peer_) + " lost (" +
                               std::strerror(errno) + ")");
    }
  }

  Fd fd_;
  int peer_;
  std::vector<char> buf_;
  size_t begin_ = 0, end_ = 0;
};

// Blocking full read/write with a deadline.
void io_all(Comm& c, int fd, void* p, size_t n, bool write, double deadline, const char* what) {
  char* b = static_cast<char*>(p);
  while (n) {
    pollfd pf{fd, short(write ? POLLOUT : POLLIN), 0};
    int left = int(std::max(0.0, deadline - now()) * 1000);
    if (poll(&pf, 1, std::min(left, 100)) < 0 && errno != EINTR) c.fail(err("poll"));
    if (now() > deadline) c.fail(std::string("timed out ") + what);
    if (!(pf.revents & (write ? POLLOUT : POLLIN | POLLHUP | POLLERR))) continue;
    ssize_t k = write ? ::send(fd, b, n, MSG_NOSIGNAL) : ::recv(fd, b, n, 0);
    if (k == 0) c.fail(std::string("connection closed while ") + what);
    if (k < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      c.fail(err(what));
    }
    b += k, n -= size_t(k);
  }
}

Fd listen_on(Comm& c, const std::string& host, int port, int* bound) {
  Fd fd(socket(AF_INET, SOCK_STREAM, 0));
  if (fd.get() < 0) c.fail(err("socket"));
  int one = 1;
  setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(port));
  if (inet_pton(AF_INET, host.c_str(), &a.sin_addr) != 1) c.fail("bad listening address " + host);
  if (bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0)
    c.fail(err(("bind " + host + ":" + std::to_string(port)).c_str()));
  if (listen(fd.get(), 512) != 0) c.fail(err("listen"));
  socklen_t len = sizeof(a);
  getsockname(fd.get(), reinterpret_cast<sockaddr*>(&a), &len);
  *bound = ntohs(a.sin_port);
  return fd;
}

Fd connect_to(Comm& c, const std::string& host, int port, double deadline) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(port));
  if (inet_pton(AF_INET, host.c_str(), &a.sin_addr) != 1) c.fail("bad address " + host);
  for (;;) {
    Fd fd(socket(AF_INET, SOCK_STREAM, 0));
    if (connect(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) return fd;
    if (now() > deadline)
      c.fail("could not connect to " + host + ":" + std::to_string(port) + " (" +
             std::strerror(errno) + ")");
    usleep(20000);
  }
}

Fd accept_one(Comm& c, int lfd, double deadline, const std::string& what) {
  for (;;) {
    pollfd pf{lfd, POLLIN, 0};
    poll(&pf, 1, 100);
    if (pf.revents & POLLIN) {
      int fd = accept(lfd, nullptr, nullptr);
      if (fd >= 0) return Fd(fd);
    }
    if (now() > deadline) c.fail(what);
  }
}

Hello hello(const std::string& token, int rank, int port, const std::string& host) {
  Hello h{};
  h.magic = kHello;
  std::strncpy(h.token, token.c_str(), sizeof(h.token) - 1);
  h.rank = rank;
  h.port = port;
  std::strncpy(h.host, host.c_str(), sizeof(h.host) - 1);
  return h;
}

bool admits(const Hello& h, const std::string& token, int size) {
  return h.magic == kHello && std::strncmp(h.token, token.c_str(), sizeof(h.token)) == 0 &&
         h.rank >= 0 && h.rank < size;
}

}  // namespace

void connect_tcp_links(Comm& c, const std::string& rendezvous, const std::string& token,
                       const std::string& host) {
  if (token.size() >= sizeof(Hello::token)) c.fail("job token longer than 63 characters");
  size_t colon = rendezvous.rfind(':');
  if (colon == std::string::npos) c.fail("rendezvous must be host:port, not " + rendezvous);
  std::string rhost = rendezvous.substr(0, colon);
  int rport = std::stoi(rendezvous.substr(colon + 1));
  int me = c.rank(), n = c.size();
  double deadline = now() + c.timeout();
  int port = 0;
  Fd lfd = listen_on(c, host, 0, &port);
  std::vector<Hello> table(n);
  table[me] = hello(token, me, port, host);
  if (me == 0) {
    int rp = 0;
    Fd rfd = listen_on(c, rhost, rport, &rp);
    std::vector<Fd> peers(n);
    int joined = 1, refused = 0;
    while (joined < n) {
      Fd fd = accept_one(c, rfd.get(), deadline,
                         "timed out with " + std::to_string(joined) + " of " + std::to_string(n) +
                             " ranks joined" +
                             (refused ? " (" + std::to_string(refused) +
                                            " connection(s) refused: wrong job token)" : ""));
      Hello h{};
      io_all(c, fd.get(), &h, sizeof(h), false, deadline, "reading a rendezvous hello");
      if (!admits(h, token, n) || peers[h.rank].get() >= 0 || h.rank == 0) {
        ++refused;                     // a stranger or a duplicate: drop the connection
        continue;
      }
      table[h.rank] = h;
      peers[h.rank] = std::move(fd);
      ++joined;
    }
    for (int r = 1; r < n; ++r)
      io_all(c, peers[r].get(), table.data(), sizeof(Hello) * n, true, deadline, "sending the table");
  } else {
    Fd fd = connect_to(c, rhost, rport, deadline);
    io_all(c, fd.get(), &table[me], sizeof(Hello), true, deadline, "sending the rendezvous hello");
    io_all(c, fd.get(), table.data(), sizeof(Hello) * n, false, deadline,
           "waiting for the rendezvous table (a wrong job token is refused)");
  }
  // pairs without a link: the higher rank connects to the lower one's listener
  int expect = 0;
  for (int p = me + 1; p < n; ++p) expect += c.link_kind(p) == "none";
  for (int p = 0; p < me; ++p) {
    if (c.link_kind(p) != "none") continue;
    Fd fd = connect_to(c, table[p].host, table[p].port, deadline);
    Hello h = hello(token, me, port, host);
    io_all(c, fd.get(), &h, sizeof(h), true, deadline, "greeting a peer");
    c.set_link(p, std::make_unique<TcpLink>(std::move(fd), p));
  }
  while (expect > 0) {
    Fd fd = accept_one(c, lfd.get(), deadline, "timed out waiting for peers to connect");
    Hello h{};
    io_all(c, fd.get(), &h, sizeof(h), false, deadline, "reading a peer's greeting");
    if (!admits(h, token, n) || h.rank <= me || c.link_kind(h.rank) != "none") continue;
    c.set_link(h.rank, std::make_unique<TcpLink>(std::move(fd), h.rank));
    --expect;
  }
}

}  // namespace autopar
