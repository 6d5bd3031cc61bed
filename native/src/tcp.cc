// TCP links and the token-checked rendezvous (see tcp.h). Every connection starts with a
// fixed-size hello (magic, token, rank, listening port, address, stream index and count). A listener reads the hellos
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
#include <sys/uio.h>
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
// A multi-stream link's chunk: small enough that the streams share a message evenly, large
// enough that a header (16 bytes) and a syscall per chunk cost nothing
constexpr size_t kChunk = 256 << 10;

// The one message of the rendezvous, of fixed size: no length is read from the wire, and the
// strings end inside their fields (checked by refusal()).
struct Hello {
  uint64_t magic;
  char token[kTokenBytes];   // NUL-padded
  int32_t rank;
  int32_t port;
  char host[56];             // NUL-terminated IPv4 address
  int32_t stream;            // which of the pair's connections this is, in [0, streams)
  int32_t streams;           // connections per pair of ranks: the same on every rank
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

// The bytes a link has received in stream order and not yet handed on, [begin, end) of buf:
// both links' recv_some hand them out from here.
class InOrder {
 public:
  explicit InOrder(size_t n) : buf_(n) {}
  // Whether recv_some(n, align) should read the sockets first.
  bool short_of(size_t n, size_t align) const {
    return end_ - begin_ < std::min(n, align) || end_ == begin_;
  }
  // Free bytes at the end (what is left moved to the front once the end is reached), and
  // where they start; added(k) counts k bytes written there.
  size_t room() {
    if (end_ == buf_.size() && begin_ > 0) {
      std::memmove(buf_.data(), buf_.data() + begin_, end_ - begin_);
      end_ -= begin_, begin_ = 0;
    }
    return buf_.size() - end_;
  }
  char* tail() { return buf_.data() + end_; }
  void added(size_t k) { end_ += k; }
  // Hand up to n bytes to consume (a multiple of align unless all n); the bytes handed.
  size_t take(size_t n, size_t align, const std::function<void(const char*, size_t)>& consume) {
    size_t have = end_ - begin_, k = std::min(n, have);
    if (k < n) k -= k % align;
    if (k == 0) return 0;
    consume(buf_.data() + begin_, k);
    begin_ += k;
    if (begin_ == end_) begin_ = end_ = 0;
    return k;
  }

 private:
  std::vector<char> buf_;
  size_t begin_ = 0, end_ = 0;
};

class TcpLink : public Link {
 public:
  TcpLink(Fd fd, int peer) : fd_(std::move(fd)), peer_(peer), in_(1 << 18) {
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
    if (in_.short_of(n, align)) fill();
    return in_.take(n, align, consume);
  }

  std::string kind() const override { return "tcp"; }

 private:
  void fill() {
    size_t room = in_.room();
    if (room == 0) return;                 // full: recv_some hands out what it has
    ssize_t k = ::recv(fd_.get(), in_.tail(), room, MSG_DONTWAIT);
    if (k > 0) {
      in_.added(size_t(k));
    } else if (k == 0) {
      throw std::runtime_error("rank " + std::to_string(peer_) + " closed the connection");
    } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      throw std::runtime_error("connection to rank " + std::to_string(peer_) + " lost (" +
                               std::strerror(errno) + ")");
    }
  }

  Fd fd_;
  int peer_;
  InOrder in_;
};

