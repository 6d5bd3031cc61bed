// autopar._native: the Python binding. Segment (the job's shared memory), Comm (one rank's
// collectives over numpy arrays, in place or into an output array) and the algorithm names.
// Every argument is checked here before the C++ code uses it (checks.h: ranks, sizes, the
// segment's descriptor, hosts, timeout, groups, roots, peers, arrays); a bad one raises
// autopar.NativeArgumentError naming the argument and its valid range, and nothing moves.
// Collectives release the GIL; native CollectiveErrors become autopar.CollectiveError with
// .rank, .op and .cause.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <map>
#include <optional>
#include <string>

#include "algorithms/algorithms.h"
#include "calls.h"
#include "checks.h"
#include "comm.h"
#include "shm.h"
#include "tcp.h"

namespace py = pybind11;
using namespace autopar;

namespace autopar {
void bind_message_passing(py::module_& m);  // solvers_binding.cc
void bind_search_state(py::module_& m);     // solvers_binding.cc
}

namespace {

[[noreturn]] void bad(const std::string& m) { throw ArgumentError(m); }

constexpr uint64_t kItemHasObject = 0x01;     // numpy's NPY_ITEM_HASOBJECT descriptor flag

// The element type of a reduction's array: one of the six the kernels know, in this machine's
// byte order; anything else is an error (never a default).
DType dtype_of(const py::array& a, const std::string& what) {
  // kind and item size are plain fields; dtype.name is computed in Python (microseconds)
  py::dtype d = a.dtype();
  char kind = d.kind();
  ssize_t size = d.itemsize();
  if (d.byteorder() == '>')
    bad(what + " has a big-endian dtype (" + std::string(py::str(d)) + "); convert it with "
        "astype(its native-order dtype) first");
  if (kind == 'f' && size == 4) return DType::f32;
  if (kind == 'f' && size == 8) return DType::f64;
  if (kind == 'f' && size == 2) return DType::f16;
  if (kind == 'i' && size == 4) return DType::i32;
  if (kind == 'i' && size == 8) return DType::i64;
  std::string name = py::str(d.attr("name"));
  if (name == "bfloat16") return DType::bf16;
  bad(what + " must be a float32, float64, float16, bfloat16, int32 or int64 array to be "
      "reduced, not " + name);
}

// Copy collectives move bytes, so any dtype works but one holding Python objects (pointers
// into this process, meaningless in another).
void check_copyable(const py::array& a, const std::string& what) {
  py::dtype d = a.dtype();
  if (d.kind() == 'O' || (d.flags() & kItemHasObject))
    bad(what + " holds Python objects (dtype " + std::string(py::str(d)) + "); only arrays of "
        "numbers can be sent to another process");
}

// The layout every buffer needs: C-contiguous (the collectives see flat bytes) and aligned to
// its element size (the reductions load whole elements).
void check_layout(const py::array& a, const std::string& what) {
  if (!(a.flags() & py::array::c_style))
    bad(what + " must be C-contiguous (pass np.ascontiguousarray(x))");
  if (!(a.flags() & py::detail::npy_api::NPY_ARRAY_ALIGNED_))
    bad(what + " must be aligned to its element size (pass a copy: x.copy())");
}

char* writable(py::array& a, const std::string& what) {
  check_layout(a, what);
  if (!a.writeable()) bad(what + " must be writable (it receives the result)");
  return static_cast<char*>(a.mutable_data());
}

const char* readable(const py::array& a, const std::string& what) {
  check_layout(a, what);
  return static_cast<const char*>(a.data());
}

// An output that shares bytes with its input would be overwritten while it is read.
void check_apart(const py::array& in, const py::array& out, const std::string& op) {
  auto lo = [](const py::array& a) { return reinterpret_cast<uintptr_t>(a.data()); };
  if (lo(in) < lo(out) + size_t(out.nbytes()) && lo(out) < lo(in) + size_t(in.nbytes()))
    bad(op + ": input and output share memory; pass separate arrays");
}

// A copy collective's dtype in the signature: kind and item size (dtype.name costs a Python call).
std::string type_tag(const py::array& a) {
  return std::string(1, a.dtype().kind()) + std::to_string(a.itemsize());
}

class PyComm {
 public:
  PyComm(int rank, int size, int fd, std::vector<int> hosts, double timeout, bool shm_within_hosts,
         bool direct)
      // hosts is copied, not moved: the copy may be made before segment() checks it
      : comm_(rank, size, segment(rank, size, fd, hosts, timeout), hosts, timeout,
              shm_within_hosts, direct) {
    handle_ = register_comm(&comm_);
  }
  ~PyComm() { unregister_comm(&comm_); }
  PyComm(const PyComm&) = delete;
  PyComm& operator=(const PyComm&) = delete;

