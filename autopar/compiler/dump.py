"""The Strategy dump, assembled from the plan and read off the lowered program.

In: a ``Program`` or ``PipelineProgram``, a redistribution ``Planner`` on its mesh (a pipeline's
first stage's; other stage meshes get their own), the traced Graph and its argument names.
Out: ``assemble_strategy`` (the one place a ``Strategy`` is built from a plan; its per-call
overhead from ``cost_model.call_overhead`` with ``host_bytes`` and ``host_arrays``, the bytes
and the number of the arguments and results, less the all-reduces riding in another's
bucket: ``Program.buckets``),
``op_strategies`` (an ``OpStrategy`` per node), ``comm_records`` (a ``CommStrategy`` per
communication step, priced), ``label`` (how the memory timeline names an instruction) and
``operands`` (per node, what makes each operand: an operator, an argument or "" for a literal);
from the plan's MeshPlans: ``plan_op_strategies``, ``input_strategies`` (an InputStrategy per
argument leaf) and ``peak_of`` (the fullest device's peak and what runs there).
"""

from __future__ import annotations

import numpy as np

from ..graph import Const
from ..pipeline_program import PipelineProgram, Transfer, TransferKind
from ..program import Collective, Compute
from ..strategies.cost_model import call_overhead, compute_time, fused, output_bytes, program_memory
from ..strategies.strategy import (
    CommStrategy,
    InputStrategy,
    OpStrategy,
    StageStrategy,
    Strategy,
    step_seconds,
)


def assemble_strategy(
    *,
    mode,
    search,
    mesh,
    inputs,
    ops,
    program,
    planner,
    peak,
    peak_op,
    cap,
    timeline=(),
    output_comm=0.0,
    host_bytes=0,
    host_arrays=0,
    micro_batches=1,
    scheduler="",
    phase_seconds=(),
    search_cost=None,
    search_bound=None,
    measured_compute=None,
    alternatives=(),
) -> Strategy:
    """The Strategy of a plan: its mesh, ``inputs`` (InputStrategy per argument leaf), ``ops``
    (``op_strategies``), the program's priced communication steps and its memory ``timeline``
    (``memory_timeline``; empty for a pipeline); a PipelineProgram adds its stages,
    micro-batches and scheduler; ``search_cost``/``search_bound``: auto_parallel's plan cost
    in its search's model and the lower bound proved there (None: no search, no bound);
    ``measured_compute``: one rank's compute as profiled (``profile_plans``), or None."""
    pipelined = isinstance(program, PipelineProgram)
    stages = (
        tuple(
            StageStrategy(
                index=st.index,
                devices=st.devices,
                seconds=st.seconds,
                memory=st.memory,
                mesh_shape=tuple(st.mesh.shape),
                axis_names=tuple(st.mesh.axis_names),
            )
            for st in program.stages
        )
        if pipelined
        else ()
    )
    return Strategy(
        mode=mode,
        search=search,
        mesh_shape=tuple(mesh.shape),
        axis_names=tuple(mesh.axis_names),
        inputs=tuple(inputs),
        ops=tuple(ops),
        output_comm_time=output_comm,
        overhead_time=call_overhead(program, host_bytes, host_arrays),
        peak_memory=peak,
        peak_op=peak_op,
        memory_limit=cap,
        stages=stages,
        micro_batches=micro_batches if pipelined else 1,
        scheduler=scheduler if pipelined else "",
        pipeline_interleave=program.interleave if pipelined else 1,
        collectives=comm_records(program, planner),
        memory_timeline=tuple((label(ins), b) for ins, b in timeline),
        phase_seconds=phase_seconds,
        search_cost=search_cost,
        search_bound=search_bound,
        measured_compute=measured_compute,
        topology=mesh.topology.source or "unnamed Topology(...)",
        alternatives=tuple(alternatives),
        outputs=() if pipelined else tuple(program.out_layouts),
        trees=(program.in_tree, program.out_tree),
    )


def estimate_terms(graph, names, plan, config, pairs=()) -> tuple:
    """(compute, communication, per call) of the step the Strategy of MeshPlan ``plan``
    (lowered, without a pipeline) reports, from the same OpStrategies, overhead and measured
    compute if profiled: their sum is its ``step_seconds``. ``pairs``: the state the step
    threads through (``host_bytes``)."""
    program = plan.program
    ops = plan_op_strategies(graph, names, [plan] * len(graph.nodes), (0,) * len(graph.nodes))
    overhead = call_overhead(program, host_bytes(graph, program, pairs), host_arrays(graph))
    comm = sum(o.comm_time for o in ops)
    compute = step_seconds(ops, 0.0, 0.0, plan.measured) - comm
    return compute, comm + plan.out_comm, overhead


