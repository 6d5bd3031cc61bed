"""Pipeline planning: stage meshes, the layouts on each, the stage plan and the cut program.

In: a ParallelConfig with ``pipeline_stages`` / ``micro_batches`` (and
``pipeline_stage_devices``), the traced Graph, the full mesh, ``on_mesh(mesh) -> MeshPlan``
(the layout search and lowering of the whole step on one stage mesh, made by
autopar.compiler.api), the example arguments, ``batch_argnums``, argument names and state
pairs. Out: ``plan_pipeline``: the stage plan (``Staged``, whose ``bound`` ranks pipelines
before any is cut); ``pipeline_program``: the ``PipelineProgram`` cut from it and, per stage,
the ``MeshPlan`` its layouts come from.

Stage meshes: with equal stages (``pipeline_stage_devices="equal"``, or counts all equal to the
first mesh axis's share) a stage's mesh is the full mesh without its first axis when that axis
has S devices, else the full mesh with its first axis divided by S (mesh (128, 8) in 8 stages:
(16, 8)); a stage of another size k is one axis of k devices, named as the full mesh's last
axis. Every mesh sits
on the innermost topology levels holding its devices. ``"auto"`` (the default where the
planner cuts the stages; annotated stages default to "equal") lets the stage planner choose
each stage's size (``stage_sizes``; sizes whose layouts cannot split the batch into
micro-batches are left out), searching layouts once per size.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import jax

from ..annotate import STAGE_SCOPE
from ..errors import ConfigError, InfeasibleError, LayoutError, PipelineError
from ..graph import Const
from ..mesh import LogicalMesh
from ..pipeline_program import pipeline_seconds
from ..program import LOCAL_KINDS, all_reduce_buckets
from ..redistribution.lower import plan_steps
from ..redistribution.stage_split import MicroPlanner, StageLowering, split_stages
from ..strategies.microbatch import MB, add_micro_axis, micro_mesh
from ..strategies.stage_assign import Stages, assign_stages
from ..strategies.stage_cuts import StageOption, StagePlan, StageRequest, plan_stages
from ..strategies.strategy import PipelineChoice, format_bytes
from .dump import bucket_bytes

if TYPE_CHECKING:
    from .mesh_plan import MeshPlan


def reshard_cost(planner):
    """``(src, dst, shape, dtype) -> (seconds, collectives)`` of the planner's cheapest path."""

    def cost(s, d, shape, dtype):
        steps, seconds = plan_steps(planner, s, d, shape, dtype)
        return seconds, sum(st.kind not in LOCAL_KINDS for st in steps)

    return cost


def stage_mesh(full, stages: int, k: int):
    """The mesh of a pipeline stage of ``k`` devices; ``full`` itself with one stage."""
    if stages == 1 and k == full.size:
        return full
    topo = full.topology.inner(k)
    if full.shape[0] % stages or k * stages != full.size:
        return LogicalMesh.create((k,), full.axis_names[-1:], topo)
    share = full.shape[0] // stages  # the first axis left to each stage
    drop = 1 if share == 1 else 0
    return LogicalMesh.create(((share,) + full.shape[1:])[drop:], full.axis_names[drop:], topo)


