"""Build a SearchProblem from a traced Graph, and map a Solution back to candidates.

In: a Graph, a LogicalMesh, the candidate lists of its nodes, fixed argument layouts and a
``reshard_cost(src, dst, shape, dtype) -> seconds`` function (the redistribution planner's),
the per-device memory limit and optional argument names. Out: ``Built``: the ``SearchProblem`` plus what is needed to
read a Solution back (``assignment``).

Problem nodes are the graph inputs (arguments; their candidates are the layouts they may be
kept in: a fixed one, or every non-partial layout) and the graph's operators. Node cost =
compute time of the candidate (cost_model) plus, for a graph result, the time to make it
replicated. Usage = the local bytes of the node's output(s); the live interval runs from the
producing step to the last reading step (arguments and results: the whole step). Edge (u, v)
per operand: cost matrix ``reshard(out layout of u's candidate -> in layout v's candidate
reads)``, computed once per distinct layout pair; per state pair (argument, producer of its
new value): 0 where the layouts agree, ``STATE_PENALTY`` elsewhere.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from autopar.graph import Value, type_str
from autopar.layout import Layout

from .candidates import Candidate
from .cost_model import compute_time, local_bytes, output_bytes
from .problem import SearchProblem


# Seconds charged when a returned state leaf (a new parameter, new optimizer state) is produced
# in a layout other than its argument's (the next step would have to reshard it), and when an
# operator reads a state argument through a collective (gathering a parameter before use).
# Both are optimizer parallelism (ZeRO / FSDP, issue 5), not plain auto_parallel: state is
# stored as its operators read it, as MindSpore does without its parallel optimizer. A soft
# constraint: a plan breaks it only when nothing else fits the memory cap. Returned state is
# charged its gather like every result: the step returns it replicated.
STATE_PENALTY = 1e6


def _state_read(seconds: float) -> float:
    return seconds + STATE_PENALTY if seconds > 0 else seconds


def live_intervals(graph):
    """``(inputs, nodes)``: half-open live steps of each graph input and of each node's outputs.
    Step 0 holds the arguments, step k + 1 runs node k; a value lives from its producing step to
    its last reading step; arguments and results live for the whole step."""
    steps = len(graph.nodes) + 1
    result_ids = {o.id for o in graph.outputs if isinstance(o, Value)}
    last_use = {}
    for k, n in enumerate(graph.nodes):
        for x in n.inputs:
            if isinstance(x, Value):
                last_use[x.id] = k + 1
    inputs = [(0, steps)] * len(graph.inputs)
    nodes = []
    for k, n in enumerate(graph.nodes):
        if any(v.id in result_ids for v in n.outputs):
            nodes.append((k + 1, steps))
        else:
            nodes.append((k + 1, max([last_use.get(v.id, 0) for v in n.outputs] + [k + 1]) + 1))
    return inputs, nodes


def memory_profile(graph, choice, input_layouts, mesh) -> np.ndarray:
    """Bytes live on one device at every step for a chosen strategy."""
    ins, nodes = live_intervals(graph)
    prof = np.zeros(len(graph.nodes) + 2, np.int64)
    for (s, e), v, l in zip(ins, graph.inputs, input_layouts):
        prof[s] += local_bytes(l, v, mesh)
        prof[e] -= local_bytes(l, v, mesh)
    for (s, e), n in zip(nodes, graph.nodes):
        b = output_bytes(n, choice[n.id], mesh)
        prof[s] += b
        prof[e] -= b
    return np.cumsum(prof)[:-1]


def arg_layouts(value, mesh, picks=None) -> list[Layout]:
    """Every non-partial layout of an argument (axes on one dimension in mesh order); ``picks``
    (per combination, per mesh axis of size > 1: None or a dimension) restricts them."""
    axes = [a for a, s in zip(mesh.axis_names, mesh.shape) if s > 1]
    if picks is None:
        picks = itertools.product([None, *range(len(value.shape))], repeat=len(axes))
    out = []
    for pick in picks:
        dims = tuple(tuple(a for a, d in zip(axes, pick) if d == i) for i in range(len(value.shape)))
        lay = Layout(dims)
        if all(s % c == 0 for s, c in zip(value.shape, lay.splits(mesh))):
            out.append(lay)
    return out


@dataclass(frozen=True, eq=False)
class Built:
    problem: SearchProblem
    graph: object
    arg_options: tuple        # per graph input: its candidate layouts
    cands: dict               # node id -> candidate list

    def assignment(self, choice):
        """(node id -> Candidate, input layouts) for a Solution's choice."""
        n_in = len(self.graph.inputs)
        inputs = tuple(opts[c] for opts, c in zip(self.arg_options, choice[:n_in]))
        nodes = {n.id: self.cands[n.id][c] for n, c in zip(self.graph.nodes, choice[n_in:])}
        return nodes, inputs


