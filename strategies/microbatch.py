"""Micro-batches as a virtual mesh axis: where each value of a step splits over micro-batches.

In: a Graph, the chosen candidate of every node and layout of every input on a stage mesh
(from any mode or search), which inputs hold the batch, and the number of micro-batches M.
Out: ``MicroPlan``: a mesh with a leading axis ``MB`` of size M before the stage mesh's axes, and
the choice and input layouts on it.

The batch arguments are split over ``MB`` on dimension 0 (micro-batch m is the m-th contiguous
block of rows, ``MB`` being the major axis of that dimension); every other argument is the same
for all micro-batches. One pass in program order then carries the split along the data: each
node keeps its chosen layout on the stage axes and may add ``MB`` to a letter only where one of
its inputs arrives split over ``MB`` (reading a value the same for every micro-batch as a partial
sum over ``MB`` where the operator is linear in it: micro-batch 0 reads it, the others zeros;
never reading a sum over micro-batches before it is complete), taking the option whose inputs
are cheapest to read (ties: the most ``MB`` splits, then the earliest option). So a value is
either the same for every micro-batch, split over them (computed per micro-batch), or a
partial sum over them (a contraction over the batch: a gradient, a summed loss), which the
lowering reduces over ``MB`` before anything reads it: that all-reduce is the gradient
accumulation (``redistribution.stage_split``). A backward pass then computes split the values
the same for every micro-batch that all their readers read split (``_backward``). Lowered on
this mesh, a rank's local shapes are those of one micro-batch.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace
from typing import NamedTuple

from autopar.annotate import shard_p
from autopar.graph import Const, Value
from autopar.layout import Layout
from autopar.mesh import LogicalMesh
from autopar.topology import Level

from .candidates import axis_choices, enumerate_candidates, identity_candidate
from .rules import rule_for

MB = "mb"


@dataclass(frozen=True)
class MicroPlan:
    mesh: LogicalMesh  # (MB, *stage mesh axes)
    choice: dict  # node id -> Candidate on ``mesh``
    in_layouts: tuple  # per graph input, on ``mesh``


def strip(layout: Layout) -> Layout:
    """``layout`` without the micro-batch axis."""
    return Layout(tuple(tuple(a for a in d if a != MB) for d in layout.dims), layout.partial - {MB})


def micro_mesh(stage_mesh: LogicalMesh, micro_batches: int) -> LogicalMesh:
    """The stage mesh with ``MB`` in front, on a topology level of its own (micro-batches run
    one after another on the same devices; the level only prices the accumulation)."""
    topo = stage_mesh.topology
    inner = topo.levels[-1]
    level = Level("micro", micro_batches, alpha=inner.alpha, beta=inner.beta)
    return LogicalMesh(
        (MB,) + stage_mesh.axis_names,
        (micro_batches,) + stage_mesh.shape,
        replace(topo, levels=(level,) + topo.levels, reducers=0),
    )


def batch_dims(graph, batch_inputs) -> dict:
    """Value id -> the dimensions of that value that carry batch rows: dimension 0 of the batch
    arguments, then every output dimension labelled with a letter an input's batch dimension
    has in the operator's spec (a contraction over the batch, a weight gradient, carries none)."""
    dims = {graph.inputs[i].id: frozenset({0}) for i in batch_inputs if graph.inputs[i].shape}
    for n in graph.nodes:
        held = [
            (j, dims[x.id]) for j, x in enumerate(n.inputs) if isinstance(x, Value) and x.id in dims
        ]
        if not held:
            continue
        if n.prim == shard_p.name:
            dims[n.outputs[0].id] = held[0][1]
            continue
        spec = rule_for(n).spec(n)
        letters = {spec.inputs[j][d] for j, ds in held for d in ds} - {None}
        for v, out in zip(n.outputs, spec.outputs):
            ds = frozenset(d for d, letter in enumerate(out) if letter in letters)
            if ds:
                dims[v.id] = ds
    return dims