def stage_sizes(S, given, full) -> tuple:
    """The device counts a stage may have: the given ones, the equal share, or for "auto"
    (leaving a device to each other stage) 1 to 8, powers of two within the innermost topology
    level, powers of two of whole levels, and the equal share (a layout search each)."""
    if isinstance(given, tuple):
        return tuple(sorted(set(given)))
    n = full.size
    if given == "equal":
        return (n // S,)
    host = full.topology.levels[-1].size
    two = lambda x: x & (x - 1) == 0
    return tuple(
        k
        for k in range(1, n - S + 2)
        if k <= host and (k <= 8 or two(k)) or k % host == 0 and two(k // host) or k * S == n
    )


def batch_inputs(graph, args, batch_argnums, pairs) -> set:
    """The graph input positions holding the batch: array leaves of ``batch_argnums`` that are
    not state the step threads through."""
    leaf_arg = [i for i, a in enumerate(args) for _ in jax.tree.leaves(a)]
    state = {i for i, _ in pairs}  # threaded through the step: never a batch
    return {
        j
        for j, v in enumerate(graph.inputs)
        if leaf_arg[j] in batch_argnums and v.shape and j not in state
    }


def _micro_batch_error(graph, mesh_plan, batch, M, names, k):
    """None when every batch argument's rows, as ``mesh_plan`` splits them, divide into ``M``
    micro-batches; else the ConfigError that says which argument does not."""
    for j in sorted(batch):
        split = math.prod(
            mesh_plan.mesh.axis_size(a) for a in mesh_plan.assignment.inputs[j].dims[0]
        )
        rows = graph.inputs[j].shape[0]
        if rows % (M * split):
            return ConfigError(
                f"micro_batches={M}: batch argument {names[j][0]} has dimension 0 of size "
                f"{rows}, which does not split into {M} micro-batches of "
                f"{split}-way split rows (on a stage of {k} devices); use a batch size that is "
                f"a multiple of {M * split} (or pass batch_argnums naming only the batch)."
            )
    return None


def micro_comm(graph, plan, planner) -> dict:
    """node id -> the seconds of the redistributions feeding it for one micro-batch, for the
    nodes a pipeline runs per micro-batch (their candidate splits over MB), from where each
    operand is made on the micro-batch mesh to where the node reads it (the micro planner's
    cheapest path; a path it forbids, which no lowering takes, is left to the whole batch's)."""
    layout = {v.id: l for v, l in zip(graph.inputs, plan.in_layouts)}
    for n in graph.nodes:
        layout.update((v.id, l) for v, l in zip(n.outputs, plan.choice[n.id].out_layouts))
    cost, memo, out = reshard_cost(planner), {}, {}
    for n in graph.nodes:
        c = plan.choice[n.id]
        if not any(MB in axes for _, axes in c.assign):
            continue
        seconds = 0.0
        for x, want in zip(n.inputs, c.in_layouts):
            if isinstance(x, Const):
                continue
            key = (layout[x.id], want, x.shape, str(x.dtype))
            if key not in memo:
                memo[key] = cost(layout[x.id], want, x.shape, x.dtype)[0]
            seconds += memo[key]
        if seconds < MicroPlanner.FORBIDDEN:
            out[n.id] = seconds
    return out


@dataclasses.dataclass(frozen=True)
class _SizeOption:
    """A stage size the stage planner may use: the layouts of the step on a stage mesh of that
    size, their micro-batch plan and the planner of that micro-batch mesh."""

    mesh_plan: MeshPlan
    planner: MicroPlanner
    option: StageOption


def _size_options(graph, full, on_mesh, S, M, given, batch, names) -> tuple[dict, dict]:
    """Stage size -> _SizeOption for every size ``stage_sizes`` allows, and stage size -> the
    error that left it out. With ``"auto"`` a size whose layouts cannot split the batch is
    left out (the first refusal is raised when no size is left); with given sizes any refusal
    is raised."""
    auto = given == "auto"
    out, refused = {}, {}
    for k in stage_sizes(S, given, full):
        try:
            mesh_plan = on_mesh(stage_mesh(full, S, k))
        except (ConfigError, LayoutError) as e:  # "auto": a size the batch cannot use
            if not auto:
                raise
            refused[k] = e
            continue
        error = _micro_batch_error(graph, mesh_plan, batch, M, names, k)
        if error is not None:
            refused[k] = error
            continue
        planner = MicroPlanner(micro_mesh(mesh_plan.mesh, M))
        inputs = mesh_plan.assignment.inputs
        plan = add_micro_axis(
            graph,
            mesh_plan.assignment.choice,
            inputs,
            batch,
            M,
            mesh_plan.mesh,
            reshard_cost(planner),
        )
        out[k] = _SizeOption(
            mesh_plan,
            planner,
            StageOption(
                mesh_plan.mesh,
                mesh_plan.assignment.choice,
                inputs,
                mesh_plan.comm,
                plan,
                micro_comm(graph, plan, planner),
            ),
        )
    if refused and (not auto or not out):
        raise next(iter(refused.values()))
    return out, refused


def _pipeline_mesh(full, S, sizes):
    """The mesh every stage's devices lie on: ``full`` with the stage axis first when the
    stages are equal, else one axis of every device."""
    if len(set(sizes)) == 1 and full.shape[0] == S and S > 1:
        return full
    name = next(n for n in ("stage", "pp", "pipe") if n not in full.axis_names)
    return LogicalMesh((name,), (full.size,), full.topology)


def _fixed_stages(graph, S):
    """The stages the user fixed (one stage, or ``ap.pipeline_stage`` annotations), else None."""
    if S == 1:
        return Stages(1, (0,) * len(graph.nodes), (tuple(range(len(graph.inputs))),))
    if any(STAGE_SCOPE in n.scope for n in graph.nodes):
        return assign_stages(graph, S)
    return None


@dataclasses.dataclass(frozen=True)
class Staged:
    """A pipeline planned up to its stages, before it is cut into a program: the stage plan
    and the stage sizes' layouts it was made from."""

    stage_plan: StagePlan
    by_size: dict[int, _SizeOption]  # stage size -> its options

    def bound(self, micro: int) -> float:
        """The pipeline's estimated step less its per-call overhead (which is never negative):
        ``pipeline_seconds`` of its stages (every stage's seconds per micro-batch plus ``micro
        - 1`` times the slowest; interleaved, as Megatron-LM's schedule runs its parts)."""
        return pipeline_seconds(self.stage_plan.seconds, micro, self.stage_plan.interleave)


def plan_pipeline(
    config, graph, full, on_mesh, args, batch_argnums, names, pairs, cache=None
) -> Staged:
    """The layouts on every stage size and the stage plan (module docstring); ``cache`` keeps
    the stage sizes' options by (stages, micro-batches, sizes) for the interleavings tried."""
    S, M = config.pipeline_stages, config.micro_batches
    batch = batch_inputs(graph, args, batch_argnums, pairs)
    fixed = _fixed_stages(graph, S)
    given = config.pipeline_stage_devices
    if given is None:  # the planner's choice where it cuts the stages
        given = "equal" if fixed is not None else "auto"
    cache = {} if cache is None else cache
    key = ("sizes", S, M, given)
    if key not in cache:
        cache[key] = _size_options(graph, full, on_mesh, S, M, given, batch, names)
    by_size, refused = cache[key]
    sizes = (
        given if isinstance(given, tuple) else None if given == "auto" else (full.size // S,) * S
    )
    try:
        return Staged(
            plan_stages(
                StageRequest(
                    graph=graph,
                    count=S,
                    micro=M,
                    scheduler=config.pipeline_scheduler,
                    options={k: o.option for k, o in by_size.items()},
                    batch_inputs=frozenset(batch),
                    link=full.level(full.axis_names[0]),
                    devices=full.size,
                    cap=config.max_device_memory,
                    sizes=sizes,
                    stages=fixed,
                    interleave=config.pipeline_interleave,
                )
            ),
            by_size,
        )
    except PipelineError as e:
        if not refused:
            raise
        why = "\n".join(f"- a stage of {k} devices: {err}" for k, err in refused.items())
        note = (
            ("\nWith pipeline stages, in_strategy's split counts apply to each stage's devices.")
            if "in_strategy" in why
            else ""
        )
        raise PipelineError(f"{e}\nThe stage sizes left out, and why:\n{why}{note}") from None


def pipeline_program(config, graph, full, staged: Staged):
    """``plan_pipeline``'s stages cut into the program: (PipelineProgram, MeshPlan per stage)."""
    stage_plan, by_size = staged.stage_plan, staged.by_size
    sched, v = config.pipeline_scheduler, stage_plan.interleave
    S = len(stage_plan.sizes)  # interleaved: the parts, v per stage's devices
    groups = stage_plan.sizes[: S // v]
    pipeline_mesh = _pipeline_mesh(full, S // v, groups)
    offsets = [sum(groups[:g]) for g in range(len(groups))]
    devices = tuple(
        tuple(range(offsets[s % len(groups)], offsets[s % len(groups)] + stage_plan.sizes[s]))
        for s in range(S)
    )
    lowerings = [
        StageLowering(
            tuple(s for s in range(S) if stage_plan.sizes[s] == k),
            o.mesh_plan.mesh,
            o.option.plan,
            o.planner,
            tuple(o.mesh_plan.out_layouts),
        )
        for k, o in ((k, by_size[k]) for k in dict.fromkeys(stage_plan.sizes))
    ]
    program = split_stages(
        graph,
        stage_plan.stages,
        lowerings,
        devices,
        sched,
        pipeline_mesh,
        pipeline_mesh.axis_names[0],
        v,
    )
    program = dataclasses.replace(
        program,
        stages=tuple(
            dataclasses.replace(
                st,
                seconds=t,
                memory=b,
                buckets=tuple(
                    bucket
                    for _, body in st.phases()
                    for bucket in all_reduce_buckets(body, st.mesh, bucket_bytes(config))
                ),
                bucket_bytes=bucket_bytes(config),
            )
            for st, t, b in zip(program.stages, stage_plan.seconds, stage_plan.memory)
        ),
    )
    return program, tuple(by_size[k].mesh_plan for k in stage_plan.sizes)


INTERLEAVES = (1, 2, 4)  # model parts per stage's devices "auto" tries


def pipeline_options(config, full, batch_rows: int) -> list:
    """The (stages, micro-batches, interleave) triples ``auto_pipeline`` tries, stages
    ascending: the given count where one is given, else ``stage_counts``, and micro-batches 1,
    2, 4 without a pipeline (they only save memory), S, 2 S, 4 S with S stages (fewer leave
    stages idle) and the count giving one row per device of the stage mesh's first axis per
    micro-batch (Megatron-LM's micro-batch of one sequence per data-parallel rank), each
    dividing the batch rows; with S > 1 stages each interleave of ``INTERLEAVES`` (or the given
    one) whose micro-batches S divides."""
    n = full.size
    given_s, given_m = config.pipeline_stages, config.micro_batches
    given_v = config.pipeline_interleave
    stages = [given_s] if given_s != "auto" else stage_counts(full)
    out = []
    for S in stages:
        if given_m != "auto":
            micro = [given_m]
        elif S == 1:
            micro = [1, 2, 4]
        else:
            try:
                first = (stage_mesh(full, S, n // S).shape or (1,))[0]
                one_row = {batch_rows // first} if batch_rows // first >= S else set()
            except ConfigError:  # stages not of whole hosts: each pair notes why, unplanned
                one_row = set()
            micro = sorted({S, 2 * S, 4 * S} | one_row)
        vs = [given_v] if given_v != "auto" else INTERLEAVES
        out += [
            (S, M, v)
            for M in micro
            if batch_rows % M == 0
            for v in vs
            if v == 1 or (S > 1 and M % S == 0)
        ]
    return out


STAGE_LADDER = (1, 2, 4, 8, 16, 32, 64)  # the stage counts "auto" aims at


def stage_counts(full) -> list:
    """The stage counts ``pipeline_options`` tries on mesh ``full``: per count of
    ``STAGE_LADDER``, the count nearest to it (by ratio; the smaller on a tie) whose stages
    ``Topology.inner`` accepts (whole levels, a tile of one, or part of the outermost),
    ascending without repeats: the ladder itself on 2^k hosts of 2^j devices; on Megatron-LM's
    315 DGX hosts of 8 GPUs (530B) 1, 3, 5, 9, 15, 35 and 63 stages, where powers of two would
    split hosts."""
    n, topo = full.size, full.topology

    def whole(s: int) -> bool:
        try:
            topo.inner(n // s)
        except ConfigError:
            return False
        return True

    valid = [s for s in range(1, n + 1) if n % s == 0 and whole(s)]
    near = lambda want: min(valid, key=lambda s: (abs(math.log(s / want)), s))
    return sorted({near(want) for want in STAGE_LADDER if want <= n})


PATIENCE = 2  # stage counts planned past the best one before auto_pipeline stops


def auto_pipeline(req, full, plan_one, stage_one):
    """Stages and micro-batches chosen with the layouts (``pipeline_stages`` or
    ``micro_batches`` "auto"), in two passes over the pairs ``pipeline_options`` gives (stages
    of equal size; the layout searches shared through ``cache``: one per stage size, its
    layouts leaving the batch rows for every micro-batch count tried with it: their least
    common multiple):
    1. each pair is planned up to its stages (``stage_one(request, cache) -> Staged``; one stage
       and one micro-batch, which has no stages, is planned whole by ``plan_one(request,
       cache) -> (graph, Strategy, program)``), giving ``Staged.bound``, its estimate less the
       per-call overhead. Stage counts stop ``PATIENCE`` counts after the one with the least
       bound so far (more stages only lengthen the bubble once fewer, larger stages fit; a
       count none of whose pairs could be planned does not count). Each stage count's pairs
       are planned from the most micro-batches down: once the stage planner finds no split of
       S stages within the cap, fewer micro-batches are not planned (each is larger, and no
       fewer of them are in flight);
    2. pairs are cut into programs by ``plan_one`` in order of their bounds until the next
       bound is no less than the least estimate so far: that pair has the least estimated step
       within the cap of all (GPipe and 1F1B estimate the same; 1F1B, the configured default,
       holds fewer activations), without cutting the pairs that cannot beat it.
    The Strategy lists every pair with its estimate, or its bound, or why it was not planned.
    When none can be planned, raises the first pair's error, naming every pair's reason."""
    rows = next(
        (
            v.shape[0]
            for j, v in enumerate(req.graph.inputs)
            if j in batch_inputs(req.graph, req.args, req.batch_argnums, req.pairs)
        ),
        1,
    )
    cache, errors = {}, {}  # index in pairs -> why it could not be planned
    pairs = pipeline_options(req.config, full, rows)
    tried = [PipelineChoice(stages=S, micro_batches=M, interleave=v) for S, M, v in pairs]
    every = {S: math.lcm(*(M for S_, M, _ in pairs if S_ == S)) for S, _, _ in pairs}
    best_s, best_bound, started = None, math.inf, set()  # stage counts with a plan
    overfull = {}  # stage count -> the most micro-batches whose stages exceed the cap
    bounded = []  # (bound, index in tried, request, whole plan or None, Staged or None)
    for k in sorted(range(len(pairs)), key=lambda k: (pairs[k][0], -pairs[k][1], pairs[k][2])):
        S, M, v = pairs[k]
        if best_s is not None and len({s for s in started if best_s < s != S}) >= PATIENCE:
            tried[k] = dataclasses.replace(
                tried[k],
                note=f"not planned: {PATIENCE} stage counts past the best ({best_s}) were slower",
            )
            continue
        if S in overfull and (S > 1 or M > 1) and v == 1:
            tried[k] = dataclasses.replace(
                tried[k],
                note=(
                    f"not planned: no split into {S} stage(s) fits the cap with {overfull[S]} "
                    "micro-batches, and fewer hold more bytes per micro-batch"
                ),
            )
            continue
        config = req.config.replace(
            pipeline_stages=S,
            micro_batches=M,
            pipeline_interleave=v,
            pipeline_stage_devices=None if S == 1 else (full.size // S,) * S,
        )
        one = dataclasses.replace(
            req, config=config, pipelined=S > 1 or M > 1, micro=every[S] if S > 1 or M > 1 else 1
        )
        try:
            whole = None if one.pipelined else plan_one(one, cache)
            staged = stage_one(one, cache) if one.pipelined else None
            bound = whole[1].step_time if whole else staged.bound(M)
        except (ConfigError, LayoutError, PipelineError, InfeasibleError) as e:
            errors[k] = e
            tried[k] = dataclasses.replace(
                tried[k], note=f"{type(e).__name__}: {str(e).split(';')[0]}"
            )
            if isinstance(e, InfeasibleError) and one.pipelined and v == 1:  # the cap
                overfull.setdefault(S, M)
            continue
        started.add(S)
        bounded.append((bound, k, one, whole, staged))
        if bound < best_bound:
            best_bound, best_s = bound, S
    best = None
    for bound, k, one, whole, staged in sorted(bounded, key=lambda b: (b[0], b[1])):
        if best is not None and whole is None and (bound, k) > best[:2]:
            peak = max(staged.stage_plan.memory)
            tried[k] = dataclasses.replace(
                tried[k],
                note=(
                    f"not cut: its stages alone take {bound * 1e6:.1f} us (peak "
                    f"{format_bytes(peak)}), no less than the chosen pipeline's whole step"
                ),
            )
            continue
        try:
            got = whole or plan_one(one, cache)
        except (ConfigError, LayoutError, PipelineError, InfeasibleError) as e:
            errors[k] = e
            tried[k] = dataclasses.replace(
                tried[k], note=f"{type(e).__name__}: {str(e).split(';')[0]}"
            )
            continue
        strat = got[1]
        seconds = strat.pipeline_time if strat.stages else strat.step_time
        tried[k] = dataclasses.replace(tried[k], seconds=seconds, peak_memory=strat.peak_memory)
        if best is None or (seconds, k) < best[:2]:
            best = (seconds, k, got)
    if best is None:  # the first pair's error, with why each other pair failed
        first_error = errors[min(errors)]
        raise type(first_error)(
            f"{first_error} Every (stages, micro-batches) pair tried failed: "
            + "; ".join(str(t) for t in tried)
        ) from first_error
    _, k, (graph, strat, program) = best
    tried[k] = dataclasses.replace(tried[k], note="chosen")
    return graph, dataclasses.replace(strat, pipeline_choices=tuple(tried)), program