  // What a custom call names this communicator by (xla_ffi.cc), valid while it lives.
  int64_t ffi_handle() const { return handle_; }

  Group group(const std::vector<int>& ranks, const std::string& op) {
    return check_group(ranks, comm_.rank(), comm_.size(), op);
  }

  void all_reduce(py::array a, const std::vector<int>& ranks, const std::string& op,
                  const std::string& algorithm, const std::vector<int>& reducers) {
    bool server = algorithm == "reduction_server";
    auto it = allreduce_algorithms().find(algorithm);
    if (!server && it == allreduce_algorithms().end())
      bad("all_reduce: algorithm='" + algorithm + "' is not one of autopar._native."
          "ALLREDUCE_ALGORITHMS or 'reduction_server'");
    if (server != !reducers.empty())
      bad(server ? "all_reduce: algorithm='reduction_server' needs reducers: the ranks that "
                   "run serve_reductions"
                 : "all_reduce: reducers are for algorithm='reduction_server' only");
    if (server) reducer_ranks(reducers, ranks, "all_reduce");
    char* p = writable(a, "all_reduce: array");
    DType t = dtype_of(a, "all_reduce: array");
    ReduceOp r = reduce_op(op, "all_reduce");
    Group g = group(ranks, "all_reduce");
    size_t n = size_t(a.size());
    uint64_t sig = call_signature("all_reduce/" + algorithm + "/" + dtype_name(t) + "/" + op, &g);
    py::gil_scoped_release release;
    comm_.set_call({"all_reduce(" + algorithm + ", " + std::to_string(n) + " x " + dtype_name(t) + ")",
                    uint64_t(a.nbytes()), sig});
    if (server)
      allreduce_reduction_server(comm_, g, reducers, p, n, t, r);
    else
      it->second(comm_, g, p, n, t, r);
  }

  size_t serve_reductions(const std::vector<int>& workers, const std::vector<int>& reducers) {
    reducer_ranks(reducers, workers, "serve_reductions");
    if (!std::count(reducers.begin(), reducers.end(), comm_.rank()))
      bad("serve_reductions: this rank (" + std::to_string(comm_.rank()) + ") is not in reducers");
    // the workers' group, as theirs: this rank is not in it (check it with this rank added)
    std::vector<int> with_me = workers;
    with_me.push_back(comm_.rank());
    check_group(with_me, comm_.rank(), comm_.size(), "serve_reductions");
    for (int w : workers) check_linked(w, "serve_reductions");
    Group g{workers, -1};
    py::gil_scoped_release release;
    comm_.set_op("serve_reductions");
    return autopar::serve_reductions(comm_, g, reducers);
  }

  void release_reducers(const std::vector<int>& reducers, const std::vector<int>& workers) {
    reducer_ranks(reducers, workers, "release_reducers");
    group(workers, "release_reducers");
    py::gil_scoped_release release;
    comm_.set_op("release_reducers");
    autopar::release_reducers(comm_, reducers);
  }

  void reduce_scatter(py::array in, py::array out, const std::vector<int>& ranks,
                      const std::string& op) {
    const char* src = readable(in, "reduce_scatter: input");
    char* dst = writable(out, "reduce_scatter: output");
    DType t = dtype_of(in, "reduce_scatter: input");
    Group g = group(ranks, "reduce_scatter");
    Blocks b(size_t(in.size()), g.size());
    if (out.dtype().not_equal(in.dtype()) || size_t(out.size()) != b.len[size_t(g.me)])
      bad("reduce_scatter: output must hold this rank's block of the input: " +
          std::to_string(b.len[size_t(g.me)]) + " elements of the input's dtype, not " +
          std::to_string(out.size()) + " of " + std::string(py::str(out.dtype())));
    check_apart(in, out, "reduce_scatter");
    ReduceOp r = reduce_op(op, "reduce_scatter");
    uint64_t sig = call_signature(std::string("reduce_scatter/") + dtype_name(t) + "/" + op, &g);
    py::gil_scoped_release release;
    comm_.set_call({"reduce_scatter(" + std::to_string(in.size()) + " x " + dtype_name(t) + ")",
                    uint64_t(in.nbytes()), sig});
    reduce_scatter_ring(comm_, g, src, dst, size_t(in.size()), t, r);
  }

