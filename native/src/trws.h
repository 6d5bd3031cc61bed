// Sequential tree-reweighted message passing (TRW-S, Kolmogorov 2006) over a pairwise cost:
// the inner loops of autopar.strategies.solvers.trws, which states the recurrence. Planning
// code: it touches no device, process or socket.
//
// In: the strategy count of every node, the edges (u, v) with u != v, and per edge its cost
// matrix twice, row-major, once oriented (u, v) and once (v, u), finite (the caller stands a
// large cost in for a forbidden pair). Node costs (``unary``) come with every sweep, flat in
// node order. Out: from sweep(), the choice of the last forward pass and the bound its
// backward pass proved; messages persist between calls.
#pragma once

#include <cstdint>
#include <vector>

namespace autopar {

class MessagePassing {
 public:
  // sizes[n]; edges[2 * e] = (u, v); forward/backward: per edge a matrix (u, v) and (v, u),
  // each at offsets[e] in its flat array (offsets[num_edges] = total size).
  MessagePassing(std::vector<int64_t> sizes, std::vector<int64_t> edges,
                 std::vector<double> forward, std::vector<double> backward,
                 std::vector<int64_t> offsets);

  // ``sweeps`` forward+backward passes over ``unary`` (sum of sizes values); writes the last
  // forward pass's choice into ``choice`` (one per node) and returns the last backward pass's
  // bound.
  double sweep(const double* unary, int sweeps, int64_t* choice);

  int64_t num_nodes() const { return static_cast<int64_t>(sizes_.size()); }
  int64_t num_values() const { return node_off_.back(); }

 private:
  struct Link {
    int64_t other;      // the neighbour j
    const double* mat;  // the edge's matrix oriented (this node, j), row-major
    int64_t into_self;  // offset of the message into this node
    int64_t into_other; // offset of the message into j (the one this node sends)
  };

  double send(int64_t i, const double* h, const std::vector<Link>& links);

  std::vector<int64_t> sizes_, node_off_;
  std::vector<double> forward_, backward_, messages_, incoming_, gamma_;
  std::vector<std::vector<Link>> before_, after_;
  std::vector<double> h_, hg_, p_, msg_;
};

}  // namespace autopar