// Several connections to one peer carrying one byte stream (NCCL Fast Socket's design). The
// sender cuts the stream into chunks of at most kChunk bytes, each led by a header (its offset
// in the stream, its length), and gives a chunk to whichever connection has handed all of its
// previous one to the kernel (dynamic load balancing: a slow or rate-capped flow gets fewer
// chunks). A chunk is sent from the caller's memory; send_some reports the bytes before the
// first chunk still going out, so the caller keeps that memory until then, as it does for one
// connection. The receiver reads every connection: the chunk that continues the stream goes
// straight into the in-order buffer, a chunk that arrived ahead (at most one per connection)
// waits in that connection's own buffer for its turn.
class MultiTcpLink : public Link {
 public:
  MultiTcpLink(std::vector<Fd> fds, int peer)
      : fds_(std::move(fds)), peer_(peer), out_(fds_.size()), in_(fds_.size()),
        ordered_(4 * kChunk) {
    for (Fd& f : fds_) {
      int one = 1;
      setsockopt(f.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      fcntl(f.get(), F_SETFL, fcntl(f.get(), F_GETFL) | O_NONBLOCK);
    }
  }

  size_t send_some(const char* p, size_t n) override {
    const uint64_t base = reported_;      // p is the stream's byte `base`
    for (bool progress = true; progress;) {
      progress = false;
      for (size_t i = 0; i < fds_.size(); ++i) {
        size_t s = (next_ + i) % fds_.size();
        Out& o = out_[s];
        if (o.left() == 0 && assigned_ < base + n) {       // idle: the next chunk is its
          o.h = {assigned_, std::min<uint64_t>(kChunk, base + n - assigned_)};
          o.sent = 0;
          assigned_ += o.h.bytes;
          next_ = (s + 1) % fds_.size();
        }
        if (o.left()) progress |= push(s, p + (o.h.offset - base));
      }
    }
    uint64_t first = assigned_;           // the earliest byte some connection still holds
    for (const Out& o : out_)
      if (o.left()) first = std::min(first, o.h.offset);
    size_t k = size_t(first - base);
    reported_ = first;
    return k;
  }

  size_t recv_some(size_t n, size_t align, char* /*direct*/,
                   const std::function<void(const char*, size_t)>& consume) override {
    if (ordered_.short_of(n, align)) pump();
    return ordered_.take(n, align, consume);
  }

  std::string kind() const override { return "tcp x" + std::to_string(fds_.size()); }

 private:
  struct Header {
    uint64_t offset, bytes;
  };
  struct Out {                 // the chunk a connection is sending
    Header h{0, 0};
    size_t sent = 0;           // of sizeof(Header) + h.bytes
    size_t left() const { return h.bytes ? sizeof(Header) + h.bytes - sent : 0; }
  };
  struct In {                  // the chunk a connection is receiving
    Header h{0, 0};
    size_t hgot = 0, got = 0, flushed = 0;   // header bytes; payload bytes read; in ordered_
    std::vector<char> ahead;   // payload that arrived before its turn
  };

  // Send what the kernel takes of connection s's chunk (payload at `data`); whether any.
  bool push(size_t s, const char* data) {
    Out& o = out_[s];
    iovec iov[2];
    int cnt = 0;
    if (o.sent < sizeof(Header))
      iov[cnt++] = {reinterpret_cast<char*>(&o.h) + o.sent, sizeof(Header) - o.sent};
    size_t done = o.sent > sizeof(Header) ? o.sent - sizeof(Header) : 0;
    iov[cnt++] = {const_cast<char*>(data) + done, o.h.bytes - done};
    msghdr m{};
    m.msg_iov = iov;
    m.msg_iovlen = size_t(cnt);
    ssize_t k = ::sendmsg(fds_[s].get(), &m, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (k < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return false;
      throw std::runtime_error("connection " + std::to_string(s) + " to rank " +
                               std::to_string(peer_) + " lost (" + std::strerror(errno) + ")");
    }
    o.sent += size_t(k);
    if (o.left() == 0) o.h.bytes = 0;
    return k > 0;
  }

  // recv into p; the bytes read (0: none now). Throws when the peer is gone.
  size_t read(size_t s, void* p, size_t n) {
    ssize_t k = ::recv(fds_[s].get(), p, n, MSG_DONTWAIT);
    if (k > 0) return size_t(k);
    if (k == 0)
      throw std::runtime_error("rank " + std::to_string(peer_) + " closed connection " +
                               std::to_string(s));
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return 0;
    throw std::runtime_error("connection " + std::to_string(s) + " to rank " +
                             std::to_string(peer_) + " lost (" + std::strerror(errno) + ")");
  }

  // Move what every connection has into ordered_, in stream order.
  void pump() {
    promote();
    for (size_t s = 0; s < fds_.size(); ++s) {
      In& c = in_[s];
      for (;;) {
        if (c.hgot < sizeof(Header)) {
          size_t k = read(s, reinterpret_cast<char*>(&c.h) + c.hgot, sizeof(Header) - c.hgot);
          c.hgot += k;
          if (c.hgot < sizeof(Header)) break;
          if (c.h.bytes == 0 || c.h.bytes > kChunk || c.h.offset < received_)
            throw std::runtime_error("connection " + std::to_string(s) + " to rank " +
                                     std::to_string(peer_) + " sent a chunk header out of place "
                                     "(not an autopar peer of this version?)");
          c.got = c.flushed = 0;
        }
        size_t k;
        if (c.h.offset + c.flushed == received_ && c.flushed == c.got) {   // in order
          size_t room = std::min<size_t>(ordered_.room(), c.h.bytes - c.got);
          if (room == 0) break;
          k = read(s, ordered_.tail(), room);
          ordered_.added(k);
          c.got += k, c.flushed += k, received_ += k;
        } else if (c.got < c.h.bytes) {                                     // ahead: held
          c.ahead.resize(kChunk);
          k = read(s, c.ahead.data() + c.got, c.h.bytes - c.got);
          c.got += k;
        } else {
          break;                                        // whole, waiting for its turn
        }
        if (c.flushed == c.h.bytes) c.hgot = 0;         // done: the next header
        if (k == 0) break;
      }
    }
    promote();
  }

  // Copy held chunks whose turn has come into ordered_.
  void promote() {
    for (bool moved = true; moved;) {
      moved = false;
      for (In& c : in_) {
        if (c.hgot < sizeof(Header) || c.h.offset + c.flushed != received_ || c.flushed == c.got)
          continue;
        size_t k = std::min(ordered_.room(), c.got - c.flushed);
        if (k == 0) return;
        std::memcpy(ordered_.tail(), c.ahead.data() + c.flushed, k);
        ordered_.added(k);
        c.flushed += k, received_ += k;
        if (c.flushed == c.h.bytes) c.hgot = 0;
        moved = true;
      }
    }
  }

  std::vector<Fd> fds_;
  int peer_;
  std::vector<Out> out_;
  std::vector<In> in_;
  uint64_t assigned_ = 0, reported_ = 0;   // sender: stream bytes given to connections, taken
  size_t next_ = 0;                        // the connection offered the next chunk first
  InOrder ordered_;                        // receiver: the stream's bytes in order
  uint64_t received_ = 0;                  // stream bytes in ordered_ so far
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

Hello hello(const std::string& token, int rank, int port, const std::string& host,
            int streams) {
  Hello h{};
  h.streams = streams;
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
  if (h.streams != mine.streams) return "another stream count";
  if (h.stream < 0 || h.stream >= h.streams) return "not a hello";
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
                       const std::string& host, int streams) {
  // the binding checked the arguments (checks.h: check_tcp)
  size_t colon = rendezvous.rfind(':');
  std::string rhost = rendezvous.substr(0, colon);
  int rport = std::stoi(rendezvous.substr(colon + 1));
  int me = c.rank(), n = c.size();
  double deadline = now() + c.timeout();
  int port = 0;
  Fd lfd = listen_on(c, host, 0, &port);
  std::vector<Hello> table(static_cast<size_t>(n));
  const Hello mine = hello(token, me, port, host, streams);
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
  // pairs without a link: the higher rank opens `streams` connections to the lower one's
  // listener; one connection is a TcpLink, several a MultiTcpLink
  auto link = [&](int p, std::vector<Fd> fds) {
    if (fds.size() == 1)
      c.set_link(p, std::make_unique<TcpLink>(std::move(fds[0]), p));
    else
      c.set_link(p, std::make_unique<MultiTcpLink>(std::move(fds), p));
  };
  int expect = 0;
  for (int p = me + 1; p < n; ++p) expect += (c.link_kind(p) == "none") * streams;
  for (int p = 0; p < me; ++p) {
    if (c.link_kind(p) != "none") continue;
    std::vector<Fd> fds;
    for (int s = 0; s < streams; ++s) {
      fds.push_back(connect_to(c, table[size_t(p)].host, table[size_t(p)].port, deadline));
      Hello greeting = mine;
      greeting.stream = s;
      io_all(c, fds.back().get(), &greeting, sizeof(greeting), true, deadline, "greeting a peer");
    }
    link(p, std::move(fds));
  }
  std::map<int, std::vector<Fd>> arriving;   // peer -> its connections, by stream
  admit(c, lfd.get(), deadline, expect, mine, [&](const Hello& h, Fd& fd) {
    if (h.rank <= me || c.link_kind(h.rank) != "none") return false;
    std::vector<Fd>& fds = arriving[h.rank];
    fds.resize(size_t(streams));
    if (fds[size_t(h.stream)].get() >= 0) return false;
    fds[size_t(h.stream)] = std::move(fd);
    if (std::all_of(fds.begin(), fds.end(), [](const Fd& f) { return f.get() >= 0; })) {
      link(h.rank, std::move(fds));
      arriving.erase(h.rank);
    }
    return true;
  }, "waiting for peers to connect");
}

}  // namespace autopar
