// 2D-ring (hierarchical) all-reduce: a ring reduce inside each host to its first rank, a ring
// all-reduce among those leaders across hosts, and a pipelined broadcast inside each host.
// Only one rank per host crosses the slow links. Runs as a plain ring when the group's hosts
// differ in size.
#include <vector>

#include "algorithms.h"

namespace autopar {

void allreduce_2d_ring(Comm& c, const Group& g, void* buf, size_t count, DType t, ReduceOp op) {
  Group intra, inter;
  if (!two_levels(c, g, &intra, &inter)) return allreduce_ring(c, g, buf, count, t, op);
  if (count == 0) return;
  size_t es = dtype_size(t);
  char* data = static_cast<char*>(buf);
  int L = intra.size();
  Blocks b(count, L);
  ring_reduce_scatter_inplace(c, intra, data, b, es, Reduce{t, op});
  int mine = (intra.me + 1) % L;                 // the block this rank now holds reduced
  if (intra.me == 0) {
    std::vector<Comm::Xfer> xs;
    for (int l = 1; l < L; ++l) {
      int blk = (l + 1) % L;
      xs.push_back({false, intra.at(l), data + b.off[blk] * es, b.len[blk] * es});
    }
    c.run(xs);
    allreduce_ring(c, inter, data, count, t, op);
  } else {
    c.send(intra.at(0), data + b.off[mine] * es, b.len[mine] * es);
  }
  broadcast_chain(c, intra, data, count * es, 0);
}

}  // namespace autopar
