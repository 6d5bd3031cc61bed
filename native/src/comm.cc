// Comm's verbs and progress loop (see comm.h).
#include "comm.h"

#include <sched.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <sstream>

namespace autopar {

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Whether process pid exists and is not a zombie.
bool alive(int pid) {
  if (pid <= 0) return true;                 // unknown: rely on the timeout
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  if (!f) return false;
  std::string line;
  std::getline(f, line);
  size_t close = line.rfind(')');
  if (close == std::string::npos || close + 2 >= line.size()) return true;
  char state = line[close + 2];
  return state != 'Z' && state != 'X';
}

}  // namespace

Comm::Comm(int rank, int size, std::shared_ptr<ShmSegment> shm, std::vector<int> hosts,
           double timeout_s, bool shm_within_hosts, bool direct)
    : rank_(rank), size_(size), shm_(std::move(shm)), links_(size), hosts_(std::move(hosts)),
      timeout_s_(timeout_s), sent_(new std::atomic<uint64_t>[size_t(size > 0 ? size : 1)]()) {
  if (hosts_.empty()) hosts_.assign(size, 0);
  if (int(hosts_.size()) != size) throw std::invalid_argument("hosts must name every rank's host");
  if (shm_) {
    shm_->set_pid(rank, int(getpid()));
    for (int p = 0; p < size; ++p)
      if (p != rank && (!shm_within_hosts || hosts_[p] == hosts_[rank]))
        links_[p] = shm_->link(rank, p);
    if (size > 1) shm_->agree_direct(rank, timeout_s, direct);
  }
}

void Comm::set_link(int peer, std::unique_ptr<Link> l) { links_.at(peer) = std::move(l); }

std::string Comm::link_kind(int peer) const {
  return links_.at(peer) ? links_[peer]->kind() : std::string("none");
}

Link& Comm::link(int peer) {
  if (peer < 0 || peer >= size_ || !links_[peer])
    fail("no link to rank " + std::to_string(peer));
  return *links_[peer];
}

void Comm::fail(const std::string& cause) {
  if (shm_) shm_->abort(rank_, "rank " + std::to_string(rank_) + ", " + op() + ": " + cause);
  throw CollectiveError(rank_, op(), cause);
}

void Comm::check(const std::vector<Xfer>& xs, double idle_s) {
  if (shm_ && shm_->aborted()) throw CollectiveError(rank_, op(), "job aborted: " + shm_->abort_reason());
  for (const Xfer& x : xs) {
    if (x.done == x.n) continue;
    if (shm_ && !alive(shm_->pid(x.peer)))
      fail("rank " + std::to_string(x.peer) + " (pid " + std::to_string(shm_->pid(x.peer)) +
           ") exited");
    if (idle_s > timeout_s_) {
      std::ostringstream m;
      m << "rank " << x.peer << " stopped answering: no data " << (x.is_send ? "accepted" : "received")
        << " for " << timeout_s_ << " s (" << x.done << " of " << x.n << " bytes moved)";
      fail(m.str());
    }
  }
}

void Comm::run(std::vector<Xfer>& xs, const std::function<bool()>& step) {
  for (Xfer& x : xs)
    if (x.n && x.peer == rank_) fail("a transfer to itself");
  size_t idle = 0;
  double since = 0, checked = 0;
  for (;;) {
    bool pending = false, moved = step ? step() : false;
    for (Xfer& x : xs) {
      if (x.done == x.n) continue;
      pending = true;
      Link& l = link(x.peer);
      if (!move_frame(x, l, &moved)) continue;
      if (x.is_send) {
        size_t limit = x.ready ? std::min(*x.ready, x.n) : x.n;
        if (limit < x.n) limit -= limit % x.align;
        if (limit > x.done) {
          size_t k = l.send_some(x.p + x.done, limit - x.done);
          x.done += k, moved |= k > 0;
          sent_[size_t(x.peer)].fetch_add(k, std::memory_order_relaxed);
        }
      } else {
        size_t k;
        try {
          if (x.red) {
            size_t es = dtype_size(x.red->dtype);
            k = l.recv_some(x.n - x.done, es, nullptr, [&](const char* d, size_t len) {
              reduce_into(x.p + x.done, d, len / es, x.red->dtype, x.red->op);
              x.done += len;
            });
          } else {
            k = l.recv_some(x.n - x.done, 1, x.p + x.done, [&](const char* d, size_t len) {
              if (d != x.p + x.done) std::memcpy(x.p + x.done, d, len);
              x.done += len;
            });
          }
        } catch (const CollectiveError&) {
          throw;
        } catch (const std::exception& e) {
          check(xs, 0);              // a job already aborted, or a dead sender, is the cause
          fail("receiving from rank " + std::to_string(x.peer) + ": " + e.what());
        }
        moved |= k > 0;
      }
    }
    if (!pending) return;
    if (moved) {
      idle = 0;
      continue;
    }
    if (++idle <= 64) continue;               // spin: the peer usually answers within microseconds
    double t = now();
    if (idle == 65) since = t, checked = t;
    double waited = t - since;
    if (waited < 1e-3) {
      // yield: when ranks outnumber cores the peer we wait for needs this core to answer
      // (8 ranks on 2 cores: a 4 KB all-reduce takes 150 us yielding for 1 ms, 750 us
      // yielding for 50 us and then sleeping)
      sched_yield();
    } else {
      // back off: a peer that is still computing should get this core; the sleep grows
      // with the wait, so a late answer costs at most a quarter more
      thread_local bool slack = prctl(PR_SET_TIMERSLACK, 1000UL) == 0;   // 1 us, not 50
      (void)slack;
      timespec ts{0, long(std::min(200e-6, waited / 4) * 1e9)};
      nanosleep(&ts, nullptr);
    }
    if (t - checked > 1e-3) {
      checked = t;
      check(xs, waited);
    }
  }
}