  void all_gather(py::array in, py::array out, const std::vector<int>& ranks) {
    const char* src = readable(in, "all_gather: input");
    char* dst = writable(out, "all_gather: output");
    check_copyable(in, "all_gather: input");
    Group g = group(ranks, "all_gather");
    if (out.dtype().not_equal(in.dtype()) || out.size() % g.size() != 0 ||
        out.size() / g.size() != in.size())
      bad("all_gather: output must hold group size x input elements (" + std::to_string(g.size()) +
          " x " + std::to_string(in.size()) + ") of the input's dtype, not " +
          std::to_string(out.size()) + " of " + std::string(py::str(out.dtype())));
    check_apart(in, out, "all_gather");
    size_t es = size_t(in.itemsize());
    uint64_t sig = call_signature("all_gather/" + type_tag(in), &g);
    py::gil_scoped_release release;
    comm_.set_call({"all_gather(" + std::to_string(in.size()) + " elements)", uint64_t(in.nbytes()),
                    sig});
    if (reaches_all(comm_, g) && size_t(in.nbytes()) >= kDirectCopyMin)
      allgather_direct(comm_, g, src, dst, size_t(in.size()), es);
    else
      allgather_ring(comm_, g, src, dst, size_t(in.size()), es);
  }

  void all_to_all(py::array in, py::array out, const std::vector<int>& ranks) {
    const char* src = readable(in, "all_to_all: input");
    char* dst = writable(out, "all_to_all: output");
    check_copyable(in, "all_to_all: input");
    Group g = group(ranks, "all_to_all");
    if (out.dtype().not_equal(in.dtype()) || out.size() != in.size() || in.size() % g.size())
      bad("all_to_all: input and output must have the same dtype and size, a multiple of the "
          "group size " + std::to_string(g.size()) + " (input " + std::to_string(in.size()) +
          ", output " + std::to_string(out.size()) + " elements)");
    check_apart(in, out, "all_to_all");
    size_t es = size_t(in.itemsize());
    uint64_t sig = call_signature("all_to_all/" + type_tag(in), &g);
    py::gil_scoped_release release;
    comm_.set_call({"all_to_all(" + std::to_string(in.size()) + " elements)", uint64_t(in.nbytes()),
                    sig});
    size_t count = size_t(in.size() / g.size());
    if (reaches_all(comm_, g) && count * es >= kDirectCopyMin)
      alltoall_direct(comm_, g, src, dst, count, es);
    else
      alltoall_pairwise(comm_, g, src, dst, count, es);
  }

  void broadcast(py::array a, const std::vector<int>& ranks, int root) {
    char* p = writable(a, "broadcast: array");
    check_copyable(a, "broadcast: array");
    Group g = group(ranks, "broadcast");
    check_root(root, g.size(), "broadcast");
    size_t bytes = size_t(a.nbytes());
    uint64_t sig = call_signature("broadcast/" + type_tag(a) + "/" + std::to_string(root), &g);
    py::gil_scoped_release release;
    comm_.set_call({"broadcast(" + std::to_string(bytes) + " bytes from " + std::to_string(root) + ")",
                    bytes, sig});
    if (reaches_all(comm_, g) && bytes >= kDirectCopyMin)
      broadcast_direct(comm_, g, p, bytes, root);
    else
      broadcast_chain(comm_, g, p, bytes, root);
  }

  void send(py::array a, int peer) {
    const char* p = readable(a, "send: array");
    check_copyable(a, "send: array");
    check_linked(peer, "send");
    size_t bytes = size_t(a.nbytes());
    py::gil_scoped_release release;
    comm_.set_call({"send(" + std::to_string(bytes) + " bytes to " + std::to_string(peer) + ")", bytes,
                    call_signature("send/recv", nullptr)});
    comm_.send(peer, p, bytes);
  }

  void recv(py::array a, int peer) {
    char* p = writable(a, "recv: array");
    check_copyable(a, "recv: array");
    check_linked(peer, "recv");
    size_t bytes = size_t(a.nbytes());
    py::gil_scoped_release release;
    comm_.set_call({"recv(" + std::to_string(bytes) + " bytes from " + std::to_string(peer) + ")",
                    bytes, call_signature("send/recv", nullptr)});
    comm_.recv(peer, p, bytes);
  }

  void barrier(const std::vector<int>& ranks, std::optional<double> timeout) {
    Group g = group(ranks, "barrier");
    uint64_t sig = call_signature("barrier", &g);
    if (timeout && !(*timeout > 0))
      throw std::invalid_argument("barrier: timeout must be a positive number of seconds");
    py::gil_scoped_release release;
    comm_.set_call({"barrier", 0, sig});
    struct Restore {              // this barrier's own timeout, the communicator's after it
      Comm& c;
      double saved;
      ~Restore() { c.set_timeout(saved); }
    } restore{comm_, comm_.timeout()};
    if (timeout) comm_.set_timeout(*timeout);
    comm_.barrier(g);
  }

