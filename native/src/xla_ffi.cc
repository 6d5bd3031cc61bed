// autopar's collectives as XLA custom calls (the FFI of the headers jaxlib ships), so a rank's
// whole step compiles into one executable: runtime/native_step.py registers these handlers
// with jax.ffi.register_ffi_target as "autopar_<name>" and calls them through jax.ffi.ffi_call.
//
// Every handler takes, after its data, an int32 scalar `order` and returns one: the Python side
// threads them from call to call, so the collectives of a step keep program order in the
// compiled executable on every rank (XLA would otherwise be free to reorder independent
// calls, and ranks would pair different collectives). Attributes: `comm`, the communicator's
// handle (calls.h: a live Comm of this process, else an error); `ranks`, the groups of the
// collective's partition one after another, each `group` ranks long, of which the handler
// takes the one holding its own rank (so every rank's executable is the same); `op`,
// `algorithm`, `root` as the Python binding's; `from` and `to` pair the ranks of a transfer
// (from[i] sends to to[i]). Each checks its buffers' sizes against
// the group before moving anything; an autopar CollectiveError comes back as an XLA error whose
// message starts with "autopar CollectiveError:" (the worker raises it as one), any other
// failure with "autopar:". all_reduce_start / all_reduce_done run a bucket's all-reduce on the
// communicator's own thread (inflight.h) while the executable computes; every other handler
// but send first waits for what was started to finish, so the links are used by one thread at
// a time.
// send hands its message to a thread per receiving rank and returns (a pipeline stage never
// waits for its receiver); sends_done waits for every queued send and raises the first failure.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "algorithms/algorithms.h"
#include "calls.h"
#include "checks.h"
#include "inflight.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace autopar {
namespace {

using Ranks = ffi::Span<const int64_t>;

DType dtype_of(ffi::DataType t, const std::string& what) {
  switch (t) {
    case ffi::DataType::F32: return DType::f32;
    case ffi::DataType::F64: return DType::f64;
    case ffi::DataType::F16: return DType::f16;
    case ffi::DataType::BF16: return DType::bf16;
    case ffi::DataType::S32: return DType::i32;
    case ffi::DataType::S64: return DType::i64;
    default:
      throw ArgumentError(what + " must be float32, float64, float16, bfloat16, int32 or int64 "
                          "to be reduced (XLA dtype " + std::to_string(int(t)) + ")");
  }
}

// This rank's group among `ranks` (groups of `size` ranks, one after another).
Group group_of(Comm& c, Ranks ranks, int64_t size, const std::string& op) {
  if (size < 1 || ranks.size() % size_t(size))
    throw ArgumentError(op + ": `ranks` must hold whole groups of `group` (" +
                        std::to_string(size) + ") ranks, not " + std::to_string(ranks.size()));
  for (size_t start = 0; start < ranks.size(); start += size_t(size)) {
    std::vector<int> rs;
    bool mine = false;
    for (size_t i = start; i < start + size_t(size); ++i) {
      int64_t r = ranks[i];
      if (r < 0 || r >= c.size())
        throw ArgumentError(op + ": rank " + std::to_string(r) + " is outside [0, " +
                            std::to_string(c.size()) + ")");
      rs.push_back(int(r));
      mine = mine || r == c.rank();
    }
    if (mine) return check_group(rs, c.rank(), c.size(), op);
  }
  throw ArgumentError(op + ": no group of `ranks` holds this rank (" + std::to_string(c.rank()) +
                      ")");
}

size_t element_size(const ffi::AnyBuffer& b) {
  size_t n = b.element_count();
  return n ? b.size_bytes() / n : 0;
}

std::atomic<uint64_t> inside_ns{0};   // ffi_seconds

// f run, with every failure an XLA error; the order token written; its time counted.
template <typename F>
ffi::Error guarded(ffi::Result<ffi::AnyBuffer>& order_out, F f) {
  auto t0 = std::chrono::steady_clock::now();
  struct Count {
    std::chrono::steady_clock::time_point t0;
    ~Count() {
      inside_ns.fetch_add(uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
          std::chrono::steady_clock::now() - t0).count()), std::memory_order_relaxed);
    }
  } count{t0};
  try {
    f();
  } catch (const CollectiveError& e) {
    return ffi::Error(ffi::ErrorCode::kAborted, std::string("autopar CollectiveError: ") + e.what());
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, std::string("autopar: ") + e.what());
  }
  if (order_out->size_bytes() >= sizeof(int32_t)) {
    int32_t zero = 0;
    std::memcpy(order_out->untyped_data(), &zero, sizeof zero);
  }
  return ffi::Error::Success();
}

