// The copy collectives by direct reads, for ranks that reach each other's memory (one host,
// single-copy agreed): after the ranks exchange their buffers' addresses, each rank reads what
// it receives straight from its peers' memory (process_vm_readv) into its own output, all
// ranks at once; a barrier then lets every rank leave (no one still reads its buffer). The
// addresses go with the buffers' lengths, checked before any byte is read. One copy
// per byte, against the slots' two, and no hand-off per piece.
// - all-gather: rank i's input lands at out[i] on every rank;
// - all-to-all: block j of rank i's input lands at out[i] on rank j;
// - broadcast: every rank but the root reads the root's buffer.
#include <cstring>
#include <vector>

#include "algorithms.h"

namespace autopar {

void allgather_direct(Comm& c, const Group& g, const void* in, void* out, size_t count,
                      size_t es) {
  int n = g.size(), me = g.me;
  size_t bytes = count * es;
  char* dst = static_cast<char*>(out);
  std::memcpy(dst + size_t(me) * bytes, in, bytes);
  if (n < 2 || bytes == 0) return;
  std::vector<uint64_t> addr = exchange_addresses(c, g, in, bytes);
  for (int i = 1; i < n; ++i) {
    int p = (me + i) % n;
    c.read_peer(g.at(p), addr[p], dst + size_t(p) * bytes, bytes);
  }
  c.barrier(g);
}

void alltoall_direct(Comm& c, const Group& g, const void* in, void* out, size_t count, size_t es) {
  int n = g.size(), me = g.me;
  size_t bytes = count * es;
  char* dst = static_cast<char*>(out);
  std::memcpy(dst + size_t(me) * bytes, static_cast<const char*>(in) + size_t(me) * bytes, bytes);
  if (n < 2 || bytes == 0) return;
  std::vector<uint64_t> addr = exchange_addresses(c, g, in, size_t(n) * bytes);
  for (int i = 1; i < n; ++i) {
    int p = (me + i) % n;
    c.read_peer(g.at(p), addr[p] + size_t(me) * bytes, dst + size_t(p) * bytes, bytes);
  }
  c.barrier(g);
}

void broadcast_direct(Comm& c, const Group& g, void* buf, size_t bytes, int root) {
  if (g.size() < 2 || bytes == 0) return;
  std::vector<uint64_t> addr = exchange_addresses(c, g, buf, bytes);
  if (g.me != root) c.read_peer(g.at(root), addr[root], buf, bytes);
  c.barrier(g);
}

}  // namespace autopar
