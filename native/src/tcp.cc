// TCP links and the token-checked rendezvous (see tcp.h). Every connection starts with a
// fixed-size hello (magic, token, rank, listening port, address). A listener reads the hellos
// of all its pending connections at once, each with its own short deadline, and drops
// strangers (silent, short, garbage, a wrong token compared in constant time, a duplicate)
// without waiting on them or failing; they are counted in the error raised if the job never
// completes. Rank 0 answers its ranks with the table of every rank's hello, which they check
// entry by entry before connecting to the addresses in it.
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
#include <functional>
#include <map>
#include <vector>

namespace autopar {

namespace {

constexpr uint64_t kHello = 0x6170746370686931ull;
constexpr size_t kTokenBytes = 64;
constexpr double kHelloSeconds = 2.0;   // a connection's time to send its whole hello
constexpr size_t kMaxPending = 64;      // connections read at once; more drop the oldest

// The one message of the rendezvous, of fixed size: no length is read from the wire, and the
// strings end inside their fields (checked by refusal()).
struct Hello {
  uint64_t magic;
  char token[kTokenBytes];   // NUL-padded
  int32_t rank;
  int32_t port;
  char host[64];             // NUL-terminated IPv4 address
};
static_assert(sizeof(Hello) == 144, "the hello has no padding");

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

// Blocking full read/write with a deadline (to an admitted peer: one that showed the token).
void io_all(Comm& c, int fd, void* p, size_t n, bool write, double deadline, const char* what) {
  char* b = static_cast<char*>(p);
  while (n) {
    pollfd pf{fd, short(write ? POLLOUT : POLLIN), 0};
    double left = std::max(0.0, deadline - now());
    if (poll(&pf, 1, int(std::min(left, 0.1) * 1000)) < 0 && errno != EINTR) c.fail(err("poll"));
    if (now() > deadline) c.fail(std::string("timed out ") + what);
    if (!(pf.revents & (write ? POLLOUT : POLLIN | POLLHUP | POLLERR))) continue;
    ssize_t k = write ? ::send(fd, b, n, MSG_NOSIGNAL) : ::recv(fd, b, n, 0);
    if (k == 0) c.fail(std::string("connection closed while ") + what);
    if (k < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      c.fail(err(what));
    }
    b += k, n -= size_t(k);
  }
}

// A non-blocking listener (admit() accepts until EAGAIN).
Fd listen_on(Comm& c, const std::string& host, int port, int* bound) {
  Fd fd(socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
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
    Fd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (connect(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) return fd;
    if (now() > deadline)
      c.fail("could not connect to " + host + ":" + std::to_string(port) + " (" +
             std::strerror(errno) + ")");
    usleep(20000);
  }
}

Hello hello(const std::string& token, int rank, int port, const std::string& host) {
  Hello h{};
  h.magic = kHello;
  std::memcpy(h.token, token.data(), std::min(token.size(), sizeof(h.token) - 1));
  h.rank = rank;
  h.port = port;
  std::memcpy(h.host, host.data(), std::min(host.size(), sizeof(h.host) - 1));
  return h;
}

// Whether two token fields are equal, in time independent of where they differ.
bool same_token(const char (&a)[kTokenBytes], const char (&b)[kTokenBytes]) {
  unsigned char diff = 0;
  for (size_t i = 0; i < kTokenBytes; ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

// Why a hello read from the wire is not one of this job's ranks', or "" when it is: the magic,
// the token (compared in constant time with ours, `mine`), a rank in [0, size), a port, and
// an address that ends inside its field and parses. Nothing in it is trusted before this.
std::string refusal(const Hello& h, const Hello& mine, int size) {
  if (h.magic != kHello) return "not a hello";
  if (!same_token(h.token, mine.token)) return "wrong job token";
  if (h.rank < 0 || h.rank >= size || h.port < 1 || h.port > 65535) return "not a hello";
  if (!std::memchr(h.host, 0, sizeof(h.host))) return "not a hello";
  in_addr a;
  if (inet_pton(AF_INET, h.host, &a) != 1) return "not a hello";
  return "";
}

// Connections accepted on a listening socket whose hello is still being read.
struct Pending {
  Fd fd;
  double deadline;
  Hello h{};
  size_t got = 0;
};

// Accept connections on lfd and read one hello from each, all of them at once, until `want`
// were admitted: take(hello, fd) is called for each hello that passes refusal() and returns
// whether it took the connection (false: a duplicate, dropped). Every connection has its own
// deadline, kHelloSeconds from its accept: one that sends too little in time, closes, or
// sends a hello that is not this job's is dropped and counted, never waited on, so strangers
// neither stall nor fail the job. Fails at `deadline` naming what joined and what was dropped.
void admit(Comm& c, int lfd, double deadline, int want, const Hello& mine,
           const std::function<bool(const Hello&, Fd&)>& take, const std::string& what) {
  std::vector<Pending> pending;
  std::map<std::string, int> dropped;   // why -> connections
  int admitted = 0;
  auto drop = [&](size_t i, const std::string& why) {
    ++dropped[why];
    pending.erase(pending.begin() + long(i));
  };
  while (admitted < want) {
    double t = now();
    if (t > deadline) {
      std::string m = "timed out " + what + " with " + std::to_string(admitted) + " of " +
                      std::to_string(want) + " joined";
      if (!dropped.empty()) {
        m += " (connections dropped:";
        for (auto& kv : dropped) m += " " + std::to_string(kv.second) + " " + kv.first + ";";
        m.back() = ')';
      }
      c.fail(m);
    }
    std::vector<pollfd> pf{{lfd, POLLIN, 0}};
    for (Pending& p : pending) pf.push_back({p.fd.get(), POLLIN, 0});
    double wait = std::min(0.1, deadline - t);
    for (Pending& p : pending) wait = std::min(wait, p.deadline - t);
    if (poll(pf.data(), nfds_t(pf.size()), int(std::max(0.0, wait) * 1000) + 1) < 0 && errno != EINTR)
      c.fail(err("poll"));
    t = now();
    // read what arrived, newest first so erasing keeps the indices of the ones still to visit
    for (size_t i = pending.size(); i-- > 0;) {
      Pending& p = pending[i];
      if (pf[i + 1].revents) {
        ssize_t k = ::recv(p.fd.get(), reinterpret_cast<char*>(&p.h) + p.got, sizeof(Hello) - p.got,
                           MSG_DONTWAIT);
        if (k == 0) {
          drop(i, "closed early");
          continue;
        }
        if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
          drop(i, "failed");
          continue;
        }
        if (k > 0) p.got += size_t(k);
      }
      if (p.got == sizeof(Hello)) {
        std::string why = refusal(p.h, mine, c.size());
        if (why.empty() && take(p.h, p.fd)) {
          ++admitted;
          pending.erase(pending.begin() + long(i));
        } else {
          drop(i, why.empty() ? "duplicate rank" : why);
        }
      } else if (t > p.deadline) {
        drop(i, "silent or short");
      }
    }
    if (pf[0].revents & POLLIN) {
      for (;;) {
        int fd = accept4(lfd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) break;
        if (pending.size() >= kMaxPending) drop(0, "silent or short");   // the oldest
        pending.push_back(Pending{Fd(fd), std::min(t + kHelloSeconds, deadline)});
      }
    }
  }
}

}  // namespace

void connect_tcp_links(Comm& c, const std::string& rendezvous, const std::string& token,
                       const std::string& host) {
  // the binding checked the arguments (checks.h: check_tcp)
  size_t colon = rendezvous.rfind(':');
  std::string rhost = rendezvous.substr(0, colon);
  int rport = std::stoi(rendezvous.substr(colon + 1));
  int me = c.rank(), n = c.size();
  double deadline = now() + c.timeout();
  int port = 0;
  Fd lfd = listen_on(c, host, 0, &port);
  std::vector<Hello> table(static_cast<size_t>(n));
  const Hello mine = hello(token, me, port, host);
  table[size_t(me)] = mine;
  if (me == 0) {
    int rp = 0;
    Fd rfd = listen_on(c, rhost, rport, &rp);
    std::vector<Fd> peers(static_cast<size_t>(n));
    admit(c, rfd.get(), deadline, n - 1, mine, [&](const Hello& h, Fd& fd) {
      if (h.rank == 0 || peers[size_t(h.rank)].get() >= 0) return false;
      table[size_t(h.rank)] = h;
      peers[size_t(h.rank)] = std::move(fd);
      return true;
    }, "at the rendezvous");
    for (int r = 1; r < n; ++r)
      io_all(c, peers[size_t(r)].get(), table.data(), sizeof(Hello) * size_t(n), true, deadline,
             "sending the table");
  } else {
    Fd fd = connect_to(c, rhost, rport, deadline);
    io_all(c, fd.get(), &table[size_t(me)], sizeof(Hello), true, deadline,
           "sending the rendezvous hello");
    io_all(c, fd.get(), table.data(), sizeof(Hello) * size_t(n), false, deadline,
           "waiting for the rendezvous table (a wrong job token is refused)");
    // the table proves the rendezvous knows the token too; every entry is checked before its
    // address is used
    for (int r = 0; r < n; ++r) {
      std::string why = refusal(table[size_t(r)], mine, n);
      if (!why.empty() || table[size_t(r)].rank != r)
        c.fail("the rendezvous at " + rendezvous + " sent a table whose entry " +
               std::to_string(r) + " is not this job's (" + (why.empty() ? "wrong rank" : why) +
               "): is it this job's rank 0?");
    }
  }
  // pairs without a link: the higher rank connects to the lower one's listener
  int expect = 0;
  for (int p = me + 1; p < n; ++p) expect += c.link_kind(p) == "none";
  for (int p = 0; p < me; ++p) {
    if (c.link_kind(p) != "none") continue;
    Fd fd = connect_to(c, table[size_t(p)].host, table[size_t(p)].port, deadline);
    Hello greeting = mine;
    io_all(c, fd.get(), &greeting, sizeof(greeting), true, deadline, "greeting a peer");
    c.set_link(p, std::make_unique<TcpLink>(std::move(fd), p));
  }
  admit(c, lfd.get(), deadline, expect, mine, [&](const Hello& h, Fd& fd) {
    if (h.rank <= me || c.link_kind(h.rank) != "none") return false;
    c.set_link(h.rank, std::make_unique<TcpLink>(std::move(fd), h.rank));
    return true;
  }, "waiting for peers to connect");
}

}  // namespace autopar