def build_problem(graph, mesh, cands, fixed_args, reshard_cost, usage_limit=None,
                  name="autopar", arg_names=None, arg_options=None, state_pairs=()) -> Built:
    """The SearchProblem of ``graph`` (see the module docstring). ``arg_options`` (per graph
    input, its candidate layouts) overrides the fixed/every-layout default. ``state_pairs``:
    (graph input, graph output) positions of state the step threads through (new parameters,
    new optimizer state): see ``STATE_PENALTY``. Costs, usages and edge matrices are computed
    once per distinct (operator signature, candidate list) and shared, read-only, by every node
    and edge that repeats them (the layers of a deep model)."""
    n_in = len(graph.inputs)
    in_iv, node_iv = live_intervals(graph)
    index = {v.id: i for i, v in enumerate(graph.inputs)}          # value id -> (problem node)
    out_index = {}                                                 # value id -> output position
    for k, n in enumerate(graph.nodes):
        for j, v in enumerate(n.outputs):
            index[v.id] = n_in + k
            out_index[v.id] = j
    state_args = {i for i, _ in state_pairs}
    result_ids = {o.id for o in graph.outputs if isinstance(o, Value)}
    if arg_options is None:
        arg_options = tuple([fixed_args[i]] if i in fixed_args else arg_layouts(v, mesh)
                            for i, v in enumerate(graph.inputs))
    memo: dict = {}

    def shared(key, make):
        if key not in memo:
            arr = make()
            arr.setflags(write=False)
            memo[key] = arr
        return memo[key]

    def to_replicated(layouts, v):
        return _by_layout(layouts, lambda l: reshard_cost(l, Layout.replicated(len(v.shape)),
                                                          v.shape, v.dtype))

    costs, usages, intervals, names = [], [], [], []
    src_keys = []                    # per problem node: its key as an edge source
    for i, v in enumerate(graph.inputs):
        opts = arg_options[i]
        key = ("arg", type_str(v.shape, v.dtype), id(opts))
        res = v.id in result_ids
        costs.append(shared(key + ("cost", res), lambda: to_replicated(opts, v) if res
                            else np.zeros(len(opts))))
        usages.append(shared(key + ("usage",), lambda: np.array(
            [local_bytes(l, v, mesh) for l in opts], np.int64)))
        intervals.append(in_iv[i])
        names.append(f"argument {arg_names[i] if arg_names else i}")
        src_keys.append(key)
    sigs = [n.signature for n in graph.nodes]
    for k, n in enumerate(graph.nodes):
        cs = cands[n.id]
        key = (sigs[k], id(cs))
        res = tuple(v.id in result_ids for v in n.outputs)

        def node_cost(n=n, cs=cs, res=res):
            c = np.array([compute_time(n, cand, mesh) for cand in cs])
            for j, v in enumerate(n.outputs):
                if res[j]:
                    c += to_replicated([cand.out_layouts[j] for cand in cs], v)
            return c
        costs.append(shared(key + ("cost", res), node_cost))
        usages.append(shared(key + ("usage",), lambda n=n, cs=cs: np.array(
            [output_bytes(n, cand, mesh) for cand in cs], np.int64)))
        intervals.append(node_iv[k])
        names.append(f"{n.name} ({n.source})" if n.source else n.name)
        src_keys.append(key)

    edges, ecosts = [], []
    for k, n in enumerate(graph.nodes):
        v_idx = n_in + k
        for pos, x in enumerate(n.inputs):
            if not isinstance(x, Value):
                continue
            u_idx = index[x.id]
            if u_idx < n_in:
                src, j = arg_options[u_idx], 0
            else:
                j = out_index[x.id]
                src = [cand.out_layouts[j] for cand in cands[graph.nodes[u_idx - n_in].id]]
            dst = cands[n.id]
            state = u_idx in state_args
            edges.append((u_idx, v_idx))
            ecosts.append(shared(("edge", src_keys[u_idx], j, src_keys[v_idx], pos, state), lambda: _matrix(
                src, [cand.in_layouts[pos] for cand in dst],
                lambda s, d: _state_read(reshard_cost(s, d, x.shape, x.dtype)) if state
                else reshard_cost(s, d, x.shape, x.dtype))))
    for i, j in state_pairs:
        o = graph.outputs[j]
        if not isinstance(o, Value) or o.id not in out_index:
            continue                       # a constant, or the argument returned unchanged
        v_idx, k = index[o.id], out_index[o.id]
        dst = cands[graph.nodes[v_idx - n_in].id]
        edges.append((i, v_idx))
        ecosts.append(shared(("state", src_keys[i], src_keys[v_idx], k), lambda: _matrix(
            arg_options[i], [cand.out_layouts[k] for cand in dst],
            lambda a, b: 0.0 if a == b else STATE_PENALTY)))
    problem = SearchProblem(tuple(costs), tuple(usages), np.array(intervals, np.int64).reshape(-1, 2),
                            np.array(edges, np.int64).reshape(-1, 2), tuple(ecosts), usage_limit,
                            name, tuple(names))
    return Built(problem, graph, arg_options, dict(cands))


def _by_layout(layouts, f) -> np.ndarray:
    memo = {}
    return np.array([memo[l] if l in memo else memo.setdefault(l, f(l)) for l in layouts])


def _matrix(src, dst, f) -> np.ndarray:
    us, ui = np.unique(np.array([str(l) for l in src]), return_inverse=True)
    ds, di = np.unique(np.array([str(l) for l in dst]), return_inverse=True)
    first_s = {s: src[i] for i, s in reversed(list(enumerate(str(l) for l in src)))}
    first_d = {d: dst[i] for i, d in reversed(list(enumerate(str(l) for l in dst)))}
    small = np.array([[f(first_s[s], first_d[d]) for d in ds] for s in us]).reshape(len(us), len(ds))
    return small[np.ix_(ui, di)]