def host_bytes(graph, program, pairs=()) -> int:
    """Bytes a call of a training loop moves between the caller and the devices: each device's
    block of every argument (a replicated one goes to every device) but the state the step
    threads through (``pairs``, ``arguments.state_pairs``: passed back as the last call
    returned it, it is already there: the native runtime's resident blocks, the jax backend's
    device arrays), and every device's block of a split result (a replicated result comes back
    once)."""
    size = lambda v: int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
    state = {i for i, _ in pairs}
    if isinstance(program, PipelineProgram):  # each stage's arguments go to its devices
        return sum(size(v) for j, v in enumerate(graph.inputs) if j not in state) + sum(
            size(v) for v in graph.outputs if not isinstance(v, Const)
        )
    mesh, n = program.mesh, program.mesh.size
    local = lambda v, l: int(np.prod(l.local_shape(v.shape, mesh))) * np.dtype(v.dtype).itemsize
    moved = sum(
        local(v, l) * n
        for j, (v, l) in enumerate(zip(graph.inputs, program.in_layouts))
        if j not in state
    )
    return moved + sum(
        size(v) if l.is_replicated() else local(v, l) * n
        for v, l in zip(graph.outputs, program.out_layouts)
        if not isinstance(v, Const)
    )


def host_arrays(graph) -> int:
    """Arrays a call passes between the caller and the devices: its arguments and results."""
    return sum(not isinstance(v, Const) for v in (*graph.inputs, *graph.outputs))


def bucket_bytes(config) -> int:
    """The all-reduce bucket the runtime fuses into (0: the jax backend, which fuses none)."""
    return config.allreduce_fusion_bytes if config.backend.value == "native" else 0


def op_strategies(
    graph, names, choices, comm, meshes, stages, no_compute=frozenset(), held=None
) -> tuple:
    """An OpStrategy per graph node ``k``: its Candidate ``choices[k]``, the seconds of the
    redistributions feeding it ``comm[k]``, its compute time and output bytes on ``meshes[k]``
    (none for a primitive in ``no_compute``), its pipeline stage ``stages[k]`` and the layouts
    its outputs are converted to once before they are read (``held``: value id -> Layout)."""
    held = held or {}
    converted = [tuple(held.get(v.id) for v in n.outputs) for n in graph.nodes]
    touch = fused(graph, meshes[0]) if meshes else {}
    return tuple(
        OpStrategy(
            name=n.name,
            prim=n.prim,
            source=n.source,
            in_shapes=tuple(tuple(x.shape) for x in n.inputs),
            out_shapes=tuple(v.shape for v in n.outputs),
            in_layouts=c.in_layouts,
            out_layouts=c.out_layouts,
            comm_time=t,
            compute_time=0.0 if n.prim in no_compute else compute_time(n, c, m, touch.get(n.id)),
            out_bytes=output_bytes(n, c, m),
            stage=s,
            operands=made_by,
            converted=conv if any(l is not None for l in conv) else (),
        )
        for n, c, t, m, s, made_by, conv in zip(
            graph.nodes, choices, comm, meshes, stages, operands(graph, names), converted
        )
    )


def label(ins) -> str:
    """How the memory timeline names an instruction."""
    if isinstance(ins, Compute):
        return ins.node.name
    return f"{ins.kind}({','.join(ins.axes)})"


