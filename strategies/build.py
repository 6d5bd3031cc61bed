"""Build a SearchProblem from a traced Graph, and map a Solution back to candidates.

In: a Graph, a LogicalMesh, the candidate lists of its nodes, fixed argument layouts and a
``reshard_cost(src, dst, shape, dtype) -> seconds`` function (the redistribution planner's),
the per-device memory limit and optional argument names. Out: ``Built``: the ``SearchProblem``
plus what is needed to read a Solution back (``assignment``, ``held``).

Problem nodes are the graph inputs (arguments; their candidates are the layouts they may be
kept in: a fixed one, or every non-partial layout), the operator chains of the graph (an
operator with its elementwise followers merged in: ``followers``; the followers' layouts are
functions of the head's candidate, so a chain has its head's candidates) and one *hub* per
value that several operators read (``add_hub``: its candidates are the layouts the value is
made or read in; its choice is the one layout it is converted to, once, before every read).
Node cost = compute time of the chain's members (cost_model) plus, for a graph result, the
time to make it replicated (hubs: 0). Usage = the local bytes of the outputs; the live interval
runs from the producing step to the last reading step (arguments and results: the whole step;
a value with a hub: its maker holds it one step, the hub from then to the last read). Edge
(u, v) per operand of v's head, from the operand's hub if it has one: cost matrix
``reshard(out layout of u's candidate -> in layout v's candidate reads)``, computed once per
distinct layout pair; maker -> hub: the conversion; per state pair (argument, producer of its
new value): 0 where the layouts agree, ``STATE_PENALTY`` elsewhere (or the real cost,
``StatePricing``). So moving a value into a layout is priced once however many operators read
it there, and carrying a partial sum through linear operators wins only when it is cheaper
counted that way. Last, per state argument priced at its real cost when returned, a node for
its new value as the step returns it (``add_returned``): at the last step, the bytes of the copy
gathered into the argument's layout, or none when the update already made it there.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from autopar.annotate import shard_p
from autopar.graph import Graph, Value, type_str
from autopar.layout import Layout

from .cost_model import compute_time, fused, local_bytes, output_bytes
from .problem import SearchProblem

# Seconds charged when a returned state leaf (a new parameter, new optimizer state) is produced
# in a layout other than its argument's (the next step would have to reshard it), and when an
# operator reads a state argument through a collective (gathering a parameter before use).
# Both are optimizer parallelism (ZeRO / FSDP), not plain auto_parallel: state is stored as its
# operators read it, as MindSpore does without its parallel optimizer. A soft constraint: a
# plan breaks it only when nothing else fits the memory cap. With the parallel optimizer on,
# ``StatePricing`` names the state priced at its real cost instead: the search then chooses
# ZeRO per parameter (a sharded update: the gradient reduce-scattered into it, the new value
# all-gathered back; a parameter stored sharded: gathered where it is read). Returned state
# keeps its argument's layout; every other result is charged its gather to replicated.
STATE_PENALTY = 1e6


@dataclass(frozen=True)
class StatePricing:
    """Which state arguments (graph input positions) the problem prices at their real cost
    instead of ``STATE_PENALTY``: ``returned``: producing the new value in another layout than
    the argument's (it is redistributed to the argument's layout as the step returns it);
    ``read``: reading the argument through a collective."""

    returned: frozenset = frozenset()
    read: frozenset = frozenset()


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


def arg_layouts(value, mesh, picks=None) -> list[Layout]:
    """Every non-partial layout of an argument (axes on one dimension in mesh order); ``picks``
    (per combination, per mesh axis of size > 1: None or a dimension) restricts them."""
    axes = [a for a, s in zip(mesh.axis_names, mesh.shape) if s > 1]
    if picks is None:
        picks = itertools.product([None, *range(len(value.shape))], repeat=len(axes))
    out = []
    for pick in picks:
        dims = tuple(
            tuple(a for a, d in zip(axes, pick) if d == i) for i in range(len(value.shape))
        )
        lay = Layout(dims)
        if all(s % c == 0 for s, c in zip(value.shape, lay.splits(mesh))):
            out.append(lay)
    return out


def default_arg_options(graph, mesh, fixed_args) -> tuple:
    """Per graph input, the layouts it may be kept in: its fixed one, else every non-partial
    layout (``arg_layouts``). Inputs of one shape and dtype held alike share one list object,
    as ``candidates_of`` shares a list per signature: build.py prices per shared list, so the
    parameters of a deep model's layers are priced once."""
    memo = {}

    def options(i, v):
        key = (v.shape, str(v.dtype), fixed_args.get(i))
        if key not in memo:
            memo[key] = [fixed_args[i]] if i in fixed_args else arg_layouts(v, mesh)
        return memo[key]

    return tuple(options(i, v) for i, v in enumerate(graph.inputs))


