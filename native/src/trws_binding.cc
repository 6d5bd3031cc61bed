// autopar._native.MessagePassing: the Python binding of trws.h (TRW-S's sweeps for the
// strategy solvers). Every argument is checked before the C++ code reads it; a bad one raises
// autopar.NativeArgumentError naming it. A sweep releases the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>
#include <vector>

#include "common.h"
#include "trws.h"

namespace py = pybind11;

namespace autopar {
namespace {

[[noreturn]] void bad(const std::string& m) { throw ArgumentError(m); }

template <typename T>
using Array = py::array_t<T, py::array::c_style | py::array::forcecast>;

template <typename T>
std::vector<T> flat(const Array<T>& a) {
  return std::vector<T>(a.data(), a.data() + a.size());
}

MessagePassing make(const Array<int64_t>& sizes, const Array<int64_t>& edges,
                    const Array<double>& forward, const Array<double>& backward,
                    const Array<int64_t>& offsets) {
  const int64_t n = sizes.size();
  for (int64_t i = 0; i < n; ++i)
    if (sizes.data()[i] < 1)
      bad("MessagePassing: sizes[" + std::to_string(i) + "] = " +
          std::to_string(sizes.data()[i]) + "; every node needs at least one strategy");
  if (edges.size() % 2 != 0)
    bad("MessagePassing: edges has " + std::to_string(edges.size()) +
        " values; give an (edges, 2) array of node pairs");
  const int64_t m = edges.size() / 2;
  if (offsets.size() != m + 1)
    bad("MessagePassing: offsets has " + std::to_string(offsets.size()) + " values for " +
        std::to_string(m) + " edges; give one per edge and the total last");
  const int64_t* e = edges.data();
  const int64_t* off = offsets.data();
  if (off[0] != 0) bad("MessagePassing: offsets[0] must be 0");
  for (int64_t k = 0; k < m; ++k) {
    const int64_t u = e[2 * k], v = e[2 * k + 1];
    if (u < 0 || u >= n || v < 0 || v >= n || u == v)
      bad("MessagePassing: edge " + std::to_string(k) + " = (" + std::to_string(u) + ", " +
          std::to_string(v) + "); nodes are 0.." + std::to_string(n - 1) + " and distinct");
    if (off[k + 1] - off[k] != sizes.data()[u] * sizes.data()[v])
      bad("MessagePassing: edge " + std::to_string(k) + "'s matrix has " +
          std::to_string(off[k + 1] - off[k]) + " values; it needs sizes[u] * sizes[v] = " +
          std::to_string(sizes.data()[u] * sizes.data()[v]));
  }
  if (forward.size() != off[m] || backward.size() != off[m])
    bad("MessagePassing: forward and backward need " + std::to_string(off[m]) +
        " values each (offsets' total); got " + std::to_string(forward.size()) + " and " +
        std::to_string(backward.size()));
  return MessagePassing(flat(sizes), flat(edges), flat(forward), flat(backward), flat(offsets));
}

py::tuple sweep(MessagePassing& mp, const Array<double>& unary, int sweeps) {
  if (unary.size() != mp.num_values())
    bad("MessagePassing.sweep: unary has " + std::to_string(unary.size()) +
        " values; it needs one per strategy of every node, " + std::to_string(mp.num_values()));
  if (sweeps < 1) bad("MessagePassing.sweep: sweeps = " + std::to_string(sweeps) + "; give >= 1");
  py::array_t<int64_t> choice(mp.num_nodes());
  int64_t* x = choice.mutable_data();
  for (int64_t i = 0; i < mp.num_nodes(); ++i) x[i] = 0;
  double bound;
  {
    py::gil_scoped_release release;
    bound = mp.sweep(unary.data(), sweeps, x);
  }
  return py::make_tuple(choice, bound);
}

}  // namespace

void bind_message_passing(py::module_& m) {
  py::class_<MessagePassing>(m, "MessagePassing",
                             "TRW-S message passing (autopar.strategies.solvers.trws)")
      .def(py::init(&make), py::arg("sizes"), py::arg("edges"), py::arg("forward"),
           py::arg("backward"), py::arg("offsets"))
      .def("sweep", &sweep, py::arg("unary"), py::arg("sweeps") = 1,
           "(choice of the last forward pass, bound of the last backward pass)");
}

}  // namespace autopar