  void connect_tcp(const std::string& rendezvous, const std::string& token, const std::string& host,
                   int streams) {
    check_tcp(rendezvous, token, host);
    if (streams < 1 || streams > 16)
      bad("connect_tcp: streams=" + std::to_string(streams) + " must be in [1, 16]");
    if (tcp_connected_) bad("connect_tcp: this Comm is connected already; call it once");
    tcp_connected_ = true;
    py::gil_scoped_release release;
    comm_.set_op("tcp rendezvous");
    connect_tcp_links(comm_, rendezvous, token, host, streams);
  }

  std::string link_kind(int peer) const {
    if (peer < 0 || peer >= comm_.size())
      bad("link_kind: peer=" + std::to_string(peer) + " must be in [0, " +
          std::to_string(comm_.size()) + ")");
    return comm_.link_kind(peer);
  }

  Comm& comm() { return comm_; }

 private:
  // The checked constructor arguments' segment (none for fd -1), with as many ranks as size.
  static std::shared_ptr<ShmSegment> segment(int rank, int size, int fd,
                                             const std::vector<int>& hosts, double timeout) {
    check_comm(rank, size, fd, hosts, timeout);
    if (fd < 0) return nullptr;
    std::shared_ptr<ShmSegment> s = ShmSegment::attach(fd);
    if (s->nranks() != size)
      bad("Comm: size=" + std::to_string(size) + " does not match the segment's " +
          std::to_string(s->nranks()) + " ranks (fd " + std::to_string(fd) +
          "); pass the rank count it was created with");
    return s;
  }

  void check_linked(int peer, const std::string& op) {
    check_peer(peer, comm_.rank(), comm_.size(), op);
    if (comm_.link_kind(peer) == "none")
      bad(op + ": no link to rank " + std::to_string(peer) + " (a rank of another host before "
          "connect_tcp?)");
  }

  // Checks reducers: ranks of the job, none twice, none a worker, each linked to this rank.
  void reducer_ranks(const std::vector<int>& reducers, const std::vector<int>& workers,
                     const std::string& op) {
    if (reducers.empty()) bad(op + ": reducers is empty; name the ranks that serve reductions");
    std::vector<char> seen(size_t(comm_.size()), 0);
    for (int w : workers)
      if (w >= 0 && w < comm_.size()) seen[size_t(w)] = 2;
    for (int r : reducers) {
      if (r < 0 || r >= comm_.size())
        bad(op + ": reducer " + std::to_string(r) + " is outside [0, " +
            std::to_string(comm_.size()) + ") (the job's ranks)");
      if (seen[size_t(r)])
        bad(op + ": rank " + std::to_string(r) +
            (seen[size_t(r)] == 2 ? " is both a worker and a reducer" : " appears twice in reducers"));
      seen[size_t(r)] = 1;
      if (r != comm_.rank()) check_linked(r, op);
    }
  }

