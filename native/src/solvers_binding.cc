// The Python bindings of the strategy solvers' C++ loops: autopar._native.MessagePassing
// (trws.h, TRW-S's sweeps) and autopar._native.SearchState (search_state.h, local_search's
// state loops). Planning code, no device. Every argument is checked before the C++ code reads
// it; a bad one raises autopar.NativeArgumentError naming it. SearchState's choice and slack
// arrays are the caller's, written in place, so they must be C-contiguous, writeable int64
// arrays. A sweep and a descent release the GIL. (One file: each pybind11 translation unit
// costs 15-20 s of compile time.)
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>
#include <vector>

#include "common.h"
#include "search_state.h"
#include "trws.h"

namespace py = pybind11;

namespace autopar {
namespace {

[[noreturn]] void bad(const std::string& m) { throw ArgumentError(m); }
[[noreturn]] void bad_state(const std::string& m) { bad("SearchState" + m); }

template <typename T>
using Array = py::array_t<T, py::array::c_style | py::array::forcecast>;

template <typename T>
std::vector<T> flat(const Array<T>& a) {
  return std::vector<T>(a.data(), a.data() + a.size());
}

std::string str(int64_t v) { return std::to_string(v); }

// The checks of an (n + 1) offsets array: starts at 0, never falls.
void check_offsets(const std::string& who, const char* name, const Array<int64_t>& off,
                   int64_t n) {
  if (off.size() != n + 1)
    bad(who + ": " + name + " has " + str(off.size()) + " values; it needs " + str(n + 1) +
        " (one per item and the total last)");
  if (off.data()[0] != 0) bad(who + ": " + name + "[0] must be 0");
  for (int64_t i = 0; i < n; ++i)
    if (off.data()[i + 1] < off.data()[i])
      bad(who + ": " + name + " falls at " + str(i + 1) + "; offsets never decrease");
}

// The checks of a pairwise cost graph, as MessagePassing and SearchState take it: every node
// has a strategy, edges join two distinct nodes, each matrix (twice: forward and backward)
// has sizes[u] * sizes[v] values at its offset.
void check_graph(const std::string& who, const Array<int64_t>& sizes,
                 const Array<int64_t>& edges, const Array<double>& forward,
                 const Array<double>& backward, const Array<int64_t>& offsets) {
  const int64_t n = sizes.size();
  const int64_t* sz = sizes.data();
  for (int64_t i = 0; i < n; ++i)
    if (sz[i] < 1)
      bad(who + ": sizes[" + str(i) + "] = " + str(sz[i]) +
          "; every node needs at least one strategy");
  if (edges.size() % 2 != 0)
    bad(who + ": edges has " + str(edges.size()) +
        " values; give an (edges, 2) array of node pairs");
  const int64_t m = edges.size() / 2;
  check_offsets(who, "offsets", offsets, m);
  const int64_t* e = edges.data();
  const int64_t* off = offsets.data();
  for (int64_t k = 0; k < m; ++k) {
    const int64_t u = e[2 * k], v = e[2 * k + 1];
    if (u < 0 || u >= n || v < 0 || v >= n || u == v)
      bad(who + ": edge " + str(k) + " = (" + str(u) + ", " + str(v) + "); nodes are 0.." +
          str(n - 1) + " and distinct");
    if (off[k + 1] - off[k] != sz[u] * sz[v])
      bad(who + ": edge " + str(k) + "'s matrix has " + str(off[k + 1] - off[k]) +
          " values; it needs sizes[u] * sizes[v] = " + str(sz[u] * sz[v]));
  }
  if (forward.size() != off[m] || backward.size() != off[m])
    bad(who + ": forward and backward need " + str(off[m]) +
        " values each (offsets' total); got " + str(forward.size()) + " and " +
        str(backward.size()));
}

MessagePassing make_passing(const Array<int64_t>& sizes, const Array<int64_t>& edges,
                            const Array<double>& forward, const Array<double>& backward,
                            const Array<int64_t>& offsets) {
  check_graph("MessagePassing", sizes, edges, forward, backward, offsets);
  return MessagePassing(flat(sizes), flat(edges), flat(forward), flat(backward), flat(offsets));
}

py::tuple sweep(MessagePassing& mp, const Array<double>& unary, int sweeps) {
  if (unary.size() != mp.num_values())
    bad("MessagePassing.sweep: unary has " + str(unary.size()) +
        " values; it needs one per strategy of every node, " + str(mp.num_values()));
  if (sweeps < 1) bad("MessagePassing.sweep: sweeps = " + str(sweeps) + "; give >= 1");
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

SearchState make_state(const Array<int64_t>& sizes, const Array<double>& node_costs,
                       const Array<int64_t>& edges, const Array<double>& forward,
                       const Array<double>& backward, const Array<int64_t>& offsets,
                       const Array<int64_t>& piece_off, const Array<int64_t>& piece_start,
                       const Array<int64_t>& piece_len, const Array<int64_t>& table,
                       const Array<int64_t>& table_off, const Array<int64_t>& capacity) {
  check_graph("SearchState", sizes, edges, forward, backward, offsets);
  const int64_t n = sizes.size();
  const int64_t* sz = sizes.data();
  int64_t values = 0;
  for (int64_t i = 0; i < n; ++i) values += sz[i];
  if (node_costs.size() != values)
    bad_state(": node_costs has " + str(node_costs.size()) +
              " values; it needs one per strategy, " + str(values));
  const int64_t steps = capacity.size();
  check_offsets("SearchState", "piece_off", piece_off, n);
  check_offsets("SearchState", "table_off", table_off, n);
  const int64_t pieces = piece_off.data()[n];
  if (piece_start.size() != pieces || piece_len.size() != pieces)
    bad_state(": piece_start and piece_len need " + str(pieces) + " values each (piece_off's " +
              "total); got " + str(piece_start.size()) + " and " + str(piece_len.size()));
  for (int64_t p = 0; p < pieces; ++p) {
    const int64_t a = piece_start.data()[p], l = piece_len.data()[p];
    if (a < 0 || l < 1 || a + l > steps)
      bad_state(": piece " + str(p) + " covers steps " + str(a) + ".." + str(a + l - 1) +
                "; pieces are non-empty and within the " + str(steps) + " steps of capacity");
  }
  for (int64_t x = 0; x < n; ++x) {
    const int64_t want = sz[x] * (piece_off.data()[x + 1] - piece_off.data()[x]);
    if (table_off.data()[x + 1] - table_off.data()[x] != want)
      bad_state(": node " + str(x) + "'s usage table has " +
                str(table_off.data()[x + 1] - table_off.data()[x]) +
                " values; it needs strategies x pieces = " + str(want));
  }
  if (table.size() != table_off.data()[n])
    bad_state(": table has " + str(table.size()) + " values; table_off's total is " +
              str(table_off.data()[n]));
  return SearchState(flat(sizes), flat(node_costs), flat(edges), flat(forward), flat(backward),
                     flat(offsets), flat(piece_off), flat(piece_start), flat(piece_len),
                     flat(table), flat(table_off), flat(capacity));
}

// The caller's int64 array of ``n`` values, written in place.
int64_t* in_place(py::array& a, const char* name, int64_t n) {
  if (!a.dtype().is(py::dtype::of<int64_t>()) || !(a.flags() & py::array::c_style) ||
      !a.writeable() || a.size() != n)
    bad_state(std::string(": ") + name + " must be a writeable C-contiguous int64 array of " +
              str(n) + " values (it is written in place); got " +
              std::string(py::str(a.dtype())) + " of " + str(a.size()));
  return static_cast<int64_t*>(a.mutable_data());
}

void check_choice(const SearchState& st, const int64_t* c, const std::vector<int64_t>& sizes) {
  for (int64_t x = 0; x < st.num_nodes(); ++x)
    if (c[x] < 0 || c[x] >= sizes[x])
      bad_state(": choice[" + str(x) + "] = " + str(c[x]) + "; node " + str(x) +
                " has strategies 0.." + str(sizes[x] - 1));
}

void check_order(const SearchState& st, const Array<int64_t>& order, const char* who) {
  for (int64_t i = 0; i < order.size(); ++i)
    if (order.data()[i] < 0 || order.data()[i] >= st.num_nodes())
      bad_state(who + std::string(": order[") + str(i) + "] = " + str(order.data()[i]) +
                "; nodes are 0.." + str(st.num_nodes() - 1));
}

// The binding of a SearchState walk (descend, repair): choice and slack written in place,
// the nodes visited in ``order``, for at most ``seconds``, without the GIL; returns the moves.
using Walk = int64_t (SearchState::*)(int64_t*, int64_t*, const int64_t*, int64_t, double);

auto walk(Walk method, const char* who) {
  return [method, who](SearchState& st, py::array choice, py::array slack,
                       const Array<int64_t>& order, double seconds) {
    int64_t* c = in_place(choice, "choice", st.num_nodes());
    int64_t* s = in_place(slack, "slack", st.num_steps());
    check_choice(st, c, st.sizes());
    check_order(st, order, who);
    py::gil_scoped_release release;
    return (st.*method)(c, s, order.data(), order.size(), seconds);
  };
}

}  // namespace

void bind_message_passing(py::module_& m) {
  py::class_<MessagePassing>(m, "MessagePassing",
                             "TRW-S message passing (autopar.strategies.solvers.trws)")
      .def(py::init(&make_passing), py::arg("sizes"), py::arg("edges"), py::arg("forward"),
           py::arg("backward"), py::arg("offsets"))
      .def("sweep", &sweep, py::arg("unary"), py::arg("sweeps") = 1,
           "(choice of the last forward pass, bound of the last backward pass)");
}

void bind_search_state(py::module_& m) {
  py::class_<SearchState>(m, "SearchState",
                          "local_search's state loops (autopar.strategies.solvers.search_state)")
      .def(py::init(&make_state), py::arg("sizes"), py::arg("node_costs"), py::arg("edges"),
           py::arg("forward"), py::arg("backward"), py::arg("offsets"), py::arg("piece_off"),
           py::arg("piece_start"), py::arg("piece_len"), py::arg("table"), py::arg("table_off"),
           py::arg("capacity"))
      .def("load",
           [](const SearchState& st, py::array choice, py::array slack) {
             const int64_t* c = in_place(choice, "choice", st.num_nodes());
             check_choice(st, c, st.sizes());
             st.load(c, in_place(slack, "slack", st.num_steps()));
           },
           py::arg("choice"), py::arg("slack"), "slack = capacity - the memory choice uses")
      .def("price",
           [](const SearchState& st, const Array<double>& lam) {
             if (lam.size() != st.num_steps())
               bad_state(".price: lam has " + str(lam.size()) + " values; it needs one per kept " +
                         "step, " + str(st.num_steps()));
             py::array_t<double> out(st.num_values());
             st.price(lam.data(), out.mutable_data());
             return out;
           },
           py::arg("lam"), "node costs plus memory priced at lam, flat in node order")
      .def("consistent",
           [](const SearchState& st, const Array<double>& score) {
             if (score.size() != st.num_values())
               bad_state(".consistent: score has " + str(score.size()) + " values; it needs " +
                         "one per strategy, " + str(st.num_values()));
             py::array_t<int64_t> out(st.num_nodes());
             int64_t* c = out.mutable_data();
             {
               py::gil_scoped_release release;
               st.consistent(score.data(), c);
             }
             return out;
           },
           py::arg("score"),
           "a choice keeping clear of forbidden pairs where arc consistency can (least score)")
      .def("descend", walk(&SearchState::descend, ".descend"), py::arg("choice"),
           py::arg("slack"), py::arg("order"), py::arg("seconds"),
           "1-opt from the nodes of order; moves made")
      .def("repair", walk(&SearchState::repair, ".repair"), py::arg("choice"),
           py::arg("slack"), py::arg("order"), py::arg("seconds"),
           "memory repair over the nodes of order; moves made");
}

}  // namespace autopar
