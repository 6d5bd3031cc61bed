// 2D-mesh all-reduce: like the 2D torus, but each phase talks to every peer of its dimension
// directly (all-pairs) instead of around a ring: a direct reduce-scatter inside each host, a
// direct reduce-scatter and all-gather of each block across hosts, a direct all-gather inside
// each host. One step per phase, suited to fully connected hosts (NVSwitch, a flat network).
// Runs as a plain ring when the group's hosts differ in size.
#include <vector>

#include "algorithms.h"

namespace autopar {

namespace {

// Position i ends holding block i of buf reduced over the group.
void direct_reduce_scatter(Comm& c, const Group& g, char* buf, const Blocks& b, size_t es,
                           const Reduce& red) {
  int n = g.size();
  std::vector<std::vector<char>> in(n);
  std::vector<Comm::Xfer> xs;
  for (int j = 0; j < n; ++j) {
    if (j == g.me) continue;
    xs.push_back({true, g.at(j), buf + b.off[j] * es, b.len[j] * es});
    in[j].resize(b.len[g.me] * es);
    xs.push_back({false, g.at(j), in[j].data(), in[j].size()});
  }
  c.run(xs);
  for (int j = 0; j < n; ++j)
    if (j != g.me) reduce_into(buf + b.off[g.me] * es, in[j].data(), b.len[g.me], red.dtype, red.op);
}

// Position i sends block i to every peer and receives theirs.
void direct_allgather(Comm& c, const Group& g, char* buf, const Blocks& b, size_t es) {
  std::vector<Comm::Xfer> xs;
  for (int j = 0; j < g.size(); ++j) {
    if (j == g.me) continue;
    xs.push_back({true, g.at(j), buf + b.off[g.me] * es, b.len[g.me] * es});
    xs.push_back({false, g.at(j), buf + b.off[j] * es, b.len[j] * es});
  }
  c.run(xs);
}

}  // namespace

void allreduce_2d_mesh(Comm& c, const Group& g, void* buf, size_t count, DType t, ReduceOp op) {
  auto hosts = host_groups(c, g);                // one host: a direct all-reduce
  if (hosts.empty()) return allreduce_ring(c, g, buf, count, t, op);
  if (g.size() < 2 || count == 0) return;
  Group intra = intra_group(g, hosts), inter = inter_group(g, hosts);
  size_t es = dtype_size(t);
  Reduce red{t, op};
  char* data = static_cast<char*>(buf);
  Blocks b(count, intra.size());
  direct_reduce_scatter(c, intra, data, b, es, red);
  if (inter.size() > 1) {
    char* mine = data + b.off[intra.me] * es;
    Blocks ib(b.len[intra.me], inter.size());
    direct_reduce_scatter(c, inter, mine, ib, es, red);
    direct_allgather(c, inter, mine, ib, es);
  }
  direct_allgather(c, intra, data, b, es);
}

}  // namespace autopar