  Comm comm_;
  int64_t handle_ = 0;
  bool tcp_connected_ = false;
};

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "autopar's native code (C++17): the collectives over shared memory and TCP, and "
            "TRW-S message passing for the strategy solvers";
  // held for the life of the process: a static py::object would be released after the
  // interpreter is gone
  py::module_ errors = py::module_::import("autopar.errors");
  static PyObject* collective_error = py::object(errors.attr("CollectiveError")).release().ptr();
  static PyObject* argument_error = py::object(errors.attr("NativeArgumentError")).release().ptr();
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const CollectiveError& e) {
      py::object exc = py::handle(collective_error)(e.what());
      exc.attr("rank") = e.rank();
      exc.attr("op") = e.op();
      exc.attr("cause") = e.cause();
      PyErr_SetObject(collective_error, exc.ptr());
    } catch (const ArgumentError& e) {
      PyErr_SetString(argument_error, e.what());
    }
  });

  py::class_<ShmSegment, std::shared_ptr<ShmSegment>>(m, "Segment")
      .def_static("create", &ShmSegment::create, py::arg("nranks"), py::arg("slots") = 8,
                  py::arg("slot_bytes") = 1 << 18)
      .def_property_readonly("fd", &ShmSegment::fd)
      .def_property_readonly("bytes", &ShmSegment::bytes)
      .def("abort", &ShmSegment::abort)
      .def_property_readonly("aborted", &ShmSegment::aborted)
      .def("abort_reason", &ShmSegment::abort_reason);

  py::class_<PyComm>(m, "Comm")
      .def(py::init<int, int, int, std::vector<int>, double, bool, bool>(), py::arg("rank"),
           py::arg("size"), py::arg("fd"), py::arg("hosts") = std::vector<int>(),
           py::arg("timeout") = 10.0, py::arg("shm_within_hosts") = false,
           py::arg("direct") = true)
      .def_property_readonly("rank", [](PyComm& c) { return c.comm().rank(); })
      .def_property_readonly("size", [](PyComm& c) { return c.comm().size(); })
      .def_property_readonly("host", [](PyComm& c) { return c.comm().host_of(c.comm().rank()); },
                             "this rank's host id (the 2D algorithms' hierarchy)")
      .def("link_kind", &PyComm::link_kind, py::arg("peer"))
      .def("bytes_sent", [](PyComm& c) {
             std::vector<uint64_t> out;
             for (int p = 0; p < c.comm().size(); ++p) out.push_back(c.comm().bytes_sent(p));
             return out;
           }, "per peer, the bytes this rank handed to its link to it so far (frames included; "
              "a peer's single-copy reads of this rank's memory are not counted)")
      .def_property_readonly("recv_seconds", [](PyComm& c) { return c.comm().recv_seconds(); },
                             "seconds spent in the recv custom call so far (a pipeline stage's "
                             "wait for its peers' transfers)")
      .def_property_readonly("direct", [](PyComm& c) { return c.comm().direct(); },
                             "whether large sends are read single-copy by the receiver")
      .def_property_readonly("ffi_handle", &PyComm::ffi_handle,
                             "the handle the XLA custom calls (ffi_targets) name this Comm by")
      .def_property_readonly("timeout", [](PyComm& c) { return c.comm().timeout(); },
                             "seconds a collective waits for a peer before failing")
      .def("all_reduce", &PyComm::all_reduce, py::arg("array"), py::arg("ranks"),
           py::arg("op") = "sum", py::arg("algorithm") = "ring",
           py::arg("reducers") = std::vector<int>(),
           "in place over the group `ranks`; algorithm='reduction_server' reduces through the "
           "ranks `reducers`, which run serve_reductions meanwhile")
      .def("serve_reductions", &PyComm::serve_reductions, py::arg("workers"), py::arg("reducers"),
           "serve the workers' reduction_server all-reduces until each calls release_reducers; "
           "the number served")
      .def("release_reducers", &PyComm::release_reducers, py::arg("reducers"), py::arg("workers"),
           "end the reducers' serve_reductions (every worker calls it once)")
      .def("reduce_scatter", &PyComm::reduce_scatter, py::arg("input"), py::arg("output"),
           py::arg("ranks"), py::arg("op") = "sum")
      .def("all_gather", &PyComm::all_gather, py::arg("input"), py::arg("output"), py::arg("ranks"))
      .def("all_to_all", &PyComm::all_to_all, py::arg("input"), py::arg("output"), py::arg("ranks"))
      .def("broadcast", &PyComm::broadcast, py::arg("array"), py::arg("ranks"), py::arg("root"))
      .def("send", &PyComm::send, py::arg("array"), py::arg("peer"))
      .def("recv", &PyComm::recv, py::arg("array"), py::arg("peer"))
      .def("barrier", &PyComm::barrier, py::arg("ranks"), py::arg("timeout") = py::none(),
           "wait for every rank of ranks; timeout (seconds) overrides the communicator's for this barrier")
      .def("connect_tcp", &PyComm::connect_tcp, py::arg("rendezvous"), py::arg("token"),
           py::arg("host") = "127.0.0.1", py::arg("streams") = 1,
           "connect to every rank no shared memory reaches, over `streams` TCP connections each");

  m.def("collective_seconds", &ffi_seconds,
        "seconds this process has spent inside the collectives' custom calls (moving data and "
        "waiting for peers), since it started");
  m.def("ffi_targets", [] {
    py::dict out;
    for (auto& kv : ffi_handlers()) out[py::str(kv.first)] = py::capsule(kv.second);
    return out;
  }, "name -> XLA FFI handler (a PyCapsule) of each collective as a custom call, for "
     "jax.ffi.register_ffi_target(f'autopar_{name}', capsule, platform='cpu')");

  bind_message_passing(m);
  bind_search_state(m);

  std::vector<std::string> names;
  for (auto& kv : allreduce_algorithms()) names.push_back(kv.first);
  m.attr("ALLREDUCE_ALGORITHMS") = names;
}