@dataclass(frozen=True, eq=False)
class Built:
    problem: SearchProblem
    graph: Graph
    arg_options: tuple  # per graph input: its candidate layouts
    cands: dict  # node id -> candidate list
    groups: tuple = ()  # per operator problem node: ((node id, per head choice: index), ...)
    hubs: tuple = ()  # per hub problem node (after the operators): (value id, layouts)
    returned: tuple = ()  # per returned-state node (after the hubs): (input, value id)

    def assignment(self, choice):
        """(node id -> Candidate, input layouts) for a Solution's choice."""
        n_in = len(self.graph.inputs)
        inputs = tuple(opts[c] for opts, c in zip(self.arg_options, choice[:n_in]))
        nodes = {
            nid: self.cands[nid][idx[c]]
            for group, c in zip(self.groups, choice[n_in:])
            for nid, idx in group
        }
        return nodes, inputs

    def choice_of(self, nodes, inputs, held):
        """The problem's choice for an assignment made elsewhere (node id -> Candidate, input
        layouts, held layouts: ``propagation.Assignment``), or None when the problem cannot
        express it. Where the assignment converts between a chain's head and its follower
        (a partial sum reduced before an elementwise operator) the chain keeps the head's
        choice and the follower its head's layout, which the lowering converts after it."""
        choice = []
        for opts, l in zip(self.arg_options, inputs):
            if l not in opts:
                return None
            choice.append(opts.index(l))
        for group in self.groups:
            (hid, hidx), n = group[0], len(group[0][1])
            c = next(
                (
                    c
                    for c in range(n)
                    if all(self.cands[nid][idx[c]] == nodes[nid] for nid, idx in group)
                ),
                next((c for c in range(n) if self.cands[hid][hidx[c]] == nodes[hid]), None),
            )
            if c is None:
                return None
            choice.append(c)
        made = lambda vid: nodes[self.graph.producer[vid].id].out_layouts[
            [v.id for v in self.graph.producer[vid].outputs].index(vid)
        ]
        for vid, layouts in self.hubs:
            lay = held.get(vid) or made(vid)
            if lay not in layouts:
                return None
            choice.append(layouts.index(lay))
        for i, vid in self.returned:
            choice.append(2 * choice[i] + (made(vid) != inputs[i]))
        return choice

    def held(self, choice, nodes) -> dict:
        """Value id -> the layout a Solution's choice converts it to before its readers read
        it (its hub's layout), for the hubs whose layout is not the one the value is made in
        (``nodes``: ``assignment``'s node choice)."""
        first = len(self.graph.inputs) + len(self.groups)
        out = {}
        for (vid, layouts), c in zip(self.hubs, choice[first:]):
            n = self.graph.producer[vid]
            made = nodes[n.id].out_layouts[[v.id for v in n.outputs].index(vid)]
            if layouts[c] != made:
                out[vid] = layouts[c]
        return out


# A follower is merged only when its own output lives at most this many steps (it feeds the
# next operator or two). A chain is one problem node with one live interval, so its usage must
# cover two members at once (a member's input dies as it runs); over a long-lived chain result
# (an activation saved for the backward pass) that would double the count under a memory cap.
SPAN = 4