def comm_records(program, planner) -> tuple:
    """A CommStrategy per communication step of a Program or PipelineProgram, priced by the
    planner (transfers between stages on the first level of the full mesh's axis)."""
    planners = {}
    if isinstance(program, PipelineProgram):  # each stage priced on its own mesh
        from ..redistribution.planner import Planner

        by_mesh = {planner.mesh: planner}
        for st in program.stages:
            if st.mesh not in by_mesh:
                by_mesh[st.mesh] = Planner(st.mesh)
            planners[st.index] = by_mesh[st.mesh]
        body = [
            (st.index, ins, name) for st in program.stages for name, b in st.phases() for ins in b
        ]
        level = program.mesh.level(program.mesh.axis_names[0])
        micro = program.micro_batches
    else:
        body = [(0, ins, "") for ins in program.instructions]
    out = []
    for stage, ins, phase in body:
        if not isinstance(ins, (Transfer, Collective)):
            continue
        common = {
            "kind": str(ins.kind),
            "axes": tuple(ins.axes),
            "shape": tuple(ins.shape),
            "dtype": str(np.dtype(ins.dtype)),
            "bytes": ins.bytes,
            "stage": stage,
        }
        if isinstance(ins, Transfer):
            way = "to" if ins.kind == TransferKind.SEND else "from"
            out.append(
                CommStrategy(
                    **common,
                    seconds=level.alpha + level.beta_for("send") * ins.bytes,
                    reason=f"stage {stage} {way} stage {ins.peer}",
                    count=micro if ins.micro else 1,
                )
            )
        else:
            pl = planners.get(stage, planner)  # priced on its input, as the planner does
            sent = int(np.prod(ins.shape, dtype=np.int64)) * np.dtype(ins.dtype).itemsize
            seconds = pl.step_time(ins.kind, ins.axes, sent)[0] + pl.relayout_seconds(
                ins.kind, ins.shape, ins.dim, ins.dst_dim, ins.bytes
            )
            out.append(
                CommStrategy(
                    **common,
                    seconds=seconds,
                    reason=ins.reason,
                    count=micro if phase in ("forward", "backward") else 1,
                )
            )
    return tuple(out)


def operands(graph, names) -> list:
    """Per graph node, the name of the operator or argument making each operand."""
    made_by = {v.id: name for v, (name, _) in zip(graph.inputs, names)}
    made_by.update((o.id, n.name) for n in graph.nodes for o in n.outputs)
    return [tuple(made_by.get(getattr(x, "id", None), "") for x in n.inputs) for n in graph.nodes]


def plan_op_strategies(graph, names, node_plan, stage_of, converts=True) -> tuple:
    """The OpStrategy of every node from the MeshPlan of its stage (``node_plan``), with the
    layouts values are converted to once (``converts``; a pipeline's micro-batch lowering
    converts per reading layout instead: its layouts carry the micro-batch axis)."""
    return op_strategies(
        graph,
        names,
        [plan.assignment.choice[n.id] for n, plan in zip(graph.nodes, node_plan)],
        [plan.comm[n.id] for n, plan in zip(graph.nodes, node_plan)],
        [plan.mesh for plan in node_plan],
        stage_of,
        held={
            v.id: plan.assignment.held[v.id]
            for n, plan in zip(graph.nodes, node_plan)
            for v in n.outputs
            if converts and v.id in plan.assignment.held
        },
    )


def input_strategies(graph, names, program, per_stage, pipelined) -> list:
    """An InputStrategy per argument leaf, in the layout of the first stage that reads it."""
    readers: dict[int, int] = {}  # argument position -> the first stage reading it
    for st in program.stages if pipelined else ():
        for i in st.inputs:
            readers.setdefault(i, st.index)
    inputs = []
    for k, ((n, p), v) in enumerate(zip(names, graph.inputs)):
        mesh_plan = per_stage[readers.get(k, 0)]
        inputs.append(
            InputStrategy(
                name=n,
                shape=v.shape,
                dtype=str(v.dtype),
                layout=mesh_plan.assignment.inputs[k],
                is_param=p,
                update=mesh_plan.updates.get(k),
            )
        )
    return inputs


def peak_of(program, graph, pipelined, timeline) -> tuple:
    """``(bytes, what runs at the peak, where)`` on the fullest device: the peak instruction of
    a Program's memory ``timeline`` (its operator, or the collective and the operator it
    feeds), or a pipeline's fullest stage."""
    if pipelined:  # each device holds one stage: the fullest stage is the peak
        top = max(program.stages, key=lambda st: st.memory)
        return top.memory, f"stage {top.index}", f"devices {list(top.devices)}"
    peak, at = program_memory(program, timeline)
    node_id = getattr(at, "node_id", None)
    node = getattr(at, "node", None) or (None if node_id is None else graph.nodes[node_id])
    peak_op = (
        "the arguments"
        if at is None
        else at.node.name
        if isinstance(at, Compute)
        else f"{at.kind} for {getattr(at, 'reason', '') or 'a result'}"
    )
    return peak, peak_op, node.source if node is not None else "the arguments"