class MicroFit:
    """The layouts a pipeline's stage search may choose: those whose batch dimensions
    (``batch_dims``) split into ``micro`` micro-batches after the mesh's split (a batch split
    512 ways on 1536 rows leaves 3, which 2 micro-batches cannot share), so ``add_micro_axis``
    finds MB a place on every batch dimension. Filtered lists are shared per (list, batch
    dimensions), as the search shares work per list."""

    def __init__(self, graph, batch_inputs, micro: int, mesh):
        self.dims, self.micro, self.mesh = batch_dims(graph, batch_inputs), micro, mesh
        # (id of a list, batch dims) -> (the list, what it keeps)
        self._memo: dict[tuple[int, tuple], tuple[list, list]] = {}

    def _fits(self, layout, shape, dims) -> bool:
        splits = layout.splits(self.mesh)
        return all(shape[d] % (self.micro * splits[d]) == 0 for d in dims)

    def _keep(self, key, options, fits):
        hit = self._memo.get(key)
        if hit is None:  # the list is kept in the memo, so its id stays unique
            hit = self._memo[key] = (options, [o for o in options if fits(o)] or options)
        return hit[1]

    def node(self, node, options) -> list:
        """A node's candidate list -> those every batch dimension of which splits (all of them
        when none does: the micro-batch plan then says why)."""
        values = list(node.inputs) + list(node.outputs)
        dims = tuple(self.dims.get(x.id, ()) if isinstance(x, Value) else () for x in values)
        if not any(dims) or self.micro == 1:
            return options
        return self._keep(
            (id(options), dims),
            options,
            lambda c: all(
                self._fits(l, x.shape, d)
                for l, x, d in zip(c.in_layouts + c.out_layouts, values, dims)
                if d
            ),
        )

    def nodes(self, graph, cands: dict) -> dict:
        return {n.id: self.node(n, cands[n.id]) for n in graph.nodes}

    def argument(self, value, options) -> list:
        """A graph input's layout options -> those splitting its batch rows (as ``node``)."""
        dims = self.dims.get(value.id, ())
        if not dims or self.micro == 1:
            return options
        return self._keep((id(options), dims), options, lambda l: self._fits(l, value.shape, dims))


def _options(node, cand, mesh):
    """``cand`` first, then the candidates of ``node`` on ``mesh`` that equal it off ``MB``."""
    if node.prim == shard_p.name:  # identity layouts: MB in front of any dimension
        (layout,) = cand.out_layouts
        extra = [
            identity_candidate(
                Layout(
                    layout.dims[:d] + ((MB,) + layout.dims[d],) + layout.dims[d + 1 :],
                    layout.partial,
                )
            )
            for d, s in enumerate(node.outputs[0].shape)
            if s % (mesh.axis_size(MB) * layout.splits(mesh)[d]) == 0
        ]
        return [cand] + extra
    spec = rule_for(node).spec(node)
    real = axis_choices(cand, mesh.axis_names[1:])
    picks = [(first,) + real for first in [None, *spec.letters]]
    out = [cand]
    for c in enumerate_candidates(node, spec, mesh, picks):
        if c in out:
            continue
        if (
            tuple(map(strip, c.in_layouts)) == cand.in_layouts
            and tuple(map(strip, c.out_layouts)) == cand.out_layouts
        ):
            out.append(c)
    return out


class _Pass(NamedTuple):
    """One pass's result: the chosen candidate per node id and the layout of every value id
    (graph inputs included) on the micro-batch mesh."""

    choice: dict
    layout: dict


def add_micro_axis(
    graph, choice, in_layouts, batch_inputs, micro_batches, stage_mesh, reshard_cost
) -> MicroPlan:
    """See the module docstring. ``batch_inputs``: graph input positions split over micro-
    batches; ``reshard_cost(src, dst, shape, dtype) -> (seconds, collectives)`` on the result's
    mesh (``micro_mesh(stage_mesh, micro_batches)``)."""
    mesh = micro_mesh(stage_mesh, micro_batches)
    args = tuple(
        Layout(((MB,) + l.dims[0],) + l.dims[1:], l.partial) if i in batch_inputs else l
        for i, (_, l) in enumerate(zip(graph.inputs, in_layouts))
    )
    cands = _all_options(graph, choice, mesh)
    forward = _forward(
        graph, cands, {v.id: args[i] for i, v in enumerate(graph.inputs)}, reshard_cost
    )
    return MicroPlan(mesh, _backward(graph, cands, forward, reshard_cost), args)


def _all_options(graph, choice, mesh) -> dict:
    """Each node's chosen candidate -> node id -> its ``_options`` on ``mesh`` (computed once
    per node signature and candidate)."""
    memo, cands = {}, {}
    for n in graph.nodes:
        key = (n.signature, choice[n.id])
        if key not in memo:
            memo[key] = _options(n, choice[n.id], mesh)
        cands[n.id] = memo[key]
    return cands