void copy_if_apart(const ffi::AnyBuffer& x, ffi::Result<ffi::AnyBuffer>& y) {
  if (y->untyped_data() != x.untyped_data() && x.size_bytes())
    std::memcpy(y->untyped_data(), x.untyped_data(), x.size_bytes());
}

// An all-reduce of n elements of x's type checked and bound: run(c, data) reduces data in place.
struct BoundAllReduce {
  AllReduceFn fn;
  Group g;
  size_t n;
  DType t;
  ReduceOp r;
  Comm::Call call;
  void run(Comm& c, void* data) const {
    c.set_call(call);
    fn(c, g, data, n, t, r);
  }
};

BoundAllReduce bind_all_reduce_once(Comm& c, const ffi::AnyBuffer& x, Ranks ranks,
                                    int64_t group, std::string_view op,
                                    std::string_view algorithm) {
  std::string alg(algorithm), o(op);
  auto it = allreduce_algorithms().find(alg);
  if (it == allreduce_algorithms().end())
    throw ArgumentError("all_reduce: algorithm='" + alg + "' is not one of the custom call's "
                        "(autopar._native.ALLREDUCE_ALGORITHMS)");
  DType t = dtype_of(x.element_type(), "all_reduce: input");
  ReduceOp r = reduce_op(o, "all_reduce");
  Group g = group_of(c, ranks, group, "all_reduce");
  size_t n = x.element_count();
  Comm::Call call{"all_reduce(" + alg + ", " + std::to_string(n) + " x " + dtype_name(t) + ")",
                  uint64_t(x.size_bytes()),
                  call_signature("all_reduce/" + alg + "/" + dtype_name(t) + "/" + o, &g)};
  return {it->second, g, n, t, r, call};
}

// A call site's all-reduce, bound once (Gloo's construct once, run many): the checks, the group
// and the signature hash are done on a site's first call; each later call of the same site
// (the same communicator, attributes and operand) finds it by comparing those, which allocates
// nothing and hashes nothing. Per thread (a site runs on whichever thread XLA gives it) and
// bounded (a thread that met more sites starts over).
struct AllReduceSite {
  int64_t handle, group;
  size_t n;
  ffi::DataType type;
  std::string op, algorithm;
  std::vector<int64_t> ranks;
  BoundAllReduce bound;
  bool is(int64_t h, const ffi::AnyBuffer& x, Ranks rs, int64_t grp, std::string_view o,
          std::string_view alg) const {
    return handle == h && group == grp && n == x.element_count() && type == x.element_type() &&
           op == o && algorithm == alg && ranks.size() == rs.size() &&
           std::equal(ranks.begin(), ranks.end(), rs.begin());
  }
};
constexpr size_t kSitesPerThread = 1024;

const BoundAllReduce& bind_all_reduce(Comm& c, int64_t handle, const ffi::AnyBuffer& x,
                                      Ranks ranks, int64_t group, std::string_view op,
                                      std::string_view algorithm) {
  thread_local std::vector<AllReduceSite> sites;
  for (const AllReduceSite& s : sites)
    if (s.is(handle, x, ranks, group, op, algorithm)) return s.bound;
  if (sites.size() >= kSitesPerThread) sites.clear();
  if (sites.empty()) sites.reserve(kSitesPerThread);   // references stay valid until a clear
  BoundAllReduce b = bind_all_reduce_once(c, x, ranks, group, op, algorithm);
  sites.push_back({handle, group, x.element_count(), x.element_type(), std::string(op),
                   std::string(algorithm), std::vector<int64_t>(ranks.begin(), ranks.end()),
                   std::move(b)});
  return sites.back().bound;
}

// The communicator of `handle`, with no started collective still running on its thread (a
// collective on this thread must not share the links with one there).
Comm& idle_comm(int64_t handle) {
  Comm& c = registered_comm(handle);
  inflight_of(c).drain();
  return c;
}

ffi::Error AllReduce(ffi::AnyBuffer x, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> y,
                     ffi::Result<ffi::AnyBuffer> order, int64_t handle, Ranks ranks, int64_t group,
                     std::string_view op, std::string_view algorithm) {
  return guarded(order, [&] {
    Comm& c = idle_comm(handle);
    const BoundAllReduce& b = bind_all_reduce(c, handle, x, ranks, group, op, algorithm);
    if (y->size_bytes() != x.size_bytes()) throw ArgumentError("all_reduce: output size differs");
    copy_if_apart(x, y);
    b.run(c, y->untyped_data());
  });
}

