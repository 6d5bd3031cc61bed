"""Micro-batches as a virtual mesh axis: where each value of a step splits over micro-batches.

In: a Graph, the chosen candidate of every node and layout of every input on a stage mesh
(from any mode or search), which inputs hold the batch, and the number of micro-batches M.
Out: ``MicroPlan``: a mesh with a leading axis ``MB`` of size M before the stage mesh's axes, and
the choice and input layouts on it.

The batch arguments are split over ``MB`` on dimension 0 (micro-batch m is the m-th contiguous
block of rows, ``MB`` being the major axis of that dimension); every other argument is the same
for all micro-batches. Sharding propagation (``strategies.propagation``) then carries the split
through the graph, each node keeping its chosen layout on the stage axes: a node may add ``MB``
to one of its letters, never read a partial sum over ``MB``. So a value is either the same for
every micro-batch, split over them (computed per micro-batch), or a partial sum over them (a
contraction over the batch: a gradient, a summed loss), which the lowering reduces over ``MB``
before anything reads it: that all-reduce is the gradient accumulation
(``redistribution.pipeline``). Lowered on this mesh, a rank's local shapes are those of one
micro-batch.
"""
from __future__ import annotations

from dataclasses import dataclass

from autopar.layout import Layout
from autopar.mesh import LogicalMesh
from autopar.topology import Level, Topology

from .candidates import axis_choices, enumerate_candidates, identity_candidate
from .propagation import propagate
from .rules import rule_for

MB = "mb"


@dataclass(frozen=True)
class MicroPlan:
    mesh: LogicalMesh             # (MB, *stage mesh axes)
    choice: dict                  # node id -> Candidate on ``mesh``
    in_layouts: tuple             # per graph input, on ``mesh``


def strip(layout: Layout) -> Layout:
    """``layout`` without the micro-batch axis."""
    return Layout(tuple(tuple(a for a in d if a != MB) for d in layout.dims), layout.partial - {MB})


def micro_mesh(stage_mesh: LogicalMesh, micro_batches: int) -> LogicalMesh:
    """The stage mesh with ``MB`` in front, on a topology level of its own (micro-batches run
    one after another on the same devices; the level only prices the accumulation)."""
    topo = stage_mesh.topology
    inner = topo.levels[-1]
    level = Level("micro", micro_batches, alpha=inner.alpha, beta=inner.beta)
    return LogicalMesh((MB,) + stage_mesh.axis_names, (micro_batches,) + stage_mesh.shape,
                       Topology((level,) + topo.levels, topo.flops, topo.mem_bandwidth))


def _options(node, cand, mesh):
    """``cand`` first, then the candidates of ``node`` on ``mesh`` that equal it off ``MB`` and
    read no partial sum over ``MB``."""
    if node.prim == "autopar_shard":          # identity layouts: MB in front of any dimension
        (layout,) = cand.out_layouts
        extra = [identity_candidate(Layout(layout.dims[:d] + ((MB,) + layout.dims[d],)
                                           + layout.dims[d + 1:], layout.partial))
                 for d, s in enumerate(node.outputs[0].shape)
                 if s % (mesh.axis_size(MB) * _count(layout.dims[d], mesh)) == 0]
        return [cand] + extra
    spec = rule_for(node).spec(node)
    real = axis_choices(cand, mesh.axis_names[1:])
    picks = [(first,) + real for first in [None, *spec.letters]]
    out = [cand]
    for c in enumerate_candidates(node, spec, mesh, picks):
        if any(MB in l.partial for l in c.in_layouts) or c in out:
            continue
        if tuple(map(strip, c.in_layouts)) == cand.in_layouts and \
                tuple(map(strip, c.out_layouts)) == cand.out_layouts:
            out.append(c)
    return out


def _count(axes, mesh) -> int:
    n = 1
    for a in axes:
        n *= mesh.axis_size(a)
    return n


def add_micro_axis(graph, choice, in_layouts, batch_inputs, micro_batches, stage_mesh,
                   reshard_cost) -> MicroPlan:
    """See the module docstring. ``batch_inputs``: graph input positions split over micro-
    batches; ``reshard_cost(src, dst, shape, dtype) -> (seconds, collectives)`` on the result's
    mesh (``micro_mesh(stage_mesh, micro_batches)``)."""
    mesh = micro_mesh(stage_mesh, micro_batches)
    args = {}
    for i, (v, l) in enumerate(zip(graph.inputs, in_layouts)):
        if i in batch_inputs:
            args[i] = Layout(((MB,) + l.dims[0],) + l.dims[1:], l.partial)
        else:
            args[i] = l
    memo, cands = {}, {}
    for n in graph.nodes:
        key = (n.signature, choice[n.id])
        if key not in memo:
            memo[key] = _options(n, choice[n.id], mesh)
        cands[n.id] = memo[key]
    assignment = propagate(graph, mesh, {}, args, reshard_cost, cands, copied_axes={MB})
    return MicroPlan(mesh, assignment.choice, tuple(args[i] for i in range(len(graph.inputs))))

