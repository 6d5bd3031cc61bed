// Recursive doubling all-reduce for small messages: log2(n) steps, each exchanging the whole
// buffer with the partner 2^j away and reducing it in; the fewest messages of any all-reduce.
// A group that is not a power of two folds its first 2r ranks pairwise first, as
// halving_doubling does. Every rank combines the same partial results (commutatively), so
// all ranks end bitwise equal.
#include <cstring>
#include <vector>

#include "algorithms.h"

namespace autopar {

void allreduce_recursive_doubling(Comm& c, const Group& g, void* buf, size_t count, DType t,
                                  ReduceOp op) {
  int n = g.size(), me = g.me;
  if (n < 2 || count == 0) return;
  size_t bytes = count * dtype_size(t);
  char* data = static_cast<char*>(buf);
  Reduce red{t, op};
  int p = 1;
  while (p * 2 <= n) p *= 2;
  int r = n - p;
  std::vector<char> mine(bytes);                 // what this rank sends while reducing into data
  if (me < 2 * r && me % 2 == 0) {
    c.send(g.at(me + 1), data, bytes);
    c.recv(g.at(me + 1), data, bytes);
    return;
  }
  if (me < 2 * r) c.exchange(g.at(me - 1), nullptr, 0, g.at(me - 1), data, bytes, &red);
  int vrank = me < 2 * r ? me / 2 : me - r;
  auto real = [&](int v) { return g.at(v < r ? 2 * v + 1 : v + r); };
  for (int d = 1; d < p; d *= 2) {
    std::memcpy(mine.data(), data, bytes);
    int partner = real(vrank ^ d);
    c.exchange(partner, mine.data(), bytes, partner, data, bytes, &red);
  }
  if (me < 2 * r) c.send(g.at(me - 1), data, bytes);
}

}  // namespace autopar
