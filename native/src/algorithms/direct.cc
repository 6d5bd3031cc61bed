// Direct all-reduce, for ranks that reach each other's memory (one host, single-copy agreed):
// group position i owns block i. It reads block i of every peer's buffer straight from the
// peer (process_vm_readv), reduces it into its own, and writes the result straight back into
// every peer's buffer (process_vm_writev), piece by piece, so a piece goes back out while it is
// still in cache. The only messages are the buffers' addresses at the start and a barrier at
// the end (after it every block is everywhere). Per rank (n-1)/n of the buffer is read from
// peers and as much written to them, as in the ring, but in about 2 + log2(n) message
// latencies instead of 2(n-1), with no second pass over memory for the all-gather half.
// Every rank gets its block's owner's sums, so all ranks end bitwise equal. The addresses go
// with the buffers' lengths, checked by every rank before any byte moves (and every message's
// frame carries the caller's size, see Comm::Call): ranks that disagree on the count fail
// with CollectiveError instead of writing past a peer's buffer. A group with a rank
// that cannot reach another (a TCP peer, single-copy off) runs the ring: every rank of such a
// group sees it, so they all choose alike.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "algorithms.h"

namespace autopar {

namespace {
constexpr size_t kPiece = 256 << 10;   // bytes reduced and written back at a time (cache-sized)
}

bool reaches_all(const Comm& c, const Group& g) {
  for (int i = 1; i < g.size(); ++i)
    if (!c.reaches(g.at(g.me + i))) return false;
  return true;
}

std::vector<uint64_t> exchange_addresses(Comm& c, const Group& g, const void* p, size_t bytes) {
  // sent to and received from every peer in one progress loop: each rank's buffer address and
  // length, so that no rank reads or writes past a peer's buffer (every rank checks every
  // peer's length before a byte moves, so all of them fail alike on a mismatch)
  struct Extent {
    uint64_t addr, bytes;
  };
  int n = g.size(), me = g.me;
  Extent mine{reinterpret_cast<uint64_t>(p), bytes};
  std::vector<Extent> peer(size_t(n), Extent{0, 0});
  peer[size_t(me)] = mine;
  std::vector<Comm::Xfer> xs;
  for (int i = 1; i < n; ++i) {
    int k = (me + i) % n;
    xs.push_back({true, g.at(k), reinterpret_cast<char*>(&mine), sizeof mine});
    xs.push_back({false, g.at(k), reinterpret_cast<char*>(&peer[size_t(k)]), sizeof mine});
  }
  c.run(xs);
  std::vector<uint64_t> addr(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    if (peer[size_t(i)].bytes != bytes)
      c.fail("single-copy sizes disagree: rank " + std::to_string(g.at(i)) + "'s buffer holds " +
             std::to_string(peer[size_t(i)].bytes) + " bytes, this rank's " +
             std::to_string(bytes) + "; every rank of the group must pass the same size");
    addr[size_t(i)] = peer[size_t(i)].addr;
  }
  return addr;
}

void allreduce_direct(Comm& c, const Group& g, void* buf, size_t count, DType t, ReduceOp op) {
  int n = g.size(), me = g.me;
  if (n < 2 || count == 0) return;
  if (!reaches_all(c, g)) return allreduce_ring(c, g, buf, count, t, op);
  std::vector<uint64_t> addr = exchange_addresses(c, g, buf, count * dtype_size(t));
  size_t es = dtype_size(t);
  Blocks b(count, n);
  char* own = static_cast<char*>(buf) + b.off[me] * es;
  size_t len = b.len[me] * es, piece = kPiece / es * es;
  thread_local std::vector<char> bounce;
  if (bounce.size() < piece) bounce.resize(piece);
  for (size_t at = 0; at < len; at += piece) {
    size_t k = std::min(piece, len - at);
    uint64_t where = b.off[me] * es + at;
    for (int i = 1; i < n; ++i) {
      int p = (me + i) % n;
      c.read_peer(g.at(p), addr[p] + where, bounce.data(), k);
      reduce_into(own + at, bounce.data(), k / es, t, op);
    }
    for (int i = 1; i < n; ++i) {
      int p = (me + i) % n;
      c.write_peer(g.at(p), addr[p] + where, own + at, k);
    }
  }
  c.barrier(g);
}

}  // namespace autopar
