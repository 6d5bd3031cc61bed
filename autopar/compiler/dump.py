"""Pieces of the Strategy dump read off a lowered program.

In: a ``Program`` or ``PipelineProgram``, a redistribution ``Planner`` on its mesh (a pipeline's
first stage's; other stage meshes get their own), the traced Graph and its argument names.
Out: ``comm_records`` (a ``CommStrategy`` per communication step, priced), ``label`` (how the
memory timeline names an instruction) and ``operands`` (per node, what makes each operand: an
operator, an argument or "" for a literal).
"""
from __future__ import annotations

import numpy as np

from ..pipeline import PipelineProgram, Transfer
from ..program import Collective, Compute
from ..strategies.strategy import CommStrategy


def label(ins) -> str:
    """How the memory timeline names an instruction."""
    if isinstance(ins, Compute):
        return ins.node.name
    return f"{ins.kind}({','.join(ins.axes)})"


def comm_records(program, planner) -> tuple:
    """A CommStrategy per communication step of a Program or PipelineProgram, priced by the
    planner (transfers between stages on the first level of the full mesh's axis)."""
    planners = {}
    if isinstance(program, PipelineProgram):           # each stage priced on its own mesh
        from ..redistribution.planner import Planner
        by_mesh = {planner.mesh: planner}
        for st in program.stages:
            if st.mesh not in by_mesh:
                by_mesh[st.mesh] = Planner(st.mesh)
            planners[st.index] = by_mesh[st.mesh]
        body = [(st.index, ins, name) for st in program.stages for name, b in st.phases()
                for ins in b]
        level = program.mesh.level(program.mesh.axis_names[0])
        micro = program.micro_batches
    else:
        body = [(0, ins, "") for ins in program.instructions]
    out = []
    for stage, ins, phase in body:
        if isinstance(ins, Transfer):
            out.append(CommStrategy(ins.kind, tuple(ins.axes), tuple(ins.shape),
                                    str(np.dtype(ins.dtype)), ins.bytes,
                                    level.alpha + level.beta * ins.bytes,
                                    f"stage {stage} {'to' if ins.kind == 'send' else 'from'} "
                                    f"stage {ins.peer}", stage, micro if ins.micro else 1))
        elif isinstance(ins, Collective):
            out.append(CommStrategy(ins.kind, tuple(ins.axes), tuple(ins.shape),
                                    str(np.dtype(ins.dtype)), ins.bytes,
                                    planners.get(stage, planner).step_time(
                                        ins.kind, ins.axes, ins.bytes)[0],
                                    ins.reason, stage,
                                    micro if phase in ("forward", "backward") else 1))
    return tuple(out)


def operands(graph, names) -> list:
    """Per graph node, the name of the operator or argument making each operand."""
    made_by = {v.id: name for v, (name, _) in zip(graph.inputs, names)}
    made_by.update((o.id, n.name) for n in graph.nodes for o in n.outputs)
    return [tuple(made_by.get(getattr(x, "id", None), "") for x in n.inputs)
            for n in graph.nodes]
