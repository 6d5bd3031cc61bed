"""Sharding propagation: give every operator a layout from a few fixed ones.

In: a Graph, a LogicalMesh, ``fixed`` (node id -> required output Layout, from ``ap.shard``),
``arg_layouts`` (graph input index -> Layout, from ``in_strategy`` or data parallelism) and a
``reshard_cost(src, dst, shape, dtype) -> (seconds, collectives)`` function (the
redistribution planner's).
Out: ``Assignment``: the chosen Candidate of every node and the layout of every graph input.

Algorithm (MindSpore's sharding propagation): outward from the fixed nodes and fixed inputs;
of the nodes next to a decided neighbour with a split or partial layout, the one with the
fewest undecided inputs goes first (then the earliest in program order), so layouts flow
mostly along the data. Nodes no split ever reaches take their replicated candidate. Then up to
``REFINE_PASSES`` sweeps in program order re-decide every node with all its neighbours known
(a greedy choice made before a cheaper layout of its input existed is revisited). Each node takes, among its
replicated candidate and the candidates whose every split is copied from a decided neighbour
(propagation spreads the user's splits, it does not invent new ones), the one with the least
time: its own compute (cost_model: a candidate computing on a block of the work is cheaper than
one computing all of it on every device) plus its resharding against its decided neighbours:
producers of its inputs (a value already
redistributed for another consumer is read from the cheapest layout it exists in), and the
distinct layouts its decided consumers and the graph outputs (replicated) read. Ties (costs equal to the picosecond) go to the candidate needing fewer collectives, then to
the one splitting more dimensions (it follows its split neighbours), then to the one keeping
fewer pending partial sums, then to the lower enumeration index, so results are deterministic. Inputs without a fixed layout are fed replicated-then-sliced (free),
so they are not seeds; afterwards each takes the layout all its consumers agree on (else, for
state, the layout its new version is made in; else replicated). Results are priced gathered
whole, but new state (a result the step threads back, ``pairs``: parameters, optimizer
moments) is priced kept in its argument's layout, which is where it stays on the devices.
A partial sum read by several operators is read reduced by all of them: reduced once, as
Megatron-LM does after a row-parallel matmul, not carried through each linear reader and
reduced again for each non-linear one further on. A last pass (``carry_shared_partials``) tries
carrying each such value and keeps it only where that is cheaper with every value counted
once per layout it is moved into.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from autopar.errors import LayoutError
from autopar.graph import Const, Value
from autopar.layout import Layout

from .candidates import Candidate, candidates_of
from .cost_model import compute_time, fused
from .rules import rule_for


@dataclass(frozen=True, eq=False)
class Assignment:
    choice: dict  # node id -> Candidate
    inputs: tuple  # Layout per graph input
    cost: float  # total resharding seconds counted by the search
    held: dict = field(default_factory=dict)  # value id -> the layout it is converted to
    # once, before its readers read it (hubs)
    bound: float | None = None  # proven lower bound on ``cost`` over every choice the
    # search could have made (None: none proved) ...
    prove: Callable[[], float | None] | None = field(default=None, repr=False)
    # ... or a function proving one, run only when asked
    peak: int | None = None  # bytes per device at the peak in the search's memory
    # model (None: not searched)
    label: str = ""  # which plan it is, when several are compared


_ZERO = (0.0, 0)


def _sum(costs):
    costs = list(costs)
    return (sum(c[0] for c in costs), sum(c[1] for c in costs))


REFINE_PASSES = 3


def _quantize(seconds: float) -> float:
    """Costs equal to the picosecond compare equal (float noise must not break ties)."""
    return float(round(seconds * 1e12)) if math.isfinite(seconds) else math.inf


def propagate(graph, mesh, fixed, arg_layouts, reshard_cost, cands=None, pairs=()) -> Assignment:
    """The module's algorithm, pass by pass (see ``_Propagation``); ``pairs``: the
    (graph input, graph output) positions of the state the step threads through
    (``arguments.state_pairs``)."""
    run = _Propagation(
        graph, mesh, arg_layouts, reshard_cost, cands or candidates_of(graph, mesh), pairs
    )
    run.fix(fixed)
    run.flood(fixed)
    run.fill_unreached()
    run.refine(fixed)
    run.carry_shared_partials(fixed)
    return run.assignment()


class _Propagation:
    """The state of one propagation: ``choice`` (node id -> Candidate decided so far) and
    ``avail`` (value id -> Counter of the layouts its decided consumers read it in), with the
    passes ``fix`` (annotated nodes), ``flood`` (the frontier outward from them and the split
    arguments), ``fill_unreached`` (replicated), ``refine`` (re-decide with every neighbour
    known) and ``assignment`` (the result, with each free argument's layout and the cost)."""

    def __init__(self, graph, mesh, arg_layouts, reshard_cost, cands, pairs=()):
        self.graph, self.mesh, self.arg_layouts = graph, mesh, arg_layouts
        self.reshard_cost, self.cands = reshard_cost, cands
        self.touch = fused(graph, mesh)
        self.choice: dict[int, Candidate] = {}
        self.in_layout = {graph.inputs[i].id: l for i, l in arg_layouts.items()}
        self.arg_ids = {v.id for v in graph.inputs}
        # results returned whole, and new state (value id -> its argument's value id), which
        # stays on the devices in its argument's layout
        state = {j: graph.inputs[i].id for i, j in pairs}
        self.out_ids = {
            o.id for j, o in enumerate(graph.outputs) if isinstance(o, Value) and j not in state
        }
        self.state_of = {
            o.id: state[j]
            for j, o in enumerate(graph.outputs)
            if isinstance(o, Value) and j in state and o.id not in self.arg_ids
        }
        self.new_state = {
            state[j]: o
            for j, o in enumerate(graph.outputs)
            if isinstance(o, Value) and o.id in self.state_of
        }
        self.specs: dict = {}
        self.avail: dict = {}
        self.informed: set = set()  # nodes next to a split or partial decided neighbour
        self.heap: list = []  # (undecided inputs, node id) of informed nodes
        self.carried: set = set()  # shared partial sums let through their readers

    # ---------------------------------------------------------------- passes
    def fix(self, fixed):
        """The annotated nodes take the candidate reading and producing their layout."""
        for nid, layout in fixed.items():
            node = self.graph.nodes[nid]
            ok = [
                c
                for c in self.cands[nid]
                if c.out_layouts[0] == layout and c.in_layouts[0] == layout
            ]
            if not ok:
                raise LayoutError(
                    f"annotation {layout} on {node.name} ({node.source}) is not a "
                    f"valid layout of shape {node.outputs[0].shape} on {self.mesh}."
                )
            self.choice[nid] = ok[0]

    def flood(self, fixed):
        """Frontier: informed nodes popped by (undecided inputs, program order). Counts only
        fall, so stale heap entries are skipped."""
        graph = self.graph
        for nid in sorted(fixed):
            self.decided(graph.nodes[nid])
        for i in sorted(self.arg_layouts):
            if not self.arg_layouts[i].is_replicated():
                for u, _ in graph.users[graph.inputs[i].id]:
                    self.inform(u)
        while self.heap:
            count, nid = heapq.heappop(self.heap)
            node = graph.nodes[nid]
            if nid in self.choice or count != self.undecided_inputs(node):
                continue
            self.decide(node)
            self.decided(node)

    def fill_unreached(self):
        """Nodes no split reached take their replicated candidate."""
        for node in self.graph.nodes:
            if node.id not in self.choice:
                self.choice[node.id] = self.cands[node.id][0]
                self._count_reads(node, self.choice[node.id])

    def refine(self, fixed):
        """Up to REFINE_PASSES sweeps re-deciding every free node, until none changes."""
        for _ in range(REFINE_PASSES):
            changed = False
            for node in self.graph.nodes:
                if node.id in fixed:
                    continue
                old = self.choice[node.id]
                self.undecide(node)
                self.decide(node)
                changed |= self.choice[node.id] is not old
            if not changed:
                break

    def carry_shared_partials(self, fixed):
        """A partial sum read by several operators is read reduced by all of them (``decide``:
        reduced once, before every read, rather than carried through each linear reader and
        reduced separately further on). This pass tries the other way for each such value, in
        program order: its readers may read it partial again, and the operators downstream
        re-decide until their layouts settle; the change stays when the values it touches
        cost less, each value counted once per layout it is moved into (``value_cost``)."""
        for node in self.graph.nodes:
            for v in node.outputs:
                if self.shared_partial(v):
                    self._try_carry(v, fixed)

    def shared_partial(self, x) -> bool:
        """``x`` is made as a partial sum, read by several operators, and not yet let through."""
        if not isinstance(x, Value) or x.id in self.carried:
            return False
        have = self.produced(x)
        return (
            have is not None
            and bool(have.partial)
            and len({u.id for u, _ in self.graph.users[x.id]}) > 1
        )

    def _try_carry(self, v, fixed):
        """One trial of ``carry_shared_partials`` for value ``v``; kept only if cheaper."""
        old = (dict(self.choice), {k: Counter(c) for k, c in self.avail.items()})
        self.carried.add(v.id)
        index = {n.id: k for k, n in enumerate(self.graph.nodes)}
        heap = [(index[u.id], u.id) for u, _ in self.graph.users[v.id] if u.id not in fixed]
        heapq.heapify(heap)
        changed, seen = set(), set()
        while heap:  # downstream, in program order, until layouts settle
            _, nid = heapq.heappop(heap)
            if nid in seen:
                continue
            seen.add(nid)
            node = self.graph.nodes[index[nid]]
            before = self.choice[nid]
            self.undecide(node)
            self.decide(node)
            if self.choice[nid] is before:
                continue
            changed.add(nid)
            if self.choice[nid].out_layouts != before.out_layouts:
                for out in node.outputs:
                    heap += [
                        (index[w.id], w.id)
                        for w, _ in self.graph.users[out.id]
                        if w.id not in fixed and w.id not in seen
                    ]
                heapq.heapify(heap)
        values = {
            x.id: x
            for nid in changed
            for n in [self.graph.nodes[index[nid]]]
            for x in list(n.inputs) + list(n.outputs)
            if isinstance(x, Value)
        }
        after = sum(self.value_cost(x) for x in values.values())
        new = (self.choice, self.avail)
        self.choice, self.avail = old
        self.carried.discard(v.id)
        if _quantize(after) < _quantize(sum(self.value_cost(x) for x in values.values())):
            self.choice, self.avail = new
            self.carried.add(v.id)

    def value_cost(self, v) -> float:
        """Seconds to lay value ``v`` out for its decided readers (and as a result): each
        distinct layout they read it in is made once, from the cheapest layout it already
        exists in (as the lowering does)."""
        have = self.produced(v)
        if have is None:
            return 0.0
        price = lambda a, b: self.reshard_cost(a, b, v.shape, v.dtype)[0]
        held, total = [have], 0.0
        wanted = (self.wanted(v) | self.kept(v, have)) - {have}
        for want in sorted(wanted, key=lambda w: (price(have, w), str(w))):
            total += min(price(h, want) for h in held)
            held.append(want)
        return total

    def assignment(self) -> Assignment:
        """Each free argument takes the layout all its consumers agree on (state whose
        consumers do not agree: the layout its new version is made in; else replicated); the
        cost is every node's reading cost plus gathering the results and keeping new state."""
        graph, choice = self.graph, self.choice
        inputs = []
        for i, v in enumerate(graph.inputs):
            if i in self.arg_layouts:
                inputs.append(self.arg_layouts[i])
                continue
            wants = {choice[u.id].in_layouts[k] for u, k in graph.users[v.id]}
            wants = {w for w in wants if not w.partial}
            new = self.new_state.get(v.id)
            if len(wants) != 1 and new is not None and not self.produced(new).partial:
                wants = {self.produced(new)}  # the layout its new version is made in
            inputs.append(
                wants.pop()
                if len(wants) == 1 and v.id not in self.out_ids
                else Layout.replicated(len(v.shape))
            )
            self.in_layout[v.id] = inputs[-1]
        total = _sum(
            [self.in_cost(n, choice[n.id]) for n in graph.nodes]
            + [
                self.reshard_cost(self.produced(o), want, o.shape, o.dtype)
                for o in {o.id: o for o in graph.outputs if isinstance(o, Value)}.values()
                for want in self.kept(o, self.produced(o))
                | ({Layout.replicated(len(o.shape))} if o.id in self.out_ids else set())
            ]
        )[0]
        return Assignment(choice, tuple(inputs), total)

    # ---------------------------------------------------------------- one node
    def spec_of(self, node):
        if node.id not in self.specs:
            self.specs[node.id] = rule_for(node).spec(node)
        return self.specs[node.id]

    def produced(self, v):
        """Layout a value is produced in, or None if its producer is undecided."""
        if isinstance(v, Const):
            return Layout.replicated(len(v.shape))
        if v.id in self.arg_ids:
            return self.in_layout.get(v.id, Layout.replicated(len(v.shape)))
        n = self.graph.producer[v.id]
        c = self.choice.get(n.id)
        return None if c is None else c.out_layouts[n.outputs.index(v)]

    def read_cost(self, x, want):
        have = self.produced(x)
        if have is None:
            return _ZERO
        if isinstance(x, Const):
            return self.reshard_cost(have, want, x.shape, x.dtype)
        layouts = {l for l, k in self.avail.get(x.id, {}).items() if k > 0} | {have}
        return min(self.reshard_cost(h, want, x.shape, x.dtype) for h in layouts)

    def in_cost(self, node, c):
        return _sum(self.read_cost(x, want) for x, want in zip(node.inputs, c.in_layouts))

    def wanted(self, v):
        """Distinct layouts decided consumers (and the graph output) read ``v`` in."""
        w = {
            self.choice[u.id].in_layouts[k]
            for u, k in self.graph.users[v.id]
            if u.id in self.choice
        }
        if v.id in self.out_ids:
            w.add(Layout.replicated(len(v.shape)))
        return w

    def score(self, node, c):
        return _sum(
            [self.in_cost(node, c)]
            + [
                self.reshard_cost(have, want, v.shape, v.dtype)
                for v, have in zip(node.outputs, c.out_layouts)
                for want in self.wanted(v) | self.kept(v, have)
            ]
        )

    def kept(self, v, have) -> set:
        """The layout new state ``v`` is kept in (a set: empty for any other value) when made
        in ``have``: its argument's where that is laid out, else ``have`` with its partial sums
        reduced (new state stays on the devices; it is not returned whole)."""
        arg = self.state_of.get(v.id)
        if arg is None:
            return set()
        return {self.in_layout[arg] if arg in self.in_layout else Layout(have.dims)}

    def neighbour_layouts(self, node):
        """Per operand (inputs then outputs), the decided layouts next to it."""
        out = []
        for x in node.inputs:
            have = self.produced(x) if isinstance(x, Value) else None
            fixed_in = isinstance(x, Value) and (x.id not in self.arg_ids or x.id in self.in_layout)
            out.append([have] if have is not None and fixed_in else [])
        for v in node.outputs:
            arg = self.state_of.get(v.id)  # new state of a laid-out argument
            kept = [self.in_layout[arg]] if arg in self.in_layout else []
            out.append(list(self.wanted(v)) + kept)
        return out

    def supported(self, node, c) -> bool:
        """Propagation copies splits, it does not invent them: every mesh axis a candidate
        places on a letter must sit on that letter's dimension in a decided neighbour's layout,
        and every partial axis it feeds must already be partial in that input."""
        spec = self.spec_of(node)
        near = self.neighbour_layouts(node)
        dims_of = list(spec.inputs) + list(spec.outputs)
        for letter, axes in c.assign:
            for a in axes:
                if not any(
                    a in lay.dims[d]
                    for op, lays in enumerate(near)
                    for lay in lays
                    for d, l in enumerate(dims_of[op])
                    if l == letter
                ):
                    return False
        if c.partial:
            group = spec.linear[c.group]
            if not any(c.partial <= lay.partial for i in group for lay in near[i]):
                return False
        return True

    def decide(self, node):
        """Take the best-scoring supported candidate; a shared partial sum (``shared_partial``)
        is read reduced."""
        shared = [k for k, x in enumerate(node.inputs) if self.shared_partial(x)]
        opts = [
            (i, c)
            for i, c in enumerate(self.cands[node.id])
            if (i == 0 or self.supported(node, c))
            and not any(c.in_layouts[k].partial for k in shared)
        ]

        def key(ic):
            i, c = ic
            seconds, count = self.score(node, c)
            seconds += compute_time(node, c, self.mesh, self.touch.get(node.id))
            return _quantize(seconds), count, -(c.num_splits - len(c.partial)), len(c.partial), i

        best = min(opts, key=key)[1]
        self.choice[node.id] = best
        self._count_reads(node, best)

    def _count_reads(self, node, c):
        for x, want in zip(node.inputs, c.in_layouts):
            if isinstance(x, Value):
                self.avail.setdefault(x.id, Counter())[want] += 1

    def undecide(self, node):
        for x, want in zip(node.inputs, self.choice.pop(node.id).in_layouts):
            if isinstance(x, Value):
                self.avail[x.id][want] -= 1

    # ---------------------------------------------------------------- the frontier
    def undecided_inputs(self, node):
        return sum(1 for x in node.inputs if isinstance(x, Value) and self.produced(x) is None)

    def push(self, node):
        if node.id not in self.choice and node.id in self.informed:
            heapq.heappush(self.heap, (self.undecided_inputs(node), node.id))

    def inform(self, node):
        self.informed.add(node.id)
        self.push(node)

    def decided(self, node):
        """Tell the neighbours of a just-decided node."""
        c = self.choice[node.id]
        for x, want in zip(node.inputs, c.in_layouts):
            if isinstance(x, Value) and x.id not in self.arg_ids and not want.is_replicated():
                self.inform(self.graph.producer[x.id])
        for v, have in zip(node.outputs, c.out_layouts):
            for user, _ in self.graph.users[v.id]:
                if have.is_replicated():
                    self.push(user)
                else:
                    self.inform(user)
