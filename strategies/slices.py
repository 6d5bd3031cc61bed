"""Local slices moved up to the operators that make what they slice.

In: a Graph, the chosen Candidate per node id, the graph inputs' layouts, the LogicalMesh
and ``reshard_cost(src, dst, shape, dtype) -> (seconds, collectives)`` (the
redistribution planner's). Out: ``slice_early``: the choice with every operator whose results
all its readers read through a local slice (each result read in one layout, which a slice
makes from the layout it is made in) switched to a candidate making those layouts itself,
where every operand of that candidate reads for free too.

Why: the searches price a slice as free, and a fused operator's result as never in memory
(``strategies.fusion``), so a value computed whole on every device and sliced by its reader
(a broadcast constant, a mask made from iotas, a scalar spread to an activation's shape) looks
as cheap as one computed split. Lowered, the slice is an instruction of its own: the whole
value is made and held (a 32 MB broadcast of a scalar on each of 4 devices where each reads
an 8 MB block). Made split, it costs no communication (its operands read for free), a block of
the work, and a block of the memory.
"""

from __future__ import annotations

from autopar.annotate import shard_p
from autopar.graph import Const, Value
from autopar.layout import Layout

from .candidates import enumerate_candidates
from .rules import rule_for

FREE = (0.0, 0)


def slice_early(graph, choice: dict, in_layouts, mesh, reshard_cost) -> dict:
    """See the module docstring; ``choice`` is not changed (a new dict is returned)."""
    choice = dict(choice)
    memo = {}

    def cands(n):
        if n.signature not in memo:
            memo[n.signature] = enumerate_candidates(n, rule_for(n).spec(n), mesh)
        return memo[n.signature]

    results = {o.id for o in graph.outputs if isinstance(o, Value)}
    arg = {v.id: l for v, l in zip(graph.inputs, in_layouts)}

    def made(x) -> Layout:
        if isinstance(x, Const):
            return Layout.replicated(len(x.shape))
        if x.id in arg:
            return arg[x.id]
        p = graph.producer[x.id]
        return choice[p.id].out_layouts[p.outputs.index(x)]

    free = lambda src, dst, v: src == dst or reshard_cost(src, dst, v.shape, v.dtype) == FREE
    changed = True
    while changed:
        changed = False
        for n in reversed(graph.nodes):
            if n.prim == shard_p.name or any(v.id in results for v in n.outputs):
                continue
            wants = []
            for v, have in zip(n.outputs, choice[n.id].out_layouts):
                read = {choice[u.id].in_layouts[k] for u, k in graph.users.get(v.id, ())}
                want = read.pop() if len(read) == 1 else None
                wants.append(want if want is not None and free(have, want, v) else None)
            if None in wants or wants == list(choice[n.id].out_layouts):
                continue
            for c in cands(n):
                if list(c.out_layouts) == wants and all(
                    free(made(x), w, x) for x, w in zip(n.inputs, c.in_layouts)
                ):
                    choice[n.id] = c
                    changed = True
                    break
    return choice
