// Comm: one rank's view of a job -- its links to every peer and the transport verbs every
// collective algorithm is written against (send, recv, exchange, recv-reduce-send,
// recv-copy-send, barrier). All verbs run one progress loop over the links involved; waiting
// spins briefly, then yields the core, then sleeps for a growing fraction of the wait (at most
// 200 us), and every millisecond checks the job's abort flag, whether the peers it waits for
// are still alive, and the time since the last byte moved.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common.h"
#include "link.h"
#include "shm.h"

namespace autopar {

struct Reduce {
  DType dtype;
  ReduceOp op;
};

// An ordered set of global ranks (a mesh axis group) and this rank's position in it.
struct Group {
  std::vector<int> ranks;
  int me;
  int size() const { return int(ranks.size()); }
  int at(int i) const { return ranks[((i % size()) + size()) % size()]; }
};

class Comm {
 public:
  // hosts[r]: the host id of rank r (the 2D algorithms' hierarchy). Every rank in the segment
  // gets a shared-memory link, unless shm_within_hosts: then only ranks of the same host id
  // do, and the others need TCP (connect_tcp_links) -- a multi-host job on one machine.
  // direct: whether this rank offers single-copy sends (ShmSegment::agree_direct; they are on
  // only when every rank of the job offers them and can reach the others' memory).
  Comm(int rank, int size, std::shared_ptr<ShmSegment> shm, std::vector<int> hosts,
       double timeout_s, bool shm_within_hosts, bool direct);

  int rank() const { return rank_; }
  int size() const { return size_; }
  int host_of(int r) const { return hosts_[r]; }
  double timeout() const { return timeout_s_; }
  void set_timeout(double s) { timeout_s_ = s; }
  void set_link(int peer, std::unique_ptr<Link> link);
  std::string link_kind(int peer) const;
  // Bytes this rank handed to its link to `peer` so far, frames included (what crosses a
  // network for a TCP link; a peer's single-copy reads of this rank's memory are not counted).
  uint64_t bytes_sent(int peer) const { return sent_[size_t(peer)].load(std::memory_order_relaxed); }
  // Seconds this rank spent in the recv custom call (a pipeline stage waiting for, then taking,
  // its peers' transfers), all calls together.
  double recv_seconds() const { return 1e-9 * double(recv_ns_.load(std::memory_order_relaxed)); }
  void add_recv_ns(uint64_t ns) { recv_ns_.fetch_add(ns, std::memory_order_relaxed); }
  // Whether this rank sends large messages single-copy (see ShmSegment::agree_direct).
  bool direct() const { return shm_ && shm_->direct(rank_); }
  // Whether this rank reads and writes rank peer's memory itself (a shared-memory peer, with
  // single-copy agreed by every rank of the job), and those copies (failures raise through
  // fail(), naming the peer).
  bool reaches(int peer) const;
  void read_peer(int peer, uint64_t addr, void* to, size_t n);
  void write_peer(int peer, uint64_t addr, const void* from, size_t n);

  // The call this thread is in (set by the collective entry points): its name in errors,
  // the bytes its caller passed (per rank) and a signature of everything else the ranks must
  // agree on (collective, algorithm, dtype, reduction, root, group). Every message carries
  // them in its frame and the receiver compares them with its own before a payload byte is
  // taken, so ranks that disagree fail with CollectiveError naming both sides instead of
  // reading each other's bytes as their own. Per thread: a pipeline stage sends and receives
  // on threads of its own beside its collectives, each on other links (a link's two
  // directions are independent).
  struct Call {
    std::string op = "collective";
    uint64_t bytes = 0;
    uint64_t signature = 0;
  };
  // copied into this thread's Call: its label's buffer is reused, so a call site set again
  // with a label no longer than before allocates nothing
  void set_call(const Call& call) { call_() = call; }
  void set_op(std::string op) { call_() = Call{std::move(op), 0, 0}; }
  const std::string& op() const { return call_().op; }
  const Call& call() const { return call_(); }

  void send(int peer, const void* buf, size_t n);
  void recv(int peer, void* buf, size_t n);
  // Send sn bytes to dst while receiving rn bytes from src into rbuf (reduced into it when
  // red is given: rbuf = rbuf op received).
  void exchange(int dst, const void* sbuf, size_t sn, int src, void* rbuf, size_t rn,
                const Reduce* red = nullptr);
  // Receive n bytes from src reducing them into buf, and forward each reduced piece to dst.
  void recv_reduce_send(int src, int dst, void* buf, size_t n, const Reduce& red);
  // Receive n bytes from src into buf, and forward each piece to every rank of dsts.
  void recv_copy_send(int src, const std::vector<int>& dsts, void* buf, size_t n);
  void barrier(const Group& g);

  // The frame that goes before every message of one byte or more on a link (96 bytes): the
  // sender's call (see Call) and the message's length. A message is never read before its
  // frame matched.
  struct Frame {
    uint64_t magic = 0;
    uint64_t signature = 0;
    uint64_t call_bytes = 0;
    uint64_t bytes = 0;
    char op[64] = {};            // the sender's call name, cut to 63 characters
  };
  // One transfer of the progress loop; a send with `ready` set only sends bytes below *ready.
  // `framed` counts the frame's bytes sent or received so far.
  struct Xfer {
    bool is_send;
    int peer;
    char* p;
    size_t n;
    const Reduce* red = nullptr;
    const size_t* ready = nullptr;
    size_t align = 1;
    size_t done = 0;
    size_t framed = 0;
    Frame frame{};
  };
  // Move every transfer to its end; `step`, when given, runs once per round of the progress
  // loop (returning whether it did anything), e.g. to reduce what has arrived and raise a
  // send's `ready`.
  void run(std::vector<Xfer>& xs, const std::function<bool()>& step = nullptr);
  // Raise CollectiveError for this rank and operation, and flag the job so peers fail fast.
  [[noreturn]] void fail(const std::string& cause);

 private:
  void check(const std::vector<Xfer>& xs, double idle_s);
  Link& link(int peer);
  // Move x's frame; true once it is all sent, or received and matching this rank's call.
  bool move_frame(Xfer& x, Link& l, bool* moved);
  void check_frame(const Xfer& x);

  int rank_, size_;
  std::shared_ptr<ShmSegment> shm_;     // declared before links_: outlives them
  std::vector<std::unique_ptr<Link>> links_;
  std::vector<int> hosts_;
  double timeout_s_;
  std::unique_ptr<std::atomic<uint64_t>[]> sent_;
  std::atomic<uint64_t> recv_ns_{0};
  static Call& call_() {
    thread_local Call call;
    return call;
  }
};

}  // namespace autopar