def followers(graph, cands, result_ids, intervals) -> list[list[int]]:
    """The operators of ``graph`` grouped into chains (node positions, head first): a node joins
    its producer's chain when it is an elementwise follower -- one output, every operand that
    is a value is the same value ``x``, every candidate reads ``x`` in exactly the layout it
    writes, it has a candidate for every layout the chain's head may write, and its output lives
    at most ``SPAN`` steps -- and ``x`` is the single output of the chain's last node, read by
    nothing else and not a result of the step. Every other node heads its own chain. A
    follower then always keeps its producer's layout (MindSpore's elementwise followers), which
    is where the merge may cost optimality: the follower could have resharded instead."""
    readers: dict = {}
    for n in graph.nodes:
        for x in n.inputs:
            if isinstance(x, Value):
                readers.setdefault(x.id, set()).add(n.id)
    memo: dict = {}  # per shared candidate list (and operand positions)

    def written(cs):
        key = ("writes", id(cs))
        if key not in memo:
            memo[key] = frozenset(c.out_layouts[0] for c in cs)
        return memo[key]

    def keeps_layout(cs, pos):
        key = ("keeps", id(cs), pos)
        if key not in memo:
            memo[key] = all(c.in_layouts[i] == c.out_layouts[0] for c in cs for i in pos)
        return memo[key]

    chain_of: dict[int, int] = {}  # value id -> chain index
    chains: list[list[int]] = []
    writes: list[frozenset[Layout]] = []  # per chain: the layouts its head may write
    for k, n in enumerate(graph.nodes):
        c, cs = None, cands[n.id]
        if len(n.outputs) == 1 and n.prim != shard_p.name:
            xs = {x.id: x for x in n.inputs if isinstance(x, Value)}
            if len(xs) == 1:
                ((xid, x),) = xs.items()
                pos = tuple(i for i, y in enumerate(n.inputs) if isinstance(y, Value))
                if (
                    xid in chain_of
                    and readers[xid] == {n.id}
                    and xid not in result_ids
                    and intervals[k][1] - intervals[k][0] <= SPAN
                    and x.shape == n.outputs[0].shape
                    and keeps_layout(cs, pos)
                    and writes[chain_of[xid]] <= written(cs)
                ):
                    c = chain_of.pop(xid)
        if c is None:
            c = len(chains)
            chains.append([])
            writes.append(written(cs) if len(n.outputs) == 1 else frozenset())
        chains[c].append(k)
        if len(n.outputs) == 1:
            chain_of[n.outputs[0].id] = c
    return chains


def build_problem(
    graph,
    mesh,
    cands,
    fixed_args,
    reshard_cost,
    usage_limit=None,
    name="autopar",
    arg_names=None,
    arg_options=None,
    state_pairs=(),
    merge=True,
    state_pricing=StatePricing(),
    repeat=1,
    batch_inputs=frozenset(),
) -> Built:
    """The SearchProblem of ``graph`` (see the module docstring). ``arg_options`` (per graph
    input, its candidate layouts) overrides the fixed/every-layout default. ``state_pairs``:
    (graph input, graph output) positions of state the step threads through (new parameters,
    new optimizer state): see ``STATE_PENALTY`` and ``state_pricing``. ``merge``: fold
    elementwise followers into their producers (``followers``). ``repeat``: for a pipeline
    stage of that many micro-batches, the conversions from a value the same for every
    micro-batch (made from no ``batch_inputs`` position: a parameter, its bf16 copy) to an
    operator that reads the batch run once per micro-batch, and cost ``repeat`` times theirs.
    Costs, usages and edge matrices are computed once per
    distinct (operator signatures, candidate lists) and shared, read-only, by every node and
    edge that repeats them (the layers of a deep model)."""
    if arg_options is None:
        arg_options = default_arg_options(graph, mesh, fixed_args)
    b = _Builder(graph, mesh, cands, reshard_cost, arg_options, state_pairs, merge, state_pricing)
    if repeat > 1:
        b.repeat, b.varies = repeat, graph.dependents(batch_inputs)
        b.accumulate(state_pairs)
    for i, v in enumerate(graph.inputs):
        b.add_argument(i, v, f"argument {arg_names[i] if arg_names else i}")
    groups = tuple(b.add_chain(chain) for chain in b.chains)
    hubs = tuple(b.add_hub(vid, reads) for vid, reads in b.hub_reads.items())
    for g, chain in enumerate(b.chains):
        b.add_reads(len(graph.inputs) + g, graph.nodes[chain[0]])
    for i, j in state_pairs:
        b.add_state_edge(i, graph.outputs[j])
    returned = tuple(
        b.add_returned(i, graph.outputs[j])
        for i, j in state_pairs
        if i in state_pricing.returned and b.updated(i, graph.outputs[j])
    )
    problem = SearchProblem(
        tuple(b.costs),
        tuple(b.usages),
        np.array(b.intervals, np.int64).reshape(-1, 2),
        np.array(b.edges, np.int64).reshape(-1, 2),
        tuple(b.ecosts),
        usage_limit,
        name,
        tuple(b.names),
    )
    return Built(problem, graph, arg_options, dict(cands), groups, hubs, returned)


