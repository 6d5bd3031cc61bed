// Reduction Server all-reduce (Vertex AI's design): reducer ranks, which run no compute, own
// the shards of the buffer. Each worker sends shard j of its buffer to reducer j and receives
// the reduced shard j back, so a worker sends the buffer once and receives it once (a ring
// sends and receives 2(n-1)/n times it), whatever the number of workers.
//
// Per all-reduce a worker first sends every reducer a request (what it reduces: its call's
// signature, element count, dtype and reduction), under a call identity of its own, so a
// reducer learns the call from its workers and checks they agree; then the data messages carry
// the workers' all_reduce identity, as every collective's do. A reducer receives its shard
// from every worker and, piece by piece as every worker's piece arrives, reduces them in
// worker order (the same sum on every run) and sends the sums back to each, so receiving,
// reducing and answering overlap. A "stop" request from every worker ends the reducer's service.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "algorithms.h"

namespace autopar {

namespace {

constexpr uint64_t kServe = 0x6170726564756365ull;   // "apreduce"
constexpr uint64_t kStop = 0x6170726564737470ull;    // "apredstp"
constexpr uint64_t kRequestSignature = 0x52535f7265717565ull;
constexpr size_t kPiece = 64 << 10;    // bytes a reducer reduces and sends back at a time

struct Request {
  uint64_t kind = 0;           // kServe or kStop
  uint64_t signature = 0;      // the worker's all_reduce call's
  uint64_t count = 0;          // elements of the worker's whole buffer
  int32_t dtype = 0, op = 0;
};
static_assert(sizeof(Request) == 32, "the request has no padding");

// Send `req` to every reducer (or receive one from every worker into reqs), as requests.
void requests(Comm& c, const std::vector<int>& peers, Request* reqs, bool send) {
  Comm::Call saved = c.call();
  c.set_call({"reduction server request", sizeof(Request), kRequestSignature});
  std::vector<Comm::Xfer> xs;
  for (size_t i = 0; i < peers.size(); ++i)
    xs.push_back({send, peers[i], reinterpret_cast<char*>(send ? reqs : reqs + i),
                  sizeof(Request)});
  c.run(xs);
  c.set_call(saved);
}

// This rank's position in reducers; fails unless it is one and no worker is.
int check_roles(Comm& c, const Group& workers, const std::vector<int>& reducers, bool reducer) {
  int me = -1;
  for (size_t j = 0; j < reducers.size(); ++j) {
    if (std::count(workers.ranks.begin(), workers.ranks.end(), reducers[j]))
      c.fail("rank " + std::to_string(reducers[j]) + " is both a worker and a reducer");
    if (reducers[j] == c.rank()) me = int(j);
  }
  if (reducer && me < 0) c.fail("this rank is not one of the reducers it serves as");
  return me;
}

}  // namespace

void allreduce_reduction_server(Comm& c, const Group& g, const std::vector<int>& reducers,
                                void* buf, size_t count, DType t, ReduceOp op) {
  check_roles(c, g, reducers, false);
  Request req{kServe, c.call().signature, count, int32_t(t), int32_t(op)};
  requests(c, reducers, &req, true);
  size_t es = dtype_size(t);
  Blocks b(count, int(reducers.size()));
  char* p = static_cast<char*>(buf);
  std::vector<Comm::Xfer> xs;
  xs.reserve(2 * reducers.size());
  for (size_t j = 0; j < reducers.size(); ++j) {
    // in place: the reducer answers only once it holds this whole shard from every worker
    xs.push_back({true, reducers[j], p + b.off[j] * es, b.len[j] * es});
    xs.push_back({false, reducers[j], p + b.off[j] * es, b.len[j] * es});
  }
  c.run(xs);
}

void release_reducers(Comm& c, const std::vector<int>& reducers) {
  Request req{kStop, 0, 0, 0, 0};
  requests(c, reducers, &req, true);
}

size_t serve_reductions(Comm& c, const Group& workers, const std::vector<int>& reducers) {
  int me = check_roles(c, workers, reducers, true);
  const std::vector<int>& from = workers.ranks;
  size_t k = from.size(), served = 0;
  std::vector<Request> reqs(k);
  std::vector<std::vector<uint64_t>> shards(k);       // uint64_t: aligned for every dtype
  const double timeout = c.timeout();
  for (;;) {
    // between steps the workers compute for as long as they need: wait on them without the
    // collective timeout (a dead worker or an aborted job still ends the wait)
    c.set_timeout(1e12);
    try {
      requests(c, from, reqs.data(), false);
    } catch (...) {
      c.set_timeout(timeout);
      throw;
    }
    c.set_timeout(timeout);
    const Request& r = reqs[0];
    if (r.kind == kStop &&
        std::all_of(reqs.begin(), reqs.end(), [](const Request& q) { return q.kind == kStop; }))
      return served;
    for (size_t w = 0; w < k; ++w) {
      const Request& q = reqs[w];
      if (q.kind != r.kind || q.signature != r.signature || q.count != r.count ||
          q.dtype != r.dtype || q.op != r.op || (q.kind != kServe && q.kind != kStop) ||
          r.dtype < 0 || r.dtype > int32_t(DType::i64) || r.op < 0 || r.op > int32_t(ReduceOp::min))
        c.fail("the workers' requests disagree: rank " + std::to_string(from[w]) +
               " asks for another reduction than rank " + std::to_string(from[0]) +
               " (different calls, sizes, dtypes or reductions, or one of them stopped)");
    }
    DType t = DType(r.dtype);
    ReduceOp op = ReduceOp(r.op);
    size_t es = dtype_size(t);
    Blocks b(size_t(r.count), int(reducers.size()));
    size_t n = b.len[size_t(me)], bytes = n * es;
    c.set_call({"all_reduce(reduction_server, " + std::to_string(r.count) + " elements)",
                r.count * es, r.signature});
    // receive every worker's shard, reduce each piece once all have it (in worker order, into
    // worker 0's copy) and send the sums back as they are made: one pipelined pass
    std::vector<Comm::Xfer> xs;
    xs.reserve(2 * k);                   // the sends read `reduced`, the step the receives
    for (size_t w = 0; w < k; ++w) {
      shards[w].resize((bytes + 7) / 8);
      xs.push_back({false, from[w], reinterpret_cast<char*>(shards[w].data()), bytes});
    }
    char* sum = reinterpret_cast<char*>(shards[0].data());
    size_t reduced = 0;
    for (size_t w = 0; w < k; ++w) xs.push_back({true, from[w], sum, bytes, nullptr, &reduced, es});
    c.run(xs, [&]() {
      size_t have = bytes;
      for (size_t w = 0; w < k; ++w) have = std::min(have, xs[w].done);
      have -= have % es;
      if (have <= reduced || (have < bytes && have - reduced < kPiece)) return false;
      for (size_t w = 1; w < k; ++w)
        reduce_into(sum + reduced, reinterpret_cast<char*>(shards[w].data()) + reduced,
                    (have - reduced) / es, t, op);
      reduced = have;
      return true;
    });
    ++served;
  }
}

}  // namespace autopar
