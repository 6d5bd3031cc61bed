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
resharding cost against its decided neighbours: producers of its inputs (a value already
redistributed for another consumer is read from the cheapest layout it exists in), and the
distinct layouts its decided consumers and the graph outputs (replicated) read. Ties (costs equal to the picosecond) go to the candidate needing fewer collectives, then to
the one splitting more dimensions (it follows its split neighbours), then to the one keeping
fewer pending partial sums, then to the lower enumeration index, so results are deterministic. Inputs without a fixed layout are fed replicated-then-sliced (free),
so they are not seeds; afterwards each takes the layout all its consumers agree on (else
replicated).
"""
from __future__ import annotations

import heapq
import math
from collections import Counter
from dataclasses import dataclass

from autopar.errors import LayoutError
from autopar.graph import Const, Value
from autopar.layout import Layout

from .candidates import Candidate, candidates_of
from .rules import rule_for


@dataclass(frozen=True, eq=False)
class Assignment:
    choice: dict          # node id -> Candidate
    inputs: tuple         # Layout per graph input
    cost: float           # total resharding seconds counted by the search


_ZERO = (0.0, 0)


def _sum(costs):
    costs = list(costs)
    return (sum(c[0] for c in costs), sum(c[1] for c in costs))


REFINE_PASSES = 3


def _quantize(seconds: float) -> float:
    """Costs equal to the picosecond compare equal (float noise must not break ties)."""
    return float(round(seconds * 1e12)) if math.isfinite(seconds) else math.inf


def propagate(graph, mesh, fixed, arg_layouts, reshard_cost, cands=None) -> Assignment:
    cands = cands or candidates_of(graph, mesh)
    choice: dict[int, Candidate] = {}
    in_layout = {graph.inputs[i].id: l for i, l in arg_layouts.items()}
    arg_ids = {v.id for v in graph.inputs}
    out_ids = {o.id for o in graph.outputs if isinstance(o, Value)}

    for nid, layout in fixed.items():
        node = graph.nodes[nid]
        ok = [c for c in cands[nid] if c.out_layouts[0] == layout and c.in_layouts[0] == layout]
        if not ok:
            raise LayoutError(f"annotation {layout} on {node.name} ({node.source}) is not a valid "
                              f"layout of shape {node.outputs[0].shape} on {mesh}.")
        choice[nid] = ok[0]

    specs = {}
    avail: dict = {}                               # value id -> Counter of layouts consumers read

    def spec_of(node):
        if node.id not in specs:
            specs[node.id] = rule_for(node).spec(node)
        return specs[node.id]

    def produced(v):
        """Layout a value is produced in, or None if its producer is undecided."""
        if isinstance(v, Const):
            return Layout.replicated(len(v.shape))
        if v.id in arg_ids:
            return in_layout.get(v.id, Layout.replicated(len(v.shape)))
        n = graph.producer[v.id]
        c = choice.get(n.id)
        return None if c is None else c.out_layouts[n.outputs.index(v)]

    def read_cost(x, want):
        have = produced(x)
        if have is None:
            return _ZERO
        if isinstance(x, Const):
            return reshard_cost(have, want, x.shape, x.dtype)
        layouts = {l for l, k in avail.get(x.id, {}).items() if k > 0} | {have}
        return min(reshard_cost(h, want, x.shape, x.dtype) for h in layouts)

    def in_cost(node, c):
        return _sum(read_cost(x, want) for x, want in zip(node.inputs, c.in_layouts))

    def wanted(v):
        """Distinct layouts decided consumers (and the graph output) read ``v`` in."""
        w = {choice[u.id].in_layouts[k] for u, k in graph.users[v.id] if u.id in choice}
        if v.id in out_ids:
            w.add(Layout.replicated(len(v.shape)))
        return w

    def score(node, c):
        return _sum([in_cost(node, c)] + [reshard_cost(have, want, v.shape, v.dtype)
                                          for v, have in zip(node.outputs, c.out_layouts)
                                          for want in wanted(v)])

    def neighbour_layouts(node):
        """Per operand (inputs then outputs), the decided layouts next to it."""
        out = []
        for x in node.inputs:
            have = produced(x) if isinstance(x, Value) else None
            fixed_in = isinstance(x, Value) and (x.id not in arg_ids or x.id in in_layout)
            out.append([have] if have is not None and fixed_in else [])
        for v in node.outputs:
            out.append([w for w in wanted(v)])
        return out

    def supported(node, c) -> bool:
        """Propagation copies splits, it does not invent them: every mesh axis a candidate
        places on a letter must sit on that letter's dimension in a decided neighbour's layout,
        and every partial axis it feeds must already be partial in that input."""
        sp = spec_of(node)
        near = neighbour_layouts(node)
        dims_of = list(sp.inputs) + list(sp.outputs)
        for letter, axes in c.assign:
            for a in axes:
                if not any(a in lay.dims[d] for op, lays in enumerate(near) for lay in lays
                           for d, l in enumerate(dims_of[op]) if l == letter):
                    return False
        if c.partial:
            group = sp.linear[c.group]
            if not any(c.partial <= lay.partial for i in group for lay in near[i]):
                return False
        return True

    def decide(node):
        opts = [(i, c) for i, c in enumerate(cands[node.id]) if i == 0 or supported(node, c)]
        def key(ic):
            seconds, count = score(node, ic[1])
            c = ic[1]
            return _quantize(seconds), count, -(c.num_splits - len(c.partial)), len(c.partial), ic[0]
        best = min(opts, key=key)
        choice[node.id] = best[1]
        for x, want in zip(node.inputs, best[1].in_layouts):
            if isinstance(x, Value):
                avail.setdefault(x.id, Counter())[want] += 1

    def undecide(node):
        for x, want in zip(node.inputs, choice.pop(node.id).in_layouts):
            if isinstance(x, Value):
                avail[x.id][want] -= 1

    # Frontier: nodes with a split or partial decided neighbour ("informed"), popped by
    # (undecided inputs, program order). Counts only fall, so stale heap entries are skipped.
    informed: set = set()
    heap: list = []

    def undecided_inputs(node):
        return sum(1 for x in node.inputs if isinstance(x, Value) and produced(x) is None)

    def push(node):
        if node.id not in choice and node.id in informed:
            heapq.heappush(heap, (undecided_inputs(node), node.id))

    def inform(node):
        informed.add(node.id)
        push(node)

    def decided(node):
        """Tell the neighbours of a just-decided node."""
        c = choice[node.id]
        for x, want in zip(node.inputs, c.in_layouts):
            if isinstance(x, Value) and x.id not in arg_ids and not want.is_replicated():
                inform(graph.producer[x.id])
        for v, have in zip(node.outputs, c.out_layouts):
            for user, _ in graph.users[v.id]:
                inform(user) if not have.is_replicated() else push(user)

    for nid in sorted(fixed):
        decided(graph.nodes[nid])
    for i in sorted(arg_layouts):
        if not arg_layouts[i].is_replicated():
            for u, _ in graph.users[graph.inputs[i].id]:
                inform(u)
    while heap:
        count, nid = heapq.heappop(heap)
        node = graph.nodes[nid]
        if nid in choice or count != undecided_inputs(node):
            continue
        decide(node)
        decided(node)
    for node in graph.nodes:                       # unreached: replicated
        if node.id not in choice:
            choice[node.id] = cands[node.id][0]
            for x, want in zip(node.inputs, choice[node.id].in_layouts):
                if isinstance(x, Value):
                    avail.setdefault(x.id, Counter())[want] += 1

    for _ in range(REFINE_PASSES):                 # every neighbour is known now: re-decide
        changed = False
        for node in graph.nodes:
            if node.id in fixed:
                continue
            old = choice[node.id]
            undecide(node)
            decide(node)
            changed |= choice[node.id] is not old
        if not changed:
            break

    inputs = []
    for i, v in enumerate(graph.inputs):
        if i in arg_layouts:
            inputs.append(arg_layouts[i])
            continue
        wants = {choice[u.id].in_layouts[k] for u, k in graph.users[v.id]}
        wants = {w for w in wants if not w.partial}
        inputs.append(wants.pop() if len(wants) == 1 and v.id not in out_ids
                      else Layout.replicated(len(v.shape)))
        in_layout[v.id] = inputs[-1]
    total = _sum([in_cost(n, choice[n.id]) for n in graph.nodes] +
                 [reshard_cost(produced(o), Layout.replicated(len(o.shape)), o.shape, o.dtype)
                  for o in graph.outputs if isinstance(o, Value)])[0]
    return Assignment(choice, tuple(inputs), total)