// all_reduce_start: x copied and its all-reduce queued on the communicator's thread (inflight.h);
// out: the id all_reduce_done takes.
ffi::Error AllReduceStart(ffi::AnyBuffer x, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> id,
                          ffi::Result<ffi::AnyBuffer> order, int64_t handle, Ranks ranks,
                          int64_t group,
                          std::string_view op, std::string_view algorithm) {
  return guarded(order, [&] {
    Comm& c = registered_comm(handle);
    BoundAllReduce b = bind_all_reduce(c, handle, x, ranks, group, op, algorithm);  // a copy:
    // the started call outlives this thread's next binds
    if (id->size_bytes() != sizeof(int32_t))
      throw ArgumentError("all_reduce_start: the id output must be one int32");
    int32_t k = int32_t(inflight_of(c).start(x.untyped_data(), x.size_bytes(),
                                             [&c, b](void* data) { b.run(c, data); }));
    std::memcpy(id->untyped_data(), &k, sizeof k);
  });
}

// all_reduce_done: waits for the started all-reduce `id` and writes its result; `after` is
// not read: the step passes a value computed after the start, so XLA cannot move the wait
// before the compute it should overlap.
ffi::Error AllReduceDone(ffi::AnyBuffer id, ffi::AnyBuffer, ffi::AnyBuffer,
                         ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> order,
                         int64_t handle) {
  return guarded(order, [&] {
    Comm& c = registered_comm(handle);
    if (id.size_bytes() != sizeof(int32_t))
      throw ArgumentError("all_reduce_done: the id must be one int32 (all_reduce_start's)");
    int32_t k;
    std::memcpy(&k, id.untyped_data(), sizeof k);
    inflight_of(c).wait(k, y->untyped_data(), y->size_bytes());
  });
}

ffi::Error AllGather(ffi::AnyBuffer x, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> y,
                     ffi::Result<ffi::AnyBuffer> order, int64_t handle, Ranks ranks,
                     int64_t group) {
  return guarded(order, [&] {
    Comm& c = idle_comm(handle);
    Group g = group_of(c, ranks, group, "all_gather");
    if (y->size_bytes() != x.size_bytes() * size_t(g.size()))
      throw ArgumentError("all_gather: the output must hold group size x the input");
    size_t n = x.element_count(), es = element_size(x);
    c.set_call({"all_gather(" + std::to_string(n) + " elements)", uint64_t(x.size_bytes()),
                call_signature("all_gather/" + std::to_string(es), &g)});
    if (reaches_all(c, g) && x.size_bytes() >= kDirectCopyMin)
      allgather_direct(c, g, x.untyped_data(), y->untyped_data(), n, es);
    else
      allgather_ring(c, g, x.untyped_data(), y->untyped_data(), n, es);
  });
}

ffi::Error ReduceScatter(ffi::AnyBuffer x, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> y,
                         ffi::Result<ffi::AnyBuffer> order, int64_t handle, Ranks ranks,
                         int64_t group,
                         std::string_view op) {
  return guarded(order, [&] {
    Comm& c = idle_comm(handle);
    std::string o(op);
    DType t = dtype_of(x.element_type(), "reduce_scatter: input");
    ReduceOp r = reduce_op(o, "reduce_scatter");
    Group g = group_of(c, ranks, group, "reduce_scatter");
    size_t n = x.element_count();
    Blocks b(n, g.size());
    if (y->element_count() != b.len[size_t(g.me)])
      throw ArgumentError("reduce_scatter: the output must hold this rank's block");
    c.set_call({"reduce_scatter(" + std::to_string(n) + " x " + dtype_name(t) + ")",
                uint64_t(x.size_bytes()),
                call_signature(std::string("reduce_scatter/") + dtype_name(t) + "/" + o, &g)});
    reduce_scatter_ring(c, g, x.untyped_data(), y->untyped_data(), n, t, r);
  });
}

ffi::Error AllToAll(ffi::AnyBuffer x, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> y,
                    ffi::Result<ffi::AnyBuffer> order, int64_t handle, Ranks ranks, int64_t group) {
  return guarded(order, [&] {
    Comm& c = idle_comm(handle);
    Group g = group_of(c, ranks, group, "all_to_all");
    size_t n = x.element_count(), es = element_size(x);
    if (y->size_bytes() != x.size_bytes() || n % size_t(g.size()))
      throw ArgumentError("all_to_all: input and output must have one size, a multiple of the "
                          "group's");
    size_t count = n / size_t(g.size());
    c.set_call({"all_to_all(" + std::to_string(n) + " elements)", uint64_t(x.size_bytes()),
                call_signature("all_to_all/" + std::to_string(es), &g)});
    if (reaches_all(c, g) && count * es >= kDirectCopyMin)
      alltoall_direct(c, g, x.untyped_data(), y->untyped_data(), count, es);
    else
      alltoall_pairwise(c, g, x.untyped_data(), y->untyped_data(), count, es);
  });
}

