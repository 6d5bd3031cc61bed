// autopar._native: the Python binding. Segment (the job's shared memory), Comm (one rank's
// collectives over numpy arrays, in place or into an output array) and the algorithm names.
// Collectives release the GIL; native CollectiveErrors become autopar.CollectiveError with
// .rank, .op and .cause.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <map>
#include <string>

#include "algorithms/algorithms.h"
#include "comm.h"
#include "shm.h"
#include "tcp.h"

namespace py = pybind11;
using namespace autopar;

namespace {

DType dtype_of(const py::array& a) {
  // kind and item size are plain fields; dtype.name is computed in Python (microseconds)
  py::dtype d = a.dtype();
  char kind = d.kind();
  ssize_t size = d.itemsize();
  if (kind == 'f' && size == 4) return DType::f32;
  if (kind == 'f' && size == 8) return DType::f64;
  if (kind == 'f' && size == 2) return DType::f16;
  if (kind == 'i' && size == 4) return DType::i32;
  if (kind == 'i' && size == 8) return DType::i64;
  std::string name = py::str(d.attr("name"));
  if (name == "bfloat16") return DType::bf16;
  throw py::type_error("autopar collectives take float32, float64, float16, bfloat16, int32 or "
                       "int64 arrays, not " + name);
}

ReduceOp op_of(const std::string& s) {
  static const std::map<std::string, ReduceOp> ops{
      {"sum", ReduceOp::sum}, {"prod", ReduceOp::prod}, {"max", ReduceOp::max}, {"min", ReduceOp::min}};
  auto it = ops.find(s);
  if (it == ops.end()) throw py::value_error("reduction must be sum, prod, max or min, not " + s);
  return it->second;
}

using AllReduce = void (*)(Comm&, const Group&, void*, size_t, DType, ReduceOp);
const std::map<std::string, AllReduce>& allreduce_algorithms() {
  static const std::map<std::string, AllReduce> m{
      {"ring", allreduce_ring}, {"halving_doubling", allreduce_halving_doubling},
      {"recursive_doubling", allreduce_recursive_doubling}, {"tree", allreduce_tree}, {"2d_ring", allreduce_2d_ring}, {"2d_torus", allreduce_2d_torus},
      {"2d_mesh", allreduce_2d_mesh}, {"direct", allreduce_direct}};
  return m;
}

char* writable(py::array& a, const char* what) {
  if (!(a.flags() & py::array::c_style) || !a.writeable())
    throw py::value_error(std::string(what) + " must be a writable C-contiguous array");
  return static_cast<char*>(a.mutable_data());
}

const char* readable(const py::array& a, const char* what) {
  if (!(a.flags() & py::array::c_style))
    throw py::value_error(std::string(what) + " must be C-contiguous");
  return static_cast<const char*>(a.data());
}

class PyComm {
 public:
  PyComm(int rank, int size, int fd, std::vector<int> hosts, double timeout, bool shm_within_hosts,
         bool direct)
      : comm_(rank, size, fd >= 0 ? ShmSegment::attach(fd) : nullptr, std::move(hosts), timeout,
              shm_within_hosts, direct) {}

  Group group(const std::vector<int>& ranks) {
    for (size_t i = 0; i < ranks.size(); ++i)
      if (ranks[i] == comm_.rank()) return Group{ranks, int(i)};
    throw py::value_error("rank " + std::to_string(comm_.rank()) + " is not in the group");
  }

  void all_reduce(py::array a, const std::vector<int>& ranks, const std::string& op,
                  const std::string& algorithm) {
    auto it = allreduce_algorithms().find(algorithm);
    if (it == allreduce_algorithms().end())
      throw py::value_error("no all-reduce algorithm " + algorithm);
    char* p = writable(a, "all_reduce buffer");
    DType t = dtype_of(a);
    ReduceOp r = op_of(op);
    Group g = group(ranks);
    size_t n = size_t(a.size());
    py::gil_scoped_release release;
    comm_.set_op("all_reduce(" + algorithm + ", " + std::to_string(n) + " x " + dtype_name(t) + ")");
    it->second(comm_, g, p, n, t, r);
  }

  void reduce_scatter(py::array in, py::array out, const std::vector<int>& ranks,
                      const std::string& op) {
    const char* src = readable(in, "reduce_scatter input");
    char* dst = writable(out, "reduce_scatter output");
    DType t = dtype_of(in);
    Group g = group(ranks);
    Blocks b(size_t(in.size()), g.size());
    if (dtype_of(out) != t || size_t(out.size()) != b.len[g.me])
      throw py::value_error("reduce_scatter output must hold this rank's block: " +
                            std::to_string(b.len[g.me]) + " elements of the input's type");
    ReduceOp r = op_of(op);
    py::gil_scoped_release release;
    comm_.set_op("reduce_scatter(" + std::to_string(in.size()) + " x " + dtype_name(t) + ")");
    reduce_scatter_ring(comm_, g, src, dst, size_t(in.size()), t, r);
  }