namespace {
constexpr uint64_t kFrameMagic = 0x61706672616d6531ull;   // "apframe1"
}

bool Comm::move_frame(Xfer& x, Link& l, bool* moved) {
  constexpr size_t kSize = sizeof(Frame);
  if (x.framed == kSize) return true;
  char* f = reinterpret_cast<char*>(&x.frame);
  if (x.is_send) {
    if (x.framed == 0) {
      const Call& c = call();
      x.frame.magic = kFrameMagic;
      x.frame.signature = c.signature;
      x.frame.call_bytes = c.bytes;
      x.frame.bytes = x.n;
      c.op.copy(x.frame.op, sizeof(x.frame.op) - 1);
    }
    size_t k = l.send_some(f + x.framed, kSize - x.framed);
    x.framed += k, *moved |= k > 0;
    sent_[size_t(x.peer)].fetch_add(k, std::memory_order_relaxed);
    return x.framed == kSize;
  }
  size_t k;
  try {
    k = l.recv_some(kSize - x.framed, 1, f + x.framed, [&](const char* d, size_t len) {
      if (d != f + x.framed) std::memcpy(f + x.framed, d, len);
    });
  } catch (const CollectiveError&) {
    throw;
  } catch (const std::exception& e) {
    check({x}, 0);
    fail("receiving from rank " + std::to_string(x.peer) + ": " + e.what());
  }
  x.framed += k, *moved |= k > 0;
  if (x.framed < kSize) return false;
  check_frame(x);
  return true;
}

void Comm::check_frame(const Xfer& x) {
  const Frame& f = x.frame;
  const Call& mine = call();
  std::string peer = "rank " + std::to_string(x.peer);
  if (f.magic != kFrameMagic)
    fail(peer + " sent bytes that are not a message frame: the ranks are out of step (a call "
         "that failed on some ranks only, or ranks calling different collectives)");
  std::string theirs(f.op, strnlen(f.op, sizeof(f.op)));
  if (f.call_bytes != mine.bytes)
    fail("ranks disagree on the size: " + peer + " passed " + std::to_string(f.call_bytes) +
         " bytes to " + theirs + ", this rank " + std::to_string(mine.bytes) + " bytes to " +
         op() + "; the ranks must pass the same size to the same call (a receive the size of "
         "its send)");
  if (f.signature != mine.signature)
    fail(peer + " is in another call (" + theirs + "): the ranks of a group must call the same "
         "collectives with the same algorithm, dtype, reduction, root and group, in the same "
         "order");
  if (f.bytes != x.n)
    fail(peer + " sent a message of " + std::to_string(f.bytes) + " bytes where this rank "
         "expects " + std::to_string(x.n) + " (" + theirs + ")");
}

void Comm::send(int peer, const void* buf, size_t n) {
  std::vector<Xfer> xs{{true, peer, static_cast<char*>(const_cast<void*>(buf)), n}};
  run(xs);
}

void Comm::recv(int peer, void* buf, size_t n) {
  std::vector<Xfer> xs{{false, peer, static_cast<char*>(buf), n}};
  run(xs);
}

void Comm::exchange(int dst, const void* sbuf, size_t sn, int src, void* rbuf, size_t rn,
                    const Reduce* red) {
  std::vector<Xfer> xs{{true, dst, static_cast<char*>(const_cast<void*>(sbuf)), sn},
                       {false, src, static_cast<char*>(rbuf), rn, red}};
  run(xs);
}

void Comm::recv_reduce_send(int src, int dst, void* buf, size_t n, const Reduce& red) {
  std::vector<Xfer> xs;
  xs.reserve(2);                       // the send reads xs[0].done: no reallocation
  xs.push_back({false, src, static_cast<char*>(buf), n, &red});
  xs.push_back({true, dst, static_cast<char*>(buf), n, nullptr, &xs[0].done,
                dtype_size(red.dtype)});
  run(xs);
}

void Comm::recv_copy_send(int src, const std::vector<int>& dsts, void* buf, size_t n) {
  std::vector<Xfer> xs;
  xs.reserve(dsts.size() + 1);
  xs.push_back({false, src, static_cast<char*>(buf), n});
  for (int d : dsts) xs.push_back({true, d, static_cast<char*>(buf), n, nullptr, &xs[0].done});
  run(xs);
}

bool Comm::reaches(int peer) const {
  return direct() && peer >= 0 && peer < size_ && peer != rank_ && links_[peer] &&
         links_[peer]->kind() == "shm";
}

void Comm::read_peer(int peer, uint64_t addr, void* to, size_t n) {
  try {
    shm_->read_peer(peer, addr, to, n);
  } catch (const std::exception& e) {
    check({}, 0);                    // a job already aborted is the cause
    fail("rank " + std::to_string(peer) + ": " + e.what());
  }
}

void Comm::write_peer(int peer, uint64_t addr, const void* from, size_t n) {
  try {
    shm_->write_peer(peer, addr, from, n);
  } catch (const std::exception& e) {
    check({}, 0);
    fail("rank " + std::to_string(peer) + ": " + e.what());
  }
}

void Comm::barrier(const Group& g) {
  // dissemination: round k, send a byte to me + 2^k, receive one from me - 2^k
  char out = 1, in = 0;
  for (int d = 1; d < g.size(); d <<= 1) exchange(g.at(g.me + d), &out, 1, g.at(g.me - d), &in, 1);
}

}  // namespace autopar
