// Ring all-reduce (reduce-scatter then all-gather, 2(n-1) steps of count/n elements), and the
// ring reduce-scatter and all-gather it is made of. Bandwidth-optimal for large messages.
#include <algorithm>
#include <cstring>

#include "algorithms.h"

namespace autopar {

void ring_reduce_scatter_inplace(Comm& c, const Group& g, char* buf, const Blocks& b, size_t es,
                                 const Reduce& red) {
  int n = g.size(), me = g.me;
  for (int s = 0; s < n - 1; ++s) {
    int sb = ((me - s) % n + n) % n, rb = ((me - s - 1) % n + n) % n;
    c.exchange(g.at(me + 1), buf + b.off[sb] * es, b.len[sb] * es, g.at(me - 1),
               buf + b.off[rb] * es, b.len[rb] * es, &red);
  }
  // block (me + 1) % n is now reduced over the whole group
}

void ring_allgather_inplace(Comm& c, const Group& g, char* buf, const Blocks& b, size_t es,
                            int first) {
  // rank me holds block (me + first) % n; after n - 1 steps every block everywhere
  int n = g.size(), me = g.me;
  for (int s = 0; s < n - 1; ++s) {
    int sb = ((me + first - s) % n + n) % n, rb = ((me + first - s - 1) % n + n) % n;
    c.exchange(g.at(me + 1), buf + b.off[sb] * es, b.len[sb] * es, g.at(me - 1),
               buf + b.off[rb] * es, b.len[rb] * es);
  }
}

void allreduce_ring(Comm& c, const Group& g, void* buf, size_t count, DType t, ReduceOp op) {
  if (g.size() < 2 || count == 0) return;
  Blocks b(count, g.size());
  Reduce red{t, op};
  size_t es = dtype_size(t);
  ring_reduce_scatter_inplace(c, g, static_cast<char*>(buf), b, es, red);
  ring_allgather_inplace(c, g, static_cast<char*>(buf), b, es, 1);
}

void reduce_scatter_ring(Comm& c, const Group& g, const void* in, void* out, size_t count, DType t,
                         ReduceOp op) {
  size_t es = dtype_size(t);
  Blocks b(count, g.size());
  if (g.size() < 2) {
    std::memcpy(out, in, count * es);
    return;
  }
  // A rotated ring so the fully reduced block lands on its owner. Step s sends the block
  // reduced at step s - 1 (straight from the input at step 0) and reduces the received one
  // into a copy of that input block made just before (cache-warm) in a scratch buffer; the
  // last block reduced is this rank's own, reduced straight into out. The scratch buffer is reused
  // across calls, so large calls do not pay page faults.
  thread_local std::vector<char> scratch;
  scratch.resize(std::max(scratch.size(), count * es));
  const char* src = static_cast<const char*>(in);
  Reduce red{t, op};
  int n = g.size(), me = g.me;
  for (int s = 0; s < n - 1; ++s) {
    int sb = ((me - s - 1) % n + n) % n, rb = ((me - s - 2) % n + n) % n;
    const char* sp = s == 0 ? src + b.off[sb] * es : scratch.data() + b.off[sb] * es;
    char* rp = rb == me ? static_cast<char*>(out) : scratch.data() + b.off[rb] * es;
    if (b.len[rb])                     // an empty block may sit at scratch.data() == nullptr
      std::memcpy(rp, src + b.off[rb] * es, b.len[rb] * es);
    c.exchange(g.at(me + 1), sp, b.len[sb] * es, g.at(me - 1), rp, b.len[rb] * es, &red);
  }
}

void allgather_ring(Comm& c, const Group& g, const void* in, void* out, size_t count, size_t es) {
  int n = g.size();
  std::memcpy(static_cast<char*>(out) + size_t(g.me) * count * es, in, count * es);
  if (n < 2 || count == 0) return;
  Blocks b(count * n, n);              // n equal blocks of count
  ring_allgather_inplace(c, g, static_cast<char*>(out), b, es, 0);
}

}  // namespace autopar
