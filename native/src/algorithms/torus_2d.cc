// 2D-torus all-reduce: a ring reduce-scatter inside each host, a ring all-reduce of each
// rank's block among the ranks holding the same block on the other hosts, and a ring
// all-gather inside each host. Every rank uses the slow links for 1/L of the data. Runs as a
// plain ring when the group's hosts differ in size.
#include "algorithms.h"

namespace autopar {

void allreduce_2d_torus(Comm& c, const Group& g, void* buf, size_t count, DType t, ReduceOp op) {
  Group intra, inter;
  if (!two_levels(c, g, &intra, &inter)) return allreduce_ring(c, g, buf, count, t, op);
  if (count == 0) return;
  size_t es = dtype_size(t);
  char* data = static_cast<char*>(buf);
  Blocks b(count, intra.size());
  ring_reduce_scatter_inplace(c, intra, data, b, es, Reduce{t, op});
  int mine = (intra.me + 1) % intra.size();
  allreduce_ring(c, inter, data + b.off[mine] * es, b.len[mine], t, op);
  ring_allgather_inplace(c, intra, data, b, es, 1);
}

}  // namespace autopar
