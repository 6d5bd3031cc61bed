// The inner loops of local_search's state (autopar.strategies.solvers.search_state): memory
// left free by a choice, node costs with memory priced, 1-opt descent and memory repair.
// Planning code: it touches no device, process or socket.
//
// In (once): per node its strategy count and costs (flat in node order, inf for an impossible
// strategy); the edges (u, v), u != v, with their cost matrices oriented (u, v) and (v, u),
// row-major, flat at offsets[e] (inf marks a forbidden pair); the memory: per node the pieces
// of the time axis it spans (piece_off[x]..piece_off[x + 1] into piece_start/piece_len, absolute
// kept-step indices, contiguous) and its usage per (strategy, piece) row-major at
// table_off[x]; the capacity of every kept step. The choice and the free memory ("slack", one
// per kept step) are the caller's arrays, read and written in place by each call.
#pragma once

#include <cstdint>
#include <vector>

namespace autopar {

class SearchState {
 public:
  SearchState(std::vector<int64_t> sizes, std::vector<double> node_costs,
              std::vector<int64_t> edges, std::vector<double> forward,
              std::vector<double> backward, std::vector<int64_t> offsets,
              std::vector<int64_t> piece_off, std::vector<int64_t> piece_start,
              std::vector<int64_t> piece_len, std::vector<int64_t> table,
              std::vector<int64_t> table_off, std::vector<int64_t> capacity);

  // slack = capacity - the memory ``choice`` uses at every kept step.
  void load(const int64_t* choice, int64_t* slack) const;

  // Node costs plus ``lam`` (one price per kept step) times each strategy's usage summed over
  // its piece, flat in node order, into ``out``.
  void price(const double* lam, double* out) const;

  // 1-opt: the nodes of ``order`` in turn (each queued once), each moved to its cheapest
  // strategy (the first among equals) that fits with every other node as now, when that is
  // cheaper than its own; a moved node's neighbours are queued again. Stops when the queue
  // is empty or ``seconds`` have passed (checked every 256 nodes). Returns the moves made.
  int64_t descend(int64_t* choice, int64_t* slack, const int64_t* order, int64_t count,
                  double seconds);

  // Memory repair: while some kept step overflows (slack < 0), rounds over the nodes of
  // ``order`` whose span holds an overflowing step at the round's start, in that order: each
  // node over what the others leave it moves to the strategy with the least
  // (extra cost + 1) / (bytes of excess removed) (extra cost: the rise of its local cost, none
  // out of a forbidden pair, no move into one). Stops when nothing overflows, a round moves
  // nothing, or ``seconds`` have passed (checked every 256 nodes). Returns the moves made.
  int64_t repair(int64_t* choice, int64_t* slack, const int64_t* order, int64_t count,
                 double seconds);

  // A choice using no forbidden pair where arc consistency can keep it so: the nodes in
  // breadth-first order (roots 0, 1, ... in turn, neighbours in edge order), each taking the
  // strategy of least ``score`` (flat in node order; the first among equals) among those left
  // to it (finite cost, a finite pair with some strategy left to each neighbour) by the nodes
  // fixed before it, or among all its strategies when none is left. Fixing a node narrows its
  // neighbours' strategies to those with a finite pair with it, and each narrowing spreads;
  // a narrowing that would leave a node nothing is not made. Writes ``choice``.
  void consistent(const double* score, int64_t* choice) const;

  const std::vector<int64_t>& sizes() const { return sizes_; }
  int64_t num_nodes() const { return static_cast<int64_t>(sizes_.size()); }
  int64_t num_values() const { return node_off_.back(); }
  int64_t num_steps() const { return static_cast<int64_t>(capacity_.size()); }

 private:
  struct Link {
    int64_t other;      // the neighbour w
    const double* mat;  // the edge's matrix oriented (this node, w), row-major
  };

  void local(int64_t x, const int64_t* choice, double* out) const;
  void allowance(int64_t x, const int64_t* choice, const int64_t* slack) const;
  void move(int64_t x, int64_t s, int64_t* choice, int64_t* slack) const;

  std::vector<int64_t> sizes_, node_off_;
  std::vector<double> node_costs_, forward_, backward_;
  std::vector<std::vector<Link>> links_;
  std::vector<int64_t> piece_off_, piece_start_, piece_len_, table_, table_off_, capacity_;
  std::vector<double> loc_;
  mutable std::vector<int64_t> low_;
};

}  // namespace autopar