ffi::Error Broadcast(ffi::AnyBuffer x, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> y,
                     ffi::Result<ffi::AnyBuffer> order, int64_t handle, Ranks ranks, int64_t group,
                     int64_t root) {
  return guarded(order, [&] {
    Comm& c = idle_comm(handle);
    Group g = group_of(c, ranks, group, "broadcast");
    if (root < 0 || root >= g.size())
      throw ArgumentError("broadcast: root " + std::to_string(root) + " is outside the group");
    if (y->size_bytes() != x.size_bytes()) throw ArgumentError("broadcast: output size differs");
    copy_if_apart(x, y);
    size_t bytes = x.size_bytes();
    c.set_call({"broadcast(" + std::to_string(bytes) + " bytes from " + std::to_string(root) + ")",
                bytes, call_signature("broadcast/" + std::to_string(root), &g)});
    if (reaches_all(c, g) && bytes >= kDirectCopyMin)
      broadcast_direct(c, g, y->untyped_data(), bytes, int(root));
    else
      broadcast_chain(c, g, y->untyped_data(), bytes, int(root));
  });
}

// The peer of this rank in a transfer between `from` and `to` (pairs of ranks, from[i] sends to
// to[i]): the ranks it sends to (is_send), else the one rank it receives from.
std::vector<int> peers_of(Comm& c, Ranks from, Ranks to, bool is_send, const std::string& op) {
  if (from.size() != to.size())
    throw ArgumentError(op + ": `from` and `to` must pair ranks one to one (" +
                        std::to_string(from.size()) + " against " + std::to_string(to.size()) + ")");
  std::vector<int> out;
  for (size_t i = 0; i < from.size(); ++i) {
    int64_t me = is_send ? from[i] : to[i], peer = is_send ? to[i] : from[i];
    if (me != c.rank()) continue;
    if (peer < 0 || peer >= c.size() || peer == c.rank() || c.link_kind(int(peer)) == "none")
      throw ArgumentError(op + ": rank " + std::to_string(peer) + " is not a linked peer");
    out.push_back(int(peer));
  }
  if (!is_send && out.size() != 1)
    throw ArgumentError(op + ": rank " + std::to_string(c.rank()) + " must receive from exactly "
                        "one rank of `from`, not " + std::to_string(out.size()));
  return out;
}

// send: x copied and queued, once per rank it goes to, on this rank's send lane for that rank
// (inflight.h): the call returns at once, and sends_done waits for them.
ffi::Error Send(ffi::AnyBuffer x, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> order,
                int64_t handle, Ranks from, Ranks to) {
  return guarded(order, [&] {
    Comm& c = registered_comm(handle);
    for (int peer : peers_of(c, from, to, true, "send")) {
      Comm::Call call{"send(" + std::to_string(x.size_bytes()) + " bytes to " +
                      std::to_string(peer) + ")", uint64_t(x.size_bytes()),
                      call_signature("send/recv", nullptr)};
      size_t n = x.size_bytes();
      inflight_of(c, peer + 1).start(x.untyped_data(), n, [&c, peer, n, call](void* data) {
        c.set_call(call);
        c.send(peer, data, n);
      });
    }
  });
}

ffi::Error SendsDone(ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> order, int64_t handle) {
  return guarded(order, [&] { settle_sends(registered_comm(handle)); });
}

// recv: `after` is not read (as all_reduce_done's): a value the step computed before, so XLA
// runs that compute before it waits here.
ffi::Error Recv(ffi::AnyBuffer, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> y,
                ffi::Result<ffi::AnyBuffer> order, int64_t handle, Ranks from, Ranks to) {
  return guarded(order, [&] {
    Comm& c = idle_comm(handle);
    int peer = peers_of(c, from, to, false, "recv")[0];
    c.set_call({"recv(" + std::to_string(y->size_bytes()) + " bytes from " +
                std::to_string(peer) + ")", uint64_t(y->size_bytes()),
                call_signature("send/recv", nullptr)});
    auto t0 = std::chrono::steady_clock::now();
    c.recv(peer, y->untyped_data(), y->size_bytes());
    c.add_recv_ns(uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::steady_clock::now() - t0).count()));
  });
}

