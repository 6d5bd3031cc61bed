// calls.h: the algorithm table, call signatures, reduce operators and the live communicators.
#include "calls.h"

#include <mutex>

#include "algorithms/algorithms.h"
#include "inflight.h"

namespace autopar {

const std::map<std::string, AllReduceFn>& allreduce_algorithms() {
  static const std::map<std::string, AllReduceFn> m{
      {"ring", allreduce_ring}, {"halving_doubling", allreduce_halving_doubling},
      {"recursive_doubling", allreduce_recursive_doubling}, {"tree", allreduce_tree},
      {"2d_ring", allreduce_2d_ring}, {"2d_torus", allreduce_2d_torus},
      {"2d_mesh", allreduce_2d_mesh}, {"direct", allreduce_direct}};
  return m;
}

uint64_t call_signature(const std::string& what, const Group* g) {
  uint64_t h = 0xcbf29ce484222325ull;
  auto mix = [&h](const std::string& s) {
    for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  };
  mix(what);
  if (g)
    for (int r : g->ranks) mix("," + std::to_string(r));
  return h;
}

ReduceOp reduce_op(const std::string& s, const std::string& where) {
  static const std::map<std::string, ReduceOp> ops{
      {"sum", ReduceOp::sum}, {"prod", ReduceOp::prod}, {"max", ReduceOp::max}, {"min", ReduceOp::min}};
  auto it = ops.find(s);
  if (it == ops.end()) throw ArgumentError(where + ": op='" + s + "' must be sum, prod, max or min");
  return it->second;
}

namespace {
std::mutex live_mu;
// Live communicators by handle: 1, 2, ... in the order this process made them, so a worker's
// one Comm has the same handle on every rank and a step's executable is the same for all.
std::map<int64_t, Comm*>& live() {
  static std::map<int64_t, Comm*> m;
  return m;
}
int64_t next_handle = 1;
}  // namespace

int64_t register_comm(Comm* c) {
  std::lock_guard<std::mutex> lock(live_mu);
  live()[next_handle] = c;
  return next_handle++;
}

void unregister_comm(Comm* c) {
  {
    std::lock_guard<std::mutex> lock(live_mu);
    for (auto it = live().begin(); it != live().end(); ++it)
      if (it->second == c) {
        live().erase(it);
        break;
      }
  }
  forget_inflight(c);        // its started collectives finish while c still lives
}

Comm& registered_comm(int64_t handle) {
  std::lock_guard<std::mutex> lock(live_mu);
  auto it = live().find(handle);
  if (it == live().end())
    throw ArgumentError("custom call: communicator handle " + std::to_string(handle) +
                        " is not a live Comm of this process (pass comm.ffi_handle of the "
                        "Comm the step was built for)");
  return *it->second;
}

}  // namespace autopar