class _Builder:
    """``build_problem``'s state: the problem's nodes (``costs``, ``usages``, ``intervals``,
    ``names``; per node its key as an edge source and its output layouts per member, output
    and choice) and edges (``edges``, ``ecosts``), filled by ``add_argument``, ``add_chain``,
    ``add_reads`` and ``add_state_edge``; ``shared`` computes each distinct array once."""

    def __init__(
        self, graph, mesh, cands, reshard_cost, arg_options, state_pairs, merge, state_pricing
    ):
        self.graph, self.mesh, self.cands = graph, mesh, cands
        self.touch = fused(graph, mesh)  # node id -> what its fused kernel moves
        self.pricing = state_pricing
        self.reshard_cost, self.arg_options = reshard_cost, arg_options
        self.in_iv, self.node_iv = live_intervals(graph)
        result_ids = {o.id for o in graph.outputs if isinstance(o, Value)}
        state_out = {
            graph.outputs[j].id for _, j in state_pairs if isinstance(graph.outputs[j], Value)
        }
        self.gathered = result_ids - state_out  # results returned replicated
        self.chains = (
            followers(graph, cands, result_ids, self.node_iv)
            if merge
            else [[k] for k in range(len(graph.nodes))]
        )
        n_in = len(graph.inputs)
        self.where = {v.id: (i, 0, 0) for i, v in enumerate(graph.inputs)}  # value ->
        for g, chain in enumerate(self.chains):  # (problem node,
            for m, k in enumerate(chain):  # member, output)
                for j, v in enumerate(graph.nodes[k].outputs):
                    self.where[v.id] = (n_in + g, m, j)
        self.state_args = {i for i, _ in state_pairs}
        self.step = {n.id: k for k, n in enumerate(graph.nodes)}
        self.hub_reads = _hub_reads(graph, self.chains, result_ids)
        for vid in self.hub_reads:  # the value lives on in its hub: its maker holds it
            k = self.step[graph.producer[vid].id]  # only while it is converted
            self.node_iv[k] = (k + 1, k + 2)
        self.memo: dict = {}
        self.pair_costs: dict = {}
        self.repeat, self.varies = 1, frozenset()  # see build_problem
        self.costs, self.usages, self.intervals, self.names = [], [], [], []
        self.src_keys, self.out_layouts = [], []
        self.edges, self.ecosts = [], []

    def shared(self, key, make):
        if key not in self.memo:
            arr = make()
            if isinstance(arr, np.ndarray):
                arr.setflags(write=False)
            self.memo[key] = arr
        return self.memo[key]

    def accumulate(self, state_pairs):
        """With ``repeat`` micro-batches, a parameter's gradient is summed over them and held
        until the update at the end of the step (on a stage: from its first micro-batch's
        backward pass): the outputs of derivatives that read the batch and have a state
        argument's size (a weight's gradient, its float32 copy) live to the last step, and
        their layouts hold those bytes all along (the same weight's gradient replicated over
        the data axis is that many bytes on every device)."""
        sizes = {math.prod(self.graph.inputs[i].shape) for i, _ in state_pairs}
        end = len(self.graph.nodes) + 1
        for k, n in enumerate(self.graph.nodes):
            if (
                n.backward
                and any(isinstance(x, Value) and x.id in self.varies for x in n.inputs)
                and any(math.prod(v.shape) in sizes for v in n.outputs)
            ):
                self.node_iv[k] = (self.node_iv[k][0], end)

    def to_replicated(self, layouts, v):
        return _by_layout(
            layouts,
            lambda l: self.reshard_cost(l, Layout.replicated(len(v.shape)), v.shape, v.dtype),
        )

    def _node(self, cost, usage, interval, name, key, outs):
        self.costs.append(cost)
        self.usages.append(usage)
        self.intervals.append(interval)
        self.names.append(name)
        self.src_keys.append(key)
        self.out_layouts.append(outs)

    def add_argument(self, i, v, name):
        opts = self.arg_options[i]
        key = ("arg", type_str(v.shape, v.dtype), id(opts))
        res = v.id in self.gathered
        self._node(
            self.shared(
                key + ("cost", res),
                lambda: self.to_replicated(opts, v) if res else np.zeros(len(opts)),
            ),
            self.shared(
                key + ("usage",),
                lambda: np.array([local_bytes(l, v, self.mesh) for l in opts], np.int64),
            ),
            self.in_iv[i],
            name,
            key,
            [[opts]],
        )

    def add_chain(self, chain) -> tuple:
        """One problem node for a chain of operators; its ((node id, index per choice), ...)."""
        nodes = [self.graph.nodes[k] for k in chain]
        res = tuple(v.id in self.gathered for n in nodes for v in n.outputs)
        key = tuple((n.signature, id(self.cands[n.id]), self.touch.get(n.id)) for n in nodes) + (
            res,
        )
        idx, cost, usage, outs = self.shared(
            key + ("chain",),
            lambda: _chain(
                nodes, self.cands, self.mesh, self.gathered, self.to_replicated, self.touch
            ),
        )
        head = nodes[0]
        self._node(
            cost,
            usage,
            (self.node_iv[chain[0]][0], self.node_iv[chain[-1]][1]),
            (f"{head.name} ({head.source})" if head.source else head.name)
            + (f" +{len(nodes) - 1} elementwise" if len(nodes) > 1 else ""),
            key,
            outs,
        )
        return tuple((n.id, i) for n, i in zip(nodes, idx))

    def add_hub(self, vid, reads) -> tuple:
        """A problem node for value ``vid`` read by several operators (``reads``: (reading
        node, operand position), ...): its candidates are the layouts the value is made or
        read in, its choice the one layout the value is converted to once, before every
        read; the readers' edges start from it. Cost 0, usage the value's local bytes in that
        layout from the step after its making (its maker holds it until then) to its last
        read. Returns (value id, its layouts)."""
        graph, n_in = self.graph, len(self.graph.inputs)
        u_idx, m, j = self.where[vid]
        v = graph.nodes[self.chains[u_idx - n_in][m]].outputs[j]
        made = self.out_layouts[u_idx][m][j]
        key = (
            "hub",
            self.src_keys[u_idx],
            m,
            j,
            tuple((r.signature, id(self.cands[r.id]), pos) for r, pos in reads),
        )
        layouts = self.shared(
            key + ("layouts",),
            lambda: tuple(
                sorted(
                    set(made) | {c.in_layouts[pos] for r, pos in reads for c in self.cands[r.id]},
                    key=str,
                )
            ),
        )
        k = self.step[graph.producer[vid].id]
        last = max(self.step[r.id] for r, _ in reads) + 1
        self._node(
            self.shared(key + ("cost",), lambda: np.zeros(len(layouts))),
            self.shared(
                key + ("usage",),
                lambda: np.array([local_bytes(l, v, self.mesh) for l in layouts], np.int64),
            ),
            (k + 2, last + 1),
            f"{v} (converted once for {len(reads)} readers)",
            key,
            [[layouts]],
        )
        hub = len(self.costs) - 1
        times = (
            self.repeat
            if (
                self.repeat > 1
                and vid not in self.varies
                and any(o.id in self.varies for r, _ in reads for o in r.outputs)
            )
            else 1
        )
        self.edges.append((u_idx, hub))
        self.ecosts.append(
            self.shared(
                key + ("made", times),
                lambda: self.matrix(
                    made,
                    layouts,
                    ("read", v.shape, v.dtype, False, times),
                    lambda a, b: times * self.reshard_cost(a, b, v.shape, v.dtype),
                ),
            )
        )
        self.where[vid] = (hub, 0, 0)
        return vid, layouts

    def add_reads(self, v_idx, n):
        """An edge per operand of chain head ``n`` (only a chain's head reads other nodes)."""
        for pos, x in enumerate(n.inputs):
            if not isinstance(x, Value):
                continue
            u_idx, m, j = self.where[x.id]
            src, dst = self.out_layouts[u_idx][m][j], self.cands[n.id]
            state = u_idx in self.state_args and u_idx not in self.pricing.read
            times = (
                self.repeat
                if (
                    self.repeat > 1
                    and x.id not in self.varies
                    and any(o.id in self.varies for o in n.outputs)
                )
                else 1
            )
            price = lambda s, d: times * self.reshard_cost(s, d, x.shape, x.dtype)
            self.edges.append((u_idx, v_idx))
            self.ecosts.append(
                self.shared(
                    ("edge", self.src_keys[u_idx], m, j, self.src_keys[v_idx], pos, state, times),
                    lambda: self.matrix(
                        src,
                        [cand.in_layouts[pos] for cand in dst],
                        ("read", x.shape, x.dtype, state, times),
                        (lambda s, d: _state_read(price(s, d))) if state else price,
                    ),
                )
            )

    def updated(self, i, o) -> bool:
        """Whether argument ``i``'s new value ``o`` is made by an operator (not a constant, not
        the argument returned unchanged)."""
        return isinstance(o, Value) and self.where.get(o.id, (0,))[0] >= len(self.graph.inputs)

    def add_returned(self, i, o) -> tuple:
        """A node for argument ``i``'s new value ``o`` as the step returns it, in the argument's
        layout, at the last step, where every result is live: choice ``2 a + g`` for the
        argument's layout ``a``: ``g = 0``, the update made it in that layout (the update's own
        bytes already count), ``g = 1``, it is gathered into it after the update (its bytes on
        top of the update's). Edges tie ``a`` to the argument's choice and allow ``g = 0`` only
        where the update's layout is ``a`` (``STATE_PENALTY`` elsewhere). Returns (i, o.id)."""
        opts, (v_idx, m, k) = self.arg_options[i], self.where[o.id]
        key = ("returned", self.src_keys[i], self.src_keys[v_idx], m, k)
        steps = len(self.graph.nodes) + 1
        self._node(
            self.shared(key + ("cost",), lambda: np.zeros(2 * len(opts))),
            self.shared(
                key + ("usage",),
                lambda: np.array(
                    [g * local_bytes(l, o, self.mesh) for l in opts for g in (0, 1)], np.int64
                ),
            ),
            (steps - 1, steps),
            f"{o} (returned)",
            key,
            [[[l for l in opts for _ in (0, 1)]]],
        )
        node = len(self.costs) - 1
        made = self.out_layouts[v_idx][m][k]
        self.edges += [(i, node), (v_idx, node)]
        self.ecosts += [
            self.shared(
                key + ("argument",),
                lambda: np.array(
                    [
                        [0.0 if a == b // 2 else STATE_PENALTY for b in range(2 * len(opts))]
                        for a in range(len(opts))
                    ]
                ),
            ),
            self.shared(
                key + ("update",),
                lambda: np.array(
                    [
                        [
                            STATE_PENALTY if b % 2 == 0 and u != opts[b // 2] else 0.0
                            for b in range(2 * len(opts))
                        ]
                        for u in made
                    ]
                ),
            ),
        ]
        return i, o.id

    def add_state_edge(self, i, o):
        """Argument ``i``'s new value ``o`` should keep its layout (``STATE_PENALTY``), or pays
        its redistribution to it (``state_pricing.returned``)."""
        if not self.updated(i, o):
            return  # a constant, or the argument returned unchanged
        v_idx, m, k = self.where[o.id]
        priced = i in self.pricing.returned
        price = (
            (lambda a, b: self.reshard_cost(b, a, o.shape, o.dtype))
            if priced
            else (lambda a, b: 0.0 if a == b else STATE_PENALTY)
        )
        self.edges.append((i, v_idx))
        self.ecosts.append(
            self.shared(
                ("state", self.src_keys[i], self.src_keys[v_idx], m, k, priced),
                lambda: self.matrix(
                    self.arg_options[i],
                    self.out_layouts[v_idx][m][k],
                    ("state", o.shape, o.dtype, priced),
                    price,
                ),
            )
        )

    def matrix(self, src, dst, kind, f) -> np.ndarray:
        """``_matrix(src, dst, f)``, the cost of each distinct layout pair computed once per
        ``kind`` (what ``f`` depends on besides the layouts: shape, dtype, pricing): on a
        3-axis mesh the values of one shape meet the same layout sets on hundreds of edges."""
        return _matrix(
            src,
            dst,
            f,
            self.pair_costs.setdefault((tuple(kind[1]), str(kind[2])) + kind[:1] + kind[3:], {}),
        )


def _hub_reads(graph, chains, result_ids) -> dict:
    """Value id -> its reads ((reading node, operand position), ...) for every value that
    gets a hub: made by a single-output operator, not a result of the step, and read by two
    or more operator reads (chain heads; a chain's followers read only inside it)."""
    heads = {graph.nodes[chain[0]].id for chain in chains}
    reads: dict = {}
    for n in graph.nodes:
        if n.id not in heads:
            continue
        for pos, x in enumerate(n.inputs):
            if isinstance(x, Value):
                reads.setdefault(x.id, []).append((n, pos))
    return {
        vid: tuple(r)
        for vid, r in reads.items()
        if len(r) > 1
        and vid in graph.producer
        and vid not in result_ids
        and len(graph.producer[vid].outputs) == 1
    }


def _chain(nodes, cands, mesh, result_ids, to_replicated, touch):
    """One chain's (per member: candidate index per head choice, costs, usages, per member and
    output: layout per head choice). A follower keeps its producer's layout. Usage is the
    largest sum of two consecutive members' outputs (a member's input dies as it runs), an
    output its fused kernel keeps in registers (``touch``: node id -> its fusion.Touch,
    cost_model.fused) counting none."""
    head = nodes[0]
    idx = [np.arange(len(cands[head.id]))]
    cost = np.array(
        [compute_time(head, c, mesh, touch.get(head.id)) for c in cands[head.id]], dtype=float
    )
    sizes = [
        np.array(
            [output_bytes(head, c, mesh, touch.get(head.id)) for c in cands[head.id]], np.int64
        )
    ]
    outs = [[[c.out_layouts[j] for c in cands[head.id]] for j in range(len(head.outputs))]]
    for n in nodes[1:]:
        cs = cands[n.id]
        pos = next(i for i, y in enumerate(n.inputs) if isinstance(y, Value))
        pick = {}  # ``followers`` guarantees a candidate reading each layout
        for l in set(outs[-1][0]):
            i = next(i for i, c in enumerate(cs) if c.in_layouts[pos] == l)
            pick[l] = (i, compute_time(n, cs[i], mesh, touch.get(n.id)))
        idx.append(np.array([pick[l][0] for l in outs[-1][0]]))
        cost += [pick[l][1] for l in outs[-1][0]]
        outs.append([[cs[i].out_layouts[0] for i in idx[-1]]])
        sizes.append(
            np.array([output_bytes(n, cs[i], mesh, touch.get(n.id)) for i in idx[-1]], np.int64)
        )
    for n, o, _i in zip(nodes, outs, idx):
        for j, v in enumerate(n.outputs):
            if v.id in result_ids:
                cost += to_replicated(o[j], v)
    usage = (
        sizes[0] if len(sizes) == 1 else np.max([a + b for a, b in zip(sizes, sizes[1:])], axis=0)
    )
    for a in [cost, usage, *idx]:
        a.setflags(write=False)
    return idx, cost, usage, outs


def _by_layout(layouts, f) -> np.ndarray:
    memo: dict[Layout, float] = {}
    return np.array([memo[l] if l in memo else memo.setdefault(l, f(l)) for l in layouts])


def _matrix(src, dst, f, memo=None) -> np.ndarray:
    """``[[f(s, d) for d in dst] for s in src]``, ``f`` called once per distinct pair of layout
    texts (and not at all for pairs in ``memo``, a dict kept by the caller)."""
    us, ui = np.unique(np.array([str(l) for l in src]), return_inverse=True)
    ds, di = np.unique(np.array([str(l) for l in dst]), return_inverse=True)
    first_s = {s: src[i] for i, s in reversed(list(enumerate(str(l) for l in src)))}
    first_d = {d: dst[i] for i, d in reversed(list(enumerate(str(l) for l in dst)))}
    memo = {} if memo is None else memo
    small = np.array(
        [
            [
                memo[s, d] if (s, d) in memo else memo.setdefault((s, d), f(first_s[s], first_d[d]))
                for d in ds
            ]
            for s in us
        ]
    ).reshape(len(us), len(ds))
    return small[np.ix_(ui, di)]