ffi::Error Barrier(ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> order, int64_t handle, Ranks ranks,
                   int64_t group) {
  return guarded(order, [&] {
    Comm& c = idle_comm(handle);
    Group g = group_of(c, ranks, group, "barrier");
    c.set_call({"barrier", 0, call_signature("barrier", &g)});
    c.barrier(g);
  });
}

// The bindings: data in and out, the order token in and out, the communicator.
auto in_out() {
  return ffi::Ffi::Bind()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>()
      .Attr<int64_t>("comm");
}

XLA_FFI_DEFINE_HANDLER(FfiAllReduce, AllReduce,
                       in_out().Attr<Ranks>("ranks").Attr<int64_t>("group")
                           .Attr<std::string_view>("op")
                           .Attr<std::string_view>("algorithm"));
XLA_FFI_DEFINE_HANDLER(FfiAllReduceStart, AllReduceStart,
                       in_out().Attr<Ranks>("ranks").Attr<int64_t>("group")
                           .Attr<std::string_view>("op")
                           .Attr<std::string_view>("algorithm"));
XLA_FFI_DEFINE_HANDLER(FfiAllReduceDone, AllReduceDone,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()
                           .Arg<ffi::AnyBuffer>()
                           .Arg<ffi::AnyBuffer>()
                           .Ret<ffi::AnyBuffer>()
                           .Ret<ffi::AnyBuffer>()
                           .Attr<int64_t>("comm"));
XLA_FFI_DEFINE_HANDLER(FfiAllGather, AllGather,
                       in_out().Attr<Ranks>("ranks").Attr<int64_t>("group"));
XLA_FFI_DEFINE_HANDLER(FfiReduceScatter, ReduceScatter,
                       in_out().Attr<Ranks>("ranks").Attr<int64_t>("group")
                           .Attr<std::string_view>("op"));
XLA_FFI_DEFINE_HANDLER(FfiAllToAll, AllToAll,
                       in_out().Attr<Ranks>("ranks").Attr<int64_t>("group"));
XLA_FFI_DEFINE_HANDLER(FfiBroadcast, Broadcast,
                       in_out().Attr<Ranks>("ranks").Attr<int64_t>("group").Attr<int64_t>("root"));
XLA_FFI_DEFINE_HANDLER(FfiSend, Send,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()
                           .Arg<ffi::AnyBuffer>()
                           .Ret<ffi::AnyBuffer>()
                           .Attr<int64_t>("comm")
                           .Attr<Ranks>("from").Attr<Ranks>("to"));
XLA_FFI_DEFINE_HANDLER(FfiSendsDone, SendsDone,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()
                           .Ret<ffi::AnyBuffer>()
                           .Attr<int64_t>("comm"));
XLA_FFI_DEFINE_HANDLER(FfiRecv, Recv,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()
                           .Arg<ffi::AnyBuffer>()
                           .Ret<ffi::AnyBuffer>()
                           .Ret<ffi::AnyBuffer>()
                           .Attr<int64_t>("comm")
                           .Attr<Ranks>("from").Attr<Ranks>("to"));
XLA_FFI_DEFINE_HANDLER(FfiBarrier, Barrier,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()
                           .Ret<ffi::AnyBuffer>()
                           .Attr<int64_t>("comm")
                           .Attr<Ranks>("ranks").Attr<int64_t>("group"));

}  // namespace

double ffi_seconds() { return 1e-9 * double(inside_ns.load(std::memory_order_relaxed)); }

std::map<std::string, void*> ffi_handlers() {
  return {{"all_reduce", reinterpret_cast<void*>(FfiAllReduce)},
          {"all_reduce_start", reinterpret_cast<void*>(FfiAllReduceStart)},
          {"all_reduce_done", reinterpret_cast<void*>(FfiAllReduceDone)},
          {"all_gather", reinterpret_cast<void*>(FfiAllGather)},
          {"reduce_scatter", reinterpret_cast<void*>(FfiReduceScatter)},
          {"all_to_all", reinterpret_cast<void*>(FfiAllToAll)},
          {"broadcast", reinterpret_cast<void*>(FfiBroadcast)},
          {"send", reinterpret_cast<void*>(FfiSend)},
          {"sends_done", reinterpret_cast<void*>(FfiSendsDone)},
          {"recv", reinterpret_cast<void*>(FfiRecv)},
          {"barrier", reinterpret_cast<void*>(FfiBarrier)}};
}

}  // namespace autopar