def _held(x, layout: dict) -> Layout:
    """The layout an operand ``x`` is read from: ``layout[x.id]``, replicated for a constant."""
    return Layout.replicated(len(x.shape)) if isinstance(x, Const) else layout[x.id]


def _forward(graph, cands, in_layout: dict, reshard_cost) -> _Pass:
    """The options per node and the inputs' layouts (by value id) -> the program-order pass of
    the module docstring: per node the cheapest option (``_option_key``) among its chosen
    candidate and those that follow the MB splits of its inputs (``_follows``, ``_summand``);
    an option that keeps every input split over MB as it arrives (``_keeps_micro``) goes
    before one that gathers an input over the micro-batches, which would need the whole
    batch before the operator could run."""
    layout, choice, memo = dict(in_layout), {}, {}
    for n in graph.nodes:
        opts = cands[n.id]
        have = tuple(_held(x, layout) for x in n.inputs)
        key = (n.signature, id(opts), have)  # a repeated layer's node: the same choice
        if key not in memo:
            spec = None if n.prim == shard_p.name else rule_for(n).spec(n)
            ok = [
                c for c in opts if c is opts[0] or (_follows(c, spec, have) and _summand(c, have))
            ]
            ok = [c for c in ok if _keeps_micro(c, have)] or ok
            memo[key] = min(ok, key=lambda c: _option_key(n, c, have, reshard_cost))
        best = choice[n.id] = memo[key]
        for v, l in zip(n.outputs, best.out_layouts):
            layout[v.id] = l
    return _Pass(choice, layout)


def _keeps_micro(c, have) -> bool:
    """Candidate ``c`` reads every input that arrives split over MB (``have``) split over MB."""
    return all(MB in w.axes for h, w in zip(have, c.in_layouts) if MB in h.axes)


def _follows(c, spec, have) -> bool:
    """Candidate ``c``, the node's spec (None: identity op) and its inputs' layouts ``have`` ->
    whether every letter ``c`` splits over MB arrives split over MB in some input."""
    if spec is None:
        mb = {d for d, axes in enumerate(c.out_layouts[0].dims) if MB in axes}
    else:
        mb = {letter for letter, axes in c.assign if MB in axes}
    return all(
        any(
            MB in h.dims[e] and _letter(spec, j, e) == letter
            for j, h in enumerate(have)
            for e in range(h.rank)
        )
        for letter in mb
    )


def _summand(c, have) -> bool:
    """Candidate ``c`` and its inputs' layouts ``have`` -> whether every input ``c`` reads as a
    partial sum over MB is one the same for every micro-batch (the zeros a scatter-add starts
    from: micro-batch 0 reads it, the others zeros), beside an input split over MB."""
    zeros = [h for h, w in zip(have, c.in_layouts) if MB in w.partial]
    return not zeros or (
        all(MB not in h.axes | h.partial for h in zeros) and any(MB in h.axes for h in have)
    )


def _option_key(n, c, have, reshard_cost) -> tuple:
    """Candidate ``c`` of node ``n`` with inputs held in ``have`` -> its sort key: seconds
    (to the picosecond) and count of the collectives reading its inputs, then minus its MB
    splits (more splits first)."""
    secs = count = 0
    for x, h, want in zip(n.inputs, have, c.in_layouts):
        s_, k_ = reshard_cost(h, want, x.shape, x.dtype)
        secs, count = secs + s_, count + k_
    splits = sum(MB in d for l in c.out_layouts for d in l.dims) + sum(
        MB in l.partial for l in c.out_layouts
    )
    return round(secs, 12), count, -splits


