// What the Python binding and the XLA custom calls (xla_ffi.cc) share: the all-reduce
// algorithms by name, a call's signature (what every rank of a group must agree on), reduce
// operators by name, and the communicators alive in this process, which a custom call reaches
// by a handle (1, 2, ... in the order the process made them; accepted only while registered).
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "comm.h"

namespace autopar {

using AllReduceFn = void (*)(Comm&, const Group&, void*, size_t, DType, ReduceOp);
// The in-place all-reduce algorithms, by the names the planner uses.
const std::map<std::string, AllReduceFn>& allreduce_algorithms();

// A collective and its parameters (`what`) and the group's ranks in order, as a 64-bit
// FNV-1a hash: ranks whose calls differ fail instead of exchanging mismatched data.
uint64_t call_signature(const std::string& what, const Group* g);

// "sum", "prod", "max" or "min"; ArgumentError naming `where` otherwise.
ReduceOp reduce_op(const std::string& s, const std::string& where);

// The communicators custom calls may use: registered while their Python Comm lives;
// unregistering one also finishes and stops its started collectives (inflight.h).
int64_t register_comm(Comm* c);
void unregister_comm(Comm* c);
// The communicator of `handle`, or ArgumentError when none of this process has it.
Comm& registered_comm(int64_t handle);

// The XLA FFI handlers (name -> function address, for jax.ffi.register_ffi_target).
std::map<std::string, void*> ffi_handlers();
// Seconds this process has spent inside those handlers (moving data and waiting for peers).
double ffi_seconds();

}  // namespace autopar
