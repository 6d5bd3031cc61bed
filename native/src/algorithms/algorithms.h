// The collective algorithms, one per file, each written against Comm's verbs over a Group.
// Buffers hold `count` elements of `t`; "blocks" split a buffer into group-size near-equal
// parts (the first count % n parts one element longer), so any count works, 0 included.
#pragma once

#include <cstdint>
#include <vector>

#include "../comm.h"

namespace autopar {

struct Blocks {
  std::vector<size_t> off, len;        // in elements
  Blocks(size_t count, int n) : off(n), len(n) {
    size_t base = n ? count / n : 0, extra = n ? count % n : 0, o = 0;
    for (int i = 0; i < n; ++i) {
      len[i] = base + (size_t(i) < extra ? 1 : 0);
      off[i] = o;
      o += len[i];
    }
  }
};

// The halves of the ring all-reduce, in place over blocks b: after the reduce-scatter, group
// position i holds block (i + 1) % n reduced; the all-gather starts from position i holding
// block (i + first) % n.
void ring_reduce_scatter_inplace(Comm& c, const Group& g, char* buf, const Blocks& b, size_t es,
                                 const Reduce& red);
void ring_allgather_inplace(Comm& c, const Group& g, char* buf, const Blocks& b, size_t es,
                            int first);

// all-reduce, in place
void allreduce_ring(Comm& c, const Group& g, void* buf, size_t count, DType t, ReduceOp op);
void allreduce_halving_doubling(Comm& c, const Group& g, void* buf, size_t count, DType t, ReduceOp op);
void allreduce_recursive_doubling(Comm& c, const Group& g, void* buf, size_t count, DType t,
                                  ReduceOp op);
void allreduce_tree(Comm& c, const Group& g, void* buf, size_t count, DType t, ReduceOp op);
void allreduce_2d_ring(Comm& c, const Group& g, void* buf, size_t count, DType t, ReduceOp op);
void allreduce_2d_torus(Comm& c, const Group& g, void* buf, size_t count, DType t, ReduceOp op);
void allreduce_2d_mesh(Comm& c, const Group& g, void* buf, size_t count, DType t, ReduceOp op);
void allreduce_direct(Comm& c, const Group& g, void* buf, size_t count, DType t, ReduceOp op);
// Reduction Server (reduction_server.cc): the workers of g reduce through the reducer ranks,
// which run serve_reductions(workers, reducers) meanwhile, until every worker has called
// release_reducers; serve_reductions returns how many all-reduces it served.
void allreduce_reduction_server(Comm& c, const Group& g, const std::vector<int>& reducers,
                                void* buf, size_t count, DType t, ReduceOp op);
void release_reducers(Comm& c, const std::vector<int>& reducers);
size_t serve_reductions(Comm& c, const Group& workers, const std::vector<int>& reducers);

// reduce-scatter: in holds count elements, out receives block g.me of them, reduced
void reduce_scatter_ring(Comm& c, const Group& g, const void* in, void* out, size_t count, DType t,
                         ReduceOp op);
// all-gather: in holds count elements per rank, out n * count, rank i's at i * count
void allgather_ring(Comm& c, const Group& g, const void* in, void* out, size_t count, size_t esize);
// all-to-all: in and out hold n blocks of count elements; block j of in goes to rank j
void alltoall_pairwise(Comm& c, const Group& g, const void* in, void* out, size_t count, size_t esize);
// broadcast from group position root, in place: a pipelined chain
void broadcast_chain(Comm& c, const Group& g, void* buf, size_t bytes, int root);

// Direct access inside a host (direct.cc): whether this rank reaches the memory of every other
// rank of g (every rank of g gets the same answer), and every rank's address of its buffer p
// of `bytes` bytes, exchanged by message (position i's at [i]); fails with CollectiveError,
// naming both lengths, when a peer's buffer is not `bytes` long.
bool reaches_all(const Comm& c, const Group& g);
std::vector<uint64_t> exchange_addresses(Comm& c, const Group& g, const void* p, size_t bytes);
// The copy collectives by direct reads (direct_copy.cc), same buffers as above; the callers use
// them when reaches_all holds and a rank's block is at least kDirectCopyMin bytes (below it
// the slots are faster).
constexpr size_t kDirectCopyMin = size_t(1) << 16;
void allgather_direct(Comm& c, const Group& g, const void* in, void* out, size_t count, size_t esize);
void alltoall_direct(Comm& c, const Group& g, const void* in, void* out, size_t count, size_t esize);
void broadcast_direct(Comm& c, const Group& g, void* buf, size_t bytes, int root);

// The hosts of a group (ranks in group order, by host id, hosts in order of first rank),
// empty when they are not all the same size (the 2D algorithms then run as one ring).
std::vector<std::vector<int>> host_groups(const Comm& c, const Group& g);
// This rank's group inside its host, and its group across hosts (same position on each host).
Group intra_group(const Group& g, const std::vector<std::vector<int>>& hosts);
Group inter_group(const Group& g, const std::vector<std::vector<int>>& hosts);
// Both, when the group spans at least two equal hosts of at least two ranks; else false.
bool two_levels(const Comm& c, const Group& g, Group* intra, Group* inter);

}  // namespace autopar