def _backward(graph, cands, forward: _Pass, reshard_cost) -> dict:
    """The forward pass -> its choice after the backward pass: values the same for every
    micro-batch that all their readers read split over MB (a broadcast constant, a mask, the
    loss's cotangent) are computed split, where that makes every read cheaper: first only where
    a node's own inputs read for free, then also through chains of such values (the zeros and
    updates of a cross-entropy's scatter-add); the variant with the cheaper reads wins."""
    results = {o.id for o in graph.outputs if not isinstance(o, Const)}
    variants, changed = [], set()
    for relaxed in (False, True):
        ch, lay = dict(forward.choice), dict(forward.layout)
        changed |= _split_invariants(graph, cands, ch, lay, reshard_cost, results, relaxed)
        variants.append(_Pass(ch, lay))
    # the reads that differ: of the rewritten nodes, and of their outputs' readers
    differ = changed | {
        u.id
        for n in graph.nodes
        if n.id in changed
        for v in n.outputs
        for u, _ in graph.users.get(v.id, ())
    }
    nodes = [n for n in graph.nodes if n.id in differ]
    best: tuple[float, dict] | None = None
    for plan in variants:
        total = _read_seconds(nodes, plan, reshard_cost)
        if best is None or total < best[0]:
            best = (total, plan.choice)
    assert best is not None  # the loop ran
    return best[1]


def _read_seconds(nodes, plan: _Pass, reshard_cost) -> float:
    """Nodes and a pass -> the seconds of every collective their inputs are read through."""
    total, memo = 0.0, {}
    for n in nodes:
        have, c = tuple(_held(x, plan.layout) for x in n.inputs), plan.choice[n.id]
        key = (n.signature, c, have)  # a repeated layer's node: the same reads
        if key not in memo:
            memo[key] = sum(
                reshard_cost(h, want, x.shape, x.dtype)[0]
                for x, h, want in zip(n.inputs, have, c.in_layouts)
            )
        total += memo[key]
    return total


def _letter(spec, operand, dim):
    """The spec letter of dimension ``dim`` of input ``operand`` (identity ops: the dim)."""
    if spec is None:
        return dim
    return spec.inputs[operand][dim]


def _split_invariants(graph, cands, choice, layout, reshard_cost, results, relaxed):
    """Rewrite, in place, nodes whose outputs are not split over MB and all of whose readers
    read them in one MB-split layout, to a candidate making that layout, when each of its
    inputs reads for free (``relaxed``: or comes from another such node, rewritten on a later
    pass); repeated until nothing changes. A node's rewrite depends only on its own choice, its
    readers' and its operands' (and their producers'), so each pass looks again only at the
    neighbours of what the passes so far rewrote: the same rewrites, in the same order, as
    looking at every node on every pass. Returns the ids of the nodes rewritten."""
    pos = {n.id: k for k, n in enumerate(graph.nodes)}
    rewritten: set = set()
    dirty = set(range(len(graph.nodes)))
    while dirty:
        todo, dirty = dirty, set()
        heap = [-k for k in todo]  # the pass's nodes, last first
        heapq.heapify(heap)
        while heap:
            at = -heapq.heappop(heap)
            n = graph.nodes[at]
            if any(MB in l.axes for l in choice[n.id].out_layouts) or any(
                v.id in results for v in n.outputs
            ):
                continue
            wants = []
            for v in n.outputs:
                w = {choice[u.id].in_layouts[k] for u, k in graph.users.get(v.id, ())}
                wants.append(w.pop() if len(w) == 1 else None)
            if any(w is None or MB not in w.axes for w in wants):
                continue

            def ok(x, want):
                if isinstance(x, Const):
                    return reshard_cost(
                        Layout.replicated(len(x.shape)), want, x.shape, x.dtype
                    ) == (0, 0)
                if reshard_cost(layout[x.id], want, x.shape, x.dtype) == (0, 0):
                    return True
                p = graph.producer.get(x.id)
                return (
                    relaxed
                    and p is not None
                    and not any(MB in l.axes for l in choice[p.id].out_layouts)
                    and not any(v.id in results for v in p.outputs)
                )

            for c in cands[n.id]:
                if list(c.out_layouts) == wants and all(
                    ok(x, want) for x, want in zip(n.inputs, c.in_layouts)
                ):
                    choice[n.id] = c
                    for v, l in zip(n.outputs, c.out_layouts):
                        layout[v.id] = l
                    near = {pos[u.id] for v in n.outputs for u, _ in graph.users.get(v.id, ())}
                    near |= {
                        pos[graph.producer[x.id].id]
                        for x in n.inputs
                        if isinstance(x, Value) and x.id in graph.producer
                    }
                    for j in near:
                        if j < at and j not in todo:  # this pass reaches them yet
                            todo.add(j)
                            heapq.heappush(heap, -j)
                        elif j > at:  # the next pass
                            dirty.add(j)
                    rewritten.add(n.id)
                    break
    return rewritten