  void all_gather(py::array in, py::array out, const std::vector<int>& ranks) {
    const char* src = readable(in, "all_gather input");
    char* dst = writable(out, "all_gather output");
    Group g = group(ranks);
    if (out.dtype().not_equal(in.dtype()) || out.size() != in.size() * g.size())
      throw py::value_error("all_gather output must hold group size x input elements of its type");
    size_t es = size_t(in.itemsize());
    py::gil_scoped_release release;
    comm_.set_op("all_gather(" + std::to_string(in.size()) + " elements)");
    if (reaches_all(comm_, g) && size_t(in.nbytes()) >= kDirectCopyMin)
      allgather_direct(comm_, g, src, dst, size_t(in.size()), es);
    else
      allgather_ring(comm_, g, src, dst, size_t(in.size()), es);
  }

  void all_to_all(py::array in, py::array out, const std::vector<int>& ranks) {
    const char* src = readable(in, "all_to_all input");
    char* dst = writable(out, "all_to_all output");
    Group g = group(ranks);
    if (out.dtype().not_equal(in.dtype()) || out.size() != in.size() || in.size() % g.size())
      throw py::value_error("all_to_all input and output must have the same type and size, a "
                            "multiple of the group size");
    size_t es = size_t(in.itemsize());
    py::gil_scoped_release release;
    comm_.set_op("all_to_all(" + std::to_string(in.size()) + " elements)");
    size_t count = size_t(in.size() / g.size());
    if (reaches_all(comm_, g) && count * es >= kDirectCopyMin)
      alltoall_direct(comm_, g, src, dst, count, es);
    else
      alltoall_pairwise(comm_, g, src, dst, count, es);
  }

  void broadcast(py::array a, const std::vector<int>& ranks, int root) {
    char* p = writable(a, "broadcast buffer");
    Group g = group(ranks);
    if (root < 0 || root >= g.size()) throw py::value_error("broadcast root outside the group");
    size_t bytes = size_t(a.nbytes());
    py::gil_scoped_release release;
    comm_.set_op("broadcast(" + std::to_string(bytes) + " bytes from " + std::to_string(root) + ")");
    if (reaches_all(comm_, g) && bytes >= kDirectCopyMin)
      broadcast_direct(comm_, g, p, bytes, root);
    else
      broadcast_chain(comm_, g, p, bytes, root);
  }

  void send(py::array a, int peer) {
    const char* p = readable(a, "send buffer");
    size_t bytes = size_t(a.nbytes());
    py::gil_scoped_release release;
    comm_.set_op("send(" + std::to_string(bytes) + " bytes to " + std::to_string(peer) + ")");
    comm_.send(peer, p, bytes);
  }

  void recv(py::array a, int peer) {
    char* p = writable(a, "recv buffer");
    size_t bytes = size_t(a.nbytes());
    py::gil_scoped_release release;
    comm_.set_op("recv(" + std::to_string(bytes) + " bytes from " + std::to_string(peer) + ")");
    comm_.recv(peer, p, bytes);
  }

  void barrier(const std::vector<int>& ranks) {
    Group g = group(ranks);
    py::gil_scoped_release release;
    comm_.set_op("barrier");
    comm_.barrier(g);
  }

  void connect_tcp(const std::string& rendezvous, const std::string& token, const std::string& host) {
    py::gil_scoped_release release;
    comm_.set_op("tcp rendezvous");
    connect_tcp_links(comm_, rendezvous, token, host);
  }

  Comm& comm() { return comm_; }

 private:
  Comm comm_;
};

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "autopar's native collectives (C++17): shared-memory and TCP transports";
  static py::object error = py::module_::import("autopar.errors").attr("CollectiveError");
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const CollectiveError& e) {
      py::gil_scoped_acquire gil;
      py::object exc = error(e.what());
      exc.attr("rank") = e.rank();
      exc.attr("op") = e.op();
      exc.attr("cause") = e.cause();
      PyErr_SetObject(error.ptr(), exc.ptr());
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
      .def("link_kind", [](PyComm& c, int peer) { return c.comm().link_kind(peer); })
      .def_property_readonly("direct", [](PyComm& c) { return c.comm().direct(); },
                             "whether large sends are read single-copy by the receiver")
      .def_property_readonly("timeout", [](PyComm& c) { return c.comm().timeout(); },
                             "seconds a collective waits for a peer before failing")
      .def("all_reduce", &PyComm::all_reduce, py::arg("array"), py::arg("ranks"),
           py::arg("op") = "sum", py::arg("algorithm") = "ring")
      .def("reduce_scatter", &PyComm::reduce_scatter, py::arg("input"), py::arg("output"),
           py::arg("ranks"), py::arg("op") = "sum")
      .def("all_gather", &PyComm::all_gather, py::arg("input"), py::arg("output"), py::arg("ranks"))
      .def("all_to_all", &PyComm::all_to_all, py::arg("input"), py::arg("output"), py::arg("ranks"))
      .def("broadcast", &PyComm::broadcast, py::arg("array"), py::arg("ranks"), py::arg("root"))
      .def("send", &PyComm::send, py::arg("array"), py::arg("peer"))
      .def("recv", &PyComm::recv, py::arg("array"), py::arg("peer"))
      .def("barrier", &PyComm::barrier, py::arg("ranks"))
      .def("connect_tcp", &PyComm::connect_tcp, py::arg("rendezvous"), py::arg("token"),
           py::arg("host") = "127.0.0.1");

  std::vector<std::string> names;
  for (auto& kv : allreduce_algorithms()) names.push_back(kv.first);
  m.attr("ALLREDUCE_ALGORITHMS") = names;
}
